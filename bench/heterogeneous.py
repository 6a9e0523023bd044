"""Heterogeneous stages against fixed choices, and the search's speed. Writes
``bench/results/heterogeneous.json``.

For each cluster (``mixed-generations``, ``mixed-tp-node``, and the 16 A100-40GB + 16
V100-16GB file ``bench/data/clusters/a100-40gb-v100-16gb-16x16.yaml``) and model
(``gpt2-medium``; a GPT-style 2.7B, GPT-2 shapes at hidden 2560, 32 blocks, 32 heads), global
batch 256, every time predicted by the one cost model of ``compile()``'s plan:

- ``searched``: :func:`~hetplan.optimizer.hetero.compile_hetero` (each stage its own class and
  (dp, tp), order searched);
- ``single_dp_tp``: the best heterogeneous pipeline with one (dp, tp) for all stages (the
  same search restricted to each (dp, tp) in turn, the best kept);
- ``file_order``: the best plan the search visited whose order of device classes follows the
  order of the nodes in the cluster file (a filter over the visited plans, those the search
  skipped by its lower bound predicted here; not a constrained search: an upper bound on
  the best file-order plan);
- ``front_only``: the search without the single-(dp, tp) seeds and the local search
  (``seed_single=False, local=False``: the DP's front alone, the previous search's
  candidates).
- ``previous_release``: ``compile()``'s plan (unchanged by the heterogeneous search, so the
  same as the release before it).

Each ratio is ``searched / baseline`` (< 1: the searched plan is faster). ``search_s``: the
heterogeneous search's wall time (warm: numba's kernel loaded, the model captured), on this
machine, and ``search_cpu_s`` its CPU time (``time.process_time``: the machine is shared, so
wall time counts other jobs); ``plans_visited`` / ``plans_predicted``: the plans the scans
visited and those the simulator re-predicted (the rest skipped by a lower bound); the 512-GPU
rows use ``bench/data/clusters/mixed-512.yaml`` (three device types)
with batch 1024. ``gap``: the proven gap on the search objective the plan records (0 for the
exact DP; the coarse DP's, at most about 2 %, on 512 GPUs, or CP-SAT's within its
neighbourhood where its refinement was taken: ``bench/hetero_cpsat.py``, see
``docs/decisions/hetero-search.md``).

Run: ``PYTHONPATH=src python bench/heterogeneous.py`` (about 5 minutes on 2 shared cores).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _machine import machine  # noqa: E402

from hetplan import zoo  # noqa: E402
from hetplan.cost_models.costs import CostModel  # noqa: E402
from hetplan.errors import InfeasiblePlanError  # noqa: E402
from hetplan.ir.capture import capture  # noqa: E402
from hetplan.ir.cluster import ClusterSpec  # noqa: E402
from hetplan.ir.plan_sections import ClusterRef, CostSettings  # noqa: E402
from hetplan.optimizer.compile import compile as compile_plan  # noqa: E402
from hetplan.optimizer.hetero import compile_hetero, predict, search_hetero  # noqa: E402
from hetplan.zoo.builders import gpt2  # noqa: E402

ROOT = Path(__file__).resolve().parent
CLUSTERS = {
    "mixed-generations": lambda: ClusterSpec.from_preset("mixed-generations"),
    "mixed-tp-node": lambda: ClusterSpec.from_preset("mixed-tp-node"),
    "a100-40gb-v100-16gb-16x16": lambda: ClusterSpec.load(
        ROOT / "data/clusters/a100-40gb-v100-16gb-16x16.yaml"),
}
BATCH = 256
PAIRS = [(dp, tp) for tp in (1, 2, 4, 8) for dp in (1, 2, 4, 8, 16, 32)]


def _model_ir(name: str) -> Any:
    args, kwargs = zoo.example_inputs("gpt2", batch=1)
    if name == "gpt-2.7b":
        with __import__("torch").device("meta"):
            model = gpt2(2560, 32, 32)()
        return capture(model, args, kwargs, name=name)
    args, kwargs = zoo.example_inputs(name, batch=1)
    return capture(zoo.build(name), args, kwargs, name=name)


def _costs(plan: Any, spec: ClusterSpec) -> CostModel:
    cs = plan.cost_settings or CostSettings()
    return CostModel(spec, None, dtype=cs.dtype, efficiency=cs.efficiency,
                     optimizer=cs.optimizer, attention=cs.attention, dp_overlap=cs.dp_overlap)


def _file_rank(spec: ClusterSpec, costs: CostModel) -> dict[str, int]:
    from hetplan.cost_models.hetero import device_classes

    return {c.name: min(c.ranks) for c in device_classes(costs)}


def row(model: str, ir: Any, cluster: str, spec: ClusterSpec, batch: int = BATCH
        ) -> dict[str, Any]:
    out: dict[str, Any] = {"model": model, "cluster": cluster, "world_size": spec.world_size,
                           "batch": batch}
    try:
        base = compile_plan(ir, spec, batch_size=batch)
    except InfeasiblePlanError as e:
        out["previous_release"] = {"error": str(e)[:300]}
        return out
    assert base.predictions is not None and base.layout is not None
    lay = base.layout
    out["previous_release"] = {"ms": base.predictions.iteration_time_ms,
                               "layout": f"dp{lay.dp} pp{lay.pp} tp{lay.tp} "
                                         f"mb{lay.micro_batch_size}x{lay.micro_batches}"}
    costs = _costs(base, spec)
    workload = base.model.workload
    assert workload is not None
    search_hetero(workload, costs, batch, micro_batch=batch)  # load the kernel
    t0, c0 = time.perf_counter(), time.process_time()
    cands = search_hetero(workload, costs, batch)
    out["search_s"] = round(time.perf_counter() - t0, 3)
    out["search_cpu_s"] = round(time.process_time() - c0, 3)
    try:
        plan = compile_hetero(workload, costs, batch, model_ref=base.model,
                              cluster_ref=ClusterRef.from_cluster(spec),
                              cost_settings=base.cost_settings)
    except InfeasiblePlanError as e:
        out["searched"] = {"error": str(e)[:300]}
        return out
    assert plan.predictions is not None and plan.hetero is not None
    ms = plan.predictions.iteration_time_ms
    out["searched"] = {"ms": ms, "stages": plan.hetero.describe(),
                       "micro_batch": f"{plan.layout.micro_batch_size}x"
                                      f"{plan.layout.micro_batches}" if plan.layout else "",
                       "method": plan.hetero.search.method, "gap": plan.hetero.search.gap,
                       "plans_visited": len(cands),
                       "plans_predicted": sum(c.evaluation is not None for c in cands)}
    front = [c for c in search_hetero(workload, costs, batch, seed_single=False, local=False)
             if c.evaluation is not None]
    if front:
        out["front_only"] = {"ms": front[0].predicted_s * 1e3,
                             "stages": front[0].hetero.describe(),
                             "ratio": ms / (front[0].predicted_s * 1e3)}
    single: tuple[float, str] | None = None
    for pair in PAIRS:
        got = [c for c in search_hetero(workload, costs, batch, restrict=pair)
               if c.evaluation is not None]
        if got and (single is None or got[0].predicted_s * 1e3 < single[0]):
            single = (got[0].predicted_s * 1e3, got[0].hetero.describe())
    if single is not None:
        out["single_dp_tp"] = {"ms": single[0], "stages": single[1], "ratio": ms / single[0]}
    pos = _file_rank(spec, costs)
    in_order = []
    for c in cands:
        if ([pos[x] for x in c.order] != sorted(pos[x] for x in c.order)
                or len(set(c.order)) != len(c.order)):
            continue
        ev = predict(workload, costs, c) if c.skipped else c.evaluation
        if ev is not None:
            in_order.append((ev.iteration_s * 1e3, c.hetero.describe()))
    if in_order:
        fo = min(in_order)
        out["file_order"] = {"ms": fo[0], "stages": fo[1], "ratio": ms / fo[0]}
    out["previous_release"]["ratio"] = ms / base.predictions.iteration_time_ms
    return out


def scale_rows(irs: dict[str, Any]) -> list[dict[str, Any]]:
    """Search time on 32 (mixed-generations) and 512 GPUs (three device types)."""
    rows = []
    big = ClusterSpec.load(ROOT / "data/clusters/mixed-512.yaml")
    for cluster, spec, batch in (("mixed-generations", CLUSTERS["mixed-generations"](), 256),
                                 ("mixed-512", big, 1024)):
        for model, ir in irs.items():
            from hetplan.ir.plan_sections import WorkloadSummary

            workload = WorkloadSummary.from_model_ir(ir)
            costs = CostModel(spec, dtype="mixed")
            search_hetero(workload, costs, batch, micro_batch=batch)  # load the kernel
            t0, c0 = time.perf_counter(), time.process_time()
            cands = search_hetero(workload, costs, batch)
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            ok = [c for c in cands if c.evaluation is not None]
            rows.append({
                "cluster": cluster, "world_size": spec.world_size, "model": model,
                "batch": batch, "search_s": round(dt, 3), "search_cpu_s": round(cpu, 3),
                "plans_visited": len(cands),
                "plans_predicted": sum(c.evaluation is not None for c in cands),
                "best_ms": ok[0].predicted_s * 1e3 if ok else None,
                "stages": ok[0].hetero.describe() if ok else None,
                "method": ok[0].hetero.search.method if ok else None,
                "units": list(ok[0].hetero.search.units) if ok else None,
                "gap": max((c.hetero.search.gap for c in ok[:1]), default=None),
            })
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    irs = {m: _model_ir(m) for m in ("gpt2-medium", "gpt-2.7b")}
    rows = []
    for cluster, make in CLUSTERS.items():
        for model, ir in irs.items():
            rows.append(row(model, ir, cluster, make()))
            print(json.dumps(rows[-1]), flush=True)
    result = {
        "machine": machine(note="2 cores shared with other jobs (load average about 12): "
                                "wall times are inflated by the sharing; search_cpu_s is "
                                "the process's CPU time"),
        "comparisons": rows,
        "scale": scale_rows(irs),
    }
    out = ROOT / "results/heterogeneous.json"
    out.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
