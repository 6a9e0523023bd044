"""Static skewed TP shards (algorithms/skewed_shards.py): checked against brute force."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetplan.algorithms.skewed_shards import (
    even_shards,
    proportional_shards,
    shard_granularity,
    shard_time,
)
from hetplan.errors import SpecError


def _brute_best(units: int, g: int, speeds: list[float], least: int = 0) -> float:
    best = float("inf")
    for split in itertools.product(range(least, units + 1), repeat=len(speeds)):
        if sum(split) == units:
            best = min(best, max(u * g / s for u, s in zip(split, speeds)))
    return best


def test_two_to_one_speeds_split_two_to_one() -> None:
    # 768 = 12 units of 64; speeds 2:2:1:1 -> ideal 4,4,2,2 units
    assert proportional_shards(768, [2.0, 2.0, 1.0, 1.0]) == (256, 256, 128, 128)


def test_equal_speeds_give_even_shards() -> None:
    assert proportional_shards(3072, [1.0] * 4) == (768,) * 4


def test_granularity_rule() -> None:
    assert shard_granularity(768, 4) == 64      # 12 units >= 8
    assert shard_granularity(256, 4) == 32      # 64 gives 4 units < 8; 32 gives 8
    assert shard_granularity(24, 2) == 4        # 8 -> 3 units < 4; 4 -> 6 units
    assert shard_granularity(7, 2) == 1


def test_remainder_goes_to_least_loaded_rank() -> None:
    sizes = proportional_shards(10, [1.0, 3.0], granularity=4)  # 2 units + 2 columns
    assert sum(sizes) == 10
    # brute force over all splits of whole columns respecting 4-column units plus one 2-tail
    assert shard_time(sizes, [1.0, 3.0]) == pytest.approx(min(
        max(a / 1.0, (10 - a) / 3.0) for a in (0, 2, 4, 6, 8, 10)))


@settings(max_examples=60, deadline=None)
@given(units=st.integers(1, 9), g=st.sampled_from([1, 8, 64]),
       speeds=st.lists(st.floats(0.2, 5.0), min_size=1, max_size=4))
def test_greedy_matches_brute_force(units: int, g: int, speeds: list[float]) -> None:
    sizes = proportional_shards(units * g, speeds, granularity=g)
    assert sum(sizes) == units * g
    assert all(s % g == 0 for s in sizes)
    assert shard_time(sizes, speeds) == pytest.approx(_brute_best(units, g, speeds))


@settings(max_examples=60, deadline=None)
@given(units=st.integers(1, 9), g=st.sampled_from([16, 128]),
       speeds=st.lists(st.floats(0.05, 5.0), min_size=1, max_size=4))
def test_min_units_gives_every_rank_one_unit_and_stays_optimal(units: int, g: int,
                                                                speeds: list[float]) -> None:
    # attention heads: every rank keeps at least one whole head, however slow
    if units < len(speeds):
        with pytest.raises(SpecError, match="min_units=1"):
            proportional_shards(units * g, speeds, granularity=g, min_units=1)
        return
    sizes = proportional_shards(units * g, speeds, granularity=g, min_units=1)
    assert sum(sizes) == units * g and all(s % g == 0 and s >= g for s in sizes)
    assert shard_time(sizes, speeds) == pytest.approx(_brute_best(units, g, speeds, 1))


def test_a_very_slow_rank_gets_one_unit_with_min_units() -> None:
    assert proportional_shards(512, [10.0, 0.1], granularity=128) == (512, 0)
    assert proportional_shards(512, [10.0, 0.1], granularity=128, min_units=1) == (384, 128)


@settings(max_examples=40, deadline=None)
@given(speeds=st.lists(st.floats(0.2, 5.0), min_size=2, max_size=6))
def test_faster_rank_never_gets_less(speeds: list[float]) -> None:
    sizes = proportional_shards(4096, speeds)
    for i, j in itertools.permutations(range(len(speeds)), 2):
        if speeds[i] > speeds[j]:
            assert sizes[i] >= sizes[j]


@pytest.mark.parametrize("speeds", [[], [1.0, 0.0], [1.0, float("nan")], [-1.0]])
def test_bad_speeds_are_rejected(speeds: list[float]) -> None:
    with pytest.raises(SpecError, match="speed"):
        proportional_shards(64, speeds)


def test_bad_features_rejected() -> None:
    with pytest.raises(SpecError, match="features"):
        proportional_shards(0, [1.0])


def test_even_shards_give_the_remainder_to_the_first_ranks() -> None:
    assert even_shards(18, 4) == (5, 5, 4, 4)
    assert even_shards(3, 4) == (1, 1, 1, 0)


def test_negative_min_units_is_refused_by_name() -> None:
    with pytest.raises(SpecError, match="min_units must be >= 0, got -1"):
        proportional_shards(512, [1.0, 2.0], 64, min_units=-1)
