"""The pipeline simulator's search paths against its plain replay: ``simulate_named`` (the
schedule built and indexed once per shape) gives what ``simulate_schedule`` of
``build_schedule`` gives, events included; each rank's and each stage's end of its last
backward equal the maxima over the timed events; malformed transfer inputs are refused with
the same messages."""

from __future__ import annotations

import pytest

from hetplan.cost_models.pipeline import (
    Action,
    ActionKind,
    PipelineSchedule,
    PipelineScheduleError,
    build_schedule,
    simulate_named,
    simulate_schedule,
)

CASES = [
    ("gpipe", 3, 4, 1, [1.0, 2.0, 1.5], [2.0, 3.0, 2.5], [0.25, 0.5]),
    ("1f1b", 4, 8, 1, [1.0, 1.25, 0.75, 2.0], [2.0, 2.5, 1.5, 4.0], [0.1, 0.2, 0.3]),
    ("interleaved-1f1b", 2, 4, 2, [1.0, 2.0, 1.5, 0.5], [2.0, 3.0, 2.5, 1.0], [0.5, 0.25]),
    ("chimera", 4, 4, 1, [1.0, 1.0, 2.0, 1.0], [2.0, 2.0, 3.0, 2.0], 0.125),
]


@pytest.mark.parametrize("name, p, m, v, fwd, bwd, p2p", CASES)
def test_named_equals_replay_and_backward_ends_match_events(
        name: str, p: int, m: int, v: int, fwd: list[float], bwd: list[float],
        p2p: float | list[float]) -> None:
    fast = simulate_named(name, p, m, v, fwd, bwd, p2p_fwd_ms=p2p, p2p_bwd_ms=p2p)
    sched = build_schedule(name, p, m, v)
    plain = simulate_schedule(sched, fwd, bwd, p2p_fwd_ms=p2p, p2p_bwd_ms=p2p)
    assert fast == plain
    assert fast.events == plain.events and len(fast.events) == 2 * m * sched.num_stages
    rank_end = [0.0] * p
    stage_end = [0.0] * sched.num_stages
    for e in fast.events:
        if e.kind is ActionKind.B:
            rank_end[e.rank] = max(rank_end[e.rank], e.end_ms)
            stage_end[e.stage] = max(stage_end[e.stage], e.end_ms)
    assert list(fast.rank_bwd_end_ms) == rank_end
    assert list(fast.stage_bwd_end_ms) == stage_end
    assert max(rank_end) == fast.iteration_ms


def test_results_with_other_times_differ() -> None:
    a = simulate_named("1f1b", 2, 4, 1, [1.0, 1.0], [2.0, 2.0])
    b = simulate_named("1f1b", 2, 4, 1, [1.0, 1.5], [2.0, 2.0])
    assert a != b and a.iteration_ms < b.iteration_ms


def test_interleaved_without_wrap_link_is_refused() -> None:
    with pytest.raises(PipelineScheduleError, match="wrap-around link 2->0"):
        simulate_named("interleaved-1f1b", 3, 3, 2, [1.0] * 6, [2.0] * 6,
                       p2p_fwd_ms=[0.5, 0.5], p2p_bwd_ms=[0.5, 0.5])


def test_non_neighbour_send_is_refused() -> None:
    F, B = ActionKind.F, ActionKind.B
    # stage 0 on rank 0, stage 1 on rank 2 of 4: the send skips rank 1
    sched = PipelineSchedule("hand", 4, 1, 4, (
        (Action(F, 0, 0), Action(B, 0, 0)),
        (Action(F, 0, 2), Action(B, 0, 2)),
        (Action(F, 0, 1), Action(B, 0, 1)),
        (Action(F, 0, 3), Action(B, 0, 3)),
    ))
    with pytest.raises(PipelineScheduleError, match="between ranks 0 and 2"):
        simulate_schedule(sched, [1.0] * 4, [1.0] * 4, p2p_fwd_ms=0.5, p2p_bwd_ms=0.5)
