"""The TCP connections that carry Gemini's snapshot copies between a rank and its holders.

Decision (``docs/decisions/gemini.md``, "Traffic"): a round's copy travels as one byte stream
per (sender, holder) pair instead of gloo messages. Over gloo a round was a header, the
plan's chunks and an acknowledgement, each a message matched by size and each handled by
gloo's event loop thread: per rank and iteration about 3 ms of CPU in ``gloo_tcp_loop``
on the 2-core test machine, for 1.4 MB. On a stream the chunks need no matching receives:
the holder reads the whole snapshot with one ``recv_into`` (``MSG_WAITALL``: the kernel
fills the mapped slot, the thread wakes once), whatever the sender's cuts were.

Framing, sender → holder: per round a 16-byte header (iteration, snapshot bytes; little
endian) then the snapshot's bytes, in the order of the sender's timetable for that holder
(which :func:`hetplan.runtime.checkpoint_schedule.timetable` gives both sides). Holder →
sender: per round 8 bytes, the iteration it has stored. An orderly end (the sender's
``close``) is end-of-file at a header boundary; anything else is an error.

Blocking sockets with the kernel's send and receive timeouts (``SO_SNDTIMEO``,
``SO_RCVTIMEO``) set to the runtime's timeout, so that no call waits for ever; a holder
waiting for the next round's header tolerates timeouts (rounds can be far apart).
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

__all__ = ["HEADER", "ACK", "LinkClosed", "local_address", "connect_links", "recv_exact",
           "set_timeouts"]

HEADER = struct.Struct("<qq")  # iteration, nbytes
ACK = struct.Struct("<q")  # iteration


class LinkClosed(ConnectionError):
    """The peer closed the connection at a message boundary (its orderly end)."""


def local_address(master: str) -> str:
    """This host's address that peers reach it by: the interface that routes to the
    rendezvous host ``master`` (``127.0.0.1`` when that is this host's loopback)."""
    if master in ("localhost", "") or master.startswith("127."):
        return "127.0.0.1"
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((master, 9))  # UDP: no packet is sent, only a route is chosen
        return str(probe.getsockname()[0])
    except OSError:
        return socket.gethostbyname(socket.gethostname())
    finally:
        probe.close()


def set_timeouts(sock: socket.socket, timeout: timedelta) -> None:
    """Blocking mode, with the kernel's send and receive timeouts (no Python-level poll)."""
    sock.settimeout(None)
    secs = max(timeout.total_seconds(), 0.001)
    tv = struct.pack("ll", int(secs), int((secs - int(secs)) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def recv_exact(sock: socket.socket, buf: memoryview, what: str, *,
               idle_ok: bool = False) -> None:
    """Fill ``buf`` from ``sock``. ``LinkClosed`` on end-of-file before the first byte,
    ``ConnectionError`` after it; ``TimeoutError`` when the kernel's receive timeout passes
    mid-message (or, unless ``idle_ok``, before it)."""
    got, n = 0, len(buf)
    while got < n:
        try:
            k = sock.recv_into(buf[got:], n - got, socket.MSG_WAITALL)
        except BlockingIOError:  # SO_RCVTIMEO passed
            if idle_ok and got == 0:
                continue
            raise TimeoutError(f"timed out receiving {what} ({got} of {n} bytes)") from None
        if k == 0:
            if got == 0:
                raise LinkClosed(f"the peer closed the connection before {what}")
            raise ConnectionError(f"the peer closed the connection in the middle of {what} "
                                  f"({got} of {n} bytes)")
        got += k


def connect_links(rank: int, holders: Sequence[int], sources: Sequence[int], host: str,
                  gather: Any, timeout: timedelta
                  ) -> tuple[dict[int, socket.socket], dict[int, socket.socket]]:
    """Connect ``rank`` to each of its holders and accept a connection from each rank it
    holds. ``gather(obj)`` all-gathers one object per rank (the side group's
    ``all_gather_object``). Returns ``({holder: socket}, {source: socket})``.

    Every rank listens before the addresses are exchanged, and a connection completes in
    the listener's backlog before it is accepted, so the connects cannot deadlock."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((host, 0))
        listener.listen(max(len(sources), 1))
        listener.settimeout(timeout.total_seconds())
        addrs = gather((host, listener.getsockname()[1]))
        out: dict[int, socket.socket] = {}
        for h in holders:
            s = socket.create_connection(tuple(addrs[h]), timeout=timeout.total_seconds())
            set_timeouts(s, timeout)
            s.sendall(ACK.pack(rank))
            out[h] = s
        inc: dict[int, socket.socket] = {}
        for _ in sources:
            s, _addr = listener.accept()
            set_timeouts(s, timeout)
            who = bytearray(ACK.size)
            recv_exact(s, memoryview(who), "the connecting rank's number")
            (src,) = ACK.unpack(who)
            if src not in sources or src in inc:
                raise ConnectionError(f"rank {rank}: unexpected checkpoint connection from "
                                      f"rank {src} (expected one from each of {list(sources)})")
            inc[src] = s
        return out, inc
    finally:
        listener.close()
