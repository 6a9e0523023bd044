"""The ``group_sync`` part of ``hetplan inspect``: SDPipe's policy, settings and the
simulated throughput that chose it (data in :func:`group_sync_report`, text in
:func:`render_group_sync`). Plans without the section report None and print nothing."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from hetplan.ir.plan import Plan

__all__ = ["group_sync_report", "render_group_sync"]


def group_sync_report(plan: Plan) -> dict[str, Any] | None:
    """The section as plain data, or None when the plan has none."""
    gs = plan.group_sync
    if gs is None:
        return None
    return {
        "policy": gs.policy,
        "requested": gs.requested,
        "mesh": [gs.num_stages, gs.num_pipelines],
        "p": gs.p,
        "window_ms": gs.window_ms,
        "window_adapt": gs.window_adapt,
        "averaged": gs.averaged,
        "optimizer_state": gs.optimizer_state,
        "communicator": gs.communicator,
        "final_full_average": gs.final_full_average,
        "stragglers": {"probability": gs.stragglers.probability,
                       "delay_ms": gs.stragglers.delay_ms},
        "iterations": gs.iterations,
        "predictions": [p.model_dump() for p in gs.predictions],
        "speedup": gs.speedup,
        "reason": gs.reason,
    }


def render_group_sync(report: dict[str, Any], c: Console) -> None:
    """Print the report's ``group_sync`` entry (nothing when it is None)."""
    gs = report.get("group_sync")
    if gs is None:
        return
    m, n = gs["mesh"]
    c.print(f"[bold]group sync[/]: {gs['policy']} (asked: {gs['requested']}) on {m} stage(s) x "
            f"{n} pipeline(s) · {gs['reason']}")
    if gs["policy"] == "sdpipe":
        c.print(f"  P={gs['p']} groups, T={gs['window_ms']:.3f} ms ({gs['window_adapt']}), "
                f"averages {gs['averaged']}, optimizer state {gs['optimizer_state']}, "
                f"{gs['communicator']} communicators, final full average "
                f"{'on' if gs['final_full_average'] else 'off'}")
    s = gs["stragglers"]
    c.print(f"  straggler model: +{s['delay_ms']:.1f} ms with probability {s['probability']:g} "
            f"per device and iteration; {gs['iterations']} simulated iterations:")
    for p in gs["predictions"]:
        skips = f", {p['lock_skips']} lock skip(s)" if p["lock_skips"] else ""
        c.print(f"    {p['policy']:<10} {p['iters_per_s']:10.3f} it/s · mean group "
                f"{p['mean_group_size']:.2f}{skips}")
