"""The fast cost-table path of the fusion pass returns exactly what the per-bucket path did.

``StageSync.ops_table`` (numpy, all bucket sizes at once) must equal ``StageSync.ops`` (one
size at a time, the simulator's path) bit for bit, for every kind of strategy; the pass's
``stage_fusion`` (dense tables + ``pareto_dp_table``) must return the same groups and time as
the reference below, which is the pass's previous code: ``ss.ops`` per bucket and
``pareto_dp`` over a cost callback.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from test_cupcake_pass import setup as cupcake_setup

from hetplan.algorithms.dp_types import GPU, Op
from hetplan.algorithms.espresso_tree import all_options, offloaded
from hetplan.algorithms.fusion import GroupCost, pareto_dp, pareto_dp_table
from hetplan.cost_models.compression import AffineTime, PiecewiseTime, TableTime, time_array
from hetplan.cost_models.evaluate import stage_syncs
from hetplan.ir.plan_sections import CastSync, CompressedSync, NoSync
from hetplan.passes.cupcake import stage_fusion, tandem_shape
from hetplan.passes.espresso import strategy_for


def _ctx(n: int, seed: int, cluster: str = "v100-pcie-8x8"):
    """One stage's sync of the random toy workload of the pass tests, and its context."""
    _, ctx, plan = cupcake_setup(n, seed, cluster)
    return stage_syncs(ctx.workload, ctx.layout, plan.stages, ctx.costs)[0], ctx


SIZES = [0.0, 1.0, 3.0, 1000.0, 4 * 2**20 - 1, 4 * 2**20, 4 * 2**20 + 1, 1e7, 3.3e8]


def _strategies():
    """Every kind of path: fp32 and cast routings, GPU/CPU compression with every tree option
    (a stride through the 4341), each compressor with its own wire ratio (powersgd's depends
    on the size)."""
    opts = all_options()
    out = [NoSync(), CastSync(dtype="fp16"),
           CompressedSync(compressor="dgc", params={"ratio": 0.01}),
           CompressedSync(compressor="powersgd", compress_device="cpu",
                          decompress_device="cpu")]
    for comp in ("dgc", "powersgd", "efsignsgd", "qsgd", "fp16"):
        for oid in range(0, len(opts), 97):
            if any(a.task == "comp" for a in opts[oid]):
                out.append(strategy_for((comp, oid)))
                out.append(strategy_for((comp, int(oid)), ratio=0.05))
    out.append(strategy_for(("dgc", all_options().index(offloaded(opts[200])))))
    return out


@pytest.mark.parametrize("cluster", ["v100-pcie-8x8", "v100-nvlink-8x8"])
def test_ops_table_equals_ops_bit_for_bit(cluster):
    ss, ctx = _ctx(4, 0, cluster)
    rng = random.Random(1)
    sizes = SIZES + [rng.uniform(0, 5e8) for _ in range(40)]
    for st in _strategies():
        resources, table = ss.ops_table(st, sizes, ctx.costs)
        assert table.shape[0] == len(sizes)
        for m, x in enumerate(sizes):
            ops = ss.ops(st, x, ctx.costs)
            assert tuple(op.resource for op in ops) == resources
            assert table[m].tolist() == [op.duration_s for op in ops], (st, x)


def test_ops_table_rejects_bad_sizes():
    ss, ctx = _ctx(3, 0)
    with pytest.raises(ValueError, match="1-D"):
        ss.ops_table(NoSync(), [], ctx.costs)
    with pytest.raises(ValueError, match=">= 0"):
        ss.ops_table(NoSync(), [1.0, -2.0], ctx.costs)


@pytest.mark.parametrize("model", [
    AffineTime(3e-5, 2e-10),
    PiecewiseTime(4e-4, 4 * 2**20, 1e-10),
    TableTime((1e3, 1e6, 1e8), (1e-4, 5e-4, 2e-2)),
    TableTime((1e3, 1e6, 1e8), (1e-4, 5e-4, 4e-4)),  # slope clamped at 0 above the table
    TableTime((1e6,), (2e-3,)),
    TableTime((0.0,), (2e-3,)),
], ids=["affine", "piecewise", "table", "table-flat", "table-1pt", "table-1pt-zero"])
def test_time_array_equals_the_model(model):
    rng = random.Random(2)
    xs = [0.0, -1.0, 1.0, 1e3, 1e6, 1e8, 4 * 2**20, 2e8] + [10 ** rng.uniform(0, 9)
                                                           for _ in range(200)]
    assert time_array(model, xs).tolist() == [model(x) for x in xs]


def test_time_array_calls_any_other_model():
    def model(x: float) -> float:
        return math.sqrt(x) * 1e-6

    assert time_array(model, [4.0, 9.0]).tolist() == [2e-6, 3e-6]


def _reference(ss, keys, strategies, ctx, max_group=None):
    """The pass's previous code: every bucket's ops from ``ss.ops``, ``pareto_dp`` on a
    callback."""
    n = len(ss.grads)
    prefix = [0.0]
    for b in ss.nbytes:
        prefix.append(prefix[-1] + b)
    ops: dict[tuple[int, int], tuple[Op, ...]] = {}
    for i in range(n):
        last = n if max_group is None else min(n, i + max_group)
        for j in range(i, last):
            if keys[j] != keys[i]:
                break
            ops[i, j] = ss.ops(strategies[keys[i]], prefix[j + 1] - prefix[i], ctx.costs)
    resources = {tuple(op.resource for op in o) for o in ops.values()}
    shapes = {tandem_shape(tuple(Op(r, 0.0) for r in res)) for res in resources}
    exact = len(shapes) == 1 and None not in shapes
    if exact:
        table = {}
        for ij, o in ops.items():
            pre, chain = 0.0, []
            for op in o:
                if op.resource == GPU:
                    pre += op.duration_s
                else:
                    chain.append(op.duration_s)
            table[ij] = GroupCost(pre, tuple(chain))

        def cost(i, j):
            return table.get((i, j))
    else:
        def cost(i, j):
            o = ops.get((i, j))
            if o is None:
                return None
            pre = sum(op.duration_s for op in o if op.resource == GPU)
            return GroupCost(pre, (sum(op.duration_s for op in o if op.resource != GPU),))
    return pareto_dp(ss.backprop_s, cost, max_group=max_group), exact


MIXES = {
    "fp32": {"a": NoSync()},
    "fp32+fp16": {"a": NoSync(), "b": CastSync(dtype="fp16")},
    "dgc-gpu": {"a": CompressedSync(compressor="dgc", params={"ratio": 0.01})},
    "dgc-cpu": {"a": CompressedSync(compressor="dgc", params={"ratio": 0.01},
                                    compress_device="cpu", decompress_device="cpu")},
    "tree-paths": {"a": strategy_for(("dgc", 5)), "b": strategy_for(("efsignsgd", 1500)),
                   "c": NoSync()},
}


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("seed", range(4))
def test_stage_fusion_is_the_reference_result(mix, seed):
    strategies = MIXES[mix]
    ss, ctx = _ctx(40, seed, "v100-pcie-8x8" if seed % 2 else "v100-nvlink-8x8")
    rng = random.Random(seed)
    names = sorted(strategies)
    keys, cur = [], rng.choice(names)
    for _ in range(len(ss.grads)):
        if rng.random() < 0.15:
            cur = rng.choice(names)
        keys.append(cur)
    for max_group in (None, 7):
        want, want_exact = _reference(ss, keys, strategies, ctx, max_group)
        got, exact = stage_fusion(ss, keys, strategies, ctx, max_group=max_group)
        assert exact == want_exact
        assert got.groups == want.groups
        assert got.time_s == want.time_s


def test_pareto_dp_table_equals_pareto_dp_on_random_costs():
    rng = random.Random(7)
    for trial in range(30):
        n = rng.randint(1, 14)
        width = rng.choice([1, 1, 2])
        bp = [rng.choice([0.0, rng.uniform(0, 3)]) for _ in range(n)]
        forbid = {(i, j) for i in range(n) for j in range(i + 1, n) if rng.random() < 0.1}
        costs = {(i, j): GroupCost(rng.uniform(0, 2), tuple(rng.uniform(0, 4)
                                                            for _ in range(width)))
                 for i in range(n) for j in range(i, n)}

        def cost(i, j, forbid=forbid, costs=costs):
            if any((i, m) in forbid for m in range(i, j + 1)):
                return None
            return costs[i, j]

        pre = np.full((n, n), np.inf)
        chain = np.full((n, n, width), np.inf)
        for (i, j), c in costs.items():
            if cost(i, j) is not None:
                pre[i, j], chain[i, j] = c.pre_s, c.chain_s
        want = pareto_dp(bp, cost, forward_s=0.5)
        got = pareto_dp_table(bp, pre, chain, forward_s=0.5)
        assert (got.groups, got.time_s) == (want.groups, want.time_s), trial


def test_pareto_dp_table_errors():
    pre = np.zeros((2, 2))
    chain = np.zeros((2, 2, 1))
    with pytest.raises(ValueError, match="shapes"):
        pareto_dp_table([1.0, 1.0, 1.0], pre, chain)
    bad = pre.copy()
    bad[1, 1] = np.inf
    with pytest.raises(ValueError, match=r"group \(1, 1\) is not allowed"):
        pareto_dp_table([1.0, 1.0], bad, chain)
    neg = chain.copy()
    neg[0, 1, 0] = -1.0
    with pytest.raises(ValueError, match=r"group \(0, 1\) has a negative cost"):
        pareto_dp_table([1.0, 1.0], pre, neg)


def _dp_affine_reference(bp_s, sizes, alpha_h, beta_h, alpha_g, beta_g):
    """``dp_affine``'s previous code (one full ``k x y`` candidate matrix per prefix)."""
    n = len(bp_s)
    bp = np.concatenate(([0.0], np.cumsum(np.asarray(bp_s, dtype=float))))
    sz = np.concatenate(([0.0], np.cumsum(np.asarray(sizes, dtype=float))))
    dp = np.full((n + 1, n + 1), np.inf)
    arg = np.zeros((n + 1, n + 1), dtype=np.int64)
    dp[0, 0] = 0.0
    ys = np.arange(1, n + 1, dtype=float)
    for j in range(1, n + 1):
        comp = bp[j] + ys[:j] * alpha_h + beta_h * sz[j]
        g = alpha_g + beta_g * (sz[j] - sz[np.arange(j)])
        cand = np.maximum(comp[None, :], dp[:j, :j]) + g[:, None]
        best_k = np.argmin(cand, axis=0)
        dp[j, 1 : j + 1] = cand[best_k, np.arange(j)]
        arg[j, 1 : j + 1] = best_k
    y = int(np.argmin(dp[n, 1:])) + 1
    groups, j = [], n
    while j > 0:
        k = int(arg[j, y])
        groups.append((k, j - 1))
        j, y = k, y - 1
    return tuple(reversed(groups))


def test_dp_affine_blocks_give_the_reference_groups():
    """Same groups (ties included: many zero and equal costs) as the unblocked DP."""
    from hetplan.algorithms.fusion_reference import dp_affine

    rng = random.Random(11)
    for trial in range(200):
        n = rng.randint(1, 45)
        bp = [rng.choice([0.0, 1.0, rng.uniform(0, 3)]) for _ in range(n)]
        sz = [rng.choice([1.0, 2.0, rng.uniform(0, 1e6)]) for _ in range(n)]
        a = [rng.choice([0.0, 1.0, rng.uniform(0, 2)]) for _ in range(2)]
        b = [rng.choice([0.0, 1e-6, rng.uniform(0, 1e-5)]) for _ in range(2)]
        got = dp_affine(bp, sz, a[0], b[0], a[1], b[1]).groups
        assert got == _dp_affine_reference(bp, sz, a[0], b[0], a[1], b[1]), trial
