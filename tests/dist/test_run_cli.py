"""`hetplan run` end to end: compile a plan, train it under torchrun (2 gloo ranks), read the
run report; a user's training script; a plan for another model, or a report path that cannot
be written, refused before any rank starts. (Signals and dead or frozen ranks:
tests/faults.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import hetplan
from hetplan.ir.cluster import ClusterSpec

pytestmark = pytest.mark.dist


def _cluster(world: int) -> ClusterSpec:
    spec = ClusterSpec.from_preset("local-cpu").model_dump(mode="json")
    spec["nodes"][0]["devices"] = [{"type": "cpu", "count": world}]
    return ClusterSpec.from_dict(spec)


def _hetplan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hetplan.cli", *args], capture_output=True,
                          text=True, timeout=240, check=False)


def _refused_in_process(*args: str) -> subprocess.CompletedProcess[str]:
    """A `hetplan` command that must be refused before any rank starts, run in this process
    through typer's CliRunner: no interpreter start, torch import or interpreter teardown of
    its own (about 8 s). Were it not refused, the launcher would release the torchrun it
    holds (:meth:`_Job.release`), which the tests check for: the returned stderr then ends
    with a line saying so."""
    from typer.testing import CliRunner

    from hetplan.cli import app
    from hetplan.runtime import launch

    released: list[object] = []
    real = launch._Job.release
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(launch._Job, "release",
                   lambda job: (released.append(job), real(job))[1])
        res = CliRunner().invoke(app, list(args))
    stderr = res.stderr + ("torchrun released\n" if released else "")
    return subprocess.CompletedProcess(list(args), res.exit_code, res.stdout, stderr)


def test_run_trains_and_reports(tmp_path: Path) -> None:
    plan = hetplan.compile("gpt-test", _cluster(2), batch_size=4, dp=2, pp=1, tp=1)
    plan.save(tmp_path / "plan.json")
    report = tmp_path / "report.json"
    proc = _hetplan("run", str(tmp_path / "plan.json"), "--model", "gpt-test", "--steps", "3",
                    "--report", str(report))
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(report.read_text())
    assert data["world_size"] == 2 and data["steps"] == 3
    assert len(data["measured"]["per_iteration_ms"]) == 3
    assert data["predicted"]["iteration_ms"] == plan.predictions.iteration_time_ms
    assert "measured" in proc.stdout
    # "warm-up done" follows the last warm-up step's line (it came before it: step 2 of the
    # 2 warm-up steps was printed after it, as if timed)
    lines = proc.stdout.splitlines()
    done = next(i for i, line in enumerate(lines) if "warm-up done" in line)
    assert lines[done - 1].startswith("step 2/5 "), lines


def test_run_refuses_a_plan_for_another_model_before_any_rank_starts(tmp_path: Path) -> None:
    plan = hetplan.compile("gpt-test", _cluster(2), batch_size=4, dp=2, pp=1, tp=1)
    plan.save(tmp_path / "plan.json")
    proc = _refused_in_process("run", str(tmp_path / "plan.json"), "--model", "mlp",
                               "--steps", "1")
    assert proc.returncode == 2
    assert "plan does not match" in proc.stderr and "the model given is 'mlp'" in proc.stderr
    assert "Traceback (most recent call last)" not in proc.stdout + proc.stderr
    assert "torchrun released" not in proc.stderr  # it never started a rank


def test_an_unwritable_report_path_is_refused_before_training(tmp_path: Path) -> None:
    plan = hetplan.compile("gpt-test", _cluster(2), batch_size=4, dp=2, pp=1, tp=1)
    plan.save(tmp_path / "plan.json")
    proc = _refused_in_process("run", str(tmp_path / "plan.json"), "--model", "gpt-test",
                               "--report", str(tmp_path / "missing" / "r.json"))
    assert proc.returncode == 2
    assert "--report" in proc.stderr and "does not exist" in proc.stderr
    assert "torchrun released" not in proc.stderr


def test_run_a_user_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from hetplan.cli import app

    root = Path(__file__).resolve().parents[2]
    plan_path = tmp_path / "plan.json"
    # in-process: planning needs no fresh interpreter (`hetplan run` below starts one); the
    # factory is imported from the working directory, as `hetplan plan --module` does
    monkeypatch.chdir(root)
    planned = CliRunner().invoke(app, ["plan", "--module", "examples.train:factory",
                                       "--cluster", "local-cpu", "-b", "8", "--dp", "4", "-o",
                                       str(plan_path)])
    assert planned.exit_code == 0, planned.output[-2000:]
    proc = _hetplan("run", str(plan_path), "--script", str(root / "examples" / "train.py"),
                    "--steps", "6")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("step 5: loss") == 4  # every rank trained to the end
    assert "terminate called" not in proc.stderr


def test_pipeline_run_reports_the_bubble_of_every_rank(tmp_path: Path) -> None:
    plan = hetplan.compile("mlp", _cluster(2), batch_size=8, dp=1, pp=2, tp=1,
                           micro_batch_size=2)
    assert plan.layout is not None and plan.layout.micro_batches == 4
    plan.save(tmp_path / "plan.json")
    report = tmp_path / "report.json"
    proc = _hetplan("run", str(tmp_path / "plan.json"), "--model", "mlp", "--steps", "4",
                    "--report", str(report))
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(report.read_text())
    per_rank = data["per_rank"]
    assert [r["rank"] for r in per_rank] == [0, 1]
    # a two-stage pipeline always waits: stage 0 for the first backward, stage 1 for the
    # first forward
    assert all(r["bubble_ms"] > 0 for r in per_rank)
    # compute and bubble of the busiest rank, as the prediction's breakdown is the busiest
    # pipeline rank's: the two numbers come from one rank
    busiest = max(per_rank, key=lambda r: r["compute_ms"])
    measured = data["measured"]
    assert measured["busiest_rank"] == busiest["rank"]
    assert (measured["compute_ms"], measured["bubble_ms"]) == (busiest["compute_ms"],
                                                               busiest["bubble_ms"])
    assert data["predicted"]["bubble_ms"] == plan.predictions.breakdown.bubble_ms
    for r in per_rank:  # medians of parts need not add up exactly; they are close
        parts = r["compute_ms"] + r["bubble_ms"] + r["exposed_comm_ms"] + r["optimizer_ms"]
        assert parts == pytest.approx(r["iteration_ms"], rel=0.25)
    shown = _hetplan("inspect", str(tmp_path / "plan.json"), "--run", str(report)).stdout
    assert "pipeline bubble" in shown
    assert f"measured on rank {busiest['rank']}, the busiest" in shown
