"""The ``rebalancing`` part of ``hetplan inspect``: DynPipe's re-balancing of a dynamic
model, one line per event with each stage's layers (and, on a plan with per-stage degrees,
the stage's device class and ``dp x tp``, which the stage keeps). Data in
:func:`rebalancing_report`, text in :func:`render_rebalancing`; plans without the section
report None and print nothing."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from hetplan.ir.plan import Plan

__all__ = ["rebalancing_report", "render_rebalancing"]


def rebalancing_report(plan: Plan) -> dict[str, Any] | None:
    """The section as plain data, or None when the plan has none."""
    reb = plan.rebalancing
    if reb is None:
        return None
    het = plan.hetero
    stages = ([f"{s.device_class} {s.dp}x{s.tp}" for s in het.stages] if het is not None
              else [f"stage {st.index}" for st in plan.stages])
    return {
        "policy": reb.policy.model_dump(mode="json"),
        "total_iterations": reb.total_iterations,
        "speedup_vs_static": reb.speedup_vs_static,
        "stages": stages,
        "events": [{"iteration": e.iteration, "label": e.label,
                    "layers": [list(b) for b in e.stages], "applied": e.applied,
                    "before_ms": e.predicted_before_ms, "after_ms": e.predicted_after_ms,
                    "bytes_moved": e.bytes_moved} for e in reb.events],
    }


def render_rebalancing(report: dict[str, Any], c: Console) -> None:
    """Print the report's ``rebalancing`` entry (nothing when it is None)."""
    rb = report.get("rebalancing")
    if rb is None:
        return
    pol = rb["policy"]
    c.print(f"[bold]re-balancing[/]: {pol['balancer']} by {pol['metric']}, trigger "
            f"{pol['trigger']}, {len(rb['events'])} event(s) over {rb['total_iterations']} "
            f"iterations, predicted speedup over static {rb['speedup_vs_static']:.3f}x")
    for e in rb["events"]:
        layers = " | ".join(f"{name}: {a}–{b}" for name, (a, b) in zip(rb["stages"],
                                                                      e["layers"]))
        verdict = "applied" if e["applied"] else "not applied"
        c.print(f"  iteration {e['iteration']} ({e['label']}): {layers}; "
                f"{e['before_ms']:.3f} → {e['after_ms']:.3f} ms, {verdict}")
