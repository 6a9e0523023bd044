"""Whether a memory-feasible partition exists does not depend on the costs balanced (the
``dynpipe`` pass stops its partition tries at the first that finds none), and the inlined DP
still returns the optimum of an exhaustive search."""

from __future__ import annotations

import itertools
import random

import pytest

from hetplan.algorithms.partition import min_max_partition, stage_loads
from hetplan.errors import InfeasiblePlanError


def _outcome(cost: list[float], p: int, mem: list[list[float]],
             cap: list[float]) -> tuple[tuple[int, int], ...] | None:
    try:
        return min_max_partition(cost, p, mem=mem, mem_cap=cap).bounds
    except InfeasiblePlanError:
        return None


@pytest.mark.parametrize("seed", range(40))
def test_feasibility_is_the_same_for_any_cost(seed: int) -> None:
    rng = random.Random(seed)
    n, p = rng.randint(2, 9), rng.randint(1, 4)
    if p > n:
        p = n
    mem = [[rng.uniform(0.5, 3.0) for _ in range(n)] for _ in range(p)]
    cap = [rng.uniform(1.0, 2.0 * n / p + 1.0) for _ in range(p)]
    outcomes = [_outcome([rng.uniform(0.0, 5.0) for _ in range(n)], p, mem, cap)
                for _ in range(4)]
    assert len({o is None for o in outcomes}) == 1, outcomes


@pytest.mark.parametrize("seed", range(30))
def test_dp_matches_exhaustive_search(seed: int) -> None:
    rng = random.Random(100 + seed)
    n, p = rng.randint(2, 8), rng.randint(1, 4)
    p = min(p, n)
    cost = [[rng.uniform(0.1, 4.0) for _ in range(n)] for _ in range(p)]
    send = [[rng.uniform(0.0, 1.0) for _ in range(n)] for _ in range(p)]
    best = min(
        max(stage_loads(_bounds(cuts, n), cost, send=send))
        for cuts in itertools.combinations(range(1, n), p - 1)
    )
    got = min_max_partition(cost, p, send=send)
    assert got.bottleneck == pytest.approx(best, rel=1e-12)


def _bounds(cuts: tuple[int, ...], n: int) -> tuple[tuple[int, int], ...]:
    edges = (0, *cuts, n)
    return tuple((a, b - 1) for a, b in zip(edges, edges[1:]))
