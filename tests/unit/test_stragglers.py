"""The straggler model of the cluster spec (``hetplan.ir.stragglers``)."""

from __future__ import annotations

import hashlib
import json

import pytest

from hetplan.errors import SpecError
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.stragglers import PAPER_SETTINGS, StragglerSpec


def _spec(**extra):
    data = ClusterSpec.from_preset("mixed-generations").model_dump(mode="json",
                                                                   exclude_none=True)
    return ClusterSpec.from_dict({**data, **extra})


def test_stragglers_apply_to_every_device_or_to_named_node_groups():
    spec = _spec(stragglers={"probability": 0.1, "delay_s": 0.3})
    assert {spec.straggler_of(r) for r in range(spec.world_size)} == {(0.1, 0.3)}
    group = spec.nodes[0].name
    spec = _spec(stragglers={"probability": 0.1, "delay_s": 0.6, "nodes": [group]})
    affected = {r for r in range(spec.world_size) if spec.straggler_of(r) != (0.0, 0.0)}
    assert affected == {d.rank for d in spec.devices() if d.group == group}
    assert _spec().straggler_of(0) == (0.0, 0.0)


def test_bad_straggler_fields_name_the_field():
    with pytest.raises(SpecError, match="stragglers.probability"):
        _spec(stragglers={"probability": 1.5, "delay_s": 0.3})
    with pytest.raises(SpecError, match="stragglers.delay_s"):
        _spec(stragglers={"probability": 0.1, "delay_s": 0})
    with pytest.raises(SpecError, match="stragglers.nodes: unknown node group 'v10'"):
        _spec(stragglers={"probability": 0.1, "delay_s": 0.3, "nodes": ["v10"]})
    with pytest.raises(SpecError, match="delay"):
        _spec(stragglers={"probability": 0.1, "delay": 0.3})


def test_fingerprint_without_stragglers_is_unchanged_and_with_them_differs():
    spec = _spec()
    data = spec.model_dump(mode="json", exclude={"name", "description", "stragglers",
                                                 "storage_bandwidth_gbps"})
    for node in data["nodes"]:  # Gemini's fields, like this one, count only when set
        node.pop("cpu_memory_gib", None)
        node["intra_link"].pop("bus_efficiency", None)  # so does a link's bus efficiency
    data["inter_node"].pop("bus_efficiency", None)
    old = hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode())
    assert spec.fingerprint() == old.hexdigest()[:16]
    assert _spec(stragglers={"probability": 0.1, "delay_s": 0.3}).fingerprint() != \
        spec.fingerprint()


def test_round_trip_and_paper_settings():
    spec = _spec(stragglers={"probability": 0.1, "delay_s": 0.6})
    assert ClusterSpec.from_dict(json.loads(spec.to_json())) == spec
    assert PAPER_SETTINGS[("hete-b", "bert")] == StragglerSpec(probability=0.1, delay_s=0.6)
    assert PAPER_SETTINGS[("hete-a", "resnet")].expected_delay_s == pytest.approx(0.01)
