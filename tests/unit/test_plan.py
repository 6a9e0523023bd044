"""Unit tests of the Plan schema: golden JSON Schema, determinism, and bad-input errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetplan.errors import PlanMismatchError, PlanVersionError, SpecError
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.model import GradTensor, LayerIR, LayerKind, ModelIR, ParamInfo
from hetplan.ir.plan import (
    SCHEMA_VERSION,
    Baseline,
    Bucket,
    CastSync,
    ClusterRef,
    CommStep,
    CompressedSync,
    CostSource,
    GradientSync,
    Layout,
    ModelRef,
    NoSync,
    PassLogEntry,
    Plan,
    Predictions,
    RankPlacement,
    ResizingController,
    Stage,
    TensorParallel,
    TensorSync,
    TimeBreakdown,
    TPGroup,
    TPLinearShard,
    TPRankRole,
    WorkloadSummary,
    _main,
    check_plan_matches,
    export_json_schema,
    load_plan,
)

GOLDEN_SCHEMA = Path(__file__).resolve().parents[1] / "golden" / "plan.schema.json"
WRITE_SCHEMA = "python -m hetplan.ir.plan --write-schema tests/golden/plan.schema.json"


def tiny_model_ir(hidden: int = 4) -> ModelIR:
    """A two-layer workload built by hand (no torch)."""
    layers = []
    grads = []
    for i, name in enumerate(("fc1", "fc2")):
        numel = hidden * hidden
        param = ParamInfo(name=f"{name}.weight", shape=(hidden, hidden), dtype="float32",
                          numel=numel, size_bytes=4 * numel)
        layers.append(LayerIR(index=i, name=name, kind=LayerKind.LINEAR, module_type="Linear",
                              params=(param,), fwd_flops=2 * numel, bwd_flops=4 * numel,
                              act_in_bytes=4 * hidden, act_out_bytes=4 * hidden))
    for lay in reversed(layers):
        p = lay.params[0]
        grads.append(GradTensor(name=p.name, numel=p.numel, size_bytes=p.size_bytes,
                                dtype="float32", layer=lay.name, layer_index=lay.index))
    return ModelIR(name="tiny", layers=tuple(layers), grad_tensors=tuple(grads),
                   num_params=2 * hidden * hidden, method="workload")


def full_plan() -> Plan:
    """A plan with every section filled, consistent across sections."""
    ir = tiny_model_ir()
    strategies = {
        "fp32": NoSync(),
        "fp16": CastSync(dtype="fp16"),
        "topk-hier": CompressedSync(
            compressor="topk", params={"ratio": 0.01}, uncompressed_dtype="fp16",
            hierarchy="hierarchical", compress_device="cpu",
            steps=(CommStep(level="intra", routine="reduce_scatter"),
                   CommStep(level="inter", routine="alltoall", compressed=True),
                   CommStep(level="inter", routine="allgather", compressed=True),
                   CommStep(level="intra", routine="allgather")),
        ),
    }
    return Plan(
        model=ModelRef.from_model_ir(ir),
        cluster=ClusterRef(name="2x2-mixed", fingerprint="c0ffee", world_size=4),
        layout=Layout(dp=1, pp=2, tp=2, micro_batches=4, micro_batch_size=2,
                      global_batch_size=8, schedule="1f1b",
                      ranks=tuple(RankPlacement(rank=r, node=r // 2, local_rank=r % 2,
                                                device="A100", pp=r // 2, tp=r % 2)
                                  for r in range(4))),
        stages=(Stage(index=0, first_layer=0, last_layer=0, layer_names=("fc1",), ranks=(0, 1),
                      fwd_ms=1.5, bwd_ms=3.0, memory_bytes=1024),
                Stage(index=1, first_layer=1, last_layer=1, ranks=(2, 3), fwd_ms=1.25,
                      bwd_ms=2.5)),
        tensor_parallel=TensorParallel(
            controller=ResizingController(variant="semi", alpha=0.8, gamma_max=0.5),
            groups=(TPGroup(ranks=(0, 1), stage=0,
                            linears=(TPLinearShard(name="fc1", split="column", features=4,
                                                   shard_sizes=(3, 1)),),
                            roles=(TPRankRole(rank=1, role="resize", gamma=0.25),)),
                    TPGroup(ranks=(2, 3), stage=1)),
        ),
        gradient_sync=GradientSync(
            strategies=strategies,
            tensors=(TensorSync(name="fc2.weight", strategy="topk-hier"),
                     TensorSync(name="fc1.weight", strategy="fp16")),
            buckets=(Bucket(tensors=("fc2.weight",), size_bytes=64, strategy="topk-hier"),
                     Bucket(tensors=("fc1.weight",), size_bytes=64, strategy="fp16")),
        ),
        predictions=Predictions(
            iteration_time_ms=12.5,
            breakdown=TimeBreakdown(compute_ms=9.0, comm_ms=4.0, exposed_comm_ms=1.0,
                                    bubble_ms=2.5, compression_ms=0.5),
            memory_per_rank_bytes=(1024, 1024, 2048, 2048),
            bubble_ratio=0.2,
            baselines=(Baseline(name="ddp-fp32", iteration_time_ms=20.0),
                       Baseline(name="megatron-even", iteration_time_ms=15.0,
                                memory_per_rank_bytes=(1, 2, 3, 4))),
        ),
        provenance={"compute": CostSource(source="profiled", detail="profile.json"),
                    "comm.inter": CostSource(source="analytic", detail="alpha-beta")},
        pass_log=(PassLogEntry(name="layout", changed=True, notes=("pp=2 tp=2",)),
                  PassLogEntry(name="fusion", changed=False, duration_ms=0.25)),
    )


def minimal_plan() -> Plan:
    return Plan(model=ModelRef(name="m", fingerprint="f00", num_params=1),
                cluster=ClusterRef(name="c", fingerprint="ba4", world_size=1))


# -- schema and determinism ------------------------------------------------------------------
def test_golden_schema_is_current() -> None:
    assert GOLDEN_SCHEMA.is_file(), f"missing {GOLDEN_SCHEMA}; create it with `{WRITE_SCHEMA}`"
    assert GOLDEN_SCHEMA.read_text(encoding="utf-8") == export_json_schema(), (
        "the Plan JSON Schema changed. Review the change; if the format changed, bump "
        f"SCHEMA_VERSION in hetplan/ir/plan.py. Then run `{WRITE_SCHEMA}` and commit the diff."
    )


def test_write_schema_entry_point(tmp_path: Path) -> None:
    out = tmp_path / "schema.json"
    assert _main(["--write-schema", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == export_json_schema()
    assert json.loads(out.read_text())["properties"]["schema_version"]["const"] == 1


@pytest.mark.parametrize("make", [minimal_plan, full_plan])
def test_json_round_trip_is_unchanged(make) -> None:
    plan = make()
    text = plan.to_json()
    again = Plan.from_json(text, complete=make is full_plan)
    assert again == plan
    assert again.to_json() == text


def test_equal_plans_give_byte_identical_json() -> None:
    a, b = full_plan().to_json(), full_plan().to_json()
    assert a == b
    assert a.endswith("}\n") and not a.endswith("\n\n")
    data = json.loads(a)
    assert list(data) == sorted(data)
    assert data["schema_version"] == SCHEMA_VERSION


def test_dict_order_does_not_change_bytes() -> None:
    plan = full_plan()
    sync = plan.gradient_sync
    assert sync is not None
    reordered = sync.model_copy(update={"strategies": dict(reversed(sync.strategies.items()))})
    other = plan.model_copy(update={"gradient_sync": reordered})
    assert other.to_json() == plan.to_json()


def test_times_are_rounded_so_noise_does_not_change_bytes() -> None:
    a = Predictions(iteration_time_ms=0.1 + 0.2)
    b = Predictions(iteration_time_ms=0.3)
    assert a == b and a.iteration_time_ms == 0.3
    assert Predictions(iteration_time_ms=-0.0).iteration_time_ms.hex() == (0.0).hex()


def test_save_and_load(tmp_path: Path) -> None:
    plan = full_plan()
    path = tmp_path / "plan.json"
    plan.save(path)
    text = path.read_text(encoding="utf-8")
    assert str(tmp_path) not in text
    assert load_plan(path) == plan
    assert load_plan(str(path)).to_json() == text


def test_summary() -> None:
    s = full_plan().summary()
    assert s.layout == "dp=1 pp=2 tp=2"
    assert (s.schedule, s.micro_batches, s.num_stages, s.num_buckets) == ("1f1b", 4, 2, 2)
    assert s.compressed_tensors == 1
    assert s.iteration_time_ms == 12.5 and s.peak_memory_bytes == 2048
    assert (s.best_baseline, s.best_baseline_time_ms) == ("megatron-even", 15.0)
    assert s.speedup == pytest.approx(1.2)
    assert s.to_dict()["speedup"] == pytest.approx(1.2)
    empty = minimal_plan().summary()
    assert empty.layout == "undecided" and empty.speedup is None


def test_workload_summary_from_model_ir() -> None:
    w = WorkloadSummary.from_model_ir(tiny_model_ir())
    assert [x.name for x in w.layers] == ["fc1", "fc2"]
    assert [(g.name, g.layer_index, g.size_bytes) for g in w.grads] == [
        ("fc2.weight", 1, 64), ("fc1.weight", 0, 64)]
    assert w.layers[0].param_bytes == 64 and w.layers[0].fwd_flops == 32


# -- bad input files -------------------------------------------------------------------------
def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"plan file .*nope\.json' does not exist.*hetplan plan"):
        load_plan(tmp_path / "nope.json")


def test_directory_is_not_a_plan(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="is not a regular file"):
        load_plan(tmp_path)


def test_truncated_file(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    text = full_plan().to_json()
    path.write_text(text[: len(text) // 2], encoding="utf-8")
    with pytest.raises(SpecError) as exc:
        load_plan(path)
    msg = str(exc.value)
    assert str(path) in msg and "not valid JSON" in msg and "truncated" in msg
    assert "line " in msg and "column " in msg and "hetplan plan" in msg


def test_invalid_json_reports_line_and_column() -> None:
    with pytest.raises(SpecError, match=r"p\.json: not valid JSON: .* at line 3, column 5"):
        Plan.from_json('{\n  "schema_version": 1,\n    oops\n}', where="p.json")


def test_empty_file() -> None:
    with pytest.raises(SpecError, match="file is empty"):
        Plan.from_json("", where="p.json")


@pytest.mark.parametrize("text, kind", [("[1, 2]", "array"), ('"x"', "string"),
                                        ("null", "null"), ("3", "number")])
def test_non_object(text: str, kind: str) -> None:
    with pytest.raises(SpecError, match=f"a plan is a JSON object, got a JSON {kind}"):
        Plan.from_json(text, where="p.json")


def test_missing_schema_version() -> None:
    data = json.loads(minimal_plan().to_json())
    del data["schema_version"]
    with pytest.raises(SpecError, match="p.json: missing 'schema_version'") as exc:
        Plan.from_json(json.dumps(data), where="p.json")
    assert not isinstance(exc.value, PlanVersionError)


def test_future_version_asks_for_upgrade() -> None:
    data = json.loads(minimal_plan().to_json())
    data["schema_version"] = 2
    data["tool_version"] = "99.0.0"  # as a newer release writes it
    data["some_new_section"] = {}
    with pytest.raises(PlanVersionError) as exc:
        Plan.from_json(json.dumps(data), where="plan.json")
    msg = str(exc.value)
    assert msg.startswith("plan.json was written by a newer hetplan 99.0.0")
    assert "(schema_version 2); this hetplan" in msg
    assert "reads version 1; upgrade hetplan" in msg


def test_a_version_edited_under_this_hetplans_tool_version_is_called_edited() -> None:
    # it said "written by a newer hetplan 0.1.0 ...; this hetplan (0.1.0) ...; upgrade"
    from hetplan import __version__

    data = json.loads(minimal_plan().to_json())
    assert data["tool_version"] == __version__
    data["schema_version"] = 2
    with pytest.raises(PlanVersionError) as exc:
        Plan.from_json(json.dumps(data), where="plan.json")
    msg = str(exc.value)
    assert "the field was edited" in msg and '"schema_version": 1' in msg
    assert "upgrade" not in msg


def test_a_preset_name_of_another_type_is_a_spec_error() -> None:
    from hetplan.ir.cluster import ClusterSpec

    for bad in (None, 3, ["local-cpu"]):
        with pytest.raises(SpecError, match="expected a preset name"):
            ClusterSpec.from_preset(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("version, match", [(0, "schema_version 0, which no hetplan"),
                                            ("1", "must be an integer"),
                                            (True, "must be an integer")])
def test_bad_versions(version: object, match: str) -> None:
    data = json.loads(minimal_plan().to_json())
    data["schema_version"] = version
    with pytest.raises(SpecError, match=match):
        Plan.from_json(json.dumps(data), where="p.json")


def test_unknown_top_level_key_suggests_the_right_one() -> None:
    data = json.loads(minimal_plan().to_json())
    data["pas_log"] = data.pop("pass_log")
    with pytest.raises(SpecError) as exc:
        Plan.from_json(json.dumps(data), where="p.json")
    msg = str(exc.value)
    assert "p.json" in msg and "pas_log" in msg and "pass_log" in msg


def test_unknown_nested_key_names_its_path() -> None:
    data = json.loads(full_plan().to_json())
    data["predictions"]["itteration_time_ms"] = data["predictions"].pop("iteration_time_ms")
    with pytest.raises(SpecError) as exc:
        Plan.from_json(json.dumps(data), where="p.json")
    msg = str(exc.value)
    assert "predictions" in msg and "itteration_time_ms" in msg
    assert "iteration_time_ms" in msg.replace("itteration_time_ms", "")


def test_negative_number_is_rejected() -> None:
    data = json.loads(full_plan().to_json())
    data["stages"][0]["fwd_ms"] = -1.0
    with pytest.raises(SpecError, match="fwd_ms"):
        Plan.from_json(json.dumps(data), where="p.json")


@pytest.mark.parametrize("token", ["NaN", "Infinity"])
def test_non_finite_numbers_are_rejected(token: str) -> None:
    good = '"iteration_time_ms": 12.5'
    text = full_plan().to_json().replace(good, f'"iteration_time_ms": {token}')
    with pytest.raises(SpecError, match="iteration_time_ms"):
        Plan.from_json(text, where="p.json")
    with pytest.raises(ValueError, match="finite"):
        CompressedSync(compressor="topk", params={"ratio": float(token.lower()[:3])})


def test_unknown_strategy_kind_is_rejected() -> None:
    data = json.loads(full_plan().to_json())
    data["gradient_sync"]["strategies"]["fp16"]["kind"] = "zip"
    with pytest.raises(SpecError, match="p.json"):
        Plan.from_json(json.dumps(data), where="p.json")


# -- cross-field rules -----------------------------------------------------------------------
@pytest.mark.parametrize("mutate, match", [
    (lambda d: d["layout"].update(dp=2, ranks=[]),
     "8 ranks, but cluster '2x2-mixed' has world_size 4"),
    (lambda d: d["stages"][1].update(first_layer=0), r"stages\[1\].first_layer: 0, expected 1"),
    (lambda d: d["stages"].pop(), r"stages\[0\].last_layer: 0, but the model has 2 layers"),
    (lambda d: d["stages"][1].update(ranks=[2, 9]), r"stages\[1\].ranks: \[2, 9\], but pipeline"),
    (lambda d: d["tensor_parallel"]["groups"][0]["linears"][0].update(shard_sizes=[3, 2]),
     "sum to 5, expected features=4"),
    (lambda d: d["gradient_sync"]["buckets"][0].update(strategy="gone"),
     "bucket 0 uses strategy 'gone'"),
    (lambda d: d["gradient_sync"]["buckets"][1].update(strategy="fp32"),
     "tensor 'fc1.weight' uses strategy 'fp16' but its bucket 1 uses 'fp32'"),
    (lambda d: d["gradient_sync"]["strategies"]["topk-hier"]["steps"][1].update(
        routine="allreduce"), "cannot carry compressed tensors"),
    (lambda d: d["gradient_sync"]["strategies"]["topk-hier"]["steps"][0].update(level="flat"),
     "hierarchical path has only 'intra' and 'inter'"),
    (lambda d: d["model"]["workload"]["grads"][0].update(layer_index=7),
     "layer_index 7, but there are only 2 layers"),
    (lambda d: d["layout"]["ranks"][3].update(tp=0), "share the .dp,pp,tp. coordinates"),
])
def test_inconsistent_plans_are_rejected(mutate, match: str) -> None:
    data = json.loads(full_plan().to_json())
    mutate(data)
    with pytest.raises(SpecError, match=match):
        Plan.from_json(json.dumps(data), where="p.json")


# -- matching a plan to its model and cluster ------------------------------------------------
class FakeCluster:
    def __init__(self, name: str, fp: str) -> None:
        self.name, self._fp = name, fp

    def fingerprint(self) -> str:
        return self._fp


def test_matching_plan_passes() -> None:
    check_plan_matches(full_plan(), model_ir=tiny_model_ir(),
                       cluster=FakeCluster("2x2-mixed", "c0ffee"), world_size=4)


def test_model_fingerprint_mismatch() -> None:
    plan, other = full_plan(), tiny_model_ir(hidden=8)
    with pytest.raises(PlanMismatchError) as exc:
        check_plan_matches(plan, model_ir=other)
    msg = str(exc.value)
    assert plan.model.fingerprint in msg and other.fingerprint() in msg
    assert "'tiny'" in msg and "re-run `hetplan plan`" in msg


def test_model_mismatch_names_inputs_of_another_sequence_length() -> None:
    """A plan captured at another sequence length (`hetplan plan --seq`) than the model given
    (`hetplan run` builds a zoo model's default inputs): the message names both shapes and
    the option to drop; a batch of another size alone is not named."""
    from dataclasses import replace

    planned = replace(tiny_model_ir(), input_shapes=((1, 32),))
    plan = full_plan().model_copy(update={"model": ModelRef.from_model_ir(planned)})
    with pytest.raises(PlanMismatchError) as exc:
        check_plan_matches(plan, model_ir=replace(planned, input_shapes=((1, 16),)))
    msg = str(exc.value)
    assert "example inputs are 1×32, the model given takes 1×16" in msg
    assert "without --seq" in msg
    with pytest.raises(PlanMismatchError) as exc:
        check_plan_matches(plan, model_ir=replace(planned, input_shapes=((2, 32),)))
    assert "--seq" not in str(exc.value)
    other = replace(tiny_model_ir(hidden=8), input_shapes=((1, 16),))  # another model
    with pytest.raises(PlanMismatchError) as exc:
        check_plan_matches(plan, model_ir=other)
    assert "--seq" not in str(exc.value)


def test_cluster_and_world_size_mismatch_are_reported_together() -> None:
    with pytest.raises(PlanMismatchError) as exc:
        check_plan_matches(full_plan(), cluster=FakeCluster("8xV100", "beef"), world_size=8)
    msg = str(exc.value)
    assert "'2x2-mixed' (fingerprint c0ffee)" in msg and "'8xV100' (fingerprint beef)" in msg
    assert "world size 4" in msg and "runs 8 processes" in msg
    assert "re-run `hetplan plan`" in msg


def test_real_cluster_spec_is_checked_by_fingerprint() -> None:
    spec = ClusterSpec.from_preset("v100-pcie-8x8")
    ref = ClusterRef.from_cluster(spec)
    assert (ref.name, ref.fingerprint, ref.world_size) == (
        spec.name, spec.fingerprint(), spec.world_size)
    plan = minimal_plan().model_copy(update={"cluster": ref})
    check_plan_matches(plan, cluster=spec, world_size=spec.world_size)
    other = ClusterSpec.from_preset("a100-nvlink-8x8")
    with pytest.raises(PlanMismatchError, match=other.fingerprint()):
        check_plan_matches(plan, cluster=other)
