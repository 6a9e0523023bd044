"""The stop at the lower bound (``select(floor=...)``, the pass's ``bound_within``).

A strategy at or below the floor is final: the best seed, if there, is returned after one
sweep that sends its tensors back to the baseline where that costs nothing; the first sweep
stops once it reaches the floor; the sweep from a seed is not run then. Where the floor is
never reached the selection is the one without it, evaluations included. The pass sets the
floor at its lower bound times ``1 + bound_within`` and stops widening its rungs there.
Measured on the bench's 36 cases in ``docs/decisions/espresso-speed.md``, "Round 9".
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hetplan.algorithms.dp_types import Op
from hetplan.algorithms.espresso import SelectionProblem, select
from hetplan.errors import SpecError
from hetplan.passes.espresso import Espresso

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "property"))
from test_espresso_mp_props import _setup, _time  # noqa: E402
from test_espresso_parallel import _KEYS, _problem  # noqa: E402  (the random problems)

def _sel(seed: int, floor: float, parallel: bool = False,
         start: list[str] | None = None) -> tuple[tuple[str, ...], float, str, int]:
    n = 7
    s = select(_problem(seed, n), exhaustive_limit=0, seeds=[[k] * n for k in _KEYS[1:]],
               screen=2, seed_within=0.1, floor=floor, parallel=parallel, start=start)
    return s.strategy, s.iteration_s, s.method, s.evaluations


@pytest.mark.parametrize("seed", range(30))
def test_a_floor_never_reached_changes_nothing(seed: int) -> None:
    """Below everything the search holds (half the result), the selection is the one
    without a floor: strategy, time, method and evaluations."""
    plain = _sel(seed, 0.0)
    assert _sel(seed, plain[1] * 0.5) == plain


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("above", [1.0, 1.02, 1.1, 1.5])
def test_the_result_is_the_plain_one_or_at_the_floor(seed: int, above: float) -> None:
    """Whatever the floor, the result is the one without it or a strategy at or below it,
    and with the seed's sweep on a second thread it is the same."""
    plain = _sel(seed, 0.0)
    floor = plain[1] * above
    got = _sel(seed, floor)
    assert got[:3] == plain[:3] or (got[1] <= floor and "(at the floor)" in got[2])
    assert _sel(seed, floor, parallel=True) == got


def test_a_seed_at_the_floor_is_final_and_keeps_only_what_pays() -> None:
    """Two tensors whose sync hides behind a long backprop and a last one that does not:
    the uniform seed ``a`` is at the floor, but only the last tensor's compression pays,
    so the others go back to the baseline (ties keep the baseline); no sweep runs."""
    ops = {"base": (Op("net", 1.0),), "a": (Op("net", 0.5),)}
    problem: SelectionProblem[str] = SelectionProblem(
        backprop_s=[0.0, 5.0, 5.0], sizes=[1, 2, 3], baseline=["base"] * 3,
        gpu_options=[["a"]] * 3, ops=lambda i, k: ops[k], compressed=lambda k: k != "base")
    seeds = [["a"] * 3]
    plain = select(problem, exhaustive_limit=0, seeds=seeds)
    floored = select(problem, exhaustive_limit=0, seeds=seeds, floor=10.5)
    assert floored.strategy == ("base", "base", "a") == plain.strategy
    assert floored.iteration_s == plain.iteration_s == 10.5
    assert floored.method == "seed 0 (at the floor)"


def test_a_start_at_the_floor_is_returned_without_a_change() -> None:
    n = 7
    plain = _sel(3, 0.0)
    start = list(plain[0])
    got = _sel(3, plain[1] * 1.05 + 1.0, start=start)  # the seeds are above this floor
    assert got[0] == tuple(start)
    assert "(at the floor)" in got[2] or got[2] == "the narrower choice"
    assert len(start) == n


def test_the_pass_stops_at_its_lower_bound_only_within_bound_within() -> None:
    """A group whose sync hides behind backprop (50 ms gaps, small tensors): the best
    uniform seed is within 0.1 % of the lower bound, so the pass stops at rung 0 with it;
    the plan is no slower than the full ladder's. A communication-bound group (large
    tensors, 0.1 ms gaps) never reaches the floor: the same plan either way."""
    ctx, plan = _setup([600_000, 600_000, 600_000, 3_000], [0, 50_000, 50_000, 50_000])
    stopped = Espresso(compressors=("dgc", "fp16")).run(plan, ctx)
    assert "(at the floor)" in stopped.notes[-1]
    full = Espresso(compressors=("dgc", "fp16"), bound_within=0.0)
    assert "(at the floor)" not in full.run(plan, ctx).notes[-1]
    assert _time(ctx, plan, Espresso(compressors=("dgc", "fp16"))) <= _time(ctx, plan, full)

    ctx, plan = _setup([9_000_000, 2_400_000, 600_000, 60_000], [0, 100, 100, 100])
    got = Espresso(compressors=("dgc", "fp16")).run(plan, ctx)
    assert "(at the floor)" not in got.notes[-1]
    assert got.plan == full.run(plan, ctx).plan


def test_bad_settings_are_refused() -> None:
    with pytest.raises(SpecError, match="bound_within=-0.1"):
        Espresso(compressors=("dgc",), bound_within=-0.1)
    with pytest.raises(ValueError, match="floor must be >= 0"):
        select(_problem(0), floor=-1.0)
