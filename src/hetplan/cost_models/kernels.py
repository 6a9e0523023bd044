"""Kernel-level compute cost: a layer's time from the shapes of its matrix multiplies and the
bytes its other kernels move (what capture records, :mod:`hetplan.ir.kernels`).

Three kinds of work, each priced by what bounds it on the device:

1. **Matrix multiplies** (``mm``, ``addmm``, ``bmm``), one shape at a time::

       t = max(2·b·m·n·k / (peak · e(b, m, n)),  bytes(b, m, n, k) / memory bandwidth)

   ``e`` is the device's GEMM efficiency curve (:class:`GemmCurve`): the largest fraction of
   the dense 16-bit peak a matrix multiply reaches on it (its *ceiling*, a published
   measurement), times the share of it a transformer block's shapes reach (*typical*,
   measured), times the work lost to **tile and wave quantization**: cuBLAS cuts the
   ``m x n`` output into tiles, one thread block each, and runs them in waves of one block
   per SM, so a product occupies ``ceil(b·ceil(m/Tm)·ceil(n/Tn) / SMs)`` full waves whatever
   its useful share of them (NVIDIA, *Matrix Multiplication Background User's Guide*,
   "Dimension Quantization Effects"). The best of the tile shapes cuBLAS uses on the device
   is taken. ``bytes`` reads both operands and writes the result once.
2. **The attention core** (score and score-times-value products, softmax, dropout on the
   scores): with a **fused** kernel (``attention="flash"``, what capture assumes) its
   products run at the same curve and the scores never reach memory (FlashAttention-2
   reaches 50-73 % of the A100's peak, "nearly matching the efficiency of raw GEMM"; Dao
   2023); **materialized** (``attention="materialized"``, Megatron-LM before fused
   attention) its products are bounded by memory as well and its softmax, masking and
   dropout move the score matrices through memory (the core's captured bytes).
3. **Memory-bound kernels** (element-wise, normalisation, softmax, dropout, casts, the
   embedding's gather): the bytes they read and write over the memory bandwidth a
   streaming kernel reaches (``GemmCurve.stream`` of the datasheet's). With
   ``fusion="none"`` each captured kernel on its own, as capture saw it. With
   ``fusion="fused"`` a transformer block runs the fused kernels of the engines that train
   at scale (Megatron-LM and Megatron-DeepSpeed, Transformer Engine): one kernel per group,
   priced by the bytes that group reads and writes (:func:`fused_block_bytes`); layers that
   are not recognisable blocks keep their captured bytes.

4. **The loss** (a ``head`` layer with outputs, as :func:`~.memory.loss_activations`
   counts it): the softmax cross-entropy over the logits, one memory-bound pass after
   another (:func:`cross_entropy_bytes`), on each rank's ``1/tp`` of the vocabulary when
   the head is vocabulary-parallel.
5. **Bias gradients** of a block whose linears carry biases (:func:`bias_grad_bytes`): one
   reduction over each biased linear's output gradient in backward.

Tensor parallelism (``tp``): a layer with Megatron pairs (and, with ``vocab_parallel``, the LM
head: its vocabulary is the split dimension) runs ``1/tp`` of its attention heads
(``bmm`` batch) and ``1/tp`` of each linear's split dimension (the largest dimension that is
not the token count: a column linear's outputs, a row linear's inputs, and the same
dimension in backward's products); its memory-bound kernels inside TP regions are split, the
others (layer norms, dropout after a row linear: ``act_replicated_bytes`` of the saved bytes)
run on every rank in full unless sequence parallelism splits them too.

A device type with no curve (:data:`GEMM_CURVES`: CPUs, V100s) is priced by the roofline
with the cost model's constant efficiency (:class:`~hetplan.cost_models.compute.ComputeModel`),
and says so in its source. Every constant and its source: ``docs/decisions/cost-model.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from hetplan.ir.kernels import Gemm
from hetplan.ir.plan_sections import LayerCost

__all__ = ["GemmCurve", "GEMM_CURVES", "curve_for", "gemm_efficiency", "KernelTimes",
           "kernel_times", "Attention", "ATTENTION_KERNELS", "Fusion", "FUSIONS",
           "BlockShape", "block_shape", "FusedBytes", "fused_block_bytes",
           "CROSS_ENTROPY_FWD_FP32_BYTES", "CROSS_ENTROPY_BWD_FP32_BYTES",
           "cross_entropy_bytes", "bias_grad_bytes"]

Attention = Literal["flash", "materialized"]
#: How the attention core runs (see module docstring).
ATTENTION_KERNELS: tuple[str, ...] = ("flash", "materialized")

Fusion = Literal["none", "fused"]
#: Which memory-bound kernels the training engine fuses (see module docstring).
FUSIONS: tuple[str, ...] = ("none", "fused")


@dataclass(frozen=True, slots=True)
class GemmCurve:
    """A device type's matrix-multiply efficiency (see module docstring).

    Attributes:
        sms: streaming multiprocessors (one thread block each per wave).
        tiles: the output tile shapes ``(Tm, Tn)`` cuBLAS picks from.
        ceiling: the largest measured fraction of the dense 16-bit tensor-core peak.
        source: where ``ceiling`` and ``sms`` come from.
        stream: the fraction of the datasheet memory bandwidth a streaming kernel reaches
            (memory-bound kernels and the memory bound of matrix multiplies use it).
        typical: the fraction of ``ceiling`` x quantization that a transformer block's
            products reach: ``ceiling`` is the best shape of a sweep, an upper tail.
    """

    sms: int
    tiles: tuple[tuple[int, int], ...]
    ceiling: float
    source: str
    stream: float = 1.0
    typical: float = 1.0


#: Streaming kernels reach about 88 % of the datasheet DRAM bandwidth on these parts: 1.80 of
#: 2.04 TB/s measured on an A100 80GB SXM (and "around 90 %" the best of any kernel in
#: NVIDIA's own GTC measurements), NVIDIA developer forum, "Trouble to reach peak bandwidth of
#: A100"; 4245 of 4800 GB/s for the largest element-wise add of hetplan's own H200 sweep
#: (bench/results/gpu_kernels_nvidia_h200.json).
_STREAM = 0.88

#: A transformer block's products reach 0.889 of what the ceiling and quantization predict:
#: the median over the 180 bf16 block shapes (qkv, proj, fc1, fc2, forward and both
#: backward products; hidden 1024-12288, 2048-16384 tokens; interquartile 0.845-0.920) of
#: hetplan's H200 sweep (bench/results/gpu_kernels_nvidia_h200.json), whose ceiling is
#: that sweep's best shape. The A100 and H100 ceilings are also the best shape of a sweep
#: (MAMF), so the same factor applies; a sweep on those devices would replace it.
_TYPICAL = 0.889

#: cuBLAS's large tiles on Ampere and Hopper (User's Guide, "Typical Tile Dimensions In
#: cuBLAS And Performance": 256x128 and 128x256 are the most efficient, 128x128 next).
_TILES = ((256, 128), (128, 256), (128, 128))

#: Per device-type family (the type name's prefix before ``-``).
GEMM_CURVES: dict[str, GemmCurve] = {
    "A100": GemmCurve(
        sms=108, tiles=_TILES, ceiling=267.9 / 312.0,
        source="A100 SXM bf16 matmul 267.9 of 312 TFLOP/s (ml-engineering MAMF table); "
               "108 SMs (A100 datasheet)", stream=_STREAM, typical=_TYPICAL),
    "H100": GemmCurve(
        sms=132, tiles=_TILES, ceiling=792.1 / 989.4,
        source="H100 SXM bf16 matmul 792.1 of 989 TFLOP/s (ml-engineering MAMF table); "
               "132 SMs (H100 SXM5 datasheet)", stream=_STREAM, typical=_TYPICAL),
    # the H100's compute die with 141 GB HBM3e: same SMs and dense peak
    "H200": GemmCurve(
        sms=132, tiles=_TILES, ceiling=785.0 / 989.4,
        source="H200 bf16 matmul 785 of 989 TFLOP/s, the best of hetplan's own GEMM sweep "
               "(bench/results/gpu_kernels_nvidia_h200.json); 132 SMs (as reported by torch)",
        stream=_STREAM, typical=_TYPICAL),
}


def curve_for(device_type: str) -> GemmCurve | None:
    """The curve of ``device_type`` (by family: ``A100-80GB`` → ``A100``), or None."""
    return GEMM_CURVES.get(device_type.split("-")[0])


def gemm_efficiency(curve: GemmCurve, batch: float, m: float, n: float) -> float:
    """Fraction of peak a ``batch x (m x n)``-output matrix multiply reaches: the ceiling
    times the best tile shape's useful share of the waves it occupies, times the typical
    shape's share of the ceiling (``curve.typical``)."""
    if batch <= 0 or m <= 0 or n <= 0:
        return curve.ceiling * curve.typical
    best = 0.0
    for tm, tn in curve.tiles:
        tiles = math.ceil(batch) * math.ceil(m / tm) * math.ceil(n / tn)
        waves = math.ceil(tiles / curve.sms)
        best = max(best, batch * m * n / (waves * curve.sms * tm * tn))
    return curve.ceiling * curve.typical * min(best, 1.0)


@dataclass(frozen=True, slots=True)
class BlockShape:
    """What a transformer block's fused kernels move, read off its captured matrix
    multiplies (:func:`block_shape`), per token of the captured batch.

    Attributes:
        hidden: the block's input and output width ``h`` (the smallest input width of its
            forward linears).
        ffn: the MLP's inner width ``f`` (the largest input width: the down projection's).
        gated: the MLP has a gate (SwiGLU: two ``h -> f`` products, ``f`` read twice).
        qk: the query and key widths together (rotary embedding / layout kernels).
        scores: attention score elements per token (heads x keys, from ``Q K^T``).
        dropout: the block drops out its residual branches (and, by the same setting in
            the engines priced here, its attention probabilities): capture saved 1-byte
            masks outside the TP regions.
    """

    hidden: int
    ffn: int
    gated: bool
    qk: float
    scores: float
    dropout: bool


def block_shape(lay: LayerCost, tokens: int) -> BlockShape | None:
    """The fused-kernel shape of ``lay``, or None when it is not a transformer block (no
    Megatron pairs, no ``h -> f -> h`` MLP, or a linear whose rows are not the tokens)."""
    if lay.tp_pairs == 0 or tokens <= 0:
        return None
    lin = [g for g in lay.gemms if g.phase == "fwd" and not g.core]
    if not lin or any(g.batch != 1 or g.m != tokens for g in lin):
        return None
    h = min(g.k for g in lin)
    f = max(g.k for g in lin)
    if f <= h:
        return None
    up = sum(g.count for g in lin if g.k == h and g.n == f)
    # every h-input product but the MLP's is q, k, v or the output projection (h wide)
    qkv = sum(g.n * g.count for g in lin if g.k == h and g.n != f) - h
    if up == 0 or qkv < h:
        return None
    kv = (qkv - h) / 2
    core = [g for g in lay.gemms if g.phase == "fwd" and g.core]
    scores = max((g.batch * g.m * g.n for g in core), default=0) / tokens
    return BlockShape(hidden=h, ffn=f, gated=up >= 2, qk=h + kv, scores=scores,
                      dropout=lay.act_replicated_nonfloat_bytes > 0)


@dataclass(frozen=True, slots=True)
class FusedBytes:
    """Bytes per token one micro-batch's fused kernels move in a block, forward and
    backward, by where they run under tensor parallelism: ``repl`` outside TP regions
    (every TP rank in full unless sequence parallelism splits them), ``split`` inside them
    (``1/tp`` each), ``core`` on the attention scores (materialized attention only)."""

    repl_fwd: float
    repl_bwd: float
    split_fwd: float
    split_bwd: float
    core_fwd: float
    core_bwd: float


def fused_block_bytes(blk: BlockShape, elem: float, attention: Attention) -> FusedBytes:
    """Per-token bytes of a transformer block's fused memory-bound kernels, as Megatron-LM
    runs them (``e`` bytes per element, ``d`` one byte per mask element where the block
    has dropout, ``h``, ``f`` its widths).

    Forward: two layer norms (Apex fused: read, write: ``2·2h·e``); two bias + dropout +
    residual adds (``bias_dropout_add_fused``: read the branch and the residual, write the
    sum and a mask: ``2·(3h·e + d·h)``); the MLP activation (``bias_gelu`` reads and writes
    ``f``; SwiGLU reads ``2f``, writes ``f``); the attention's layout kernel (materialized:
    the context's ``[b, np, s, hn] -> [s, b, h]`` copy, ``2h·e``; flash: the rotary kernel
    over queries and keys, ``2·qk·e``). Backward: dropout-add backward (read the gradient
    and mask, write: ``2·(2h·e + d·h)``), layer-norm backward (read gradient and input,
    write: ``2·3h·e``), the residual gradients' accumulation (``2·3h·e``), the activation's
    backward (GeLU ``3f·e``, SwiGLU ``5f·e``) and the layout kernel's again. Attention
    scores, materialized: ``FusedScaleMaskSoftmax`` reads and writes each score
    (``2e``), dropout reads it and writes it and a mask (``2e + d``); backward reads the
    gradient and probabilities and writes (``3e``), dropout backward ``2e + d``. Bias
    gradients (a reduction over each biased output gradient, ``9h·e`` for a GPT block)
    are :func:`bias_grad_bytes`'s: they depend on the block's parameters, not its shape.
    """
    h, f = float(blk.hidden), float(blk.ffn)
    d = 1.0 if blk.dropout else 0.0
    act_fwd = (3.0 if blk.gated else 2.0) * f * elem
    act_bwd = (5.0 if blk.gated else 3.0) * f * elem
    layout = 2.0 * (h if attention == "materialized" else blk.qk) * elem
    core_fwd = core_bwd = 0.0
    if attention == "materialized":
        core_fwd = blk.scores * (2 * elem + 2 * elem + d)
        core_bwd = blk.scores * (3 * elem + 2 * elem + d)
    return FusedBytes(
        repl_fwd=2 * 2 * h * elem + 2 * (3 * h * elem + d * h),
        repl_bwd=2 * (2 * h * elem + d * h) + 2 * 3 * h * elem + 2 * 3 * h * elem,
        split_fwd=act_fwd + layout,
        split_bwd=act_bwd + layout,
        core_fwd=core_fwd,
        core_bwd=core_bwd,
    )


#: fp32 bytes per logit element the cross-entropy's forward moves besides reading the 16-bit
#: logits once: Megatron-LM's ``_VocabParallelCrossEntropy`` (``tensor_parallel/
#: cross_entropy.py``) on the ``.float()`` copy of the logits: write that copy (4), the
#: row maximum (read 4), subtract it in place (read, write: 8), ``exp`` in place (8), the row
#: sum (read 4), divide by it in place, the softmax kept for backward (8). The runtime's
#: ``F.cross_entropy`` over fp32 logits makes the same passes (upcast, then log-softmax's
#: maximum, shifted exponential sum and normalisation).
CROSS_ENTROPY_FWD_FP32_BYTES = 36.0
#: ... and its backward besides writing the 16-bit logits' gradient once: scale the kept
#: softmax (less one at the targets, a gather) by the loss gradient in place (read, write:
#: 8) and read it again to cast it back to the logits' dtype (4).
CROSS_ENTROPY_BWD_FP32_BYTES = 12.0


def cross_entropy_bytes(elem: float) -> tuple[float, float]:
    """(forward, backward) bytes per logit element of the cross-entropy over logits of
    ``elem`` bytes per element (see :data:`CROSS_ENTROPY_FWD_FP32_BYTES`): with 16-bit
    logits 38 and 14."""
    return elem + CROSS_ENTROPY_FWD_FP32_BYTES, elem + CROSS_ENTROPY_BWD_FP32_BYTES


def bias_grad_bytes(lay: LayerCost, capture_bytes: float) -> tuple[float, float]:
    """Bytes per token (capture dtype) that a block's bias gradients read in backward:
    (outside TP regions, inside them). Each bias gradient is a reduction over the tokens of
    its linear's output gradient (Megatron-LM's ``grad_output.sum(dim=0)`` in its linear
    layers, or autograd's reduction of the bias broadcast in ``bias_gelu`` and
    ``bias_dropout_add_fused``), so it reads that gradient once. A block's linears carry
    biases when its parameters beyond the linear weights cover one bias element per
    linear output (GPT-2, BLOOM: ``9h`` of them beside four norm vectors of ``h``; a Llama
    block has two ``h`` norm vectors and no bias). Outputs ``h`` wide (the attention's
    output projection, the MLP's down projection: Megatron's row-parallel linears, whose
    bias is added after the reduction) are outside the TP regions; the rest are split.
    (0, 0) for a layer that is not a block."""
    if lay.tp_pairs == 0 or capture_bytes <= 0:
        return 0.0, 0.0
    lin = [g for g in lay.gemms if g.phase == "fwd" and not g.core and g.batch == 1]
    if not lin:
        return 0.0, 0.0
    weights = sum(g.k * g.n * g.count for g in lin)
    outputs = sum(g.n * g.count for g in lin)
    if lay.param_bytes / capture_bytes - weights < outputs:
        return 0.0, 0.0
    h = min(g.k for g in lin)
    repl = sum(g.n * g.count for g in lin if g.n == h)
    return repl * capture_bytes, (outputs - repl) * capture_bytes


@dataclass(frozen=True, slots=True)
class KernelTimes:
    """One layer's forward and backward seconds for one micro-batch on one rank, and the
    attention core's share of the forward (what selective recomputation runs again)."""

    fwd_s: float
    bwd_s: float
    core_fwd_s: float


def _scaled(g: Gemm, tokens: int, r: float, tp: int, split: bool) -> tuple[float, ...]:
    """(batch, m, n, k) of ``g`` at ``r`` times the captured batch on one of ``tp`` ranks."""
    b, m, n, k = float(g.batch), float(g.m), float(g.n), float(g.k)
    if g.core or g.batch > 1:
        b *= r
        if split:
            b /= tp
        return b, m, n, k
    dims = [m, n, k]
    token = next((i for i in (0, 2, 1) if int(dims[i]) == tokens), 0)
    dims[token] *= r
    if split:
        other = max((i for i in range(3) if i != token), key=lambda i: (dims[i], -i))
        dims[other] /= tp
    return b, dims[0], dims[1], dims[2]


def kernel_times(
    lay: LayerCost,
    curve: GemmCurve,
    *,
    peak_flops: float,
    mem_bw: float,
    elem_bytes: float,
    bytes_scale: float,
    tokens: int,
    r: float,
    tp: int = 1,
    sp: bool = False,
    attention: Attention = "flash",
    fusion: Fusion = "none",
    vocab_parallel: bool = False,
) -> KernelTimes:
    """Forward / backward time of ``lay`` (see module docstring).

    Args:
        lay: the layer, with its captured kernels (``gemms`` non-empty).
        curve: the device's GEMM curve.
        peak_flops: the device's dense peak in its compute dtype (FLOP/s).
        mem_bw: the device's datasheet memory bandwidth (bytes/s); kernels reach
            ``curve.stream`` of it.
        elem_bytes: bytes per element of the compute dtype (matrix operands).
        bytes_scale: captured bytes → bytes in the compute dtype.
        tokens: the capture's tokens per batch (a matrix dimension equal to it scales with
            the micro-batch).
        r: micro-batch / captured batch.
        tp: tensor-parallel degree (applies to a layer with Megatron pairs).
        sp: sequence parallelism (splits the replicated kernels too).
        attention: ``flash`` or ``materialized`` (see module docstring).
        fusion: ``none`` (captured kernels) or ``fused`` (the engine's fused block kernels,
            :func:`fused_block_bytes`; layers that are not blocks keep their captured bytes).
        vocab_parallel: the LM head is split across the ``tp`` ranks by vocabulary
            (Megatron-LM's column-parallel output layer with a vocab-parallel
            cross-entropy): its products run ``1/tp`` of the vocabulary on each rank.
    """
    split = tp > 1 and (lay.tp_pairs > 0 or (vocab_parallel and lay.kind == "head"))
    mem_bw = mem_bw * curve.stream
    fwd = bwd = core_fwd = 0.0
    for g in lay.gemms:
        b, m, n, k = _scaled(g, tokens, r, tp, split)
        flops = 2.0 * g.count * b * m * n * k
        t = flops / (peak_flops * gemm_efficiency(curve, b, m, n))
        if not (g.core and attention == "flash"):
            t = max(t, g.count * elem_bytes * b * (m * k + k * n + m * n) / mem_bw)
        if g.phase == "fwd":
            fwd += t
            core_fwd += t if g.core else 0.0
        else:
            bwd += t
    if lay.kind == "head" and lay.act_out_bytes:
        logits = lay.act_out_bytes * bytes_scale / elem_bytes * r / (tp if split else 1)
        ce_fwd, ce_bwd = cross_entropy_bytes(elem_bytes)
        fwd += logits * ce_fwd / mem_bw
        bwd += logits * ce_bwd / mem_bw
    blk = block_shape(lay, tokens) if fusion == "fused" else None
    if blk is not None:
        fb = fused_block_bytes(blk, elem_bytes, attention)
        tok = tokens * r / mem_bw
        repl_div = tp if split and sp else 1
        split_div = tp if split else 1
        bias_repl, bias_split = bias_grad_bytes(lay, elem_bytes / bytes_scale)
        fwd += tok * (fb.repl_fwd / repl_div + fb.split_fwd / split_div)
        bwd += tok * (fb.repl_bwd / repl_div + fb.split_bwd / split_div)
        bwd += tok * bytes_scale * (bias_repl / repl_div + bias_split / split_div)
        core_mem = tok * fb.core_fwd / split_div
        fwd += core_mem
        core_fwd += core_mem
        bwd += tok * fb.core_bwd / split_div
        return KernelTimes(fwd, bwd, core_fwd)
    share = 1.0
    if split:
        repl = (lay.act_replicated_bytes / lay.act_saved_bytes
                if lay.act_saved_bytes and not sp else 0.0)
        share = repl + (1.0 - repl) / tp
    mem_scale = r * bytes_scale / mem_bw
    fwd += lay.mem_fwd_bytes * share * mem_scale
    bwd += lay.mem_bwd_bytes * share * mem_scale
    if attention == "materialized":
        core_div = tp if split else 1
        core_mem = lay.core_mem_fwd_bytes * mem_scale / core_div
        fwd += core_mem
        core_fwd += core_mem
        bwd += lay.core_mem_bwd_bytes * mem_scale / core_div
    return KernelTimes(fwd, bwd, core_fwd)
