"""``evaluate`` against iteration times worked out by hand.

The cluster is one node with two devices of a made-up type (10 TFLOP/s fp32, 1000 GB/s,
16 GiB) on an 80 Gbit/s (= 1e10 B/s) link with 5 µs per algorithm step; the cost model runs
at efficiency 0.5, so the roofline peak is 5e12 FLOP/s. The workload has two layers:

==========  ==========  ==========  ============  ===========  ===========  ==============
layer       fwd FLOPs   bwd FLOPs   param bytes   act in       act out      act saved
==========  ==========  ==========  ============  ===========  ===========  ==============
L0          1e10        2e10        4e6           1e6          1e6          1e6
L1          1e6         2e6         8e6           1e6          1e6          2e6
==========  ==========  ==========  ============  ===========  ===========  ==============

and one gradient per layer, ready in backward order: ``L1.w`` (8e6 B) then ``L0.w`` (4e6 B).

Roofline per micro-batch of 1 (``max(FLOPs / peak, bytes / bandwidth)``; forward bytes =
params + act in + act out; backward bytes = 2·params + saved + act in + act out):

* L0 forward  max(1e10/5e12, 6e6/1e12)  = 2e-3 s (compute bound)
* L0 backward max(2e10/5e12, 11e6/1e12) = 4e-3 s
* L1 forward  max(1e6/5e12, 10e6/1e12)  = 1e-5 s (memory bound)
* L1 backward max(2e6/5e12, 20e6/1e12)  = 2e-5 s

Communication (alpha-beta): allreduce on 2 ranks = 2·(2-1)·5e-6 + 2·(2-1)/2 · n / 1e10;
p2p = 5e-6 + n / 1e10. Optimizer step (fp32 Adam, torch's foreach kernels): 72 bytes per
parameter element (18 per parameter byte) at 1e12 B/s, plus 7 kernel launches of 10 us.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.evaluate import SyncScorer, evaluate, stage_syncs
from hetplan.errors import InfeasiblePlanError
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan_sections import (
    Bucket,
    GradCost,
    GradientSync,
    LayerCost,
    Layout,
    NoSync,
    Stage,
    WorkloadSummary,
)

GiB = 2**30


def toy_cluster(*, bandwidth_gbps: float = 80.0, latency_us: float = 5.0,
                memory_gib: float = 16.0, devices: int = 2,
                comm_overlaps_compute: bool = True) -> ClusterSpec:
    return ClusterSpec.from_dict({
        "name": "toy",
        "nodes": [{
            "name": "box",
            "devices": [{"type": "toy", "count": devices}],
            "cpu_cores": 4,
            "intra_link": {"kind": "pcie", "bandwidth_gbps": bandwidth_gbps,
                           "latency_us": latency_us},
        }],
        "device_types": {
            "toy": {"memory_gib": memory_gib, "peak_tflops": {"fp32": 10.0},
                    "mem_bandwidth_gb_s": 1000.0,
                    "comm_overlaps_compute": comm_overlaps_compute},
        },
    })


def costs(spec: ClusterSpec) -> CostModel:
    return CostModel(spec, efficiency=0.5, dtype="fp32", optimizer="adam")


WL = WorkloadSummary(
    batch_size=1,
    layers=(
        LayerCost(name="L0", fwd_flops=10**10, bwd_flops=2 * 10**10, param_bytes=4_000_000,
                  act_in_bytes=1_000_000, act_out_bytes=1_000_000, act_saved_bytes=1_000_000),
        LayerCost(name="L1", fwd_flops=10**6, bwd_flops=2 * 10**6, param_bytes=8_000_000,
                  act_in_bytes=1_000_000, act_out_bytes=1_000_000, act_saved_bytes=2_000_000),
    ),
    grads=(
        GradCost(name="L1.w", size_bytes=8_000_000, layer_index=1),
        GradCost(name="L0.w", size_bytes=4_000_000, layer_index=0),
    ),
)

# hand-computed roofline times (seconds), micro-batch 1
F0, B0 = 2e-3, 4e-3
F1, B1 = 1e-5, 2e-5
ALPHA, BW = 5e-6, 80e9 / 8  # one step's latency; bytes per second


def allreduce2(nbytes: float) -> float:
    return 2 * (2 - 1) * ALPHA + 2 * (2 - 1) / 2 * nbytes / BW


def p2p(nbytes: float) -> float:
    return 1 * ALPHA + 1 * nbytes / BW


def optimizer(param_bytes: float) -> float:
    return 18 * param_bytes / 1e12 + 7 * 10e-6


ONE_STAGE = (Stage(index=0, first_layer=0, last_layer=1, ranks=(0, 1)),)
TWO_STAGES = (
    Stage(index=0, first_layer=0, last_layer=0, ranks=(0,)),
    Stage(index=1, first_layer=1, last_layer=1, ranks=(1,)),
)


# --------------------------------------------------------------------------------------
# data parallelism
# --------------------------------------------------------------------------------------
def test_dp2_layerwise_sync_by_hand() -> None:
    layout = Layout(dp=2, micro_batches=1, micro_batch_size=1, global_batch_size=2)
    ev = evaluate(WL, layout, ONE_STAGE, None, costs(toy_cluster()))

    f, b = F0 + F1, B0 + B1  # 2.01e-3, 4.02e-3
    # backward runs L1 then L0: L1.w ready at B1, L0.w ready at B1 + B0
    ar1 = allreduce2(8e6)  # 1e-5 + 8e-4 = 8.1e-4
    ar0 = allreduce2(4e6)  # 1e-5 + 4e-4 = 4.1e-4
    end1 = B1 + ar1  # 8.3e-4, long before L0.w is ready
    assert end1 < B1 + B0
    end0 = max(B1 + B0, end1) + ar0  # 4.43e-3
    exposed = end0 - b  # 4.1e-4
    opt = optimizer(12e6)  # 2.16e-4 + 7e-5 = 2.86e-4
    expected = f + b + exposed + opt  # 6.726e-3

    assert expected == pytest.approx(6.726e-3)
    assert ev.iteration_s == pytest.approx(expected, rel=1e-9)
    assert ev.stages[0].fwd_s == pytest.approx(f)
    assert ev.stages[0].bwd_s == pytest.approx(b)
    assert ev.stages[0].exposed_sync_s == pytest.approx(exposed)
    assert ev.exposed_comm_s == pytest.approx(exposed)
    assert ev.optimizer_s == pytest.approx(opt)
    assert ev.compute_s == pytest.approx(f + b)
    assert ev.comm_s == pytest.approx(ar1 + ar0)  # the link was busy this long
    assert ev.bubble_s == pytest.approx(0.0, abs=1e-12)


def test_dp2_comm_takes_turns_with_compute_on_cpu_like_devices() -> None:
    # a device whose communication shares the compute cores (gloo on a CPU): each allreduce
    # runs as soon as its gradient is ready and delays the rest of backprop; nothing overlaps
    layout = Layout(dp=2, micro_batches=1, micro_batch_size=1, global_batch_size=2)
    ev = evaluate(WL, layout, ONE_STAGE, None,
                  costs(toy_cluster(comm_overlaps_compute=False)))
    serial = (F0 + F1) + B1 + allreduce2(8e6) + B0 + allreduce2(4e6) + optimizer(12e6)
    assert serial == pytest.approx(7.536e-3)
    assert ev.iteration_s == pytest.approx(serial, rel=1e-9)
    overlapped = evaluate(WL, layout, ONE_STAGE, None, costs(toy_cluster()))
    assert overlapped.iteration_s < ev.iteration_s


def test_builtin_cpu_type_does_not_overlap_comm() -> None:
    spec = ClusterSpec.from_preset("local-cpu")
    assert all(not d.comm_overlaps_compute for d in spec.devices())
    assert all(d.comm_overlaps_compute for d in ClusterSpec.from_preset("a100-nvlink-8x8").devices())


def test_dp2_one_bucket_by_hand() -> None:
    layout = Layout(dp=2, micro_batches=1, micro_batch_size=1, global_batch_size=2)
    sync = GradientSync(
        strategies={"fp32": NoSync()},
        buckets=(Bucket(tensors=("L1.w", "L0.w"), size_bytes=12_000_000, strategy="fp32"),),
    )
    ev = evaluate(WL, layout, ONE_STAGE, sync, costs(toy_cluster()))
    # one allreduce of 12e6 B once L0.w is ready, i.e. when backward ends: fully exposed
    exposed = allreduce2(12e6)  # 1e-5 + 1.2e-3
    expected = (F0 + F1) + (B0 + B1) + exposed + optimizer(12e6)  # 7.526e-3
    assert expected == pytest.approx(7.526e-3)
    assert ev.iteration_s == pytest.approx(expected, rel=1e-9)


def test_dp2_micro_batches_scale_compute() -> None:
    # global batch 8 over dp=2: 4 per replica as 2 micro-batches of 2
    layout = Layout(dp=2, micro_batches=2, micro_batch_size=2, global_batch_size=8)
    ev = evaluate(WL, layout, ONE_STAGE, None, costs(toy_cluster()))
    # at micro-batch 2 activations double; L0 stays compute bound, L1 memory bound
    f0, b0 = 2 * F0, 2 * B0  # 4e-3, 8e-3
    f1 = max(2e6 / 5e12, (8e6 + 4e6) / 1e12)  # 1.2e-5
    b1 = max(4e6 / 5e12, (16e6 + 4e6 + 4e6) / 1e12)  # 2.4e-5
    f, b = f0 + f1, b0 + b1
    # pp=1: F B F B back to back; the sync overlaps the last backward only
    end1 = b1 + allreduce2(8e6)
    end0 = max(b1 + b0, end1) + allreduce2(4e6)
    exposed = end0 - b
    expected = 2 * (f + b) + exposed + optimizer(12e6)  # 24.768e-3
    assert expected == pytest.approx(24.768e-3)
    assert ev.iteration_s == pytest.approx(expected, rel=1e-9)
    assert ev.compute_s == pytest.approx(2 * (f + b))


def test_dp1_has_no_sync() -> None:
    layout = Layout(dp=1, micro_batches=1, micro_batch_size=1, global_batch_size=1)
    stage = (Stage(index=0, first_layer=0, last_layer=1, ranks=(0,)),)
    ev = evaluate(WL, layout, stage, None, costs(toy_cluster(devices=1)))
    expected = F0 + F1 + B0 + B1 + optimizer(12e6)
    assert ev.iteration_s == pytest.approx(expected, rel=1e-9)
    assert ev.exposed_comm_s == 0.0


# --------------------------------------------------------------------------------------
# pipeline parallelism
# --------------------------------------------------------------------------------------
def test_pp2_one_micro_batch_by_hand() -> None:
    layout = Layout(dp=1, pp=2, micro_batches=1, micro_batch_size=1, global_batch_size=1)
    ev = evaluate(WL, layout, TWO_STAGES, None, costs(toy_cluster()))
    # activations of L0's output (1e6 B) go forward, their gradient (same size) back
    t_p2p = p2p(1e6)  # 5e-6 + 1e-4
    # each stage's optimizer runs in parallel; the larger one (L1, 8e6 B) decides
    opt = max(optimizer(4e6), optimizer(8e6))
    expected = F0 + t_p2p + F1 + B1 + t_p2p + B0 + opt  # 6.454e-3
    assert expected == pytest.approx(6.454e-3)
    assert ev.iteration_s == pytest.approx(expected, rel=1e-9)
    assert ev.stages[0].fwd_s == pytest.approx(F0)
    assert ev.stages[1].bwd_s == pytest.approx(B1)
    # two ranks busy F0+B0 and F1+B1 of a 2*p2p + sum makespan
    assert ev.compute_s == pytest.approx(F0 + B0)


def test_pp2_memory_by_hand() -> None:
    layout = Layout(dp=1, pp=2, micro_batches=4, micro_batch_size=1, global_batch_size=4)
    ev = evaluate(WL, layout, TWO_STAGES, None, costs(toy_cluster()))
    # 1F1B: stage s holds min(M, pp - s) micro-batches of activations; Adam: 2x params
    m0, m1 = ev.memory
    assert (m0.params, m0.grads, m0.optimizer) == (4_000_000, 4_000_000, 8_000_000)
    assert m0.activations == 1_000_000 * min(4, 2 - 0)
    assert (m1.params, m1.grads, m1.optimizer) == (8_000_000, 8_000_000, 16_000_000)
    assert m1.activations == 2_000_000 * min(4, 2 - 1)
    # plus the allocator margin: 5 % of the activations (and buffers: none here)
    assert m0.margin == m1.margin == 0.05 * 2e6
    assert m0.total == 4e6 + 4e6 + 8e6 + 2e6 + 0.05 * 2e6
    assert m1.total == 8e6 + 8e6 + 16e6 + 2e6 + 0.05 * 2e6


def test_gpipe_holds_every_micro_batch() -> None:
    layout = Layout(dp=1, pp=2, micro_batches=4, micro_batch_size=1, global_batch_size=4,
                    schedule="gpipe")
    ev = evaluate(WL, layout, TWO_STAGES, None, costs(toy_cluster()))
    assert ev.memory[0].activations == 4 * 1_000_000
    assert ev.memory[1].activations == 4 * 2_000_000


# --------------------------------------------------------------------------------------
# monotonicity in bandwidth
# --------------------------------------------------------------------------------------
DP2_PP2 = (
    Stage(index=0, first_layer=0, last_layer=0, ranks=(0, 1)),
    Stage(index=1, first_layer=1, last_layer=1, ranks=(2, 3)),
)
LAYOUTS = [
    (Layout(dp=2, micro_batches=1, micro_batch_size=1, global_batch_size=2), ONE_STAGE),
    (Layout(dp=2, micro_batches=2, micro_batch_size=1, global_batch_size=4), ONE_STAGE),
    (Layout(dp=1, pp=2, micro_batches=1, micro_batch_size=1, global_batch_size=1), TWO_STAGES),
    (Layout(dp=1, pp=2, micro_batches=3, micro_batch_size=1, global_batch_size=3,
            schedule="gpipe"), TWO_STAGES),
    (Layout(dp=2, pp=2, micro_batches=2, micro_batch_size=1, global_batch_size=4), DP2_PP2),
]


def one_bucket_per_stage(stages: tuple[Stage, ...]) -> GradientSync:
    """Each stage's gradients (in backward-ready order) fused into one fp32 bucket."""
    buckets = []
    for s in stages:
        grads = [g for g in WL.grads if s.first_layer <= g.layer_index <= s.last_layer]
        buckets.append(Bucket(tensors=tuple(g.name for g in grads),
                              size_bytes=sum(g.size_bytes for g in grads), strategy="fp32"))
    return GradientSync(strategies={"fp32": NoSync()}, buckets=tuple(buckets))


@settings(max_examples=30, deadline=None)
@given(
    gbps=st.floats(1.0, 5000.0),
    more=st.floats(1.0, 100.0),
    latency=st.floats(0.0, 50.0),
    which=st.integers(0, len(LAYOUTS) - 1),
    bucketed=st.booleans(),
)
def test_more_bandwidth_never_slower(gbps: float, more: float, latency: float, which: int,
                                     bucketed: bool) -> None:
    layout, stages = LAYOUTS[which]
    sync = one_bucket_per_stage(stages) if bucketed else None

    def predict(bandwidth: float) -> float:
        spec = toy_cluster(bandwidth_gbps=bandwidth, latency_us=latency, devices=4)
        return evaluate(WL, layout, stages, sync, costs(spec)).iteration_s

    assert predict(gbps * more) <= predict(gbps) * (1 + 1e-12)


def test_bandwidth_matters_for_exposed_sync() -> None:
    # sanity of the property above: with the bucket fully exposed, 10x the bandwidth is
    # strictly faster (the 1.2e-3 s transfer shrinks to 1.2e-4 s)
    layout, stages = LAYOUTS[0]
    sync = one_bucket_per_stage(stages)
    slow = evaluate(WL, layout, stages, sync, costs(toy_cluster(bandwidth_gbps=80)))
    fast = evaluate(WL, layout, stages, sync, costs(toy_cluster(bandwidth_gbps=800)))
    assert slow.iteration_s - fast.iteration_s == pytest.approx(12e6 / 1e10 - 12e6 / 1e11)


# --------------------------------------------------------------------------------------
# memory infeasibility
# --------------------------------------------------------------------------------------
BIG = WorkloadSummary(
    layers=(
        LayerCost(name="A", fwd_flops=10**9, bwd_flops=2 * 10**9, param_bytes=GiB,
                  act_out_bytes=1024, act_saved_bytes=GiB // 4),
        LayerCost(name="B", fwd_flops=10**9, bwd_flops=2 * 10**9, param_bytes=2 * GiB,
                  act_out_bytes=1024, act_saved_bytes=GiB // 4),
    ),
    grads=(GradCost(name="B.w", size_bytes=2 * GiB, layer_index=1),
           GradCost(name="A.w", size_bytes=GiB, layer_index=0)),
)


def test_memory_infeasible_names_rank_and_numbers() -> None:
    # 6 GiB devices (5.4 GiB usable). Stage 0 (A): 1 + 1 + 2 (Adam) + 0.25 = 4.25 GiB fits;
    # stage 1 (B) on rank 1: 2 + 2 + 4 + 0.25 + 0.0125 (5 % margin on 0.25) = 8.2625 GiB
    # does not.
    spec = toy_cluster(memory_gib=6.0)
    layout = Layout(dp=1, pp=2, micro_batches=1, micro_batch_size=1, global_batch_size=1)
    with pytest.raises(InfeasiblePlanError) as info:
        evaluate(BIG, layout, TWO_STAGES, None, costs(spec))
    msg = str(info.value)
    assert "rank 1 needs 8.26 GiB" in msg
    assert "6.00 GiB" in msg
    assert "5.40 GiB usable" in msg
    assert "params 2.00" in msg and "optimizer state 4.00" in msg and "activations 0.25" in msg
    assert "allocator margin 0.01" in msg
    assert "rank 0" not in msg
    assert "dp=1 pp=2" in msg


def test_memory_infeasible_first_rank() -> None:
    # both layers on each of 2 DP ranks: 3 + 3 + 6 + 0.5 + 0.025 = 12.525 GiB > 5.4 GiB on
    # rank 0
    spec = toy_cluster(memory_gib=6.0)
    layout = Layout(dp=2, micro_batches=1, micro_batch_size=1, global_batch_size=2)
    with pytest.raises(InfeasiblePlanError, match=r"rank 0 needs 12\.5[23] GiB"):
        evaluate(BIG, layout, ONE_STAGE, None, costs(spec))


def test_memory_check_can_be_skipped_and_fits_with_room() -> None:
    layout = Layout(dp=1, pp=2, micro_batches=1, micro_batch_size=1, global_batch_size=1)
    ev = evaluate(BIG, layout, TWO_STAGES, None, costs(toy_cluster(memory_gib=6.0)),
                  check_memory=False)
    assert ev.memory[1].total == 2 * GiB * 4 + GiB // 4 + int(0.05 * (GiB // 4))
    # with 10 GiB devices (9 GiB usable) the same layout fits
    evaluate(BIG, layout, TWO_STAGES, None, costs(toy_cluster(memory_gib=10.0)))


# --------------------------------------------------------------------------------------
# Chimera: every rank holds two stages; each stage syncs over the 2·dp ranks holding it
# --------------------------------------------------------------------------------------
# P=2, M=2: micro-batch 0 goes down (stage 0 on rank 0, stage 1 on rank 1), micro-batch 1
# up (stage 0 on rank 1, stage 1 on rank 0). Action lists (build_schedule("chimera", 2, 2)):
# rank 0 "0F0 1F1 1B1 0B0", rank 1 "0F1 1F0 1B0 0B1". Each action costs its stage's time;
# one hop over link 0 (either direction) is p2p(1e6) = 1.05e-4 s:
#   rank 0: F(0,s0) [0, F0]; F(1,s1) after rank 1's F(1,s0) + hop: [F0+h, F0+h+F1];
#           B(1,s1) right after: [.., F0+h+F1+B1]; B(0,s0) after rank 1's B(0,s1) + hop
#   rank 1: F(1,s0) [0, F0]; F(0,s1) [F0+h, F0+h+F1]; B(0,s1) [.., F0+h+F1+B1];
#           B(1,s0) after rank 0's B(1,s1) + hop
# so both ranks end with B of stage 0 from F0+2h+F1+B1 to F0+2h+F1+B1+B0.
HOP = p2p(1e6)
CHIMERA_END = F0 + 2 * HOP + F1 + B1 + B0  # 6.24e-3
STAGE1_END = F0 + HOP + F1 + B1  # stage 1's last backward, on either rank: 2.135e-3


def allreduce(n: int, nbytes: float) -> float:
    """Ring all-reduce on ``n`` ranks over the toy link (2(n-1) steps of α, 2(n-1)/n of the
    bytes over the bandwidth)."""
    return 2 * (n - 1) * ALPHA + 2 * (n - 1) / n * nbytes / BW


def chimera(dp: int, zero: int = 0) -> Layout:
    return Layout(dp=dp, pp=2, micro_batches=2, micro_batch_size=1, global_batch_size=2 * dp,
                  schedule="chimera", zero_stage=zero)  # type: ignore[arg-type]


def test_chimera_each_action_costs_its_stage_and_dp1_syncs_over_two_ranks() -> None:
    """dp=1: each stage still has two copies (ranks 0 and 1), whose gradients are averaged
    (before: no sync at all, and rank 0 ran its up stage 1 at stage 0's time)."""
    ev = evaluate(WL, chimera(dp=1), TWO_STAGES, one_bucket_per_stage(TWO_STAGES),
                  costs(toy_cluster()))
    assert CHIMERA_END == pytest.approx(6.24e-3)
    assert ev.pipeline.iteration_ms * 1e-3 == pytest.approx(CHIMERA_END)
    assert [e * 1e-3 for e in ev.pipeline.stage_bwd_end_ms] == pytest.approx(
        [CHIMERA_END, STAGE1_END])
    # each rank runs both stages, half the micro-batches each
    assert ev.compute_s == pytest.approx(F0 + B0 + F1 + B1)
    # overlapped with backward, one timeline per rank over both its stages' buckets: stage
    # 1's all-reduce (8e6 B) is done long before stage 0's gradient (4e6 B) is ready, which
    # is then all-reduced after the last backward: 2 ranks, not dp=1
    assert ev.stages[1].sync_busy_s == pytest.approx(allreduce(2, 8e6))
    assert ev.stages[0].exposed_sync_s == pytest.approx(allreduce(2, 4e6))
    # one optimizer over both stages' 12e6 parameter bytes on every rank
    assert ev.optimizer_s == pytest.approx(optimizer(12e6))
    expected = CHIMERA_END + allreduce(2, 4e6) + optimizer(12e6)  # 6.936e-3
    assert expected == pytest.approx(6.936e-3)
    assert ev.iteration_s == pytest.approx(expected, rel=1e-9)


def test_chimera_syncs_both_stages_over_two_dp_ranks_after_the_flush() -> None:
    """dp=2 on 4 ranks, syncing after the flush: each stage's bucket is all-reduced over the
    4 ranks holding it (dp replicas of pipeline ranks s and 1-s), and every rank all-reduces
    both its stages' buckets on its link, one after the other, after its last backward. The
    1F1B plan of the same layout all-reduces one stage's bucket over 2 ranks per rank."""
    spec = toy_cluster(devices=4)
    after = CostModel(spec, efficiency=0.5, dtype="fp32", optimizer="adam",
                      dp_overlap="after-flush")
    sync = one_bucket_per_stage(DP2_PP2)
    ev = evaluate(WL, chimera(dp=2), DP2_PP2, sync, after)
    both = allreduce(4, 4e6) + allreduce(4, 8e6)  # 6.3e-4 + 1.23e-3
    assert ev.comm_s == pytest.approx(both)
    assert ev.exposed_comm_s == pytest.approx(both)
    assert ev.iteration_s == pytest.approx(CHIMERA_END + both + optimizer(12e6), rel=1e-9)
    plain = chimera(dp=2).model_copy(update={"schedule": "1f1b"})
    one_f_one_b = evaluate(WL, plain, DP2_PP2, sync, after)
    assert one_f_one_b.comm_s == pytest.approx(allreduce(2, 8e6))  # the busier stage's
    # what the gradient-sync passes score with: the same group
    syncs = stage_syncs(WL, chimera(dp=2), DP2_PP2, after)
    assert [(ss.stage.index, ss.dp, ss.link) for ss in syncs] == [(0, 4, "intra"),
                                                                  (1, 4, "intra")]
    assert [ss.dp for ss in stage_syncs(WL, plain, DP2_PP2, after)] == [2, 2]
    scorer = SyncScorer(WL, chimera(dp=2), DP2_PP2, after)
    assert scorer.iteration_s(sync) == evaluate(WL, chimera(dp=2), DP2_PP2, sync, after,
                                                check_memory=False).iteration_s


def test_chimera_rank_memory_holds_both_stages_by_hand() -> None:
    """Every rank holds stage 0 (L0: 4e6 B) and stage 1 (L1: 8e6 B): fp32 weights, gradients
    and Adam's two moments of both; at the peak of its action list it holds one micro-batch
    of each stage's activations (1e6 + 2e6 B)."""
    ev = evaluate(WL, chimera(dp=1), TWO_STAGES, None, costs(toy_cluster()))
    for m in ev.memory:
        assert (m.params, m.grads, m.optimizer) == (12_000_000, 12_000_000, 24_000_000)
        assert m.activations == 1_000_000 + 2_000_000
        assert m.margin == int(0.05 * 3e6)
        assert m.total == 12e6 + 12e6 + 24e6 + 3e6 + 0.05 * 3e6
    # ZeRO-1 shards the optimizer state over the 2·dp = 4 ranks averaging each stage
    zero1 = evaluate(WL, chimera(dp=2, zero=1), DP2_PP2, None, costs(toy_cluster(devices=4)))
    assert [m.optimizer for m in zero1.memory] == [24_000_000 // 4] * 4
    assert [m.params for m in zero1.memory] == [12_000_000] * 4
