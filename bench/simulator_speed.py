"""How long one evaluation of the data-parallel timeline takes (the passes call it thousands
of times per compile). Target: ≤ 1 ms for 314 gradient tensors (ResNet-101).

Measures, side by side in one run: per-tensor fp32 allreduce (one op per tensor: the fast
path), DDP-style buckets, and a 4-op GPU-compression path per tensor (the general event loop).
Writes ``bench/results/simulator_speed.json``.

    python bench/simulator_speed.py
"""

from __future__ import annotations

import json
import statistics
import timeit
from pathlib import Path

from _machine import machine

from hetplan.algorithms.dp_timeline import simulate_dp
from hetplan.algorithms.dp_types import GPU, Op, SyncUnit
from hetplan.cost_models.pipeline import simulate_pipeline
from hetplan.ir.workload import espresso_workloads

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "espresso_models.json"


def _time(fn, repeat: int = 7, number: int = 50) -> float:
    return statistics.median(timeit.repeat(fn, repeat=repeat, number=number)) / number


def main() -> int:
    wl = espresso_workloads(DATA)["resnet101"]
    n = len(wl.grad_tensors)
    bp = [(g.ready_gap_us or 0) * 1e-6 for g in wl.grad_tensors]
    per_tensor = [SyncUnit(i, (Op("net", g.size_bytes / 12.5e9 + 50e-6),))
                  for i, g in enumerate(wl.grad_tensors)]
    buckets = [SyncUnit(i, (Op("net", 2e-3),)) for i in range(0, n, 20)]
    compressed = [
        SyncUnit(i, (Op(GPU, 1e-4), Op("intra", 1e-4), Op("inter", 2e-4), Op(GPU, 5e-5)))
        for i in range(n)
    ]
    cases = {
        "per-tensor allreduce": per_tensor,
        "buckets (every 20 tensors)": buckets,
        "4-op GPU compression path per tensor": compressed,
    }
    results = {}
    for name, units in cases.items():
        seconds = _time(lambda units=units: simulate_dp(bp, units))
        results[name] = {"tensors": n, "units": len(units), "ms": round(seconds * 1e3, 4)}
        print(f"{name:40s} {seconds * 1e3:8.3f} ms")
    pipeline = {}
    for sched, v in [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("chimera", 1)]:
        seconds = _time(lambda sched=sched, v=v: simulate_pipeline(
            [1.0] * 16, [2.0] * 16, 64, sched, virtual_stages=v, p2p_fwd_ms=0.1,
            p2p_bwd_ms=0.1), repeat=5, number=3)
        pipeline[sched] = {"stages": 16, "micro_batches": 64, "ms": round(seconds * 1e3, 3)}
        print(f"pipeline {sched:31s} {seconds * 1e3:8.3f} ms (16 stages, 64 micro-batches)")
    target_ms = 1.0
    out = {
        "pipeline_schedules": pipeline,
        "machine": machine(),
        "workload": "resnet101 (314 gradient tensors)",
        "target_ms": target_ms,
        "results": results,
        "meets_target": results["per-tensor allreduce"]["ms"] <= target_ms,
    }
    path = ROOT / "bench" / "results" / "simulator_speed.json"
    path.write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
