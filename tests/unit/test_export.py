"""``hetplan export``: the values written for each engine and the price of what it cannot express.

These tests need no engine installed. The plan is the small deterministic workload of
``tests/golden/inspect_small.workload.json`` compiled on ``mixed-generations`` (A100s computing
bf16 and V100s computing fp16, hierarchical gradient sync). The gaps' prices are checked
against plans edited by hand in the test and re-predicted with ``hetplan.simulate`` (a
separate entry point from the exporter). The engines' own parsers check the same exports in
``test_export_engines.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from hetplan.cli import app
from hetplan.cost_models.predict import simulate
from hetplan.errors import SpecError
from hetplan.ir.model import ModelIR
from hetplan.ir.plan import Bucket, CompressedSync, GradientSync, NoSync, Plan, Stage
from hetplan.optimizer.compile import compile as compile_plan
from hetplan.report.export import export_plan

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


@pytest.fixture(scope="module")
def ir() -> ModelIR:
    return ModelIR.load(GOLDEN / "inspect_small.workload.json")


@pytest.fixture(scope="module")
def pp_tp(ir: ModelIR) -> Plan:
    """dp=8 pp=2 tp=2, 1F1B, ZeRO-1, sequence parallel; stages of 2 and 6 layers. The split
    is set here (the planner's choice moves with the cost model; what is tested is how the
    exporter expresses and prices a split, not which one is planned)."""
    plan = compile_plan(ir, "mixed-generations", batch_size=64, dp=8, pp=2, tp=2)
    names = [lay.name for lay in plan.model.workload.layers]  # type: ignore[union-attr]
    uneven = (plan.stages[0].model_copy(update={"first_layer": 0, "last_layer": 1,
                                                "layer_names": tuple(names[0:2])}),
              plan.stages[1].model_copy(update={"first_layer": 2, "last_layer": 7,
                                                "layer_names": tuple(names[2:8])}))
    if plan.stages == uneven:
        return plan
    return _edit(plan, stages=uneven, pipeline_actions=None,
                 gradient_sync=_split_by_stage(plan, uneven))


def _gap(result: object, part: str) -> object:
    gaps = {g.part: g for g in result.gaps}  # type: ignore[attr-defined]
    assert part in gaps, f"no gap {part!r}; gaps: {sorted(gaps)}"
    return gaps[part]


def _edit(plan: Plan, **update: object) -> Plan:
    return Plan.model_validate(plan.model_copy(update=update).model_dump())


def _split_by_stage(plan: Plan, stages: tuple[Stage, ...]) -> GradientSync:
    """The plan's buckets cut at the new stage boundaries (written here, independently)."""
    assert plan.gradient_sync is not None and plan.model.workload is not None
    layer = {g.name: g.layer_index for g in plan.model.workload.grads}
    size = {g.name: g.size_bytes for g in plan.model.workload.grads}
    out = []
    for b in plan.gradient_sync.buckets:
        for st in stages:
            names = tuple(t for t in b.tensors if st.first_layer <= layer[t] <= st.last_layer)
            if names:
                out.append(Bucket(tensors=names, strategy=b.strategy,
                                  size_bytes=sum(size[t] for t in names)))
    return GradientSync(strategies=plan.gradient_sync.strategies, buckets=tuple(out))


# -- the values ------------------------------------------------------------------------------
def test_deepspeed_values(pp_tp: Plan) -> None:
    lay = pp_tp.layout
    assert lay is not None
    cfg = export_plan(pp_tp, "deepspeed").values
    assert cfg["train_micro_batch_size_per_gpu"] == lay.micro_batch_size == 4
    assert cfg["gradient_accumulation_steps"] == lay.micro_batches == 2
    # DeepSpeed's own rule: train_batch = micro x accumulation x data-parallel size
    assert cfg["train_batch_size"] == 4 * 2 * lay.dp == lay.global_batch_size == 64
    assert cfg["zero_optimization"]["stage"] == 1
    assert cfg["pipeline"]["stages"] == 2 and cfg["tensor_parallel"]["autotp_size"] == 2
    # bf16 on A100 and fp16 on V100: one dtype every device runs, with dynamic loss scaling
    assert cfg["fp16"]["enabled"] and cfg["fp16"]["loss_scale"] == 0 and "bf16" not in cfg
    assert json.loads(export_plan(pp_tp, "deepspeed").content) == cfg


def test_megatron_values(pp_tp: Plan) -> None:
    result = export_plan(pp_tp, "megatron")
    args = result.values
    assert (args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"]) == (2, 2)
    assert args["micro_batch_size"] == 4 and args["global_batch_size"] == 64
    assert args["num_layers"] == 4  # the transformer blocks
    # the plan's stages: embeddings | 4 blocks, final norm and head
    assert [(s.first_layer, s.last_layer) for s in pp_tp.stages] == [(0, 1), (2, 7)]
    assert args["pipeline_model_parallel_layout"] == "E|ttttL"
    assert args["sequence_parallel"] and args["use_distributed_optimizer"] and args["fp16"]
    lines = result.content.splitlines()
    assert "--pipeline-model-parallel-layout E|ttttL" in lines
    assert "--sequence-parallel" in lines and "--fp16" in lines
    assert not any(g.part == "uneven-stages" for g in result.gaps)  # the layout expresses them


def test_torchtitan_values(pp_tp: Plan) -> None:
    vals = export_plan(pp_tp, "torchtitan").values
    assert vals["parallelism.data_parallel_shard_degree"] == 8
    assert vals["parallelism.data_parallel_replicate_degree"] == 1
    assert vals["parallelism.tensor_parallel_degree"] == 2
    assert vals["parallelism.pipeline_parallel_degree"] == 2
    # with pipelining, local_batch_size is one step of a data-parallel rank, split into
    # micro-batches; global = local x dp
    assert vals["parallelism.pipeline_parallel_microbatch_size"] == 4
    assert vals["training.local_batch_size"] == 8
    assert vals["training.global_batch_size"] == 8 * 8
    assert vals["parallelism.module_fqns_per_model_part"] == [
        ["tok_embeddings"], ["layers.0", "layers.1", "layers.2", "layers.3", "norm", "output"]]
    # no fp16 in torchtitan: fp32 everywhere, named as a gap
    assert vals["training.mixed_precision_param"] == "float32"
    assert "torchtitan computes fp32" in _gap(export_plan(pp_tp, "torchtitan"),
                                               "precision").exported_as



def test_a_part_the_engine_replaces_is_not_said_to_be_dropped(pp_tp: Plan) -> None:
    """Was: "(each dropped alone and re-predicted)" and "without it: ..." for ZeRO-1, which
    torchtitan replaces by FSDP (priced so), not drops: the plan with ZeRO 0 is another
    number."""
    result = export_plan(pp_tp, "torchtitan")
    gap: Any = _gap(result, "zero")
    assert "FSDP" in gap.exported_as
    text = result.text
    assert "dropped alone" not in text and "without it:" not in text
    assert "re-predicted with only that part as exported" in text
    assert f"    priced as exported: {gap.iteration_time_ms:.3f} ms" in text


def test_interleaved_layout(ir: ModelIR) -> None:
    plan = compile_plan(ir, "mixed-generations", batch_size=64, dp=8, pp=2, tp=2,
                        schedule="interleaved-1f1b", virtual_stages=2)
    assert len(plan.stages) == 4
    mega = export_plan(plan, "megatron")
    blocks = [sum(1 for i in range(s.first_layer, s.last_layer + 1)
                  if plan.model.workload.layers[i].kind == "block") for s in plan.stages]
    if blocks == [1, 1, 1, 1]:
        assert mega.values["num_layers_per_virtual_pipeline_stage"] == 1
    else:
        assert mega.values["pipeline_model_parallel_layout"].count("|") == 3
    assert export_plan(plan, "torchtitan").values[
        "parallelism.pipeline_parallel_schedule"] == "Interleaved1F1B"
    # DeepSpeed has no interleaving: one contiguous stage per pipeline rank, priced
    ds = export_plan(plan, "deepspeed")
    gap = _gap(ds, "schedule")
    merged = (Stage(index=0, first_layer=0, last_layer=plan.stages[1].last_layer,
                    ranks=plan.stages[0].ranks),
              Stage(index=1, first_layer=plan.stages[2].first_layer, last_layer=7,
                    ranks=plan.stages[1].ranks))
    lay = plan.layout.model_copy(update={"schedule": "1f1b", "virtual_stages": 1})
    edited = _edit(plan, layout=lay, stages=merged, pipeline_actions=None,
                   gradient_sync=_split_by_stage(plan, merged))
    assert gap.iteration_time_ms == pytest.approx(simulate(edited).iteration_time_ms, abs=1e-6)


# -- the gaps, priced -------------------------------------------------------------------------
def test_uneven_stages_priced_by_resimulation(pp_tp: Plan) -> None:
    gap = _gap(export_plan(pp_tp, "deepspeed"), "uneven-stages")
    even = (Stage(index=0, first_layer=0, last_layer=3, ranks=pp_tp.stages[0].ranks),
            Stage(index=1, first_layer=4, last_layer=7, ranks=pp_tp.stages[1].ranks))
    edited = _edit(pp_tp, stages=even, pipeline_actions=None,
                   gradient_sync=_split_by_stage(pp_tp, even))
    assert gap.iteration_time_ms == pytest.approx(simulate(edited).iteration_time_ms, abs=1e-6)
    assert gap.delta_ms == pytest.approx(gap.iteration_time_ms - simulate(pp_tp).iteration_time_ms,
                                         abs=1e-6)


def test_hierarchical_sync_priced_by_resimulation(pp_tp: Plan) -> None:
    sync = pp_tp.gradient_sync
    assert sync is not None
    assert {s.hierarchy for s in sync.strategies.values()} == {"hierarchical"}
    flat = sync.model_copy(update={"strategies": {k: NoSync() for k in sync.strategies}})
    want = simulate(_edit(pp_tp, gradient_sync=flat)).iteration_time_ms
    for engine in ("deepspeed", "megatron", "torchtitan"):
        gap = _gap(export_plan(pp_tp, engine), "hierarchical-sync")
        assert gap.iteration_time_ms == pytest.approx(want, abs=1e-6), engine


def test_compression_named_and_priced(pp_tp: Plan) -> None:
    sync = pp_tp.gradient_sync
    assert sync is not None
    key = next(iter(sync.strategies))
    topk = CompressedSync(compressor="topk", params={"ratio": 0.01})
    compressed = sync.model_copy(update={"strategies": {**sync.strategies, key: topk}})
    plan = _edit(pp_tp, gradient_sync=compressed)
    back = compressed.model_copy(update={"strategies": {**sync.strategies, key: NoSync()}})
    want = simulate(_edit(pp_tp, gradient_sync=back)).iteration_time_ms
    for engine in ("deepspeed", "megatron", "torchtitan"):
        gap = _gap(export_plan(plan, engine), "compression")
        assert "topk" in gap.plan_does
        assert gap.iteration_time_ms == pytest.approx(want, abs=1e-6)


def test_fusion_buckets_named(pp_tp: Plan) -> None:
    """One bucket per tensor is not what a 25 MiB size cap makes: named, and the exported
    configuration is priced with the engines' size-capped buckets."""
    assert pp_tp.gradient_sync is not None and pp_tp.model.workload is not None
    key = next(iter(pp_tp.gradient_sync.strategies))
    one_each = tuple(Bucket(tensors=(g.name,), size_bytes=g.size_bytes, strategy=key)
                     for g in pp_tp.model.workload.grads)
    plan = _edit(pp_tp, gradient_sync=pp_tp.gradient_sync.model_copy(
        update={"buckets": one_each}))
    result = export_plan(plan, "megatron")
    gap = _gap(result, "fusion-buckets")
    assert f"{len(one_each)} chosen fusion bucket(s)" in gap.plan_does
    assert "--ddp-bucket-size = 25 MiB" in gap.exported_as
    assert result.values["ddp_bucket_size"] == 25 * 2**20 // 4


def test_everything_expressed_for_a_plain_plan(ir: ModelIR) -> None:
    """Pure data parallelism in bf16 with flat fp32 size-capped buckets: nothing to name,
    and the exported configuration is predicted at the plan's time."""
    plan = compile_plan(ir, "a100-nvlink-8x8", batch_size=64, dp=64, pp=1, tp=1,
                        passes="uniform-stages,ddp-buckets", zero_stage=0)
    for engine in ("deepspeed", "megatron", "torchtitan"):
        result = export_plan(plan, engine)
        assert result.gaps == (), (engine, [g.part for g in result.gaps])
        assert result.exported_ms == result.plan_ms
        assert f"every part of the plan is expressed in {engine}" in result.text
    cfg = export_plan(plan, "deepspeed").values
    assert cfg["bf16"] == {"enabled": True}
    assert cfg["train_batch_size"] == cfg["train_micro_batch_size_per_gpu"] * cfg[
        "gradient_accumulation_steps"] * 64
    titan = export_plan(plan, "torchtitan").values
    assert titan["parallelism.data_parallel_replicate_degree"] == 64
    assert titan["training.mixed_precision_param"] == "bfloat16"


def test_deterministic_and_errors(pp_tp: Plan) -> None:
    for engine in ("deepspeed", "megatron", "torchtitan"):
        a, b = export_plan(pp_tp, engine), export_plan(pp_tp, engine)
        assert (a.content, a.text) == (b.content, b.text)
    with pytest.raises(SpecError, match="unknown engine 'megatorn'; did you mean 'megatron'"):
        export_plan(pp_tp, "megatorn")


def test_cli_writes_the_file(pp_tp: Plan, tmp_path: Path) -> None:
    plan_file = tmp_path / "plan.json"
    pp_tp.save(plan_file)
    out = tmp_path / "ds.json"
    res = CliRunner().invoke(app, ["export", str(plan_file), "--to", "deepspeed", "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["train_batch_size"] == 64
    assert "not expressible in deepspeed" in res.output
    bad = CliRunner().invoke(app, ["export", str(plan_file), "--to", "horovod"])
    assert bad.exit_code == 2 and "unknown engine 'horovod'" in bad.output
