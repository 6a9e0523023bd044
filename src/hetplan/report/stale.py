"""Whether a plan's stored prediction still holds, for ``hetplan inspect``.

A plan file stores what was predicted for it when it was written: its ``predictions`` and
each stage's ``fwd_ms``, ``bwd_ms`` and ``memory_bytes``. A hand edit (stages, buckets, the
pipeline's action lists, a stage's recomputation ...) leaves them as they were, and
``inspect`` showed them as the plan's prediction. :func:`check_prediction` re-predicts the
plan as ``hetplan simulate`` does (:func:`~hetplan.cost_models.predict.evaluate_plan`: one
evaluation with the plan's embedded workload, cluster and cost settings; cheap beside
planning) and compares:

* equal: the plan is shown as stored, and the report is the one it always was;
* different: the re-predicted numbers are shown, with a line giving the stored iteration
  time and the re-predicted one;
* a plan predicted with a profile DB (``cost_settings.profile_fingerprint``) is re-predicted
  only with that DB (``--profile``): with none, or another, the stored numbers are shown and
  a line says they were not re-checked (``hetplan inspect`` refuses another DB outright, as
  it has nothing else to do with it; ``hetplan diff`` compares plans through this check
  too). A plan without a workload summary, a cluster spec or predictions is shown as stored
  (the report's warnings say what it lacks).

Memory is not checked here: an edited plan that no longer fits is shown with its
re-predicted memory (the memory section's ``out-of-memory`` warning names the ranks).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from hetplan.cost_models.hetero import HeteroEvaluation
from hetplan.cost_models.predict import evaluate_plan, resolve_profile
from hetplan.cost_models.profile_db import ProfileDB
from hetplan.errors import HetplanError
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import Stage

__all__ = ["PredictionCheck", "check_prediction", "add_check"]

_WHY = "the plan was edited (or written by another hetplan version)"


@dataclass(frozen=True)
class PredictionCheck:
    """The outcome of :func:`check_prediction`.

    Attributes:
        plan: the plan to show: the one given, or with its predictions and stage times
            re-predicted where they were stale.
        status: ``holds`` (re-predicted equal, or nothing to check), ``stale`` or
            ``unchecked`` (the costs it was predicted with are not at hand).
        note: one line for the user ("" when it holds).
        stored_ms: the stored iteration time (None without predictions).
        predicted_ms: the re-predicted one (None where not re-predicted).
    """

    plan: Plan
    status: Literal["holds", "stale", "unchecked"]
    note: str = ""
    stored_ms: float | None = None
    predicted_ms: float | None = None


def check_prediction(plan: Plan, *, profile: ProfileDB | str | Path | None = None
                     ) -> PredictionCheck:
    """Re-predict ``plan`` and compare with what it stores (see the module docstring).

    Args:
        plan: a valid plan.
        profile: the profile DB (or its path) the plan was predicted with, if it was.

    Raises:
        SpecError: ``profile`` cannot be read.
    """
    stored = plan.predictions
    if stored is None or plan.model.workload is None or plan.cluster.spec is None:
        return PredictionCheck(plan, "holds")
    was = f"stored prediction {stored.iteration_time_ms:.3f} ms"
    recorded = plan.cost_settings.profile_fingerprint if plan.cost_settings else ""
    db = resolve_profile(profile) if recorded else None
    if recorded and db is None:
        return PredictionCheck(
            plan, "unchecked", f"{was} not re-checked: the plan was predicted with profile DB "
            f"{recorded}, which the file does not carry; give it with --profile DB",
            stored.iteration_time_ms)
    if db is not None and db.fingerprint() != recorded:
        return PredictionCheck(
            plan, "unchecked", f"{was} not re-checked: --profile {profile} is profile DB "
            f"{db.fingerprint()}, not the one the plan was predicted with ({recorded})",
            stored.iteration_time_ms)
    try:
        ev, fresh = evaluate_plan(plan, profile=db, check_memory=False)
    except HetplanError as e:
        return PredictionCheck(plan, "unchecked", f"{was} not re-checked: the plan cannot be "
                               f"re-predicted: {e}", stored.iteration_time_ms)
    stages = _timed_stages(plan, ev)
    changed = [name for name, differs in (
        ("breakdown", fresh.breakdown != stored.breakdown),
        ("memory per rank", fresh.memory_per_rank_bytes != stored.memory_per_rank_bytes
         or fresh.memory_breakdown != stored.memory_breakdown),
        ("bubble ratio", (fresh.bubble_ratio, fresh.bubble_ratio_balanced,
                          fresh.bubble_ratio_eq1) != (stored.bubble_ratio,
                                                      stored.bubble_ratio_balanced,
                                                      stored.bubble_ratio_eq1)),
        ("stage times", stages != plan.stages)) if differs]
    now = fresh.iteration_time_ms
    if now == stored.iteration_time_ms and not changed:
        return PredictionCheck(plan, "holds", "", now, now)
    shown = plan.model_copy(update={"predictions": fresh, "stages": stages})
    if now != stored.iteration_time_ms:
        before, after = _distinct(stored.iteration_time_ms, now)
        note = (f"stored prediction {before} ms is stale: {_WHY}; re-predicted {after} ms "
                "(as `hetplan simulate`)")
    else:
        note = (f"stored prediction is stale in its {', '.join(changed)}: {_WHY}; "
                f"re-predicted (iteration time {now:.3f} ms unchanged)")
    return PredictionCheck(shown, "stale", note, stored.iteration_time_ms, now)


def _distinct(a: float, b: float) -> tuple[str, str]:
    """``a`` and ``b`` (ms, different) at 3 decimals, or at as many more as tell them apart:
    a prediction that moved by less than 0.0005 ms read "stored prediction 0.534 ms is
    stale: ...; re-predicted 0.534 ms"."""
    for digits in (3, 6, 9):
        x, y = f"{a:.{digits}f}", f"{b:.{digits}f}"
        if x != y:
            return x, y
    return repr(a), repr(b)


def _timed_stages(plan: Plan, ev: Any) -> tuple[Stage, ...]:
    """The plan's stages with the per-micro-batch times and peak memory of evaluation
    ``ev``, as the planner writes them (``compile`` / ``compile_hetero``), validated (so
    rounded as read from a file). A plan without a pipeline may list no stages (the
    evaluation then times the model as one): none to time."""
    if not plan.stages:
        return plan.stages
    if isinstance(ev, HeteroEvaluation):
        times = list(zip(ev.fwd_s, ev.bwd_s))
    else:
        times = [(c.fwd_s, c.bwd_s) for c in ev.stages]
    return tuple(Stage.model_validate({**st.model_dump(), "fwd_ms": f * 1e3, "bwd_ms": b * 1e3,
                                       "memory_bytes": ev.memory[st.ranks[0]].total})
                 for st, (f, b) in zip(plan.stages, times, strict=True))


def add_check(report: dict[str, Any], check: PredictionCheck) -> dict[str, Any]:
    """``report`` (:func:`~hetplan.report.inspect.build_report` of ``check.plan``) with the
    check's line: ``predictions.check`` (status, stored and re-predicted ms, the note) and,
    when stale, a ``stale-prediction`` warning. Unchanged when the prediction holds."""
    if not check.note:
        return report
    if "predictions" in report:
        report["predictions"]["check"] = {
            "status": check.status, "stored_iteration_time_ms": check.stored_ms,
            "predicted_iteration_time_ms": check.predicted_ms, "note": check.note}
    if check.status == "stale" and "warnings" in report:
        report["warnings"].insert(0, {"kind": "stale-prediction", "message": check.note})
    return report
