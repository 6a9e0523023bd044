"""A pipeline's TP stages priced between the TP records timed with every group at once and
with one group alone, by how much the other stages' compute overlaps theirs
(:mod:`hetplan.cost_models.core_sharing`, ``docs/decisions/cpu-fidelity.md`` section 26)."""

from __future__ import annotations

import pytest

from hetplan.cost_models.core_sharing import stage_overlaps
from hetplan.cost_models.pipeline import simulate_pipeline
from hetplan.cost_models.profile_db import HandoverRecord, ProfileDB
from hetplan.ir.cluster import ClusterSpec
from tests.unit.test_tp_step import LINES, MS, NO_SP, P2P, PP_TP, SP, TP, _phase

#: the same phases with one TP group alone: half the together records' (30 / 10 ms with
#: sequence parallelism, 20 / 8 without)
SOLO_SP = (_phase("tp_sp_alone_forward", 15 * MS), _phase("tp_sp_alone_backward", 5 * MS))
SOLO_NO_SP = (_phase("tp_alone_forward", 10 * MS), _phase("tp_alone_backward", 4 * MS))
TOGETHER = ProfileDB(collectives=LINES, handovers=(P2P, *SP, *NO_SP))


def _flat(pairs: list[tuple[float, float]]) -> list[float]:
    return [x for pair in pairs for x in pair]


def _db(*records: HandoverRecord) -> ProfileDB:
    return ProfileDB(collectives=LINES, handovers=(P2P, *SP, *NO_SP, *records))


def _priced(db: ProfileDB, batch: int = 8, **pins: object):  # type: ignore[no-untyped-def]
    import hetplan

    plan = hetplan.compile("megatron-gpt-test", ClusterSpec.from_preset("local-cpu"),
                           batch_size=batch, profile=db, micro_batch_size=2, dtype="fp32",
                           **pins)
    assert plan.predictions is not None
    return plan


def _stage_times(db: ProfileDB, overlap: tuple[float, float] | None
                 ) -> list[tuple[float, float]]:
    """Each stage's (forward, backward) of the PP 2 x TP 2 plan priced with ``db`` at the
    given overlap share."""
    from hetplan import zoo
    from hetplan.cost_models.costs import CostModel
    from hetplan.cost_models.stage_times import stage_times
    from hetplan.ir.capture import capture
    from hetplan.ir.plan_sections import WorkloadSummary

    plan = _priced(TOGETHER, **PP_TP)
    args, kwargs = zoo.example_inputs("megatron-gpt-test", batch=1, device="meta")
    ir = capture(zoo.build("megatron-gpt-test", device="meta"), args, kwargs,
                 name="megatron-gpt-test")
    workload = WorkloadSummary.from_model_ir(ir)
    costs = CostModel(ClusterSpec.from_preset("local-cpu"), db, dtype="fp32",
                      vocab_parallel=True)
    out = []
    for st in plan.stages:
        t = stage_times(workload, st, plan.layout, costs, 2, 2 / workload.batch_size,
                        overlap=overlap)
        out.append((t[0], t[1]))
    return out


# -- the overlap of a schedule --------------------------------------------------------------
def test_stages_that_never_compute_together_overlap_nothing() -> None:
    pipe = simulate_pipeline([5.0, 5.0], [5.0, 5.0], 1, "gpipe")  # one micro-batch: in turn
    assert stage_overlaps(pipe, [[2], [2]], [0, 0], [4], 2, 2) == [(0.0, 0.0), (0.0, 0.0)]


def test_1f1b_overlaps_follow_the_schedule() -> None:
    # 1F1B over 4 micro-batches, 5 ms every action: rank 0's forwards 0-10, 20-25, 30-35
    # and rank 1's 5-10, 15-20, 25-30, 35-40; its backwards run while rank 0 computes
    # except the last, rank 0's while rank 1 does except the last
    pipe = simulate_pipeline([5.0, 5.0], [5.0, 5.0], 4, "1f1b")
    (f0, b0), (f1, b1) = stage_overlaps(pipe, [[2], [2]], [0, 0], [4], 2, 2)
    assert (f0, b0) == pytest.approx((0.75, 0.75))
    assert (f1, b1) == pytest.approx((1.0, 0.5))


def test_processes_on_another_node_do_not_share_the_cores() -> None:
    # each pipeline rank on a node of its own: nothing else computes on a stage's node
    pipe = simulate_pipeline([5.0, 5.0], [5.0, 5.0], 4, "1f1b")
    assert stage_overlaps(pipe, [[2, 0], [0, 2]], [0, 1], [2, 2], 2, 2) == [
        (1.0, 1.0), (1.0, 1.0)]  # no room below "together": priced as before
    # one node of eight, two data-parallel TP groups per stage: a stage alone is 1/3 busy
    pipe = simulate_pipeline([5.0, 5.0], [5.0, 5.0], 1, "gpipe")
    assert _flat(stage_overlaps(pipe, [[4], [4]], [0, 0], [8], 2, 2)) == pytest.approx(
        [1 / 3] * 4)


# -- the price of a stage -------------------------------------------------------------------
def test_a_stage_is_priced_between_the_two_records_by_its_overlap() -> None:
    db = _db(*SOLO_SP)
    together = _stage_times(TOGETHER, None)
    assert _stage_times(db, None) == together  # no overlap given: the together records
    assert _flat(_stage_times(db, (1.0, 1.0))) == pytest.approx(_flat(together))
    alone = _stage_times(db, (0.0, 0.0))  # half, as recorded
    assert _flat(alone) == pytest.approx(_flat([(f / 2, b / 2) for f, b in together]))
    half = _stage_times(db, (0.5, 0.25))
    assert _flat(half) == pytest.approx(_flat([(0.75 * f, 0.625 * b) for f, b in together]))
    # without the alone records the overlap changes nothing
    assert _stage_times(TOGETHER, (0.0, 0.0)) == together


def test_alone_records_not_of_the_same_steps_are_not_used() -> None:
    together = _stage_times(TOGETHER, None)
    for other in ((_phase("tp_sp_alone_forward", 15 * MS, micro_batch=1), SOLO_SP[1]),
                  (_phase("tp_sp_alone_forward", 15 * MS, nbytes=10 * 939_520),
                   _phase("tp_sp_alone_backward", 5 * MS, nbytes=10 * 939_520)),
                  (SOLO_SP[0],)):  # the backward not measured alone
        assert _stage_times(_db(*other), (0.0, 0.0)) == together
    # an alone loss without a together one (or the reverse): different steps, not used
    assert _stage_times(_db(*SOLO_SP, _phase("tp_sp_alone_loss", 5 * MS)), (0.0, 0.0)) \
        == together


def test_an_alone_record_slower_than_together_never_raises_the_price() -> None:
    slow = (_phase("tp_sp_alone_forward", 60 * MS), _phase("tp_sp_alone_backward", 20 * MS))
    assert _stage_times(_db(*slow), (0.0, 0.0)) == _stage_times(TOGETHER, None)


# -- whole plans ----------------------------------------------------------------------------
def test_a_tp_pipeline_is_predicted_faster_with_the_alone_records() -> None:
    with_alone = _priced(_db(*SOLO_SP, *SOLO_NO_SP), **PP_TP)
    without = _priced(TOGETHER, **PP_TP)
    all_alone = _priced(ProfileDB(collectives=LINES, handovers=(
        P2P, *(r.model_copy(update={"operation": r.operation.replace("alone_", "")})
               for r in (*SOLO_SP, *SOLO_NO_SP)))), **PP_TP)  # as if every record alone
    assert with_alone.layout == without.layout
    t = with_alone.predictions.iteration_time_ms
    # between pricing every action alone and every action together, strictly
    assert all_alone.predictions.iteration_time_ms < t < without.predictions.iteration_time_ms
    # and deterministic, to the byte
    assert _priced(_db(*SOLO_SP, *SOLO_NO_SP), **PP_TP).to_json() == with_alone.to_json()


def test_plans_that_are_not_a_tp_pipeline_do_not_read_the_alone_records() -> None:
    db = _db(*SOLO_SP, *SOLO_NO_SP)
    for pins in (TP, dict(dp=2, pp=2, tp=1, zero_stage=0, recompute="none",
                          schedule="1f1b")):
        a, b = _priced(db, **pins), _priced(TOGETHER, **pins)
        assert a.layout == b.layout
        assert a.predictions.iteration_time_ms == b.predictions.iteration_time_ms
