"""Files a user types are refused at once, with the field named, when they are too large, too
deep, repeat a key, or give a boolean or a string where a number is meant; never a hang, an
OverflowError or a RecursionError (what `hetplan validate` did before).

Each check runs through the public loaders: ``ClusterSpec.load``, ``load_plan`` and
``load_structured_file`` (workloads, profiles, dynamics and run reports use it too).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from hetplan.errors import SpecError
from hetplan.ir.cluster import MAX_WORLD_SIZE, ClusterSpec
from hetplan.ir.plan import load_plan
from hetplan.ir.validation import (
    MAX_DEPTH,
    MAX_FILE_BYTES,
    check_output_path,
    load_structured_file,
    loads_json,
)


def preset() -> dict[str, Any]:
    return json.loads(ClusterSpec.from_preset("mixed-tp-node").to_json())


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def refused(path: Path, *expected: str) -> str:
    with pytest.raises(SpecError) as exc:
        ClusterSpec.load(path)
    msg = str(exc.value)
    assert str(path) in msg
    for text in expected:
        assert text in msg, f"{text!r} not in:\n{msg}"
    return msg


# -- counts and sizes ---------------------------------------------------------------------------
def test_a_billion_devices_is_refused_at_once(tmp_path: Path) -> None:
    data = preset()
    data["nodes"][0]["count"] = 1_000_000_000
    refused(write(tmp_path, "c.yaml", yaml.safe_dump(data)), "nodes[0].count",
            "less than or equal to 65536")


def test_a_world_over_the_limit_names_the_counts(tmp_path: Path) -> None:
    data = preset()
    data["nodes"][0]["count"] = MAX_WORLD_SIZE // 8 + 1
    refused(write(tmp_path, "c.yaml", yaml.safe_dump(data)),
            f"nodes: {MAX_WORLD_SIZE // 8 + 1:,} nodes with", "at most 65,536 devices",
            "check the 'count'")


def test_a_400_digit_count_is_a_clear_error(tmp_path: Path) -> None:
    text = json.dumps(preset()).replace('"count": 2', '"count": ' + "9" * 400, 1)
    msg = refused(write(tmp_path, "c.json", text), "nodes[0].count", "less than or equal")
    assert "Overflow" not in msg
    huge = json.dumps(preset()).replace('"count": 2', '"count": ' + "9" * 5000, 1)
    refused(write(tmp_path, "c2.json", huge), "not valid JSON", "digits")


@pytest.mark.parametrize("path, value, expected", [
    (("nodes", 0, "intra_link", "bandwidth_gbps"), 1e12, "intra_link.bandwidth_gbps"),
    (("nodes", 0, "intra_link", "bandwidth_gbps"), 1e-9, "intra_link.bandwidth_gbps"),
    (("nodes", 0, "devices", 0, "count"), 100_000, "devices[0].count"),
    (("nodes", 0, "cpu_cores"), 10**9, "cpu_cores"),
    (("nodes", 0, "slowdown"), 1e9, "slowdown"),
    (("device_types", "A100-80GB", "memory_gib"), 1e12, "memory_gib"),
    (("device_types", "A100-80GB", "peak_tflops", "fp32"), 1e12, "peak_tflops.fp32"),
])
def test_numbers_have_sane_bounds(tmp_path: Path, path: tuple[Any, ...], value: float,
                                  expected: str) -> None:
    data = preset()
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    refused(write(tmp_path, "c.yaml", yaml.safe_dump(data)), expected)


# -- strict types -------------------------------------------------------------------------------
@pytest.mark.parametrize("value, kind", [(True, "a boolean True"), ("8", "a string '8'")])
def test_no_bool_or_string_as_a_count(tmp_path: Path, value: object, kind: str) -> None:
    data = preset()
    data["nodes"][0]["devices"][0]["count"] = value
    refused(write(tmp_path, "c.yaml", yaml.safe_dump(data)),
            f"nodes[0].devices[0].count: expected an integer, got {kind}")


def test_no_bool_as_a_number(tmp_path: Path) -> None:
    data = preset()
    data["inter_node"]["latency_us"] = False
    refused(write(tmp_path, "c.yaml", yaml.safe_dump(data)),
            "inter_node.latency_us: expected a number, got a boolean False")


@pytest.mark.parametrize("text, number", [("1e3", "1.0e+3"), ("-2E+9", "-2.0E+9")])
def test_a_yaml_exponent_without_a_point_is_explained(tmp_path: Path, text: str,
                                                       number: str) -> None:
    """YAML 1.1 (PyYAML) reads ``1e3`` as text; the refusal says how to write the number."""
    body = yaml.safe_dump(preset()).replace("latency_us: 3.0", f"latency_us: {text}", 1)
    assert f"latency_us: {text}" in body
    refused(write(tmp_path, "c.yaml", body), f"expected a number, got a string '{text}'",
            f"write {number}")


# -- duplicate keys, nesting, size --------------------------------------------------------------
def test_duplicate_keys_are_refused_in_json_as_in_yaml(tmp_path: Path) -> None:
    text = json.dumps(preset())
    dup = text.replace('"name": "mixed-tp-node"', '"name": "a", "name": "mixed-tp-node"', 1)
    refused(write(tmp_path, "c.json", dup), "the key 'name' is written twice")
    yaml_dup = "name: a\nname: b\nnodes: []\n"
    refused(write(tmp_path, "c.yaml", yaml_dup), "duplicate key 'name'")


def test_deep_nesting_is_a_spec_error_not_a_recursion_error(tmp_path: Path) -> None:
    for depth in (MAX_DEPTH + 5, 100_000):
        deep = "[" * depth + "1" + "]" * depth
        for suffix in (".json", ".yaml"):
            path = write(tmp_path, f"c{suffix}", '{"name": "x", "nodes": ' + deep + "}")
            msg = refused(path)
            assert "nested" in msg and "deep" in msg or "too deeply" in msg, msg


def test_yaml_nested_thousands_deep_is_refused_before_pyyaml_parses_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """PyYAML needed seconds (over 20 under load) to reach its recursion limit on such a
    value; the flow depth is read first, quoted text and comments aside."""
    from hetplan.ir import files

    assert files._flow_depth('a: [1, {b: [2]}]  # [[[[\nc: "[[\\"[["\nd: \'[[\'\'[[\'') == 3
    calls: list[str] = []
    real = files.yaml.load
    monkeypatch.setattr(files.yaml, "load", lambda *a, **k: calls.append("load") or real(*a, **k))
    deep = "[" * 100_000 + "1" + "]" * 100_000
    msg = refused(write(tmp_path, "c.yaml", "name: x\nnodes: " + deep + "\n"))
    assert "too deeply" in msg and calls == []
    shallow = "[" * (MAX_DEPTH + 5) + "1" + "]" * (MAX_DEPTH + 5)
    assert "nested" in refused(write(tmp_path, "d.yaml", "name: x\nnodes: " + shallow + "\n"))
    assert calls == ["load"]  # parsed, and refused by the shape check, which names where


def test_a_yaml_alias_bomb_is_refused(tmp_path: Path) -> None:
    lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    for i in range(1, 9):
        prev = f"*a{i - 1}"
        lines.append(f"a{i}: &a{i} [{', '.join([prev] * 10)}]")
    path = write(tmp_path, "bomb.yaml", "\n".join(lines) + "\nname: x\n")
    refused(path, "more than 2,000,000 values")


MERGED_NODES = """\
name: two-node-groups
nodes:
- &node
  name: a
  count: 1
  devices: [{type: cpu, count: 2}]
  cpu_cores: 2
  intra_link: {kind: loopback, bandwidth_gbps: 7.5, latency_us: 800.0}
- <<: *node
  name: b
%s
inter_node: {kind: ethernet, bandwidth_gbps: 10.0, latency_us: 25.0}
"""


def test_yaml_merge_keys_are_read(tmp_path: Path) -> None:
    # before: "could not determine a constructor for the tag 'tag:yaml.org,2002:merge'",
    # with a hint about indentation; a key written next to '<<' overrides the merged one
    spec = ClusterSpec.load(write(tmp_path, "merged.yaml", MERGED_NODES % ""))
    assert [n.name for n in spec.nodes] == ["a", "b"]
    assert spec.nodes[1].cpu_cores == 2 and spec.world_size == 4


def test_a_key_written_twice_next_to_a_merge_key_is_still_refused(tmp_path: Path) -> None:
    refused(write(tmp_path, "merged.yaml", MERGED_NODES % "  name: c"), "duplicate key 'name'")


def test_unhashable_yaml_key_is_a_spec_error(tmp_path: Path) -> None:
    refused(write(tmp_path, "c.yaml", "? [a, b]\n: 1\n"), "a key must be a plain value")


def test_a_file_over_the_size_limit_is_refused_before_parsing(tmp_path: Path) -> None:
    path = tmp_path / "big.json"
    with path.open("wb") as f:
        f.truncate(MAX_FILE_BYTES + 1)  # sparse: nothing is written
    refused(path, "MiB; hetplan reads files of at most 32 MiB")
    with pytest.raises(SpecError, match="at most 32 MiB"):
        load_plan(path)


def test_loads_json_keeps_syntax_errors_for_the_caller() -> None:
    with pytest.raises(json.JSONDecodeError):
        loads_json("{", where="x")
    assert loads_json('{"a": [1, {"b": 2}]}', where="x") == {"a": [1, {"b": 2}]}


def test_structured_files_share_the_limits(tmp_path: Path) -> None:
    path = write(tmp_path, "w.json", '{"a": 1, "a": 2}')
    with pytest.raises(SpecError, match="w.json: not valid: the key 'a' is written twice"):
        load_structured_file(path, what="workload")


# -- output paths -------------------------------------------------------------------------------
def test_output_paths_are_checked_and_never_created(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "dir" / "x.json"
    with pytest.raises(SpecError, match="^-o '.*x.json': the directory .*dir' does not exist"):
        check_output_path(missing, option="-o")
    assert not (tmp_path / "no").exists()
    with pytest.raises(SpecError, match="is a directory"):
        check_output_path(tmp_path, option="-o")
    assert check_output_path(tmp_path / "x.json", option="-o") == tmp_path / "x.json"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_an_output_path_the_file_system_refuses_is_refused_before_work(tmp_path: Path) -> None:
    # before, as root (os.access says yes to root whatever the file system allows) this
    # passed, and the command did its work and then ended in "internal error:
    # PermissionError ... This is a bug in hetplan"
    with pytest.raises(SpecError, match="^-o '/proc/hetplan-out.json' cannot be written"):
        check_output_path("/proc/hetplan-out.json", option="-o")
    check_output_path(tmp_path / "x.json", option="-o")
    assert list(tmp_path.iterdir()) == []  # the probe leaves nothing behind


def _workload() -> dict[str, Any]:
    from hetplan.ir.model import GradTensor, LayerIR, LayerKind, ModelIR, ParamInfo

    layer = LayerIR(index=0, name="fc", kind=LayerKind.LINEAR, module_type="Linear",
                    params=(ParamInfo(name="fc.weight", shape=(4, 4), dtype="float32",
                                      numel=16, size_bytes=64),),
                    fwd_flops=128, bwd_flops=256, act_in_bytes=32, act_out_bytes=32)
    grad = GradTensor(name="fc.weight", numel=16, size_bytes=64, dtype="float32", layer="fc",
                      layer_index=0)
    ir = ModelIR(name="m", layers=(layer,), grad_tensors=(grad,), num_params=16, method="fx",
                 input_shapes=((2, 4),), input_dtypes=("float32",))
    data: dict[str, Any] = json.loads(ir.to_json())
    return data


@pytest.mark.parametrize("path, value, kind", [
    (("layers", 0, "fwd_flops"), True, "a boolean"),
    (("layers", 0, "act_out_bytes"), "32", "a string"),
    (("layers", 0, "params", 0, "numel"), True, "a boolean"),
    (("grad_tensors", 0, "size_bytes"), "64", "a string"),
    (("num_params",), True, "a boolean"),
    (("input_shapes", 0, 0), True, "a boolean"),
])
def test_workload_numbers_are_strict(tmp_path: Path, path: tuple[Any, ...], value: object,
                                     kind: str) -> None:
    # before, a workload with fwd_flops: true was read as 1 FLOP and planned
    from hetplan.ir.model import ModelIR

    data = _workload()
    ModelIR.load(write(tmp_path, "ok.json", json.dumps(data)))
    target: Any = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(SpecError, match=f"expected an integer, got {kind}"):
        ModelIR.load(write(tmp_path, "w.json", json.dumps(data)))


def test_a_workload_that_is_a_directory_binary_or_too_large_is_refused(tmp_path: Path) -> None:
    # before: a directory "does not exist", a binary file was an internal UnicodeDecodeError
    # and a file of any size was read whole
    from hetplan.ir.model import ModelIR

    with pytest.raises(SpecError, match="is not a regular file; pass the path of a file"):
        ModelIR.load(tmp_path)
    binary = tmp_path / "w.json"
    binary.write_bytes(b"\xd7\xff" * 100)
    with pytest.raises(SpecError, match="w.json: the workload file is not UTF-8 text"):
        ModelIR.load(binary)
    with binary.open("wb") as f:
        f.truncate(MAX_FILE_BYTES + 1)
    with pytest.raises(SpecError, match=f"at most {MAX_FILE_BYTES // 2**20} MiB"):
        ModelIR.load(binary)
    with pytest.raises(SpecError, match="workload file '.*nope.json' does not exist"):
        ModelIR.load(tmp_path / "nope.json")
