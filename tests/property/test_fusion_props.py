"""Optimality of the fusion solvers (``hetplan.algorithms.fusion`` and the reference solvers
of ``hetplan.algorithms.fusion_reference``) against brute force.

The reference is independent of the solvers: every one of the 2^(N-1) contiguous partitions is
turned into sync units and timed by the project's simulator (``simulate_dp``), and the least
time is the expectation. Costs are affine (the thesis's Eq. 5.1 model) or arbitrary tables
(any non-negative cost per group, like a profiled lookup with a knee).
"""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from hetplan.algorithms.dp_timeline import simulate_dp
from hetplan.algorithms.dp_types import CPU, GPU, Op, SyncUnit
from hetplan.algorithms.fusion import GroupCost, pareto_dp, tandem_time
from hetplan.algorithms.fusion_reference import all_partitions, alg51, dp_affine

REL = 1e-9


def simulated(backprop, groups, cost, forward=0.0):
    """The simulator's time of ``groups``: compute-stream pre-op, then chain ops on channels
    ``net`` (and ``cpu``) in order."""
    channels = ("net", CPU, "inter")
    units = []
    for i, j in groups:
        c = cost(i, j)
        ops = (Op(GPU, c.pre_s, "pre"),) + tuple(
            Op(channels[k], d, f"c{k}") for k, d in enumerate(c.chain_s))
        units.append(SyncUnit(j, ops))
    return simulate_dp(backprop, units, forward_s=forward).iteration_s


def brute_force(backprop, cost, forward=0.0):
    return min(simulated(backprop, p, cost, forward) for p in all_partitions(len(backprop)))


def close(a, b):
    return math.isclose(a, b, rel_tol=REL, abs_tol=1e-12)


num = st.floats(0.0, 10.0, allow_nan=False, allow_infinity=False)


@st.composite
def affine_instances(draw, max_n=12):
    n = draw(st.integers(1, max_n))
    backprop = draw(st.lists(num, min_size=n, max_size=n))
    sizes = draw(st.lists(st.floats(0.0, 8.0), min_size=n, max_size=n))
    coef = draw(st.lists(st.floats(0.0, 3.0), min_size=4, max_size=4))
    forward = draw(num)
    return backprop, sizes, coef, forward


def affine_cost(sizes, ah, bh, ag, bg):
    pre = [0.0]
    for s in sizes:
        pre.append(pre[-1] + s)
    return lambda i, j: GroupCost(ah + bh * (pre[j + 1] - pre[i]),
                                  (ag + bg * (pre[j + 1] - pre[i]),))


@settings(max_examples=60, deadline=None)
@given(affine_instances())
def test_affine_solvers_match_brute_force_on_the_simulator(inst):
    backprop, sizes, (ah, bh, ag, bg), forward = inst
    cost = affine_cost(sizes, ah, bh, ag, bg)
    best = brute_force(backprop, cost, forward)
    h = lambda i, j: cost(i, j).pre_s  # noqa: E731
    g = lambda i, j: cost(i, j).chain_s[0]  # noqa: E731
    for fusion in (
        dp_affine(backprop, sizes, ah, bh, ag, bg, forward_s=forward),
        pareto_dp(backprop, cost, forward_s=forward),
        alg51(backprop, h, g, forward_s=forward),  # both prunings are exact for affine costs
    ):
        assert close(fusion.time_s, best), fusion
        # the reported time is the simulator's time of the reported groups
        assert close(simulated(backprop, fusion.groups, cost, forward), fusion.time_s)


@st.composite
def table_instances(draw, max_n=12, channels=1):
    n = draw(st.integers(1, max_n))
    backprop = draw(st.lists(num, min_size=n, max_size=n))
    table = {}
    for i in range(n):
        for j in range(i, n):
            pre = draw(num)
            chain = tuple(draw(num) for _ in range(channels))
            table[i, j] = GroupCost(pre, chain)
    return backprop, table, draw(num)


@settings(max_examples=60, deadline=None)
@given(table_instances())
def test_pareto_dp_matches_brute_force_for_arbitrary_table_costs(inst):
    backprop, table, forward = inst
    cost = table.__getitem__
    fusion = pareto_dp(backprop, lambda i, j: cost((i, j)), forward_s=forward)
    best = brute_force(backprop, lambda i, j: cost((i, j)), forward)
    assert close(fusion.time_s, best)
    assert close(simulated(backprop, fusion.groups, lambda i, j: cost((i, j)), forward),
                 fusion.time_s)


@settings(max_examples=40, deadline=None)
@given(table_instances(max_n=9, channels=2))
def test_pareto_dp_with_two_channels_matches_brute_force(inst):
    """GPU pre-op, then the network, then a CPU op (e.g. CPU decompression): a tandem."""
    backprop, table, forward = inst
    cost = lambda i, j: table[i, j]  # noqa: E731
    fusion = pareto_dp(backprop, cost, forward_s=forward)
    assert close(fusion.time_s, brute_force(backprop, cost, forward))


@settings(max_examples=40, deadline=None)
@given(table_instances(max_n=10))
def test_alg51_without_pruning_2_is_exact_for_subadditive_free_tables(inst):
    """With pruning 2 off and pruning 1 off, Algorithm 5.1 is an exhaustive search: exact for
    any costs. (Pruning 1 needs subadditive costs; pruning 2 affine ones: see C5.)"""
    backprop, table, forward = inst
    cost = lambda i, j: table[i, j]  # noqa: E731
    fusion = alg51(backprop, lambda i, j: table[i, j].pre_s, lambda i, j: table[i, j].chain_s[0],
                   forward_s=forward, prune1=False, prune2=False)
    assert close(fusion.time_s, brute_force(backprop, cost, forward))


@settings(max_examples=40, deadline=None)
@given(affine_instances(max_n=10))
def test_tandem_recurrence_equals_the_simulator_for_every_partition(inst):
    backprop, sizes, (ah, bh, ag, bg), forward = inst
    cost = affine_cost(sizes, ah, bh, ag, bg)
    for p in all_partitions(len(backprop)):
        assert close(tandem_time(backprop, p, cost, forward_s=forward),
                     simulated(backprop, p, cost, forward))
