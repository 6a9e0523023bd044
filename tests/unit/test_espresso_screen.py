"""The candidate screen and the sweep from a nearly-as-fast seed (``hetplan.algorithms.espresso``).

The screen is an approximation the ``espresso`` pass runs with (``screen=3``,
``seed_within=0.1``); its effect on plan quality over the bench's 36 cases is in
``docs/decisions/espresso-speed.md``, "Round 6". Here: what it tries (hand-counted trials),
that it is off by default in ``select``, and that bad settings are refused.
"""

from __future__ import annotations

import random

import pytest

from hetplan.algorithms.dp_types import Op
from hetplan.algorithms.espresso import SelectionProblem, gpu_decisions, select
from hetplan.errors import SpecError
from hetplan.passes.espresso import Espresso

_OPS = {"base": (Op("net", 1.0),), "a": (Op("net", 1.5),), "b": (Op("net", 1.6),),
        "c": (Op("net", 1.7),), "fast": (Op("net", 0.2),)}


def _problem(options: list[str], n: int = 4) -> SelectionProblem[str]:
    return SelectionProblem(
        backprop_s=[0.1] * n, sizes=[1] * n, baseline=["base"] * n,
        gpu_options=[options] * n, ops=lambda i, k: _OPS[k],
        compressed=lambda k: k != "base", ops_class=[1.0] * n)


def _trials(problem: SelectionProblem[str], screen: int) -> tuple[int, list[str]]:
    before = problem.evaluations
    strategy, _ = gpu_decisions(problem, prune=False, screen=screen)
    return problem.evaluations - before - 1, strategy  # less the session's base run


def test_screened_tensors_try_only_what_their_class_holds() -> None:
    """Four tensors of one class, three slower options each, none taken: without the
    screen every tensor tries all three (12 trials); with ``screen=1`` only the first
    reached does (3), the others have nothing their class holds but their own option."""
    assert _trials(_problem(["a", "b", "c"]), screen=0) == (12, ["base"] * 4)
    assert _trials(_problem(["a", "b", "c"]), screen=1) == (3, ["base"] * 4)
    assert _trials(_problem(["a", "b", "c"]), screen=4) == (12, ["base"] * 4)


def test_an_option_taken_in_the_sweep_is_tried_by_the_rest_of_its_class() -> None:
    """The first tensor reached (the latest ready) takes ``fast``; each later one then tries
    ``fast`` alone (not ``a``, ``b``, ``c``) and takes it too: 4 + 3 trials, where the
    unscreened sweep runs 4 per tensor (each sweep also re-runs its base once per change:
    4 more simulations)."""
    n_screened, screened = _trials(_problem(["a", "b", "c", "fast"]), screen=1)
    n_full, full = _trials(_problem(["a", "b", "c", "fast"]), screen=0)
    assert screened == full == ["fast"] * 4
    assert (n_screened, n_full) == (4 + 3 + 4, 16 + 4)


def test_select_is_unscreened_by_default() -> None:
    p = _problem(["a", "b", "c"])
    default = select(p, exhaustive_limit=0)
    q = _problem(["a", "b", "c"])
    explicit = select(q, exhaustive_limit=0, screen=0, seed_within=0.0)
    assert (default.strategy, default.evaluations) == (explicit.strategy, explicit.evaluations)


@pytest.mark.parametrize("seed", range(8))
def test_sweeping_a_nearly_as_fast_seed_never_returns_slower(seed: int) -> None:
    """``seed_within`` adds a sweep from the best seed and keeps the better result: on the
    same problem it is never slower than without it."""
    rng = random.Random(seed)
    n = 6
    table = {k: tuple(Op(r, rng.uniform(0.1, 2.0)) for r in rng.sample(["net", "gpu", "cpu"],
                                                                        rng.randint(1, 3)))
             for k in ("p", "q", "r")}
    table["base"] = (Op("net", 1.5),)

    def make() -> SelectionProblem[str]:
        return SelectionProblem(
            backprop_s=[rng_bp[i] for i in range(n)], sizes=[1] * n, baseline=["base"] * n,
            gpu_options=[["p", "q", "r"]] * n, ops=lambda i, k: table[k],
            compressed=lambda k: k != "base", ops_class=[1.0] * n)

    rng_bp = [rng.uniform(0.0, 1.0) for _ in range(n)]
    seeds = [[k] * n for k in ("p", "q", "r")]
    plain = select(make(), exhaustive_limit=0, seeds=seeds, screen=2)
    wider = select(make(), exhaustive_limit=0, seeds=seeds, screen=2, seed_within=0.5)
    assert wider.iteration_s <= plain.iteration_s + 1e-12


def test_bad_settings_are_refused_with_the_field_named() -> None:
    with pytest.raises(SpecError, match="screen=-1"):
        Espresso(compressors=("dgc",), screen=-1)
    with pytest.raises(SpecError, match="seed_within=-0.5"):
        Espresso(compressors=("dgc",), seed_within=-0.5)
    with pytest.raises(ValueError, match="seed_within must be >= 0"):
        select(_problem(["a"]), seed_within=-1.0)
    with pytest.raises(ValueError, match="screen must be >= 0"):
        gpu_decisions(_problem(["a"]), screen=-1)


@pytest.mark.parametrize("screen", [1, 2])
def test_the_screen_chooses_the_same_with_and_without_the_fast_trials(screen: int) -> None:
    """The screen decides what is tried, not how: the resumable, bounded trials and full
    simulations of every candidate give the same strategy and time."""
    fast = gpu_decisions(_problem(["a", "b", "c", "fast"], n=5), prune=False, screen=screen)
    slow = gpu_decisions(_problem(["a", "b", "c", "fast"], n=5), prune=False, screen=screen,
                         fast=False)
    assert fast == slow
