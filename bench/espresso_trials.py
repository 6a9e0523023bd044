"""Bench: how the Espresso pass's trials end, and how far the rejected ones were from winning.

Runs the ``espresso`` pass with its defaults in the setup of ``bench/espresso.py`` with the
kernels **uncompiled** (``HETPLAN_JIT=0``: the same functions and results, run by Python, so
that they can be counted), for the cases given (default: vgg16 and ugatit on the NVLink
testbed, the two models whose selection time is furthest above Table 4.5 after LSTM).

Per case, every trial (a run of the event loop resumed from the base's state,
``_dp_kernels._run`` without ``rebase``) is counted by how it ended: rejected by the bound
(``inf``), converged to the base's state (``converged``), or run to the end; with the heap
pops it took (one per op started: the loop's unit of work) against the tensors left after
its resume point. For a sample of the rejected trials (``--sample``, default 10 %, drawn with
a fixed seed) the same trial is run again without a bound, giving its **excess** (its time
over the time it had to beat, relative) and the **share of its unbounded run's pops spent
before the bound rejected it**. And the bound a changed tensor's own chain of ops gives at
the resume point (each op after the one before, on its resource once that is free; the
other tensors left out, so a lower bound) is checked against every bounded trial: how many
rejected trials it would have rejected at once, and the pops that would save.

Run: ``python bench/espresso_trials.py [--cases m/c/comp,...] [--sample F] [--out FILE]``
(default ``bench/results/espresso_trials.json``). Pure Python: about a minute per ugatit
case.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from collections import Counter
from pathlib import Path
from typing import Any

os.environ["HETPLAN_JIT"] = "0"  # before hetplan is imported: the kernels run as Python

sys.path.insert(0, str(Path(__file__).parent))
import espresso as be  # noqa: E402  (bench/espresso.py: the cases' setup)
import numpy as np  # noqa: E402

OUT = Path(__file__).parent / "results" / "espresso_trials.json"
DEFAULT_CASES = ("vgg16/nvlink/dgc,vgg16/nvlink/efsignsgd,vgg16/nvlink/randomk,"
                 "ugatit/nvlink/dgc,ugatit/nvlink/efsignsgd,ugatit/nvlink/randomk")
QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)
#: excess bands (relative) for the share of pops spent before the rejection
BANDS = ((0.0, 1e-4), (1e-4, 1e-3), (1e-3, 1e-2), (1e-2, 1e-1), (1e-1, float("inf")))


def _chain_bound(b: Any, w: Any, m: int, changed: Any) -> float:
    """A lower bound on a trial's time at its resume point ``m``: each changed tensor's ops
    one after another from its ready time (the GPU's time before segment ``m`` plus the
    backprop up to it), each on its resource once the ops already started there are done."""
    from hetplan.algorithms.dp_types import CPU_ID, GPU_ID

    ready = float(b.snap_gpu[m])
    at: dict[int, float] = {}
    for k in range(m, b.bp.shape[0]):
        ready += float(b.bp[k])
        at[k] = ready
    end = 0.0
    for k in changed:
        t = at[int(k)]
        for o in range(int(w.start[k]), int(w.start[k] + w.count[k])):
            r, d = int(w.res[o]), float(w.dur[o])
            if r == GPU_ID:
                s = t
            elif r == CPU_ID:
                s = max(t, float(b.snap_cpu[m].min()))
            else:
                s = max(t, float(b.snap_free[m, r]))
            t = s + d
        end = max(end, t)
    return float(b.fwd) + end + float(b.opt)


def count(case: str, sample: float) -> dict[str, Any]:
    import hetplan.algorithms._dp_kernels as kernels
    from hetplan.algorithms.dp_types import EPS_BOUND
    from hetplan.ir.plan_sections import WorkloadSummary
    from hetplan.ir.workload import espresso_workloads
    from hetplan.passes.espresso import Espresso

    pops = [0]
    real_pop, real_run = kernels._pop, kernels._run

    def pop(h: Any, size: int) -> int:
        pops[0] += 1
        return real_pop(h, size)

    ends: Counter[str] = Counter()
    spent: Counter[str] = Counter()
    left: Counter[str] = Counter()
    chain = Counter[str]()
    sampled: list[tuple[float, int, int]] = []
    draw = random.Random(0)

    def run(b: Any, w: Any, m: int, changed: Any, bound: float, rebase: bool) -> float:
        p0 = pops[0]
        f = real_run(b, w, m, changed, bound, rebase)
        if rebase:
            return f
        used = pops[0] - p0
        end = "rejected" if f == np.inf else "converged" if f == b.base_s else "ran to the end"
        ends[end] += 1
        spent[end] += used
        left[end] += int(b.bp.shape[0]) - m
        if bound < np.inf and _chain_bound(b, w, m, changed) > \
                bound + EPS_BOUND * max(1.0, abs(bound)):
            assert f == np.inf, "the chain bound rejected a trial the simulation keeps"
            chain["rejected at once"] += 1
            chain["pops saved"] += used
        if f == np.inf and draw.random() < sample:
            p1 = pops[0]
            full = real_run(b, w, m, changed, np.inf, False)
            sampled.append(((full - bound) / bound, used, pops[0] - p1))
        return f

    wls = espresso_workloads(be.DATA, gaps="effective", include_extra=False)
    model, cluster, comp = case.split("/")
    wl = WorkloadSummary.from_model_ir(wls[model])
    kernels._pop, kernels._run = pop, run  # type: ignore[assignment]
    try:
        ctx, plan = be._setup(wl, be.CLUSTERS[cluster])
        Espresso(compressors=(comp, "fp16")).run(plan, ctx)
    finally:
        kernels._pop, kernels._run = real_pop, real_run  # type: ignore[assignment]
    a = np.array(sampled) if sampled else np.zeros((0, 3))
    share = a[:, 1] / np.maximum(a[:, 2], 1) if len(a) else np.zeros(0)
    total = sum(spent.values())
    return {
        "tensors": len(wl.grads),
        "trials": {e: {"count": ends[e], "pops": spent[e],
                       "mean_pops": round(spent[e] / ends[e], 1) if ends[e] else 0.0,
                       "mean_tensors_after_resume": round(left[e] / ends[e], 1)
                       if ends[e] else 0.0} for e in sorted(ends)},
        "pops": total,
        "rejected_sampled": len(a),
        "rejected_excess_quantiles": {str(q): float(np.quantile(a[:, 0], q)) if len(a) else None
                                      for q in QUANTILES},
        "rejected_share_of_pops_before_rejection_by_excess": [
            {"excess_from": lo, "excess_to": None if hi == float("inf") else hi,
             "trials": int(((a[:, 0] >= lo) & (a[:, 0] < hi)).sum()),
             "mean_share": round(float(share[(a[:, 0] >= lo) & (a[:, 0] < hi)].mean()), 3)
             if ((a[:, 0] >= lo) & (a[:, 0] < hi)).any() else None}
            for lo, hi in BANDS],
        "chain_bound": {"rejected_at_once": chain["rejected at once"],
                        "pops_saved": chain["pops saved"],
                        "share_of_all_pops": round(chain["pops saved"] / total, 4)
                        if total else 0.0},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=DEFAULT_CASES)
    ap.add_argument("--sample", type=float, default=0.1)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    out: dict[str, Any] = {}
    for case in args.cases.split(","):
        out[case] = got = count(case, args.sample)
        t = got["trials"]
        print(f"{case:28s} {got['pops']:9d} pops; "
              + ", ".join(f"{e} {v['count']} (mean {v['mean_pops']} pops)"
                          for e, v in t.items())
              + f"; rejected trials' excess, median "
              f"{got['rejected_excess_quantiles']['0.5']:.2e}; chain bound saves "
              f"{got['chain_bound']['share_of_all_pops']:.2%}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "what": "how the espresso pass's trials end (uncompiled kernels, counted), how far "
                "the rejected ones were from the time they had to beat, and what a bound "
                "from the changed tensors' own chains would save",
        "sample": args.sample,
        "cases": out}, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
