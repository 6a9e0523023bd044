"""Gemini's side process: it sends a rank's snapshots to the holders and stores the copies
of the ranks it holds, so that none of that work shares the training process's GIL.

Decision (``docs/decisions/gemini.md``, "Round 3"): with the streams on threads of the
training process, every system call of a round (the timed sends, the acknowledgement, the
receivers' header, payload and acknowledgement) handed the GIL back and forth with the
training thread, which takes it back after every torch op: 4 to 9 more wake-ups of the
training thread per iteration and 0.5 to 1.5 ms more of its CPU. Here those calls run in
one small process per rank, a child of the worker, with its own interpreter; the worker
keeps only the packing (one ``torch.cat`` into its own shared-memory slot) and one message
per round.

Parent side (:class:`Agent`): :meth:`Agent.start` launches ``python -m
hetplan.runtime.checkpoint_agent`` with the connected streams (:mod:`checkpoint_link`) and
one end of a ``SOCK_SEQPACKET`` control pair inherited; :meth:`Agent.round` asks it to send
the snapshot now in the own slot; :meth:`Agent.wait` returns that round's record (releasing
the chunks still ahead first); :meth:`Agent.close` ends the streams and reaps the process.

Child side (:func:`main`): the main thread sends each round's chunks to the holders at the
plan's times (``poll`` on the control socket until a chunk is due, so that a release is seen
at once), reading them from the own slot's file mapped read-only, then reads the holders'
acknowledgements and reports the round; one thread per rank held receives that rank's
snapshots straight into its slot in the node's store (:class:`NodeStore`, as before) and
acknowledges them. Errors go back as messages and are raised in the worker at its next step.

Lifetime: the child dies with its parent (``PR_SET_PDEATHSIG``), and it exits when the
control socket closes; it is started without the worker's ``RANK`` variables, so tools that
find ranks by their environment do not take it for one. Every wait is bounded: the streams
have the kernel's send and receive timeouts (the runtime's timeout), the parent's waits on
the control socket too.

Messages (pickled tuples). Parent → child: ``("round", iteration, nbytes, slot, anchor,
sends)`` (``sends``: ``(holder, span, start, end, due_ms)`` in order; ``anchor``: the
``time.perf_counter`` of the step's end, ``CLOCK_MONOTONIC``, the same in both processes),
``("release", iteration)``, ``("close", clean)``. Child → parent: ``("done", iteration,
chunks, round_ms, cpu_ms)`` (``chunks``: ``(holder, span, offset, nbytes, planned_ms,
sent_ms, how)``), ``("error", text)``, ``("closed",)``.
"""

from __future__ import annotations

import mmap
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from hetplan.runtime.checkpoint_link import ACK, HEADER, LinkClosed, recv_exact
from hetplan.runtime.checkpoint_store import NodeStore

__all__ = ["Agent", "main"]

_MSG = 1 << 16  # the largest control message (a round's send list is a few dozen tuples)
_RANK_VARS = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "GROUP_WORLD_SIZE")


class Agent:
    """The worker's handle on its side process (see module docstring)."""

    def __init__(self, proc: subprocess.Popen[bytes], ctrl: socket.socket,
                 timeout: timedelta) -> None:
        self.proc = proc
        self.pid = proc.pid
        self._ctrl = ctrl
        self._timeout = timeout.total_seconds()
        self._lock = threading.Lock()  # the packing thread and the training thread send
        self._pending: list[tuple[Any, ...]] = []

    @classmethod
    def start(cls, rank: int, root: Path, node: int, out: dict[int, socket.socket],
              inc: dict[int, socket.socket], timeout: timedelta) -> Agent:
        """Launch the side process with the streams to ``out`` (holder → socket) and from
        ``inc`` (source → socket); the worker's copies of the sockets are closed."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fds = [theirs.fileno(), *(s.fileno() for s in out.values()),
               *(s.fileno() for s in inc.values())]
        spec = {"rank": rank, "root": str(root), "node": node, "ctrl": theirs.fileno(),
                "out": {h: s.fileno() for h, s in out.items()},
                "inc": {r: s.fileno() for r, s in inc.items()},
                "timeout": timeout.total_seconds(), "parent": os.getpid()}
        env = {k: v for k, v in os.environ.items() if k not in _RANK_VARS}
        src = str(Path(__file__).resolve().parents[2])  # where this hetplan is imported from
        env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
        proc = subprocess.Popen(
            [sys.executable, "-m", "hetplan.runtime.checkpoint_agent", repr(spec)],
            pass_fds=fds, env=env, stdin=subprocess.DEVNULL, close_fds=True)
        theirs.close()
        for s in [*out.values(), *inc.values()]:
            s.close()
        mine.settimeout(None)  # blocking: waits are bounded by select (see _recv)
        return cls(proc, mine, timeout)

    def _send(self, msg: tuple[Any, ...]) -> None:
        with self._lock:
            self._ctrl.send(pickle.dumps(msg, protocol=5))

    def round(self, iteration: int, nbytes: int, slot: int, anchor: float,
              sends: Sequence[tuple[int, int, int, int, float]]) -> None:
        """Send the snapshot of ``iteration`` (``nbytes``, in own slot ``slot``) to the
        holders, each ``(holder, span, start, end, due_ms)`` at ``anchor + due_ms``."""
        self._send(("round", iteration, nbytes, slot, anchor, list(sends)))

    def wait(self, iteration: int) -> tuple[Any, ...]:
        """The ``("done", ...)`` message of the round of ``iteration``: the chunks still
        ahead are released first unless it is done already. ``RuntimeError`` with the side
        process's error, ``TimeoutError`` after the runtime's timeout."""
        try:
            msg = self._recv(block=False)
        except BlockingIOError:
            self._send(("release", iteration))
            msg = self._recv(block=True)
        if msg[0] == "done" and msg[1] == iteration:
            return msg
        if msg[0] == "done":
            raise RuntimeError(f"the checkpoint side process finished iteration {msg[1]}, "
                               f"expected {iteration}")
        raise RuntimeError(f"checkpoint side process: {msg[1]}")

    def _recv(self, block: bool, wait_s: float | None = None) -> tuple[Any, ...]:
        """The next message; ``BlockingIOError`` when none is there and not ``block``, else
        waiting at most ``wait_s`` (default: the timeout). (A socket with a Python timeout
        would wait before a ``MSG_DONTWAIT`` receive, so the socket is blocking and the wait
        is a ``select``.)"""
        wait_s = self._timeout if wait_s is None else wait_s
        if block and not select.select([self._ctrl], [], [], wait_s)[0]:
            raise TimeoutError(f"the checkpoint side process (pid {self.pid}) did not "
                               f"answer within {wait_s:.0f} s")
        data = self._ctrl.recv(_MSG, socket.MSG_DONTWAIT)
        if not data:
            code = self.proc.poll()
            raise RuntimeError(f"the checkpoint side process (pid {self.pid}) ended "
                               f"(exit code {code})")
        msg: tuple[Any, ...] = pickle.loads(data)
        return msg

    def close(self, clean: bool) -> None:
        """End the streams to the holders at a header boundary and, when ``clean``, wait
        (at most the timeout) until each rank held has ended its stream; then reap the
        process (killed if it does not exit in time)."""
        try:
            self._send(("close", clean))
            deadline = time.monotonic() + (self._timeout if clean else 1.0)
            while time.monotonic() < deadline:
                msg = self._recv(True, max(deadline - time.monotonic(), 0.0))
                if msg[0] == "closed":
                    break
        except (OSError, RuntimeError, TimeoutError):
            pass
        self._ctrl.close()
        try:
            self.proc.wait(timeout=self._timeout if clean else 1.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=self._timeout)


# -- the side process -------------------------------------------------------------------
def _die_with_parent(parent: int) -> None:
    """``PR_SET_PDEATHSIG`` = SIGKILL (Linux); exit at once if the parent is gone already."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - not Linux: the ctrl EOF ends it
        pass
    if os.getppid() != parent:
        os._exit(1)


def _batch_policy() -> None:
    """``SCHED_BATCH`` for this process (its threads inherit it): its many short wake-ups
    (a chunk due, an acknowledgement, a copy arriving) do not preempt the training threads
    on a busy machine; it runs when a CPU is free or at the next time slice, long before
    the next step needs the round. Where the policy cannot be set, it stays as it is."""
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        pass


class _Side:
    """The child's state: the streams, the store, the own slot's read-only mappings."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.rank = int(spec["rank"])
        self.store = NodeStore(Path(spec["root"]), int(spec["node"]))
        self.ctrl = socket.socket(fileno=int(spec["ctrl"]))
        self.out = {int(h): socket.socket(fileno=int(fd)) for h, fd in spec["out"].items()}
        self.inc = {int(r): socket.socket(fileno=int(fd)) for r, fd in spec["inc"].items()}
        self.timeout = float(spec["timeout"])
        self.threads: list[threading.Thread] = []  # the receivers
        self.released = -1  # the newest iteration whose remaining chunks go at once
        self.closing = False
        self.lock = threading.Lock()
        self._views: dict[int, tuple[int, int, mmap.mmap]] = {}

    def tell(self, msg: tuple[Any, ...]) -> None:
        with self.lock:
            self.ctrl.send(pickle.dumps(msg, protocol=5))

    def own_view(self, slot: int, nbytes: int) -> memoryview:
        """The snapshot bytes of own slot ``slot`` (the file mapped read-only, kept while it
        is the same file of the same size)."""
        path = self.store.data_path("own", self.rank, slot)
        st = os.stat(path)
        got = self._views.get(slot)
        if got is None or (got[0], got[1]) != (st.st_ino, st.st_size):
            with open(path, "rb") as f:
                mm = mmap.mmap(f.fileno(), st.st_size, prot=mmap.PROT_READ)
            got = self._views[slot] = (st.st_ino, st.st_size, mm)
        start = self.store.snapshot_offset()
        return memoryview(got[2])[start:start + nbytes]

    def control(self, timeout_s: float | None) -> bool:
        """Handle the control messages that arrive within ``timeout_s`` (None: wait for
        one); False when the parent closed the control socket."""
        r, _, _ = select.select([self.ctrl], [], [], timeout_s)
        if not r:
            return True
        data = self.ctrl.recv(_MSG)
        if not data:
            return False
        msg = pickle.loads(data)
        if msg[0] == "release":
            self.released = max(self.released, int(msg[1]))
        elif msg[0] == "round":
            self.send_round(*msg[1:])
        elif msg[0] == "close":
            self.close(bool(msg[1]))
            return False
        return True

    def send_round(self, it: int, nbytes: int, slot: int, anchor: float,
                   sends: list[tuple[int, int, int, int, float]]) -> None:
        """One round: the header to every holder, each chunk at its time (late ones with the
        following chunks to the same holder that are due too), the acknowledgements."""
        cpu0 = time.thread_time()

        def ms() -> float:
            return (time.perf_counter() - anchor) * 1e3

        view = self.own_view(slot, nbytes)
        header = HEADER.pack(it, nbytes)
        for s in self.out.values():
            s.sendall(header)
        chunks: list[tuple[int, int, int, int, float, float, str]] = []
        i = 0
        while i < len(sends):
            holder, _, start, end, due = sends[i]
            how = "on_time"
            while True:
                if self.released >= it:
                    how = "released"
                    break
                left = due - ms()
                if left <= 0:
                    how = "late" if left < -1.0 else how
                    break
                if not self.control(left / 1e3):
                    return
            now = ms()
            released = how == "released"
            j, stop = i + 1, end  # the following chunks to this holder that are due too
            while (j < len(sends) and sends[j][0] == holder and sends[j][2] == stop
                   and (released or sends[j][4] <= now)):
                stop = sends[j][3]
                j += 1
            self.out[holder].sendall(view[start:stop])
            for k in range(i, j):
                h, span, a, b, d = sends[k]
                kind = how if k == i else (
                    "released" if released and d > now else
                    "late" if d < now - 1.0 else "on_time")
                chunks.append((h, span, a, b - a, d, now, kind))
            i = j
        view.release()
        got = bytearray(ACK.size)
        for h, s in self.out.items():
            recv_exact(s, memoryview(got), f"holder rank {h}'s acknowledgement")
            (ack,) = ACK.unpack(got)
            if ack != it:
                raise RuntimeError(f"holder rank {h} acknowledged iteration {ack}, "
                                   f"expected {it}")
        self.tell(("done", it, chunks, ms(), (time.thread_time() - cpu0) * 1e3))

    def receive(self, source: int, sock: socket.socket) -> None:
        """A receiver thread: ``source``'s snapshots, each straight into its slot of this
        node's store (a scratch buffer when the slot already holds that iteration),
        completed and acknowledged, until ``source`` closes the stream."""
        hdr = bytearray(HEADER.size)
        scratch = bytearray(0)
        try:
            while True:
                try:
                    recv_exact(sock, memoryview(hdr), f"rank {source}'s next snapshot",
                               idle_ok=True)
                except LinkClosed:
                    return
                it, n = HEADER.unpack(hdr)
                res = self.store.reserve("held", source, it, n)
                if res is not None:
                    buf = res.buffer
                else:
                    if len(scratch) < n:
                        scratch = bytearray(n)
                    buf = memoryview(scratch)[:n]
                recv_exact(sock, buf, f"rank {source}'s snapshot of iteration {it}")
                if res is not None:
                    self.store.commit(res)
                sock.sendall(ACK.pack(it))
        except BaseException as e:  # noqa: BLE001 - reported to the worker
            if not self.closing:
                self.tell(("error", f"receiving from rank {source}: {e!r}"))

    def close(self, clean: bool) -> None:
        for s in self.out.values():
            try:
                s.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        self.closing_wait(clean)
        self.tell(("closed",))

    def closing_wait(self, clean: bool) -> None:
        """Wait (when ``clean``) for the ranks held to end their streams."""
        deadline = time.monotonic() + (self.timeout if clean else 0.0)
        for t in self.threads:
            t.join(timeout=max(deadline - time.monotonic(), 0.0))
        self.closing = True


def main(argv: Sequence[str]) -> int:
    """The side process (module docstring): ``argv[0]`` is the spec ``Agent.start`` wrote."""
    import ast

    spec = ast.literal_eval(argv[0])
    _die_with_parent(int(spec["parent"]))
    _batch_policy()
    side = _Side(spec)
    for r, sock in side.inc.items():
        t = threading.Thread(target=side.receive, args=(r, sock), daemon=True,
                             name=f"gemini-receive-{r}")
        t.start()
        side.threads.append(t)
    try:
        while side.control(None):
            pass
    except BaseException as e:  # noqa: BLE001 - reported to the worker, then exit
        try:
            side.tell(("error", f"sending: {e!r}"))
        except OSError:
            pass
        return 1
    finally:
        for s in [*side.out.values(), *side.inc.values()]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
