"""The data-parallel sync timed inside the runtime's own step (``docs/decisions/
cpu-fidelity.md`` section 12): the ``allreduce_step`` record, the charge the cost model takes
from it in place of the ``allreduce`` record, where it does not apply, and the measurement."""

from __future__ import annotations

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
MIB = 1 << 20


def _line(collective: str, group: int, alpha_s: float, beta: float = 1e-9) -> CollectiveRecord:
    return CollectiveRecord(collective=collective,  # type: ignore[arg-type]
                            backend="gloo", link_kind="loopback", group_size=group,
                            alpha_s=alpha_s, beta_s_per_byte=beta,
                            samples=(CollectiveSample(nbytes=4096, seconds=alpha_s),))


def _hand(operation: str, group: int, points: list[tuple[float, float]],
          nbytes: int = 4096) -> HandoverRecord:
    return HandoverRecord(operation=operation,  # type: ignore[arg-type]
                          backend="gloo", link_kind="loopback", group_size=group,
                          processes=4, nbytes=nbytes,
                          samples=tuple(HandoverSample(burst_s=b, seconds=s) for b, s in points))


LINES = (_line("p2p", 2, 0.3 * MS), _line("allreduce", 4, 4.0 * MS),
         _line("allreduce", 2, 0.3 * MS),
         # ZeRO-3's routines at local-cpu's loopback line (unmeasured, they would be priced
         # as the all-reduce: test_comm_model.py)
         *(_line(c, 4, 2.4 * MS, beta=8e-10) for c in ("allgather", "reduce_scatter")))
#: the matmul-burst records (section 10-11)
HANDS = (_hand("p2p", 2, [(0.0, 1.0 * MS), (2 * MS, 3.0 * MS)]),
         _hand("allreduce", 4, [(0.0, 5.0 * MS), (4 * MS, 6.0 * MS)]),
         _hand("allreduce", 4, [(0.0, 5.5 * MS), (4 * MS, 6.5 * MS)], nbytes=MIB))
#: the sync inside the runtime's step: 12 ms added to a 6 ms step, at gpt-test's bucket
STEP = _hand("allreduce_step", 4, [(6 * MS, 12.0 * MS)], nbytes=939_520)
BURSTS = ProfileDB(collectives=LINES, handovers=HANDS)
WITH_STEP = ProfileDB(collectives=LINES, handovers=(*HANDS, STEP))
NO_HANDS = ProfileDB(collectives=LINES)


def _plan(db: ProfileDB, **pins: object):  # type: ignore[no-untyped-def]
    import hetplan

    return hetplan.compile("gpt-test", ClusterSpec.from_preset("local-cpu"), batch_size=8,
                           profile=db, micro_batch_size=2, dtype="fp32", **pins)


DP = dict(dp=4, pp=1, tp=1, zero_stage=0, passes="uniform-stages,ddp-buckets")


# -- the record -----------------------------------------------------------------------------
def test_the_step_record_round_trips_beside_the_burst_records() -> None:
    back = ProfileDB.from_json(WITH_STEP.to_json())
    assert back == WITH_STEP
    rec = back.handover("allreduce_step", "gloo", "loopback", 4)
    assert rec is not None and rec.nbytes == 939_520
    # the burst records of the same group are unchanged beside it
    assert back.handover("allreduce", "gloo", "loopback", 4) == HANDS[1]
    with pytest.raises(ValueError, match="operation"):
        _hand("allgather_stpe", 4, [(0.0, 1 * MS)])


def test_the_step_wait_is_measured_beyond_the_all_reduce_line() -> None:
    comm = CommModel(ClusterSpec.from_preset("local-cpu"), WITH_STEP)
    line = comm.time_s("allreduce", 939_520, 4, "intra")
    assert comm.has_handover("allreduce_step", 4, "intra")
    assert not comm.has_handover("allreduce_step", 2, "intra")
    assert not CommModel(ClusterSpec.from_preset("local-cpu"), BURSTS).has_handover(
        "allreduce_step", 4, "intra")
    # one sample: the same at any step length and message size
    for step, nbytes in ((1 * MS, None), (6 * MS, 939_520), (30 * MS, MIB)):
        assert comm.wait_s("allreduce_step", 4, "intra", step, nbytes) == pytest.approx(
            12.0 * MS - line)


# -- plans ----------------------------------------------------------------------------------
def test_a_data_parallel_plan_pays_the_step_record_in_place_of_the_burst_one() -> None:
    none = _plan(NO_HANDS, **DP).predictions
    bursts = _plan(BURSTS, **DP).predictions
    step = _plan(WITH_STEP, **DP).predictions
    comm = CommModel(ClusterSpec.from_preset("local-cpu"), WITH_STEP)
    wait_ms = (12.0 * MS - comm.time_s("allreduce", 939_520, 4, "intra")) * 1e3
    # charged instead of the burst record's wait, not on top of it
    assert step.breakdown.exposed_comm_ms == pytest.approx(
        none.breakdown.exposed_comm_ms + wait_ms, abs=1e-6)
    assert step.breakdown.exposed_comm_ms > bursts.breakdown.exposed_comm_ms + 3.0
    assert step.iteration_time_ms == pytest.approx(none.iteration_time_ms + wait_ms, abs=1e-6)
    assert step.breakdown.compute_ms == pytest.approx(none.breakdown.compute_ms)


def test_the_step_record_does_not_apply_where_the_runtime_does_not_run_that_sync() -> None:
    # ZeRO-3: FSDP2's reduce-scatters inside backward, not the bucket's all-reduce after it
    z3 = dict(DP, zero_stage=3)
    assert _priced(WITH_STEP, **z3) == _priced(BURSTS, **z3)
    # another group size than the record's: the burst record, as before
    dp2 = dict(dp=2, pp=2, tp=1, zero_stage=0, schedule="1f1b")
    assert _priced(WITH_STEP, **dp2) == _priced(BURSTS, **dp2)
    # (while the record's own group does change: the comparison can fail)
    assert _priced(WITH_STEP, **DP) != _priced(BURSTS, **DP)


def _priced(db: ProfileDB, **pins: object) -> tuple[object, ...]:
    """The plan's decisions and its own prediction (the plan also names the profile's hash,
    and its DDP baseline is a data-parallel plan that does pay the step record)."""
    plan = _plan(db, **pins)
    assert plan.predictions is not None
    return (plan.layout, plan.stages, plan.gradient_sync, plan.predictions.iteration_time_ms,
            plan.predictions.breakdown)


def test_the_charge_is_deterministic() -> None:
    assert _plan(WITH_STEP, **DP).to_json() == _plan(WITH_STEP, **DP).to_json()


# -- the measurement ------------------------------------------------------------------------
@pytest.mark.dist
def test_profile_sync_steps_times_the_sync_inside_the_step() -> None:
    from hetplan.profiling.sync_step import profile_sync_steps

    recs, times = profile_sync_steps("gpt-test", 2, batch_size=2, rounds=3, warmup=1,
                                     passes=1, timeout_s=120, zero3=True)
    packed = recs[1].nbytes
    assert [r.key for r in recs] == [("allreduce_step", "gloo", "loopback", 2, 939_520),
                                     ("allgather_step", "gloo", "loopback", 2, packed),
                                     ("reduce_broadcast_step", "gloo", "loopback", 2,
                                      939_520),
                                     ("zero3_forward", "gloo", "loopback", 2, 939_520),
                                     ("zero3_backward", "gloo", "loopback", 2, 939_520),
                                     ("zero3_step", "gloo", "loopback", 2, 939_520)]
    rec, gathered, rooted = recs[0], recs[1], recs[2]
    for z in recs[3:]:  # the plain phase, and what FSDP2's gathers / reduce-scatters add
        # (the step: the plain replica's optimizer step, and FSDP2's over its shards)
        assert z.processes == 2 and len(z.samples) == 1
        assert z.samples[0].burst_s > 0.0 and z.samples[0].seconds > 0.0
    assert rec.processes == 2 and len(rec.samples) == 1
    assert rec.samples[0].burst_s > 0.0 and rec.samples[0].seconds >= 0.0
    (t,) = times
    assert t.group_size == 2 and t.nbytes == 939_520
    assert t.step_s == rec.samples[0].burst_s and t.added_s == rec.samples[0].seconds
    # the step's parts: forward and backward (no sync) inside the step, and the sync's wait
    assert 0.0 < t.compute_s < t.step_s
    assert t.compute_with_sync_s > 0.0 and t.wait_s > 0.0
    # what the sync takes inside the steps with it: the mean wait and the slowest rank's lag
    assert t.slowest_step_with_sync_s >= t.step_with_sync_s > t.compute_with_sync_s
    assert t.added_s == pytest.approx(
        t.wait_s + t.slowest_step_with_sync_s - t.step_with_sync_s)
    # the compressed bucket: DGC at 1 % of gpt-test's 234,880 gradients (k = 2,348; DGC's
    # threshold keeps k to 2k), fp32 values and int32 indices, each of the two members'
    # payload gathered, after the same step without a sync
    assert t.compressed_nbytes == packed and packed % 2 == 0
    assert 2 * 2_348 * 8 <= packed <= 2 * 2 * 2_348 * 8
    assert gathered.samples[0].burst_s == t.step_s
    assert gathered.samples[0].seconds == t.compressed_added_s
    # what that sync takes inside its steps, less the compressor's work: the same identity
    assert t.compressed_slowest_step_with_sync_s >= t.compressed_step_with_sync_s > 0.0
    assert t.compressed_wait_s > 0.0 and t.compression_s > 0.0
    assert t.compressed_added_s == pytest.approx(max(
        t.compressed_wait_s + t.compressed_slowest_step_with_sync_s
        - t.compressed_step_with_sync_s - t.compression_s, 0.0))
    # the reduce and the broadcast of the whole bucket, after the same step: the same identity
    assert rooted.samples[0].burst_s == t.step_s
    assert rooted.samples[0].seconds == t.rooted_added_s
    assert t.rooted_slowest_step_with_sync_s >= t.rooted_step_with_sync_s > 0.0
    assert t.rooted_wait_s > 0.0
    assert t.rooted_added_s == pytest.approx(max(
        t.rooted_wait_s + t.rooted_slowest_step_with_sync_s - t.rooted_step_with_sync_s, 0.0))


def test_run_profile_on_the_emulated_link_takes_the_sync_steps_there(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import hetplan.profiling as prof

    calls: list[tuple[str, str]] = []

    def fake_steps(model: str, world: int, *, link_kind: str, zero3: bool = False,
                   **_: object) -> tuple[list[HandoverRecord], list[object]]:
        assert not zero3  # FSDP2's phases run loopback collectives: not on this link
        calls.append((model, link_kind))
        return [r.model_copy(update={"link_kind": link_kind}) for r in (STEP, GATHER)], []

    def measured_elsewhere(*_: object, **__: object) -> None:
        raise AssertionError("loopback phases are not timed on the emulated link")

    monkeypatch.setenv("HETPLAN_EMULATE_BW", "1")
    monkeypatch.setattr(prof, "profile_handovers", lambda *a, **k: [])
    monkeypatch.setattr(prof, "profile_sync_steps", fake_steps)
    monkeypatch.setattr(prof, "profile_tp_steps", measured_elsewhere)
    monkeypatch.setattr(prof, "profile_traced_stages", measured_elsewhere)
    db = prof.run_profile("gpt-test", world_size=4, what=["collectives"], batch_size=2,
                          link_kind="ethernet", show_progress=False)
    assert calls == [("gpt-test", "ethernet")]
    assert sorted((r.operation, r.link_kind) for r in db.handovers) == [
        ("allgather_step", "ethernet"), ("allreduce_step", "ethernet")]


def test_profile_sync_steps_rejects_bad_input() -> None:
    from hetplan.errors import SpecError
    from hetplan.profiling.sync_step import profile_sync_steps

    with pytest.raises(ValueError, match="world_size"):
        profile_sync_steps("gpt-test", 1)
    with pytest.raises(ValueError, match="rounds and passes"):
        profile_sync_steps("gpt-test", 2, rounds=0)
    with pytest.raises(ValueError, match="optimizer"):
        profile_sync_steps("gpt-test", 2, optimizer="lion")
    with pytest.raises(SpecError, match="gpt-tset"):
        profile_sync_steps("gpt-tset", 2)
    with pytest.raises(ValueError):
        profile_sync_steps("gpt-test", 4, group_sizes=[3])


def test_run_profile_takes_the_step_records_for_a_zoo_model(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import hetplan.profiling as prof

    calls: list[tuple[str, int, int]] = []

    def fake_steps(model: str, world: int, *, batch_size: int, **_: object
                   ) -> tuple[list[HandoverRecord], list[object]]:
        calls.append((model, world, batch_size))
        return [STEP], []

    # the tensor-parallel phases and traced stages are measured by their own tests
    # (test_tp_step.py, test_stage_trace.py): here they only hand over one record each
    tp = STEP.model_copy(update={"operation": "tp_forward"})
    traced = STEP.model_copy(update={"operation": "traced_forward"})
    monkeypatch.setattr(prof, "_collectives", lambda *a, **k: [])
    monkeypatch.setattr(prof, "profile_handovers", lambda *a, **k: list(HANDS))
    monkeypatch.setattr(prof, "profile_sync_steps", fake_steps)
    monkeypatch.setattr(prof, "profile_tp_steps", lambda *a, **k: ([tp], []))
    monkeypatch.setattr(prof, "profile_traced_stages", lambda *a, **k: ([traced], None))
    db = prof.run_profile("gpt-test", world_size=4, what=["collectives"], batch_size=2,
                          show_progress=False)
    assert calls == [("gpt-test", 4, 2)]
    assert STEP in db.handovers and HANDS[0] in db.handovers
    assert tp in db.handovers and traced in db.handovers
    # without a zoo model (a module, or collectives alone): no step record
    calls.clear()
    db = prof.run_profile(None, world_size=4, what=["collectives"], show_progress=False)
    assert calls == [] and STEP not in db.handovers


# -- ZeRO-3 ---------------------------------------------------------------------------------
#: what the runtime's ZeRO-3 added to a plain 3 ms forward and 5 ms backward of gpt-test
Z3 = (_hand("zero3_forward", 4, [(3 * MS, 30.0 * MS)], nbytes=939_520),
      _hand("zero3_backward", 4, [(5 * MS, 60.0 * MS)], nbytes=939_520))
WITH_Z3 = ProfileDB(collectives=LINES, handovers=(*HANDS, STEP, *Z3))
ZERO3 = dict(DP, zero_stage=3)


def test_zero3_is_priced_from_the_measured_phases_with_its_sync_inside_backward() -> None:
    plain = _plan(WITH_Z3, **DP)  # the same stages without ZeRO: the plain compute
    z3 = _plan(WITH_Z3, **ZERO3)
    analytic = _plan(WITH_STEP, **ZERO3)  # no ZeRO-3 record: the overlapped gathers
    assert plain.predictions is not None and z3.predictions is not None
    assert analytic.predictions is not None
    # gpt-test's parameters are the records' bytes (fp32): the additions as measured
    assert z3.predictions.breakdown.compute_ms == pytest.approx(
        plain.predictions.breakdown.compute_ms + 90.0, rel=1e-3)
    # the reduce-scatters are in the measured backward: no sync after it
    assert z3.predictions.breakdown.exposed_comm_ms == 0.0
    assert analytic.predictions.breakdown.exposed_comm_ms > 0.0
    assert z3.predictions.iteration_time_ms > analytic.predictions.iteration_time_ms + 30.0


def test_zero3_records_of_another_group_or_without_the_backward_do_not_apply() -> None:
    only_fwd = ProfileDB(collectives=LINES, handovers=(*HANDS, STEP, Z3[0]))
    assert _priced(only_fwd, **ZERO3) == _priced(WITH_STEP, **ZERO3)
    pairs = ProfileDB(collectives=LINES, handovers=(*HANDS, STEP, *(
        r.model_copy(update={"group_size": 2}) for r in Z3)))
    assert _priced(pairs, **ZERO3) == _priced(WITH_STEP, **ZERO3)
    # ZeRO-0 plans do not read them
    assert _priced(WITH_Z3, **DP) == _priced(WITH_STEP, **DP)


def test_profile_sync_steps_skips_models_too_large_to_replicate_per_process() -> None:
    from hetplan.profiling.sync_step import profile_sync_steps

    # gpt-test has about 0.23 M parameters: above this limit nothing is spawned or returned
    assert profile_sync_steps("gpt-test", 2, max_params=1000) == ([], [])


#: FSDP2's optimizer step over gpt-test's shards: 6 ms (the plain replica's 1 ms)
Z3_STEP = _hand("zero3_step", 4, [(1 * MS, 6.0 * MS)], nbytes=939_520)


def _optimizer_ms(db: ProfileDB, **pins: object) -> float:
    """The plan's optimizer step (its breakdown's, which the iteration includes)."""
    p = _plan(db, **pins).predictions
    assert p is not None
    b = p.breakdown
    assert p.iteration_time_ms == pytest.approx(
        b.compute_ms + b.bubble_ms + b.exposed_comm_ms + b.compression_ms + b.optimizer_ms,
        abs=1e-3)
    return b.optimizer_ms


def test_zero3_optimizer_step_is_the_measured_fsdp2_step() -> None:
    with_step = ProfileDB(collectives=LINES, handovers=(*HANDS, STEP, *Z3, Z3_STEP))
    # gpt-test's parameters are the record's bytes: the step as measured
    assert _optimizer_ms(with_step, **ZERO3) == pytest.approx(6.0, rel=1e-3)
    assert _optimizer_ms(WITH_Z3, **ZERO3) < 3.0  # the bytes-and-kernels model
    # ZeRO-0 plans and another group size do not read it
    assert _priced(with_step, **DP) == _priced(WITH_Z3, **DP)
    pairs = ProfileDB(collectives=LINES, handovers=(*HANDS, STEP, *Z3,
                                                    Z3_STEP.model_copy(update={"group_size": 2})))
    assert _priced(pairs, **ZERO3) == _priced(WITH_Z3, **ZERO3)


def test_an_interleaved_rank_pays_the_step_record_once_for_all_its_chunks() -> None:
    # the runtime syncs a rank's chunks in one phase (one GradSync over its parameters),
    # which the record timed once: two chunks per rank, one wait
    pairs = _hand("allreduce_step", 2, [(6 * MS, 12.0 * MS)], nbytes=939_520)
    il = dict(dp=2, pp=2, tp=1, zero_stage=0, schedule="interleaved-1f1b", virtual_stages=2)
    none = _plan(NO_HANDS, **il).predictions
    step = _plan(ProfileDB(collectives=LINES, handovers=(*HANDS, pairs)), **il).predictions
    assert none is not None and step is not None
    comm = CommModel(ClusterSpec.from_preset("local-cpu"),
                     ProfileDB(collectives=LINES, handovers=(pairs,)))
    wait_ms = comm.wait_s("allreduce_step", 2, "intra", 6 * MS) * 1e3
    assert wait_ms > 5.0
    assert step.breakdown.exposed_comm_ms == pytest.approx(
        none.breakdown.exposed_comm_ms + wait_ms, abs=1e-6)


# -- a compressed bucket: the allgather_step record -------------------------------------------
def _eth(operation: str, group: int, points: list[tuple[float, float]], nbytes: int = 4096
         ) -> HandoverRecord:
    return _hand(operation, group, points, nbytes).model_copy(update={"link_kind": "ethernet"})


#: lines of loopback only: the ethernet link's are the analytic ones (the emulated link's
#: wire time), under which Espresso and Cupcake give gpt-test one DGC bucket, all-gathered
ETH_LINES = LINES
ETH_BURSTS = (*HANDS, _eth("allreduce", 4, [(0.0, 7.0 * MS), (4 * MS, 11.0 * MS)]))
#: the compressed step on the emulated link: 30 ms of waits after a 20 ms step, 4 members'
#: DGC payloads of gpt-test
GATHER = _eth("allgather_step", 4, [(20 * MS, 30.0 * MS)], nbytes=4 * 28_188)
SLOW_BURSTS = ProfileDB(collectives=ETH_LINES, handovers=ETH_BURSTS)
SLOW_STEP = ProfileDB(collectives=ETH_LINES, handovers=(*ETH_BURSTS, GATHER))
SLOW_NONE = ProfileDB(collectives=ETH_LINES)
COMPRESSED = dict(dp=4, pp=1, tp=1, zero_stage=0, compressors=("fp16", "dgc"),
                  passes="uniform-stages,espresso,cupcake-fusion")


def _slow(db: ProfileDB, **pins: object):  # type: ignore[no-untyped-def]
    import hetplan

    return hetplan.compile("gpt-test", ClusterSpec.from_preset("cpu-2x2-slow"), batch_size=8,
                           profile=db, micro_batch_size=2, dtype="fp32", **pins)


def test_the_allgather_step_wait_is_measured_beyond_the_all_gather_line() -> None:
    comm = CommModel(ClusterSpec.from_preset("cpu-2x2-slow"), SLOW_STEP)
    assert comm.has_handover("allgather_step", 4, "inter")
    assert not comm.has_handover("allgather_step", 4, "intra")  # loopback: none
    line = comm.time_s("allgather", 4 * 28_188, 4, "inter")
    assert line > comm.time_s("allgather", 4096, 4, "inter")  # the record's bytes count
    for step in (1 * MS, 20 * MS, 60 * MS):
        assert comm.wait_s("allgather_step", 4, "inter", step) == pytest.approx(
            30.0 * MS - line)


def test_a_compressed_plan_pays_the_allgather_step_record_in_place_of_the_burst_one() -> None:
    none, bursts, step = (_slow(db, **COMPRESSED)
                          for db in (SLOW_NONE, SLOW_BURSTS, SLOW_STEP))
    # the same plan, priced three ways; its first bucket (the one the wait is charged at)
    # DGC, all-gathered
    assert step.gradient_sync == none.gradient_sync == bursts.gradient_sync
    sync = step.gradient_sync
    assert sync is not None
    strategy = sync.strategies[sync.buckets[0].strategy]
    assert strategy.kind == "compressed" and strategy.compressor == "dgc"
    comm = CommModel(ClusterSpec.from_preset("cpu-2x2-slow"), SLOW_STEP)
    wait_ms = (30.0 * MS - comm.time_s("allgather", 4 * 28_188, 4, "inter")) * 1e3
    p_none, p_bursts, p_step = (p.predictions for p in (none, bursts, step))
    # the burst record's wait (7-11 ms after the burst, less the line) is replaced by the
    # step record's, not added to
    assert p_bursts.breakdown.exposed_comm_ms > p_none.breakdown.exposed_comm_ms + 1.0
    assert p_step.breakdown.exposed_comm_ms == pytest.approx(
        p_none.breakdown.exposed_comm_ms + wait_ms, abs=1e-6)
    assert p_step.iteration_time_ms == pytest.approx(p_none.iteration_time_ms + wait_ms,
                                                     abs=1e-6)
    assert p_step.breakdown.compression_ms == p_none.breakdown.compression_ms > 0.0


def test_the_allgather_step_record_does_not_apply_to_other_syncs() -> None:
    # an uncompressed bucket: its all-reduce after the step, priced as before
    dp = dict(dp=4, pp=1, tp=1, zero_stage=0, passes="uniform-stages,ddp-buckets")
    assert _slow(SLOW_STEP, **dp).predictions == _slow(SLOW_BURSTS, **dp).predictions
    # a record of another group size than the plan's
    two = ProfileDB(collectives=ETH_LINES, handovers=(
        *ETH_BURSTS, GATHER.model_copy(update={"group_size": 2})))
    assert _slow(two, **COMPRESSED).predictions == _slow(SLOW_BURSTS, **COMPRESSED).predictions
    # (while the record's own group does change: the comparison can fail)
    assert (_slow(SLOW_STEP, **COMPRESSED).predictions
            != _slow(SLOW_BURSTS, **COMPRESSED).predictions)


def test_only_one_flat_compressed_all_gather_is_the_path_the_record_timed() -> None:
    from hetplan.cost_models.evaluate import _allgathered
    from hetplan.ir.plan_sections import CastSync, CommStep, CompressedSync, NoSync

    assert _allgathered(CompressedSync(compressor="dgc", params={"ratio": 0.01}))
    assert _allgathered(CompressedSync(compressor="randomk", params={"ratio": 0.05}))
    assert not _allgathered(NoSync()) and not _allgathered(CastSync())
    # not a sparsifier: its payload is not a small fraction like the record's
    for other in ("efsignsgd", "qsgd", "fp16"):
        assert not _allgathered(CompressedSync(compressor=other))
    two = (CommStep(routine="reduce_scatter"), CommStep(routine="allgather", compressed=True))
    assert not _allgathered(CompressedSync(compressor="dgc", params={"ratio": 0.01},
                                           steps=two))
    hier = (CommStep(level="intra", routine="allgather", compressed=True),)
    assert not _allgathered(CompressedSync(compressor="dgc", params={"ratio": 0.01},
                                           hierarchy="hierarchical", steps=hier))


def test_the_allgather_step_wait_is_taken_at_the_bytes_the_plan_gathers() -> None:
    # records at two sizes around the plan's first unit's payloads: the charge lies between
    # their two waits, so it is read at the plan's bytes
    small = _eth("allgather_step", 4, [(20 * MS, 10.0 * MS)], nbytes=64)
    large = _eth("allgather_step", 4, [(20 * MS, 100.0 * MS)], nbytes=MIB)
    both = ProfileDB(collectives=ETH_LINES, handovers=(*ETH_BURSTS, small, large))
    comm = CommModel(ClusterSpec.from_preset("cpu-2x2-slow"), both)
    lo = 10.0 * MS - comm.time_s("allgather", 64, 4, "inter")
    hi = 100.0 * MS - comm.time_s("allgather", MIB, 4, "inter")
    assert hi > lo + 50 * MS
    none = _slow(SLOW_NONE, **COMPRESSED).predictions
    got = _slow(both, **COMPRESSED).predictions
    extra_s = (got.breakdown.exposed_comm_ms - none.breakdown.exposed_comm_ms) / 1e3
    assert lo + 1e-6 < extra_s < hi - 1e-6


def test_a_hierarchical_path_is_not_the_sync_the_allreduce_step_record_timed() -> None:
    from hetplan.cost_models.evaluate import _allreduced
    from hetplan.ir.plan_sections import CastSync, CommStep, CompressedSync, NoSync

    assert _allreduced(NoSync()) and _allreduced(CastSync(dtype="bf16"))
    # the same group's reduce-scatter and all-gather: its hand-overs after the same step
    two = (CommStep(routine="reduce_scatter"), CommStep(routine="allgather"))
    assert _allreduced(NoSync(steps=two))
    # a hierarchical path runs on other groups and links: not the record's sync (its wait
    # stays the burst record's)
    hier = (CommStep(level="intra", routine="reduce_scatter"),
            CommStep(level="inter", routine="allreduce"),
            CommStep(level="intra", routine="allgather"))
    assert not _allreduced(NoSync(hierarchy="hierarchical", steps=hier))
    assert not _allreduced(CompressedSync(compressor="dgc", params={"ratio": 0.01}))


# -- a reduce and a broadcast: the reduce_broadcast_step record -------------------------------
#: the step with the bucket reduced and broadcast: 18 ms added to a 6 ms step
ROOTED_STEP = _hand("reduce_broadcast_step", 4, [(6 * MS, 18.0 * MS)], nbytes=939_520)
#: the rooted routines measured beside the all-reduce (cheaper than it: the search takes them)
ROOT_LINES = (_line("reduce", 4, 1.0 * MS), _line("broadcast", 4, 0.5 * MS))
ROOTED_DB = ProfileDB(collectives=LINES + ROOT_LINES, handovers=(*HANDS, STEP, ROOTED_STEP))
ROOTED_NO_RECORD = ProfileDB(collectives=LINES + ROOT_LINES, handovers=(*HANDS, STEP))


def test_the_reduce_broadcast_step_wait_is_measured_beyond_both_lines() -> None:
    comm = CommModel(ClusterSpec.from_preset("local-cpu"), ROOTED_DB)
    lines = (comm.time_s("reduce", 939_520, 4, "intra")
             + comm.time_s("broadcast", 939_520, 4, "intra"))
    # by hand: 1.0 + 0.5 ms and 1 ns/B twice
    assert lines == pytest.approx(1.5 * MS + 2 * 939_520e-9)
    assert comm.wait_s("reduce_broadcast_step", 4, "intra", 6 * MS, 939_520) == pytest.approx(
        18.0 * MS - lines)


def _routines(plan) -> set[tuple[str, ...]]:  # type: ignore[no-untyped-def]
    return {tuple(st.routine for st in s.steps)
            for s in plan.gradient_sync.strategies.values()}


def test_a_reduce_broadcast_plan_pays_its_own_step_record() -> None:
    from hetplan.cost_models.predict import simulate

    # gpt-test's one bucket, its routing chosen by Espresso: without the record the reduce
    # and broadcast win (their lines 1.5 ms + 2 x 0.94 ms against the all-reduce's 4 ms +
    # 0.94 ms: about 1.6 ms less) and keep the all-reduce step's charge
    pins = dict(DP, passes="uniform-stages,ddp-buckets,espresso")
    without = _plan(ROOTED_NO_RECORD, **pins)
    assert _routines(without) == {("reduce", "broadcast")}
    comm = CommModel(ClusterSpec.from_preset("local-cpu"), ROOTED_DB)
    rooted_ms = comm.wait_s("reduce_broadcast_step", 4, "intra", 6 * MS, 939_520) * 1e3
    allreduce_ms = comm.wait_s("allreduce_step", 4, "intra", 6 * MS, 939_520) * 1e3
    assert rooted_ms > allreduce_ms + 5.0  # the records differ: the test can fail
    # the same plan re-priced with the record of its path: that record's charge instead
    assert without.predictions is not None
    again = simulate(without, profile=ROOTED_DB)
    assert again.iteration_time_ms == pytest.approx(
        without.predictions.iteration_time_ms + rooted_ms - allreduce_ms, abs=1e-6)
    # and with the record, the search takes the all-reduce, predicted faster than that
    with_ = _plan(ROOTED_DB, **pins)
    assert _routines(with_) == {("allreduce",)}
    assert with_.predictions is not None
    assert with_.predictions.iteration_time_ms < again.iteration_time_ms


def test_the_reduce_broadcast_record_does_not_apply_to_an_all_reduce() -> None:
    assert _priced(ROOTED_DB, **DP) == _priced(ROOTED_NO_RECORD, **DP)  # ddp-buckets: one
    # flat all-reduce
    from hetplan.cost_models.evaluate import _reduce_broadcast
    from hetplan.ir.plan_sections import CastSync, CommStep, NoSync

    pair = (CommStep(routine="reduce"), CommStep(routine="broadcast"))
    assert _reduce_broadcast(NoSync(steps=pair)) and _reduce_broadcast(CastSync(steps=pair))
    assert not _reduce_broadcast(NoSync())
    assert not _reduce_broadcast(NoSync(steps=(CommStep(routine="reduce_scatter"),
                                               CommStep(routine="allgather"))))
