"""``evaluate`` simulates the DP timeline of stages with the same backprop segments and sync
units once (a deep pipeline of repeated blocks): the prediction is the one of simulating every
stage, which ``record=True`` still does."""

from __future__ import annotations

import pytest

from hetplan.algorithms.dp_types import Op, SyncUnit
from hetplan.cost_models import evaluate as evaluate_module
from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.evaluate import _same_units, evaluate
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan_sections import GradCost, LayerCost, Layout, Stage, WorkloadSummary


def _cluster() -> ClusterSpec:
    return ClusterSpec.from_dict({
        "name": "node-8",
        "nodes": [{
            "name": "n",
            "devices": [{"type": "A100-80GB", "count": 8}],
            "cpu_cores": 8,
            "intra_link": {"kind": "nvlink", "bandwidth_gbps": 2400, "latency_us": 2},
        }],
    })


def _blocks(n: int) -> WorkloadSummary:
    """``n`` identical layers, each with a weight and a bias gradient."""
    return WorkloadSummary(
        layers=tuple(LayerCost(name=f"L{i}", param_bytes=2**22 + 2**12, fwd_flops=10**12,
                               bwd_flops=2 * 10**12, act_out_bytes=2**20)
                     for i in range(n)),
        grads=tuple(GradCost(name=f"L{i}.{p}", size_bytes=s, layer_index=i)
                    for i in reversed(range(n)) for p, s in (("b", 2**12), ("w", 2**22))),
    )


def test_same_units_ignores_only_names() -> None:
    a = [SyncUnit(0, (Op("net", 1.0, "allreduce"),), "x")]
    assert _same_units(a, [SyncUnit(0, (Op("net", 1.0, "allreduce"),), "y")])
    assert not _same_units(a, [SyncUnit(1, (Op("net", 1.0, "allreduce"),), "x")])
    assert not _same_units(a, [SyncUnit(0, (Op("net", 2.0, "allreduce"),), "x")])
    assert not _same_units(a, a + a)


def test_repeated_stages_share_one_simulation_with_the_same_prediction(
        monkeypatch: pytest.MonkeyPatch) -> None:
    wl = _blocks(8)
    layout = Layout(dp=2, pp=4, micro_batch_size=1, micro_batches=8)
    stages = tuple(Stage(index=s, first_layer=2 * s, last_layer=2 * s + 1,
                         ranks=tuple(layout.rank_of(d, s, 0) for d in range(2)))
                   for s in range(4))
    costs = CostModel(_cluster())
    calls: list[bool] = []
    real = evaluate_module.simulate_dp

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(bool(kwargs.get("record")))
        return real(*args, **kwargs)

    monkeypatch.setattr(evaluate_module, "simulate_dp", counting)
    shared = evaluate(wl, layout, stages, None, costs, check_memory=False)
    assert calls == [False]  # four equal stages, one simulation
    calls.clear()
    each = evaluate(wl, layout, stages, None, costs, check_memory=False, record=True)
    assert calls == [True] * 4
    assert shared.iteration_s == each.iteration_s
    assert [s.exposed_sync_s for s in shared.stages] == [s.exposed_sync_s for s in each.stages]
    assert shared.iteration_s > 0
