"""`hetplan run` end to end: compile a plan, train it under torchrun (2 gloo ranks), read the
run report; and a plan for another world size is refused by every rank."""

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
    # the ranks' one-line errors and torchrun's summary, no Python traceback anywhere
    assert "Traceback (most recent call last)" not in proc.stdout + proc.stderr
    assert "FAILED" in proc.stderr  # torchrun's summary box names the failed ranks


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
    assert data["measured"]["bubble_ms"] == max(r["bubble_ms"] for r in per_rank)
    assert data["predicted"]["bubble_ms"] == plan.predictions.breakdown.bubble_ms
    for r in per_rank:  # medians of parts need not add up exactly; they are close
        parts = r["compute_ms"] + r["bubble_ms"] + r["exposed_comm_ms"] + r["optimizer_ms"]
        assert parts == pytest.approx(r["iteration_ms"], rel=0.25)
    assert "pipeline bubble" in _hetplan("inspect", str(tmp_path / "plan.json"), "--run",
                                         str(report)).stdout


def test_ctrl_c_stops_every_rank(tmp_path: Path) -> None:
    import signal
    import time

    plan = hetplan.compile("gpt-test", _cluster(2), batch_size=4, dp=2, pp=1, tp=1)
    plan.save(tmp_path / "plan.json")
    # a terminal's Ctrl-C sends SIGINT to the foreground process group: hetplan and torchrun
    # (torchrun starts the ranks in sessions of their own and stops them itself)
    proc = subprocess.Popen(
        [sys.executable, "-m", "hetplan.cli", "run", str(tmp_path / "plan.json"), "--model",
         "gpt-test", "--steps", "5000"],  # bounded, even if all else fails
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(workers) < 2:
            time.sleep(0.5)
            workers = _workers_under(proc.pid)
        assert len(workers) == 2, "the ranks never started"
        time.sleep(3.0)  # let them train
        os.killpg(os.getpgid(proc.pid), signal.SIGINT)
        proc.communicate(timeout=60)
        assert proc.returncode != 0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_alive(p) for p in workers):
            time.sleep(0.5)
        assert not any(_alive(p) for p in workers), "ranks still running after Ctrl-C"
    finally:  # never leave ranks behind, whatever failed above
        for pid in [*_descendants(proc.pid), proc.pid, *workers]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=30)


def _workers_under(root: int) -> list[int]:
    """Descendants of ``root`` that run hetplan's worker (not torchrun itself)."""
    return [p for p, c in _descendants(root).items()
            if b"hetplan.runtime.worker" in c and b"torch.distributed.run" not in c]


def _descendants(root: int) -> dict[int, bytes]:
    """Every descendant process of ``root`` with its command line, from /proc."""
    parent: dict[int, int] = {}
    cmd: dict[int, bytes] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmd[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])

    def under(pid: int) -> bool:
        while pid > 1:
            pid = parent.get(pid, 0)
            if pid == root:
                return True
        return False

    return {p: c for p, c in sorted(cmd.items()) if under(p)}


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
