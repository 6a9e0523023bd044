"""CP-SAT in the heterogeneous search: where it is used, what it gains, what it costs. Writes
``bench/results/hetero_cpsat.json``.

1. ``scale``: ``bench/data/clusters/mixed-512.yaml`` (512 GPUs of three types, batch 1024),
   ``gpt2-medium`` and the GPT-style 2.7B of ``bench/heterogeneous.py``: the search
   (:func:`~hetplan.optimizer.hetero.search_hetero`) without CP-SAT (the coarse DP alone)
   and with it (the coarse DP, then CP-SAT around its best plan at one-device resolution),
   warm (numba's kernel loaded, OR-Tools imported), the median of 3 interleaved runs; the chosen plan's predicted time and
   the CP-SAT record (status, objective, bound, gap within its neighbourhood, work).
   ``ortools_import_s``: the one-off import of OR-Tools in a fresh interpreter (a cold
   ``hetplan plan`` pays it once, only when CP-SAT runs).
2. ``full_model``: CP-SAT over the *whole* space (no neighbourhood) against the exact DP on
   ``mixed-generations`` (32 GPUs), GPT-2 (14 layers; the larger models' full models hold
   hundreds of thousands of booleans), for one micro-batch size: booleans, status, gap and time
   at a deterministic limit, against the DP's time to its proven optimum. Why the search
   keeps the DP where it scales.
3. ``small``: CP-SAT against brute force on the small clusters of the unit tests (gpt-test,
   8 layers, at most 4 device groups): equal objectives, zero gap, solve time.

Run: ``PYTHONPATH=src python bench/hetero_cpsat.py`` (a few minutes on 2 shared cores).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _machine import machine  # noqa: E402

from hetplan import zoo  # noqa: E402
from hetplan.algorithms.hetero_cpsat import solve_cpsat  # noqa: E402
from hetplan.algorithms.hetero_search import solve_brute_force, solve_exact  # noqa: E402
from hetplan.cost_models.costs import CostModel  # noqa: E402
from hetplan.cost_models.hetero import build_problem, device_classes  # noqa: E402
from hetplan.ir.capture import capture  # noqa: E402
from hetplan.ir.cluster import ClusterSpec  # noqa: E402
from hetplan.ir.plan_sections import WorkloadSummary  # noqa: E402
from hetplan.optimizer.hetero import search_hetero  # noqa: E402
from hetplan.zoo.builders import gpt2  # noqa: E402

ROOT = Path(__file__).resolve().parent
#: runs per search timing (the median is reported)
REPEATS = 3


def _workload(name: str) -> WorkloadSummary:
    if name == "gpt-2.7b":
        args, kwargs = zoo.example_inputs("gpt2", batch=1)
        with __import__("torch").device("meta"):
            model = gpt2(2560, 32, 32)()
        return WorkloadSummary.from_model_ir(capture(model, args, kwargs, name=name))
    args, kwargs = zoo.example_inputs(name, batch=1)
    return WorkloadSummary.from_model_ir(capture(zoo.build(name), args, kwargs, name=name))


def _import_s() -> float:
    code = ("import time; t = time.perf_counter(); from ortools.sat.python import cp_model; "
            "print(time.perf_counter() - t)")
    return round(float(subprocess.check_output([sys.executable, "-c", code], text=True)), 3)


def scale_rows(wls: dict[str, WorkloadSummary]) -> list[dict[str, Any]]:
    spec = ClusterSpec.load(ROOT / "data/clusters/mixed-512.yaml")
    costs = CostModel(spec, dtype="mixed")
    rows = []
    for model, wl in wls.items():
        search_hetero(wl, costs, 1024, micro_batch=1024)  # kernel and OR-Tools loaded
        row: dict[str, Any] = {"cluster": "mixed-512", "model": model, "batch": 1024}
        times: dict[str, list[float]] = {"coarse_dp": [], "coarse_dp_cpsat": []}
        for _ in range(REPEATS):  # interleaved: the machine's load drifts
            for label, flag in (("coarse_dp", False), ("coarse_dp_cpsat", True)):
                t0 = time.perf_counter()
                cands = search_hetero(wl, costs, 1024, cpsat=flag)
                times[label].append(time.perf_counter() - t0)
        for label, flag in (("coarse_dp", False), ("coarse_dp_cpsat", True)):
            cands = search_hetero(wl, costs, 1024, cpsat=flag)
            dt = sorted(times[label])[REPEATS // 2]
            best = next(c for c in cands if c.evaluation is not None)
            row[label] = {"search_s": round(dt, 3),
                          "search_s_runs": [round(t, 3) for t in times[label]],
                          "predicted_ms": best.predicted_s * 1e3,
                          "objective_ms": best.solution.objective * 1e3,
                          "stages": best.hetero.describe(),
                          "method": best.hetero.search.method}
            rec = best.hetero.search.cpsat
            if rec is not None:
                row[label]["cpsat"] = rec.model_dump()
        row["ratio_predicted"] = (row["coarse_dp_cpsat"]["predicted_ms"]
                                  / row["coarse_dp"]["predicted_ms"])
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def full_model_rows() -> list[dict[str, Any]]:
    costs = CostModel(ClusterSpec.from_preset("mixed-generations"), dtype="mixed")
    classes = device_classes(costs)
    rows = []
    for model, wl in (("gpt2", _workload("gpt2")),):
        problem, _ = build_problem(wl, costs, classes, 8, 32)
        t0 = time.perf_counter()
        exact = solve_exact(problem)
        dp_s = time.perf_counter() - t0
        assert exact is not None
        sat = solve_cpsat(problem, hint=exact.stages, deterministic_limit=2.0,
                          wall_limit_s=120.0)
        cold = solve_cpsat(problem, deterministic_limit=2.0, wall_limit_s=120.0)
        rows.append({"cluster": "mixed-generations", "model": model, "micro_batch": "8x32",
                     "layers": problem.num_layers, "options": len(problem.options),
                     "exact_dp": {"objective_ms": exact.objective * 1e3,
                                  "seconds": round(dp_s, 3)},
                     "cpsat_warm": _sat(sat), "cpsat_cold": _sat(cold)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _sat(r: Any) -> dict[str, Any]:
    return {"status": r.status, "objective_ms": r.objective * 1e3 if r.stages else None,
            "bound_ms": r.bound * 1e3, "gap": r.gap, "booleans": r.booleans,
            "deterministic_time": r.deterministic_time, "wall_s": round(r.wall_s, 3)}


def small_rows() -> list[dict[str, Any]]:
    def node(name: str, kind: str, count: int, per: int) -> dict[str, Any]:
        return {"name": name, "count": count, "devices": [{"type": kind, "count": per}],
                "cpu_cores": 16, "intra_link": {"kind": "nvlink", "bandwidth_gbps": 1200.0,
                                                "latency_us": 2.0}}
    clusters = {
        "2xA100+2xV100": [node("a", "A100-80GB", 1, 2), node("v", "V100-SXM2-32GB", 1, 2)],
        "A100+V100+V100": [node("a", "A100-80GB", 1, 1), node("v", "V100-SXM2-32GB", 2, 1)],
        "A100,2xV100,A100-40": [node("a", "A100-80GB", 1, 1),
                                node("v", "V100-SXM2-32GB", 1, 2),
                                node("b", "A100-40GB", 1, 1)],
    }
    wl = _workload("gpt-test")
    rows = []
    for name, nodes in clusters.items():
        spec = ClusterSpec.from_dict({"name": name, "nodes": nodes, "inter_node": {
            "kind": "ethernet", "bandwidth_gbps": 100.0, "latency_us": 25.0}})
        costs = CostModel(spec, dtype="mixed")
        for mb, m in ((2, 4), (4, 2)):
            problem, _ = build_problem(wl, costs, device_classes(costs), mb, m)
            brute = solve_brute_force(problem)
            sat = solve_cpsat(problem)
            assert brute is not None
            rows.append({"cluster": name, "micro_batch": f"{mb}x{m}",
                         "brute_force_ms": brute.objective * 1e3,
                         "cpsat_ms": sat.objective * 1e3,
                         "equal": abs(sat.objective - brute.objective) <= 1e-8 * brute.objective,
                         "gap": sat.gap, "status": sat.status, "booleans": sat.booleans,
                         "wall_s": round(sat.wall_s, 3)})
    return rows


def main() -> None:
    wls = {m: _workload(m) for m in ("gpt2-medium", "gpt-2.7b")}
    result = {
        "machine": machine(note="2 cores shared with other jobs: wall times are inflated "
                                "by the sharing"),
        "ortools_import_s": _import_s(),
        "scale": scale_rows(wls),
        "full_model": full_model_rows(),
        "small": small_rows(),
    }
    out = ROOT / "results/hetero_cpsat.json"
    out.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
