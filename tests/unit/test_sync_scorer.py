"""``SyncScorer`` against ``evaluate``: the iteration time of a gradient-sync section scored
with the prefix computed once must equal ``evaluate(check_memory=False).iteration_s`` bit for
bit, for DDP buckets, every uncompressed routing (flat and hierarchical, the way the espresso
pass scores them), per-tensor compressed and cast strategies, and no section at all, on a
data-parallel layout and on a pipeline (one DP group per stage), with and without ZeRO-1 and
with the sync after the pipeline flush.

The workload is GPT-2 of the Espresso artifact (``data/espresso_models.json``) on the
8 x 8 V100 PCIe preset (its DP groups span several nodes with several ranks each)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetplan.algorithms.espresso_tree import option_id, options
from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.ddp import ddp_gradient_sync
from hetplan.cost_models.evaluate import SyncScorer, evaluate
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import (
    ClusterRef,
    GradientSync,
    Layout,
    ModelRef,
    TensorSync,
    WorkloadSummary,
)
from hetplan.passes.base import PassContext
from hetplan.passes.espresso import strategy_for, strategy_name
from hetplan.passes.manager import run_passes
from hetplan.passes.spec import parse_pipeline

DATA = Path(__file__).resolve().parents[2] / "data" / "espresso_models.json"


@pytest.fixture(scope="module")
def workload() -> WorkloadSummary:
    if not DATA.exists():
        pytest.skip(f"{DATA} not found")
    from hetplan.ir.workload import espresso_workloads

    return WorkloadSummary.from_model_ir(espresso_workloads(DATA, gaps="effective")["gpt2"])


def _plan(workload: WorkloadSummary, layout: Layout, costs: CostModel) -> Plan:
    spec = costs.cluster
    ctx = PassContext(workload=workload, cluster=spec, costs=costs, layout=layout)
    plan = Plan(model=ModelRef(name="gpt2", fingerprint="f", num_params=1),
                cluster=ClusterRef.from_cluster(spec), layout=layout)
    return run_passes(plan, parse_pipeline("uniform-stages,even-tp"), ctx)


def _syncs(workload: WorkloadSummary, plan: Plan, zero: int) -> list[GradientSync]:
    ddp = ddp_gradient_sync(workload, plan.stages)
    out = [ddp]
    keys = [(None, option_id(o)) for o in options(hierarchies=["flat", "hierarchical"],
                                                   compress=False)]
    for key in keys:  # every routing of the buckets, as the espresso pass builds them
        name = strategy_name(key)
        out.append(GradientSync(
            strategies={name: strategy_for(key)},
            buckets=tuple(b.model_copy(update={"strategy": name}) for b in ddp.buckets)))
    if zero <= 1:  # per-tensor strategies, alternating a cast, a sparsifier and fp32
        mixed = [(None, 0), ("fp16", keys[-1][1]),
                 ("dgc", option_id(options(devices=["gpu"], hierarchies=["flat"],
                                           compress=True, max_compressions=1)[0]))]
        strategies = {strategy_name(k): strategy_for(k) for k in mixed}
        out.append(GradientSync(strategies=strategies, tensors=tuple(
            TensorSync(name=g.name, strategy=strategy_name(mixed[i % 3]))
            for i, g in enumerate(workload.grads))))
    return out


@pytest.mark.parametrize("dp, pp, zero, overlap", [
    (64, 1, 0, "backward"), (64, 1, 1, "backward"), (16, 4, 0, "backward"),
    (16, 4, 1, "after-flush"), (32, 2, 3, "backward"),
])
def test_scorer_equals_evaluate(workload: WorkloadSummary, dp: int, pp: int, zero: int,
                                overlap: str) -> None:
    costs = CostModel(ClusterSpec.from_preset("v100-pcie-8x8"), dtype="fp16",
                      dp_overlap=overlap)  # type: ignore[arg-type]
    layout = Layout(dp=dp, pp=pp, micro_batches=pp, micro_batch_size=workload.batch_size,
                    zero_stage=zero)  # type: ignore[arg-type]
    plan = _plan(workload, layout, costs)
    scorer = SyncScorer(workload, layout, plan.stages, costs)
    syncs = _syncs(workload, plan, zero)
    for sync in [None, *syncs]:
        want = evaluate(workload, layout, plan.stages, sync, costs,
                        check_memory=False).iteration_s
        assert scorer.iteration_s(sync) == want
    ddp = syncs[0]
    for sync in syncs[1:]:
        if not sync.buckets:
            continue
        (strategy,) = sync.strategies.values()
        want = evaluate(workload, layout, plan.stages, sync, costs,
                        check_memory=False).iteration_s
        assert scorer.rerouted_s(ddp, strategy) == want
    # the routings do differ, so equality above is not trivially one number
    assert len({scorer.iteration_s(s) for s in syncs}) > 1


@pytest.mark.parametrize("dp, pp, zero, overlap", [
    (64, 1, 1, "backward"), (16, 4, 0, "after-flush"),
])
def test_threshold_decides_as_the_exact_time(workload: WorkloadSummary, dp: int, pp: int,
                                             zero: int, overlap: str) -> None:
    """With ``below``, the scorer returns the exact time when it is below the threshold and
    otherwise a number at least the threshold and at most the exact time (a lower bound);
    the bound does skip simulations (some results differ from the exact time)."""
    costs = CostModel(ClusterSpec.from_preset("v100-pcie-8x8"), dtype="fp16",
                      dp_overlap=overlap)  # type: ignore[arg-type]
    layout = Layout(dp=dp, pp=pp, micro_batches=pp, micro_batch_size=workload.batch_size,
                    zero_stage=zero)  # type: ignore[arg-type]
    plan = _plan(workload, layout, costs)
    scorer = SyncScorer(workload, layout, plan.stages, costs)
    syncs = [s for s in _syncs(workload, plan, zero) if s.buckets]
    exact = [scorer.rerouted_s(syncs[0], next(iter(s.strategies.values()))) for s in syncs]
    skipped = 0
    for s, t in zip(syncs, exact):
        strategy = next(iter(s.strategies.values()))
        for below in (0.5 * t, t, min(exact), 1.5 * t):
            got = scorer.rerouted_s(syncs[0], strategy, below=below)
            if t < below:
                assert got == t
            else:
                assert below <= got <= t
                skipped += got != t
    assert skipped
