"""Per-step framework costs: the optimizer step, measured as the runtime runs it.

An optimizer step costs a fixed amount per parameter tensor (its Python loop, the dispatch of
each tensor's small kernels) plus an amount per byte it reads and writes. On a GPU the bytes
dominate; on a CPU running a small model the per-tensor part does: Adam over tiny-gpt2's 28
tensors (0.55 MB) takes about 1 ms on 4 processes sharing 2 cores, where moving its 28 bytes per
parameter at the preset's 20 GB/s would take 0.2 ms. :func:`profile_optimizer_steps` measures
``step()`` + ``zero_grad(set_to_none=True)`` (the runtime's optimizer phase) of the optimizer
the runtime builds for a plan (:func:`hetplan.runtime.executor.plan_optimizer`) over synthetic
fp32 parameters, a grid of tensor counts and sizes, on ``processes`` processes at once (the
ranks of one node contend for its cores as in training), and fits ``seconds = per_tensor_s *
tensors + per_byte_s * nbytes``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import numpy as np
import torch

from hetplan.cost_models.profile_db import OptimizerRecord, OptimizerSample

__all__ = ["DEFAULT_OPTIMIZERS", "DEFAULT_STEP_GRID", "fit_step_line",
           "profile_optimizer_steps"]

#: Optimizers measured by default (the names plans use in ``cost_settings.optimizer``).
DEFAULT_OPTIMIZERS: tuple[str, ...] = ("adam", "sgd")
#: ``(tensors, elements per tensor)`` points: few/many tensors, small/large ones.
DEFAULT_STEP_GRID: tuple[tuple[int, int], ...] = (
    (4, 256), (64, 256), (4, 262_144), (64, 16_384), (16, 262_144))


def fit_step_line(samples: Sequence[OptimizerSample]) -> tuple[float, float]:
    """Non-negative least squares of ``seconds = a * tensors + b * nbytes`` on residuals
    relative to each time (so that small steps constrain ``a`` as large ones constrain
    ``b``); (a, b). With one sample all of it is put on the per-tensor term."""
    if len(samples) == 1:
        s = samples[0]
        return s.seconds / s.tensors, 0.0
    x = np.array([[s.tensors, s.nbytes] for s in samples], dtype=float)
    y = np.array([max(s.seconds, 1e-12) for s in samples], dtype=float)
    w = 1.0 / y
    coef, *_ = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)
    a, b = float(coef[0]), float(coef[1])
    if a >= 0 and b >= 0:
        return a, b
    # on the boundary: the better of the two one-term fits
    best: tuple[float, float, float] | None = None
    for col in (0, 1):
        xc = x[:, col] * w
        c = float(max(np.dot(xc, y * w) / max(np.dot(xc, xc), 1e-300), 0.0))
        err = float(np.sum((xc * c - y * w) ** 2))
        cand = (c, 0.0) if col == 0 else (0.0, c)
        if best is None or err < best[2]:
            best = (*cand, err)
    assert best is not None
    return best[0], best[1]


def _time_steps(name: str, tensors: int, numel: int, warmup: int, iters: int) -> float:
    """Median seconds of ``step()`` + ``zero_grad(set_to_none=True)`` over synthetic params."""
    from hetplan.runtime.executor import plan_optimizer

    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(numel, generator=g)) for _ in range(tensors)]
    grads = [torch.randn(numel, generator=g) for _ in range(tensors)]
    opt = plan_optimizer(name)(params)
    times = []
    for i in range(warmup + iters):
        for p, gr in zip(params, grads):
            p.grad = gr.clone()
        t0 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _worker(rank: int, world: int, optimizers: Sequence[str],
            grid: Sequence[tuple[int, int]], warmup: int, iters: int) -> list[float]:
    import torch.distributed as dist

    out = []
    for name in optimizers:
        for tensors, numel in grid:
            dist.barrier()  # every process steps at once, as the ranks of a node do
            out.append(_time_steps(name, tensors, numel, warmup, iters))
    return out


def profile_optimizer_steps(
    processes: int,
    *,
    device_type: str = "cpu",
    optimizers: Sequence[str] = DEFAULT_OPTIMIZERS,
    grid: Sequence[tuple[int, int]] = DEFAULT_STEP_GRID,
    warmup: int = 3,
    iters: int = 9,
    threads_per_process: int | None = None,
    timeout_s: float = 300.0,
) -> list[OptimizerRecord]:
    """Measure the optimizer step on ``processes`` local processes at once (CPU).

    Args:
        processes: processes stepping at once (the ranks of one node).
        device_type: the cluster device type to file the records under.
        optimizers: plan optimizer names (see :func:`~hetplan.runtime.executor.plan_optimizer`).
        grid: ``(tensors, elements per tensor)`` points to time.
        warmup / iters: untimed and timed steps per point (the median counts).
        threads_per_process: torch threads per process (default: cores / processes, as
            training gets).
        timeout_s: limit on the whole measurement.

    Returns:
        One :class:`OptimizerRecord` per optimizer: per point the mean over processes of
        their medians, and the fitted line.
    """
    import os

    from hetplan.profiling._spawn import run_local_ranks

    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    if threads_per_process is None:
        threads_per_process = max(1, (os.cpu_count() or 1) // processes)
    per_rank: list[list[float]] = run_local_ranks(
        _worker, processes, (tuple(optimizers), tuple(grid), warmup, iters),
        backend="gloo", timeout_s=timeout_s, threads_per_process=threads_per_process)
    records = []
    for k, name in enumerate(optimizers):
        samples = []
        for j, (tensors, numel) in enumerate(grid):
            i = k * len(grid) + j
            secs = statistics.fmean(r[i] for r in per_rank)
            samples.append(OptimizerSample(tensors=tensors, nbytes=tensors * numel * 4,
                                           seconds=secs))
        a, b = fit_step_line(samples)
        records.append(OptimizerRecord(optimizer=name, device_type=device_type,
                                       processes=processes, samples=tuple(samples),
                                       per_tensor_s=a, per_byte_s=b))
    return records
