"""Bench: where the Espresso pass's GPU selection time goes, compiled kernels against the rest.

Runs the ``espresso`` pass with its defaults in the setup of ``bench/espresso.py`` (every case
unless ``--cases`` says otherwise), in one process, after loading the numba kernels, and
times every call of a compiled kernel (``best_option``, ``best_classes``, ``rebase_run``,
``bubble_mask``, ...; numba's dispatch and argument unboxing included) made inside the GPU
selection (Algorithm 4.1's sweeps and the uniform seeds: the span of
``Selection.gpu_process_s``). Per case, the least over ``--repeat`` runs (default 3) of the
selection's CPU time (``time.process_time``), the kernels' share of that run and the rest
(Python: candidate lists, packing, sessions, the sweep loop), beside Table 4.5. The kernel
time is what a selection making the same choices cannot go below without fewer or cheaper
trials (``docs/decisions/espresso-speed.md``, "Round 7"). The wrappers cost about 0.3 us a
kernel call, counted in the rest.

Run: ``python bench/espresso_profile.py [--cases m/c/comp,...] [--repeat N] [--out FILE]``
(default ``bench/results/espresso_profile.json``); ``PYTHONPATH=<tree>/src`` profiles
another tree.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import espresso as be  # noqa: E402  (bench/espresso.py: the cases' setup and Table 4.5)

OUT = Path(__file__).parent / "results" / "espresso_profile.json"


def _timed(spent: Counter[str], name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    def g(*args: Any) -> Any:
        t = time.process_time()
        try:
            return f(*args)
        finally:
            spent[name] += time.process_time() - t
    return g


def profile(cases: list[str], repeat: int) -> dict[str, Any]:
    import hetplan.algorithms.dp_session as ds
    import hetplan.algorithms.espresso as ea
    from hetplan.ir.plan_sections import WorkloadSummary
    from hetplan.ir.workload import espresso_workloads
    from hetplan.passes.espresso import Espresso

    if not ds.warm_up():
        raise SystemExit("the kernels are not compiled (HETPLAN_JIT=0 or no numba): "
                         "nothing to profile")
    spent: Counter[str] = Counter()
    kernels = ds._COMPILED[0]
    for name in list(vars(kernels)):
        setattr(kernels, name, _timed(spent, name, getattr(kernels, name)))
    inside: Counter[str] = Counter()  # kernel time inside the GPU selection's spans

    def span(f: Callable[..., Any]) -> Callable[..., Any]:
        def g(*args: Any, **kwargs: Any) -> Any:
            before = dict(spent)
            try:
                return f(*args, **kwargs)
            finally:
                for n, v in spent.items():
                    inside[n] += v - before.get(n, 0.0)
        return g

    sweep, seeds = ea.gpu_decisions, ea._best_seed
    ea.gpu_decisions, ea._best_seed = span(sweep), span(seeds)  # type: ignore[assignment]
    wls = espresso_workloads(be.DATA, gaps="effective", include_extra=False)
    out: dict[str, Any] = {}
    try:
        for case in cases:
            model, cl, comp = case.split("/")
            wl = WorkloadSummary.from_model_ir(wls[model])
            runs = []
            for _ in range(repeat):
                ctx, plan = be._setup(wl, be.CLUSTERS[cl])
                inside.clear()
                with be._Recorder() as rec:
                    Espresso(compressors=(comp, "fp16")).run(plan, ctx)
                runs.append((sum(s.gpu_process_s for s in rec.selections), dict(inside)))
            total, per = min(runs, key=lambda r: r[0])
            k = sum(per.values())
            out[case] = {
                "gpu_process_ms": round(total * 1e3, 2),
                "kernels_ms": round(k * 1e3, 2),
                "rest_ms": round((total - k) * 1e3, 2),
                "kernel_ms": {n: round(v * 1e3, 2) for n, v in sorted(per.items()) if v > 0},
                "table_4_5_ms": be.TABLE_4_5_MS[model],
                "kernels_vs_table_4_5": round(k * 1e3 / be.TABLE_4_5_MS[model], 3),
            }
            print(f"{case:28s} GPU selection {total * 1e3:7.1f} ms CPU: kernels {k * 1e3:7.1f}"
                  f" ms, rest {(total - k) * 1e3:6.1f} ms | Table 4.5 "
                  f"{be.TABLE_4_5_MS[model]} ms", flush=True)
    finally:
        ea.gpu_decisions, ea._best_seed = sweep, seeds  # type: ignore[assignment]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    every = [f"{m}/{c}/{k}" for m in be.TABLE_4_5_MS for c in be.CLUSTERS for k in be.COMPRESSORS]
    ap.add_argument("--cases", default=",".join(every))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    load = [round(x, 2) for x in os.getloadavg()]
    got = profile(args.cases.split(","), args.repeat)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "what": "CPU time of the espresso pass's GPU selection (least of repeat runs), the "
                "compiled kernels' part of it (dispatch included) and the rest",
        "repeat": args.repeat,
        "machine": {"note": "2 CPU cores shared with other jobs",
                    "load_average_start": load,
                    "load_average_end": [round(x, 2) for x in os.getloadavg()]},
        "cases": got}, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
