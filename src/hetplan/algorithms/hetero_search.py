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

(fill and drain pass every stage once; the slowest stage is busy for the rest), device
use per class is bounded by its capacity, and there are at most ``m`` stages. Stages may come in any order of classes.
A stage may start only at a layer whose ``cuttable[k]`` holds (``LayerIR.cuttable_before``:
the runtime cannot split the model elsewhere); every solver skips the other boundaries
(the DP and CP-SAT place no stage that starts or ends there, :func:`objective` refuses a
plan that cuts there, so the local search and brute force never reach one).

Solvers:

- :func:`solve_exact`: dynamic programming, exact for ``J``. For a threshold ``tau`` on
  ``max v`` it computes ``S(tau)``, the least ``sum a`` of a plan whose stages all have
  ``v <= tau``, right to left over (first layer, stages after, devices used per class), so a
  stage's in-flight count is known when it is placed; then ``J* = min_tau S(tau) + tau``
  over the distinct ``v`` values, scanned downwards along the Pareto front of
  ``(sum a, max v)``: each DP jumps below the ``max v`` its plan reached, and the scan stops
  once ``S(tau)`` plus a floor of ``max v`` cannot beat the best ``J`` found (or, with a
  ``judge``, the best time a finer model gives the plans visited). Each threshold is one
  pass of :func:`~hetplan.algorithms._hetero_kernels.dp_pass` (numba-compiled):
  ``O(L^2 . options . min(m, L) . prod(capacity[c] / unit[c] + 1))``.
- :func:`improve_locally`: first-improvement hill climbing from a plan under a finer
  model's judge (boundary moves, swaps of neighbouring stages' options), for the plans the
  DP's front misses.
- :func:`solve_brute_force`: the readable reference, every sequence of (option, layer count),
  for tests on small instances.
- :func:`solve_cpsat` (:mod:`hetplan.algorithms.hetero_cpsat`): the same objective as a
  CP-SAT model, where the exact DP's state space is too large.

Deterministic: ties go to the lexicographically smallest stage tuple.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from hetplan.algorithms import _hetero_kernels as _kernels

__all__ = ["StageOption", "HeteroProblem", "StageChoice", "HeteroSolution", "solve_exact",
           "solve_brute_force", "objective", "state_count", "improve_locally"]

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
        work: optional, per layer, seconds whose sum over ``[i, j)`` is at most ``v`` of
            that range under every mode (the steady-state compute); lets the search bound
            ``max v`` by balancing all work over all devices (:func:`_max_v_floor`).
    """

    device_class: int
    dp: int
    tp: int
    a: tuple[np.ndarray, ...]
    v: tuple[np.ndarray, ...]
    q: tuple[np.ndarray, ...]
    work: np.ndarray | None = None

    @property
    def devices(self) -> int:
        return self.dp * self.tp


@dataclass(frozen=True)
class HeteroProblem:
    """Layers, options, device classes and micro-batches (see the module docstring).

    ``unit[c]``: every option of class ``c`` uses a multiple of ``unit[c]`` devices (the DP
    counts devices in these units).

    ``cuttable``: per layer, whether a stage may start there (empty: at every layer; the
    first layer always may)."""

    num_layers: int
    options: tuple[StageOption, ...]
    capacity: tuple[int, ...]
    micro_batches: int
    modes: tuple[str, ...] = ("none",)
    unit: tuple[int, ...] = ()
    cuttable: tuple[bool, ...] = ()

    def __post_init__(self) -> None:
        if self.cuttable and len(self.cuttable) != self.num_layers:
            raise ValueError(f"HeteroProblem.cuttable needs one value per layer "
                             f"({self.num_layers}), got {len(self.cuttable)}")

    def units(self) -> tuple[int, ...]:
        return self.unit or tuple(1 for _ in self.capacity)

    def cut_allowed(self) -> np.ndarray:
        """Per layer boundary ``0..L``, whether a stage may start (``< L``) or end there
        (boundaries 0 and ``L`` always; boundary ``k`` of ``0 < k < L`` where
        ``cuttable[k]`` holds)."""
        out = np.ones(self.num_layers + 1, bool)
        if self.cuttable:
            out[1:self.num_layers] = self.cuttable[1:]
        return out


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
    front: tuple[tuple[float, tuple[StageChoice, ...]], ...] = field(default=())


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
    if len(stages) > problem.micro_batches:  # 1F1B needs a micro-batch per stage
        return INF
    if problem.cuttable and not all(problem.cuttable[s.first] for s in stages[1:]):
        return INF  # a stage starts where the runtime cannot split the model
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
    allowed = problem.cut_allowed()
    best: tuple[float, tuple[StageChoice, ...]] | None = None
    for cuts in _compositions(L):
        P = len(cuts)
        if P > sum(problem.capacity):  # every stage uses at least one device
            continue
        bounds = list(itertools.accumulate(cuts, initial=0))
        if not all(allowed[b] for b in bounds):
            continue  # a cut where the runtime cannot split the model
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


def _neighbours(problem: HeteroProblem, stages: tuple[StageChoice, ...]
                ) -> list[tuple[StageChoice, ...]]:
    """The plans one move from ``stages``, in a fixed order: each boundary moved by -2, -1,
    +1, +2 layers, then the options of each two neighbouring stages swapped; every stage
    at its cheapest fitting mode, plans that break a rule (:func:`objective`: a boundary
    moved onto a layer that is not cuttable, too) left out."""
    moves: list[list[StageChoice]] = []
    for k in range(len(stages) - 1):
        x, y = stages[k], stages[k + 1]
        for d in (-2, -1, 1, 2):
            if x.first < x.end + d < y.end:
                moves.append([*stages[:k], StageChoice(x.option, x.mode, x.first, x.end + d),
                              StageChoice(y.option, y.mode, x.end + d, y.end), *stages[k + 2:]])
    for k in range(len(stages) - 1):
        x, y = stages[k], stages[k + 1]
        if x.option != y.option:
            moves.append([*stages[:k], StageChoice(y.option, x.mode, x.first, x.end),
                          StageChoice(x.option, y.mode, y.first, y.end), *stages[k + 2:]])
    out = []
    P = len(stages)
    for move in moves:
        fixed = []
        for k, st in enumerate(move):
            r = _mode_for(problem, st.option, st.first, st.end, min(problem.micro_batches, P - k))
            if r is None:
                break
            fixed.append(StageChoice(st.option, r, st.first, st.end))
        else:
            if objective(problem, tuple(fixed)) < INF:
                out.append(tuple(fixed))
    return out


def improve_locally(problem: HeteroProblem, stages: tuple[StageChoice, ...],
                    judge: Callable[[tuple[StageChoice, ...]], float], *,
                    max_rounds: int = 64) -> tuple[tuple[StageChoice, ...], float, int]:
    """First-improvement hill climbing from ``stages`` under ``judge`` (a finer model's
    time; inf: does not fit) over :func:`_neighbours` (boundary moves and swaps of
    neighbouring stages' options), until no move improves or ``max_rounds`` moves were
    taken. The DP's front misses plans the finer model prefers; this repairs the plan it
    chose where one move away is better. Returns the plan, its judged time and how many
    plans were judged. Deterministic (moves in a fixed order). Each round judges at most
    ``6 (P - 1)`` plans."""
    best_t, judged = judge(stages), 1
    for _ in range(max_rounds):
        for cand in _neighbours(problem, stages):
            t = judge(cand)
            judged += 1
            if t < best_t:
                stages, best_t = cand, t
                break
        else:
            break
    return stages, best_t, judged


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


def solve_exact(problem: HeteroProblem, *, max_states: int = 5_000_000,
                incumbent: float = INF,
                judge: Callable[[tuple[StageChoice, ...]], float] | None = None,
                rel_gap: float = 0.0) -> HeteroSolution | None:
    """The plan minimising ``J`` (see the module docstring); None if no plan fits, or if a
    floor of ``J`` (:func:`_sum_a_floor` plus the floor of ``max v``) already reaches
    ``incumbent``.

    ``incumbent``: the objective of a plan found elsewhere (another micro-batch size); the
    threshold scan stops once no plan here can beat it, and the returned ``bound`` is then
    the lower bound proven on this problem's ``J`` (``bound == objective`` when the scan
    ran to the end). ``front`` holds every plan the scan visited (one per DP pass, on the
    Pareto front of ``(sum a, max v)``), best ``J`` first: the candidates a caller may
    re-predict with a finer model.

    ``judge``: a finer model's time of a plan (``inf``: it does not fit there). With it the
    scan stops only once ``S(tau)`` plus the floor of ``max v`` reaches the best *judged*
    time (and ``incumbent``, a judged time from elsewhere): every plan whose objective
    could be below the judge's best so far is visited. The judge is not bound by ``J``, so
    this is exhaustive for the judge only where ``J`` never exceeds it; ``best`` is still
    the least ``J`` among the plans visited.

    ``rel_gap``: after a pass whose plan reached ``max v = t``, the next threshold is the
    largest ``v`` below ``(1 - rel_gap) t`` rather than below ``t``. A plan skipped that
    way has ``J >= S + (1 - rel_gap) t`` (``S`` only grows as the threshold falls), so the
    returned ``bound`` stays a proven lower bound and the gap ``(objective - bound) /
    objective`` is at most about ``rel_gap``; 0 (the default) is exact.

    Raises:
        ValueError: the state space exceeds ``max_states`` (coarsen the problem).
    """
    n_states = state_count(problem)
    if n_states > max_states:
        raise ValueError(f"exact search needs {n_states:,} states, more than {max_states:,}")
    L, m = problem.num_layers, problem.micro_batches
    units = problem.units()
    shape = tuple(cap // unit + 1 for cap, unit in zip(problem.capacity, units))
    Q = min(m, L)
    arcs = _arcs(problem, Q)
    if arcs is None:
        return None
    arc_o, arc_i, arc_j, arc_a, arc_v, arc_mode = arcs
    Q = arc_a.shape[1]
    taus = np.unique(arc_v[np.isfinite(arc_v)])
    if not taus.size:
        return None
    floor_v = _max_v_floor(arc_i, arc_j, arc_v, L, problem)
    if floor_v + _sum_a_floor(arc_i, arc_j, arc_a, L) >= incumbent:
        return None  # no plan here can beat the incumbent: not one pass
    size = int(np.prod(shape))
    strides = np.array([int(np.prod(shape[c + 1:])) for c in range(len(shape))], np.int64)
    opt_class = np.array([o.device_class for o in problem.options], np.int64)
    opt_step = np.array([o.devices // units[o.device_class] for o in problem.options],
                        np.int64)
    best_arr = np.empty((L + 1, Q, size))
    back = np.empty((L + 1, 5, Q, size), np.int64)
    run = _kernels.kernel()
    # Descending scan over the Pareto front of (sum a, max v): the best plan with every
    # v <= tau has max v = tau' <= tau, and no plan with max v in [tau', tau] beats it
    # (its sum a is the least there); so the next threshold is the largest v below tau'.
    # S only grows as tau falls: stop once S(tau) + the floor of max v cannot beat the best.
    best: tuple[float, tuple[StageChoice, ...]] | None = None
    front: list[tuple[float, tuple[StageChoice, ...]]] = []
    explored, bound = 0, INF

    def one_pass(tau: float) -> tuple[float, tuple[StageChoice, ...]] | None:
        nonlocal explored, best, incumbent
        run(arc_o, arc_i, arc_j, arc_a, arc_v, arc_mode, opt_class, opt_step,
            np.array(shape, np.int64), strides, tau, L, m <= L, best_arr, back)
        explored += (L + 1) * Q * size
        found = _read_back(best_arr, back, L, size)
        if found is not None:
            j = objective(problem, found[1])
            if (j, found[1]) not in front:
                front.append((j, found[1]))
            if best is None or (j, found[1]) < best:
                best = (j, found[1])
            if judge is not None:
                incumbent = min(incumbent, judge(found[1]))
        return found

    def limit() -> float:
        assert best is not None
        return incumbent if judge is not None else min(best[0], incumbent)

    def max_v(stages: tuple[StageChoice, ...]) -> float:
        return max(float(problem.options[x.option].v[x.mode][x.first, x.end]) for x in stages)

    # 1. the plan of least sum a (no threshold)
    found = one_pass(INF)
    if found is None:
        return None
    s_inf, reached = found[0], max_v(found[1])
    # 2. probes from the floor of max v upwards: a plan found there bounds J* from above
    probe = floor_v * 1.5
    while 0.0 < probe < reached and s_inf + floor_v < limit():
        if one_pass(probe) is not None:
            break
        probe *= 1.5
    # 3. the scan: plans of max v = t at thresholds below tau have J >= S(tau) + t, so
    # every t with S(tau) + t >= the best is skipped (S(inf) for the first step)
    value = s_inf
    while True:
        if value + floor_v >= limit():
            bound = min(bound, value + floor_v)
            break
        target = reached
        if rel_gap > 0.0 and reached < INF:
            target = reached * (1.0 - rel_gap)
            bound = min(bound, value + target)  # the plans of the window skipped
        k = int(np.searchsorted(taus, min(target, limit() - value), side="left")) - 1
        if k < 0:
            break
        found = one_pass(float(taus[k]))
        if found is None:
            break
        value, reached = found[0], max_v(found[1])
    if best is None:
        return None
    front.sort()
    return HeteroSolution(best[1], best[0], min(best[0], bound), "exact-dp", explored,
                          front=tuple(front))


Arcs = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _arcs(problem: HeteroProblem, Q: int) -> Arcs | None:
    """Every stage the DP may place, as the arrays of :mod:`._hetero_kernels`: option,
    first and end layer, and ``a``, ``v``, mode over ``q = 0..Q'-1`` stages after it, at the
    cheapest mode that fits ``min(m, q + 1)`` micro-batches (inf / -1 where none does);
    only stages whose both ends are allowed cuts (:meth:`HeteroProblem.cut_allowed`);
    sorted by first layer descending, then option, then end layer. ``Q' <= Q``: the depths
    at and past ``Q' - 1`` look the same to every stage. None: no stage fits."""
    L, m = problem.num_layers, problem.micro_batches
    ii, jj = np.triu_indices(L + 1, k=1)
    allowed = problem.cut_allowed()
    ok = allowed[ii] & allowed[jj]  # no stage starts or ends where no cut may fall
    ii, jj = ii[ok], jj[ok]
    need = np.minimum(m, np.arange(Q) + 1)
    tables = []
    for opt in problem.options:
        q = np.stack([x[ii, jj] for x in opt.q])  # (R, ranges)
        fits = q[:, :, None] >= need[None, None, :]  # (R, ranges, Q)
        any_fit = fits.any(axis=0)
        mode = np.where(any_fit, fits.argmax(axis=0), -1)
        a_all = np.stack([x[ii, jj] for x in opt.a])
        v_all = np.stack([x[ii, jj] for x in opt.v])
        r = np.maximum(mode, 0)
        cols = np.arange(len(ii))[:, None]
        tables.append((np.where(any_fit, a_all[r, cols], INF),
                       np.where(any_fit, v_all[r, cols], INF), mode))
    rows = []
    for o, (a, v, mode) in enumerate(tables):
        keep = np.isfinite(a).any(axis=1)
        dominated = _dominated(problem, o, tables)
        rows.append((np.full(int(keep.sum()), o), ii[keep], jj[keep], a[keep], v[keep],
                     mode[keep], dominated[keep]))
    if not any(len(r[0]) for r in rows):
        return None
    o_, i_, j_, a_, v_, m_, d_ = (np.concatenate([r[k] for r in rows]) for k in range(7))
    # Depths past which no stage changes (mode, a, v) are one state: a stage with more
    # stages after it holds more micro-batches, and where every stage fits them at the same
    # mode the DP need not tell those depths apart (exact; GPT-2-medium on 512 GPUs of
    # 80 and 32 GB: 28 depths -> 1). Only with more micro-batches than layers: otherwise
    # the depth also counts stages, at most one per micro-batch.
    last = Q
    while m > L and last > 1 and all(np.array_equal(x[:, last - 1], x[:, last - 2], equal_nan=True)
                           for x in (a_, v_, m_)):
        last -= 1
    a_, v_, m_ = a_[:, :last], v_[:, :last], m_[:, :last]
    order = np.lexsort((j_, o_, -i_))
    order = order[~d_[order]]
    return (o_[order].astype(np.int64), i_[order].astype(np.int64),
            j_[order].astype(np.int64), np.ascontiguousarray(a_[order], dtype=np.float64),
            np.ascontiguousarray(v_[order], dtype=np.float64), m_[order].astype(np.int64))


def _dominated(problem: HeteroProblem, o: int,
               tables: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> np.ndarray:
    """Per layer range, whether option ``o``'s stage is dominated: an option of a lower
    index, the same class and as many devices has ``a`` and ``v`` no larger at every depth.
    The DP meets the other first (arcs go by option within a first layer) and only a
    strictly smaller ``sum a`` replaces a state, so dropping ``o``'s stage there changes
    no state, no back pointer and no plan; the thresholds it alone brought (its ``v``)
    find the same plans as the next lower ones. GPT-2.7B on mixed-generations: 44 % of the
    stages at micro-batch 8."""
    me = problem.options[o]
    a, v, _ = tables[o]
    out = np.zeros(a.shape[0], bool)
    for k in range(o):
        other = problem.options[k]
        if other.device_class != me.device_class or other.devices != me.devices:
            continue
        ak, vk, _ = tables[k]
        out |= (ak <= a).all(axis=1) & (vk <= v).all(axis=1)
    return out


def _max_v_floor(arc_i: np.ndarray, arc_j: np.ndarray, arc_v: np.ndarray, L: int,
                 problem: HeteroProblem) -> float:
    """A lower bound on ``max v`` of any plan, the larger of two:

    - every layer lies in some stage, so ``max v`` is at least, for every layer, the least
      ``v`` of the stages that could cover it;
    - with every option's ``work``: a stage of ``d`` devices of class ``c`` has
      ``d max v >= d sum work >= sum over its layers of e_c(layer)``, the least device-seconds
      any option of class ``c`` spends on the layer; summed over stages,
      ``max v >= sum_layer min_c e_c(layer) / sum_c capacity[c]``."""
    v = arc_v.min(axis=1)
    layers = np.arange(L)
    cover = (arc_i[:, None] <= layers) & (arc_j[:, None] > layers)  # (arcs, L)
    least = np.where(cover, v[:, None], INF).min(axis=0)
    finite = least[np.isfinite(least)]
    out = float(finite.max()) if finite.size else 0.0
    if problem.options and all(o.work is not None for o in problem.options):
        per_layer = np.full(L, INF)
        for o in problem.options:
            assert o.work is not None
            per_layer = np.minimum(per_layer, o.devices * o.work)
        out = max(out, float(per_layer.sum()) / sum(problem.capacity))
    return out


def _sum_a_floor(arc_i: np.ndarray, arc_j: np.ndarray, arc_a: np.ndarray, L: int) -> float:
    """A lower bound on ``sum a`` of any plan: the shortest path from layer 0 to ``L``
    over the arcs, each at its least ``a`` over depths (arcs come sorted by first layer
    descending). O(arcs)."""
    least = arc_a.min(axis=1)
    dist = np.full(L + 1, INF)
    dist[L] = 0.0
    starts = np.flatnonzero(np.diff(arc_i, prepend=arc_i[0] + 1))
    ends = np.append(starts[1:], len(arc_i))
    for lo, hi in zip(starts, ends):
        dist[arc_i[lo]] = float(np.min(least[lo:hi] + dist[arc_j[lo:hi]]))
    return float(dist[0])


def _read_back(best: np.ndarray, back: np.ndarray, L: int, size: int
               ) -> tuple[float, tuple[StageChoice, ...]] | None:
    """``S(tau)`` and its stages from a filled DP (None: no plan has every ``v <= tau``)."""
    top = best[0]
    if not np.isfinite(top).any():
        return None
    q0, u0 = divmod(int(np.argmin(top)), size)
    value = float(top[q0, u0])
    stages = []
    i, q, u = 0, q0, u0
    while True:
        o, r, j, qn, un = (int(x) for x in back[i, :, q, u])
        stages.append(StageChoice(o, r, i, j))
        if j == L:
            break
        i, q, u = j, qn, un
    return value, tuple(stages)
