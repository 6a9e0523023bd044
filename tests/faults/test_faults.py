"""Fault injection on ``hetplan run`` with 4 gloo ranks and ``--timeout 10``: a killed rank, a
frozen rank, the launcher stopped by SIGINT (Ctrl-C), SIGTERM or SIGKILL, torchrun killed,
and ranks that load different plans.

In every case the test reads the process table: every process of the job (launcher,
torchrun, ranks, found by an environment marker) is gone within the timeout + 10 s of the
fault, and the exit code and the lines printed are the documented ones. Whatever a failing
test leaves is killed in a ``finally``.
"""

from __future__ import annotations

import os
import re
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from faultlib import ROOT, TIMEOUT_S, WORLD, Job, rank_lines, start, write_plan

from hetplan.runtime.launch import RUN_DIR_PREFIX, STALE_AFTER_S, sweep_run_dirs

pytestmark = pytest.mark.dist

#: the bound of the issue: every process gone within the run's timeout + 10 s of the fault
GONE_WITHIN_S = TIMEOUT_S + 10


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_plan(tmp_path_factory.mktemp("plan") / "plan.json")


@pytest.fixture
def training(tmp_path: Path, plan: Path) -> Iterator[Callable[[], Job]]:
    """Starts ``hetplan run plan --model mlp`` for many steps and waits until the ranks
    train; kills what the test leaves."""
    jobs: list[Job] = []

    def run() -> Job:
        job = start(tmp_path, str(plan), "--model", "mlp", "--steps", "100000")
        jobs.append(job)
        job.wait_for_output("warm-up done")
        assert sorted(job.ranks()) == list(range(WORLD)), job.processes()
        return job

    try:
        yield run
    finally:
        for job in jobs:
            job.cleanup()


def _finish(job: Job) -> tuple[int, str]:
    """Wait until every process of the job is gone (bounded); the exit code and stderr."""
    job.wait_until_gone(GONE_WITHIN_S)
    code = job.proc.wait(timeout=5)
    return code, job.stderr()


def test_a_killed_rank_ends_the_run(training: Callable[[], Job]) -> None:
    job = training()
    os.kill(job.ranks()[2], signal.SIGKILL)
    code, err = _finish(job)
    assert code == 1, err[-3000:]
    assert re.search(r"rank\s+: 2 .*\n.*exitcode\s+: -9", err), err[-3000:]  # torchrun's box
    assert "error: training failed (exit code 1)" in err


def test_a_frozen_rank_is_named_by_every_other_rank(training: Callable[[], Job]) -> None:
    job = training()
    os.kill(job.ranks()[1], signal.SIGSTOP)
    code, err = _finish(job)
    assert code == 1, err[-3000:]
    named = {int(m.group(1)): m.group(2) for m in re.finditer(
        r"^rank (\d+): ranks? ([\d, ]+) stopped responding", err, re.M)}
    assert sorted(named) == [0, 2, 3], err[-3000:]
    assert all("1" in who.replace(" ", "").split(",") for who in named.values()), named
    assert "hetplan run: killed rank 1" in err  # it ignored torchrun's SIGTERM, frozen


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_stopped_launcher_stops_every_rank_with_one_line_each(
    training: Callable[[], Job], sig: signal.Signals, code: int
) -> None:
    job = training()
    if sig == signal.SIGINT:  # Ctrl-C: the terminal signals the foreground process group
        os.killpg(job.proc.pid, sig)
    else:
        os.kill(job.proc.pid, sig)
    got, err = _finish(job)
    assert got == code, err[-3000:]
    assert sorted(rank_lines(err, f"stopped by {sig.name}$")) == list(range(WORLD)), err
    assert "Traceback" not in err and "SignalException" not in err, err
    assert f"stopped by {sig.name}: every process of the run has ended" in err


def test_a_killed_launcher_takes_its_tree_with_it(training: Callable[[], Job]) -> None:
    """... and the run directory it could not remove goes at the next launch's sweep."""
    job = training()
    os.kill(job.proc.pid, signal.SIGKILL)
    code, _ = _finish(job)
    assert code == -signal.SIGKILL
    pattern = f"{RUN_DIR_PREFIX}{job.proc.pid}-*"
    left = list(Path(tempfile.gettempdir()).glob(pattern))
    assert len(left) == 1, left  # SIGKILL: the launcher could not remove it
    # its lock is free; aged past the threshold, the sweep of the next launch removes it (no
    # threshold of 0 here: that could take a launcher starting beside this test)
    for lock in left[0].iterdir():
        old = time.time() - 2 * STALE_AFTER_S
        os.utime(lock, (old, old))
    sweep_run_dirs()
    assert not list(Path(tempfile.gettempdir()).glob(pattern))


def test_a_killed_torchrun_ends_the_run(training: Callable[[], Job]) -> None:
    job = training()
    torchrun = job.torchrun()
    os.kill(torchrun, signal.SIGKILL)
    code, err = _finish(job)
    assert code == 1, err[-3000:]
    assert f"torchrun (pid {torchrun}) was killed by SIGKILL" in err


def test_ranks_with_different_plans_all_refuse(tmp_path: Path, plan: Path) -> None:
    other = write_plan(tmp_path / "other.json", batch_size=16)
    job = start(tmp_path, str(plan), "--script",
                str(ROOT / "tests" / "faults" / "two_plans_train.py"), "--steps", "3",
                env={"HETPLAN_FAULT_OTHER_PLAN": str(other)})
    try:
        code = job.proc.wait(timeout=300)  # the refusal comes as the ranks start
        job.wait_until_gone(GONE_WITHIN_S)
        err = job.stderr()
    finally:
        job.cleanup()
    assert code == 2, err[-3000:]
    assert sorted(rank_lines(err, "error: the ranks loaded different plans")) == [0, 1, 2, 3]
    assert re.search(r"rank\(s\) 0, 1 loaded plan \w+ \(.*global batch 8", err), err
    assert re.search(r"rank\(s\) 2, 3 loaded plan \w+ \(.*global batch 16", err), err
    assert "Received data size" not in err and "step 0" not in job.stdout()
