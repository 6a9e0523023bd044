"""The runtime's mapping of the plan's chunk schedule onto the serialised snapshot
(:func:`hetplan.runtime.checkpoint_schedule.timetable`)."""

from __future__ import annotations

from pathlib import Path

import pytest

import hetplan
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan_checkpointing import Checkpointing
from hetplan.runtime.checkpoint_schedule import timetable

CLUSTER = Path(__file__).resolve().parents[1] / "fixtures" / "clusters" / "cpu-4-nodes.yaml"


@pytest.fixture(scope="module")
def ck() -> Checkpointing:
    p = hetplan.compile("gpt-test", ClusterSpec.load(CLUSTER), batch_size=8, pp=2, dp=2,
                        zero_stage=0, passes="dynpipe,even-tp,ddp-buckets,gemini{replicas=2}")
    assert p.checkpointing is not None
    return p.checkpointing


@pytest.mark.parametrize("nbytes", [1, 999, 1_420_800, 1_500_123, 3_000_001])
def test_cuts_cover_the_blob_in_plan_order(ck: Checkpointing, nbytes: int) -> None:
    for row in ck.ranks:
        sends = timetable(ck, row.rank, nbytes)
        sched = next(s for s in ck.schedules if s.id == row.schedule)
        for h in row.holders[1:]:
            mine = [s for s in sends if s.holder == h]
            assert mine[0].start == 0 and mine[-1].end == nbytes
            assert all(a.end == b.start for a, b in zip(mine, mine[1:]))
        # the plan's spans, in its order, each due at its span's start
        planned = [c.span for c in sched.chunks]
        got = [s.span for s in sends]
        assert got == [x for x in planned if x in got] and got == sorted(got)
        for s in sends:
            assert s.due_ms == sched.spans[s.span].start_ms


def test_same_size_keeps_the_planned_bytes(ck: Checkpointing) -> None:
    row = ck.ranks[0]
    sched = next(s for s in ck.schedules if s.id == row.schedule)
    sends = timetable(ck, 0, sched.state_bytes)
    assert [(s.start, s.end - s.start) for s in sends] == [(c.offset, c.size)
                                                          for c in sched.chunks]


def test_overflow_chunk_is_due_at_the_last_span_end(ck: Checkpointing) -> None:
    sched = ck.schedules[0]
    last = sched.chunks[-1]
    moved = last.model_copy(update={"span": len(sched.spans)})
    s2 = sched.model_copy(update={"chunks": (*sched.chunks[:-1], moved)})
    ck2 = ck.model_copy(update={"schedules": (s2, *ck.schedules[1:])})
    sends = timetable(ck2, 0, sched.state_bytes)
    end = sched.spans[-1].start_ms + sched.spans[-1].duration_ms
    assert sends[-1].due_ms == end and sends[-1].span == len(sched.spans)


def test_unplanned_holder_gets_the_whole_blob_at_once(ck: Checkpointing) -> None:
    s2 = ck.schedules[0].model_copy(update={"chunks": ()})
    ck2 = ck.model_copy(update={"schedules": (s2, *ck.schedules[1:])})
    sends = timetable(ck2, 0, 1234)
    assert [(s.holder, s.start, s.end, s.due_ms, s.span) for s in sends] == [
        (ck.ranks[0].holders[1], 0, 1234, 0.0, -1)]
