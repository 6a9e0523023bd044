"""The validator's rules on ``rebalancing`` events as the runtime runs them
(:mod:`hetplan.ir.plan_rebalancing_checks`; ``docs/decisions/bad-input-round11.md``, "Left
alone"): on :func:`test_plan_checks.valid_plan` (4 layers, stages 0-1 | 2-3) with three
events written the way the ``dynpipe`` pass writes them, one field edited.

Refused: two applied events at one iteration, and an applied event's migrations that are not
the moves its stages make from the stages the runtime holds before it (applied events run
in iteration order). Accepted, as the runtime reads them the plan's way: a list out of
iteration order (sorted), events past ``total_iterations``, a proposal (not applied), an
applied event that lists no migrations, and an event the runtime skips.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hetplan.ir.plan import load_plan
from hetplan.ir.plan_checks import plan_problems
from hetplan.ir.rebalancing import DynamicsSpec
from test_dynpipe_pass import EXAMPLE, dynamic_plan
from test_plan_checks import refused as plan_refused
from test_plan_checks import valid_plan


def _move(layer: int, src: int, dst: int) -> dict[str, Any]:
    return {"layer": layer, "src_stage": src, "dst_stage": dst, "bytes": 64.0}


def _events() -> list[dict[str, Any]]:
    """0-1 | 2-3 -> (10, applied) 0-2 | 3-3 -> (20, applied) 0-0 | 1-3, then a proposal at
    30 back to 0-1 | 2-3 (its moves from 0-0 | 1-3, the stages held)."""
    return [
        {"iteration": 10, "stages": [[0, 2], [3, 3]], "applied": True,
         "migrations": [_move(2, 1, 0)]},
        {"iteration": 20, "stages": [[0, 0], [1, 3]], "applied": True,
         "migrations": [_move(1, 0, 1), _move(2, 0, 1)]},
        {"iteration": 30, "stages": [[0, 1], [2, 3]], "applied": False,
         "migrations": [_move(1, 1, 0)]},
    ]


def _with(events: list[dict[str, Any]], total: int = 100) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(valid_plan().to_json())
    data["rebalancing"] = {"total_iterations": total, "events": events}
    return data


def loads(tmp_path: Path, data: dict[str, Any]) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    load_plan(path)


def refused(tmp_path: Path, events: list[dict[str, Any]], *expected: str) -> str:
    def edit(d: dict[str, Any]) -> None:
        d["rebalancing"] = {"total_iterations": 100, "events": events}

    return plan_refused(tmp_path, edit, *expected)


def test_the_events_as_the_pass_writes_them_load(tmp_path: Path) -> None:
    loads(tmp_path, _with(_events()))


# -- refused ------------------------------------------------------------------------------
def test_two_applied_events_at_one_iteration(tmp_path: Path) -> None:
    """The runtime runs both after iteration 10's step: the layers move twice, and no
    iteration trains on events[0]'s stages, which the plan shows applied."""
    events = _events()
    events[1]["iteration"] = 10
    msg = refused(tmp_path, events,
                  "rebalancing.events[1].iteration: 10, the iteration of events[0], also "
                  "applied: the runtime moves the layers twice",
                  "no iteration trains on events[0]'s stages [0-2, 3-3]",
                  "re-run `hetplan plan --dynamics FILE`")
    assert "migrations" not in msg  # the chain of moves is still the list's


def test_a_migration_that_is_not_the_stages_move(tmp_path: Path) -> None:
    events = _events()
    events[0]["migrations"] = [_move(2, 0, 1)]
    refused(tmp_path, events,
            "rebalancing.events[0].migrations: lists layer 2 stage 0->1, leaves out layer 2 "
            "stage 1->0: moving from the plan's stages [0-1, 2-3] to [0-2, 3-3], the runtime "
            "sends layer 2 stage 1->0",
            "never from this list", "re-run `hetplan plan --dynamics FILE`")


def test_a_migration_left_out_or_listed_twice(tmp_path: Path) -> None:
    events = _events()
    events[1]["migrations"] = [_move(1, 0, 1), _move(1, 0, 1)]
    refused(tmp_path, events,
            "rebalancing.events[1].migrations: lists layer 1 stage 0->1, leaves out layer 2 "
            "stage 0->1: moving from events[0]'s (iteration 10) [0-2, 3-3] to [0-0, 1-3]")


def test_an_event_moved_before_the_one_it_follows(tmp_path: Path) -> None:
    """events[0] edited to iteration 25: the runtime runs events[1] first, from the plan's
    stages, so both lists of moves describe moves it does not make."""
    events = _events()
    events[0]["iteration"] = 25
    refused(tmp_path, events,
            "rebalancing.events[1].migrations: lists layer 2 stage 0->1, leaves out nothing: "
            "moving from the plan's stages [0-1, 2-3] to [0-0, 1-3]",
            "rebalancing.events[0].migrations: lists nothing, leaves out layer 1 stage 1->0: "
            "moving from events[1]'s (iteration 20) [0-0, 1-3] to [0-2, 3-3]")


def test_a_pass_made_plan_validates_and_its_edits_are_refused() -> None:
    plan = dynamic_plan(DynamicsSpec.load(EXAMPLE))
    reb = plan.rebalancing
    assert reb is not None and plan_problems(plan) == []
    applied = [i for i, e in enumerate(reb.events) if e.applied]
    assert applied and all(reb.events[i].migrations for i in applied)
    i = applied[-1]
    wrong = reb.events[i].model_copy(update={"migrations": reb.events[i].migrations[1:]})
    events = reb.events[:i] + (wrong,) + reb.events[i + 1:]
    edited = plan.model_copy(update={"rebalancing": reb.model_copy(update={"events": events})})
    assert [p.split(":")[0] for p in plan_problems(edited)] == [
        f"rebalancing.events[{i}].migrations"]


# -- accepted: the runtime reads them as the plan does --------------------------------------
def test_a_list_out_of_iteration_order_loads(tmp_path: Path) -> None:
    """The runtime sorts the applied events by iteration: the same moves, in the same order."""
    events = _events()
    loads(tmp_path, _with([events[2], events[1], events[0]]))


def test_events_past_total_iterations_load(tmp_path: Path) -> None:
    """The run's length is ``hetplan run --steps``; ``total_iterations`` is the horizon of
    the predicted speedup, which the runtime does not read."""
    loads(tmp_path, _with(_events(), total=15))


def test_a_proposal_and_an_event_without_migrations_load(tmp_path: Path) -> None:
    events = _events()
    events[2].update(iteration=20, migrations=[_move(3, 0, 1)])  # not applied: nothing runs
    events[1]["migrations"] = []  # declarative: the runtime derives the moves
    loads(tmp_path, _with(events))


def test_an_event_the_runtime_skips_is_not_replayed(tmp_path: Path) -> None:
    """After re-packing onto one stage, an event on two is skipped (with a warning): the
    next one moves from the one stage."""
    events = [
        {"iteration": 10, "stages": [[0, 3]], "applied": True, "released_stages": [1],
         "migrations": [_move(2, 1, 0), _move(3, 1, 0)]},
        {"iteration": 10, "stages": [[0, 1], [2, 3]], "applied": True,
         "migrations": [_move(0, 0, 1)]},
    ]
    loads(tmp_path, _with(events))
