"""The data-parallel timeline simulator: backprop, (de)compression and communication overlap.

This is the objective every gradient-sync pass (DDP bucketing, Espresso, Cupcake) scores
candidates with, so it is pure Python over plain floats and fast (one evaluation of 314
gradient tensors takes well under a millisecond; see ``bench/simulator_speed.py``).

Semantics (``research/zen_espresso.md`` §E.2, ``research/cupcake_gemini.md`` §A3):

- Gradient tensors are indexed in backward-ready order; ``backprop_s[i]`` is the backprop
  compute between tensor ``i-1`` becoming ready and tensor ``i`` becoming ready.
- A *sync unit* (one tensor, or a bucket of consecutive tensors) becomes ready when its last
  tensor's backprop segment ends. Its ops run in order; each starts when the previous op has
  finished **and** its resource is free.
- Resources:
  - ``"gpu"``: the one compute stream, shared with backprop. A runnable GPU op (compression,
    decompression) runs as soon as the stream finishes its current backprop segment, ahead of
    the remaining backprop, so it delays every later gradient (Espresso Fig. 4.2(c)).
  - ``"cpu"``: a pool of ``cpu_workers`` compression workers, FIFO.
  - any other name (``"net"``, ``"intra"``, ``"inter"``): a communication channel, FIFO in
    order of becoming runnable, one op at a time.
- Iteration time ``= forward_s + max(end of backprop, end of every op) + optimizer_s``.

Ties (two ops runnable at the same instant on one resource) go to the unit that became ready
first, then the lower unit index: deterministic.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["Op", "SyncUnit", "DPEvent", "DPTimeline", "DPSession", "dp_session", "jit_enabled",
           "jit_error", "warm_up", "search_offload",
           "before_last_busy_period", "simulate_dp", "GPU", "CPU"]

GPU = "gpu"
CPU = "cpu"
#: relative slack of the lower bounds that stop a trial (rounding: the run and the bounds add
#: the same durations in other orders), at least this much in absolute terms
_EPS_BOUND = 1e-12
#: relative slack of the release bound (:func:`_release_bounds` sums in another order than
#: the run: rounding of up to ~1e-13 relative for a thousand tensors)
_EPS_RELEASE = 1e-9


@dataclass(frozen=True, slots=True)
class Op:
    """One step of a unit's sync path: ``duration_s`` on ``resource``."""

    resource: str
    duration_s: float
    label: str = ""


@dataclass(frozen=True, slots=True)
class SyncUnit:
    """A tensor or a bucket: ready after tensor ``last_tensor``'s backprop; then ``ops``."""

    last_tensor: int
    ops: tuple[Op, ...]
    name: str = ""


@dataclass(frozen=True, slots=True)
class DPEvent:
    """A timed interval of the simulated iteration (times from the start of backprop)."""

    resource: str
    label: str
    unit: int  # -1 for backprop segments
    start_s: float
    end_s: float


@dataclass(frozen=True, slots=True)
class DPTimeline:
    """Result of :func:`simulate_dp`.

    Attributes:
        iteration_s: forward + backprop/sync end + optimizer.
        backprop_end_s: when the last backprop segment ended (delayed by GPU ops).
        sync_end_s: when the last sync op ended (0 if none).
        exposed_comm_s: time after the end of backprop spent waiting for sync.
        busy_s: total busy time per resource.
        events: every interval, if ``record=True`` (else empty).
    """

    iteration_s: float
    backprop_end_s: float
    sync_end_s: float
    exposed_comm_s: float
    busy_s: dict[str, float]
    events: tuple[DPEvent, ...] = ()


def simulate_dp(
    backprop_s: Sequence[float],
    units: Sequence[SyncUnit],
    *,
    forward_s: float = 0.0,
    optimizer_s: float = 0.0,
    cpu_workers: int = 1,
    record: bool = False,
) -> DPTimeline:
    """Simulate one data-parallel iteration (see module docstring).

    Args:
        backprop_s: backprop time preceding each gradient tensor becoming ready.
        units: sync units; ``last_tensor`` indexes ``backprop_s``.
        forward_s: forward time (added before backprop).
        optimizer_s: optimizer step (added at the end).
        cpu_workers: size of the CPU compression pool.
        record: also return every interval in ``events``.

    Returns:
        The timeline. Complexity O((N + K) log K) for N tensors and K ops.
    """
    n = len(backprop_s)
    for u in units:
        if not 0 <= u.last_tensor < n:
            raise ValueError(
                f"sync unit {u.name!r} ends at tensor {u.last_tensor}, outside 0..{n - 1}"
            )
    if cpu_workers < 1:
        raise ValueError(f"cpu_workers must be >= 1, got {cpu_workers}")
    if all(op.resource != GPU for u in units for op in u.ops):
        return _simulate_no_gpu_ops(backprop_s, units, forward_s, optimizer_s, cpu_workers, record)
    return _simulate_general(backprop_s, units, forward_s, optimizer_s, cpu_workers, record)


class _Resources:
    """The CPU worker pool and the FIFO channels: run an op as soon as it and its resource
    are ready; record busy time (and the interval, when ``events`` is given)."""

    __slots__ = ("cpu", "free", "busy", "events")

    def __init__(
        self, cpu_workers: int, busy: dict[str, float], events: list[DPEvent] | None
    ) -> None:
        self.cpu = [0.0] * cpu_workers
        self.free: dict[str, float] = {}
        self.busy = busy
        self.events = events

    def run(self, op: Op, t: float, unit: int) -> float:
        """Start ``op`` (runnable at ``t``) on its resource; return its end time."""
        if op.resource == CPU:
            w = min(range(len(self.cpu)), key=self.cpu.__getitem__)
            s = max(t, self.cpu[w])
            self.cpu[w] = s + op.duration_s
        else:
            s = max(t, self.free.get(op.resource, 0.0))
            self.free[op.resource] = s + op.duration_s
        e = s + op.duration_s
        self.busy[op.resource] = self.busy.get(op.resource, 0.0) + op.duration_s
        if self.events is not None:
            self.events.append(DPEvent(op.resource, op.label, unit, s, e))
        return e


def _finish(
    forward_s: float,
    optimizer_s: float,
    bp_end: float,
    sync_end: float,
    busy: dict[str, float],
    events: list[DPEvent],
) -> DPTimeline:
    end = max(bp_end, sync_end)
    return DPTimeline(
        iteration_s=forward_s + end + optimizer_s,
        backprop_end_s=bp_end,
        sync_end_s=sync_end,
        exposed_comm_s=end - bp_end,
        busy_s=busy,
        events=tuple(events),
    )


def _simulate_no_gpu_ops(
    backprop_s: Sequence[float],
    units: Sequence[SyncUnit],
    forward_s: float,
    optimizer_s: float,
    cpu_workers: int,
    record: bool,
) -> DPTimeline:
    """Fast path: no op competes with backprop, so ready times are fixed up front."""
    ready = []
    t = 0.0
    for b in backprop_s:
        t += b
        ready.append(t)
    bp_end = t
    busy: dict[str, float] = {"gpu": bp_end}
    events: list[DPEvent] = []
    if record:
        start = 0.0
        for i, b in enumerate(backprop_s):
            events.append(DPEvent(GPU, f"backprop {i}", -1, start, start + b))
            start += b
    order = sorted(range(len(units)), key=lambda k: (ready[units[k].last_tensor], k))
    single = all(len(units[k].ops) == 1 for k in order)
    if single:
        res = _Resources(cpu_workers, busy, events if record else None)
        sync_end = 0.0
        for k in order:
            sync_end = max(sync_end, res.run(units[k].ops[0], ready[units[k].last_tensor], k))
        return _finish(forward_s, optimizer_s, bp_end, sync_end, busy, events)
    return _event_loop(ready, None, units, forward_s, optimizer_s, cpu_workers, busy, events,
                       record, bp_end)


def _simulate_general(
    backprop_s: Sequence[float],
    units: Sequence[SyncUnit],
    forward_s: float,
    optimizer_s: float,
    cpu_workers: int,
    record: bool,
) -> DPTimeline:
    return _event_loop(None, backprop_s, units, forward_s, optimizer_s, cpu_workers,
                       {"gpu": 0.0}, [], record, None)


def _event_loop(
    ready: list[float] | None,
    backprop_s: Sequence[float] | None,
    units: Sequence[SyncUnit],
    forward_s: float,
    optimizer_s: float,
    cpu_workers: int,
    busy: dict[str, float],
    events: list[DPEvent],
    record: bool,
    bp_end_fixed: float | None,
) -> DPTimeline:
    """Discrete-event loop. With ``backprop_s`` the GPU stream interleaves backprop segments
    with GPU ops (GPU ops first once runnable); with ``ready`` backprop is fixed."""
    by_last: dict[int, list[int]] = {}
    for k, u in enumerate(units):
        by_last.setdefault(u.last_tensor, []).append(k)
    # runnable queue: (runnable time, unit ready time, unit, op index)
    runnable: list[tuple[float, float, int, int]] = []
    unit_ready = [0.0] * len(units)
    if ready is not None:
        for k, u in enumerate(units):
            unit_ready[k] = ready[u.last_tensor]
            if u.ops:
                heapq.heappush(runnable, (unit_ready[k], unit_ready[k], k, 0))
    res = _Resources(cpu_workers, busy, events if record else None)
    gpu_queue: list[tuple[float, float, int, int]] = []  # runnable GPU ops
    gpu_free = 0.0
    next_bp = 0
    n_bp = len(backprop_s) if backprop_s is not None else 0
    sync_end = 0.0

    def run_op(t: float, k: int, j: int) -> None:
        nonlocal sync_end
        e = res.run(units[k].ops[j], t, k)
        if j + 1 < len(units[k].ops):
            heapq.heappush(runnable, (e, unit_ready[k], k, j + 1))
        else:
            sync_end = max(sync_end, e)

    while True:
        # the GPU stream, when it is simulated, advances up to the next runnable event
        if backprop_s is not None:
            horizon = runnable[0][0] if runnable else float("inf")
            while gpu_free < horizon:
                if gpu_queue and gpu_queue[0][0] <= gpu_free:
                    t, r, k, j = heapq.heappop(gpu_queue)
                    op = units[k].ops[j]
                    s, e = gpu_free, gpu_free + op.duration_s
                    gpu_free = e
                    busy[GPU] += op.duration_s
                    if record:
                        events.append(DPEvent(GPU, op.label, k, s, e))
                    if j + 1 < len(units[k].ops):
                        heapq.heappush(runnable, (e, r, k, j + 1))
                        horizon = min(horizon, e)
                    else:
                        sync_end = max(sync_end, e)
                elif next_bp < n_bp:
                    s = gpu_free
                    e = s + backprop_s[next_bp]
                    gpu_free = e
                    busy[GPU] += backprop_s[next_bp]
                    if record:
                        events.append(DPEvent(GPU, f"backprop {next_bp}", -1, s, e))
                    for k in by_last.get(next_bp, ()):
                        unit_ready[k] = e
                        if units[k].ops:
                            heapq.heappush(runnable, (e, e, k, 0))
                            horizon = min(horizon, e)
                    next_bp += 1
                    if next_bp == n_bp:
                        bp_end_fixed = e
                elif gpu_queue:
                    gpu_free = max(gpu_free, gpu_queue[0][0])
                else:
                    break
        if not runnable:
            if backprop_s is not None and (gpu_queue or next_bp < n_bp):
                continue
            break
        t, r, k, j = heapq.heappop(runnable)
        if units[k].ops[j].resource == GPU and backprop_s is not None:
            heapq.heappush(gpu_queue, (t, r, k, j))
            continue
        run_op(t, k, j)
    bp_end = bp_end_fixed if bp_end_fixed is not None else 0.0
    return _finish(forward_s, optimizer_s, bp_end, sync_end, busy, events)


class DPSession:
    """Fast, resumable :func:`simulate_dp` for one sync unit per tensor (unit ``i`` ends at
    tensor ``i``), for searches that change a few tensors' ops at a time (Espresso).

    :meth:`rebase` simulates a *base* strategy once and keeps the simulator's state at the
    start of every backprop segment. That state depends only on the ops of the earlier
    tensors: unit ``i`` enters the timeline when segment ``i`` ends, and the event order is a
    fixed function of the state. :meth:`trial` therefore resumes from the state at the first
    tensor whose ops differ from the base and replays the same float operations in the same
    order as :func:`simulate_dp`'s general event loop: its result equals
    ``simulate_dp(...).iteration_s`` bit for bit (``tests/unit/test_timeline_session.py``
    checks this on random instances, with and without GPU and CPU ops).

    With ``bound`` a trial may stop early and return ``inf`` once the iteration is proven
    longer than ``bound``: the lower bound ``max over resources r of (r's free time + the
    work still to start on r)`` (the GPU counts the remaining backprop too; CPU work is spread
    over the pool) is checked at the resume point, and ``op start + the work on its resource
    from this op on`` (plus the remaining backprop for the GPU) at every channel and GPU op,
    and the release bound of the later tensors' work (:func:`_release_bounds`) at every
    segment start after the changed tensors. A returned finite value is always exact. A
    trial also stops, returning the base's time, when its state at a segment start after
    every changed tensor is equivalent to the base's there (:meth:`_converged`): the rest of
    the run is then the base's.

    Args:
        backprop_s: backprop time before each tensor becomes ready.
        forward_s / optimizer_s / cpu_workers: as for :func:`simulate_dp`.
    """

    __slots__ = ("_bp", "_fwd", "_opt", "_workers", "_suffix_bp", "_ops", "_snaps", "_pend",
                 "_suffix", "_snap_gpu", "base_s", "trials", "_release")

    def __init__(
        self,
        backprop_s: Sequence[float],
        *,
        forward_s: float = 0.0,
        optimizer_s: float = 0.0,
        cpu_workers: int = 1,
    ) -> None:
        if cpu_workers < 1:
            raise ValueError(f"cpu_workers must be >= 1, got {cpu_workers}")
        self._bp = tuple(backprop_s)
        self._fwd = forward_s
        self._opt = optimizer_s
        self._workers = cpu_workers
        suffix = [0.0] * (len(self._bp) + 1)
        for i in range(len(self._bp) - 1, -1, -1):
            suffix[i] = suffix[i + 1] + self._bp[i]
        self._suffix_bp = suffix
        self._ops: list[tuple[Op, ...]] = []
        self._snaps: list[tuple[float, list, list, dict[str, float], list[float], float]] = []
        self._pend: dict[int, dict[str, float]] = {}
        self._suffix: list[dict[str, float]] = []
        self._snap_gpu: list[float] = []
        self.base_s = 0.0
        self.trials = 0  # trials run by best_offload
        self._release: list[float] = []

    @property
    def base_ops(self) -> list[tuple[Op, ...]]:
        """The base strategy's ops per tensor (do not modify)."""
        return self._ops

    def rebase(self, unit_ops: Sequence[tuple[Op, ...]]) -> float:
        """Simulate ``unit_ops`` (one ops tuple per tensor) as the new base; its iteration time.

        Only the tensors from the first one whose ops differ from the current base's are
        re-simulated (the saved states before it do not depend on them), from that state."""
        if len(unit_ops) != len(self._bp):
            raise ValueError(f"{len(unit_ops)} units for {len(self._bp)} tensors: one per tensor")
        new = list(unit_ops)
        n = len(self._bp)
        m, last = 0, n - 1
        if n and len(self._snaps) == n and len(self._ops) == n:
            while m < n and new[m] == self._ops[m]:
                m += 1
            if m == n:
                self._ops = new
                return self.base_s
            while new[last] == self._ops[last]:
                last -= 1
        self._ops = new
        if m == 0 or not self._snaps:
            m = 0
            self._snaps = []
            state: tuple = (0.0, [], [], {}, [0.0] * self._workers, 0.0)
        else:
            gpu_free, runnable, gpu_queue, free, cpu, sync_end = self._snaps[m]
            state = (gpu_free, runnable.copy(), gpu_queue.copy(), dict(free), cpu.copy(),
                     sync_end)
            del self._snaps[m:]
        self._snap_gpu = []
        gpu_free, runnable, gpu_queue, free, cpu, sync_end = state
        self.base_s = self._run(self._ops, gpu_free, m, runnable, gpu_queue, free, cpu,
                                sync_end, self._snaps, float("inf"), None)
        self._snap_gpu = [snap[0] for snap in self._snaps]
        # the work left per resource from each tensor on (from m down; later ones are kept)
        if len(self._suffix) != n + 1:
            self._suffix, last = [{} for _ in range(n + 1)], n - 1
        suffix = self._suffix
        for i in range(last, -1, -1):
            acc = dict(suffix[i + 1])
            for op in self._ops[i]:
                acc[op.resource] = acc.get(op.resource, 0.0) + op.duration_s
            suffix[i] = acc
        self._release = _release_bounds(self._bp, self._ops, self._workers, suffix)
        # in-flight work at each saved state: computed when a trial needs it; states up to
        # m hold only tensors before m, which did not change
        self._pend = {i: p for i, p in self._pend.items() if i <= m}
        return self.base_s

    def _pending(self, i: int) -> dict[str, float]:
        """Work per resource of the ops queued (not yet started) at the state before
        segment ``i``, for the trial bound."""
        pend = self._pend.get(i)
        if pend is None:
            _, runnable, gpu_queue, _, _, _ = self._snaps[i]
            pend = {}
            for _, _, k, j in itertools.chain(runnable, gpu_queue):
                for op in self._ops[k][j:]:
                    pend[op.resource] = pend.get(op.resource, 0.0) + op.duration_s
            self._pend[i] = pend
        return pend

    def trial(
        self,
        changes: dict[int, tuple[Op, ...]],
        *,
        bound: float = float("inf"),
    ) -> float:
        """Iteration time of the base strategy with tensor ``i``'s ops replaced by
        ``changes[i]``; ``inf`` when ``bound`` is finite and the time is proven > ``bound``."""
        if not changes:
            return self.base_s
        first = min(changes)
        if not 0 <= first < len(self._bp) or max(changes) >= len(self._bp):
            raise ValueError(f"tensor index outside 0..{len(self._bp) - 1}: {sorted(changes)}")
        ops = self._ops
        if len(changes) == 1:
            ops = ops.copy()
            ops[first] = changes[first]
        else:
            ops = [changes.get(i, o) for i, o in enumerate(ops)]
        rem = None
        if bound < float("inf"):
            rem = dict(self._pending(first))
            for r, d in self._suffix[first].items():
                rem[r] = rem.get(r, 0.0) + d
            for i, new in changes.items():
                for op in self._ops[i]:
                    rem[op.resource] -= op.duration_s
                for op in new:
                    rem[op.resource] = rem.get(op.resource, 0.0) + op.duration_s
        gpu_free, runnable, gpu_queue, free, cpu, sync_end = self._snaps[first]
        if rem is not None and self._bound(gpu_free, first, free, cpu, sync_end,
                                           rem) > bound + _EPS_BOUND * max(1.0, abs(bound)):
            return float("inf")
        return self._run(ops, gpu_free, first, runnable.copy(), gpu_queue.copy(), dict(free),
                         cpu.copy(), sync_end, None, bound, rem, tuple(changes))

    def best_option(self, j: int, candidates: Sequence[tuple[Op, ...]], backs: Sequence[bool],
                    best: float, eps: float) -> tuple[int, float]:
        """Algorithm 4.1's ``GetBestOption`` for tensor ``j``: try ``candidates`` (ops lists)
        in order; candidate ``c`` is kept when its time is below ``best - eps``, or at most
        ``best + eps`` when ``backs[c]`` (the baseline option, preferred on a tie). Each trial
        is bounded by what it must beat. Returns ``(index of the kept candidate or -1, its
        time or best)``."""
        chosen = -1
        for c, (ops, back) in enumerate(zip(candidates, backs)):
            f = self.trial({j: ops}, bound=best + eps if back else best - eps)
            if f < best - eps or (back and f <= best + eps):
                best, chosen = f, c
        return chosen, best

    def best_classes(self, class_idx: Sequence[int],
                     strategies: Sequence[Sequence[tuple[Op, ...]]]) -> tuple[int, float]:
        """The fastest of whole strategies given per class of tensors: in strategy ``s``
        tensor ``i`` gets the ops ``strategies[s][class_idx[i]]`` (e.g. uniform strategies,
        tensors of one size sharing their ops). Each trial is bounded by the best so far; the
        first of equals wins. Returns ``(index, time)``; ``(-1, inf)`` without strategies."""
        if any(len(sd) != len(strategies[0]) for sd in strategies):
            raise ValueError("best_classes: every strategy needs ops for the same classes")
        best, best_s = float("inf"), -1
        for s, ops in enumerate(strategies):
            f = self.trial({i: ops[c] for i, c in enumerate(class_idx)}, bound=best)
            if best_s < 0 or f < best:
                best, best_s = f, s
        return best_s, best

    def best_offload(self, groups: Sequence[Sequence[int]],
                     offloaded: dict[int, tuple[Op, ...]], best: float, eps: float,
                     exhaustive: bool = True) -> tuple[list[int], float]:
        """Algorithm 4.2 over offloading vectors ``u`` (``0 <= u[g] <= len(groups[g])``;
        ``u`` replaces the ops of the first ``u[g]`` tensors of each group by
        ``offloaded[i]``). A vector is kept when its time is below ``best - eps``, each trial
        bounded by that. With ``exhaustive``, every vector in :func:`itertools.product` order
        (Theorem 4.1; the first of equals wins); otherwise coordinate descent: one group's
        count at a time, repeated until no group changes. Returns ``(u, its time)``, ``u``
        all zeros when none beats ``best``."""

        def score(u: Sequence[int], bound: float) -> float:
            self.trials += 1
            changes = {i: offloaded[i] for g, k in zip(groups, u) for i in g[:k]}
            return self.trial(changes, bound=bound)

        return search_offload([len(g) for g in groups], score, best, eps, exhaustive)

    def before_bubbles(self, eps: float) -> set[int]:
        """:func:`before_last_busy_period` of the base strategy (``eps >= 0``)."""
        if eps < 0:
            raise ValueError(f"before_bubbles needs eps >= 0, got {eps}")
        units = [SyncUnit(i, o) for i, o in enumerate(self._ops)]
        return before_last_busy_period(self._bp, units, self._workers, eps)

    def _converged(self, m: int, runnable: list, gpu_queue: list, free: dict[str, float],
                   cpu: list[float], sync_end: float, changed: Sequence[int]) -> bool:
        """Whether a trial's state at the start of segment ``m`` (all changed tensors before
        ``m``, same ``gpu_free``) behaves exactly like the base's there, so that the rest of
        the run, and the result, are the base's. Times at or before ``now`` are equivalent
        (every remaining op starts after ``now`` and ``max(t, free)`` then gives ``t``;
        ``sync_end`` only meets the backprop end, which is later), and no changed tensor may
        still have ops in flight."""
        now, b_run, b_queue, b_free, b_cpu, b_sync = self._snaps[m]
        if max(sync_end, now) != max(b_sync, now) or len(runnable) != len(b_run) \
                or len(gpu_queue) != len(b_queue):
            return False
        # equal heaps have equal tops: a cheap rejection before the full comparison below
        if (runnable and runnable[0] != b_run[0]) or (gpu_queue and gpu_queue[0] != b_queue[0]):
            return False
        for r in set(free) | set(b_free):
            if max(free.get(r, 0.0), now) != max(b_free.get(r, 0.0), now):
                return False
        if sorted(max(w, now) for w in cpu) != sorted(max(w, now) for w in b_cpu):
            return False
        if any(e[2] in changed for e in runnable) or any(e[2] in changed for e in gpu_queue):
            return False
        return sorted(runnable) == sorted(b_run) and sorted(gpu_queue) == sorted(b_queue)

    def _bound(self, gpu_free: float, next_bp: int, free: dict[str, float], cpu: list[float],
               sync_end: float, rem: dict[str, float]) -> float:
        """A lower bound on the iteration time from a segment start (see the class doc)."""
        # every op still to start starts at or after ``now``: the GPU stream only starts a
        # segment while every runnable op is later, and later units are ready after it
        now = gpu_free
        end = max(sync_end, now + self._suffix_bp[next_bp] + rem.get(GPU, 0.0))
        for r, d in rem.items():
            if r == GPU or d <= 0.0:
                continue
            if r == CPU:
                acc = 0.0  # left to right, as the compiled kernel adds (not sum())
                for w in cpu:
                    acc += max(w, now)
                end = max(end, (acc + d) / len(cpu))
            else:
                end = max(end, max(free.get(r, 0.0), now) + d)
        return self._fwd + end + self._opt

    def _run(
        self,
        uops: Sequence[tuple[Op, ...]],
        gpu_free: float,
        next_bp: int,
        runnable: list[tuple[float, float, int, int]],
        gpu_queue: list[tuple[float, float, int, int]],
        free: dict[str, float],
        cpu: list[float],
        sync_end: float,
        snaps: list | None,
        bound: float,
        rem: dict[str, float] | None,
        changed: Sequence[int] = (),
    ) -> float:
        """:func:`_event_loop`'s general path (same float operations in the same order) over
        one unit per tensor, from a saved state."""
        bp = self._bp
        n = len(bp)
        inf = float("inf")
        push, pop = heapq.heappush, heapq.heappop
        bp_end = 0.0
        single_cpu = len(cpu) == 1
        suffix_bp = self._suffix_bp
        limit = bound + _EPS_BOUND * max(1.0, abs(bound)) - self._fwd - self._opt
        release_limit = limit + _EPS_RELEASE * max(1.0, abs(limit))
        last_changed = max(changed) if changed else n
        snap_gpu = self._snap_gpu
        release = self._release
        # changed tensors whose ops have not all finished: the state cannot equal the
        # base's before they have (a cheap pre-check of :meth:`_converged`)
        moving = {k for k in changed if uops[k]}
        while True:
            horizon = runnable[0][0] if runnable else inf
            while gpu_free < horizon:
                if gpu_queue and gpu_queue[0][0] <= gpu_free:
                    t, r, k, j = pop(gpu_queue)
                    ops = uops[k]
                    d = ops[j].duration_s
                    if rem is not None:
                        left = rem[GPU]
                        if gpu_free + left + suffix_bp[next_bp] > limit:
                            return inf
                        rem[GPU] = left - d
                    e = gpu_free + d
                    gpu_free = e
                    if j + 1 < len(ops):
                        push(runnable, (e, r, k, j + 1))
                        if e < horizon:
                            horizon = e
                    else:
                        if e > sync_end:
                            sync_end = e
                        if moving:
                            moving.discard(k)
                elif next_bp < n:
                    if snaps is not None:
                        snaps.append((gpu_free, runnable.copy(), gpu_queue.copy(), dict(free),
                                      cpu.copy(), sync_end))
                    else:
                        if rem is not None and next_bp > last_changed and \
                                gpu_free + release[next_bp] > release_limit:
                            return inf  # the work of the tensors from next_bp on
                        if not moving and next_bp > last_changed and \
                                gpu_free == snap_gpu[next_bp] and self._converged(
                                    next_bp, runnable, gpu_queue, free, cpu, sync_end, changed):
                            return self.base_s
                    e = gpu_free + bp[next_bp]
                    gpu_free = e
                    if uops[next_bp]:
                        push(runnable, (e, e, next_bp, 0))
                        if e < horizon:
                            horizon = e
                    next_bp += 1
                    if next_bp == n:
                        bp_end = e
                elif gpu_queue:
                    gpu_free = max(gpu_free, gpu_queue[0][0])
                else:
                    break
            if not runnable:
                if gpu_queue or next_bp < n:
                    continue
                break
            t, r, k, j = pop(runnable)
            ops = uops[k]
            op = ops[j]
            res = op.resource
            if res == GPU:
                push(gpu_queue, (t, r, k, j))
                continue
            d = op.duration_s
            if res == CPU:
                w = 0 if single_cpu else min(range(len(cpu)), key=cpu.__getitem__)
                s = cpu[w]
                if t > s:  # max(t, cpu[w]) without the call
                    s = t
                cpu[w] = s + d
            else:
                s = free.get(res, 0.0)
                if t > s:
                    s = t
                free[res] = s + d
            e = s + d
            if rem is not None:
                left = rem[res]
                if res != CPU and s + left > limit:
                    return inf  # this and the rest of res's work run one after another
                rem[res] = left - d
            if j + 1 < len(ops):
                push(runnable, (e, r, k, j + 1))
            else:
                if e > sync_end:
                    sync_end = e
                if moving:
                    moving.discard(k)
        if n == 0:
            bp_end = 0.0
        return self._fwd + max(bp_end, sync_end) + self._opt


def _release_bounds(bp: Sequence[float], uops: Sequence[tuple[Op, ...]], workers: int,
                    suffix: Sequence[dict[str, float]]) -> list[float]:
    """``out[m]``: a lower bound on ``end - now`` (end of the last op, ``now`` the GPU's time
    at the start of segment ``m``) from the work of tensors ``m..n-1`` alone. Tensor ``k``
    is ready no earlier than ``now + bp[m] + ... + bp[k]``; on a channel all work of tensors
    ``>= k`` (``suffix[k]``, the session's work per resource from tensor ``k`` on) starts no
    earlier than that plus the shortest lead (ops before a tensor's first op there) and runs
    one op at a time, and the op that ends last is followed by its tensor's tail (ops after
    its last op there): so ``end >= ready_k + lead + work + tail``. On the CPU pool the work
    is spread over the workers."""
    n = len(bp)
    inf = float("inf")
    out = [-inf] * (n + 1)
    lead: dict[str, float] = {}  # over tensors >= k: a resource is here once it has ops
    tail: dict[str, float] = {}
    before = 0.0
    for b in bp:  # left to right, as the compiled kernel adds (Python 3.12's sum() compensates)
        before += b
    best = -inf
    for k in range(n - 1, -1, -1):
        ops = uops[k]
        pre = 0.0
        first: dict[str, float] = {}
        for op in ops:
            if op.resource != GPU:
                first.setdefault(op.resource, pre)
            pre += op.duration_s
        post = 0.0
        last: dict[str, float] = {}
        for op in reversed(ops):
            if op.resource != GPU:
                last.setdefault(op.resource, post)
            post += op.duration_s
        for r, x in first.items():
            lead[r] = min(lead.get(r, inf), x)
            tail[r] = min(tail.get(r, inf), last[r])
        # ready_k - now >= bp[m] + ... + bp[k] = before - (bp[0] + ... + bp[m-1])
        for r, x in lead.items():
            w = suffix[k][r]
            span = x + (w / workers if r == CPU else w) + tail[r]
            if before + span > best:
                best = before + span
        before -= bp[k]
        out[k] = best - before  # before = bp[0] + ... + bp[k-1]
    return out


def search_offload(
    counts: Sequence[int],
    score: Callable[[Sequence[int], float], float],
    best: float,
    eps: float,
    exhaustive: bool = True,
) -> tuple[list[int], float]:
    """Algorithm 4.2's search over vectors ``u`` with ``0 <= u[g] <= counts[g]``:
    ``score(u, bound)`` is ``u``'s time (or anything above ``bound`` once proven longer). A
    vector is kept when its time is below ``best - eps``. With ``exhaustive``, every vector
    in :func:`itertools.product` order (Theorem 4.1; the first of equals wins); otherwise
    coordinate descent: one group's count at a time, repeated until no group changes.
    Returns ``(u, its time)``, ``u`` all zeros when none beats ``best``."""
    best_u = [0] * len(counts)
    if exhaustive:
        for u in itertools.product(*(range(c + 1) for c in counts)):
            if any(u) and (f := score(u, best - eps)) < best - eps:
                best, best_u = f, list(u)
        return best_u, best
    changed = True
    while changed:
        changed = False
        for gi, c in enumerate(counts):
            for k in range(c + 1):
                if k == best_u[gi]:
                    continue
                trial = best_u.copy()
                trial[gi] = k
                if (f := score(trial, best - eps)) < best - eps:
                    best, best_u, changed = f, trial, True
    return best_u, best


def before_last_busy_period(backprop_s: Sequence[float], units: Sequence[SyncUnit],
                            cpu_workers: int = 1, eps: float = 1e-9) -> set[int]:
    """Units whose communication ends no later than the start of the last busy period of the
    communication channels (all channels together), where a gap is only a gap if no unit
    *spans* it (became ready before it and still has ops after it): a gap inside one unit's
    own path, e.g. its decompression between two communication steps after it waited behind
    earlier units, closes when the earlier communication shortens. Espresso's Property #1
    (:func:`hetplan.algorithms.espresso.tensors_before_bubbles`); gaps of at most ``eps``
    are no gaps."""
    tl = simulate_dp(backprop_s, units, record=True, cpu_workers=cpu_workers)
    comm = sorted((e.start_s, e.end_s, e.unit) for e in tl.events
                  if e.unit >= 0 and e.resource not in (GPU, CPU))
    if not comm:
        return set()
    ready = [0.0] * len(backprop_s)
    done: dict[int, float] = {}
    for ev in tl.events:
        if ev.unit < 0:
            ready[int(ev.label.rsplit(" ", 1)[1])] = ev.end_s
        else:
            done[ev.unit] = max(done.get(ev.unit, 0.0), ev.end_s)
    last_start, reach = comm[0][0], comm[0][1]
    for s, e, _ in comm[1:]:
        if s > reach + eps and not any(ready[u] < s - eps and end > reach + eps
                                       for u, end in done.items()):
            last_start = s
        reach = max(reach, e)
    ends: dict[int, float] = {}
    for _, e, u in comm:
        ends[u] = max(ends.get(u, 0.0), e)
    return {u for u, e in ends.items() if e <= last_start + eps}


_JIT_ERROR: list[str] = []  # why the kernels could not be loaded, once known


def jit_enabled() -> bool:
    """Whether :func:`dp_session` returns the compiled session: ``HETPLAN_JIT`` is not ``0``
    and :mod:`hetplan.cost_models._dp_jit` loads (numba installed, a usable cache location).
    When it does not, the pure-Python session runs and :func:`jit_error` says why."""
    if os.environ.get("HETPLAN_JIT", "1") == "0":
        return False
    if _JIT_ERROR:
        return False
    try:
        import hetplan.cost_models._dp_jit  # noqa: F401
    except Exception as e:  # ImportError without numba; RuntimeError without a cache dir
        _JIT_ERROR.append(f"{type(e).__name__}: {e}")
        logging.getLogger("hetplan").warning(
            "the compiled simulator could not be loaded (%s); using the pure-Python one "
            "(same results, slower); install numba, or set HETPLAN_JIT=0 to silence this",
            _JIT_ERROR[0])
        return False
    return True


def jit_error() -> str | None:
    """Why the compiled session is not in use (None when it is, or was never tried)."""
    return _JIT_ERROR[0] if _JIT_ERROR else None


def dp_session(
    backprop_s: Sequence[float],
    *,
    forward_s: float = 0.0,
    optimizer_s: float = 0.0,
    cpu_workers: int = 1,
    jit: bool | None = None,
    share: DPSession | None = None,
) -> DPSession:
    """A :class:`DPSession`: the compiled one (:mod:`hetplan.cost_models._dp_jit`, same
    results bit for bit, tens of times faster) when ``jit`` (default: :func:`jit_enabled`),
    else the pure-Python one. ``share``: an earlier session of the same problem; a compiled
    session reuses its ops already converted to arrays (no effect on results)."""
    if jit if jit is not None else jit_enabled():
        from hetplan.cost_models._dp_jit import JitDPSession

        return JitDPSession(backprop_s, forward_s=forward_s,  # type: ignore[return-value]
                            optimizer_s=optimizer_s, cpu_workers=cpu_workers, share=share)
    return DPSession(backprop_s, forward_s=forward_s, optimizer_s=optimizer_s,
                     cpu_workers=cpu_workers)


def warm_up() -> bool:
    """Compile (or load from numba's on-disk cache) every kernel of the compiled session by
    running each once on a two-tensor problem; ``scripts/setup.sh`` calls it so that the first
    plan does not wait for the compiler. Returns whether the kernels are in use."""
    if not jit_enabled():
        return False
    s = dp_session([1.0, 1.0], jit=True)
    s.rebase([(Op("net", 2.0),), (Op(GPU, 0.5), Op("net", 1.0))])
    s.trial({0: (Op("net", 3.0),)}, bound=9.0)
    s.best_option(1, [(Op("net", 0.1),)], [False], s.base_s, 1e-9)
    s.best_offload([[0]], {0: (Op(CPU, 1.0),)}, 9.0, 1e-9)
    s.best_offload([[0]], {0: (Op(CPU, 1.0),)}, 9.0, 1e-9, exhaustive=False)
    s.best_classes([0, 0], [[(Op("net", 1.0),)]])
    s.before_bubbles(1e-9)
    return True
