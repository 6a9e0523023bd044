"""Heterogeneous pipelines: search each stage's device class, (dp, tp), order and layers.

:func:`compile_hetero` is read top to bottom:

1. **Classes**: the cluster's device classes (:func:`~hetplan.cost_models.hetero.
   device_classes`), by content, so the order of nodes in the cluster file changes nothing.
2. **Search**, per global micro-batch size (powers of two dividing the batch, at least one
   micro-batch per ... pipeline): the tables of :func:`~hetplan.cost_models.hetero.
   build_problem` and the exact DP (:func:`~hetplan.algorithms.hetero_search.solve_exact`)
   over layer splits, device use, stage degrees and recomputation; orders of classes come
   out of the DP (stages of any class in any order). On large clusters the DP runs in a
   coarser space (stages of whole device units); CP-SAT then re-solves a neighbourhood of
   its best plan at one-device resolution (:func:`_refine_best`,
   :mod:`hetplan.optimizer.hetero_refine`), and both are re-predicted.
3. **Re-predict** every plan the DP's threshold scans visit with the full simulator
   (:func:`~hetplan.cost_models.hetero.evaluate_hetero`) and keep the fastest; a scan
   stops only once its remaining plans' objective cannot be below the best predicted time,
   and a plan whose floor (:func:`lower_bound_s`) is above its scan's best is not
   predicted (:func:`search_hetero`). The scans restricted to each single (dp, tp) add
   their plans (the DP's front misses plans the simulator prefers), and a local search
   under the simulator starts from the best. The best plan with another order of classes
   is kept as the runner-up ``explain`` shows.
4. **Assemble** the plan: the layout of the pipeline (``dp = tp = 1``, the global
   micro-batch), the stages with their ranks (tp innermost), the ``hetero`` section,
   predictions and the pass log (method, objective, bound, gap, states).

Deterministic: ties go to the smaller objective, then the micro-batch size, then the stage
tuple.

About 630 lines: the search (steps 2-3) and the assembly (4) share :class:`HeteroCandidate`;
the search is the part to move to its own module when this file grows again.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from hetplan.algorithms.hetero_search import (
    HeteroProblem,
    HeteroSolution,
    StageChoice,
    StageOption,
    improve_locally,
    objective,
    solve_exact,
    state_count,
)
from hetplan.algorithms.pipeline_schedules import layout_actions
from hetplan.cost_models.compute import vocab_split
from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.engine_memory import tied_head_copy
from hetplan.cost_models.hetero import (
    MODES,
    DeviceClass,
    HeteroEvaluation,
    OptionInfo,
    assign_ranks,
    build_problem,
    coarse_units,
    device_classes,
    evaluate_hetero,
    hetero_predictions,
)
from hetplan.cost_models.memory import capture_bytes
from hetplan.cost_models.predict import provenance
from hetplan.cost_models.profile_db import ProfileDB
from hetplan.errors import InfeasiblePlanError, PassError, SpecError
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan import Plan
from hetplan.ir.plan_cpsat import CpSatRecord
from hetplan.ir.plan_hetero import Hetero, HeteroAlternative, HeteroSearch, StageShape
from hetplan.ir.plan_sections import (
    ClusterRef,
    CostSettings,
    Layout,
    ModelRef,
    PassLogEntry,
    Stage,
    WorkloadSummary,
)
from hetplan.optimizer.hetero_passes import with_passes
from hetplan.passes.base import Pass

__all__ = ["compile_hetero", "choose_hetero", "HeteroCandidate", "search_hetero", "predict",
           "cpsat_note",
           "rebuild_alternative", "lower_bound_s", "COARSE_GAP"]

#: Where the device-use space is coarsened (:func:`~hetplan.cost_models.hetero.
#: coarse_units`: large clusters), the threshold scan may skip windows of ``max v`` of this
#: relative width (a proven gap of at most about 2 % on the objective, recorded in the
#: plan): GPT-2-medium on 512 GPUs, 35-66 passes per micro-batch size without it.
COARSE_GAP = 0.02


@dataclass(frozen=True)
class HeteroCandidate:
    """One solved micro-batch size: its solution, options and plan pieces."""

    micro_batch: int
    micro_batches: int
    solution: HeteroSolution
    infos: tuple[OptionInfo, ...]
    classes: tuple[DeviceClass, ...]
    layout: Layout = field(compare=False)
    stages: tuple[Stage, ...] = field(compare=False)
    hetero: Hetero = field(compare=False)
    evaluation: HeteroEvaluation | None = field(default=None, compare=False)
    #: not predicted: :func:`lower_bound_s` (``bound_s``) put it above its scan's best
    skipped: bool = field(default=False, compare=False)
    bound_s: float = field(default=0.0, compare=False)
    #: found by :func:`~hetplan.algorithms.hetero_search.improve_locally` from the best
    #: visited plan, not visited by a scan
    local: bool = field(default=False, compare=False)

    @property
    def predicted_s(self) -> float:
        """The simulator's iteration time (inf: skipped, or does not fit)."""
        return self.evaluation.iteration_s if self.evaluation is not None else float("inf")

    @property
    def order(self) -> tuple[str, ...]:
        """Class names along the pipeline, consecutive repeats merged."""
        out: list[str] = []
        for s in self.hetero.stages:
            if not out or out[-1] != s.device_class:
                out.append(s.device_class)
        return tuple(out)


def _micro_batch_sizes(batch: int) -> list[int]:
    sizes = {batch}
    p = 1
    while p < batch:
        if batch % p == 0:
            sizes.add(p)
        p *= 2
    return sorted(sizes)


#: A plan by content: see :func:`_key`.
Key = tuple[int, tuple[tuple[int, int, int, int, int, int], ...]]


def _key(mb: int, stages: tuple[StageChoice, ...], infos: list[OptionInfo]) -> Key:
    """A plan by content (micro-batch, then per stage class, tp, dp, mode, layers: the
    order of the option indices of :func:`build_problem`), so the plans of a restricted
    problem (other option indices) meet the unrestricted ones."""
    return mb, tuple((infos[s.option].device_class, infos[s.option].tp, infos[s.option].dp,
                      s.mode, s.first, s.end) for s in stages)


def _compute_prefix(option: StageOption) -> np.ndarray:
    """Per layer boundary ``l``, the option's forward + backward seconds of layers
    ``[0, l)`` for one micro-batch without recomputation: ``a`` of the first mode from
    layer 0 (no resharding into the first stage), whose ranges are prefix differences."""
    return np.concatenate([[0.0], option.a[0][0, 1:]])


def lower_bound_s(problem: HeteroProblem, stages: tuple[StageChoice, ...]) -> float:
    """A floor on the simulator's iteration time of a plan, from the search tables alone.

    Stage ``k`` runs ``m`` forwards and backwards of at least ``T_k`` seconds each (its
    per-micro-batch compute without recomputation) and cannot start before micro-batch 0
    has passed the stages before it, whose backwards then close the iteration:
    ``max_k sum_{j<k} T_j + m T_k``. Transfers, sync and the optimizer step only add."""
    m = problem.micro_batches
    before = out = 0.0
    for s in stages:
        pre = _compute_prefix(problem.options[s.option])
        t = float(pre[s.end] - pre[s.first])
        out = max(out, before + m * t)
        before += t
    return out


def space_floor_s(problem: HeteroProblem) -> float:
    """A floor on the simulator's time of every plan of ``problem``
    (:func:`lower_bound_s`'s, relaxed): the last stage closes after every stage's first
    micro-batch, ``sum_k T_k >= sum_layer min_o t_o(layer)``; and the bottleneck takes
    ``m max_k T_k``, where the device seconds ``sum_k d_k T_k`` are at least each layer's
    least ``devices x t`` over the options, shared by at most every device."""
    if not problem.options:
        return float("inf")
    times = np.array([np.diff(_compute_prefix(o)) for o in problem.options])
    devices = np.array([[o.devices] for o in problem.options], dtype=float)
    fill = float(times.min(axis=0).sum())
    busy = problem.micro_batches * float((devices * times).min(axis=0).sum()) / sum(
        problem.capacity)
    return max(fill, busy)


#: The floor of :func:`lower_bound_s` is summed in another order than the simulator's
#: times: a plan is skipped only when the floor clears the best time by this much.
_BOUND_SLACK = 1e-9


@dataclass
class _Search:
    """What every scan of one :func:`search_hetero` call shares: the built problems per
    micro-batch size and the simulator's predictions by plan content."""

    workload: WorkloadSummary
    costs: CostModel
    classes: tuple[DeviceClass, ...]
    units: tuple[int, ...]
    problems: list[tuple[int, int, HeteroProblem, list[OptionInfo]]]
    max_states: int
    judge: bool
    predicted: dict[Key, HeteroEvaluation | None] = field(default_factory=dict)

    @property
    def coarse(self) -> bool:
        return any(u > 1 for u in self.units)

    def predict(self, key: Key, cand: HeteroCandidate) -> HeteroEvaluation | None:
        if key not in self.predicted:
            self.predicted[key] = predict(self.workload, self.costs, cand)
        return self.predicted[key]


def search_hetero(workload: WorkloadSummary, costs: CostModel, batch_size: int, *,
                  micro_batch: int | None = None, max_tp: int = 8,
                  restrict: tuple[int, int] | None = None,
                  max_states: int = 5_000_000, judge: bool = True,
                  seed_single: bool = True, local: bool = True,
                  cpsat: bool = True) -> list[HeteroCandidate]:
    """The plans the exact DP visits, over every micro-batch size, best first.

    Each micro-batch size's threshold scan visits the Pareto front of ``(sum a, max v)``
    (:attr:`HeteroSolution.front`). With ``judge`` every visited plan is re-predicted by the
    simulator (:func:`predict`) unless :func:`lower_bound_s` already puts it above the
    scan's best predicted time (then it is kept with ``skipped``: it cannot be the scan's
    best, and the scan runs exactly as if it had been predicted); a scan stops only once no
    plan left in it has an objective below the best predicted time so far. Candidates are
    sorted by predicted time. Without ``judge`` a scan stops at the objective's own optimum
    and candidates are sorted by objective.

    ``restrict``: only stages of this ``(dp, tp)`` (the best plan with one (dp, tp) for all
    stages, a bench baseline).

    ``seed_single`` (with ``judge``, in exact spaces): after the unrestricted scans, the
    scans restricted to each ``(dp, tp)`` run too (few options: cheap passes) and their
    plans join the candidates. The DP's front misses plans the simulator prefers (its
    objective does not see the pipeline transfers of the 1F1B steady state: gpt2-medium on
    mixed-tp-node, the front's best predicts 428.9 ms where a single-(dp, tp) plan off the
    front predicts 407.1 ms). A pair is skipped when :func:`space_floor_s` of its space is
    above the best so far, and each restricted scan starts from the best predicted time so
    far, so it visits every plan of its front whose objective is below it: the chosen plan
    is never predicted slower than the best single-(dp, tp) plan as long as that plan's
    objective is not above the best's predicted time (the objective is optimistic but for
    resharding, which it prices as cross-node).

    ``local`` (with ``judge``, unrestricted): from the best predicted plan, a
    first-improvement local search under the simulator
    (:func:`~hetplan.algorithms.hetero_search.improve_locally`: boundaries moved by one or
    two layers, neighbouring stages' options swapped); a better plan it finds joins the
    candidates with ``local`` set (2.7B on mixed-generations: 1525.4 -> 1520.6 ms). Not
    run with ``restrict``, so the single-(dp, tp) searches stay the scans the seeds repeat.

    ``cpsat``: in a coarse space, refine the best plan with CP-SAT at one-device resolution
    (:func:`_refine_best`).

    Order: micro-batch counts near the layer count first (the best plans of the bench lie
    there), so later scans start from a low best and stop early. Each micro-batch size's
    tables are built once and each plan is predicted at most once."""
    classes = device_classes(costs)
    units = coarse_units(classes)
    problems = []
    for mb in [micro_batch] if micro_batch else _micro_batch_sizes(batch_size):
        problem, infos = build_problem(workload, costs, classes, mb, batch_size // mb,
                                       max_tp=max_tp, units=units)
        problems.append((mb, batch_size // mb, problem, infos))
    # micro-batch counts near the layer count first (deep pipelines with small bubbles:
    # where the best plans of the bench lie), so the later scans start from a low best
    # and stop early; the order changes no plan's prediction
    problems.sort(key=lambda x: (abs(math.log2(x[1]) - math.log2(x[2].num_layers)), x[0]))
    ctx = _Search(workload, costs, classes, units, problems, max_states, judge)
    out = _scan(ctx, restrict)
    if restrict is None and judge and seed_single and not ctx.coarse:
        seen = {_key(c.micro_batch, c.solution.stages, list(c.infos)) for c in out}
        pairs = sorted({(o.dp, o.tp) for *_, infos in problems for o in infos},
                       key=lambda p: (p[1], p[0]))
        for pair in pairs:
            best = min((c.predicted_s for c in out), default=float("inf"))
            if _pair_floor_s(ctx, pair) * (1.0 - _BOUND_SLACK) > best:
                continue  # no plan of this (dp, tp) can beat the best so far
            for cand in _scan(ctx, pair, best):
                key = _key(cand.micro_batch, cand.solution.stages, list(cand.infos))
                if key not in seen:
                    seen.add(key)
                    out.append(cand)
    if judge and local and restrict is None:
        out += _improve(ctx, out)
    if ctx.coarse and cpsat and out:
        out = _refine_best(workload, costs, classes, out, judge, max_tp)
    out.sort(key=lambda c: (c.predicted_s if judge else c.solution.objective,
                            c.solution.objective, c.micro_batch,
                            _key(c.micro_batch, c.solution.stages, list(c.infos))))
    return out


def _improve(ctx: _Search, cands: list[HeteroCandidate]) -> list[HeteroCandidate]:
    """The plan :func:`improve_locally` reaches from the best predicted candidate, as a
    candidate (none if no move improves it). Moves are judged by the simulator unless
    :func:`lower_bound_s` already puts them above the plan they would replace."""
    fits = [c for c in cands if c.evaluation is not None]
    if not fits:
        return []
    start = min(fits, key=lambda c: (c.predicted_s, c.solution.objective, c.micro_batch,
                                     _key(c.micro_batch, c.solution.stages, list(c.infos))))
    mb, m = start.micro_batch, start.micro_batches
    _, _, problem, infos = next(x for x in ctx.problems if x[0] == mb)
    index = {(o.device_class, o.dp, o.tp): k for k, o in enumerate(infos)}
    if any((start.infos[s.option].device_class, start.infos[s.option].dp,
            start.infos[s.option].tp) not in index for s in start.solution.stages):
        return []  # a plan outside the searched options (none today): nothing to climb
    stages = tuple(StageChoice(index[(start.infos[s.option].device_class,
                                      start.infos[s.option].dp, start.infos[s.option].tp)],
                               s.mode, s.first, s.end) for s in start.solution.stages)
    evals: dict[tuple[StageChoice, ...], HeteroEvaluation | None] = {}
    best = [start.predicted_s]

    def judge(st: tuple[StageChoice, ...]) -> float:
        if lower_bound_s(problem, st) * (1.0 - _BOUND_SLACK) > best[0]:
            return float("inf")  # cannot improve on the plan it would replace
        cand = _candidate(ctx.workload, mb, m, HeteroSolution(st, 0.0, 0.0, "exact-dp"),
                          infos, ctx.classes, ctx.units)
        ev = evals[st] = ctx.predict(_key(mb, st, infos), cand)
        t = ev.iteration_s if ev is not None else float("inf")
        best[0] = min(best[0], t)
        return t

    found, t, _ = improve_locally(problem, stages, judge)
    if found == stages or t >= start.predicted_s:
        return []
    j = objective(problem, found)
    # the plan it started from records the gap of its scan (coarse spaces: the windows
    # skipped); the local plan keeps that relative gap
    ratio = start.solution.bound / start.solution.objective if start.solution.objective else 1.0
    sol = HeteroSolution(found, j, j * min(ratio, 1.0), start.solution.method,
                         start.solution.states)
    cand = _candidate(ctx.workload, mb, m, sol, infos, ctx.classes, ctx.units)
    return [dataclasses.replace(cand, evaluation=evals[found], local=True)]


def _restricted(problem: HeteroProblem, infos: list[OptionInfo],
                restrict: tuple[int, int] | None) -> tuple[HeteroProblem, list[OptionInfo]]:
    """``problem`` with only the options of ``(dp, tp) == restrict`` (None: all)."""
    if restrict is None:
        return problem, infos
    keep = [k for k, o in enumerate(infos) if (o.dp, o.tp) == restrict]
    return (HeteroProblem(problem.num_layers, tuple(problem.options[k] for k in keep),
                          problem.capacity, problem.micro_batches, problem.modes,
                          problem.unit, problem.cuttable), [infos[k] for k in keep])


def _pair_floor_s(ctx: _Search, pair: tuple[int, int]) -> float:
    """:func:`space_floor_s` of the scan restricted to ``pair``, over its micro-batch sizes
    (inf: no option has that pair)."""
    out = float("inf")
    for _, _, problem, infos in ctx.problems:
        sub, _ = _restricted(problem, infos, pair)
        if sub.options:
            out = min(out, space_floor_s(sub))
    return out


def _scan(ctx: _Search, restrict: tuple[int, int] | None, incumbent: float = float("inf")
          ) -> list[HeteroCandidate]:
    """One threshold scan per micro-batch size over the options of ``restrict`` (None:
    all), carrying the best predicted time (with ``judge``) or objective from one size to
    the next; the visited plans, unsorted."""
    out: list[HeteroCandidate] = []
    best_objective = float("inf")
    judge, coarse = ctx.judge, ctx.coarse
    for mb, m, problem, infos in ctx.problems:
        problem, infos = _restricted(problem, infos, restrict)
        if not problem.options or state_count(problem) > ctx.max_states:
            continue
        if space_floor_s(problem) * (1.0 - _BOUND_SLACK) > incumbent:
            continue  # every plan of this size predicts slower than the best so far
        judged: dict[tuple[StageChoice, ...], HeteroCandidate] = {}
        # the scan's best judged time, as solve_exact holds it (min of incumbent and judge)
        floor = [incumbent]

        def _judge(stages: tuple[StageChoice, ...], mb: int = mb, m: int = m,
                   infos: list[OptionInfo] = infos, problem: HeteroProblem = problem,
                   floor: list[float] = floor) -> float:
            cand = _candidate(ctx.workload, mb, m, HeteroSolution(stages, 0.0, 0.0, "exact-dp"),
                              infos, ctx.classes, ctx.units)
            bound = lower_bound_s(problem, stages)
            if bound * (1.0 - _BOUND_SLACK) > floor[0]:
                # predicted, it could not lower the scan's best: skip the simulator
                judged[stages] = dataclasses.replace(cand, skipped=True, bound_s=bound)
                return bound
            ev = ctx.predict(_key(mb, stages, infos), cand)
            judged[stages] = dataclasses.replace(cand, evaluation=ev, bound_s=bound)
            t = ev.iteration_s if ev is not None else float("inf")
            floor[0] = min(floor[0], t)
            return t

        # exact spaces: the scan runs on to the best predicted time; coarse (large) ones
        # stop at the objective's optimum and only their visited plans are re-predicted
        sol = solve_exact(problem, max_states=ctx.max_states,
                          incumbent=incumbent if judge and not coarse else best_objective,
                          judge=_judge if judge and not coarse else None,
                          rel_gap=COARSE_GAP if coarse else 0.0)
        if sol is None:
            continue
        best_objective = min(best_objective, sol.objective)
        for j, stages in sol.front:
            one = HeteroSolution(stages, j, sol.bound if stages == sol.stages else j,
                                 sol.method, sol.states)
            cand = _candidate(ctx.workload, mb, m, one, infos, ctx.classes, ctx.units)
            if judge:
                if stages not in judged:
                    _judge(stages)
                done = judged[stages]
                cand = dataclasses.replace(cand, evaluation=done.evaluation,
                                           skipped=done.skipped, bound_s=done.bound_s)
                if cand.evaluation is not None:
                    incumbent = min(incumbent, cand.evaluation.iteration_s)
            out.append(cand)
    return out


def _refine_best(workload: WorkloadSummary, costs: CostModel, classes: tuple[DeviceClass, ...],
                 out: list[HeteroCandidate], judge: bool, max_tp: int) -> list[HeteroCandidate]:
    """CP-SAT around the best coarse plan (:mod:`hetplan.optimizer.hetero_refine`): its
    record goes on that plan and, where CP-SAT found a smaller objective, on a new
    candidate at one-device resolution (re-predicted like the others)."""
    from hetplan.optimizer.hetero_refine import refine_stages  # imports OR-Tools (~1 s)

    def rank(c: HeteroCandidate) -> tuple[float, float, int, Key]:
        return (c.predicted_s if judge else c.solution.objective, c.solution.objective,
                c.micro_batch, _key(c.micro_batch, c.solution.stages, list(c.infos)))

    old = best = min(out, key=rank)
    ref = refine_stages(workload, costs, classes, best.micro_batch, best.micro_batches,
                        [(best.infos[s.option], s) for s in best.solution.stages],
                        max_tp=max_tp)
    if ref is None:
        return out
    res, record, new = ref.result, ref.record, None
    if res.stages and res.objective < res.hint_objective:
        ones = tuple(1 for _ in classes)
        new = _candidate(workload, best.micro_batch, best.micro_batches,
                         HeteroSolution(res.stages, res.objective, res.bound, "cp-sat"),
                         list(ref.infos), classes, ones)
        ev = predict(workload, costs, new) if judge else None
        taken = (ev is not None and ev.iteration_s < best.predicted_s) if judge else True
        record = record.model_copy(update={
            "taken": taken, "predicted_ms": ev.iteration_s * 1e3 if ev is not None else 0.0})
        new = dataclasses.replace(new, evaluation=ev, hetero=new.hetero.model_copy(update={
            "search": new.hetero.search.model_copy(update={
                "method": "coarse-dp+cp-sat", "cpsat": record,
                "bound_ms": record.bound_ms, "gap": record.gap})}))
    best = dataclasses.replace(best, hetero=best.hetero.model_copy(update={
        "search": best.hetero.search.model_copy(update={"cpsat": record})}))
    return [best if c is old else c for c in out] + ([new] if new is not None else [])


def _candidate(workload: WorkloadSummary, mb: int, m: int, sol: HeteroSolution,
               infos: list[OptionInfo], classes: tuple[DeviceClass, ...],
               units: tuple[int, ...]) -> HeteroCandidate:
    chosen = [infos[s.option] for s in sol.stages]
    ranks = assign_ranks(classes, [(o.device_class, o.dp, o.tp) for o in chosen])
    names = [x.name for x in workload.layers]
    stages = tuple(
        Stage(index=k, first_layer=s.first, last_layer=s.end - 1,
              layer_names=tuple(names[s.first:s.end]), ranks=r, recompute=MODES[s.mode])  # type: ignore[arg-type]
        for k, (s, r) in enumerate(zip(sol.stages, ranks)))
    shapes = tuple(StageShape(stage=k, device_class=classes[o.device_class].name, dp=o.dp,
                              tp=o.tp, micro_batch_size=mb // o.dp, zero_stage=o.zero_stage)  # type: ignore[arg-type]
                   for k, o in enumerate(chosen))
    layout = Layout(dp=1, pp=len(stages), tp=1, micro_batches=m, micro_batch_size=mb,
                    global_batch_size=mb * m, schedule="1f1b")
    coarse = any(u > 1 for u in units)
    gap = (sol.objective - sol.bound) / sol.objective if sol.objective > 0 else 0.0
    hetero = Hetero(stages=shapes, search=HeteroSearch(
        method="coarse-dp" if coarse else "exact-dp", objective_ms=sol.objective * 1e3,
        bound_ms=sol.bound * 1e3, gap=min(max(gap, 0.0), 1.0), states=sol.states,
        units=units))
    return HeteroCandidate(mb, m, sol, tuple(infos), classes, layout, stages, hetero)


def predict(workload: WorkloadSummary, costs: CostModel, cand: HeteroCandidate
            ) -> HeteroEvaluation | None:
    """The full simulator's prediction of a candidate (None: it does not fit)."""
    try:
        return evaluate_hetero(workload, cand.layout, cand.stages, cand.hetero, costs)
    except InfeasiblePlanError:
        return None


def compile_hetero(workload: WorkloadSummary, costs: CostModel, batch_size: int, *,
                   model_ref: ModelRef, cluster_ref: ClusterRef,
                   cost_settings: CostSettings | None = None, micro_batch: int | None = None,
                   max_tp: int = 8, passes: Sequence[Pass] = (),
                   allow_tied_split: bool = True) -> Plan:
    """The fastest heterogeneous pipeline plan (see the module docstring).

    ``allow_tied_split=False`` (what ``hetplan plan --hetero`` asks, :func:`choose_hetero`)
    keeps a model whose LM head is tied to its token embedding (GPT-2) on one stage: the
    runtime does not sum tied gradients across stages of different degrees, so a split one
    is a plan for the simulator only (``hetplan run`` refuses it at setup).

    ``passes``: the pass pipeline to apply to the chosen stages
    (:func:`~hetplan.passes._hetero_sync.run_hetero_passes`: gradient-sync passes per
    stage, the others logged with why they do not apply); with a gradient-sync section the
    plan is re-predicted with each stage's per-bucket DP timeline, and the pass log gives
    both predictions. The search itself ranks with the closed-form ring sync.

    Raises:
        InfeasiblePlanError: no pipeline of any micro-batch size fits in memory.
    """
    cands = search_hetero(workload, costs, batch_size, micro_batch=micro_batch, max_tp=max_tp)
    fits = [c for c in cands if c.evaluation is not None]
    tied = tied_head_copy(costs.memory_layers(workload), capture_bytes(workload), False)
    allowed = cands  # what the plan and its runner-up may be
    if tied is not None and fits and not allow_tied_split:
        # the runtime does not sum a tied embedding's gradients across stages of different
        # degrees (runtime/pipeline.stage_modules refuses them): one stage only
        allowed = [c for c in cands if len(c.stages) == 1]
        fits = [c for c in fits if len(c.stages) == 1]
        if not fits:
            raise InfeasiblePlanError(
                "the model's LM head is tied to its token embedding, and the runtime does "
                "not sum tied gradients across stages of different data- or tensor-parallel "
                "degrees; no one-stage heterogeneous plan fits: re-plan with --hetero off")
    if not fits:
        raise InfeasiblePlanError(
            f"no heterogeneous pipeline of the {len(costs.devices)} devices fits the model "
            f"in memory at any micro-batch size dividing the batch of {batch_size}; use a "
            "smaller batch or a cluster with more memory")
    best = fits[0]
    ev = best.evaluation
    assert ev is not None
    runner = _runner_up(best, _with_skipped_predicted(workload, costs, best, allowed))
    search = best.hetero.search.model_copy(update={"runner_up": runner})
    hetero = best.hetero.model_copy(update={
        "search": search,
        "stages": tuple(s.model_copy(update={"reshard_in_ms": r * 1e3})
                        for s, r in zip(best.hetero.stages, ev.reshard_s))})
    stages = tuple(st.model_copy(update={"fwd_ms": f * 1e3, "bwd_ms": b * 1e3,
                                         "memory_bytes": ev.memory[st.ranks[0]].total})
                   for st, f, b in zip(best.stages, ev.fwd_s, ev.bwd_s))
    by_objective = min(cands, key=lambda c: (c.solution.objective, c.micro_batch))
    obj_ev = by_objective.evaluation
    if by_objective.skipped:
        obj_ev = predict(workload, costs, by_objective)
    obj_ms = obj_ev.iteration_s * 1e3 if obj_ev is not None else float("inf")
    skipped = sum(c.skipped for c in cands)
    visited = min((c.predicted_s for c in fits if not c.local), default=float("inf"))
    local = (f"a local search from the best visited plan ({visited * 1e3:.3f} ms) moved "
             "boundaries / swapped neighbouring stages to it; " if best.local else "")
    note = (f"exact DP over {len({c.micro_batch for c in cands})} micro-batch size(s) visited "
            f"{len(cands) - best.local} plan(s) (with the scans restricted to one (dp, tp) "
            f"each), {len(cands) - best.local - skipped} re-predicted by the simulator "
            f"({len(fits)} fit), "
            f"{skipped} skipped by a lower bound above their scan's best; "
            f"{hetero.search.method}, device units {list(hetero.search.units)}, objective gap "
            f"{hetero.search.gap:.4f}; "
            f"{local}chose {hetero.describe()} micro-batch "
            f"{best.micro_batch}x{best.micro_batches}: "
            f"predicted {ev.iteration_s * 1e3:.3f} ms, objective "
            f"{best.solution.objective * 1e3:.3f} ms; the objective's best "
            f"({by_objective.hetero.describe()}, {by_objective.solution.objective * 1e3:.3f} "
            f"ms) predicts {obj_ms:.3f} ms")
    notes = (note,) + ((cpsat_note(hetero.search.cpsat),) if hetero.search.cpsat else ())
    plan = Plan(model=model_ref, cluster=cluster_ref, layout=best.layout, stages=stages,
                pipeline_actions=layout_actions(best.layout), hetero=hetero,
                cost_settings=cost_settings, precision=costs.precision,
                pass_log=(PassLogEntry(name="hetero-search", changed=True, notes=notes),))
    if passes:
        plan, ev = with_passes(workload, costs, plan, passes, ev)
    plan = plan.model_copy(update={
        "predictions": hetero_predictions(ev), "provenance": provenance(ev.stages, costs)})
    return Plan.model_validate(plan.model_dump())


def cpsat_note(rec: CpSatRecord) -> str:
    """The pass log's (and ``inspect``'s) line on a CP-SAT refinement."""
    verdict = ("taken" if rec.taken else
               f"not taken (predicted {rec.predicted_ms:.3f} ms)" if rec.predicted_ms else
               "not taken")
    return (f"cp-sat at one-device resolution around the coarse plan (window {rec.window} "
            f"layer(s), {rec.slots} stage(s), {rec.booleans} booleans, warm start "
            f"{rec.hint_objective_ms:.3f} ms): {rec.status}, objective "
            f"{rec.objective_ms:.3f} ms, bound {rec.bound_ms:.3f} ms, gap {rec.gap:.4f} "
            f"within the neighbourhood, {rec.deterministic_time:.3f} of "
            f"{rec.deterministic_limit:g} deterministic units; {verdict}")


def _with_skipped_predicted(workload: WorkloadSummary, costs: CostModel,
                            best: HeteroCandidate, cands: list[HeteroCandidate]
                            ) -> list[HeteroCandidate]:
    """The predicted candidates, plus the skipped ones of another order of classes than
    ``best``'s whose lower bound is below the fastest such predicted one (only those could
    be the runner-up), predicted now; sorted as :func:`search_hetero` sorts."""
    fits = [c for c in cands if c.evaluation is not None]
    other = [c.predicted_s for c in fits if c.order != best.order]
    limit = min(other, default=float("inf"))
    for c in cands:
        if c.skipped and c.order != best.order and c.bound_s <= limit:
            ev = predict(workload, costs, c)
            if ev is not None:
                fits.append(dataclasses.replace(c, evaluation=ev, skipped=False))
    fits.sort(key=lambda c: (c.predicted_s, c.solution.objective, c.micro_batch,
                             _key(c.micro_batch, c.solution.stages, list(c.infos))))
    return fits


def _runner_up(best: HeteroCandidate, fits: list[HeteroCandidate]) -> HeteroAlternative | None:
    """The best re-predicted candidate whose order of classes differs from ``best``'s."""
    for cand in fits:
        if cand.order == best.order or cand.evaluation is None:
            continue
        return HeteroAlternative(
            order=cand.hetero.order,
            degrees=tuple(f"{s.dp}x{s.tp}" for s in cand.hetero.stages),
            iteration_time_ms=cand.evaluation.iteration_s * 1e3,
            note=f"micro-batch {cand.micro_batch}x{cand.micro_batches}; search objective "
                 f"{cand.solution.objective * 1e3:.3f} ms vs "
                 f"{best.solution.objective * 1e3:.3f} ms",
            first_layers=tuple(st.first_layer for st in cand.stages),
            recompute=tuple(st.recompute for st in cand.stages),
            micro_batch_size=cand.micro_batch, micro_batches=cand.micro_batches)
    return None


def rebuild_alternative(workload: WorkloadSummary, costs: CostModel, alt: HeteroAlternative
                        ) -> tuple[Layout, tuple[Stage, ...], Hetero]:
    """The layout, stages and section of a stored runner-up, for re-predicting it
    (``hetplan explain``). Ranks are drawn from each class as :func:`compile_hetero` draws
    them.

    Raises:
        SpecError: the alternative names a device class the cluster lacks, or lacks its
            layer splits (a plan written before they were recorded).
    """
    classes = device_classes(costs)
    index = {c.name: k for k, c in enumerate(classes)}
    if not alt.first_layers or len(alt.first_layers) != len(alt.order):
        raise SpecError("hetero.search.runner_up: no layer splits recorded; re-run "
                        "`hetplan plan --hetero`")
    missing = [n for n in alt.order if n not in index]
    if missing:
        raise SpecError(f"hetero.search.runner_up: device class(es) {missing} are not in the "
                        f"cluster (classes: {sorted(index)})")
    dims = [tuple(int(x) for x in d.split("x")) for d in alt.degrees]
    shapes = [(index[n], dp, tp) for n, (dp, tp) in zip(alt.order, dims)]
    ranks = assign_ranks(classes, shapes)
    ends = list(alt.first_layers[1:]) + [len(workload.layers)]
    names = [x.name for x in workload.layers]
    mb, m = alt.micro_batch_size, alt.micro_batches
    stages = tuple(
        Stage(index=k, first_layer=a, last_layer=b - 1, layer_names=tuple(names[a:b]),
              ranks=r, recompute=alt.recompute[k] if alt.recompute else "none")
        for k, (a, b, r) in enumerate(zip(alt.first_layers, ends, ranks)))
    hetero = Hetero(stages=tuple(
        StageShape(stage=k, device_class=n, dp=dp, tp=tp, micro_batch_size=mb // dp,
                   zero_stage=1 if dp > 1 else 0)
        for k, (n, (dp, tp)) in enumerate(zip(alt.order, dims))))
    layout = Layout(dp=1, pp=len(stages), tp=1, micro_batches=m, micro_batch_size=mb,
                    global_batch_size=mb * m, schedule="1f1b")
    return layout, stages, hetero


def choose_hetero(plan: Plan, spec: ClusterSpec, db: ProfileDB | None, batch_size: int,
                  mode: Literal["auto", "on", "off"], passes: Sequence[Pass] = ()) -> Plan:
    """``hetplan plan --hetero``: ``compile()``'s ``plan`` or the heterogeneous one.

    ``off`` returns ``plan``; ``on`` returns :func:`compile_hetero`'s plan with ``passes``
    (``compile()``'s pipeline) applied per stage; ``auto`` the one predicted faster (ties
    keep ``plan``). Both are priced by one cost model (``plan``'s
    cost settings and profile) and the same pipeline simulator; ``compile()``'s prediction
    runs the per-bucket gradient sync of its passes, and so does the heterogeneous one's
    when ``passes`` hold gradient-sync passes (per stage, on each stage's own DP group;
    without them, the ring sync of :func:`~hetplan.cost_models.hetero.sync_s`). The plan
    returned records the
    comparison in its pass log.

    Raises:
        InfeasiblePlanError: with ``on``, no heterogeneous pipeline fits.
        PassError: with ``on``, a pass refuses the heterogeneous pipeline (``auto`` keeps
            ``plan`` then, as when none fits).
    """
    if mode == "off":
        return plan
    cs = plan.cost_settings or CostSettings(vocab_parallel="unstated")
    workload = plan.model.workload
    costs = CostModel(spec, db, dtype=cs.dtype, efficiency=cs.efficiency, optimizer=cs.optimizer,
                      attention=cs.attention, dp_overlap=cs.dp_overlap, fusion=cs.fusion,
                      grad_accumulation=cs.grad_accumulation,
                      vocab_parallel=vocab_split(cs.vocab_split, workload))
    if workload is None:
        raise InfeasiblePlanError("the plan carries no workload summary to search "
                                  "heterogeneous stages over; re-run `hetplan plan`")
    base_ms = plan.predictions.iteration_time_ms if plan.predictions else float("inf")
    try:
        het = compile_hetero(workload, costs, batch_size, model_ref=plan.model,
                             cluster_ref=ClusterRef.from_cluster(spec), cost_settings=cs,
                             passes=passes, allow_tied_split=False)
    except InfeasiblePlanError as e:
        if mode == "on":
            raise
        return _noted(plan, f"--hetero auto: no heterogeneous pipeline fits ({e}); kept "
                            f"compile()'s plan ({base_ms:.3f} ms)")
    except PassError as e:  # a pass refuses per-stage degrees (DynPipe's re-packing)
        if mode == "on":
            raise
        return _noted(plan, f"--hetero auto: a pass refuses the heterogeneous pipeline ({e}); "
                            f"kept compile()'s plan ({base_ms:.3f} ms)")
    assert het.predictions is not None
    het_ms = het.predictions.iteration_time_ms
    if mode == "on" or het_ms < base_ms:
        sched = plan.layout.schedule if plan.layout is not None else "1f1b"
        # the heterogeneous search plans 1F1B pipelines only: say so when compile()'s differed
        only = (f"; its schedule is 1f1b (the heterogeneous search plans 1F1B only; compile()'s "
                f"plan ran {sched})" if sched != "1f1b" else "")
        return _noted(het, f"--hetero {mode}: heterogeneous {het_ms:.3f} ms vs compile()'s "
                           f"{base_ms:.3f} ms ({_layout_text(plan)}); took the heterogeneous "
                           f"plan{only}")
    return _noted(plan, f"--hetero auto: compile()'s {base_ms:.3f} ms vs heterogeneous "
                        f"{het_ms:.3f} ms ({het.hetero.describe() if het.hetero else '-'}); "
                        "kept compile()'s plan")


def _layout_text(plan: Plan) -> str:
    lay = plan.layout
    if lay is None:
        return "-"
    return f"dp{lay.dp} pp{lay.pp} tp{lay.tp}, micro-batch {lay.micro_batch_size}x{lay.micro_batches}"


def _noted(plan: Plan, note: str) -> Plan:
    return plan.model_copy(update={"pass_log": plan.pass_log + (
        PassLogEntry(name="hetero-choice", changed=plan.hetero is not None, notes=(note,)),)})
