"""Discrete-event simulator of one training iteration of a pipeline: the pipeline objective.

Schedules are data, as in ``torch.distributed.pipelining``: per rank an ordered tuple of
:class:`Action` (F or B, micro-batch, virtual stage). Generators exist for ``gpipe``,
``1f1b`` (PipeDream-flush, Megatron non-interleaved), ``interleaved-1f1b`` (Megatron, with
``virtual_stages`` chunks per rank) and ``chimera`` (Li & Hoefler, SC'21). The simulator
replays a schedule against per-rank compute times and per-link transfer times and returns
the makespan, per-rank busy/idle time, the bubble ratio and every timed event.

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
      ``forward_ms[r] * P / S`` per stage (so interleaved chunks take ``1/v`` each, and each
      of Chimera's two replica stages on a rank takes the full ``forward_ms[r]``). Rank
      speed thus models heterogeneous devices; a slow stage shows up as extra bubble.
    * Link ``i`` joins rank ``i`` and rank ``i+1`` (either direction). Interleaved schedules
      also hop from rank ``P-1`` back to rank 0; that wrap-around link is entry ``P-1`` of a
      length-``P`` list (a scalar means every link, the wrap one included).

Numbers pass through unchanged, so ``int`` or ``fractions.Fraction`` inputs give exact
results (except interleaved chunk durations, which divide).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from fractions import Fraction
from functools import lru_cache
from numbers import Rational
from typing import NamedTuple

from hetplan.errors import HetplanError

__all__ = [
    "SCHEDULES", "Action", "ActionKind", "PipelineDeadlockError", "PipelineSchedule",
    "PipelineScheduleError", "PipelineSimResult", "TimedEvent", "bubble_ratio_eq1",
    "bubble_ratio_gpipe_1f1b", "bubble_ratio_interleaved", "build_schedule", "chimera_schedule",
    "gpipe_schedule", "interleaved_1f1b_schedule", "one_f_one_b_schedule", "simulate_pipeline",
    "simulate_schedule",
]

#: Schedule names accepted by :func:`build_schedule` and :func:`simulate_pipeline`.
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b", "chimera")


class PipelineScheduleError(HetplanError, ValueError):
    """A schedule or its inputs are malformed (bad sizes, missing or duplicate actions)."""


class PipelineDeadlockError(PipelineScheduleError):
    """No rank can make progress; ``table`` is the step x rank table marking the stall."""

    def __init__(self, message: str, table: str) -> None:
        super().__init__(f"{message}\n{table}")
        self.table = table


class ActionKind(str, Enum):
    """Forward or backward computation of one micro-batch on one stage."""

    F = "F"
    B = "B"


class Action(NamedTuple):
    """One computation in a rank's list: ``kind`` of ``microbatch`` on virtual ``stage``.

    ``stage`` indexes the micro-batch's own pipeline, ``0 .. num_stages-1`` (for gpipe/1f1b
    it equals the rank; interleaved rank ``r`` holds stages ``r, r+P, ...``; in Chimera it is
    the stage in the micro-batch's direction). Prints as ``"{stage}{kind}{microbatch}"``,
    like ``torch.distributed.pipelining``'s ``_Action``.
    """

    kind: ActionKind
    microbatch: int
    stage: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"


@dataclass(frozen=True)
class PipelineSchedule:
    """A pipeline schedule as data: per rank, the ordered actions it executes.

    Attributes:
        name: schedule name (one of :data:`SCHEDULES` for generated schedules).
        num_ranks: pipeline ranks ``P``.
        num_microbatches: micro-batches ``M`` per iteration.
        num_stages: virtual stages ``S`` each micro-batch passes through (``P * v``).
        actions: ``actions[r]`` is rank ``r``'s ordered tuple of :class:`Action`.
    """

    name: str
    num_ranks: int
    num_microbatches: int
    num_stages: int
    actions: tuple[tuple[Action, ...], ...]

    def format_table(self, stalled: dict[int, int] | None = None) -> str:
        """Render a step x rank table; ``stalled[rank] = step`` cells print as ``[..]``.

        Rows with a stalled cell end in ``<-- STALLED HERE``. O(P * max steps).
        """
        stalled = stalled or {}
        steps = max((len(a) for a in self.actions), default=0)
        header = ["step"] + [f"rank {r}" for r in range(self.num_ranks)]
        rows: list[list[str]] = []
        for k in range(steps):
            row = [str(k)]
            for r, acts in enumerate(self.actions):
                cell = str(acts[k]) if k < len(acts) else ""
                row.append(f"[{cell}]" if stalled.get(r) == k else cell)
            rows.append(row)
        widths = [max(len(x[c]) for x in [header, *rows]) for c in range(len(header))]
        lines = [" | ".join(h.rjust(w) for h, w in zip(header, widths))]
        for k, row in enumerate(rows):
            line = " | ".join(c.rjust(w) for c, w in zip(row, widths))
            if k in stalled.values():
                line += "  <-- STALLED HERE"
            lines.append(line)
        return "\n".join(lines)


class TimedEvent(NamedTuple):
    """One executed action: ``kind`` of ``microbatch`` on ``stage`` ran on ``rank``."""

    rank: int
    kind: ActionKind
    microbatch: int
    stage: int
    start_ms: float
    end_ms: float


@dataclass(frozen=True)
class PipelineSimResult:
    """Outcome of simulating one iteration.

    Attributes:
        schedule: the schedule's name.
        iteration_ms: makespan, from time 0 to the last action's end.
        busy_ms: per-rank compute time.
        idle_ms: per-rank ``iteration_ms - busy_ms`` (bubbles, including head and tail).
        bubble_ratio: ``1 - sum(busy_ms) / (P * iteration_ms)`` (0 when the makespan is 0).
        events: every action with its start and end, sorted by (start, rank).
    """

    schedule: str
    iteration_ms: float
    busy_ms: tuple[float, ...]
    idle_ms: tuple[float, ...]
    bubble_ratio: float
    events: tuple[TimedEvent, ...]


# --------------------------------------------------------------------------- generators

_F, _B = ActionKind.F, ActionKind.B


def _check_sizes(num_ranks: int, num_microbatches: int) -> None:
    if num_ranks < 1:
        raise PipelineScheduleError(f"num_ranks must be >= 1, got {num_ranks!r}")
    if num_microbatches < 1:
        raise PipelineScheduleError(f"num_microbatches must be >= 1, got {num_microbatches!r}")


def gpipe_schedule(num_ranks: int, num_microbatches: int) -> PipelineSchedule:
    """GPipe: every rank runs all forwards, then all backwards, both in micro-batch order.

    O(P * M).
    """
    _check_sizes(num_ranks, num_microbatches)
    m_range = range(num_microbatches)
    actions = tuple(
        tuple([Action(_F, m, r) for m in m_range] + [Action(_B, m, r) for m in m_range])
        for r in range(num_ranks)
    )
    return PipelineSchedule("gpipe", num_ranks, num_microbatches, num_ranks, actions)


def one_f_one_b_schedule(num_ranks: int, num_microbatches: int) -> PipelineSchedule:
    """1F1B (PipeDream-flush; Megatron ``forward_backward_pipelining_without_interleaving``).

    Rank ``r`` runs ``min(P-r-1, M)`` warm-up forwards, then alternates one forward and one
    backward, then drains the remaining backwards. O(P * M).
    """
    _check_sizes(num_ranks, num_microbatches)
    per_rank = []
    for r in range(num_ranks):
        warm = min(num_ranks - r - 1, num_microbatches)
        acts = [Action(_F, m, r) for m in range(warm)]
        for i in range(num_microbatches - warm):
            acts += [Action(_F, warm + i, r), Action(_B, i, r)]
        acts += [Action(_B, m, r) for m in range(num_microbatches - warm, num_microbatches)]
        per_rank.append(tuple(acts))
    return PipelineSchedule("1f1b", num_ranks, num_microbatches, num_ranks, tuple(per_rank))


def interleaved_1f1b_schedule(
    num_ranks: int, num_microbatches: int, virtual_stages: int
) -> PipelineSchedule:
    """Megatron's interleaved 1F1B with ``v = virtual_stages`` model chunks per rank.

    Rank ``r`` holds virtual stages ``r, r+P, ..., r+(v-1)P``. It walks ``M*v`` virtual
    micro-batches: the ``k``-th forward is micro-batch ``(k // (P*v)) * P + k % P`` on chunk
    ``(k % (P*v)) // P``; backwards walk the chunks in reverse. Warm-up is
    ``min(2*(P-r-1) + (v-1)*P, M*v)`` forwards (all of them when ``M == P``), then 1F1B, then
    drain, exactly as in Megatron-LM. O(P * M * v).

    Raises:
        PipelineScheduleError: ``virtual_stages < 2`` or ``M % P != 0``.
    """
    _check_sizes(num_ranks, num_microbatches)
    p, v, m_total = num_ranks, virtual_stages, num_microbatches
    if v < 2:
        raise PipelineScheduleError(
            f"interleaved-1f1b needs virtual_stages >= 2, got {v!r}; use '1f1b' for one chunk"
        )
    if m_total % p != 0:
        raise PipelineScheduleError(
            f"interleaved-1f1b needs micro_batches divisible by the pipeline size: "
            f"{m_total} % {p} = {m_total % p}; use a multiple of {p} micro-batches"
        )
    total = m_total * v

    def action(kind: ActionKind, k: int, r: int) -> Action:
        chunk = (k % (p * v)) // p
        if kind is _B:
            chunk = v - 1 - chunk
        return Action(kind, (k // (p * v)) * p + k % p, chunk * p + r)

    per_rank = []
    for r in range(p):
        warm = total if m_total == p else min(2 * (p - r - 1) + (v - 1) * p, total)
        acts = [action(_F, k, r) for k in range(warm)]
        for i in range(total - warm):
            acts += [action(_F, warm + i, r), action(_B, i, r)]
        acts += [action(_B, k, r) for k in range(total - warm, total)]
        per_rank.append(tuple(acts))
    return PipelineSchedule("interleaved-1f1b", p, m_total, p * v, tuple(per_rank))


@lru_cache(maxsize=64)
def _chimera_unit(p: int, n: int) -> tuple[tuple[tuple[ActionKind, int, int], ...], ...]:
    """Per-rank order of one Chimera basic unit of ``n`` micro-batches (see chimera_schedule).

    Non-delay list scheduling at unit times F=1, B=2: repeatedly start the action with the
    earliest possible start; ties on a rank go to backward first, then the higher stage, then
    the lower micro-batch. O(n * P * (P + n)) once per (P, n), cached.
    """
    half = n // 2

    def rank_of(m: int, s: int) -> int:
        return s if m < half else p - 1 - s

    ready: list[list[tuple[int, int, int, int, int]]] = [[] for _ in range(p)]
    for m in range(n):  # (ready_time, kind 0=B 1=F, -stage, mb, stage)
        ready[rank_of(m, 0)].append((0, 1, 0, m, 0))
    free = [0] * p
    order: list[list[tuple[ActionKind, int, int]]] = [[] for _ in range(p)]
    for _ in range(2 * p * n):
        best: tuple[int, int, tuple[int, int, int, int, int]] | None = None
        for r in range(p):
            if not ready[r]:
                continue
            start = max(free[r], min(c[0] for c in ready[r]))
            pick = min((c for c in ready[r] if c[0] <= start), key=lambda c: c[1:4])
            if best is None or start < best[0]:
                best = (start, r, pick)
        assert best is not None, "chimera unit generator ran dry"
        start, r, (_, kind_bit, _, m, s) = best
        ready[r].remove(best[2])
        kind = _F if kind_bit else _B
        end = start + (1 if kind is _F else 2)
        free[r] = end
        order[r].append((kind, m, s))
        if kind is _F and s + 1 < p:
            ready[rank_of(m, s + 1)].append((end, 1, -(s + 1), m, s + 1))
        elif kind is _F:
            ready[r].append((end, 0, -s, m, s))
        elif s > 0:
            ready[rank_of(m, s - 1)].append((end, 0, -(s - 1), m, s - 1))
    return tuple(tuple(o) for o in order)


def chimera_schedule(num_ranks: int, num_microbatches: int) -> PipelineSchedule:
    """Chimera (Li & Hoefler, SC'21): two model replicas in opposite directions.

    Rank ``i`` holds stage ``i`` of the *down* pipeline and stage ``P-1-i`` of the *up*
    pipeline. Micro-batches form units of ``P`` (the last unit may be smaller); in each unit
    the first half goes down and the second half up. Decisions, since the paper gives the
    schedule only as figures:

    * A unit's per-rank order comes from non-delay list scheduling at unit times F=1, B=2
      (the paper's assumption), ties to backward first, then the stage nearer the loss, then
      the lower micro-batch. It reproduces the paper's D-2 bubbles per worker; with
      balanced stages, no transfer and ``M == P`` its makespan is ``P*T_F + (2P-2)*T_B``,
      i.e. exactly Eq. (1) of the DynPipe seed, whenever ``T_B >= 2*T_F`` (tested for
      P = 2..16). For ``T_B < 2*T_F`` this fixed order is a few ``T_F`` slower than Eq. (1).
    * Units are concatenated per rank ("direct concatenation"); forward doubling and
      backward halving are not modelled.
    * Both replicas' stages on a rank cost that rank's ``forward_ms``/``backward_ms``;
      the gradient all-reduce between the replicas is outside the iteration simulated here.

    O(P^2 * M) plus a cached O(P^4) unit construction.

    Raises:
        PipelineScheduleError: ``P`` or ``M`` is odd (Chimera assumes even depth and splits
            micro-batches half/half between the directions).
    """
    _check_sizes(num_ranks, num_microbatches)
    p, m_total = num_ranks, num_microbatches
    if p % 2 or m_total % 2:
        raise PipelineScheduleError(
            f"chimera needs an even number of ranks and of micro-batches, got P={p}, "
            f"M={m_total}; micro-batches are split half/half between the two directions"
        )
    per_rank: list[list[Action]] = [[] for _ in range(p)]
    for base in range(0, m_total, p):
        unit = _chimera_unit(p, min(p, m_total - base))
        for r in range(p):
            per_rank[r] += [Action(k, base + m, s) for k, m, s in unit[r]]
    return PipelineSchedule("chimera", p, m_total, p, tuple(tuple(a) for a in per_rank))


def build_schedule(
    name: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1
) -> PipelineSchedule:
    """Build a named schedule (one of :data:`SCHEDULES`). O(P * M * v).

    Raises:
        PipelineScheduleError: unknown name, or ``virtual_stages != 1`` for a schedule
            without chunks, or the generator's own size requirements.
    """
    if name == "interleaved-1f1b":
        return interleaved_1f1b_schedule(num_ranks, num_microbatches, virtual_stages)
    generators = {"gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule,
                  "chimera": chimera_schedule}
    if name not in generators:
        raise PipelineScheduleError(f"unknown pipeline schedule {name!r}; expected one of "
                                    f"{', '.join(SCHEDULES)}")
    if virtual_stages != 1:
        raise PipelineScheduleError(f"schedule {name!r} has one chunk per rank, got "
                                    f"virtual_stages={virtual_stages}; use 'interleaved-1f1b'")
    return generators[name](num_ranks, num_microbatches)


# --------------------------------------------------------------------------- simulator


def _encode(schedule: PipelineSchedule) -> tuple[list[list[int]], list[int]]:
    """Validate the schedule and encode it as ints. O(P * M * S).

    Returns:
        ``codes[r]``: rank ``r``'s actions, ``m * S + s`` for F and ``n + m * S + s`` for B
        (``n = M * S``); and ``rank_of[m * S + s]``, the rank that runs stage ``s`` of ``m``.
    """
    p, m_total, s_total = schedule.num_ranks, schedule.num_microbatches, schedule.num_stages
    if len(schedule.actions) != p:
        raise PipelineScheduleError(f"schedule {schedule.name!r} lists {len(schedule.actions)} "
                                    f"ranks, expected num_ranks={p}")
    if s_total < 1 or s_total % p:
        raise PipelineScheduleError(f"num_stages={s_total} must be a positive multiple of "
                                    f"num_ranks={p}")
    n = m_total * s_total
    owner = [-1] * (2 * n)
    codes: list[list[int]] = []
    for r, acts in enumerate(schedule.actions):
        row = []
        for a in acts:
            if not (0 <= a.microbatch < m_total and 0 <= a.stage < s_total):
                raise PipelineScheduleError(f"rank {r}: action {a} is out of range "
                                            f"(M={m_total}, S={s_total})")
            code = a.microbatch * s_total + a.stage + (0 if a.kind is _F else n)
            if owner[code] >= 0:
                raise PipelineScheduleError(f"action {a} appears twice (ranks {owner[code]}, {r})")
            owner[code] = r
            row.append(code)
        codes.append(row)
    for i in range(n):
        rf, rb = owner[i], owner[n + i]
        if rf < 0 or rb < 0:
            missing = Action(_F if rf < 0 else _B, i // s_total, i % s_total)
            raise PipelineScheduleError(f"schedule {schedule.name!r} never runs {missing}")
        if rf != rb:
            raise PipelineScheduleError(f"{Action(_F, i // s_total, i % s_total)} runs on rank "
                                        f"{rf} but its backward on rank {rb}; both must share "
                                        f"a rank")
    return codes, owner[:n]


def _hops(
    value: float | Sequence[float], rank_of: list[int], s_total: int, p: int, what: str,
    back: bool,
) -> list[float]:
    """Per ``m * S + s``: transfer time into stage s from s-1 (or from s+1 when ``back``).

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
    hops: list[float] = [0] * len(rank_of)
    for i, dst in enumerate(rank_of):
        if (i + 1 if back else i) % s_total == 0:
            continue  # no stage beyond the last (backward) or before the first (forward)
        src = rank_of[i + 1] if back else rank_of[i - 1]
        lo, hi = min(src, dst), max(src, dst)
        if lo == hi:
            continue
        if hi - lo != 1 and (lo, hi) != (0, p - 1):
            raise PipelineScheduleError(f"the schedule sends between ranks {src} and {dst}, "
                                        f"which are not neighbours (links i<->i+1, {p - 1}<->0)")
        t = links[lo if hi - lo == 1 else p - 1]
        if t is None:
            raise PipelineScheduleError(f"the schedule crosses the wrap-around link {p - 1}->0;"
                                        f" give {what} as a scalar or as {p} entries (last = "
                                        f"wrap)")
        hops[i] = t
    return hops


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
        forward_ms: per rank, forward time of one micro-batch through the rank's 1/P share.
        backward_ms: per rank, the same for backward.
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
    p, m_total, s_total = schedule.num_ranks, schedule.num_microbatches, schedule.num_stages
    if len(forward_ms) != p or len(backward_ms) != p:
        raise PipelineScheduleError(f"forward_ms and backward_ms need {p} entries (one per "
                                    f"rank), got {len(forward_ms)} and {len(backward_ms)}")
    if any(not t >= 0 for t in [*forward_ms, *backward_ms]):
        raise PipelineScheduleError("forward_ms and backward_ms must be >= 0, got "
                                    f"{list(forward_ms)!r} and {list(backward_ms)!r}")
    codes, rank_of = _encode(schedule)
    hop_f = _hops(p2p_fwd_ms, rank_of, s_total, p, "p2p_fwd_ms", back=False)
    hop_b = _hops(p2p_bwd_ms, rank_of, s_total, p, "p2p_bwd_ms", back=True)
    v = s_total // p
    dur_f = [t / v if v > 1 else t for t in forward_ms]
    dur_b = [t / v if v > 1 else t for t in backward_ms]

    n = m_total * s_total
    end: list[float | None] = [None] * (2 * n)  # by action code
    waiters: dict[int, list[int]] = {}
    pos = [0] * p
    free: list[float] = [0] * p
    busy: list[float] = [0] * p
    done: list[tuple[float, int, int, float]] = []  # (start, rank, code, end)
    stack = list(range(p - 1, -1, -1))
    while stack:
        r = stack.pop()
        row, k, t_free = codes[r], pos[r], free[r]
        while k < len(row):
            code = row[k]
            if code < n:  # F(m, s) waits for F(m, s-1) + activation transfer
                dep, hop, start, d = code - 1, hop_f[code], t_free, dur_f[r]
                if code % s_total == 0:
                    dep = -1
            else:  # B(m, s) waits for F(m, s) and B(m, s+1) + gradient transfer
                i = code - n
                t = end[i]
                if t is None:
                    waiters.setdefault(i, []).append(r)
                    break
                dep, hop, start, d = code + 1, hop_b[i], max(t, t_free), dur_b[r]
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
            done.append((start, r, code, t_free))
            k += 1
            stack.extend(waiters.pop(code, ()))
        pos[r], free[r] = k, t_free
    stuck = {r: pos[r] for r in range(p) if pos[r] < len(codes[r])}
    if stuck:
        heads = ", ".join(f"rank {r} at step {k} ({schedule.actions[r][k]})"
                          for r, k in stuck.items())
        raise PipelineDeadlockError(
            f"pipeline schedule {schedule.name!r} deadlocks: no rank can make progress; "
            f"stuck: {heads}. Each rank runs its list in order, so a rank waiting on an "
            f"action that is queued behind another waiting rank never starts.",
            schedule.format_table(stuck),
        )
    makespan = max(free, default=0)
    done.sort()
    events = tuple(
        TimedEvent(r, _F, c // s_total, c % s_total, st, e) if c < n
        else TimedEvent(r, _B, (c - n) // s_total, (c - n) % s_total, st, e)
        for st, r, c, e in done
    )
    return PipelineSimResult(
        schedule=schedule.name,
        iteration_ms=makespan,
        busy_ms=tuple(busy),
        idle_ms=tuple(makespan - b for b in busy),
        bubble_ratio=1 - sum(busy) / (p * makespan) if makespan else 0,
        events=events,
    )


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
        forward_ms: per rank, forward time of ONE micro-batch (unequal values allowed).
        backward_ms: per rank, backward time of ONE micro-batch.
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
    sched = build_schedule(schedule, len(forward_ms), num_microbatches, virtual_stages)
    return simulate_schedule(sched, forward_ms, backward_ms,
                             p2p_fwd_ms=p2p_fwd_ms, p2p_bwd_ms=p2p_bwd_ms)


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
    _check_sizes(num_stages, num_microbatches)
    return Fraction(num_stages - 1, num_microbatches + num_stages - 1)


def bubble_ratio_interleaved(
    num_stages: int, num_microbatches: int, virtual_stages: int
) -> Fraction:
    """Interleaved 1F1B bubble ratio ``(P-1)/(v*M+P-1)``: balanced, no transfer. O(1)."""
    _check_sizes(num_stages, num_microbatches)
    return Fraction(num_stages - 1, virtual_stages * num_microbatches + num_stages - 1)
