"""Test-suite settings and shared fixtures. Hypothesis runs derandomized and without per-example deadlines by
default, so a CI run is reproducible and a loaded machine cannot fail a property test on
time alone; ``HYPOTHESIS_PROFILE=explore`` draws fresh random examples on every run."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import settings

# multi-process tests fork their ranks from one server that imported torch once, instead of
# spawning a fresh interpreter (a ~2 s torch import) per rank; HETPLAN_START_METHOD=spawn
# runs them the way `hetplan profile` does by default
os.environ.setdefault("HETPLAN_START_METHOD", "forkserver")

settings.register_profile("hetplan", deadline=None, derandomize=True, print_blob=True)
settings.register_profile("explore", deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "hetplan"))

GOLDEN = Path(__file__).resolve().parent / "golden"


def _check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("HETPLAN_UPDATE_GOLDEN") == "1":
        path.write_text(text, encoding="utf-8")
    assert path.is_file(), f"{path} is missing; run with HETPLAN_UPDATE_GOLDEN=1 to create it"
    assert text == path.read_text(encoding="utf-8"), (
        f"{name} differs from the golden file; if the change is intended, regenerate with "
        "HETPLAN_UPDATE_GOLDEN=1 and review the diff"
    )


@pytest.fixture
def golden() -> Callable[[str, str], None]:
    """``golden(name, text)``: ``text`` must equal ``tests/golden/<name>``
    (``HETPLAN_UPDATE_GOLDEN=1`` rewrites the file; review the diff)."""
    return _check_golden
