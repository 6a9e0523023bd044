"""Property: any valid Plan survives a JSON round trip unchanged, byte for byte.

The generated plans are consistent across sections (the plan validator,
:mod:`hetplan.ir.plan_checks`, refuses any other): the layout uses every rank of the cluster,
stage ``s`` runs on the ranks of pipeline coordinate ``s mod pp``, TP groups are TP groups of
the layout, gradient sync names the workload's gradients, compressors take their own
parameters.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hetplan.ir.fields import MAX_COUNT
from hetplan.ir.plan import (
    Baseline,
    Bucket,
    CastSync,
    ClusterRef,
    CommStep,
    CompressedSync,
    CostSource,
    GradCost,
    GradientSync,
    LayerCost,
    Layout,
    ModelRef,
    NoSync,
    PassLogEntry,
    Plan,
    Predictions,
    RankPlacement,
    ResizingController,
    Stage,
    TensorParallel,
    TensorSync,
    TimeBreakdown,
    TPGroup,
    TPLinearShard,
    TPRankRole,
    WorkloadSummary,
)

names = st.text(st.characters(codec="utf-8", categories=["L", "N", "P", "S", "Zs"]),
                min_size=1, max_size=12)
ids = st.text("abcdefghijklmnopqrstuvwxyz0123456789-._", min_size=1, max_size=10)
counts = st.integers(min_value=0, max_value=MAX_COUNT)
times = st.floats(min_value=0, max_value=1e9, allow_nan=False, allow_infinity=False)
ratios = st.floats(min_value=0, max_value=1)
maybe_times = st.none() | times


@st.composite
def layouts(draw: st.DrawFn) -> Layout:
    dp, pp, tp = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 2))
    schedule = draw(st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b"]))
    virtual = draw(st.integers(2, 3)) if schedule == "interleaved-1f1b" else 1
    micro_batches = draw(st.integers(pp, 64))
    if schedule == "interleaved-1f1b":  # Megatron's interleaving walks groups of pp
        micro_batches -= micro_batches % pp
    micro_batch_size = draw(st.integers(1, 32))
    lay = Layout(dp=dp, pp=pp, tp=tp, micro_batches=micro_batches,
                 micro_batch_size=micro_batch_size, schedule=schedule, virtual_stages=virtual,
                 global_batch_size=draw(st.sampled_from([None, dp * micro_batch_size
                                                         * micro_batches])))
    if draw(st.booleans()):
        ranks = tuple(RankPlacement(rank=r, node=r // 2, local_rank=r % 2, device=draw(ids),
                                    dp=d, pp=p, tp=t)
                      for r in range(lay.num_ranks) for d, p, t in [lay.coords(r)])
        lay = lay.model_copy(update={"ranks": ranks})
    return lay


@st.composite
def workloads(draw: st.DrawFn, min_layers: int) -> WorkloadSummary:
    layer_names = draw(st.lists(names, min_size=min_layers, max_size=min_layers + 4,
                                unique=True))
    layers = [LayerCost(name=n, fwd_flops=draw(counts), bwd_flops=draw(counts),
                        param_bytes=draw(counts), act_out_bytes=draw(counts),
                        measured_bwd_us=draw(maybe_times)) for n in layer_names]
    grad_names = draw(st.lists(names, max_size=6, unique=True))
    grads = [GradCost(name=n, size_bytes=draw(counts), dtype=draw(st.sampled_from(
        ["float32", "bfloat16"])), layer_index=draw(st.integers(0, len(layers) - 1)),
                      ready_gap_us=draw(maybe_times)) for n in grad_names]
    return WorkloadSummary(layers=tuple(layers), grads=tuple(grads),
                           unattributed_fwd_flops=draw(counts))


@st.composite
def stage_lists(draw: st.DrawFn, num_layers: int, lay: Layout) -> tuple[Stage, ...]:
    n = lay.pp * lay.virtual_stages
    cuts = sorted(draw(st.sets(st.integers(1, num_layers - 1), min_size=n - 1,
                               max_size=n - 1))) if n > 1 else []
    bounds = [0, *cuts, num_layers]
    return tuple(Stage(index=i, first_layer=a, last_layer=b - 1,
                       ranks=tuple(lay.rank_of(d, i % lay.pp, t)
                                   for d in range(lay.dp) for t in range(lay.tp)),
                       fwd_ms=draw(times), bwd_ms=draw(times),
                       memory_bytes=draw(st.none() | counts))
                 for i, (a, b) in enumerate(zip(bounds, bounds[1:])))


@st.composite
def tensor_parallel(draw: st.DrawFn, lay: Layout, with_stages: bool,
                    modules: list[str]) -> TensorParallel:
    """A TP section whose linear is one of ``modules`` (the workload's layers) and whose
    role prunes at most the controller's gamma_max (the plan validator's rule 5)."""
    d, p = draw(st.integers(0, lay.dp - 1)), draw(st.integers(0, lay.pp - 1))
    ranks = [lay.rank_of(d, p, t) for t in range(lay.tp)]
    shards = tuple(draw(st.integers(0, 512)) for _ in ranks)
    linear = TPLinearShard(name=draw(st.sampled_from(modules)),
                           split=draw(st.sampled_from(["column", "row"])),
                           features=max(1, sum(shards)),
                           shard_sizes=shards if sum(shards) else (1, *shards[1:]))
    controller = ResizingController(variant=draw(st.sampled_from(["off", "zero", "semi"])),
                                    alpha=draw(ratios),
                                    gamma_max=draw(st.floats(0, 0.999)),  # 9-digit rounding
                                    theta_iter=draw(times), replan_trigger=draw(times))
    roles = tuple(TPRankRole(rank=r, role=draw(st.sampled_from(["normal", "resize",
                                                                 "migrate_src"])),
                             gamma=draw(st.floats(0, controller.gamma_max)), beta=draw(ratios))
                  for r in ranks[:1])
    group = TPGroup(ranks=tuple(ranks), linears=(linear,), roles=roles,
                    stage=p if with_stages else None)
    return TensorParallel(controller=controller, groups=(group,))


sparsifier_params = st.fixed_dictionaries(
    {}, optional={"ratio": st.floats(min_value=1e-6, max_value=1.0)})
sync_strategies = st.one_of(
    st.builds(NoSync),
    st.builds(CastSync, dtype=st.sampled_from(["fp16", "bf16"])),
    st.builds(CompressedSync, compressor=st.sampled_from(["topk", "randomk", "dgc"]),
              params=sparsifier_params,
              compress_device=st.sampled_from(["gpu", "cpu"]),
              decompress_device=st.sampled_from(["gpu", "cpu"]),
              uncompressed_dtype=st.sampled_from(["fp32", "fp16", "bf16"]),
              error_feedback=st.booleans(),
              hierarchy=st.just("hierarchical"),
              steps=st.just((CommStep(level="intra", routine="reduce"),
                             CommStep(level="inter", routine="gather", compressed=True),
                             CommStep(level="inter", routine="broadcast", compressed=True),
                             CommStep(level="intra", routine="broadcast")))),
    st.builds(CompressedSync, compressor=st.just("qsgd"),
              params=st.fixed_dictionaries({}, optional={"levels": st.integers(1, 127)})),
)


@st.composite
def gradient_syncs(draw: st.DrawFn, grad_names: list[str]) -> GradientSync:
    strategies = draw(st.dictionaries(ids, sync_strategies, min_size=1, max_size=3))
    keys = sorted(strategies)
    per_tensor = [TensorSync(name=n, strategy=draw(st.sampled_from(keys))) for n in grad_names]
    buckets = tuple(Bucket(tensors=(t.name,), size_bytes=draw(counts), strategy=t.strategy)
                    for t in per_tensor)
    return GradientSync(strategies=strategies, tensors=tuple(per_tensor), buckets=buckets)


breakdowns = st.builds(TimeBreakdown, compute_ms=times, comm_ms=times, exposed_comm_ms=times,
                       bubble_ms=times, compression_ms=times)


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    lay = draw(layouts())
    world_size = lay.num_ranks
    workload = draw(workloads(lay.pp * lay.virtual_stages))
    stages = draw(stage_lists(len(workload.layers), lay))
    memory = st.lists(counts, max_size=world_size).map(tuple)
    baselines = st.lists(st.builds(Baseline, name=names, iteration_time_ms=times,
                                   breakdown=st.none() | breakdowns,
                                   memory_per_rank_bytes=memory),
                         max_size=3, unique_by=lambda b: b.name).map(tuple)
    return Plan(
        model=ModelRef(name=draw(names), fingerprint=draw(ids), num_params=draw(counts),
                       workload=workload),
        cluster=ClusterRef(name=draw(names), fingerprint=draw(ids), world_size=world_size),
        layout=lay,
        stages=stages,
        tensor_parallel=draw(st.none() | tensor_parallel(
            lay, with_stages=True, modules=[layer.name for layer in workload.layers])),
        gradient_sync=draw(st.none() | gradient_syncs([g.name for g in workload.grads])),
        predictions=draw(st.none() | st.builds(
            Predictions, iteration_time_ms=times, breakdown=breakdowns,
            memory_per_rank_bytes=memory, bubble_ratio=ratios, baselines=baselines)),
        provenance=draw(st.dictionaries(ids, st.builds(
            CostSource, source=st.sampled_from(["profiled", "analytic"]), detail=names),
            max_size=3)),
        pass_log=tuple(draw(st.lists(st.builds(PassLogEntry, name=ids, changed=st.booleans(),
                                               duration_ms=maybe_times,
                                               notes=st.lists(names, max_size=2).map(tuple)),
                                     max_size=4))),
    )


@settings(max_examples=150, deadline=None)
@given(plans())
def test_plan_json_round_trip_is_unchanged(plan: Plan) -> None:
    text = plan.to_json()
    again = Plan.from_json(text, complete=True)
    assert again == plan
    assert again.to_json() == text
    assert text.endswith("\n")
