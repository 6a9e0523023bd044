"""Heterogeneous pipeline search: which device class runs which stage, with which (dp, tp),
in which order along the pipeline, and with which layers. Pure numbers, no torch.

The problem (:class:`HeteroProblem`). ``L`` layers must be cut into consecutive stages. Each
stage takes one *option* ``o`` — a device class ``c(o)``, a data-parallel degree and a
tensor-parallel degree, using ``devices(o) = dp x tp`` devices of its class — and each class
``c`` has ``capacity[c]`` devices. For a stage of option ``o`` over layers ``[i, j)`` the
cost model gives, per recomputation mode ``r`` (the cheapest that fits is used):

- ``a[o][r][i, j]``: its per-micro-batch forward + backward time plus the resharding of its
  input from the previous stage (both directions; 0 for the first stage);
- ``v[o][r][i, j]``: its steady-state busy time, ``(m - 1)`` micro-batches of forward +
  backward, plus its exposed gradient sync and optimizer step;
- ``q[o][r][i, j]``: the most micro-batches of activations it can hold in memory (-1: does
  not fit at all).

A stage ``k`` of a ``P``-stage 1F1B pipeline holds ``min(m, P - k)`` micro-batches, so it
fits iff ``q >= min(m, P - k)``. The **search objective** is the closed-form 1F1B iteration

    ``J = sum_k a_k + max_k v_k``

(fill and drain pass every stage once; the slowest stage is busy for the rest), and device
use per class is bounded by its capacity. Stages may come in any order of classes.

Solvers:

- :func:`solve_exact`: dynamic programming, exact for ``J``. For a threshold ``tau`` on
  ``max v`` it computes ``S(tau)``, the least ``sum a`` of a plan whose stages all have
  ``v <= tau``, right to left over (first layer, stages after, devices used per class), so a
  stage's in-flight count is known when it is placed; then ``J* = min_tau S(tau) + tau``
  over the distinct ``v`` values, scanned downwards along the Pareto front of
  ``(sum a, max v)``: each DP jumps below the ``max v`` its plan reached, and the scan stops
  once ``S(tau)`` plus the smallest ``v`` cannot beat the best ``J`` found.
  Each threshold costs ``O(L^2 . options . modes)`` numpy operations over arrays of
  ``min(m, L) x prod(capacity[c] / unit[c] + 1)`` states.
- :func:`solve_brute_force`: the readable reference, every sequence of (option, layer count),
  for tests on small instances.
- :func:`solve_cpsat` (:mod:`hetplan.algorithms.hetero_cpsat`): the same objective as a
  CP-SAT model, where the exact DP's state space is too large.

Deterministic: ties go to the lexicographically smallest stage tuple.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

import numpy as np

__all__ = ["StageOption", "HeteroProblem", "StageChoice", "HeteroSolution", "solve_exact",
           "solve_brute_force", "objective", "state_count"]

INF = float("inf")


@dataclass(frozen=True)
class StageOption:
    """One shape a stage may take.

    Attributes:
        device_class: index into ``HeteroProblem.capacity``.
        dp / tp: the stage's degrees; it uses ``dp * tp`` devices of its class.
        a / v / q: per recomputation mode (``modes`` of the problem), ``(L+1, L+1)`` arrays
            indexed ``[i, j]`` for layers ``[i, j)`` (see the module docstring); entries
            with ``j <= i`` are ignored.
    """

    device_class: int
    dp: int
    tp: int
    a: tuple[np.ndarray, ...]
    v: tuple[np.ndarray, ...]
    q: tuple[np.ndarray, ...]

    @property
    def devices(self) -> int:
        return self.dp * self.tp


@dataclass(frozen=True)
class HeteroProblem:
    """Layers, options, device classes and micro-batches (see the module docstring).

    ``unit[c]``: every option of class ``c`` uses a multiple of ``unit[c]`` devices (the DP
    counts devices in these units)."""

    num_layers: int
    options: tuple[StageOption, ...]
    capacity: tuple[int, ...]
    micro_batches: int
    modes: tuple[str, ...] = ("none",)
    unit: tuple[int, ...] = ()

    def units(self) -> tuple[int, ...]:
        return self.unit or tuple(1 for _ in self.capacity)


@dataclass(frozen=True, order=True)
class StageChoice:
    """One stage of a solution: option index, recompute mode index, layers ``[first, end)``."""

    option: int
    mode: int
    first: int
    end: int


@dataclass(frozen=True)
class HeteroSolution:
    """Stages in pipeline order, the objective ``J`` and how it was found."""

    stages: tuple[StageChoice, ...]
    objective: float
    bound: float
    method: str
    states: int = 0
    notes: tuple[str, ...] = field(default=())


def _mode_for(problem: HeteroProblem, o: int, i: int, j: int, in_flight: int) -> int | None:
    """The first (cheapest) recomputation mode with which option ``o`` over ``[i, j)``
    holds ``in_flight`` micro-batches; None if none does."""
    opt = problem.options[o]
    for r in range(len(problem.modes)):
        if opt.q[r][i, j] >= in_flight:
            return r
    return None


def objective(problem: HeteroProblem, stages: tuple[StageChoice, ...]) -> float:
    """``J`` of a sequence of stages, or ``inf`` when it breaks a rule (layers not covered in
    order, a class over capacity, a stage that does not fit or at a mode that is not the
    cheapest that fits)."""
    if not stages or stages[0].first != 0 or stages[-1].end != problem.num_layers:
        return INF
    used = [0] * len(problem.capacity)
    total, worst, P = 0.0, 0.0, len(stages)
    for k, s in enumerate(stages):
        if s.end <= s.first or (k and stages[k - 1].end != s.first):
            return INF
        opt = problem.options[s.option]
        used[opt.device_class] += opt.devices
        if _mode_for(problem, s.option, s.first, s.end,
                     min(problem.micro_batches, P - k)) != s.mode:
            return INF
        total += float(opt.a[s.mode][s.first, s.end])
        worst = max(worst, float(opt.v[s.mode][s.first, s.end]))
    if any(u > c for u, c in zip(used, problem.capacity)):
        return INF
    return total + worst


def solve_brute_force(problem: HeteroProblem) -> HeteroSolution | None:
    """Every sequence of stages (option, layer count), each at its cheapest fitting mode:
    the reference for :func:`solve_exact`. Exponential; for ``L <= 12`` and a few options."""
    L = problem.num_layers
    best: tuple[float, tuple[StageChoice, ...]] | None = None
    for cuts in _compositions(L):
        P = len(cuts)
        if P > sum(problem.capacity):  # every stage uses at least one device
            continue
        bounds = list(itertools.accumulate(cuts, initial=0))
        for opts in itertools.product(range(len(problem.options)), repeat=P):
            stages = []
            for k, o in enumerate(opts):
                r = _mode_for(problem, o, bounds[k], bounds[k + 1],
                              min(problem.micro_batches, P - k))
                if r is None:
                    break
                stages.append(StageChoice(o, r, bounds[k], bounds[k + 1]))
            else:
                j = objective(problem, tuple(stages))
                if j < INF and (best is None or (j, tuple(stages)) < best):
                    best = (j, tuple(stages))
    if best is None:
        return None
    return HeteroSolution(best[1], best[0], best[0], "brute-force")


def _compositions(n: int) -> list[tuple[int, ...]]:
    """Every ordered way of writing ``n`` as a sum of positive integers."""
    out = []
    for k in range(1, n + 1):
        for cut in itertools.combinations(range(1, n), k - 1):
            pts = (0,) + cut + (n,)
            out.append(tuple(pts[i + 1] - pts[i] for i in range(k)))
    return out


def state_count(problem: HeteroProblem) -> int:
    """States of the exact DP per threshold: layers x in-flight depths x device-use
    vectors."""
    q = min(problem.micro_batches, problem.num_layers)
    u = 1
    for cap, unit in zip(problem.capacity, problem.units()):
        u *= cap // unit + 1
    return (problem.num_layers + 1) * (q + 1) * u


def solve_exact(problem: HeteroProblem, *, max_states: int = 5_000_000
                ) -> HeteroSolution | None:
    """The plan minimising ``J`` (see the module docstring); None if no plan fits.

    Raises:
        ValueError: the state space exceeds ``max_states`` (use CP-SAT).
    """
    n_states = state_count(problem)
    if n_states > max_states:
        raise ValueError(f"exact search needs {n_states:,} states, more than {max_states:,}")
    L, m = problem.num_layers, problem.micro_batches
    units = problem.units()
    shape = tuple(cap // unit + 1 for cap, unit in zip(problem.capacity, units))
    Q = min(m, L)
    # per (option, i, j): a, v and the mode as vectors over q, the stage's in-flight count
    # being min(m, q + 1); inf where no mode fits
    table = _tables(problem, Q)
    taus = sorted({float(x) for (_, vv, _) in table.values() for x in vv if x < INF})
    if not taus:
        return None
    # Descending scan over the Pareto front of (sum a, max v): the best plan with every
    # v <= tau has max v = tau' <= tau, and no plan with max v in [tau', tau] beats it
    # (its sum a is the least there); so the next threshold is the largest v below tau'.
    # S only grows as tau falls: stop once S(tau) + the smallest v cannot beat the best.
    best: tuple[float, tuple[StageChoice, ...]] | None = None
    explored = 0
    tau = INF
    while True:
        value, stages = _dp(problem, table, tau, shape, units, Q)
        explored += n_states
        if value is None or stages is None:
            break
        j = objective(problem, stages)
        if best is None or (j, stages) < best:
            best = (j, stages)
        if value + taus[0] >= best[0]:
            break
        reached = max(float(problem.options[x.option].v[x.mode][x.first, x.end])
                      for x in stages)
        k = bisect.bisect_left(taus, reached) - 1
        if k < 0:
            break
        tau = taus[k]
    if best is None:
        return None
    return HeteroSolution(best[1], best[0], best[0], "exact-dp", explored)


Table = dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray, np.ndarray]]


def _tables(problem: HeteroProblem, Q: int) -> Table:
    """``(o, i, j) -> (a over q, v over q, mode over q)`` for ``q = 0..Q-1`` stages after the
    stage, at the cheapest mode that fits ``min(m, q + 1)`` micro-batches."""
    L, m = problem.num_layers, problem.micro_batches
    out: Table = {}
    for o, opt in enumerate(problem.options):
        for i in range(L):
            for j in range(i + 1, L + 1):
                a = np.full(Q, INF)
                v = np.full(Q, INF)
                mode = np.full(Q, -1, dtype=np.int64)
                for q in range(Q):
                    r = _mode_for(problem, o, i, j, min(m, q + 1))
                    if r is None:
                        continue
                    a[q], v[q], mode[q] = opt.a[r][i, j], opt.v[r][i, j], r
                if np.isfinite(a).any():
                    out[(o, i, j)] = (a, v, mode)
    return out


def _dp(problem: HeteroProblem, table: Table, tau: float, shape: tuple[int, ...],
        units: tuple[int, ...], Q: int
        ) -> tuple[float | None, tuple[StageChoice, ...] | None]:
    """``S(tau)`` and its stages by dynamic programming (None, None: no plan has every
    ``v <= tau``).

    ``best[i][q, u]``: least ``sum a`` of stages covering ``[i, L)`` that are
    ``min(count, Q)`` = ``q + 1`` in number and use the device vector of flat index ``u``
    (in units); a stage placed before such a suffix holds ``min(m, q + 2)`` micro-batches."""
    L = problem.num_layers
    size = int(np.prod(shape))
    strides = [int(np.prod(shape[c + 1:])) for c in range(len(shape))]
    grid = np.indices(shape).reshape(len(shape), -1)
    best = [np.full((Q, size), INF) for _ in range(L + 1)]
    # back-pointers: (option, mode, end layer, suffix q, suffix u) per state
    back = [np.full((5, Q, size), -1, dtype=np.int64) for _ in range(L + 1)]
    by_start: dict[int, list[tuple[int, int, tuple[np.ndarray, np.ndarray, np.ndarray]]]] = {}
    for (o, i, j), row in table.items():
        by_start.setdefault(i, []).append((o, j, row))
    for i in range(L - 1, -1, -1):
        for o, j, (a, v, mode) in by_start.get(i, ()):
            opt = problem.options[o]
            c = opt.device_class
            step = opt.devices // units[c]
            if step >= shape[c]:
                continue
            shift = step * strides[c]
            if j == L:  # the last stage: one stage from i on, only its own devices
                if v[0] <= tau and a[0] < best[i][0, shift]:
                    best[i][0, shift] = a[0]
                    back[i][:, 0, shift] = (o, mode[0], j, -1, -1)
                continue
            # a stage before a suffix of index q is of index qq = min(q + 1, Q - 1)
            qq = np.minimum(np.arange(Q) + 1, Q - 1)
            allowed = (v[qq] <= tau) & np.isfinite(a[qq])
            if not allowed.any():
                continue
            src = best[j][:, :size - shift] if shift else best[j]
            src_ok = (grid[c] + step < shape[c])[:size - shift] if shift else None
            cand = src + a[qq][:, None]
            cand[~allowed] = INF
            if src_ok is not None:
                cand[:, ~src_ok] = INF
            for q in range(Q):  # suffix index q -> this stage's index qq[q] (Q-2, Q-1 merge)
                if not allowed[q]:
                    continue
                cur = best[i][qq[q], shift:]
                better = cand[q] < cur
                if not better.any():
                    continue
                dst = np.nonzero(better)[0]
                cur[dst] = cand[q][dst]
                b = back[i]
                b[0, qq[q], dst + shift] = o
                b[1, qq[q], dst + shift] = mode[qq[q]]
                b[2, qq[q], dst + shift] = j
                b[3, qq[q], dst + shift] = q
                b[4, qq[q], dst + shift] = dst
    top = best[0]
    if not np.isfinite(top).any():
        return None, None
    q0, u0 = divmod(int(np.argmin(top)), size)
    value = float(top[q0, u0])
    stages = []
    i, q, u = 0, q0, u0
    while True:
        o, r, j, qn, un = (int(x) for x in back[i][:, q, u])
        stages.append(StageChoice(o, r, i, j))
        if j == L:
            break
        i, q, u = j, qn, un
    return value, tuple(stages)
