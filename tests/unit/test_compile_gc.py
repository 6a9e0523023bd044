"""``hetplan.compile`` keeps the process's older objects out of the cyclic collector while it
plans (``gc.freeze``) and gives them back after, also when planning fails; a program that
froze objects itself keeps its freeze."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest

import hetplan
from hetplan.errors import SpecError
from hetplan.optimizer import compile as compile_mod


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()


def _spy(monkeypatch: pytest.MonkeyPatch, seen: list[int], fail: bool = False) -> None:
    def fake(*args: Any, **kwargs: Any) -> Any:
        seen.append(gc.get_freeze_count())
        if fail:
            raise SpecError("bad option")
        return "plan"

    monkeypatch.setattr(compile_mod, "_compile", fake)


def test_compile_freezes_older_objects_while_it_plans(
        monkeypatch: pytest.MonkeyPatch, unfrozen: None) -> None:
    seen: list[int] = []
    _spy(monkeypatch, seen)
    assert hetplan.compile("gpt2", "mixed-generations") == "plan"
    assert seen and seen[0] > 0  # the objects made before the call were frozen
    assert gc.get_freeze_count() == 0  # and given back


def test_compile_unfreezes_when_planning_fails(
        monkeypatch: pytest.MonkeyPatch, unfrozen: None) -> None:
    seen: list[int] = []
    _spy(monkeypatch, seen, fail=True)
    with pytest.raises(SpecError, match="bad option"):
        hetplan.compile("gpt2", "mixed-generations")
    assert seen[0] > 0 and gc.get_freeze_count() == 0


def test_compile_leaves_a_programs_own_freeze(
        monkeypatch: pytest.MonkeyPatch, unfrozen: None) -> None:
    seen: list[int] = []
    _spy(monkeypatch, seen)
    gc.freeze()
    mine = gc.get_freeze_count()
    hetplan.compile("gpt2", "mixed-generations")
    assert seen == [mine] and gc.get_freeze_count() == mine


def test_compile_plans_the_same_with_and_without_the_freeze(unfrozen: None) -> None:
    gc.freeze()  # compile then leaves the collector as it is
    held = hetplan.compile("gpt2", "a100-nvlink-8x8", batch_size=64).to_json()
    gc.unfreeze()
    assert hetplan.compile("gpt2", "a100-nvlink-8x8", batch_size=64).to_json() == held
