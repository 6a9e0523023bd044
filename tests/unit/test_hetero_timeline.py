"""``hetplan timeline`` and ``inspect --trace`` on a plan with per-stage degrees (``hetero``):
both draw / compare the iteration ``simulate`` predicts (``evaluate_hetero``: each stage its
own times, resharding link and DP group), where they refused the plan before (they priced it
with one dp x tp for every stage)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from hetplan.algorithms.pipeline_schedules import plan_schedule
from hetplan.cli import app
from hetplan.cost_models.hetero import HeteroEvaluation, evaluate_hetero
from hetplan.cost_models.predict import plan_costs, simulate
from hetplan.ir.plan import Plan
from hetplan.report.timeline import timeline_segments
from hetplan.report.trace_compare import compare_trace, load_trace, plan_digest
from hetplan.runtime.trace import StepTrace, chrome_trace
from test_plan_lists_everywhere import toy_hetero_plan


@pytest.fixture(scope="module")
def plan() -> Plan:
    """V100 dp2 on layers 0-1 (ranks 2-3), then A100 dp2 on layers 2-3 (ranks 0-1), 1F1B
    over 4 micro-batches, every 16 MiB gradient synced fp32 on its stage's DP group; as read
    from a file."""
    made = toy_hetero_plan(1 << 24, gradient_sync=True)
    return Plan.model_validate(json.loads(made.to_json()))


def _evaluated(plan: Plan) -> HeteroEvaluation:
    """``simulate``'s evaluation of ``plan`` (unrounded)."""
    workload, layout, costs = plan_costs(plan)
    assert plan.hetero is not None
    return evaluate_hetero(workload, layout, plan.stages, plan.hetero, costs,
                           gradient_sync=plan.gradient_sync, actions=plan.pipeline_actions)


def test_timeline_draws_what_simulate_predicts(plan: Plan) -> None:
    ev = _evaluated(plan)
    segments = timeline_segments(plan)
    (bar,) = [s for s in segments if s.kind == "predicted"]
    assert bar.end_ms == ev.iteration_s * 1e3  # the same number, to the bit
    assert round(bar.end_ms, 6) == simulate(plan).iteration_time_ms
    assert max(s.end_ms for s in segments) == bar.end_ms
    # one row per stage, naming its ranks: every rank of the plan in exactly one row
    rows = [lane for lane in dict.fromkeys(s.lane for s in segments)
            if lane.startswith("stage") and "·" not in lane]
    assert rows == ["stage 0: ranks 2–3, V100-SXM2-32GB 2x1",
                    "stage 1: ranks 0–1, A100-80GB 2x1"]
    for k, row in enumerate(rows):
        mine = [s for s in segments if s.lane == row]
        for kind, want in (("F", ev.fwd_s[k]), ("B", ev.bwd_s[k])):
            got = [s.duration_ms for s in mine if s.kind == kind]
            assert len(got) == 4 and got == pytest.approx([want * 1e3] * 4, rel=1e-12)
        # the stage's gradient sync runs on its own DP timeline, ending where it finishes
        last_b = max(s.end_ms for s in mine if s.kind == "B")
        sync = [s for s in segments if s.lane.startswith(f"stage {k} · ")]
        assert sync and max(s.end_ms for s in sync) == pytest.approx(
            last_b + ev.stages[k].exposed_sync_s * 1e3, rel=1e-12)
    assert ev.fwd_s[0] > 1.2 * ev.fwd_s[1]  # each stage at its own device's speed (fp32)


def test_timeline_command_draws_the_plan(plan: Plan, tmp_path: Path) -> None:
    path, out = tmp_path / "plan.json", tmp_path / "t.html"
    plan.save(path)
    result = CliRunner().invoke(app, ["timeline", str(path), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.exists()


def _recording(plan: Plan, rank: int, stage: int) -> dict[str, Any]:
    """Rank ``rank`` of ``stage`` computing its stage's list, 1 ms an action, back to back."""
    assert plan.layout is not None
    tr = StepTrace(rank, (0, stage, 0), "host")
    tr.start(1)
    now = 10.0
    for a in plan_schedule(plan.layout, plan.pipeline_actions).actions[stage]:
        tr.add(f"{a.kind.value}{a.microbatch} s{a.stage}", "compute", now, now + 1e-3,
               kind=a.kind.value, microbatch=a.microbatch, stage=a.stage)
        now += 1e-3
    tr.add("micro-batches", "phase", 10.0, now)
    tr.stop()
    return tr.to_dict()


def _trace(plan: Plan) -> dict[str, Any]:
    ranks = [_recording(plan, r, st.index) for st in plan.stages for r in st.ranks]
    return json.loads(json.dumps(chrome_trace(ranks, {"plan_digest": plan_digest(plan),
                                                      "step": 1})))


def test_trace_compares_each_rank_with_its_stage(plan: Plan, tmp_path: Path) -> None:
    ev = _evaluated(plan)
    cmp = compare_trace(plan, load_trace(_trace(plan)))
    assert cmp["predicted_iteration_ms"] == round(ev.iteration_s * 1e3, 3)
    stage_of = {r: st.index for st in plan.stages for r in st.ranks}
    assert sorted(r["rank"] for r in cmp["ranks"]) == [0, 1, 2, 3]
    for row in cmp["ranks"]:
        k = stage_of[row["rank"]]
        assert row["pp_rank"] == k
        sim = {(e.kind.value, e.microbatch): e for e in ev.pipeline.events if e.rank == k}
        assert len(row["actions"]) == len(sim) == 8
        for a in row["actions"]:
            e = sim[(a["action"][0], int(a["action"][1:].split()[0]))]
            assert a["predicted_start_ms"] == round(e.start_ms, 3)
            want = ev.fwd_s[k] if e.kind.value == "F" else ev.bwd_s[k]
            assert a["predicted_ms"] == round(want * 1e3, 3)
        assert row["predicted"]["exposed_sync_ms"] == round(
            ev.stages[k].exposed_sync_s * 1e3, 3)
    path, trace = tmp_path / "plan.json", tmp_path / "trace.json"
    plan.save(path)
    trace.write_text(json.dumps(_trace(plan)))
    result = CliRunner().invoke(app, ["inspect", str(path), "--trace", str(trace)])
    assert result.exit_code == 0, result.output
    assert "rank 2 (pipeline rank 0)" in result.output
    assert "rank 0 (pipeline rank 1)" in result.output
