"""Pipeline schedules as data: per pipeline rank, the ordered actions it executes.

One generator per schedule — ``gpipe``, ``1f1b`` (PipeDream-flush, Megatron
non-interleaved), ``interleaved-1f1b`` (Megatron, ``virtual_stages`` chunks per rank) and
``chimera`` (Li & Hoefler, SC'21) — gives a :class:`PipelineSchedule`: ``actions[r]`` is rank
``r``'s ordered tuple of :class:`Action`. The same lists are

* costed by the pipeline simulator (:mod:`hetplan.cost_models.pipeline` replays them against
  stage and link times),
* written into the plan (``Plan.pipeline_actions``, one string per rank: :meth:`encode`), and
* executed by the runtime (``hetplan.runtime.handlers.stages``), which derives them with
  :func:`build_schedule` when a plan predates that section.

An action is (stage, F or B, micro-batch) and prints as ``"{stage}{kind}{microbatch}"``, e.g.
``"2F0"``, like ``torch.distributed.pipelining``'s ``_Action``; :meth:`Action.parse` reads it
back. ``stage`` indexes the micro-batch's own pipeline ``0 .. S-1``: for gpipe and 1f1b it is
the rank; interleaved rank ``r`` holds stages ``r, r+P, …``; in Chimera it is the stage in the
micro-batch's direction (so a stage index names two ranks, one per direction).

Dependencies (what every consumer assumes): ``F(m, s)`` needs ``F(m, s-1)``; ``B(m, s)`` needs
``F(m, s)`` and ``B(m, s+1)`` (the last stage's backward follows its own forward, where the
loss lives). :func:`check_progress` says whether a rank-by-rank execution in list order can
finish; a schedule that cannot deadlocks on any machine.

Pure Python, no torch: the only imports are hetplan's errors and the plan section type.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache
from typing import NamedTuple

from hetplan.errors import HetplanError
from hetplan.ir.plan_sections import Layout, PipelineActions

__all__ = [
    "SCHEDULES", "Action", "ActionKind", "PipelineDeadlockError", "PipelineSchedule",
    "deadlock_error",
    "PipelineScheduleError", "build_schedule", "check_progress", "check_sizes", "chimera_schedule",
    "decode_schedule", "gpipe_schedule", "interleaved_1f1b_schedule", "layout_actions",
    "one_f_one_b_schedule", "plan_schedule",
]

#: Schedule names :func:`build_schedule` generates.
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b", "chimera")

_ACTION = re.compile(r"(\d+)([FB])(\d+)")


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

    Prints as ``"{stage}{kind}{microbatch}"`` (``"2F0"``); :meth:`parse` is the inverse.
    """

    kind: ActionKind
    microbatch: int
    stage: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @staticmethod
    def parse(text: str) -> Action:
        """The action ``"{stage}{F|B}{microbatch}"`` (``"2F0"``).

        Raises:
            PipelineScheduleError: ``text`` is not of that form.
        """
        match = _ACTION.fullmatch(text.strip())
        if match is None:
            raise PipelineScheduleError(f"pipeline action {text!r} is not of the form "
                                        "'{stage}{F|B}{microbatch}', e.g. '2F0'")
        stage, kind, mb = match.groups()
        return Action(ActionKind(kind), int(mb), int(stage))


_F, _B = ActionKind.F, ActionKind.B


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

    def encode(self) -> tuple[str, ...]:
        """One string per rank, its actions separated by spaces (``"0F0 0F1 0B0 0B1"``).
        O(actions)."""
        return tuple(" ".join(str(a) for a in acts) for acts in self.actions)

    def index(self) -> tuple[list[list[int]], list[int]]:
        """Validate the schedule and encode it as ints. O(P * M * S).

        Returns:
            ``codes[r]``: rank ``r``'s actions, ``m * S + s`` for F and ``n + m * S + s`` for
            B (``n = M * S``); and ``rank_of[m * S + s]``, the rank that runs stage ``s`` of
            micro-batch ``m``.

        Raises:
            PipelineScheduleError: wrong rank count or stage count, an action out of range,
                twice, missing, or a backward on another rank than its forward.
        """
        p, m_total, s_total = self.num_ranks, self.num_microbatches, self.num_stages
        if len(self.actions) != p:
            raise PipelineScheduleError(f"schedule {self.name!r} lists {len(self.actions)} "
                                        f"ranks, expected num_ranks={p}")
        if s_total < 1 or s_total % p:
            raise PipelineScheduleError(f"num_stages={s_total} must be a positive multiple of "
                                        f"num_ranks={p}")
        n = m_total * s_total
        owner = [-1] * (2 * n)
        codes: list[list[int]] = []
        for r, acts in enumerate(self.actions):
            row = []
            for a in acts:
                if not (0 <= a.microbatch < m_total and 0 <= a.stage < s_total):
                    raise PipelineScheduleError(f"rank {r}: action {a} is out of range "
                                                f"(M={m_total}, S={s_total})")
                code = a.microbatch * s_total + a.stage + (0 if a.kind is _F else n)
                if owner[code] >= 0:
                    raise PipelineScheduleError(f"action {a} appears twice (ranks "
                                                f"{owner[code]}, {r})")
                owner[code] = r
                row.append(code)
            codes.append(row)
        for i in range(n):
            rf, rb = owner[i], owner[n + i]
            if rf < 0 or rb < 0:
                missing = Action(_F if rf < 0 else _B, i // s_total, i % s_total)
                raise PipelineScheduleError(f"schedule {self.name!r} never runs {missing}")
            if rf != rb:
                raise PipelineScheduleError(f"{Action(_F, i // s_total, i % s_total)} runs on "
                                            f"rank {rf} but its backward on rank {rb}; both "
                                            "must share a rank")
        return codes, owner[:n]

    def stage_ranks(self) -> dict[int, int]:
        """Stage index → the rank that runs it, when each stage has one rank (not Chimera).

        Raises:
            PipelineScheduleError: a stage runs on two ranks.
        """
        where: dict[int, int] = {}
        for r, acts in enumerate(self.actions):
            for a in acts:
                if where.setdefault(a.stage, r) != r:
                    raise PipelineScheduleError(
                        f"schedule {self.name!r} runs stage {a.stage} on ranks "
                        f"{where[a.stage]} and {r}; a stage must live on one rank")
        return where

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


def decode_schedule(name: str, num_microbatches: int, num_stages: int,
                    ranks: tuple[str, ...] | list[str]) -> PipelineSchedule:
    """The schedule :meth:`PipelineSchedule.encode` wrote, validated and checked to finish.

    Raises:
        PipelineScheduleError: a malformed action, or the checks of
            :meth:`PipelineSchedule.index`.
        PipelineDeadlockError: the lists can never complete (:func:`check_progress`).
    """
    actions = tuple(tuple(Action.parse(t) for t in row.split()) for row in ranks)
    schedule = PipelineSchedule(name, len(actions), num_microbatches, num_stages, actions)
    check_progress(schedule)
    return schedule


def check_progress(schedule: PipelineSchedule) -> None:
    """Raise unless executing every rank's list in order, respecting the dependencies (module
    docstring), finishes. O(A) for A actions: a blocked rank sleeps until its dependency ends.

    Raises:
        PipelineScheduleError: the checks of :meth:`PipelineSchedule.index`.
        PipelineDeadlockError: with the step x rank table marking every stuck rank.
    """
    codes, _ = schedule.index()
    s_total, n = schedule.num_stages, schedule.num_microbatches * schedule.num_stages
    done = [False] * (2 * n)
    waiters: dict[int, list[int]] = {}
    pos = [0] * schedule.num_ranks
    stack = list(range(schedule.num_ranks - 1, -1, -1))
    while stack:
        r = stack.pop()
        row, k = codes[r], pos[r]
        while k < len(row):
            code = row[k]
            i = code if code < n else code - n
            deps = [i - 1] if code < n and i % s_total else []
            if code >= n:
                deps = [i] + ([n + i + 1] if (i + 1) % s_total else [])
            blocked = next((d for d in deps if not done[d]), None)
            if blocked is not None:
                waiters.setdefault(blocked, []).append(r)
                break
            done[code] = True
            k += 1
            stack.extend(waiters.pop(code, ()))
        pos[r] = k
    stuck = {r: pos[r] for r in range(schedule.num_ranks) if pos[r] < len(codes[r])}
    if stuck:
        raise deadlock_error(schedule, stuck)


# --------------------------------------------------------------------------- generators


def check_sizes(num_ranks: int, num_microbatches: int) -> None:
    """Raise :class:`PipelineScheduleError` unless both sizes are at least 1."""
    if num_ranks < 1:
        raise PipelineScheduleError(f"num_ranks must be >= 1, got {num_ranks!r}")
    if num_microbatches < 1:
        raise PipelineScheduleError(f"num_microbatches must be >= 1, got {num_microbatches!r}")


def gpipe_schedule(num_ranks: int, num_microbatches: int) -> PipelineSchedule:
    """GPipe: every rank runs all forwards, then all backwards, both in micro-batch order.

    O(P * M).
    """
    check_sizes(num_ranks, num_microbatches)
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
    check_sizes(num_ranks, num_microbatches)
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
    check_sizes(num_ranks, num_microbatches)
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
      the gradient all-reduce between the replicas is outside the iteration simulated.

    O(P^2 * M) plus a cached O(P^4) unit construction.

    Raises:
        PipelineScheduleError: ``P`` or ``M`` is odd (Chimera assumes even depth and splits
            micro-batches half/half between the directions).
    """
    check_sizes(num_ranks, num_microbatches)
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


# --------------------------------------------------------------------------- the plan's lists


def layout_actions(layout: Layout) -> PipelineActions | None:
    """The plan section holding the action lists of ``layout``'s schedule (None: ``pp == 1``,
    no pipeline). What :func:`hetplan.compile` writes. O(P * M * v).

    Raises:
        PipelineScheduleError: the layout's schedule cannot be generated for its sizes.
    """
    if layout.pp == 1:
        return None
    sched = build_schedule(layout.schedule, layout.pp, layout.micro_batches,
                           layout.virtual_stages)
    return PipelineActions(schedule=layout.schedule, micro_batches=sched.num_microbatches,
                           num_stages=sched.num_stages, ranks=sched.encode())


def plan_schedule(layout: Layout, actions: PipelineActions | None) -> PipelineSchedule:
    """The schedule a plan runs: its ``pipeline_actions`` section decoded and checked, or, for
    a plan written before that section existed, the lists generated for its layout.

    Raises:
        PipelineScheduleError: malformed or incomplete lists, or ungeneratable sizes.
        PipelineDeadlockError: the plan's lists can never complete.
    """
    if actions is None:
        return build_schedule(layout.schedule, layout.pp, layout.micro_batches,
                              layout.virtual_stages)
    return decode_schedule(actions.schedule, actions.micro_batches, actions.num_stages,
                           actions.ranks)


def deadlock_error(schedule: PipelineSchedule, stuck: dict[int, int]) -> PipelineDeadlockError:
    """The error for ``schedule`` stuck at ``{rank: step}``: each stuck rank's next action in
    the message and the step x rank table (the progress check and the simulator share it)."""
    heads = ", ".join(f"rank {r} at step {k} ({schedule.actions[r][k]})"
                      for r, k in stuck.items())
    return PipelineDeadlockError(
        f"pipeline schedule {schedule.name!r} deadlocks: no rank can make progress; "
        f"stuck: {heads}. Each rank runs its list in order, so a rank waiting on an "
        f"action that is queued behind another waiting rank never starts.",
        schedule.format_table(stuck),
    )
