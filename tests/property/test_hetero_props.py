"""Order invariance of heterogeneous plans: permuting the nodes of a cluster file (and the
device groups inside a node) never changes the chosen plan's predicted iteration time, on
the mixed presets."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetplan.cost_models.costs import CostModel
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan_sections import ClusterRef, ModelRef, WorkloadSummary
from hetplan.optimizer.hetero import compile_hetero


@pytest.fixture(scope="module")
def gpt_test() -> WorkloadSummary:
    from hetplan import zoo
    from hetplan.ir.capture import capture

    args, kwargs = zoo.example_inputs("gpt-test", batch=1)
    return WorkloadSummary.from_model_ir(capture(zoo.build("gpt-test"), args, kwargs,
                                                 name="gpt-test"))


def _plan_time(workload: WorkloadSummary, spec: ClusterSpec) -> tuple[float, str]:
    costs = CostModel(spec, dtype="mixed")
    plan = compile_hetero(workload, costs, 16,
                          model_ref=ModelRef(name="gpt-test", fingerprint="x", num_params=1),
                          cluster_ref=ClusterRef.from_cluster(spec))
    assert plan.predictions is not None and plan.hetero is not None
    return plan.predictions.iteration_time_ms, plan.hetero.describe()


def _permuted(spec: ClusterSpec, order: list[int], flip: bool) -> ClusterSpec:
    data: dict[str, Any] = json.loads(spec.to_json())
    nodes = [data["nodes"][i % len(data["nodes"])] for i in order]
    if flip:
        for n in nodes:
            n["devices"] = list(reversed(n["devices"]))
    data["nodes"] = nodes
    return ClusterSpec.from_dict(data)


_BASE: dict[str, tuple[float, str]] = {}


@pytest.mark.parametrize("preset", ["mixed-generations", "mixed-tp-node"])
@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_permuting_nodes_never_changes_the_predicted_time(gpt_test: WorkloadSummary,
                                                          preset: str, data: Any) -> None:
    spec = ClusterSpec.from_preset(preset)
    if preset not in _BASE:
        _BASE[preset] = _plan_time(gpt_test, spec)
    n = len(spec.nodes)
    order = data.draw(st.permutations(range(n)))
    flip = data.draw(st.booleans())
    if list(order) == list(range(n)) and not flip:
        flip = True
    got = _plan_time(gpt_test, _permuted(spec, list(order), flip))
    assert got[0] == pytest.approx(_BASE[preset][0], rel=1e-12)
    assert got[1] == _BASE[preset][1]
