"""The runtime's tensor-parallel phases timed with every TP group at once
(``docs/decisions/cpu-fidelity.md`` section 13): the ``tp_*`` records, the charge a TP stage
takes from them in place of its split layer records and the collectives' lines, where it
does not apply, and the measurement."""

from __future__ import annotations

import json

import pytest

from hetplan.cost_models.comm import CommModel
from hetplan.cost_models.profile_db import (
    CollectiveRecord,
    CollectiveSample,
    HandoverRecord,
    HandoverSample,
    ProfileDB,
)
from hetplan.ir.cluster import ClusterSpec

MS = 1e-3
#: megatron-gpt-test's fp32 parameters (the records' ``nbytes``)
MEGATRON_BYTES = 939_520


def _line(collective: str, group: int, alpha_s: float) -> CollectiveRecord:
    return CollectiveRecord(collective=collective,  # type: ignore[arg-type]
                            backend="gloo", link_kind="loopback", group_size=group,
                            alpha_s=alpha_s, beta_s_per_byte=1e-9,
                            samples=(CollectiveSample(nbytes=4096, seconds=alpha_s),))


def _phase(operation: str, seconds: float, group: int = 2, micro_batch: int | None = 2,
           nbytes: int = MEGATRON_BYTES, burst: float = 2 * MS) -> HandoverRecord:
    return HandoverRecord(operation=operation,  # type: ignore[arg-type]
                          backend="gloo", link_kind="loopback", group_size=group,
                          processes=4, nbytes=nbytes, micro_batch=micro_batch,
                          samples=(HandoverSample(burst_s=burst, seconds=seconds),))


LINES = (_line("p2p", 2, 0.3 * MS), _line("allreduce", 4, 4.0 * MS),
         _line("allreduce", 2, 0.3 * MS), _line("allgather", 2, 0.3 * MS),
         _line("reduce_scatter", 2, 0.3 * MS))
#: a p2p burst record, so that the profile has hand-overs without TP phases
P2P = HandoverRecord(operation="p2p", backend="gloo", link_kind="loopback", group_size=2,
                     processes=4, nbytes=4096,
                     samples=(HandoverSample(burst_s=0.0, seconds=0.5 * MS),))
#: the TP phases of the whole model at micro-batch 2: 30 ms forward, 10 ms backward with
#: sequence parallelism, 20 / 8 ms without
SP = (_phase("tp_sp_forward", 30 * MS), _phase("tp_sp_backward", 10 * MS))
NO_SP = (_phase("tp_forward", 20 * MS), _phase("tp_backward", 8 * MS))
BASE = ProfileDB(collectives=LINES, handovers=(P2P,))
WITH = ProfileDB(collectives=LINES, handovers=(P2P, *SP, *NO_SP))

TP = dict(dp=2, pp=1, tp=2, zero_stage=0, recompute="none")
PP_TP = dict(dp=1, pp=2, tp=2, zero_stage=0, recompute="none", schedule="1f1b")


def _plan(db: ProfileDB | None, batch: int = 4, mb: int = 2, **pins: object
          ):  # type: ignore[no-untyped-def]
    import hetplan

    return hetplan.compile("megatron-gpt-test", ClusterSpec.from_preset("local-cpu"),
                           batch_size=batch, profile=db, micro_batch_size=mb, dtype="fp32",
                           **pins)


def _priced(db: ProfileDB | None, **pins: object) -> tuple[object, ...]:
    plan = _plan(db, **pins)
    assert plan.predictions is not None
    return (plan.layout, plan.stages, plan.predictions.iteration_time_ms,
            plan.predictions.breakdown)


# -- the record -----------------------------------------------------------------------------
def test_the_phase_record_round_trips_and_older_records_are_written_unchanged() -> None:
    back = ProfileDB.from_json(WITH.to_json())
    assert back == WITH
    assert back.handover("tp_sp_forward", "gloo", "loopback", 2) == SP[0]
    assert back.handover("tp_sp_forward", "gloo", "loopback", 2).micro_batch == 2
    # a record without a micro-batch (every message record) is written without the field
    doc = json.loads(BASE.to_json())
    assert "micro_batch" not in doc["handovers"][0]
    assert "micro_batch" in json.loads(WITH.to_json())["handovers"][-1]
    with pytest.raises(ValueError, match="micro_batch"):
        _phase("tp_forward", 1 * MS, micro_batch=0)


def test_the_phase_record_of_the_nearest_model_is_read() -> None:
    other = _phase("tp_sp_forward", 99 * MS, nbytes=10 * MEGATRON_BYTES)
    comm = CommModel(ClusterSpec.from_preset("local-cpu"),
                     ProfileDB(collectives=LINES, handovers=(*SP, other)))
    assert comm.phase_record("tp_sp_forward", 2, "intra", MEGATRON_BYTES) == SP[0]
    assert comm.phase_record("tp_sp_forward", 2, "intra", 9 * MEGATRON_BYTES) == other
    assert comm.phase_record("tp_sp_forward", 4, "intra", MEGATRON_BYTES) is None
    assert CommModel(ClusterSpec.from_preset("local-cpu"), BASE).phase_record(
        "tp_sp_forward", 2, "intra", MEGATRON_BYTES) is None


# -- plans ----------------------------------------------------------------------------------
def test_a_tp_stage_is_charged_the_measured_phases() -> None:
    base = _plan(BASE, **TP)
    plan = _plan(WITH, **TP)
    assert plan.layout.sequence_parallel  # the planner's default for pp=1
    assert base.predictions is not None and plan.predictions is not None
    # one stage holds the whole model, one micro-batch at the record's: the phases as measured
    assert plan.predictions.breakdown.compute_ms == pytest.approx(40.0, rel=1e-6)
    assert base.predictions.breakdown.compute_ms < 30.0
    # without sequence parallelism the other pair of records
    no_sp = _plan(WITH, sequence_parallel=False, **TP)
    assert no_sp.predictions is not None
    assert no_sp.predictions.breakdown.compute_ms == pytest.approx(28.0, rel=1e-6)


def test_the_charge_scales_with_the_micro_batch_and_splits_between_stages() -> None:
    one = _plan(WITH, batch=2, mb=1, **TP)  # micro-batch 1 against the records' 2
    assert one.predictions is not None
    assert one.predictions.breakdown.compute_ms == pytest.approx(20.0, rel=1e-6)
    # two stages: each its share by the layer records, shares summing to the whole model
    from hetplan.cost_models.costs import CostModel
    from hetplan.cost_models.stage_times import stage_times
    from hetplan.ir.plan_sections import WorkloadSummary

    plan = _plan(WITH, **PP_TP)
    assert len(plan.stages) == 2
    from hetplan import zoo
    from hetplan.ir.capture import capture

    args, kwargs = zoo.example_inputs("megatron-gpt-test", batch=1, device="meta")
    ir = capture(zoo.build("megatron-gpt-test", device="meta"), args, kwargs,
                 name="megatron-gpt-test")
    workload = WorkloadSummary.from_model_ir(ir)
    costs = CostModel(ClusterSpec.from_preset("local-cpu"), WITH, dtype="fp32",
                      vocab_parallel=True)
    times = [stage_times(workload, st, plan.layout, costs, 2, 2 / workload.batch_size)
             for st in plan.stages]
    assert sum(t[0] for t in times) == pytest.approx(30 * MS, rel=1e-6)
    assert sum(t[1] for t in times) == pytest.approx(10 * MS, rel=1e-6)
    assert all(0.1 < t[0] / (30 * MS) < 0.9 for t in times)
    # each stage's per-layer backward (the data-parallel timeline's) sums to its backward
    assert all(sum(t[3]) == pytest.approx(t[1]) for t in times)


def _with(*records: HandoverRecord) -> ProfileDB:
    return ProfileDB(collectives=LINES, handovers=(P2P, *SP, *NO_SP, *records))


def _stage_forwards(db: ProfileDB) -> list[float]:
    """Each stage's forward per micro-batch of the PP 2 x TP 2 plan priced with ``db``."""
    from hetplan import zoo
    from hetplan.cost_models.costs import CostModel
    from hetplan.cost_models.stage_times import stage_times
    from hetplan.ir.capture import capture
    from hetplan.ir.plan_sections import WorkloadSummary

    plan = _plan(WITH, **PP_TP)  # the same stages for every ``db``
    args, kwargs = zoo.example_inputs("megatron-gpt-test", batch=1, device="meta")
    ir = capture(zoo.build("megatron-gpt-test", device="meta"), args, kwargs,
                 name="megatron-gpt-test")
    workload = WorkloadSummary.from_model_ir(ir)
    costs = CostModel(ClusterSpec.from_preset("local-cpu"), db, dtype="fp32",
                      vocab_parallel=True)
    return [stage_times(workload, st, plan.layout, costs, 2, 2 / workload.batch_size)[0]
            for st in plan.stages]


def test_the_measured_loss_is_charged_to_the_last_stage_only() -> None:
    """The vocabulary-parallel cross-entropy runs after the last stage's forward (section
    14's trace): with the ``tp_sp_loss`` record the last stage pays it whole and the other
    stages share only the forward without it."""
    loss = _phase("tp_sp_loss", 12 * MS)
    shared = _stage_forwards(WITH)
    placed = _stage_forwards(_with(loss))
    share = [f / (30 * MS) for f in shared]  # each stage's share of the forward record
    assert placed[0] == pytest.approx(share[0] * 18 * MS, rel=1e-9)
    assert placed[1] == pytest.approx(share[1] * 18 * MS + 12 * MS, rel=1e-9)
    assert sum(placed) == pytest.approx(30 * MS, rel=1e-9)  # the whole forward, moved
    assert placed[1] - shared[1] == pytest.approx(12 * MS * share[0], rel=1e-9)
    # one stage holding the whole model: the forward record as before
    one = _plan(_with(loss), **TP)
    assert one.predictions is not None
    assert one.predictions.breakdown.compute_ms == pytest.approx(40.0, rel=1e-6)
    # and the pipeline is predicted slower: its last stage is on the critical path twice
    slow = _plan(_with(loss), **PP_TP)
    fast = _plan(WITH, **PP_TP)
    assert slow.predictions is not None and fast.predictions is not None
    assert slow.predictions.iteration_time_ms > fast.predictions.iteration_time_ms


def test_a_loss_record_not_of_the_forwards_steps_is_not_charged() -> None:
    for other in (_phase("tp_sp_loss", 12 * MS, micro_batch=1),  # another micro-batch
                  _phase("tp_sp_loss", 12 * MS, nbytes=MEGATRON_BYTES // 2),  # model
                  _phase("tp_sp_loss", 31 * MS)):  # longer than the forward it is part of
        assert _stage_forwards(_with(other)) == \
            _stage_forwards(WITH)


def test_the_records_do_not_apply_where_the_run_is_not_what_was_measured() -> None:
    # another TP size than the records'
    four = ProfileDB(collectives=LINES, handovers=(P2P, *(
        r.model_copy(update={"group_size": 4}) for r in (*SP, *NO_SP))))
    assert _priced(four, **TP) == _priced(BASE, **TP)
    # only the forward measured
    assert _priced(ProfileDB(collectives=LINES, handovers=(P2P, SP[0])), **TP) == _priced(
        BASE, **TP)
    # recomputation reruns forwards the records do not hold; ZeRO-3 shards the parameters
    for pins in (dict(TP, recompute="full"), dict(TP, zero_stage=3)):
        assert _priced(WITH, **pins) == _priced(BASE, **pins)
    # plans without TP do not read them
    dp = dict(dp=2, pp=2, tp=1, zero_stage=0, schedule="1f1b")
    assert _priced(WITH, batch=8, **dp) == _priced(BASE, batch=8, **dp)
    # (while the records' own TP plan does change: the comparisons can fail)
    assert _priced(WITH, **TP) != _priced(BASE, **TP)


def test_the_charge_is_deterministic() -> None:
    assert _plan(WITH, **TP).to_json() == _plan(WITH, **TP).to_json()


# -- the measurement ------------------------------------------------------------------------
@pytest.mark.dist
def test_profile_tp_steps_times_the_split_model_beside_the_plain_one() -> None:
    from hetplan.profiling.tp_step import profile_tp_steps

    recs, times = profile_tp_steps("megatron-gpt-test", 2, batch_size=2, rounds=2, warmup=1,
                                   passes=1, timeout_s=120)
    assert [r.operation for r in recs] == ["tp_forward", "tp_backward", "tp_loss",
                                           "tp_sp_forward", "tp_sp_backward", "tp_sp_loss"]
    for r in recs:
        assert (r.group_size, r.processes, r.nbytes, r.micro_batch) == (2, 2, MEGATRON_BYTES,
                                                                         2)
        assert r.samples[0].seconds > 0.0 and r.samples[0].burst_s > 0.0
    assert [(t.group_size, t.sequence_parallel) for t in times] == [(2, False), (2, True)]
    for t in times:  # the loss is part of the forward it was timed in
        assert 0.0 < t.tp_loss_s < t.tp_forward_s and 0.0 < t.loss_s < t.forward_s


def test_profile_tp_steps_rejects_bad_input() -> None:
    from hetplan.profiling.tp_step import profile_tp_steps

    with pytest.raises(ValueError, match="world_size"):
        profile_tp_steps("megatron-gpt-test", 1)
    with pytest.raises(ValueError, match="passes"):
        profile_tp_steps("megatron-gpt-test", 2, passes=0)
    with pytest.raises(ValueError, match="group size"):
        profile_tp_steps("megatron-gpt-test", 4, group_sizes=[3])
    assert profile_tp_steps("megatron-gpt-test", 2, max_params=1000) == ([], [])


def test_run_profile_takes_the_tp_records_for_a_zoo_model(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import hetplan.profiling as prof

    calls: list[tuple[str, int, int]] = []

    def fake_tp(model: str, world: int, *, batch_size: int, **_: object
                ) -> tuple[list[HandoverRecord], list[object]]:
        calls.append((model, world, batch_size))
        return list(SP), []

    monkeypatch.setattr(prof, "_collectives", lambda *a, **k: [])
    monkeypatch.setattr(prof, "profile_handovers", lambda *a, **k: [P2P])
    monkeypatch.setattr(prof, "profile_sync_steps", lambda *a, **k: ([], []))
    monkeypatch.setattr(prof, "profile_tp_steps", fake_tp)
    traced = P2P.model_copy(update={"operation": "traced_forward", "micro_batch": 2})
    monkeypatch.setattr(prof, "profile_traced_stages", lambda *a, **k: ([traced], None))
    db = prof.run_profile("megatron-gpt-test", world_size=4, what=["collectives"],
                          batch_size=2, show_progress=False)
    assert calls == [("megatron-gpt-test", 4, 2)]
    assert SP[0] in db.handovers and P2P in db.handovers and traced in db.handovers
    calls.clear()
    db = prof.run_profile(None, world_size=4, what=["collectives"], show_progress=False)
    assert calls == [] and SP[0] not in db.handovers
