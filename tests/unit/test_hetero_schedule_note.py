"""``--hetero``: the heterogeneous search plans 1F1B pipelines only; when it replaces a plan
with another schedule (here interleaved 1F1B), the pass log says so instead of dropping the
request silently."""

from __future__ import annotations

import hetplan
from hetplan.ir.cluster import ClusterSpec
from hetplan.optimizer.hetero import choose_hetero


def _spec() -> ClusterSpec:
    link = {"kind": "nvlink", "bandwidth_gbps": 1200.0, "latency_us": 2.0}
    return ClusterSpec.from_dict({"name": "two-kinds", "nodes": [
        {"name": "a", "devices": [{"type": "A100-80GB", "count": 4}], "cpu_cores": 16,
         "intra_link": link},
        {"name": "v", "devices": [{"type": "V100-SXM2-32GB", "count": 4}], "cpu_cores": 16,
         "intra_link": link}],
        "inter_node": {"kind": "ethernet", "bandwidth_gbps": 100, "latency_us": 10}})


def _note(plan: hetplan.Plan) -> str:
    (entry,) = [e for e in plan.pass_log if e.name == "hetero-choice"]
    return entry.notes[0]


def test_the_schedule_change_is_noted() -> None:
    spec = _spec()
    base = hetplan.compile("gpt-test", spec, batch_size=16, schedule="interleaved-1f1b",
                           pp=2, virtual_stages=2)
    assert base.layout is not None and base.layout.schedule == "interleaved-1f1b"
    het = choose_hetero(base, spec, None, 16, "on")
    assert het.layout is not None and het.layout.schedule == "1f1b"
    assert "plans 1F1B only; compile()'s plan ran interleaved-1f1b" in _note(het)


def test_no_note_when_the_schedules_agree() -> None:
    spec = _spec()
    het = choose_hetero(hetplan.compile("gpt-test", spec, batch_size=16), spec, None, 16, "on")
    assert "1F1B only" not in _note(het)
