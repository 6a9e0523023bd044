"""Plan reports: ``build_report`` (inspect), ``explain`` and ``diff_plans``.

Expected numbers are worked out by hand from a plan written out literally below (``HAND``),
or, for ``explain``, by editing the plan by hand in the test and re-predicting it with
``hetplan.simulate`` (a separate entry point from the explainer).

Golden files: ``tests/golden/inspect_small.txt`` and ``tests/golden/explain_small.txt`` are
reviewed snapshots of the text output for a small deterministic plan (the checked-in
workload ``tests/golden/inspect_small.workload.json`` compiled on ``mixed-generations`` with
dp=8 pp=2 tp=2), rendered without colour at 100 columns. After a reviewed change of the output
regenerate them with::

    HETPLAN_UPDATE_GOLDEN=1 python -m pytest tests/unit/test_report.py -k golden
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hetplan.errors import SpecError
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.model import ModelIR
from hetplan.ir.plan import (
    Baseline,
    Bucket,
    CastSync,
    ClusterRef,
    CompressedSync,
    CostSource,
    GradCost,
    GradientSync,
    LayerCost,
    Layout,
    ModelRef,
    NoSync,
    Plan,
    Predictions,
    Stage,
    TensorParallel,
    TPGroup,
    TPLinearShard,
    TPRankRole,
    WorkloadSummary,
)
from hetplan.optimizer.compile import compile as compile_plan
from hetplan.cost_models.predict import simulate
from hetplan.report.diff import diff_plans, diff_text
from hetplan.report.explain import explain
from hetplan.report.inspect import (
    SECTIONS,
    build_report,
    describe_strategy,
    select_sections,
)
from hetplan.report.render import render_text

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
GiB = 2**30
MiB = 2**20

Golden = Callable[[str, str], None]  # the `golden` fixture (tests/conftest.py)


# --------------------------------------------------------------------------------------
# a plan written out by hand
# --------------------------------------------------------------------------------------
def duo_cluster() -> ClusterSpec:
    """Node ``big``: 2 devices of 16 GiB; node ``small``: 2 devices of 8 GiB."""
    def node(name: str) -> dict[str, object]:
        return {"name": name, "devices": [{"type": name, "count": 2}], "cpu_cores": 4,
                "intra_link": {"kind": "pcie", "bandwidth_gbps": 100, "latency_us": 5}}

    def device(mem: float) -> dict[str, object]:
        return {"memory_gib": mem, "peak_tflops": {"fp32": 10.0}, "mem_bandwidth_gb_s": 1000.0}

    return ClusterSpec.from_dict({
        "name": "duo",
        "nodes": [node("big"), node("small")],
        "inter_node": {"kind": "ethernet", "bandwidth_gbps": 100, "latency_us": 10},
        "device_types": {"big": device(16), "small": device(8)},
    })


def hand_plan() -> Plan:
    """dp=1 pp=2 tp=2: stage 0 (layers 0–1) on ranks 0, 1 (big); stage 1 on ranks 2, 3."""
    layers = (
        LayerCost(name="L0", param_bytes=30_000_000, tp_split_bytes=20_000_000, tp_pairs=1),
        LayerCost(name="L1", param_bytes=2_001_000, tp_split_bytes=1_000_000, tp_pairs=1),
        LayerCost(name="L2", param_bytes=4_000_500),
        LayerCost(name="L3", param_bytes=8_000_000),
    )
    grads = (
        GradCost(name="L3.w", size_bytes=8_000_000, layer_index=3),
        GradCost(name="L2.w", size_bytes=4_000_000, layer_index=2),
        GradCost(name="L2.b", size_bytes=500, layer_index=2),
        GradCost(name="L1.w", size_bytes=2_000_000, layer_index=1),
        GradCost(name="L1.b", size_bytes=1_000, layer_index=1),
        GradCost(name="L0.w", size_bytes=30_000_000, layer_index=0),
    )
    sync = GradientSync(
        strategies={"fp32": NoSync(),
                    "topk": CompressedSync(compressor="topk", params={"ratio": 0.01})},
        buckets=(
            Bucket(tensors=("L3.w",), size_bytes=8_000_000, strategy="fp32"),
            Bucket(tensors=("L2.w",), size_bytes=4_000_000, strategy="topk"),
            Bucket(tensors=("L1.w", "L1.b"), size_bytes=2_001_000, strategy="fp32"),
            Bucket(tensors=("L0.w",), size_bytes=30_000_000, strategy="topk"),
        ),
    )
    tp = TensorParallel(groups=(
        TPGroup(ranks=(0, 1), stage=0,
                linears=(TPLinearShard(name="L0.fc", split="column", features=100,
                                       shard_sizes=(60, 40)),
                         TPLinearShard(name="L1.fc", split="row", features=50,
                                       shard_sizes=(30, 20))),
                roles=(TPRankRole(rank=1, role="resize", gamma=0.1),)),
        TPGroup(ranks=(2, 3), stage=1),
    ))
    return Plan(
        model=ModelRef(name="hand", fingerprint="f00d", num_params=11_000_000,
                       workload=WorkloadSummary(layers=layers, grads=grads)),
        cluster=ClusterRef.from_cluster(duo_cluster()),
        layout=Layout(dp=1, pp=2, tp=2, micro_batches=4, micro_batch_size=2,
                      global_batch_size=8),
        stages=(
            Stage(index=0, first_layer=0, last_layer=1, ranks=(0, 1), fwd_ms=1.0, bwd_ms=2.0),
            Stage(index=1, first_layer=2, last_layer=3, ranks=(2, 3), fwd_ms=1.5, bwd_ms=3.5),
        ),
        tensor_parallel=tp,
        gradient_sync=sync,
        predictions=Predictions(
            iteration_time_ms=10.0,
            memory_per_rank_bytes=(13 * GiB, 5 * GiB, 3 * GiB, 7 * GiB),
            bubble_ratio=0.3,
            baselines=(Baseline(name="ddp", iteration_time_ms=25.0),
                       Baseline(name="fast", iteration_time_ms=8.0)),
        ),
        provenance={"compute": CostSource(source="analytic", detail="roofline"),
                    "comm": CostSource(source="profiled")},
    )


@pytest.fixture(scope="module")
def hand() -> dict[str, object]:
    return build_report(hand_plan())


def test_report_has_every_section_and_is_plain_json(hand: dict[str, object]) -> None:
    assert set(SECTIONS) <= set(hand)
    text = json.dumps(hand, sort_keys=True)
    assert json.loads(text) == hand
    assert json.dumps(build_report(hand_plan()), sort_keys=True) == text  # deterministic
    assert select_sections(hand, ["memory"]) == {"memory": hand["memory"]}


def test_layout_and_stages(hand: dict[str, object]) -> None:
    lay = hand["layout"]
    assert (lay["dp"], lay["pp"], lay["tp"], lay["micro_batches"]) == (1, 2, 2, 4)
    assert lay["device_types"] == {"big": 2, "small": 2} and lay["heterogeneous"] is True
    s0, s1 = hand["stages"]
    assert s0["device_types"] == {"big": 2} and s1["device_types"] == {"small": 2}
    assert (s0["step_ms"], s1["step_ms"]) == (3.0, 5.0)
    assert s0["share_of_slowest"] == pytest.approx(3 / 5) and s1["slowest"]
    assert (s0["first_layer_name"], s0["last_layer_name"]) == ("L0", "L1")


def test_tp_shares_by_split_features(hand: dict[str, object]) -> None:
    tp = hand["tp"]
    assert tp["degree"] == 2 and tp["num_groups"] == 2
    g0, g1 = tp["groups"]
    # (60 + 30) / 150 and (40 + 20) / 150; the stage's split bytes 20e6 + 1e6
    assert g0["shares"] == pytest.approx([0.6, 0.4]) and not g0["even"]
    assert g0["uneven_linears"] == 2 and g0["roles"] == ["1:resize"]
    assert g0["shard_bytes"] == [12_600_000, 8_400_000]
    assert g1["shares"] == [0.5, 0.5] and g1["even"] and g1["device_types"] == ["small"] * 2


def test_sync_grouped_by_strategy(hand: dict[str, object]) -> None:
    sync = hand["sync"]
    rows = {r["name"]: r for r in sync["strategies"]}
    assert (rows["fp32"]["tensors"], rows["fp32"]["bytes"], rows["fp32"]["buckets"]) == \
        (3, 8_000_000 + 2_000_000 + 1_000, 2)
    assert (rows["topk"]["tensors"], rows["topk"]["bytes"], rows["topk"]["buckets"]) == \
        (2, 34_000_000, 2)
    assert rows["topk"]["kind"] == "compressed" and "ratio=0.01" in rows["topk"]["description"]
    assert sync["implicit_fp32_tensors"] == 1 and sync["implicit_fp32_bytes"] == 500
    assert sync["by_kind"] == {"none": {"tensors": 3, "bytes": 10_001_000},
                               "compressed": {"tensors": 2, "bytes": 34_000_000}}
    b = sync["buckets"]
    assert (b["count"], b["min_bytes"], b["median_bytes"], b["max_bytes"]) == \
        (4, 2_001_000, 6_000_000, 30_000_000)
    assert [c["count"] for c in b["size_classes"]] == [0, 3, 0, 1]
    assert b["per_stage"] == [{"stage": 0, "count": 2}, {"stage": 1, "count": 2}]
    assert (b["largest"]["index"], b["largest"]["stage"]) == (3, 0)


def test_memory_headroom_per_stage_and_device_type(hand: dict[str, object]) -> None:
    mem = hand["memory"]
    usable_big, usable_small = int(16 * GiB * 0.9), int(8 * GiB * 0.9)
    rows = {(r["stage"], r["device_type"]): r for r in mem["per_stage"]}
    big, small = rows[(0, "big")], rows[(1, "small")]
    assert (big["max_bytes"], big["peak_rank"], big["usable_bytes"]) == (13 * GiB, 0, usable_big)
    assert big["headroom_bytes"] == usable_big - 13 * GiB
    assert small["used_fraction"] == pytest.approx(7 * GiB / usable_small, abs=1e-6)
    assert [r["device_type"] for r in mem["per_device_type"]] == ["big", "small"]
    # 90 % of usable: 12.96 GiB on big, 6.48 GiB on small
    assert mem["near_oom_ranks"] == [0, 3]
    assert mem["peak"]["peak_rank"] == 0


def test_predictions_and_warnings(hand: dict[str, object]) -> None:
    pred = hand["predictions"]
    base = {b["name"]: b for b in pred["baselines"]}
    assert base["ddp"]["speedup"] == pytest.approx(2.5) and base["ddp"]["beaten"]
    assert base["ddp"]["saved_ms"] == pytest.approx(15.0)
    assert base["fast"]["speedup"] == pytest.approx(0.8) and not base["fast"]["beaten"]
    assert hand["provenance"]["analytic"] == ["compute"]
    kinds = [w["kind"] for w in hand["warnings"]]
    assert kinds == ["analytic-costs", "near-oom", "heavy-bubble", "slower-than-baseline"]
    assert "fast" in hand["warnings"][-1]["message"]


def test_undecided_plan_reports_without_failing() -> None:
    plan = Plan(model=ModelRef(name="m", fingerprint="ab", num_params=1),
                cluster=ClusterRef(name="c", fingerprint="cd", world_size=2))
    report = build_report(plan)
    assert report["layout"]["decided"] is False and report["stages"] == []
    assert [w["kind"] for w in report["warnings"]] == ["no-predictions"]
    text = render_text(report)
    assert "layout: undecided" in text and "predictions: none" in text


def test_render_text_shows_the_numbers(hand: dict[str, object]) -> None:
    text = " ".join(render_text(hand, width=120).split())
    assert "layout: dp=1 pp=2 tp=2, schedule 1f1b, 4 micro-batches of 2" in text
    assert "2× big" in text and "2× small" in text
    assert "60.0% / 40.0%" in text
    assert "baseline ddp: 25.000 ms (2.50×) beaten by 15.000 ms" in text
    assert "baseline fast: 8.000 ms (0.80×) faster than the plan by 2.000 ms" in text
    only = render_text(hand, sections=["memory"])
    assert "memory per rank" in only and "pipeline stages" not in only


# --------------------------------------------------------------------------------------
# a small compiled plan: explain, diff, golden text
# --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small() -> Plan:
    ir = ModelIR.load(GOLDEN / "inspect_small.workload.json")
    plan = compile_plan(ir, "mixed-generations", batch_size=64, dp=8, pp=2, tp=2)
    return plan.model_copy(update={"tool_version": "0.0.0+golden"})


def _edit(plan: Plan, **update: object) -> Plan:
    return Plan.model_validate(plan.model_copy(update=update).model_dump())


def _with_buckets(plan: Plan, buckets: list[Bucket],
                  extra_strategies: dict[str, Any] | None = None) -> Plan:
    assert plan.gradient_sync is not None
    strategies = {**plan.gradient_sync.strategies, **(extra_strategies or {})}
    sync = plan.gradient_sync.model_copy(update={"buckets": tuple(buckets),
                                                 "strategies": strategies})
    return _edit(plan, gradient_sync=sync)


def _alt(exp: object, prefix: str) -> object:
    found = [a for a in exp.alternatives if a.name.startswith(prefix)]  # type: ignore[attr-defined]
    assert len(found) == 1, [a.name for a in exp.alternatives]  # type: ignore[attr-defined]
    return found[0]


def _sizes(plan: Plan) -> dict[str, int]:
    assert plan.model.workload is not None
    return {g.name: g.size_bytes for g in plan.model.workload.grads}


def test_explain_bucket_split_and_merge(small: Plan) -> None:
    exp = explain(small, "bucket:0")
    assert exp.kind == "bucket"
    assert exp.current_ms == pytest.approx(simulate(small).iteration_time_ms, abs=1e-6)
    assert small.gradient_sync is not None
    b0 = small.gradient_sync.buckets[0]
    size = _sizes(small)
    split = [Bucket(tensors=(t,), size_bytes=size[t], strategy=b0.strategy) for t in b0.tensors]
    by_hand = _with_buckets(small, split + list(small.gradient_sync.buckets[1:]))
    alt = _alt(exp, "split into")
    assert alt.iteration_time_ms == pytest.approx(simulate(by_hand).iteration_time_ms, abs=1e-6)
    # the two buckets are in different stages: nothing to merge with
    assert len(exp.alternatives) == 1

    # cut bucket 0 in two by hand: merging bucket:0 with bucket:1 gives the original back
    half = len(b0.tensors) // 2
    parts = [b0.tensors[:half], b0.tensors[half:]]
    cut = _with_buckets(small, [
        Bucket(tensors=p, size_bytes=sum(size[t] for t in p), strategy=b0.strategy)
        for p in parts] + list(small.gradient_sync.buckets[1:]))
    merged = _alt(explain(cut, "bucket:0"), "merged with bucket:1")
    assert merged.iteration_time_ms == pytest.approx(simulate(small).iteration_time_ms, abs=1e-6)


def test_explain_tensor_alone_with_fp32(small: Plan) -> None:
    assert small.gradient_sync is not None
    b0 = small.gradient_sync.buckets[0]
    name = b0.tensors[1]
    exp = explain(small, name)
    assert exp.kind == "tensor"
    rest = tuple(t for t in b0.tensors if t != name)
    size = _sizes(small)
    # the plan's strategies are the passes' routings (e.g. "fp32#63"); the alternative adds a
    # plain flat fp32 allreduce under the name "fp32"
    assert "fp32" not in small.gradient_sync.strategies
    by_hand = _with_buckets(small, [
        Bucket(tensors=rest, size_bytes=b0.size_bytes - size[name], strategy=b0.strategy),
        *small.gradient_sync.buckets[1:],
        Bucket(tensors=(name,), size_bytes=size[name], strategy="fp32"),
    ], extra_strategies={"fp32": NoSync()})
    alt = _alt(exp, "alone, fp32 allreduce")
    assert alt.iteration_time_ms == pytest.approx(simulate(by_hand).iteration_time_ms, abs=1e-6)
    assert alt.delta_ms == pytest.approx(alt.iteration_time_ms - exp.current_ms, abs=1e-6)
    assert f"bucket:0, {len(b0.tensors)} tensor(s)" in exp.text


def test_explain_stage_boundary_moves(small: Plan) -> None:
    s0, s1 = small.stages
    assert small.model.workload is not None
    names = [x.name for x in small.model.workload.layers]
    exp = explain(small, "stage:1")
    assert explain(small, "stage:0-1").alternatives == exp.alternatives
    # move the boundary one layer to the right: stage 1's first layer joins stage 0
    b = s1.first_layer + 1
    stages = (
        Stage(index=0, first_layer=0, last_layer=b - 1, ranks=s0.ranks,
              layer_names=tuple(names[:b])),
        Stage(index=1, first_layer=b, last_layer=s1.last_layer, ranks=s1.ranks,
              layer_names=tuple(names[b:])),
    )
    layer_of = {g.name: g.layer_index for g in small.model.workload.grads}
    size = _sizes(small)
    assert small.gradient_sync is not None
    buckets = []
    for bucket in small.gradient_sync.buckets:
        for part in ([t for t in bucket.tensors if layer_of[t] < b],
                     [t for t in bucket.tensors if layer_of[t] >= b]):
            if part:
                buckets.append(Bucket(tensors=tuple(part), strategy=bucket.strategy,
                                      size_bytes=sum(size[t] for t in part)))
    by_hand = _edit(small, stages=stages,
                    gradient_sync=small.gradient_sync.model_copy(
                        update={"buckets": tuple(buckets)}))
    alt = _alt(exp, f"move {names[s1.first_layer]} from stage 1 to stage 0")
    assert alt.iteration_time_ms == pytest.approx(simulate(by_hand).iteration_time_ms, abs=1e-6)
    assert len(exp.alternatives) == 2


def test_explain_rank(small: Plan) -> None:
    exp = explain(small, "rank:17")
    facts = dict(exp.facts)
    spec = ClusterSpec.from_preset("mixed-generations")
    assert spec.devices()[17].type in facts["device"]
    assert small.predictions is not None
    mem = small.predictions.memory_per_rank_bytes[17]
    assert facts["memory"].startswith(f"{mem / MiB:.2f} MiB")
    assert "stage 1" in facts["coordinates"]
    assert exp.alternatives == ()
    assert json.loads(json.dumps(exp.to_dict()))["kind"] == "rank"


def test_explain_rank_names_both_stages_a_chimera_rank_holds() -> None:
    """A Chimera rank holds stage r of the down pipeline and stage P-1-r of the up one; the
    rank's coordinates name both (they named one)."""
    from hetplan.optimizer.compile import model_ir

    plan = compile_plan(model_ir("gpt-test"), "local-cpu", batch_size=8, pp=2, dp=2,
                        schedule="chimera", zero_stage=0)
    assert plan.stages is not None and len(plan.stages) == 2
    coords = dict(explain(plan, "rank:0").facts)["coordinates"]
    up = plan.stages[1]
    assert coords.startswith("dp=0 pp=0 tp=0; stage 0 (layers 0–")
    assert (f"and stage 1 (layers {up.first_layer}–{up.last_layer}) of the up pipeline "
            "(Chimera)") in coords
    plain = compile_plan(model_ir("gpt-test"), "local-cpu", batch_size=8, pp=2, dp=2,
                         schedule="1f1b", zero_stage=0)
    assert "up pipeline" not in dict(explain(plain, "rank:0").facts)["coordinates"]


@pytest.mark.parametrize(("target", "needles"), [
    ("blocks.0.attn.weight", ["did you mean", "blocks.0.attn.qkv.weight"]),
    ("bucket:9", ["2 bucket(s)", "bucket:0 … bucket:1"]),
    ("rank:32", ["32 rank(s)"]),
    ("stage:0-2", ["consecutive stages"]),
    ("stage:x", ["integer"]),
])
def test_explain_unknown_targets(small: Plan, target: str, needles: list[str]) -> None:
    with pytest.raises(SpecError) as info:
        explain(small, target)
    for needle in needles:
        assert needle in str(info.value)


def test_diff_of_a_plan_with_itself(small: Plan) -> None:
    d = diff_plans(small, small)
    assert d["identical"] and d["changed_sections"] == []
    assert diff_text(d).strip() == "the plans are identical"


def test_diff_after_editing_buckets_and_strategy(small: Plan) -> None:
    assert small.gradient_sync is not None and small.predictions is not None
    b0, b1 = small.gradient_sync.buckets
    strategies = {**small.gradient_sync.strategies, "fp16": CastSync()}
    sync = small.gradient_sync.model_copy(update={
        "strategies": strategies,
        "buckets": (b0.model_copy(update={"strategy": "fp16"}), b1),
    })
    edited = _edit(small, gradient_sync=sync)
    edited = _edit(edited, predictions=simulate(edited))
    d = diff_plans(small, edited)
    assert d["changed_sections"] == ["sync", "predictions"]
    assert d["sync"]["strategy_changes"]["count"] == len(b0.tensors)
    assert d["sync"]["regrouped_tensors"]["count"] == 0
    it = d["predictions"]["iteration_time_ms"]
    assert edited.predictions is not None
    expected = edited.predictions.iteration_time_ms - small.predictions.iteration_time_ms
    assert it["delta"] == pytest.approx(expected, abs=1e-6)
    text = diff_text(d)
    assert "change strategy" in text and "iteration time" in text
    # each plan's strategy on its own line: "a → b" read as one more step of a's path
    old = describe_strategy(small.gradient_sync.strategies[b0.strategy])
    assert f":\n      a: {old}\n      b: cast to fp16; " in text


def test_diff_of_layouts(small: Plan) -> None:
    ir = ModelIR.load(GOLDEN / "inspect_small.workload.json")
    other = compile_plan(ir, "mixed-generations", batch_size=64, dp=16, pp=2, tp=1)
    d = diff_plans(small, other)
    assert d["layout"]["tp"] == {"a": 2, "b": 1, "changed": True, "delta": -1,
                                 "relative": -0.5}
    assert d["tp"]["groups"]["b"] == 0
    assert not d["model"]["fingerprint"]["changed"]


# --------------------------------------------------------------------------------------
# golden text
# --------------------------------------------------------------------------------------
def test_golden_inspect_text(small: Plan, golden: Golden) -> None:
    golden("inspect_small.txt", render_text(build_report(small), width=100))


def test_golden_explain_text(small: Plan, golden: Golden) -> None:
    assert small.gradient_sync is not None
    tensor = small.gradient_sync.buckets[0].tensors[1]
    text = "\n".join(explain(small, t).text for t in ("bucket:0", "stage:1", "rank:17", tensor))
    golden("explain_small.txt", text)


def test_a_compressed_strategy_names_where_it_compresses_in_words() -> None:
    """It read 'topk(ratio=0.01) on gpu/gpu', also on a CPU-only cluster: the plan's 'gpu'
    is the rank's own device and 'cpu' the host's CPU."""
    def text(comp: str, decomp: str) -> str:
        return describe_strategy(CompressedSync.model_validate(
            {"compressor": "topk", "params": {"ratio": 0.01}, "compress_device": comp,
             "decompress_device": decomp}))

    assert text("gpu", "gpu") == ("topk(ratio=0.01) on the device, error feedback; "
                                  "flat allgather*")
    assert text("cpu", "cpu").startswith("topk(ratio=0.01) on the host CPU, ")
    assert text("gpu", "cpu").startswith(
        "topk(ratio=0.01) compressed on the device, decompressed on the host CPU, ")
    assert "gpu" not in text("gpu", "cpu")
