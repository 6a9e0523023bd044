"""Compressor (encode / decode) times per size, on the CPU and, when present, on CUDA.

Simple reference implementations in plain torch of every compressor the cost model knows
(:data:`hetplan.cost_models.compression.COMPRESSORS`); they do the work a real implementation
does (select, quantise, pack bits, scatter back), not the bookkeeping (error feedback, state):

* ``fp16`` / ``bf16``: cast down; decode casts back to fp32.
* ``topk``: ``topk(|x|, k)`` and a gather of the values; decode scatters into zeros.
* ``randomk``: ``k`` random indices and a gather; decode scatters.
* ``dgc``: the threshold is estimated by ``topk`` on a 1 % sample, then a mask and
  ``nonzero`` select the elements above it; decode scatters.
* ``efsignsgd``: mean magnitude and the signs packed 8 per byte; decode unpacks.
* ``onebit``: like efsignsgd with separate means for the positive and negative elements.
* ``qsgd``: the norm and stochastic rounding to ``levels`` levels stored as int8 with the
  sign; decode rescales.
* ``powersgd``: rank-``r`` factors of the buffer viewed as a square-ish matrix (one power
  iteration with a QR orthogonalisation); decode multiplies them back.

Each sample is the median of several calls (at least ``iters``, more for small buffers, about
``min_time_s`` per size and compressor). Sizes are raw fp32 bytes, as the cost model expects.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from hetplan.cost_models.compression import (
    COMPRESSORS,
    DEFAULT_POWERSGD_RANK,
    DEFAULT_QSGD_LEVELS,
    DEFAULT_SPARSITY_RATIO,
)
from hetplan.cost_models.profile_db import CompressorRecord, CompressorSample

if TYPE_CHECKING:
    from rich.progress import Progress

__all__ = ["DEFAULT_COMPRESSOR_SIZES", "codec", "profile_compressors"]

KiB, MiB = 2**10, 2**20
#: 4 KiB, 32 KiB ... 16 MiB (factor 8).
DEFAULT_COMPRESSOR_SIZES: tuple[int, ...] = (4 * KiB, 32 * KiB, 256 * KiB, 2 * MiB, 16 * MiB)

Encode = Callable[[torch.Tensor], Any]
Decode = Callable[[Any], torch.Tensor]
_BIT_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _bits(device: torch.device) -> torch.Tensor:
    w = _BIT_WEIGHTS.get(device)
    if w is None:
        w = _BIT_WEIGHTS[device] = 2 ** torch.arange(8, dtype=torch.uint8, device=device)
    return w


def _pack(mask: torch.Tensor) -> torch.Tensor:
    """Booleans → bytes, 8 per byte (padded)."""
    n = mask.numel()
    pad = (-n) % 8
    m = torch.nn.functional.pad(mask.to(torch.uint8), (0, pad)).view(-1, 8)
    return (m * _bits(mask.device)).sum(dim=1, dtype=torch.uint8)


def _unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    bits = packed.unsqueeze(1).bitwise_and(_bits(packed.device)).ne(0)
    return bits.view(-1)[:n]


def codec(name: str, numel: int) -> tuple[Encode, Decode]:
    """The ``(encode, decode)`` pair of compressor ``name`` for fp32 buffers of ``numel``.

    Raises:
        ValueError: unknown compressor.
    """
    k = max(1, int(numel * DEFAULT_SPARSITY_RATIO))
    if name in ("fp16", "bf16"):
        dtype = torch.float16 if name == "fp16" else torch.bfloat16
        return (lambda x: x.to(dtype)), (lambda y: y.to(torch.float32))
    if name in ("topk", "randomk", "dgc"):
        def decode(c: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            vals, idx = c
            return torch.zeros(numel, dtype=vals.dtype, device=vals.device).scatter_(0, idx, vals)

        if name == "topk":
            def encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                idx = torch.topk(x.abs(), k, sorted=False).indices
                return x.gather(0, idx), idx
        elif name == "randomk":
            def encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                idx = torch.randint(0, numel, (k,), device=x.device)
                return x.gather(0, idx), idx
        else:
            sample = max(1, numel // 100)

            def encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                a = x.abs()
                picks = torch.randint(0, numel, (sample,), device=x.device)
                kk = max(1, int(sample * DEFAULT_SPARSITY_RATIO))
                thr = torch.topk(a[picks], kk, sorted=False).values.min()
                idx = torch.nonzero(a >= thr).view(-1)
                return x.gather(0, idx), idx
        return encode, decode
    if name == "efsignsgd":
        return (
            lambda x: (x.abs().mean(), _pack(x >= 0)),
            lambda c: torch.where(_unpack(c[1], numel), c[0], -c[0]),
        )
    if name == "onebit":
        def encode_1bit(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            pos = x >= 0
            n_pos = pos.sum().clamp(min=1)
            s_pos = torch.where(pos, x, 0).sum() / n_pos
            s_neg = torch.where(pos, 0, x).sum() / (numel - n_pos).clamp(min=1)
            return s_pos, s_neg, _pack(pos)

        return encode_1bit, lambda c: torch.where(_unpack(c[2], numel), c[0], c[1])
    if name == "qsgd":
        s = DEFAULT_QSGD_LEVELS

        def encode_q(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            norm = x.norm().clamp(min=1e-30)
            level = (x.abs() / norm * s + torch.rand_like(x)).floor_()
            return norm, (level * x.sign()).to(torch.int8)

        return encode_q, lambda c: c[1].to(torch.float32) * (c[0] / s)
    if name == "powersgd":
        rows = max(1, int(math.sqrt(numel)))
        while numel % rows:
            rows -= 1
        cols = numel // rows
        r = min(DEFAULT_POWERSGD_RANK, rows, cols)

        def encode_p(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            m = x.view(rows, cols)
            q = torch.randn(cols, r, device=x.device, dtype=x.dtype)
            p = torch.linalg.qr(m @ q).Q
            return p, m.t() @ p

        return encode_p, lambda c: (c[0] @ c[1].t()).view(-1)
    raise ValueError(f"unknown compressor {name!r} (known: {', '.join(COMPRESSORS)})")


def _median_time(fn: Callable[[], Any], iters: int, min_time_s: float, cuda: bool) -> float:
    def once() -> float:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    once()  # warm-up
    times = [once() for _ in range(iters)]
    start = time.perf_counter()
    while len(times) < 200 and time.perf_counter() - start < min_time_s:
        times.append(once())
    return statistics.median(times)


def _measure(
    name: str, sizes: Sequence[int], device: torch.device, iters: int, min_time_s: float,
    progress: Callable[[], None] | None,
) -> list[CompressorSample]:
    cuda = device.type == "cuda"
    gen = torch.Generator(device=device).manual_seed(0)
    samples = []
    for nbytes in sorted(set(sizes)):
        numel = max(nbytes // 4, 8)
        x = torch.randn(numel, generator=gen, device=device)
        encode, decode = codec(name, numel)
        encoded = encode(x)
        c = _median_time(lambda: encode(x), iters, min_time_s, cuda)
        d = _median_time(lambda: decode(encoded), iters, min_time_s, cuda)
        samples.append(CompressorSample(nbytes=numel * 4, compress_s=c, decompress_s=d))
        if progress is not None:
            progress()
    return samples


def profile_compressors(
    *,
    device_type: str,
    compressors: Sequence[str] = COMPRESSORS,
    sizes: Sequence[int] = DEFAULT_COMPRESSOR_SIZES,
    devices: Sequence[str] | None = None,
    iters: int = 3,
    min_time_s: float = 0.02,
    num_threads: int | None = 1,
    progress: Progress | None = None,
) -> list[CompressorRecord]:
    """Time compress and decompress of every compressor on every size.

    Args:
        device_type: the cluster device type of this machine (``cpu`` on a CPU-only host, the
            GPU type such as ``A100-80GB`` on a GPU host): records are keyed by it.
        compressors: names from :data:`~hetplan.cost_models.compression.COMPRESSORS`.
        sizes: raw fp32 buffer sizes in bytes.
        devices: ``"cpu"`` and/or ``"cuda"``; default ``cpu``, plus ``cuda`` when available.
        iters / min_time_s: at least ``iters`` calls per point, more until ``min_time_s``.
        num_threads: torch threads for the CPU measurements (restored afterwards); 1 is what
            a CPU compression worker beside training gets.
        progress: a ``rich.progress.Progress`` to show a task on.

    Returns:
        One :class:`CompressorRecord` per (compressor, device kind), ``device_kind`` ``cpu``
        or ``gpu``.

    Example:
        >>> recs = profile_compressors(device_type="cpu", compressors=["fp16"], sizes=[4096])
        >>> recs[0].key, recs[0].samples[0].compress_s > 0
        (('fp16', 'cpu', 'cpu'), True)
    """
    unknown = [c for c in compressors if c not in COMPRESSORS]
    if unknown:
        raise ValueError(f"unknown compressor(s) {unknown} (known: {', '.join(COMPRESSORS)})")
    if devices is None:
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    task = None
    if progress is not None:
        total = len(compressors) * len(set(sizes)) * len(devices)
        task = progress.add_task("compressors", total=total)
    records = []
    old_threads = torch.get_num_threads()
    try:
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        for dev_name in devices:
            device = torch.device(dev_name)
            kind = "gpu" if device.type == "cuda" else "cpu"
            for name in compressors:
                samples = _measure(
                    name, sizes, device, iters, min_time_s,
                    (lambda: progress.advance(task)) if progress is not None else None,
                )
                records.append(CompressorRecord(
                    compressor=name, device_kind=kind,  # type: ignore[arg-type]
                    device_type=device_type, samples=tuple(samples),
                ))
    finally:
        torch.set_num_threads(old_threads)
    return records
