"""The heterogeneous pipeline search as a CP-SAT model (OR-Tools), for spaces where the exact
DP (:func:`~hetplan.algorithms.hetero_search.solve_exact`) does not scale. Pure numbers,
no torch.

Same problem and objective as :mod:`hetplan.algorithms.hetero_search` (read its module
docstring first): cut ``L`` layers into consecutive stages, give each an *option* (device
class, ``dp``, ``tp``), minimise ``J = sum_k a_k + max_k v_k`` under per-class device
capacity, per-stage memory and at most ``m`` stages.

The model (:func:`solve_cpsat`):

- **Slots by depth.** Slot ``d`` is the stage with ``d`` stages after it (``d = 0``: the
  last stage). A 1F1B stage there holds ``min(m, d + 1)`` micro-batches, so its cheapest
  fitting recomputation mode, its ``a`` and its ``v`` are constants of ``(d, option, i, j)``:
  the per-(class, layers, dp, tp, mode) stage times and the memory rule become a table
  that the model reads by boolean selection.
- **Variables.** ``x[d, o, i, j]``: slot ``d`` runs option ``o`` over layers ``[i, j)``,
  one boolean per *arc* that fits in memory at that depth (arcs that do not fit are never
  created: the memory constraint), and none that starts or ends at a boundary where the
  runtime cannot split the model (``HeteroProblem.cuttable``). ``on[d]``: slot ``d`` is used.
- **Constraints.** Each used slot takes exactly one arc; ``on[d] >= on[d + 1]``; slot 0
  ends at ``L``; a used slot ``d + 1`` ends where slot ``d`` starts; the first stage (a
  used slot whose next slot is unused) starts at layer 0; per class ``c``,
  ``sum devices(o) x <= capacity[c]``; slots ``<= m``.
- **Divisibility.** ``dp x tp`` equals the devices a stage uses and ``tp`` divides the
  class's devices per node (and the heads, or the plan's uneven-shard rule): the option set
  the cost model builds holds only such pairs, so choosing an option is choosing an allowed
  ``(dp, tp)``.
- **Objective.** ``sum a x + V`` with ``V >= sum_{o,i,j} v[d,o,i,j] x[d,o,i,j]`` for every
  slot (one arc per used slot, so that sum is the slot's ``v``). Times are scaled to
  integers (``resolution`` seconds per unit, about 1e-9 of the largest arc time); the
  reported ``bound`` subtracts the rounding slack, so it stays a proven lower bound on the
  float ``J``.

Warm start: ``hint`` (the DP's or the coarse DP's stages) is given as a complete solution
hint. Deterministic: one worker, a fixed seed and a *deterministic* time limit
(``max_deterministic_time``, CP-SAT's reproducible work measure), so the same inputs give
the same solution; a wall-clock limit (``wall_limit_s``) is only a safety net.

``arcs``: optionally, which ``(option, first, end)`` triples each slot may take (a
neighbourhood of a warm start on large clusters); the bound is then a bound over that
neighbourhood only, and the result says so (``restricted``).

Size: ``sum_d |arcs(d)|`` booleans, at most ``min(m, L) x options x L (L + 1) / 2``;
exact on small instances (``tests/unit/test_hetero_cpsat.py`` checks it against
:func:`~hetplan.algorithms.hetero_search.solve_brute_force`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hetplan.algorithms.hetero_search import HeteroProblem, StageChoice, objective

__all__ = ["CpSatResult", "solve_cpsat", "window_arcs"]

INF = float("inf")

#: ``arcs(d)``: the ``(option, first, end)`` triples slot ``d`` may take (None: all).
ArcFilter = Callable[[int], Sequence[tuple[int, int, int]]]


@dataclass(frozen=True)
class CpSatResult:
    """A CP-SAT solve.

    Attributes:
        stages: the best stages found, in pipeline order (empty: none found).
        objective: their ``J`` in seconds, recomputed in floating point
            (:func:`~hetplan.algorithms.hetero_search.objective`); inf when none found.
        bound: a proven lower bound on ``J`` over the model's space (seconds).
        gap: ``(objective - bound) / objective`` (0: proven optimal).
        status: CP-SAT's status name (``OPTIMAL``, ``FEASIBLE``, ``INFEASIBLE``, ``UNKNOWN``).
        booleans: arc booleans in the model.
        slots: stage slots in the model.
        restricted: the model covered only ``arcs`` (a neighbourhood), not every stage.
        deterministic_time: CP-SAT's deterministic work units spent (reproducible).
        wall_s: wall-clock seconds of the solve (varies run to run; keep it out of plans).
        hint_objective: ``J`` of the warm start (inf: none given).
    """

    stages: tuple[StageChoice, ...]
    objective: float
    bound: float
    gap: float
    status: str
    booleans: int
    slots: int
    restricted: bool
    deterministic_time: float
    wall_s: float
    hint_objective: float = INF


def _mode_for(problem: HeteroProblem, o: int, i: int, j: int, in_flight: int) -> int | None:
    opt = problem.options[o]
    for r in range(len(problem.modes)):
        if opt.q[r][i, j] >= in_flight:
            return r
    return None


def window_arcs(problem: HeteroProblem, hint: Sequence[StageChoice], window: int,
                options: Sequence[int] | None = None) -> tuple[int, ArcFilter]:
    """A neighbourhood of a warm start: as many slots as ``hint`` has stages, slot ``d``
    (stage ``P - 1 - d`` of the hint) takes any option of ``options`` (default all) over
    ``[i, j)`` with ``i`` and ``j`` within ``window`` layers of that stage's bounds.

    Returns:
        ``(slots, arcs)`` for :func:`solve_cpsat`.
    """
    P, L = len(hint), problem.num_layers
    opts = list(range(len(problem.options))) if options is None else list(options)
    cache: dict[int, list[tuple[int, int, int]]] = {}

    def arcs(d: int) -> Sequence[tuple[int, int, int]]:
        if d not in cache:
            s = hint[P - 1 - d]
            lo_i, hi_i = max(0, s.first - window), min(L - 1, s.first + window)
            lo_j, hi_j = max(1, s.end - window), min(L, s.end + window)
            cache[d] = [(o, i, j) for o in opts for i in range(lo_i, hi_i + 1)
                        for j in range(max(i + 1, lo_j), hi_j + 1)]
        return cache[d]

    return P, arcs


def solve_cpsat(problem: HeteroProblem, *, hint: Sequence[StageChoice] = (),
                max_slots: int | None = None, arcs: ArcFilter | None = None,
                deterministic_limit: float = 5.0, wall_limit_s: float = 30.0,
                seed: int = 0) -> CpSatResult:
    """Minimise ``J`` with CP-SAT (see the module docstring).

    Args:
        problem: the search problem (tables per option and recomputation mode).
        hint: a warm start (stages in pipeline order), e.g. the coarse DP's plan; ignored
            where it breaks the model's rules.
        max_slots: at most this many stages (default ``min(m, L)``); fewer than the optimum
            needs restricts the space (the result then says ``restricted``).
        arcs: per slot, the ``(option, first, end)`` triples allowed (default: all that fit);
            see :func:`window_arcs`.
        deterministic_limit: CP-SAT's ``max_deterministic_time`` (reproducible).
        wall_limit_s: wall-clock safety limit (a solve stopped by it may differ run to run).
        seed: CP-SAT's ``random_seed``.

    Returns:
        The best solution found with its proven bound and gap (empty ``stages``: no plan
        fits the model's space, or none was found within the limits).
    """
    # imported here: OR-Tools takes about a second to import (pandas with it), which every
    # `hetplan` command would pay otherwise
    from ortools.sat.python import cp_model

    t0 = time.perf_counter()
    L, m = problem.num_layers, problem.micro_batches
    full_slots = min(m, L)
    K = min(full_slots, max_slots) if max_slots is not None else full_slots
    restricted = arcs is not None or K < full_slots
    # 1. the arcs of each slot, at the cheapest mode that fits its depth
    table: list[list[tuple[int, int, int, int, float, float]]] = []
    allowed = problem.cut_allowed()
    for d in range(K):
        rows = []
        cand = arcs(d) if arcs is not None else [
            (o, i, j) for o in range(len(problem.options))
            for i in range(L) for j in range(i + 1, L + 1)]
        for o, i, j in cand:
            if not (allowed[i] and allowed[j]):
                continue  # a stage may only start and end at a cuttable boundary
            r = _mode_for(problem, o, i, j, min(m, d + 1))
            if r is None:
                continue
            opt = problem.options[o]
            a, v = float(opt.a[r][i, j]), float(opt.v[r][i, j])
            if math.isfinite(a) and math.isfinite(v):
                rows.append((o, r, i, j, a, v))
        table.append(rows)
    n_bool = sum(len(t) for t in table)
    hint_j = objective(problem, tuple(hint)) if hint else INF
    biggest = max((max(a, v) for t in table for (_, _, _, _, a, v) in t), default=0.0)
    if biggest <= 0.0 or not table or not table[0]:
        return CpSatResult((), INF, INF, 1.0, "INFEASIBLE", n_bool, K, restricted, 0.0,
                           time.perf_counter() - t0, hint_j)
    res = biggest / 1e9  # seconds per integer unit

    def units(t: float) -> int:
        return int(round(t / res))

    # 2. the model
    model = cp_model.CpModel()
    on = [model.new_bool_var(f"on{d}") for d in range(K)]
    x = [[model.new_bool_var(f"x{d}_{n}") for n in range(len(table[d]))] for d in range(K)]
    start = [model.new_int_var(0, L - 1, f"s{d}") for d in range(K)]
    model.add(on[0] == 1)
    V = model.new_int_var(0, units(biggest), "maxv")
    firsts = []
    for d in range(K):
        model.add(sum(x[d]) == on[d])
        if d + 1 < K:
            model.add_implication(on[d + 1], on[d])
        model.add(start[d] == sum(i * b for (_, _, i, _, _, _), b in zip(table[d], x[d])))
        end_d = sum(j * b for (_, _, _, j, _, _), b in zip(table[d], x[d]))
        if d == 0:
            model.add(end_d == L)
        else:  # a used slot d ends where slot d - 1 starts
            model.add(end_d == start[d - 1]).only_enforce_if(on[d])
        first = on[d] if d + 1 == K else None
        if first is None:
            first = model.new_bool_var(f"first{d}")
            model.add_bool_and([on[d], on[d + 1].negated()]).only_enforce_if(first)
            model.add_bool_or([on[d].negated(), on[d + 1]]).only_enforce_if(first.negated())
        model.add(start[d] == 0).only_enforce_if(first)
        firsts.append(first)
        model.add(V >= sum(units(v) * b for (*_, v), b in zip(table[d], x[d])))
    for c, cap in enumerate(problem.capacity):
        use = [problem.options[o].devices * b for d in range(K)
               for (o, *_), b in zip(table[d], x[d]) if problem.options[o].device_class == c]
        if use:
            model.add(sum(use) <= cap)
    model.minimize(sum(units(a) * b for d in range(K)
                       for (_, _, _, _, a, _), b in zip(table[d], x[d])) + V)
    # 3. the warm start, as a complete hint (every variable: a partial hint left the
    # single-worker search without any solution on 512 GPUs within 2 deterministic seconds)
    if hint and hint_j < INF and len(hint) <= K:
        P = len(hint)
        want = {(P - 1 - k, s.option, s.first, s.end) for k, s in enumerate(hint)}
        worst = 0
        for d in range(K):
            model.add_hint(on[d], d < P)
            model.add_hint(start[d], hint[P - 1 - d].first if d < P else 0)
            if firsts[d] is not on[d]:
                model.add_hint(firsts[d], d == P - 1)
            for (o, _, i, j, _, v), b in zip(table[d], x[d]):
                model.add_hint(b, (d, o, i, j) in want)
                worst = max(worst, units(v)) if (d, o, i, j) in want else worst
        model.add_hint(V, worst)
    # 4. solve, deterministically
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = seed
    solver.parameters.max_deterministic_time = deterministic_limit
    solver.parameters.max_time_in_seconds = wall_limit_s
    # presolve probing spent the whole limit on the arc booleans: GPT-2.7B on mixed-512
    # (2839 booleans) was proven optimal after 0.207 deterministic units with it and 0.028
    # without, and a 10 k-boolean neighbourhood found no solution in 2 units with it
    solver.parameters.cp_model_probing_level = 0
    status = solver.solve(model)
    name = solver.status_name(status)
    wall = time.perf_counter() - t0
    slack = (K + 1) * 0.5 * res  # rounding of the integer coefficients
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return CpSatResult((), INF, INF if name == "INFEASIBLE" else 0.0, 1.0, name, n_bool,
                           K, restricted, float(solver.deterministic_time), wall, hint_j)
    stages: list[StageChoice] = []
    for d in reversed(range(K)):
        if not solver.boolean_value(on[d]):
            continue
        for (o, r, i, j, _, _), b in zip(table[d], x[d]):
            if solver.boolean_value(b):
                stages.append(StageChoice(o, r, i, j))
    got = tuple(stages)
    j_float = objective(problem, got)
    if status == cp_model.OPTIMAL:  # optimal up to the integer resolution
        bound, gap = j_float, 0.0
    else:
        bound = min(j_float, max(0.0, solver.best_objective_bound * res - slack))
        gap = (j_float - bound) / j_float if j_float > 0 else 0.0
    return CpSatResult(got, j_float, bound, min(max(gap, 0.0), 1.0), name, n_bool, K,
                       restricted, float(solver.deterministic_time), wall, hint_j)
