"""Where a benchmark's numbers were taken: the ``machine`` entry of every results file.

Benchmarks run as scripts (``python bench/NAME.py``), so this directory is on ``sys.path``
and they import ``from _machine import machine``.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

__all__ = ["cpu_shares", "cpu_times", "machine", "speed_probe"]


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine(**extra: Any) -> dict[str, Any]:
    """CPU count, platform, processor, Python, torch and hetplan versions and the git commit,
    plus ``extra`` (e.g. ``note=`` saying the machine was shared, ``backend="gloo"``)."""
    try:
        commit: str | None = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
            cwd=Path(__file__).resolve().parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "hetplan": _version("hetplan"),
        "commit": commit,
        **extra,
    }


def speed_probe(repeats: int = 5) -> dict[str, float]:
    """How fast this machine is right now, in ms for a fixed workload (least of ``repeats``):
    ``python`` a pure-Python loop of 200,000 additions, ``matmul`` 200 products of 128 x 128
    fp32 matrices on one torch thread. On one idle machine the numbers repeat within its
    frequency scaling, so probes of two sittings that differ by far more say the machine ran
    at a different speed (a shared host can slow a VM down without any load showing inside
    it)."""
    import time

    import torch

    def _python() -> float:
        t0, acc = time.perf_counter(), 0
        for i in range(200_000):
            acc += i
        return (time.perf_counter() - t0) * 1e3

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.ones(128, 128)

        def _matmul() -> float:
            t0 = time.perf_counter()
            for _ in range(200):
                torch.mm(a, a)
            return (time.perf_counter() - t0) * 1e3

        _matmul()
        return {"python_ms": round(min(_python() for _ in range(repeats)), 3),
                "matmul_ms": round(min(_matmul() for _ in range(repeats)), 3)}
    finally:
        torch.set_num_threads(threads)


def cpu_times() -> dict[str, int] | None:
    """The machine's CPU time so far in clock ticks (``/proc/stat``'s first line: user, nice,
    system, idle, iowait, irq, softirq, steal), or None off Linux. Two readings give the
    share of the interval the hypervisor took (``steal``) and the share the CPUs were busy."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
    except OSError:
        return None
    names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    values = [int(f) for f in fields] + [0] * (len(names) - len(fields))  # old kernels: fewer
    return dict(zip(names, values))


def cpu_shares(before: dict[str, int] | None, after: dict[str, int] | None
               ) -> dict[str, float] | None:
    """Between two :func:`cpu_times` readings: the shares of CPU time busy, idle and stolen."""
    if not before or not after:
        return None
    d = {k: after[k] - before[k] for k in before}
    total = sum(d.values()) or 1
    return {"busy": round((total - d["idle"] - d["iowait"] - d["steal"]) / total, 4),
            "idle": round((d["idle"] + d["iowait"]) / total, 4),
            "steal": round(d["steal"] / total, 4)}
