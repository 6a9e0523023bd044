"""Properties of the exact pipeline partitioner (``hetplan.algorithms.partition``).

Expectations come from an independent brute force over every set of cut points, and from the
greedy and uniform baselines (the exact solver must never be worse than either).
"""

from __future__ import annotations

import itertools
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from hetplan.algorithms.partition import (
    greedy_partition,
    min_max_partition,
    stage_loads,
    uniform_partition,
)
from hetplan.errors import InfeasiblePlanError

EPS = 1e-9


def brute_force(cost, send, mem, cap, p):
    """Smallest bottleneck over every non-empty contiguous partition (None: none fits)."""
    n = len(cost[0])
    best = None
    for cuts in itertools.combinations(range(1, n), p - 1):
        edges = (0, *cuts, n)
        worst = 0.0
        ok = True
        for s in range(p):
            i, j = edges[s], edges[s + 1] - 1
            load = sum(cost[s][i : j + 1]) + (send[s][j] if s < p - 1 else 0.0)
            if mem is not None and sum(mem[s][i : j + 1]) > cap[s]:
                ok = False
                break
            worst = max(worst, load)
        if ok and (best is None or worst < best):
            best = worst
    return best


@st.composite
def instances(draw, with_mem: bool):
    n = draw(st.integers(1, 7))
    p = draw(st.integers(1, n))
    val = st.floats(0, 10, allow_nan=False, allow_infinity=False)
    cost = [draw(st.lists(val, min_size=n, max_size=n)) for _ in range(p)]
    send = [draw(st.lists(st.floats(0, 3), min_size=n, max_size=n)) for _ in range(p)]
    mem = cap = None
    if with_mem:
        mem = [draw(st.lists(st.integers(0, 5), min_size=n, max_size=n)) for _ in range(p)]
        cap = draw(st.lists(st.integers(0, 15), min_size=p, max_size=p))
    return cost, send, mem, cap, p


@settings(max_examples=300, deadline=None)
@given(instances(with_mem=False))
def test_equals_brute_force_heterogeneous_with_transfers(inst) -> None:
    cost, send, _, _, p = inst
    part = min_max_partition(cost, p, send=send)
    assert math.isclose(part.bottleneck, brute_force(cost, send, None, None, p),
                        rel_tol=1e-9, abs_tol=EPS)
    assert stage_loads(part.bounds, cost, send=send) == part.loads


@settings(max_examples=300, deadline=None)
@given(instances(with_mem=True))
def test_equals_brute_force_with_memory_caps(inst) -> None:
    cost, send, mem, cap, p = inst
    expected = brute_force(cost, send, mem, cap, p)
    try:
        part = min_max_partition(cost, p, send=send, mem=mem, mem_cap=cap)
    except InfeasiblePlanError:
        assert expected is None
        return
    assert expected is not None
    assert math.isclose(part.bottleneck, expected, rel_tol=1e-9, abs_tol=EPS)
    for s, (i, j) in enumerate(part.bounds):
        assert sum(mem[s][i : j + 1]) <= cap[s]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 100), min_size=1, max_size=40), st.integers(1, 12),
       st.lists(st.floats(0.25, 4), min_size=12, max_size=12))
def test_never_worse_than_greedy_or_uniform(weights, p, speeds) -> None:
    p = min(p, len(weights))
    cost = [[w / v for w in weights] for v in speeds[:p]]
    part = min_max_partition(cost, p)
    assert part.bottleneck <= greedy_partition(cost, p).bottleneck + EPS
    uni = max(stage_loads(uniform_partition(len(weights), p), cost))
    assert part.bottleneck <= uni + EPS
    # contiguous, non-empty, covering every layer
    assert [b[0] for b in part.bounds] == [0] + [b[1] + 1 for b in part.bounds[:-1]]
    assert part.bounds[-1][1] == len(weights) - 1


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 20), min_size=2, max_size=30), st.integers(1, 8))
def test_deterministic(weights, p) -> None:
    p = min(p, len(weights))
    assert min_max_partition(weights, p) == min_max_partition(list(weights), p)
