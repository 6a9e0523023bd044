"""Compression cost: (de)compression time per compressor, device and size, and wire ratios.

Compressors (:data:`COMPRESSORS`, with their default parameters, from
:mod:`hetplan.ir.compressors`): the casts ``fp16`` and ``bf16``; the sparsifiers ``topk``,
``randomk`` and ``dgc``; the quantizers ``efsignsgd``, ``onebit`` and ``qsgd``; and the
low-rank ``powersgd``. Each runs on a ``gpu`` or a ``cpu`` (Espresso's dimension 2).

**Wire ratio** (compressed bytes / raw bytes, raw gradients taken as fp32, metadata such as a
scale or norm ignored; zen_espresso §E.4(c)):

* casts: 0.5;
* sparsifiers keeping a fraction ``ratio`` (default 0.01) of the elements: ``2 * ratio``
  (an fp32 value plus an int32 index per kept element);
* ``efsignsgd`` and ``onebit``: 1/32;
* ``qsgd`` with ``levels`` s (default 127): ``(1 + ceil(log2(s + 1))) / 32``, a sign bit plus
  the level index in 0..s (s = 127 gives 8 bits, 0.25);
* ``powersgd`` with rank r (default 4): a tensor is viewed as an m×n matrix (m = first
  dimension, n = the product of the rest) and sends P (m×r) and Q (n×r), so
  ``min(1, r(m + n) / (m n))``; 1-D tensors are sent raw (1.0). Without a shape the matrix is
  taken as square with ``nbytes / 4`` elements: ``min(1, 2r / sqrt(numel))``.

**Time models** (all callables ``nbytes -> seconds``):

* :class:`AffineTime`: ``alpha + beta * nbytes`` (Cupcake's h(x) = α_h + β_h·x);
* :class:`PiecewiseTime`: constant up to a threshold, then linear and continuous (the thesis
  observes constant encode/decode time below ≈ 4 MB on V100, then almost linear);
* :class:`TableTime`: measured points interpolated linearly (from the profile DB).

**Defaults** (``source="analytic"``, zen_espresso §E.4(d), reference-code constants):

* GPU: :class:`PiecewiseTime` with threshold 4 MiB (2^20 fp32 elements), constants from the
  Espresso code's "compress" option on V100 (encode = total − decode): randomk 54/34 µs
  (encode/decode), dgc 356/34, efsignsgd 130/140, onebit 450/170, casts 4/22 (its FP16 option).
  Not in the reference code, so assumed: ``topk`` = dgc (both select top-k), ``qsgd`` = onebit
  (quantize and pack bits), ``powersgd`` 300/34 (two thin matmuls and an orthogonalisation; a
  placeholder, profile it). Above the threshold time grows in proportion to size on V100; on
  another GPU the slope is scaled by 900 GB/s over the device's memory bandwidth (divided by
  its ``slowdown``), the constant part (kernel launches) is not.
* CPU: a pure-throughput :class:`AffineTime` at 20 Gbit/s (``t = bytes * 8 / 20e9``) for
  compression and decompression alike (the reference code's model of a GPU machine's host
  CPUs). When the device type itself is ``cpu`` (the training process's own cores run the
  runtime's torch compressors, as in gloo runs) each call also pays a fixed
  :data:`CPU_DEVICE_CALL_S` (compress, decompress): the dispatch of the compressor's few
  torch ops, which the thesis' GPU kernels pay as their constant part. Without it a 3 KiB
  LayerNorm gradient looks free to compress on a CPU cluster (decision in
  ``docs/decisions.md``, "End-to-end runs").

Profiled records (:class:`~.profile_db.CompressorRecord`) replace the defaults for their
``(compressor, device_kind, device_type)``.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal, Protocol

from hetplan.cost_models.profile_db import CompressorRecord, ProfileDB
from hetplan.errors import SpecError
from hetplan.ir.cluster import DEVICE_CATALOGUE, ClusterSpec, DeviceSpec
from hetplan.ir.compressors import (
    COMPRESSORS,
    DEFAULT_POWERSGD_RANK,
    DEFAULT_QSGD_LEVELS,
    DEFAULT_SPARSITY_RATIO,
    Compressor,
)
from hetplan.ir.validation import did_you_mean

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "COMPRESSORS",
    "CPU_DEVICE_CALL_S",
    "CPU_THROUGHPUT_BITS_PER_S",
    "DEFAULT_POWERSGD_RANK",
    "DEFAULT_QSGD_LEVELS",
    "DEFAULT_SPARSITY_RATIO",
    "GPU_THRESHOLD_BYTES",
    "REFERENCE_MEM_BANDWIDTH_GB_S",
    "AffineTime",
    "CompressionCost",
    "CompressionModel",
    "Compressor",
    "PiecewiseTime",
    "SPARSIFIERS",
    "TableTime",
    "time_array",
    "TimeModel",
    "wire_ratio",
]

#: The compressors that keep a fraction (``ratio``) of the elements, as values and indices.
SPARSIFIERS = ("topk", "randomk", "dgc")
#: GPU (de)compression time is constant up to this size (2^20 fp32 elements).
GPU_THRESHOLD_BYTES = 4 * 2**20
#: Memory bandwidth of the V100 the reference constants were measured on.
REFERENCE_MEM_BANDWIDTH_GB_S = 900.0
#: CPU compression throughput of the reference model.
CPU_THROUGHPUT_BITS_PER_S = 20e9
#: Fixed (compress, decompress) seconds per call on the ``cpu`` device type: the runtime's
#: top-k on a 3 KiB tensor took 95 / 22 us on one core of the development machine (error
#: feedback included); rounded down, as cheaper compressors (casts) dispatch fewer ops.
CPU_DEVICE_CALL_S = (50e-6, 20e-6)

# (encode µs, decode µs) on a V100 for tensors up to GPU_THRESHOLD_BYTES.
_GPU_REFERENCE_US: dict[str, tuple[float, float]] = {
    "fp16": (4.0, 22.0),
    "bf16": (4.0, 22.0),
    "randomk": (54.0, 34.0),
    "dgc": (356.0, 34.0),
    "topk": (356.0, 34.0),
    "efsignsgd": (130.0, 140.0),
    "onebit": (450.0, 170.0),
    "qsgd": (450.0, 170.0),
    "powersgd": (300.0, 34.0),
}


class TimeModel(Protocol):
    """A time as a function of raw bytes."""

    def __call__(self, nbytes: float) -> float: ...


@dataclass(frozen=True, slots=True)
class AffineTime:
    """``alpha_s + beta_s_per_byte * nbytes`` (0 for 0 bytes)."""

    alpha_s: float
    beta_s_per_byte: float

    def __call__(self, nbytes: float) -> float:
        return self.alpha_s + self.beta_s_per_byte * nbytes if nbytes > 0 else 0.0


@dataclass(frozen=True, slots=True)
class PiecewiseTime:
    """``constant_s`` up to ``threshold_bytes``, then ``+ beta_s_per_byte`` per extra byte.

    Continuous at the threshold; 0 for 0 bytes.
    """

    constant_s: float
    threshold_bytes: float
    beta_s_per_byte: float

    def __call__(self, nbytes: float) -> float:
        if nbytes <= 0:
            return 0.0
        extra = nbytes - self.threshold_bytes
        return self.constant_s + self.beta_s_per_byte * extra if extra > 0 else self.constant_s


@dataclass(frozen=True, slots=True)
class TableTime:
    """Measured ``(nbytes, seconds)`` points, linearly interpolated.

    Below the smallest size the first time is used (fixed overhead dominates); above the
    largest the line through the last two points is extended (slope clamped at ≥ 0), or with
    a single point time grows in proportion to size. 0 for 0 bytes.
    """

    sizes: tuple[float, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.sizes or len(self.sizes) != len(self.seconds):
            raise ValueError("TableTime needs as many seconds as sizes, and at least one")
        if any(b <= a for a, b in zip(self.sizes, self.sizes[1:])):
            raise ValueError(f"TableTime sizes must increase strictly, got {self.sizes}")

    def __call__(self, nbytes: float) -> float:
        if nbytes <= 0:
            return 0.0
        xs, ys = self.sizes, self.seconds
        if nbytes <= xs[0]:
            return ys[0]
        if nbytes >= xs[-1]:
            if len(xs) == 1:
                return ys[0] * nbytes / xs[0] if xs[0] > 0 else ys[0]
            slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
            return ys[-1] + slope * (nbytes - xs[-1])
        i = bisect.bisect_right(xs, nbytes)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (nbytes - x0) / (x1 - x0)


def time_array(model: TimeModel, nbytes: Sequence[float] | np.ndarray) -> np.ndarray:
    """``model`` at every size of ``nbytes`` (for cost tables over many sizes at once).

    The built-in models (:class:`AffineTime`, :class:`PiecewiseTime`, :class:`TableTime`) are
    evaluated with numpy using the same float operations as their ``__call__``, so every
    value is bit-identical to ``model(x)``; any other model is called once per size.
    """
    import numpy as np

    x = np.asarray(nbytes, dtype=float)
    if isinstance(model, AffineTime):
        return np.where(x > 0, model.alpha_s + model.beta_s_per_byte * x, 0.0)
    if isinstance(model, PiecewiseTime):
        extra = x - model.threshold_bytes
        t = np.where(extra > 0, model.constant_s + model.beta_s_per_byte * extra,
                     model.constant_s)
        return np.where(x > 0, t, 0.0)
    if isinstance(model, TableTime):
        return _table_array(model, x)
    return np.array([model(float(v)) for v in x.ravel()], dtype=float).reshape(x.shape)


def _table_array(model: TableTime, x: np.ndarray) -> np.ndarray:
    """:meth:`TableTime.__call__` over an array, branch by branch with the same operations."""
    import numpy as np

    xs, ys = model.sizes, model.seconds
    if len(xs) == 1:
        above = ys[0] * x / xs[0] if xs[0] > 0 else np.full_like(x, ys[0])
        out = above.copy()
    else:
        ax, ay = np.asarray(xs), np.asarray(ys)
        i = np.clip(np.searchsorted(ax, x, side="right"), 1, len(xs) - 1)
        x0, x1, y0, y1 = ax[i - 1], ax[i], ay[i - 1], ay[i]
        out = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
        hi = x >= xs[-1]
        out[hi] = ys[-1] + slope * (x[hi] - xs[-1])
    out[x <= xs[0]] = ys[0]
    out[x <= 0] = 0.0
    return out


def wire_ratio(
    compressor: str,
    *,
    nbytes: float | None = None,
    shape: Sequence[int] | None = None,
    ratio: float = DEFAULT_SPARSITY_RATIO,
    levels: int = DEFAULT_QSGD_LEVELS,
    rank: int = DEFAULT_POWERSGD_RANK,
) -> float:
    """Compressed bytes / raw fp32 bytes of ``compressor`` (see the module docstring).

    Args:
        compressor: one of :data:`COMPRESSORS`.
        nbytes: raw size; used only by ``powersgd`` without ``shape``.
        shape: tensor shape; used only by ``powersgd``.
        ratio: fraction of elements a sparsifier keeps, in (0, 1].
        levels: QSGD quantization levels s ≥ 1.
        rank: PowerSGD rank ≥ 1.

    Raises:
        SpecError: unknown compressor or parameter out of range.
        ValueError: ``powersgd`` without ``shape`` or ``nbytes``.
    """
    _check_compressor(compressor)
    if compressor in ("fp16", "bf16"):
        return 0.5
    if compressor in SPARSIFIERS:
        if not 0 < ratio <= 1:
            raise SpecError(f"sparsifier ratio must be in (0, 1], got {ratio!r}")
        return min(1.0, 2.0 * ratio)
    if compressor in ("efsignsgd", "onebit"):
        return 1.0 / 32
    if compressor == "qsgd":
        if levels < 1:
            raise SpecError(f"qsgd levels must be >= 1, got {levels!r}")
        return min(1.0, (1 + math.ceil(math.log2(levels + 1))) / 32)
    if rank < 1:
        raise SpecError(f"powersgd rank must be >= 1, got {rank!r}")
    if shape is not None:
        if len(shape) < 2:
            return 1.0
        m, n = shape[0], math.prod(shape[1:])
        return min(1.0, rank * (m + n) / (m * n)) if m * n > 0 else 1.0
    if nbytes is None:
        raise ValueError("powersgd's wire ratio depends on the tensor: pass shape or nbytes")
    numel = nbytes / 4
    return min(1.0, 2.0 * rank / math.sqrt(numel)) if numel > 0 else 1.0


@dataclass(frozen=True, slots=True)
class CompressionCost:
    """Time and wire ratio of one compressor on one kind of device.

    Attributes:
        compressor / device_kind / device_type: what it is for (``device_type`` None: the
            reference V100 constants, unscaled).
        compress / decompress: time models over raw bytes.
        source: ``"profiled"`` or ``"analytic"``; ``detail`` says how.
        ratio / levels / rank: the compressor parameters the wire ratio uses.
    """

    compressor: str
    device_kind: Literal["gpu", "cpu"]
    device_type: str | None
    compress: TimeModel
    decompress: TimeModel
    source: Literal["profiled", "analytic"]
    detail: str = ""
    ratio: float = DEFAULT_SPARSITY_RATIO
    levels: int = DEFAULT_QSGD_LEVELS
    rank: int = DEFAULT_POWERSGD_RANK

    def compress_s(self, nbytes: float) -> float:
        """Seconds to compress a tensor of ``nbytes`` raw bytes."""
        return self.compress(nbytes)

    def decompress_s(self, nbytes: float) -> float:
        """Seconds to decompress back to a tensor of ``nbytes`` raw bytes."""
        return self.decompress(nbytes)

    def wire_ratio(self, nbytes: float | None = None, shape: Sequence[int] | None = None) -> float:
        """Compressed / raw bytes; only ``powersgd`` needs ``shape`` (or ``nbytes``)."""
        return wire_ratio(self.compressor, nbytes=nbytes, shape=shape, ratio=self.ratio,
                          levels=self.levels, rank=self.rank)

    def wire_bytes(self, nbytes: float, shape: Sequence[int] | None = None) -> float:
        """Bytes on the wire for a tensor of ``nbytes`` raw bytes."""
        return nbytes * self.wire_ratio(nbytes, shape)


class CompressionModel:
    """Compression costs on a cluster: profiled where the DB has them, else the defaults.

    Args:
        cluster: gives device types (memory bandwidth scales the GPU defaults).
        db: measured compressors; None for analytic only.
    """

    def __init__(self, cluster: ClusterSpec, db: ProfileDB | None = None) -> None:
        self.cluster = cluster
        self.db = db
        used = sorted({g.type for node in cluster.nodes for g in node.devices})
        self._default_type = used[0] if len(used) == 1 else None
        self._cache: dict[tuple[object, ...], CompressionCost] = {}

    def cost(
        self,
        compressor: str,
        device_kind: Literal["gpu", "cpu"],
        device_type: str | None = None,
        *,
        ratio: float = DEFAULT_SPARSITY_RATIO,
        levels: int = DEFAULT_QSGD_LEVELS,
        rank: int = DEFAULT_POWERSGD_RANK,
    ) -> CompressionCost:
        """The cost of ``compressor`` on a ``device_kind`` of a ``device_type`` machine.

        Args:
            compressor: one of :data:`COMPRESSORS`.
            device_kind: ``"gpu"`` or ``"cpu"``.
            device_type: a device type of the cluster; None means the cluster's only device
                type if it has one, else the reference V100 (unscaled).
            ratio / levels / rank: compressor parameters (see :func:`wire_ratio`).

        Raises:
            SpecError: unknown compressor, device kind or device type. A ``gpu`` cost asked
                of the ``cpu`` device type is its CPU cost (the device itself).
        """
        key = (compressor, device_kind, device_type, ratio, levels, rank)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        _check_compressor(compressor)
        if device_kind not in ("gpu", "cpu"):
            raise SpecError(f"device_kind must be 'gpu' or 'cpu', got {device_kind!r}")
        wire_ratio(compressor, nbytes=1.0, ratio=ratio, levels=levels, rank=rank)  # validate
        dtype = device_type if device_type is not None else self._default_type
        spec = self._device_spec(dtype) if dtype is not None else None
        if device_kind == "gpu" and dtype == "cpu":
            # a plan's "gpu" means the gradient's own device (as the runtime runs it); on the
            # cpu device type that is the training process's cores: the CPU cost, on the
            # compute resource (the caller's choice of resource)
            device_kind = "cpu"
        record = (
            self.db.compressor(compressor, device_kind, dtype)
            if self.db is not None and dtype is not None else None
        )
        if record is not None:
            comp, decomp = _tables(record)
            result = CompressionCost(
                compressor, device_kind, dtype, comp, decomp, "profiled",
                f"{len(record.samples)} samples on {dtype} ({device_kind})",
            )
        elif device_kind == "cpu":
            result = _cpu_default(compressor, dtype)
        else:
            result = _gpu_default(compressor, dtype, spec)
        result = replace(result, ratio=ratio, levels=levels, rank=rank)
        self._cache[key] = result
        return result

    def _device_spec(self, device_type: str) -> DeviceSpec:
        spec = self.cluster.device_types.get(device_type) or DEVICE_CATALOGUE.get(device_type)
        if spec is None:
            names = sorted(set(self.cluster.device_types) | set(DEVICE_CATALOGUE))
            raise SpecError(
                f"unknown device type {device_type!r}{did_you_mean(device_type, names)} "
                f"(known: {', '.join(names)})"
            )
        return spec


def _gpu_default(
    compressor: str, device_type: str | None, spec: DeviceSpec | None
) -> CompressionCost:
    encode_us, decode_us = _GPU_REFERENCE_US[compressor]
    scale = 1.0
    where = "reference V100"
    if spec is not None:
        scale = REFERENCE_MEM_BANDWIDTH_GB_S / (spec.mem_bandwidth_gb_s / spec.slowdown)
        where = f"{device_type} (slope x{scale:.3g} vs V100 by memory bandwidth)"

    def model(us: float) -> PiecewiseTime:
        const = us * 1e-6
        return PiecewiseTime(const, GPU_THRESHOLD_BYTES, const / GPU_THRESHOLD_BYTES * scale)

    return CompressionCost(
        compressor, "gpu", device_type, model(encode_us), model(decode_us), "analytic",
        f"Espresso reference constants, constant below 4 MiB then linear; {where}",
    )


def _cpu_default(compressor: str, device_type: str | None) -> CompressionCost:
    """The CPU throughput model; plus the per-call dispatch cost on the ``cpu`` device type."""
    beta = 8.0 / CPU_THROUGHPUT_BITS_PER_S
    where = f"CPU throughput model, {CPU_THROUGHPUT_BITS_PER_S / 1e9:g} Gbit/s"
    if device_type != "cpu":
        line = AffineTime(0.0, beta)
        return CompressionCost(compressor, "cpu", device_type, line, line, "analytic", where)
    comp_s, decomp_s = CPU_DEVICE_CALL_S
    return CompressionCost(
        compressor, "cpu", device_type, AffineTime(comp_s, beta), AffineTime(decomp_s, beta),
        "analytic", f"{where}, + {comp_s * 1e6:g} / {decomp_s * 1e6:g} us per call on the "
        "cpu device type",
    )


def _tables(record: CompressorRecord) -> tuple[TableTime, TableTime]:
    sizes = tuple(float(s.nbytes) for s in record.samples)
    comp = TableTime(sizes, tuple(s.compress_s for s in record.samples))
    decomp = TableTime(sizes, tuple(s.decompress_s for s in record.samples))
    return comp, decomp


def _check_compressor(compressor: str) -> None:
    if compressor not in COMPRESSORS:
        raise SpecError(
            f"unknown compressor {compressor!r}{did_you_mean(compressor, COMPRESSORS)} "
            f"(known: {', '.join(COMPRESSORS)})"
        )
