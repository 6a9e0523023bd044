"""Helpers of the fault-injection tests: start ``hetplan run`` as a user would, find every
process of the job in the process table, inject a fault, and never leave a process behind.

Every process a test starts carries ``HETPLAN_FAULT_TEST=<unique id>`` in its environment
(the launcher gets it, torchrun and the ranks inherit it), so the job's processes are found
in ``/proc`` whatever re-parented them: this is independent of the launcher's own marker.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import hetplan
from hetplan.ir.cluster import ClusterSpec

MARK = "HETPLAN_FAULT_TEST"
WORLD = 4
TIMEOUT_S = 10  # the run's collective timeout (--timeout)
ROOT = Path(__file__).resolve().parents[2]


def cluster(world: int = WORLD) -> ClusterSpec:
    """``local-cpu`` with ``world`` CPU devices on one node."""
    spec = ClusterSpec.from_preset("local-cpu").model_dump(mode="json")
    spec["nodes"][0]["devices"] = [{"type": "cpu", "count": world}]
    return ClusterSpec.from_dict(spec)


def write_plan(path: Path, batch_size: int = 8) -> Path:
    """A data-parallel plan for the zoo's ``mlp`` on ``WORLD`` ranks."""
    plan = hetplan.compile("mlp", cluster(), batch_size=batch_size, dp=WORLD, pp=1, tp=1)
    plan.save(path)
    return path


def _environ(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@dataclass
class Job:
    """One ``hetplan run`` started by a test (see :func:`start`)."""

    proc: subprocess.Popen[bytes]
    mark: str
    out: Path
    err: Path
    started: float = field(default_factory=time.monotonic)

    def processes(self) -> dict[int, str]:
        """Every live process of the job (zombies are dead), with its command line."""
        needle = f"{MARK}={self.mark}".encode()
        found = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit() and needle in _environ(int(entry)).split(b"\0"):
                if _state(int(entry)) not in ("Z", "gone"):
                    found[int(entry)] = _cmdline(int(entry))
        return found

    def ranks(self) -> dict[int, int]:
        """Rank → pid of the job's rank processes."""
        ranks = {}
        for pid in self.processes():
            env = dict(item.split(b"=", 1) for item in _environ(pid).split(b"\0")
                       if b"=" in item)
            if b"RANK" in env and b"TORCHELASTIC_RUN_ID" in env:
                ranks[int(env[b"RANK"])] = pid
        return ranks

    def torchrun(self) -> int:
        """The pid of torchrun (the launcher's child)."""
        return next(p for p, c in self.processes().items()
                    if "torch.distributed.run" in c and p != self.proc.pid)

    def stdout(self) -> str:
        return self.out.read_text(errors="replace")

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def wait_for_output(self, text: str, limit_s: float = 180.0) -> None:
        """Wait until the launcher's stdout or stderr holds ``text``."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            if text in self.stdout() or text in self.stderr():
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"the run ended (exit {self.proc.returncode}) before "
                                     f"{text!r}:\n{self.stderr()[-3000:]}")
            time.sleep(0.2)
        raise AssertionError(f"no {text!r} after {limit_s} s:\n{self.stderr()[-3000:]}")

    def wait_until_gone(self, limit_s: float) -> float:
        """Seconds until no process of the job is left (the launcher reaped); fails the test
        with the survivors' command lines after ``limit_s``."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < limit_s:
            self.proc.poll()
            if not self.processes():
                return time.monotonic() - t0
            time.sleep(0.1)
        left = self.processes()
        if not left:  # gone between the last poll and now: late, not left behind
            raise AssertionError(f"the job's processes were gone only "
                                 f"{time.monotonic() - t0:.1f} s after the fault, more than "
                                 f"{limit_s:g} s (machine load: {os.getloadavg()[0]:.1f})")
        raise AssertionError(f"{len(left)} process(es) of the job still run "
                             f"{limit_s:g} s after the fault: {left}")

    def cleanup(self) -> None:
        """Kill whatever of the job is left (SIGCONT first: a stopped process keeps a
        SIGKILL pending until it runs) and reap the launcher."""
        for _ in range(3):
            left = self.processes()
            if not left:
                break
            for pid in left:
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
            time.sleep(0.2)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)


def start(tmp_path: Path, *args: str, timeout_s: int = TIMEOUT_S,
          env: dict[str, str] | None = None) -> Job:
    """``hetplan run ARGS --timeout TIMEOUT_S`` in a session of its own (as a shell runs a
    foreground job), output to files (a pipe nobody reads could block it)."""
    mark = uuid.uuid4().hex
    out, err = tmp_path / "run.out", tmp_path / "run.err"
    full_env = dict(os.environ, **(env or {}), **{MARK: mark})
    proc = subprocess.Popen(
        [sys.executable, "-m", "hetplan.cli", "run", *args, "--timeout", str(timeout_s)],
        stdout=out.open("wb"), stderr=err.open("wb"), env=full_env, cwd=ROOT,
        start_new_session=True,
    )
    return Job(proc, mark, out, err)


def rank_lines(text: str, pattern: str) -> list[int]:
    """The ranks of the lines ``rank N: <pattern>``, in order of appearance."""
    return [int(m.group(1)) for m in re.finditer(rf"^rank (\d+): {pattern}", text, re.M)]
