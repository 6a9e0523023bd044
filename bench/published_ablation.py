"""Each compute-model change's effect on the published runs, pinned (``published.py``'s
layouts and engine settings), one change added at a time in one process.

Variants, cumulative: ``before`` (captured memory-bound kernels, datasheet bandwidth, the
best-shape GEMM ceiling, the head unsplit under TP), ``+fusion`` (the engines' fused block
kernels), ``+stream`` (streaming bandwidth), ``+vocab_parallel`` (the head split by
vocabulary), ``+typical`` (the typical block shape's GEMM share): the last is what
``published.py`` runs. Llama 3's FSDP is ZeRO-2 in every variant (``ZERO_BY_SOURCE``; its
ZeRO-3 compiles take minutes each). Writes ``bench/results/published_kernels_ablation.json``.

    python bench/published_ablation.py
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from typing import Any

import published as P
from _machine import machine
from published_data import load_runs, measured_iteration

VARIANTS: tuple[tuple[str, dict[str, Any], bool, bool], ...] = (
    ("before", {"fusion": "none", "vocab_parallel": False}, False, False),
    ("+fusion", {"fusion": "fused", "vocab_parallel": False}, False, False),
    ("+stream", {"fusion": "fused", "vocab_parallel": False}, True, False),
    ("+vocab_parallel", {"fusion": "fused", "vocab_parallel": True}, True, False),
    ("+typical", {"fusion": "fused", "vocab_parallel": True}, True, True),
)


def main() -> int:
    import hetplan.cost_models.kernels as kernels

    data = load_runs()
    curves = dict(kernels.GEMM_CURVES)
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    for name, opts, stream, typical in VARIANTS:
        for fam, c in curves.items():
            kernels.GEMM_CURVES[fam] = dataclasses.replace(
                c, stream=c.stream if stream else 1.0, typical=c.typical if typical else 1.0)
        ratios: dict[str, float] = {}
        for run in data.runs:
            ir, _ = P.capture_model(run)
            pins, _ = P.express(run)
            dtype = pins.pop("dtype")
            pins.update(opts)
            batch = run.layout.global_batch_size
            r = P._compile(ir, P.cluster_for(run), batch, dtype=dtype, **pins)
            if r["fits"] is False:
                r = P._compile(ir, P.cluster_for(run, unbounded_memory=True), batch,
                               dtype=dtype, **pins)
            meas = measured_iteration(run, data.flops_conventions).seconds
            ratios[run.id] = r["predicted_iteration_s"] / meas
        errs = [abs(v - 1) for v in ratios.values()]
        out[name] = {"ratios": ratios, "median_abs_error": statistics.median(errs),
                     "within_10pct": sum(e <= 0.10 for e in errs),
                     "median_ratio": statistics.median(ratios.values())}
        print(f"{name:16s} median |pred/meas - 1| {out[name]['median_abs_error']:.1%}, "
              f"{out[name]['within_10pct']} within 10 %, median ratio "
              f"{out[name]['median_ratio']:.3f}", flush=True)
    for fam, c in curves.items():
        kernels.GEMM_CURVES[fam] = c
    path = P.RESULTS / "published_kernels_ablation.json"
    path.write_text(json.dumps({
        "benchmark": "published_ablation",
        "machine": machine(note="2-core machine shared with other work"),
        "variants": [v[0] for v in VARIANTS],
        "wall_seconds": time.perf_counter() - t0,
        "results": out,
    }, indent=1, sort_keys=True) + "\n")
    print(f"wrote {path.relative_to(P.ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
