"""Espresso pass speed-ups that must not change the choice: the per-hierarchy lower bound
(a hierarchy proven slower than another's result is not searched) and the cost tables."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import hetplan.passes.espresso as espresso_pass
from hetplan.cost_models.costs import CostModel
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan import ClusterRef, ModelRef, Plan
from hetplan.ir.plan_sections import Layout, WorkloadSummary
from hetplan.ir.workload import espresso_workloads
from hetplan.passes.base import PassContext
from hetplan.passes.espresso import Espresso

DATA = Path(__file__).resolve().parents[2] / "data" / "espresso_models.json"


def _setup(model: str, preset: str) -> tuple[PassContext, Plan]:
    wl = WorkloadSummary.from_model_ir(
        espresso_workloads(DATA, gaps="effective", include_extra=False)[model])
    spec = ClusterSpec.from_preset(preset)
    layout = Layout(dp=64, micro_batch_size=wl.batch_size)
    ctx = PassContext(workload=wl, cluster=spec, costs=CostModel(spec), layout=layout)
    plan = Plan(model=ModelRef(name="t", fingerprint="0" * 16, num_params=1),
                cluster=ClusterRef.from_cluster(spec, embed=False), layout=layout)
    return ctx, plan


class _Spy:
    """Records every hierarchy's bound and the last selection each hierarchy's rungs made."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.bounds: dict[int, float] = {}
        self.last: dict[int, float] = {}
        bound, select = espresso_pass._StageCosts.lower_bound, Espresso._select

        def lower_bound(costs: Any, keys: Any) -> float:
            self.bounds[id(costs)] = b = bound(costs, keys)
            return b

        def one_rung(pass_: Any, ss: Any, costs: Any, *args: Any) -> Any:
            sel = select(pass_, ss, costs, *args)
            self.last[id(costs)] = sel.iteration_s
            return sel

        monkeypatch.setattr(espresso_pass._StageCosts, "lower_bound", lower_bound)
        monkeypatch.setattr(Espresso, "_select", one_rung)


@pytest.mark.parametrize("preset", ["espresso-nvlink-8x8", "espresso-pcie-8x8"])
def test_bound_below_each_hierarchy_and_skip_keeps_the_plan(
        preset: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ctx, plan = _setup("lstm", preset)
    with monkeypatch.context() as m:  # every hierarchy searched
        m.setattr(espresso_pass, "_SKIP_EPS", float("inf"))
        spy = _Spy(m)
        every = Espresso(compressors=("dgc", "fp16")).run(plan, ctx)
        assert len(spy.last) == 2 and set(spy.last) == set(spy.bounds)
        for k, f in spy.last.items():  # the bound holds for each hierarchy's choice
            assert spy.bounds[k] <= f
    spy = _Spy(monkeypatch)
    fast = Espresso(compressors=("dgc", "fp16")).run(plan, ctx)
    assert fast.plan.gradient_sync == every.plan.gradient_sync
    if preset == "espresso-nvlink-8x8":  # flat's bound (34.7 ms) > hierarchical's 16.3 ms
        assert len(spy.last) == 1
