"""`hetplan run` of a 2-stage pipeline (2 gloo ranks): rank 0 holds the first stage, and
the loss is the last stage's. Its progress line printed "loss nan", which reads as a
diverged run, then "loss (on the last stage)", no loss at all; the line now comes from the
first rank of the last stage, with the loss."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

import hetplan
from hetplan.ir.cluster import ClusterSpec

pytestmark = pytest.mark.dist


def test_the_progress_line_of_a_pipeline_shows_the_last_stages_loss(tmp_path: Path) -> None:
    spec = ClusterSpec.from_preset("local-cpu").model_dump(mode="json")
    spec["nodes"][0]["devices"] = [{"type": "cpu", "count": 2}]
    plan = hetplan.compile("gpt-test", ClusterSpec.from_dict(spec), batch_size=4, dp=1, pp=2,
                           tp=1, dtype="fp32", zero_stage=0, optimizer="sgd")
    plan.save(tmp_path / "plan.json")
    proc = subprocess.run([sys.executable, "-m", "hetplan.cli", "run",
                           str(tmp_path / "plan.json"),
                           "--model", "gpt-test", "--steps", "1",
                           "--report", str(tmp_path / "report.json")], capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 3, proc.stdout  # 2 warm-up steps + 1
    losses = [float(line.split("loss ")[1].split()[0]) for line in steps]
    assert all(math.isfinite(x) for x in losses), steps
    assert any("rank 1: warm-up done" in line for line in proc.stdout.splitlines())
    # the losses shown are the training's: the report's final loss is the last one shown
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["final_loss"] == pytest.approx(losses[-1], abs=1e-4)
