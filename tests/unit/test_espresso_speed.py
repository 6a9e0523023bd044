"""Espresso pass speed-ups that must not change the choice: the per-hierarchy lower bound
(a hierarchy proven slower than another's result is not searched) and the cost tables; and
the narrower retry of wider rungs (it may change the choice: measured in
``docs/decisions/espresso-speed.md``, "Round 4")."""

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


def test_registered_arrays_are_the_converted_ones() -> None:
    """The cost tables register every ops tuple's arrays with one session ahead (one slice of
    the table per size); they must be what converting the tuple op by op gives, bit for bit,
    or every trial of every rung would see other durations."""
    from hetplan.algorithms.dp_session import DPSession
    from hetplan.cost_models.evaluate import stage_syncs

    ctx, plan = _setup("vgg16", "espresso-pcie-8x8")
    ss = stage_syncs(ctx.workload, ctx.layout, plan.stages, ctx.costs)[0]
    costs = espresso_pass._StageCosts(ss, ctx, 0.01, ("gpu", "cpu"))
    keys = [(None, 0, "fp32"), ("dgc", 5, "fp32"), ("dgc", 5, "fp16"), ("efsignsgd", 40, "fp32")]
    fresh = DPSession(ss.backprop_s)
    checked = 0
    for key in keys:
        costs.table(key)
        for i in range(len(ss.grads)):
            ops = costs.ops(i, key)
            (r1, d1), = costs.arrays._arrays_of([ops])
            (r2, d2), = fresh._arrays_of([ops])
            assert r1.tolist() == r2.tolist() and d1.tolist() == d2.tolist()
            assert costs.arrays._conv[id(ops)][0] is ops  # registered, not converted again
            checked += 1
    assert checked == 4 * len(ss.grads)
    # equal ops values get one identity, different ones different identities
    a, b = costs.ops(0, keys[1]), costs.ops(0, keys[2])
    assert (costs.signature(a) == costs.signature(b)) == (a == b)
    assert costs.signature(tuple(a)) == costs.signature(a)


def test_benefits_left_out_then_computed_once_are_the_same() -> None:
    """``select(benefits=False)`` + :func:`tensor_benefits` (what the pass does for the kept
    selection alone) gives the benefits ``select`` computes itself."""
    from hetplan.algorithms.dp_types import GPU, Op
    from hetplan.algorithms.espresso import SelectionProblem, select, tensor_benefits

    raw, comp = [14.0, 11.0, 10.0, 6.0, 9.0], [5.0, 5.0, 3.6, 2.0, 4.0]

    def problem() -> SelectionProblem[str]:
        def ops(i: int, k: str) -> tuple[Op, ...]:
            return (Op("net", raw[i]),) if k == "N" else (Op(GPU, comp[i]), Op("net", 3.6))
        return SelectionProblem(backprop_s=[10, 10, 9, 4, 3], sizes=[3, 2, 1, 1, 2],
                                baseline=["N"] * 5, gpu_options=[["G"]] * 5, ops=ops,
                                compressed=lambda k: k != "N")

    full = select(problem(), exhaustive_limit=0)
    p = problem()
    lean = select(p, exhaustive_limit=0, benefits=False)
    assert lean.strategy == full.strategy and lean.iteration_s == full.iteration_s
    assert any(k != "N" for k in full.strategy)
    assert set(lean.benefit_s) == {0.0}
    assert tensor_benefits(p, lean.strategy, lean.iteration_s) == full.benefit_s
    assert tensor_benefits(p, lean.strategy, lean.iteration_s, fast=False) == full.benefit_s


def test_wider_rungs_retry_only_the_routings_and_casts_in_use(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A wider rung's sweep tries its new paths and, besides them, exactly the uncompressed
    routings and casts the narrower choice holds (not every routing and cast again); the
    first rung tries everything it has."""
    ctx, plan = _setup("lstm", "espresso-pcie-8x8")
    calls: list[tuple[list[Any], list[Any], Any]] = []
    select = Espresso._select

    def one_rung(pass_: Any, ss: Any, costs: Any, cands: Any, new: Any, narrower: Any,
                 floor: float = 0.0) -> Any:
        calls.append((list(cands), list(new), narrower))
        return select(pass_, ss, costs, cands, new, narrower, floor)

    monkeypatch.setattr(Espresso, "_select", one_rung)
    Espresso(compressors=("randomk", "fp16")).run(plan, ctx)
    assert len(calls) >= 3
    first_cands, first_new, first_narrower = calls[0]
    assert first_narrower is None and first_new == first_cands
    retried = 0
    for cands, new, narrower in calls[1:]:
        if narrower is None:  # the other hierarchy's first rung
            continue
        used = set(narrower.strategy)
        plain = [k for k in new if k[0] is None]
        assert plain == [k for k in cands if k[0] is None and k in used]
        retried += len(plain)
        assert any(k[0] is not None for k in new)
    assert retried > 0  # the narrower choices do hold routings or casts here
