"""Heterogeneous pipelines: search each stage's device class, (dp, tp), order and layers.

:func:`compile_hetero` is read top to bottom:

1. **Classes**: the cluster's device classes (:func:`~hetplan.cost_models.hetero.
   device_classes`), by content, so the order of nodes in the cluster file changes nothing.
2. **Search**, per global micro-batch size (powers of two dividing the batch, at least one
   micro-batch per ... pipeline): the tables of :func:`~hetplan.cost_models.hetero.
   build_problem` and the exact DP (:func:`~hetplan.algorithms.hetero_search.solve_exact`)
   over layer splits, device use, stage degrees and recomputation; orders of classes come
   out of the DP (stages of any class in any order).
3. **Re-predict** the :data:`FINALISTS` best solutions with the full simulator
   (:func:`~hetplan.cost_models.hetero.evaluate_hetero`) and keep the fastest; the best
   solution with another order of classes is kept as the runner-up ``explain`` shows.
4. **Assemble** the plan: the layout of the pipeline (``dp = tp = 1``, the global
   micro-batch), the stages with their ranks (tp innermost), the ``hetero`` section,
   predictions and the pass log (method, objective, bound, gap, states).

Deterministic: ties go to the smaller objective, then the micro-batch size, then the stage
tuple.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hetplan.algorithms.hetero_search import HeteroSolution, solve_exact, state_count
from hetplan.algorithms.pipeline_schedules import layout_actions
from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.hetero import (
    MODES,
    DeviceClass,
    HeteroEvaluation,
    OptionInfo,
    assign_ranks,
    build_problem,
    device_classes,
    evaluate_hetero,
)
from hetplan.errors import InfeasiblePlanError
from hetplan.ir.plan import Plan
from hetplan.ir.plan_hetero import Hetero, HeteroAlternative, HeteroSearch, StageShape
from hetplan.ir.plan_sections import (
    ClusterRef,
    CostSettings,
    Layout,
    ModelRef,
    PassLogEntry,
    Predictions,
    RankMemory,
    Stage,
    TimeBreakdown,
    WorkloadSummary,
)

__all__ = ["compile_hetero", "HeteroCandidate", "search_hetero", "FINALISTS"]

#: Solutions re-predicted with the full simulator.
FINALISTS = 3


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


def search_hetero(workload: WorkloadSummary, costs: CostModel, batch_size: int, *,
                  micro_batch: int | None = None, max_tp: int = 8,
                  restrict: tuple[int, int] | None = None,
                  max_states: int = 5_000_000) -> list[HeteroCandidate]:
    """Every micro-batch size's best pipeline under the search objective, best first.

    ``restrict``: only stages of this ``(dp, tp)`` (the best plan with one (dp, tp) for all
    stages, a bench baseline)."""
    classes = device_classes(costs)
    out = []
    for mb in [micro_batch] if micro_batch else _micro_batch_sizes(batch_size):
        m = batch_size // mb
        problem, infos = build_problem(workload, costs, classes, mb, m, max_tp=max_tp)
        if restrict is not None:
            keep = [k for k, o in enumerate(infos) if (o.dp, o.tp) == restrict]
            if not keep:
                continue
            problem = type(problem)(problem.num_layers,
                                    tuple(problem.options[k] for k in keep),
                                    problem.capacity, problem.micro_batches, problem.modes,
                                    problem.unit)
            infos = [infos[k] for k in keep]
        if not problem.options or state_count(problem) > max_states:
            continue
        sol = solve_exact(problem, max_states=max_states)
        if sol is None:
            continue
        out.append(_candidate(workload, mb, m, sol, infos, classes))
    out.sort(key=lambda c: (c.solution.objective, c.micro_batch, c.solution.stages))
    return out


def _candidate(workload: WorkloadSummary, mb: int, m: int, sol: HeteroSolution,
               infos: list[OptionInfo], classes: tuple[DeviceClass, ...]) -> HeteroCandidate:
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
    hetero = Hetero(stages=shapes, search=HeteroSearch(
        method="exact-dp", objective_ms=sol.objective * 1e3, bound_ms=sol.bound * 1e3,
        gap=0.0, states=sol.states))
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
                   max_tp: int = 8) -> Plan:
    """The fastest heterogeneous pipeline plan (see the module docstring).

    Raises:
        InfeasiblePlanError: no pipeline of any micro-batch size fits in memory.
    """
    cands = search_hetero(workload, costs, batch_size, micro_batch=micro_batch, max_tp=max_tp)
    scored: list[tuple[float, int, HeteroCandidate, HeteroEvaluation]] = []
    for k, cand in enumerate(cands[:FINALISTS]):
        ev = predict(workload, costs, cand)
        if ev is not None:
            scored.append((ev.iteration_s, k, cand, ev))
    if not scored:
        raise InfeasiblePlanError(
            f"no heterogeneous pipeline of the {len(costs.devices)} devices fits the model "
            f"in memory at any micro-batch size dividing the batch of {batch_size}; use a "
            "smaller batch or a cluster with more memory")
    scored.sort(key=lambda x: (x[0], x[1]))
    _, _, best, ev = scored[0]
    runner = _runner_up(workload, costs, best, cands)
    search = best.hetero.search.model_copy(update={"runner_up": runner})
    hetero = best.hetero.model_copy(update={
        "search": search,
        "stages": tuple(s.model_copy(update={"reshard_in_ms": r * 1e3})
                        for s, r in zip(best.hetero.stages, ev.reshard_s))})
    stages = tuple(st.model_copy(update={"fwd_ms": f * 1e3, "bwd_ms": b * 1e3,
                                         "memory_bytes": ev.memory[st.ranks[0]].total})
                   for st, f, b in zip(best.stages, ev.fwd_s, ev.bwd_s))
    note = (f"{len(cands)} micro-batch size(s) solved by exact DP, {len(scored)} re-predicted; "
            f"chose {hetero.describe()} micro-batch {best.micro_batch}x{best.micro_batches}; "
            f"objective {best.solution.objective * 1e3:.3f} ms, bound "
            f"{best.solution.bound * 1e3:.3f} ms, gap 0, {best.solution.states} states")
    plan = Plan(
        model=model_ref, cluster=cluster_ref, layout=best.layout, stages=stages,
        pipeline_actions=layout_actions(best.layout), hetero=hetero,
        predictions=Predictions(
            iteration_time_ms=ev.iteration_s * 1e3,
            breakdown=TimeBreakdown(compute_ms=ev.compute_s * 1e3, comm_ms=ev.comm_s * 1e3,
                                    exposed_comm_ms=ev.exposed_comm_s * 1e3,
                                    bubble_ms=ev.bubble_s * 1e3),
            memory_per_rank_bytes=tuple(m.total for m in ev.memory),
            memory_breakdown=tuple(RankMemory(params=m.params, grads=m.grads,
                                              optimizer=m.optimizer,
                                              activations=m.activations, buffers=m.buffers,
                                              margin=m.margin) for m in ev.memory),
            bubble_ratio=min(max(ev.bubble_ratio, 0.0), 1.0)),
        cost_settings=cost_settings, precision=costs.precision,
        pass_log=(PassLogEntry(name="hetero-search", changed=True, notes=(note,)),),
    )
    return Plan.model_validate(plan.model_dump())


def _runner_up(workload: WorkloadSummary, costs: CostModel, best: HeteroCandidate,
               cands: list[HeteroCandidate]) -> HeteroAlternative | None:
    """The best candidate whose order of classes differs from ``best``'s, re-predicted."""
    for cand in cands:
        if cand.order == best.order:
            continue
        ev = predict(workload, costs, cand)
        if ev is None:
            continue
        return HeteroAlternative(
            order=cand.hetero.order,
            degrees=tuple(f"{s.dp}x{s.tp}" for s in cand.hetero.stages),
            iteration_time_ms=ev.iteration_s * 1e3,
            note=f"micro-batch {cand.micro_batch}x{cand.micro_batches}; search objective "
                 f"{cand.solution.objective * 1e3:.3f} ms vs "
                 f"{best.solution.objective * 1e3:.3f} ms")
    return None
