"""Every rank's memory for a plan, and the recomputation that makes a partition fit.

:func:`rank_memory` applies :mod:`hetplan.cost_models.memory` to a plan's sections: each rank
holds the model state of the stages on it (one, or ``virtual_stages`` interleaved chunks) in
its device type's dtypes (:func:`stage_precision`) with the layout's ZeRO sharding and
uneven TP shares, the activations of its stages under their recomputation at the peak of its
pipeline rank's action list (the last stage's with the loss's fp32 logits), ZeRO's buffers
and the allocator margin.

:func:`choose_recompute` is how the passes that write stages pick each stage's
recomputation: the cheapest mode that fits (``none``, then ``selective`` where the stage has
an attention core to drop, then ``full``), upgrading one stage at a time — on the rank that
overflows most, a stage at the lowest mode of that rank's stages, the one with the most
activation bytes among them — until every rank fits or every stage is at ``full``. A rank
holding several stages (interleaved chunks) so takes selective recomputation on all of them,
which reruns only attention cores, before a full forward on any. Deterministic;
O(upgrades · ranks · layers).
"""

from __future__ import annotations

from dataclasses import dataclass

from hetplan.algorithms.pipeline_schedules import PipelineSchedule
from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.engine_memory import tied_head_copy
from hetplan.cost_models.memory import (
    USABLE_FRACTION,
    MemoryBreakdown,
    StatePrecision,
    breakdown,
    capture_bytes,
    layer_activations,
    loss_activations,
    model_state,
    peak_in_flight,
    recompute_transient,
    schedule_of,
    zero_buffers,
)
from hetplan.cost_models.precision import state_precision
from hetplan.cost_models.tp_shares import rank_layer_shares
from hetplan.ir.plan_sections import Layout, Stage, TensorParallel, WorkloadSummary

__all__ = ["rank_memory", "stage_precision", "choose_recompute", "held_positions",
           "held_stages", "RECOMPUTE_ORDER"]

#: Recomputation modes from the cheapest in time to the smallest in memory.
RECOMPUTE_ORDER = ("none", "selective", "full")


def stage_precision(workload: WorkloadSummary, st: Stage, costs: CostModel,
                     rank: int | None = None) -> StatePrecision:
    """Bytes per element a rank of ``st`` holds (``rank``: that rank's device type; None: the
    stage's largest)."""
    cap = capture_bytes(workload)
    own = None if rank is None else costs.devices[rank].type
    key = ("stage_precision", st.ranks, own, cap)
    hit: StatePrecision | None = costs.memo.get(key)
    if hit is not None:
        return hit
    types = sorted({costs.devices[r].type for r in st.ranks})
    if own is not None:
        out = state_precision(costs.precision, own, types, cap)
    else:
        options = [state_precision(costs.precision, t, types, cap) for t in types]
        out = max(options, key=lambda p: (p.act_bytes, p.weight_bytes, p.grad_bytes))
    costs.memo[key] = out
    return out


def held_positions(stages: tuple[Stage, ...], layout: Layout) -> dict[int, list[int]]:
    """Rank → the positions in ``stages`` of the stages it holds: those listing it (its
    interleaved chunks), then under Chimera the mirror ``pp-1-s`` of its stage ``s`` (its
    up replica's stage). The rank's own stage comes first, so two Chimera ranks holding the
    same pair of stages (``r`` and ``pp-1-r``) stay apart, as their action lists do."""
    held: dict[int, list[int]] = {}
    for k, st in enumerate(stages):
        for r in st.ranks:
            held.setdefault(r, []).append(k)
    if layout.stage_copies == 2 and len(stages) == layout.pp:
        for k, st in enumerate(stages):
            for r in st.ranks:
                held[r].append(layout.pp - 1 - k)
    return held


def held_stages(stages: tuple[Stage, ...], layout: Layout) -> tuple[Stage, ...]:
    """``stages`` with each one's ranks those holding a copy of it: as listed, and under
    Chimera also its mirror's (the up replica's copy on pipeline rank ``pp-1-s``): the
    ranks whose slowest device runs it and whose group averages its gradients."""
    if layout.stage_copies == 1 or len(stages) != layout.pp:
        return stages
    n = layout.pp
    return tuple(st.model_copy(update={"ranks": st.ranks + stages[n - 1 - k].ranks})
                 for k, st in enumerate(stages))


def rank_memory(
    workload: WorkloadSummary,
    stages: tuple[Stage, ...],
    layout: Layout,
    costs: CostModel,
    scale: float,
    tp_section: TensorParallel | None = None,
    *,
    schedule: PipelineSchedule | None = None,
) -> tuple[MemoryBreakdown, ...]:
    """Every rank's peak memory (:mod:`hetplan.cost_models.memory`): the model state of the
    stages it holds, their activations at the peak of its schedule's action list (with each
    stage's recomputation), ZeRO's buffers and the allocator margin. ``schedule``: the
    plan's own action lists where they are not the ones the layout's schedule generates (a
    plan edited by hand; None: the generated lists)."""
    even = _class_memory(workload, stages, layout, costs, scale, tp_section, schedule)
    if even is not None:
        rc, per_class = even
        return tuple(per_class[c] for c in rc.class_of)
    return _uneven_rank_memory(workload, stages, layout, costs, scale, tp_section, schedule)


@dataclass(frozen=True)
class _RankClasses:
    """The ranks of a stage list grouped by what they hold: ranks of one device type
    holding the same stages hold the same bytes (with even TP shards).

    Attributes:
        classes: per class, (device type, positions in the stage list of the stages its
            ranks hold, its ranks ascending); classes in the order of their first rank.
        class_of: per rank holding a stage, ascending, its class.
        worst: per class, for each distinct usable capacity of its ranks, (capacity, the
            position in ``class_of`` of the first of its ranks with that capacity): the rank
            of the class that overflows most, whatever the class's bytes.
        stage_types: per stage, the device types of its ranks, sorted (its state precision
            depends on them).
    """

    classes: list[tuple[str, tuple[int, ...], list[int]]]
    class_of: list[int]
    worst: list[list[tuple[float, int]]]
    stage_types: list[tuple[str, ...]]


def _rank_classes(costs: CostModel, stages: tuple[Stage, ...], layout: Layout
                  ) -> _RankClasses:
    """:class:`_RankClasses` of ``stages`` (memoised by their ranks: the recomputation
    search and the passes ask again and again for stages that differ in layers only)."""
    key = ("rank_classes", tuple(st.ranks for st in stages), layout.stage_copies)
    hit: _RankClasses | None = costs.memo.get(key)
    if hit is not None:
        return hit
    held = held_positions(stages, layout)  # rank -> positions of the stages it holds
    types = [d.type for d in costs.devices]
    index: dict[tuple[str, tuple[int, ...]], int] = {}
    classes: list[tuple[str, tuple[int, ...], list[int]]] = []
    class_of: list[int] = []
    for r in sorted(held):
        ck = (types[r], tuple(held[r]))
        c = index.get(ck)
        if c is None:
            c = index[ck] = len(classes)
            classes.append((ck[0], ck[1], []))
        classes[c][2].append(r)
        class_of.append(c)
    caps = [d.memory_bytes * USABLE_FRACTION for d in costs.devices]
    worst: list[dict[float, int]] = [{} for _ in classes]
    for pos, c in enumerate(class_of):
        worst[c].setdefault(caps[pos], pos)
    out = costs.memo[key] = _RankClasses(
        classes, class_of, [sorted(w.items()) for w in worst],
        [tuple(sorted({types[r] for r in st.ranks})) for st in stages])
    return out


def _class_memory(
    workload: WorkloadSummary,
    stages: tuple[Stage, ...],
    layout: Layout,
    costs: CostModel,
    scale: float,
    tp_section: TensorParallel | None,
    edited: PipelineSchedule | None = None,
) -> tuple[_RankClasses, list[MemoryBreakdown]] | None:
    """One breakdown per rank class (:func:`_rank_classes`), or None when some TP group has
    uneven shares (then ranks of one class may differ)."""
    if any(rank_layer_shares(workload, st, layout.tp, tp_section) for st in stages):
        return None
    sched = _schedule(layout, edited)
    rc = _rank_classes(costs, stages, layout)
    # Each class's breakdown is looked up in ``costs.memo`` across calls (the recomputation
    # search re-prices the same stages again and again, one stage changed at a time). The
    # memo holds the workload, so its id is not reused while the entries live.
    context = _memo_context(workload, layout, costs, scale, edited)
    out: list[MemoryBreakdown] = []
    for kind, ks, ranks in rc.classes:
        mine = [stages[k] for k in ks]
        key = context + (kind,) + tuple(
            (st.index, st.first_layer, st.last_layer, st.recompute, rc.stage_types[k], None)
            for k, st in zip(ks, mine))
        hit = costs.memo.get(key)
        if hit is None:
            hit = costs.memo[key] = _rank_memory(workload, mine, layout, costs, scale,
                                                 ranks[0], sched, [None] * len(mine))
        out.append(hit)
    return rc, out


def _schedule(layout: Layout, edited: PipelineSchedule | None) -> PipelineSchedule | None:
    """The action lists the activations follow: the plan's edited ones, else the generated
    ones of the layout's schedule (None without a pipeline)."""
    if layout.pp == 1:
        return None
    if edited is not None:
        return edited
    return schedule_of(layout.schedule, layout.pp, layout.micro_batches,
                       layout.virtual_stages)


def _memo_context(workload: WorkloadSummary, layout: Layout, costs: CostModel,
                  scale: float, edited: PipelineSchedule | None) -> tuple[object, ...]:
    costs.memo[("workload", id(workload))] = workload  # its id stays unique while cached
    return ("rank_memory", id(workload), layout.pp, layout.virtual_stages, layout.tp,
            layout.dp, layout.zero_stage, layout.sequence_parallel, layout.schedule,
            layout.micro_batches, scale, None if edited is None else edited.encode())


def _uneven_rank_memory(
    workload: WorkloadSummary,
    stages: tuple[Stage, ...],
    layout: Layout,
    costs: CostModel,
    scale: float,
    tp_section: TensorParallel | None,
    edited: PipelineSchedule | None = None,
) -> tuple[MemoryBreakdown, ...]:
    """:func:`rank_memory` with uneven TP shares: one breakdown per rank of uneven groups."""
    sched = _schedule(layout, edited)
    held = held_positions(stages, layout)  # rank -> positions of the stages it holds
    uneven: dict[tuple[int, int], tuple[float, ...]] = {}
    for st in stages:
        for r, shares in rank_layer_shares(workload, st, layout.tp, tp_section).items():
            uneven[(st.index, r)] = tuple(shares)
    context = _memo_context(workload, layout, costs, scale, edited)
    types = [d.type for d in costs.devices]
    # a stage's state precision depends on the device types of its ranks
    stage_types = [tuple(sorted({types[r] for r in st.ranks})) for st in stages]
    classes: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    for r in sorted(held):
        classes.setdefault((types[r], tuple(held[r])), []).append(r)
    out: dict[int, MemoryBreakdown] = {}
    for (kind, ks), ranks in classes.items():
        mine = [stages[k] for k in ks]
        for r in ranks:  # shares differ only between ranks of uneven TP groups
            shares_of = [uneven.get((st.index, r)) for st in mine]
            key = context + (kind,) + tuple(
                (st.index, st.first_layer, st.last_layer, st.recompute, stage_types[k], sh)
                for k, st, sh in zip(ks, mine, shares_of))
            hit = costs.memo.get(key)
            if hit is None:
                hit = costs.memo[key] = _rank_memory(
                    workload, mine, layout, costs, scale, r, sched,
                    [None if sh is None else list(sh) for sh in shares_of])
            out[r] = hit
    return tuple(out[r] for r in sorted(held))


def _rank_memory(workload: WorkloadSummary, mine: list[Stage], layout: Layout,
                 costs: CostModel, scale: float, rank: int, sched: PipelineSchedule | None,
                 shares: list[list[float] | None]) -> MemoryBreakdown:
    """One rank's breakdown; ``mine`` are the stages it holds, ``shares`` its uneven TP
    shares of each (None: even)."""
    weights = grads = state = buffers = transient = 0.0
    stage_bytes = [0.0] * len(mine) if sched is None else [0.0] * (layout.pp * layout.virtual_stages)
    all_layers = costs.memory_layers(workload)
    vocab_tp = layout.tp if costs.vocab_parallel else 1
    group = layout.sync_group_size  # ZeRO shards inside the group that averages gradients
    for k, st in enumerate(mine):
        layers = all_layers[st.first_layer : st.last_layer + 1]
        prec = stage_precision(workload, st, costs, rank)
        w, g, o = model_state(layers, tp=layout.tp, dp=group, zero_stage=layout.zero_stage,
                              optimizer=costs.optimizer, precision=prec, shares=shares[k])
        weights, grads, state = weights + w, grads + g, state + o
        buffers = max(buffers, zero_buffers(layers, tp=layout.tp, zero_stage=layout.zero_stage,
                                            precision=prec, shares=shares[k]))
        acts = 0.0
        mine_shares = shares[k]
        for j, lay in enumerate(layers):
            share = None if mine_shares is None else mine_shares[j]
            acts += layer_activations(
                lay, st.recompute, tp=layout.tp, sequence_parallel=layout.sequence_parallel,
                precision=prec, micro_batch_scale=scale, share=share)
            transient = max(transient, recompute_transient(
                lay, st.recompute, tp=layout.tp, sequence_parallel=layout.sequence_parallel,
                precision=prec, micro_batch_scale=scale, share=share))
        if st.last_layer == len(workload.layers) - 1:  # this stage computes the loss
            tied = tied_head_copy(all_layers, prec.capture_bytes, vocab_tp > 1)
            if tied is not None and not any(s.first_layer <= tied[0] <= s.last_layer
                                            for s in mine):
                # the LM head's copy of the embedding it is tied to (engine_memory)
                w, g, o = model_state([tied[1]], tp=layout.tp, dp=group,
                                      zero_stage=layout.zero_stage, optimizer=costs.optimizer,
                                      precision=prec)
                weights, grads, state = weights + w, grads + g, state + o
            held, loss_transient = loss_activations(layers[-1], prec.capture_bytes,
                                                    micro_batch_scale=scale, vocab_tp=vocab_tp)
            acts += held
            transient = max(transient, loss_transient)
        stage_bytes[k if sched is None else st.index] = acts
    if sched is None:
        activations = sum(stage_bytes)
    else:
        activations = peak_in_flight(sched, mine[0].index % layout.pp, stage_bytes)
    return breakdown(weights, grads, state, activations + transient, buffers)


def choose_recompute(
    workload: WorkloadSummary,
    layout: Layout,
    stages: tuple[Stage, ...],
    costs: CostModel,
    *,
    tensor_parallel: TensorParallel | None = None,
    mode: str = "auto",
) -> tuple[Stage, ...]:
    """``stages`` with their recomputation: ``mode`` everywhere, or for ``auto`` the cheapest
    per stage that lets every rank fit (see module docstring). Stages that cannot fit even at
    ``full`` stay at ``full``; :func:`~hetplan.cost_models.evaluate.evaluate` then refuses
    the plan with the breakdown."""
    if mode != "auto":
        if mode not in RECOMPUTE_ORDER:
            raise ValueError(f"recompute must be auto or one of {RECOMPUTE_ORDER}, got {mode!r}")
        return tuple(st.model_copy(update={"recompute": mode}) for st in stages)
    scale = layout.micro_batch_size / workload.batch_size
    caps = [d.memory_bytes * USABLE_FRACTION for d in costs.devices]
    # what the engine keeps (``memory_layers``), not the capture: a fused attention kernel
    # keeps no scores, so selective recomputation would drop nothing there and only cost time
    kept = costs.memory_layers(workload)
    has_core = [any(x.act_attn_core_bytes for x in kept[st.first_layer:st.last_layer + 1])
                for st in stages]
    weight = [sum(x.act_saved_bytes for x in kept[st.first_layer:st.last_layer + 1])
              for st in stages]
    current = tuple(st if st.recompute == "none" else st.model_copy(update={"recompute": "none"})
                    for st in stages)
    held = held_positions(current, layout)  # only the recomputation changes below
    while True:
        even = _class_memory(workload, current, layout, costs, scale, tensor_parallel)
        if even is not None:  # the worst rank of each class and capacity only
            rc, per_class = even
            totals = [m.total for m in per_class]
            over = [(totals[c] - cap, -r) for c, worst in enumerate(rc.worst)
                    for cap, r in worst if totals[c] > cap]
        else:
            mem = rank_memory(workload, current, layout, costs, scale, tensor_parallel)
            over = [(m.total - caps[r], -r) for r, m in enumerate(mem) if m.total > caps[r]]
        if not over:
            return current
        worst = -max(over)[1]
        mine = held.get(worst, [])
        options = [current[k] for k in mine if current[k].recompute != "full"]
        if not options:
            return current
        st = max(options, key=lambda x: (-RECOMPUTE_ORDER.index(x.recompute),
                                          weight[x.index], -x.index))
        step = RECOMPUTE_ORDER.index(st.recompute) + 1
        if RECOMPUTE_ORDER[step] == "selective" and not has_core[st.index]:
            step += 1
        upgraded = st.model_copy(update={"recompute": RECOMPUTE_ORDER[step]})
        current = tuple(upgraded if x.index == st.index else x for x in current)
