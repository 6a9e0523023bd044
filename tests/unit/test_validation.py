"""Tests of hetplan.ir.validation: reading YAML/JSON files and formatting pydantic errors."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from hetplan.errors import SpecError
from hetplan.ir.validation import (
    did_you_mean,
    format_validation_error,
    load_structured_file,
    validate_model,
)

_STRICT = ConfigDict(frozen=True, extra="forbid")


class Link(BaseModel):
    model_config = _STRICT
    kind: Literal["nvlink", "pcie"]
    bandwidth_gbps: float = Field(gt=0)


class Group(BaseModel):
    model_config = _STRICT
    type: str
    count: int


class Node(BaseModel):
    model_config = _STRICT
    name: str
    devices: list[Group]
    link: Link | None = None


class Cluster(BaseModel):
    model_config = _STRICT
    nodes: tuple[Node, ...]
    catalogue: dict[str, Link] = Field(default_factory=dict)


@dataclass(frozen=True)
class Param:
    name: str
    numel: int

    __pydantic_config__ = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class Layer:
    name: str
    params: tuple[Param, ...] = ()

    __pydantic_config__ = ConfigDict(extra="forbid")


def _good_node() -> dict[str, object]:
    return {"name": "n0", "devices": [{"type": "A100", "count": 8}]}


# -- load_structured_file -------------------------------------------------------------------
@pytest.mark.parametrize("suffix", [".yaml", ".yml"])
def test_load_yaml(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"c{suffix}"
    path.write_text("name: x\nnodes:\n  - {a: 1}\n")
    assert load_structured_file(path, what="cluster spec") == {"name": "x", "nodes": [{"a": 1}]}


def test_load_json(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"a": [1, 2], "b": {"c": 1.5}}))
    assert load_structured_file(str(path), what="thing") == {"a": [1, 2], "b": {"c": 1.5}}


def test_load_other_suffix_tries_json_then_yaml(tmp_path: Path) -> None:
    as_json = tmp_path / "c.txt"
    as_json.write_text('{"a": 1}')
    as_yaml = tmp_path / "c.conf"
    as_yaml.write_text("a: 1\nb: [x, y]\n")
    assert load_structured_file(as_json, what="x") == {"a": 1}
    assert load_structured_file(as_yaml, what="x") == {"a": 1, "b": ["x", "y"]}


def test_missing_file_names_path_and_what(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(SpecError) as info:
        load_structured_file(path, what="cluster spec")
    msg = str(info.value)
    assert "cluster spec file" in msg
    assert "nope.yaml" in msg
    assert "does not exist" in msg


def test_directory_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="not a regular file"):
        load_structured_file(tmp_path, what="cluster spec")


def test_invalid_yaml_reports_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("name: c\nnodes:\n  - name: a\n   count: 2\n")
    with pytest.raises(SpecError) as info:
        load_structured_file(path, what="cluster spec")
    msg = str(info.value)
    assert str(path) in msg
    assert "not valid YAML" in msg
    assert "line 4" in msg
    assert "count: 2" in msg  # the offending source line is quoted
    assert "indentation" in msg  # how to fix


def test_invalid_json_reports_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{"name": "c",\n "nodes": [1,]}')
    with pytest.raises(SpecError) as info:
        load_structured_file(path, what="cluster spec")
    msg = str(info.value)
    assert "not valid JSON" in msg
    assert "line 2, column 14" in msg


def test_duplicate_yaml_key_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "dup.yaml"
    path.write_text("name: a\nother: 1\nname: b\n")
    with pytest.raises(SpecError) as info:
        load_structured_file(path, what="cluster spec")
    msg = str(info.value)
    assert "duplicate key 'name'" in msg
    assert "line 1" in msg and "line 3" in msg


@pytest.mark.parametrize(
    ("text", "kind"), [("- a\n- b\n", "list"), ("just a string\n", "string"), ("42\n", "int")]
)
def test_top_level_must_be_mapping(tmp_path: Path, text: str, kind: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as info:
        load_structured_file(path, what="cluster spec")
    assert "must be a mapping" in str(info.value)
    assert f"got a {kind}" in str(info.value)


@pytest.mark.parametrize(("name", "text"), [("c.yaml", "# only a comment\n"),
                                           ("c.json", ""), ("c.json", " \n")])
def test_empty_file(tmp_path: Path, name: str, text: str) -> None:
    """Was, for an empty .json: "not valid JSON ...; check for a missing comma or quote"."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(SpecError, match="is empty") as info:
        load_structured_file(path, what="cluster spec")
    assert "missing comma" not in str(info.value)
    assert "examples/clusters/" in str(info.value)  # how to get one


def test_empty_file_of_a_kind_hetplan_writes_names_the_command(tmp_path: Path) -> None:
    """Was: "write the profile DB as a YAML or JSON mapping", for a file no one writes by
    hand."""
    path = tmp_path / "profile.json"
    path.write_text("")
    with pytest.raises(SpecError, match="is empty") as info:
        load_structured_file(path, what="profile DB")
    assert "`hetplan profile -o FILE`" in str(info.value)


def test_non_utf8_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_bytes(b"name: \xff\xfe\n")
    with pytest.raises(SpecError, match="not UTF-8"):
        load_structured_file(path, what="cluster spec")


# -- format_validation_error ----------------------------------------------------------------
def _error(model: type[BaseModel], data: object) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        model.model_validate(data)
    return info.value


def test_unknown_nested_key_suggests_field_of_nested_model() -> None:
    data = {"nodes": [_good_node(), {"name": "n1", "devices": [{"type": "A", "cuont": 2}]}]}
    msg = format_validation_error(_error(Cluster, data), where="c.yaml", model=Cluster)
    lines = msg.splitlines()
    assert "c.yaml: nodes[1].devices[0].cuont: unknown key 'cuont'; did you mean 'count'?" in lines
    assert "c.yaml: nodes[1].devices[0]: missing required key 'count'" in lines
    assert lines[-1].startswith("hint:")


def test_unknown_top_level_key() -> None:
    msg = format_validation_error(_error(Cluster, {"nodse": []}), where="c.yaml", model=Cluster)
    assert "c.yaml: nodse: unknown key 'nodse'; did you mean 'nodes'?" in msg.splitlines()
    assert "c.yaml: missing required key 'nodes'" in msg.splitlines()


def test_unknown_key_through_optional_and_dict_values() -> None:
    node = {**_good_node(), "link": {"kind": "pcie", "bandwith_gbps": 5}}
    data = {"nodes": [node], "catalogue": {"fast link": {"kind": "pcie", "bandwidthgbps": 1}}}
    lines = format_validation_error(_error(Cluster, data), where="f", model=Cluster).splitlines()
    assert (
        "f: nodes[0].link.bandwith_gbps: unknown key 'bandwith_gbps'; "
        "did you mean 'bandwidth_gbps'?"
    ) in lines
    assert (
        "f: catalogue['fast link'].bandwidthgbps: unknown key 'bandwidthgbps'; "
        "did you mean 'bandwidth_gbps'?"
    ) in lines


def test_unknown_key_without_close_match_lists_allowed_keys() -> None:
    data = {"nodes": [{**_good_node(), "zzzzzz": 1}]}
    msg = format_validation_error(_error(Cluster, data), where="f", model=Cluster)
    assert "f: nodes[0].zzzzzz: unknown key 'zzzzzz'; allowed keys here: devices, link, name" in msg


def test_no_model_means_no_suggestion() -> None:
    data = {"nodes": [], "catalgue": {}}
    msg = format_validation_error(_error(Cluster, data), where="f")
    assert "f: catalgue: unknown key 'catalgue'" in msg.splitlines()


def test_value_errors_quote_input_and_suggest_literals() -> None:
    node = {**_good_node(), "link": {"kind": "nvlnk", "bandwidth_gbps": -3}}
    lines = format_validation_error(
        _error(Cluster, {"nodes": [node]}), where="f", model=Cluster
    ).splitlines()
    assert ("f: nodes[0].link.bandwidth_gbps: Input should be greater than 0 (got -3); the "
            "unit is Gbit/s (100 Gb/s Ethernet is 100.0)") in lines
    kind_line = next(line for line in lines if line.startswith("f: nodes[0].link.kind:"))
    assert "(got 'nvlnk')" in kind_line
    assert kind_line.endswith("did you mean 'nvlink'?")


def test_long_input_is_truncated() -> None:
    data = {"nodes": [{**_good_node(), "name": ["x" * 500]}]}
    msg = format_validation_error(_error(Cluster, data), where="f", model=Cluster)
    line = next(line for line in msg.splitlines() if line.startswith("f: nodes[0].name"))
    assert len(line) < 200


def test_custom_hint_is_last_line() -> None:
    msg = format_validation_error(
        _error(Cluster, {}), where="f", model=Cluster, hint="hint: see examples/"
    )
    assert msg.splitlines()[-1] == "hint: see examples/"


def test_validator_message_lines_each_get_location() -> None:
    from pydantic import model_validator

    class Checked(BaseModel):
        model_config = _STRICT
        a: int

        @model_validator(mode="after")
        def _two_problems(self) -> Checked:
            raise ValueError("first problem\nsecond problem")

    msg = format_validation_error(_error(Checked, {"a": 1}), where="f", model=Checked)
    assert msg.splitlines()[:2] == ["f: first problem", "f: second problem"]


def test_dataclass_models_get_suggestions() -> None:
    adapter = TypeAdapter(Layer)
    with pytest.raises(ValidationError) as info:
        adapter.validate_python({"name": "l0", "params": [{"name": "w", "numell": 4}]})
    lines = format_validation_error(info.value, where="w.json", model=Layer).splitlines()
    assert "w.json: params[0].numell: unknown key 'numell'; did you mean 'numel'?" in lines
    assert "w.json: params[0]: missing required key 'numel'" in lines


# -- validate_model -------------------------------------------------------------------------
def test_validate_model_returns_instance() -> None:
    out = validate_model(Cluster, {"nodes": [_good_node()]}, where="f")
    assert isinstance(out, Cluster)
    assert out.nodes[0].devices[0].count == 8


def test_validate_model_dataclass() -> None:
    out = validate_model(Layer, {"name": "l", "params": [{"name": "w", "numel": 3}]}, where="f")
    assert out == Layer(name="l", params=(Param(name="w", numel=3),))


def test_validate_model_raises_spec_error_chained() -> None:
    with pytest.raises(SpecError) as info:
        validate_model(Group, {"type": "A100", "cuont": 8}, where="c.yaml")
    assert isinstance(info.value.__cause__, ValidationError)
    assert "c.yaml: cuont: unknown key 'cuont'; did you mean 'count'?" in str(info.value)


def test_did_you_mean() -> None:
    assert did_you_mean("cuont", ["count", "type"]) == "; did you mean 'count'?"
    assert did_you_mean("a100-80gb", ["A100-80GB", "V100"]) == "; did you mean 'A100-80GB'?"
    # several: closest first (equally close ones as difflib orders them)
    names = ["fc1.weight", "fc1.bias", "fc2.weight", "head.weight"]
    assert did_you_mean("fc3.weight", names, n=2) == "; did you mean 'fc2.weight' or 'fc1.weight'?"
    # a part of a long dotted name is rarely close by difflib's ratio; ``substring`` finds it
    long = ["blocks.0.attn.qkv.weight", "blocks.0.attn.qkv.bias", "blocks.0.mlp.fc.weight"]
    assert did_you_mean("qkv", long, n=3) == ""
    assert did_you_mean("qkv", long, n=3, substring=True) == (
        "; did you mean 'blocks.0.attn.qkv.weight' or 'blocks.0.attn.qkv.bias'?")
    assert did_you_mean("zzz", ["count", "type"]) == ""


def test_a_list_written_as_something_else_is_called_a_list() -> None:
    """pydantic says 'a valid tuple'; a YAML or JSON file has lists, not tuples."""
    for value, said in (({"a": _good_node()}, "expected a list, got a mapping"),
                        ("n0", "expected a list, got a string 'n0'"),
                        (None, "expected a list, got null")):
        text = format_validation_error(_error(Cluster, {"nodes": value}), where="f", model=None)
        assert f"f: nodes: {said}" in text.splitlines(), text
        assert "tuple" not in text


def test_a_value_past_a_unit_fields_bound_names_the_unit() -> None:
    """A bandwidth in bit/s or a memory in bytes is refused by the field's bound; the message
    says which unit the field is in."""
    from hetplan.ir.cluster import ClusterSpec

    spec = ClusterSpec.from_preset("cpu-2x2").model_dump(mode="json")
    spec["inter_node"]["bandwidth_gbps"] = 100e9
    spec["device_types"]["cpu"]["memory_gib"] = 4 * 2**30
    spec["device_types"]["cpu"]["peak_tflops"]["fp32"] = 1e11
    with pytest.raises(SpecError) as info:
        ClusterSpec.from_dict(spec, where="c.yaml")
    text = str(info.value)
    assert "inter_node.bandwidth_gbps: Input should be less than or equal to 1000000 (got " \
           "100000000000.0); the unit is Gbit/s (100 Gb/s Ethernet is 100.0), not bit/s" in text
    assert "the unit is GiB (80 GiB is 80.0), not bytes" in text
    assert "peak_tflops.fp32" in text and "not FLOP/s" in text


def test_a_name_differing_only_in_case_is_suggested_first() -> None:
    """difflib rates 'a100-80gb' as close to 'H100-80GB' as to 'A100-80GB' and chose H100."""
    types = ["V100-SXM2-32GB", "A100-40GB", "A100-80GB", "H100-80GB", "cpu"]
    assert did_you_mean("a100-80gb", types) == "; did you mean 'A100-80GB'?"
    assert did_you_mean("h100-80gb", types, n=2).startswith("; did you mean 'H100-80GB'")


def test_a_mapping_written_as_something_else_is_called_a_mapping() -> None:
    """pydantic says 'a valid dictionary or instance of StragglerSpec'."""
    for value, said in (([1, 2], "got a list"), ("yes", "got a string 'yes'")):
        text = format_validation_error(_error(Cluster, {"nodes": [{**_good_node(), "link": value}]}),
                                       where="f", model=None)
        assert f"f: nodes[0].link: expected a mapping ('key: value' lines), {said}" in text, text


def test_a_number_written_with_its_unit_is_told_the_unit() -> None:
    from hetplan.ir.cluster import ClusterSpec

    spec = ClusterSpec.from_preset("cpu-2x2").model_dump(mode="json")
    spec["inter_node"]["bandwidth_gbps"] = "100Gbps"
    with pytest.raises(SpecError) as info:
        ClusterSpec.from_dict(spec, where="c.yaml")
    assert ("inter_node.bandwidth_gbps: expected a number, got a string '100Gbps'; the unit is "
            "Gbit/s (100 Gb/s Ethernet is 100.0)") in str(info.value)
