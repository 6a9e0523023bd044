"""`hetplan run` of a plan with bf16, ZeRO-1 and full recomputation (2 gloo ranks): the run
report holds the loss per step and every rank's measured peak memory beside the predicted
one; a progress line per step while it runs; `hetplan inspect --run` shows both side by
side."""

from __future__ import annotations

import json
import os
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
                          text=True, timeout=300, check=False)


def test_run_report_with_memory_and_losses(tmp_path: Path) -> None:
    plan = hetplan.compile("gpt-test", _cluster(2), batch_size=8, dp=2, pp=1, tp=1,
                           dtype="bf16", zero_stage=1, recompute="full", optimizer="sgd")
    assert plan.precision is not None and plan.layout is not None
    assert plan.layout.zero_stage == 1 and plan.stages[0].recompute == "full"
    plan.save(tmp_path / "plan.json")
    report = tmp_path / "report.json"
    proc = _hetplan("run", str(tmp_path / "plan.json"), "--model", "gpt-test", "--steps", "3",
                    "--report", str(report))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("loss ") >= 5 and "step 5/5" in proc.stdout  # 2 warm-up + 3
    data = json.loads(report.read_text())
    losses = data["loss_per_step"]
    assert len(losses) == 5 and all(x == x for x in losses)  # no NaN
    for r in data["per_rank"]:
        # measured in the last warm-up step: the run trains the 5 steps it prints, no more
        assert r["peak_memory_step"] == 2
        measured, predicted = r["peak_memory_bytes"], r["predicted_memory_bytes"]
        assert measured > 0 and predicted > 0
        # the process's CPU time per step: spent, and no more than the host's cores could give
        # in the step (a bound the hardware sets, not a timing: the half is the slack between
        # the step clock's window and the CPU clock's)
        assert 0 < r["cpu_ms"] <= 1.5 * (os.cpu_count() or 1) * r["iteration_ms"]
        assert set(r["predicted_memory_by_kind"]) == {"params", "grads", "optimizer",
                                                      "activations", "buffers"}
    assert plan.predictions is not None
    assert data["predicted"]["optimizer_ms"] == plan.predictions.breakdown.optimizer_ms > 0
    assert data["measured"]["optimizer_ms"] > 0
    # no pipeline: compute is rank 0's, no rank is named the busiest
    assert data["measured"]["busiest_rank"] is None
    assert data["measured"]["compute_ms"] == data["per_rank"][0]["compute_ms"]
    shown = _hetplan("inspect", str(tmp_path / "plan.json"), "--run", str(report))
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert "measured MiB" in shown.stdout and "loss per step" in shown.stdout
    assert "optimizer step" in shown.stdout and "optimizer ms" in shown.stdout


def test_run_report_without_warm_up_meters_one_more_step(tmp_path: Path) -> None:
    """With one warm-up step (whose optimizer state would not exist yet) the peak is
    measured in an extra step after the timed ones (the worker's own ``--warmup``; the CLI
    always runs two)."""
    plan = hetplan.compile("gpt-test", _cluster(2), batch_size=8, dp=2, pp=1, tp=1,
                           optimizer="sgd")
    plan.save(tmp_path / "plan.json")
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc-per-node", "2", "-m", "hetplan.runtime.worker", "--plan",
           str(tmp_path / "plan.json"), "--model", "gpt-test", "--steps", "2", "--warmup", "1",
           "--report", str(report)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(report.read_text())
    assert len(data["loss_per_step"]) == 3
    assert [r["peak_memory_step"] for r in data["per_rank"]] == [4, 4]
    assert all(r["peak_memory_bytes"] > 0 for r in data["per_rank"])
