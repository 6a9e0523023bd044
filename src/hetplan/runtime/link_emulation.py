"""A slow network for local gloo runs: ``HETPLAN_EMULATE_BW=<Gbit/s>`` (benchmarks and tests).

Loopback gloo moves gigabytes per second, so a plan made for a bandwidth-poor cluster cannot
be measured on one machine as it is. With ``HETPLAN_EMULATE_BW`` set, every gradient-sync
collective that crosses nodes (levels ``flat`` and ``inter``; ``intra`` stays at loopback
speed; a ``flat`` group is taken to span nodes, so on a one-node plan every collective is
throttled) also occupies an emulated link of that many Gbit/s per rank, with
``HETPLAN_EMULATE_LATENCY_US`` (default 0) microseconds per algorithm step:

- the link is one FIFO per process (a rank's NIC): a collective issued at ``t`` starts on it
  at ``max(t, link free)`` and holds it for ``steps * latency + volume * 8 / bandwidth``;
- ``steps`` and ``volume`` (what a rank sends) follow the ring / chain algorithms, the cost
  model's convention in :mod:`hetplan.algorithms.collectives`: ``latency_steps(collective,
  g)`` and ``bus_factor(collective, g) * nbytes`` with ``nbytes`` the collective's size there
  (gathers count their whole output) — the alpha-beta time the cost model predicts for that
  link;
- whoever waits for the collective's result (the gradient path's worker thread, or
  :meth:`~hetplan.runtime.grad_sync.GradSync.finish` for the asynchronous allreduce) also
  waits until its emulated end. The collective's real time counts too: the emulated end is a
  lower bound, never added on top.

So backprop keeps running while the emulated link is busy (overlap is measured, not modelled),
and a collective's wire time is the one the cost model predicts (loopback gloo's real time,
usually shorter, runs underneath it); compute, (de)compression, the order and overlap of the
collectives and thread scheduling are real. Every rank computes the same delays,
as the volume of a ring collective is the same on every rank. Decision and limits in
``docs/decisions.md`` ("End-to-end runs").
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections.abc import Callable, Iterator

from hetplan.algorithms.collectives import analytic_time_s
from hetplan.errors import SpecError

__all__ = ["ENV", "ENV_LATENCY", "EmulatedLink", "emulated_link", "occupy", "throttled"]

#: The environment variable: the emulated per-rank bandwidth in Gbit/s (unset or empty: off).
ENV = "HETPLAN_EMULATE_BW"
#: Latency per algorithm step in microseconds (only with :data:`ENV`; default 0).
ENV_LATENCY = "HETPLAN_EMULATE_LATENCY_US"
_THROTTLED_LEVELS = ("flat", "inter")


class EmulatedLink:
    """One rank's emulated NIC: a FIFO of ``gbps`` Gbit/s.

    Args:
        gbps: bandwidth, > 0.
        latency_us: latency per algorithm step, >= 0.
        clock: seconds (``time.perf_counter``; tests pass their own).
        sleep: waits seconds (``time.sleep``).
    """

    def __init__(self, gbps: float, latency_us: float = 0.0,
                 clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if not 0 < gbps < math.inf:
            raise SpecError(f"{ENV}={gbps!r}: the emulated bandwidth must be > 0 Gbit/s and "
                            f"finite, e.g. {ENV}=1 (unset it to run at full speed)")
        if not 0 <= latency_us < math.inf:
            raise SpecError(f"{ENV_LATENCY}={latency_us!r}: the emulated latency must be >= 0 "
                            f"microseconds and finite, e.g. {ENV_LATENCY}=50")
        self.bytes_per_s = gbps * 1e9 / 8
        self.latency_s = latency_us * 1e-6
        self._clock = clock
        self._sleep = sleep
        self._free_at = 0.0
        self._lock = threading.Lock()
        #: seconds of link time reserved so far (the emulated transfer time, summed)
        self.busy_s = 0.0

    def reserve(self, collective: str, nbytes: float, group_size: int) -> float:
        """Queue a collective issued now; the time at which it ends on the link."""
        seconds = analytic_time_s(collective, nbytes, group_size, self.bytes_per_s,
                                  self.latency_s)
        with self._lock:
            start = max(self._clock(), self._free_at)
            self._free_at = start + seconds
            self.busy_s += seconds
            return self._free_at

    def wait(self, end: float) -> None:
        """Block until ``end`` (a :meth:`reserve` result)."""
        left = end - self._clock()
        if left > 0:
            self._sleep(left)


_LINK: EmulatedLink | None = None
_LINK_KEY: str | None = None  # the settings _LINK was made from


def emulated_link() -> EmulatedLink | None:
    """This process's link from ``HETPLAN_EMULATE_BW`` and ``HETPLAN_EMULATE_LATENCY_US``
    (None when the bandwidth is unset or empty)."""
    global _LINK, _LINK_KEY
    raw = os.environ.get(ENV, "").strip()
    lat = os.environ.get(ENV_LATENCY, "").strip()
    if not raw:
        if lat:
            raise SpecError(f"{ENV_LATENCY}={lat!r} emulates a link's latency only together "
                            f"with its bandwidth: set {ENV} too (e.g. {ENV}=10), or unset "
                            f"{ENV_LATENCY}")
        return None
    lat = lat or "0"
    key = f"{raw}/{lat}"
    if _LINK is None or key != _LINK_KEY:
        _LINK, _LINK_KEY = EmulatedLink(_number(ENV, raw, "a bandwidth in Gbit/s", "1"),
                                        _number(ENV_LATENCY, lat, "microseconds", "50")), key
    return _LINK


def _number(name: str, raw: str, what: str, example: str) -> float:
    try:
        return float(raw)
    except ValueError as e:
        raise SpecError(f"{name}={raw!r}: expected {what}, e.g. {name}={example} (unset "
                        f"{ENV} to run at full speed)") from e


def throttled(level: str) -> EmulatedLink | None:
    """The link a collective at ``level`` occupies (None: not emulated or intra-node)."""
    return emulated_link() if level in _THROTTLED_LEVELS else None


@contextlib.contextmanager
def occupy(link: EmulatedLink | None, collective: str, nbytes: float,
           group_size: int) -> Iterator[None]:
    """Run a synchronous collective (the body) on ``link``: queued when the body starts,
    waited for when it ends (nothing when ``link`` is None)."""
    end = link.reserve(collective, nbytes, group_size) if link is not None else 0.0
    yield
    if link is not None:
        link.wait(end)
