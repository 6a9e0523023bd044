"""The processes of one ``hetplan run`` job: how they are marked, found, tied to their
parent, and stopped.

``hetplan run`` (the *launcher*) starts ``torchrun``, which starts one process per rank. The
launcher owns that tree:

- **Marked.** Every process of the job inherits ``HETPLAN_RUN_ID`` (a value unique to the
  run) from the launcher's environment for torchrun, so the launcher finds them all in
  ``/proc`` (:func:`marked_processes`), with their ``RANK``, whatever re-parented them.
- **Tied to their parent.** torchrun gets the parent-death signal ``SIGKILL`` (Linux
  ``prctl(PR_SET_PDEATHSIG)``, :func:`set_parent_death_signal`) so it dies with the
  launcher; each rank sets it too and dies with torchrun. A rank also watches the
  launcher's pid (:func:`watch_launcher`), for a torchrun that is alive but frozen when the
  launcher dies.
- **Stopped at once.** A rank's ``SIGINT``, ``SIGTERM`` or ``SIGHUP`` ends it within
  moments with one line, even while its main thread waits inside a collective
  (:func:`stop_on_signals`): Python runs signal handlers only between bytecodes, so a
  handler alone would wait for the collective's timeout. Only a rank that is already
  reporting a failure finishes that first, for a few seconds at most (:func:`defer_stop`).
- **Reporting how it ended.** A rank writes its exit code to ``HETPLAN_RUN_DIR/rank<N>.exit``
  (:func:`record_exit`); the launcher reads them (:func:`recorded_exits`) to tell a refused
  plan (2) from a failed run (1), and to stop the rest of the job once a rank has failed.

Only the standard library is used: the launcher imports this before torch.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path

__all__ = [
    "DEBUG_ENV",
    "defer_stop",
    "LAUNCHER_PID_ENV",
    "RUN_DIR_ENV",
    "RUN_ID_ENV",
    "STOP_SIGNALS",
    "is_running",
    "kill",
    "marked_processes",
    "record_exit",
    "recorded_exits",
    "say",
    "set_parent_death_signal",
    "signal_exit_code",
    "start_time",
    "stop_on_signals",
    "watch_launcher",
]

RUN_ID_ENV = "HETPLAN_RUN_ID"
LAUNCHER_PID_ENV = "HETPLAN_LAUNCHER_PID"
RUN_DIR_ENV = "HETPLAN_RUN_DIR"
DEBUG_ENV = "HETPLAN_DEBUG"

#: The signals that stop a run: Ctrl-C, ``kill``, a closed terminal.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

_PR_SET_PDEATHSIG = 1


def signal_exit_code(sig: int) -> int:
    """The shell's exit code for a process ended by ``sig``: 128 + its number (130 for
    SIGINT, 143 for SIGTERM, 129 for SIGHUP)."""
    return 128 + int(sig)


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent dies (``prctl``); False
    where that is not available (not Linux). The setting survives ``exec``, so a
    ``subprocess`` ``preexec_fn`` can give it to a child."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state first), or None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot): with the pid, names one process even
    after the pid is reused. None when it does not exist."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields is not None else None


def is_running(pid: int) -> bool:
    """Whether ``pid`` exists and has not exited (a zombie has exited)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def _environ(pid: int) -> dict[str, str] | None:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def marked_processes(value: str, key: str = RUN_ID_ENV) -> dict[int, int | None]:
    """The running processes whose environment has ``key=value``, each with its ``RANK``
    (None for torchrun and other non-rank processes), from ``/proc``; the calling process
    is never listed. Empty where ``/proc`` does not exist."""
    found: dict[int, int | None] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    me = os.getpid()
    for entry in entries:
        if not entry.isdigit() or int(entry) == me:
            continue
        env = _environ(int(entry))
        if env is None or env.get(key) != value or not is_running(int(entry)):
            continue
        rank = env.get("RANK", "")
        found[int(entry)] = int(rank) if rank.isdigit() else None
    return found


def kill(pids: Iterable[int], sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to each pid, ignoring those already gone."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


# -- inside a rank ---------------------------------------------------------------------------
def _rank() -> str:
    return os.environ.get("RANK", "?")


def say(line: str) -> None:
    """Write one line to stderr in one ``write``, so that lines of ranks sharing the pipe
    never interleave; nothing when stderr is closed (the launcher is gone)."""
    try:
        sys.stderr.flush()
        os.write(2, (line.rstrip("\n") + "\n").encode(errors="replace"))
    except (OSError, ValueError):
        pass


def record_exit(code: int) -> None:
    """Write this rank's exit code for the launcher (``HETPLAN_RUN_DIR/rank<N>.exit``); does
    nothing outside ``hetplan run``."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        return
    path = Path(run_dir) / f"rank{_rank()}.exit"
    try:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(str(code))
        tmp.rename(path)
    except OSError:
        pass  # the launcher is gone (its directory with it): nobody to tell


def recorded_exits(run_dir: str | Path) -> dict[int, int]:
    """The exit codes ranks recorded in ``run_dir`` (:func:`record_exit`), by rank."""
    codes: dict[int, int] = {}
    for path in Path(run_dir).glob("rank*.exit"):
        rank, text = path.stem[len("rank"):], path.read_text().strip()
        if rank.isdigit() and text.lstrip("-").isdigit():
            codes[int(rank)] = int(text)
    return codes


_stopping = threading.Lock()
_stop_deferred_until = 0.0  # time.monotonic() before which a stop signal waits


def defer_stop(seconds: float) -> None:
    """Let a stop signal that comes in the next ``seconds`` wait until they have passed
    (or the process has exited by itself): a rank that is naming a failed peer, or tearing
    down after an error, finishes that first instead of dying with a bare "stopped by
    SIGTERM" as torchrun stops the job."""
    global _stop_deferred_until
    _stop_deferred_until = max(_stop_deferred_until, time.monotonic() + seconds)


def _stop_now(sig: int) -> None:
    """End this rank for ``sig``: one line, (with ``HETPLAN_DEBUG``) every thread's stack,
    the exit record, and ``os._exit`` without interpreter finalisation. Only the first
    caller does it (the same signal often comes from the launcher and from torchrun); any
    other waits for the exit."""
    if not _stopping.acquire(blocking=False):
        _stopping.acquire()  # never released: the first caller ends the process
    while time.monotonic() < _stop_deferred_until:
        time.sleep(0.05)
    code = signal_exit_code(sig)
    say(f"rank {_rank()}: stopped by {signal.Signals(sig).name}")
    if os.environ.get(DEBUG_ENV):
        try:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        except (OSError, ValueError):
            pass  # stderr is a closed pipe: the launcher is gone
    record_exit(code)
    os._exit(code)


def stop_on_signals(signals: Iterable[int] = STOP_SIGNALS) -> None:
    """End this rank at once on any of ``signals`` (see :func:`_stop_now`), whatever its
    main thread is doing. Call from the main thread.

    Python's C-level handler runs in whichever thread the kernel picks and writes the signal
    number to the wake-up fd (``signal.set_wakeup_fd``); a daemon thread blocked on that fd
    ends the process. The Python-level handler, run later by the main thread, does the
    same (it is what runs if something else replaced the wake-up fd).
    """
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    for sig in signals:
        signal.signal(sig, lambda s, _frame: _stop_now(s))

    def wait() -> None:
        while True:
            data = os.read(read_fd, 1)
            if data:
                _stop_now(data[0])

    threading.Thread(target=wait, name="hetplan-stop", daemon=True).start()


def watch_launcher(period_s: float = 1.0) -> bool:
    """In a rank of ``hetplan run``: exit when the launcher (``HETPLAN_LAUNCHER_PID``) is
    gone, checked every ``period_s`` by a daemon thread (torchrun, which dies with the
    launcher, may be frozen). False (nothing done) outside ``hetplan run``.

    A launcher that died before this call is noticed at once: its pid no longer runs, or
    runs another process (its start time changed), and this rank exits.
    """
    text = os.environ.get(LAUNCHER_PID_ENV, "")
    if not text.isdigit():
        return False
    launcher = int(text)
    born = os.environ.get(LAUNCHER_PID_ENV + "_START", "")
    expected = int(born) if born.isdigit() else start_time(launcher)

    def gone() -> bool:
        return not is_running(launcher) or start_time(launcher) != expected

    def watch() -> None:
        while not gone():
            time.sleep(period_s)
        say(f"rank {_rank()}: the launcher (pid {launcher}) is gone; stopping")
        record_exit(signal_exit_code(signal.SIGHUP))
        os._exit(signal_exit_code(signal.SIGHUP))

    if gone():
        watch()
    threading.Thread(target=watch, name="hetplan-watch-launcher", daemon=True).start()
    return True
