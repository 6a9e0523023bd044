"""The pipeline's compute and bubble on a GPU: timed by events on the device's stream, not
by the host, which only queues the kernels (and which NCCL's receives do not block).

CUDA is not needed to check the arithmetic: the events here read a clock the fake stages
advance, as the device's would, while the host returns at once. With host clocks instead
(the monitor without events) the same run counts nothing as compute.
"""

from __future__ import annotations

from typing import Any

import pytest

from hetplan.algorithms.pipeline_schedules import Action, ActionKind
from hetplan.runtime.busy_clock import BusyClock
from hetplan.runtime.schedule import StageMonitor


class _Device:
    now = 0.0  # seconds


class _Event:
    def record(self) -> None:
        self.t = _Device.now

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: _Event) -> float:  # milliseconds, as CUDA's
        return (other.t - self.t) * 1e3


class _Stage:
    """Queues 5 ms of forward and 10 ms of backward on the device; returns at once."""

    stage_index = 1

    def forward_one_chunk(self, chunk: int, *args: Any, **kwargs: Any) -> str:
        _Device.now += 0.005
        return f"out{chunk}"

    def backward_one_chunk(self, chunk: int, *args: Any, **kwargs: Any) -> None:
        _Device.now += 0.010


class _Schedule:
    def _maybe_compute_loss(self, *args: Any) -> None:
        _Device.now += 0.001  # the last stage's loss


def _step(monitor: StageMonitor, stage: _Stage, schedule: _Schedule) -> float:
    monitor.reset()
    _Device.now += 0.002  # the device waits for the first activation
    assert stage.forward_one_chunk(0) == "out0"
    schedule._maybe_compute_loss()
    _Device.now += 0.003  # ... and for a gradient
    stage.backward_one_chunk(0)
    return monitor.settle(host_s=1e-4)


def test_device_events_time_the_calls_and_the_step() -> None:
    stage, schedule = _Stage(), _Schedule()
    monitor = StageMonitor([stage], _Event)  # type: ignore[list-item]
    monitor.watch_loss(schedule)
    span = _step(monitor, stage, schedule)
    assert span == pytest.approx(0.021)
    assert monitor.busy_s == pytest.approx(0.016)  # 5 + 1 + 10 ms; the 5 ms of waits are not
    assert monitor.executed == [Action(ActionKind.F, 0, 1), Action(ActionKind.B, 0, 1)]
    span = _step(monitor, stage, schedule)  # reset forgets the previous step
    assert (span, monitor.busy_s) == (pytest.approx(0.021), pytest.approx(0.016))


def test_host_clocks_see_only_the_launches() -> None:
    """Without events (the CPU, where the host computes) the step is the host's time."""
    stage, schedule = _Stage(), _Schedule()
    monitor = StageMonitor([stage])  # type: ignore[list-item]
    monitor.watch_loss(schedule)
    assert _step(monitor, stage, schedule) == 1e-4
    assert monitor.busy_s < 0.005


def test_busy_blocks_on_the_device() -> None:
    """The heterogeneous pipeline's clock: blocks of device work, the step's device span."""
    clock = BusyClock(_Event)
    clock.reset()
    with clock.busy() as host:
        _Device.now += 0.004
    _Device.now += 0.006  # waiting for a peer
    with clock.busy():
        _Device.now += 0.002
    assert clock.settle(host_s=0.0) == pytest.approx(0.012)
    assert clock.busy_s == pytest.approx(0.006)
    assert len(host) == 2 and host[1] >= host[0]
