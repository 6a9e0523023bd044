"""``hetplan explain`` for a plan with per-stage degrees (``Plan.hetero``).

Such a plan is priced by :func:`~hetplan.cost_models.hetero.evaluate_hetero`, not by the
homogeneous ``evaluate`` the other explainers re-run, so only ``stage:K`` is explained here:
stage ``K``'s device class, degrees, micro-batch per replica, layers and the resharding into
it, re-predicted with the plan's cost model; and why this device order was chosen over the
runner-up the search recorded (``hetero.search.runner_up``), which is rebuilt from its stored
layer splits and degrees and re-predicted with the same cost model, never read back from the
file.

The plan runs its own ``pipeline_actions`` (hand-edited lists included), as ``simulate``
prices it. The runner-up runs them too where they are lists for its pipeline (the same
schedule, micro-batch count and number of stages), so both orders are compared over the
same lists; otherwise it runs the lists its own schedule generates, and the alternative's
note says so (:func:`~hetplan.cost_models.evaluate.edited_lists` never maps lists onto a
pipeline of another shape).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hetplan.cost_models.evaluate import edited_lists
from hetplan.cost_models.hetero import evaluate_hetero
from hetplan.cost_models.predict import plan_costs
from hetplan.cost_models.profile_db import ProfileDB
from hetplan.errors import InfeasiblePlanError, SpecError
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan import Plan
from hetplan.optimizer.hetero import cpsat_note, rebuild_alternative
from hetplan.report._text import fmt_delta_ms, fmt_ms, ranges

__all__ = ["explain_hetero", "hetero_layout", "HeteroExplained", "per_stage_refusal"]


@dataclass(frozen=True)
class HeteroExplained:
    """What :func:`~hetplan.report.explain.explain` turns into its ``Explanation``:
    ``alternatives`` as (name, ms, delta ms, fits in memory, note)."""

    current_ms: float
    facts: tuple[tuple[str, str], ...]
    alternatives: tuple[tuple[str, float, float, bool, str], ...]
    verdict: str
    text: str


def explain_hetero(plan: Plan, target: str, *, cluster: ClusterSpec | str | Path | None = None,
                   profile: ProfileDB | str | Path | None = None) -> HeteroExplained:
    """What explains ``stage:K`` of a heterogeneous plan.

    Raises:
        SpecError: ``target`` is not ``stage:K`` of an existing stage (heterogeneous plans
            explain stages only).
    """
    hetero = plan.hetero
    assert hetero is not None
    k = _stage_index(target, len(plan.stages))
    workload, layout, costs = plan_costs(plan, cluster=cluster, profile=profile)
    note = ""
    sync = plan.gradient_sync  # each stage's sync on its DP timeline (None: the ring)
    acts = plan.pipeline_actions  # the lists the executor runs, edited ones included
    try:
        ev = evaluate_hetero(workload, layout, plan.stages, hetero, costs, gradient_sync=sync,
                             actions=acts)
    except InfeasiblePlanError as e:
        note = str(e)
        ev = evaluate_hetero(workload, layout, plan.stages, hetero, costs, check_memory=False,
                             gradient_sync=sync, actions=acts)
    current = ev.iteration_s * 1e3
    # the runner-up carries no gradient-sync section: compare both with the search's ring
    ring = current if sync is None else evaluate_hetero(
        workload, layout, plan.stages, hetero, costs, check_memory=False,
        actions=acts).iteration_s * 1e3
    st, shape = plan.stages[k], hetero.stages[k]
    slowest = max(range(len(ev.fwd_s)), key=lambda i: ev.fwd_s[i] + ev.bwd_s[i])
    facts: list[tuple[str, str]] = [
        ("stage", f"{k}: layers {st.first_layer}–{st.last_layer} "
                  f"({st.last_layer - st.first_layer + 1}), {len(st.ranks)}× "
                  f"{shape.device_class}"),
        ("degrees", f"dp {shape.dp} x tp {shape.tp}, {shape.micro_batch_size} sample(s) per "
                    f"replica of the global micro-batch of {layout.micro_batch_size}, ZeRO-"
                    f"{shape.zero_stage}, recompute {st.recompute}"),
        ("time/micro-batch", f"fwd {fmt_ms(ev.fwd_s[k] * 1e3)} + bwd "
                             f"{fmt_ms(ev.bwd_s[k] * 1e3)}; slowest stage {slowest}"),
        ("resharding in", "none: the first stage" if k == 0 else
         f"{fmt_ms(ev.reshard_s[k] * 1e3)} per micro-batch each way (from "
         f"{hetero.stages[k - 1].device_class} dp {hetero.stages[k - 1].dp} x tp "
         f"{hetero.stages[k - 1].tp})"),
        ("gradient sync", f"{fmt_ms(ev.sync_s[k] * 1e3)} on its own {shape.dp}-rank "
                          "data-parallel group(s)"),
        ("device order", " → ".join(f"{s.device_class} {s.dp}x{s.tp}" for s in hetero.stages)),
        ("search", f"{hetero.search.method}, objective {fmt_ms(hetero.search.objective_ms)}, "
                   f"gap {hetero.search.gap:.4f}"),
    ]
    facts += _pass_facts(plan, k)
    alternatives: list[tuple[str, float, float, bool, str]] = []
    runner = hetero.search.runner_up
    if runner is not None and runner.first_layers:
        lay2, stages2, het2 = rebuild_alternative(workload, costs, runner)
        name = "runner-up order " + " → ".join(
            f"{c} {d}" for c, d in zip(runner.order, runner.degrees))
        try:
            alt = evaluate_hetero(workload, lay2, stages2, het2, costs, actions=acts)
            fits, why = True, (f"micro-batch {runner.micro_batch_size}x{runner.micro_batches}, "
                               f"layers split at {list(runner.first_layers)}")
        except InfeasiblePlanError as e:
            alt = evaluate_hetero(workload, lay2, stages2, het2, costs, check_memory=False,
                                  actions=acts)
            fits, why = False, str(e)
        ms = alt.iteration_s * 1e3
        if sync is not None:
            why += f"; both with the search's ring sync (this plan: {fmt_ms(ring)})"
        if edited_lists(layout, acts) is not None:
            why += ("; with this plan's edited action lists" if edited_lists(lay2, acts)
                    is not None else "; with the action lists its own schedule generates "
                    "(this plan's edited lists are for another pipeline shape)")
        alternatives.append((name, round(ms, 6), round(ms - ring, 6) + 0.0, fits, why))
    if note:  # an edited plan that no longer fits: no order of it is "the one that fits"
        verdict = ("the plan as written does not fit in memory (note above)"
                   + ("" if not alternatives else ", nor does the runner-up order"
                      if not alternatives[0][3] else "; the runner-up order does")
                   + ": undo the edit or re-run `hetplan plan`")
    elif not alternatives:
        verdict = "no other device order fits: this order is the only feasible one"
    elif not alternatives[0][3]:
        verdict = "the runner-up order runs out of memory: this order is the only one that fits"
    elif alternatives[0][2] > 0:
        verdict = (f"this order is predicted {alternatives[0][2]:.3f} ms faster than the "
                   "runner-up order")
    else:
        verdict = (f"the runner-up order is predicted {-alternatives[0][2]:.3f} ms faster: "
                   "the plan's order is not the fastest of the two")
    lines = [f"explain {target}"]
    width = max(len(a) for a, _ in facts)
    lines += [f"  {a.ljust(width)}  {b}" for a, b in facts]
    lines.append(f"predicted iteration time as planned: {fmt_ms(current)}")
    stored = plan.predictions.iteration_time_ms if plan.predictions else None
    if stored is not None and abs(stored - current) > 1e-6:
        lines.append(f"  (the plan file says {fmt_ms(stored)})")
    if note:
        lines.append(f"  note: as planned it does not fit in memory: {note}")
    if alternatives:
        lines.append("alternatives, re-predicted with the plan's cost model:")
        for name, ms, delta, fits, why in alternatives:
            tail = "" if fits else "  [does not fit in memory]"
            lines.append(f"  {name}: {fmt_ms(ms)} ({fmt_delta_ms(delta)}){tail}")
            lines.append(f"    {why}")
    lines.append(f"verdict: {verdict}")
    return HeteroExplained(current, tuple(facts), tuple(alternatives), verdict,
                           "\n".join(lines) + "\n")


def _pass_facts(plan: Plan, k: int) -> list[tuple[str, str]]:
    """Stage ``k``'s entries of the per-stage pass sections: its layers at each
    re-balancing event, and its TP groups' controller roles."""
    out: list[tuple[str, str]] = []
    reb = plan.rebalancing
    if reb is not None and reb.events:
        moves = ", ".join(f"{a}–{b} from iteration {e.iteration}"
                          + ("" if e.applied else " (not applied)")
                          for e in reb.events for a, b in [e.stages[k]])
        out.append(("re-balancing", f"layers {moves}; predicted speedup over static "
                                    f"{reb.speedup_vs_static:.3f}x (whole plan)"))
    tp = plan.tensor_parallel
    mine = [g for g in tp.groups if g.stage == k] if tp is not None else []
    if tp is not None and mine:
        roles = [f"rank {r.rank} {r.role} γ {r.gamma:.3f}" for g in mine for r in g.roles
                 if r.role != "normal"]
        out.append(("TP controller", f"{tp.controller.variant} in {len(mine)} TP group(s); "
                    + ("; ".join(roles) if roles else "no straggler expected")))
    return out


def per_stage_refusal(plan: Plan) -> str:
    """Why ``hetplan export`` refuses a plan with per-stage degrees, or "" for a plan without
    them: torchtitan, Megatron and DeepSpeed run one ``dp x tp`` on every stage, so no
    configuration of theirs expresses it (``simulate``, ``explain``, ``timeline`` and
    ``inspect --trace`` price it with :func:`evaluate_hetero`)."""
    if plan.hetero is None:
        return ""
    return (f"hetero: the plan gives each stage its own devices and dp x tp "
            f"({plan.hetero.describe()}); torchtitan, Megatron and DeepSpeed run one dp x tp "
            "on every stage, so no configuration of theirs expresses it: export a plan made "
            "without --hetero (`hetplan plan ... --hetero off`)")


def _stage_index(target: str, n: int) -> int:
    head, _, tail = target.partition(":")
    if head != "stage" or not tail.isdigit() or int(tail) >= n:
        raise SpecError(f"a plan with per-stage degrees (hetero) explains stage:K only, K in "
                        f"0..{n - 1}; got {target!r}")
    return int(tail)


def hetero_layout(plan: Plan) -> dict[str, object]:
    """For ``hetplan inspect``: each stage's device class, ranks and degrees, and how the
    order was searched (``lines``: the same as text)."""
    hetero = plan.hetero
    assert hetero is not None
    rows = []
    lines = ["heterogeneous stages (each its own devices and dp x tp; micro-batch per replica):"]
    for st, s in zip(plan.stages, hetero.stages):
        rows.append({"stage": s.stage, "device_class": s.device_class, "dp": s.dp, "tp": s.tp,
                     "ranks": list(st.ranks), "micro_batch_size": s.micro_batch_size,
                     "zero_stage": s.zero_stage, "reshard_in_ms": s.reshard_in_ms})
        ranks = f"ranks {ranges(st.ranks)}"
        lines.append(f"  stage {s.stage}: {len(st.ranks)}× {s.device_class} ({ranks}), dp "
                     f"{s.dp} x tp {s.tp}, {s.micro_batch_size} sample(s) per replica, ZeRO-"
                     f"{s.zero_stage}, resharding in {fmt_ms(s.reshard_in_ms)}")
    search = hetero.search
    lines.append(f"  searched by {search.method}: objective {fmt_ms(search.objective_ms)}, "
                 f"bound {fmt_ms(search.bound_ms)}, gap {search.gap:.4f}")
    if search.cpsat is not None:
        lines.append(f"  {cpsat_note(search.cpsat)}")
    if search.runner_up is not None:
        r = search.runner_up
        lines.append("  runner-up order: " + " → ".join(
            f"{c} {d}" for c, d in zip(r.order, r.degrees))
            + f", predicted {fmt_ms(r.iteration_time_ms)} (`hetplan explain PLAN stage:0`)")
    return {"stages": rows, "method": search.method, "gap": search.gap, "lines": lines,
            "cpsat": search.cpsat.model_dump() if search.cpsat is not None else None}
