"""`hetplan run` end to end: compile a plan, train it under torchrun (2 gloo ranks), read the
run report; and a plan for another world size is refused by every rank."""

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


def test_run_refuses_a_plan_for_another_model(tmp_path: Path) -> None:
    plan = hetplan.compile("gpt-test", _cluster(2), batch_size=4, dp=2, pp=1, tp=1)
    plan.save(tmp_path / "plan.json")
    proc = _hetplan("run", str(tmp_path / "plan.json"), "--model", "mlp", "--steps", "1")
    assert proc.returncode == 2
    assert "does not match the plan" in proc.stderr
    assert "Traceback (most recent call last)" not in proc.stdout


def test_run_a_user_script(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    plan_path = tmp_path / "plan.json"
    proc = subprocess.run(
        [sys.executable, "-m", "hetplan.cli", "plan", "--module", "examples.train:factory",
         "--cluster", "local-cpu", "-b", "8", "--dp", "4", "-o", str(plan_path)],
        capture_output=True, text=True, timeout=240, check=False, cwd=root,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = _hetplan("run", str(plan_path), "--script", str(root / "examples" / "train.py"),
                    "--steps", "6")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 5: loss" in proc.stdout
