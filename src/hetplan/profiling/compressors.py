"""Compressor (encode / decode) times per size, on the CPU and, when present, on CUDA.

The compressors timed are the runtime's own (:mod:`hetplan.runtime.compressors`, every name
in :data:`hetplan.cost_models.compression.COMPRESSORS` with its default parameters), so the
cost model is fed with what training executes. Error-feedback bookkeeping (one add and one
subtract per compression) is not included.

Each sample is the median of several calls (at least ``iters``, more for small buffers, about
``min_time_s`` per size and compressor). Sizes are raw fp32 bytes, as the cost model expects.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from hetplan.cost_models.compression import COMPRESSORS
from hetplan.cost_models.profile_db import CompressorRecord, CompressorSample
from hetplan.errors import SpecError
from hetplan.runtime.compressors import make_compressor

if TYPE_CHECKING:
    from rich.progress import Progress

__all__ = ["DEFAULT_COMPRESSOR_SIZES", "codec", "profile_compressors"]

KiB, MiB = 2**10, 2**20
#: 4 KiB, 32 KiB ... 16 MiB (factor 8).
DEFAULT_COMPRESSOR_SIZES: tuple[int, ...] = (4 * KiB, 32 * KiB, 256 * KiB, 2 * MiB, 16 * MiB)

Encode = Callable[[torch.Tensor], Any]
Decode = Callable[[Any], torch.Tensor]


def codec(name: str, numel: int) -> tuple[Encode, Decode]:
    """The ``(encode, decode)`` pair of the runtime compressor ``name`` for ``numel`` elements.

    Raises:
        ValueError: unknown compressor.
    """
    try:
        comp = make_compressor(name)
    except SpecError as e:
        raise ValueError(str(e)) from None
    return (lambda x: comp.compress(x)), (lambda c: comp.decompress(c, numel))


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
    step: Callable[[], None] | None = None
    if progress is not None:
        total = len(compressors) * len(set(sizes)) * len(devices)
        step = functools.partial(progress.advance, progress.add_task("compressors", total=total))
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
                    name, sizes, device, iters, min_time_s, step,
                )
                records.append(CompressorRecord(
                    compressor=name, device_kind=kind,  # type: ignore[arg-type]
                    device_type=device_type, samples=tuple(samples),
                ))
    finally:
        torch.set_num_threads(old_threads)
    return records
