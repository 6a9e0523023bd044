"""The emulated link of ``HETPLAN_EMULATE_BW``: FIFO occupancy, ring volumes, parsing."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetplan.errors import SpecError
from hetplan.runtime import link_emulation
from hetplan.runtime.link_emulation import (
    ENV,
    ENV_LATENCY,
    EmulatedLink,
    emulated_link,
    occupy,
    throttled,
)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def test_fifo_and_ring_volumes() -> None:
    clock = _Clock()
    link = EmulatedLink(8.0, clock=clock, sleep=clock.sleep)  # 1e9 bytes/s
    # ring allreduce on 4 ranks sends 2*3/4 of the buffer: 1.5 ms for 1 MB
    end1 = link.reserve("allreduce", 1e6, 4)
    assert end1 == pytest.approx(1.5e-3)
    # issued at the same time: queues behind the first (allgather sends 3/4 of its output)
    end2 = link.reserve("allgather", 4e6, 4)
    assert end2 == pytest.approx(1.5e-3 + 3e-3)
    clock.now = 10.0  # an idle link starts the next one when it is issued
    assert link.reserve("broadcast", 1e6, 2) == pytest.approx(10.001)
    assert link.busy_s == pytest.approx(5.5e-3)
    # latency per ring step: allreduce on 4 ranks has 2*3 steps, broadcast on 2 one
    slow = EmulatedLink(8.0, latency_us=100.0, clock=clock, sleep=clock.sleep)
    assert slow.reserve("allreduce", 1e6, 4) == pytest.approx(10.0 + 6e-4 + 1.5e-3)
    assert slow.busy_s == pytest.approx(6e-4 + 1.5e-3)
    link.wait(9.0)  # in the past: no wait
    assert clock.now == 10.0
    with occupy(link, "reduce_scatter", 2e6, 2):  # 1 MB at 1 GB/s
        clock.now += 2e-4  # the real collective took 0.2 ms
    assert clock.now == pytest.approx(10.002)  # waited for the emulated end after 10.001


def test_one_rank_and_no_link_cost_nothing() -> None:
    clock = _Clock()
    link = EmulatedLink(1.0, clock=clock, sleep=clock.sleep)
    assert link.reserve("allreduce", 1e9, 1) == 0.0
    with occupy(None, "allreduce", 1e9, 4):
        pass
    assert clock.now == 0.0


def test_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(link_emulation, "_LINK", None)
    monkeypatch.delenv(ENV, raising=False)
    assert emulated_link() is None and throttled("flat") is None
    monkeypatch.setenv(ENV, "0.5")
    link = emulated_link()
    assert link is not None and link.bytes_per_s == pytest.approx(0.5e9 / 8)
    assert emulated_link() is link  # one link per process
    assert throttled("inter") is link and throttled("flat") is link
    assert throttled("intra") is None  # inside a node: loopback speed
    monkeypatch.setenv(ENV_LATENCY, "30")
    slow = emulated_link()
    assert slow is not link and slow is not None and slow.latency_s == pytest.approx(30e-6)
    assert link.latency_s == 0.0
    monkeypatch.setenv(ENV_LATENCY, "-1")
    with pytest.raises(SpecError, match=f"{ENV_LATENCY}=-1.0: .*>= 0"):
        emulated_link()
    monkeypatch.setenv(ENV_LATENCY, "soon")
    with pytest.raises(SpecError, match=f"{ENV_LATENCY}='soon': expected microseconds"):
        emulated_link()
    monkeypatch.delenv(ENV_LATENCY)
    monkeypatch.setenv(ENV, "fast")
    with pytest.raises(SpecError, match=f"{ENV}='fast'.*Gbit/s"):
        emulated_link()
    monkeypatch.setenv(ENV, "0")
    with pytest.raises(SpecError, match="must be > 0"):
        emulated_link()


@pytest.mark.parametrize(("env", "needle"), [
    ({"HETPLAN_EMULATE_BW": "fast"}, "HETPLAN_EMULATE_BW='fast': expected a bandwidth"),
    ({"HETPLAN_EMULATE_BW": "1", "HETPLAN_EMULATE_LATENCY_US": "x"},
     "HETPLAN_EMULATE_LATENCY_US='x'"),
    ({"HETPLAN_EMULATE_STRAGGLER": "x"}, "HETPLAN_EMULATE_STRAGGLER='x'"),
])
def test_hetplan_run_refuses_a_bad_emulation_variable_before_any_rank_starts(
        env: dict[str, str], needle: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Was: every rank started and printed the error, then torchrun's 40-line failure report."""
    from typer.testing import CliRunner

    import hetplan
    from hetplan.cli import app
    from hetplan.runtime import launch as launch_mod

    def never(*_a: object, **_k: object) -> None:
        raise AssertionError("started despite a bad emulation variable")

    monkeypatch.setattr(launch_mod, "prestart", never)
    monkeypatch.setattr(launch_mod, "launch", never)
    plan = hetplan.compile("mlp", "local-cpu", batch_size=8, dp=4, pp=1, tp=1)
    path = tmp_path / "plan.json"
    plan.save(path)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    res = CliRunner().invoke(app, ["run", str(path), "--model", "mlp"])
    assert res.exit_code == 2, res.output
    assert needle in " ".join(res.output.split())
