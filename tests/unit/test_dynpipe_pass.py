"""The ``dynpipe`` pass: balanced stages on heterogeneous devices (expected split derived by
hand), never slower than the uniform-stages baseline (checked with the simulator on random
workloads), bubble predictions, the re-balancing section for a dynamic model, determinism,
and the dynamics file's errors."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.evaluate import evaluate
from hetplan.errors import SpecError
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan import ClusterRef, ModelRef, Plan
from hetplan.ir.plan_sections import GradCost, LayerCost, Layout, WorkloadSummary
from hetplan.ir.rebalancing import DynamicsSpec
from hetplan.passes.base import PassContext
from hetplan.passes.ddp_buckets import DDPBuckets
from hetplan.passes.dynpipe import DynPipe
from hetplan.passes.manager import run_passes
from hetplan.passes.uniform_stages import UniformStages

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pruning.yaml"


def fast_and_slow(slowdown: float = 2.0) -> ClusterSpec:
    node = {"devices": [{"type": "A100-80GB", "count": 1}], "cpu_cores": 8,
            "intra_link": {"kind": "nvlink", "bandwidth_gbps": 2400, "latency_us": 2}}
    return ClusterSpec.from_dict({
        "name": "fast-slow",
        "nodes": [dict(node, name="fast"), dict(node, name="slow", slowdown=slowdown)],
        "inter_node": {"kind": "infiniband", "bandwidth_gbps": 100000, "latency_us": 1},
    })


def workload(flops: list[int], kinds: list[str] | None = None) -> WorkloadSummary:
    kinds = kinds or ["block"] * len(flops)
    return WorkloadSummary(
        layers=tuple(LayerCost(name=f"L{i}", kind=k, fwd_flops=f, bwd_flops=2 * f,
                               param_bytes=4096, act_out_bytes=64, act_saved_bytes=64)
                     for i, (f, k) in enumerate(zip(flops, kinds))),
        grads=tuple(GradCost(name=f"L{i}.w", size_bytes=4096, layer_index=i)
                    for i in reversed(range(len(flops)))),
    )


def ctx_for(wl: WorkloadSummary, spec: ClusterSpec, layout: Layout) -> PassContext:
    return PassContext(workload=wl, cluster=spec, costs=CostModel(spec), layout=layout)


def plan_for(ctx: PassContext) -> Plan:
    return Plan(model=ModelRef(name="toy", fingerprint="f" * 16, num_params=1,
                               workload=ctx.workload),
                cluster=ClusterRef.from_cluster(ctx.cluster), layout=ctx.layout)


def iteration_s(ctx: PassContext, passes: list) -> float:
    plan = run_passes(plan_for(ctx), passes, ctx)
    return evaluate(ctx.workload, ctx.layout, plan.stages, plan.gradient_sync,
                    ctx.costs).iteration_s


def test_twice_as_fast_device_gets_twice_the_layers() -> None:
    # 12 identical compute-bound layers; device 1 runs 2x slower: 8 + 4 layers equalize the
    # stage times (8t = 4 * 2t).
    ctx = ctx_for(workload([10**12] * 12), fast_and_slow(2.0),
                  Layout(pp=2, micro_batches=8))
    plan = DynPipe().run(plan_for(ctx), ctx).plan
    assert [(s.first_layer, s.last_layer) for s in plan.stages] == [(0, 7), (8, 11)]
    assert plan.stages[1].ranks == (1,)


def test_never_predicted_slower_than_uniform_stages() -> None:
    rng = random.Random(3)
    spec = fast_and_slow(3.0)
    for _ in range(12):
        n = rng.randint(2, 14)
        wl = workload([rng.randint(1, 50) * 10**10 for _ in range(n)])
        ctx = ctx_for(wl, spec, Layout(pp=2, micro_batches=rng.choice([1, 2, 8])))
        ours = iteration_s(ctx, [DynPipe(), DDPBuckets()])
        base = iteration_s(ctx, [UniformStages(), DDPBuckets()])
        assert ours <= base * (1 + 1e-12)


def test_bubble_predictions_separate_imbalance() -> None:
    from hetplan.cost_models.bubble import bubble_ratios

    wl = workload([10**12] * 8)
    lay = Layout(pp=2, micro_batches=4)
    # uniform split on a 2x slow device: unbalanced, so the simulated bubble exceeds the
    # balanced-stage bubble of the same schedule
    ctx = ctx_for(wl, fast_and_slow(2.0), lay)
    plan = run_passes(plan_for(ctx), [UniformStages()], ctx)
    ev = evaluate(wl, lay, plan.stages, None, ctx.costs)
    balanced, eq1 = bubble_ratios(ev, lay)
    assert ev.bubble_ratio > balanced + 0.05
    # equal devices and an even split: the plan's bubble is the balanced one,
    # 1F1B (P-1)/(M+P-1) = 1/5 with negligible transfers
    ctx = ctx_for(wl, fast_and_slow(1.0), lay)
    plan = run_passes(plan_for(ctx), [UniformStages()], ctx)
    ev = evaluate(wl, lay, plan.stages, None, ctx.costs)
    balanced, eq1 = bubble_ratios(ev, lay)
    assert ev.bubble_ratio == pytest.approx(balanced, abs=1e-3)
    assert balanced == pytest.approx(0.2, abs=1e-3)
    assert eq1 == pytest.approx(0.0)  # Eq. (1) at P = 2 with T_C = 0 is 0 (digest 6.1)


def dynamic_plan(spec: DynamicsSpec) -> Plan:
    # embedding-like and head-like dense layers around 14 prunable blocks; the head costs
    # as much as 4 blocks, so pruning the blocks shifts the balance towards the last stage
    flops = [10**9] + [10**12] * 14 + [4 * 10**12]
    kinds = ["embedding"] + ["block"] * 14 + ["head"]
    ctx = ctx_for(workload(flops, kinds), fast_and_slow(1.0), Layout(pp=2, micro_batches=8))
    return DynPipe(dynamics=spec).run(plan_for(ctx), ctx).plan


def test_dynamics_plan_events_and_moves() -> None:
    spec = DynamicsSpec.load(EXAMPLE)
    plan = dynamic_plan(spec)
    reb = plan.rebalancing
    assert reb is not None and reb.total_iterations == 10000
    assert [e.iteration for e in reb.events] == [4000, 5000, 6000, 7000]
    assert any(e.applied for e in reb.events)
    current = [(s.first_layer, s.last_layer) for s in plan.stages]
    for e in reb.events:
        stage_old = [s for s, (i, j) in enumerate(current) for _ in range(i, j + 1)]
        stage_new = [s for s, (i, j) in enumerate(e.stages) for _ in range(i, j + 1)]
        moved = [k for k in range(len(stage_old)) if stage_old[k] != stage_new[k]]
        assert [m.layer for m in e.migrations] == moved
        assert e.bytes_moved == pytest.approx(sum(m.bytes for m in e.migrations))
        if e.applied:
            assert e.predicted_after_ms <= e.predicted_before_ms
            current = list(e.stages)
    # blocks got faster, the dense head did not: the last stage holds fewer blocks at the end
    first = plan.stages[1].last_layer - plan.stages[1].first_layer
    assert current[1][1] - current[1][0] < first
    assert reb.speedup_vs_static > 1.0


def test_dynamic_plan_is_deterministic() -> None:
    spec = DynamicsSpec.load(EXAMPLE)
    a, b = dynamic_plan(spec), dynamic_plan(spec)
    assert a.to_json() == b.to_json()


def test_dynamics_file_errors(tmp_path: Path) -> None:
    bad = tmp_path / "d.yaml"
    bad.write_text("total_iterations: 100\npruning: {final_sparsity: 0.9, frequncy: 10, "
                   "steps: 2}\n")
    with pytest.raises(SpecError, match="did you mean 'frequency'"):
        DynamicsSpec.load(bad)
    bad.write_text("total_iterations: 100\npruning: {final_sparsity: 0.9, frequency: 50, "
                   "steps: 2}\n")
    with pytest.raises(SpecError, match="not before total_iterations"):
        DynamicsSpec.load(bad)
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(SpecError, match="must be a mapping"):
        DynamicsSpec.load(bad)
    bad.write_text("total_iterations: [\n")
    with pytest.raises(SpecError, match="d.yaml"):
        DynamicsSpec.load(bad)
    with pytest.raises(SpecError, match="missing.yaml"):
        DynamicsSpec.load(tmp_path / "missing.yaml")


def test_sparse_from_start_kernel_in_the_dynamics_file(tmp_path: Path) -> None:
    """``kernel: sparse-from-start`` (the paper's code: blocks on the sparse kernel from
    iteration 0) is accepted and reaches the replay. Both kernels price a pruned block
    alike, so the events are the same; before the first pruning step, where the run and
    the static pipeline share one partition, the blocks run the sparse kernel at 0 %
    (slower than dense): a longer shared part, ``(D + S) / (D + S')`` with a larger ``D``,
    so a smaller predicted speedup over the static pipeline."""
    text = EXAMPLE.read_text()
    assert "kernel: sparse " in text
    path = tmp_path / "d.yaml"
    path.write_text(text.replace("kernel: sparse ", "kernel: sparse-from-start "))
    csr = DynamicsSpec.load(path)
    assert csr.pruning is not None and csr.pruning.kernel == "sparse-from-start"
    late = dynamic_plan(DynamicsSpec.load(EXAMPLE)).rebalancing
    early = dynamic_plan(csr).rebalancing
    assert late is not None and early is not None
    assert [e.stages for e in early.events] == [e.stages for e in late.events]
    assert any(e.applied for e in late.events)
    assert 1.0 < early.speedup_vs_static < late.speedup_vs_static
    path.write_text(text.replace("kernel: sparse ", "kernel: csr "))
    with pytest.raises(SpecError, match="kernel"):
        DynamicsSpec.load(path)


def test_compile_records_bubbles_baseline_and_dynamics() -> None:
    from hetplan.optimizer.compile import compile as compile_plan

    plan = compile_plan("tiny-gpt2", "mixed-generations", batch_size=64, pp=4, tp=1,
                        passes=("dynpipe", "even-tp", "ddp-buckets"), dynamics=EXAMPLE)
    pred = plan.predictions
    assert pred is not None
    assert pred.bubble_ratio_balanced is not None and pred.bubble_ratio_eq1 is not None
    assert pred.bubble_ratio >= pred.bubble_ratio_balanced - 1e-9
    base = next(b for b in pred.baselines if b.name == "baseline-passes")
    assert pred.iteration_time_ms <= base.iteration_time_ms * (1 + 1e-9)
    assert plan.rebalancing is not None
    assert [e.iteration for e in plan.rebalancing.events] == [4000, 5000, 6000, 7000]


def test_planned_event_refuses_stages_that_are_not_contiguous() -> None:
    import pydantic

    from hetplan.ir.rebalancing import PlannedEvent

    PlannedEvent(iteration=5, stages=((0, 3), (4, 6)))
    for stages, where in ((((0, 3), (5, 6)), "stage 1 covers layers 5..6"),
                          (((1, 3),), "stage 0 covers layers 1..3"),
                          (((0, 3), (4, 2)), "stage 1 covers layers 4..2")):
        with pytest.raises(pydantic.ValidationError, match=f"event at iteration 5: {where}"):
            PlannedEvent(iteration=5, stages=stages)
