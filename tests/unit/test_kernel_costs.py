"""The kernel-level compute model (cost_models/kernels.py) and the NIC-sharing rule."""

from __future__ import annotations

import math

import pytest

from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.kernels import (
    GEMM_CURVES,
    bias_grad_bytes,
    block_shape,
    cross_entropy_bytes,
    curve_for,
    fused_block_bytes,
    gemm_efficiency,
    kernel_times,
)
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


def test_large_aligned_gemm_reaches_the_typical_share_of_the_measured_ceiling() -> None:
    # 108 SMs x (256 x 128) tiles: 27 x 32 tiles of 256 x 128 fill 8 waves exactly; a block's
    # shapes reach 0.889 of the best shape's measured ceiling (hetplan's H200 sweep)
    assert A100.typical == pytest.approx(0.889)
    assert gemm_efficiency(A100, 1, 27 * 256, 32 * 128) == pytest.approx(
        267.9 / 312.0 * 0.889)


def test_wave_quantization_one_tile_too_many() -> None:
    # 109 tiles of 128 x 128 need 2 waves of 108 blocks; the best tile shape cannot do better
    # than a 128-wide strip split 109 ways
    full = gemm_efficiency(A100, 1, 108 * 128, 128)
    over = gemm_efficiency(A100, 1, 109 * 128, 128)
    assert full == pytest.approx(A100.ceiling * A100.typical)
    assert over < 0.6 * A100.ceiling * A100.typical


def test_tile_quantization_small_shape() -> None:
    # a 64 x 64 output uses a quarter of one 128 x 128 tile, on one SM of 108
    e = gemm_efficiency(A100, 1, 64, 64)
    assert e == pytest.approx(A100.ceiling * A100.typical * 64 * 64 / (108 * 128 * 128))


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
    # 4 GB at 2 TB/s datasheet, of which streaming kernels reach ``stream``
    fwd = 2e-3 / A100.stream
    assert A100.stream == pytest.approx(0.88)
    assert (t.fwd_s, t.bwd_s) == pytest.approx((fwd, 2 * fwd))
    t8 = _times(lay, tp=8)
    assert t8.fwd_s == pytest.approx(fwd * (0.25 + 0.75 / 8))
    t8sp = _times(lay, tp=8, sp=True)
    assert t8sp.fwd_s == pytest.approx(fwd / 8)


def test_materialized_attention_moves_the_scores_flash_does_not() -> None:
    core = Gemm(phase="fwd", core=True, batch=32, m=2048, n=2048, k=64)
    lay = _layer(gemms=(core,), core_mem_fwd_bytes=2_000_000_000,
                 core_mem_bwd_bytes=4_000_000_000)
    flash = _times(lay, attention="flash")
    mat = _times(lay, attention="materialized")
    assert flash.core_fwd_s == flash.fwd_s
    assert mat.fwd_s >= flash.fwd_s + 1e-3 / A100.stream - 1e-12
    assert mat.bwd_s == pytest.approx(flash.bwd_s + 2e-3 / A100.stream)


def _gpt_block(h: int = 1024, s: int = 2048, heads: int = 16, dropout: bool = True,
               **kw: object) -> LayerCost:
    """A GPT block's forward products as capture records them (qkv, out, fc1, fc2, and the
    attention core's two batched products), with captured memory-bound bytes."""
    g = [Gemm(phase="fwd", batch=1, m=s, n=3 * h, k=h),
         Gemm(phase="fwd", batch=1, m=s, n=h, k=h),
         Gemm(phase="fwd", batch=1, m=s, n=4 * h, k=h),
         Gemm(phase="fwd", batch=1, m=s, n=h, k=4 * h),
         Gemm(phase="fwd", core=True, batch=heads, m=s, n=s, k=h // heads),
         Gemm(phase="fwd", core=True, batch=heads, m=s, n=h // heads, k=s)]
    base: dict[str, object] = dict(gemms=tuple(g), tp_pairs=2, act_saved_bytes=100 * s * h,
                                   act_replicated_bytes=10 * s * h,
                                   act_replicated_nonfloat_bytes=(2 * s * h if dropout else 0),
                                   mem_fwd_bytes=100 * s * h * 2,
                                   mem_bwd_bytes=150 * s * h * 2,
                                   core_mem_fwd_bytes=22 * heads * s * s * 2,
                                   core_mem_bwd_bytes=13 * heads * s * s * 2)
    base.update(kw)
    return _layer(**base)


def test_block_shape_reads_a_gpt_and_a_gated_block_and_refuses_others() -> None:
    blk = block_shape(_gpt_block(), 2048)
    assert blk is not None
    assert (blk.hidden, blk.ffn, blk.gated, blk.qk, blk.scores, blk.dropout) == (
        1024, 4096, False, 2048, 16 * 2048, True)
    # Llama-style: q and o are h x h (count 2), k and v h x kv (count 2), gate and up h x f
    h, kv, f, s = 1024, 256, 2816, 2048
    llama = _layer(tp_pairs=2, gemms=(
        Gemm(phase="fwd", batch=1, m=s, n=h, k=h, count=2),
        Gemm(phase="fwd", batch=1, m=s, n=kv, k=h, count=2),
        Gemm(phase="fwd", batch=1, m=s, n=f, k=h, count=2),
        Gemm(phase="fwd", batch=1, m=s, n=h, k=f)))
    lb = block_shape(llama, s)
    assert lb is not None
    assert (lb.hidden, lb.ffn, lb.gated, lb.qk, lb.dropout) == (h, f, True, h + kv, False)
    # not blocks: no Megatron pairs, a head (one product), rows that are not the tokens
    assert block_shape(_gpt_block(tp_pairs=0), 2048) is None
    head = _layer(tp_pairs=1, gemms=(Gemm(phase="fwd", batch=1, m=2048, n=50000, k=1024),))
    assert block_shape(head, 2048) is None
    assert block_shape(_gpt_block(), 4096) is None


def test_fused_block_bytes_is_megatrons_closed_form() -> None:
    h, e = 1024, 2
    blk = block_shape(_gpt_block(h=h), 2048)
    assert blk is not None
    fb = fused_block_bytes(blk, e, "materialized")
    # 2 layer norms (read + write h) + 2 bias-dropout-adds (read 2h, write h, 1-byte mask)
    assert fb.repl_fwd == 2 * 2 * h * e + 2 * (3 * h * e + h)
    # bias-GeLU reads and writes 4h; the context's layout copy reads and writes h
    assert fb.split_fwd == 2 * 4 * h * e + 2 * h * e
    # dropout-add backward, layer-norm backward, residual-gradient accumulation
    assert fb.repl_bwd == 2 * (2 * h * e + h) + 2 * 3 * h * e + 2 * 3 * h * e
    assert fb.split_bwd == 3 * 4 * h * e + 2 * h * e
    # scale-mask-softmax + dropout on the scores: 9 bytes each forward, 11 backward
    assert (fb.core_fwd, fb.core_bwd) == (16 * 2048 * 9, 16 * 2048 * 11)
    flash = fused_block_bytes(blk, e, "flash")
    assert (flash.core_fwd, flash.core_bwd) == (0.0, 0.0)
    assert flash.split_fwd == 2 * 4 * h * e + 2 * blk.qk * e
    # no dropout: no masks, nothing else changes
    nod = block_shape(_gpt_block(h=h, dropout=False), 2048)
    assert nod is not None
    assert fused_block_bytes(nod, e, "materialized").repl_fwd == fb.repl_fwd - 2 * h


def test_fused_kernels_replace_the_captured_bytes_and_split_under_tp() -> None:
    lay = _gpt_block()
    gemm_only = _times(lay.model_copy(update=dict(
        mem_fwd_bytes=0, mem_bwd_bytes=0, core_mem_fwd_bytes=0, core_mem_bwd_bytes=0)),
        attention="flash")
    unfused = _times(lay, attention="materialized")
    fused = _times(lay, attention="materialized", fusion="fused")
    assert fused.fwd_s < unfused.fwd_s and fused.bwd_s < unfused.bwd_s
    blk = block_shape(lay, 2048)
    assert blk is not None
    fb = fused_block_bytes(blk, 2, "materialized")
    bw = 2.0e12 * A100.stream
    flash_fused = _times(lay, attention="flash", fusion="fused")
    fl = fused_block_bytes(blk, 2, "flash")
    assert flash_fused.fwd_s == pytest.approx(
        gemm_only.fwd_s + 2048 * (fl.repl_fwd + fl.split_fwd) / bw)
    # under TP 8 the kernels inside TP regions and the scores split; the rest is replicated
    t8 = _times(lay, attention="materialized", fusion="fused", tp=8)
    t8sp = _times(lay, attention="materialized", fusion="fused", tp=8, sp=True)
    assert t8.bwd_s - t8sp.bwd_s == pytest.approx(2048 * fb.repl_bwd * (1 - 1 / 8) / bw)
    # a layer that is not a block keeps its captured bytes
    other = _layer(mem_fwd_bytes=4_000_000_000)
    assert _times(other, fusion="fused").fwd_s == _times(other).fwd_s


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
    # the head whole, as test_tp_resizing_pass.ARGS (split, the skew saves nothing here)
    plan = compile("gpt-test", "mixed-tp-node", batch_size=128, dp=2, pp=2, tp=4,
                   micro_batch_size=32, dtype="fp16", vocab_parallel=False)
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


def test_vocab_parallel_splits_the_head_by_its_vocabulary() -> None:
    g = Gemm(phase="fwd", batch=1, m=2048, n=51200, k=4096)
    head = _layer(kind="head", gemms=(g,))
    whole = _times(head, tp=8).fwd_s
    # without vocab parallelism every TP rank computes all logits
    assert whole == pytest.approx(_times(head).fwd_s)
    split = _times(head, tp=8, vocab_parallel=True).fwd_s
    assert split == pytest.approx(
        g.flops / 8 / (312e12 * gemm_efficiency(A100, 1, 2048, 51200 / 8)))
    # only the head: another layer without Megatron pairs is not split
    other = _layer(kind="other", gemms=(g,))
    assert _times(other, tp=8, vocab_parallel=True).fwd_s == pytest.approx(whole)


def test_typical_share_is_the_median_of_the_h200_sweeps_block_shapes() -> None:
    import json
    import statistics
    from pathlib import Path

    sweep = json.loads((Path(__file__).resolve().parents[2] / "bench" / "results"
                        / "gpu_kernels_nvidia_h200.json").read_text())
    h200 = GEMM_CURVES["H200"]
    raw = [g["tflops"] * 1e12 / (989.4e12 * gemm_efficiency(h200, 1, g["m"], g["n"])
                                 / h200.typical)
           for g in sweep["gemm"] if g["dtype"] == "bf16" and g["kind"] == "block"]
    assert len(raw) == 180
    assert statistics.median(raw) == pytest.approx(h200.typical, abs=5e-4)


# -- work every Megatron-style step does beyond the blocks' kernels ---------------------------
def test_cross_entropy_passes_over_the_logits_by_hand() -> None:
    # forward: read the 16-bit logits (2), write the fp32 copy (4), max (4), subtract (8),
    # exp (8), sum (4), normalise (8); backward: scale in place (8), cast back (4 + 2)
    assert cross_entropy_bytes(2) == (38.0, 14.0)
    s, h, v = 2048, 4096, 51200
    g = Gemm(phase="fwd", batch=1, m=s, n=v, k=h)
    head = _layer(kind="head", gemms=(g,), act_out_bytes=s * v * 2)
    bare = _times(head.model_copy(update={"act_out_bytes": 0}))
    bw = 2.0e12 * A100.stream
    t = _times(head)
    assert t.fwd_s - bare.fwd_s == pytest.approx(s * v * 38 / bw)
    assert t.bwd_s - bare.bwd_s == pytest.approx(s * v * 14 / bw)
    # a vocabulary-parallel head's cross-entropy runs over its 1/tp of the logits; twice the
    # micro-batch, twice the logits
    split = _times(head, tp=8, vocab_parallel=True, r=2.0)
    bare8 = _times(head.model_copy(update={"act_out_bytes": 0}), tp=8, vocab_parallel=True,
                   r=2.0)
    assert split.fwd_s - bare8.fwd_s == pytest.approx(2 * s * v / 8 * 38 / bw)


def _biased(lay: LayerCost, h: int, elem: int = 2) -> LayerCost:
    """``lay`` with a GPT block's parameters: the four linears' weights and biases
    (3h + h + 4h + h) and two layer norms' weights and biases."""
    weights = 3 * h * h + h * h + 4 * h * h + 4 * h * h
    return lay.model_copy(update={"param_bytes": (weights + 9 * h + 4 * h) * elem})


def test_bias_gradients_of_a_gpt_block_by_hand() -> None:
    h, s = 1024, 2048
    lay = _biased(_gpt_block(h=h, s=s), h)
    # row-parallel outputs (the two h-wide ones) outside TP regions, qkv and fc1 inside
    assert bias_grad_bytes(lay, 2) == (2 * h * 2, 7 * h * 2)
    # no bias: the parameters are the weights and the norms only (a Llama block has 2h)
    assert bias_grad_bytes(_gpt_block(h=h, s=s, param_bytes=12 * h * h * 2 + 2 * h * 2), 2) == (
        0.0, 0.0)
    assert bias_grad_bytes(_layer(kind="norm", param_bytes=4 * h), 2) == (0.0, 0.0)
    bw = 2.0e12 * A100.stream
    plain = _times(_gpt_block(h=h, s=s), attention="flash", fusion="fused", tp=8)
    biased = _times(lay, attention="flash", fusion="fused", tp=8)
    assert biased.fwd_s == plain.fwd_s
    assert biased.bwd_s - plain.bwd_s == pytest.approx(s * (2 * h + 7 * h / 8) * 2 / bw)
    # sequence parallelism splits the row linears' bias gradients too
    sp = _times(lay, attention="flash", fusion="fused", tp=8, sp=True)
    sp_plain = _times(_gpt_block(h=h, s=s), attention="flash", fusion="fused", tp=8, sp=True)
    assert sp.bwd_s - sp_plain.bwd_s == pytest.approx(s * 9 * h / 8 * 2 / bw)
