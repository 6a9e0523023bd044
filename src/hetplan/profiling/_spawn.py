"""Run a function on ``n`` local processes (optionally in one ``torch.distributed`` group).

Processes are started with ``torch.multiprocessing``: ``spawn`` by default (no inherited
OpenMP or CUDA state), or ``forkserver`` when ``HETPLAN_START_METHOD=forkserver`` (a server
process that imports torch once, never touches CUDA or starts threads, and forks every rank:
no ~2 s torch import per rank when a process starts many runs, e.g. the test suite). The
rendezvous is a ``FileStore`` in a fresh temporary directory, so no fixed port is ever used,
and the process group gets a timeout. Every rank's return value is pickled to that directory
and returned to the caller in rank order; an exception in any rank is re-raised in the caller
with the child's traceback, and a run that overstays ``timeout_s`` is terminated (the error
names the ranks that had returned by then).
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

__all__ = ["run_local_ranks", "start_method"]

#: Modules the fork server imports before it forks ranks (``forkserver`` only). A rank that
#: captures a model or builds one on the meta device imports ``torch._dynamo`` (~2 s: torch's
#: reference ops are wrapped in ``torch._disable_dynamo``); none of these starts a thread.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "hetplan.runtime.groups",
            "hetplan.ir.capture", "hetplan.runtime.executor"]


def start_method() -> str:
    """How ranks are started: ``HETPLAN_START_METHOD`` (``spawn`` or ``forkserver``),
    default ``spawn``. With ``forkserver`` the server preloads torch (set before it starts).
    Another value is a :class:`~hetplan.errors.SpecError` naming the variable."""
    method = os.environ.get("HETPLAN_START_METHOD", "spawn")
    if method not in ("spawn", "forkserver"):
        from hetplan.errors import SpecError

        raise SpecError(f"HETPLAN_START_METHOD={method!r}: use 'spawn' (the default) or "
                        "'forkserver' (ranks forked from one server that imported torch once)")
    if method == "forkserver":
        import multiprocessing

        multiprocessing.set_forkserver_preload(_PRELOAD)
    return method


def _entry(
    rank: int,
    fn: Callable[..., Any],
    args: Sequence[Any],
    world_size: int,
    backend: str | None,
    tmpdir: str,
    timeout_s: float,
    threads: int | None,
    cpu_sched: str,
) -> None:
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    if backend == "gloo" or (backend is None and not torch.cuda.is_available()):
        # CPU ranks: scheduled as the runtime's CPU workers are (hetplan.runtime.cpu_sched)
        from hetplan.runtime.cpu_sched import apply_cpu_sched

        apply_cpu_sched(cpu_sched)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    if backend is not None:
        import torch.distributed as dist

        store = dist.FileStore(os.path.join(tmpdir, "store"), world_size)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    from hetplan.runtime.groups import exit_now, shutdown_process_groups

    try:
        result = fn(rank, world_size, *args)
    except BaseException:
        shutdown_process_groups(clean=False)
        raise
    # written before the shutdown barrier: a run that times out names the ranks that returned
    tmp = Path(tmpdir) / f"result-{rank}.pkl.tmp"
    tmp.write_bytes(pickle.dumps(result))
    tmp.rename(Path(tmpdir) / f"result-{rank}.pkl")
    shutdown_process_groups(clean=True)
    exit_now(0)


def run_local_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    backend: str | None = "gloo",
    timeout_s: float = 120.0,
    threads_per_process: int | None = None,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` fresh local processes.

    Args:
        fn: a picklable (module-level) function; its return value must be picklable.
        world_size: number of processes (≥ 1).
        args: extra positional arguments, pickled to every process.
        backend: ``torch.distributed`` backend of the group the processes join before ``fn``
            runs (``gloo``, ``nccl``), or None for no process group.
        timeout_s: process-group timeout, and wall-clock limit of the whole run (start-up
            included).
        threads_per_process: ``torch.set_num_threads`` in each process (None: torch default).

    Returns:
        The ranks' return values, in rank order.

    Raises:
        TimeoutError: the processes did not finish within ``timeout_s`` (they are killed).
        torch.multiprocessing.ProcessRaisedException: a rank raised (traceback included).
        torch.multiprocessing.ProcessExitedException: a rank died (e.g. killed by a signal).
    """
    import torch.multiprocessing as mp

    from hetplan.runtime.cpu_sched import cpu_sched_policy

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    # read here, not in the ranks: a fork server's ranks see the server's environment
    cpu_sched = cpu_sched_policy()
    with tempfile.TemporaryDirectory(prefix="hetplan-ranks-") as tmpdir:
        ctx = mp.start_processes(
            _entry,
            args=(fn, tuple(args), world_size, backend, tmpdir, timeout_s, threads_per_process,
                  cpu_sched),
            nprocs=world_size,
            join=False,
            start_method=start_method(),
        )
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                # ranks that returned while others hang: e.g. one pipeline stage raised (and
                # its rank function caught it) while the next waits for its activations
                done = [r for r in range(world_size)
                        if (Path(tmpdir) / f"result-{r}.pkl").exists()]
                for p in ctx.processes:
                    if p.is_alive():
                        p.terminate()
                for p in ctx.processes:
                    p.join(5)
                returned = f"; rank(s) {done} had returned" if done else ""
                raise TimeoutError(
                    f"{getattr(fn, '__name__', fn)!s} on {world_size} local process(es) did not "
                    f"finish within {timeout_s:g} s{returned}; raise timeout_s or use smaller "
                    "sizes"
                )
        return [pickle.loads((Path(tmpdir) / f"result-{r}.pkl").read_bytes())
                for r in range(world_size)]
