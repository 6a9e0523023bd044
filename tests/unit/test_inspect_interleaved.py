"""``hetplan inspect``'s tensor-parallel table on an interleaved plan: a TP group's ``stage``
is its pipeline rank, which holds several chunks (``plan.stages`` has ``pp · v`` entries),
so the group's split parameters are those of every chunk its ranks hold."""

from __future__ import annotations

from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan import Plan
from hetplan.optimizer.compile import compile
from hetplan.report.inspect import build_report

NVLINK = {"kind": "nvlink", "bandwidth_gbps": 2400, "latency_us": 2}


def _plan() -> Plan:
    """gpt-test on one 8-GPU node: dp 2, pp 2 with 2 interleaved chunks each, tp 2."""
    spec = ClusterSpec.from_dict({"name": "one", "nodes": [
        {"name": "n0", "devices": [{"type": "A100-80GB", "count": 8}], "cpu_cores": 8,
         "intra_link": NVLINK}]})
    return compile("gpt-test", spec, batch_size=8, schedule="interleaved-1f1b", pp=2, tp=2,
                   virtual_stages=2, dp=2)


def test_tp_split_bytes_count_every_chunk_of_the_pipeline_rank() -> None:
    plan = _plan()
    wl = plan.model.workload
    assert wl is not None and plan.layout is not None and len(plan.stages) == 4
    groups = build_report(plan)["tp"]["groups"]
    assert {g["stage"] for g in groups} == {0, 1}
    for g in groups:
        rank = g["example_ranks"][0]
        chunks = [st for st in plan.stages if rank in st.ranks]
        # both chunks of the pipeline rank, not the virtual stage of the same index
        assert [st.index % 2 for st in chunks] == [g["stage"]] * 2
        want = sum(min(x.tp_split_bytes, x.param_bytes) for st in chunks
                   for x in wl.layers[st.first_layer:st.last_layer + 1])
        assert want > 0 and g["split_bytes"] == want


def test_memory_rows_name_every_chunk_of_the_pipeline_rank() -> None:
    plan = _plan()
    rows = build_report(plan)["memory"]["per_stage"]
    # one row per pipeline rank (its chunks s and s + pp), not one per chunk's last index
    assert [r["stages"] for r in rows] == [[0, 2], [1, 3]]
    assert [r["stage"] for r in rows] == [0, 1]
    assert sum(r["ranks"] for r in rows) == 8
    from hetplan.report.render import render_text

    text = render_text(build_report(plan), sections=("memory",))
    assert "0+2" in text and "1+3" in text
