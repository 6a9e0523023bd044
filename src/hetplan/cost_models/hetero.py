"""Costs of heterogeneous pipelines: stages with their own device class and (dp, tp).

Three things, all from the one :class:`~hetplan.cost_models.costs.CostModel`:

1. **Device classes** (:func:`device_classes`): ranks grouped by what the cost model can
   tell apart — device type, slowdown, the node's intra-node link and how many devices of
   the type a node holds. Classes are named and ordered by content, never by the order of
   nodes in the cluster file, and a stage's ranks are drawn from its class packed node by
   node (:func:`assign_ranks`): permuting the file's nodes permutes rank numbers only.
2. **Search tables** (:func:`build_problem`): for every option (class, dp, tp) and
   recomputation mode the arrays ``a``, ``v``, ``q`` of
   :mod:`hetplan.algorithms.hetero_search` over every layer range, from per-layer prefix
   sums: compute as :func:`~hetplan.cost_models.stage_times.stage_times` prices it (each
   replica runs ``micro_batch / dp`` samples at ``tp``), the resharding of the stage's input
   (:func:`reshard_s`), the stage's gradient sync on its own data-parallel group
   (:func:`sync_s`) and optimizer step, and its memory
   (:func:`~hetplan.cost_models.memory.stage_memory` plus the resharding buffer).
3. **Prediction** (:func:`evaluate_hetero`): a plan with a ``hetero`` section: stage times
   with :func:`stage_times` on each stage's own layout, the pipeline (1F1B, GPipe where the
   plan names it, or the plan's own hand-edited action lists) simulated with
   the resharding transfers on its links, each stage's exposed sync and optimizer step
   (the step as :func:`~hetplan.cost_models.evaluate.evaluate` prices it, on the stage's
   projection: the bytes its kernels move and a launch per kernel, or the profile's
   measured step; the search's tables count the bytes only, a floor),
   and every rank's memory at the peak of its action list. With a ``gradient_sync``
   section, each stage's sync is the per-bucket DP timeline
   :func:`~hetplan.cost_models.evaluate.evaluate` runs, over that stage's own
   data-parallel group (:func:`stage_projection`); without one (the search), the closed
   form of :func:`sync_s`.

**Stage projection** (:func:`stage_projection`): stage ``k`` seen as a homogeneous plan of
its own: the workload of its layers and gradients only, a layout of ``dp_k x tp_k`` with
ZeRO ``zero_k`` and the stage's per-replica micro-batch, one stage on the stage's real
ranks. The gradient-sync passes (Espresso, Cupcake, DDP buckets) run on it unchanged and
:func:`evaluate_hetero` prices its sync with it, so passes and prediction never disagree.
Stages sync on disjoint groups, so a stage's choices change only its own finish time.

Resharding (forward; backward moves the same bytes back): every receiving replica needs its
``micro_batch / dp_recv`` samples of the boundary activation. Its TP ranks each take
``1/tp_recv`` of them from the sender ranks that hold them and all-gather inside the node
(Megatron's scatter-gather); across nodes, all receiving ranks on a node share its network.
The receiving ranks keep a whole-slice buffer for the gather (the memory model counts it).

Deterministic and free of torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from hetplan.algorithms.dp_types import DPTimeline
from hetplan.algorithms.hetero_search import HeteroProblem, StageOption
from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.engine_memory import tied_head_copy
from hetplan.cost_models.evaluate import (Evaluation, StageCost, edited_lists, evaluate,
                                          optimizer_step_s)
from hetplan.cost_models.memory import (
    ALLOCATOR_MARGIN,
    MOMENT_BYTES,
    USABLE_FRACTION,
    MemoryBreakdown,
    StatePrecision,
    capture_bytes,
    layer_activations,
    loss_activations,
    model_state,
    peak_in_flight,
    recompute_transient,
    schedule_of,
    stage_memory,
)
from hetplan.cost_models.pipeline import (
    PipelineSchedule,
    PipelineSimResult,
    simulate_pipeline,
    simulate_schedule,
)
from hetplan.cost_models.precision import state_precision
from hetplan.cost_models.stage_times import recompute_s, stage_times
from hetplan.ir.cluster import Device
from hetplan.ir.plan_hetero import Hetero, StageShape
from hetplan.ir.plan_sections import (
    Baseline,
    GradientSync,
    Layout,
    LayerCost,
    PipelineActions,
    Predictions,
    RankMemory,
    Stage,
    TimeBreakdown,
    WorkloadSummary,
)

__all__ = ["DeviceClass", "device_classes", "assign_ranks", "build_problem", "coarse_units",
           "STATE_BUDGET", "reshard_s",
           "sync_s", "HeteroEvaluation", "evaluate_hetero", "MODES", "TP_DEGREES",
           "StageProjection", "stage_projection", "stage_sync_section", "hetero_predictions"]

#: Recomputation modes, cheapest in time first (the search takes the first that fits).
MODES = ("none", "selective", "full")
#: Tensor-parallel degrees the search considers (a TP group stays inside a node).
TP_DEGREES = (1, 2, 4, 8)


@dataclass(frozen=True)
class DeviceClass:
    """Ranks the cost model cannot tell apart.

    Attributes:
        name: the device type, or ``type@group`` when several classes share a type.
        type: the device type.
        ranks: its ranks, packed node by node (nodes ordered by their name).
        per_node: devices of this class on each of its nodes.
    """

    name: str
    type: str
    ranks: tuple[int, ...]
    per_node: int

    @property
    def count(self) -> int:
        return len(self.ranks)


def device_classes(costs: CostModel) -> tuple[DeviceClass, ...]:
    """The cluster's device classes, ordered by (type, slowdown, per-node count, group)."""
    spec = costs.cluster
    by_key: dict[tuple[str, float, int, float, float], list[Device]] = {}
    per_node: dict[tuple[int, str, float], int] = {}
    for d in costs.devices:
        per_node[(d.node_index, d.type, d.slowdown)] = per_node.get(
            (d.node_index, d.type, d.slowdown), 0) + 1
    for d in costs.devices:
        link = spec.link_between(d.rank, d.rank)
        key = (d.type, d.slowdown, per_node[(d.node_index, d.type, d.slowdown)],
               link.bandwidth_bytes_per_s, link.latency_s)
        by_key.setdefault(key, []).append(d)
    types = [k[0] for k in by_key]
    out = []
    for key in sorted(by_key, key=lambda k: tuple(str(x) for x in k)):
        devs = sorted(by_key[key], key=lambda d: (d.node, d.local_rank))
        name = str(key[0])
        if types.count(key[0]) > 1:
            name = f"{key[0]}@{min(d.group for d in devs)}"
        out.append(DeviceClass(name, str(key[0]), tuple(d.rank for d in devs), key[2]))
    return tuple(out)


def assign_ranks(classes: Sequence[DeviceClass], shapes: Sequence[tuple[int, int, int]]
                 ) -> list[tuple[int, ...]]:
    """Ranks of each stage ``(class index, dp, tp)`` in pipeline order: taken from the
    class's packed list in stage order, so each TP group of ``tp`` dividing the per-node
    count lies inside a node; listed tp innermost."""
    taken = [0] * len(classes)
    out = []
    for c, dp, tp in shapes:
        start = taken[c]
        out.append(classes[c].ranks[start:start + dp * tp])
        taken[c] += dp * tp
    return out


# -- the pieces of a stage's cost ----------------------------------------------------------
def _layer_arrays(workload: WorkloadSummary, costs: CostModel, dev: Device, tp: int,
                  mb: int, link: Literal["intra", "inter"], mode: str) -> tuple[np.ndarray, np.ndarray]:
    """Per layer, forward and backward seconds of one replica of ``mb`` samples at ``tp``
    with recomputation ``mode``, TP all-reduces on ``link`` included (as stage_times)."""
    times = costs.compute.layer_times(workload, dev, mb, tp=tp, sp=tp > 1)
    prec = state_precision(costs.precision, dev.type, (dev.type,), capture_bytes(workload))
    scale = mb / workload.batch_size
    f = np.zeros(len(times))
    b = np.zeros(len(times))
    for k, (lay, t) in enumerate(zip(workload.layers, times)):
        lf, lb = t.fwd_s, t.bwd_s
        if not t.per_rank:
            div = costs.compute.tp_divisor(lay, tp)
            lf, lb = lf / div, lb / div
        comm = 0.0
        if tp > 1 and lay.tp_pairs:
            comm = lay.tp_pairs * costs.comm.time_s(
                "allreduce", lay.act_out_bytes * scale * prec.act_scale, tp, link)
        f[k] = lf + comm
        # full recomputation runs the forward's all-reduces again (stage_times)
        again = comm if mode == "full" and lay.kind == "block" else 0.0
        b[k] = lb + recompute_s(lay, lf, mode, t.core_fwd_s) + comm + again
    return f, b


def reshard_s(workload: WorkloadSummary, costs: CostModel, boundary: int, dev: Device,
              dp: int, tp: int, mb: int, receivers_per_node: int, cross_node: bool) -> float:
    """One direction of the resharding into a stage whose first layer is ``boundary``: each
    of its ranks receives ``1/tp`` of its replica's ``mb / dp`` samples of the activation
    (``receivers_per_node`` ranks share a node's network across nodes) and, with ``tp > 1``,
    all-gathers the rest inside the node."""
    if boundary == 0:
        return 0.0
    prec = state_precision(costs.precision, dev.type, (dev.type,), capture_bytes(workload))
    per_replica = workload.layers[boundary - 1].boundary_bytes * (mb / dp) / workload.batch_size
    per_replica *= prec.act_scale
    piece = per_replica / tp
    link: Literal["intra", "inter"] = "inter" if cross_node else "intra"
    if cross_node:
        t = costs.comm.time_s("p2p", piece * receivers_per_node, 2, link)
    else:
        t = costs.comm.time_s("p2p", piece, 2, link)
    if tp > 1:
        t += costs.comm.time_s("allgather", per_replica, tp, "intra")
    return t


def sync_s(costs: CostModel, grad_bytes: float, dp: int, tp: int, cross_node: bool,
           zero_stage: int) -> float:
    """A stage's gradient sync on its own data-parallel group of ``dp`` ranks (one per TP
    rank: ``tp`` groups cross a node's network at once): an all-reduce, or with ZeRO-1 a
    reduce-scatter plus an all-gather of the updated weights (the same bytes in a ring)."""
    if dp == 1 or grad_bytes <= 0:
        return 0.0
    link: Literal["intra", "inter"] = "inter" if cross_node else "intra"
    nbytes = grad_bytes * (tp if cross_node else 1)
    if zero_stage:
        return (costs.comm.time_s("reduce_scatter", nbytes, dp, link)
                + costs.comm.time_s("allgather", nbytes, dp, link))
    return costs.comm.time_s("allreduce", nbytes, dp, link)


def _step_bytes(prec: StatePrecision, optimizer: str) -> float:
    """Bytes the optimizer step moves per parameter element (as ``evaluate``)."""
    fp32 = prec.master_bytes or prec.weight_bytes
    out = 2 * fp32 + prec.grad_bytes + 2 * MOMENT_BYTES[optimizer]
    return out + (prec.weight_bytes if prec.master_bytes else 0)


def _rank_param_bytes(layers: Sequence[LayerCost], tp: int) -> np.ndarray:
    """Per layer, the parameter bytes (capture dtype) one TP rank holds of ``layers`` (the
    cost model's :meth:`~hetplan.cost_models.costs.CostModel.memory_layers`: a
    vocabulary-parallel embedding split too, as ``stage_times.shard_bytes`` counts it)."""
    out = np.zeros(len(layers))
    for k, lay in enumerate(layers):
        split = min(lay.tp_split_bytes, lay.param_bytes) if tp > 1 else 0
        out[k] = lay.param_bytes - split + split / tp
    return out


# -- 2. the search tables ------------------------------------------------------------------
#: Device-use vectors the exact DP tracks at most (product over classes of count/unit + 1):
#: 32 mixed GPUs (17 x 17 = 289) stay at unit 1; 512 of three types are coarsened.
STATE_BUDGET = 400


def coarse_units(classes: Sequence[DeviceClass], budget: int = STATE_BUDGET) -> tuple[int, ...]:
    """Per class, the device multiple every stage uses so that the DP's device-use vectors
    number at most ``budget``: all 1 where that already holds; otherwise the class with the
    most values steps to whole nodes, then doubles, until the product fits."""
    units = [1] * len(classes)

    def size() -> int:
        out = 1
        for cls, u in zip(classes, units):
            out *= cls.count // u + 1
        return out

    while size() > budget:
        c = max(range(len(classes)), key=lambda k: (classes[k].count // units[k], -k))
        if classes[c].count // units[c] <= 1:
            break
        nxt = classes[c].per_node if units[c] < classes[c].per_node else 2 * units[c]
        if nxt > classes[c].count:
            break
        units[c] = nxt
    return tuple(units)

@dataclass(frozen=True)
class OptionInfo:
    """What an option of the problem is, for turning a solution into a plan."""

    device_class: int
    dp: int
    tp: int
    zero_stage: int


def build_problem(workload: WorkloadSummary, costs: CostModel, classes: Sequence[DeviceClass],
                  micro_batch: int, micro_batches: int, *, max_tp: int = 8,
                  tp_pinned: int | None = None, units: Sequence[int] | None = None
                  ) -> tuple[HeteroProblem, list[OptionInfo]]:
    """The search problem for global micro-batch ``micro_batch`` x ``micro_batches``: every
    option (class, dp dividing the micro-batch, tp dividing the class's per-node count) and
    its ``a``/``v``/``q`` tables under each recomputation mode. ZeRO-1 inside a stage's
    data-parallel group whenever ``dp > 1`` (it only divides memory; the ring moves the same
    bytes). ``units[c]``: only stages whose ``dp x tp`` is a multiple of it (a coarser space
    for large clusters, :func:`coarse_units`). Stages start only where the workload's
    layers are ``cuttable_before``. Complexity: O(options x modes x L^2)."""
    L, m = len(workload.layers), micro_batches
    has_pairs = any(x.tp_pairs for x in workload.layers)
    options: list[StageOption] = []
    infos: list[OptionInfo] = []
    for c, cls in enumerate(classes):
        dev = costs.devices[cls.ranks[0]]
        nodes = max(1, cls.count // max(cls.per_node, 1))
        for tp in TP_DEGREES:
            if tp > max_tp or cls.per_node % tp or (tp > 1 and not has_pairs):
                continue
            if tp_pinned is not None and tp != tp_pinned:
                continue
            for dp in range(1, cls.count // tp + 1):
                if micro_batch % dp or dp * tp > cls.count:
                    continue
                if units is not None and (dp * tp) % units[c]:
                    continue
                cross = dp * tp > cls.per_node and nodes > 1
                opt = _option(workload, costs, dev, c, dp, tp, micro_batch // dp, m, cross,
                              min(dp * tp, cls.per_node))
                options.append(opt)
                infos.append(OptionInfo(c, dp, tp, 1 if dp > 1 else 0))
    units = tuple(math.gcd(*[o.devices for o in options if o.device_class == c] or [1])
                  for c in range(len(classes)))
    capacity = tuple(cls.count - cls.count % u for cls, u in zip(classes, units))
    problem = HeteroProblem(L, tuple(options), capacity, m, MODES, units,
                            tuple(x.cuttable_before for x in workload.layers))
    return problem, infos


def _option(workload: WorkloadSummary, costs: CostModel, dev: Device, c: int, dp: int,
            tp: int, mb: int, m: int, cross: bool, receivers_per_node: int) -> StageOption:
    """One option's tables; every range is priced from per-layer prefix sums (memory is
    additive over layers but for the largest recomputation transient, a running max)."""
    L = len(workload.layers)
    zero = 1 if dp > 1 else 0
    prec = state_precision(costs.precision, dev.type, (dev.type,), capture_bytes(workload))
    pbytes = np.concatenate([[0.0], np.cumsum(_rank_param_bytes(costs.memory_layers(workload),
                                                                tp))])
    elems = pbytes / prec.capture_bytes
    step_per_elem = _step_bytes(prec, costs.optimizer) / (dp if zero else 1)
    # a stage boundary crosses nodes, but one node has no inter-node link to cross
    between_nodes = costs.comm.cluster.inter_node is not None
    reshard = [2 * reshard_s(workload, costs, i, dev, dp, tp, mb * dp, receivers_per_node,
                             between_nodes) for i in range(L + 1)]
    cap = dev.memory_bytes * USABLE_FRACTION
    scale = mb / workload.batch_size
    mem_layers = costs.memory_layers(workload)
    state = np.concatenate([[0.0], np.cumsum([
        sum(model_state([lay], tp=tp, dp=dp, zero_stage=zero, optimizer=costs.optimizer,
                        precision=prec)) for lay in mem_layers])])
    # a range that ends the model computes the loss and may hold the tied head's copy
    ends = np.arange(L + 1) == L
    held, loss_transient, copy_state, table = _last_stage_extras(mem_layers, costs, tp, dp,
                                                                 zero, prec, scale)
    overlap = costs.dp_overlap == "backward"
    bufs = np.array([(workload.layers[i - 1].boundary_bytes * scale * prec.act_scale) if i
                     else 0.0 for i in range(L + 1)])
    a_modes, v_modes, q_modes = [], [], []
    work = None
    for mode in MODES:
        f, b = _layer_arrays(workload, costs, dev, tp, mb, "intra", mode)
        fb = np.concatenate([[0.0], np.cumsum(f + b)])
        if work is None:  # the first mode (no recomputation) is the cheapest
            work = (m - 1) * (f + b)
        bb = np.concatenate([[0.0], np.cumsum(b)])
        kw = dict(tp=tp, sequence_parallel=tp > 1, precision=prec, micro_batch_scale=scale)
        acts = np.concatenate([[0.0], np.cumsum(
            [layer_activations(lay, mode, **kw) for lay in mem_layers])])  # type: ignore[arg-type]
        trans = [recompute_transient(lay, mode, **kw) for lay in mem_layers]  # type: ignore[arg-type]
        a = np.full((L + 1, L + 1), np.inf)
        v = np.full((L + 1, L + 1), np.inf)
        q = np.full((L + 1, L + 1), -1.0)
        ii, jj = np.triu_indices(L + 1, k=1)
        t = fb[jj] - fb[ii]
        sync = _sync_vec(costs, (elems[jj] - elems[ii]) * prec.grad_bytes, dp, tp, cross,
                         zero)
        exposed = np.maximum(sync - (bb[jj] - bb[ii]), 0.0) if overlap else sync
        step = step_per_elem * (elems[jj] - elems[ii]) / dev.mem_bandwidth_bytes_per_s
        a[ii, jj] = t + np.asarray(reshard)[ii]
        v[ii, jj] = (m - 1) * t + exposed + step
        # the largest recomputation transient over [i, j): a running max along j
        peak = np.zeros((L + 1, L + 1))
        tr = np.asarray(trans)
        for i in range(L):
            peak[i, i + 1:] = np.maximum.accumulate(tr[i:])
        last = ends[jj]
        q[ii, jj] = _in_flight_vec(
            state[jj] - state[ii] + np.where(last & (ii > table), copy_state, 0.0),
            acts[jj] - acts[ii] + np.where(last, held, 0.0),
            np.maximum(peak[ii, jj], np.where(last, loss_transient, 0.0)), bufs[ii], cap, m)
        a_modes.append(a)
        v_modes.append(v)
        q_modes.append(q)
    return StageOption(c, dp, tp, tuple(a_modes), tuple(v_modes), tuple(q_modes), work)


def _last_stage_extras(layers: tuple[LayerCost, ...], costs: CostModel, tp: int, dp: int,
                       zero: int, prec: StatePrecision, scale: float
                       ) -> tuple[float, float, float, int]:
    """What a stage ending the model holds beside its layers, as the homogeneous memory
    model counts it (:func:`~hetplan.cost_models.rank_memory.rank_memory`): the loss's held
    and transient bytes per micro-batch, the model state of the LM head's copy of a tied
    embedding, and that embedding's layer index (the copy is held by a stage starting after
    it; ``L`` when there is no copy)."""
    vocab_tp = tp if costs.vocab_parallel else 1
    held, transient = loss_activations(layers[-1], prec.capture_bytes,
                                       micro_batch_scale=scale, vocab_tp=vocab_tp)
    tied = tied_head_copy(layers, prec.capture_bytes, vocab_tp > 1)
    if tied is None:
        return held, transient, 0.0, len(layers)
    copy = sum(model_state([tied[1]], tp=tp, dp=dp, zero_stage=zero,
                           optimizer=costs.optimizer, precision=prec))
    return held, transient, copy, tied[0]


def _sync_vec(costs: CostModel, grad_bytes: np.ndarray, dp: int, tp: int, cross_node: bool,
              zero_stage: int) -> np.ndarray:
    """:func:`sync_s` over an array of gradient byte counts (the collectives are lines)."""
    if dp == 1:
        return np.zeros_like(grad_bytes)
    link: Literal["intra", "inter"] = "inter" if cross_node else "intra"
    nbytes = grad_bytes * (tp if cross_node else 1)
    kinds = ("reduce_scatter", "allgather") if zero_stage else ("allreduce",)
    out = np.zeros_like(grad_bytes)
    for kind in kinds:
        line = costs.comm.alpha_beta(kind, dp, link)
        out += line.alpha_s + line.beta_s_per_byte * nbytes
    return np.where(grad_bytes > 0, out, 0.0)


def _in_flight_vec(state: np.ndarray, acts: np.ndarray, transient: np.ndarray,
                   buf: np.ndarray, cap: float, m: int) -> np.ndarray:
    """Per layer range, the most micro-batches of activations (``acts`` bytes each) a rank
    holds within ``cap`` beside its model state, the recomputation transient and the
    resharding buffer, allocator margin included (as
    :func:`~hetplan.cost_models.memory.breakdown`), capped at ``m``; -1 where one does not
    fit."""
    k = 1.0 + ALLOCATOR_MARGIN
    room = cap - state - k * (transient + buf)
    with np.errstate(divide="ignore", invalid="ignore"):
        fit = np.minimum(m, np.floor(room / (k * np.where(acts > 0, acts, 1.0))))
    out = np.where(acts > 0, fit, float(m))
    return np.where(room < k * acts, -1.0, out)


# -- 3. prediction of a plan with per-stage degrees ------------------------------------------
@dataclass(frozen=True)
class HeteroEvaluation:
    """The predicted iteration of a heterogeneous pipeline (seconds).

    ``memory`` has one entry per rank of the cluster (zero for ranks no stage uses).
    ``stages`` and ``dp_timelines`` are per stage, as
    :class:`~hetplan.cost_models.evaluate.Evaluation`'s (the timeline and ``inspect --trace``
    read either): a stage whose sync runs on the DP timeline (a gradient-sync section,
    ``dp > 1``) has its :func:`stage_projection`'s cost and timeline, whose backward is the
    one the timeline spans; the others their :func:`stage_times` and the closed-form sync of
    :func:`sync_s`, and no timeline. The timelines hold their events with ``record``."""

    iteration_s: float
    compute_s: float
    bubble_s: float
    exposed_comm_s: float
    comm_s: float
    optimizer_s: float
    bubble_ratio: float
    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]
    reshard_s: tuple[float, ...]
    sync_s: tuple[float, ...]
    memory: tuple[MemoryBreakdown, ...]
    pipeline: PipelineSimResult
    #: the largest stage's (de)compression seconds (0 without a gradient-sync section)
    compression_s: float = 0.0
    stages: tuple[StageCost, ...] = ()
    dp_timelines: tuple[DPTimeline | None, ...] = ()


@dataclass(frozen=True)
class StageProjection:
    """One stage of a heterogeneous pipeline as a homogeneous data-parallel plan of its own
    (see the module docstring): ``workload`` holds only the stage's layers (re-indexed from
    0) and gradients (their names kept), ``stage`` is its only stage on the real ranks,
    ``layout`` its ``dp x tp`` with its ZeRO stage and per-replica micro-batch."""

    workload: WorkloadSummary
    layout: Layout
    stage: Stage


def stage_projection(workload: WorkloadSummary, layout: Layout, st: Stage,
                     shape: StageShape) -> StageProjection:
    """The :class:`StageProjection` of stage ``st`` (degrees ``shape``) of a pipeline with
    ``layout`` (its micro-batch count). Complexity O(layers + gradients)."""
    first, last = st.first_layer, st.last_layer
    layers = workload.layers[first:last + 1]
    grads = tuple(g.model_copy(update={"layer_index": g.layer_index - first})
                  for g in workload.grads if first <= g.layer_index <= last)
    sub = workload.model_copy(update={"layers": layers, "grads": grads})
    sub_layout = Layout(dp=shape.dp, pp=1, tp=shape.tp, micro_batches=layout.micro_batches,
                        micro_batch_size=shape.micro_batch_size, schedule="1f1b",
                        sequence_parallel=shape.tp > 1, zero_stage=shape.zero_stage)
    stage = Stage(index=0, first_layer=0, last_layer=len(layers) - 1,
                  layer_names=tuple(x.name for x in layers), ranks=st.ranks,
                  recompute=st.recompute)
    return StageProjection(sub, sub_layout, stage)


def stage_sync_section(sync: GradientSync, names: Sequence[str]) -> GradientSync:
    """The part of a plan's gradient-sync section that names the tensors ``names`` (one
    stage's gradients): their per-tensor entries, the buckets of them and the strategies
    those use. A bucket holds one stage's tensors only (rule 6 of
    :mod:`hetplan.ir.plan_checks`)."""
    mine = set(names)
    tensors = tuple(t for t in sync.tensors if t.name in mine)
    buckets = tuple(b for b in sync.buckets if b.tensors[0] in mine)
    used = {t.strategy for t in tensors} | {b.strategy for b in buckets}
    return GradientSync(strategies={k: v for k, v in sync.strategies.items() if k in used},
                        tensors=tensors, buckets=buckets)


def stage_sync_exposed_s(workload: WorkloadSummary, layout: Layout, st: Stage,
                         shape: StageShape, sync: GradientSync, costs: CostModel
                         ) -> tuple[float, float, float]:
    """(communication busy, exposed sync, compression) seconds of stage ``st``'s gradient
    sync: :func:`~hetplan.cost_models.evaluate.evaluate`'s DP timeline over the stage's
    last backward, on its :func:`stage_projection`, with its part of ``sync``."""
    cost = _stage_sync(workload, layout, st, shape, sync, costs).stages[0]
    return cost.sync_busy_s, max(cost.exposed_sync_s, 0.0), cost.compression_s


def _stage_sync(workload: WorkloadSummary, layout: Layout, st: Stage, shape: StageShape,
                sync: GradientSync, costs: CostModel, record: bool = False) -> Evaluation:
    """The evaluation of stage ``st``'s :func:`stage_projection` with its part of ``sync``
    (its DP timeline's events with ``record``, which changes no number)."""
    proj = stage_projection(workload, layout, st, shape)
    part = stage_sync_section(sync, [g.name for g in proj.workload.grads])
    return evaluate(proj.workload, proj.layout, (proj.stage,), part, costs,
                    check_memory=False, record=record)


def stage_layout(layout: Layout, shape_dp: int, shape_tp: int, mb: int, zero: int) -> Layout:
    """The layout one stage of a heterogeneous pipeline runs: its own dp x tp and per-replica
    micro-batch, the pipeline's depth and micro-batch count."""
    return Layout(dp=shape_dp, pp=layout.pp, tp=shape_tp, micro_batches=layout.micro_batches,
                  micro_batch_size=mb, schedule=layout.schedule,
                  sequence_parallel=shape_tp > 1, zero_stage=zero)  # type: ignore[arg-type]


def evaluate_hetero(workload: WorkloadSummary, layout: Layout, stages: Sequence[Stage],
                    hetero: Hetero, costs: CostModel, *, check_memory: bool = True,
                    gradient_sync: GradientSync | None = None,
                    actions: PipelineActions | None = None,
                    record: bool = False) -> HeteroEvaluation:
    """Predict one iteration of a plan with a ``hetero`` section (see the module docstring).

    ``gradient_sync``: the plan's gradient-sync section; each stage with ``dp > 1`` then
    syncs its tensors' buckets and strategies on the DP timeline over its own group
    (:func:`stage_sync_exposed_s`); None prices every stage's sync with :func:`sync_s`.

    ``actions``: the plan's ``pipeline_actions``, which the heterogeneous executor runs
    position by position: where they differ from the generated lists (a plan edited by
    hand), the pipeline is replayed over them and every rank's activations peak where its
    own list holds the most micro-batches, as :func:`~hetplan.cost_models.evaluate.evaluate`
    does (:func:`~hetplan.cost_models.evaluate.edited_lists`: lists of another pipeline
    shape than ``layout``'s, as a rebuilt alternative may be handed, are not replayed).
    Each pipeline position is one stage, so the replay is the homogeneous one with each
    stage's own times and resharding links. Unedited lists predict to the bit what the
    generated ones do (the search passes none).

    ``record``: keep every event of each stage's DP timeline (for ``hetplan timeline``); the
    pipeline's events are always kept. It changes no number.

    Raises:
        InfeasiblePlanError: a rank runs out of memory (with ``check_memory``), naming it
            and its breakdown.
    """
    from hetplan.cost_models.memory import check_fits

    P, m = len(stages), layout.micro_batches
    fwd, bwd, tp_comm, sources = [], [], [], []
    for st, shape in zip(stages, hetero.stages):
        sub = stage_layout(layout, shape.dp, shape.tp, shape.micro_batch_size, shape.zero_stage)
        f, b, c, _, src = stage_times(workload, st, sub, costs, shape.micro_batch_size,
                                      shape.micro_batch_size / workload.batch_size)
        fwd.append(f)
        bwd.append(b)
        tp_comm.append(c)
        sources.append(src)
    links = [_link_reshard(workload, costs, stages[k], stages[k + 1], hetero.stages[k + 1])
             for k in range(P - 1)]
    edited = edited_lists(layout, actions)
    link_ms = [x * 1e3 for x in links] or 0
    if edited is not None:  # the plan's own lists, as the executor runs them
        pipe = simulate_schedule(edited, [x * 1e3 for x in fwd], [x * 1e3 for x in bwd],
                                 p2p_fwd_ms=link_ms, p2p_bwd_ms=link_ms)
    else:
        pipe = simulate_pipeline([x * 1e3 for x in fwd], [x * 1e3 for x in bwd], m,
                                 _schedule_name(layout), p2p_fwd_ms=link_ms, p2p_bwd_ms=link_ms)
    ends = [0.0] * P
    for ev in pipe.events:
        if ev.kind.value == "B":
            ends[ev.rank] = max(ends[ev.rank], ev.end_ms * 1e-3)
    syncs, exposed, steps = [], [], []
    costs_of: list[StageCost] = []
    timelines: list[DPTimeline | None] = []
    compression = 0.0
    for k, (st, shape, b) in enumerate(zip(stages, hetero.stages, bwd)):
        dev = costs.devices[st.ranks[0]]
        prec = state_precision(costs.precision, dev.type, (dev.type,), capture_bytes(workload))
        per_layer = _rank_param_bytes(costs.memory_layers(workload), shape.tp)
        elems = float(per_layer[st.first_layer:st.last_layer + 1].sum()) / prec.capture_bytes
        dp_group = list(st.ranks[::shape.tp])
        cross = len({costs.devices[r].node_index for r in dp_group}) > 1
        if gradient_sync is not None and shape.dp > 1:
            proj = _stage_sync(workload, layout, st, shape, gradient_sync, costs, record)
            cost = proj.stages[0]
            compression = max(compression, cost.compression_s)
            syncs.append(cost.sync_busy_s)
            exposed.append(max(cost.exposed_sync_s, 0.0))
            costs_of.append(cost)
            timelines.append(proj.dp_timelines[0])
            steps.append(proj.optimizer_s)
        else:
            s = sync_s(costs, elems * prec.grad_bytes, shape.dp, shape.tp, cross,
                       shape.zero_stage)
            syncs.append(s)
            exposed.append(max(s - b, 0.0) if costs.dp_overlap == "backward" else s)
            costs_of.append(StageCost(fwd[k], b, tp_comm[k], exposed[-1], s, 0.0, sources[k]))
            timelines.append(None)
            part = stage_projection(workload, layout, st, shape)
            steps.append(optimizer_step_s(part.workload, (part.stage,), part.layout, costs))
    optimizer = max(steps)
    iteration = max(e + x for e, x in zip(ends, exposed)) + optimizer
    memory = _memory(workload, layout, stages, hetero, costs, edited)
    if check_memory:
        check_fits(list(memory), [d.memory_bytes for d in costs.devices],
                   what=f"heterogeneous pipeline {hetero.describe()} micro-batch "
                   f"{layout.micro_batch_size}x{m}")
    compute = max((f + b) * m for f, b in zip(fwd, bwd))
    return HeteroEvaluation(
        iteration_s=iteration, compute_s=compute,
        bubble_s=max(pipe.iteration_ms * 1e-3 - compute, 0.0),
        exposed_comm_s=max(exposed), comm_s=max(syncs) + sum(links) * 2,
        optimizer_s=optimizer, bubble_ratio=pipe.bubble_ratio, fwd_s=tuple(fwd),
        bwd_s=tuple(bwd), reshard_s=(0.0, *links), sync_s=tuple(syncs), memory=memory,
        pipeline=pipe, compression_s=compression, stages=tuple(costs_of),
        dp_timelines=tuple(timelines))


def hetero_predictions(ev: HeteroEvaluation, baselines: Sequence[Baseline] = ()
                       ) -> Predictions:
    """The plan's ``predictions`` section of a :func:`evaluate_hetero` result (milliseconds),
    for ``compile_hetero`` and ``simulate`` alike."""
    return Predictions(
        iteration_time_ms=ev.iteration_s * 1e3,
        breakdown=TimeBreakdown(compute_ms=ev.compute_s * 1e3, comm_ms=ev.comm_s * 1e3,
                                exposed_comm_ms=ev.exposed_comm_s * 1e3,
                                compression_ms=ev.compression_s * 1e3,
                                bubble_ms=ev.bubble_s * 1e3,
                                optimizer_ms=ev.optimizer_s * 1e3),
        memory_per_rank_bytes=tuple(m.total for m in ev.memory),
        memory_breakdown=tuple(RankMemory(params=m.params, grads=m.grads,
                                          optimizer=m.optimizer, activations=m.activations,
                                          buffers=m.buffers, margin=m.margin)
                               for m in ev.memory),
        bubble_ratio=min(max(ev.bubble_ratio, 0.0), 1.0), baselines=tuple(baselines))


def _schedule_name(layout: Layout) -> str:
    """The schedule whose generated lists the heterogeneous executor runs: GPipe's for a
    plan that names it, else 1F1B's (what the search plans; the runtime refuses the
    others with per-stage degrees)."""
    return "gpipe" if layout.schedule == "gpipe" else "1f1b"


def _link_reshard(workload: WorkloadSummary, costs: CostModel, sender: Stage, receiver: Stage,
                  shape: object) -> float:
    """Forward resharding time into ``receiver`` (its ``shape``: a StageShape)."""
    dp, tp, mb = shape.dp, shape.tp, shape.micro_batch_size  # type: ignore[attr-defined]
    nodes_s = {costs.devices[r].node_index for r in sender.ranks}
    per_node: dict[int, int] = {}
    for r in receiver.ranks:
        n = costs.devices[r].node_index
        per_node[n] = per_node.get(n, 0) + 1
    cross = len(nodes_s | set(per_node)) > 1
    dev = costs.devices[receiver.ranks[0]]
    return reshard_s(workload, costs, receiver.first_layer, dev, dp, tp, mb * dp,
                     max(per_node.values()), cross)


def _memory(workload: WorkloadSummary, layout: Layout, stages: Sequence[Stage], hetero: Hetero,
            costs: CostModel, edited: PipelineSchedule | None = None
            ) -> tuple[MemoryBreakdown, ...]:
    """Every rank's peak: its stage's model state (ZeRO inside the stage's own DP group),
    activations at the peak of its action list (``edited``, the plan's own lists where not
    the generated ones, else its schedule's), the recomputation transient and the resharding
    buffer of the stage's input."""
    P, m = len(stages), layout.micro_batches
    sched = (edited if edited is not None
             else schedule_of(_schedule_name(layout), P, m) if P > 1 else None)
    out = [MemoryBreakdown(0, 0, 0, 0)] * len(costs.devices)
    for k, (st, shape) in enumerate(zip(stages, hetero.stages)):
        dev = costs.devices[st.ranks[0]]
        prec = state_precision(costs.precision, dev.type, (dev.type,), capture_bytes(workload))
        scale = shape.micro_batch_size / workload.batch_size
        in_flight = 1.0 if sched is None else peak_in_flight(sched, k, [1.0] * P)
        buf = (workload.layers[st.first_layer - 1].boundary_bytes * scale * prec.act_scale
               if st.first_layer else 0.0)
        layers = costs.memory_layers(workload)
        last = st.last_layer == len(layers) - 1
        mem = stage_memory(layers[st.first_layer:st.last_layer + 1], tp=shape.tp,
                           micro_batch_scale=scale, in_flight=in_flight,
                           optimizer=costs.optimizer, buffers=int(buf), precision=prec,
                           dp=shape.dp, zero_stage=shape.zero_stage,
                           sequence_parallel=shape.tp > 1, recompute=st.recompute,
                           last=last, vocab_tp=shape.tp if costs.vocab_parallel else 1)
        tied = tied_head_copy(layers, prec.capture_bytes,
                              costs.vocab_parallel and shape.tp > 1) if last else None
        if tied is not None and st.first_layer > tied[0]:  # the head's copy of the table
            w, g, o = model_state([tied[1]], tp=shape.tp, dp=shape.dp,
                                  zero_stage=shape.zero_stage, optimizer=costs.optimizer,
                                  precision=prec)
            mem = replace(mem, params=mem.params + int(w), grads=mem.grads + int(g),
                          optimizer=mem.optimizer + int(o))
        for r in st.ranks:
            out[r] = mem
    return tuple(out)
