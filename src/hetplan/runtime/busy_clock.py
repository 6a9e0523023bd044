"""Seconds a rank spends computing within a step, and the step's span: host clocks on the
CPU, the device's events on a GPU.

On a GPU the host only queues kernels, and NCCL's receives make the stream wait, not the
host: a host clock around a call times its launch. :class:`BusyClock` with an event factory
(``torch.cuda.Event(enable_timing=True)``) brackets each timed call with two events on the
current stream and sums their elapsed times once the device has reached the step's end
(:meth:`BusyClock.settle`); the step's span is then the device's too (an event at
:meth:`BusyClock.reset`). Without one, both are host times.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["BusyClock", "cuda_events"]


def cuda_events(model: torch.nn.Module) -> Callable[[], Any] | None:
    """The event factory for a model on a GPU; None on the CPU."""
    if any(p.device.type == "cuda" for p in model.parameters()):
        return lambda: torch.cuda.Event(enable_timing=True)
    return None


class BusyClock:
    """Busy seconds of one step (:attr:`busy_s`) and its span (:meth:`settle`).

    Args:
        events: a factory of timing events (``record()``, ``synchronize()``,
            ``elapsed_time(other)`` in milliseconds), or None for host clocks.
    """

    def __init__(self, events: Callable[[], Any] | None = None) -> None:
        self.events = events
        self.busy_s = 0.0
        self._spans: list[tuple[Any, Any]] = []
        self._start: Any = None

    def _event(self) -> Any:
        assert self.events is not None
        ev = self.events()
        ev.record()
        return ev

    def reset(self) -> None:
        """Start a step: forget the previous one's time (on a GPU: mark the step's start)."""
        self.busy_s = 0.0
        self._spans = []
        self._start = self._event() if self.events is not None else None

    @contextlib.contextmanager
    def busy(self) -> Iterator[list[float]]:
        """Count the block as computing; yields ``[host start]``, to which the host end is
        appended on exit (for traces)."""
        start = self._event() if self.events is not None else None
        host = [time.perf_counter()]
        try:
            yield host
        finally:
            host.append(time.perf_counter())
            if start is not None:
                self._spans.append((start, self._event()))
            else:
                self.busy_s += host[1] - host[0]

    def settle(self, host_s: float) -> float:
        """After the step (``host_s``: its host time): add the device-timed blocks to
        :attr:`busy_s`, waiting for the device to reach the step's end, and return the step's
        span: the device's on a GPU, else ``host_s``."""
        if self._start is None:
            return host_s
        end = self._event()
        end.synchronize()
        self.busy_s += sum(a.elapsed_time(b) for a, b in self._spans) / 1e3
        self._spans = []
        return float(self._start.elapsed_time(end)) / 1e3
