"""Pipeline schedules as data, and the check that a schedule can finish.

A schedule is, per pipeline rank, the ordered tuple of :class:`Action` it executes; an action
is (stage, F or B, micro-batch) and prints as ``"{stage}{kind}{microbatch}"``, e.g. ``"2F0"``,
like ``torch.distributed.pipelining``'s ``_Action`` (:meth:`Action.parse` reads it back).
``stage`` indexes the micro-batch's own pipeline ``0 .. S-1``. The plan stores the lists
(``Plan.pipeline_actions``, one string per rank: :meth:`PipelineSchedule.encode`).

Dependencies (what every consumer assumes): ``F(m, s)`` needs ``F(m, s-1)``; ``B(m, s)`` needs
``F(m, s)`` and ``B(m, s+1)`` (the last stage's backward follows its own forward, where the
loss lives). :func:`check_progress` says whether a rank-by-rank execution in list order can
finish; a schedule that cannot deadlocks on any machine.

Why in ``ir``: the plan's one validator (:mod:`hetplan.ir.plan_checks`) refuses action lists
that cannot finish, with the same check and message the simulator and the runtime use, and
``ir`` imports nothing above it. The generators (gpipe, 1f1b, interleaved 1F1B, Chimera) are
search-side code and stay in :mod:`hetplan.algorithms.pipeline_schedules`, which re-exports
everything here.

Pure Python, no torch: the only import is hetplan's errors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from hetplan.errors import HetplanError

__all__ = [
    "Action", "ActionKind", "PipelineDeadlockError", "PipelineSchedule", "PipelineScheduleError",
    "TRANSFER_ACT", "TRANSFER_GRAD", "check_progress", "chimera_shape_problem",
    "deadlock_error", "decode_schedule", "last_stage_order_problem", "misplaced_stages",
    "transfer_order_problem", "transfers",
]

_ACTION = re.compile(r"(\d+)([FB])(\d+)")


class PipelineScheduleError(HetplanError, ValueError):
    """A schedule or its inputs are malformed (bad sizes, missing or duplicate actions)."""


class PipelineDeadlockError(PipelineScheduleError):
    """No rank can make progress; ``message`` names the stuck ranks (one line) and ``table``
    is the step x rank table marking the stall."""

    def __init__(self, message: str, table: str) -> None:
        super().__init__(f"{message}\n{table}")
        self.message = message
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


# ------------------------------------------------------------- what the executors also need
# Pure checks the plan's validator (rule 4, :mod:`hetplan.ir.plan_checks`) runs before launch
# and the runtime runs again: each returns what is wrong (no field path, no fix), or nothing.


def misplaced_stages(schedule: PipelineSchedule) -> dict[int, list[int]]:
    """Per rank, the stages its list runs that live on another pipeline rank: stage ``s``
    lives on rank ``s mod P`` (the plan's stages, rule 3), which is what torch's schedule
    runtime and the heterogeneous executor build. Not for Chimera, whose rank ``r`` holds
    stages ``r`` and ``P-1-r`` (:func:`chimera_shape_problem`). O(actions)."""
    p = schedule.num_ranks
    out: dict[int, list[int]] = {}
    for r, acts in enumerate(schedule.actions):
        if wrong := sorted({a.stage for a in acts if a.stage % p != r}):
            out[r] = wrong
    return out


def chimera_shape_problem(schedule: PipelineSchedule) -> str:
    """What makes ``schedule`` not Chimera's shape ("" when it is), which the runtime's
    Chimera executor, its sync groups and its loss scale assume: ``P`` even, one stage per
    rank and direction, every micro-batch running stage ``s`` on rank ``s`` (down) or on rank
    ``P-1-s`` (up) for all its stages, as many micro-batches down as up. Needs
    :meth:`PipelineSchedule.index` to pass. O(M * S)."""
    _, rank_of = schedule.index()
    p, s_total, m_total = schedule.num_ranks, schedule.num_stages, schedule.num_microbatches
    if p % 2 or s_total != p:
        return (f"{p} ranks and {s_total} stages; Chimera runs one stage per rank and "
                "direction over an even number of ranks")
    down = 0
    for m in range(m_total):
        ranks = [rank_of[m * s_total + s] for s in range(s_total)]
        if ranks == list(range(p)):
            down += 1
        elif ranks != list(range(p - 1, -1, -1)):
            return (f"micro-batch {m} runs its stages on ranks {ranks}, neither down "
                    f"(0..{p - 1}) nor up ({p - 1}..0)")
    if 2 * down != m_total:
        return (f"{down} of {m_total} micro-batches go down; Chimera sends half each way "
                "(each direction's loss is divided by M/2)")
    return ""


#: The kinds of :func:`transfers`: activations (a forward's outputs), gradients.
TRANSFER_ACT, TRANSFER_GRAD = 0, 1


def transfers(schedule: PipelineSchedule
              ) -> tuple[dict[tuple[int, int, int], list[tuple[int, int]]],
                         dict[tuple[int, int, int], list[tuple[int, int]]]]:
    """Per ``(source pipeline rank, destination, kind)`` (kind :data:`TRANSFER_ACT` or
    :data:`TRANSFER_GRAD`): the ``(micro-batch, receiving stage)`` of every message in the
    order the source posts its sends, and in the order the destination posts its receives
    (a receive is posted just before the action that needs it, a send just after the action
    that makes it). Needs :meth:`PipelineSchedule.index` to pass. O(actions)."""
    _, rank_of = schedule.index()
    s_total = schedule.num_stages
    sent: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
    got: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
    for r, acts in enumerate(schedule.actions):
        for a in acts:
            m, s = a.microbatch, a.stage
            if a.kind is _F:
                if s > 0:
                    got.setdefault((rank_of[m * s_total + s - 1], r, TRANSFER_ACT),
                                   []).append((m, s))
                if s + 1 < s_total:
                    sent.setdefault((r, rank_of[m * s_total + s + 1], TRANSFER_ACT),
                                    []).append((m, s + 1))
            else:
                if s + 1 < s_total:
                    got.setdefault((rank_of[m * s_total + s + 1], r, TRANSFER_GRAD),
                                   []).append((m, s))
                if s > 0:
                    sent.setdefault((r, rank_of[m * s_total + s - 1], TRANSFER_GRAD),
                                    []).append((m, s - 1))
    return sent, got


def transfer_order_problem(schedule: PipelineSchedule) -> tuple[int, str] | None:
    """The first ``(destination rank, what)`` where the two ends of one kind of transfer
    between two ranks post in different orders (None: none). An executor whose messages carry
    no tag (NCCL pairs the operations of two ranks in posting order: the runtime's Chimera
    executor and its executor of per-stage degrees) would pair the wrong messages.
    O(actions)."""
    sent, got = transfers(schedule)
    for key in sorted(set(sent) | set(got)):
        out, into = sent.get(key, []), got.get(key, [])
        if out != into:
            src, dst, kind = key
            what = ("activations", "gradients")[kind]
            return dst, (f"rank {src} sends {what} to rank {dst} for (micro-batch, stage) "
                         f"{out[:4]} but rank {dst} receives them in the order {into[:4]}; "
                         "the runtime needs both in one order")
    return None


def last_stage_order_problem(schedule: PipelineSchedule) -> tuple[int, list[int]] | None:
    """``(rank, micro-batch order)`` when the last stage's forwards do not run in ascending
    micro-batch order (None: they do). torch's ``_PipelineScheduleRuntime`` (which runs every
    schedule but Chimera and per-stage degrees) appends the last stage's loss of each forward
    to a list, in the order the forwards run (``_maybe_compute_loss``), and its backward of
    micro-batch ``m`` reads the loss at position ``m`` of that list (``_maybe_get_loss``):
    forwards out of order make a backward fail ("Loss for microbatch m is not available") or
    backpropagate another micro-batch's loss. The backwards may come in any order. O(actions).
    """
    last = schedule.num_stages - 1
    for r, acts in enumerate(schedule.actions):
        order = [a.microbatch for a in acts if a.kind is _F and a.stage == last]
        if order != sorted(order):
            return r, order
    return None
