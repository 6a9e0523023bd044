"""DynPipe's iterative diffusion balancer (Algorithm 2): a pure solver, no torch.

The decentralised alternative to the exact min-max partition of
:mod:`hetplan.algorithms.partition`: starting from the current partition, overloaded stages
hand boundary layers to a lighter neighbour while that lowers the variance of the stage
loads. :mod:`hetplan.algorithms.dynamics` re-plans with either balancer (by time or by
parameter count) at every event of a dynamic model (``research/dynpipe.md`` §3.3).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["diffusion_balance"]


def _pvar(xs: Sequence[float]) -> float:
    m = sum(xs) / len(xs)
    return sum((x - m) ** 2 for x in xs) / len(xs)


def diffusion_balance(
    bounds: Sequence[tuple[int, int]],
    cost: Sequence[Sequence[float]],
    *,
    send: Sequence[Sequence[float]] | None = None,
    mem: Sequence[Sequence[float]] | None = None,
    mem_cap: Sequence[float] | None = None,
    max_iters: int = 5,
) -> tuple[tuple[int, int], ...]:
    """DynPipe's Algorithm 2, restricted to neighbours so that stages stay contiguous.

    Per iteration (at most ``max_iters``): loads, mean and population variance are computed
    and every stage above the mean is *overloaded* (status fixed for the iteration). Each
    overloaded stage, in index order, hands boundary layers to its lighter neighbour — its
    first layer to the stage before, or its last layer to the stage after — one at a time,
    as long as each move lowers the variance of the stage loads, fits the receiver's memory
    and leaves the sender a layer. The iteration that accepts nothing ends the search.

    Deviations from the seed (decisions): the receiver is a neighbour, not the globally least
    loaded stage, because a non-adjacent move breaks the layer order (digest §3.3, §9.1); a
    sender may move several layers per iteration (one "attempt" per neighbour direction),
    which converges in few iterations as the seed reports.

    Args:
        bounds: the current partition.
        cost: ``cost[s][l]``: load of layer ``l`` on stage ``s``.
        send: ``send[s][j]`` added to stage ``s`` when it ends at layer ``j``.
        mem / mem_cap: per-stage per-layer bytes and per-stage capacity.

    Returns:
        The new bounds. O(max_iters · L · P) with O(1) load updates.
    """
    p = len(bounds)
    n = bounds[-1][1] + 1
    pre = [[0.0] for _ in range(p)]
    for s in range(p):
        for x in cost[s]:
            pre[s].append(pre[s][-1] + x)
    b = [list(x) for x in bounds]

    def load(s: int, i: int, j: int) -> float:
        extra = send[s][j] if send is not None and s < p - 1 else 0.0
        return pre[s][j + 1] - pre[s][i] + extra

    def fits(s: int, i: int, j: int) -> bool:
        return mem is None or mem_cap is None or sum(mem[s][i : j + 1]) <= mem_cap[s]

    loads = [load(s, i, j) for s, (i, j) in enumerate(b)]
    for _ in range(max_iters):
        avg = sum(loads) / p
        over = [s for s in range(p) if loads[s] > avg]
        accepted = False
        for src in over:
            while True:
                var = _pvar(loads)
                options = []
                if src > 0 and b[src][0] < b[src][1]:
                    options.append((loads[src - 1], src - 1))
                if src < p - 1 and b[src][0] < b[src][1]:
                    options.append((loads[src + 1], src + 1))
                moved = False
                for _, dst in sorted(options):
                    nb = [list(x) for x in b]
                    if dst < src:
                        nb[src][0] += 1
                        nb[dst][1] += 1
                    else:
                        nb[src][1] -= 1
                        nb[dst][0] -= 1
                    if not fits(dst, *nb[dst]):
                        continue
                    new = list(loads)
                    new[src], new[dst] = load(src, *nb[src]), load(dst, *nb[dst])
                    if _pvar(new) < var * (1 - 1e-12) - 1e-15:
                        b, loads, moved = nb, new, True
                        break
                if not moved:
                    break
                accepted = True
        if not accepted:
            break
    assert b[0][0] == 0 and b[-1][1] == n - 1
    return tuple((i, j) for i, j in b)
