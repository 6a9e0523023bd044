"""SDPipe's scheduler as a small TCP service on one rank, and the workers' client.

The scheduler (:class:`hetplan.algorithms.sdpipe.GroupScheduler`, a pure state machine) runs
in a daemon thread of the scheduler rank, driven by wall time (``time.monotonic``). Every
worker holds one connection and speaks one line per message:

- ``R <stage> <pipeline>`` — ready: the worker finished its local step and waits; the answer
  is ``G <w0>,<w1>,...`` (the sorted pipelines of its group) once the scheduler commits it;
- ``D <stage> <pipeline>`` — done: the worker trained its last iteration and leaves the
  connectivity requirement (:meth:`GroupScheduler.retire`); no answer.

The thread ends when every worker of the mesh is done (or :meth:`SchedulerService.stop`).
A socket service rather than the rendezvous store's keys: a ready signal must wake the
scheduler at once and the answer must wake exactly the group's members, which a store can
only approximate by polling. Deterministic given the order in which messages arrive.
"""

from __future__ import annotations

import selectors
import socket
import threading
import time
from dataclasses import dataclass, field

from hetplan.algorithms.sdpipe import Commit, GroupScheduler, SchedulerConfig

__all__ = ["SchedulerClient", "SchedulerService", "ServiceStats"]

#: The longest the service thread sleeps before re-checking its deadlines and stop flag.
_POLL_S = 0.05


@dataclass
class ServiceStats:
    """What the scheduler did: the groups it committed and its lock skips."""

    commits: list[Commit] = field(default_factory=list)

    @property
    def lock_skips(self) -> int:
        return sum(c.lock_skipped for c in self.commits)


class SchedulerService:
    """The scheduler thread (see the module docstring).

    Args:
        config: the scheduler's settings (its mesh is every worker that will connect).
        host: the address to listen on ("" for every interface).
    """

    def __init__(self, config: SchedulerConfig, host: str = "127.0.0.1") -> None:
        self.config = config
        self.scheduler = GroupScheduler(config)
        self.stats = ServiceStats()
        self._sock = socket.create_server((host, 0))
        self._sock.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._sock, selectors.EVENT_READ, None)
        self._conns: dict[tuple[int, int], socket.socket] = {}
        self._buffers: dict[socket.socket, bytes] = {}
        self._done: set[tuple[int, int]] = set()
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="sdpipe-scheduler", daemon=True)
        self.error: BaseException | None = None

    @property
    def port(self) -> int:
        """The TCP port the service listens on."""
        return int(self._sock.getsockname()[1])

    def start(self) -> SchedulerService:
        """Start the thread; returns self."""
        self._thread.start()
        return self

    def join(self, timeout: float | None = None) -> bool:
        """Wait until every worker is done (or ``timeout``); True when the thread ended."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self) -> None:
        """Stop the thread and close every socket."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5.0)
        for conn in list(self._buffers):
            conn.close()
        self._sel.close()
        self._sock.close()

    # -- the thread -------------------------------------------------------------------------
    def _now(self) -> float:
        return time.monotonic() - self._t0

    def _loop(self) -> None:
        total = self.config.num_stages * self.config.num_pipelines
        try:
            while not self._stop.is_set() and len(self._done) < total:
                deadline = self.scheduler.next_deadline()
                wait = _POLL_S if deadline is None else min(_POLL_S, deadline - self._now())
                for key, _ in self._sel.select(max(wait, 0.0)):
                    if key.fileobj is self._sock:
                        conn, _ = self._sock.accept()
                        conn.setblocking(True)
                        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                        self._sel.register(conn, selectors.EVENT_READ, None)
                        self._buffers[conn] = b""
                    else:
                        assert isinstance(key.fileobj, socket.socket)
                        self._read(key.fileobj)
                self._deliver(self.scheduler.advance(self._now()))
        except BaseException as e:  # reported by the handler; workers then time out
            self.error = e

    def _read(self, conn: socket.socket) -> None:
        data = conn.recv(4096)
        if not data:
            self._sel.unregister(conn)
            return
        buf = self._buffers[conn] + data
        *lines, self._buffers[conn] = buf.split(b"\n")
        for line in lines:
            kind, stage_s, pipe_s = line.decode().split()
            stage, pipe = int(stage_s), int(pipe_s)
            self._conns[(stage, pipe)] = conn
            if kind == "R":
                self._deliver(self.scheduler.ready(stage, pipe, self._now()))
            elif kind == "D":
                self._done.add((stage, pipe))
                self._deliver(self.scheduler.retire(stage, pipe, self._now()))
            else:
                raise ValueError(f"unknown scheduler message {line!r}")

    def _deliver(self, commits: list[Commit]) -> None:
        for c in commits:
            self.stats.commits.append(c)
            text = ("G " + ",".join(map(str, c.group)) + "\n").encode()
            for member in c.group:
                self._conns[(c.stage, member)].sendall(text)


class SchedulerClient:
    """One worker's connection to the scheduler."""

    def __init__(self, host: str, port: int, stage: int, pipeline: int,
                 timeout_s: float | None = None) -> None:
        self.stage, self.pipeline = stage, pipeline
        self._sock = socket.create_connection((host, port), timeout=timeout_s)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._file = self._sock.makefile("rb")

    def ready(self) -> tuple[int, ...]:
        """Signal ready and wait for the group; returns its sorted pipelines."""
        self._sock.sendall(f"R {self.stage} {self.pipeline}\n".encode())
        line = self._file.readline()
        if not line.startswith(b"G "):
            raise ConnectionError(f"the SDPipe scheduler closed the connection of stage "
                                  f"{self.stage}, pipeline {self.pipeline} (answer {line!r})")
        return tuple(int(x) for x in line[2:].decode().strip().split(","))

    def done(self) -> None:
        """Tell the scheduler this worker trained its last iteration."""
        self._sock.sendall(f"D {self.stage} {self.pipeline}\n".encode())

    def close(self) -> None:
        self._file.close()
        self._sock.close()
