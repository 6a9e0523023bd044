"""The strategies practitioners run, end to end through ``compile``: mixed precision per
device type by default, ``--dtype`` forcing one dtype on every preset, interleaved virtual
stages, ZeRO sharding, per-stage recomputation, and layouts refused only for memory with the
per-rank breakdown in numbers. No timed assertions."""

from __future__ import annotations

import pytest

from hetplan import compile
from hetplan.algorithms.pipeline_schedules import plan_schedule
from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.evaluate import evaluate
from hetplan.cost_models.predict import simulate
from hetplan.errors import InfeasiblePlanError
from hetplan.ir.cluster import PRESETS, ClusterSpec
from hetplan.ir.model import ModelIR
from hetplan.ir.plan import Plan
from hetplan.optimizer.compile import _workload
from hetplan.passes.base import rank_of


@pytest.fixture(scope="module")
def gpt_test() -> ModelIR:
    return _workload("gpt-test", None, None, None)


@pytest.fixture(scope="module")
def megatron() -> ModelIR:
    """Megatron-LM layers (an attention core selective recomputation can drop), 4 x dim 128,
    sequence 128."""
    import torch

    from hetplan import models
    from hetplan.ir.capture import capture

    return capture(models.MegatronGPT(256, 128, 128, 4, 4),
                   (torch.zeros(1, 128, dtype=torch.long),), name="megatron-gpt")


# -- precision ---------------------------------------------------------------------------------
def test_default_plans_are_mixed_precision_per_device_type(gpt_test: ModelIR) -> None:
    plan = compile(gpt_test, "mixed-generations", batch_size=64)
    assert plan.cost_settings is not None and plan.cost_settings.dtype == "mixed"
    prec = plan.precision
    assert prec is not None and prec.policy == "mixed"
    a100, v100 = prec.devices["A100-80GB"], prec.devices["V100-SXM2-32GB"]
    assert (a100.compute_dtype, a100.loss_scaling, a100.peak_dtype) == ("bf16", "none", "bf16")
    assert (v100.compute_dtype, v100.loss_scaling, v100.peak_dtype) == ("fp16", "dynamic",
                                                                         "fp16")
    assert prec.master_weights_dtype == "fp32" and prec.optimizer_state_dtype == "fp32"
    cpu = compile(gpt_test, "cpu-2x2", batch_size=8).precision
    assert cpu is not None and cpu.devices["cpu"].compute_dtype == "fp32"
    assert cpu.master_weights_dtype is None  # fp32 weights are the master copy


def test_each_device_is_priced_at_its_own_dtype_peak(gpt_test: ModelIR) -> None:
    spec = ClusterSpec.from_preset("mixed-generations")
    wl = compile(gpt_test, spec, batch_size=64).model.workload
    assert wl is not None
    mixed, fp32 = CostModel(spec, dtype="mixed"), CostModel(spec, dtype="fp32")
    for dev in {d.type: d for d in spec.devices()}.values():
        fast, slow = (c.compute.layer_times(wl, dev, 64)[3] for c in (mixed, fp32))
        peak = {"A100-80GB": 312 / 19.5, "V100-SXM2-32GB": 125 / 15.7}[dev.type]
        # the block is compute-bound at micro-batch 64: time scales with the peak
        assert slow.fwd_s / fast.fwd_s == pytest.approx(peak, rel=1e-9)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_bf16_works_on_every_preset(gpt_test: ModelIR, preset: str) -> None:
    spec = ClusterSpec.from_preset(preset)
    plan = compile(gpt_test, spec, batch_size=spec.world_size, dtype="bf16", dp=spec.world_size,
                   passes="dynpipe,even-tp,ddp-buckets")
    assert plan.precision is not None and plan.precision.policy == "bf16"
    for dtype in plan.precision.devices.values():
        assert dtype.compute_dtype == "bf16"
        # a type without a bf16 peak (V100, CPU) is priced at its fp32 peak
        assert dtype.peak_dtype in ("bf16", "fp32")


def test_bf16_on_cpu_runs_the_whole_default_pipeline(gpt_test: ModelIR) -> None:
    # this failed with a KeyError inside dynpipe: CPUs list no bf16 peak
    plan = compile(gpt_test, "cpu-2x2", batch_size=8, dtype="bf16")
    assert plan.precision is not None
    assert plan.precision.devices["cpu"].model_dump() == {
        "compute_dtype": "bf16", "loss_scaling": "none", "peak_dtype": "fp32"}


# -- the plan's memory breakdown ----------------------------------------------------------------
def test_predictions_carry_the_per_rank_breakdown(gpt_test: ModelIR) -> None:
    plan = compile(gpt_test, "mixed-generations", batch_size=64)
    pred = plan.predictions
    assert pred is not None and len(pred.memory_breakdown) == 32
    assert tuple(m.total for m in pred.memory_breakdown) == pred.memory_per_rank_bytes
    assert all(m.params and m.grads and m.optimizer for m in pred.memory_breakdown)
    # a stage may save no activations (an embedding's integer ids); the margin follows them
    assert any(m.activations for m in pred.memory_breakdown)
    assert all(bool(m.margin) == bool(m.activations) for m in pred.memory_breakdown)
    assert simulate(plan) == pred.model_copy(update={"baselines": pred.baselines})


# -- interleaved virtual stages ------------------------------------------------------------------
def test_interleaved_1f1b_compiles(gpt_test: ModelIR) -> None:
    # pp 2: gpt-test has 7 layer boundaries of which 6 can be cut (``pos_emb`` is only read
    # by glue), too few for pp 4 x 2 chunks; the search refuses that with the reason
    plan = compile(gpt_test, "a100-nvlink-8x8", batch_size=64, pp=2,
                   schedule="interleaved-1f1b")
    lay = plan.layout
    assert lay is not None and lay.schedule == "interleaved-1f1b" and lay.virtual_stages >= 2
    assert len(plan.stages) == lay.pp * lay.virtual_stages
    for st in plan.stages:  # chunk k on pipeline rank k % pp, as the runtime builds it
        coord = st.index % lay.pp
        assert st.ranks == tuple(rank_of(lay, d, coord, t) for d in range(lay.dp)
                                 for t in range(lay.tp))
    sched = plan_schedule(lay, plan.pipeline_actions)
    assert sched.num_stages == len(plan.stages)
    assert plan.predictions is not None
    assert simulate(plan).iteration_time_ms == plan.predictions.iteration_time_ms


def test_interleaved_pins_its_chunk_count(gpt_test: ModelIR) -> None:
    plan = compile(gpt_test, "cpu-2x2", batch_size=8, pp=2, schedule="interleaved-1f1b",
                   virtual_stages=3)
    assert plan.layout is not None and plan.layout.virtual_stages == 3
    assert len(plan.stages) == 6


def test_interleaved_rank_holds_all_its_chunks(gpt_test: ModelIR) -> None:
    plan = compile(gpt_test, "cpu-2x2", batch_size=8, pp=2, tp=1, zero_stage=0,
                   schedule="interleaved-1f1b", virtual_stages=2)  # tp=1: whole layers
    assert plan.model.workload is not None and plan.layout is not None
    wl = plan.model.workload
    ev = evaluate(wl, plan.layout, plan.stages, None, CostModel(ClusterSpec.from_preset(
        "cpu-2x2"), dtype="mixed"), check_memory=False)
    # rank 0 holds chunks 0 and 2: the parameters of both (fp32 on CPU)
    own = sum(wl.layers[i].param_bytes for st in plan.stages if 0 in st.ranks
              for i in range(st.first_layer, st.last_layer + 1))
    assert ev.memory[0].params == own


# -- ZeRO ----------------------------------------------------------------------------------------
def test_zero1_is_free_and_chosen_with_data_parallelism(gpt_test: ModelIR) -> None:
    plan = compile(gpt_test, "a100-nvlink-8x8", batch_size=64, dp=64)
    assert plan.layout is not None and plan.layout.zero_stage == 1
    pred = plan.predictions
    assert pred is not None
    # ZeRO-1 costs what the all-reduce costs: pinning 0 is never faster, and holds more
    zero0 = compile(gpt_test, "a100-nvlink-8x8", batch_size=64, dp=64, zero_stage=0)
    assert zero0.predictions is not None
    assert pred.iteration_time_ms <= zero0.predictions.iteration_time_ms
    assert pred.memory_breakdown[0].optimizer * 64 == pytest.approx(
        zero0.predictions.memory_breakdown[0].optimizer, rel=1e-4)


def _tight(gib: float, devices: int = 8) -> ClusterSpec:
    cpu = {"memory_gib": gib, "peak_tflops": {"fp32": 0.1}, "mem_bandwidth_gb_s": 20.0}
    return ClusterSpec.from_dict({
        "name": "tight", "nodes": [{"name": "host", "devices": [{"type": "small",
                                                                   "count": devices}],
                                    "cpu_cores": 8,
                                    "intra_link": {"kind": "loopback", "bandwidth_gbps": 40.0,
                                                   "latency_us": 10.0}}],
        "device_types": {"small": cpu}})


def test_zero_goes_up_a_stage_when_memory_needs_it() -> None:
    import torch

    from hetplan import models
    from hetplan.ir.capture import capture

    # wide and short: model state, not activations, decides
    wide = capture(models.MegatronGPT(256, 8, 512, 4, 8), (torch.zeros(1, 8, dtype=torch.long),))
    kw = dict(batch_size=8, dp=8, micro_batch_size=1)
    need = {z: max(compile(wide, _tight(4.0), zero_stage=z, **kw).predictions
                   .memory_per_rank_bytes) for z in (1, 2, 3)}  # type: ignore[union-attr]
    assert need[1] > need[2] > need[3]
    # fp32 Adam on CPU over dp=8: ZeRO-1 holds 4 + 4 + 8/8 bytes per parameter, ZeRO-2
    # 4 + 4/8 + 8/8 (+ a gradient bucket), ZeRO-3 (4 + 4 + 8)/8 (+ buckets)
    spec = _tight((need[1] + need[2]) / 2 / 0.9 / 2**30)
    plan = compile(wide, spec, **kw)
    assert plan.layout is not None and plan.layout.zero_stage == 2
    note = plan.pass_log[0].notes[0]
    assert "zero=2" in note
    with pytest.raises(InfeasiblePlanError, match="zero=1"):
        compile(wide, spec, zero_stage=1, **kw)


# -- recomputation and refusals ------------------------------------------------------------------
def test_recompute_is_chosen_per_stage_only_when_memory_needs_it(megatron: ModelIR) -> None:
    roomy = compile(megatron, _tight(4.0, 2), batch_size=16, dp=1, pp=2, micro_batch_size=8)
    assert all(st.recompute == "none" for st in roomy.stages)
    need = roomy.predictions.memory_per_rank_bytes  # type: ignore[union-attr]
    acts = [m.activations for m in roomy.predictions.memory_breakdown]  # type: ignore[union-attr]
    # a device a little smaller than the fullest rank needs: that stage recomputes
    # (and above what the other stage needs: the last stage also holds the loss's logits)
    gib = max(max(need) - max(acts) / 2, min(need) * 1.001) / 0.9 / 2**30
    tight = compile(megatron, _tight(gib, 2), batch_size=16, dp=1, pp=2, micro_batch_size=8)
    modes = [st.recompute for st in tight.stages]
    assert modes.count("none") == 1 and set(modes) - {"none"} <= {"selective", "full"}
    slower = tight.predictions.iteration_time_ms  # type: ignore[union-attr]
    assert slower > roomy.predictions.iteration_time_ms  # type: ignore[union-attr]


def test_a_layout_refused_for_the_models_structure_is_not_called_out_of_memory(
        megatron: ModelIR) -> None:
    """4 layers, pp 4 x 2 chunks: 8 stages need more cuts than the model has places for.
    The summary said "none of the 1 layouts fits in memory" before the reason."""
    with pytest.raises(InfeasiblePlanError) as info:
        compile(megatron, _tight(64.0, 4), batch_size=8, dp=1, pp=4,
                schedule="interleaved-1f1b", virtual_stages=2, micro_batch_size=2)
    msg = str(info.value)
    assert msg.startswith("none of the 1 layouts can be planned; for example: ")
    assert "cuts" in msg and "memory" not in msg


def test_more_pipeline_chunks_than_layers_is_named(gpt_test: ModelIR) -> None:
    """Was: "no layout ... divides the global batch of 8 into at most 65,536 micro-batches",
    advising another batch size, for pp x virtual_stages above the model's layers."""
    n = len(gpt_test.layers)
    with pytest.raises(InfeasiblePlanError) as info:
        compile(gpt_test, "local-cpu", batch_size=8, pp=2, schedule="interleaved-1f1b",
                virtual_stages=n)
    msg = str(info.value)
    assert (f"pp=2 x virtual_stages={n} makes {2 * n} pipeline chunks, but the model has {n} "
            "layers") in msg
    assert f"pin virtual_stages <= {n // 2}" in msg and "batch size" not in msg


def test_memory_only_infeasible_layout_is_refused_with_the_breakdown(megatron: ModelIR) -> None:
    roomy = compile(megatron, _tight(4.0, 2), batch_size=16, dp=1, pp=2, micro_batch_size=8)
    need = max(roomy.predictions.memory_per_rank_bytes)  # type: ignore[union-attr]
    spec = _tight(need * 0.8 / 0.9 / 2**30, 2)
    with pytest.raises(InfeasiblePlanError) as info:
        compile(megatron, spec, batch_size=16, dp=1, pp=2, micro_batch_size=8,
                recompute="none")
    msg = str(info.value)
    assert "none of the 1 layouts fits in memory" in msg
    assert "needs" in msg and "GiB usable" in msg
    for part in ("params", "grads", "master weights + optimizer state", "activations",
                 "allocator margin"):
        assert part in msg, part
    # the same layout with recomputation fits: memory alone refused it
    fits = compile(megatron, spec, batch_size=16, dp=1, pp=2, micro_batch_size=8)
    assert any(st.recompute != "none" for st in fits.stages)


# -- determinism ---------------------------------------------------------------------------------
def test_same_inputs_give_byte_identical_plans(gpt_test: ModelIR) -> None:
    def once() -> Plan:
        return compile(gpt_test, "mixed-generations", batch_size=64,
                       schedule="interleaved-1f1b")

    a, b = once(), once()
    assert a.to_json() == b.to_json()
    assert Plan.from_json(a.to_json()) == a


# -- compression and ZeRO ------------------------------------------------------------------------
def test_compression_applies_with_zero_stage_one_only(gpt_test: ModelIR) -> None:
    kw = dict(batch_size=64, dp=64, compressors=("topk",))
    one = compile(gpt_test, "espresso-pcie-8x8", zero_stage=1, **kw)
    two = compile(gpt_test, "espresso-pcie-8x8", zero_stage=2, **kw)
    espresso = next(e for e in two.pass_log if e.name == "espresso")
    assert "not used: ZeRO-2" in espresso.notes[0]
    assert two.gradient_sync is not None
    assert {s.kind for s in two.gradient_sync.strategies.values()} == {"none"}
    assert one.gradient_sync is not None  # compression is allowed, whether chosen or not
    assert not any("not used" in n for e in one.pass_log for n in e.notes)


def test_evaluate_refuses_compressed_sync_under_zero_two(gpt_test: ModelIR) -> None:
    from hetplan.errors import SpecError
    from hetplan.ir.plan_sections import CastSync, GradientSync, TensorSync

    plan = compile(gpt_test, "espresso-pcie-8x8", batch_size=64, dp=64, zero_stage=2)
    assert plan.model.workload is not None and plan.layout is not None
    wl = plan.model.workload
    cast = GradientSync(strategies={"fp16": CastSync()},
                        tensors=tuple(TensorSync(name=g.name, strategy="fp16") for g in wl.grads))
    costs = CostModel(ClusterSpec.from_preset("espresso-pcie-8x8"), dtype="mixed")
    with pytest.raises(SpecError, match="needs zero_stage <= 1"):
        evaluate(wl, plan.layout, plan.stages, cast, costs)
    # ZeRO-1: the cast sync is priced, plus the all-gather of the updated weight shards
    from hetplan.cost_models.evaluate import stage_syncs

    one = plan.layout.model_copy(update={"zero_stage": 1})
    evaluate(wl, one, plan.stages, cast, costs)
    ss = stage_syncs(wl, one, plan.stages, costs)[0]
    assert [op.label for op in ss.ops(CastSync(), 1e6, costs)][-1] == "allgather"
    zero0 = stage_syncs(wl, plan.layout.model_copy(update={"zero_stage": 0}), plan.stages,
                        costs)[0]
    assert "allgather" not in [op.label for op in zero0.ops(CastSync(), 1e6, costs)]
