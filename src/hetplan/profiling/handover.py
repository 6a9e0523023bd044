"""Hand-overs timed under training's own contention: every process computes between messages.

On the CPU presets' machine (4 gloo processes on 2 cores) a rank that blocks on a message
gives its core to another process; when the message arrives it waits for a core again,
behind ranks that are computing. :mod:`.collectives` times messages back to back, with the
other ranks asleep and cores free, so it never sees that wait (a 4 KiB hand-over 0.1-0.8 ms
there, about 4 ms a hop inside a pipeline run; a 4 KiB all-reduce 4.7 ms back to back, 10 ms
after each rank computed 3 ms: ``docs/decisions/cpu-fidelity.md``).

:func:`profile_handovers` spawns ``world_size`` processes that all do, for each burst
length in ``bursts_s``:

1. **compute only**: ``rounds`` bursts of a fixed amount of work (small matmuls, calibrated
   once on all processes at once so that one burst takes about the asked length with every
   process computing), no messages: the burst's wall time under contention, ``b``;
2. **compute, then a message**: ``rounds`` times the same burst followed by the operation:
   ``p2p`` (each rank ``isend`` to the next, ``irecv`` from the previous one, ``wait`` on
   both: a pipeline stage's blocking receive, every stage at once) or ``allreduce`` (the whole
   world, and every group of each size in ``group_sizes`` at once): the round's wall time
   ``r``. All-reduces are timed at every message size in ``sizes`` (4 KiB and 1 MiB by
   default: the wait grows with the message, a 1 MiB all-reduce on 4 ranks costs 3.8 / 4.6 /
   9.1 ms after 0 / 1 / 3 ms of compute, ``docs/decisions/cpu-fidelity.md`` section 6; a
   data-parallel bucket of the CPU plans is 0.1-1 MB); p2p at the smallest (a pipeline's
   activations on those plans are tens of KiB).

Both are timed in ``passes`` rounds over all the bursts (the host's fast and slow spells
outlast one burst's block of rounds). A sample is ``(b, r - b)``: the time one message costs
beyond the burst. Each rank takes the mean over its rounds (the slow wake-ups are what is
measured; a median would drop them); ``b`` is the mean over the ranks and ``r`` the slowest
rank's. The cost model charges it, less the back-to-back line at the same size, per blocking
receive (:meth:`hetplan.cost_models.comm.CommModel.wait_s`).

**On an emulated link** (``emulate=True``, with ``HETPLAN_EMULATE_BW`` set, as ``hetplan
profile`` does when that variable is set): every all-reduce also occupies the runtime's
emulated link (:func:`throttle`, :mod:`hetplan.runtime.link_emulation`), as a gradient sync
across emulated nodes does, and the records are filed under the kind of link the emulation
stands for (``ethernet`` for ``cpu-2x2-slow``). The emulated wire time is the analytic line
of that link by construction, so only the hand-overs are taken there (and, for a zoo model,
the data-parallel sync inside its step: :mod:`.sync_step`): what they add is the real
loopback collective running underneath the emulated one, with its waits for a core.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

from hetplan.cost_models.profile_db import HandoverRecord, HandoverSample

__all__ = ["DEFAULT_BURSTS_S", "DEFAULT_SIZES", "LinkSettings", "emulated_settings",
           "profile_handovers", "throttle"]

#: Bursts around the per-micro-batch stage times of small CPU plans (0.3-10 ms).
DEFAULT_BURSTS_S: tuple[float, ...] = (0.0, 0.5e-3, 2e-3, 8e-3)
#: Message sizes of the all-reduces (p2p: the smallest): a latency-bound message and one of
#: the size of a small model's whole gradient bucket.
DEFAULT_SIZES: tuple[int, ...] = (4096, 1 << 20)
_CALIBRATE_S = 0.3  # wall time of the calibration, every process computing
_DIM = 48  # matmul side of one unit of burst work (tens of microseconds on a CPU core)


def _burst_op(units: int) -> Any:
    import torch

    a = torch.ones(_DIM, _DIM) / _DIM
    b = torch.ones(_DIM, _DIM)

    def burst() -> None:
        x = b
        for _ in range(units):
            x = torch.mm(a, x)

    return burst


#: An emulated link's settings, passed to the processes: (Gbit/s, latency per step in µs).
LinkSettings = tuple[float, float]


def throttle(op: Any, name: str, nbytes: int, group_size: int,
             link: LinkSettings | None) -> Any:
    """``op`` run on an emulated link of these settings (one per process, as the runtime's
    :class:`~hetplan.runtime.link_emulation.EmulatedLink` of ``HETPLAN_EMULATE_BW``) the way
    the runtime runs a gradient-sync collective across nodes: queued on the link when it
    starts, waited for until its emulated end when it returns (a lower bound, never added on
    top). p2p, and anything without a link, runs as it is (the runtime throttles only
    gradient-sync collectives)."""
    if link is None or name == "p2p":
        return op
    from hetplan.runtime.link_emulation import EmulatedLink

    emulated = EmulatedLink(*link)

    def run() -> None:
        end = emulated.reserve(name, nbytes, group_size)
        op()
        emulated.wait(end)

    return run


def emulated_settings(emulate: bool) -> LinkSettings | None:
    """The settings of the runtime's emulated link from ``HETPLAN_EMULATE_BW`` (and
    ``HETPLAN_EMULATE_LATENCY_US``) when ``emulate``, else None; read here and passed to the
    spawned processes (a process pool may have started before the variable was set).

    Raises:
        ValueError: ``emulate`` without ``HETPLAN_EMULATE_BW`` set.
    """
    if not emulate:
        return None
    from hetplan.runtime.link_emulation import ENV, emulated_link

    link = emulated_link()
    if link is None:
        raise ValueError(f"emulate=True needs {ENV} set to the emulated link's Gbit/s, e.g. "
                         f"{ENV}=1 (as the run it describes)")
    return (link.bytes_per_s * 8 / 1e9, link.latency_s * 1e6)


def _message_op(operation: str, rank: int, world: int, group: Any, nbytes: int,
                gsize: int, link: LinkSettings | None) -> Any:
    import torch
    import torch.distributed as dist

    x = torch.ones(max(nbytes // 4, 1), dtype=torch.float32)
    y = torch.empty_like(x)
    if operation == "allreduce":
        return throttle(lambda: dist.all_reduce(x, group=group), "allreduce", nbytes, gsize,
                        link)
    nxt, prev = (rank + 1) % world, (rank - 1) % world

    def exchange() -> None:  # every rank sends and receives at once: every stage's receive
        sent = dist.isend(x, nxt)
        got = dist.irecv(y, prev)
        assert sent is not None and got is not None
        got.wait()
        sent.wait()

    return exchange


def _mean_round_s(op: Any, rounds: int) -> float:
    t0 = time.perf_counter()
    for _ in range(rounds):
        op()
    return (time.perf_counter() - t0) / rounds


def _worker(rank: int, world: int, bursts_s: Sequence[float], group_sizes: Sequence[int],
            sizes: Sequence[int], rounds: int, warmup: int, passes: int,
            link: LinkSettings | None = None
            ) -> dict[tuple[str, int, int], list[tuple[float, float]]]:
    """Runs in every rank: (operation, group size, bytes) -> [(burst s, message s)], the
    slowest rank's."""
    import torch
    import torch.distributed as dist

    from hetplan.profiling.collectives import own_groups

    groups = own_groups(rank, world, group_sizes)
    # calibrate one unit of work on every process at once (the contention of training)
    # (for a fixed wall window, longer than the scheduler's slices, so every process
    # shares the cores for all of it)
    unit = _burst_op(1)
    for _ in range(20):
        unit()
    dist.barrier()
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < _CALIBRATE_S:
        unit()
        count += 1
    t = torch.tensor([(time.perf_counter() - t0) / count], dtype=torch.float64)
    dist.all_reduce(t)
    per_unit = float(t.item()) / world
    runs = [("p2p", 2, None, min(sizes))] + [("allreduce", g, groups[g], n)
                                              for g in sorted(groups) for n in sorted(sizes)]
    # per (burst, operation, group, bytes): summed mean burst and slowest round over passes
    acc: dict[tuple[float, str, int, int], list[float]] = {}
    per_pass = max(-(-rounds // passes), 1)
    for _ in range(passes):  # every pass over all bursts: no burst in one spell of the host
        for burst_s in bursts_s:
            burst = _burst_op(max(round(burst_s / per_unit), 0))
            for operation, gsize, group, nbytes in runs:
                message = _message_op(operation, rank, world, group, nbytes, gsize, link)

                def both() -> None:
                    burst()
                    message()

                for _ in range(warmup):
                    both()
                dist.barrier()
                b = _mean_round_s(burst, per_pass) if burst_s > 0 else 0.0
                dist.barrier()
                r = _mean_round_s(both, per_pass)
                # the burst's mean over the ranks; the round's slowest rank (a round ends
                # for the ring when its last member's does)
                mean_b = torch.tensor([b], dtype=torch.float64)
                dist.all_reduce(mean_b)
                max_r = torch.tensor([r], dtype=torch.float64)
                dist.all_reduce(max_r, op=dist.ReduceOp.MAX)
                sums = acc.setdefault((burst_s, operation, gsize, nbytes), [0.0, 0.0])
                sums[0] += float(mean_b.item()) / world / passes
                sums[1] += float(max_r.item()) / passes
                dist.barrier()
    out: dict[tuple[str, int, int], list[tuple[float, float]]] = {}
    for (_, operation, gsize, nbytes), (bb, rr) in acc.items():
        out.setdefault((operation, gsize, nbytes), []).append((bb, max(rr - bb, 0.0)))
    return out


def profile_handovers(
    world_size: int,
    *,
    backend: str = "gloo",
    link_kind: str = "loopback",
    bursts_s: Sequence[float] = DEFAULT_BURSTS_S,
    group_sizes: Sequence[int] | None = None,
    sizes: Sequence[int] = DEFAULT_SIZES,
    rounds: int = 45,
    warmup: int = 2,
    passes: int = 3,
    timeout_s: float = 120.0,
    threads_per_process: int | None = 1,
    emulate: bool = False,
) -> list[HandoverRecord]:
    """Time p2p hand-overs and all-reduces after compute bursts on ``world_size`` processes.

    Args:
        world_size: processes (≥ 2), all computing and communicating at once.
        backend: ``gloo`` (the CPU presets' backend; the only one this is meant for).
        link_kind: the link kind the records are filed under (``loopback`` on one host).
        bursts_s: burst lengths to measure (wall seconds with every process computing);
            0 measures the messages back to back under the same pattern.
        group_sizes: smaller all-reduce groups, every group of a size at once (default:
            every divisor of ``world_size`` from 2 below it, as :mod:`.collectives`).
        sizes: the messages (per-rank buffer bytes) of the all-reduces, one record each;
            p2p is timed at the smallest.
        rounds / warmup: timed rounds per burst and operation (split over the passes),
            and untimed rounds before each pass's.
        passes: rounds over all bursts (as :func:`~.collectives.size_order`), so that every
            burst meets the same mix of the host's fast and slow spells.
        timeout_s: limit on the whole run.
        threads_per_process: torch threads per process (1: a training rank's share of the
            CPU presets' cores).
        emulate: the all-reduces also occupy the runtime's emulated link
            (``HETPLAN_EMULATE_BW``, :func:`throttle`), as a gradient sync
            across emulated nodes does; p2p never (the runtime does not throttle it). File
            the records under that link's kind (``link_kind``).

    Returns:
        One :class:`HandoverRecord` per operation, group size and message size: ``p2p``
        (group 2, the smallest size) and ``allreduce`` at ``world_size`` and each of
        ``group_sizes``, at each size; a sample per burst.

    Raises:
        ValueError: ``world_size`` < 2, no bursts, a negative burst, no sizes or one < 1,
            a group size that does not divide ``world_size``, or ``emulate`` without
            ``HETPLAN_EMULATE_BW`` set.
    """
    from hetplan.profiling._spawn import run_local_ranks
    from hetplan.profiling.collectives import subgroups

    if world_size < 2:
        raise ValueError(f"hand-overs need world_size >= 2, got {world_size}")
    if not bursts_s or min(bursts_s) < 0:
        raise ValueError(f"bursts_s must be non-negative seconds, got {list(bursts_s)}")
    if not sizes or min(sizes) < 1:
        raise ValueError(f"sizes must be message bytes >= 1, got {list(sizes)}")
    if passes < 1 or rounds < 1:
        raise ValueError(f"rounds and passes must be >= 1, got {rounds} and {passes}")
    if group_sizes is None:
        group_sizes = [g for g in range(2, world_size) if world_size % g == 0]
    for g in group_sizes:
        subgroups(world_size, g)
    link = emulated_settings(emulate)
    bursts = tuple(sorted(set(bursts_s)))
    results = run_local_ranks(
        _worker, world_size,
        (bursts, tuple(sorted(set(group_sizes) - {world_size})), tuple(sorted(set(sizes))),
         rounds, warmup, passes, link),
        backend=backend, timeout_s=timeout_s, threads_per_process=threads_per_process,
    )
    points: dict[tuple[str, int, int], list[tuple[float, float]]] = results[0]
    records = []
    for (operation, gsize, nbytes), pts in sorted(points.items()):
        # two bursts may come out at the same measured length: keep one sample per length
        by_burst: dict[float, list[float]] = {}
        for b, s in pts:
            by_burst.setdefault(b, []).append(s)
        records.append(HandoverRecord(
            operation=operation,  # type: ignore[arg-type]
            backend=backend, link_kind=link_kind, group_size=gsize,
            processes=world_size, nbytes=nbytes,
            samples=tuple(HandoverSample(burst_s=b, seconds=statistics.fmean(v))
                          for b, v in sorted(by_burst.items())),
        ))
    return records
