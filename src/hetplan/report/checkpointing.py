"""The ``checkpointing`` entry of ``hetplan inspect``: Gemini's placement, chunk schedule and
predicted numbers beside the remote-storage baseline (plan section
:mod:`hetplan.ir.plan_checkpointing`).

:func:`checkpointing_report` turns the section into plain data (``{"available": False}``
without one); :func:`render_checkpointing` prints it, and prints nothing for a plan without
the section, so reports of plans that do not checkpoint read as before.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape

from hetplan.ir.plan import Plan
from hetplan.report._text import fmt_bytes, fmt_ms, fmt_pct

__all__ = ["checkpointing_report", "render_checkpointing"]


def checkpointing_report(plan: Plan) -> dict[str, Any]:
    """The checkpointing section as JSON-ready data."""
    ck = plan.checkpointing
    if ck is None:
        return {"available": False}
    schedules = []
    for s in ck.schedules:
        per_span: dict[int, int] = {}
        for c in s.chunks:
            per_span[c.span] = per_span.get(c.span, 0) + 1
        schedules.append({
            "id": s.id, "state_bytes": s.state_bytes, "ranks": [r.rank for r in ck.ranks
                                                                 if r.schedule == s.id],
            "spans": len(s.spans), "idle_ms": round(sum(x.duration_ms for x in s.spans), 6),
            "chunks": len(s.chunks), "spans_used": len(per_span),
            "overflow_bytes": s.overflow_bytes, "overflow_ms": s.overflow_ms,
        })
    return {
        "available": True,
        "method": ck.method, "replicas": ck.replicas, "placement": ck.placement,
        "node_groups": [list(g) for g in ck.node_groups],
        "node_holders": [list(h) for h in ck.node_holders],
        "rank_holders": {str(r.rank): list(r.holders) for r in ck.ranks},
        "buffer_bytes": ck.buffer_bytes, "sub_buffers": ck.sub_buffers, "mu": ck.mu,
        "every_iters": ck.every_iters, "storage_every_iters": ck.storage_every_iters,
        "storage_bandwidth_gbps": ck.storage_bandwidth_gbps,
        "storage_bandwidth_assumed": ck.storage_bandwidth_assumed,
        "cpu_memory_checked": ck.cpu_memory_checked,
        "schedules": schedules,
        "recovery": [r.model_dump(mode="json") for r in ck.recovery],
        "gemini": ck.gemini.model_dump(mode="json"),
        "baseline": ck.baseline.model_dump(mode="json"),
    }


def _fmt_groups(groups: list[list[int]], limit: int = 8) -> str:
    shown = " ".join("{" + ",".join(map(str, g)) + "}" for g in groups[:limit])
    return shown + (f" … ({len(groups)} groups)" if len(groups) > limit else "")


def render_checkpointing(report: dict[str, Any], c: Console) -> None:
    """Print the checkpointing entry of ``report`` (nothing when the plan has none)."""
    ck = report.get("checkpointing") or {"available": False}
    if not ck["available"]:
        return
    c.print(f"checkpointing: [bold]{ck['method']}[/], m={ck['replicas']} replicas, "
            f"{ck['placement']} placement over {len(ck['node_holders'])} nodes")
    c.print(f"  node groups {_fmt_groups(ck['node_groups'])}")
    holders = ck["rank_holders"]
    first = list(holders.items())[:4]
    c.print("  rank holders " + ", ".join(f"{r}→{h[1:]}" for r, h in first)
            + (" …" if len(holders) > 4 else ""))
    c.print(f"  buffer {fmt_bytes(ck['buffer_bytes'])} in {ck['sub_buffers']} sub-buffers, "
            f"μ={ck['mu']}; CPU checkpoint every {ck['every_iters']} iteration(s), storage "
            f"fallback every {ck['storage_every_iters']}")
    for s in ck["schedules"][:4]:
        c.print(f"  schedule {s['id']}: {fmt_bytes(s['state_bytes'])} state, {s['chunks']} "
                f"chunks in {s['spans_used']} of {s['spans']} idle spans "
                f"({fmt_ms(s['idle_ms'])} idle), overflow {fmt_bytes(s['overflow_bytes'])}"
                f" ({len(s['ranks'])} rank(s))")
    odds = ", ".join(
        f"k={r['failed_nodes']}: {r['exact']} = {fmt_pct(r['probability'])}"
        + (f" (Eq. 6.4 ≥ {fmt_pct(r['eq64_bound'])})" if r["eq64_bound"] is not None else "")
        for r in ck["recovery"])
    c.print(f"  recovery from CPU memory: {odds}")
    for cost in (ck["gemini"], ck["baseline"]):
        per_day = (f", {fmt_ms(cost['wasted_ms_per_day'])}/day"
                   if cost["wasted_ms_per_day"] is not None else "")
        c.print(f"  {escape(cost['name'])}: checkpoint {fmt_ms(cost['checkpoint_ms'])} every "
                f"{cost['every_iters']} it., retrieval {fmt_ms(cost['retrieval_ms'])}, "
                f"slowdown {fmt_pct(cost['slowdown'])}, wasted {fmt_ms(cost['wasted_ms'])} "
                f"per failure{per_day}")
    if ck["storage_bandwidth_assumed"]:
        c.print(f"  (storage bandwidth not in the cluster spec: assumed "
                f"{ck['storage_bandwidth_gbps']} Gb/s)")
