"""The ``gemini`` pass: placement on the plan's nodes, idle spans of pipeline, tensor- and
data-parallel layouts, the chunk schedule and the predictions."""

from __future__ import annotations

from pathlib import Path

import pytest

import hetplan
from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.idle_spans import intersect_spans, node_idle_spans
from hetplan.errors import InfeasiblePlanError, SpecError
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan import Layout, Plan
from hetplan.passes import get_all_passes
from hetplan.passes.gemini import Gemini

CLUSTER = Path(__file__).resolve().parents[1] / "fixtures" / "clusters" / "cpu-4-nodes.yaml"
PIPE = "dynpipe,even-tp,ddp-buckets"


def _plan(model: str = "gpt-test", replicas: int = 2, **pins: int) -> Plan:
    spec = f"{PIPE},gemini{{replicas={replicas}}}"
    return hetplan.compile(model, ClusterSpec.load(CLUSTER), batch_size=8, passes=spec,
                           seq=16, **pins)


def _idle(plan: Plan) -> tuple[float, list[list[tuple[float, float]]]]:
    workload = plan.model.workload
    assert plan.layout is not None and workload is not None and plan.cost_settings is not None
    costs = CostModel(ClusterSpec.load(CLUSTER), dtype=plan.cost_settings.dtype,
                      precision=plan.precision)
    idle = node_idle_spans(workload, plan.layout, plan.stages, plan.gradient_sync, costs,
                           tensor_parallel=plan.tensor_parallel)
    return idle.iteration_s, [list(b) for b in idle.busy]


def test_registry_and_options() -> None:
    assert get_all_passes()["gemini"] is Gemini
    with pytest.raises(SpecError, match="replicas"):
        Gemini(replicas=0)
    with pytest.raises(SpecError, match="mu"):
        Gemini(mu=1.5)


def test_pipeline_plan_holders_and_schedule() -> None:
    plan = _plan(pp=2, dp=2)
    ck = plan.checkpointing
    assert ck is not None and ck.replicas == 2 and ck.placement == "group"
    assert ck.node_groups == ((0, 1), (2, 3))
    assert [r.holders for r in ck.ranks] == [(0, 1), (1, 0), (2, 3), (3, 2)]
    for row in ck.ranks:
        sch = ck.schedules[row.schedule]
        assert sch.state_bytes == row.state_bytes > 0
        sent = sum(c.size for c in sch.chunks)
        assert sent == (ck.replicas - 1) * row.state_bytes  # every byte of one remote copy
    # the pipeline's activation transfers cross nodes: the simulator reports them busy
    iteration_s, busy = _idle(plan)
    assert all(busy), "every node carries pipeline or gradient traffic"
    assert all(b <= iteration_s + 1e-12 for spans in busy for _, b in spans)
    assert ck.recovery[1].exact == "2/3"  # Fig. 6.3 (a): N=4, m=2, k=2
    assert ck.gemini.checkpoint_ms < ck.baseline.checkpoint_ms
    assert ck.cpu_memory_checked and not ck.storage_bandwidth_assumed


def test_tensor_parallel_across_nodes_is_busy_inside_actions() -> None:
    plan = _plan(pp=2, dp=2)
    workload = plan.model.workload
    assert workload is not None and plan.layout is not None
    costs = CostModel(ClusterSpec.load(CLUSTER), dtype="fp32")
    tp = Layout(dp=2, pp=1, tp=2, micro_batch_size=plan.layout.micro_batch_size,
                micro_batches=plan.layout.micro_batches)
    idle = node_idle_spans(workload, tp, (), None, costs)
    ev = idle.evaluation
    compute_s = sum(e.end_ms - e.start_ms for e in ev.pipeline.events if e.rank == 0) * 1e-3
    for busy in idle.busy:  # every forward and backward action holds the TP link
        assert sum(b - a for a, b in busy) >= compute_s - 1e-12
    dp_only = node_idle_spans(workload, Layout(dp=4, micro_batch_size=2), (), None, costs)
    assert all(sum(b - a for a, b in busy) < compute_s for busy in dp_only.busy)


def test_ring_and_mixed_and_too_many_replicas() -> None:
    plan = _plan(replicas=3, pp=2, dp=2)
    ck = plan.checkpointing
    assert ck is not None and ck.placement == "mixed"
    assert ck.node_holders == ((0, 1, 2), (1, 2, 3), (2, 3, 0), (3, 0, 1))
    with pytest.raises(SpecError, match="lower --replicas"):
        _plan(replicas=5, pp=2, dp=2)


def test_deterministic_json() -> None:
    assert _plan(pp=2, dp=2).to_json() == _plan(pp=2, dp=2).to_json()


def test_cpu_memory_too_small_is_infeasible() -> None:
    spec = ClusterSpec.load(CLUSTER).model_dump()
    spec["nodes"][0]["cpu_memory_gib"] = 2 ** -10
    with pytest.raises(InfeasiblePlanError, match="cpu_memory_gib"):
        hetplan.compile("gpt-test", ClusterSpec.from_dict(spec), batch_size=8, seq=16,
                        passes=f"{PIPE},gemini", pp=2, dp=2)


def test_intersect_spans() -> None:
    assert intersect_spans([[(0, 4), (6, 9)], [(1, 7)]]) == ((1, 4), (6, 7))
    assert intersect_spans([]) == ()
