"""``partition_bound`` (the search's pipeline lower bound with whole layers) against a brute
force over every cut of the layers into at most ``pp`` contiguous stages: never above the
true minimum of ``max_k (prefix_k + m · t_k)``, within ``1e-9`` of it, and never below the
continuous bound ``T / (1 - (1 - 1/m)^pp)``."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from hetplan.optimizer.bounds import partition_bound


def _brute(times: list[float], pp: int, m: int) -> float:
    n = len(times)
    best = float("inf")
    for k in range(1, min(pp, n) + 1):
        for cuts in itertools.combinations(range(1, n), k - 1):
            bounds = [0, *cuts, n]
            prefix, worst = 0.0, 0.0
            for a, b in zip(bounds, bounds[1:]):
                t = sum(times[a:b])
                worst = max(worst, prefix + m * t)
                prefix += t
            best = min(best, worst)
    return best


@settings(max_examples=200, deadline=None)
@given(times=st.lists(st.floats(0.0, 10.0, allow_nan=False), min_size=1, max_size=8),
       pp=st.integers(1, 5), m=st.integers(1, 12))
def test_matches_brute_force(times: list[float], pp: int, m: int) -> None:
    pp = min(pp, len(times))
    m = max(m, pp)
    got = partition_bound(times, pp, m)
    want = _brute(times, pp, m)
    total = sum(times)
    continuous = total / (1.0 - (1.0 - 1.0 / m) ** pp)
    assert got <= want * (1 + 1e-12) + 1e-12
    assert got >= want * (1 - 1e-9) - 1e-12
    assert got >= continuous * (1 - 1e-12) - 1e-12


def test_whole_layers_raise_the_bound() -> None:
    # 4 equal layers on 3 stages: one stage holds 2 layers, so m · 2 bounds from below
    times = [1.0] * 4
    assert partition_bound(times, 3, 8) >= 16.0 * (1 - 1e-9)
    assert partition_bound(times, 3, 8) > 4.0 / (1.0 - (1.0 - 1.0 / 8) ** 3)
