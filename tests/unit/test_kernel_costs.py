"""The kernel-level compute model (cost_models/kernels.py) and the NIC-sharing rule."""

from __future__ import annotations

import math

import pytest

from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.kernels import GEMM_CURVES, curve_for, gemm_efficiency, kernel_times
from hetplan.cost_models.stage_times import nic_share
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.kernels import Gemm
from hetplan.ir.plan_sections import LayerCost

A100 = GEMM_CURVES["A100"]


def test_curve_by_family_and_none_for_others() -> None:
    assert curve_for("A100-80GB") is A100
    assert curve_for("H100-80GB") is GEMM_CURVES["H100"]
    assert curve_for("V100-SXM2-32GB") is None
    assert curve_for("cpu") is None


def test_large_aligned_gemm_reaches_the_measured_ceiling() -> None:
    # 108 SMs x (256 x 128) tiles: 27 x 32 tiles of 256 x 128 fill 8 waves exactly
    assert gemm_efficiency(A100, 1, 27 * 256, 32 * 128) == pytest.approx(267.9 / 312.0)


def test_wave_quantization_one_tile_too_many() -> None:
    # 109 tiles of 128 x 128 need 2 waves of 108 blocks; the best tile shape cannot do better
    # than a 128-wide strip split 109 ways
    full = gemm_efficiency(A100, 1, 108 * 128, 128)
    over = gemm_efficiency(A100, 1, 109 * 128, 128)
    assert full == pytest.approx(A100.ceiling)
    assert over < 0.6 * A100.ceiling


def test_tile_quantization_small_shape() -> None:
    # a 64 x 64 output uses a quarter of one 128 x 128 tile, on one SM of 108
    e = gemm_efficiency(A100, 1, 64, 64)
    assert e == pytest.approx(A100.ceiling * 64 * 64 / (108 * 128 * 128))


def _layer(**kw: object) -> LayerCost:
    base: dict[str, object] = dict(name="blk", kind="block", fwd_flops=1, bwd_flops=2)
    base.update(kw)
    return LayerCost(**base)  # type: ignore[arg-type]


def _times(lay: LayerCost, **kw: object):  # noqa: ANN202
    args: dict[str, object] = dict(peak_flops=312e12, mem_bw=2.0e12, elem_bytes=2,
                                   bytes_scale=1.0, tokens=2048, r=1.0)
    args.update(kw)
    return kernel_times(lay, A100, **args)  # type: ignore[arg-type]


def test_gemm_time_is_flops_over_curve_and_scales_the_token_dim() -> None:
    g = Gemm(phase="fwd", batch=1, m=2048, n=8192, k=8192)
    lay = _layer(gemms=(g,))
    t = _times(lay)
    assert t.fwd_s == pytest.approx(g.flops / (312e12 * gemm_efficiency(A100, 1, 2048, 8192)))
    # micro-batch 4: the token dimension (m) grows 4x, and with it the waves' fill
    t4 = _times(lay, r=4.0)
    assert t4.fwd_s == pytest.approx(
        4 * g.flops / (312e12 * gemm_efficiency(A100, 1, 4 * 2048, 8192)))
    assert t4.fwd_s < 4 * t.fwd_s


def test_tp_splits_the_largest_weight_dim_and_costs_efficiency() -> None:
    g = Gemm(phase="fwd", batch=1, m=2048, n=3 * 1024, k=1024)
    lay = _layer(gemms=(g,), tp_pairs=1)
    one = _times(lay).fwd_s
    eight = _times(lay, tp=8).fwd_s
    # n = 3072 / 8 = 384: smaller tiles grid, at least 1/8 of the time, here more
    assert eight > one / 8
    assert eight == pytest.approx(
        g.flops / 8 / (312e12 * gemm_efficiency(A100, 1, 2048, 384)))


def test_memory_bound_kernels_by_bytes_and_replicated_share_under_tp() -> None:
    lay = _layer(mem_fwd_bytes=4_000_000_000, mem_bwd_bytes=8_000_000_000,
                 tp_pairs=2, act_saved_bytes=100, act_replicated_bytes=25)
    t = _times(lay)
    assert (t.fwd_s, t.bwd_s) == pytest.approx((2e-3, 4e-3))
    t8 = _times(lay, tp=8)
    assert t8.fwd_s == pytest.approx(2e-3 * (0.25 + 0.75 / 8))
    t8sp = _times(lay, tp=8, sp=True)
    assert t8sp.fwd_s == pytest.approx(2e-3 / 8)


def test_materialized_attention_moves_the_scores_flash_does_not() -> None:
    core = Gemm(phase="fwd", core=True, batch=32, m=2048, n=2048, k=64)
    lay = _layer(gemms=(core,), core_mem_fwd_bytes=2_000_000_000,
                 core_mem_bwd_bytes=4_000_000_000)
    flash = _times(lay, attention="flash")
    mat = _times(lay, attention="materialized")
    assert flash.core_fwd_s == flash.fwd_s
    assert mat.fwd_s >= flash.fwd_s + 1e-3 - 1e-12
    assert mat.bwd_s == pytest.approx(flash.bwd_s + 2e-3)


def test_nic_share_counts_groups_per_node() -> None:
    spec = ClusterSpec.from_preset("a100-nvlink-8x8")
    costs = CostModel(spec)
    per_node = 8
    # one rank per node (tp=8 style): eight groups share each node's NICs
    assert nic_share(costs, [n * per_node for n in range(spec.num_nodes)]) == 8
    # two per node: four groups
    assert nic_share(costs, [n * per_node + j for n in range(spec.num_nodes)
                             for j in range(2)]) == 4
    # inside one node: no network
    assert nic_share(costs, list(range(8))) == 1
    assert math.isclose(nic_share(costs, list(range(spec.world_size))), 1.0)


def test_a_cluster_with_a_device_type_lacking_a_curve_prices_every_device_alike() -> None:
    """Mixed A100 + V100 (no V100 curve): every device by the roofline, so the passes compare
    devices, not pricing methods; the TP-resizing pass then gives the A100s the larger
    shards. An A100-only cluster keeps the kernel prices."""
    from hetplan.cost_models.costs import CostModel
    from hetplan.ir.cluster import ClusterSpec
    from hetplan.optimizer.compile import compile

    mixed = CostModel(ClusterSpec.from_preset("mixed-tp-node"), dtype="fp16")
    assert not mixed.compute.kernel_devices
    assert CostModel(ClusterSpec.from_preset("a100-nvlink-8x8"), dtype="bf16").compute \
        .kernel_devices
    plan = compile("gpt-test", "mixed-tp-node", batch_size=128, dp=2, pp=2, tp=4,
                   micro_batch_size=32, dtype="fp16")
    assert plan.tensor_parallel is not None
    devices = plan.cluster.spec.devices()  # type: ignore[union-attr]
    checked = 0
    for g in plan.tensor_parallel.groups:
        for lin in g.linears:
            by_type: dict[str, set[int]] = {}
            for r, size in zip(g.ranks, lin.shard_sizes):
                by_type.setdefault(devices[r].type, set()).add(size)
            if len(by_type) == 2:
                checked += 1
                assert min(by_type["A100-80GB"]) > max(by_type["V100-SXM2-32GB"])
    assert checked  # mixed-tp-node's TP groups mix both generations
