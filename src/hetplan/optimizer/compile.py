"""``hetplan.compile``: model + cluster → the fastest feasible plan, with its baselines.

Read top to bottom:

1. **Workload**: capture the model (a zoo name, an ``nn.Module`` with example inputs, a
   :class:`ModelIR` or a workload file) into the plan's :class:`WorkloadSummary`.
2. **Cost model** for the cluster, from the profile DB where it has measurements.
3. **Layout search**: every layout :func:`enumerate_layouts` allows; for each, the passes
   that shape it (stages, TP, baseline buckets) fill the plan sections and :func:`evaluate`
   predicts the iteration; infeasible ones (memory) are dropped. The :data:`FINALISTS`
   fastest then get the whole pipeline, refinement passes (Cupcake; Espresso when
   compressors are allowed) included, and the fastest of those wins (ties: the smaller
   layout tuple). A refinement never makes a layout slower, so a layout outside the
   finalists could win only if refinement helped it by more than its gap to the last
   finalist; that is the price of not running the expensive searches on every layout.
4. **Baselines**: the same prediction for the baselines the plan must beat — DDP (pure data
   parallelism, 25 MiB fp32 buckets), the winning layout with baseline passes, and the winning
   layout with layer-wise (unfused) fp32 sync.
5. **Plan**: predictions, provenance of every cost, the pass log.

:func:`simulate` re-evaluates a plan (also one edited by hand) from the plan file alone.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hetplan.algorithms.pipeline_schedules import layout_actions
from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.evaluate import Evaluation, evaluate
from hetplan.cost_models.profile_db import ProfileDB
from hetplan.errors import InfeasiblePlanError, SpecError
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.model import ModelIR
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import (
    Baseline,
    ClusterRef,
    CostSettings,
    CostSource,
    Layout,
    ModelRef,
    PassLogEntry,
    Predictions,
    TimeBreakdown,
    WorkloadSummary,
)
from hetplan.optimizer.layout import LayoutCandidate, enumerate_layouts
from hetplan.passes import BASELINE_PASSES, get_all_passes
from hetplan.passes.base import PassContext
from hetplan.passes.manager import run_passes

__all__ = ["compile", "simulate", "plan_costs", "resolve_cluster", "resolve_profile", "DEFAULT_PASSES"]

#: Layouts that get the refinement passes after screening (see :func:`compile`).
FINALISTS = 3

#: The pass pipeline compile runs: balanced pipeline stages
#: (``dynpipe``; ``uniform-stages`` stays the baseline), then the baseline TP and buckets,
#: then ``espresso`` (per-tensor gradient-sync options), then ``cupcake-fusion`` (optimal
#: buckets of consecutive tensors sharing a strategy; never predicted slower than its input),
#: then ``tp-resizing`` (TP shards by device speed, resizing controller settings; last, so its
#: predicted effect uses the final gradient sync).
DEFAULT_PASSES: tuple[str, ...] = ("dynpipe", "even-tp", "ddp-buckets", "espresso",
                                   "cupcake-fusion", "tp-resizing")


def resolve_cluster(cluster: ClusterSpec | str | Path) -> ClusterSpec:
    """A ClusterSpec from a spec, a preset name or a YAML/JSON file path."""
    if isinstance(cluster, ClusterSpec):
        return cluster
    path = Path(cluster)
    if path.suffix in (".yaml", ".yml", ".json") or path.exists():
        return ClusterSpec.load(path)
    return ClusterSpec.from_preset(str(cluster))


def resolve_profile(profile: ProfileDB | str | Path | None) -> ProfileDB | None:
    if profile is None or isinstance(profile, ProfileDB):
        return profile
    return ProfileDB.load(profile)


def _workload(model: Any, example_inputs: Any, example_kwargs: Any, seq: int | None) -> ModelIR:
    if isinstance(model, ModelIR):
        return model
    if isinstance(model, (str, Path)) and str(model).endswith(".json"):
        return ModelIR.load(model)
    from hetplan.ir.capture import capture

    if isinstance(model, str):
        from hetplan import zoo

        entry = zoo.get(model)
        args, kwargs = zoo.example_inputs(entry.name, batch=1, seq=seq)
        return capture(zoo.build(entry.name), args, kwargs, name=entry.name)
    if example_inputs is None:
        raise SpecError(
            "compile() of an nn.Module needs example_inputs (one micro-batch, ideally of size 1)"
        )
    return capture(model, example_inputs, example_kwargs)


def _passes(names: Sequence[str], dynamics: Any = None,
            tp_options: dict[str, Any] | None = None) -> list[Any]:
    """Instantiate passes by name; ``dynamics`` (a DynamicsSpec) goes to ``dynpipe``,
    ``tp_options`` (keyword options) to ``tp-resizing``."""
    registry = get_all_passes()
    out = []
    for n in names:
        if n not in registry:
            import difflib

            near = difflib.get_close_matches(n, list(registry), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise SpecError(f"unknown pass {n!r}{hint} (known: {sorted(registry)})")
        if n == "tp-resizing" and tp_options:
            out.append(registry[n](**tp_options))
            continue
        out.append(registry[n](dynamics=dynamics) if n == "dynpipe" and dynamics is not None
                   else registry[n]())
    if dynamics is not None and "dynpipe" not in names:
        raise SpecError("dynamics were given but the pass list has no 'dynpipe' pass to "
                        f"re-balance the pipeline (passes: {list(names)}); add 'dynpipe'")
    return out


def compile(  # noqa: A001 - the product's verb
    model: Any,
    cluster: ClusterSpec | str | Path,
    *,
    batch_size: int,
    example_inputs: Any = None,
    example_kwargs: Any = None,
    seq: int | None = None,
    profile: ProfileDB | str | Path | None = None,
    schedule: str = "1f1b",
    passes: Sequence[str] = DEFAULT_PASSES,
    dp: int | None = None,
    pp: int | None = None,
    tp: int | None = None,
    micro_batch_size: int | None = None,
    dtype: str = "fp32",
    efficiency: float = 0.5,
    optimizer: str = "adam",
    require_profiled: bool = False,
    compressors: Sequence[str] = (),
    dynamics: Any = None,
    tp_controller: str = "off",
    tp_gamma_max: float = 0.9,
) -> Plan:
    """Compile the fastest feasible plan for ``model`` on ``cluster``.

    Args:
        model: a zoo name, an ``nn.Module`` (with ``example_inputs``), a :class:`ModelIR`, or
            a workload JSON path.
        cluster: a :class:`ClusterSpec`, a preset name or a cluster file.
        batch_size: global batch size per iteration (samples).
        example_inputs / example_kwargs: one micro-batch for an ``nn.Module``.
        seq: sequence length for zoo language models.
        profile: profile DB (or its path) with measured costs.
        schedule: pipeline schedule (``1f1b``, ``gpipe``, ``interleaved-1f1b``).
        passes: the pass pipeline (names from :func:`hetplan.passes.get_all_passes`).
        dp / pp / tp / micro_batch_size: pin a layout dimension.
        dtype / efficiency / optimizer: cost-model settings (recorded in the plan).
        require_profiled: refuse analytic compute estimates.
        compressors: compressors gradient-sync passes may use (opt-in: lossy ones change
            convergence), e.g. ``("dgc", "fp16")``; see ``passes/espresso.py``.
        dynamics: a :class:`~hetplan.ir.rebalancing.DynamicsSpec` (or its YAML/JSON path):
            how the model changes while training; ``dynpipe`` plans the re-balancing.
        tp_controller / tp_gamma_max: the heterogeneous-TP controller ``tp-resizing`` writes
            (``off``, ``zero``, ``migration``, ``semi``; opt-in, resizing is lossy) and its
            largest pruning ratio γ, in [0, 1).

    Returns:
        The plan; ``plan.predictions.baselines`` holds what it beat.

    Raises:
        InfeasiblePlanError: no layout fits (the message names the binding constraint).

    Example:
        >>> plan = hetplan.compile("gpt2", "a100-nvlink-8x8", batch_size=64)  # doctest: +SKIP
    """
    if batch_size < 1:
        raise SpecError(f"batch_size must be >= 1, got {batch_size}")
    spec = resolve_cluster(cluster)
    db = resolve_profile(profile)
    ir = _workload(model, example_inputs, example_kwargs, seq)
    workload = WorkloadSummary.from_model_ir(ir)
    costs = CostModel(spec, db, dtype=dtype, efficiency=efficiency, optimizer=optimizer,
                      require_profiled=require_profiled)
    if isinstance(dynamics, (str, Path)):
        from hetplan.ir.rebalancing import DynamicsSpec

        dynamics = DynamicsSpec.load(dynamics)
    pipeline = _passes(passes, dynamics,
                       {"variant": tp_controller, "gamma_max": tp_gamma_max})
    model_ref = ModelRef(name=ir.name, fingerprint=ir.fingerprint(), num_params=ir.num_params)
    cluster_ref = ClusterRef.from_cluster(spec, embed=False)
    candidates = enumerate_layouts(workload, spec, batch_size, dp=dp, pp=pp, tp=tp,
                                   micro_batch_size=micro_batch_size)
    if not candidates:
        raise InfeasiblePlanError(
            f"no layout of {spec.world_size} devices divides the global batch of {batch_size} "
            f"(with dp={dp}, pp={pp}, tp={tp} pinned): choose a batch size divisible by a "
            "data-parallel degree the cluster allows"
        )
    # screen every layout with the passes that shape it; refine only the finalists
    screening = [p for p in pipeline if not _refines(p, tuple(compressors))]
    refining = len(screening) < len(pipeline)
    screened: list[tuple[float, LayoutCandidate, Plan, Evaluation]] = []
    infeasible: list[tuple[float, str]] = []
    for cand in candidates:
        layout = cand.to_layout(batch_size, schedule)
        reason = _memory_lower_bound(workload, cand, spec, costs)
        if reason:
            infeasible.append((0.0, reason))
            continue
        try:
            plan, ev = _plan_for(layout, model_ref, cluster_ref,
                                 screening if refining else pipeline, workload, spec, costs,
                                 compressors=tuple(compressors), model_ir=ir)
        except InfeasiblePlanError as e:
            infeasible.append((0.0, str(e)))
            continue
        screened.append((ev.iteration_s, cand, plan, ev))
    screened.sort(key=lambda x: (x[0], x[1]))
    best: tuple[float, LayoutCandidate, Plan, Evaluation] | None = None
    for _, cand, plan, ev in screened[:FINALISTS] if refining else screened[:1]:
        if refining:
            try:
                plan, ev = _plan_for(cand.to_layout(batch_size, schedule), model_ref,
                                     cluster_ref, pipeline, workload, spec, costs,
                                     compressors=tuple(compressors), model_ir=ir)
            except InfeasiblePlanError as e:
                infeasible.append((0.0, str(e)))
                continue
        if best is None or (ev.iteration_s, cand) < (best[0], best[1]):
            best = (ev.iteration_s, cand, plan, ev)
    if best is None:
        raise InfeasiblePlanError(
            f"none of the {len(candidates)} layouts fits in memory; for example: "
            f"{infeasible[-1][1]}"
        )
    _, cand, plan, ev = best
    plan = plan.model_copy(update={"stages": _stages_with_times(plan, ev)})
    baselines = _baselines(cand, batch_size, schedule, model_ref, cluster_ref, workload, spec,
                           costs, passes)
    search_note = (
        f"{len(candidates)} layout(s) considered, {len(infeasible)} infeasible, "
        + (f"best {min(FINALISTS, len(screened))} refined, " if refining else "")
        + f"chose {cand.describe()}"
    )
    plan = plan.model_copy(
        update={
            "model": ModelRef(name=ir.name, fingerprint=ir.fingerprint(),
                              num_params=ir.num_params, workload=workload),
            "cluster": ClusterRef.from_cluster(spec),
            "predictions": _predictions(ev, baselines, plan.layout),
            "provenance": _provenance(ev, costs),
            "cost_settings": CostSettings(dtype=dtype, efficiency=efficiency,
                                          optimizer=optimizer,  # type: ignore[arg-type]
                                          profile_fingerprint=_db_fingerprint(db)),
            "pass_log": (PassLogEntry(name="layout-search", changed=True,
                                      notes=(search_note,)),) + plan.pass_log,
            # the action lists the simulator costs and the runtime executes
            "pipeline_actions": layout_actions(plan.layout) if plan.layout else None,
        }
    )
    return Plan.model_validate(plan.model_dump())


def _stages_with_times(plan: Plan, ev: Evaluation) -> tuple[Any, ...]:
    """The plan's stages with their predicted per-micro-batch times and peak memory."""
    return tuple(
        st.model_copy(update={
            "fwd_ms": cost.fwd_s * 1e3,
            "bwd_ms": cost.bwd_s * 1e3,
            "memory_bytes": ev.memory[st.ranks[0]].total,
        })
        for st, cost in zip(plan.stages, ev.stages)
    )


def _memory_lower_bound(
    workload: WorkloadSummary, cand: LayoutCandidate, spec: ClusterSpec, costs: CostModel
) -> str:
    """Why ``cand`` cannot fit whatever the stage partition (the parameter-related bytes of
    the model spread perfectly over pp·tp ranks exceed the smallest device), or ""."""
    from hetplan.cost_models.memory import OPTIMIZER_STATE_FACTOR, USABLE_FRACTION

    per_param_byte = 2.0 + OPTIMIZER_STATE_FACTOR[costs.optimizer]
    split = sum(min(x.tp_split_bytes, x.param_bytes) for x in workload.layers)
    total = sum(x.param_bytes for x in workload.layers)
    need = per_param_byte * ((total - split) + split / cand.tp) / cand.pp
    cap = min(d.memory_bytes for d in costs.devices) * USABLE_FRACTION
    if need <= cap:
        return ""
    return (
        f"layout {cand.describe()}: parameters, gradients and optimizer state alone need "
        f"{need / 2**30:.1f} GiB per rank even if perfectly balanced, more than "
        f"{cap / 2**30:.1f} GiB usable"
    )


def _refines(p: Any, compressors: tuple[str, ...]) -> bool:
    """Whether pass ``p`` is a refinement here (see ``passes/base.py``)."""
    flag = getattr(p, "refines", False)
    return bool(flag(compressors)) if callable(flag) else bool(flag)


def _plan_for(
    layout: Layout,
    model_ref: ModelRef,
    cluster_ref: ClusterRef,
    pipeline: list[Any],
    workload: WorkloadSummary,
    spec: ClusterSpec,
    costs: CostModel,
    compressors: tuple[str, ...] = (),
    model_ir: ModelIR | None = None,
) -> tuple[Plan, Evaluation]:
    ctx = PassContext(workload=workload, cluster=spec, costs=costs, layout=layout,
                      compressors=compressors, model_ir=model_ir)
    plan = Plan(model=model_ref, cluster=cluster_ref, layout=layout)
    plan = run_passes(plan, pipeline, ctx)
    ev = evaluate(workload, layout, plan.stages, plan.gradient_sync, costs,
                  tensor_parallel=plan.tensor_parallel)
    return plan, ev


def _baselines(
    cand: LayoutCandidate,
    batch_size: int,
    schedule: str,
    model_ref: ModelRef,
    cluster_ref: ClusterRef,
    workload: WorkloadSummary,
    spec: ClusterSpec,
    costs: CostModel,
    passes: Sequence[str],
) -> list[Baseline]:
    out: list[Baseline] = []
    base = _passes(BASELINE_PASSES)
    layout = cand.to_layout(batch_size, schedule)

    def add(name: str, description: str, fn: Any) -> None:
        try:
            ev = fn()
        except InfeasiblePlanError:
            return
        out.append(Baseline(name=name, description=description,
                            iteration_time_ms=ev.iteration_s * 1e3, breakdown=_breakdown(ev),
                            memory_per_rank_bytes=tuple(m.total for m in ev.memory)))

    # pure data parallelism with DDP buckets, at the largest micro-batch that fits
    ddp = [c for c in enumerate_layouts(workload, spec, batch_size, pp=1, tp=1)]
    for c in sorted(ddp, key=lambda c: -c.micro_batch_size):
        before = len(out)
        add("ddp", f"PyTorch DDP: dp={c.dp}, 25 MiB fp32 buckets, micro-batch "
                   f"{c.micro_batch_size}×{c.micro_batches}",
            lambda c=c: _plan_for(c.to_layout(batch_size, schedule), model_ref, cluster_ref,
                                  base, workload, spec, costs)[1])
        if len(out) > before:
            break
    if tuple(passes) != BASELINE_PASSES:
        add("baseline-passes", f"{cand.describe()} with uniform stages, even TP, DDP buckets",
            lambda: _plan_for(layout, model_ref, cluster_ref, base, workload, spec, costs)[1])

    def layerwise() -> Evaluation:
        plan, _ = _plan_for(layout, model_ref, cluster_ref, base, workload, spec, costs)
        return evaluate(workload, layout, plan.stages, None, costs)

    add("layer-wise", f"{cand.describe()} with one fp32 allreduce per gradient (no fusion)",
        layerwise)
    return out


def _breakdown(ev: Evaluation) -> TimeBreakdown:
    return TimeBreakdown(
        compute_ms=ev.compute_s * 1e3,
        comm_ms=ev.comm_s * 1e3,
        exposed_comm_ms=ev.exposed_comm_s * 1e3,
        bubble_ms=ev.bubble_s * 1e3,
        compression_ms=ev.compression_s * 1e3,
    )


def _predictions(ev: Evaluation, baselines: list[Baseline],
                 layout: Layout | None = None) -> Predictions:
    from hetplan.cost_models.bubble import bubble_ratios

    balanced, eq1 = bubble_ratios(ev, layout) if layout is not None else (None, None)
    return Predictions(
        bubble_ratio_balanced=balanced,
        bubble_ratio_eq1=eq1,
        iteration_time_ms=ev.iteration_s * 1e3,
        breakdown=_breakdown(ev),
        memory_per_rank_bytes=tuple(m.total for m in ev.memory),
        bubble_ratio=min(max(ev.bubble_ratio, 0.0), 1.0),
        baselines=tuple(baselines),
    )


def _provenance(ev: Evaluation, costs: CostModel) -> dict[str, CostSource]:
    counts: dict[str, int] = {}
    for st in ev.stages:
        for k, v in st.layer_sources.items():
            counts[k] = counts.get(k, 0) + v
    detail = ", ".join(f"{v} layer-device pair(s) {k}" for k, v in sorted(counts.items()))
    compute_src = "profiled" if set(counts) == {"profiled"} else "analytic"
    comm_lines = {line.source for line in costs.comm._lines.values()}
    comm_src = "profiled" if comm_lines == {"profiled"} else "analytic"
    return {
        "compute": CostSource(source=compute_src, detail=detail),  # type: ignore[arg-type]
        "comm": CostSource(source=comm_src,  # type: ignore[arg-type]
                           detail=", ".join(sorted(comm_lines)) or "no collectives"),
    }


def _db_fingerprint(db: ProfileDB | None) -> str:
    if db is None:
        return ""
    return hashlib.sha256(db.to_json().encode()).hexdigest()[:16]


def plan_costs(
    plan: Plan,
    *,
    cluster: ClusterSpec | str | Path | None = None,
    profile: ProfileDB | str | Path | None = None,
) -> tuple[WorkloadSummary, Layout, CostModel]:
    """What re-evaluating ``plan`` needs: its workload, its layout and the cost model built
    with the plan's cost settings on its embedded cluster (or ``cluster``, which must have
    the plan's fingerprint).

    Raises:
        SpecError: the plan has no workload summary or no cluster.
        PlanMismatchError: ``cluster`` is not the plan's cluster.
    """
    workload = plan.model.workload
    if workload is None:
        raise SpecError("the plan carries no workload summary; re-run `hetplan plan`")
    spec = resolve_cluster(cluster) if cluster is not None else plan.cluster.spec
    if spec is None:
        raise SpecError("the plan does not embed its cluster; pass --cluster FILE|PRESET")
    if spec.fingerprint() != plan.cluster.fingerprint:
        from hetplan.errors import PlanMismatchError

        raise PlanMismatchError(
            f"cluster {spec.name!r} (fingerprint {spec.fingerprint()}) is not the cluster the "
            f"plan was made for ({plan.cluster.name!r}, {plan.cluster.fingerprint}); re-run "
            "`hetplan plan` for this cluster"
        )
    settings = plan.cost_settings or CostSettings()
    costs = CostModel(spec, resolve_profile(profile), dtype=settings.dtype,
                      efficiency=settings.efficiency, optimizer=settings.optimizer)
    layout = plan.layout or Layout(dp=spec.world_size, micro_batch_size=workload.batch_size)
    return workload, layout, costs


def simulate(
    plan: Plan,
    *,
    cluster: ClusterSpec | str | Path | None = None,
    profile: ProfileDB | str | Path | None = None,
) -> Predictions:
    """Re-predict ``plan`` from the plan alone (its workload summary and embedded cluster).

    A hand-edited plan (buckets, stages, layout) is re-evaluated as it stands; baselines are
    carried over from the plan.

    Raises:
        SpecError: the plan has no workload summary or no cluster (pass ``cluster=``).
    """
    workload, layout, costs = plan_costs(plan, cluster=cluster, profile=profile)
    ev = evaluate(workload, layout, plan.stages, plan.gradient_sync, costs,
                  tensor_parallel=plan.tensor_parallel)
    baselines = plan.predictions.baselines if plan.predictions else ()
    return _predictions(ev, list(baselines), layout)
