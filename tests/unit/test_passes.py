"""The baseline passes (uniform-stages, even-tp, ddp-buckets), their registry and the pass
manager, on hand-made workloads.

Expected partitions (stages, buckets, TP groups) are written out by hand in each test from
the rule the pass documents, never taken from the pass's own output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest

from hetplan.cost_models.costs import CostModel
from hetplan.errors import PassError, SpecError
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan import ClusterRef, ModelRef, Plan
from hetplan.ir.plan_sections import GradCost, LayerCost, Layout, NoSync, WorkloadSummary
from hetplan.passes import BASELINE_PASSES, get_all_passes
from hetplan.passes.base import PassContext, PassResult
from hetplan.passes.ddp_buckets import DDPBuckets
from hetplan.passes.even_tp import EvenTP
from hetplan.passes.manager import run_passes
from hetplan.passes.uniform_stages import UniformStages

MiB = 2**20


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------
def one_node(devices: int) -> ClusterSpec:
    return ClusterSpec.from_dict({
        "name": f"node-{devices}",
        "nodes": [{
            "name": "n",
            "devices": [{"type": "A100-80GB", "count": devices}],
            "cpu_cores": 8,
            "intra_link": {"kind": "nvlink", "bandwidth_gbps": 2400, "latency_us": 2},
        }],
    })


def workload(num_layers: int, grads: list[tuple[str, int, int]] | None = None,
             tp_pairs: int = 0) -> WorkloadSummary:
    """``num_layers`` layers ``L0..``; ``grads`` as (name, bytes, layer) in backward-ready
    order (default: one 4-byte gradient per layer, last layer first)."""
    if grads is None:
        grads = [(f"L{i}.w", 4, i) for i in reversed(range(num_layers))]
    per_layer = [0] * num_layers
    for _, size, layer in grads:
        per_layer[layer] += size
    return WorkloadSummary(
        layers=tuple(
            LayerCost(name=f"L{i}", param_bytes=per_layer[i], fwd_flops=1000, bwd_flops=2000,
                      act_out_bytes=64, tp_pairs=tp_pairs,
                      tp_split_bytes=per_layer[i] if tp_pairs else 0)
            for i in range(num_layers)
        ),
        grads=tuple(GradCost(name=n, size_bytes=s, layer_index=layer) for n, s, layer in grads),
    )


def context(wl: WorkloadSummary, layout: Layout, cluster: ClusterSpec | None = None
            ) -> PassContext:
    spec = cluster or one_node(layout.num_ranks)
    return PassContext(workload=wl, cluster=spec, costs=CostModel(spec), layout=layout)


def empty_plan(ctx: PassContext) -> Plan:
    return Plan(
        model=ModelRef(name="toy", fingerprint="f" * 16, num_params=1, workload=ctx.workload),
        cluster=ClusterRef.from_cluster(ctx.cluster),
        layout=ctx.layout,
    )


def bucket_names(plan: Plan) -> list[list[str]]:
    assert plan.gradient_sync is not None
    return [list(b.tensors) for b in plan.gradient_sync.buckets]


# --------------------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------------------
def test_registry_keys_are_pass_names() -> None:
    registry = get_all_passes()
    assert {"uniform-stages", "even-tp", "ddp-buckets", "dynpipe"} <= set(registry)
    for key, cls in registry.items():
        assert key == cls.name
        assert cls().name == key  # instances agree with their class
    # the baselines own different sections; an optimizing pass replaces a baseline's section
    sections = [s for n in BASELINE_PASSES for s in registry[n].sections]
    assert len(sections) == len(set(sections))
    assert {s for cls in registry.values() for s in cls.sections} == {
        "stages", "rebalancing", "tensor_parallel", "gradient_sync", "sparse_sync",
        "checkpointing",
        "group_sync",
    }


def test_baseline_passes_are_registered_in_pipeline_order() -> None:
    registry = get_all_passes()
    assert BASELINE_PASSES == ("uniform-stages", "even-tp", "ddp-buckets")
    assert all(name in registry for name in BASELINE_PASSES)


# --------------------------------------------------------------------------------------
# uniform-stages
# --------------------------------------------------------------------------------------
def test_uniform_stages_10_layers_4_stages() -> None:
    ctx = context(workload(10), Layout(dp=2, pp=4, tp=1))
    result = UniformStages().run(empty_plan(ctx), ctx)
    stages = result.plan.stages
    assert result.changed
    # 10 = 3 + 3 + 2 + 2: the first 10 mod 4 = 2 stages get the extra layer
    assert [(s.first_layer, s.last_layer) for s in stages] == [(0, 2), (3, 5), (6, 7), (8, 9)]
    assert [s.index for s in stages] == [0, 1, 2, 3]
    assert [list(s.layer_names) for s in stages] == [
        ["L0", "L1", "L2"], ["L3", "L4", "L5"], ["L6", "L7"], ["L8", "L9"]
    ]
    # ranks: tp innermost, then dp, pp outermost -> stage s holds ranks 2s, 2s+1
    assert [s.ranks for s in stages] == [(0, 1), (2, 3), (4, 5), (6, 7)]


@pytest.mark.parametrize(("layers", "pp"), [(1, 1), (7, 1), (7, 7), (8, 3), (13, 4), (5, 2)])
def test_uniform_stages_contiguous_and_covering(layers: int, pp: int) -> None:
    ctx = context(workload(layers), Layout(dp=1, pp=pp, tp=1))
    stages = UniformStages().run(empty_plan(ctx), ctx).plan.stages
    assert len(stages) == pp
    covered = [i for s in stages for i in range(s.first_layer, s.last_layer + 1)]
    assert covered == list(range(layers))  # contiguous, in order, no gap, no overlap
    sizes = [s.last_layer - s.first_layer + 1 for s in stages]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the larger stages come first
    ranks = sorted(r for s in stages for r in s.ranks)
    assert ranks == list(range(pp))


def test_uniform_stages_ranks_partition_the_world() -> None:
    layout = Layout(dp=2, pp=2, tp=2)
    ctx = context(workload(4, tp_pairs=1), layout)
    stages = UniformStages().run(empty_plan(ctx), ctx).plan.stages
    # (pp*dp + dp)*tp + tp: stage 0 = ranks 0..3, stage 1 = ranks 4..7
    assert [sorted(s.ranks) for s in stages] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_uniform_stages_more_stages_than_layers_names_the_pass() -> None:
    ctx = context(workload(2), Layout(dp=1, pp=4, tp=1))
    with pytest.raises(PassError, match="uniform-stages.*4 pipeline stages.*2 layers"):
        UniformStages().run(empty_plan(ctx), ctx)


# --------------------------------------------------------------------------------------
# ddp-buckets
# --------------------------------------------------------------------------------------
def test_ddp_buckets_follow_ddp_rule() -> None:
    sixth = int(0.6 * MiB)  # 0.6 MiB
    grads = [
        ("a", sixth, 7), ("b", sixth, 6), ("c", sixth, 5), ("d", sixth, 4),
        ("e", 30 * MiB, 3),
        ("f", 10 * MiB, 2), ("g", 10 * MiB, 1), ("h", 10 * MiB, 0),
    ]
    ctx = context(workload(8, grads), Layout(dp=2))
    plan = run_passes(empty_plan(ctx), [UniformStages(), DDPBuckets()], ctx)
    # by hand, PyTorch's rule (add the tensor, close once the size reaches the limit):
    #   first bucket, limit 1 MiB: a (0.6), +b = 1.2 >= 1 -> close [a, b]
    #   limit 25 MiB from now on: c, d (1.2), +e = 31.2 >= 25 -> close [c, d, e]
    #   f, g (20), +h = 30 >= 25 -> close [f, g, h]
    assert bucket_names(plan) == [["a", "b"], ["c", "d", "e"], ["f", "g", "h"]]
    gs = plan.gradient_sync
    assert gs is not None
    assert [b.size_bytes for b in gs.buckets] == [
        2 * sixth, 2 * sixth + 30 * MiB, 30 * MiB
    ]
    # every bucket is one flat fp32 allreduce
    assert all(b.strategy == "fp32" for b in gs.buckets)
    assert gs.strategies == {"fp32": NoSync()}
    strat = gs.strategies["fp32"]
    assert strat.hierarchy == "flat"
    assert [(s.level, s.routine, s.compressed) for s in strat.steps] == [
        ("flat", "allreduce", False)
    ]
    # every gradient in exactly one bucket
    assert sorted(t for b in gs.buckets for t in b.tensors) == sorted(g[0] for g in grads)


def test_ddp_buckets_caps_are_inclusive() -> None:
    # a bucket closes when it reaches the limit: exactly 1 MiB (first) or 25 MiB (later)
    grads = [("a", MiB // 2, 4), ("b", MiB // 2, 3), ("c", 10 * MiB, 2), ("d", 15 * MiB, 1),
             ("e", 1, 0)]
    ctx = context(workload(5, grads), Layout(dp=2))
    plan = run_passes(empty_plan(ctx), [UniformStages(), DDPBuckets()], ctx)
    assert bucket_names(plan) == [["a", "b"], ["c", "d"], ["e"]]


def test_ddp_buckets_large_first_tensor_alone() -> None:
    # a first tensor above the 1 MiB first-bucket cap gets a bucket of its own
    grads = [("big", 2 * MiB, 2), ("x", 100, 1), ("y", 100, 0)]
    ctx = context(workload(3, grads), Layout(dp=2))
    plan = run_passes(empty_plan(ctx), [UniformStages(), DDPBuckets()], ctx)
    assert bucket_names(plan) == [["big"], ["x", "y"]]


def test_ddp_buckets_custom_caps() -> None:
    grads = [(f"t{i}", MiB, 5 - i) for i in range(6)]
    ctx = context(workload(6, grads), Layout(dp=2))
    plan = run_passes(empty_plan(ctx), [UniformStages(),
                                        DDPBuckets(bucket_cap_mb=2, first_bucket_mb=3)], ctx)
    # first bucket at most 3 MiB: t0 t1 t2; then at most 2 MiB: t3 t4, t5
    assert bucket_names(plan) == [["t0", "t1", "t2"], ["t3", "t4"], ["t5"]]


def test_ddp_buckets_never_mix_stages_and_restart_per_stage() -> None:
    sixth = int(0.6 * MiB)
    # 6 layers in 2 stages (0-2, 3-5); backward-ready order: stage 1 first, then stage 0
    grads = [("a", sixth, 5), ("b", sixth, 4), ("c", sixth, 3),
             ("d", sixth, 2), ("e", sixth, 1), ("f", sixth, 0)]
    ctx = context(workload(6, grads), Layout(dp=1, pp=2))
    plan = run_passes(empty_plan(ctx), [UniformStages(), DDPBuckets()], ctx)
    stage_of = {g[0]: (0 if g[2] <= 2 else 1) for g in grads}
    buckets = bucket_names(plan)
    for b in buckets:
        assert len({stage_of[t] for t in b}) == 1, f"bucket {b} mixes stages"
    # each stage has its own first bucket (closes on reaching 1 MiB: 0.6 + 0.6), then 25 MiB
    per_stage = {s: [b for b in buckets if stage_of[b[0]] == s] for s in (0, 1)}
    assert per_stage[1] == [["a", "b"], ["c"]]
    assert per_stage[0] == [["d", "e"], ["f"]]


def test_ddp_buckets_interleaved_stages_still_separate() -> None:
    # gradients of two stages alternating in ready order (tied weights, odd captures):
    # each stage keeps its own open bucket
    grads = [("s1a", 100, 3), ("s0a", 100, 0), ("s1b", 100, 2), ("s0b", 100, 1)]
    ctx = context(workload(4, grads), Layout(dp=1, pp=2))
    plan = run_passes(empty_plan(ctx), [UniformStages(), DDPBuckets()], ctx)
    assert sorted(bucket_names(plan)) == [["s0a", "s0b"], ["s1a", "s1b"]]


def test_ddp_buckets_without_stages_is_one_stage() -> None:
    grads = [("x", 100, 1), ("y", 100, 0)]
    ctx = context(workload(2, grads), Layout(dp=2))
    result = DDPBuckets().run(empty_plan(ctx), ctx)  # no uniform-stages before it
    assert bucket_names(result.plan) == [["x", "y"]]
    assert result.changed


# --------------------------------------------------------------------------------------
# even-tp
# --------------------------------------------------------------------------------------
def test_even_tp_tp1_leaves_section_empty() -> None:
    ctx = context(workload(4), Layout(dp=2, pp=2, tp=1))
    result = EvenTP().run(empty_plan(ctx), ctx)
    assert result.plan.tensor_parallel is None
    assert not result.changed


def test_even_tp_tp2_groups() -> None:
    ctx = context(workload(4, tp_pairs=1), Layout(dp=2, pp=2, tp=2))
    plan = run_passes(empty_plan(ctx), [UniformStages(), EvenTP()], ctx)
    tp = plan.tensor_parallel
    assert tp is not None
    groups = tp.groups
    assert len(groups) == 2 * 2  # dp * pp
    assert all(len(g.ranks) == 2 for g in groups)
    # tp innermost: groups are pairs of neighbouring ranks
    assert sorted(tuple(sorted(g.ranks)) for g in groups) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    # disjoint and covering the world
    assert sorted(r for g in groups for r in g.ranks) == list(range(8))
    # every group lies inside the stage it names
    for g in groups:
        assert g.stage is not None
        assert set(g.ranks) <= set(plan.stages[g.stage].ranks)
    assert {g.stage for g in groups} == {0, 1}
    assert all(g.linears == () for g in groups)  # even split of every linear


def test_even_tp_tp2_dp_only() -> None:
    ctx = context(workload(2, tp_pairs=1), Layout(dp=3, pp=1, tp=2))
    tp = EvenTP().run(empty_plan(ctx), ctx).plan.tensor_parallel
    assert tp is not None
    assert [tuple(g.ranks) for g in tp.groups] == [(0, 1), (2, 3), (4, 5)]


# --------------------------------------------------------------------------------------
# pass manager
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Exploding:
    name: ClassVar[str] = "exploding-pass"
    sections: ClassVar[tuple[str, ...]] = ("stages",)
    refines: ClassVar[bool] = False

    def run(self, plan: Plan, ctx: PassContext) -> PassResult:
        raise RuntimeError("kaboom")


@dataclass(frozen=True)
class BadSpec:
    name: ClassVar[str] = "bad-spec-pass"
    sections: ClassVar[tuple[str, ...]] = ("stages",)
    refines: ClassVar[bool] = False

    def run(self, plan: Plan, ctx: PassContext) -> PassResult:
        raise SpecError("the spec is wrong")


@dataclass(frozen=True)
class InvalidPlan:
    """Returns a plan whose stage does not start at layer 0 (fails re-validation)."""

    name: ClassVar[str] = "invalid-plan-pass"
    sections: ClassVar[tuple[str, ...]] = ("stages",)
    refines: ClassVar[bool] = False

    def run(self, plan: Plan, ctx: PassContext) -> PassResult:
        from hetplan.ir.plan_sections import Stage

        bad = plan.model_copy(update={"stages": (
            Stage(index=0, first_layer=1, last_layer=1, ranks=(0,)),
        )})
        return PassResult(bad, True)


def test_manager_names_failing_pass() -> None:
    ctx = context(workload(4), Layout(dp=2))
    with pytest.raises(PassError) as info:
        run_passes(empty_plan(ctx), [UniformStages(), Exploding(), DDPBuckets()], ctx)
    msg = str(info.value)
    assert "exploding-pass" in msg
    assert "uniform-stages" in msg  # the passes that ran before it
    assert "RuntimeError" in msg and "kaboom" in msg
    assert isinstance(info.value.__cause__, RuntimeError)


def test_manager_names_pass_on_hetplan_error() -> None:
    ctx = context(workload(4), Layout(dp=2))
    with pytest.raises(SpecError, match="bad-spec-pass") as info:
        run_passes(empty_plan(ctx), [UniformStages(), BadSpec()], ctx)
    assert "the spec is wrong" in str(info.value)


def test_manager_names_pass_that_leaves_invalid_plan() -> None:
    ctx = context(workload(4), Layout(dp=1))
    with pytest.raises(PassError, match="invalid-plan-pass"):
        run_passes(empty_plan(ctx), [InvalidPlan()], ctx)


def test_manager_names_the_invalid_pass_when_a_later_pass_raises() -> None:
    # the later pass runs on the invalid plan (the plan is validated once, at the end); its
    # error is reported as the invalid plan the earlier pass left, as a check after every
    # pass would have
    ctx = context(workload(4), Layout(dp=1))
    with pytest.raises(PassError, match="invalid-plan-pass") as info:
        run_passes(empty_plan(ctx), [InvalidPlan(), Exploding()], ctx)
    assert "kaboom" not in str(info.value)
    with pytest.raises(PassError, match="(?s)invalid-plan-pass.*first_layer: 1"):
        run_passes(empty_plan(ctx), [InvalidPlan(), LeavesPlan(), BadSpec()], ctx)


def test_manager_pass_error_names_pass_once() -> None:
    ctx = context(workload(2), Layout(dp=1, pp=4))
    with pytest.raises(PassError, match="uniform-stages"):
        run_passes(empty_plan(ctx), [UniformStages()], ctx)


def test_manager_logs_every_pass_in_order() -> None:
    ctx = context(workload(4, tp_pairs=1), Layout(dp=2, pp=2, tp=2))
    registry = get_all_passes()
    passes = [registry[n]() for n in ("uniform-stages", "even-tp", "ddp-buckets")]
    plan = run_passes(empty_plan(ctx), passes, ctx)
    assert [e.name for e in plan.pass_log] == ["uniform-stages", "even-tp", "ddp-buckets"]
    assert all(e.changed for e in plan.pass_log)
    assert plan.stages and plan.tensor_parallel is not None and plan.gradient_sync is not None


# -- re-validation of the sections a pass changed, and of a plan handed in unvalidated --------
def _unvalidated_stage(num_layers: int) -> object:
    """A stage pydantic would refuse (an unknown recompute mode), built without validation."""
    from hetplan.ir.plan_sections import Stage

    return Stage.model_construct(index=0, first_layer=0, last_layer=num_layers - 1,
                                 layer_names=(), ranks=(0,), fwd_ms=0.0, bwd_ms=0.0,
                                 memory_bytes=None, recompute="sometimes")


@dataclass(frozen=True)
class SmugglesStage:
    """Writes a stage that skipped validation into a plan that passed it."""

    name: ClassVar[str] = "smuggles-stage-pass"
    sections: ClassVar[tuple[str, ...]] = ("stages",)
    refines: ClassVar[bool] = False

    def run(self, plan: Plan, ctx: PassContext) -> PassResult:
        stage = _unvalidated_stage(len(ctx.workload.layers))
        return PassResult(plan.model_copy(update={"stages": (stage,)}), True)


@dataclass(frozen=True)
class LeavesPlan:
    """Changes nothing."""

    name: ClassVar[str] = "leaves-plan-pass"
    sections: ClassVar[tuple[str, ...]] = ("gradient_sync",)
    refines: ClassVar[bool] = False

    def run(self, plan: Plan, ctx: PassContext) -> PassResult:
        return PassResult(plan, False)


def test_manager_revalidates_a_section_a_later_pass_changed() -> None:
    # the plan was validated after uniform-stages; the next pass's new section is validated
    # from its dump, not trusted as an object
    ctx = context(workload(4), Layout(dp=1))
    with pytest.raises(PassError, match="(?s)smuggles-stage-pass.*sometimes"):
        run_passes(empty_plan(ctx), [UniformStages(), SmugglesStage()], ctx)


def test_manager_validates_a_plan_handed_in_unvalidated_whole() -> None:
    # the incoming plan never went through this loop's validation: the first re-validation
    # covers every section, even those the first pass leaves alone
    ctx = context(workload(4), Layout(dp=1))
    bad = empty_plan(ctx).model_copy(update={"stages": (_unvalidated_stage(4),)})
    with pytest.raises(PassError, match="(?s)leaves-plan-pass.*sometimes"):
        run_passes(bad, [LeavesPlan()], ctx)


def test_manager_result_equals_whole_revalidation() -> None:
    ctx = context(workload(4, tp_pairs=1), Layout(dp=2, pp=2, tp=2))
    registry = get_all_passes()
    passes = [registry[n]() for n in ("uniform-stages", "even-tp", "ddp-buckets")]
    plan = run_passes(empty_plan(ctx), passes, ctx)
    assert plan == Plan.model_validate(plan.model_dump())
    assert plan.to_json() == Plan.model_validate(plan.model_dump()).to_json()
