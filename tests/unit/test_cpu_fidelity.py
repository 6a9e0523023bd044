"""The cost model on CPU ranks (gloo, ``comm_overlaps_compute: false``): what the breakdown
calls communication and compression, and the per-step framework costs a profile measures
(the causes of the CPU fidelity misses in ``docs/decisions/cpu-fidelity.md``)."""

from __future__ import annotations

import functools

import pytest

import hetplan
from hetplan.ir.cluster import ClusterSpec


def test_uncompressed_sync_on_cpu_ranks_is_communication_not_compression() -> None:
    # collectives of cpu ranks take turns with compute on the compute resource; the breakdown
    # used to report that time as compression (0.229 ms of it for a plan that compresses
    # nothing) and 0 ms of communication
    plan = hetplan.compile("tiny-gpt2", ClusterSpec.from_preset("local-cpu"), batch_size=8,
                           dp=4, pp=1, tp=1, zero_stage=0)
    assert plan.gradient_sync is not None
    kinds = {s.kind for s in plan.gradient_sync.strategies.values()}
    assert kinds == {"none"}, kinds
    b = plan.predictions.breakdown
    assert b.compression_ms == 0.0
    assert b.comm_ms > 0.0
    # nothing overlaps on cpu ranks: all of the sync is exposed
    assert b.exposed_comm_ms == pytest.approx(b.comm_ms, rel=1e-9)


def test_compressed_sync_on_cpu_ranks_still_reports_compression() -> None:
    plan = hetplan.compile("gpt-test", ClusterSpec.from_preset("cpu-2x2-slow"), batch_size=8,
                           dp=4, pp=1, tp=1, zero_stage=0, compressors=("dgc",))
    assert plan.gradient_sync is not None
    assert any(s.kind == "compressed" for s in plan.gradient_sync.strategies.values())
    b = plan.predictions.breakdown
    assert b.compression_ms > 0.0
    assert b.comm_ms > 0.0


@functools.cache
def _tiny_gpt2_ir():  # type: ignore[no-untyped-def]
    """tiny-gpt2 captured once for the tests that read it (a frozen IR)."""
    from hetplan import zoo

    args, kwargs = zoo.example_inputs("tiny-gpt2", batch=1)
    return hetplan.capture(zoo.build("tiny-gpt2", device="meta"), args, kwargs)


def _optimizer_ms(db: object, zero: int = 0, dp: int = 4) -> float:
    from hetplan.cost_models.costs import CostModel
    from hetplan.cost_models.evaluate import evaluate
    from hetplan.ir.plan_sections import Layout, WorkloadSummary

    wl = WorkloadSummary.from_model_ir(_tiny_gpt2_ir())
    costs = CostModel(ClusterSpec.from_preset("local-cpu"), db, optimizer="adam")  # type: ignore[arg-type]
    layout = Layout(dp=dp, micro_batch_size=2, global_batch_size=2 * dp, zero_stage=zero)
    return evaluate(wl, layout, (), None, costs, check_memory=False).optimizer_s * 1e3


def _step_db(per_tensor_s: float, per_byte_s: float, processes: int = 4) -> object:
    from hetplan.cost_models.profile_db import OptimizerRecord, OptimizerSample, ProfileDB

    rec = OptimizerRecord(optimizer="adam", device_type="cpu", processes=processes,
                          samples=(OptimizerSample(tensors=1, nbytes=4, seconds=1e-5),),
                          per_tensor_s=per_tensor_s, per_byte_s=per_byte_s)
    return ProfileDB(optimizer_steps=(rec,))


def test_measured_optimizer_step_prices_every_tensor() -> None:
    # the analytic estimate (bytes over the preset's bandwidth, a launch per kernel) is the
    # fallback; a measured line (hetplan profile --what step) replaces it
    ir = _tiny_gpt2_ir()
    wl_tensors = len(ir.grad_tensors)
    fp32_bytes = sum(g.size_bytes for g in ir.grad_tensors)
    analytic = _optimizer_ms(None)
    measured = _optimizer_ms(_step_db(30e-6, 1e-9))
    assert measured != pytest.approx(analytic, rel=1e-3)
    assert measured == pytest.approx((30e-6 * wl_tensors + 1e-9 * fp32_bytes) * 1e3, rel=1e-6)
    # ZeRO-1: a rank steps its 1/dp chunk: about a quarter of the tensors and of the bytes
    zero1 = _optimizer_ms(_step_db(30e-6, 1e-9), zero=1)
    assert zero1 == pytest.approx((30e-6 * -(-wl_tensors // 4) + 1e-9 * fp32_bytes / 4) * 1e3,
                                  rel=1e-6)


def test_optimizer_record_nearest_process_count() -> None:
    from hetplan.cost_models.profile_db import ProfileDB, merge

    db = merge(_step_db(1e-6, 0.0, 1), _step_db(2e-6, 0.0, 4))  # type: ignore[arg-type]
    assert isinstance(db, ProfileDB)
    assert db.optimizer_step("adam", "cpu", 4).per_tensor_s == 2e-6  # type: ignore[union-attr]
    assert db.optimizer_step("adam", "cpu", 3).per_tensor_s == 2e-6  # type: ignore[union-attr]
    assert db.optimizer_step("adam", "cpu", 1).per_tensor_s == 1e-6  # type: ignore[union-attr]
    assert db.optimizer_step("sgd", "cpu", 4) is None
    assert ProfileDB.from_json(db.to_json()) == db


def test_fit_step_line_recovers_a_line() -> None:
    from hetplan.cost_models.profile_db import OptimizerSample
    from hetplan.profiling.step import fit_step_line

    pts = [(4, 4096), (64, 65536), (4, 4 << 20), (16, 16 << 20)]
    samples = [OptimizerSample(tensors=t, nbytes=b, seconds=20e-6 * t + 2e-9 * b)
               for t, b in pts]
    a, b = fit_step_line(samples)
    assert a == pytest.approx(20e-6, rel=1e-6)
    assert b == pytest.approx(2e-9, rel=1e-6)


def test_layers_profiled_at_a_micro_batch_are_found_by_the_batch_1_plan() -> None:
    # tiny-gpt2's position embedding (a (1, seq) index input) and first block (the mask)
    # have batch-specific signatures: profiled at micro-batch 2 they were not found when
    # planning from the batch-1 capture, and fell back to the roofline
    from hetplan.cost_models.compute import ComputeModel
    from hetplan.ir.plan_sections import WorkloadSummary
    from hetplan.profiling import run_profile

    db = run_profile("tiny-gpt2", what=("layers",), batch_size=2, warmup=0, iters=1,
                     show_progress=False)
    wl = WorkloadSummary.from_model_ir(_tiny_gpt2_ir())
    dev = ClusterSpec.from_preset("local-cpu").devices()[0]
    times = ComputeModel(db).layer_times(wl, dev, 2)
    assert ComputeModel.sources(times) == {"profiled": len(wl.layers)}
    assert {r.batch_size for r in db.compute} == {2}


@pytest.mark.parametrize("name", ["local-cpu", "cpu-2x2", "cpu-2x2-slow"])
def test_cpu_presets_describe_4_processes_on_the_2_core_machine(name: str) -> None:
    # the machine these presets name runs 4 gloo processes on 2 cores (issue 19): a preset
    # that gives each process a core of its own describes twice the machine
    spec = ClusterSpec.from_preset(name)
    groups = spec.nodes
    processes = sum(g.count * sum(d.count for d in g.devices) for g in groups)
    cores = sum(g.count * g.cpu_cores for g in groups)
    assert processes == 4, name
    assert cores == 2, name
