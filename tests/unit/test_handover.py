"""Hand-overs under the run's own contention (``docs/decisions/cpu-fidelity.md`` section 10):
the profile record, the wait the cost model charges from it, and that plans without such a
record (GPU plans, analytic or older profiles) are priced exactly as before."""

from __future__ import annotations

import functools

import pytest

from hetplan.cost_models.comm import CommModel
from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.evaluate import evaluate
from hetplan.cost_models.profile_db import (
    CollectiveRecord,
    CollectiveSample,
    HandoverRecord,
    HandoverSample,
    ProfileDB,
    merge,
)
from hetplan.errors import SpecError
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.model import ModelIR
from hetplan.ir.plan_sections import Layout, WorkloadSummary

MS = 1e-3


def _line(collective: str, group: int, alpha_s: float, backend: str = "gloo",
          link: str = "loopback", beta: float = 1e-9) -> CollectiveRecord:
    return CollectiveRecord(collective=collective,  # type: ignore[arg-type]
                            backend=backend, link_kind=link, group_size=group,
                            alpha_s=alpha_s, beta_s_per_byte=beta,
                            samples=(CollectiveSample(nbytes=4096, seconds=alpha_s),))


def _hand(operation: str, group: int, points: list[tuple[float, float]],
          backend: str = "gloo", link: str = "loopback", nbytes: int = 4096) -> HandoverRecord:
    return HandoverRecord(operation=operation,  # type: ignore[arg-type]
                          backend=backend, link_kind=link, group_size=group,
                          processes=4, nbytes=nbytes,
                          samples=tuple(HandoverSample(burst_s=b, seconds=s) for b, s in points))


def _lines() -> tuple[CollectiveRecord, ...]:
    return (_line("p2p", 2, 0.3 * MS), _line("allreduce", 4, 4.0 * MS),
            _line("allreduce", 2, 0.3 * MS))


def _hands(link: str = "loopback") -> tuple[HandoverRecord, ...]:
    return (_hand("p2p", 2, [(0.0, 1.0 * MS), (2 * MS, 3.0 * MS)], link=link),
            _hand("allreduce", 4, [(0.0, 5.0 * MS), (4 * MS, 9.0 * MS)], link=link),
            _hand("allreduce", 2, [(0.0, 0.5 * MS), (4 * MS, 2.0 * MS)], link=link),
            _hand("allreduce", 32, [(0.0, 5.0 * MS)], link=link))


BASE = ProfileDB(collectives=_lines())
WITH = ProfileDB(collectives=_lines(), handovers=_hands())


# -- the record -----------------------------------------------------------------------------
def test_record_interpolates_between_measured_bursts_and_clamps_outside() -> None:
    rec = _hand("p2p", 2, [(2 * MS, 3.0 * MS), (0.0, 1.0 * MS)])
    assert [s.burst_s for s in rec.samples] == [0.0, 2 * MS]  # kept sorted
    assert rec.seconds_at(1 * MS) == pytest.approx(2.0 * MS)
    assert rec.seconds_at(-1.0) == pytest.approx(1.0 * MS)
    assert rec.seconds_at(50 * MS) == pytest.approx(3.0 * MS)  # never extrapolated
    with pytest.raises(ValueError, match="more than one sample for burst_s"):
        _hand("p2p", 2, [(0.0, 1.0), (0.0, 2.0)])


def test_record_survives_a_round_trip_and_is_read_back() -> None:
    text = WITH.to_json()
    back = ProfileDB.from_json(text)
    assert back == WITH
    assert back.handover("p2p", "gloo", "loopback", 2) == _hands()[0]
    assert back.handover("p2p", "nccl", "loopback", 2) is None
    assert back.to_json() == text  # byte-identical
    # a DB without hand-overs is written as before they existed, and reads them as empty
    assert '"handovers"' not in BASE.to_json()
    assert ProfileDB.from_json(BASE.to_json()).handovers == ()
    # merge keeps the record with more samples
    more = _hand("p2p", 2, [(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)])
    merged = merge(WITH, ProfileDB(handovers=(more,)))
    assert merged.handover("p2p", "gloo", "loopback", 2) == more


def test_bad_record_names_the_field() -> None:
    bad = WITH.model_dump(mode="json")
    bad["handovers"][0]["processes"] = 1
    with pytest.raises(SpecError, match="processes"):
        ProfileDB.from_dict(bad)


# -- the wait the cost model charges --------------------------------------------------------
def test_wait_is_the_measured_time_beyond_the_line() -> None:
    cluster = ClusterSpec.from_preset("local-cpu")
    comm = CommModel(cluster, WITH)
    line = comm.time_s("p2p", 4096, 2, "intra")
    assert comm.wait_s("p2p", 2, "intra", 1 * MS) == pytest.approx(2.0 * MS - line)
    assert comm.wait_s("allreduce", 4, "intra", 0.0) == pytest.approx(
        5.0 * MS - comm.time_s("allreduce", 4096, 4, "intra"))
    assert comm.wait_s("allreduce", 1, "intra", 1 * MS) == 0.0
    # no record, or records of another backend: no wait
    assert CommModel(cluster, BASE).wait_s("p2p", 2, "intra", 1 * MS) == 0.0
    assert CommModel(cluster, WITH, backend="nccl").wait_s("p2p", 2, "intra", 1 * MS) == 0.0
    # a measurement faster than the line is not a negative wait
    fast = ProfileDB(collectives=_lines(), handovers=(_hand("p2p", 2, [(0.0, 1e-6)]),))
    assert CommModel(cluster, fast).wait_s("p2p", 2, "intra", 0.0) == 0.0


MIB = 1 << 20
#: the 4-rank all-reduce at 4 KiB (as in WITH) and at 1 MiB, where the wait is larger
SIZED = ProfileDB(collectives=_lines(), handovers=_hands() + (
    _hand("allreduce", 4, [(0.0, 7.0 * MS), (4 * MS, 17.0 * MS)], nbytes=MIB),))


def test_records_at_two_sizes_are_kept_apart_and_read_back() -> None:
    back = ProfileDB.from_json(SIZED.to_json())
    assert back == SIZED
    assert back.handover("allreduce", "gloo", "loopback", 4, MIB).nbytes == MIB  # type: ignore[union-attr]
    # no size asked: the smallest (what a profile of one size gave)
    assert back.handover("allreduce", "gloo", "loopback", 4).nbytes == 4096  # type: ignore[union-attr]
    assert back.handover("allreduce", "gloo", "loopback", 4, 12345) is None
    # merging with an older profile of one size keeps both sizes
    merged = merge(WITH, SIZED)
    assert len([r for r in merged.handovers if r.key[:4] == ("allreduce", "gloo", "loopback",
                                                             4)]) == 2


def test_wait_is_interpolated_in_bytes_between_the_measured_sizes() -> None:
    comm = CommModel(ClusterSpec.from_preset("local-cpu"), SIZED)
    line = lambda n: comm.time_s("allreduce", n, 4, "intra")  # noqa: E731
    small = 9.0 * MS - line(4096)  # after a 4 ms burst
    big = 17.0 * MS - line(MIB)
    assert big > small  # the measured wait grows with the message
    assert comm.wait_s("allreduce", 4, "intra", 4 * MS, 4096) == pytest.approx(small)
    assert comm.wait_s("allreduce", 4, "intra", 4 * MS, MIB) == pytest.approx(big)
    mid = (4096 + MIB) / 2
    assert comm.wait_s("allreduce", 4, "intra", 4 * MS, mid) == pytest.approx((small + big) / 2)
    # outside the measured sizes: the nearest one's wait, never extrapolated
    assert comm.wait_s("allreduce", 4, "intra", 4 * MS, 100) == pytest.approx(small)
    assert comm.wait_s("allreduce", 4, "intra", 4 * MS, 64 * MIB) == pytest.approx(big)
    # no size asked, or a profile with one size: the smallest size's wait, as before
    assert comm.wait_s("allreduce", 4, "intra", 4 * MS) == pytest.approx(small)
    one = CommModel(ClusterSpec.from_preset("local-cpu"), WITH)
    assert one.wait_s("allreduce", 4, "intra", 4 * MS, MIB) == pytest.approx(small)


# -- plans ----------------------------------------------------------------------------------
@functools.cache
def _ir(name: str) -> ModelIR:
    """The zoo model's IR, captured once for the plans of this module (a frozen IR)."""
    from hetplan.optimizer.compile import model_ir

    return model_ir(name)


def _plan(preset: str, db: ProfileDB | None, **pins: object):  # type: ignore[no-untyped-def]
    import hetplan

    return hetplan.compile(_ir("gpt-test"), ClusterSpec.from_preset(preset), batch_size=8,
                           profile=db, micro_batch_size=2, dtype="fp32", **pins)


PP = dict(dp=1, pp=4, tp=1, zero_stage=0, schedule="1f1b")
DP = dict(dp=4, pp=1, tp=1, zero_stage=0)


def test_a_pipeline_with_the_record_predicts_a_larger_bubble() -> None:
    base = _plan("local-cpu", BASE, **PP).predictions
    with_ = _plan("local-cpu", WITH, **PP).predictions
    assert base.breakdown.bubble_ms > 0
    # every hop on the critical path pays the measured wait (here 2-3 ms less a 0.3 ms line)
    assert with_.breakdown.bubble_ms > base.breakdown.bubble_ms + 5.0
    assert with_.iteration_time_ms > base.iteration_time_ms + 5.0
    assert with_.breakdown.compute_ms == pytest.approx(base.breakdown.compute_ms)


def test_data_parallel_sync_pays_the_wait_once() -> None:
    base = _plan("local-cpu", BASE, **DP).predictions
    with_ = _plan("local-cpu", WITH, **DP).predictions
    comm = CommModel(ClusterSpec.from_preset("local-cpu"), WITH)
    extra = with_.breakdown.exposed_comm_ms - base.breakdown.exposed_comm_ms
    # the all-reduce record after a burst between 0 and 4 ms: 5-9 ms, less the 4 KiB line
    low = (5.0 * MS - comm.time_s("allreduce", 4096, 4, "intra")) * 1e3
    high = (9.0 * MS - comm.time_s("allreduce", 4096, 4, "intra")) * 1e3
    assert low - 1e-6 <= extra <= high + 1e-6
    assert with_.iteration_time_ms == pytest.approx(base.iteration_time_ms + extra, abs=1e-6)


def test_data_parallel_sync_pays_the_wait_at_its_bucket_bytes() -> None:
    plan = _plan("local-cpu", WITH, **DP)
    sized = _plan("local-cpu", SIZED, **DP)
    buckets = sized.gradient_sync.buckets  # type: ignore[union-attr]
    assert len(buckets) == 1  # gpt-test's gradients in one bucket, about 1 MB of fp32
    nbytes = buckets[0].size_bytes
    assert 0.5 * MIB < nbytes < 2 * MIB
    comm = CommModel(ClusterSpec.from_preset("local-cpu"), SIZED)
    extra = (sized.predictions.breakdown.exposed_comm_ms
             - plan.predictions.breakdown.exposed_comm_ms) * 1e-3
    # the bucket's wait less the 4 KiB one, at the same burst (the stage's backward, 0-4 ms)
    lo = min(comm.wait_s("allreduce", 4, "intra", b, nbytes)
             - comm.wait_s("allreduce", 4, "intra", b) for b in (0.0, 4 * MS))
    assert extra > 0.5 * MS and extra >= lo - 1e-9
    assert sized.predictions.iteration_time_ms == pytest.approx(
        plan.predictions.iteration_time_ms + extra * 1e3, abs=1e-6)


def test_plans_without_the_record_and_gpu_plans_are_unchanged(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import hetplan

    gpu = dict(dp=32, pp=2, tp=1, zero_stage=0, micro_batch_size=2)
    spec = ClusterSpec.from_preset("a100-nvlink-8x8")
    every_link = tuple(r for k in ("nvlink", "pcie", "ethernet", "infiniband", "loopback")
                       for r in _hands(k) + tuple(
                           _hand(op, 32, [(0.0, 9.0 * MS)], link=k, nbytes=1 << 20)
                           for op in ("allreduce_step", "allgather_step",
                                      "reduce_broadcast_step", "zero3_forward",
                                      "zero3_backward", "zero3_step"))
                       + tuple(_hand(op, g, [(1 * MS, 30.0 * MS)], link=k, nbytes=939_520
                                     ).model_copy(update={"micro_batch": 2})
                               for g in (2, 4, 32)
                               for op in ("tp_forward", "tp_backward", "tp_sp_forward",
                                          "tp_sp_backward", "traced_forward",
                                          "traced_backward"))
                       + tuple(_hand(op, g, [(1 * MS, 10.0 * MS)], link=k, nbytes=939_520
                                     ).model_copy(update={"micro_batch": 2})
                               for g in (2, 4, 32) for op in ("tp_loss", "tp_sp_loss")))
    nccl = (_line("p2p", 2, 5e-6, backend="nccl", link="nvlink"),
            _line("allreduce", 32, 5e-5, backend="nccl", link="nvlink"))

    def plans() -> list[str]:
        return [
            # CPU plans whose profile has no hand-over record
            _plan("local-cpu", BASE, **PP).to_json(),
            _plan("local-cpu", BASE, **DP).to_json(),
            _plan("local-cpu", None, **PP).to_json(),
            # GPU plans: gloo hand-over records never apply to nccl, even on the GPUs' link
            hetplan.compile(_ir("gpt-test"), spec, batch_size=256, **gpu,  # type: ignore[arg-type]
                            profile=ProfileDB(collectives=nccl,
                                              handovers=every_link)).to_json(),
            hetplan.compile(_ir("gpt-test"), spec, batch_size=256, **gpu,  # type: ignore[arg-type]
                            profile=ProfileDB(handovers=every_link)).to_json(),
            # ZeRO-3: a GPU plan with gloo's ZeRO-3 records, a CPU one without records
            hetplan.compile(_ir("gpt-test"), spec, batch_size=256,  # type: ignore[arg-type]
                            **dict(gpu, pp=1, dp=64, zero_stage=3),
                            profile=ProfileDB(collectives=nccl,
                                              handovers=every_link)).to_json(),
            _plan("local-cpu", BASE, **dict(DP, zero_stage=3)).to_json(),
            # tensor parallelism: a GPU plan with gloo's TP phase records, a CPU one without
            hetplan.compile(_ir("megatron-gpt-test"), spec,  # type: ignore[arg-type]
                            batch_size=256, **dict(gpu, pp=1, dp=32, tp=2),
                            profile=ProfileDB(collectives=nccl,
                                              handovers=every_link)).to_json(),
            hetplan.compile(_ir("megatron-gpt-test"), spec,  # type: ignore[arg-type]
                            batch_size=256, **dict(gpu, pp=2, dp=16, tp=2),
                            profile=ProfileDB(collectives=nccl,
                                              handovers=every_link)).to_json(),
            hetplan.compile(_ir("megatron-gpt-test"), ClusterSpec.from_preset("local-cpu"),
                            batch_size=4, dp=2, pp=1, tp=2, zero_stage=0, micro_batch_size=2,
                            dtype="fp32", profile=BASE).to_json(),
        ]

    charged = plans()
    with_record = _plan("local-cpu", WITH, **PP).predictions
    # the same plans with the wait switched off everywhere: byte-identical
    monkeypatch.setattr(CommModel, "wait_s", lambda *a, **k: 0.0)
    monkeypatch.setattr(CommModel, "measured_s", lambda *a, **k: None)
    monkeypatch.setattr(CommModel, "phase_record", lambda *a, **k: None)
    assert plans() == charged
    # (while a CPU plan with the record does change: the switch is real)
    assert _plan("local-cpu", WITH, **PP).predictions != with_record


def test_the_charge_is_deterministic() -> None:
    assert _plan("local-cpu", WITH, **PP).to_json() == _plan("local-cpu", WITH, **PP).to_json()


# -- the measurement ------------------------------------------------------------------------
@pytest.mark.dist
def test_profile_handovers_measures_every_operation_after_each_burst() -> None:
    from hetplan.profiling.handover import profile_handovers

    recs = profile_handovers(2, bursts_s=(0.0, 0.5e-3), rounds=4, warmup=1, passes=2,
                             timeout_s=120)
    assert [r.key for r in recs] == [("allreduce", "gloo", "loopback", 2, 4096),
                                     ("allreduce", "gloo", "loopback", 2, 1 << 20),
                                     ("p2p", "gloo", "loopback", 2, 4096)]
    for r in recs:
        assert r.processes == 2
        assert r.samples[0].burst_s == 0.0  # back to back under the same pattern
        assert len(r.samples) == 2 and r.samples[-1].burst_s > 0.0
        assert all(s.seconds >= 0.0 for s in r.samples)
        assert any(s.seconds > 0.0 for s in r.samples)


def test_profile_handovers_rejects_bad_input() -> None:
    from hetplan.profiling.handover import profile_handovers

    with pytest.raises(ValueError, match="world_size"):
        profile_handovers(1)
    with pytest.raises(ValueError, match="bursts_s"):
        profile_handovers(4, bursts_s=(-1.0,))
    with pytest.raises(ValueError, match="group size"):
        profile_handovers(4, group_sizes=(3,))
    with pytest.raises(ValueError, match="passes"):
        profile_handovers(4, passes=0)
    with pytest.raises(ValueError, match="sizes"):
        profile_handovers(4, sizes=())


# -- the emulated inter-node link (cpu-2x2-slow) --------------------------------------------
#: 1 Gbit/s: 8 ns per byte on the wire, times the bus factor (allgather 3/4, allreduce 3/2)
ETH = ProfileDB(collectives=_lines() + (
    _line("allgather", 4, 5.0 * MS, link="ethernet", beta=6e-9),
    _line("allreduce", 4, 5.0 * MS, link="ethernet", beta=12e-9),
    # the rooted routines measured too (a gloo profile without them prices them as the
    # lines above: test_comm_model.py), cheap enough that the per-tensor compressed paths
    # this test is about (DGC gather + broadcast, 16-bit reduce + broadcast) are chosen
    _line("gather", 4, 0.1 * MS, link="ethernet", beta=6e-9),
    _line("broadcast", 4, 0.1 * MS, link="ethernet", beta=8e-9),
    _line("reduce", 4, 0.1 * MS, link="ethernet", beta=8e-9)),
                handovers=_hands() + (_hand("allreduce", 4, [(0.0, 7.0 * MS), (4 * MS, 11 * MS)],
                                            link="ethernet"),))
SLOW = dict(dp=4, pp=1, tp=1, zero_stage=0, compressors=("fp16", "dgc"))


def test_the_wait_on_the_emulated_link_is_its_own_record() -> None:
    slow = ClusterSpec.from_preset("cpu-2x2-slow")
    # loopback records say nothing about the inter-node link
    assert CommModel(slow, WITH).wait_s("allreduce", 4, "inter", 1 * MS) == 0.0
    comm = CommModel(slow, ETH)
    assert comm.wait_s("allreduce", 4, "inter", 2 * MS) == pytest.approx(
        9.0 * MS - comm.time_s("allreduce", 4096, 4, "inter"))


def test_a_compressed_plan_across_the_emulated_link_pays_its_wait() -> None:
    without = ProfileDB(collectives=ETH.collectives, handovers=_hands())
    base = _plan("cpu-2x2-slow", without, **SLOW)
    with_ = _plan("cpu-2x2-slow", ETH, **SLOW)
    assert with_.gradient_sync == base.gradient_sync  # the same plan, priced with the wait
    assert any(s.kind == "compressed"
               for s in with_.gradient_sync.strategies.values())  # type: ignore[union-attr]
    comm = CommModel(ClusterSpec.from_preset("cpu-2x2-slow"), ETH)
    extra = with_.predictions.iteration_time_ms - base.predictions.iteration_time_ms
    # the ethernet record after a burst between 0 and 4 ms: 7-11 ms, less the line at 4 KiB
    line = comm.time_s("allreduce", 4096, 4, "inter")
    assert (7.0 * MS - line) * 1e3 - 1e-6 <= extra <= (11.0 * MS - line) * 1e3 + 1e-6


def test_emulated_profiles_need_the_link_and_its_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    from hetplan.profiling import run_profile
    from hetplan.profiling.handover import profile_handovers

    monkeypatch.delenv("HETPLAN_EMULATE_BW", raising=False)
    with pytest.raises(ValueError, match="HETPLAN_EMULATE_BW"):
        profile_handovers(2, emulate=True)
    monkeypatch.setenv("HETPLAN_EMULATE_BW", "1")
    with pytest.raises(SpecError, match="--link-kind ethernet"):
        run_profile(None, world_size=2, what=("collectives",), output=None,
                    show_progress=False)


def test_profile_command_names_the_link_kind_option(monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: object) -> None:
    from pathlib import Path

    from typer.testing import CliRunner

    from hetplan.cli import app

    assert isinstance(tmp_path, Path)
    out = str(tmp_path / "p.json")
    bad = CliRunner().invoke(app, ["profile", "-o", out, "--what", "collectives",
                                   "--link-kind", "ethernt"])
    assert bad.exit_code != 0 and "--link-kind 'ethernt'" in bad.output
    assert "ethernet" in bad.output
    monkeypatch.setenv("HETPLAN_EMULATE_BW", "1")
    unfiled = CliRunner().invoke(app, ["profile", "-o", out, "--what", "collectives"])
    assert unfiled.exit_code != 0 and "--link-kind ethernet" in unfiled.output


def test_only_collectives_are_put_on_the_emulated_link() -> None:
    from hetplan.profiling.handover import throttle

    calls: list[str] = []
    op = lambda: calls.append("op")  # noqa: E731
    assert throttle(op, "p2p", 65536, 2, (0.01, 0.0)) is op  # the runtime never throttles p2p
    assert throttle(op, "allreduce", 65536, 2, None) is op  # no emulated link
    wrapped = throttle(op, "allreduce", 1, 2, (1e6, 0.0))  # 1 byte on 1 Pbit/s
    assert wrapped is not op
    wrapped()
    assert calls == ["op"]


@pytest.mark.dist
def test_hand_overs_on_the_emulated_link_take_its_wire_time(
        monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    from pathlib import Path

    from hetplan.algorithms.collectives import analytic_time_s
    from hetplan.profiling import run_profile
    from hetplan.profiling.handover import profile_handovers

    monkeypatch.setenv("HETPLAN_EMULATE_BW", "0.01")  # 10 Mbit/s: 64 KiB take ~10 ms
    wire = analytic_time_s("allreduce", 65536, 2, 0.01e9 / 8, 0.0)
    hands = profile_handovers(2, bursts_s=(0.0,), sizes=(65536,), rounds=2, warmup=1,
                              passes=1, link_kind="ethernet", emulate=True, timeout_s=120)
    got = {r.operation: r for r in hands}
    assert got["allreduce"].link_kind == "ethernet"
    assert got["allreduce"].samples[0].seconds >= wire * 0.99
    # `hetplan profile` with the variable set and no zoo model takes only the hand-overs,
    # filed under the link
    assert isinstance(tmp_path, Path)
    monkeypatch.setattr("hetplan.profiling.profile_handovers",
                        lambda *a, **k: hands if k.get("emulate") else [])
    db = run_profile(None, world_size=2, what=("collectives",), output=tmp_path / "p.json",
                     link_kind="ethernet", show_progress=False)
    assert db.collectives == () and db.handovers == tuple(sorted(hands, key=lambda r: r.key))
