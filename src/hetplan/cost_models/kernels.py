"""Kernel-level compute cost: a layer's time from the shapes of its matrix multiplies and the
bytes its other kernels move (what capture records, :mod:`hetplan.ir.kernels`).

Three kinds of work, each priced by what bounds it on the device:

1. **Matrix multiplies** (``mm``, ``addmm``, ``bmm``), one shape at a time::

       t = max(2·b·m·n·k / (peak · e(b, m, n)),  bytes(b, m, n, k) / memory bandwidth)

   ``e`` is the device's GEMM efficiency curve (:class:`GemmCurve`): the largest fraction of
   the dense 16-bit peak a matrix multiply reaches on it (its *ceiling*, a published
   measurement), times the work lost to **tile and wave quantization**: cuBLAS cuts the
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
   embedding's gather): the bytes they read and write over the memory bandwidth, each kernel
   on its own (no fusion assumed).

Tensor parallelism (``tp``): a layer with Megatron pairs runs ``1/tp`` of its attention heads
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
           "kernel_times", "Attention", "ATTENTION_KERNELS"]

Attention = Literal["flash", "materialized"]
#: How the attention core runs (see module docstring).
ATTENTION_KERNELS: tuple[str, ...] = ("flash", "materialized")


@dataclass(frozen=True, slots=True)
class GemmCurve:
    """A device type's matrix-multiply efficiency (see module docstring).

    Attributes:
        sms: streaming multiprocessors (one thread block each per wave).
        tiles: the output tile shapes ``(Tm, Tn)`` cuBLAS picks from.
        ceiling: the largest measured fraction of the dense 16-bit tensor-core peak.
        source: where ``ceiling`` and ``sms`` come from.
    """

    sms: int
    tiles: tuple[tuple[int, int], ...]
    ceiling: float
    source: str


#: cuBLAS's large tiles on Ampere and Hopper (User's Guide, "Typical Tile Dimensions In
#: cuBLAS And Performance": 256x128 and 128x256 are the most efficient, 128x128 next).
_TILES = ((256, 128), (128, 256), (128, 128))

#: Per device-type family (the type name's prefix before ``-``).
GEMM_CURVES: dict[str, GemmCurve] = {
    "A100": GemmCurve(
        sms=108, tiles=_TILES, ceiling=267.9 / 312.0,
        source="A100 SXM bf16 matmul 267.9 of 312 TFLOP/s (ml-engineering MAMF table); "
               "108 SMs (A100 datasheet)"),
    "H100": GemmCurve(
        sms=132, tiles=_TILES, ceiling=792.1 / 989.4,
        source="H100 SXM bf16 matmul 792.1 of 989 TFLOP/s (ml-engineering MAMF table); "
               "132 SMs (H100 SXM5 datasheet)"),
    # the H100's compute die with 141 GB HBM3e: same SMs and dense peak
    "H200": GemmCurve(
        sms=132, tiles=_TILES, ceiling=785.0 / 989.4,
        source="H200 bf16 matmul 785 of 989 TFLOP/s, the best of hetplan's own GEMM sweep "
               "(bench/results/gpu_kernels_nvidia_h200.json); 132 SMs (as reported by torch)"),
}


def curve_for(device_type: str) -> GemmCurve | None:
    """The curve of ``device_type`` (by family: ``A100-80GB`` → ``A100``), or None."""
    return GEMM_CURVES.get(device_type.split("-")[0])


def gemm_efficiency(curve: GemmCurve, batch: float, m: float, n: float) -> float:
    """Fraction of peak a ``batch x (m x n)``-output matrix multiply reaches: the ceiling
    times the best tile shape's useful share of the waves it occupies."""
    if batch <= 0 or m <= 0 or n <= 0:
        return curve.ceiling
    best = 0.0
    for tm, tn in curve.tiles:
        tiles = math.ceil(batch) * math.ceil(m / tm) * math.ceil(n / tn)
        waves = math.ceil(tiles / curve.sms)
        best = max(best, batch * m * n / (waves * curve.sms * tm * tn))
    return curve.ceiling * min(best, 1.0)


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
) -> KernelTimes:
    """Forward / backward time of ``lay`` (see module docstring).

    Args:
        lay: the layer, with its captured kernels (``gemms`` non-empty).
        curve: the device's GEMM curve.
        peak_flops: the device's dense peak in its compute dtype (FLOP/s).
        mem_bw: the device's memory bandwidth (bytes/s).
        elem_bytes: bytes per element of the compute dtype (matrix operands).
        bytes_scale: captured bytes → bytes in the compute dtype.
        tokens: the capture's tokens per batch (a matrix dimension equal to it scales with
            the micro-batch).
        r: micro-batch / captured batch.
        tp: tensor-parallel degree (applies to a layer with Megatron pairs).
        sp: sequence parallelism (splits the replicated kernels too).
        attention: ``flash`` or ``materialized`` (see module docstring).
    """
    split = tp > 1 and lay.tp_pairs > 0
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
