"""Tests of the Espresso benchmark converter (hetplan.ir.workload) and workload JSON files.

Expectations come from the raw benchmark file (read here with ``json``) or are written out by
hand, never from the converter's own output.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hetplan.errors import PlanVersionError, SpecError
from hetplan.ir.model import ModelIR
from hetplan.ir.workload import espresso_workloads, layer_of_tensor, workload_from_gradients

REPO = Path(__file__).resolve().parents[2]
ESPRESSO = REPO / "data" / "espresso_models.json"
SECTIONS = ("models", "extra_models_not_selectable_from_cli")
EXPECTED_MODELS = {
    "vgg16", "resnet101", "ugatit", "bert", "gpt2", "lstm", "resnet50", "bert_large", "ncf",
}


def _bench() -> dict[str, Any]:
    if not ESPRESSO.is_file():
        pytest.skip(f"Espresso benchmark file not found at {ESPRESSO.resolve()}")
    return json.loads(ESPRESSO.read_text())


@pytest.fixture(scope="module")
def bench() -> dict[str, dict[str, Any]]:
    """Model name → its raw entry in the benchmark file."""
    data = _bench()
    return {name: m for s in SECTIONS for name, m in data[s].items()}


@pytest.fixture(scope="module")
def raw() -> dict[str, ModelIR]:
    _bench()
    return espresso_workloads(ESPRESSO)


@pytest.fixture(scope="module")
def effective() -> dict[str, ModelIR]:
    _bench()
    return espresso_workloads(ESPRESSO, gaps="effective")


# --------------------------------------------------------------------------------------
# the converter against the benchmark file
# --------------------------------------------------------------------------------------
def test_all_models_converted(bench: dict[str, Any], raw: dict[str, ModelIR]) -> None:
    assert set(bench) == EXPECTED_MODELS
    assert set(raw) == EXPECTED_MODELS


def test_core_section_only() -> None:
    _bench()
    only = espresso_workloads(ESPRESSO, include_extra=False)
    assert set(only) == {"vgg16", "resnet101", "ugatit", "bert", "gpt2", "lstm"}


@pytest.mark.parametrize("name", sorted(EXPECTED_MODELS))
def test_tensors_match_file(name: str, bench: dict[str, Any], raw: dict[str, ModelIR]) -> None:
    m, ir = bench[name], raw[name]
    grads = ir.grad_tensors
    assert len(grads) == m["num_tensors"] == len(m["tensor_names"])
    assert [g.name for g in grads] == m["tensor_names"]
    assert [g.numel for g in grads] == [int(x) for x in m["tensor_sizes"]]
    assert sum(g.numel for g in grads) == sum(m["tensor_sizes"]) == m["total_elements"]
    assert ir.num_params == m["total_elements"]
    assert ir.grad_bytes == m["total_bytes_fp32"]
    assert all(g.size_bytes == 4 * g.numel and g.dtype == "float32" for g in grads)
    assert ir.method == "workload"


@pytest.mark.parametrize("name", sorted(EXPECTED_MODELS))
def test_gaps_match_file(
    name: str,
    bench: dict[str, Any],
    raw: dict[str, ModelIR],
    effective: dict[str, ModelIR],
) -> None:
    m = bench[name]
    assert [g.ready_gap_us for g in raw[name].grad_tensors] == [float(x) for x in m["ready_gaps"]]
    assert [g.ready_gap_us for g in effective[name].grad_tensors] == [
        float(x) for x in m["ready_gaps_effective"]
    ]
    # per-layer measured backprop adds up to the file's totals
    raw_sum = sum(lay.measured_bwd_us or 0.0 for lay in raw[name].layers)
    eff_sum = sum(lay.measured_bwd_us or 0.0 for lay in effective[name].layers)
    assert raw_sum == pytest.approx(m["sum_raw_gaps_us"])
    assert eff_sum == pytest.approx(m["sum_effective_gaps_us"])


def test_raw_and_effective_gaps_differ() -> None:
    _bench()
    raw = espresso_workloads(ESPRESSO, gaps="raw")["vgg16"]
    eff = espresso_workloads(ESPRESSO, gaps="effective")["vgg16"]
    assert [g.ready_gap_us for g in raw.grad_tensors] != [g.ready_gap_us for g in eff.grad_tensors]


# --------------------------------------------------------------------------------------
# layers
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("tensor", "layer"),
    [
        ("layer4.2.bn3.weight", "layer4.2"),
        ("fc.bias", "fc"),
        ("bert.encoder.layer.11.output.dense.bias", "bert.encoder.layer.11"),
        ("transformer.wte.weight", "transformer.wte"),
        ("transformer.h.0.ln_1.bias", "transformer.h.0"),
        ("features.0.weight", "features.0"),
        ("conv1.weight", "conv1"),
        ("bias", "bias"),
    ],
)
def test_layer_of_tensor(tensor: str, layer: str) -> None:
    assert layer_of_tensor(tensor) == layer


def test_resnet101_layers_in_forward_order(raw: dict[str, ModelIR]) -> None:
    ir = raw["resnet101"]
    # torchvision ResNet-101: stem, then 3 / 4 / 23 / 3 bottleneck blocks, then fc.
    blocks = [f"layer{i}.{j}" for i, n in ((1, 3), (2, 4), (3, 23), (4, 3)) for j in range(n)]
    assert [lay.name for lay in ir.layers] == ["conv1", "bn1", *blocks, "fc"]
    assert [lay.index for lay in ir.layers] == list(range(len(ir.layers)))
    assert ir.layers[0].name == "conv1"
    assert ir.layers[-1].name == "fc"


@pytest.mark.parametrize(
    ("name", "first", "last"),
    [
        ("gpt2", "transformer.wte", "transformer.ln_f"),
        ("bert", "bert.embeddings.word_embeddings", "qa_outputs"),
        ("vgg16", "features.0", "classifier.6"),
    ],
)
def test_first_and_last_layer(name: str, first: str, last: str, raw: dict[str, ModelIR]) -> None:
    layers = raw[name].layers
    assert (layers[0].name, layers[-1].name) == (first, last)


@pytest.mark.parametrize("name", ["resnet101", "gpt2", "bert", "vgg16"])
def test_grads_point_at_their_layer(name: str, raw: dict[str, ModelIR]) -> None:
    ir = raw[name]
    for g in ir.grad_tensors:
        layer = ir.layers[g.layer_index]
        assert layer.name == g.layer
        assert g.name.startswith(layer.name + ".")
        assert g.name in {p.name for p in layer.params}
    # backward order visits layers from the last to the first
    idx = [g.layer_index for g in ir.grad_tensors]
    assert idx == sorted(idx, reverse=True)
    assert idx[0] == len(ir.layers) - 1 and idx[-1] == 0


# --------------------------------------------------------------------------------------
# workload JSON
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(EXPECTED_MODELS))
def test_json_round_trip(name: str, raw: dict[str, ModelIR], tmp_path: Path) -> None:
    ir = raw[name]
    text = ir.to_json()
    back = ModelIR.from_json(text)
    assert back == ir
    assert back.to_json() == text
    path = tmp_path / f"{name}.json"
    ir.save(path)
    data = path.read_bytes()
    loaded = ModelIR.load(path)
    loaded.save(path)
    assert path.read_bytes() == data
    assert loaded.fingerprint() == ir.fingerprint()


def _small() -> ModelIR:
    return workload_from_gradients(
        "small",
        ["head.bias", "head.weight", "blocks.1.w", "blocks.0.w", "emb.weight"],
        [4, 16, 8, 8, 32],
        [0.0, 5.0, 10.0, 10.0, 2.5],
    )


def test_workload_from_gradients_small() -> None:
    ir = _small()
    assert [lay.name for lay in ir.layers] == ["emb", "blocks.0", "blocks.1", "head"]
    assert ir.num_params == 68
    assert ir.layer("head").measured_bwd_us == pytest.approx(5.0)
    assert [p.name for p in ir.layer("head").params] == ["head.bias", "head.weight"]


def _dump(tmp_path: Path, data: dict[str, Any]) -> Path:
    path = tmp_path / "w.json"
    path.write_text(json.dumps(data))
    return path


def test_truncated_file(tmp_path: Path) -> None:
    text = _small().to_json()
    path = tmp_path / "w.json"
    path.write_text(text[: len(text) // 2])
    with pytest.raises(SpecError, match="not valid JSON"):
        ModelIR.load(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="does not exist"):
        ModelIR.load(tmp_path / "nope.json")


def test_not_an_object() -> None:
    with pytest.raises(SpecError, match="JSON object"):
        ModelIR.from_json("[1, 2]")


@pytest.mark.parametrize(
    ("where", "key", "typo", "path"),
    [
        ((), "num_params", "num_paramz", "num_paramz"),
        (("grad_tensors", 0), "layer_index", "layer_indx", "grad_tensors[0].layer_indx"),
        (("layers", 0, "params", 0), "shape", "shap", "layers[0].params[0].shap"),
    ],
    ids=["top-level", "grad", "param"],
)
def test_unknown_key_suggests(
    tmp_path: Path, where: tuple[str | int, ...], key: str, typo: str, path: str
) -> None:
    data = json.loads(_small().to_json())
    obj = data
    for step in where:
        obj = obj[step]
    obj[typo] = obj.pop(key)
    with pytest.raises(SpecError) as info:
        ModelIR.load(_dump(tmp_path, data))
    msg = str(info.value)
    assert path in msg
    assert f"did you mean '{key}'" in msg
    assert "w.json" in msg


def test_newer_schema_version(tmp_path: Path) -> None:
    data = json.loads(_small().to_json())
    data["schema_version"] = 99
    with pytest.raises(PlanVersionError, match="99"):
        ModelIR.load(_dump(tmp_path, data))


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("name", "nonexistent.weight", "belongs to no parameter"),
        ("layer", "nonexistent", "claims layer 'nonexistent'"),
        ("layer_index", 99, "#99"),
    ],
)
def test_grad_with_unknown_layer_or_param(
    tmp_path: Path, field: str, value: Any, needle: str
) -> None:
    data = json.loads(_small().to_json())
    data["grad_tensors"][0][field] = value
    with pytest.raises(SpecError, match="gradient") as info:
        ModelIR.load(_dump(tmp_path, data))
    assert needle in str(info.value)
    assert "w.json" in str(info.value)


def test_num_params_mismatch(tmp_path: Path) -> None:
    data = json.loads(_small().to_json())
    data["num_params"] += 1
    with pytest.raises(SpecError, match="num_params"):
        ModelIR.load(_dump(tmp_path, data))


@pytest.mark.parametrize(
    ("names", "numels", "gaps"),
    [
        (["a.w", "b.w"], [1], [0.0, 1.0]),
        (["a.w", "b.w"], [1, 2], [0.0]),
        (["a.w"], [1, 2], [0.0, 1.0]),
    ],
)
def test_mismatched_list_lengths(names: list[str], numels: list[int], gaps: list[float]) -> None:
    with pytest.raises(SpecError, match="same length"):
        workload_from_gradients("bad", names, numels, gaps)


@pytest.mark.parametrize(
    ("numels", "gaps"), [([0, 1], [0.0, 1.0]), ([1, 1], [0.0, -1.0])], ids=["size", "gap"]
)
def test_bad_sizes_or_gaps(numels: list[int], gaps: list[float]) -> None:
    with pytest.raises(SpecError, match="positive"):
        workload_from_gradients("bad", ["a.w", "b.w"], numels, gaps)


def test_empty_workload() -> None:
    with pytest.raises(SpecError, match="no gradient tensors"):
        workload_from_gradients("empty", [], [], [])


def test_missing_benchmark_file(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="does not exist"):
        espresso_workloads(tmp_path / "nope.json")


def test_benchmark_file_without_models(tmp_path: Path) -> None:
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"constants": {}}))
    with pytest.raises(SpecError, match="'models'"):
        espresso_workloads(path)


@pytest.mark.parametrize("content, expected", [
    (b"\xd7\xff" * 50, "is not UTF-8 text"),
    (b'{"models": []}', "models: expected a mapping of model names to models, got list"),
    (b'{"models": {"x": 3}}', "models.x: expected a mapping with tensor_names, tensor_sizes "
                              "and ready_gaps, got int"),
    (b'{"models": {"x": {"tensor_names": ["a"], "tensor_sizes": [[1]], "ready_gaps": [0]}}}',
     "model 'x': tensor_names must be a list of names, tensor_sizes of integers"),
    (b'{"constants": [4], "models": {}}', "constants: expected a mapping"),
])
def test_a_malformed_benchmark_file_is_named(tmp_path: Path, content: bytes,
                                             expected: str) -> None:
    # before: UnicodeDecodeError, AttributeError or TypeError (`hetplan workload convert`
    # said "internal error")
    path = tmp_path / "bench.json"
    path.write_bytes(content)
    with pytest.raises(SpecError, match=expected):
        espresso_workloads(path)
