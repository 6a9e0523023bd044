"""`hetplan run` of a 2-stage pipeline (2 gloo ranks): rank 0 holds the first stage, so the
loss its progress line shows is the last stage's; it printed "loss nan", which reads as a
diverged run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import hetplan
from hetplan.ir.cluster import ClusterSpec

pytestmark = pytest.mark.dist


def test_the_progress_line_of_a_pipeline_shows_no_nan_loss(tmp_path: Path) -> None:
    spec = ClusterSpec.from_preset("local-cpu").model_dump(mode="json")
    spec["nodes"][0]["devices"] = [{"type": "cpu", "count": 2}]
    plan = hetplan.compile("gpt-test", ClusterSpec.from_dict(spec), batch_size=4, dp=1, pp=2,
                           tp=1, dtype="fp32", zero_stage=0, optimizer="sgd")
    plan.save(tmp_path / "plan.json")
    proc = subprocess.run([sys.executable, "-m", "hetplan.cli", "run",
                           str(tmp_path / "plan.json"),
                           "--model", "gpt-test", "--steps", "1"], capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 3, proc.stdout  # 2 warm-up steps + 1
    assert all("loss (on the last stage)" in line and "nan" not in line for line in steps)
