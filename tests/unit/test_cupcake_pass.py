"""The ``cupcake-fusion`` pass on small workloads, scored end to end with ``evaluate``.

Expectations come from brute force: every contiguous partition of the stage's gradients is
written as buckets and predicted with the project's ``evaluate`` (not the pass's solver).
"""

from __future__ import annotations

import random

import pytest

from hetplan.algorithms.fusion_reference import all_partitions
from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.evaluate import evaluate
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan import ClusterRef, ModelRef, Plan
from hetplan.ir.plan_sections import (
    Bucket,
    CastSync,
    CompressedSync,
    GradientSync,
    Layout,
    NoSync,
    TensorSync,
    WorkloadSummary,
)
from hetplan.ir.workload import workload_from_gradients
from hetplan.passes import get_all_passes
from hetplan.passes.base import PassContext
from hetplan.passes.cupcake import CupcakeFusion
from hetplan.passes.ddp_buckets import DDPBuckets


def setup(n: int, seed: int, cluster: str = "v100-pcie-8x8", dp: int = 64):
    rng = random.Random(seed)
    ir = workload_from_gradients(
        f"toy{seed}", [f"m{i}.weight" for i in range(n)],
        [rng.choice([1, 2**10, 2**16, 2**20, 2**22]) * rng.randint(1, 3) for _ in range(n)],
        [rng.uniform(0, 3000) for _ in range(n)],
    )
    wl = WorkloadSummary.from_model_ir(ir)
    spec = ClusterSpec.from_preset(cluster)
    costs = CostModel(spec, None)
    layout = Layout(dp=dp, micro_batch_size=wl.batch_size, global_batch_size=dp * wl.batch_size)
    ctx = PassContext(workload=wl, cluster=spec, costs=costs, layout=layout)
    plan = Plan(model=ModelRef(name=ir.name, fingerprint=ir.fingerprint(),
                               num_params=ir.num_params),
                cluster=ClusterRef.from_cluster(spec, embed=False), layout=layout)
    return wl, ctx, plan


def predicted(wl, ctx, plan, sync):
    return evaluate(wl, ctx.layout, plan.stages, sync, ctx.costs,
                    check_memory=False).iteration_s


def as_sync(wl, groups, strategies, key):
    names = [g.name for g in wl.grads]
    buckets = tuple(Bucket(tensors=tuple(names[i : j + 1]),
                           size_bytes=sum(g.size_bytes for g in wl.grads[i : j + 1]),
                           strategy=key[names[i]]) for i, j in groups)
    return GradientSync(strategies=strategies, buckets=buckets)


def covered_in_order(wl, sync):
    return [t for b in sync.buckets for t in b.tensors] == [g.name for g in wl.grads]


def test_registered_under_its_name():
    assert get_all_passes()["cupcake-fusion"] is CupcakeFusion


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("cluster", ["v100-pcie-8x8", "v100-nvlink-8x8"])
def test_fp32_buckets_are_optimal_by_brute_force_with_evaluate(seed, cluster):
    wl, ctx, plan = setup(8, seed, cluster)
    out = CupcakeFusion().run(plan, ctx)
    strategies, key = {"fp32": NoSync()}, {g.name: "fp32" for g in wl.grads}
    best = min(predicted(wl, ctx, plan, as_sync(wl, p, strategies, key))
               for p in all_partitions(len(wl.grads)))
    got = out.plan.gradient_sync
    assert got is not None and covered_in_order(wl, got)
    assert predicted(wl, ctx, plan, got) == pytest.approx(best, rel=1e-9)
    assert any("exact DP" in n for n in out.notes)


def test_never_slower_than_ddp_buckets_and_falls_back():
    wl, ctx, plan = setup(12, 7)
    ddp = DDPBuckets().run(plan, ctx).plan
    out = CupcakeFusion().run(ddp, ctx)
    assert predicted(wl, ctx, ddp, out.plan.gradient_sync) <= predicted(
        wl, ctx, ddp, ddp.gradient_sync)
    # forced to layer-wise buckets (max_group=1), fusion loses to DDP's buckets: kept
    forced = CupcakeFusion(max_group=1).run(ddp, ctx)
    assert not forced.changed
    assert forced.plan.gradient_sync == ddp.gradient_sync
    assert any("kept the incoming" in n for n in forced.notes)


def test_only_tensors_sharing_a_strategy_are_fused_and_it_is_optimal():
    """Alternating runs of fp32 and fp16-cast tensors: buckets never mix strategies, and the
    result is the best of all partitions that respect the runs (brute force)."""
    wl, ctx, plan = setup(9, 3)
    names = [g.name for g in wl.grads]
    key = {n: ("fp16" if (i // 3) % 2 else "fp32") for i, n in enumerate(names)}
    strategies = {"fp32": NoSync(), "fp16": CastSync(dtype="fp16")}
    incoming = GradientSync(strategies=strategies,
                            tensors=tuple(TensorSync(name=n, strategy=key[n]) for n in names))
    plan = plan.model_copy(update={"gradient_sync": incoming})
    out = CupcakeFusion().run(plan, ctx)
    got = out.plan.gradient_sync
    assert covered_in_order(wl, got)
    for b in got.buckets:
        assert {key[t] for t in b.tensors} == {b.strategy}
    allowed = [p for p in all_partitions(9)
               if all(len({key[names[k]] for k in range(i, j + 1)}) == 1 for i, j in p)]
    best = min(predicted(wl, ctx, plan, as_sync(wl, p, strategies, key)) for p in allowed)
    assert predicted(wl, ctx, plan, got) == pytest.approx(best, rel=1e-9)
    assert got.tensors == incoming.tensors  # per-tensor strategies are kept


def test_compressed_strategy_uses_the_surrogate_and_is_not_slower():
    """GPU decompression after the allgather is not a tandem: the note says surrogate, the
    result is scored by the simulator and never slower than the unfused input."""
    wl, ctx, plan = setup(10, 5)
    names = [g.name for g in wl.grads]
    strategies = {"dgc": CompressedSync(compressor="dgc", params={"ratio": 0.01})}
    incoming = GradientSync(strategies=strategies,
                            tensors=tuple(TensorSync(name=n, strategy="dgc") for n in names))
    plan = plan.model_copy(update={"gradient_sync": incoming})
    out = CupcakeFusion().run(plan, ctx)
    assert any("surrogate" in n for n in out.notes)
    assert predicted(wl, ctx, plan, out.plan.gradient_sync) <= predicted(wl, ctx, plan,
                                                                         incoming)
    # with tiny tensors the compression's fixed cost dominates: fusion must help here
    assert out.changed and len(out.plan.gradient_sync.buckets) < len(names)


def test_deterministic_plan_json():
    wl, ctx, plan = setup(12, 11)
    a = CupcakeFusion().run(plan, ctx).plan.model_dump_json()
    b = CupcakeFusion().run(plan, ctx).plan.model_dump_json()
    assert a == b


def test_dp1_leaves_the_plan_alone():
    wl, ctx, plan = setup(4, 1, dp=1)
    out = CupcakeFusion().run(plan, ctx)
    assert not out.changed and out.plan == plan


def test_compile_runs_the_pass_and_is_never_slower_than_ddp():
    """``hetplan plan`` (compile with the default passes) includes cupcake-fusion, records
    the DDP baseline beside it, and the plan is never predicted slower than that baseline."""
    from pathlib import Path

    from hetplan.ir.workload import espresso_workloads
    from hetplan.optimizer.compile import DEFAULT_PASSES, compile

    # after the passes whose gradient sync it fuses (later passes own other sections)
    assert DEFAULT_PASSES.index("cupcake-fusion") > DEFAULT_PASSES.index("espresso") > \
        DEFAULT_PASSES.index("ddp-buckets")
    data = Path(__file__).resolve().parents[2] / "data" / "espresso_models.json"
    if not data.is_file():
        pytest.skip(f"benchmark file {data} not present on this machine")
    ir = espresso_workloads(data)["resnet50"]
    for cluster in ("v100-pcie-8x8", "v100-nvlink-8x8"):
        plan = compile(ir, cluster, batch_size=64, dp=64, pp=1, tp=1)
        assert "cupcake-fusion" in [e.name for e in plan.pass_log]
        base = {b.name: b.iteration_time_ms for b in plan.predictions.baselines}
        assert plan.predictions.iteration_time_ms <= base["ddp"] + 1e-9
        assert plan.predictions.iteration_time_ms <= base["layer-wise"] + 1e-9
