"""Which loss `hetplan run` prints and which one its report holds, said where a user reads
them: with several data-parallel replicas, the progress line shows the printing rank's
replica's loss and the report the replicas' mean, so the last printed loss and the report's
``final_loss`` differed without a word (9.8509 printed, 9.8574 in the report)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

import hetplan
from hetplan.cli import app
from hetplan.runtime.worker import _loss_note


def test_the_progress_line_says_whose_loss_it_is() -> None:
    assert _loss_note(0, 1) is None  # one replica: its loss is the batch's
    note = _loss_note(2, 4)
    assert note is not None and note.startswith("rank 2: ")
    assert "replica's (1 of 4)" in note and "mean over the replicas" in note


def _inspect_run(tmp_path: Path, model: str, dp: int) -> str:
    plan = hetplan.compile(model, "local-cpu", batch_size=8, dp=dp, tp=1)
    plan.save(tmp_path / "plan.json")
    measured = {"iteration_ms": 2.0, "compute_ms": 1.0, "bubble_ms": 0.0,
                "exposed_comm_ms": 0.5, "optimizer_ms": 0.5, "per_iteration_ms": [2.0]}
    report = {"world_size": 4, "steps": 1, "final_loss": 1.0, "measured": measured,
              "per_rank": [], "loss_per_step": [1.5, 1.0], "cpu_sched": "normal"}
    (tmp_path / "report.json").write_text(json.dumps(report))
    res = CliRunner().invoke(app, ["inspect", str(tmp_path / "plan.json"), "--run",
                                   str(tmp_path / "report.json"), "-s", "layout"])
    assert res.exit_code == 0, res.output
    return " ".join(res.output.split())


def test_inspect_run_says_the_loss_is_the_replicas_mean(tmp_path: Path) -> None:
    assert ("loss per step (mean over the 4 data-parallel replicas): 1.5000 1.0000"
            in _inspect_run(tmp_path, "mlp", 4))
    # one replica (a 4-stage pipeline): its loss is the batch's
    assert "loss per step: 1.5000 1.0000" in _inspect_run(tmp_path, "gpt-test", 1)


def test_inspect_run_says_what_its_error_column_is(tmp_path: Path) -> None:
    """'-84.3%' under 'error' left the sign to guess: predicted below measured."""
    assert ("error: (predicted - measured) / measured; below 0, the run took longer than "
            "predicted"
            in _inspect_run(tmp_path, "mlp", 4))


def test_validate_summarises_a_run_report(tmp_path: Path) -> None:
    """validate said only 'ok: r.json is a valid run report', where it summarises every
    other kind of file; it now gives the run's ranks, steps and measured iteration, and
    what reads the report."""
    report = {"world_size": 4, "steps": 3, "final_loss": 1.0, "per_rank": [],
              "measured": {"iteration_ms": 805.739, "compute_ms": 1.0, "bubble_ms": 0.0,
                           "exposed_comm_ms": 0.5, "optimizer_ms": 0.5,
                           "per_iteration_ms": [805.739]},
              "loss_per_step": [1.0], "cpu_sched": "normal"}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    res = CliRunner().invoke(app, ["validate", str(path)])
    assert res.exit_code == 0, res.output
    said = " ".join(res.output.split())
    assert ("is a valid run report: 4 rank(s), 3 timed step(s), 805.74 ms/iteration measured; "
            "`hetplan inspect PLAN --run` puts it beside") in said


def test_a_plan_with_per_stage_degrees_counts_the_last_stages_replicas() -> None:
    """Its layout holds placeholders (dp 1): the replicas that compute a loss are the last
    stage's; the loss notes of `run` and `inspect --run` never appeared for such plans."""
    from types import SimpleNamespace

    from hetplan.ir.plan import Plan

    stages = [SimpleNamespace(dp=4), SimpleNamespace(dp=16)]
    fake = SimpleNamespace(hetero=SimpleNamespace(stages=stages),
                           layout=SimpleNamespace(dp=1))
    assert Plan.loss_replicas(fake) == 16  # type: ignore[arg-type]
    fake.hetero = None
    fake.layout.dp = 3
    assert Plan.loss_replicas(fake) == 3  # type: ignore[arg-type]
