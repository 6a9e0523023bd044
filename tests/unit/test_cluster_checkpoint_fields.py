"""The cluster fields Gemini reads: CPU memory per node and remote-storage bandwidth."""

from __future__ import annotations

import pytest

from hetplan.errors import SpecError
from hetplan.ir.cluster import ClusterSpec


def _spec(**extra: object) -> dict[str, object]:
    node: dict[str, object] = {"name": "n", "count": 2, "devices": {"type": "cpu", "count": 2},
                               "cpu_cores": 4,
                               "intra_link": {"kind": "pcie", "bandwidth_gbps": 100,
                                              "latency_us": 5}}
    node.update({k: v for k, v in extra.items() if k == "cpu_memory_gib"})
    data: dict[str, object] = {"name": "c", "nodes": [node],
                               "inter_node": {"kind": "ethernet", "bandwidth_gbps": 10,
                                              "latency_us": 20}}
    data.update({k: v for k, v in extra.items() if k != "cpu_memory_gib"})
    return data


def test_optional_fields_default_to_none_and_keep_the_fingerprint() -> None:
    plain = ClusterSpec.from_dict(_spec())
    assert plain.storage_bandwidth_gbps is None
    assert plain.nodes[0].cpu_memory_gib is None
    given = ClusterSpec.from_dict(_spec(cpu_memory_gib=768, storage_bandwidth_gbps=20))
    assert given.nodes[0].cpu_memory_gib == 768
    assert given.storage_bandwidth_gbps == 20
    assert given.fingerprint() != plain.fingerprint()
    # a preset that sets neither keeps the fingerprint it had before the fields existed
    spec = ClusterSpec.from_preset("mixed-generations")
    assert "cpu_memory_gib" not in spec.to_json()
    assert spec.fingerprint() == "616818b1a5d6fdae"  # its value before the fields existed


@pytest.mark.parametrize(("key", "value", "words"), [
    ("cpu_memory_gib", -1, "cpu_memory_gib"),
    ("cpu_memory_gib", 1e9, "cpu_memory_gib"),
    ("storage_bandwidth_gbps", 0, "storage_bandwidth_gbps"),
    ("storage_bandwidth_gbps", "fast", "storage_bandwidth_gbps"),
])
def test_out_of_bounds_values_name_the_field(key: str, value: object, words: str) -> None:
    with pytest.raises(SpecError, match=words):
        ClusterSpec.from_dict(_spec(**{key: value}))
