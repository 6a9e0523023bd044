"""``hetplan run``: check what can be checked alone, then launch torchrun and own its tree.

Single machine: ``--standalone`` with ``nproc_per_node = dp · pp · tp``. Several machines:
pass torchrun's rendezvous options after ``--`` (``--nnodes 4 --rdzv-endpoint host:29500
--rdzv-id job1``) on every node; processes per node then come from the plan's cluster (its
devices per node), or ``--nproc-per-node`` in the extra options.

1. **Preflight** (:func:`preflight`), before any rank starts: the plan against its cluster
   and the model's fingerprint (``check_plan_matches``, the plan's one validator), the world
   size torchrun would start against the plan's, the ``--report`` path writable, the options
   in range, the pipeline schedule one the runtime executes, the strategies a combination it
   composes, and whether this host can hold the processes it would start
   (:func:`host_problem`). A mismatch is one message and exit code 2, at once.

   **What a host may start** (:func:`host_problem`). The processes torchrun starts *here*
   are ``--nproc-per-node`` (the whole world on one machine, a node's share with
   ``--nnodes``). A plan whose cluster has accelerators (any device type not named
   ``cpu…``) needs that many CUDA devices on this host: one process per GPU on a machine
   without them would run every GPU's work on the CPU (a 64-GPU plan started 64 processes
   on a 2-core machine). A plan for CPU devices may oversubscribe the cores, as the gloo
   tests do (4 processes on 2 cores), up to :data:`OVERSUBSCRIBE` times the cores this
   process may run on (and at least :data:`MIN_CPU_PROCESSES`); beyond that only with
   ``--oversubscribe``. ``--dry-run`` skips this check: it prints the command for the
   machines that will run it.
2. **Launch** (:func:`launch`): torchrun runs in a session of its own with the parent-death
   signal SIGKILL, so it dies with the launcher; every process of the run carries the run's
   marker (:mod:`hetplan.runtime.proctree`). torchrun's stderr (its own and the ranks') is
   relayed by a thread (:func:`relay_stderr`), so the launcher itself never blocks on a pipe.
   ``hetplan run`` starts torchrun's process before the preflight's torch import and model
   capture (:func:`prestart`): it imports torch meanwhile and waits
   (:mod:`hetplan.runtime.torchrun_gate`); :func:`launch` lets it go once the preflight has
   passed, and a refused plan kills it (:meth:`_Job.abandon`) before it has started anything.
3. **Supervise**, every 0.1 s:

   - SIGINT, SIGTERM or SIGHUP to the launcher (Ctrl-C reaches it alone, torchrun being in
     its own session) is forwarded to torchrun, which passes it to every rank in one sweep
     (so all report the same signal); ranks still running 1 s later get it from the
     launcher. Each rank prints one line and exits. Whatever still runs ``grace_s`` later
     is killed. torchrun's chatter (its log lines and its ``SignalException`` traceback) is
     dropped unless ``--debug``. A second signal kills at once.
   - Once a rank has recorded a failure, torchrun stops the others (but waits 30 s for one
     that ignores SIGTERM, as a frozen rank does): the ranks still running
     ``failed_grace_s`` later are killed, torchrun too if it still runs ``grace_s`` after
     that. Not with torchrun's ``--max-restarts N`` (N > 0): torchrun then restarts the
     ranks, and the launcher leaves them to it.
   - When torchrun has exited (or was killed), every process still marked with the run is
     killed, and the relay is given ``grace_s`` to finish; it is not waited for longer.
   - The run's directory (the ranks' exit records) is removed however the run ends. A
     launcher killed by SIGKILL cannot do that; the lock it held in the directory is gone
     with it, and the next launch on the machine removes the directory
     (:func:`sweep_run_dirs`).

Exit codes (:class:`RunOutcome`): 0 trained; 1 the run failed (a rank's error, a frozen or
dead peer, torchrun killed); 2 refused (preflight, or every failed rank refused the plan);
128 + N stopped by signal N (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from hetplan.errors import SpecError
from hetplan.ir.files import check_overwrite
from hetplan.ir.plan import Plan, check_plan_matches
from hetplan.runtime import proctree
from hetplan.runtime.composition import refusals
from hetplan.runtime.hetero_ranks import plan_world_size

__all__ = ["HostCapacity", "MIN_CPU_PROCESSES", "OVERSUBSCRIBE", "RunOutcome", "host_problem",
           "launch", "launched_world_size", "preflight", "prestart", "relay_stderr",
           "torchrun_command"]


def _model_hint(plan: Plan) -> str:
    """Which of --model and --module the plan was made with, from its model's name: a zoo
    name is the --model to give, another one (a class name) came from a factory."""
    from hetplan.zoo.entries import ZOO  # only on this refusal: the zoo imports torch

    name = plan.model.name
    if name in ZOO:
        return f": the plan was made for the zoo model {name!r}, so give --model {name}"
    return (f": the plan was made for {name!r}, not a zoo model, so give --module with the "
            "factory it was planned with")


def torchrun_command(
    plan: Plan,
    plan_path: str | Path,
    *,
    model: str | None = None,
    module: str | None = None,
    steps: int = 10,
    report: str | Path | None = None,
    timeout_s: float = 120.0,
    torchrun_args: Sequence[str] = (),
    script: str | Path | None = None,
    trace: str | Path | None = None,
    trace_step: int = 0,
) -> list[str]:
    """The command line that runs ``plan`` (see module docstring). With ``script`` the
    user's training script runs (through the worker, which ties it to the launcher and
    releases the runtime when it ends) instead of the synthetic-data worker; it gets
    ``--plan PATH --steps N``. ``trace``: the worker writes the per-action trace of step
    ``trace_step`` (0: the last) there (:mod:`hetplan.runtime.trace`)."""
    if plan.layout is None:
        raise SpecError(f"{plan_path}: the plan has no layout; compile it with `hetplan plan`")
    if script is not None and not Path(script).is_file():
        what = "is a directory" if Path(script).is_dir() else "does not exist"
        raise SpecError(f"--script: training script {str(script)!r} {what}; pass the path of "
                        "a Python file")
    if script is not None and Path(script).suffix != ".py":
        raise SpecError(f"--script: {str(script)!r} is not a Python file (.py); pass your "
                        "training script (see examples/train.py)")
    if script is not None and (model or module):
        given = "--model" if model else "--module"
        raise SpecError(f"{given} names the model of the synthetic-data run; a --script run "
                        f"builds its own model in the script: drop {given}")
    if script is None and bool(model) == bool(module):
        raise SpecError("give exactly one of --model NAME or --module pkg.mod:factory "
                        f"(or --script train.py){_model_hint(plan) if not model else ''}")
    extra = list(torchrun_args)
    multi_node = any(a.startswith(("--nnodes", "--rdzv")) for a in extra)
    cmd = [sys.executable, "-m", "torch.distributed.run"]
    if not any(a.startswith("--nproc") for a in extra):
        world = plan_world_size(plan)
        per_node = world
        spec = plan.cluster.spec
        if multi_node:
            if spec is None or spec.devices_per_node is None:
                raise SpecError(
                    "multi-node run: the plan's cluster does not give one device count per "
                    "node; pass --nproc-per-node after --"
                )
            per_node = spec.devices_per_node
        cmd += ["--nproc-per-node", str(per_node)]
    if not multi_node:
        cmd += ["--standalone", "--nnodes", "1"]
    cmd += extra
    cmd += ["-m", "hetplan.runtime.worker"]
    if script is not None:
        return cmd + ["--script", str(script), "--plan", str(plan_path), "--steps", str(steps)]
    cmd += ["--plan", str(plan_path), "--steps", str(steps), "--timeout", str(timeout_s)]
    cmd += ["--model", model] if model else ["--module", str(module)]
    if report:
        cmd += ["--report", str(report)]
    if trace:
        cmd += ["--trace", str(trace), "--trace-step", str(trace_step)]
    return cmd


# -- preflight --------------------------------------------------------------------------------
def _option(args: Sequence[str], name: str) -> str | None:
    """The value of torchrun option ``--name`` (``--name V``, ``--name=V``, or with ``_``)."""
    names = {f"--{name}", f"--{name.replace('-', '_')}"}
    for i, a in enumerate(args):
        key, eq, value = a.partition("=")
        if key in names:
            return value if eq else (args[i + 1] if i + 1 < len(args) else None)
    return None


def launched_world_size(cmd: Sequence[str]) -> int | None:
    """The number of ranks a torchrun command starts (``--nproc-per-node`` × ``--nnodes``);
    None when it is not fixed (an elastic ``--nnodes 1:4``, ``auto``, ``gpu``)."""
    per_node, nodes = _option(cmd, "nproc-per-node"), _option(cmd, "nnodes") or "1"
    if per_node is None or not per_node.isdigit() or not nodes.isdigit():
        return None
    return int(per_node) * int(nodes)


def _omp_default(cmd: Sequence[str], env: Mapping[str, str]) -> dict[str, str]:
    """``OMP_NUM_THREADS=1`` where torchrun would set it (unset, and more than one process
    per node), so that it does the same without printing its five-line warning about it
    before every run; a value the user set, or one process per node, stays as it is."""
    per_node = _option(cmd, "nproc-per-node")
    if "OMP_NUM_THREADS" in env or per_node is None or not per_node.isdigit() \
            or int(per_node) < 2:
        return {}
    return {"OMP_NUM_THREADS": "1"}


#: CPU processes per core a CPU plan may start on one host without ``--oversubscribe``
OVERSUBSCRIBE = 2
#: ... and never fewer than this many (the gloo tests' 4 ranks, on any machine)
MIN_CPU_PROCESSES = 4


@dataclass(frozen=True)
class HostCapacity:
    """What this host offers a run: CUDA devices and the CPU cores this process may use."""

    cuda_devices: int
    cpu_cores: int

    @classmethod
    def detect(cls) -> HostCapacity:
        """This machine (imports torch, to count CUDA devices)."""
        import torch

        cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not on Linux
            cores = os.cpu_count() or 1
        return cls(cuda_devices=cuda, cpu_cores=max(cores, 1))


def _is_cpu_type(name: str) -> bool:
    """A device type that is a CPU (``cpu``, ``cpu-fast`` ...); any other is an accelerator."""
    return name.lower().startswith("cpu")


def host_problem(plan: Plan, cmd: Sequence[str], host: HostCapacity, *,
                 oversubscribe: bool = False) -> str | None:
    """Why this host cannot start the processes ``cmd`` would start for ``plan`` (see the
    module docstring, "What a host may start"), or None.

    Args:
        plan: the plan (its embedded cluster says CPU or accelerator devices).
        cmd: the torchrun command: its ``--nproc-per-node`` processes start here.
        host: this host's CUDA devices and CPU cores.
        oversubscribe: ``--oversubscribe``: a CPU plan may start any number of processes.
    """
    per_node = _option(cmd, "nproc-per-node")
    if per_node is None or not per_node.isdigit():
        return None  # torchrun decides (auto, gpu ...): nothing to check here
    local = int(per_node)
    spec = plan.cluster.spec
    world = plan_world_size(plan)
    types = sorted({d.type for d in spec.devices()}) if spec is not None else []
    accel = [t for t in types if not _is_cpu_type(t)]
    nodes = _option(cmd, "nnodes") or "1"
    here = (f"this host has {host.cuda_devices} CUDA device(s) and {host.cpu_cores} CPU "
            "core(s)")
    plan_says = (f"the plan is for world size {world} on cluster {plan.cluster.name!r}"
                 + (f" ({', '.join(accel)})" if accel else ""))
    if accel:
        if host.cuda_devices >= local:
            return None
        multi = ""
        if spec is not None and spec.devices_per_node is not None and spec.num_nodes > 1:
            multi = (f"`-- --nnodes {spec.num_nodes} --nproc-per-node "
                     f"{spec.devices_per_node} --rdzv-endpoint HOST:29500 --rdzv-id JOB` on "
                     "each node, ")
        return (f"{plan_says}, and `hetplan run` would start {local} process(es) on this "
                f"host (--nproc-per-node {local} x --nnodes {nodes}), one per GPU, but {here}. "
                "To check the plan without training add --dry-run; to train it run `hetplan "
                f"run` on the cluster's GPU machines ({multi}torchrun's flags after --); to "
                "train here re-plan for this machine's CPUs (`hetplan plan MODEL --cluster "
                "local-cpu`, or a cluster file with `type: cpu` devices)")
    limit = max(MIN_CPU_PROCESSES, OVERSUBSCRIBE * host.cpu_cores)
    if local <= limit or oversubscribe:
        return None
    return (f"{plan_says}, and `hetplan run` would start {local} CPU process(es) on this host "
            f"(--nproc-per-node {local}), but {here}: more than {limit} ({OVERSUBSCRIBE} per "
            f"core, at least {MIN_CPU_PROCESSES}). Add --oversubscribe to start them anyway, "
            "--dry-run to only check the plan, torchrun's --nnodes/--nproc-per-node after -- to "
            "spread them over several machines, or re-plan for fewer ranks (`hetplan plan "
            "MODEL --cluster local-cpu`)")


def _check_writable(path: Path, option: str) -> None:
    if str(path) == "-":
        raise SpecError(f"{option} '-' would write a file named '-' (not standard output); "
                        "give a file path, e.g. report.json")
    if path.is_dir():
        raise SpecError(f"{option} {str(path)!r} is a directory; give a file path, e.g. "
                        f"{str(path / 'report.json')!r}")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise SpecError(f"{option} {str(path)!r}: directory {str(parent)!r} does not exist; "
                        f"create it (mkdir -p {parent}) or choose another path")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists()
                                                   and not os.access(path, os.W_OK)):
        raise SpecError(f"{option} {str(path)!r} is not writable; choose a path you can write")


def preflight(
    plan: Plan,
    cmd: Sequence[str],
    *,
    model_ir: Callable[[], Any] | None = None,
    report: str | Path | None = None,
    steps: int = 10,
    timeout_s: float = 120.0,
    host: HostCapacity | None = None,
    oversubscribe: bool = False,
) -> None:
    """Refuse, before any rank starts, what the launcher can know is wrong.

    Args:
        plan: the loaded (hence schema-validated) plan.
        cmd: the torchrun command (:func:`torchrun_command`), for the world size it starts.
        model_ir: captures the model here (returns anything with ``name`` and
            ``fingerprint()``); called after the cheap checks. None when the model is only
            known to the ranks (``--script``).
        report: the ``--report`` path, or None.
        steps / timeout_s: ``--steps`` and ``--timeout``.
        host: this host, checked against the processes the command starts here
            (:func:`host_problem`); None: not checked (``--dry-run``: the command is for
            the machines that will run it).
        oversubscribe: ``--oversubscribe``: start any number of CPU processes.

    Raises:
        SpecError: an option out of range (``--max-restarts`` below 0 among them: torchrun's
            parser takes it), an unwritable report path, a plan without layout,
            a combination of strategies the runtime does not compose
            (:func:`~hetplan.runtime.composition.refusals`), more processes than ``host``
            can hold (:func:`host_problem`).
        PlanMismatchError: the plan is not for this model, its cluster, or the world size
            torchrun would start (every mismatch listed).
    """
    if steps < 1:
        raise SpecError(f"--steps must be at least 1, got {steps}")
    restarts = _option(cmd, "max-restarts")
    if restarts is not None and restarts.lstrip("-").isdigit() and int(restarts) < 0:
        raise SpecError(f"--max-restarts {restarts}: torchrun restarts the ranks at most N "
                        "times, N >= 0; give --max-restarts 0 (a failed rank fails the run) "
                        "or a positive N (restart the ranks, e.g. from Gemini checkpoints)")
    if not timeout_s > 0 or timeout_s > 86400:
        raise SpecError(f"--timeout must be in (0, 86400] seconds, got {timeout_s}")
    if report is not None:
        _check_writable(Path(report), "--report")
        check_overwrite(report, option="--report", kind="run report")
    layout = plan.layout
    if layout is None:
        raise SpecError("the plan has no layout; compile it with `hetplan plan`")
    if problems := refusals(plan):  # what every rank would refuse at setup
        raise SpecError("the runtime does not execute this plan's combination of strategies:"
                        "\n  " + "\n  ".join(problems))
    world = launched_world_size(cmd)
    if world is not None and world != (need := plan_world_size(plan)):
        from hetplan.errors import PlanMismatchError

        shape = (plan.hetero.describe() if plan.hetero is not None
                 else f"dp={layout.dp} pp={layout.pp} tp={layout.tp}")
        per_node, nodes = _option(cmd, "nproc-per-node"), _option(cmd, "nnodes") or "1"
        # the options given after --: --standalone is there unless --nnodes/--rdzv were;
        # --nproc-per-node is set from the plan (its cluster's devices per node) unless given
        spec = plan.cluster.spec
        planned = need if "--standalone" in cmd else (spec.devices_per_node if spec else None)
        given = [o for o, g in (("--nproc-per-node", per_node != str(planned)),
                                ("--nnodes", "--standalone" not in cmd)) if g]
        raise PlanMismatchError(
            f"the plan needs {need} processes ({shape}) but torchrun would start {world} "
            f"(--nproc-per-node {per_node} × --nnodes {nodes}); "
            f"drop {' and '.join(given or ['--nproc-per-node'])} (hetplan run sets the "
            f"processes from the plan) or re-plan for {world} ranks"
        )
    if host is not None and (why := host_problem(plan, cmd, host, oversubscribe=oversubscribe)):
        raise SpecError(why)
    check_plan_matches(plan, cluster=plan.cluster.spec)
    if model_ir is not None:
        check_plan_matches(plan, model_ir=model_ir())


# -- relaying torchrun's stderr ------------------------------------------------------------------
#: how torchrun's agent's exceptions end a traceback (a rank failed; a signal stopped it)
_AGENT_ERRORS = ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError",
                 "torch.distributed.elastic.multiprocessing.api.SignalException")

#: the line between two chained tracebacks
_CHAINED = ("During handling of the above exception, another exception occurred:",
            "The above exception was the direct cause of the following exception:")

#: a torch log line: level, date, time, then the pid of the process that logged it
_LOG_LINE = re.compile(r"^\[?[IWEF]\d{4} [\d:.]+ (\d+) ")

#: how long torchrun gets to pass a stop signal on before the launcher signals the ranks
_DIRECT_AFTER_S = 1.0

#: the lines of a C++ stack that torch prints under a warning or in an error's message
_CPP_FRAMES = ("Exception raised from ", "frame #", "<omitting python frames>")


def relay_stderr(lines: Iterable[str], out: TextIO, keep_agent_traceback: bool = False,
                 drop: Callable[[str], bool] | None = None) -> None:
    """Copy torchrun's stderr (its own and the ranks') to ``out``, without the launcher's
    Python traceback when a rank fails or a signal stops it: the ranks print their errors,
    torchrun prints a summary box naming the failed ranks, and its ``Traceback …
    ChildFailedError`` (or ``SignalException``) says nothing more. Any other traceback (a
    user script's) is copied whole, chained ones included. Lines for which ``drop`` is true
    are left out."""
    held: list[str] = []
    for line in lines:
        if drop is not None and drop(line):
            continue
        if held:
            held.append(line)
            if line.startswith(_AGENT_ERRORS) and not keep_agent_traceback:
                held = []  # the launcher's traceback: dropped
            elif line.strip() and not line.startswith((" ", "\t", "Traceback", *_CHAINED)):
                out.writelines(held)  # another exception line: the traceback stays
                held = []
            continue
        if line.startswith(("Traceback (most recent call last)", *_CHAINED)):
            held = [line]
            continue
        out.write(line)
        out.flush()
    out.writelines(held)
    out.flush()


# -- launching and supervising -----------------------------------------------------------------
@dataclass
class RunOutcome:
    """How a run ended.

    Attributes:
        code: the exit code ``hetplan run`` returns (module docstring).
        stopped_by: the signal that stopped the run (None: it ended by itself).
        torchrun_code: torchrun's exit status (negative: killed by that signal).
        rank_codes: the exit codes the ranks recorded, by rank (a killed rank records none).
        killed: the ranks (None for torchrun itself) the launcher had to kill, by pid.
    """

    code: int
    stopped_by: int | None = None
    torchrun_code: int | None = None
    rank_codes: dict[int, int] = field(default_factory=dict)
    killed: dict[int, int | None] = field(default_factory=dict)


def _die_with_parent(parent: int) -> Callable[[], None]:
    """A ``preexec_fn`` giving the child the parent-death signal SIGKILL; the child exits at
    once if the parent is already gone. Only async-signal-safe calls run in the child: libc's
    ``prctl`` is looked up here, before the fork."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None

    def child() -> None:
        if prctl is not None:
            prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(1)

    return child


#: The prefix of a run's directory under the temporary directory (:func:`new_run_dir`).
RUN_DIR_PREFIX = "hetplan-run-"
#: The lock file a launcher holds in its run's directory for as long as it runs.
_LOCK_NAME = ".launcher.lock"
#: A run directory whose lock nobody holds is removed once its lock file is this old (s):
#: the time between creating the file and locking it is the only time an unheld lock is a
#: live launcher's.
STALE_AFTER_S = 60.0


def new_run_dir(parent: str | None = None) -> tuple[str, int | None]:
    """A new run directory (under ``parent``, default the temporary directory) and the
    descriptor of the lock the launcher holds in it (``flock``, exclusive) until it removes
    the directory; None where ``fcntl`` is missing or the file system has no locks. A
    launcher killed by SIGKILL cannot remove its directory; the kernel drops its lock, and
    the next launcher's :func:`sweep_run_dirs` removes it."""
    try:
        import fcntl
    except ImportError:  # not a POSIX system: nothing can tell a dead launcher's directory
        return tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}-", dir=parent), None
    for _ in range(3):
        path = tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}-", dir=parent)
        fd = os.open(os.path.join(path, _LOCK_NAME), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # no locks here (ENOLCK, EOPNOTSUPP): run without the sweep's help
            os.close(fd)
            return path, None
        if os.fstat(fd).st_nlink > 0:
            return path, fd
        # a sweep judged the fresh lock stale (a clock far off) and removed the directory
        # between its creation and the lock: make another
        os.close(fd)
    raise OSError(f"could not keep a run directory under {parent or tempfile.gettempdir()}: "
                  "another launcher's sweep removed each one made (is the clock far off?)")


def sweep_run_dirs(parent: str | None = None, stale_after_s: float = STALE_AFTER_S
                   ) -> list[str]:
    """Remove the run directories (:func:`new_run_dir`) under ``parent`` whose launcher is
    gone: their lock is free (a lock is released when its process ends, however it ends)
    and its file older than ``stale_after_s``. Only real directories of this user holding a
    regular lock file are judged (no symbolic link is followed); others are left alone.
    Returns the paths removed."""
    try:
        import fcntl
    except ImportError:
        return []
    base = Path(parent or tempfile.gettempdir())
    removed: list[str] = []
    try:
        entries = list(base.glob(f"{RUN_DIR_PREFIX}*"))
    except OSError:
        return removed
    now = time.time()
    flags = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    for path in sorted(entries):
        try:
            st = path.lstat()
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            fd = os.open(path / _LOCK_NAME, flags)
        except OSError:  # no lock file (not made by new_run_dir), or not ours to judge
            continue
        try:
            st = os.fstat(fd)
            if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid()
                    or now - st.st_mtime < stale_after_s):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held: its launcher is running
                continue
            shutil.rmtree(path, ignore_errors=True)
            if not path.exists():
                removed.append(str(path))
        finally:
            os.close(fd)
    return removed


class _Job:
    """One launched torchrun and its ranks (see module docstring, steps 2–3)."""

    def __init__(self, cmd: list[str], *, debug: bool, grace_s: float, failed_grace_s: float,
                 out: TextIO) -> None:
        self.cmd, self.debug, self.out = cmd, debug, out
        self.grace_s, self.failed_grace_s = grace_s, failed_grace_s
        # torchrun --max-restarts N: a failed rank is torchrun's to restart, not to kill
        self.elastic = (_option(cmd, "max-restarts") or "0") != "0"
        sweep_run_dirs()
        self.run_dir, self._lock = new_run_dir()
        self.run_id = f"{os.getpid()}-{Path(self.run_dir).name}"
        self.proc: subprocess.Popen[str] | None = None
        self.stopped_by: int | None = None
        self.kill_at: float | None = None  # when whatever still runs is killed
        self.direct_at: float | None = None  # when a stop signal goes to the ranks directly
        self.killed: dict[int, int | None] = {}
        self.relay: threading.Thread | None = None
        self.gated = False  # started through torchrun_gate, which waits for release()

    # -- signals --------------------------------------------------------------------------
    def on_signal(self, sig: int, _frame: FrameType | None) -> None:
        if self.stopped_by is not None:  # a second one: no more waiting
            self.kill_at = time.monotonic()
            return
        self.stopped_by = sig
        now = time.monotonic()
        self.kill_at, self.direct_at = now + self.grace_s, now + _DIRECT_AFTER_S
        self._forward(sig, ranks=False)

    def _forward(self, sig: int, *, ranks: bool) -> None:
        """Send ``sig`` to torchrun, which sends it on to every rank in one sweep (so each
        rank reports the same signal); with ``ranks`` (torchrun gone, or the ranks still
        running a moment later) straight to the ranks too."""
        torchrun_alive = self.proc is not None and self.proc.poll() is None
        if torchrun_alive:
            assert self.proc is not None
            proctree.kill([self.proc.pid], sig)
        if ranks or not torchrun_alive:
            left = [p for p, r in self.processes().items() if r is not None]
            proctree.kill(left, sig)

    def processes(self) -> dict[int, int | None]:
        """Every running process of the run but the launcher: pid → rank (None: torchrun)."""
        return proctree.marked_processes(self.run_id)

    def _quiet(self, line: str) -> bool:
        """Lines left out unless --debug: C++ stack frames (under a rank's warning or error),
        and torchrun's own log lines once a stop signal came."""
        if self.debug:
            return False
        if line.startswith(_CPP_FRAMES):
            return True
        if self.stopped_by is None or self.proc is None:
            return False
        m = _LOG_LINE.match(line)
        return m is not None and int(m.group(1)) == self.proc.pid

    # -- running --------------------------------------------------------------------------
    def start(self, gated: bool = False) -> None:
        """Start torchrun (``gated``: its gate, which imports torch and waits for
        :meth:`release`)."""
        cmd = self.cmd
        if gated:
            from hetplan.runtime.torchrun_gate import TORCHRUN

            if cmd[1:3] != ["-m", TORCHRUN]:
                raise ValueError(f"not a torchrun command: {cmd[:3]}")
            cmd = [cmd[0], "-m", "hetplan.runtime.torchrun_gate", TORCHRUN, *cmd[3:]]
        self.gated = gated
        env = dict(os.environ)
        env[proctree.RUN_ID_ENV] = self.run_id
        env[proctree.RUN_DIR_ENV] = self.run_dir
        env[proctree.LAUNCHER_PID_ENV] = str(os.getpid())
        env[proctree.LAUNCHER_PID_ENV + "_START"] = str(proctree.start_time(os.getpid()) or "")
        if self.debug:
            env[proctree.DEBUG_ENV] = "1"
        env.update(_omp_default(self.cmd, env))
        self.proc = subprocess.Popen(
            cmd, stderr=subprocess.PIPE, text=True, errors="replace", env=env,
            stdin=subprocess.PIPE if gated else None,
            start_new_session=True, preexec_fn=_die_with_parent(os.getpid()),
        )
        stderr = self.proc.stderr
        assert stderr is not None
        self.relay = threading.Thread(
            target=relay_stderr, args=(stderr, self.out, self.debug, self._quiet),
            name="hetplan-relay", daemon=True)
        self.relay.start()
        if self.stopped_by is not None:  # a signal came while starting
            self._forward(self.stopped_by, ranks=False)

    def release(self) -> None:
        """Let a gated torchrun run (a signal already received: let its gate end instead)."""
        if not self.gated or self.proc is None or self.proc.stdin is None:
            return
        try:
            if self.stopped_by is None:
                self.proc.stdin.write("go\n")
            self.proc.stdin.close()
        except OSError:  # the gate is gone (killed): supervise() reports how it ended
            pass

    def abandon(self) -> None:
        """The preflight refused the plan: end the gated torchrun, which has started nothing,
        and remove the run's directory."""
        if self.proc is not None:
            if self.proc.poll() is None:
                proctree.kill([self.proc.pid])
            self.proc.wait()
            if self.proc.stdin is not None:
                with contextlib.suppress(OSError):
                    self.proc.stdin.close()
        if self.relay is not None:
            self.relay.join(self.grace_s)
        self.remove_run_dir()

    def remove_run_dir(self) -> None:
        """Remove the run's directory and let go of its lock (see :func:`new_run_dir`)."""
        shutil.rmtree(self.run_dir, ignore_errors=True)
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def supervise(self) -> int:
        """Wait for torchrun (module docstring, step 3); its exit status."""
        assert self.proc is not None
        rounds = 0
        while (status := self.proc.poll()) is None:
            now = time.monotonic()
            if self.direct_at is not None and now >= self.direct_at and self.stopped_by:
                self._forward(self.stopped_by, ranks=True)  # torchrun did not pass it on
                self.direct_at = None
            if self.kill_at is None and not self.elastic and any(
                    c != 0 for c in self._rank_codes().values()):
                self.kill_at = now + self.failed_grace_s  # torchrun stops the rest
            if self.kill_at is not None and now >= self.kill_at:
                # after a failure torchrun is spared once, to reap the ranks and print its
                # summary; after a signal, or when it does not exit either, it goes too
                self._kill_all(include_torchrun=self.stopped_by is not None or rounds > 0)
                self.kill_at, rounds = now + self.grace_s, rounds + 1
            time.sleep(0.1)
        return status

    def _rank_codes(self) -> dict[int, int]:
        return proctree.recorded_exits(self.run_dir)

    def _kill_all(self, include_torchrun: bool) -> None:
        procs = self.processes()
        if self.proc is not None:
            procs.pop(self.proc.pid, None)
            if include_torchrun and self.proc.poll() is None:
                procs[self.proc.pid] = None
        victims = {p: r for p, r in procs.items() if p not in self.killed}
        for pid, rank in sorted(victims.items(), key=lambda kv: (kv[1] is None, kv[1] or 0)):
            who = f"rank {rank}" if rank is not None else "torchrun"
            why = (f"did not stop {self.grace_s:g} s after {signal.Signals(self.stopped_by).name}"
                   if self.stopped_by is not None else
                   f"still running {self.failed_grace_s:g} s after a rank failed (frozen?)")
            self.out.write(f"hetplan run: killed {who} (pid {pid}): {why}\n")
        self.out.flush()
        proctree.kill(victims)
        self.killed.update(victims)

    def finish(self) -> None:
        """After torchrun: kill whatever of the run is left and let the relay drain
        (bounded). The run's directory goes in :meth:`outcome` (or :func:`launch`'s
        clean-up when supervision itself failed)."""
        deadline = time.monotonic() + self.grace_s
        while (left := self.processes()) and time.monotonic() < deadline:
            proctree.kill(left)  # their parent is gone: nobody else will stop them
            self.killed.update({p: r for p, r in left.items() if p not in self.killed})
            time.sleep(0.05)
        if self.relay is not None:
            self.relay.join(max(0.0, deadline - time.monotonic()) + 1.0)
            if self.relay.is_alive():
                self.out.write("hetplan run: stopped relaying output: a process outside the "
                               "run still holds torchrun's stderr open\n")
                self.out.flush()

    def outcome(self, status: int | None) -> RunOutcome:
        codes = self._rank_codes()
        if status is not None and status < 0 and self.stopped_by is None and self.proc \
                and self.proc.pid not in self.killed:
            self.out.write(f"hetplan run: torchrun (pid {self.proc.pid}) was killed by "
                           f"{signal.Signals(-status).name}; its ranks were stopped with it\n")
            self.out.flush()
        self.remove_run_dir()
        failed = [c for c in codes.values() if c != 0 and c < 128]
        if self.stopped_by is not None:
            code = proctree.signal_exit_code(self.stopped_by)
        elif status == 0:
            code = 0
        elif failed and all(c == 2 for c in failed):
            code = 2
        else:
            code = 1
        return RunOutcome(code, self.stopped_by, status, codes, dict(self.killed))


def prestart(cmd: list[str], *, keep_agent_traceback: bool = False, grace_s: float = 5.0,
             failed_grace_s: float = 2.0, out: TextIO | None = None) -> _Job:
    """Start torchrun's process for ``cmd`` held before it does anything but import torch
    (:mod:`hetplan.runtime.torchrun_gate`), so that its import overlaps the preflight. Pass
    the result to :func:`launch` once the preflight has passed, or call its ``abandon()``
    when it refused the plan. Arguments as :func:`launch`'s."""
    job = _Job(cmd, debug=keep_agent_traceback, grace_s=grace_s, failed_grace_s=failed_grace_s,
               out=out or sys.stderr)
    job.start(gated=True)
    return job


def launch(cmd: list[str], *, keep_agent_traceback: bool = False, grace_s: float = 5.0,
           failed_grace_s: float = 2.0, out: TextIO | None = None,
           job: _Job | None = None) -> RunOutcome:
    """Run the torchrun command and own its process tree (module docstring, steps 2–3).

    Args:
        cmd: the command (:func:`torchrun_command`).
        keep_agent_traceback: ``--debug``: keep torchrun's tracebacks and log lines, and let
            the ranks print tracebacks.
        grace_s: how long processes get to stop after a signal before they are killed.
        failed_grace_s: how long the other ranks get to stop once a rank has failed (torchrun
            stops them at once; only a frozen one needs killing).
        out: where stderr is relayed (default ``sys.stderr``).
        job: torchrun already started for ``cmd`` by :func:`prestart` (which took the
            arguments above), released here.

    Returns:
        How the run ended; ``.code`` is the exit code for ``hetplan run``.
    """
    if job is None:
        job = _Job(cmd, debug=keep_agent_traceback, grace_s=grace_s,
                   failed_grace_s=failed_grace_s, out=out or sys.stderr)
    elif job.cmd != cmd:
        raise ValueError("launch(job=...): the job was prestarted for another command")
    in_main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, job.on_signal) for sig in proctree.STOP_SIGNALS} \
        if in_main else {}
    status: int | None = None
    try:
        if job.proc is None:
            job.start()
        job.release()
        status = job.supervise()
    finally:
        try:
            if status is None:  # the launcher itself failed: leave nothing behind
                job._kill_all(include_torchrun=True)
            job.finish()
        finally:
            if status is None:
                job.remove_run_dir()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    return job.outcome(status)
