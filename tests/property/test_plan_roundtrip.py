"""Property: any valid Plan survives a JSON round trip unchanged, byte for byte."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

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
counts = st.integers(min_value=0, max_value=2**62)
times = st.floats(min_value=0, max_value=1e9, allow_nan=False, allow_infinity=False)
ratios = st.floats(min_value=0, max_value=1)
maybe_times = st.none() | times


@st.composite
def workloads(draw: st.DrawFn) -> WorkloadSummary:
    layer_names = draw(st.lists(names, min_size=1, max_size=6, unique=True))
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
def layouts(draw: st.DrawFn, world_size: int) -> Layout:
    dp, pp = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    tp = draw(st.integers(1, max(1, world_size // (dp * pp))))
    if dp * pp * tp > world_size:
        dp = pp = tp = 1
    schedule = draw(st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b"]))
    ranks = ()
    if draw(st.booleans()):
        coords = [(d, p, t) for d in range(dp) for p in range(pp) for t in range(tp)]
        ranks = tuple(RankPlacement(rank=r, node=r // 2, local_rank=r % 2, device=draw(ids),
                                    dp=d, pp=p, tp=t) for r, (d, p, t) in enumerate(coords))
    return Layout(dp=dp, pp=pp, tp=tp, micro_batches=draw(st.integers(1, 64)),
                  micro_batch_size=draw(st.integers(1, 32)),
                  global_batch_size=draw(st.none() | st.integers(1, 4096)), schedule=schedule,
                  virtual_stages=draw(st.integers(1, 3)) if schedule == "interleaved-1f1b" else 1,
                  ranks=ranks)


@st.composite
def stage_lists(draw: st.DrawFn, num_layers: int, world_size: int) -> tuple[Stage, ...]:
    cuts = []
    if num_layers > 1:
        cuts = sorted(draw(st.sets(st.integers(1, num_layers - 1), max_size=3)))
    bounds = [0, *cuts, num_layers]
    rank_ids = st.integers(0, world_size - 1)
    return tuple(Stage(index=i, first_layer=a, last_layer=b - 1,
                       ranks=tuple(draw(st.lists(rank_ids, min_size=1, max_size=2))),
                       fwd_ms=draw(times), bwd_ms=draw(times),
                       memory_bytes=draw(st.none() | counts))
                 for i, (a, b) in enumerate(zip(bounds, bounds[1:])))


@st.composite
def tensor_parallel(draw: st.DrawFn, world_size: int) -> TensorParallel:
    ranks = draw(st.lists(st.integers(0, world_size - 1), min_size=1, max_size=3, unique=True))
    shards = tuple(draw(st.integers(0, 512)) for _ in ranks)
    linear = TPLinearShard(name=draw(names), split=draw(st.sampled_from(["column", "row"])),
                           features=max(1, sum(shards)),
                           shard_sizes=shards if sum(shards) else (1, *shards[1:]))
    roles = tuple(TPRankRole(rank=r, role=draw(st.sampled_from(["normal", "resize",
                                                                 "migrate_src"])),
                             gamma=draw(ratios), beta=draw(ratios)) for r in ranks[:1])
    controller = ResizingController(variant=draw(st.sampled_from(["off", "zero", "semi"])),
                                    alpha=draw(ratios),
                                    gamma_max=draw(st.floats(0, 0.999)),  # 9-digit rounding
                                    theta_iter=draw(times), replan_trigger=draw(times))
    return TensorParallel(controller=controller,
                          groups=(TPGroup(ranks=tuple(ranks), linears=(linear,), roles=roles),))


param_values = st.booleans() | st.integers(-(2**40), 2**40) | times | ids
sync_strategies = st.one_of(
    st.builds(NoSync),
    st.builds(CastSync, dtype=st.sampled_from(["fp16", "bf16"])),
    st.builds(CompressedSync, compressor=ids,
              params=st.dictionaries(ids, param_values, max_size=3),
              compress_device=st.sampled_from(["gpu", "cpu"]),
              decompress_device=st.sampled_from(["gpu", "cpu"]),
              uncompressed_dtype=st.sampled_from(["fp32", "fp16", "bf16"]),
              error_feedback=st.booleans(),
              hierarchy=st.just("hierarchical"),
              steps=st.just((CommStep(level="intra", routine="reduce"),
                             CommStep(level="inter", routine="gather", compressed=True),
                             CommStep(level="intra", routine="broadcast")))),
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
    world_size = draw(st.integers(1, 8))
    workload = draw(workloads())
    n_layers = len(workload.layers)
    memory = st.lists(counts, max_size=world_size).map(tuple)
    baselines = st.lists(st.builds(Baseline, name=names, iteration_time_ms=times,
                                   breakdown=st.none() | breakdowns,
                                   memory_per_rank_bytes=memory),
                         max_size=3, unique_by=lambda b: b.name).map(tuple)
    return Plan(
        model=ModelRef(name=draw(names), fingerprint=draw(ids), num_params=draw(counts),
                       workload=draw(st.none() | st.just(workload))),
        cluster=ClusterRef(name=draw(names), fingerprint=draw(ids), world_size=world_size),
        layout=draw(st.none() | layouts(world_size)),
        stages=draw(st.just(()) | stage_lists(n_layers, world_size)),
        tensor_parallel=draw(st.none() | tensor_parallel(world_size)),
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
    again = Plan.from_json(text)
    assert again == plan
    assert again.to_json() == text
    assert text.endswith("\n")
