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
``C = 1`` (:func:`hetplan.algorithms.fusion_reference.thesis_time`).

The solver — what the ``cupcake-fusion`` pass runs — is :func:`pareto_dp_table`, exact for
any non-negative group costs (profiled tables, piecewise, several channels; §A9.2): per
prefix, the Pareto front of (compute finish, channel finishes, groups). The simulator is
monotone in each of them, so a dominated prefix never completes better. :func:`pareto_dp` is
the same solver for callers holding a cost function instead of tables (it builds the tables).

Ties (decided here; the thesis is silent, §F-7): the least time; then the fewest groups
(exact, because the group count is part of the state); then the smallest predecessor
boundary; then neighbouring groups are merged wherever that is predicted no slower.

Reference solvers that no pass calls — the thesis's Algorithm 5.1, the exact affine DP and
brute force over every partition — live in :mod:`hetplan.algorithms.fusion_reference`: the
differential tests hold :func:`pareto_dp` against them and ``bench/fusion.py`` compares their
speed with the thesis's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "Group",
    "GroupCost",
    "Fusion",
    "tandem_time",
    "pareto_dp",
    "pareto_dp_table",
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
        solver: ``pareto_dp``, or a reference solver's name (``alg51``, ``dp_affine``).
        calls: recursive calls (``alg51``) or states kept (the DPs).
    """

    groups: tuple[Group, ...]
    time_s: float
    solver: str
    calls: int = 0


def check_backprop(backprop_s: Sequence[float]) -> None:
    """Raise ValueError unless there is at least one tensor and every backprop time is
    >= 0 (the input check of every fusion solver, here and in the reference module)."""
    if not backprop_s:
        raise ValueError("fusion needs at least one gradient tensor (backprop_s is empty)")
    bad = [i for i, b in enumerate(backprop_s) if not b >= 0.0]
    if bad:
        raise ValueError(
            f"backprop_s[{bad[0]}] = {backprop_s[bad[0]]!r}: backprop times must be >= 0"
        )


def _check_groups(groups: Sequence[Group], n: int) -> None:
    nxt = 0
    for i, j in groups:
        if i != nxt or j < i:
            raise ValueError(
                f"groups {list(groups)} are not consecutive ranges covering 0..{n - 1}")
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
    check_backprop(backprop_s)
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


# -- the Pareto-front DP ----------------------------------------------------------------------
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

    check_backprop(backprop_s)
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

    check_backprop(backprop_s)
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
            for state in front:
                fronts[j + 1].append(_extend(state, k, c, bsum))
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
