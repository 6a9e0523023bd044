"""CPU ranks as Linux batch tasks on request (``hetplan.runtime.cpu_sched``): the policy read
from ``HETPLAN_CPU_SCHED``, its bad values refused, the default leaving the process alone, and
the profiler's ranks scheduled as the runtime's are."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hetplan.errors import SpecError
from hetplan.profiling._spawn import run_local_ranks
from hetplan.runtime.cpu_sched import ENV, apply_cpu_sched, cpu_sched_policy

linux_only = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"),
                                reason="SCHED_BATCH is Linux's; elsewhere the policy is left alone")


def test_the_default_is_normal_and_batch_can_be_chosen() -> None:
    assert cpu_sched_policy({}) == "normal"
    assert cpu_sched_policy({ENV: ""}) == "normal"
    assert cpu_sched_policy({ENV: " BATCH "}) == "batch"
    assert cpu_sched_policy({ENV: "normal"}) == "normal"


def test_a_bad_value_names_the_variable_and_the_values() -> None:
    with pytest.raises(SpecError, match=r"HETPLAN_CPU_SCHED='fifo'.*normal, batch"):
        cpu_sched_policy({ENV: "fifo"})
    with pytest.raises(SpecError, match=r"apply_cpu_sched\(policy='idle'\)"):
        apply_cpu_sched("idle")


def _policy_after_apply(env_value: str | None, start_batch: bool = False) -> str:
    """Apply the policy in a fresh interpreter (this process keeps its own), started under
    the batch policy if asked, and report what the kernel then says."""
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if env_value is not None:
        env[ENV] = env_value
    code = ("import os; from hetplan.runtime.cpu_sched import apply_cpu_sched; "
            "print(apply_cpu_sched(), os.sched_getscheduler(0) == os.SCHED_BATCH)")
    start = os.SCHED_BATCH if start_batch else os.SCHED_OTHER  # whatever pytest runs under
    pre = lambda: os.sched_setscheduler(0, start, os.sched_param(0))  # noqa: E731
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=60, check=True, preexec_fn=pre)
    return out.stdout.strip()


@linux_only
def test_apply_sets_the_kernel_policy_of_the_process() -> None:
    assert _policy_after_apply("batch") == "batch True"
    assert _policy_after_apply(None) == "normal False"
    # the default leaves a process started as a batch task (e.g. under chrt -b) as it is
    assert _policy_after_apply(None, start_batch=True) == "batch True"


def _policy(rank: int, world: int) -> bool:
    return os.sched_getscheduler(0) == os.SCHED_BATCH


@linux_only
def test_profiler_ranks_follow_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """``hetplan profile``'s processes are scheduled as ``hetplan run``'s workers are, so a
    profile and a run under the same value measure the same thing."""
    monkeypatch.setenv(ENV, "batch")
    assert run_local_ranks(_policy, 2, backend=None, timeout_s=60) == [True, True]
    monkeypatch.setenv(ENV, "normal")  # the ranks keep the policy they were started with
    started = os.sched_getscheduler(0) == os.SCHED_BATCH
    assert run_local_ranks(_policy, 2, backend=None, timeout_s=60) == [started, started]


def test_hetplan_run_refuses_a_bad_value_before_any_rank_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    import hetplan
    from hetplan.cli import app
    from hetplan.runtime import launch as launch_mod

    def never(*_a: object, **_k: object) -> None:
        raise AssertionError("launched despite a bad HETPLAN_CPU_SCHED")

    monkeypatch.setattr(launch_mod, "launch", never)
    plan = hetplan.compile("mlp", "local-cpu", batch_size=8, dp=4, pp=1, tp=1)
    path = tmp_path / "plan.json"
    plan.save(path)
    monkeypatch.setenv(ENV, "realtime")
    res = CliRunner().invoke(app, ["run", str(path), "--model", "mlp"])
    assert res.exit_code == 2, res.output
    assert "HETPLAN_CPU_SCHED='realtime'" in " ".join(res.output.split())


def test_hetplan_profile_refuses_a_bad_value_before_measuring(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from hetplan.profiling import run_profile

    monkeypatch.setenv(ENV, "fifo")
    with pytest.raises(SpecError, match="HETPLAN_CPU_SCHED='fifo'"):
        run_profile(None, what=["collectives"], output=tmp_path / "p.json", show_progress=False)
    assert not (tmp_path / "p.json").exists()


def test_hetplan_profile_refuses_a_bad_start_method_before_measuring(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Was: "internal error: ValueError" (exit 1) once the first measurement started."""
    from hetplan.profiling import run_profile

    monkeypatch.setenv("HETPLAN_START_METHOD", "frk")
    with pytest.raises(SpecError, match="HETPLAN_START_METHOD='frk'.*'forkserver'"):
        run_profile(None, what=["collectives"], output=tmp_path / "p.json", show_progress=False)
    assert not (tmp_path / "p.json").exists()


@linux_only
def test_a_refused_policy_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_a: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_getscheduler", lambda _pid: os.SCHED_OTHER)
    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    with pytest.raises(SpecError, match="HETPLAN_CPU_SCHED=batch: this system refuses.*unset"):
        apply_cpu_sched("batch")


@pytest.mark.parametrize("policy", ["batch", "normal"])
def test_inspect_run_says_when_the_ranks_ran_as_batch_tasks(tmp_path: Path,
                                                           policy: str) -> None:
    from typer.testing import CliRunner

    import hetplan
    from hetplan.cli import app

    plan = hetplan.compile("mlp", "local-cpu", batch_size=8, dp=4, pp=1, tp=1)
    plan.save(tmp_path / "plan.json")
    measured = {"iteration_ms": 2.0, "compute_ms": 1.0, "bubble_ms": 0.0,
                "exposed_comm_ms": 0.5, "optimizer_ms": 0.5, "per_iteration_ms": [2.0]}
    report = {"world_size": 4, "steps": 1, "final_loss": 1.0, "measured": measured,
              "per_rank": [], "loss_per_step": [1.0], "cpu_sched": policy}
    (tmp_path / "report.json").write_text(json.dumps(report))
    res = CliRunner().invoke(app, ["inspect", str(tmp_path / "plan.json"), "--run",
                                   str(tmp_path / "report.json")])
    assert res.exit_code == 0, res.output
    said = "ran as batch tasks (HETPLAN_CPU_SCHED=batch)" in " ".join(res.output.split())
    assert said == (policy == "batch")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the variable applies to CPU ranks")
def test_a_worker_refuses_a_bad_value_in_one_line_with_code_2() -> None:
    """A rank started outside ``hetplan run`` (plain torchrun) checks the variable itself,
    before it starts any thread or joins a group."""
    env = {**os.environ, ENV: "fifo"}
    proc = subprocess.run([sys.executable, "-m", "hetplan.runtime.worker", "--plan", "x.json"],
                          env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "HETPLAN_CPU_SCHED='fifo'" in proc.stderr
    assert "Traceback" not in proc.stderr
