"""Compute cost per layer and device type: profiled first, roofline otherwise.

For each layer of a workload (:class:`~hetplan.ir.plan_sections.WorkloadSummary`) and a device,
the forward and backward time of one micro-batch comes from, in order:

1. ``profiled``: the profile DB record for the layer's per-sample signature on that device
   type, in the device type's compute dtype (the plan's precision; fp32 without one), measured
   at the micro-batch nearest the one asked for and scaled linearly from it, divided by the
   device's slowdown. A record in another dtype is never used: an fp32 time says little about
   a bf16 run (the H200 in ``bench/results/gpu_kernels_nvidia_h200.json`` runs large GEMMs
   14x faster in bf16 than in fp32);
2. ``measured``: a benchmark workload's recorded backprop time (``measured_bwd_us``, V100), the
   forward taken as half of it, scaled by the device's fp32 peak relative to a V100 SXM2;
3. ``kernels``: on a device type with a GEMM efficiency curve (A100, H100), from the
   layer's captured kernels: each matrix multiply by its shape on the curve, the attention
   core fused or materialized, the other kernels by the bytes they move
   (:mod:`hetplan.cost_models.kernels`). A tensor-parallel layer is priced as one rank of
   its TP group runs it (``tp``), so small per-rank shapes lose efficiency as they do;
4. ``analytic``: a roofline, ``max(FLOPs / (peak · efficiency), bytes / memory bandwidth)``,
   where bytes are the parameters read plus the activations read and written (backward: twice
   the parameters — read weights, write gradients — plus the saved activations and the
   incoming and outgoing gradients). Each device type is priced in its own compute dtype
   (the plan's :class:`~hetplan.ir.plan_sections.Precision`): the peak its
   ``DevicePrecision.peak_dtype`` names, and bytes in that dtype (the workload's captured
   bytes times compute over captured element size). A dtype the device lists no peak for
   runs at its fp32 peak.

With ``require_profiled=True`` a missing profile raises :class:`MissingProfileError` listing
every missing (layer, device type) key instead of falling back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from hetplan.cost_models.kernels import (
    ATTENTION_KERNELS,
    FUSIONS,
    Attention,
    Fusion,
    curve_for,
    kernel_times,
)
from hetplan.cost_models.engine_memory import splits_vocabulary
from hetplan.cost_models.memory import capture_bytes
from hetplan.cost_models.precision import DTYPE_SIZE
from hetplan.cost_models.profile_db import ProfileDB
from hetplan.errors import MissingProfileError
from hetplan.ir.cluster import Device
from hetplan.ir.plan_sections import LayerCost, Precision, WorkloadSummary

__all__ = ["LayerTime", "ComputeModel", "V100_FP32_FLOPS", "vocab_split", "workload_tokens"]

#: The device the Espresso benchmark workloads were measured on (V100 SXM2, fp32 FLOP/s).
V100_FP32_FLOPS = 15.7e12


@dataclass(frozen=True, slots=True)
class LayerTime:
    """Forward and backward time of one layer for one micro-batch, and where it came from.

    ``per_rank``: the times are already one TP rank's (``kernels`` priced at ``tp``);
    otherwise a TP layer's times are the whole layer's and the caller divides them.
    ``core_fwd_s``: the attention core's share of ``fwd_s`` where it was priced apart
    (``kernels``), else None (callers take the core's FLOP share of ``fwd_s``)."""

    fwd_s: float
    bwd_s: float
    source: str  # "profiled" | "measured" | "kernels" | "analytic"
    per_rank: bool = False
    core_fwd_s: float | None = None


class ComputeModel:
    """Per-layer compute times (see module docstring).

    Args:
        db: profile DB (or None: no profiled times).
        efficiency: fraction of peak FLOP/s the roofline assumes dense layers reach.
        dtype: the compute dtype whose peak the roofline uses (``fp32``, ``bf16`` ...) on a
            device type ``precision`` does not list (its fp32 peak if it lists none for it).
        require_profiled: raise instead of falling back to analytic estimates.
        precision: the compute dtype of each device type (None: ``dtype`` everywhere).
        attention: how the attention core runs: ``flash`` (fused) or ``materialized``.
        fusion: which memory-bound kernels the engine fuses: ``none`` (each captured kernel
            alone) or ``fused`` (:func:`~hetplan.cost_models.kernels.fused_block_bytes`).
        vocab_parallel: the model's LM head is split across TP ranks by vocabulary
            (:meth:`tp_divisor`): the plan's ``cost_settings.vocab_parallel == "split"``,
            which the planner states only for a model whose head has its ``V x h`` token
            embedding (:func:`~hetplan.cost_models.engine_memory.splits_vocabulary`, the
            pair the runtime's ``shard_vocab`` splits, with a vocabulary-parallel
            cross-entropy). Build it through :func:`vocab_split` so a head without that
            pair is never priced split.
        kernel_devices: price layers by their kernels on device types that have a GEMM
            curve. :class:`~hetplan.cost_models.costs.CostModel` sets it False when some device
            type of the cluster has none: every device of a plan is then priced by the same
            roofline, because the passes compare devices with each other (TP shard sizes, stage
            balancing), and a kernel-priced A100 beside a roofline-priced V100 would compare
            two models, not two devices (the kernel model's wave quantization made an A100
            slower than a V100 on small layers).
    """

    def __init__(
        self,
        db: ProfileDB | None = None,
        *,
        efficiency: float = 0.5,
        dtype: str = "fp32",
        require_profiled: bool = False,
        precision: Precision | None = None,
        attention: Attention = "flash",
        kernel_devices: bool = True,
        fusion: Fusion = "none",
        vocab_parallel: bool = False,
    ) -> None:
        if not 0 < efficiency <= 1:
            raise ValueError(f"efficiency must be in (0, 1], got {efficiency}")
        if attention not in ATTENTION_KERNELS:
            raise ValueError(f"attention must be one of {ATTENTION_KERNELS}, got {attention!r}")
        self.attention: Attention = attention
        if fusion not in FUSIONS:
            raise ValueError(f"fusion must be one of {FUSIONS}, got {fusion!r}")
        self.fusion: Fusion = fusion
        self.vocab_parallel = vocab_parallel
        self.kernel_devices = kernel_devices
        self.db = db
        self.efficiency = efficiency
        self.dtype = dtype
        self.require_profiled = require_profiled
        self.precision = precision
        self._cache: dict[tuple[int, str, float, int, int, bool],
                          tuple[object, list[LayerTime]]] = {}

    def tp_divisor(self, lay: LayerCost, tp: int) -> int:
        """What one rank of a ``tp``-way group runs of ``lay``'s single-rank time, as a
        divisor: ``tp`` for a layer with Megatron pairs and, with ``vocab_parallel``, for the
        LM head (its vocabulary is split: ``vocab_parallel`` is only set for a model whose
        head has its ``V x h`` embedding, see :func:`vocab_split`); 1 for a layer every rank
        runs whole."""
        split = lay.tp_pairs > 0 or (self.vocab_parallel and lay.kind == "head")
        return tp if tp > 1 and split else 1

    def layer_times(
        self, workload: WorkloadSummary, device: Device, micro_batch: int, *, tp: int = 1,
        sp: bool = False,
    ) -> list[LayerTime]:
        """Times of every layer of ``workload`` on ``device`` for a micro-batch of that size
        (``tp`` / ``sp``: price a TP layer as one rank of a ``tp``-way group runs it, where
        the layer's kernels allow; such times say ``per_rank``)."""
        key = (id(workload), device.type, device.slowdown, micro_batch, tp, sp)
        cached = self._cache.get(key)
        if cached is not None and cached[0] is workload:
            return cached[1]
        scale = micro_batch / workload.batch_size
        bytes_scale = self._bytes_scale(workload, device)
        tokens = workload_tokens(workload)
        times = [self._one(lay, device, scale, bytes_scale, micro_batch, tokens, tp, sp)
                 for lay in workload.layers]
        if self.require_profiled:
            missing = [
                f"{lay.name} (signature {lay.signature}) on {device.type}"
                for lay, t in zip(workload.layers, times)
                if t.source != "profiled"
            ]
            if missing:
                raise MissingProfileError(
                    f"no profiled compute time for {len(missing)} layer(s): "
                    + "; ".join(missing[:8])
                    + (" …" if len(missing) > 8 else "")
                    + ". Run `hetplan profile --model …` on that device type, or drop "
                    "--require-profiled to use analytic estimates"
                )
        self._cache[key] = (workload, times)
        return times

    def peak_dtype(self, device: Device) -> str:
        """The dtype whose peak prices ``device`` (see module docstring)."""
        if self.precision is not None and device.type in self.precision.devices:
            return self.precision.devices[device.type].peak_dtype
        listed = {name for name, _ in device.peak_flops}
        key = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(self.dtype,
                                                                              self.dtype)
        return key if key in listed else "fp32"

    def _bytes_scale(self, workload: WorkloadSummary, device: Device) -> float:
        """Captured bytes → bytes in ``device``'s compute dtype."""
        if self.precision is None or device.type not in self.precision.devices:
            return 1.0
        size = DTYPE_SIZE[self.precision.devices[device.type].compute_dtype]
        return size / capture_bytes(workload)

    def compute_dtype(self, device: Device) -> str:
        """The dtype ``device`` computes in: the plan's precision, else ``dtype``."""
        if self.precision is not None and device.type in self.precision.devices:
            return self.precision.devices[device.type].compute_dtype
        return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(self.dtype,
                                                                             self.dtype)

    def _one(self, lay: LayerCost, device: Device, scale: float,
             bytes_scale: float = 1.0, micro_batch: int = 1, tokens: int = 0, tp: int = 1,
             sp: bool = False) -> LayerTime:
        if self.db is not None and lay.signature:
            rec = self.db.compute_record(lay.signature, device.type,
                                         self.compute_dtype(device), micro_batch)
            if rec is not None:
                speed = 1.0 / device.slowdown
                rscale = micro_batch / rec.batch_size
                return LayerTime(
                    rec.fwd_ms * 1e-3 * rscale / speed, rec.bwd_ms * 1e-3 * rscale / speed,
                    "profiled",
                )
        if lay.measured_bwd_us is not None:
            ratio = V100_FP32_FLOPS / device.flops("fp32")
            bwd = lay.measured_bwd_us * 1e-6 * scale * ratio
            return LayerTime(bwd / 2, bwd, "measured")
        curve = curve_for(device.type) if self.kernel_devices else None
        if curve is not None and lay.gemms:
            dtype = self.peak_dtype(device)
            k = kernel_times(
                lay, curve, peak_flops=device.flops(dtype),
                mem_bw=device.mem_bandwidth_bytes_per_s,
                elem_bytes=DTYPE_SIZE.get(dtype, 4), bytes_scale=bytes_scale, tokens=tokens,
                r=scale, tp=tp, sp=sp, attention=self.attention,
                fusion=self.fusion, vocab_parallel=self.vocab_parallel)
            return LayerTime(k.fwd_s, k.bwd_s, "kernels", per_rank=tp > 1,
                             core_fwd_s=k.core_fwd_s)
        return self._roofline(lay, device, scale, bytes_scale)

    def _roofline(self, lay: LayerCost, device: Device, scale: float,
                  bytes_scale: float = 1.0) -> LayerTime:
        peak = device.flops(self.peak_dtype(device)) * self.efficiency
        bw = device.mem_bandwidth_bytes_per_s / bytes_scale
        act = (lay.act_in_bytes + lay.act_out_bytes) * scale
        fwd = max(lay.fwd_flops * scale / peak, (lay.param_bytes + act) / bw)
        bwd_bytes = 2 * lay.param_bytes + lay.act_saved_bytes * scale + act
        bwd = max(lay.bwd_flops * scale / peak, bwd_bytes / bw)
        return LayerTime(fwd, bwd, "analytic")

    @staticmethod
    def sources(times: Sequence[LayerTime]) -> dict[str, int]:
        """How many layers got their time from each source."""
        out: dict[str, int] = {}
        for t in times:
            out[t.source] = out.get(t.source, 0) + 1
        return out


def workload_tokens(workload: WorkloadSummary) -> int:
    """Tokens (or samples) of the capture's first input: a matrix dimension equal to it
    grows with the micro-batch."""
    if not workload.input_shapes or not workload.input_shapes[0]:
        return workload.batch_size
    return math.prod(workload.input_shapes[0])


def vocab_split(requested: bool, workload: WorkloadSummary | None) -> bool:
    """Whether the LM head of ``workload`` runs vocabulary-parallel (under ``tp > 1``):
    ``requested`` (the plan's ``cost_settings.vocab_parallel == "split"``, or the compile
    option) and the model has the ``V x h`` embedding pair the runtime splits
    (:func:`~hetplan.cost_models.engine_memory.splits_vocabulary`). The one rule
    ``compile``, ``simulate`` and the heterogeneous search build their cost model with."""
    if not requested or workload is None:
        return False
    return splits_vocabulary(workload.layers, capture_bytes(workload))
