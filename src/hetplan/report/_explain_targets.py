"""The explainers behind :func:`hetplan.report.explain.explain`, one per kind of target.

Each takes the explanation context (the plan, its cost model and current evaluation) and the
resolved target, and returns the facts (label, value) and the re-evaluated alternatives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hetplan.cost_models.evaluate import Evaluation
from hetplan.cost_models.memory import USABLE_FRACTION
from hetplan.ir.plan_sections import Bucket, GradientSync, NoSync, Stage, TensorSync
from hetplan.report._text import device_mix, fmt_bytes, fmt_ms, fmt_pct, layer_label, ranges
from hetplan.report.inspect import describe_strategy

__all__ = ["EXPLAINERS", "Alternative", "sync_with_buckets", "fp32_strategy", "strategy_text"]



@dataclass(frozen=True)
class Alternative:
    """One alternative decision, re-evaluated.

    Attributes:
        name: short label (``split into 12 per-tensor operations``).
        iteration_time_ms: predicted iteration time with this alternative.
        delta_ms: ``iteration_time_ms`` minus the current plan's (positive: slower).
        fits_memory: whether every rank still fits in its usable memory.
        note: why it does not fit, or other remarks.
    """

    name: str
    iteration_time_ms: float
    delta_ms: float
    fits_memory: bool = True
    note: str = ""



# -- helpers shared by the target explainers -----------------------------------------------
def sync_with_buckets(sync: GradientSync, buckets: list[Bucket],
                      extra: dict[str, Any] | None = None) -> GradientSync:
    """``sync`` with new buckets (and extra strategies); per-tensor entries follow their
    bucket's strategy so the section stays consistent."""
    strategies = {**sync.strategies, **(extra or {})}
    in_bucket = {t: b.strategy for b in buckets for t in b.tensors}
    tensors = tuple(TensorSync(name=t.name, strategy=in_bucket.get(t.name, t.strategy))
                    for t in sync.tensors)
    return GradientSync(strategies=strategies, tensors=tensors, buckets=tuple(buckets))


def fp32_strategy(sync: GradientSync) -> tuple[str, dict[str, Any]]:
    """(key of a plain fp32 flat-allreduce strategy, strategies to add for it)."""
    for key, strategy in sorted(sync.strategies.items()):
        if strategy == NoSync():
            return key, {}
    key = "fp32" if "fp32" not in sync.strategies else "fp32-flat-allreduce"
    return key, {key: NoSync()}


def strategy_text(sync: GradientSync, key: str) -> str:
    return f"{key} ({describe_strategy(sync.strategies[key])})"


Facts = list[tuple[str, str]]


# -- tensor ------------------------------------------------------------------------------
def explain_tensor(ctx: Any, name: str) -> tuple[Facts, list[Alternative]]:
    """A gradient: its strategy and bucket vs. synced alone with fp32 (or its strategy)."""
    wl = ctx.workload
    order = {g.name: i for i, g in enumerate(wl.grads)}
    g = wl.grads[order[name]]
    stage_of = ctx.stage_of_layer()
    facts: Facts = [
        ("size", f"{fmt_bytes(g.size_bytes)} ({g.dtype})"),
        ("layer", (f"{layer_label(wl.layers[g.layer_index].name)} (layer {g.layer_index}, stage "
                  f"{stage_of[g.layer_index]})")),
        ("ready", f"{order[name] + 1} of {len(wl.grads)} in backward order"),
    ]
    sparse = ctx.plan.sparse_sync
    row = next((t for t in sparse.tensors if t.name == name), None) if sparse else None
    if row is not None and row.scheme != "dense":
        assert sparse is not None
        how = f"{row.scheme}" + (f" ({row.pull} pull)" if row.scheme == "zen" else "")
        facts.append(("sparse sync", (
            f"{how}: {row.rows}x{row.row_elems} rows, density {row.stats.density:.4f} per "
            f"rank, {row.stats.density_n:.4f} over the group, skew {row.stats.skew:.2f} "
            f"({row.stats.source}); predicted {row.predicted_ms:.3f} ms vs dense "
            f"{row.dense_ms:.3f} ms")))
        facts += ctx.decided_by("sparse_sync")
        rest = tuple(t for t in sparse.tensors if t.name != name)
        dense = sparse.model_copy(update={"tensors": rest}) if rest else None
        return facts, [ctx.alternative("dense: left to the gradient-sync path", sparse=dense)]
    sync: GradientSync | None = ctx.sync
    if sync is None:
        facts.append(("sync", "undecided: synced alone with an fp32 allreduce"))
        return facts, []
    b_index = next((i for i, b in enumerate(sync.buckets) if name in b.tensors), None)
    bucket = sync.buckets[b_index] if b_index is not None else None
    key = bucket.strategy if bucket is not None else \
        {t.name: t.strategy for t in sync.tensors}.get(name)
    if bucket is not None:
        facts.append(("bucket", (f"bucket:{b_index}, {len(bucket.tensors)} tensor(s), "
                                f"{fmt_bytes(bucket.size_bytes)}")))
    else:
        facts.append(("bucket", "none: synced alone"))
    facts.append(("strategy", strategy_text(sync, key) if key else "unlisted: fp32 allreduce"))
    facts += ctx.decided_by("gradient_sync")

    def alone(strategy: str, extra: dict[str, Any]) -> GradientSync:
        buckets = []
        for b in sync.buckets:
            rest = tuple(t for t in b.tensors if t != name)
            if len(rest) == len(b.tensors):
                buckets.append(b)
            elif rest:
                buckets.append(Bucket(tensors=rest, strategy=b.strategy,
                                      size_bytes=max(b.size_bytes - g.size_bytes, 0)))
        buckets.append(Bucket(tensors=(name,), size_bytes=g.size_bytes, strategy=strategy))
        return sync_with_buckets(sync, buckets, extra)

    alts: list[Alternative] = []
    fp32, extra = fp32_strategy(sync)
    shared = bucket is not None and len(bucket.tensors) > 1
    is_fp32 = key is None or sync.strategies[key] == NoSync()
    if shared or not is_fp32:
        alts.append(ctx.alternative("alone, fp32 allreduce", sync=alone(fp32, extra)))
    if shared and key is not None and not is_fp32:
        alts.append(ctx.alternative(f"alone, strategy {key}", sync=alone(key, {})))
    if not shared:
        j = _bucket_of_neighbour(ctx, sync, name)
        if j is not None:
            merged = [_merge(ctx, [x], extra=(name,)) if k == j else x
                      for k, x in enumerate(sync.buckets) if k != b_index]
            alts.append(ctx.alternative(f"fused into bucket:{j}",
                                        sync=sync_with_buckets(sync, merged)))
    return facts, alts


def _bucket_of_neighbour(ctx: Any, sync: GradientSync, name: str) -> int | None:
    """The bucket (other than ``name``'s) holding the nearest gradient of the same stage."""
    grads = ctx.workload.grads
    stage_of = ctx.stage_of_layer()
    pos = {g.name: i for i, g in enumerate(grads)}[name]
    stage = stage_of[grads[pos].layer_index]
    where = {t: i for i, b in enumerate(sync.buckets) for t in b.tensors}
    for d in range(1, len(grads)):
        for p in (pos + d, pos - d):
            if 0 <= p < len(grads) and stage_of[grads[p].layer_index] == stage:
                j = where.get(grads[p].name)
                if j is not None and name not in sync.buckets[j].tensors:
                    return j
    return None


def _merge(ctx: Any, buckets: list[Bucket], extra: tuple[str, ...] = ()) -> Bucket:
    """One bucket holding the tensors of ``buckets`` (and ``extra``), in backward order, with
    the first bucket's strategy."""
    sizes = {g.name: g.size_bytes for g in ctx.workload.grads}
    pos = {g.name: i for i, g in enumerate(ctx.workload.grads)}
    names = sorted({t for b in buckets for t in b.tensors} | set(extra), key=pos.__getitem__)
    return Bucket(tensors=tuple(names), size_bytes=sum(sizes[t] for t in names),
                  strategy=buckets[0].strategy)


# -- bucket ------------------------------------------------------------------------------
def explain_bucket(ctx: Any, i: int) -> tuple[Facts, list[Alternative]]:
    """A bucket vs. one operation per tensor and vs. merged with a neighbouring bucket."""
    sync: GradientSync = ctx.sync
    buckets = list(sync.buckets)
    b = buckets[i]
    stage = _bucket_stage(ctx, b)
    facts: Facts = [
        ("tensors", f"{len(b.tensors)}: {b.tensors[0]}"
                    + (f" … {b.tensors[-1]}" if len(b.tensors) > 1 else "")),
        ("size", fmt_bytes(b.size_bytes)),
        ("stage", str(stage)),
        ("launched", f"{i + 1} of {len(buckets)}"),
        ("strategy", strategy_text(sync, b.strategy)),
    ]
    facts += ctx.decided_by("gradient_sync")
    alts: list[Alternative] = []
    if len(b.tensors) > 1:
        sizes = {g.name: g.size_bytes for g in ctx.workload.grads}
        split = [Bucket(tensors=(t,), size_bytes=sizes[t], strategy=b.strategy)
                 for t in b.tensors]
        alts.append(ctx.alternative(
            f"split into {len(b.tensors)} per-tensor operations",
            sync=sync_with_buckets(sync, buckets[:i] + split + buckets[i + 1:])))
    same = [j for j in range(len(buckets)) if j != i and _bucket_stage(ctx, buckets[j]) == stage]
    before = [j for j in same if j < i]
    after = [j for j in same if j > i]
    for j in ([before[-1]] if before else []) + ([after[0]] if after else []):
        merged = _merge(ctx, [b, buckets[j]])
        rest = [x for k, x in enumerate(buckets) if k not in (i, j)]
        note = "" if buckets[j].strategy == b.strategy else \
            f"bucket:{j} uses {buckets[j].strategy}; the merged bucket uses {b.strategy}"
        alts.append(ctx.alternative(
            f"merged with bucket:{j} ({len(buckets[j].tensors)} tensor(s), "
            f"{fmt_bytes(buckets[j].size_bytes)})",
            sync=sync_with_buckets(sync, rest + [merged]), note=(lambda _, n=note: n)))
    return facts, alts


def _bucket_stage(ctx: Any, b: Bucket, stages: tuple[Stage, ...] | None = None) -> int:
    layer = {g.name: g.layer_index for g in ctx.workload.grads}[b.tensors[-1]]
    return ctx.stage_of_layer(stages)[layer]


# -- stage boundary ----------------------------------------------------------------------
def explain_stage(ctx: Any, k: int) -> tuple[Facts, list[Alternative]]:
    """Stage ``k`` and the boundary before it (stage 0: after it) vs. moving it one layer."""
    stages: tuple[Stage, ...] = ctx.stages
    ev: Evaluation = ctx.current
    names = [x.name for x in ctx.workload.layers]
    facts: Facts = []
    if stages:
        facts += _stage_facts(ctx, k)
    if len(stages) < 2:
        facts.append(("boundary", "none: the plan has one pipeline stage (pp=1)"))
        return facts, []
    b = max(k, 1)
    left, right = stages[b - 1], stages[b]
    facts.append(("boundary", (f"between stage {b - 1} (layers {left.first_layer}–"
                              f"{left.last_layer}) and stage {b} (layers {right.first_layer}–"
                              f"{right.last_layer}), before "
                              f"{layer_label(names[right.first_layer])}")))
    facts.append(("bubble", f"{fmt_pct(ev.bubble_ratio)} of the pipeline"))
    facts += ctx.decided_by("stages")
    alts: list[Alternative] = []
    for delta in (-1, 1):
        moved = _move_boundary(stages, b, delta, names)
        if moved is None:
            continue
        layer = names[right.first_layer - 1] if delta < 0 else names[right.first_layer]
        src, dst = (b - 1, b) if delta < 0 else (b, b - 1)
        alts.append(ctx.alternative(
            f"move {layer_label(layer)} from stage {src} to stage {dst}",
            stages=moved, sync=_split_buckets(ctx, moved), note=_stage_note(b)))
    return facts, alts


def _stage_facts(ctx: Any, k: int) -> Facts:
    st = ctx.stages[k]
    costs = ctx.current.stages
    step = [(c.fwd_s + c.bwd_s) * 1e3 for c in costs]
    slow = max(range(len(step)), key=lambda s: step[s])
    types: dict[str, int] = {}
    for r in st.ranks:
        t = ctx.costs.devices[r].type
        types[t] = types.get(t, 0) + 1
    n = st.last_layer - st.first_layer + 1
    where = f"{k}: layers {st.first_layer}–{st.last_layer} ({n}), ranks {ranges(st.ranks)}"
    times = (f"fwd {fmt_ms(costs[k].fwd_s * 1e3)} + bwd {fmt_ms(costs[k].bwd_s * 1e3)}; "
             f"{fmt_pct(step[k] / step[slow])} of the slowest stage ({slow})")
    return [("stage", f"{where}, {device_mix(types)}"), ("time/micro-batch", times)]


def _stage_note(b: int) -> Callable[[Evaluation], str]:
    def note(ev: Evaluation) -> str:
        a, c = ev.stages[b - 1], ev.stages[b]
        return (f"stage {b - 1}: {fmt_ms((a.fwd_s + a.bwd_s) * 1e3)}, stage {b}: "
                f"{fmt_ms((c.fwd_s + c.bwd_s) * 1e3)} per micro-batch; bubble "
                f"{fmt_pct(ev.bubble_ratio)}")
    return note


def _move_boundary(stages: tuple[Stage, ...], b: int, delta: int,
                   names: list[str]) -> tuple[Stage, ...] | None:
    """Stages with the first layer of stage ``b`` moved by ``delta``; None if a stage would
    become empty."""
    left, right = stages[b - 1], stages[b]
    first = right.first_layer + delta
    if first <= left.first_layer or first > right.last_layer:
        return None

    def with_range(st: Stage, lo: int, hi: int) -> Stage:
        data = {**st.model_dump(), "first_layer": lo, "last_layer": hi,
                "layer_names": tuple(names[lo: hi + 1]) if st.layer_names else ()}
        return Stage.model_validate(data)

    out = list(stages)
    out[b - 1] = with_range(left, left.first_layer, first - 1)
    out[b] = with_range(right, first, right.last_layer)
    return tuple(out)


def _split_buckets(ctx: Any, stages: tuple[Stage, ...]) -> GradientSync | None:
    """The gradient sync with buckets split where they now span two stages."""
    sync: GradientSync | None = ctx.sync
    if sync is None:
        return None
    stage_of = ctx.stage_of_layer(stages)
    grad = {g.name: g for g in ctx.workload.grads}
    out = []
    for b in sync.buckets:
        parts: dict[int, list[str]] = {}
        for t in b.tensors:
            parts.setdefault(stage_of[grad[t].layer_index], []).append(t)
        out += [Bucket(tensors=tuple(ts), strategy=b.strategy,
                       size_bytes=sum(grad[t].size_bytes for t in ts))
                for _, ts in sorted(parts.items())]
    return sync_with_buckets(sync, out)


# -- rank --------------------------------------------------------------------------------
def explain_rank(ctx: Any, r: int) -> tuple[Facts, list[Alternative]]:
    """A rank's device, memory and compute time vs. the slowest device and stage."""
    dev = ctx.costs.devices[r]
    lay = ctx.layout
    dp, pp, tp = lay.coords(r)
    ev: Evaluation = ctx.current
    stages = ctx.stages or (Stage(index=0, first_layer=0,
                                  last_layer=len(ctx.workload.layers) - 1,
                                  ranks=tuple(range(lay.num_ranks))),)
    st = next(s for s in stages if r in s.ranks)
    facts: Facts = [
        ("device", f"{dev.type} on node {dev.node} (local rank {dev.local_rank})"
                   + (f", slowdown {dev.slowdown:g}" if dev.slowdown != 1 else "")),
        ("coordinates", (f"dp={dp} pp={pp} tp={tp}; stage {st.index} (layers "
                        f"{st.first_layer}–{st.last_layer})" + _up_copy(lay, stages, st))),
    ]
    if lay.tp > 1:
        group = [lay.rank_of(dp, pp, t) for t in range(lay.tp)]
        facts.append(("TP group", f"ranks {ranges(group)}, shard {tp + 1} of {lay.tp}"))
    facts += _rank_time(ctx, r, st, ev)
    facts += _rank_memory(ctx, r, ev)
    return facts, []


def _up_copy(lay: Any, stages: tuple[Stage, ...], st: Stage) -> str:
    """Under Chimera, the other stage the rank holds: ``pp-1-s`` of the up pipeline."""
    if lay.stage_copies != 2 or len(stages) != lay.pp:
        return ""
    up = stages[lay.pp - 1 - st.index]
    return (f", and stage {up.index} (layers {up.first_layer}–{up.last_layer}) of the up "
            "pipeline (Chimera)")


def _device_ms(ctx: Any, dev: Any, st: Stage) -> float:
    """fwd + bwd of the stage's layers on ``dev`` for one micro-batch (TP-split, no comm)."""
    lay = ctx.layout
    times = ctx.costs.compute.layer_times(ctx.workload, dev, lay.micro_batch_size)
    total = 0.0
    for i in range(st.first_layer, st.last_layer + 1):
        t = times[i].fwd_s + times[i].bwd_s
        total += t / ctx.costs.compute.tp_divisor(ctx.workload.layers[i], lay.tp)
    return total * 1e3


def _rank_time(ctx: Any, r: int, st: Stage, ev: Evaluation) -> Facts:
    devices = ctx.costs.devices
    own = _device_ms(ctx, devices[r], st)
    per_rank = {q: _device_ms(ctx, devices[q], st) for q in st.ranks}
    slow = max(st.ranks, key=lambda q: (per_rank[q], -q))
    cost = ev.stages[st.index]
    stage_ms = (cost.fwd_s + cost.bwd_s) * 1e3
    tp_ms = 2 * cost.tp_comm_s * 1e3
    steps = [(c.fwd_s + c.bwd_s) * 1e3 for c in ev.stages]
    slowest = max(range(len(steps)), key=lambda s: steps[s])
    if per_rank[slow] <= own:
        pace = "it is the slowest device of its stage and sets the stage's pace"
    else:
        wait = per_rank[slow] - own
        pace = (f"waits {fmt_ms(wait)} per micro-batch ({fmt_pct(wait / per_rank[slow])} idle) "
                f"for the slowest device of its stage, rank {slow} ({devices[slow].type})")
    tp_text = f" + TP all-reduces {fmt_ms(tp_ms)}" if tp_ms else ""
    return [
        ("compute/micro-batch", f"{fmt_ms(own)} on its {devices[r].type}{tp_text}; {pace}"),
        ("stage time", (f"{fmt_ms(stage_ms)} per micro-batch (fwd + bwd); "
                       f"{fmt_pct(stage_ms / steps[slowest])} of the slowest stage "
                       f"({slowest}, {fmt_ms(steps[slowest])})")),
    ]


def _rank_memory(ctx: Any, r: int, ev: Evaluation) -> Facts:
    devices = ctx.costs.devices
    mem = [m.total for m in ev.memory]
    usable = [devices[q].memory_bytes * USABLE_FRACTION for q in range(len(mem))]
    top = max(range(len(mem)), key=lambda q: (mem[q] / usable[q], -q))
    out = [("memory", (f"{fmt_bytes(mem[r])} of {fmt_bytes(usable[r])} usable "
                      f"({fmt_pct(mem[r] / usable[r])}): {_breakdown(ev.memory[r])}"))]
    if top != r:
        out.append(("fullest rank", (f"rank {top} ({devices[top].type}): {fmt_bytes(mem[top])}, "
                                    f"{fmt_pct(mem[top] / usable[top])} of usable")))
    else:
        out.append(("fullest rank", "this one"))
    return out


def _breakdown(m: Any) -> str:
    parts = (("params", m.params), ("grads", m.grads), ("optimizer", m.optimizer),
             ("activations", m.activations), ("buffers", m.buffers),
             ("allocator margin", m.margin))
    return ", ".join(f"{name} {fmt_bytes(v)}" for name, v in parts if v)


# -- tensor-parallel linear -------------------------------------------------------------
def explain_linear(ctx: Any, name: str) -> tuple[Facts, list[Alternative]]:
    """A TP linear with per-rank shard sizes: sizes per rank and device, the ranks' roles and
    the predicted effect, against even shards of its pair (the linears sharing its sizes'
    groups) everywhere."""
    tp = ctx.plan.tensor_parallel
    devices = ctx.costs.devices
    groups = [(g, lin) for g in tp.groups for lin in g.linears if lin.name == name]
    g0, lin0 = groups[0]
    facts: Facts = [
        ("split", (f"{lin0.split}-parallel, {lin0.features} features over "
                   f"{len(g0.ranks)} ranks, {len(groups)} group(s)")),
    ]
    patterns: dict[tuple[Any, ...], list[Any]] = {}
    for g, lin in groups:
        key = (tuple(devices[r].type for r in g.ranks), lin.shard_sizes)
        patterns.setdefault(key, []).append(g)
    for (types, sizes), gs in patterns.items():
        per_rank = ", ".join(f"{s} ({t})" for s, t in zip(sizes, types))
        facts.append((f"ranks {ranges(list(gs[0].ranks))}"
                      + (f" (+{len(gs) - 1} alike)" if len(gs) > 1 else ""), per_rank))
    by_role: dict[tuple[str, float, float], list[int]] = {}
    for g, _ in groups:
        for r in g.roles:
            if r.role != "normal":
                by_role.setdefault((r.role, r.gamma, r.beta), []).append(r.rank)
    roles = [f"ranks {ranges(sorted(rs))} {role} γ={gam:.3f}" + (f" β={beta:.3f}" if beta
                                                                  else "")
             for (role, gam, beta), rs in by_role.items()]
    ctl = tp.controller
    facts.append(("controller", f"{ctl.variant} (criterion {ctl.criterion}, γ_max "
                                f"{ctl.gamma_max:g})" + (f"; {', '.join(roles)}" if roles
                                                          else "; every rank normal")))
    if tp.predicted is not None:
        p = tp.predicted
        facts.append(("predicted", (f"even {fmt_ms(p.even_ms)}, skewed "
                                    f"{fmt_ms(p.skewed_ms)}, even + controller "
                                    f"{fmt_ms(p.controller_ms)}")))
    facts += ctx.decided_by("tensor_parallel")
    # its Megatron pair: the linears of the same module (the runtime shards a pair with one
    # size list, so they go even together)
    parent = name.rpartition(".")[0]
    pair = {lin.name for g, _ in groups for lin in g.linears
            if lin.name.rpartition(".")[0] == parent}
    even_groups = tuple(g.model_copy(update={"linears": tuple(
        x for x in g.linears if x.name not in pair)}) for g in tp.groups)
    even = tp.model_copy(update={"groups": even_groups})
    alt = ctx.alternative(f"even shards for {len(pair)} linear(s) of its pair", tp=even)
    return facts, [alt]


EXPLAINERS: dict[str, Callable[[Any, Any], tuple[Facts, list[Alternative]]]] = {
    "tensor": explain_tensor,
    "bucket": explain_bucket,
    "stage": explain_stage,
    "rank": explain_rank,
    "linear": explain_linear,
}
