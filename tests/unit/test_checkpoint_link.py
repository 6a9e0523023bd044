"""Gemini's replica streams: connecting each rank to its holders, and reading a message
whole or telling an orderly end from a broken one."""

from __future__ import annotations

import socket
import threading
from datetime import timedelta
from typing import Any

import pytest

from hetplan.runtime.checkpoint_link import (
    ACK,
    HEADER,
    LinkClosed,
    connect_links,
    local_address,
    recv_exact,
    set_timeouts,
)


def _pair(timeout_s: float = 5.0) -> tuple[socket.socket, socket.socket]:
    """Two connected TCP sockets on this host, set up as the handler sets up its links."""
    with socket.create_server(("127.0.0.1", 0)) as ls:
        a = socket.create_connection(ls.getsockname())
        b, _ = ls.accept()
    for s in (a, b):
        set_timeouts(s, timedelta(seconds=timeout_s))
    return a, b


def test_a_message_arrives_whole_across_many_sends() -> None:
    a, b = _pair()
    blob = bytes(range(256)) * 4096  # 1 MiB, more than one socket buffer
    got = bytearray(len(blob))
    t = threading.Thread(target=lambda: [a.sendall(blob[i:i + 100_000])
                                         for i in range(0, len(blob), 100_000)])
    t.start()
    recv_exact(b, memoryview(got), "the snapshot")
    t.join()
    assert got == blob
    a.close()
    b.close()


def test_orderly_end_and_broken_message_are_told_apart() -> None:
    a, b = _pair()
    a.sendall(HEADER.pack(7, 64)[:10])
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(ConnectionError, match="middle of the header.*10 of 16"):
        recv_exact(b, memoryview(bytearray(HEADER.size)), "the header")
    with pytest.raises(LinkClosed, match="before the header"):
        recv_exact(b, memoryview(bytearray(HEADER.size)), "the header")
    a.close()
    b.close()


def test_a_stalled_message_times_out_but_an_idle_link_may_wait() -> None:
    a, b = _pair(timeout_s=0.05)
    a.sendall(b"abc")
    with pytest.raises(TimeoutError, match="3 of 8 bytes"):
        recv_exact(b, memoryview(bytearray(8)), "the acknowledgement")
    # idle (nothing of the message yet): keeps waiting through timeouts until data comes
    buf = bytearray(ACK.size)
    timer = threading.Timer(0.2, lambda: a.sendall(ACK.pack(42)))
    timer.start()
    recv_exact(b, memoryview(buf), "the next header", idle_ok=True)
    timer.join()
    assert ACK.unpack(buf) == (42,)
    a.close()
    b.close()


def test_connect_links_pairs_every_rank_with_its_holders() -> None:
    holders = {0: [1], 1: [2], 2: [0]}  # a ring of three ranks
    sources = {h: [r for r, hs in holders.items() if h in hs] for h in holders}
    addrs: list[Any] = [None] * 3
    gathered = threading.Barrier(3)
    out: dict[int, Any] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        def gather(obj: Any) -> list[Any]:
            addrs[r] = obj
            gathered.wait()
            return list(addrs)

        try:
            out[r] = connect_links(r, holders[r], sources[r], "127.0.0.1", gather,
                                   timedelta(seconds=10))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    for r in range(3):
        to, frm = out[r]
        assert sorted(to) == holders[r] and sorted(frm) == sources[r]
        h = holders[r][0]
        to[h].sendall(ACK.pack(100 + r))  # reaches the holder's stream from r
        got = bytearray(ACK.size)
        recv_exact(out[h][1][r], memoryview(got), "a message")
        assert ACK.unpack(got) == (100 + r,)
    for to, frm in out.values():
        for s in [*to.values(), *frm.values()]:
            s.close()


def test_local_address_of_a_loopback_rendezvous() -> None:
    assert local_address("127.0.0.1") == "127.0.0.1"
    assert local_address("localhost") == "127.0.0.1"


def test_set_timeouts_makes_the_socket_blocking() -> None:
    a, b = _pair(timeout_s=3)
    assert a.gettimeout() is None and b.gettimeout() is None
    assert a.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    a.close()
    b.close()
