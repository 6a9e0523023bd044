"""Discrete-event simulator of one training iteration of a pipeline: the pipeline objective.

Schedules are data, as in ``torch.distributed.pipelining``: per rank an ordered tuple of
:class:`Action` (F or B, micro-batch, virtual stage), generated for ``gpipe``, ``1f1b``,
``interleaved-1f1b`` and ``chimera`` by :mod:`hetplan.algorithms.pipeline_schedules` (its
names are re-exported here). The plan carries exactly those lists (``Plan.pipeline_actions``)
and the runtime executes them; :func:`simulate_schedule` replays a schedule's lists against
per-rank compute times and per-link transfer times and returns the makespan, per-rank
busy/idle time, the bubble ratio and every timed event; :func:`simulate_pipeline` does so for
the lists :func:`build_schedule` generates, i.e. the ones a compiled plan carries.

Timing model (what "simulate" means here):
    * Each rank executes its action list strictly in order, one action at a time.
    * ``F(m, s)`` starts when rank is free and ``F(m, s-1)`` ended plus the forward transfer
      time of the link between their ranks. ``B(m, s)`` additionally needs ``F(m, s)`` (same
      rank, no transfer) and ``B(m, s+1)`` plus the backward transfer time. The last stage's
      backward follows its own forward directly (the loss lives in that forward).
    * Transfers sit on links, not on compute: they delay the receiver but never occupy the
      sender or receiver, sends never block, and links have no contention (a link carries any
      number of transfers at once). Transfers that overlap compute are therefore free; only
      the exposed part shows up as bubble.
    * Times are per rank: ``forward_ms[r]`` is rank ``r``'s time to run its share (1/P of
      the model) forward for one micro-batch. A schedule with ``S`` virtual stages charges
      ``forward_ms[r] * P / S`` per stage (so interleaved chunks take ``1/v`` each). Rank
      speed thus models heterogeneous devices; a slow stage shows up as extra bubble. With
      ``S > P`` entries instead, ``forward_ms[s]`` is virtual stage ``s``'s own time
      (interleaved chunks of different sizes).
    * Chimera's times are per stage: ``forward_ms[s]`` is stage ``s``'s time, charged to
      whichever rank runs an action of stage ``s`` (rank ``s`` for a micro-batch going down,
      ``P-1-s`` going up). A Chimera rank runs two different stages, so no one time per rank
      describes it; the evaluation passes each stage's time at the slowest device of the
      ranks holding it (:mod:`hetplan.cost_models.evaluate`).
    * Link ``i`` joins rank ``i`` and rank ``i+1`` (either direction). Interleaved schedules
      also hop from rank ``P-1`` back to rank 0; that wrap-around link is entry ``P-1`` of a
      length-``P`` list (a scalar means every link, the wrap one included).

Numbers pass through unchanged, so ``int`` or ``fractions.Fraction`` inputs give exact
results (except interleaved chunk durations, which divide).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from functools import cached_property, lru_cache
from numbers import Rational
from typing import NamedTuple

import numpy as np

from hetplan.algorithms import _pipeline_kernel
from hetplan.algorithms.pipeline_schedules import (
    SCHEDULES,
    Action,
    ActionKind,
    PipelineDeadlockError,
    PipelineSchedule,
    PipelineScheduleError,
    build_schedule,
    deadlock_error,
    check_sizes,
    chimera_schedule,
    gpipe_schedule,
    interleaved_1f1b_schedule,
    one_f_one_b_schedule,
)
from hetplan.cost_models.memory import schedule_of

__all__ = [
    "SCHEDULES", "Action", "ActionKind", "PipelineDeadlockError", "PipelineSchedule",
    "PipelineScheduleError", "PipelineSimResult", "TimedEvent", "bubble_ratio_eq1",
    "bubble_ratio_gpipe_1f1b", "bubble_ratio_interleaved", "build_schedule", "chimera_schedule",
    "gpipe_schedule", "interleaved_1f1b_schedule", "one_f_one_b_schedule", "simulate_named",
    "simulate_pipeline", "simulate_schedule",
]

_F, _B = ActionKind.F, ActionKind.B


class TimedEvent(NamedTuple):
    """One executed action: ``kind`` of ``microbatch`` on ``stage`` ran on ``rank``."""

    rank: int
    kind: ActionKind
    microbatch: int
    stage: int
    start_ms: float
    end_ms: float


@dataclass(frozen=True, eq=False)
class PipelineSimResult:
    """Outcome of simulating one iteration.

    Attributes:
        schedule: the schedule's name.
        iteration_ms: makespan, from time 0 to the last action's end.
        busy_ms: per-rank compute time.
        idle_ms: per-rank ``iteration_ms - busy_ms`` (bubbles, including head and tail).
        bubble_ratio: ``1 - sum(busy_ms) / (P * iteration_ms)`` (0 when the makespan is 0).
        rank_bwd_end_ms: per rank, when its last backward ends (0 without one).
        stage_bwd_end_ms: per virtual stage, when its last backward ends.
        events: every action with its start and end, sorted by (start, rank); built on first
            use (a search reads only the numbers above).
    """

    schedule: str
    iteration_ms: float
    busy_ms: tuple[float, ...]
    idle_ms: tuple[float, ...]
    bubble_ratio: float
    rank_bwd_end_ms: tuple[float, ...]
    stage_bwd_end_ms: tuple[float, ...]
    #: (start, rank, action code, end) per action (or the compiled replay's four arrays of
    #: them), and the schedule's ``S`` and ``M * S``
    _done: list[tuple[float, int, int, float]] | tuple[np.ndarray, ...] = field(repr=False)
    _s_total: int = field(repr=False)
    _n: int = field(repr=False)

    @cached_property
    def events(self) -> tuple[TimedEvent, ...]:
        s_total, n = self._s_total, self._n
        done = self._done
        if isinstance(done, tuple):
            done = list(zip(*(x.tolist() for x in done)))
        return tuple(
            TimedEvent(r, _F, c // s_total, c % s_total, st, e) if c < n
            else TimedEvent(r, _B, (c - n) // s_total, (c - n) % s_total, st, e)
            for st, r, c, e in sorted(done)
        )

    def _key(self) -> tuple[object, ...]:
        return (self.schedule, self.iteration_ms, self.busy_ms, self.idle_ms,
                self.bubble_ratio, self.events)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PipelineSimResult):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


# --------------------------------------------------------------------------- simulator


@lru_cache(maxsize=64)
def _hop_links(rank_of: tuple[int, ...], s_total: int, p: int,
               back: bool) -> tuple[tuple[int, ...], tuple[int, int, int] | None]:
    """Per ``m * S + s``: the link a transfer into stage s crosses (from s-1, or from s+1 when
    ``back``): ``i`` for ranks ``i, i+1``, ``p - 1`` for the wrap-around ``p-1 <-> 0``, -1
    for none (and after the first non-neighbour pair); and that first pair as (position,
    src, dst), if any. O(M * S),
    cached per schedule shape (the search simulates one shape many times)."""
    out = [-1] * len(rank_of)
    for i, dst in enumerate(rank_of):
        if (i + 1 if back else i) % s_total == 0:
            continue  # no stage beyond the last (backward) or before the first (forward)
        src = rank_of[i + 1] if back else rank_of[i - 1]
        lo, hi = min(src, dst), max(src, dst)
        if lo == hi:
            continue
        if hi - lo != 1 and (lo, hi) != (0, p - 1):
            return tuple(out), (i, src, dst)
        out[i] = lo if hi - lo == 1 else p - 1
    return tuple(out), None


def _hops(
    value: float | Sequence[float], rank_of: tuple[int, ...], s_total: int, p: int, what: str,
    back: bool,
) -> tuple[list[float], tuple[int, ...]]:
    """Per ``m * S + s``, the transfer time into stage s from s-1 (or from s+1 when ``back``)
    as a table and an index: the time is ``table[which[m * S + s]]`` (the link's time, or
    0 from the table's last entry where there is no hop).

    ``value`` is a scalar for every link, or ``P-1`` link times (link i joins ranks i, i+1),
    or ``P`` with the wrap-around link ``P-1 <-> 0`` last. O(M * S).
    """
    if isinstance(value, (int, float, Rational)):
        links: list[float | None] = [value] * p
    elif len(value) in (p - 1, p):
        links = [*value, None] if len(value) == p - 1 else list(value)
    else:
        raise PipelineScheduleError(f"{what} needs {p - 1} link times (or {p} with the "
                                    f"wrap-around link {p - 1}->0), got {len(value)}")
    if any(t is not None and not t >= 0 for t in links):
        raise PipelineScheduleError(f"{what} must be >= 0, got {value!r}")
    which, bad = _hop_links(rank_of, s_total, p, back)
    wrap = which.index(p - 1) if links[p - 1] is None and (p - 1) in which else None
    if bad is not None and (wrap is None or bad[0] < wrap):
        raise PipelineScheduleError(f"the schedule sends between ranks {bad[1]} and {bad[2]}, "
                                    f"which are not neighbours (links i<->i+1, {p - 1}<->0)")
    if wrap is not None:
        raise PipelineScheduleError(f"the schedule crosses the wrap-around link {p - 1}->0;"
                                    f" give {what} as a scalar or as {p} entries (last = "
                                    f"wrap)")
    table = [0 if t is None else t for t in links] + [0]  # index -1: no hop
    return table, which


def simulate_schedule(
    schedule: PipelineSchedule,
    forward_ms: Sequence[float],
    backward_ms: Sequence[float],
    *,
    p2p_fwd_ms: float | Sequence[float] = 0,
    p2p_bwd_ms: float | Sequence[float] = 0,
) -> PipelineSimResult:
    """Replay ``schedule`` against per-rank compute and per-link transfer times.

    Args:
        schedule: per-rank action lists (generated or hand-written).
        forward_ms: per rank, forward time of one micro-batch through the rank's 1/P share
            (or, with ``S > P`` entries, per virtual stage: that stage's own time; for a
            schedule named ``chimera``, per stage: ``P`` entries, stage ``s``'s own time
            whichever rank runs it).
        backward_ms: per rank (or per virtual stage), the same for backward.
        p2p_fwd_ms: activation transfer time per link ``i -> i+1`` (scalar = every link).
        p2p_bwd_ms: gradient transfer time per link ``i+1 -> i`` (scalar = every link).

    Returns:
        The makespan, busy/idle time per rank, bubble ratio and timed events.

    Raises:
        PipelineScheduleError: malformed schedule or inputs.
        PipelineDeadlockError: the action order can never complete; the message holds a
            step x rank table with each stuck rank's next action in brackets.

    Complexity: O(A log A) for A = 2*M*S actions: event-driven, a blocked rank sleeps until
    the action it waits for ends, and the final sort of the events dominates.
    """
    codes, rank_of = schedule.index()
    return _simulate(schedule, codes, tuple(rank_of), forward_ms, backward_ms, p2p_fwd_ms,
                     p2p_bwd_ms)


class _Flat(NamedTuple):
    """A schedule's codes as the compiled replay reads them (:mod:`._pipeline_kernel`), and
    each transfer's link (``_hop_links``) as arrays."""

    codes: np.ndarray
    row_start: np.ndarray
    link_f: np.ndarray
    link_b: np.ndarray


def _simulate(
    schedule: PipelineSchedule,
    codes: Sequence[Sequence[int]],
    rank_of: tuple[int, ...],
    forward_ms: Sequence[float],
    backward_ms: Sequence[float],
    p2p_fwd_ms: float | Sequence[float],
    p2p_bwd_ms: float | Sequence[float],
    flat: _Flat | None = None,
) -> PipelineSimResult:
    """:func:`simulate_schedule` of a schedule already indexed (``schedule.index()``);
    with ``flat``, and float times, by the compiled replay when numba is there (the same
    numbers: :mod:`hetplan.algorithms._pipeline_kernel`)."""
    p, m_total, s_total = schedule.num_ranks, schedule.num_microbatches, schedule.num_stages
    # Chimera runs two stages per rank: its times are the stages' own (module docstring)
    per_stage = ((s_total > p or schedule.name == "chimera")
                 and len(forward_ms) == len(backward_ms) == s_total)
    if not per_stage and (len(forward_ms) != p or len(backward_ms) != p):
        what = "one per stage" if schedule.name == "chimera" else "one per rank"
        raise PipelineScheduleError(f"forward_ms and backward_ms need {p} entries ({what}), "
                                    f"got {len(forward_ms)} and {len(backward_ms)}")
    if any(not t >= 0 for t in [*forward_ms, *backward_ms]):
        raise PipelineScheduleError("forward_ms and backward_ms must be >= 0, got "
                                    f"{list(forward_ms)!r} and {list(backward_ms)!r}")
    table_f, which_f = _hops(p2p_fwd_ms, rank_of, s_total, p, "p2p_fwd_ms", back=False)
    table_b, which_b = _hops(p2p_bwd_ms, rank_of, s_total, p, "p2p_bwd_ms", back=True)
    v = 1 if per_stage else s_total // p
    dur_f = [t / v if v > 1 else t for t in forward_ms]
    dur_b = [t / v if v > 1 else t for t in backward_ms]
    if (flat is not None and all(type(t) is float for t in (*dur_f, *dur_b))
            and all(type(t) in (int, float) for t in (*table_f, *table_b))
            and (jit := _pipeline_kernel.kernel_for(len(flat.codes))) is not None):
        return _replay_compiled(jit, schedule, flat, per_stage, dur_f, dur_b, table_f, table_b)
    hop_f, hop_b = [table_f[k] for k in which_f], [table_b[k] for k in which_b]

    n = m_total * s_total
    end: list[float | None] = [None] * (2 * n)  # by action code
    waiters: dict[int, list[int]] = {}
    pos = [0] * p
    free: list[float] = [0] * p
    busy: list[float] = [0] * p
    rank_bwd: list[float] = [0] * p
    stage_bwd: list[float] = [0] * s_total
    done: list[tuple[float, int, int, float]] = []  # (start, rank, code, end)
    stack = list(range(p - 1, -1, -1))
    while stack:
        r = stack.pop()
        row, k, t_free = codes[r], pos[r], free[r]
        while k < len(row):
            code = row[k]
            if code < n:  # F(m, s) waits for F(m, s-1) + activation transfer
                d = dur_f[code % s_total] if per_stage else dur_f[r]
                dep, hop, start = code - 1, hop_f[code], t_free
                if code % s_total == 0:
                    dep = -1
            else:  # B(m, s) waits for F(m, s) and B(m, s+1) + gradient transfer
                i = code - n
                t = end[i]
                if t is None:
                    waiters.setdefault(i, []).append(r)
                    break
                d = dur_b[i % s_total] if per_stage else dur_b[r]
                dep, hop, start = code + 1, hop_b[i], max(t, t_free)
                if (i + 1) % s_total == 0:
                    dep = -1
            if dep >= 0:
                t = end[dep]
                if t is None:
                    waiters.setdefault(dep, []).append(r)
                    break
                start = max(start, t + hop)
            t_free = end[code] = start + d
            busy[r] += d
            if code >= n:
                rank_bwd[r] = max(rank_bwd[r], t_free)
                s = (code - n) % s_total
                stage_bwd[s] = max(stage_bwd[s], t_free)
            done.append((start, r, code, t_free))
            k += 1
            stack.extend(waiters.pop(code, ()))
        pos[r], free[r] = k, t_free
    stuck = {r: pos[r] for r in range(p) if pos[r] < len(codes[r])}
    if stuck:
        raise deadlock_error(schedule, stuck)
    makespan = max(free, default=0)
    return PipelineSimResult(
        schedule=schedule.name,
        iteration_ms=makespan,
        busy_ms=tuple(busy),
        idle_ms=tuple(makespan - b for b in busy),
        bubble_ratio=1 - sum(busy) / (p * makespan) if makespan else 0,
        rank_bwd_end_ms=tuple(rank_bwd),
        stage_bwd_end_ms=tuple(stage_bwd),
        _done=done,
        _s_total=s_total,
        _n=n,
    )


def _replay_compiled(
    k: Callable[..., int], schedule: PipelineSchedule, flat: _Flat, per_stage: bool,
    dur_f: list[float], dur_b: list[float], table_f: list[float], table_b: list[float],
) -> PipelineSimResult:
    """``_simulate``'s loop run by the compiled kernel ``k``; the same result."""
    p, s_total = schedule.num_ranks, schedule.num_stages
    n = schedule.num_microbatches * s_total
    a = len(flat.codes)
    end = np.full(2 * n, -1.0)
    pos = np.zeros(p, np.int64)
    free, busy, rank_bwd = np.zeros(p), np.zeros(p), np.zeros(p)
    stage_bwd = np.zeros(s_total)
    d_start, d_end = np.empty(a), np.empty(a)
    d_rank, d_code = np.empty(a, np.int64), np.empty(a, np.int64)
    hop_f = np.asarray(table_f, np.float64)[flat.link_f]
    hop_b = np.asarray(table_b, np.float64)[flat.link_b]
    count = k(flat.codes, flat.row_start, n, s_total, per_stage,
              np.asarray(dur_f), np.asarray(dur_b), hop_f, hop_b, end, pos, free, busy,
              rank_bwd, stage_bwd, d_start, d_rank, d_code, d_end)
    if count < a:
        rows = flat.row_start
        stuck = {r: int(pos[r]) for r in range(p) if pos[r] < rows[r + 1] - rows[r]}
        raise deadlock_error(schedule, stuck)
    makespan = float(free.max()) if p else 0
    busy_t = tuple(busy.tolist())
    return PipelineSimResult(
        schedule=schedule.name,
        iteration_ms=makespan,
        busy_ms=busy_t,
        idle_ms=tuple(makespan - b for b in busy_t),
        bubble_ratio=1 - sum(busy_t) / (p * makespan) if makespan else 0,
        rank_bwd_end_ms=tuple(rank_bwd.tolist()),
        stage_bwd_end_ms=tuple(stage_bwd.tolist()),
        _done=(d_start, d_rank, d_code, d_end),
        _s_total=s_total,
        _n=n,
    )


@lru_cache(maxsize=32)
def _indexed(name: str, p: int, m: int, v: int) -> tuple[
        PipelineSchedule, tuple[tuple[int, ...], ...], tuple[int, ...], _Flat | None]:
    """The named schedule and its index (:meth:`PipelineSchedule.index`), built once per
    shape: a search simulates the same shape with many stage times; for a schedule of at
    least :data:`~._pipeline_kernel.MIN_ACTIONS` actions, also its arrays for the compiled
    replay."""
    sched = schedule_of(name, p, m, v)  # the memory model's copy: built once per shape
    codes, rank_of = sched.index()
    rank_of_t = tuple(rank_of)
    big = sum(len(row) for row in codes) >= _pipeline_kernel.MIN_ACTIONS
    flat = _flat(codes, rank_of_t, sched.num_stages, p) if big else None
    return sched, tuple(tuple(row) for row in codes), rank_of_t, flat


def _flat(codes: Sequence[Sequence[int]], rank_of: tuple[int, ...], s_total: int, p: int
          ) -> _Flat:
    """The arrays of :class:`_Flat` for an indexed schedule."""
    return _Flat(codes=np.array([c for row in codes for c in row], np.int64),
                 row_start=np.cumsum([0] + [len(row) for row in codes]).astype(np.int64),
                 link_f=np.array(_hop_links(rank_of, s_total, p, False)[0], np.int64),
                 link_b=np.array(_hop_links(rank_of, s_total, p, True)[0], np.int64))


def simulate_named(
    name: str,
    num_ranks: int,
    num_microbatches: int,
    virtual_stages: int,
    forward_ms: Sequence[float],
    backward_ms: Sequence[float],
    *,
    p2p_fwd_ms: float | Sequence[float] = 0,
    p2p_bwd_ms: float | Sequence[float] = 0,
) -> PipelineSimResult:
    """:func:`simulate_schedule` of ``build_schedule(name, num_ranks, num_microbatches,
    virtual_stages)``, with the schedule and its index built once per shape; ``forward_ms``
    and ``backward_ms`` per rank or (``S > P`` entries) per virtual stage."""
    sched, codes, rank_of, flat = _indexed(name, num_ranks, num_microbatches, virtual_stages)
    return _simulate(sched, codes, rank_of, forward_ms, backward_ms, p2p_fwd_ms, p2p_bwd_ms,
                     flat)


def simulate_pipeline(
    forward_ms: Sequence[float],
    backward_ms: Sequence[float],
    num_microbatches: int,
    schedule: str = "1f1b",
    *,
    virtual_stages: int = 1,
    p2p_fwd_ms: float | Sequence[float] = 0,
    p2p_bwd_ms: float | Sequence[float] = 0,
) -> PipelineSimResult:
    """Simulate one iteration of a named schedule; ``P = len(forward_ms)``.

    Args:
        forward_ms: per rank, forward time of ONE micro-batch (unequal values allowed;
            per stage for ``chimera``, see the module docstring).
        backward_ms: per rank (per stage for ``chimera``), backward time of ONE micro-batch.
        num_microbatches: micro-batches per iteration ``M``.
        schedule: one of :data:`SCHEDULES`.
        virtual_stages: chunks per rank (``interleaved-1f1b`` only).
        p2p_fwd_ms: activation transfer per link ``i -> i+1`` (scalar or ``P-1``/``P`` list).
        p2p_bwd_ms: gradient transfer per link ``i+1 -> i``.

    Returns:
        :class:`PipelineSimResult`.

    Example:
        >>> r = simulate_pipeline([1, 1], [2, 2], num_microbatches=2, schedule="1f1b")
        >>> r.iteration_ms, r.bubble_ratio
        (9, 0.33333333333333337)

    Complexity: O(P * M * v log(P * M * v)); P=16, M=64 takes a few milliseconds.
    """
    return simulate_named(schedule, len(forward_ms), num_microbatches, virtual_stages,
                          forward_ms, backward_ms, p2p_fwd_ms=p2p_fwd_ms, p2p_bwd_ms=p2p_bwd_ms)


# --------------------------------------------------------------------------- closed forms


def _exact(*xs: object) -> bool:
    return all(isinstance(x, (int, Fraction)) for x in xs)


def bubble_ratio_eq1(p: int, t_f: float, t_b: float, t_c: float) -> float:
    """DynPipe seed Eq. (1), exactly as printed: Chimera's bubble ratio with ``B = P``.

    With ``g = P^2/2 - P``::

        ((3g + 6P - 2g/P - 8) T_C + 2g T_B) / ((3P^2 - 2P) T_C + (2P^2 - 2P) T_B + P^2 T_F)

    ``T_F``/``T_B`` are the full forward/backward time divided by P (balanced stages) and
    ``T_C`` the exposed neighbour transfer. Exact (``Fraction``) when every argument is an
    int or Fraction. O(1).

    Raises:
        PipelineScheduleError: ``p < 2`` (the formula is not defined for one worker).
    """
    if p < 2:
        raise PipelineScheduleError(f"Eq. (1) needs P >= 2 workers, got {p!r}")
    pp: Fraction | float = Fraction(p) if _exact(t_f, t_b, t_c) else float(p)
    g = pp * pp / 2 - pp
    num = (3 * g + 6 * pp - 2 * g / pp - 8) * t_c + 2 * g * t_b
    den = (3 * pp * pp - 2 * pp) * t_c + (2 * pp * pp - 2 * pp) * t_b + pp * pp * t_f
    return num / den


def bubble_ratio_gpipe_1f1b(num_stages: int, num_microbatches: int) -> Fraction:
    """Classic GPipe/1F1B bubble ratio ``(P-1)/(M+P-1)``: balanced stages, no transfer. O(1)."""
    check_sizes(num_stages, num_microbatches)
    return Fraction(num_stages - 1, num_microbatches + num_stages - 1)


def bubble_ratio_interleaved(
    num_stages: int, num_microbatches: int, virtual_stages: int
) -> Fraction:
    """Interleaved 1F1B bubble ratio ``(P-1)/(v*M+P-1)``: balanced, no transfer. O(1)."""
    check_sizes(num_stages, num_microbatches)
    return Fraction(num_stages - 1, virtual_stages * num_microbatches + num_stages - 1)
