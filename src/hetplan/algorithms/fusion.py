"""Optimal tensor fusion for gradient sync (Cupcake, thesis ch. 5): pure solvers.

The problem (``research/cupcake_gemini.md`` §A2–§A3): gradient tensors ``0..N-1`` become ready
in backward order; ``backprop_s[i]`` is the backprop compute before tensor ``i`` is ready.
Partition them into contiguous *groups*; each group is one sync unit: compute-stream work
(compression, a cast) right after its last tensor's backprop, then one op on each of a chain
of FIFO channels (communication, CPU work). Minimise the iteration time.

The objective is the project's DP timeline simulator (:func:`hetplan.algorithms.dp_timeline.
simulate_dp`) for units whose ops are *tandem*: zero or more compute-stream ops, then ops on
distinct FIFO channels, in one fixed channel order for all groups. For such units the
simulator reduces to this recurrence (:func:`tandem_time`), which the solvers use::

    comp(a)  = comp(a-1) + backprop of group a's tensors + pre(a)     (one compute stream)
    end_0(a) = max(comp(a), end_0(a-1)) + d_0(a)                      (channel 0, FIFO)
    end_c(a) = max(end_{c-1}(a), end_c(a-1)) + d_c(a)                 (channel c)
    time     = forward + max(comp(last), end_{C-1}(last))

(the compute stream runs a group's pre-ops as soon as its last tensor's backprop ends, ahead
of the remaining backprop; a channel serves ops in the order they become runnable, which is
the group order because ``end_{c-1}`` grows with the group index). The thesis model (Eq. 5.1,
§A3: compression ``h`` on the compute stream, communication ``g`` on one channel) is the case
``C = 1``; :func:`thesis_time` evaluates it from ``h(i, j)`` and ``g(i, j)``.

Solvers:

- :func:`alg51` — Algorithm 5.1 as the thesis intends it, with the listing's defects fixed
  (§A6.2 D1–D7): branch and bound over the first group, pruning 1 (the "optimistic outcome"
  lower bound, Eq. 5.4, plus the forward time the listing omits) and pruning 2 (skip
  first-group ends before ``j*``, Eq. 5.5 with ``M.delay``). Exponential in the worst case.
  **Pruning 2 is exact only for affine** ``h`` and ``g`` (``α + β·bytes``): with the measured
  "constant below a threshold, then linear" compression cost it can cut off the optimum
  (case C5: 126.8 instead of 126). Pruning 1 needs subadditive ``h`` and ``g``. Both can be
  switched off for the Table 5.1 ablation.
- :func:`dp_affine` — exact O(N³) DP for the thesis's affine costs (§A9.1): the compute
  finish of a prefix depends only on (tensors, groups), so the least channel finish per
  (tensors, groups) is all the future needs. Vectorised with numpy.
- :func:`pareto_dp` — exact DP for any non-negative group costs (profiled tables, piecewise,
  several channels; §A9.2): per prefix, the Pareto front of (compute finish, channel
  finishes, groups). The simulator is monotone in each of them, so a dominated prefix never
  completes better.

Ties (decided here; the thesis is silent, §F-7): the least time; then the fewest groups
(both exact in :func:`dp_affine` and :func:`pareto_dp`, because the group count is part of
the state); then the smallest predecessor boundary. :func:`alg51` keeps the first strategy it
finds at the least time (strict ``<``, as the listing).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "Group",
    "GroupCost",
    "Fusion",
    "all_partitions",
    "tandem_time",
    "thesis_time",
    "alg51",
    "dp_affine",
    "pareto_dp",
    "pareto_dp_table",
    "SearchBudgetExceeded",
]

#: A group of consecutive tensors ``(first, last)``, both inclusive.
Group = tuple[int, int]


@dataclass(frozen=True, slots=True)
class GroupCost:
    """One group's sync work: ``pre_s`` on the compute stream, then ``chain_s[c]`` on FIFO
    channel ``c`` (same channel order for every group; a 0 means the op takes no time)."""

    pre_s: float
    chain_s: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class Fusion:
    """A solver's answer: the groups, their predicted time, and how it was found.

    Attributes:
        groups: consecutive ``(first, last)`` tensor ranges covering ``0..N-1``.
        time_s: predicted iteration time (forward + end of the last sync op or backprop).
        solver: ``alg51``, ``dp_affine`` or ``pareto_dp``.
        calls: recursive calls (``alg51``) or states kept (the DPs).
    """

    groups: tuple[Group, ...]
    time_s: float
    solver: str
    calls: int = 0


class SearchBudgetExceeded(RuntimeError):
    """:func:`alg51` made more recursive calls than ``max_calls`` allowed."""


def _check_backprop(backprop_s: Sequence[float]) -> None:
    if not backprop_s:
        raise ValueError("fusion needs at least one gradient tensor (backprop_s is empty)")
    bad = [i for i, b in enumerate(backprop_s) if not b >= 0.0]
    if bad:
        raise ValueError(
            f"backprop_s[{bad[0]}] = {backprop_s[bad[0]]!r}: backprop times must be >= 0"
        )


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


def _check_groups(groups: Sequence[Group], n: int) -> None:
    nxt = 0
    for i, j in groups:
        if i != nxt or j < i:
            raise ValueError(f"groups {list(groups)} are not consecutive ranges covering 0..{n - 1}")
        nxt = j + 1
    if nxt != n:
        raise ValueError(f"groups {list(groups)} do not cover 0..{n - 1}")


def tandem_time(
    backprop_s: Sequence[float],
    groups: Sequence[Group],
    cost: Callable[[int, int], GroupCost],
    *,
    forward_s: float = 0.0,
) -> float:
    """Iteration time of ``groups`` by the tandem recurrence (module docstring); equal to
    :func:`~hetplan.algorithms.dp_timeline.simulate_dp` for tandem units. O(N + G·C)."""
    _check_backprop(backprop_s)
    _check_groups(groups, len(backprop_s))
    comp = 0.0
    ends: list[float] = []
    for i, j in groups:
        for k in range(i, j + 1):
            comp += backprop_s[k]
        c = cost(i, j)
        comp += c.pre_s
        if not ends:
            ends = [0.0] * len(c.chain_s)
        t = comp
        for ch, d in enumerate(c.chain_s):
            t = max(t, ends[ch]) + d
            ends[ch] = t
    return forward_s + max([comp, *ends])


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
    _check_backprop(backprop_s)
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


# -- exact polynomial solvers ----------------------------------------------------------------
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

    _check_backprop(backprop_s)
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


@dataclass(slots=True)
class _State:
    vec: tuple[float, ...]  # (compute finish, channel finishes...)
    groups: int
    prev: _State | None
    start: int  # first tensor of the last group


def pareto_dp(
    backprop_s: Sequence[float],
    cost: Callable[[int, int], GroupCost | None],
    *,
    forward_s: float = 0.0,
    max_group: int | None = None,
) -> Fusion:
    """Exact fusion for any non-negative group costs on tandem units (§A9.2).

    Per prefix length ``k`` the Pareto front of states (compute finish, each channel's
    finish, groups) is kept; extending a state by the group ``(k, j)`` applies the tandem
    recurrence. Every later event is a non-decreasing function of the state, so a state that
    is no smaller in every component never completes strictly better (and the group count is
    in the state, so "fewest groups" among the fastest is exact too).

    Args:
        backprop_s: backprop time before each tensor is ready.
        cost: ``cost(i, j)`` for the group ``i..j``, or ``None`` where that group is not
            allowed (e.g. tensors with different strategies); single-tensor groups must be
            allowed. Every group must have the same number of channels.
        forward_s: added to the time.
        max_group: longest group considered (``None``: no limit).

    Returns:
        The optimal groups. O(N² · F²) for fronts of at most F states.
    """
    import numpy as np

    _check_backprop(backprop_s)
    n = len(backprop_s)
    rows = [_row(cost, k, n if max_group is None else min(n, k + max_group))
            for k in range(n)]
    widths = {len(c.chain_s) for row in rows for c in row}
    if len(widths) != 1:
        raise ValueError(f"groups have {sorted(widths)} channel ops: not one tandem chain")
    (width,) = widths
    pre = np.full((n, n), np.inf)
    chain = np.full((n, n, width), np.inf)
    for k, row in enumerate(rows):
        pre[k, k : k + len(row)] = [c.pre_s for c in row]
        chain[k, k : k + len(row)] = [c.chain_s for c in row]
    return pareto_dp_table(backprop_s, pre, chain, forward_s=forward_s)


def pareto_dp_table(
    backprop_s: Sequence[float],
    pre_s: np.ndarray,
    chain_s: np.ndarray,
    *,
    forward_s: float = 0.0,
) -> Fusion:
    """:func:`pareto_dp` with the group costs as dense tables (the fast path for callers
    that compute every group's cost at once, e.g. with numpy).

    Args:
        backprop_s: backprop time before each tensor is ready (``N`` tensors).
        pre_s: ``N x N``; ``pre_s[i, j]`` is the compute-stream time of the group ``i..j``.
        chain_s: ``N x N x C``; ``chain_s[i, j, c]`` its time on channel ``c``.
            Non-finite entries (``inf``) mark groups that are not allowed; the groups
            allowed from ``i`` are ``i..j`` up to the first non-finite one (a longer group
            contains it). Single-tensor groups must be allowed.

    Returns:
        The same :class:`Fusion` :func:`pareto_dp` returns for the same costs (it builds
        these tables and calls this function).
    """
    import numpy as np

    _check_backprop(backprop_s)
    n = len(backprop_s)
    pre = np.asarray(pre_s, dtype=float)
    chain = np.asarray(chain_s, dtype=float)
    if pre.shape != (n, n) or chain.ndim != 3 or chain.shape[:2] != (n, n):
        raise ValueError(f"cost tables of shapes {pre.shape} and {chain.shape} for {n} tensors: "
                         f"need ({n}, {n}) and ({n}, {n}, channels)")
    ok = np.isfinite(pre) & np.isfinite(chain).all(axis=2)
    ok &= np.triu(np.ones((n, n), dtype=bool))
    row_len = [int(np.argmin(np.append(ok[k, k:], False))) for k in range(n)]
    if 0 in row_len:
        k = row_len.index(0)
        raise ValueError(f"group ({k}, {k}) is not allowed: every single tensor must be a "
                         f"valid group")
    allowed = np.zeros((n, n), dtype=bool)
    for k, m in enumerate(row_len):
        allowed[k, k : k + m] = True
    if (pre[allowed] < 0).any() or (chain[allowed] < 0).any():
        k, j = (int(v[0]) for v in np.nonzero(allowed & ((pre < 0) | (chain < 0).any(axis=2))))
        raise ValueError(f"group ({k}, {j}) has a negative cost {_cost_at(pre, chain, k, j)}")
    pre = np.where(allowed, pre, np.inf)
    chain = np.where(allowed[:, :, None], chain, np.inf)

    def cost(i: int, j: int) -> GroupCost:
        return _cost_at(pre, chain, i, j)

    if chain.shape[2] == 1:
        found = _pareto_2d(backprop_s, pre, chain[:, :, 0], forward_s)
    else:
        rows = [[cost(k, j) for j in range(k, k + m)] for k, m in enumerate(row_len)]
        found = _pareto_nd(backprop_s, rows, forward_s)
    return _merge_ties(backprop_s, found, cost, row_len, forward_s)


def _cost_at(pre: np.ndarray, chain: np.ndarray, i: int, j: int) -> GroupCost:
    return GroupCost(float(pre[i, j]), tuple(float(d) for d in chain[i, j]))


def _pareto_nd(
    backprop_s: Sequence[float], rows: list[list[GroupCost]], forward_s: float
) -> Fusion:
    """:func:`pareto_dp` for several channels: explicit fronts of :class:`_State`."""
    n = len(backprop_s)
    fronts: list[list[_State]] = [[] for _ in range(n + 1)]
    fronts[0] = [_State((0.0,), 0, None, 0)]
    kept = 0
    for k in range(n):
        front = _pareto(fronts[k])
        kept += len(front)
        bsum = 0.0
        for j, c in enumerate(rows[k], start=k):
            bsum += backprop_s[j]
            for s in front:
                fronts[j + 1].append(_extend(s, k, c, bsum))
    best = min(fronts[n], key=lambda s: (max(s.vec), s.groups, s.start))
    groups: list[Group] = []
    s: _State | None = best
    end = n - 1
    while s is not None and s.prev is not None:
        groups.append((s.start, end))
        end = s.start - 1
        s = s.prev
    groups.reverse()
    return Fusion(groups=tuple(groups), time_s=forward_s + max(best.vec), solver="pareto_dp",
                  calls=kept)


def _merge_ties(
    backprop_s: Sequence[float], found: Fusion, cost: Callable[[int, int], GroupCost],
    row_len: Sequence[int], forward_s: float,
) -> Fusion:
    """Fewer groups at the same time: merge neighbouring groups, left to right, wherever the
    merged strategy is predicted no slower. Many optima tie when the channel idles (a
    finish clamped to the compute finish), and fewer launches are the safer choice."""
    groups = list(found.groups)
    best = tandem_time(backprop_s, groups, cost, forward_s=forward_s)
    a = 0
    while a + 1 < len(groups):
        i, j = groups[a][0], groups[a + 1][1]
        if j - i < row_len[i]:
            trial = groups[:a] + [(i, j)] + groups[a + 2 :]
            t = tandem_time(backprop_s, trial, cost, forward_s=forward_s)
            if t <= best:
                groups, best = trial, t
                continue
        a += 1
    return Fusion(groups=tuple(groups), time_s=best, solver=found.solver, calls=found.calls)


def _row(cost: Callable[[int, int], GroupCost | None], k: int, last: int) -> list[GroupCost]:
    """The allowed groups starting at ``k``: ``cost(k, j)`` for ``j = k, k+1, ...`` up to the
    first forbidden one (a longer group contains it) or ``last``."""
    row = []
    for j in range(k, last):
        c = cost(k, j)
        if c is None:
            break
        if c.pre_s < 0 or any(d < 0 for d in c.chain_s):
            raise ValueError(f"group ({k}, {j}) has a negative cost {c}")
        row.append(c)
    if not row:
        raise ValueError(f"cost({k}, {k}) is None: every single tensor must be a valid group")
    return row


def _pareto_2d(
    backprop_s: Sequence[float], pre: np.ndarray, d: np.ndarray, forward_s: float
) -> Fusion:
    """:func:`pareto_dp` for one channel, vectorised over all kept states: for every prefix
    ``j`` the candidates are every kept state of a shorter prefix ``k`` extended by the group
    ``(k, j-1)``; the 2-D front (compute, channel finish) is a sort and a running minimum.
    ``pre`` and ``d`` are the dense cost tables (``inf``: not allowed)."""
    import numpy as np

    n = len(backprop_s)
    bp = np.concatenate(([0.0], np.cumsum(np.asarray(backprop_s, dtype=float))))
    comp = np.zeros(1)
    comm = np.zeros(1)
    grp = np.zeros(1, dtype=np.int64)
    kk = np.zeros(1, dtype=np.int64)  # prefix length of each state
    prev = np.full(1, -1, dtype=np.int64)
    for j in range(1, n + 1):
        ok = np.isfinite(pre[kk, j - 1])
        src = np.nonzero(ok)[0]
        ks = kk[src]
        c_comp = comp[src] + (bp[j] - bp[ks]) + pre[ks, j - 1]
        c_comm = np.maximum(c_comp, comm[src]) + d[ks, j - 1]
        c_grp = grp[src] + 1
        order = np.lexsort((ks, c_grp, c_comm, c_comp))
        cs = c_comm[order]
        keep = np.ones(len(cs), dtype=bool)
        keep[1:] = cs[1:] < np.minimum.accumulate(cs)[:-1]
        sel = order[keep]
        comp = np.concatenate((comp, c_comp[sel]))
        comm = np.concatenate((comm, c_comm[sel]))
        grp = np.concatenate((grp, c_grp[sel]))
        kk = np.concatenate((kk, np.full(len(sel), j, dtype=np.int64)))
        prev = np.concatenate((prev, src[sel]))
    final = np.nonzero(kk == n)[0]
    end = np.maximum(comp[final], comm[final])
    best = int(final[np.lexsort((grp[final], end))[0]])
    groups: list[Group] = []
    while prev[best] >= 0:
        p = int(prev[best])
        groups.append((int(kk[p]), int(kk[best]) - 1))
        best = p
    groups.reverse()
    return Fusion(groups=tuple(groups), time_s=forward_s + float(end.min()),
                  solver="pareto_dp", calls=len(comp))


def _extend(s: _State, k: int, c: GroupCost, bsum: float) -> _State:
    comp = s.vec[0] + bsum + c.pre_s
    ends = list(s.vec[1:]) or [0.0] * len(c.chain_s)
    t = comp
    for ch, d in enumerate(c.chain_s):
        t = max(t, ends[ch]) + d
        ends[ch] = t
    return _State((comp, *ends), s.groups + 1, s, k)


def _pareto(states: list[_State]) -> list[_State]:
    """Non-dominated states; of equal ones the first (smallest predecessor boundary)."""
    states.sort(key=lambda s: (s.groups, s.vec, s.start))
    kept: list[_State] = []
    for s in states:
        if any(o.groups <= s.groups and all(a <= b for a, b in zip(o.vec, s.vec))
               for o in kept):
            continue
        kept.append(s)
    return kept
