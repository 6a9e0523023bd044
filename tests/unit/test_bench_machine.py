"""``bench/_machine.py``: what a results file records about the machine's speed and load.

A shared host can slow this VM down with no load showing inside it (``docs/decisions/
cpu-fidelity.md``, section 19), so the fidelity bench records a speed probe and the CPU
shares of its sitting. These check the arithmetic of the shares and the probe's form; none
asserts a duration.
"""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.append(str(BENCH))  # after everything else: bench/ holds scripts named like modules

from _machine import cpu_shares, cpu_times, speed_probe  # noqa: E402


def _ticks(user: int, idle: int, steal: int, iowait: int = 0) -> dict[str, int]:
    return {"user": user, "nice": 0, "system": 0, "idle": idle, "iowait": iowait, "irq": 0,
            "softirq": 0, "steal": steal}


def test_cpu_shares_split_the_interval_into_busy_idle_and_stolen() -> None:
    before = _ticks(user=100, idle=100, steal=10)
    after = _ticks(user=160, idle=120, steal=30, iowait=0)  # 60 busy, 20 idle, 20 stolen
    assert cpu_shares(before, after) == {"busy": 0.6, "idle": 0.2, "steal": 0.2}


def test_cpu_shares_count_iowait_as_idle() -> None:
    shares = cpu_shares(_ticks(0, 0, 0), _ticks(user=50, idle=25, steal=0, iowait=25))
    assert shares == {"busy": 0.5, "idle": 0.5, "steal": 0.0}


def test_cpu_shares_need_two_readings() -> None:
    assert cpu_shares(None, _ticks(1, 1, 1)) is None
    assert cpu_shares(_ticks(1, 1, 1), None) is None


def test_cpu_times_reads_the_eight_fields_of_proc_stat() -> None:
    t = cpu_times()
    if not Path("/proc/stat").exists():
        assert t is None
        return
    assert t is not None and set(t) == {"user", "nice", "system", "idle", "iowait", "irq",
                                        "softirq", "steal"}
    assert all(v >= 0 for v in t.values())


def test_speed_probe_gives_both_workloads_in_ms_and_restores_torch_threads() -> None:
    import torch

    threads = torch.get_num_threads()
    p = speed_probe(repeats=1)
    assert set(p) == {"python_ms", "matmul_ms"} and all(v > 0 for v in p.values())
    assert torch.get_num_threads() == threads
