"""A run's trace beside the simulator's timeline (``hetplan inspect PLAN --trace``), and the
trace-event export, on hand-made traces (the gloo runs are ``tests/dist/test_run_trace.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from hetplan.algorithms.pipeline_schedules import plan_schedule
from hetplan.cli import app
from hetplan.errors import SpecError
from hetplan.ir.cluster import ClusterSpec
from hetplan.optimizer.compile import compile
from hetplan.report.timeline import _evaluate_plan
from hetplan.report.trace_compare import compare_trace, load_trace, plan_digest
from hetplan.runtime.trace import StepTrace, chrome_trace


@pytest.fixture(scope="module")
def plan() -> Any:
    spec = ClusterSpec.from_preset("local-cpu")
    return compile("gpt-test", spec, batch_size=8, schedule="1f1b", pp=2, dp=2, tp=1,
                   micro_batch_size=2)


def _recording(plan: Any, rank: int, t0: float) -> dict[str, Any]:
    """Rank ``rank`` computing its plan's actions 1 ms each, waiting 0.5 ms before every
    receiving action, the last stage 0.25 ms of loss after each forward."""
    layout = plan.layout
    d, p, t = layout.coords(rank)
    tr = StepTrace(rank, (d, p, t), "host")
    tr.start(3)
    now = t0
    last = len(plan.stages) - 1
    for a in plan_schedule(layout, plan.pipeline_actions).actions[p]:
        begin = now
        receives = (a.kind.value == "F" and a.stage > 0) or (a.kind.value == "B"
                                                            and a.stage < last)
        if receives:
            tr.add(f"wait {a.kind.value}{a.microbatch} s{a.stage}", "wait", now, now + 5e-4,
                   kind=a.kind.value, microbatch=a.microbatch, stage=a.stage)
            now += 5e-4
        tr.add(f"{a.kind.value}{a.microbatch} s{a.stage}", "compute", now, now + 1e-3,
               kind=a.kind.value, microbatch=a.microbatch, stage=a.stage)
        now += 1e-3
        if a.kind.value == "F" and a.stage == last:
            tr.add(f"loss{a.microbatch} s{a.stage}", "loss", now, now + 2.5e-4,
                   microbatch=a.microbatch, stage=a.stage)
            now += 2.5e-4
        tr.add(f"{a.kind.value}{a.microbatch} s{a.stage}", "action", begin, now,
               kind=a.kind.value, microbatch=a.microbatch, stage=a.stage, index=0)
        now += 1e-4  # posting a send
    tr.add("micro-batches", "phase", t0, now)
    tr.add("after_backward GradSyncHandler", "phase", now, now + 2e-3)
    tr.add("after_sync StagesHandler", "phase", now + 2e-3, now + 2.5e-3)
    tr.add("optimizer step", "phase", now + 2.5e-3, now + 3.5e-3)
    tr.add("comp", "sync", now, now + 5e-4, tid=1)
    tr.add("comp", "sync", now + 1e-3, now + 1.5e-3, tid=1)
    for bucket in (10, 2):
        tr.add(f"launch bucket {bucket}", "sync", now, now + 1e-4)
    tr.stop()
    return tr.to_dict()


def _trace(plan: Any) -> dict[str, Any]:
    ranks = [_recording(plan, r, 100.0 + r * 1e-3) for r in range(4)]
    return json.loads(json.dumps(chrome_trace(ranks, {"plan_digest": plan_digest(plan),
                                                      "step": 3})))


def test_each_action_is_predicted_beside_measured(plan: Any) -> None:
    cmp = compare_trace(plan, load_trace(_trace(plan)))
    ev = _evaluate_plan(plan, None, None)[0]
    assert cmp["step"] == 3 and len(cmp["ranks"]) == 4
    assert cmp["predicted_iteration_ms"] == pytest.approx(ev.iteration_s * 1e3, abs=1e-3)
    for r in cmp["ranks"]:
        p = plan.layout.coords(r["rank"])[1]
        sim = {(e.kind.value, e.microbatch, e.stage): e for e in ev.pipeline.events
               if e.rank == p}
        want = plan_schedule(plan.layout, plan.pipeline_actions).actions[p]
        assert [x["action"] for x in r["actions"]] == [
            f"{a.kind.value}{a.microbatch} s{a.stage}" for a in want]
        for row, a in zip(r["actions"], want):
            e = sim[(a.kind.value, a.microbatch, a.stage)]
            assert row["predicted_start_ms"] == pytest.approx(e.start_ms, abs=1e-3)
            assert row["predicted_ms"] == pytest.approx(e.end_ms - e.start_ms, abs=1e-3)
            assert row["measured_ms"] == pytest.approx(1.0)
        m = r["measured"]
        n = len(want)
        receives = sum(x["wait_ms"] > 0 for x in r["actions"])
        assert m["compute_ms"] == pytest.approx(n * 1.0)
        assert m["wait_for_activations_ms"] + m["wait_for_gradients_ms"] == pytest.approx(
            receives * 0.5)
        assert m["loss_ms"] == pytest.approx(0.25 * plan.layout.micro_batches if p == 1
                                             else 0.0)
        assert m["other_ms"] == pytest.approx(n * 0.1, abs=1e-3)
        assert m["after_backward_ms"] == {"GradSyncHandler": pytest.approx(2.0)}
        assert m["after_sync_ms"] == {"StagesHandler": pytest.approx(0.5)}
        assert m["micro_batches_start_ms"] == pytest.approx(r["rank"] * 1.0)
        assert m["sync_ms"] == {"comp": pytest.approx(1.0),
                                "launch bucket 2": pytest.approx(0.1),
                                "launch bucket 10": pytest.approx(0.1)}
        # in bucket order, as `inspect --trace` prints them (not 'bucket 10' before 'bucket 2')
        assert list(m["sync_ms"]) == ["comp", "launch bucket 2", "launch bucket 10"]
        assert m["optimizer_ms"] == pytest.approx(1.0)


def test_times_start_at_the_hosts_earliest_micro_batch_phase(plan: Any) -> None:
    doc = _trace(plan)
    first = {e["pid"]: min(x["ts"] for x in doc["traceEvents"]
                           if x["ph"] == "X" and x["pid"] == e["pid"])
             for e in doc["traceEvents"] if e["ph"] == "X"}
    assert first[0] == 0 and first[3] == pytest.approx(3000.0)  # 3 ms later, in us
    assert doc["otherData"]["hetplan"]["time_origin_by_host_s"] == {"host": 100.0}


def test_a_trace_of_another_plan_is_refused(plan: Any) -> None:
    doc = _trace(plan)
    doc["otherData"]["hetplan"]["plan_digest"] = "0" * 16
    with pytest.raises(SpecError, match=r"recorded for another plan \(digest 0000000000000000\)"):
        compare_trace(plan, doc)


@pytest.mark.parametrize(("doc", "field"), [
    ({"events": []}, "traceEvents"),
    ({"traceEvents": []}, "otherData.hetplan"),
    ({"traceEvents": [{"ph": "B"}], "otherData": {"hetplan": {}}}, r"traceEvents\[0\]"),
    ({"traceEvents": [{"ph": "X", "ts": 0, "dur": -1}], "otherData": {"hetplan": {}}},
     "dur must be"),
])
def test_bad_traces_name_what_is_wrong(doc: Any, field: str) -> None:
    with pytest.raises(SpecError, match=field):
        load_trace(doc, "t.json")


def test_inspect_prints_the_comparison(plan: Any, tmp_path: Path) -> None:
    plan_file, trace_file = tmp_path / "plan.json", tmp_path / "trace.json"
    plan_file.write_text(plan.to_json())
    trace_file.write_text(json.dumps(_trace(plan)))
    res = CliRunner().invoke(app, ["inspect", str(plan_file), "--trace", str(trace_file),
                                   "-s", "layout"])
    assert res.exit_code == 0, res.output
    assert "rank 3 (pipeline rank 1), step 3" in res.output
    assert "waiting for activations" in res.output
    res = CliRunner().invoke(app, ["inspect", str(plan_file), "--trace", str(trace_file),
                                   "--json", "-s", "layout"])
    assert res.exit_code == 0, res.output
    assert len(json.loads(res.output)["trace"]["ranks"]) == 4


@pytest.mark.parametrize(("args", "message"), [
    (["--trace", "trace.txt"], "must end in .json"),
    (["--trace", "t.json", "--trace-step", "99"], "--trace-step 99"),
    (["--trace", "missing-dir/t.json"], "cannot write"),
])
def test_run_refuses_bad_trace_options(plan: Any, tmp_path: Path, args: list[str],
                                       message: str, monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plan.json").write_text(plan.to_json())
    res = CliRunner().invoke(app, ["run", "plan.json", "--model", "gpt-test", "--dry-run",
                                   "--steps", "3", *args])
    assert res.exit_code == 2, res.output
    assert message in res.output


def test_run_dry_run_passes_the_trace_to_the_workers(plan: Any, tmp_path: Path,
                                                     monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plan.json").write_text(plan.to_json())
    res = CliRunner().invoke(app, ["run", "plan.json", "--model", "gpt-test", "--dry-run",
                                   "--trace", "t.json", "--trace-step", "4"])
    assert res.exit_code == 0, res.output
    assert "--trace t.json --trace-step 4" in " ".join(res.output.split())
