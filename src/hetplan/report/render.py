"""Rendering of an inspection report (:func:`hetplan.report.inspect.build_report`) with rich.

:func:`render_report` prints to any rich console (the CLI's, in colour on a terminal);
:func:`render_text` returns plain text at a fixed width (golden files, logs). Everything shown
comes from the report dict, so ``hetplan inspect`` and ``hetplan inspect --json`` agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from hetplan.report._text import (
    device_mix,
    fmt_bytes,
    fmt_ms,
    fmt_pct,
    layer_label,
    plain_text,
    ranges,
)
from hetplan.report.checkpointing import render_checkpointing
from hetplan.report.group_sync import render_group_sync
from hetplan.report.rebalancing import render_rebalancing
from hetplan.report.inspect import SECTIONS

__all__ = ["render_report", "render_text"]


def render_text(report: dict[str, Any], *, sections: Sequence[str] = (),
                width: int = 100) -> str:
    """The report as plain text (no colour) at ``width`` columns."""
    return plain_text(lambda c: render_report(report, c, sections=sections), width=width)


def render_report(report: dict[str, Any], console: Console, *,
                  sections: Sequence[str] = ()) -> None:
    """Print the sections of ``report`` (all of them by default) to ``console``."""
    chosen = [s for s in SECTIONS if s in sections] if sections else list(SECTIONS)
    for name in chosen:
        _RENDERERS[name](report, console)
        if sections and name in _ABSENT and not _present(report, name):
            # asked for by name: say the plan has none, rather than print nothing
            console.print(f"{name}: none ({_ABSENT[name]})", markup=False)


#: The sections only some plans have, each with what writes it.
_ABSENT = {
    "checkpointing": "the plan was made without `hetplan plan --checkpoint gemini`",
    "group_sync": "the plan was made without `hetplan plan --group-sync sdpipe|auto`",
    "rebalancing": "the plan was made without `hetplan plan --dynamics FILE`",
}


def _present(report: dict[str, Any], name: str) -> bool:
    entry = report.get(name)
    return entry is not None and (name != "checkpointing" or bool(entry["available"]))


def _n(count: int, one: str, many: str) -> str:
    return f"{count} {one if count == 1 else many}"


def _table(title: str, columns: Sequence[tuple[str, str]]) -> Table:
    table = Table(title=title, title_justify="left")
    for col, just in columns:
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    return table


def _layout(report: dict[str, Any], c: Console) -> None:
    lay = report["layout"]
    c.print(f"[bold]plan[/] for {escape(lay['model'])} on {escape(lay['cluster'])} "
            f"({lay['world_size']} devices), written by hetplan {lay['tool_version']}")
    c.print(f"model fingerprint {lay['model_fingerprint']} · cluster fingerprint "
            f"{lay['cluster_fingerprint']}")
    if lay["device_types"]:
        kind = "heterogeneous" if lay["heterogeneous"] else "homogeneous"
        c.print(f"devices: {device_mix(lay['device_types'])} ({kind}, {lay['nodes']} node(s))")
    if not lay["decided"]:
        c.print("layout: undecided")
        return
    batch = f", global batch {lay['global_batch_size']}" if lay["global_batch_size"] else ""
    virtual = f", {lay['virtual_stages']} virtual stages" if lay["virtual_stages"] > 1 else ""
    # per-stage degrees: the layout keeps dp = tp = 1 and the pipeline's micro-batch, which
    # read as one rank training the whole batch ("dp=1 pp=1 tp=1 ... 16 of 32 ranks used")
    degrees = (f"pp={lay['pp']} with each stage's own dp x tp (below)" if lay.get("hetero")
               else f"dp={lay['dp']} pp={lay['pp']} tp={lay['tp']}")
    mb = " (through the pipeline, split over each stage's replicas)" if lay.get("hetero") else ""
    c.print(f"layout: {degrees}, schedule {lay['schedule']}, "
            f"{_n(lay['micro_batches'], 'micro-batch', 'micro-batches')} of "
            f"{lay['micro_batch_size']}{mb}{batch}{virtual}"
            f" · {lay['ranks_used']} of {lay['world_size']} ranks used")
    for line in lay.get("hetero", {}).get("lines", ()):
        c.print(escape(line))
    c.print(f"strategy: {_strategy(lay)}")


def _strategy(lay: dict[str, Any]) -> str:
    """Precision per device type, ZeRO, sequence parallelism, recomputation per stage."""
    prec = lay.get("precision")
    if prec:
        dtypes = ", ".join(
            f"{t} {d['compute_dtype']}" + (" + loss scaling" if d["loss_scaling"] != "none"
                                           else "")
            for t, d in prec["devices"].items())
        parts = [f"precision {prec['policy']} ({dtypes})"]
    else:
        parts = ["precision as cost settings"]
    # a heterogeneous plan's ZeRO stage is per stage (its layout's is 0)
    zeros = [row["zero_stage"] for row in lay.get("hetero", {}).get("stages", ())]
    if any(zeros):
        parts.append("ZeRO per stage " + " ".join(str(z) for z in zeros))
    else:
        parts.append(f"ZeRO-{lay['zero_stage']}" if lay.get("zero_stage") else "no ZeRO")
    if lay.get("sequence_parallel"):
        parts.append("sequence parallel")
    modes = lay.get("recompute") or []
    if any(m != "none" for m in modes):
        parts.append("recompute per stage " + " ".join(modes))
    else:
        parts.append("no recomputation")
    return ", ".join(parts)


def _stages(report: dict[str, Any], c: Console) -> None:
    stages = report["stages"]
    if not stages:
        c.print("pipeline stages: none decided")
        return
    table = _table("pipeline stages (times per micro-batch)", (
        ("stage", "right"), ("layers", "left"), ("ranks", "left"), ("devices", "left"),
        ("fwd ms", "right"), ("bwd ms", "right"), ("of slowest", "right"),
        ("mem/rank", "right"),
    ))
    for st in stages:
        first, last = st["first_layer_name"], st["last_layer_name"]
        names = "" if first is None else layer_label(first)
        if st["num_layers"] > 1 and last is not None:
            names = f"{names} … {layer_label(last)}"
        share = fmt_pct(st["share_of_slowest"]) + (" ◀" if st["slowest"] else "")
        table.add_row(
            str(st["index"]),
            f"{st['first_layer']}–{st['last_layer']} ({st['num_layers']}) {escape(names)}",
            ranges(st["ranks"]),
            device_mix(st["device_types"]),
            f"{st['fwd_ms']:.3f}",
            f"{st['bwd_ms']:.3f}",
            share,
            fmt_bytes(st["memory_bytes"]),
        )
    c.print(table)


def _tp(report: dict[str, Any], c: Console) -> None:
    tp = report["tp"]
    if not tp["enabled"]:
        c.print(f"tensor parallel: off (tp={tp['degree']})")
        return
    ctrl = tp["controller"]
    c.print(f"tensor parallel: degree {tp['degree']}, {tp['num_groups']} group(s), resizing "
            f"controller {ctrl['variant']}")
    c.print(f"  controller: straggler if T > {'T_min' if ctrl['criterion'] == 'min' else 'T_avg'}"
            f" + {fmt_pct(ctrl['straggler_eps'])}, γ_max {ctrl['gamma_max']:g}, α "
            f"{ctrl['alpha']:g}, θ_iter {ctrl['theta_iter']:g}")
    c.print(f"  re-plan at +{fmt_pct(ctrl['replan_trigger'])} iteration time, receivers "
            f"{ctrl['receivers']}, imputation {ctrl['imputation']}")
    table = _table("tensor-parallel shards (groups with the same shards folded)", (
        ("stage", "right"), ("groups", "right"), ("1st group", "left"),
        ("devices", "left"), ("shards", "left"), ("share/rank", "left"),
        ("split params/rank", "left"),
    ))
    for g in tp["groups"]:
        shares = g["shares"]
        share_text = (f"{fmt_pct(shares[0])} each" if len(set(shares)) == 1
                      else " / ".join(fmt_pct(s) for s in shares))
        sizes = g["shard_bytes"]
        size_text = (f"{fmt_bytes(sizes[0])} each" if len(set(sizes)) == 1
                     else " / ".join(fmt_bytes(s) for s in sizes))
        kind = "even" if g["even"] else f"uneven ({g['uneven_linears']} linears)"
        if g["roles"]:
            kind += ", roles " + ", ".join(g["roles"])
        types = g["device_types"]
        table.add_row(
            "—" if g["stage"] is None else str(g["stage"]),
            str(g["count"]),
            ranges(g["example_ranks"]),
            device_mix({t: types.count(t) for t in set(types)}),
            kind,
            share_text,
            size_text,
        )
    c.print(table)
    for g in tp["groups"]:
        where = f"stage {'—' if g['stage'] is None else g['stage']}, {ranges(g['example_ranks'])}"
        for lin in g.get("linears", []):
            names = (lin["first"] if lin["count"] == 1
                     else f"{lin['first']} … {lin['last']} ({lin['count']} linears)")
            c.print(f"  shards {where}: {names}: "
                    f"{' / '.join(str(x) for x in lin['shard_sizes'])} columns")
        for r in g.get("role_details", []):
            c.print(f"  role {where}: rank {g['example_ranks'][r['position']]} "
                    f"{r['role']} γ={r['gamma']:.3f}"
                    + (f" β={r['beta']:.3f}" if r["beta"] else ""))
    pred = tp.get("predicted")
    if pred:
        gam = pred["expected_gamma"]
        lo, hi = (min(gam.values()), max(gam.values())) if gam else (0.0, 0.0)
        gam_text = ("no straggler" if not gam else
                    f"γ {lo:.3f}{'' if lo == hi else f'–{hi:.3f}'} on "
                    f"{len(gam)} rank(s) {ranges(sorted(int(r) for r in gam))}")
        def speedup(x: float | None) -> str:  # None: over 0 ms (an edited prediction)
            return "—" if x is None else f"{x:.2f}×"

        c.print(f"  predicted iteration: even shards {pred['even_ms']:.3f} ms, skewed "
                f"{pred['skewed_ms']:.3f} ms ({speedup(pred['skew_speedup'])})")
        c.print(f"  even shards + controller: {pred['controller_ms']:.3f} ms "
                f"({speedup(pred['controller_speedup'])}, lossy; {gam_text})")


def _sparse(rows: list[dict[str, Any]], c: Console) -> None:
    table = _table("sparse gradients (Zen)", (
        ("tensor", "left"), ("rows", "right"), ("scheme", "left"), ("density", "right"),
        ("over group", "right"), ("skew", "right"), ("stats", "left"),
        ("predicted", "right"), ("dense", "right"), ("benefit", "right"),
    ))
    for r in rows:
        scheme = r["scheme"] + (f" ({r['pull']})" if r["scheme"] == "zen" else "")
        table.add_row(escape(r["name"]), f"{r['rows']}x{r['row_elems']}", scheme,
                      f"{r['density']:.4f}", f"{r['density_n']:.4f}", f"{r['skew']:.2f}",
                      r["stats_source"], f"{r['predicted_ms']:.3f} ms",
                      f"{r['dense_ms']:.3f} ms", f"{r['benefit']:.2f}x")
    c.print(table)


def _sync(report: dict[str, Any], c: Console) -> None:
    sync = report["sync"]
    if sync.get("sparse"):
        _sparse(sync["sparse"], c)
    if not sync["decided"]:
        c.print(f"gradient sync: undecided ({sync['num_tensors']} gradient tensors, "
                f"{fmt_bytes(sync['total_bytes'])}; each would be one fp32 allreduce)")
        return
    b = sync["buckets"]
    c.print(f"gradient sync: {sync['num_tensors']} tensors ({fmt_bytes(sync['total_bytes'])}) "
            f"in {b['count']} bucket(s)")
    table = _table("sync strategies", (
        ("strategy", "left"), ("kind", "left"), ("what it does", "left"), ("tensors", "right"),
        ("bytes", "right"), ("buckets", "right"),
    ))
    for row in sync["strategies"]:
        table.add_row(escape(row["name"]), row["kind"], escape(row["description"]),
                      str(row["tensors"]), fmt_bytes(row["bytes"]), str(row["buckets"]))
    if sync["implicit_fp32_tensors"]:
        table.add_row("(unlisted)", "none", "fp32; allreduce, one per tensor",
                      str(sync["implicit_fp32_tensors"]), fmt_bytes(sync["implicit_fp32_bytes"]),
                      "0")
    c.print(table)
    if any("#" in row["name"] for row in sync["strategies"]):  # "fp32#63": 63 what?
        c.print("  NAME#N: the strategy is option N of the candidates Espresso's search "
                "priced")
    if not b["count"]:
        return
    classes = ", ".join(f"{k['label']}: {k['count']}" for k in b["size_classes"] if k["count"])
    c.print(f"buckets: {b['count']}, sizes min {fmt_bytes(b['min_bytes'])} · median "
            f"{fmt_bytes(b['median_bytes'])} · max {fmt_bytes(b['max_bytes'])}")
    c.print(f"  by size: {classes}")
    if len(b["per_stage"]) > 1:
        c.print("  by stage: " + ", ".join(f"stage {s['stage']}: {s['count']}"
                                           for s in b["per_stage"]))
    big = b["largest"]
    c.print(f"  largest: bucket:{big['index']}, {fmt_bytes(big['size_bytes'])}, "
            f"{_n(big['tensors'], 'tensor', 'tensors')}, strategy {escape(big['strategy'])}")
    c.print(f"    {escape(big['first_tensor'])} … {escape(big['last_tensor'])}")


def _memory(report: dict[str, Any], c: Console) -> None:
    mem = report["memory"]
    if not mem["available"]:
        c.print("memory: not predicted")
        return
    peak = mem["peak"]
    usable = f"{fmt_pct(mem['usable_fraction'])} of device memory"
    head = f"memory per rank (usable = {usable})" if mem["capacity_known"] else \
        "memory per rank (device capacity unknown: the plan embeds no cluster spec)"
    table = _table(head, (
        ("stage", "right"), ("device", "left"), ("ranks", "right"), ("peak", "right"),
        ("usable", "right"), ("used", "right"), ("headroom", "right"),
    ))
    for row in mem["per_stage"]:
        stages = row.get("stages") or [row["stage"]]
        table.add_row("+".join(map(str, stages)), row["device_type"], str(row["ranks"]),
                      fmt_bytes(row["max_bytes"]), fmt_bytes(row["usable_bytes"]),
                      fmt_pct(row["used_fraction"]), fmt_bytes(row["headroom_bytes"]))
    c.print(table)
    c.print("per device type:")
    for row in mem["per_device_type"]:
        c.print(f"  {row['device_type']}: peak {fmt_bytes(row['max_bytes'])}, "
                f"{fmt_pct(row['used_fraction'])} of usable, headroom "
                f"{fmt_bytes(row['headroom_bytes'])}")
    c.print(f"peak: rank {peak['peak_rank']}, {fmt_bytes(peak['max_bytes'])} "
            f"({fmt_pct(peak['used_fraction'])} of usable)")


def _predictions(report: dict[str, Any], c: Console) -> None:
    pred = report["predictions"]
    if not pred["available"]:
        c.print("predictions: none")
        return
    c.print(f"predicted iteration time: [bold]{pred['iteration_time_ms']:.3f} ms[/]")
    if check := pred.get("check"):  # the stored prediction, re-checked (report/stale.py)
        colour = "yellow" if check["status"] == "stale" else "dim"
        c.print(f"  [{colour}]{escape(check['note'])}[/]")
    b = pred["breakdown"]
    c.print(f"  compute {fmt_ms(b['compute_ms'])} · comm {fmt_ms(b['comm_ms'])} (exposed "
            f"{fmt_ms(b['exposed_comm_ms'])}) · compression {fmt_ms(b['compression_ms'])}")
    c.print(f"  bubble {fmt_ms(b['bubble_ms'])} · bubble ratio {fmt_pct(pred['bubble_ratio'])}"
            f" · optimizer step {fmt_ms(b.get('optimizer_ms', 0.0))}")
    for base in pred["baselines"]:
        if base["beaten"]:
            verdict = f"beaten by {base['saved_ms']:.3f} ms"
        elif base["saved_ms"] == 0:
            verdict = "tied"
        else:
            verdict = f"[red]faster than the plan by {-base['saved_ms']:.3f} ms[/]"
        speedup = f"{base['speedup']:.2f}×" if base["speedup"] is not None else "—"
        c.print(f"  baseline {escape(base['name'])}: {base['iteration_time_ms']:.3f} ms "
                f"({speedup}) {verdict}")
        if base["description"]:
            c.print(f"    {escape(base['description'])}")


def _provenance(report: dict[str, Any], c: Console) -> None:
    prov = report["provenance"]
    if prov["costs"]:
        c.print("cost provenance:")
        for kind, v in prov["costs"].items():
            # "comm: analytic (analytic)" said one word twice: a detail that is the source
            detail = (f" ({escape(v['detail'])})" if v["detail"] and v["detail"] != v["source"]
                      else "")
            c.print(f"  {kind}: {v['source']}{detail}")
    else:
        c.print("cost provenance: not recorded")
    s = prov["cost_settings"]
    if s is not None:
        db = f"profile DB {s['profile_fingerprint']}" if s["profile_fingerprint"] \
            else "no profile DB"
        c.print(f"  settings: dtype {s['dtype']}, efficiency {s['efficiency']:g}, optimizer "
                f"{s['optimizer']}, {db}")
    if prov["passes"]:
        c.print("  passes: " + " → ".join(p["name"] for p in prov["passes"]))
        for p in prov["passes"]:
            for note in p["notes"]:
                c.print(f"    {p['name']}: {escape(note)}")


def _warnings(report: dict[str, Any], c: Console) -> None:
    warnings = report["warnings"]
    if not warnings:
        c.print("warnings: none")
        return
    c.print(f"[yellow]warnings ({len(warnings)}):[/]")
    for w in warnings:
        c.print(f"  [yellow]![/] {w['kind']}: {escape(w['message'])}")


_RENDERERS = {
    "layout": _layout,
    "stages": _stages,
    "tp": _tp,
    "sync": _sync,
    "memory": _memory,
    "predictions": _predictions,
    "checkpointing": render_checkpointing,
    "provenance": _provenance,
    "group_sync": render_group_sync,
    "rebalancing": render_rebalancing,
    "warnings": _warnings,
}
