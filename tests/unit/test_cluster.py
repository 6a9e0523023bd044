"""Tests of hetplan.ir.cluster: the cluster spec, its derived views, presets and errors."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from hetplan.errors import SpecError
from hetplan.ir.cluster import DEVICE_CATALOGUE, PRESETS, ClusterSpec, list_presets

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "clusters"

# Written out by hand, so that a renamed or dropped preset fails a test.
EXPECTED_PRESETS = {
    # name: (world_size, num_nodes, heterogeneous)
    "v100-pcie-8x8": (64, 8, False),
    "v100-nvlink-8x8": (64, 8, False),
    "espresso-nvlink-8x8": (64, 8, False),
    "espresso-pcie-8x8": (64, 8, False),
    "a100-nvlink-8x8": (64, 8, False),
    "a100-1024": (1024, 128, False),
    "h100-1024": (1024, 128, False),
    "mixed-generations": (32, 4, True),
    "one-slow-node": (32, 4, True),
    "mixed-tp-node": (16, 2, True),
    "local-cpu": (4, 1, False),
    "cpu-2x2": (4, 2, False),
    "cpu-2x2-slow": (4, 2, False),
}


def _two_node_spec() -> dict[str, Any]:
    """A small valid spec, as a user would write it."""
    return {
        "name": "test",
        "nodes": [
            {
                "name": "gpu",
                "count": 2,
                "devices": [{"type": "A100-80GB", "count": 4}],
                "cpu_cores": 32,
                "intra_link": {"kind": "nvlink", "bandwidth_gbps": 2400, "latency_us": 2},
            }
        ],
        "inter_node": {"kind": "ethernet", "bandwidth_gbps": 100, "latency_us": 10},
    }


def _write(tmp_path: Path, data: dict[str, Any] | str, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


def _load_error(tmp_path: Path, data: dict[str, Any] | str, name: str = "c.yaml") -> str:
    path = _write(tmp_path, data, name)
    with pytest.raises(SpecError) as info:
        ClusterSpec.load(path)
    msg = str(info.value)
    assert str(path) in msg  # every message names the file
    return msg


# -- presets --------------------------------------------------------------------------------
def test_preset_names() -> None:
    assert set(PRESETS) == set(EXPECTED_PRESETS)
    assert [name for name, _ in list_presets()] == list(PRESETS)
    assert all(desc for _, desc in list_presets())


@pytest.mark.parametrize("name", sorted(EXPECTED_PRESETS))
def test_preset_shape(name: str) -> None:
    spec = ClusterSpec.from_preset(name)
    world, nodes, hetero = EXPECTED_PRESETS[name]
    assert spec.name == name
    assert (spec.world_size, spec.num_nodes, spec.is_heterogeneous) == (world, nodes, hetero)
    assert len(spec.devices()) == world
    assert [d.rank for d in spec.devices()] == list(range(world))


@pytest.mark.parametrize("name", sorted(EXPECTED_PRESETS))
def test_preset_round_trips(name: str, tmp_path: Path) -> None:
    spec = ClusterSpec.from_preset(name)
    yaml_path = tmp_path / "c.yaml"
    json_path = tmp_path / "c.json"
    spec.save(yaml_path)
    spec.save(json_path)
    from_yaml = ClusterSpec.load(yaml_path)
    from_json = ClusterSpec.load(json_path)
    assert from_yaml == spec
    assert from_json == spec
    assert from_yaml.to_yaml() == spec.to_yaml()
    assert from_json.to_json() == spec.to_json()
    assert json.loads(json_path.read_text())["name"] == name
    assert from_yaml.fingerprint() == spec.fingerprint()


@pytest.mark.parametrize("name", sorted(EXPECTED_PRESETS))
def test_example_files_match_presets(name: str) -> None:
    path = EXAMPLES / f"{name}.yaml"
    fix = "regenerate with: python -m hetplan.ir.cluster examples/clusters"
    assert path.is_file(), f"{path} is missing; {fix}"
    assert ClusterSpec.load(path) == ClusterSpec.from_preset(name), f"{path} drifted; {fix}"
    assert path.read_text() == ClusterSpec.from_preset(name).to_yaml(), f"{fix}"


def test_unknown_preset_suggests_name() -> None:
    with pytest.raises(SpecError) as info:
        ClusterSpec.from_preset("a100-nvlink-8x4")
    msg = str(info.value)
    assert "unknown cluster preset 'a100-nvlink-8x4'" in msg
    assert "did you mean 'a100-nvlink-8x8'?" in msg
    assert "one-slow-node" in msg  # lists what exists


def test_datasheet_numbers() -> None:
    a100 = DEVICE_CATALOGUE["A100-80GB"]
    assert a100.peak_tflops == {
        "fp64": 9.7,
        "fp32": 19.5,
        "tf32": 156.0,
        "fp16": 312.0,
        "bf16": 312.0,
        "int8": 624.0,
    }
    assert a100.mem_bandwidth_gb_s == 2039.0
    assert DEVICE_CATALOGUE["V100-SXM2-32GB"].peak_tflops["fp16"] == 125.0
    assert DEVICE_CATALOGUE["V100-SXM2-32GB"].mem_bandwidth_gb_s == 900.0
    h100 = DEVICE_CATALOGUE["H100-80GB"]
    assert (h100.peak_tflops["bf16"], h100.peak_tflops["tf32"]) == (989.4, 494.7)
    assert h100.mem_bandwidth_gb_s == 3350.0


# -- derived views --------------------------------------------------------------------------
def test_rank_order_and_nodes_mixed() -> None:
    spec = ClusterSpec.from_preset("mixed-generations")
    devs = spec.devices()
    assert spec.node_names() == ("a100-0", "a100-1", "v100-0", "v100-1")
    assert (devs[0].node, devs[0].local_rank, devs[0].type) == ("a100-0", 0, "A100-80GB")
    assert (devs[15].node, devs[15].local_rank, devs[15].node_index) == ("a100-1", 7, 1)
    assert (devs[16].node, devs[16].type, devs[16].group) == ("v100-0", "V100-SXM2-32GB", "v100")
    assert devs[31].node_index == 3
    assert spec.node_of(17) == 2
    assert spec.ranks_of_node(2) == tuple(range(16, 24))
    assert devs[0].memory_bytes == 80 * 2**30
    assert devs[16].memory_bytes == 32 * 2**30
    assert devs[16].flops("fp16") == 125e12
    assert devs[0].flops("bfloat16") == 312e12  # torch dtype names are accepted
    with pytest.raises(KeyError, match="bf16"):
        devs[16].flops("bf16")  # V100 has no bf16


def test_slowdown_applies_to_flops_and_bandwidth() -> None:
    spec = ClusterSpec.from_preset("one-slow-node")
    fast, slow = spec.devices()[0], spec.devices()[31]
    assert (fast.node, slow.node) == ("a100-0", "a100-slow")
    assert fast.slowdown == 1.0 and slow.slowdown == 2.0
    assert slow.flops("fp32") == pytest.approx(9.75e12)
    assert fast.flops("fp32") == pytest.approx(19.5e12)
    assert slow.mem_bandwidth_bytes_per_s == pytest.approx(2039e9 / 2)


def test_device_and_node_slowdowns_multiply() -> None:
    data = _two_node_spec()
    data["nodes"][0]["slowdown"] = 1.5
    data["device_types"] = {
        "A100-80GB": {
            "memory_gib": 80,
            "peak_tflops": {"fp32": 20},
            "mem_bandwidth_gb_s": 2000,
            "slowdown": 2.0,
            "relative_speed": 3.0,
        }
    }
    dev = ClusterSpec.from_dict(data).devices()[5]
    assert dev.slowdown == pytest.approx(3.0)
    assert dev.flops("fp32") == pytest.approx(20e12 / 3)
    assert dev.relative_speed == pytest.approx(1.0)


def test_user_device_type_overrides_builtin() -> None:
    data = _two_node_spec()
    data["device_types"] = {
        "A100-80GB": {"memory_gib": 40, "peak_tflops": {"fp32": 1}, "mem_bandwidth_gb_s": 1}
    }
    spec = ClusterSpec.from_dict(data)
    assert spec.devices()[0].memory_bytes == 40 * 2**30


def test_builtin_types_are_filled_in() -> None:
    spec = ClusterSpec.from_dict(_two_node_spec())
    assert list(spec.device_types) == ["A100-80GB"]
    assert spec.device_types["A100-80GB"].memory_gib == 80.0


def test_links() -> None:
    spec = ClusterSpec.from_preset("v100-pcie-8x8")
    assert spec.link_between(0, 7).kind == "pcie"
    assert spec.link_between(3, 3).kind == "pcie"
    inter = spec.link_between(7, 8)
    assert (inter.kind, inter.bandwidth_gbps) == ("ethernet", 25.0)
    assert inter.bandwidth_bytes_per_s == pytest.approx(25e9 / 8)
    with pytest.raises(IndexError, match="rank 64"):
        spec.link_between(0, 64)


def test_devices_per_node() -> None:
    assert ClusterSpec.from_preset("a100-nvlink-8x8").devices_per_node == 8
    data = _two_node_spec()
    data["nodes"].append(
        {
            **data["nodes"][0],
            "name": "small",
            "count": 1,
            "devices": [{"type": "A100-80GB", "count": 2}],
        }
    )
    spec = ClusterSpec.from_dict(data)
    assert spec.devices_per_node is None
    assert spec.world_size == 10
    assert spec.is_heterogeneous is False  # same devices, different node sizes


def test_heterogeneous_by_type_group() -> None:
    data = _two_node_spec()
    data["nodes"][0]["devices"] = [
        {"type": "A100-80GB", "count": 2},
        {"type": "A100-40GB", "count": 2},
    ]
    spec = ClusterSpec.from_dict(data)
    assert spec.is_heterogeneous
    assert [d.type for d in spec.devices()[:4]] == ["A100-80GB"] * 2 + ["A100-40GB"] * 2


def test_single_mapping_devices_shorthand() -> None:
    data = _two_node_spec()
    data["nodes"][0]["devices"] = {"type": "A100-80GB", "count": 4}
    assert ClusterSpec.from_dict(data) == ClusterSpec.from_dict(_two_node_spec())


def test_single_node_needs_no_inter_node() -> None:
    spec = ClusterSpec.from_preset("local-cpu")
    assert spec.inter_node is None
    assert spec.link_between(0, 3).kind == "loopback"


# -- fingerprint ----------------------------------------------------------------------------
def test_fingerprint_stable_and_sensitive() -> None:
    base = ClusterSpec.from_dict(_two_node_spec())
    fp = base.fingerprint()
    assert len(fp) == 16 and int(fp, 16) >= 0
    assert ClusterSpec.from_dict(_two_node_spec()).fingerprint() == fp

    renamed = _two_node_spec()
    renamed["name"] = "other"
    renamed["description"] = "cosmetic"
    assert ClusterSpec.from_dict(renamed).fingerprint() == fp

    changes = [
        ("inter_node", "bandwidth_gbps", 50),
        ("inter_node", "latency_us", 11),
    ]
    for section, key, value in changes:
        data = _two_node_spec()
        data[section][key] = value
        assert ClusterSpec.from_dict(data).fingerprint() != fp, (section, key)
    for key, value in [("count", 3), ("cpu_cores", 16), ("slowdown", 1.5)]:
        data = _two_node_spec()
        data["nodes"][0][key] = value
        assert ClusterSpec.from_dict(data).fingerprint() != fp, key


def test_presets_have_distinct_fingerprints() -> None:
    fps = {ClusterSpec.from_preset(name).fingerprint() for name in PRESETS}
    assert len(fps) == len(PRESETS)


def test_spec_is_frozen() -> None:
    spec = ClusterSpec.from_preset("local-cpu")
    with pytest.raises(Exception, match="frozen"):
        spec.name = "x"  # type: ignore[misc]


# -- bad input ------------------------------------------------------------------------------
def test_unknown_nested_key_suggests_count(tmp_path: Path) -> None:
    data = _two_node_spec()
    data["nodes"][0]["devices"] = [{"type": "A100-80GB", "cuont": 4}]
    msg = _load_error(tmp_path, data)
    assert "nodes[0].devices[0].cuont: unknown key 'cuont'; did you mean 'count'?" in msg


def test_misspelt_top_level_key(tmp_path: Path) -> None:
    data = _two_node_spec()
    data["inter_nodes"] = data.pop("inter_node")
    msg = _load_error(tmp_path, data)
    assert "inter_nodes: unknown key 'inter_nodes'; did you mean 'inter_node'?" in msg


def test_misspelt_key_in_device_catalogue(tmp_path: Path) -> None:
    data = _two_node_spec()
    data["device_types"] = {
        "X1": {"memory_gib": 1, "peak_tflops": {"fp32": 1}, "mem_bandwith_gb_s": 1}
    }
    msg = _load_error(tmp_path, data)
    assert "device_types.X1.mem_bandwith_gb_s: unknown key" in msg
    assert "did you mean 'mem_bandwidth_gb_s'?" in msg


@pytest.mark.parametrize("bandwidth", [-5, 0])
def test_non_positive_bandwidth_names_field(tmp_path: Path, bandwidth: int) -> None:
    data = _two_node_spec()
    data["nodes"][0]["intra_link"]["bandwidth_gbps"] = bandwidth
    msg = _load_error(tmp_path, data)
    assert "nodes[0].intra_link.bandwidth_gbps" in msg
    assert f"(got {bandwidth})" in msg


def test_negative_inter_node_bandwidth(tmp_path: Path) -> None:
    data = _two_node_spec()
    data["inter_node"]["bandwidth_gbps"] = -100
    msg = _load_error(tmp_path, data)
    assert "inter_node.bandwidth_gbps" in msg and "(got -100)" in msg


@pytest.mark.parametrize("devices", [[], [{"type": "A100-80GB", "count": 0}]])
def test_zero_devices_names_node(tmp_path: Path, devices: list[dict[str, Any]]) -> None:
    data = _two_node_spec()
    data["nodes"][0]["devices"] = devices
    msg = _load_error(tmp_path, data)
    assert "nodes[0].devices" in msg
    assert "node 'gpu'" in msg


def test_unknown_device_type_suggests(tmp_path: Path) -> None:
    data = _two_node_spec()
    data["nodes"][0]["devices"] = [{"type": "A100-80G", "count": 4}]
    msg = _load_error(tmp_path, data)
    assert "unknown device type 'A100-80G'" in msg
    assert "node 'gpu'" in msg
    assert "did you mean 'A100-80GB'?" in msg


def test_unknown_dtype_key_suggests(tmp_path: Path) -> None:
    data = _two_node_spec()
    data["device_types"] = {
        "X": {"memory_gib": 1, "peak_tflops": {"fp322": 1}, "mem_bandwidth_gb_s": 1}
    }
    msg = _load_error(tmp_path, data)
    assert "device_types.X.peak_tflops.fp322" in msg
    assert "did you mean 'fp32'?" in msg


def test_multi_node_without_inter_node(tmp_path: Path) -> None:
    data = _two_node_spec()
    del data["inter_node"]
    msg = _load_error(tmp_path, data)
    assert "inter_node: missing; the cluster has 2 nodes" in msg


def test_duplicate_node_names(tmp_path: Path) -> None:
    data = _two_node_spec()
    data["nodes"].append(copy.deepcopy(data["nodes"][0]))
    msg = _load_error(tmp_path, data)
    assert "two node groups are named 'gpu'" in msg


def test_expanded_node_name_clash(tmp_path: Path) -> None:
    data = _two_node_spec()  # group 'gpu' with count 2 names its nodes gpu-0, gpu-1
    data["nodes"].append({**copy.deepcopy(data["nodes"][0]), "name": "gpu-1", "count": 1})
    msg = _load_error(tmp_path, data)
    assert "'gpu-1'" in msg and "occur twice" in msg


def test_bad_link_kind_suggests(tmp_path: Path) -> None:
    data = _two_node_spec()
    data["inter_node"]["kind"] = "infiniban"
    msg = _load_error(tmp_path, data)
    assert "inter_node.kind" in msg and "did you mean 'infiniband'?" in msg


def test_slowdown_below_one_rejected(tmp_path: Path) -> None:
    data = _two_node_spec()
    data["nodes"][0]["slowdown"] = 0.5
    msg = _load_error(tmp_path, data)
    assert "nodes[0].slowdown" in msg and "(got 0.5)" in msg


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    with pytest.raises(SpecError) as info:
        ClusterSpec.load(path)
    assert "absent.yaml" in str(info.value) and "does not exist" in str(info.value)


def test_invalid_yaml_syntax(tmp_path: Path) -> None:
    msg = _load_error(tmp_path, "name: c\nnodes: [\n  {name: a\n")
    assert "not valid YAML" in msg
    assert "line" in msg and "column" in msg


def test_invalid_json_syntax(tmp_path: Path) -> None:
    msg = _load_error(tmp_path, '{"name": "c", "nodes": [}', name="c.json")
    assert "not valid JSON" in msg and "line 1, column 25" in msg


def test_error_ends_with_hint(tmp_path: Path) -> None:
    data = _two_node_spec()
    data["nodse"] = []
    msg = _load_error(tmp_path, data)
    assert msg.splitlines()[-1].startswith("hint:")
    assert "examples/clusters" in msg.splitlines()[-1]


def test_espresso_presets_match_the_artifacts_constants() -> None:
    # espresso_models.json: beta_intra 0.02 (NVLink) / 0.4 (PCIe) us per 1000 B, beta_inter
    # 0.8 us per 1000 B, i.e. 50 / 2.5 / 1.25 GB/s
    for name, intra_gbytes in (("espresso-nvlink-8x8", 50.0), ("espresso-pcie-8x8", 2.5)):
        spec = ClusterSpec.from_preset(name)
        assert spec.nodes[0].intra_link.bandwidth_gbps / 8 == pytest.approx(intra_gbytes)
        assert spec.inter_node is not None
        assert spec.inter_node.bandwidth_gbps / 8 == pytest.approx(1.25)
        assert 1e3 / (spec.inter_node.bandwidth_gbps / 8 * 1e3) == pytest.approx(0.8)
