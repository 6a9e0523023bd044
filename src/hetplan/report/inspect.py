"""``hetplan inspect``: a plan as a report of plain data, one entry per section.

:func:`build_report` reads only the plan (its embedded workload summary and cluster spec); it
never re-runs the cost model, so it is fast and shows exactly what the plan it is given says
(``hetplan inspect`` first re-checks the stored prediction, :mod:`hetplan.report.stale`, and
gives it the re-predicted plan where that prediction is stale). The report is a JSON-ready
dict with these sections (:data:`SECTIONS`):

- ``layout``: model, cluster, fingerprints, dp × pp × tp, micro-batching, schedule, devices.
- ``stages``: per pipeline stage its layers, ranks, device types, predicted per-micro-batch
  forward/backward times and how close it is to the slowest stage.
- ``tp``: tensor-parallel degree (with per-stage degrees, the largest), controller settings and shard sizes (groups with the same
  pattern are folded into one entry), per group its listed linears' shard sizes (runs of
  linears with equal sizes folded) and the ranks' controller roles (γ, β), and the predicted
  effect of ``tp-resizing`` (even vs skewed shards vs even shards with the controller).
- ``sync``: per strategy the number of gradient tensors and bytes it syncs, and the fusion
  buckets (count, size distribution, the largest).
- ``memory``: peak memory per rank summarised per stage and per device type, with headroom
  against the usable memory of the embedded cluster spec.
- ``predictions``: iteration time, its breakdown, and each baseline with the speedup over it.
- ``provenance``: where each cost came from (profiled or analytic), cost settings, passes.
- ``checkpointing``: Gemini's placement, chunk schedule and predictions
  (:mod:`hetplan.report.checkpointing`); ``{"available": false}`` without the section.
- ``group_sync``: SDPipe's policy, P and T, and the simulated throughput of each policy
  (None without the section; :mod:`hetplan.report.group_sync`).
- ``rebalancing``: DynPipe's events for a dynamic model, each stage's layers per event
  (None without the section; :mod:`hetplan.report.rebalancing`).
- ``warnings``: analytic costs, near-OOM ranks, heavy pipeline bubbles, baselines that are
  faster than the plan, missing sections.

A ``summary`` entry (:meth:`Plan.summary`) holds the headline numbers. Rendering lives in
:mod:`hetplan.report.render`.

Example:
    >>> report = build_report(load_plan("plan.json"))  # doctest: +SKIP
    >>> report["predictions"]["iteration_time_ms"]  # doctest: +SKIP
"""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

from hetplan.cost_models.memory import USABLE_FRACTION
from hetplan.ir.cluster import Device
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import CastSync, CompressedSync, NoSync, SyncStrategy, TPGroup
from hetplan.report._text import fmt_bytes, fmt_pct, ranges
from hetplan.report.checkpointing import checkpointing_report
from hetplan.report.group_sync import group_sync_report
from hetplan.report.rebalancing import rebalancing_report

__all__ = [
    "SECTIONS",
    "REPORT_VERSION",
    "NEAR_OOM_FRACTION",
    "HEAVY_BUBBLE_RATIO",
    "BUCKET_SIZE_CLASSES",
    "build_report",
    "describe_strategy",
    "select_sections",
]

#: Version of the report's structure (``hetplan inspect --json``).
REPORT_VERSION = 1
#: The report sections, in display order (``--section NAME``).
SECTIONS: tuple[str, ...] = (
    "layout", "stages", "tp", "sync", "memory", "predictions", "provenance", "checkpointing",
    "group_sync", "rebalancing", "warnings",
)
#: A rank is near OOM at this fraction of its usable memory.
NEAR_OOM_FRACTION = 0.9
#: A pipeline bubble ratio at or above this is "heavy".
HEAVY_BUBBLE_RATIO = 0.2
MiB = 2**20
#: Bucket size classes of the size distribution: (label, lower bound, upper bound) in bytes.
BUCKET_SIZE_CLASSES: tuple[tuple[str, int, int | None], ...] = (
    ("< 1 MiB", 0, MiB),
    ("1–10 MiB", MiB, 10 * MiB),
    ("10–25 MiB", 10 * MiB, 25 * MiB),
    ("≥ 25 MiB", 25 * MiB, None),
)


def _ms(x: float) -> float:
    return round(x, 6) + 0.0  # + 0.0 turns -0.0 into 0.0


def _frac(x: float) -> float:
    return round(x, 6) + 0.0


def build_report(plan: Plan) -> dict[str, Any]:
    """The inspection report of ``plan`` as plain, JSON-ready data (see module docstring).

    Args:
        plan: any valid plan; sections it has not decided are reported as such.

    Returns:
        A dict with ``report_version``, ``summary`` and one key per name in :data:`SECTIONS`.
    """
    devices = plan.cluster.spec.devices() if plan.cluster.spec is not None else None
    report: dict[str, Any] = {
        "report_version": REPORT_VERSION,
        "summary": plan.summary().to_dict(),
        "layout": _layout(plan, devices),
        "stages": _stages(plan, devices),
        "tp": _tp(plan, devices),
        "sync": _sync(plan),
        "memory": _memory(plan, devices),
        "predictions": _predictions(plan),
        "provenance": _provenance(plan),
        "checkpointing": checkpointing_report(plan),
        "group_sync": group_sync_report(plan),
        "rebalancing": rebalancing_report(plan),
    }
    report["warnings"] = _warnings(plan, report)
    return report


def select_sections(report: dict[str, Any], sections: list[str] | None) -> dict[str, Any]:
    """The report narrowed to ``sections`` (all of it for None or an empty list)."""
    if not sections:
        return report
    return {name: report[name] for name in sections}


def _types(devices: tuple[Device, ...] | None, ranks: Any) -> dict[str, int]:
    if devices is None:
        return {}
    return dict(Counter(devices[r].type for r in ranks if r < len(devices)))


# -- layout ------------------------------------------------------------------------------
def _layout(plan: Plan, devices: tuple[Device, ...] | None) -> dict[str, Any]:
    spec = plan.cluster.spec
    lay = plan.layout
    out: dict[str, Any] = {
        "model": plan.model.name,
        "model_fingerprint": plan.model.fingerprint,
        "num_params": plan.model.num_params,
        "cluster": plan.cluster.name,
        "cluster_fingerprint": plan.cluster.fingerprint,
        "world_size": plan.cluster.world_size,
        "tool_version": plan.tool_version,
        "schema_version": plan.schema_version,
        "nodes": spec.num_nodes if spec is not None else None,
        "heterogeneous": spec.is_heterogeneous if spec is not None else None,
        "device_types": _types(devices, range(plan.cluster.world_size)),
        "decided": lay is not None,
    }
    if lay is None:
        return out
    out.update(
        dp=lay.dp, pp=lay.pp, tp=lay.tp, micro_batches=lay.micro_batches,
        micro_batch_size=lay.micro_batch_size, global_batch_size=lay.global_batch_size,
        schedule=lay.schedule, virtual_stages=lay.virtual_stages, ranks_used=lay.num_ranks,
        zero_stage=lay.zero_stage, sequence_parallel=lay.sequence_parallel,
        recompute=[st.recompute for st in plan.stages],
        precision=plan.precision.model_dump(mode="json") if plan.precision is not None
        else None,
    )
    if plan.hetero is not None:
        from hetplan.report.explain_hetero import hetero_layout

        out.update(ranks_used=sum(len(st.ranks) for st in plan.stages),
                   hetero=hetero_layout(plan))
    return out


# -- stages ------------------------------------------------------------------------------
def _stages(plan: Plan, devices: tuple[Device, ...] | None) -> list[dict[str, Any]]:
    layers = plan.model.workload.layers if plan.model.workload is not None else ()
    slowest = max((st.fwd_ms + st.bwd_ms for st in plan.stages), default=0.0)
    out = []
    for st in plan.stages:
        names = st.layer_names or tuple(
            layers[i].name for i in range(st.first_layer, st.last_layer + 1) if i < len(layers)
        )
        step = st.fwd_ms + st.bwd_ms
        out.append({
            "index": st.index,
            "first_layer": st.first_layer,
            "last_layer": st.last_layer,
            "num_layers": st.last_layer - st.first_layer + 1,
            "first_layer_name": names[0] if names else None,
            "last_layer_name": names[-1] if names else None,
            "ranks": list(st.ranks),
            "device_types": _types(devices, st.ranks),
            "fwd_ms": _ms(st.fwd_ms),
            "bwd_ms": _ms(st.bwd_ms),
            "step_ms": _ms(step),
            "share_of_slowest": _frac(step / slowest) if slowest else None,
            "slowest": bool(slowest) and step == slowest,
            "memory_bytes": st.memory_bytes,
        })
    return out


# -- tensor parallelism --------------------------------------------------------------------
def _tp(plan: Plan, devices: tuple[Device, ...] | None) -> dict[str, Any]:
    tp = plan.tensor_parallel
    degree = plan.layout.tp if plan.layout is not None else 1
    if plan.hetero is not None:  # per-stage degrees: the largest; the groups name stages
        degree = max(s.tp for s in plan.hetero.stages)
    if tp is None:
        return {"degree": degree, "enabled": False, "num_groups": 0, "groups": []}
    patterns: dict[tuple[Any, ...], dict[str, Any]] = {}
    for g in tp.groups:
        entry = _tp_group(plan, g, devices)
        key = (entry["stage"], tuple(entry["device_types"]), tuple(entry["shares"]),
               tuple(entry["roles"]), entry["uneven_linears"],
               repr(entry["linears"]), repr(entry["role_details"]))
        if key in patterns:
            patterns[key]["count"] += 1
            continue
        patterns[key] = {**entry, "count": 1, "example_ranks": list(g.ranks)}
    pred = tp.predicted
    return {
        "degree": degree,
        "enabled": True,
        "num_groups": len(tp.groups),
        "controller": tp.controller.model_dump(mode="json"),
        "groups": list(patterns.values()),
        "predicted": None if pred is None else {
            **pred.model_dump(mode="json"),
            "skew_speedup": _frac(pred.even_ms / pred.skewed_ms) if pred.skewed_ms else None,
            "controller_speedup": (_frac(pred.even_ms / pred.controller_ms)
                                   if pred.controller_ms else None),
        },
    }


def _tp_linears(g: TPGroup) -> list[dict[str, Any]]:
    """The group's listed linears folded by shard sizes: runs of consecutive linears with the
    same sizes become one entry (first and last name, count)."""
    out: list[dict[str, Any]] = []
    for lin in g.linears:
        sizes = list(lin.shard_sizes)
        if out and out[-1]["shard_sizes"] == sizes:
            out[-1]["last"] = lin.name
            out[-1]["count"] += 1
            continue
        out.append({"first": lin.name, "last": lin.name, "count": 1, "shard_sizes": sizes})
    return out


def _stage_of_ranks(plan: Plan, ranks: tuple[int, ...]) -> int | None:
    for st in plan.stages:
        if set(ranks) <= set(st.ranks):
            return st.index
    return None


def _tp_group(plan: Plan, g: TPGroup, devices: tuple[Device, ...] | None) -> dict[str, Any]:
    """Shares of each rank of the group (by split features) and its shard bytes."""
    n = len(g.ranks)
    stage = g.stage if g.stage is not None else _stage_of_ranks(plan, g.ranks)
    total = sum(lin.features for lin in g.linears)
    if total:
        shares = [sum(lin.shard_sizes[i] for lin in g.linears) / total for i in range(n)]
    else:  # no per-linear entries: every splittable linear split evenly
        shares = [1.0 / n] * n
    split = 0
    workload = plan.model.workload
    # the stages the group's ranks hold: every chunk of its pipeline rank when interleaved
    # (``g.stage`` is the pipeline rank, not an index of ``plan.stages``)
    held = [st for st in plan.stages if g.ranks and g.ranks[0] in st.ranks]
    if not held and stage is not None and stage < len(plan.stages):
        held = [plan.stages[stage]]
    if workload is not None:
        split = sum(min(x.tp_split_bytes, x.param_bytes) for st in held
                    for x in workload.layers[st.first_layer: st.last_layer + 1])
    uneven = sum(1 for lin in g.linears if len(set(lin.shard_sizes)) > 1)
    roles = {r.rank: r.role for r in g.roles if r.role != "normal"}
    return {
        "stage": stage,
        "device_types": [devices[r].type if devices and r < len(devices) else "?"
                         for r in g.ranks],
        "shares": [_frac(s) for s in shares],
        "even": not uneven,
        "uneven_linears": uneven,
        "split_bytes": split,
        "shard_bytes": [int(split * s) for s in shares],
        "roles": [f"{pos}:{roles[r]}" for pos, r in enumerate(g.ranks) if r in roles],
        "role_details": [{"position": g.ranks.index(r.rank), "role": r.role,
                          "gamma": _frac(r.gamma), "beta": _frac(r.beta)}
                         for r in g.roles if r.role != "normal"],
        "linears": _tp_linears(g),
    }


# -- gradient sync -------------------------------------------------------------------------
def describe_strategy(strategy: SyncStrategy) -> str:
    """One line for a sync strategy: dtype or compressor, devices and the collective path.

    Example: ``topk(ratio=0.01) on the device, error feedback; intra allreduce → inter
    allgather*``; ``fp32; flat allreduce`` (``*`` marks steps that carry the compressed payload).
    """
    path = " → ".join(
        f"{s.level} {s.routine}" + ("*" if s.compressed else "") for s in strategy.steps
    )
    if isinstance(strategy, NoSync):
        return f"fp32; {path}"
    if isinstance(strategy, CastSync):
        return f"cast to {strategy.dtype}; {path}"
    assert isinstance(strategy, CompressedSync)
    params = ", ".join(f"{k}={v}" for k, v in sorted(strategy.params.items()))
    extra = ", error feedback" if strategy.error_feedback else ""
    dtype = f", {strategy.uncompressed_dtype} uncompressed" \
        if strategy.uncompressed_dtype != "fp32" else ""
    # the plan's "gpu" is the rank's own device (a CPU rank's too), "cpu" the host's CPU:
    # "on gpu/gpu" read as GPUs on a CPU-only cluster
    word = {"gpu": "the device", "cpu": "the host CPU"}
    comp, decomp = strategy.compress_device, strategy.decompress_device
    where = (f"on {word[comp]}" if comp == decomp
             else f"compressed on {word[comp]}, decompressed on {word[decomp]}")
    return f"{strategy.compressor}({params}) {where}{extra}{dtype}; {path}"


def _sync(plan: Plan) -> dict[str, Any]:
    sync = plan.gradient_sync
    grads = plan.model.workload.grads if plan.model.workload is not None else ()
    size = {g.name: g.size_bytes for g in grads}
    out: dict[str, Any] = {
        "decided": sync is not None,
        "num_tensors": len(grads),
        "total_bytes": sum(size.values()),
        "sparse": _sparse(plan),
    }
    if sync is None:
        return out
    strategy_of = {t.name: t.strategy for t in sync.tensors}
    for b in sync.buckets:
        strategy_of.update((name, b.strategy) for name in b.tensors)
    implicit = [g.name for g in grads if g.name not in strategy_of]
    rows: list[dict[str, Any]] = []
    for name, strategy in sorted(sync.strategies.items()):
        tensors = [t for t, s in strategy_of.items() if s == name]
        rows.append({
            "name": name,
            "kind": strategy.kind,
            "description": describe_strategy(strategy),
            "tensors": len(tensors),
            "bytes": sum(size.get(t, 0) for t in tensors),
            "buckets": sum(1 for b in sync.buckets if b.strategy == name),
        })
    by_kind: dict[str, dict[str, int]] = {}
    for row in rows:
        acc = by_kind.setdefault(row["kind"], {"tensors": 0, "bytes": 0})
        acc["tensors"] += row["tensors"]
        acc["bytes"] += row["bytes"]
    in_bucket = {t for b in sync.buckets for t in b.tensors}
    out.update(
        strategies=rows,
        by_kind=by_kind,
        implicit_fp32_tensors=len(implicit),
        implicit_fp32_bytes=sum(size[t] for t in implicit),
        unbucketed_tensors=sum(1 for g in grads if g.name not in in_bucket),
        buckets=_buckets(plan),
    )
    return out


def _sparse(plan: Plan) -> list[dict[str, Any]]:
    """The sparse gradients (``sparse_sync``): scheme, statistics, predicted vs dense."""
    if plan.sparse_sync is None:
        return []
    return [{
        "name": t.name, "rows": t.rows, "row_elems": t.row_elems, "scheme": t.scheme,
        "pull": t.pull, "density": t.stats.density, "density_n": t.stats.density_n,
        "skew": t.stats.skew, "stats_source": t.stats.source,
        "predicted_ms": _ms(t.predicted_ms), "dense_ms": _ms(t.dense_ms),
        "benefit": _frac(t.benefit),
    } for t in plan.sparse_sync.tensors]


def _buckets(plan: Plan) -> dict[str, Any]:
    assert plan.gradient_sync is not None
    buckets = plan.gradient_sync.buckets
    sizes = [b.size_bytes for b in buckets]
    if not buckets:
        return {"count": 0}
    stage_of_layer: dict[int, int] = {}
    for st in plan.stages:
        stage_of_layer.update((i, st.index) for i in range(st.first_layer, st.last_layer + 1))
    layer_of = {}
    if plan.model.workload is not None:
        layer_of = {g.name: g.layer_index for g in plan.model.workload.grads}

    def stage(b: Any) -> int | None:
        layer = layer_of.get(b.tensors[-1])
        return None if layer is None else stage_of_layer.get(layer, 0)

    per_stage = Counter(stage(b) for b in buckets)
    i_max = max(range(len(buckets)), key=lambda i: (sizes[i], -i))
    big = buckets[i_max]
    return {
        "count": len(buckets),
        "total_bytes": sum(sizes),
        "min_bytes": min(sizes),
        "median_bytes": int(statistics.median(sizes)),
        "mean_bytes": int(sum(sizes) / len(sizes)),
        "max_bytes": max(sizes),
        "size_classes": [
            {"label": label, "min_bytes": lo, "max_bytes": hi,
             "count": sum(1 for s in sizes if s >= lo and (hi is None or s < hi))}
            for label, lo, hi in BUCKET_SIZE_CLASSES
        ],
        "per_stage": [{"stage": s, "count": n}
                      for s, n in sorted(per_stage.items(), key=lambda x: (x[0] is None, x[0]))],
        "largest": {
            "index": i_max,
            "size_bytes": big.size_bytes,
            "tensors": len(big.tensors),
            "strategy": big.strategy,
            "first_tensor": big.tensors[0],
            "last_tensor": big.tensors[-1],
            "stage": stage(big),
        },
    }


# -- memory --------------------------------------------------------------------------------
def _memory(plan: Plan, devices: tuple[Device, ...] | None) -> dict[str, Any]:
    pred = plan.predictions
    mem = list(pred.memory_per_rank_bytes) if pred is not None else []
    out: dict[str, Any] = {
        "available": bool(mem),
        "usable_fraction": USABLE_FRACTION,
        "near_oom_fraction": NEAR_OOM_FRACTION,
        "capacity_known": devices is not None,
    }
    if not mem:
        return out
    # a rank's stages: one, or its interleaved chunks (stage s and s + pp, ...)
    stages_of: dict[int, tuple[int, ...]] = {}
    for st in sorted(plan.stages, key=lambda st: st.index):
        for r in st.ranks:
            stages_of[r] = stages_of.get(r, ()) + (st.index,)

    def row(ranks: list[int]) -> dict[str, Any]:
        peak = max(ranks, key=lambda r: (mem[r], -r))
        cap = devices[peak].memory_bytes if devices is not None else None
        usable = int(cap * USABLE_FRACTION) if cap is not None else None
        return {
            "ranks": len(ranks),
            "peak_rank": peak,
            "max_bytes": mem[peak],
            "min_bytes": min(mem[r] for r in ranks),
            "capacity_bytes": cap,
            "usable_bytes": usable,
            "headroom_bytes": usable - mem[peak] if usable is not None else None,
            "used_fraction": _frac(mem[peak] / usable) if usable else None,
        }

    ranks = range(len(mem))
    dtype = (lambda r: devices[r].type) if devices is not None else (lambda r: "?")
    groups: dict[tuple[tuple[int, ...], str], list[int]] = {}
    for r in ranks:
        if stages_of and r not in stages_of:
            continue  # a rank no stage uses (a heterogeneous plan may leave some idle)
        groups.setdefault((stages_of.get(r, (0,)), dtype(r)), []).append(r)
    by_type: dict[str, list[int]] = {}
    for r in ranks:
        by_type.setdefault(dtype(r), []).append(r)
    near, over = [], []
    if devices is not None:
        near = [r for r in ranks
                if mem[r] >= NEAR_OOM_FRACTION * USABLE_FRACTION * devices[r].memory_bytes]
        # an edited plan may no longer fit: its re-predicted memory is past the usable part
        over = [r for r in near if mem[r] > int(devices[r].memory_bytes * USABLE_FRACTION)]
    out.update(
        peak=row(list(ranks)),
        per_stage=[{"stage": s[0], "stages": list(s), "device_type": t, **row(rs)}
                   for (s, t), rs in sorted(groups.items())],
        per_device_type=[{"device_type": t, **row(rs)} for t, rs in sorted(by_type.items())],
        near_oom_ranks=near,
        oom_ranks=over,
        # the over-budget rank to name: the peak among them (the plan's peak rank may be a
        # larger device that fits, while a smaller one does not)
        oom_peak=row(over) if over else None,
    )
    return out


# -- predictions and provenance --------------------------------------------------------------
def _predictions(plan: Plan) -> dict[str, Any]:
    pred = plan.predictions
    if pred is None:
        return {"available": False}
    t = pred.iteration_time_ms
    baselines = []
    for b in sorted(pred.baselines, key=lambda b: (b.iteration_time_ms, b.name)):
        baselines.append({
            "name": b.name,
            "description": b.description,
            "iteration_time_ms": _ms(b.iteration_time_ms),
            "speedup": _frac(b.iteration_time_ms / t) if t else None,
            "saved_ms": _ms(b.iteration_time_ms - t),
            "beaten": b.iteration_time_ms > t,
        })
    return {
        "available": True,
        "iteration_time_ms": _ms(t),
        "breakdown": pred.breakdown.model_dump(mode="json"),
        "bubble_ratio": pred.bubble_ratio,
        "baselines": baselines,
    }


def _provenance(plan: Plan) -> dict[str, Any]:
    settings = plan.cost_settings
    return {
        "costs": {k: {"source": v.source, "detail": v.detail}
                  for k, v in sorted(plan.provenance.items())},
        "analytic": sorted(k for k, v in plan.provenance.items() if v.source == "analytic"),
        "cost_settings": settings.model_dump(mode="json") if settings is not None else None,
        "passes": [{"name": e.name, "changed": e.changed, "notes": list(e.notes)}
                   for e in plan.pass_log],
    }


# -- warnings ------------------------------------------------------------------------------
def _warnings(plan: Plan, report: dict[str, Any]) -> list[dict[str, str]]:
    out: list[dict[str, str]] = []

    def warn(kind: str, message: str) -> None:
        out.append({"kind": kind, "message": message})

    analytic = report["provenance"]["analytic"]
    if analytic:
        details = "; ".join(
            f"{k}: {report['provenance']['costs'][k]['detail'] or 'no detail'}" for k in analytic
        )
        warn("analytic-costs",
             f"{' and '.join(analytic)} costs are analytic estimates ({details}); measure them "
             "with `hetplan profile` and re-plan with --profile")
    mem = report["memory"]
    if mem.get("oom_ranks"):
        peak, over = mem["oom_peak"], mem["oom_ranks"]
        warn("out-of-memory",
             f"the plan does not fit in memory: {len(over)} rank(s) ({ranges(over)}) need more "
             f"than their usable memory; rank {peak['peak_rank']} needs "
             f"{fmt_bytes(peak['max_bytes'])} of {fmt_bytes(peak['usable_bytes'])} usable "
             f"({fmt_pct(peak['used_fraction'])}); `hetplan simulate` refuses "
             "it: undo the edit, or re-run `hetplan plan`")
    elif mem.get("near_oom_ranks"):
        peak = mem["peak"]
        warn("near-oom",
             f"{len(mem['near_oom_ranks'])} rank(s) ({ranges(mem['near_oom_ranks'])}) use "
             f"≥ {fmt_pct(NEAR_OOM_FRACTION)} of their usable memory; rank {peak['peak_rank']} "
             f"peaks at {fmt_pct(peak['used_fraction'])}")
    pred = report["predictions"]
    if not pred["available"]:
        warn("no-predictions", "the plan has no predictions; re-run `hetplan plan`")
        return out
    if pred["bubble_ratio"] >= HEAVY_BUBBLE_RATIO:
        warn("heavy-bubble",
             f"pipeline bubble ratio {100 * pred['bubble_ratio']:.1f}% (≥ "
             f"{100 * HEAVY_BUBBLE_RATIO:.0f}%): more micro-batches or better-balanced stages "
             "would help")
    for b in pred["baselines"]:
        if b["iteration_time_ms"] < pred["iteration_time_ms"]:
            warn("slower-than-baseline",
                 f"baseline {b['name']} is predicted faster: {b['iteration_time_ms']:.3f} ms vs "
                 f"{pred['iteration_time_ms']:.3f} ms ({b['speedup']:.2f}×)")
    if plan.model.workload is None:
        warn("no-workload", "the plan embeds no workload summary: it cannot be re-simulated")
    if plan.cluster.spec is None:
        warn("no-cluster-spec",
             "the plan embeds no cluster spec: memory headroom and device types are unknown")
    return out
