"""The pass pipeline on a chosen heterogeneous plan, and its re-prediction.

:func:`with_passes` runs ``compile()``'s passes on the plan :func:`~hetplan.optimizer.
hetero.compile_hetero` chose (:func:`~hetplan.passes._hetero_sync.run_hetero_passes`:
gradient-sync passes per stage, the others logged with why they do not apply), re-predicts
it with each stage's per-bucket DP timeline, and, with compressors allowed, chooses each
stage's ZeRO stage. Its own module so that the search module stays the search.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.hetero import HeteroEvaluation, evaluate_hetero
from hetplan.errors import InfeasiblePlanError
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import PassLogEntry, WorkloadSummary
from hetplan.passes._hetero_sync import run_hetero_passes
from hetplan.passes.base import Pass

__all__ = ["with_passes"]


def with_passes(workload: WorkloadSummary, costs: CostModel, plan: Plan,
                 passes: Sequence[Pass], ev: HeteroEvaluation
                 ) -> tuple[Plan, HeteroEvaluation]:
    """``plan`` after ``passes`` (:func:`~hetplan.passes._hetero_sync.run_hetero_passes`)
    and its prediction with each stage's DP timeline (``ev``: the search's, with the ring
    sync).

    With compressors allowed, the ZeRO stage is then chosen per stage, as ``compile()``
    chooses it per layout: a compressed sync under ZeRO-1 all-gathers the updated weights
    on top of it, so each stage the search gave ZeRO-1 is tried at ZeRO-0 (the passes re-run
    on the plan), kept where the plan is predicted faster and still fits. Stages sync on
    disjoint groups, so one stage's choice does not change another's sync. Last, the plan
    with the passes' compressors removed (fp32 routings only, ZeRO as searched) replaces it
    where that is predicted faster: Espresso with compressors chooses per tensor and does
    not also re-route the incoming buckets as it does without them, so allowing compressors
    could otherwise predict slower (gpt2-medium on mixed-generations: 243.015 ms with
    dgc,fp16 vs 242.791 ms without)."""
    layout = plan.layout
    assert layout is not None
    base, ring_ms = plan, ev.iteration_s * 1e3
    plan = run_hetero_passes(base, passes, costs)
    if plan.gradient_sync is None:
        return plan, ev
    het = plan.hetero
    assert het is not None
    ev = evaluate_hetero(workload, layout, plan.stages, het, costs,
                         gradient_sync=plan.gradient_sync)
    notes = [f"each stage's gradient sync on its own DP group's timeline: predicted "
             f"{ev.iteration_s * 1e3:.3f} ms (the search's closed-form ring sync: "
             f"{ring_ms:.3f} ms)"]
    if any(getattr(p, "compressors", ()) for p in passes):
        for shape in het.stages:
            if shape.zero_stage != 1:
                continue
            shapes = tuple(s.model_copy(update={"zero_stage": 0}) if s.stage == shape.stage
                           else s for s in het.stages)
            trial_het = het.model_copy(update={"stages": shapes})
            trial = run_hetero_passes(base.model_copy(update={"hetero": trial_het}), passes,
                                      costs)
            try:
                trial_ev = evaluate_hetero(workload, layout, plan.stages, trial_het,
                                           costs, gradient_sync=trial.gradient_sync)
            except InfeasiblePlanError:
                notes.append(f"stage {shape.stage}: ZeRO-0 (for compressed sync) does not "
                             "fit; kept ZeRO-1")
                continue
            better = trial_ev.iteration_s < ev.iteration_s
            notes.append(f"stage {shape.stage}: ZeRO-0 with the passes re-run predicts "
                         f"{trial_ev.iteration_s * 1e3:.3f} ms vs ZeRO-1 "
                         f"{ev.iteration_s * 1e3:.3f} ms; "
                         + ("took ZeRO-0" if better else "kept ZeRO-1"))
            if better:
                plan, ev, het = trial, trial_ev, trial_het
        plan, ev = _fp32_guard(workload, costs, base, passes, plan, ev, notes)
    stages = tuple(st.model_copy(update={"memory_bytes": ev.memory[st.ranks[0]].total})
                   for st in plan.stages)
    return plan.model_copy(update={"stages": stages, "pass_log": plan.pass_log + (
        PassLogEntry(name="hetero-sync", changed=True, notes=tuple(notes)),)}), ev


def _fp32_guard(workload: WorkloadSummary, costs: CostModel, base: Plan,
                passes: Sequence[Pass], plan: Plan, ev: HeteroEvaluation, notes: list[str]
                ) -> tuple[Plan, HeteroEvaluation]:
    """``(plan, ev)``, or the plan of ``passes`` without compressors on ``base`` where that
    is predicted faster (see :func:`with_passes`); the verdict goes to ``notes``."""
    if not any(getattr(p, "compressors", ()) for p in passes):
        return plan, ev
    plain = [dataclasses.replace(p, compressors=())  # type: ignore[type-var]
             if getattr(p, "compressors", ()) else p for p in passes]
    other = run_hetero_passes(base, plain, costs)
    assert base.layout is not None and base.hetero is not None
    other_ev = evaluate_hetero(workload, base.layout, base.stages, base.hetero, costs,
                               gradient_sync=other.gradient_sync)
    better = other_ev.iteration_s < ev.iteration_s
    notes.append(f"without compressors (fp32 routings, ZeRO as searched): "
                 f"{other_ev.iteration_s * 1e3:.3f} ms vs {ev.iteration_s * 1e3:.3f} ms; "
                 + ("took it" if better else "kept the compressed plan"))
    return (other, other_ev) if better else (plan, ev)
