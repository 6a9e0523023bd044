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

__all__ = ["machine"]


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
