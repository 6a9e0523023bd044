"""Pipeline schedules as data (hetplan.algorithms.pipeline_schedules) and the plan's action
lists: printing and parsing actions, encoding and decoding a schedule, the deadlock check,
the plan section's validation, that compile fills it, and that the simulator costs exactly
those lists."""

from __future__ import annotations

import json

import pytest

import hetplan
from hetplan.algorithms.pipeline_schedules import (
    SCHEDULES,
    Action,
    ActionKind,
    PipelineDeadlockError,
    PipelineScheduleError,
    build_schedule,
    check_progress,
    decode_schedule,
    layout_actions,
    plan_schedule,
)
from hetplan.cost_models.pipeline import simulate_pipeline, simulate_schedule
from hetplan.errors import SpecError
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import ClusterRef, Layout, ModelRef, PipelineActions

F, B = ActionKind.F, ActionKind.B


def _sizes() -> list[tuple[str, int, int, int]]:
    """(schedule, P, M, v) for every schedule over small sizes it accepts."""
    out = []
    for p in range(1, 5):
        for m in range(1, 9):
            out += [("gpipe", p, m, 1), ("1f1b", p, m, 1)]
            if p % 2 == 0 and m % 2 == 0:
                out.append(("chimera", p, m, 1))
            if m % p == 0:
                out += [("interleaved-1f1b", p, m, v) for v in (2, 3)]
    return out


# -- actions and schedules ------------------------------------------------------------------------
def test_action_prints_and_parses_like_torch_pipelining() -> None:
    a = Action(F, 0, 2)
    assert str(a) == "2F0"
    assert Action.parse("2F0") == a
    assert Action.parse("13B107") == Action(B, 107, 13)
    for bad in ("2X0", "F0", "2F", "2 F0", "2F0,1B0", ""):
        with pytest.raises(PipelineScheduleError, match="is not of the form"):
            Action.parse(bad)


@pytest.mark.parametrize(("name", "p", "m", "v"), _sizes())
def test_every_generated_schedule_encodes_decodes_and_finishes(name: str, p: int, m: int,
                                                               v: int) -> None:
    sched = build_schedule(name, p, m, v)
    check_progress(sched)
    back = decode_schedule(name, m, sched.num_stages, sched.encode())
    assert back == sched


def test_encoding_is_one_string_per_rank() -> None:
    assert build_schedule("1f1b", 2, 3).encode() == ("0F0 0F1 0B0 0F2 0B1 0B2",
                                                     "1F0 1B0 1F1 1B1 1F2 1B2")


def test_stage_ranks() -> None:
    assert build_schedule("interleaved-1f1b", 2, 4, 2).stage_ranks() == {0: 0, 1: 1, 2: 0,
                                                                         3: 1}
    with pytest.raises(PipelineScheduleError, match="stage 0 on ranks 0 and 1"):
        build_schedule("chimera", 2, 2).stage_ranks()


@pytest.mark.parametrize(("ranks", "error", "match"), [
    (("0F0 0B0", "1F0 1B0 1F1 1B1"), PipelineScheduleError, "never runs 0F1"),
    (("0F0 0F0 0B0", "1F0 1B0"), PipelineScheduleError, "appears twice"),
    (("0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1 1F2"), PipelineScheduleError, "out of range"),
    (("0F0 0F1 0B1", "1F0 1B0 1F1 1B1 0B0"), PipelineScheduleError, "its backward on rank 1"),
    (("0F0 0B0 0F1 0B1", "1F1 1F0 1B0 1B1"), PipelineDeadlockError, r"rank 1 at step 0 \(1F1\)"),
    (("0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1X1"), PipelineScheduleError, "'1X1'"),
])
def test_decode_refuses_lists_that_cannot_run(ranks: tuple[str, ...], error: type,
                                              match: str) -> None:
    m = 1 if "0F0 0F0" in ranks[0] else 2
    with pytest.raises(error, match=match):
        decode_schedule("hand", m, 2, ranks)


def test_deadlock_check_agrees_with_the_simulator() -> None:
    acts = tuple(tuple(Action.parse(a) for a in row.split())
                 for row in ("0F0 0B0 0F1 0B1", "1F1 1F0 1B0 1B1"))
    from hetplan.algorithms.pipeline_schedules import PipelineSchedule

    sched = PipelineSchedule("hand", 2, 2, 2, acts)
    with pytest.raises(PipelineDeadlockError) as pure:
        check_progress(sched)
    with pytest.raises(PipelineDeadlockError) as timed:
        simulate_schedule(sched, [1, 1], [2, 2])
    assert pure.value.table == timed.value.table
    assert pure.value.table.count("<-- STALLED HERE") == 2


# -- the simulator costs exactly these lists ------------------------------------------------------
@pytest.mark.parametrize(("name", "p", "m", "v"),
                         [("gpipe", 3, 4, 1), ("1f1b", 4, 6, 1), ("interleaved-1f1b", 2, 4, 2),
                          ("chimera", 4, 8, 1)])
def test_the_simulator_runs_each_rank_in_list_order(name: str, p: int, m: int, v: int) -> None:
    sched = build_schedule(name, p, m, v)
    fwd, bwd = list(range(1, p + 1)), [2 * t for t in range(1, p + 1)]
    result = simulate_pipeline(fwd, bwd, m, name, virtual_stages=v, p2p_fwd_ms=1, p2p_bwd_ms=1)
    for r in range(p):
        events = sorted((e for e in result.events if e.rank == r), key=lambda e: e.start_ms)
        assert tuple(Action(e.kind, e.microbatch, e.stage) for e in events) == sched.actions[r]
    decoded = decode_schedule(name, m, sched.num_stages, sched.encode())
    assert simulate_schedule(decoded, fwd, bwd, p2p_fwd_ms=1, p2p_bwd_ms=1) == result


# -- the plan section -----------------------------------------------------------------------------
def _plan(layout: Layout | None, actions: PipelineActions | None) -> Plan:
    return Plan(model=ModelRef(name="m", fingerprint="f", num_params=1),
                cluster=ClusterRef(name="c", fingerprint="g", world_size=8), layout=layout,
                pipeline_actions=actions)


def test_layout_actions_and_plan_schedule() -> None:
    assert layout_actions(Layout(pp=1, micro_batches=4)) is None
    layout = Layout(pp=2, micro_batches=4, schedule="interleaved-1f1b", virtual_stages=2)
    section = layout_actions(layout)
    assert section is not None
    assert (section.schedule, section.micro_batches, section.num_stages) == (
        "interleaved-1f1b", 4, 4)
    generated = build_schedule("interleaved-1f1b", 2, 4, 2)
    assert section.ranks == generated.encode()
    assert plan_schedule(layout, section) == generated
    assert plan_schedule(layout, None) == generated  # a plan from before the section
    plan = _plan(layout, section)
    assert Plan.from_json(plan.to_json()) == plan


@pytest.mark.parametrize("bad", ["0F0,0F1", "0F0  0F1", " 0F0", "0X0", "", "F0"])
def test_section_refuses_malformed_action_strings(bad: str) -> None:
    with pytest.raises(ValueError, match="ranks"):
        PipelineActions(schedule="1f1b", micro_batches=1, num_stages=2, ranks=("0F0 0B0", bad))


def test_plan_refuses_actions_that_do_not_match_the_layout() -> None:
    section = layout_actions(Layout(pp=2, micro_batches=2))
    data = json.loads(_plan(Layout(pp=2, micro_batches=2), section).to_json())
    data["layout"]["micro_batches"] = 4  # edited by hand, the lists left as they were
    with pytest.raises(SpecError, match="micro_batches is 2, the layout needs 4"):
        Plan.from_json(json.dumps(data))
    with pytest.raises(ValueError, match="len\\(ranks\\) is 2, the layout needs 4"):
        _plan(Layout(pp=4, micro_batches=2), section)
    with pytest.raises(ValueError, match="schedule is '1f1b', the layout needs 'gpipe'"):
        _plan(Layout(pp=2, micro_batches=2, schedule="gpipe"), section)
    with pytest.raises(ValueError, match="needs a layout"):
        _plan(None, section)  # type: ignore[arg-type]


def test_compile_writes_the_lists_of_its_layout() -> None:
    spec = ClusterSpec.from_preset("local-cpu").model_dump(mode="json")
    spec["nodes"][0]["devices"] = [{"type": "cpu", "count": 2}]
    cluster = ClusterSpec.from_dict(spec)
    piped = hetplan.compile("mlp", cluster, batch_size=8, dp=1, pp=2, tp=1,
                            micro_batch_size=2, schedule="gpipe")
    assert piped.layout is not None and piped.pipeline_actions is not None
    assert piped.pipeline_actions == layout_actions(piped.layout)
    assert piped.pipeline_actions.ranks == build_schedule("gpipe", 2, 4).encode()
    flat = hetplan.compile("mlp", cluster, batch_size=8, dp=2, pp=1, tp=1)
    assert flat.pipeline_actions is None


def test_schedules_listed_are_the_generated_ones() -> None:
    assert set(SCHEDULES) == {"gpipe", "1f1b", "interleaved-1f1b", "chimera"}
    with pytest.raises(PipelineScheduleError, match="unknown pipeline schedule 'zb'"):
        build_schedule("zb", 2, 2)
