"""The objective applied to a whole plan: re-predict a plan from the plan file alone.

- :func:`plan_costs` rebuilds what evaluating a plan needs (its workload summary, layout and
  the cost model made with the plan's own cost settings and precision section on its
  embedded cluster);
- :func:`simulate` re-evaluates the plan as it stands (also one edited by hand) and returns
  its :class:`Predictions`;
- :func:`predictions` / :func:`breakdown` turn an :class:`Evaluation` into the plan's
  prediction section, the one place compile and simulate both use.

This lives beside :func:`~hetplan.cost_models.evaluate.evaluate` (the objective every pass
scores with), below the passes and the optimizer, so that reports can re-predict a plan
without importing the search.
"""

from __future__ import annotations

from collections.abc import Sequence
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING

from hetplan.cost_models.bubble import bubble_ratios
from hetplan.cost_models.compute import vocab_split
from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.evaluate import Evaluation, StageCost, evaluate
from hetplan.cost_models.profile_db import ProfileDB
from hetplan.errors import PlanMismatchError, SpecError
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan import Plan, load_plan
from hetplan.ir.plan_checks import plan_problems
from hetplan.ir.plan_sections import (
    Baseline,
    CostSettings,
    CostSource,
    Layout,
    Predictions,
    RankMemory,
    TimeBreakdown,
    WorkloadSummary,
)

if TYPE_CHECKING:  # imported where used: the heterogeneous model is not needed otherwise
    from hetplan.cost_models.hetero import HeteroEvaluation

__all__ = ["plan_costs", "simulate", "evaluate_plan", "predictions", "breakdown",
           "resolve_cluster", "resolve_profile", "check_profile_fits", "provenance"]


def resolve_cluster(cluster: ClusterSpec | str | Path) -> ClusterSpec:
    """A ClusterSpec from a spec, a preset name or a YAML/JSON file path."""
    if isinstance(cluster, ClusterSpec):
        return cluster
    if not isinstance(cluster, (str, PathLike)):
        raise SpecError("cluster: expected a ClusterSpec, a preset name or a cluster file "
                        f"path, got {type(cluster).__name__}")
    path = Path(cluster)
    if path.suffix in (".yaml", ".yml", ".json") or path.exists():
        return ClusterSpec.load(path)
    return ClusterSpec.from_preset(str(cluster))


def resolve_profile(profile: ProfileDB | str | Path | None) -> ProfileDB | None:
    """A ProfileDB from a DB or its path; ``None`` stays ``None`` (analytic costs)."""
    if profile is None or isinstance(profile, ProfileDB):
        return profile
    if not isinstance(profile, (str, PathLike)):
        raise SpecError("profile: expected a ProfileDB or a profile DB file path, got "
                        f"{type(profile).__name__}")
    return ProfileDB.load(profile)


def check_profile_fits(db: ProfileDB | None, workload: WorkloadSummary, model: str,
                       source: object = "the profile DB") -> None:
    """Refuse a profile DB whose layer records are all of layers ``workload`` does not have:
    it was measured on another model (or at another sequence length, part of a layer's
    signature), and every layer would silently be priced by the analytic estimates. A DB
    without layer records (collectives only) or with any record of this model passes.

    Raises:
        SpecError: naming the file, what it holds and how to profile this model.
    """
    if db is None or not db.compute:
        return
    mine = {lay.signature for lay in workload.layers}
    if any(r.signature in mine for r in db.compute):
        return
    labels = sorted({r.label for r in db.compute if r.label})[:3]
    held = f" ({', '.join(labels)}{', ...' if len(db.compute) > 3 else ''})" if labels else ""
    raise SpecError(
        f"{source}: none of its {len(db.compute)} layer record(s){held} is a layer of model "
        f"{model!r}: it was profiled on another model or at another --seq; profile this one "
        f"with `hetplan profile {model} -o FILE` (or use a profile without layer records for "
        "analytic compute)")


def provenance(stages: Sequence[StageCost], costs: CostModel) -> dict[str, CostSource]:
    """Where a plan's costs came from, for its ``provenance`` section: compute ``profiled``
    only when every layer-device pair of ``stages`` (an evaluation's, homogeneous or
    heterogeneous) was, comm only when every collective line was; else ``analytic``, which
    ``hetplan inspect`` warns of."""
    counts: dict[str, int] = {}
    for st in stages:
        for k, v in st.layer_sources.items():
            counts[k] = counts.get(k, 0) + v
    detail = ", ".join(f"{v} layer-device pair(s) {k}" for k, v in sorted(counts.items()))
    compute_src = "profiled" if set(counts) == {"profiled"} else "analytic"
    comm_lines = costs.comm.sources_used()
    comm_src = "profiled" if comm_lines == {"profiled"} else "analytic"
    comm_detail = ", ".join(sorted(comm_lines)) or "no collectives"
    if unmeasured := costs.comm.unprofiled_link_kinds():
        comm_detail += (f"; the profile DB has no {costs.comm.backend} collectives on "
                        f"{' or '.join(unmeasured)} links: `hetplan profile --link-kind "
                        f"{unmeasured[0]}` over such a link (HETPLAN_EMULATE_BW for an "
                        "emulated one) measures them")
    return {
        "compute": CostSource(source=compute_src, detail=detail),  # type: ignore[arg-type]
        "comm": CostSource(source=comm_src,  # type: ignore[arg-type]
                           detail=comm_detail),
    }


def breakdown(ev: Evaluation) -> TimeBreakdown:
    """The plan's time breakdown of an evaluation (milliseconds)."""
    return TimeBreakdown(
        compute_ms=ev.compute_s * 1e3,
        comm_ms=ev.comm_s * 1e3,
        exposed_comm_ms=ev.exposed_comm_s * 1e3,
        bubble_ms=ev.bubble_s * 1e3,
        compression_ms=ev.compression_s * 1e3,
        optimizer_ms=ev.optimizer_s * 1e3,
    )


def predictions(ev: Evaluation, baselines: list[Baseline] | tuple[Baseline, ...],
                layout: Layout | None = None) -> Predictions:
    """The plan's prediction section of an evaluation, with the baselines it beat."""
    balanced, eq1 = bubble_ratios(ev, layout) if layout is not None else (None, None)
    return Predictions(
        bubble_ratio_balanced=balanced,
        bubble_ratio_eq1=eq1,
        iteration_time_ms=ev.iteration_s * 1e3,
        breakdown=breakdown(ev),
        memory_per_rank_bytes=tuple(m.total for m in ev.memory),
        memory_breakdown=tuple(
            RankMemory(params=m.params, grads=m.grads, optimizer=m.optimizer,
                       activations=m.activations, buffers=m.buffers, margin=m.margin)
            for m in ev.memory),
        bubble_ratio=min(max(ev.bubble_ratio, 0.0), 1.0),
        baselines=tuple(baselines),
    )


def plan_costs(
    plan: Plan,
    *,
    cluster: ClusterSpec | str | Path | None = None,
    profile: ProfileDB | str | Path | None = None,
) -> tuple[WorkloadSummary, Layout, CostModel]:
    """What re-evaluating ``plan`` needs: its workload, its layout and the cost model built
    with the plan's cost settings on its embedded cluster (or ``cluster``, which must have
    the plan's fingerprint; a plan that does not embed its spec is then checked against it by
    the plan's own rules, :mod:`hetplan.ir.plan_checks`).

    Raises:
        SpecError: the plan has no workload summary or no cluster.
        PlanMismatchError: ``cluster`` is not the plan's cluster, or the plan does not fit
            it (e.g. a precision peak its device type lacks; one line per problem, each
            naming the field).
    """
    workload = plan.model.workload
    if workload is None:
        raise SpecError("the plan carries no workload summary; re-run `hetplan plan`")
    spec = resolve_cluster(cluster) if cluster is not None else plan.cluster.spec
    if spec is None:
        raise SpecError(f"the plan does not embed its cluster ({plan.cluster.name!r}); give it: "
                        "--cluster FILE|PRESET (Python: cluster=, a ClusterSpec, preset name "
                        "or file)")
    if spec.fingerprint() != plan.cluster.fingerprint:
        raise PlanMismatchError(
            f"cluster {spec.name!r} (fingerprint {spec.fingerprint()}) is not the cluster the "
            f"plan was made for ({plan.cluster.name!r}, {plan.cluster.fingerprint}); re-run "
            "`hetplan plan` for this cluster"
        )
    if plan.cluster.spec is None and (problems := plan_problems(plan, cluster=spec)):
        raise PlanMismatchError("\n".join(problems))
    # a plan without cost settings was priced with the head whole
    settings = plan.cost_settings or CostSettings(vocab_parallel="unstated")
    db = resolve_profile(profile)
    check_profile_fits(db, workload, plan.model.name,
                       profile if isinstance(profile, (str, Path)) else "the profile DB")
    costs = CostModel(spec, db, dtype=settings.dtype,
                      efficiency=settings.efficiency, optimizer=settings.optimizer,
                      precision=plan.precision, attention=settings.attention,
                      dp_overlap=settings.dp_overlap, fusion=settings.fusion,
                      grad_accumulation=settings.grad_accumulation,
                      vocab_parallel=vocab_split(settings.vocab_split, workload))
    layout = plan.layout or Layout(dp=spec.world_size, micro_batch_size=workload.batch_size)
    return workload, layout, costs


def simulate(
    plan: Plan | str | Path,
    *,
    cluster: ClusterSpec | str | Path | None = None,
    profile: ProfileDB | str | Path | None = None,
) -> Predictions:
    """Re-predict ``plan`` (a plan, or its file) from the plan alone (its workload summary
    and embedded cluster).

    A hand-edited plan (buckets, stages, layout, the pipeline's action lists) is re-evaluated
    as it stands: the pipeline is simulated over the plan's own ``pipeline_actions``, the
    lists the runtime runs, and each rank's activations peak where its own list holds the
    most micro-batches (per-stage degrees too: ``evaluate_hetero``); baselines are carried
    over from the plan.

    Raises:
        SpecError: the plan has no workload summary or no cluster (pass ``cluster=``).
        InfeasiblePlanError: a rank runs out of memory.
    """
    if isinstance(plan, (str, PathLike)):
        plan = load_plan(plan)
    elif not isinstance(plan, Plan):
        raise SpecError("plan: expected a Plan or a plan file path, got "
                        f"{type(plan).__name__}")
    return evaluate_plan(plan, cluster=cluster, profile=profile)[1]


def evaluate_plan(
    plan: Plan,
    *,
    cluster: ClusterSpec | str | Path | None = None,
    profile: ProfileDB | str | Path | None = None,
    check_memory: bool = True,
) -> tuple[Evaluation | HeteroEvaluation, Predictions]:
    """:func:`simulate`'s evaluation of ``plan`` and the prediction section it gives
    (``check_memory=False``: a rank that does not fit is predicted all the same)."""
    workload, layout, costs = plan_costs(plan, cluster=cluster, profile=profile)
    baselines = plan.predictions.baselines if plan.predictions else ()
    if plan.hetero is not None:  # per-stage degrees (hetplan.cost_models.hetero)
        from hetplan.cost_models.hetero import evaluate_hetero, hetero_predictions

        hev = evaluate_hetero(workload, layout, plan.stages, plan.hetero, costs,
                              check_memory=check_memory, gradient_sync=plan.gradient_sync,
                              actions=plan.pipeline_actions)
        return hev, hetero_predictions(hev, baselines)
    ev = evaluate(workload, layout, plan.stages, plan.gradient_sync, costs,
                  check_memory=check_memory, tensor_parallel=plan.tensor_parallel,
                  sparse_sync=plan.sparse_sync, actions=plan.pipeline_actions)
    return ev, predictions(ev, list(baselines), layout)
