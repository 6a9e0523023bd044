"""Fusion solvers on the worked cases C1–C6 of ``research/cupcake_gemini.md`` Part C.

Expected values are the digest's (derived by hand / brute force with exact rationals from the
thesis timeline) and are re-checked here against the project's simulator.
"""

from __future__ import annotations

import pytest

from hetplan.algorithms.dp_timeline import simulate_dp
from hetplan.algorithms.dp_types import GPU, Op, SyncUnit
from hetplan.algorithms.fusion import GroupCost, pareto_dp, tandem_time
from hetplan.algorithms.fusion_reference import all_partitions, alg51, dp_affine, thesis_time


def affine(sizes, a, b):
    pre = [0.0]
    for s in sizes:
        pre.append(pre[-1] + s)
    return lambda i, j: a + b * (pre[j + 1] - pre[i])


def sim(backprop, groups, h, g):
    units = [SyncUnit(j, (Op(GPU, h(i, j)), Op("net", g(i, j)))) for i, j in groups]
    return simulate_dp(backprop, units).iteration_s


def cost_of(h, g):
    return lambda i, j: GroupCost(h(i, j), (g(i, j),))


def test_c1_fused_encode_is_paid_once_below_the_knee():
    """C1: ten 128 KB tensors, DGC encode 0.4 ms, constant below 4 MB."""
    kb = 1024
    sizes = [128 * kb] * 10
    pre = [0.0]
    for s in sizes:
        pre.append(pre[-1] + s)
    knee = 4 * 2**20
    h = lambda i, j: 0.4e-3 * max(1.0, (pre[j + 1] - pre[i]) / knee)  # noqa: E731
    layer_wise = sum(h(i, i) for i in range(10))
    assert layer_wise == pytest.approx(4.0e-3)
    assert h(0, 9) == pytest.approx(0.4e-3)
    # with zero backprop and free communication the solver fuses everything
    f = pareto_dp([0.0] * 10, cost_of(h, lambda i, j: 0.0))
    assert f.groups == ((0, 9),)
    assert f.time_s == pytest.approx(0.4e-3)


def test_c2_layer_wise_compression_can_be_slower_than_fp32():
    """C2 (qualitative, thesis §5.2.3): 161 tensors, 48 ms of compute, fp32 communication
    overhead ~56 ms; DGC layer-wise pays > 60 ms of compression, so layer-wise DGC is
    predicted slower than fp32, and the optimal fusion beats both."""
    n = 161
    backprop = [48e-3 / n] * n
    fp32_g = lambda i, j: 104e-3 / n * (j - i + 1)  # noqa: E731 (comm exceeds compute)
    dgc_h = lambda i, j: 0.4e-3  # noqa: E731 (each encode >= 0.25 ms, ~64 ms in all)
    dgc_g = lambda i, j: 5e-5 + 0.02 * fp32_g(i, j)  # noqa: E731
    layer = tuple((i, i) for i in range(n))
    fp32 = sim(backprop, layer, lambda i, j: 0.0, fp32_g)
    dgc_layer = sim(backprop, layer, dgc_h, dgc_g)
    assert dgc_layer >= fp32
    best = pareto_dp(backprop, cost_of(dgc_h, dgc_g))
    # simulated iteration times from the fixed costs above (no clock is read)
    assert best.time_s < min(fp32, dgc_layer)


C3 = dict(B=[1, 2, 3, 2, 1], x=[4, 2, 2, 1, 1], h=(2, 0.25), g=(1, 0.5))


def test_c3_five_tensors_unique_optimum_and_ranking():
    B, x = C3["B"], C3["x"]
    h, g = affine(x, *C3["h"]), affine(x, *C3["g"])
    assert [h(i, i) for i in range(5)] == [3, 2.5, 2.5, 2.25, 2.25]
    assert sim(B, ((0, 2), (3, 4)), h, g) == 17.5
    assert sim(B, tuple((i, i) for i in range(5)), h, g) == 23.0
    assert sim(B, ((0, 4),), h, g) == 19.5
    times = sorted(sim(B, p, h, g) for p in all_partitions(5))
    assert times[:2] == [17.5, 18.5]
    for f in (alg51(B, h, g), dp_affine(B, x, *C3["h"], *C3["g"]), pareto_dp(B, cost_of(h, g))):
        assert f.groups == ((0, 2), (3, 4)) and f.time_s == 17.5


def test_c3_pruning_1_bounds_are_lower_bounds_and_prune_x0():
    """Eq. 5.4 for x_0 = (0, i-1): bound 15.5, 15.5, 17, 19.25, 19.5 (digest), each at most
    the exact best completion, and x_0=(0,3), (0,4) are pruned once 17.5 is known."""
    B, x = C3["B"], C3["x"]
    h, g = affine(x, *C3["h"]), affine(x, *C3["g"])
    n = 5

    def hh(i, j):
        return h(i, j) if i <= j else 0.0

    def gg(i, j):
        return g(i, j) if i <= j else 0.0

    bounds, exact = [], []
    for i in range(1, n + 1):
        bounds.append(max(sum(B) + hh(0, i - 1) + hh(i, n - 1),
                          sum(B[:i]) + hh(0, i - 1) + gg(0, i - 1) + gg(i, n - 1)))
        exact.append(min(sim(B, p, h, g) for p in all_partitions(n) if p[0] == (0, i - 1)))
    assert bounds == [15.5, 15.5, 17.0, 19.25, 19.5]
    assert exact == [19.25, 18.5, 17.5, 19.25, 19.5]
    assert all(b <= e for b, e in zip(bounds, exact))
    assert [b > 17.5 for b in bounds] == [False, False, False, True, True]
    # pruning saves recursive calls relative to the exhaustive search
    full = alg51(B, h, g, prune1=False, prune2=False, bootstrap=False)
    pruned = alg51(B, h, g)
    assert pruned.calls < full.calls and full.time_s == pruned.time_s == 17.5


def test_c4_pruning_2_skips_short_second_groups():
    B, x = [1] * 5, [8, 1, 1, 1, 1]
    h, g = affine(x, 1, 1 / 8), affine(x, 1, 1)
    assert sim(B, ((0, 0), (1, 4)), h, g) == 17
    assert sim(B, ((0, 0), (1, 1), (2, 4)), h, g) == 18
    assert sim(B, tuple((i, i) for i in range(5)), h, g) == 20
    assert sim(B, ((0, 4),), h, g) == 20.5
    with2 = alg51(B, h, g, prune1=False)
    without = alg51(B, h, g, prune1=False, prune2=False)
    assert with2.groups == without.groups == ((0, 0), (1, 4))
    assert with2.time_s == 17
    assert with2.calls < without.calls


C5 = dict(B=[6, 2, 7, 9, 10, 3, 2, 7], x=[10, 8, 1, 7, 9, 2, 8, 7])


def c5_costs():
    pre = [0.0]
    for s in C5["x"]:
        pre.append(pre[-1] + s)
    h = lambda i, j: max(8.0, pre[j + 1] - pre[i])  # noqa: E731
    g = lambda i, j: 7 + 1.4 * (pre[j + 1] - pre[i])  # noqa: E731
    return h, g


def test_c5_pruning_2_is_inexact_with_a_knee_shaped_compression_cost():
    """The documented failure: with h = max(8, X) pruning 2 cuts off the optimum."""
    B = C5["B"]
    h, g = c5_costs()
    best = min(sim(B, p, h, g) for p in all_partitions(8))
    assert best == pytest.approx(126)
    assert sim(B, ((0, 0), (1, 1), (2, 3), (4, 5), (6, 7)), h, g) == pytest.approx(126)
    thesis = alg51(B, h, g)
    assert thesis.groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert thesis.time_s == pytest.approx(126.8)
    assert alg51(B, h, g, prune2=False).time_s == pytest.approx(126)
    exact = pareto_dp(B, cost_of(h, g))
    assert exact.groups == ((0, 0), (1, 1), (2, 3), (4, 5), (6, 7))
    assert exact.time_s == pytest.approx(126)


def test_c6_ties_give_the_fewest_groups_deterministically():
    """C6: three strategies reach 17.5; (0,2)(3,4) has the fewest groups."""
    B, x = [2] * 5, [1] * 5
    h, g = affine(x, 1, 0.5), affine(x, 1, 1)
    opt = [p for p in all_partitions(5) if sim(B, p, h, g) == 17.5]
    assert sorted(opt) == sorted([((0, 2), (3, 4)), ((0, 1), (2, 3), (4, 4)),
                                  ((0, 2), (3, 3), (4, 4))])
    for _ in range(2):
        assert dp_affine(B, x, 1, 0.5, 1, 1).groups == ((0, 2), (3, 4))
        assert pareto_dp(B, cost_of(h, g)).groups == ((0, 2), (3, 4))
    assert alg51(B, h, g).time_s == 17.5


def test_one_tensor_and_zero_sized_tensors():
    assert pareto_dp([3.0], lambda i, j: GroupCost(1.0, (2.0,))).groups == ((0, 0),)
    assert dp_affine([3.0], [0.0], 1, 1, 1, 1).time_s == 5.0  # 3 + α_h + α_g
    assert alg51([3.0], lambda i, j: 1.0, lambda i, j: 2.0).groups == ((0, 0),)
    # zero-size tensors with a per-launch latency: fusing them is free, so all fuse
    f = dp_affine([0.0, 0.0, 0.0], [0.0, 0.0, 0.0], 0.0, 0.0, 1.0, 1.0)
    assert f.groups == ((0, 2),) and f.time_s == 1.0


def test_forbidden_groups_are_respected():
    """Tensors 0-1 and 2-3 use different strategies: no group may span 1..2."""
    cost = lambda i, j: None if i <= 1 < j else GroupCost(0.0, (1.0,))  # noqa: E731
    f = pareto_dp([1.0] * 4, cost)
    assert f.groups == ((0, 1), (2, 3))


def test_bad_input_is_reported():
    with pytest.raises(ValueError, match="at least one"):
        pareto_dp([], lambda i, j: GroupCost(0, (0,)))
    with pytest.raises(ValueError, match=">= 0"):
        dp_affine([-1.0], [1.0], 1, 1, 1, 1)
    with pytest.raises(ValueError, match="every single tensor"):
        pareto_dp([1.0], lambda i, j: None)
    with pytest.raises(ValueError, match="cover"):
        thesis_time([1.0, 1.0], [(0, 0)], lambda i, j: 0, lambda i, j: 0)
    with pytest.raises(ValueError, match="negative"):
        pareto_dp([1.0], lambda i, j: GroupCost(-1.0, (0.0,)))


def test_thesis_time_is_eq_5_1():
    """Eq. 5.1: f = A + ΣB + Σh + Σg − P (P = overlapped communication). For C3's optimum:
    ΣB = 9, Σh = 2.25·... computed directly from the timeline table of the digest."""
    B, x = C3["B"], C3["x"]
    h, g = affine(x, *C3["h"]), affine(x, *C3["g"])
    groups = ((0, 2), (3, 4))
    t = thesis_time(B, groups, h, g, forward_s=1.5)
    # group timelines (10, 10, 15) and (15.5, 15.5, 17.5): no overlap beyond the first comm
    assert t == 1.5 + 17.5
    assert tandem_time(B, groups, cost_of(h, g)) == 17.5
