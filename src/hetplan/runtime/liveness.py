"""Which rank stopped: heartbeats in the job's store, read when a collective fails.

A collective whose peer is frozen (``SIGSTOP``, a hung device) or dead fails on every other
rank only after the process group's timeout, and gloo's error names a socket or a buffer, not
the rank. So every rank of a :class:`~hetplan.runtime.executor.Runtime` beats: a daemon thread
adds 1 to ``hetplan/heartbeat/<rank>`` in the default group's store every ``period_s``. The
thread keeps beating while the main thread waits in a collective (the wait releases the GIL),
so only a frozen or dead process stops. When a step fails, :meth:`Heartbeat.stalled` reads
every count twice, ``probe_s`` apart; the ranks whose count did not move are the suspects
that :class:`PeerFailureError` names.

The store is torchrun's (a TCP store its agent serves, which outlives every rank) or the
tests' ``FileStore``; reads run on a helper thread with a deadline, so a store that no longer
answers cannot hold the failing rank past it.
"""

from __future__ import annotations

import atexit
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch.distributed as dist

__all__ = ["Heartbeat", "PeerFailureError"]

T = TypeVar("T")

#: the source location gloo puts before its messages ("[.../unbound_buffer.cc:78] ")
_SOURCE = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\] ")


class PeerFailureError(RuntimeError):
    """A collective failed and some ranks stopped beating: they are named as the suspects.

    Attributes:
        suspects: the global ranks whose heartbeat did not move (frozen or dead).
    """

    def __init__(self, message: str, suspects: Sequence[int]) -> None:
        super().__init__(message)
        self.suspects = tuple(suspects)


def _with_deadline(fn: Callable[[], T], seconds: float) -> T | None:
    """``fn()`` on a daemon thread; None when it has not returned after ``seconds`` (or
    raised)."""
    box: list[T] = []

    def run() -> None:
        try:
            box.append(fn())
        except Exception:  # noqa: BLE001 - a store that fails is a store that says nothing
            pass

    thread = threading.Thread(target=run, name="hetplan-heartbeat-read", daemon=True)
    thread.start()
    thread.join(seconds)
    return box[0] if box else None


class Heartbeat:
    """This rank's heartbeat, and a reading of everyone's (see module docstring).

    Args:
        store: a ``torch.distributed.Store`` every rank shares (keys get the prefix
            ``hetplan/heartbeat/``).
        rank: this process's global rank.
        world: the number of ranks.
        period_s: seconds between two beats.
    """

    def __init__(self, store: Any, rank: int, world: int, period_s: float = 0.5) -> None:
        self.store = dist.PrefixStore("hetplan/heartbeat/", store)
        self.rank, self.world, self.period_s = rank, world, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="hetplan-heartbeat",
                                        daemon=True)
        self._thread.start()
        # A daemon thread still inside the store's C++ call when the interpreter finalises
        # is ended by pthread_exit, which aborts the process ("terminate called without an
        # active exception"): a script that never calls Runtime.close() must not meet that.
        atexit.register(self.stop)

    @classmethod
    def of_default_group(cls, period_s: float = 0.5) -> Heartbeat | None:
        """A heartbeat in the default process group's store; None without one."""
        if not dist.is_initialized():
            return None
        try:
            # private, but the only handle on the store every rank already shares
            store = dist.distributed_c10d._get_default_store()
        except (RuntimeError, AttributeError, ValueError):
            return None
        return cls(store, dist.get_rank(), dist.get_world_size(), period_s)

    def _beat(self) -> None:
        key = str(self.rank)
        while not self._stop.is_set():
            try:
                self.store.add(key, 1)
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending
                return
            self._stop.wait(self.period_s)

    def counts(self, deadline_s: float = 5.0) -> list[int] | None:
        """Every rank's beat count (0: never beat), or None when the store did not answer
        within ``deadline_s``."""
        def read() -> list[int]:
            return [int(self.store.add(str(r), 0)) for r in range(self.world)]

        return _with_deadline(read, deadline_s)

    def stalled(self, probe_s: float | None = None) -> list[int] | None:
        """The ranks whose count did not move in ``probe_s`` (default: three beats), this
        rank excluded; None when the store did not answer."""
        probe_s = 3 * self.period_s if probe_s is None else probe_s
        before = self.counts()
        if before is None:
            return None
        time.sleep(probe_s)
        after = self.counts()
        if after is None:
            return None
        return [r for r in range(self.world) if r != self.rank and after[r] == before[r]]

    def explain(self, error: BaseException) -> PeerFailureError | None:
        """A :class:`PeerFailureError` for ``error`` (a failed collective) naming the ranks
        that stopped beating; None when every rank still beats or nothing can be read."""
        from hetplan.runtime.proctree import defer_stop

        probe_s = 3 * self.period_s
        defer_stop(probe_s + 1.0)  # torchrun stops the job once a first rank has failed
        suspects = self.stalled(probe_s)
        if not suspects:
            return None
        who = (f"rank {suspects[0]}" if len(suspects) == 1
               else "ranks " + ", ".join(str(r) for r in suspects))
        text = str(error).strip()
        first = _SOURCE.sub("", text.splitlines()[0]) if text else type(error).__name__
        return PeerFailureError(
            f"{who} stopped responding (no heartbeat for {probe_s:.1f} s: frozen or dead); "
            f"this rank's collective failed: {first}", suspects)

    def stop(self, join_s: float = 2.0) -> None:
        """Stop beating; waits up to ``join_s`` for the thread to end (a beat in flight)."""
        atexit.unregister(self.stop)
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(join_s)
