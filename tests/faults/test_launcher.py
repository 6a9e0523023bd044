"""The launcher's parts, one process at a time: preflight refusals (before any rank starts),
the stderr relay, and the process-tree mechanics a rank relies on (parent-death signal,
stop signals ending it with one line, the launcher watch, exit records)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from faultlib import cluster

import hetplan
from hetplan.errors import PlanMismatchError, SpecError
from hetplan.ir.plan import Plan, load_plan
from hetplan.runtime import proctree
from hetplan.runtime.launch import launched_world_size, preflight, relay_stderr, torchrun_command


@pytest.fixture(scope="module")
def plan() -> Plan:
    return hetplan.compile("mlp", cluster(4), batch_size=8, dp=4, pp=1, tp=1)


def _cmd(plan: Plan, *extra: str) -> list[str]:
    return torchrun_command(plan, "plan.json", model="mlp", torchrun_args=list(extra))


class _Model:
    def __init__(self, name: str, fingerprint: str) -> None:
        self.name, self._fp = name, fingerprint

    def fingerprint(self) -> str:
        return self._fp


# -- preflight ---------------------------------------------------------------------------------
def test_preflight_accepts_the_plans_own_run(plan: Plan, tmp_path: Path) -> None:
    preflight(plan, _cmd(plan), report=tmp_path / "r.json",
              model_ir=lambda: _Model("mlp", plan.model.fingerprint))


@pytest.mark.parametrize(("report", "match"), [
    ("missing/r.json", "directory .* does not exist; create it"),
    (".", "is a directory; give a file path"),
])
def test_an_unusable_report_path_is_refused_before_the_model_is_captured(
    plan: Plan, tmp_path: Path, report: str, match: str
) -> None:
    def never() -> _Model:
        raise AssertionError("the model was captured before the --report check")

    with pytest.raises(SpecError, match=match):
        preflight(plan, _cmd(plan), report=tmp_path / report, model_ir=never)


def test_a_read_only_report_directory_is_refused(plan: Plan, tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("running as root: root may write into a read-only directory")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    with pytest.raises(SpecError, match="not writable"):
        preflight(plan, _cmd(plan), report=ro / "r.json")


@pytest.mark.parametrize(("steps", "timeout", "match"), [
    (0, 10.0, "--steps must be at least 1"),
    (3, 0.0, "--timeout must be in"),
    (3, -5.0, "--timeout must be in"),
])
def test_options_out_of_range_are_refused(plan: Plan, steps: int, timeout: float,
                                          match: str) -> None:
    with pytest.raises(SpecError, match=match):
        preflight(plan, _cmd(plan), steps=steps, timeout_s=timeout)


def test_another_model_is_refused_by_the_launcher(plan: Plan) -> None:
    with pytest.raises(PlanMismatchError, match="the model given is 'gpt-test'"):
        preflight(plan, _cmd(plan), model_ir=lambda: _Model("gpt-test", "0" * 16))


def test_a_world_size_the_plan_does_not_have_is_refused(plan: Plan) -> None:
    cmd = _cmd(plan, "--nproc-per-node", "3")
    assert launched_world_size(cmd) == 3
    with pytest.raises(PlanMismatchError, match="needs 4 processes .* torchrun would start 3"):
        preflight(plan, cmd)


def test_a_world_size_from_nnodes_names_the_options_given(plan: Plan) -> None:
    """With --nnodes 2 alone the advice was "drop --nproc-per-node", an option not given."""
    cmd = _cmd(plan, "--nnodes", "2")
    assert launched_world_size(cmd) == 8
    with pytest.raises(PlanMismatchError) as info:
        preflight(plan, cmd)
    msg = str(info.value)
    assert "torchrun would start 8 (--nproc-per-node 4 × --nnodes 2)" in msg, msg
    assert "drop --nnodes" in msg and "drop --nproc-per-node" not in msg, msg


def test_a_chimera_plan_passes_and_what_it_does_not_compose_is_refused() -> None:
    """Chimera plans run (``runtime/handlers/chimera.py``): the launcher lets one through;
    Chimera with tensor parallelism, which its executor does not compose, is refused before
    any rank starts, naming the fix."""
    chimera = hetplan.compile("mlp", cluster(4), batch_size=8, pp=2, schedule="chimera",
                              zero_stage=0)
    assert chimera.layout is not None and chimera.layout.schedule == "chimera"
    preflight(chimera, _cmd(chimera))
    tp = chimera.model_copy(update={"layout": chimera.layout.model_copy(
        update={"tp": 2, "dp": chimera.layout.dp // 2})})
    with pytest.raises(SpecError, match="layout.schedule: 'chimera' with tensor parallelism "
                                        r"\(tp=2\) is not executed .*--schedule 1f1b"):
        preflight(tp, _cmd(tp))


def test_a_combination_the_runtime_does_not_compose_is_refused_by_the_launcher() -> None:
    """The runtime's composition refusals (every rank refuses such a plan at setup) are
    checked before any rank starts."""
    from hetplan.ir.plan_sections import Bucket, GradientSync
    from hetplan.passes.espresso import strategy_for

    zero2 = hetplan.compile("mlp", cluster(4), batch_size=8, dp=4, zero_stage=2)
    assert zero2.layout is not None and zero2.layout.zero_stage == 2
    assert zero2.model.workload is not None
    data = zero2.model_dump(mode="json")  # top-k compression on ZeRO-2's reduce-scattered grads
    data["gradient_sync"] = GradientSync(
        strategies={"s": strategy_for(("topk", 5), ratio=0.5)},
        buckets=(Bucket(tensors=tuple(g.name for g in zero2.model.workload.grads),
                        size_bytes=1, strategy="s"),)).model_dump(mode="json")
    data["predictions"] = None
    edited = Plan.model_validate(data)
    with pytest.raises(SpecError, match="the runtime does not execute this plan's combination "
                                        "of strategies:\n  gradient_sync.strategies.*"
                                        "compressed \\(topk\\) under ZeRO-2"):
        preflight(edited, _cmd(edited))


def test_an_edited_cluster_is_refused(plan: Plan, tmp_path: Path) -> None:
    """A plan file whose embedded cluster was edited after planning is refused when it is
    loaded — the launcher's first step, before any rank starts."""
    data = plan.model_dump(mode="json")
    data["cluster"]["spec"]["nodes"][0]["devices"][0]["count"] = 8
    data["cluster"]["world_size"] = 8
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SpecError, match="cluster.fingerprint.*was cluster.spec edited"):
        load_plan(path)


@pytest.mark.parametrize(("args", "world"), [
    (["--nproc-per-node", "4"], 4),
    (["--nproc_per_node=2", "--nnodes", "3"], 6),
    (["--nproc-per-node", "4", "--nnodes", "1:2"], None),
    (["--nproc-per-node", "gpu"], None),
])
def test_launched_world_size(args: list[str], world: int | None) -> None:
    assert launched_world_size(args) == world


# -- the stderr relay -----------------------------------------------------------------------
AGENT_SIGNAL = """\
rank 0: stopped by SIGINT
Traceback (most recent call last):
  File "/x/torch/distributed/run.py", line 1032, in <module>
    main()
torch.distributed.elastic.multiprocessing.api.SignalException: Process 42 got signal: 2
During handling of the above exception, another exception occurred:
Traceback (most recent call last):
  File "/x/torch/distributed/run.py", line 1032, in <module>
torch.distributed.elastic.multiprocessing.api.SignalException: Process 42 got signal: 2
rank 1: stopped by SIGINT
"""

USER_CHAINED = """\
Traceback (most recent call last):
  File "train.py", line 3, in <module>
ValueError: bad batch
During handling of the above exception, another exception occurred:
Traceback (most recent call last):
  File "train.py", line 5, in <module>
KeyError: 'x'
"""


def _relay(text: str, keep: bool = False) -> str:
    out = io.StringIO()
    relay_stderr(io.StringIO(text), out, keep)
    return out.getvalue()


def test_the_agents_chained_signal_tracebacks_are_dropped() -> None:
    assert _relay(AGENT_SIGNAL) == "rank 0: stopped by SIGINT\nrank 1: stopped by SIGINT\n"
    assert _relay(AGENT_SIGNAL, keep=True) == AGENT_SIGNAL


def test_a_users_chained_traceback_is_copied_whole() -> None:
    assert _relay(USER_CHAINED) == USER_CHAINED


def test_dropped_lines() -> None:
    out = io.StringIO()
    relay_stderr(io.StringIO("keep\nframe #0: x\nkeep too\n"), out,
                 drop=lambda line: line.startswith("frame #"))
    assert out.getvalue() == "keep\nkeep too\n"


# -- the process tree ---------------------------------------------------------------------------
def _python(code: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, **(env or {})))


def _gone_within(pid: int, limit_s: float) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if not proctree.is_running(pid):
            return True
        time.sleep(0.05)
    return False


def test_a_prestarted_torchrun_is_held_and_a_refusal_ends_it(plan: Plan) -> None:
    """`hetplan run` starts torchrun's process before the model check (it imports torch
    meanwhile, :mod:`hetplan.runtime.torchrun_gate`); a refused plan ends it: gone, its run
    directory removed, nothing printed, no rank started."""
    from hetplan.runtime.launch import prestart

    out = io.StringIO()
    job = prestart(_cmd(plan), out=out)
    assert job.proc is not None
    cmdline = Path(f"/proc/{job.proc.pid}/cmdline").read_bytes().split(b"\0")
    # held by the gate, under the name tools look for torchrun's process by
    assert b"hetplan.runtime.torchrun_gate" in cmdline and b"torch.distributed.run" in cmdline
    assert proctree.is_running(job.proc.pid)
    job.abandon()
    assert job.proc.poll() is not None and not job.processes()
    assert not Path(job.run_dir).exists()
    assert out.getvalue() == ""


def test_the_gate_without_torchrun_s_name_is_refused() -> None:
    proc = subprocess.run([sys.executable, "-m", "hetplan.runtime.torchrun_gate", "--x"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and "usage" in proc.stderr


def test_a_child_with_the_parent_death_signal_dies_with_its_parent() -> None:
    parent = _python("""
        import subprocess, sys, time
        from hetplan.runtime.launch import _die_with_parent
        import os
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                 preexec_fn=_die_with_parent(os.getpid()))
        print(child.pid, flush=True)
        time.sleep(60)
    """)
    child = 0
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert proctree.is_running(child)
        parent.kill()
        parent.wait(timeout=10)
        assert _gone_within(child, 10), "the child outlived its parent"
    finally:
        proctree.kill([parent.pid, child] if child else [parent.pid])
        parent.wait(timeout=10)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_ends_a_rank_with_one_line_and_a_record(
    tmp_path: Path, sig: signal.Signals
) -> None:
    rank = _python("""
        import threading
        from hetplan.runtime import proctree
        proctree.stop_on_signals()
        print("ready", flush=True)
        threading.Event().wait()  # blocked, as in a collective
    """, env={"RANK": "5", proctree.RUN_DIR_ENV: str(tmp_path)})
    try:
        assert rank.stdout is not None and rank.stdout.readline() == "ready\n"
        rank.send_signal(sig)
        _, err = rank.communicate(timeout=20)
    finally:
        rank.kill()
    assert rank.returncode == 128 + sig
    assert err == f"rank 5: stopped by {sig.name}\n"
    assert proctree.recorded_exits(tmp_path) == {5: 128 + sig}


def test_a_rank_exits_when_the_launcher_is_gone(tmp_path: Path) -> None:
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    rank = _python("""
        import time
        from hetplan.runtime import proctree
        assert proctree.watch_launcher(period_s=0.1)
        print("ready", flush=True)
        time.sleep(60)
    """, env={"RANK": "3", proctree.LAUNCHER_PID_ENV: str(launcher.pid),
              proctree.RUN_DIR_ENV: str(tmp_path)})
    try:
        assert rank.stdout is not None and rank.stdout.readline() == "ready\n"
        launcher.kill()
        launcher.wait(timeout=10)
        _, err = rank.communicate(timeout=20)
    finally:
        rank.kill()
        launcher.kill()
    assert rank.returncode == 129
    assert f"rank 3: the launcher (pid {launcher.pid}) is gone; stopping" in err
    assert proctree.recorded_exits(tmp_path) == {3: 129}


def test_marked_processes_are_found_with_their_rank() -> None:
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              env=dict(os.environ, MY_MARK="m1", **rank))
             for rank in ({"RANK": "0"}, {"RANK": "1"}, {})]
    try:
        deadline = time.monotonic() + 10
        found: dict[int, int | None] = {}
        while time.monotonic() < deadline and len(found) < 3:
            found = proctree.marked_processes("m1", key="MY_MARK")
        assert found == {procs[0].pid: 0, procs[1].pid: 1, procs[2].pid: None}
        proctree.kill(found)
        for p in procs:
            p.wait(timeout=10)
        assert proctree.marked_processes("m1", key="MY_MARK") == {}
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)


# -- run directories ----------------------------------------------------------------------------
def _age(path: Path, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


def test_a_run_directory_is_held_while_its_launcher_runs_and_swept_after(tmp_path: Path) -> None:
    """A run directory carries its launcher's lock: the sweep leaves it while the lock is
    held (however old), removes it once the lock is free and old enough, and leaves alone a
    young free one (its launcher may be between creating the lock and taking it) and any
    directory without the lock file."""
    from hetplan.runtime.launch import RUN_DIR_PREFIX, new_run_dir, sweep_run_dirs

    held, fd = new_run_dir(str(tmp_path))
    assert fd is not None and Path(held).name.startswith(f"{RUN_DIR_PREFIX}{os.getpid()}-")
    lock = next(p for p in Path(held).iterdir() if p.name.endswith(".lock"))
    _age(lock, 3600)
    freed, fd2 = new_run_dir(str(tmp_path))
    assert fd2 is not None
    os.close(fd2)  # as the kernel does when a launcher is killed
    young, fd3 = new_run_dir(str(tmp_path))
    assert fd3 is not None
    os.close(fd3)
    freed_lock = next(p for p in Path(freed).iterdir() if p.name.endswith(".lock"))
    _age(freed_lock, 3600)
    foreign = tmp_path / f"{RUN_DIR_PREFIX}old-format"
    foreign.mkdir()
    _age(foreign, 3600)
    # a link named like a run directory, to a directory with a free, old lock: not followed
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / freed_lock.name).write_text("")
    _age(target / freed_lock.name, 3600)
    link = tmp_path / f"{RUN_DIR_PREFIX}link"
    link.symlink_to(target)
    try:
        assert sweep_run_dirs(str(tmp_path)) == [freed]
        assert Path(held).is_dir() and Path(young).is_dir() and foreign.is_dir()
        assert link.is_symlink() and (target / freed_lock.name).exists()
        assert not Path(freed).exists()
    finally:
        os.close(fd)
    assert sweep_run_dirs(str(tmp_path)) == [held]  # its lock is free now, and old


def test_a_launcher_that_fails_removes_its_run_directory(plan: Plan, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A launcher whose own supervision raises still kills what it started and removes its
    run directory (the directory used to be left behind on that path)."""
    from hetplan.runtime import launch as launch_mod

    made: list[str] = []
    real = launch_mod.new_run_dir

    def recording(parent: str | None = None) -> tuple[str, int | None]:
        path, fd = real(str(tmp_path))
        made.append(path)
        return path, fd

    def broken(self: object) -> int:
        raise RuntimeError("supervision failed")

    monkeypatch.setattr(launch_mod, "new_run_dir", recording)
    monkeypatch.setattr(launch_mod._Job, "supervise", broken)
    monkeypatch.setattr(launch_mod._Job, "start", lambda self, gated=False: None)
    with pytest.raises(RuntimeError, match="supervision failed"):
        launch_mod.launch(_cmd(plan), out=io.StringIO())
    assert len(made) == 1 and not Path(made[0]).exists()
