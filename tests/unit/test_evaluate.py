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
from hetplan.cost_models.evaluate import evaluate
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
