"""The readable reference of the data-parallel timeline: backprop, (de)compression and
communication overlap, one plain event loop (:func:`simulate_dp`).

This is the objective every gradient-sync pass (DDP bucketing, Espresso, Cupcake) scores
candidates with, through ``cost_models.evaluate``. It is pure Python over plain floats (one
evaluation of 314 gradient tensors takes well under a millisecond; see
``bench/simulator_speed.py``). Searches that score thousands of candidates which each change
a few tensors use :class:`~hetplan.algorithms.dp_session.DPSession` instead, whose kernels
replay this loop's float operations in the same order (same results bit for bit; the tests
hold them against this module).

Semantics (``research/zen_espresso.md`` §E.2, ``research/cupcake_gemini.md`` §A3):

- Gradient tensors are indexed in backward-ready order; ``backprop_s[i]`` is the backprop
  compute between tensor ``i-1`` becoming ready and tensor ``i`` becoming ready.
- A *sync unit* (one tensor, or a bucket of consecutive tensors) becomes ready when its last
  tensor's backprop segment ends. Its ops run in order; each starts when the previous op has
  finished **and** its resource is free.
- Resources (:mod:`hetplan.algorithms.dp_types`):
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
from collections.abc import Sequence

import numpy as np

from hetplan.algorithms._dp_search import bubble_mask
from hetplan.algorithms.dp_types import CPU, GPU, DPEvent, DPTimeline, Op, SyncUnit

__all__ = ["simulate_dp", "before_last_busy_period"]


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


def before_last_busy_period(backprop_s: Sequence[float], units: Sequence[SyncUnit],
                            cpu_workers: int = 1, eps: float = 1e-9) -> set[int]:
    """Units whose communication ends no later than the start of the last busy period of the
    communication channels (all channels together), where a gap is only a gap if no unit
    *spans* it (became ready before it and still has ops after it): a gap inside one unit's
    own path, e.g. its decompression between two communication steps after it waited behind
    earlier units, closes when the earlier communication shortens. Espresso's Property #1
    (:func:`hetplan.algorithms.espresso.tensors_before_bubbles`); gaps of at most ``eps``
    are no gaps.

    The gap rules are the search session's (:func:`~hetplan.algorithms._dp_search.
    bubble_mask`, run uncompiled) applied to this module's recorded run.

    Args:
        backprop_s / cpu_workers: as for :func:`simulate_dp`.
        units: one per tensor, unit ``i`` ending at tensor ``i`` (Espresso's units).
        eps: gap tolerance, ``>= 0``.
    """
    if eps < 0:
        raise ValueError(f"before_last_busy_period needs eps >= 0, got {eps}")
    for i, u in enumerate(units):
        if u.last_tensor != i:
            raise ValueError(
                f"before_last_busy_period: unit {i} ({u.name!r}) ends at tensor "
                f"{u.last_tensor}; it needs one unit per tensor, unit i ending at tensor i")
    if len(units) != len(backprop_s):
        raise ValueError(f"before_last_busy_period: {len(units)} units for "
                         f"{len(backprop_s)} tensors; it needs one unit per tensor")
    tl = simulate_dp(backprop_s, units, record=True, cpu_workers=cpu_workers)
    ready = np.zeros(len(backprop_s))
    rows = []
    for e in tl.events:
        if e.unit < 0:
            ready[int(e.label.rsplit(" ", 1)[1])] = e.end_s
        else:
            rows.append((e.start_s, e.end_s, e.unit, 0.0 if e.resource in (GPU, CPU) else 1.0))
    ev = np.array(rows, dtype=np.float64).reshape(len(rows), 4)
    return {int(i) for i in np.flatnonzero(bubble_mask(ev, ready, float(eps)))}
