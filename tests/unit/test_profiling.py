"""Unit tests of the measurement side of ``hetplan profile`` (``hetplan.profiling``).

Multi-process tests (marker ``dist``) spawn gloo processes on CPU with a FileStore
rendezvous; each keeps its sizes tiny so the file runs in well under a minute.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import hetplan
from hetplan import zoo
from hetplan.cost_models.comm import CommModel
from hetplan.cost_models.compression import COMPRESSORS
from hetplan.cost_models.profile_db import ProfileDB
from hetplan.ir.cluster import ClusterSpec
from hetplan.models import TinyGPT
from hetplan.profiling import (
    profile_collectives,
    profile_compressors,
    profile_layers,
    profile_layers_concurrent,
    run_local_ranks,
    run_profile,
)
from hetplan.profiling.collectives import sample_seconds, size_order, subgroups
from hetplan.profiling.compressors import codec
from hetplan.profiling.layers import _hooked_units, time_layers


def _gpt() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return TinyGPT(vocab_size=64, block_size=16, dim=32, n_layers=3, n_heads=2), torch.randint(
        0, 64, (4, 16))


class _Twice(nn.Module):
    """Calls ``shared`` twice: the IR has layers ``shared`` and ``shared@1``."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.shared = nn.Linear(32, 32)
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.shared(torch.relu(self.inp(x)))
        return self.out(self.shared(torch.relu(x)))


# -- layers ---------------------------------------------------------------------------------
def test_profile_layers_one_record_per_signature() -> None:
    model, ids = _gpt()
    ir = hetplan.capture(model, ids)
    recs = profile_layers(model, ids, device_type="cpu", warmup=1, iters=3)
    sigs = {lay.signature(ir.batch_size) for lay in ir.layers}
    assert {r.signature for r in recs} == sigs
    assert len(recs) < len(ir.layers)  # the three identical blocks share one record
    assert all(r.device_type == "cpu" and r.fwd_ms >= 0 and r.bwd_ms >= 0 for r in recs)
    block = next(r for r in recs if r.label.startswith("GPTBlock"))
    assert block.fwd_ms > 0 and block.bwd_ms > 0
    assert block.samples == 3 * 3  # iterations x equal blocks
    assert "+2 equal" in block.label
    assert all(p.grad is None for p in model.parameters())  # gradients cleared


def test_layer_times_add_up_to_the_step() -> None:
    """Gap attribution leaves nothing out: per step, layers sum to forward + backward."""
    model, ids = _gpt()
    ir = hetplan.capture(model, ids)
    timing = time_layers(model, (ids,), {}, _hooked_units(ir), last_layer=ir.layers[-1].name,
                         warmup=1, iters=2)
    for step, total in enumerate(timing.step_ms):
        parts = sum(v[step] for v in timing.fwd_ms.values())
        parts += sum(v[step] for v in timing.bwd_ms.values())
        assert parts == pytest.approx(total, rel=1e-6)
    # pos_emb is used through its weight, never called: its work sits in neighbouring gaps
    assert timing.fwd_ms.get("pos_emb", [0.0])[0] == 0.0


def test_profile_layers_second_invocation_is_covered() -> None:
    model = _Twice()
    x = torch.randn(8, 16)
    ir = hetplan.capture(model, x)
    assert "shared@1" in [lay.name for lay in ir.layers]
    recs = profile_layers(model, x, device_type="cpu", warmup=1, iters=2, ir=ir)
    by_sig = {r.signature: r for r in recs}
    second = by_sig[ir.layer("shared@1").signature(ir.batch_size)]
    assert second.fwd_ms > 0 and second.bwd_ms > 0


def test_profile_layers_rejects_bad_counts() -> None:
    model, ids = _gpt()
    with pytest.raises(ValueError, match="iters"):
        profile_layers(model, ids, device_type="cpu", iters=0)


# -- compressors ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", COMPRESSORS)
def test_codec_round_trip_shape(name: str) -> None:
    x = torch.randn(4096)
    encode, decode = codec(name, x.numel())
    y = decode(encode(x))
    assert y.shape == x.shape and y.dtype == torch.float32
    if name in ("fp16", "bf16"):
        assert torch.allclose(y, x, rtol=1e-2, atol=1e-2)


def test_compressor_timings_positive() -> None:
    recs = profile_compressors(device_type="cpu", sizes=(4096, 65536), devices=["cpu"],
                               iters=1, min_time_s=0.0)
    assert {r.compressor for r in recs} == set(COMPRESSORS)
    for r in recs:
        assert r.key == (r.compressor, "cpu", "cpu")
        assert [s.nbytes for s in r.samples] == [4096, 65536]
        assert all(s.compress_s > 0 and s.decompress_s > 0 for s in r.samples)


def test_unknown_compressor() -> None:
    with pytest.raises(ValueError, match="unknown compressor"):
        profile_compressors(device_type="cpu", compressors=["zip"])


# -- run_profile ----------------------------------------------------------------------------
def test_run_profile_writes_and_merges(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "profile.json"
    model, ids = _gpt()
    kw = dict(world_size=1, device_type="cpu", output=out, what=("layers", "compressors"),
              warmup=0, iters=1, compressor_sizes=(4096,), show_progress=False)
    first = run_profile((model, (ids,), {}), **kw)
    loaded = ProfileDB.load(out)
    assert loaded == first and loaded.compute and loaded.compressors
    assert loaded.machines[0].device_type == "cpu"
    second = run_profile((model, (ids,), {}), **kw)
    again = ProfileDB.load(out)
    assert again == second
    for recs in (again.compute, again.compressors):
        keys = [r.key for r in recs]
        assert len(keys) == len(set(keys))
    assert len(again.compute) == len(first.compute)
    assert len(again.machines) == 1


def test_run_profile_zoo_model(tmp_path) -> None:  # type: ignore[no-untyped-def]
    db = run_profile("mlp", world_size=1, output=None, what=("layers",), batch_size=4,
                     warmup=0, iters=1, show_progress=False)
    ir = hetplan.capture(zoo.build("mlp"), torch.empty(4, 32, device="meta"))
    assert {r.signature for r in db.compute} == {lay.signature(ir.batch_size) for lay in ir.layers}


def test_run_profile_bad_what() -> None:
    with pytest.raises(ValueError, match="unknown measurement"):
        run_profile(None, what=("gpu-burn",), show_progress=False)


# -- multi-process --------------------------------------------------------------------------
def _fail(rank: int, world: int) -> None:
    raise RuntimeError(f"rank {rank} of {world} failed on purpose")


@pytest.mark.dist
def test_run_local_ranks_reports_child_errors() -> None:
    with pytest.raises(Exception, match="failed on purpose"):
        run_local_ranks(_fail, 1, backend=None, timeout_s=60)


def _rank_one_hangs(rank: int, world: int) -> int:
    if rank == 1:
        time.sleep(120)
    return rank


@pytest.mark.dist
def test_run_local_ranks_timeout_names_the_ranks_that_returned() -> None:
    """A run that times out says which ranks had returned (a rank whose pipeline stage raised
    while the next stage's ranks wait on it), not only that it timed out."""
    with pytest.raises(TimeoutError, match=r"within 8 s; rank\(s\) \[0\] had returned"):
        run_local_ranks(_rank_one_hangs, 2, backend=None, timeout_s=8)


@pytest.mark.dist
def test_profile_collectives_world_2() -> None:
    prof = profile_collectives(2, sizes=(4096, 65536, 1 << 20),
                               collectives=("allreduce", "reduce_scatter", "p2p"),
                               iters=2, max_iters=5, min_time_s=0.0, timeout_s=120)
    got = {r.collective: r for r in prof.records}
    assert "allreduce" in got and "p2p" in got
    assert set(got) | set(prof.skipped) == {"allreduce", "reduce_scatter", "p2p"}
    ar = got["allreduce"]
    assert ar.key == ("allreduce", "gloo", "loopback", 2)
    assert [s.nbytes for s in ar.samples] == [4096, 65536, 1 << 20]
    assert all(s.seconds > 0 for s in ar.samples)
    assert ar.alpha_s is not None and ar.beta_s_per_byte is not None
    assert ar.alpha_s + ar.beta_s_per_byte > 0
    # the cost model picks the measured line up for a loopback cluster
    db = ProfileDB(collectives=tuple(prof.records))
    comm = CommModel(ClusterSpec.from_preset("local-cpu"), db)
    line = comm.alpha_beta("allreduce", 2, "intra")
    assert line.source == "profiled"


def test_p2p_sample_is_the_mean_hand_over_of_a_relay() -> None:
    # a pipeline pays every hop: one slow wake-up in three relays counts (a median drops it),
    # and a relay around 4 ranks is 4 hand-overs
    times = [0.004, 0.004, 0.016]
    assert sample_seconds("p2p", times, 4) == pytest.approx(0.008 / 4)
    assert sample_seconds("p2p", times, 2) == pytest.approx(0.008 / 2)
    # collectives keep the median call
    assert sample_seconds("allreduce", times, 4) == pytest.approx(0.004)
    with pytest.raises(ValueError, match="no timed calls"):
        sample_seconds("p2p", [], 4)


@pytest.mark.dist
def test_p2p_relay_through_three_ranks() -> None:
    # an odd ring: every rank receives from the previous one and sends to the next
    prof = profile_collectives(3, sizes=(4096, 65536), collectives=("p2p",), iters=2,
                               max_iters=3, min_time_s=0.0, timeout_s=120)
    (rec,) = prof.records
    assert rec.key == ("p2p", "gloo", "loopback", 2)
    assert [s.nbytes for s in rec.samples] == [4096, 65536]
    assert all(s.seconds > 0 for s in rec.samples)


def test_sizes_are_timed_in_rounds_over_all_of_them() -> None:
    # every size meets the same spells of a busy host: rounds over all sizes, not one block
    # per size
    assert size_order([4096, 65536, 1 << 20], 2) == [4096, 65536, 1 << 20] * 2
    assert size_order([4096], 3) == [4096, 4096, 4096]
    with pytest.raises(ValueError, match="passes must be >= 1"):
        size_order([4096], 0)
    with pytest.raises(ValueError, match="passes must be >= 1"):
        profile_collectives(2, passes=0)


def test_subgroups_are_consecutive_equal_groups() -> None:
    assert subgroups(4, 2) == [[0, 1], [2, 3]]
    assert subgroups(6, 3) == [[0, 1, 2], [3, 4, 5]]
    assert subgroups(4, 4) == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="divide the 4 processes"):
        subgroups(4, 3)
    with pytest.raises(ValueError, match="must be >= 2"):
        subgroups(4, 1)
    with pytest.raises(ValueError, match="divide the 4 processes"):
        profile_collectives(4, group_sizes=[3])


@pytest.mark.dist
def test_pairs_of_four_ranks_are_measured_not_rescaled() -> None:
    # a tp=2 plan on 4 ranks prices its collectives from pairs measured together, not from
    # the 4-rank line rescaled by latency steps
    prof = profile_collectives(4, sizes=(4096, 65536), collectives=("allreduce",), iters=2,
                               max_iters=3, min_time_s=0.0, timeout_s=120)
    assert [r.key for r in prof.records] == [("allreduce", "gloo", "loopback", 4),
                                             ("allreduce", "gloo", "loopback", 2)]
    pair = prof.records[1]
    assert [s.nbytes for s in pair.samples] == [4096, 65536]
    assert all(s.seconds > 0 for s in pair.samples)
    comm = CommModel(ClusterSpec.from_preset("local-cpu"), ProfileDB(collectives=tuple(
        prof.records)))
    line = comm.alpha_beta("allreduce", 2, "intra")
    assert line.source == "profiled" and "rescaled" not in line.detail
    assert line.alpha_s == pytest.approx(pair.alpha_s)


@pytest.mark.dist
def test_profile_layers_concurrent_two_processes() -> None:
    model, ids = _gpt()
    recs = profile_layers_concurrent(model, ids, processes=2, device_type="cpu", warmup=1,
                                     iters=2, timeout_s=120)
    ir = hetplan.capture(model, ids)
    assert {r.signature for r in recs} == {lay.signature(ir.batch_size) for lay in ir.layers}
    block = next(r for r in recs if r.label.startswith("GPTBlock"))
    assert block.samples == 2 * 2 * 3 and block.fwd_ms > 0  # steps x processes x blocks


def test_profile_collectives_needs_two() -> None:
    with pytest.raises(ValueError, match="world_size >= 2"):
        profile_collectives(1)
    with pytest.raises(ValueError, match="unknown collective"):
        profile_collectives(2, collectives=("allreduce", "scan"))


def test_a_profile_at_one_batch_prices_a_capture_at_another() -> None:
    """Records are keyed per sample and carry their micro-batch and dtype: a profile taken at
    micro-batch 4 in bf16 prices the blocks of a capture at batch 1, scaled from batch 4, for
    a device that computes in bf16, and nothing for one that computes in fp32."""
    from hetplan.cost_models.compute import ComputeModel
    from hetplan.ir.plan_sections import DevicePrecision, Precision, WorkloadSummary

    model, ids = _gpt()
    recs = profile_layers(model, ids, device_type="cpu", warmup=1, iters=2, dtype="bf16")
    assert {(r.dtype, r.batch_size) for r in recs} == {("bf16", 4)}
    block = next(r for r in recs if r.label.startswith("GPTBlock"))
    one = WorkloadSummary.from_model_ir(hetplan.capture(model, ids[:1]))
    device = ClusterSpec.from_preset("local-cpu").devices()[0]
    db = ProfileDB(compute=tuple(recs))
    bf16 = Precision(policy="bf16", master_weights_dtype="fp32",
                     devices={"cpu": DevicePrecision(compute_dtype="bf16", peak_dtype="fp32")})
    times = ComputeModel(db, precision=bf16).layer_times(one, device, micro_batch=2)
    names = [lay.name for lay in one.layers]
    t = times[names.index("blocks.0")]
    assert t.source == "profiled"
    assert t.fwd_s == pytest.approx(block.fwd_ms * 1e-3 * 2 / 4)
    fp32 = ComputeModel(db).layer_times(one, device, micro_batch=2)
    assert fp32[names.index("blocks.0")].source == "analytic"


def test_the_default_collectives_are_every_routine_a_plan_may_run() -> None:
    """Every routine of the gradient-sync option tree, and p2p, is measured by default: a
    plan priced from a profile never mixes measured lines with the spec's for its routines
    (docs/decisions/cpu-fidelity.md section 23)."""
    from hetplan.algorithms.espresso_tree import TASKS
    from hetplan.profiling.collectives import DEFAULT_COLLECTIVES

    routines = {r for task, rs in TASKS.items() if task.startswith("comm") for r in rs}
    assert {"reduce", "gather"} <= routines
    assert routines | {"p2p"} == set(DEFAULT_COLLECTIVES)
