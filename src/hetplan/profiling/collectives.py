"""Collective times across local processes, and α–β lines fitted to them.

:func:`profile_collectives` spawns ``world_size`` processes (``torch.multiprocessing``, a
``FileStore`` rendezvous in a temporary directory, a process-group timeout; see
:mod:`hetplan.profiling._spawn`), and in them times every requested collective over a range
of buffer sizes. Sizes follow the convention of :mod:`hetplan.cost_models.comm`: ``nbytes``
is the per-rank buffer of allreduce, reduce_scatter, broadcast, reduce and p2p, the total
gathered output of allgather and gather, and the total each rank sends for alltoall.

How one sample is taken: after ``warmup`` untimed calls, calls run back to back
(collectives synchronise the ranks themselves) and each is timed on its own, in ``passes``
rounds over all sizes (:func:`size_order`), so that no size is measured in one spell of a
busy host alone; the sample is the **median** call time, and the slowest rank's median is
recorded (a collective ends when its last rank does). Small sizes get more calls (at least
``iters``, up to ``max_iters``, about ``min_time_s`` per size) because they are noisy.

p2p is measured the way a pipeline pays it, as a **relay** through every rank: rank 0 sends
to 1, each rank receives from the previous one and sends to the next, rank ``n-1`` back to
0, with the ``isend``/``irecv`` + ``wait`` calls torch's pipeline runtime makes; each rank
sits blocked in its receive until the hand-over reaches it, as a pipeline stage waits for
its activation. The sample is one hand-over (a relay's time over ``world_size`` hops), the
**mean** over the calls, not the median: a pipeline pays every hop on its critical path
(ten in a 4-stage 1F1B over 4 micro-batches), and on 4 processes sharing 2 cores the slow
wake-ups are a large part of the total; a median drops them. Filed under group size 2
whatever ``world_size`` is. (Before 2026-11-26 p2p was a ping-pong between ranks 0 and 1
while the other ranks sat in the next all-reduce; on this machine its small-size samples
jumped between 0.06 ms and 1.5–2 ms by whether those ranks' wake-ups fell inside the
ping-pong, and the median hid it.)

Smaller groups are measured too (``group_sizes``, by default every divisor of the world
size: pairs on 4 ranks), every group of that size at once, as a ``tp=2`` plan's groups all
talk together; their records carry their own group size, so the cost model uses them as
measured instead of rescaling the world's line (which assumes one latency step costs the
same in any group: on 4 processes sharing 2 cores it does not).

Collectives the backend does not implement (gloo lacks ``reduce_scatter`` on CPU in some
torch versions) are skipped; :func:`profile_collectives` returns the reasons in
``CollectiveProfile.skipped``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hetplan.cost_models.comm import fit_alpha_beta
from hetplan.cost_models.profile_db import CollectiveRecord, CollectiveSample

__all__ = [
    "DEFAULT_COLLECTIVES",
    "DEFAULT_SIZES",
    "CollectiveProfile",
    "profile_collectives",
    "sample_seconds",
    "size_order",
    "subgroups",
]

KiB, MiB = 2**10, 2**20
#: 4 KiB, 16 KiB ... 64 MiB (factor 4).
DEFAULT_SIZES: tuple[int, ...] = tuple(4 * KiB * 4**k for k in range(8))
#: Every routine a gradient-sync path or a pipeline may run (the Espresso option tree's
#: routines, ``hetplan.algorithms.espresso_tree.TASKS``, and p2p): a plan is never priced
#: from a measured line for some of its routines and the link's spec for others.
DEFAULT_COLLECTIVES: tuple[str, ...] = (
    "allreduce", "allgather", "broadcast", "reduce_scatter", "alltoall", "reduce", "gather",
    "p2p",
)
_ALL = DEFAULT_COLLECTIVES


@dataclass
class CollectiveProfile:
    """What :func:`profile_collectives` measured.

    Attributes:
        records: one record per collective measured (samples and fitted α, β).
        skipped: collective → why it was not measured.
        seconds: wall time of the whole measurement (process start-up included).
    """

    records: list[CollectiveRecord] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    def __iter__(self):
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)


def _op(name: str, nbytes: int, rank: int, world: int, device: str,
        group: Any = None, root: int = 0):
    """A zero-argument callable doing one ``name`` collective of ``nbytes`` (see module doc)
    in ``group`` (``world`` ranks, global rank ``root`` first; None: the whole world)."""
    import torch
    import torch.distributed as dist

    numel = max(nbytes // 4, world)
    numel -= numel % world  # divisible shards for allgather, reduce_scatter and alltoall

    def buf(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.float32, device=device)

    if name == "allreduce":
        x = buf(numel)
        return lambda: dist.all_reduce(x, group=group)
    if name == "broadcast":
        x = buf(numel)
        return lambda: dist.broadcast(x, src=root, group=group)
    if name == "reduce":
        x = buf(numel)
        return lambda: dist.reduce(x, dst=root, group=group)
    if name == "allgather":
        out, inp = buf(numel), buf(numel // world)
        gather_fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather_fn(out, inp, group=group)
    if name == "gather":
        inp = buf(numel // world)
        gl = [buf(numel // world) for _ in range(world)] if rank == root else None
        return lambda: dist.gather(inp, gl, dst=root, group=group)
    if name == "reduce_scatter":
        inp, out = buf(numel), buf(numel // world)
        rs_fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: rs_fn(out, inp, group=group)
    if name == "alltoall":
        inp, out = buf(numel), buf(numel)
        return lambda: dist.all_to_all_single(out, inp, group=group)
    if name == "p2p":
        x = buf(numel)
        nxt, prev = (rank + 1) % world, (rank - 1) % world

        def hand(op: Any, peer: int) -> None:  # isend/irecv + wait, as torch pipelining
            work = op(x, peer)
            assert work is not None  # in the default group a rank is always a member
            work.wait()

        def relay() -> None:  # one hand-over per rank, around the ring (module doc)
            if rank == 0:
                hand(dist.isend, nxt)
                hand(dist.irecv, prev)
            else:
                hand(dist.irecv, prev)
                hand(dist.isend, nxt)

        return relay
    raise ValueError(f"unknown collective {name!r} (known: {', '.join(_ALL)})")


def sample_seconds(name: str, times: Sequence[float], world: int) -> float:
    """One sample from one rank's timed calls: the median call of a collective; for p2p
    the mean relay over its ``world`` hand-overs (a pipeline pays every hop, slow wake-ups
    included: module doc).

    Example:
        >>> sample_seconds("p2p", [0.25, 0.25, 1.0], 4)
        0.125
        >>> sample_seconds("allreduce", [0.25, 0.25, 1.0], 4)
        0.25
    """
    if not times:
        raise ValueError(f"no timed calls of {name!r} to take a sample from")
    if name == "p2p":
        return statistics.fmean(times) / world
    return statistics.median(times)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _timed(op, n: int, device: str) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        op()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def size_order(sizes: Sequence[int], passes: int) -> list[int]:
    """The order sizes are timed in: ``passes`` rounds over all of them, so that every size
    meets the same mix of the host's fast and slow spells (on the CPU presets' machine a
    spell outlasts one size's block of calls: a pair all-reduce measured 0.31 ms at 4 KiB and
    3.9 ms at 16 KiB in one block-per-size profile, and the fit follows the fast sizes).

    Example:
        >>> size_order([4096, 65536], 2)
        [4096, 65536, 4096, 65536]
    """
    if passes < 1:
        raise ValueError(f"passes must be >= 1, got {passes!r}")
    return [n for _ in range(passes) for n in sizes]


def subgroups(world: int, group_size: int) -> list[list[int]]:
    """The consecutive rank groups of ``group_size`` that :func:`profile_collectives` times
    at once (``[[0, 1], [2, 3]]`` for 2 of 4), as tensor- or data-parallel groups of that
    size all communicate at once in training.

    Raises:
        ValueError: ``group_size`` is not a divisor of ``world`` of at least 2.
    """
    if group_size < 2 or world % group_size:
        raise ValueError(f"group size {group_size} must be >= 2 and divide the {world} "
                         "processes (groups of equal size, all measured at once)")
    return [list(range(g, g + group_size)) for g in range(0, world, group_size)]


def own_groups(rank: int, world: int, group_sizes: Sequence[int]) -> dict[int, Any]:
    """This rank's process group of each size in ``group_sizes`` (:func:`subgroups`), and
    ``None`` (the default group) for ``world``. Every rank must call it with the same
    arguments: ``new_group`` is collective, so every rank creates every group, in order."""
    import torch.distributed as dist

    mine: dict[int, Any] = {world: None}
    for g in group_sizes:
        for ranks in subgroups(world, g):
            pg = dist.new_group(ranks)
            if rank in ranks:
                mine[g] = pg
    return mine


def _worker(
    rank: int,
    world: int,
    collectives: Sequence[str],
    sizes: Sequence[int],
    warmup: int,
    iters: int,
    max_iters: int,
    min_time_s: float,
    device: str,
    group_sizes: Sequence[int] = (),
    passes: int = 1,
) -> tuple[dict[tuple[str, int], list[tuple[int, float]]], dict[str, str]]:
    """Runs in every rank; returns ((collective, group size) → [(nbytes, seconds)], skipped).
    Groups smaller than the world are measured all at once (:func:`subgroups`); a sample is
    the slowest rank's."""
    import torch
    import torch.distributed as dist

    if device == "cuda":
        device = f"cuda:{rank % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
    out: dict[tuple[str, int], list[tuple[int, float]]] = {}
    skipped: dict[str, str] = {}
    flag = torch.zeros(1, device=device)
    # every rank creates every group, in the same order (new_group is collective)
    mine = {g: (pg, rank - rank % g) for g, pg in own_groups(rank, world, group_sizes).items()
            if pg is not None}
    runs = [(name, world) for name in collectives]
    runs += [(name, g) for g in group_sizes for name in collectives if name != "p2p"]
    for name, gsize in runs:
        if name == "p2p" and world < 2:
            continue
        group, root = mine.get(gsize, (None, 0))
        ops: dict[int, Any] = {}
        for nbytes in sizes:
            # every rank must agree on skipping, or the others hang in the collective
            err = ""
            try:
                op = _op(name, nbytes, rank, gsize, device, group, root)
                for _ in range(max(warmup, 1)):
                    op()
                _sync(device)
                ops[nbytes] = op
            except (RuntimeError, NotImplementedError, ValueError) as e:
                err = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            flag.fill_(1.0 if err else 0.0)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() > 0:
                skipped[name if gsize == world else f"{name} n={gsize}"] = (
                    err or "not supported on another rank")
                ops = {}
                break
        if not ops:
            continue
        times: dict[int, list[float]] = {n: [] for n in ops}
        per_pass = -(-iters // passes)
        for nbytes in size_order(list(ops), passes):
            timed = _timed(ops[nbytes], per_pass, device)
            # every rank must make the same number of calls: agree on how many more
            more = min(max(max_iters // passes, per_pass),
                       int(min_time_s / passes / max(statistics.median(timed), 1e-9)))
            extra = torch.tensor([max(more - per_pass, 0)], dtype=torch.float64)
            dist.all_reduce(extra, op=dist.ReduceOp.MAX)
            times[nbytes] += timed + _timed(ops[nbytes], int(extra.item()), device)
        points: list[tuple[int, float]] = []
        for nbytes in ops:
            med = torch.tensor([sample_seconds(name, times[nbytes], world)],
                               dtype=torch.float64)
            dist.all_reduce(med, op=dist.ReduceOp.MAX)
            points.append((nbytes, float(med.item())))
        dist.barrier()
        out[(name, gsize)] = points
    return out, skipped


def profile_collectives(
    world_size: int,
    *,
    backend: str = "gloo",
    sizes: Sequence[int] = DEFAULT_SIZES,
    collectives: Sequence[str] = DEFAULT_COLLECTIVES,
    link_kind: str = "loopback",
    warmup: int = 2,
    iters: int = 5,
    max_iters: int = 50,
    min_time_s: float = 0.05,
    timeout_s: float = 120.0,
    threads_per_process: int | None = 1,
    group_sizes: Sequence[int] | None = None,
    passes: int = 3,
) -> CollectiveProfile:
    """Measure collectives on ``world_size`` local processes and fit α–β lines.

    Args:
        world_size: processes (≥ 2); the group size of the records (p2p: 2), and of one
            more record per collective for each of ``group_sizes``.
        backend: ``gloo`` (CPU tensors) or ``nccl`` (one GPU per process).
        sizes: buffer sizes in bytes (see the module docstring for what they mean).
        collectives: names from :data:`hetplan.cost_models.comm.COLLECTIVES`.
        link_kind: the :data:`~hetplan.ir.cluster.LinkKind` the records are filed under
            (``loopback`` for processes on one host, ``nvlink``/``pcie`` for GPUs of one
            node).
        warmup / iters: untimed calls, and the minimum timed calls, per size.
        max_iters / min_time_s: small sizes get more calls, up to ``max_iters``, until
            ``min_time_s`` has been spent on the size.
        timeout_s: process-group timeout and limit on the whole run.
        threads_per_process: torch threads per process (gloo reductions are single-threaded).
        group_sizes: smaller groups to measure too, every group of a size at once
            (:func:`subgroups`: 2 of 4 is two pairs talking together, as the tensor- or
            data-parallel groups of a ``tp=2`` plan on 4 ranks do). Default: every divisor
            of ``world_size`` from 2 below it. Rescaling the whole world's line by latency
            steps (:mod:`hetplan.cost_models.comm`) assumes a step costs the same in a small
            group; with more processes than cores it does not (a ring step waits for a
            sleeping peer's wake-up), so the sizes plans use are measured (rooted routines
            too, each group rooted at its first rank). Not for p2p.
        passes: rounds over the sizes (:func:`size_order`); ``iters``, ``max_iters`` and
            ``min_time_s`` are split over them.

    Returns:
        A :class:`CollectiveProfile`: records with samples and fitted ``alpha_s`` /
        ``beta_s_per_byte`` (:func:`~hetplan.cost_models.comm.fit_alpha_beta`), skipped
        collectives with the reason, and the wall time.

    Raises:
        ValueError: ``world_size`` < 2, an unknown collective, no sizes, or a group size
            that does not divide ``world_size``.
        TimeoutError: the run exceeded ``timeout_s``.

    Example:
        >>> prof = profile_collectives(2, sizes=(4096, 2**20))  # doctest: +SKIP
        >>> [r.collective for r in prof.records]  # doctest: +SKIP
        ['allreduce', 'allgather', 'broadcast', 'reduce_scatter', 'alltoall', 'reduce', 'gather',
         'p2p']
    """
    from hetplan.profiling._spawn import run_local_ranks

    if world_size < 2:
        raise ValueError(f"collectives need world_size >= 2, got {world_size}")
    unknown = [c for c in collectives if c not in _ALL]
    if unknown:
        raise ValueError(f"unknown collective(s) {unknown} (known: {', '.join(_ALL)})")
    if not sizes or min(sizes) <= 0:
        raise ValueError(f"sizes must be positive byte counts, got {list(sizes)}")
    if group_sizes is None:
        group_sizes = [g for g in range(2, world_size) if world_size % g == 0]
    for g in group_sizes:
        subgroups(world_size, g)  # raises for a size that does not divide the world
    size_order(sizes, passes)  # raises for passes < 1
    device = "cuda" if backend == "nccl" else "cpu"
    t0 = time.perf_counter()
    results = run_local_ranks(
        _worker,
        world_size,
        (tuple(collectives), tuple(sorted(sizes)), warmup, iters, max_iters, min_time_s,
         device, tuple(sorted(set(group_sizes) - {world_size})), passes),
        backend=backend,
        timeout_s=timeout_s,
        threads_per_process=threads_per_process,
    )
    points, skipped = results[0]
    prof = CollectiveProfile(skipped=dict(skipped))
    for (name, gsize), pts in sorted(points.items(), key=lambda kv: (kv[0][1] != world_size,
                                                                     kv[0][1])):
        line = fit_alpha_beta(pts)
        prof.records.append(CollectiveRecord(
            collective=name,
            backend=backend,
            link_kind=link_kind,
            group_size=2 if name == "p2p" else gsize,
            samples=tuple(CollectiveSample(nbytes=n, seconds=s) for n, s in pts),
            alpha_s=line.alpha_s,
            beta_s_per_byte=line.beta_s_per_byte,
        ))
    prof.seconds = time.perf_counter() - t0
    return prof
