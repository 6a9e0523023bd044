"""Gemini's side process (``runtime/checkpoint_agent.py``): a round's snapshot reaches the
holder's store bitwise, chunks still ahead go at once when the step needs the round, the
close is orderly, and the side process dies with its worker."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta
from pathlib import Path

from hetplan.runtime.checkpoint_agent import Agent
from hetplan.runtime.checkpoint_link import set_timeouts
from hetplan.runtime.checkpoint_store import NodeStore

TIMEOUT = timedelta(seconds=60)


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.socket() as ls:
        ls.bind(("127.0.0.1", 0))
        ls.listen(1)
        a = socket.create_connection(ls.getsockname())
        b, _ = ls.accept()
    for s in (a, b):
        set_timeouts(s, TIMEOUT)
    return a, b


def _own(root: Path, rank: int, it: int, blob: bytes) -> int:
    store = NodeStore(root, rank)
    res = store.reserve("own", rank, it, len(blob))
    assert res is not None
    res.buffer[:] = blob
    store.commit(res)
    return res.slot


def _gone(pid: int, limit_s: float = 30.0) -> bool:
    """Whether ``pid`` ends (or is a zombie: dead, not yet reaped) within ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except OSError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def test_round_reaches_the_holder_and_release_sends_the_rest(tmp_path: Path) -> None:
    # ranks 0 and 1 on nodes 0 and 1, each the other's holder
    a01, b01 = _tcp_pair()  # 0 -> 1
    a10, b10 = _tcp_pair()  # 1 -> 0
    ag0 = Agent.start(0, tmp_path, 0, {1: a01}, {1: b10}, TIMEOUT)
    ag1 = Agent.start(1, tmp_path, 1, {0: a10}, {0: b01}, TIMEOUT)
    try:
        blob0 = bytes(range(256)) * 40 + b"tail"
        blob1 = os.urandom(3000)
        slot0 = _own(tmp_path, 0, 5, blob0)
        slot1 = _own(tmp_path, 1, 5, blob1)
        n0 = len(blob0)
        # rank 0: two chunks, the second due in a minute; rank 1: one chunk due at once
        ag0.round(5, n0, slot0, time.perf_counter(),
                  [(1, 0, 0, 1000, 0.0), (1, 1, 1000, n0, 60_000.0)])
        ag1.round(5, len(blob1), slot1, time.perf_counter(), [(0, -1, 0, len(blob1), 0.0)])
        done0 = ag0.wait(5)  # releases the second chunk: no minute's wait
        done1 = ag1.wait(5)
        # the first chunk is due at once (late: the side process was still starting)
        assert [c[-1] for c in done0[2]][1:] == ["released"]
        assert done0[2][0][-1] in ("on_time", "late")
        assert [(c[2], c[3]) for c in done0[2]] == [(0, 1000), (1000, n0 - 1000)]
        assert len(done1[2]) == 1 and done1[2][0][-1] in ("on_time", "late")
        # the holders' copies are complete and bitwise the senders' snapshots
        assert NodeStore(tmp_path, 1).read("held", 0, 5) == blob0
        assert NodeStore(tmp_path, 0).read("held", 1, 5) == blob1
        # the next round goes to the other slot; the first copy stays (two buffers)
        blob0b = blob0[::-1]
        slot0b = _own(tmp_path, 0, 6, blob0b)
        assert slot0b != slot0
        ag0.round(6, n0, slot0b, time.perf_counter(), [(1, -1, 0, n0, 0.0)])
        ag0.wait(6)
        held = NodeStore(tmp_path, 1)
        assert sorted(held.iterations("held", 0)) == [5, 6]
        assert held.read("held", 0, 6) == blob0b and held.read("held", 0, 5) == blob0
    finally:  # both at once, as the ranks do: each waits for the other's end of stream
        closers = [threading.Thread(target=a.close, args=(True,)) for a in (ag0, ag1)]
        for t in closers:
            t.start()
        for t in closers:
            t.join()
    assert ag0.proc.returncode == 0 and ag1.proc.returncode == 0


def test_side_process_dies_with_its_worker(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import socket, sys, time
        from datetime import timedelta
        from hetplan.runtime.checkpoint_agent import Agent
        a, b = socket.socketpair()
        ag = Agent.start(0, {str(tmp_path)!r}, 0, {{}}, {{1: b}}, timedelta(seconds=60))
        print(ag.pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        assert not _gone(pid, 0.5)  # it runs while its worker does
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=60)
        assert _gone(pid), f"the side process {pid} outlived its worker"
    finally:
        parent.kill()
        parent.wait(timeout=60)
