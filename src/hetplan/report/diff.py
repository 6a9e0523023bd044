"""``hetplan diff``: what changed between two plans, and what it does to the predictions.

:func:`diff_plans` compares two plans section by section on their inspection reports
(:func:`hetplan.report.inspect.build_report`) plus the raw buckets and strategies: model and
cluster fingerprints, layout, stages, tensor parallelism, buckets (count, sizes, regrouped
tensors), per-tensor strategies, and the predictions (iteration time, breakdown, bubble,
memory). Differences are ``b − a``. :func:`render_diff` prints the result.

A plan edited by hand still stores the prediction it was written with, so ``hetplan diff``
compares the plans :func:`~hetplan.report.stale.check_prediction` shows (re-predicted as
``simulate`` does where the stored numbers went stale; :func:`diff_checked`), with a line
per plan saying so: comparing the stored numbers said an edit that multiplied the batch by
10,000 changed the iteration time by +0.000 ms.

Example:
    >>> d = diff_plans(load_plan("a.json"), load_plan("b.json"))  # doctest: +SKIP
    >>> d["predictions"]["iteration_time_ms"]["delta"]  # doctest: +SKIP
    -3.25
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from hetplan.ir.plan import Plan
from hetplan.report._text import fmt_bytes, fmt_pct, plain_text, ranges
from hetplan.report.inspect import build_report
from hetplan.report.stale import check_prediction

__all__ = ["diff_plans", "diff_checked", "render_diff", "diff_text"]

_LAYOUT_KEYS = ("dp", "pp", "tp", "micro_batches", "micro_batch_size", "global_batch_size",
                "schedule", "virtual_stages")
_BREAKDOWN_KEYS = ("compute_ms", "comm_ms", "exposed_comm_ms", "bubble_ms", "compression_ms",
                   "optimizer_ms")


def _change(a: Any, b: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"a": a, "b": b, "changed": a != b}
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) \
            and not isinstance(a, bool) and not isinstance(b, bool):
        out["delta"] = round(b - a, 6) + 0.0
        out["relative"] = round((b - a) / a, 6) + 0.0 if a else None
    return out


def diff_plans(a: Plan, b: Plan) -> dict[str, Any]:
    """The differences between plans ``a`` and ``b`` as plain, JSON-ready data.

    Returns:
        A dict with ``identical`` (the plans are equal), ``changed_sections`` and one entry
        per section: ``model``, ``cluster``, ``layout``, ``stages``, ``tp``, ``sync``,
        ``predictions``. Numbers come as ``{"a", "b", "changed", "delta", "relative"}``.
    """
    ra, rb = build_report(a), build_report(b)
    out: dict[str, Any] = {
        "model": {
            "name": _change(a.model.name, b.model.name),
            "fingerprint": _change(a.model.fingerprint, b.model.fingerprint),
        },
        "cluster": {
            "name": _change(a.cluster.name, b.cluster.name),
            "fingerprint": _change(a.cluster.fingerprint, b.cluster.fingerprint),
        },
        "layout": {k: _change(ra["layout"].get(k), rb["layout"].get(k)) for k in _LAYOUT_KEYS},
        "stages": _stages(ra["stages"], rb["stages"]),
        "tp": _tp(ra["tp"], rb["tp"]),
        "sync": _sync(a, b, ra["sync"], rb["sync"]),
        "predictions": _predictions(ra, rb),
    }
    changed = [name for name, section in out.items() if _any_changed(section)]
    out["changed_sections"] = changed
    out["identical"] = a == b
    return out


def _any_changed(node: Any) -> bool:
    if isinstance(node, dict):
        if node.get("changed") is True:
            return True
        return any(_any_changed(v) for v in node.values())
    if isinstance(node, list):
        return any(_any_changed(v) for v in node)
    return False


def _stages(sa: list[dict[str, Any]], sb: list[dict[str, Any]]) -> dict[str, Any]:
    rows = []
    for i in range(max(len(sa), len(sb))):
        x = sa[i] if i < len(sa) else None
        y = sb[i] if i < len(sb) else None

        def get(s: dict[str, Any] | None, key: str) -> Any:
            return None if s is None else s[key]

        rows.append({
            "index": i,
            "layers": _change(
                None if x is None else [x["first_layer"], x["last_layer"]],
                None if y is None else [y["first_layer"], y["last_layer"]]),
            "ranks": _change(get(x, "ranks"), get(y, "ranks")),
            "fwd_ms": _change(get(x, "fwd_ms"), get(y, "fwd_ms")),
            "bwd_ms": _change(get(x, "bwd_ms"), get(y, "bwd_ms")),
            "memory_bytes": _change(get(x, "memory_bytes"), get(y, "memory_bytes")),
        })
    return {"count": _change(len(sa), len(sb)), "per_stage": rows}


def _tp(ta: dict[str, Any], tb: dict[str, Any]) -> dict[str, Any]:
    def uneven(t: dict[str, Any]) -> int:
        return sum(g["count"] for g in t["groups"] if not g["even"])

    def variant(t: dict[str, Any]) -> str | None:
        return t["controller"]["variant"] if t.get("controller") else None

    return {
        "degree": _change(ta["degree"], tb["degree"]),
        "groups": _change(ta["num_groups"], tb["num_groups"]),
        "uneven_groups": _change(uneven(ta), uneven(tb)),
        "controller": _change(variant(ta), variant(tb)),
    }


def _strategy_of(plan: Plan) -> dict[str, str]:
    """Gradient name → strategy description (kind and path), ``fp32; flat allreduce`` for
    tensors the plan does not list."""
    from hetplan.report.inspect import describe_strategy

    sync = plan.gradient_sync
    grads = plan.model.workload.grads if plan.model.workload is not None else ()
    out = {g.name: "fp32; flat allreduce" for g in grads}
    if sync is None:
        return out
    for entry in sync.tensors:
        out[entry.name] = describe_strategy(sync.strategies[entry.strategy])
    for bucket in sync.buckets:
        for name in bucket.tensors:
            out[name] = describe_strategy(sync.strategies[bucket.strategy])
    return out


def _groups(plan: Plan) -> set[tuple[str, ...]]:
    sync = plan.gradient_sync
    return {tuple(b.tensors) for b in sync.buckets} if sync is not None else set()


def _sync(a: Plan, b: Plan, ya: dict[str, Any], yb: dict[str, Any]) -> dict[str, Any]:
    ba, bb = ya.get("buckets", {"count": 0}), yb.get("buckets", {"count": 0})
    sa, sb = _strategy_of(a), _strategy_of(b)
    moved = sorted(n for n in sa.keys() & sb.keys() if sa[n] != sb[n])
    ga, gb = _groups(a), _groups(b)
    regrouped = {t for g in ga ^ gb for t in g}

    def kinds(y: dict[str, Any]) -> dict[str, int]:
        return {k: v["tensors"] for k, v in sorted(y.get("by_kind", {}).items())}

    return {
        "buckets": _change(ba["count"], bb["count"]),
        "bucket_bytes_max": _change(ba.get("max_bytes"), bb.get("max_bytes")),
        "bucket_bytes_median": _change(ba.get("median_bytes"), bb.get("median_bytes")),
        "bucket_bytes_min": _change(ba.get("min_bytes"), bb.get("min_bytes")),
        "tensors_per_kind": _change(kinds(ya), kinds(yb)),
        "strategy_changes": {"count": len(moved), "changed": bool(moved),
                             "examples": [{"tensor": n, "a": sa[n], "b": sb[n]}
                                          for n in moved[:5]]},
        "regrouped_tensors": {"count": len(regrouped), "changed": bool(regrouped)},
    }


def _predictions(ra: dict[str, Any], rb: dict[str, Any]) -> dict[str, Any]:
    pa, pb = ra["predictions"], rb["predictions"]
    ma, mb = ra["memory"], rb["memory"]
    if not pa["available"] or not pb["available"]:
        return {"available": _change(pa["available"], pb["available"])}
    out: dict[str, Any] = {
        "iteration_time_ms": _change(pa["iteration_time_ms"], pb["iteration_time_ms"]),
        "bubble_ratio": _change(pa["bubble_ratio"], pb["bubble_ratio"]),
        "breakdown": {k: _change(pa["breakdown"][k], pb["breakdown"][k])
                      for k in _BREAKDOWN_KEYS},
        "peak_memory_bytes": _change(ma.get("peak", {}).get("max_bytes"),
                                     mb.get("peak", {}).get("max_bytes")),
    }
    t_a, t_b = pa["iteration_time_ms"], pb["iteration_time_ms"]
    out["speedup_b_over_a"] = round(t_a / t_b, 6) if t_b else None
    types = sorted({r["device_type"] for r in ma.get("per_device_type", [])}
                   | {r["device_type"] for r in mb.get("per_device_type", [])})

    def peak(m: dict[str, Any], t: str) -> Any:
        return next((r["max_bytes"] for r in m.get("per_device_type", [])
                     if r["device_type"] == t), None)

    out["peak_memory_per_device_type"] = {t: _change(peak(ma, t), peak(mb, t)) for t in types}
    return out


# -- rendering ------------------------------------------------------------------------------
def diff_text(d: dict[str, Any], *, width: int = 100) -> str:
    """:func:`render_diff` as plain text at ``width`` columns."""
    return plain_text(lambda c: render_diff(d, c), width=width)


def _fmt(v: Any, unit: str) -> str:
    if v is None:
        return "—"
    if unit == "bytes":
        return fmt_bytes(v)
    if unit == "ms":
        return f"{v:.3f} ms"
    if unit == "pct":
        return fmt_pct(v)
    if unit == "ranks":
        return ranges(v)
    if unit == "layers":
        return f"{v[0]}–{v[1]}"
    if isinstance(v, dict):
        return ", ".join(f"{k}: {x}" for k, x in v.items()) or "—"
    return str(v)


def _line(c: Console, label: str, ch: dict[str, Any], unit: str = "") -> None:
    if not ch["changed"]:
        return
    a, b = _fmt(ch["a"], unit), _fmt(ch["b"], unit)
    delta = ""
    if "delta" in ch and unit in ("ms", "bytes"):
        sign = "+" if ch["delta"] >= 0 else "-"
        rel = f", {ch['relative']:+.1%}" if ch.get("relative") is not None else ""
        delta = f" ({sign}{_fmt(abs(ch['delta']), unit)}{rel})"
    c.print(f"  {label}: {escape(a)} → {escape(b)}{delta}")


def diff_checked(a: Plan, b: Plan, *, profile: str | Path | None = None) -> dict[str, Any]:
    """:func:`diff_plans` of the plans as :func:`~hetplan.report.stale.check_prediction` shows
    them (a stale stored prediction re-predicted), with ``prediction_checks``: per plan
    (``a``, ``b``) its status and note, for the plans whose stored prediction did not hold.

    Args:
        profile: the profile DB a plan was predicted with (each plan predicted with this DB
            is re-checked with it; one predicted with another is not re-checked).
    """
    ca, cb = check_prediction(a, profile=profile), check_prediction(b, profile=profile)
    out = diff_plans(ca.plan, cb.plan)
    out["identical"] = a == b
    out["prediction_checks"] = {k: {"status": c.status, "note": c.note}
                                for k, c in (("a", ca), ("b", cb)) if c.note}
    return out


def render_diff(d: dict[str, Any], c: Console) -> None:
    """Print the diff ``d`` (from :func:`diff_plans`): only what changed."""
    if d["identical"]:
        c.print("the plans are identical")
        return
    if not d["changed_sections"]:
        c.print("no differences in layout, stages, sync or predictions (metadata differs)")
    for name in ("model", "cluster"):
        if _any_changed(d[name]):
            c.print(f"[bold]{name}[/]")
            _line(c, "name", d[name]["name"])
            _line(c, "fingerprint", d[name]["fingerprint"])
    if d["model"]["fingerprint"]["changed"]:
        c.print("  [yellow]![/] different models: stages and buckets are compared by position")
    if _any_changed(d["layout"]):
        c.print("[bold]layout[/]")
        for k, ch in d["layout"].items():
            _line(c, k, ch)
    _render_stages(c, d["stages"])
    if _any_changed(d["tp"]):
        c.print("[bold]tensor parallel[/]")
        for k, ch in d["tp"].items():
            _line(c, k.replace("_", " "), ch)
    _render_sync(c, d["sync"])
    _render_predictions(c, d["predictions"])
    for k, check in d.get("prediction_checks", {}).items():
        c.print(f"  [yellow]![/] {k}: {escape(check['note'])}")


def _render_stages(c: Console, st: dict[str, Any]) -> None:
    if not _any_changed(st):
        return
    c.print("[bold]stages[/]")
    _line(c, "count", st["count"])
    for row in st["per_stage"]:
        if not _any_changed(row):
            continue
        c.print(f"  stage {row['index']}:")
        for key, unit in (("layers", "layers"), ("ranks", "ranks"), ("fwd_ms", "ms"),
                          ("bwd_ms", "ms"), ("memory_bytes", "bytes")):
            _line(c, "  " + key.replace("_ms", " ms/mb").replace("_bytes", ""), row[key], unit)


def _render_sync(c: Console, sy: dict[str, Any]) -> None:
    if not _any_changed(sy):
        return
    c.print("[bold]gradient sync[/]")
    _line(c, "buckets", sy["buckets"])
    for key in ("min", "median", "max"):
        _line(c, f"{key} bucket size", sy[f"bucket_bytes_{key}"], "bytes")
    _line(c, "tensors per strategy kind", sy["tensors_per_kind"])
    if sy["regrouped_tensors"]["count"]:
        c.print(f"  {sy['regrouped_tensors']['count']} tensor(s) in different buckets")
    moved = sy["strategy_changes"]
    if moved["count"]:
        c.print(f"  {moved['count']} tensor(s) change strategy, e.g.:")
        for ex in moved["examples"]:
            # one line per plan: a strategy's collective path uses → itself
            c.print(f"    {escape(ex['tensor'])}:\n      a: {escape(ex['a'])}\n"
                    f"      b: {escape(ex['b'])}")


def _speed(speedup: float | None) -> str:
    if not speedup or speedup == 1:
        return ""
    if speedup > 1:
        return f"; b is {speedup:.2f}× faster"
    return f"; b is {1 / speedup:.2f}× slower"


def _render_predictions(c: Console, p: dict[str, Any]) -> None:
    c.print("[bold]predictions[/]")
    if "iteration_time_ms" not in p:
        c.print("  one of the plans has no predictions")
        return
    it = p["iteration_time_ms"]
    c.print(f"  iteration time: {it['a']:.3f} ms → {it['b']:.3f} ms ({it['delta']:+.3f} ms"
            + (f", {it['relative']:+.1%}" if it.get("relative") is not None else "") + ")"
            + _speed(p["speedup_b_over_a"]))
    for k, ch in p["breakdown"].items():
        _line(c, k.replace("_ms", "").replace("_", " "), ch, "ms")
    _line(c, "bubble ratio", p["bubble_ratio"], "pct")
    _line(c, "peak memory", p["peak_memory_bytes"], "bytes")
    for t, ch in p["peak_memory_per_device_type"].items():
        _line(c, f"peak memory on {t}", ch, "bytes")
