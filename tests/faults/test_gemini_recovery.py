"""Gemini recovery on gloo: 4 ranks as 4 nodes (``cpu-4-nodes``), a pipeline plan
(pp=2 × dp=2), m = 2 replicas in groups {0,1} {2,3}, under ``hetplan run --max-restarts 1``.

* One rank is killed mid-run and its node's CPU snapshots wiped: torchrun restarts the job,
  the rank fetches its state from its holder, every rank resumes at the same iteration, and
  the parameters after the last step are bitwise equal to those of a run without a failure.
* Both ranks of one group are killed and wiped: no iteration is held in CPU memory by every
  rank, so the job falls back to the ``torch.distributed.checkpoint`` save on storage, and
  again ends bitwise equal.

Both failures happen in one run (``--max-restarts 2``; the group is lost once the restarted
job has trained on to iteration :data:`SECOND_KILL`), so one launch serves both tests: each
reads the lines of its own restart, and both compare the run's final parameters with the
reference. A run launched per failure cost a whole ``hetplan run`` start (about 15 s of the
CLI, torchrun and four ranks importing torch) and its 42 steps more.

The final parameters are read from each rank's last snapshot in the store (a
``HETPLAN_CHECKPOINT_DIR`` given by the user is kept after the run).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from faultlib import Job, start

import hetplan
from hetplan.ir.cluster import ClusterSpec
from hetplan.runtime.checkpoint_snapshot import unpack
from hetplan.runtime.checkpoint_store import NodeStore

pytestmark = pytest.mark.dist

CLUSTER = Path(__file__).resolve().parents[1] / "fixtures" / "clusters" / "cpu-4-nodes.yaml"
STEPS = 40  # + 2 warm-up iterations: 42 in all
LAST = STEPS + 2
STORAGE_EVERY = 5
FIRST_KILL = 8  # rank 1 lost: restored from its holder
SECOND_KILL = 14  # ranks 0 and 1 lost, after the first restart: restored from storage


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = hetplan.compile("gpt-test", ClusterSpec.load(CLUSTER), batch_size=8, pp=2,
                        dp=2, zero_stage=0,  # the runtime runs ZeRO only without a pipeline
                        passes="dynpipe,even-tp,ddp-buckets,gemini{replicas=2}")
    assert p.checkpointing is not None and p.checkpointing.every_iters == 1
    ck = p.checkpointing.model_copy(update={"storage_every_iters": STORAGE_EVERY})
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    p.model_copy(update={"checkpointing": ck}).save(path)
    return path


def _run(tmp: Path, plan: Path, restarts: int) -> tuple[Job, Path]:
    store = tmp / "store"
    job = start(tmp, str(plan), "--model", "gpt-test", "--steps", str(STEPS),
                "--max-restarts", str(restarts), timeout_s=20,
                env={"HETPLAN_CHECKPOINT_DIR": str(store)})
    return job, store


def _finish(job: Job) -> None:
    try:
        assert job.proc.wait(timeout=300) == 0, job.stderr()[-4000:]
    finally:
        job.cleanup()


def _final_params(store: Path) -> dict[int, dict[str, torch.Tensor]]:
    out = {}
    for rank in range(4):
        blob = NodeStore(store, rank).read("own", rank, LAST)  # node n holds rank n
        out[rank] = unpack(blob)["params"]
    return out


def _newest(store: Path, rank: int) -> int:
    return max(NodeStore(store, rank).iterations("own", rank), default=-1)


def _kill_after(job: Job, store: Path, ranks: list[int], iteration: int) -> int:
    """Wait until every rank has a snapshot of ``iteration``, SIGKILL ``ranks`` and wipe
    their nodes' stores (the machines are lost); the newest iteration a killed rank had
    snapshotted (its step after that one cannot have finished before its holder had it)."""
    deadline = time.monotonic() + 240
    while min(_newest(store, r) for r in range(4)) < iteration:
        assert job.proc.poll() is None, job.stderr()[-3000:]
        assert time.monotonic() < deadline, "the ranks never reached the kill iteration"
        time.sleep(0.01)
    pids = job.ranks()
    for r in ranks:
        os.kill(pids[r], signal.SIGKILL)
    newest = max(_newest(store, r) for r in ranks)
    for r in ranks:
        shutil.rmtree(store / f"node{r}", ignore_errors=True)
    return newest


@pytest.fixture(scope="module")
def reference(plan: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    tmp = tmp_path_factory.mktemp("reference")
    job, store = _run(tmp, plan, restarts=1)
    _finish(job)
    assert "resumed" not in job.stderr()
    return _final_params(store)


@dataclass(frozen=True)
class Failures:
    """The run that lost rank 1, then ranks 0 and 1: each restart's stderr, the newest
    iteration rank 1 had snapshotted when it was killed, and the final parameters."""

    first: str  # from the start to the second kill (the holder restart's lines)
    second: str  # from the second kill on (the storage restart's lines)
    snapshotted: int
    params: dict[int, dict[str, torch.Tensor]]


@pytest.fixture(scope="module")
def failures(plan: Path, tmp_path_factory: pytest.TempPathFactory) -> Failures:
    job, store = _run(tmp_path_factory.mktemp("failures"), plan, restarts=2)
    try:
        snapshotted = _kill_after(job, store, [1], FIRST_KILL)
        # every rank has resumed and trained on to SECOND_KILL before this kill, so the first
        # restart's lines are all written; the next restart's ranks need seconds to start
        _kill_after(job, store, [0, 1], SECOND_KILL)
        cut = len(job.stderr())
    except BaseException:
        job.cleanup()
        raise
    _finish(job)
    err = job.stderr()
    return Failures(err[:cut], err[cut:], snapshotted, _final_params(store))


def _assert_bitwise(got: dict[int, dict], want: dict[int, dict]) -> None:
    for rank in range(4):
        assert got[rank].keys() == want[rank].keys()
        for name, t in want[rank].items():
            assert torch.equal(got[rank][name], t), f"rank {rank} {name} differs"


def test_killed_rank_fetches_from_holder_bitwise_equal(failures: Failures,
                                                       reference: dict) -> None:
    err, snapshotted = failures.first, failures.snapshotted
    fetched = re.findall(r"rank 1: checkpointing: resumed at iteration (\d+) from holder "
                         r"rank 0", err)
    assert fetched, err[-3000:]
    resumed = {int(m) for m in re.findall(r"resumed at iteration (\d+)", err)}
    assert len(resumed) == 1  # every rank at the same iteration
    # rank 1 had completed `snapshotted` steps, or one more if its holder had acknowledged
    # that snapshot (then the holder has it): at most one completed iteration is lost
    assert min(resumed) >= snapshotted - 1
    assert "from the storage" not in err  # the holder had it
    _assert_bitwise(failures.params, reference)


def test_whole_group_lost_falls_back_to_storage(failures: Failures, reference: dict) -> None:
    err = failures.second
    steps = {int(m) for m in re.findall(r"resumed at iteration (\d+) from the storage", err)}
    assert len(steps) == 1 and min(steps) % STORAGE_EVERY == 0 and min(steps) >= 10, err[-3000:]
    _assert_bitwise(failures.params, reference)
