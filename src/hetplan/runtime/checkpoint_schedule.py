"""When and how Gemini's checkpoint chunks go out: the plan's chunk schedule mapped onto the
snapshot actually serialised, and the record of what was sent.

The plan (``checkpointing.schedules``) places chunks of a rank's *predicted* state
(``state_bytes``) into the idle spans of the iteration, each span an offset from the
iteration's start. The runtime sends a snapshot blob whose size ``n`` differs from the
prediction (``torch.save`` framing, the RNG state, the data position), so a planned chunk
``[offset, offset + size)`` of the predicted state becomes the bytes
``[offset·n/S, (offset+size)·n/S)`` of the blob (``S = state_bytes``): the same order, the
same spans, the same share of the state per span. A chunk in the overflow span
(``span == len(spans)``, Algorithm 6.2's appended span) is due at the end of the last real
span. Without a planned chunk for a holder (a zero-size prediction), the whole blob goes at
offset 0 as one chunk.

:func:`timetable` is pure (no process group), so the sender and the receiver compute the
same cuts (a gloo receive must match its send's size) and tests can check it directly.
:class:`ChunkEvent` / :class:`RoundRecord` are what the run report records per snapshot.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from hetplan.ir.plan_checkpointing import Checkpointing

__all__ = ["PlannedSend", "ChunkEvent", "RoundRecord", "timetable"]


@dataclass(frozen=True)
class PlannedSend:
    """One chunk to send: blob bytes ``[start, end)`` to ``holder`` (remote copy ``replica``),
    due ``due_ms`` after the step's start (idle span ``span``; ``-1`` for an unplanned
    whole-blob chunk)."""

    holder: int
    replica: int
    span: int
    start: int
    end: int
    due_ms: float


def timetable(ck: Checkpointing, rank: int, nbytes: int) -> list[PlannedSend]:
    """The chunks of ``rank``'s ``nbytes``-byte snapshot, in the plan's order (see module
    docstring). Chunks that scale to zero bytes are dropped; each holder's chunks cover
    ``[0, nbytes)`` exactly."""
    row = ck.ranks[rank]
    sched = next(s for s in ck.schedules if s.id == row.schedule)
    spans = sched.spans
    overflow_ms = (spans[-1].start_ms + spans[-1].duration_ms) if spans else 0.0
    state = sched.state_bytes
    out: list[PlannedSend] = []
    covered: dict[int, int] = {}
    if state > 0:
        for c in sched.chunks:
            if c.replica + 1 >= len(row.holders):
                continue
            holder = row.holders[c.replica + 1]
            start = c.offset * nbytes // state
            end = nbytes if c.offset + c.size >= state else (c.offset + c.size) * nbytes // state
            if end <= start:
                continue
            due = spans[c.span].start_ms if c.span < len(spans) else overflow_ms
            out.append(PlannedSend(holder, c.replica, c.span, start, end, due))
            covered[holder] = covered.get(holder, 0) + (end - start)
    for replica, holder in enumerate(row.holders[1:]):
        if covered.get(holder, 0) != nbytes:  # no (or an incomplete) plan for this holder
            out = [s for s in out if s.holder != holder]
            if nbytes:
                out.append(PlannedSend(holder, replica, -1, 0, nbytes, 0.0))
    return out


@dataclass
class ChunkEvent:
    """One chunk as sent: to ``holder``, ``nbytes`` from ``offset``, planned ``planned_ms``
    after the step's start and issued at ``sent_ms``. ``how``: ``on_time`` (waited for its
    span), ``late`` (its span had passed when its turn came: serialisation or earlier chunks
    took longer), ``released`` (the next step needed the round done, so it went before its
    span)."""

    holder: int
    span: int
    offset: int
    nbytes: int
    planned_ms: float
    sent_ms: float
    how: str


@dataclass
class RoundRecord:
    """One snapshot's round, for the run report (times in ms from the round's anchor, the
    end of the optimizer step that completed ``iteration``, i.e. the next step's start).

    ``serialise_ms``: when the snapshot was serialised and stored locally; ``round_ms``: when
    every holder had acknowledged; ``checkpoint_cpu_ms``: CPU time of the checkpoint thread;
    ``wait_before_step_ms``: how long the next optimizer step waited for the round;
    ``train_cpu_ms``: CPU time of the training thread over the next iteration;
    ``step_start_ms``: when the next step actually started, after the anchor (the worker's
    loop between steps)."""

    iteration: int
    bytes: int
    chunks: list[ChunkEvent] = field(default_factory=list)
    serialise_ms: float = 0.0
    round_ms: float = 0.0
    checkpoint_cpu_ms: float = 0.0
    wait_before_step_ms: float | None = None
    train_cpu_ms: float | None = None
    step_start_ms: float | None = None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for k, v in d.items():
            if isinstance(v, float):
                d[k] = round(v, 3)
        for c in d["chunks"]:
            c["planned_ms"] = round(c["planned_ms"], 3)
            c["sent_ms"] = round(c["sent_ms"], 3)
        return d
