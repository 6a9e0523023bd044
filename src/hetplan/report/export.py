"""``hetplan export``: a plan as the launch configuration of torchtitan, Megatron or DeepSpeed.

What it decides: for one engine, the values that engine's own configuration takes for the
parts of the plan it can express — layout (dp / pp / tp, virtual stages, the stage split
where the engine takes one), micro-batch size and count / global batch, pipeline schedule,
recomputation, ZeRO / FSDP, precision (bf16 / fp16 with dynamic loss scaling) and sequence
parallelism — and the parts it cannot express (uneven stages or TP shards, per-tensor
compression, hierarchical routing, fusion buckets, Zen sparse sync, re-balancing,
per-device precision, hand-edited pipeline action lists ...).

What each unexpressed part was worth: the plan is re-predicted with that part as the engine
runs it (dropped, or replaced by the engine's nearest setting), with the plan's own cost
model (:func:`hetplan.cost_models.predict.plan_costs` and
:func:`hetplan.cost_models.evaluate.evaluate`, the objective ``compile`` optimized), one
part at a time and all of them together (what the exported configuration is predicted to
run at). The current plan is re-evaluated the same way, so differences never mix two cost
models; the baselines the plan carries are listed beside them. Every variant keeps the
plan's sparse-sync section (``sparse-sync`` drops it), as ``simulate`` prices it. The plan,
and every variant that keeps its pipeline layout, runs the plan's own ``pipeline_actions``
as ``simulate`` does; the ``edited-action-lists`` part (only when they differ from the
generated lists) is worth the difference between the plan with them and with the generated
lists.

Inputs: a plan (read, never re-searched) and an engine name. Output: an :class:`Export` with
the file text, the values, the priced gaps and a readable report. Deterministic: the same
plan gives the same bytes. Cost: one evaluation per unexpressed part, plus two.

Example:
    >>> result = export_plan(plan, "megatron")  # doctest: +SKIP
    >>> print(result.content)  # doctest: +SKIP
    --num-layers 12
    --tensor-model-parallel-size 2
    ...
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from functools import reduce
from pathlib import Path
from typing import Any

from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.evaluate import Evaluation, evaluate
from hetplan.cost_models.precision import resolve_precision
from hetplan.cost_models.predict import plan_costs
from hetplan.cost_models.profile_db import ProfileDB
from hetplan.errors import InfeasiblePlanError, SpecError
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import CostSettings, Stage
from hetplan.ir.validation import did_you_mean
from hetplan.report._export_engines import ENGINES, WRITERS, EngineConfig
from hetplan.report._export_gaps import PlanView, Unexpressed, Variant, split_buckets
from hetplan.report._text import fmt_delta_ms, fmt_ms
from hetplan.report.explain_hetero import per_stage_refusal

__all__ = ["ENGINES", "Gap", "Export", "export_plan", "plan_view"]

_TITLES = {
    "deepspeed": "DeepSpeed ds_config (deepspeed.initialize(config=...))",
    "megatron": "Megatron-LM pretrain_gpt.py arguments",
    "torchtitan": "torchtitan 0.3 overrides (after --module M --config C)",
}


@dataclass(frozen=True)
class Gap:
    """A part of the plan the engine cannot express, and what it was worth.

    Attributes:
        part: short key (``uneven-stages``, ``compression`` ...).
        plan_does: what the plan does.
        exported_as: what the exported configuration does instead.
        iteration_time_ms: the plan re-predicted without this part alone (None: not an
            iteration-time decision; see ``worth``).
        delta_ms: ``iteration_time_ms`` minus the plan's (positive: the part saved time).
        fits_memory: whether every rank still fits without it.
        worth: the part's predicted worth in words.
    """

    part: str
    plan_does: str
    exported_as: str
    iteration_time_ms: float | None
    delta_ms: float | None
    fits_memory: bool
    worth: str


@dataclass(frozen=True)
class Export:
    """A plan exported to one engine.

    Attributes:
        engine: ``deepspeed``, ``megatron`` or ``torchtitan``.
        content: the file to write (JSON for DeepSpeed, one argument per line otherwise).
        values: the exported values in the engine's own names.
        gaps: the parts the engine cannot express, each priced alone.
        plan_ms: the plan's iteration time, re-predicted with its cost model.
        exported_ms: the iteration time of the plan without every gap (what the exported
            configuration is predicted to run at).
        exported_fits: whether that plan fits in memory.
        exported_note: why it does not fit, or "".
        notes: what the user supplies, and approximations that are not priced.
        baselines: (name, predicted ms) of the baselines the plan carries.
        text: the readable report.
    """

    engine: str
    content: str
    values: dict[str, Any]
    gaps: tuple[Gap, ...]
    plan_ms: float
    exported_ms: float
    exported_fits: bool
    exported_note: str
    notes: tuple[str, ...]
    baselines: tuple[tuple[str, float], ...] = ()
    text: str = field(default="", compare=False)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``hetplan export --json``."""
        return asdict(self)


def plan_view(plan: Plan, costs: CostModel) -> PlanView:
    """The facts of ``plan`` the engine writers read (see :class:`PlanView`)."""
    workload, layout = plan.model.workload, plan.layout
    if workload is None or layout is None:
        raise SpecError("export needs a complete plan (a layout and the workload summary); "
                        "re-run `hetplan plan`")
    stages = plan.stages or (Stage(index=0, first_layer=0, last_layer=len(workload.layers) - 1,
                                   ranks=tuple(range(layout.num_ranks))),)
    settings = plan.cost_settings or CostSettings()
    fallback = settings.dtype if settings.dtype in ("fp32", "bf16", "fp16") else "fp32"
    dtypes: dict[str, str] = {}
    for r in range(layout.num_ranks):
        t = costs.devices[r].type
        dtypes[t] = plan.precision.compute_dtype(t) if plan.precision is not None else fallback
    return PlanView(plan, workload, layout, stages, dtypes)


class _Pricer:
    """Re-predicts variants of one plan with the plan's cost model."""

    def __init__(self, plan: Plan, cluster: Any, profile: Any) -> None:
        self.plan = plan
        self.profile = profile
        self.workload, self.layout, self.costs = plan_costs(plan, cluster=cluster,
                                                            profile=profile)
        self._forced: dict[str, CostModel] = {}

    def costs_for(self, precision: str | None) -> CostModel:
        if precision is None:
            return self.costs
        if precision not in self._forced:
            c = self.costs
            settings = self.plan.cost_settings or CostSettings()
            self._forced[precision] = CostModel(
                c.cluster, c.db, dtype=precision, efficiency=settings.efficiency,
                optimizer=c.optimizer, precision=resolve_precision(precision, c.cluster))
        return self._forced[precision]

    def price(self, v: Variant) -> tuple[float | None, bool, str]:
        """(iteration ms, fits in memory, why not); the ms are None when the cost model
        refuses the combination (e.g. compression under ZeRO-2), with its reason."""
        sync = split_buckets(self.workload, v.stages, v.sync)
        costs = self.costs_for(v.precision)

        def run(check_memory: bool) -> Evaluation:
            return evaluate(self.workload, v.layout, v.stages, sync, costs,
                            check_memory=check_memory, tensor_parallel=v.tp,
                            sparse_sync=v.sparse, actions=v.actions)

        try:
            try:
                ev, note = run(True), ""
            except InfeasiblePlanError as e:
                ev, note = run(False), str(e)
        except SpecError as e:
            return None, True, str(e)
        return round(ev.iteration_s * 1e3, 6), not note, note


def export_plan(
    plan: Plan,
    engine: str,
    *,
    cluster: ClusterSpec | str | Path | None = None,
    profile: ProfileDB | str | Path | None = None,
) -> Export:
    """Export ``plan`` to ``engine`` (see the module docstring).

    Args:
        plan: a complete plan with a workload summary and an embedded cluster.
        engine: ``deepspeed``, ``megatron`` or ``torchtitan``.
        cluster: the cluster, when the plan does not embed it.
        profile: the profile DB the plan was made with (analytic costs otherwise).

    Raises:
        SpecError: an unknown engine (the message lists them), a plan with per-stage
            degrees (no engine runs stages of different dp x tp), or a plan that cannot be
            re-evaluated (no workload summary, no cluster, no layout).
    """
    if engine not in WRITERS:
        raise SpecError(f"--to: unknown engine {engine!r}{did_you_mean(engine, list(ENGINES))}"
                        f" (known: {', '.join(ENGINES)})")
    if why := per_stage_refusal(plan):
        raise SpecError(why)
    pricer = _Pricer(plan, cluster, profile)
    view = plan_view(plan, pricer.costs)
    cfg = WRITERS[engine](view)
    base = view.variant()
    plan_ms, _, why = pricer.price(base)
    if plan_ms is None:
        raise SpecError(f"the plan cannot be re-predicted: {why}")
    gaps = tuple(_priced(pricer, base, u, plan_ms) for u in cfg.unexpressed)
    priced = [u.apply for u in cfg.unexpressed if u.apply is not None]
    exported = reduce(lambda v, f: f(v), priced, base)
    exp_ms, exp_fits, exp_note = pricer.price(exported)
    if exp_ms is None:
        raise SpecError(f"the exported configuration cannot be priced: {exp_note}")
    baselines = tuple((b.name, b.iteration_time_ms)
                      for b in (plan.predictions.baselines if plan.predictions else ()))
    result = Export(engine, cfg.content, cfg.values, gaps, plan_ms, exp_ms, exp_fits,
                    exp_note, cfg.notes, baselines)
    return Export(**{**asdict(result), "gaps": gaps, "text": _text(result, view, cfg)})


def _priced(pricer: _Pricer, base: Variant, u: Unexpressed, plan_ms: float) -> Gap:
    if u.apply is None:
        return Gap(u.part, u.plan_does, u.exported_as, None, None, True, u.worth)
    ms, fits, note = pricer.price(u.apply(base))
    if ms is None:
        return Gap(u.part, u.plan_does, u.exported_as, None, None, True,
                   f"not priced alone: the cost model refuses the plan with only this part "
                   f"changed ({note})")
    delta = round(ms - plan_ms, 6) + 0.0
    if not fits:
        worth = f"without it the plan does not fit in memory ({note})"
    elif delta > 0:
        worth = f"saves {fmt_ms(delta)} per iteration"
    elif delta < 0:
        worth = f"costs {fmt_ms(-delta)} per iteration under the engine's setting"
    else:
        worth = "no predicted difference"
    return Gap(u.part, u.plan_does, u.exported_as, ms, delta, fits, worth)


def _text(r: Export, view: PlanView, cfg: EngineConfig) -> str:
    lay = view.layout
    lines = [f"export to {r.engine}: {_TITLES[r.engine]}"]
    chunks = f" x {lay.virtual_stages} virtual stages" if lay.virtual_stages > 1 else ""
    lines.append(f"  plan  dp={lay.dp} pp={lay.pp}{chunks} tp={lay.tp}, {lay.micro_batches} "
                 f"micro-batch(es) of {lay.micro_batch_size} (global batch "
                 f"{view.global_batch}), schedule {lay.schedule}, ZeRO-{lay.zero_stage}"
                 + (", sequence parallel" if lay.sequence_parallel else ""))
    lines.append(f"predicted iteration time, re-evaluated with the plan's cost model: plan "
                 f"{fmt_ms(r.plan_ms)}, as exported {fmt_ms(r.exported_ms)} "
                 f"({fmt_delta_ms(r.exported_ms - r.plan_ms)})"
                 + ("" if r.exported_fits else "  [does not fit in memory]"))
    if not r.exported_fits:
        lines.append(f"  note: {r.exported_note}")
    if r.gaps:
        lines.append(f"not expressible in {r.engine} (each priced alone: the plan "
                     "re-predicted with only that part as exported):")
        for g in r.gaps:
            ms = f"{fmt_ms(g.iteration_time_ms)} ({fmt_delta_ms(g.delta_ms)}): " \
                if g.iteration_time_ms is not None and g.delta_ms is not None else ""
            lines.append(f"  {g.part}: {g.plan_does}")
            lines.append(f"    exported as: {g.exported_as}")
            lines.append(f"    priced as exported: {ms}{g.worth}")
    else:
        lines.append(f"every part of the plan is expressed in {r.engine}")
    for n in r.notes:
        lines.append(f"note: {n}")
    if r.baselines:
        lines.append("baselines the plan carries: " + ", ".join(
            f"{name} {fmt_ms(ms)}" for name, ms in r.baselines))
    return "\n".join(lines) + "\n"
