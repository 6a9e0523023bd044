"""The ``tp-resizing`` pass on the ``mixed-tp-node`` preset: its predicted effect and its cost.

For GPT-2 at tp=4 (dp=4 pp=1, and dp=1 pp=4 without gradient sync; every TP group holds
2 A100 + 2 V100) in fp32 and fp16 it records the simulated iteration with even shards, with the pass's skewed shards and with
even shards plus the ZERO controller's expected γ (lossy), the shard sizes of the first
linear and the expected γ; and the wall time of ``compile`` with and without the pass, side
by side in one process (alternating, best of ``--reps``), pinned and with the full layout
search. Writes ``bench/results/tp_plan.json``. Predictions are analytic (no profile DB).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from _machine import machine

from hetplan.optimizer.compile import DEFAULT_PASSES, compile

HERE = Path(__file__).resolve().parent
PRESET = "mixed-tp-node"
WITHOUT = tuple(p for p in DEFAULT_PASSES if p != "tp-resizing")


def _timed(**kw: Any) -> tuple[float, Any]:
    t = time.perf_counter()
    plan = compile("gpt2", PRESET, **kw)
    return time.perf_counter() - t, plan


def _effect(dtype: str, dp: int, pp: int, reps: int) -> dict[str, Any]:
    pinned = dict(batch_size=16, dp=dp, pp=pp, tp=4, micro_batch_size=4, dtype=dtype)
    best = {"with": float("inf"), "without": float("inf")}
    plan = None
    for _ in range(reps):
        dt, plan = _timed(**pinned)
        best["with"] = min(best["with"], dt)
        dt, _ = _timed(passes=WITHOUT, **pinned)
        best["without"] = min(best["without"], dt)
    assert plan is not None and plan.tensor_parallel is not None
    tp = plan.tensor_parallel
    pred = tp.predicted
    g = tp.groups[0]
    return {
        "dtype": dtype,
        "layout": f"dp={dp} pp={pp} tp=4 mb=4",
        "pass_notes": list(plan.pass_log[-1].notes),
        "group_devices": [plan.cluster.spec.devices()[r].type for r in g.ranks],
        "first_linear": None if not g.linears else {
            "name": g.linears[0].name, "features": g.linears[0].features,
            "shard_sizes": list(g.linears[0].shard_sizes)},
        "even_ms": pred.even_ms,
        "skewed_ms": pred.skewed_ms,
        "controller_ms": pred.controller_ms,
        "skew_speedup": pred.even_ms / pred.skewed_ms,
        "controller_speedup": pred.even_ms / pred.controller_ms,
        "expected_gamma": pred.expected_gamma,
        "compile_seconds_pinned": best,
    }


def _search_overhead(reps: int) -> dict[str, Any]:
    best = {"with": float("inf"), "without": float("inf")}
    chosen = {}
    for _ in range(reps):
        dt, plan = _timed(batch_size=16)
        best["with"] = min(best["with"], dt)
        chosen["with"] = plan.layout.model_dump(include={"dp", "pp", "tp"})
        dt, plan = _timed(batch_size=16, passes=WITHOUT)
        best["without"] = min(best["without"], dt)
        chosen["without"] = plan.layout.model_dump(include={"dp", "pp", "tp"})
    return {"compile_seconds_search": best, "ratio": best["with"] / best["without"],
            "chosen_layout": chosen}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "tp_plan.json")
    args = ap.parse_args()
    compile("gpt2", PRESET, batch_size=16, dp=4, pp=1, tp=4)  # warm-up: imports, capture
    rows = [_effect(d, dp, pp, args.reps) for dp, pp in ((4, 1), (1, 4)) for d in ("fp32", "fp16")]
    search = _search_overhead(args.reps)
    out = {"preset": PRESET, "model": "gpt2", "rows": rows, "search": search,
           "machine": machine(note="machine shared with other jobs: wall times are noisy, compare "
                                      "the with/without pairs (alternating, best of reps) only")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    for r in rows:
        print(f"{r['layout']} {r['dtype']}: even {r['even_ms']:.2f} ms, skewed {r['skewed_ms']:.2f} ms "
              f"({r['skew_speedup']:.3f}x), even+controller {r['controller_ms']:.2f} ms "
              f"({r['controller_speedup']:.3f}x); shards {r['first_linear']}; compile "
              f"{r['compile_seconds_pinned']}")
    print(f"search: {search}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
