"""Reference fusion solvers: kept for differential tests and the bench, called by no pass.

The ``cupcake-fusion`` pass solves the fusion problem of :mod:`hetplan.algorithms.fusion`
(same problem, recurrence, :class:`~hetplan.algorithms.fusion.GroupCost` and
:class:`~hetplan.algorithms.fusion.Fusion`) with :func:`~hetplan.algorithms.fusion.
pareto_dp_table`. The solvers here are independent ways to the same answer under narrower
conditions; the tests hold the pass's solver against them (``tests/unit/test_fusion.py``,
``tests/unit/test_fusion_tables.py``, ``tests/property/test_fusion_props.py``), and
``bench/fusion.py`` times them beside the thesis's reported numbers (Table 5.1):

- :func:`all_partitions` — brute force: every one of the ``2^(N-1)`` partitions.
- :func:`thesis_time` — Eq. 5.1 through the §A3 timeline: compression ``h`` on the compute
  stream, communication ``g`` on one channel (the tandem recurrence with ``C = 1``).
- :func:`alg51` — Algorithm 5.1 as the thesis intends it, with the listing's defects fixed
  (§A6.2 D1–D7): branch and bound over the first group, pruning 1 (the "optimistic outcome"
  lower bound, Eq. 5.4, plus the forward time the listing omits) and pruning 2 (skip
  first-group ends before ``j*``, Eq. 5.5 with ``M.delay``). Exponential in the worst case.
  **Pruning 2 is exact only for affine** ``h`` and ``g`` (``α + β·bytes``): with the measured
  "constant below a threshold, then linear" compression cost it can cut off the optimum
  (case C5: 126.8 instead of 126). Pruning 1 needs subadditive ``h`` and ``g``. Both can be
  switched off for the Table 5.1 ablation. It keeps the first strategy it finds at the least
  time (strict ``<``, as the listing).
- :func:`dp_affine` — exact O(N³) DP for the thesis's affine costs (§A9.1): the compute
  finish of a prefix depends only on (tensors, groups), so the least channel finish per
  (tensors, groups) is all the future needs. Vectorised with numpy. Ties: the least time,
  then the fewest groups, then the smallest predecessor boundary (as the pass's solver).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence

from hetplan.algorithms.fusion import Fusion, Group, GroupCost, check_backprop, tandem_time

__all__ = [
    "all_partitions",
    "thesis_time",
    "alg51",
    "dp_affine",
    "SearchBudgetExceeded",
]


class SearchBudgetExceeded(RuntimeError):
    """:func:`alg51` made more recursive calls than ``max_calls`` allowed."""


def all_partitions(n: int) -> Iterator[tuple[Group, ...]]:
    """Every partition of ``0..n-1`` into contiguous groups (``2^(n-1)`` of them), the
    single group first. For brute force in tests and benchmarks."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    for mask in range(2 ** (n - 1)):
        groups, start = [], 0
        for i in range(n - 1):
            if mask >> i & 1:
                groups.append((start, i))
                start = i + 1
        groups.append((start, n - 1))
        yield tuple(groups)


def thesis_time(
    backprop_s: Sequence[float],
    groups: Sequence[Group],
    h: Callable[[int, int], float],
    g: Callable[[int, int], float],
    *,
    forward_s: float = 0.0,
) -> float:
    """Eq. 5.1 through the §A3 timeline: compression ``h(i, j)`` on the compute stream,
    communication ``g(i, j)`` on one channel. ``A`` is ``forward_s``."""
    return tandem_time(backprop_s, groups, lambda i, j: GroupCost(h(i, j), (g(i, j),)),
                       forward_s=forward_s)


# -- Algorithm 5.1 ---------------------------------------------------------------------------
def alg51(
    backprop_s: Sequence[float],
    h: Callable[[int, int], float],
    g: Callable[[int, int], float],
    *,
    forward_s: float = 0.0,
    prune1: bool = True,
    prune2: bool = True,
    bootstrap: bool = True,
    max_calls: int | None = None,
) -> Fusion:
    """Algorithm 5.1 (thesis §5.3.2) with the listing's defects fixed (§A6.2).

    Fixes: D1 ``local_opt_time`` (not ``local_opt_fuse_time``); D2 base case ``k = N``
    returns no groups; D3 ``M.comp`` and ``M.delay`` are carried down the recursion from the
    timeline of ``M``; D4 ``Main`` is ``FindOptFusion({}, 0)``, so the first group is pruned
    too (``M.comp = M.delay = 0``); D5 the incumbent is seeded with two equal groups (the
    thesis's suggested bootstrap) and updated by every evaluated strategy, including
    "the rest as one group"; D6 the bound adds the forward time ``A`` and empty ranges cost 0;
    D7 strict ``<`` keeps the first strategy found at the least time.

    Args:
        backprop_s: ``B(T_i)`` per tensor, in backward-ready order.
        h / g: compression and communication time of the group ``(i, j)``.
        forward_s: ``A``.
        prune1 / prune2: the two pruning techniques (§A4, §A5). Pruning 2 is exact only for
            affine ``h`` and ``g``; pruning 1 needs them subadditive.
        bootstrap: seed the incumbent with two equal groups.
        max_calls: raise :class:`SearchBudgetExceeded` after this many recursive calls.

    Returns:
        The best strategy found (optimal under the conditions above). O(2^N) worst case.
    """
    check_backprop(backprop_s)
    n = len(backprop_s)
    prefix = [0.0]
    for b in backprop_s:
        prefix.append(prefix[-1] + b)

    def bsum(i: int, j: int) -> float:
        return prefix[j + 1] - prefix[i] if i <= j else 0.0

    def hh(i: int, j: int) -> float:
        return h(i, j) if i <= j else 0.0

    def gg(i: int, j: int) -> float:
        return g(i, j) if i <= j else 0.0

    def f(groups: Sequence[Group]) -> float:
        return thesis_time(backprop_s, groups, h, g, forward_s=forward_s)

    best: list[object] = [float("inf"), ()]
    calls = [0]
    if bootstrap and n >= 2:
        seed = ((0, n // 2 - 1), (n // 2, n - 1))
        best[:] = [f(seed), seed]

    def offer(groups: tuple[Group, ...], t: float) -> None:
        if t < best[0]:  # type: ignore[operator]
            best[:] = [t, groups]

    def rec(m: tuple[Group, ...], k: int, comp: float, comm_end: float) -> tuple[Group, ...]:
        calls[0] += 1
        if max_calls is not None and calls[0] > max_calls:
            raise SearchBudgetExceeded(f"Algorithm 5.1 exceeded {max_calls} recursive calls")
        if k == n:
            return ()
        local: tuple[Group, ...] = ((k, n - 1),)
        local_t = f(m + local)
        offer(m + local, local_t)
        delay = comm_end - comp
        jstar = k
        if prune2:
            for i in range(k, n):
                if bsum(k, i) + hh(k, i) <= delay:
                    jstar = i
                else:
                    break
        for i in range(jstar, n):
            if prune1:
                base = bsum(k, n - 1) + hh(k, i) + hh(i + 1, n - 1)
                cases = max(bsum(k, i) + hh(k, i), delay) + gg(k, i) + gg(i + 1, n - 1)
                if forward_s + comp + max(base, cases) > best[0]:  # type: ignore[operator]
                    continue
            if i == n - 1:
                continue  # the single remaining group: already evaluated as ``local``
            new_comp = comp + bsum(k, i) + hh(k, i)
            new_comm = max(new_comp, comm_end) + gg(k, i)
            cur = ((k, i),) + rec(m + ((k, i),), i + 1, new_comp, new_comm)
            t = f(m + cur)
            if t < local_t:
                local, local_t = cur, t
            offer(m + cur, t)
        return local

    rec((), 0, 0.0, 0.0)
    return Fusion(groups=best[1], time_s=best[0], solver="alg51",  # type: ignore[arg-type]
                  calls=calls[0])


# -- the exact affine DP ---------------------------------------------------------------------
def dp_affine(
    backprop_s: Sequence[float],
    sizes: Sequence[float],
    alpha_h: float,
    beta_h: float,
    alpha_g: float,
    beta_g: float,
    *,
    forward_s: float = 0.0,
) -> Fusion:
    """Exact fusion for affine costs ``h = α_h + β_h·bytes``, ``g = α_g + β_g·bytes``
    (§A9.1), O(N³) time and O(N²) memory, vectorised over the predecessor boundary.

    ``comp(k, y) = B(0..k-1) + y·α_h + β_h·S(0..k-1)`` depends only on the prefix length ``k``
    and the group count ``y``; ``dp[k][y]`` is the least channel finish of such a prefix::

        dp[j][y] = min_k max(comp(j, y), dp[k][y-1]) + α_g + β_g·S(k..j-1)

    Ties: fewest groups, then the smallest ``k``. The returned time is re-evaluated with
    :func:`tandem_time` (the simulator's order of float additions).
    """
    import numpy as np

    check_backprop(backprop_s)
    n = len(backprop_s)
    if len(sizes) != n:
        raise ValueError(f"{len(sizes)} sizes for {n} tensors")
    if min(alpha_h, beta_h, alpha_g, beta_g) < 0:
        raise ValueError("affine cost coefficients must be >= 0")
    bp = np.concatenate(([0.0], np.cumsum(np.asarray(backprop_s, dtype=float))))
    sz = np.concatenate(([0.0], np.cumsum(np.asarray(sizes, dtype=float))))
    inf = np.inf
    dp = np.full((n + 1, n + 1), inf)  # dp[y, k]: y groups over the first k tensors
    arg = np.zeros((n + 1, n + 1), dtype=np.int64)
    dp[0, 0] = 0.0
    ys = np.arange(1, n + 1, dtype=float)
    buf = np.empty((n, n))
    for j in range(1, n + 1):
        comp = bp[j] + ys[:j] * alpha_h + beta_h * sz[j]  # comp(j, y) for y = 1..j
        g = alpha_g + beta_g * (sz[j] - sz[:j])  # g(k..j-1) for every k < j
        # cand[y-1, k] = max(comp(j, y), dp[y-1, k]) + g[k]; a prefix of k tensors has at
        # most k groups, so rows y-1 >= a only need k >= a: rows in 4 blocks, each from its
        # first row's k on (rows are contiguous: the argmin over k runs along memory)
        for a, b in _row_blocks(j):
            cand = buf[: b - a, : j - a]
            np.maximum(comp[a:b, None], dp[a:b, a:j], out=cand)
            cand += g[None, a:]
            best_k = np.argmin(cand, axis=1)
            dp[a + 1 : b + 1, j] = cand[np.arange(b - a), best_k]
            arg[a + 1 : b + 1, j] = best_k + a
    y = int(np.argmin(dp[1:, n])) + 1
    groups: list[Group] = []
    j = n
    while j > 0:
        k = int(arg[y, j])
        groups.append((k, j - 1))
        j, y = k, y - 1
    groups.reverse()
    cost = _affine_cost(sizes, alpha_h, beta_h, alpha_g, beta_g)
    t = tandem_time(backprop_s, groups, cost, forward_s=forward_s)
    return Fusion(groups=tuple(groups), time_s=t, solver="dp_affine", calls=n * n)


def _row_blocks(j: int, blocks: int = 4) -> list[tuple[int, int]]:
    """``[a, b)`` row ranges splitting ``0..j-1`` into at most ``blocks`` parts."""
    return list(itertools.pairwise(sorted({j * q // blocks for q in range(blocks + 1)})))


def _affine_cost(
    sizes: Sequence[float], alpha_h: float, beta_h: float, alpha_g: float, beta_g: float
) -> Callable[[int, int], GroupCost]:
    pre = [0.0]
    for s in sizes:
        pre.append(pre[-1] + s)

    def cost(i: int, j: int) -> GroupCost:
        x = pre[j + 1] - pre[i]
        return GroupCost(alpha_h + beta_h * x, (alpha_g + beta_g * x,))

    return cost
