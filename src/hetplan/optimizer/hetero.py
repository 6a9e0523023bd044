"""Heterogeneous pipelines: search each stage's device class, (dp, tp), order and layers.

:func:`compile_hetero` is read top to bottom:

1. **Classes**: the cluster's device classes (:func:`~hetplan.cost_models.hetero.
   device_classes`), by content, so the order of nodes in the cluster file changes nothing.
2. **Search**, per global micro-batch size (powers of two dividing the batch, at least one
   micro-batch per ... pipeline): the tables of :func:`~hetplan.cost_models.hetero.
   build_problem` and the exact DP (:func:`~hetplan.algorithms.hetero_search.solve_exact`)
   over layer splits, device use, stage degrees and recomputation; orders of classes come
   out of the DP (stages of any class in any order).
3. **Re-predict** every plan the DP's threshold scans visit with the full simulator
   (:func:`~hetplan.cost_models.hetero.evaluate_hetero`) and keep the fastest; a scan
   stops only once its remaining plans' objective cannot be below the best predicted time
   (:func:`search_hetero`). The best plan with another order of classes is kept as the
   runner-up ``explain`` shows.
4. **Assemble** the plan: the layout of the pipeline (``dp = tp = 1``, the global
   micro-batch), the stages with their ranks (tp innermost), the ``hetero`` section,
   predictions and the pass log (method, objective, bound, gap, states).

Deterministic: ties go to the smaller objective, then the micro-batch size, then the stage
tuple.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from hetplan.algorithms.hetero_search import (
    HeteroSolution,
    StageChoice,
    solve_exact,
    state_count,
)
from hetplan.algorithms.pipeline_schedules import layout_actions
from hetplan.cost_models.costs import CostModel
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
)
from hetplan.cost_models.profile_db import ProfileDB
from hetplan.errors import InfeasiblePlanError, SpecError
from hetplan.ir.cluster import ClusterSpec
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

__all__ = ["compile_hetero", "choose_hetero", "HeteroCandidate", "search_hetero", "predict",
           "rebuild_alternative", "COARSE_GAP"]

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

    @property
    def predicted_s(self) -> float:
        """The simulator's iteration time (inf: not predicted, or does not fit)."""
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


def search_hetero(workload: WorkloadSummary, costs: CostModel, batch_size: int, *,
                  micro_batch: int | None = None, max_tp: int = 8,
                  restrict: tuple[int, int] | None = None,
                  max_states: int = 5_000_000, judge: bool = True) -> list[HeteroCandidate]:
    """The plans the exact DP visits, over every micro-batch size, best first.

    Each micro-batch size's threshold scan visits the Pareto front of ``(sum a, max v)``
    (:attr:`HeteroSolution.front`). With ``judge`` every visited plan is re-predicted by the
    simulator (:func:`predict`, about 1 ms each) and a scan stops only once no plan left in
    it has an objective below the best predicted time so far (the objective is optimistic:
    on GPT-2 the simulator's times of visited multi-stage plans were 0.3-44 % above it,
    never below); candidates are then sorted by predicted time. Without ``judge`` a scan
    stops at the objective's own optimum and candidates are sorted by objective.
    ``restrict``: only stages of this ``(dp, tp)`` (the best plan with one (dp, tp) for all
    stages, a bench baseline)."""
    classes = device_classes(costs)
    units = coarse_units(classes)
    coarse = any(u > 1 for u in units)
    out: list[HeteroCandidate] = []
    incumbent = best_objective = float("inf")
    for mb in [micro_batch] if micro_batch else _micro_batch_sizes(batch_size):
        m = batch_size // mb
        problem, infos = build_problem(workload, costs, classes, mb, m, max_tp=max_tp,
                                       units=units)
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
        judged: dict[tuple[StageChoice, ...], HeteroCandidate] = {}

        def _judge(stages: tuple[StageChoice, ...], mb: int = mb, m: int = m,
                   infos: list[OptionInfo] = infos) -> float:
            cand = _candidate(workload, mb, m, HeteroSolution(stages, 0.0, 0.0, "exact-dp"),
                              infos, classes, units)
            ev = predict(workload, costs, cand)
            judged[stages] = dataclasses.replace(cand, evaluation=ev)
            return ev.iteration_s if ev is not None else float("inf")

        # exact spaces: the scan runs on to the best predicted time; coarse (large) ones
        # stop at the objective's optimum and only their visited plans are re-predicted
        sol = solve_exact(problem, max_states=max_states,
                          incumbent=incumbent if judge and not coarse else best_objective,
                          judge=_judge if judge and not coarse else None,
                          rel_gap=COARSE_GAP if coarse else 0.0)
        if sol is None:
            continue
        best_objective = min(best_objective, sol.objective)
        for j, stages in sol.front:
            one = HeteroSolution(stages, j, sol.bound if stages == sol.stages else j,
                                 sol.method, sol.states)
            cand = _candidate(workload, mb, m, one, infos, classes, units)
            if judge:
                if stages not in judged:
                    _judge(stages)
                cand = dataclasses.replace(cand, evaluation=judged[stages].evaluation)
                if cand.evaluation is not None:
                    incumbent = min(incumbent, cand.evaluation.iteration_s)
            out.append(cand)
    out.sort(key=lambda c: (c.predicted_s if judge else c.solution.objective,
                            c.solution.objective, c.micro_batch, c.solution.stages))
    return out


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
                   max_tp: int = 8) -> Plan:
    """The fastest heterogeneous pipeline plan (see the module docstring).

    Raises:
        InfeasiblePlanError: no pipeline of any micro-batch size fits in memory.
    """
    cands = search_hetero(workload, costs, batch_size, micro_batch=micro_batch, max_tp=max_tp)
    fits = [c for c in cands if c.evaluation is not None]
    if not fits:
        raise InfeasiblePlanError(
            f"no heterogeneous pipeline of the {len(costs.devices)} devices fits the model "
            f"in memory at any micro-batch size dividing the batch of {batch_size}; use a "
            "smaller batch or a cluster with more memory")
    best = fits[0]
    ev = best.evaluation
    assert ev is not None
    runner = _runner_up(best, fits)
    search = best.hetero.search.model_copy(update={"runner_up": runner})
    hetero = best.hetero.model_copy(update={
        "search": search,
        "stages": tuple(s.model_copy(update={"reshard_in_ms": r * 1e3})
                        for s, r in zip(best.hetero.stages, ev.reshard_s))})
    stages = tuple(st.model_copy(update={"fwd_ms": f * 1e3, "bwd_ms": b * 1e3,
                                         "memory_bytes": ev.memory[st.ranks[0]].total})
                   for st, f, b in zip(best.stages, ev.fwd_s, ev.bwd_s))
    by_objective = min(cands, key=lambda c: (c.solution.objective, c.micro_batch))
    note = (f"exact DP over {len({c.micro_batch for c in cands})} micro-batch size(s) visited "
            f"{len(cands)} plan(s), all re-predicted by the simulator ({len(fits)} fit); "
            f"{hetero.search.method}, device units {list(hetero.search.units)}, objective gap "
            f"{hetero.search.gap:.4f}; "
            f"chose {hetero.describe()} micro-batch {best.micro_batch}x{best.micro_batches}: "
            f"predicted {ev.iteration_s * 1e3:.3f} ms, objective "
            f"{best.solution.objective * 1e3:.3f} ms; the objective's best "
            f"({by_objective.hetero.describe()}, {by_objective.solution.objective * 1e3:.3f} "
            f"ms) predicts {by_objective.predicted_s * 1e3:.3f} ms")
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
                  mode: Literal["auto", "on", "off"]) -> Plan:
    """``hetplan plan --hetero``: ``compile()``'s ``plan`` or the heterogeneous one.

    ``off`` returns ``plan``; ``on`` returns :func:`compile_hetero`'s plan; ``auto`` the one
    predicted faster (ties keep ``plan``). Both are priced by one cost model (``plan``'s
    cost settings and profile) and the same pipeline simulator; ``compile()``'s prediction
    also runs the per-bucket gradient sync of its passes, the heterogeneous one the ring
    sync of :func:`~hetplan.cost_models.hetero.sync_s`. The plan returned records the
    comparison in its pass log.

    Raises:
        InfeasiblePlanError: with ``on``, no heterogeneous pipeline fits.
    """
    if mode == "off":
        return plan
    cs = plan.cost_settings or CostSettings()
    costs = CostModel(spec, db, dtype=cs.dtype, efficiency=cs.efficiency, optimizer=cs.optimizer,
                      attention=cs.attention, dp_overlap=cs.dp_overlap, fusion=cs.fusion,
                      vocab_parallel=cs.vocab_parallel)
    workload = plan.model.workload
    if workload is None:
        raise InfeasiblePlanError("the plan carries no workload summary to search "
                                  "heterogeneous stages over; re-run `hetplan plan`")
    base_ms = plan.predictions.iteration_time_ms if plan.predictions else float("inf")
    try:
        het = compile_hetero(workload, costs, batch_size, model_ref=plan.model,
                             cluster_ref=ClusterRef.from_cluster(spec), cost_settings=cs)
    except InfeasiblePlanError as e:
        if mode == "on":
            raise
        return _noted(plan, f"--hetero auto: no heterogeneous pipeline fits ({e}); kept "
                            f"compile()'s plan ({base_ms:.3f} ms)")
    assert het.predictions is not None
    het_ms = het.predictions.iteration_time_ms
    if mode == "on" or het_ms < base_ms:
        return _noted(het, f"--hetero {mode}: heterogeneous {het_ms:.3f} ms vs compile()'s "
                           f"{base_ms:.3f} ms ({_layout_text(plan)}); took the heterogeneous plan")
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
