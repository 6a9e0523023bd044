"""Predict one iteration of a plan: the single objective of layout search and every pass.

:func:`evaluate` turns (workload, layout, stages, tensor-parallel and gradient-sync sections)
into an iteration time, a breakdown, the memory of every rank and the pipeline bubble:

1. **Stage times.** For every pipeline stage, each layer's forward and backward time for one
   micro-batch on every distinct device of the stage (:class:`ComputeModel`); a synchronous
   stage runs at its slowest device. Layers with Megatron pairs are split ``tp`` ways and add
   one all-reduce of their output per pair in forward and in backward on the TP group's link.
2. **Pipeline.** The schedule is simulated over the stage times with point-to-point
   activation transfers between stages (:func:`simulate_pipeline`), giving each stage's end of
   its last backward.
3. **Gradient sync.** Each stage's data-parallel group syncs that stage's gradients while the
   stage runs its last micro-batch's backward: the DP timeline (:func:`simulate_dp`) over that
   backward, with one sync unit per bucket (or per tensor), gives the time the stage finishes
   after its backward ends (exposed communication, GPU compression delays).
4. **Iteration** ``= max over stages (last backward end + exposed sync) + optimizer step``; the
   optimizer step is memory-bound (Adam reads and writes about 7 bytes per parameter byte).
5. **Memory** per rank (:mod:`hetplan.cost_models.memory`) with the schedule's in-flight
   micro-batches; :class:`~hetplan.errors.InfeasiblePlanError` when a rank does not fit.

Everything here is deterministic and free of torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hetplan.algorithms.dp_timeline import simulate_dp
from hetplan.algorithms.dp_types import CPU, GPU, DPTimeline, Op, SyncUnit
from hetplan.cost_models.compression import CompressionCost, TimeModel, time_array
from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.memory import (
    MemoryBreakdown,
    check_fits,
    in_flight_micro_batches,
    stage_memory,
)
from hetplan.cost_models.pipeline import PipelineSimResult, simulate_pipeline
from hetplan.cost_models.tp_shares import max_layer_shares, rank_layer_shares, stage_compute
from hetplan.errors import SpecError
from hetplan.ir.cluster import Device
from hetplan.ir.plan_sections import (
    CastSync,
    CompressedSync,
    GradientSync,
    Layout,
    NoSync,
    Stage,
    SyncStrategy,
    TensorParallel,
    WorkloadSummary,
)

__all__ = ["Evaluation", "StageCost", "StageSync", "stage_syncs", "evaluate", "rank_devices",
           "OPTIMIZER_BYTES_PER_PARAM_BYTE"]

#: Bytes the optimizer step moves per parameter byte (Adam: read p, g, m, v; write p, m, v).
OPTIMIZER_BYTES_PER_PARAM_BYTE = 7.0


@dataclass(frozen=True)
class StageCost:
    """One stage's per-micro-batch times and what its DP sync adds."""

    fwd_s: float
    bwd_s: float
    tp_comm_s: float
    exposed_sync_s: float
    sync_busy_s: float
    compression_s: float
    layer_sources: dict[str, int]


@dataclass(frozen=True)
class Evaluation:
    """The predicted iteration (seconds; the plan stores milliseconds)."""

    iteration_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    bubble_s: float
    compression_s: float
    optimizer_s: float
    bubble_ratio: float
    memory: tuple[MemoryBreakdown, ...]
    stages: tuple[StageCost, ...]
    pipeline: PipelineSimResult
    dp_timelines: tuple[DPTimeline | None, ...]


def rank_devices(costs: CostModel, stage: Stage) -> list[Device]:
    return [costs.devices[r] for r in stage.ranks]


def _group_link(costs: CostModel, ranks: list[int]) -> tuple[str, int, int]:
    """(link name, nodes spanned, largest members on one node) of a rank group."""
    nodes: dict[int, int] = {}
    for r in ranks:
        n = costs.devices[r].node_index
        nodes[n] = nodes.get(n, 0) + 1
    link = "intra" if len(nodes) == 1 else "inter"
    return link, len(nodes), max(nodes.values())


def evaluate(
    workload: WorkloadSummary,
    layout: Layout,
    stages: tuple[Stage, ...],
    gradient_sync: GradientSync | None,
    costs: CostModel,
    *,
    check_memory: bool = True,
    record: bool = False,
    tensor_parallel: TensorParallel | None = None,
) -> Evaluation:
    """Predict one iteration (see module docstring).

    ``tensor_parallel``: the plan's TP section; with uneven shard sizes or resizing roles
    the stage compute follows :mod:`hetplan.cost_models.tp_shares` (each TP layer at its
    slowest rank's share), else every TP layer is split evenly.

    Raises:
        SpecError: the sections do not fit together (stages missing, unknown tensors).
        InfeasiblePlanError: a rank runs out of memory (with ``check_memory``).
    """
    if not stages:
        stages = (
            Stage(index=0, first_layer=0, last_layer=len(workload.layers) - 1,
                  ranks=tuple(range(layout.num_ranks))),
        )
    if len(stages) != layout.pp:
        raise SpecError(f"layout has pp={layout.pp} but the plan lists {len(stages)} stage(s)")
    mb = layout.micro_batch_size
    scale = mb / workload.batch_size
    stage_of = [0] * len(workload.layers)
    for st in stages:
        for i in range(st.first_layer, st.last_layer + 1):
            stage_of[i] = st.index

    fwd, bwd, tp_comm, bwd_layers, sources = [], [], [], [], []
    for st in stages:
        f, b, c, per_layer, src = _stage_times(workload, st, layout, costs, mb, scale,
                                               tensor_parallel)
        fwd.append(f)
        bwd.append(b)
        tp_comm.append(c)
        bwd_layers.append(per_layer)
        sources.append(src)

    p2p = []
    for s in range(len(stages) - 1):
        nbytes = workload.layers[stages[s].last_layer].act_out_bytes * scale / layout.tp
        a, b = stages[s].ranks[0], stages[s + 1].ranks[0]
        link = costs.cluster.link_between(a, b)
        p2p.append(costs.comm.time_s("p2p", nbytes, 2, link) * 1e3)
    if layout.schedule == "interleaved-1f1b" and p2p:
        # chunk v of the last rank feeds chunk v+1 of the first: the wrap-around link
        nbytes = workload.layers[stages[-1].last_layer].act_out_bytes * scale / layout.tp
        link = costs.cluster.link_between(stages[-1].ranks[0], stages[0].ranks[0])
        p2p.append(costs.comm.time_s("p2p", nbytes, 2, link) * 1e3)
    key = (tuple(fwd), tuple(bwd), layout.micro_batches, layout.schedule,
           layout.virtual_stages, tuple(p2p))
    cached = costs.pipeline_cache.get(key)
    if cached is None:
        pipe = simulate_pipeline(
            [x * 1e3 for x in fwd],
            [x * 1e3 for x in bwd],
            layout.micro_batches,
            layout.schedule,
            virtual_stages=layout.virtual_stages,
            p2p_fwd_ms=p2p or 0,
            p2p_bwd_ms=p2p or 0,
        )
        ends = [0.0] * len(stages)
        for ev in pipe.events:
            if ev.kind.value == "B":
                ends[ev.rank] = max(ends[ev.rank], ev.end_ms * 1e-3)
        cached = costs.pipeline_cache[key] = (pipe, tuple(ends))
    pipe, last_bwd_end = cached

    strategies = _units_by_stage(workload, gradient_sync, stage_of, len(stages))
    stage_costs, timelines = [], []
    comm_busy = compression = 0.0
    finish = []
    for s, st in enumerate(stages):
        tl = None
        exposed = busy = comp = 0.0
        if layout.dp > 1 and strategies[s]:
            tl = _sync_stage(workload, st, layout, costs, strategies[s], bwd_layers[s], record,
                             max_layer_shares(workload, st, layout.tp, tensor_parallel))
            exposed = tl.iteration_s - bwd[s]
            busy = sum(v for k, v in tl.busy_s.items() if k not in (GPU, CPU))
            comp = tl.busy_s.get(GPU, 0.0) - sum(bwd_layers[s]) + tl.busy_s.get(CPU, 0.0)
        stage_costs.append(StageCost(fwd[s], bwd[s], tp_comm[s], exposed, busy, comp, sources[s]))
        timelines.append(tl)
        comm_busy = max(comm_busy, busy)
        compression = max(compression, comp)
        finish.append(last_bwd_end[s] + max(exposed, 0.0))

    optimizer_s = _optimizer_s(workload, stages, layout, costs, tensor_parallel)
    iteration = max(finish) + optimizer_s
    compute = max((f + b) * layout.micro_batches for f, b in zip(fwd, bwd))
    memory = _memory(workload, stages, layout, costs, scale, tensor_parallel)
    if check_memory:
        check_fits(
            list(memory),
            [d.memory_bytes for d in costs.devices[: len(memory)]],
            what=f"layout dp={layout.dp} pp={layout.pp} tp={layout.tp} "
            f"micro-batch {layout.micro_batch_size}",
        )
    return Evaluation(
        iteration_s=iteration,
        compute_s=compute,
        comm_s=comm_busy + max(c * layout.micro_batches for c in tp_comm),
        exposed_comm_s=max(max(f - e, 0.0) for f, e in zip(finish, last_bwd_end)),
        bubble_s=max(pipe.iteration_ms * 1e-3 - compute, 0.0),
        compression_s=compression,
        optimizer_s=optimizer_s,
        bubble_ratio=pipe.bubble_ratio,
        memory=memory,
        stages=tuple(stage_costs),
        pipeline=pipe,
        dp_timelines=tuple(timelines),
    )


def _stage_times(
    workload: WorkloadSummary,
    st: Stage,
    layout: Layout,
    costs: CostModel,
    mb: int,
    scale: float,
    tp_section: TensorParallel | None = None,
) -> tuple[float, float, float, list[float], dict[str, int]]:
    """Per-micro-batch forward, backward and TP-communication time of a stage, at the speed
    of its slowest device (or, with uneven TP shards, of each layer's slowest rank), and each
    layer's backward time (for the DP timeline)."""
    devices = {(d.type, d.slowdown): d for d in rank_devices(costs, st)}
    tp = layout.tp
    if tp > 1:
        tp_ranks = list(st.ranks[:tp])
        link, _, _ = _group_link(costs, tp_ranks)
    best: tuple[float, float, list[float]] | None = None
    sources: dict[str, int] = {}
    layers = workload.layers[st.first_layer : st.last_layer + 1]
    tp_comm = 0.0
    for dev in devices.values():
        times = costs.compute.layer_times(workload, dev, mb)[st.first_layer : st.last_layer + 1]
        f = b = 0.0
        per_layer = []
        for lay, t in zip(layers, times):
            lf, lb = t.fwd_s, t.bwd_s
            if tp > 1 and lay.tp_pairs:
                lf, lb = lf / tp, lb / tp
            f += lf
            b += lb
            per_layer.append(lb)
            sources[t.source] = sources.get(t.source, 0) + 1
        if best is None or f + b > best[0] + best[1]:
            best = (f, b, per_layer)
    assert best is not None
    # the cost sources stay those counted above (every device of the stage)
    best = stage_compute(workload, st, tp, costs, mb, tp_section) or best
    if tp > 1:
        for lay in layers:
            if lay.tp_pairs:
                nbytes = lay.act_out_bytes * scale
                tp_comm += lay.tp_pairs * costs.comm.time_s("allreduce", nbytes, tp, link)
    # TP all-reduces happen in forward and again in backward
    per_layer = list(best[2])
    if per_layer and tp_comm:
        per_layer[-1] += tp_comm
    return best[0] + tp_comm, best[1] + tp_comm, tp_comm, per_layer, sources


def _units_by_stage(
    workload: WorkloadSummary,
    sync: GradientSync | None,
    stage_of: list[int],
    num_stages: int,
) -> list[list[tuple[list[int], SyncStrategy]]]:
    """Per stage: (gradient indices, strategy) per sync unit, in backward-ready order.

    Without a gradient-sync section every gradient is its own fp32 allreduce (layer-wise)."""
    index = {g.name: i for i, g in enumerate(workload.grads)}
    out: list[list[tuple[list[int], SyncStrategy]]] = [[] for _ in range(num_stages)]
    covered: set[int] = set()
    if sync is not None:
        per_tensor = {t.name: t.strategy for t in sync.tensors}
        groups = [(list(b.tensors), b.strategy) for b in sync.buckets]
        in_bucket = {n for names, _ in groups for n in names}
        groups += [([n], s) for n, s in per_tensor.items() if n not in in_bucket]
        for names, strategy in groups:
            idx = []
            for n in names:
                if n not in index:
                    raise SpecError(
                        f"gradient_sync names tensor {n!r}, which the workload does not have"
                    )
                idx.append(index[n])
            idx.sort()
            stages = {stage_of[workload.grads[i].layer_index] for i in idx}
            if len(stages) != 1:
                raise SpecError(
                    f"a sync unit holds tensors of stages {sorted(stages)}: "
                    f"{names[:3]}…; a bucket must stay inside one pipeline stage"
                )
            out[stages.pop()].append((idx, sync.strategies[strategy]))
            covered.update(idx)
    for i, g in enumerate(workload.grads):
        if i not in covered:
            out[stage_of[g.layer_index]].append(([i], NoSync()))
    for units in out:
        units.sort(key=lambda u: u[0][-1])
    return out


def _sync_stage(
    workload: WorkloadSummary,
    st: Stage,
    layout: Layout,
    costs: CostModel,
    units: list[tuple[list[int], SyncStrategy]],
    bwd_per_layer: list[float],
    record: bool,
    shares: list[float] | None = None,
) -> DPTimeline:
    """DP timeline of one stage over its last micro-batch's backward (``shares``: the largest
    TP share of each layer of the stage with uneven shards, else None: ``1 / tp``)."""
    grad_idx, segments = _stage_segments(workload, st, bwd_per_layer)
    position = {i: k for k, i in enumerate(grad_idx)}
    dp_ranks = [r for k, r in enumerate(st.ranks) if k % layout.tp == 0]
    link, nodes, per_node = _group_link(costs, dp_ranks)
    sync_units = []
    for idx, strategy in units:
        nbytes = sum(
            _shard_bytes(workload, workload.grads[i].size_bytes, workload.grads[i].layer_index,
                         layout.tp, None if shares is None
                         else shares[workload.grads[i].layer_index - st.first_layer])
            for i in idx
        )
        ops = _strategy_ops(strategy, nbytes, costs, st, layout.dp, link, nodes, per_node)
        sync_units.append(SyncUnit(position[idx[-1]], ops, workload.grads[idx[-1]].name))
    sync_units.sort(key=lambda u: u.last_tensor)
    return simulate_dp(segments, sync_units, record=record)


def _stage_segments(
    workload: WorkloadSummary, st: Stage, bwd_per_layer: list[float]
) -> tuple[list[int], list[float]]:
    """The stage's gradients (workload indices, ready order) and the backprop time before
    each becomes ready (the last segment also holds backprop that produces no gradient)."""
    # a layer's gradients are ready when its backward ends; layers are back-propagated in
    # reverse order, so layer i ends after layers last..i
    first = st.first_layer
    end_of_layer: dict[int, float] = {}
    t = 0.0
    for i in range(st.last_layer, first - 1, -1):
        t += bwd_per_layer[i - first]
        end_of_layer[i] = t
    grads = [i for i, g in enumerate(workload.grads) if first <= g.layer_index <= st.last_layer]
    segments = []
    prev = 0.0
    for i in grads:
        ready = max(end_of_layer[workload.grads[i].layer_index], prev)
        segments.append(ready - prev)
        prev = ready
    if segments:
        segments[-1] += t - prev
    return grads, segments


@dataclass(frozen=True)
class StageSync:
    """What a gradient-sync pass needs to score strategies of one stage's DP group with the
    same ops and backprop segments :func:`evaluate` uses.

    Attributes:
        stage: the stage.
        grads: workload gradient indices of the stage, in backward-ready order.
        backprop_s: backprop time before each of them becomes ready.
        nbytes: each gradient's bytes on one rank (TP shard).
        dp / link / nodes / per_node: the DP group: size, link kind, nodes spanned, largest
            number of its ranks on one node.
    """

    stage: Stage
    grads: tuple[int, ...]
    backprop_s: tuple[float, ...]
    nbytes: tuple[float, ...]
    dp: int
    link: str
    nodes: int
    per_node: int

    def ops(self, strategy: SyncStrategy, nbytes: float, costs: CostModel) -> tuple[Op, ...]:
        """The simulator ops of syncing ``nbytes`` with ``strategy`` in this group."""
        return _strategy_ops(strategy, nbytes, costs, self.stage, self.dp, self.link,
                             self.nodes, self.per_node)

    def ops_table(
        self, strategy: SyncStrategy, nbytes: Sequence[float] | np.ndarray, costs: CostModel
    ) -> tuple[tuple[str, ...], np.ndarray]:
        """:meth:`ops` at many sizes at once: (the ops' resources, which do not depend on the
        size, and a ``len(nbytes) x ops`` array of durations). Row ``m`` equals
        ``[op.duration_s for op in self.ops(strategy, nbytes[m], costs)]`` bit for bit;
        for cost tables over every bucket of a stage (the fusion pass)."""
        x = np.asarray(nbytes, dtype=float)
        if x.ndim != 1 or not len(x):
            raise ValueError(f"ops_table needs a non-empty 1-D list of sizes, got shape {x.shape}")
        ops = _strategy_ops(strategy, x, costs, self.stage, self.dp, self.link, self.nodes,
                            self.per_node)
        cols = [np.broadcast_to(np.asarray(op.duration_s, dtype=float), x.shape) for op in ops]
        table = np.stack(cols, axis=1) if cols else np.zeros((len(x), 0))
        return tuple(op.resource for op in ops), table


def stage_syncs(
    workload: WorkloadSummary, layout: Layout, stages: tuple[Stage, ...], costs: CostModel
) -> list[StageSync]:
    """One :class:`StageSync` per stage that has gradients (none when ``dp == 1``)."""
    if layout.dp <= 1:
        return []
    if not stages:
        stages = (Stage(index=0, first_layer=0, last_layer=len(workload.layers) - 1,
                        ranks=tuple(range(layout.num_ranks))),)
    out = []
    for st in stages:
        _, _, _, per_layer, _ = _stage_times(workload, st, layout, costs,
                                             layout.micro_batch_size,
                                             layout.micro_batch_size / workload.batch_size)
        grads, segments = _stage_segments(workload, st, per_layer)
        if not grads:
            continue
        dp_ranks = [r for k, r in enumerate(st.ranks) if k % layout.tp == 0]
        link, nodes, per_node = _group_link(costs, dp_ranks)
        nbytes = tuple(_shard_bytes(workload, workload.grads[i].size_bytes,
                                    workload.grads[i].layer_index, layout.tp) for i in grads)
        out.append(StageSync(st, tuple(grads), tuple(segments), nbytes, layout.dp, link, nodes,
                             per_node))
    return out


def _shard_bytes(workload: WorkloadSummary, nbytes: int, layer: int, tp: int,
                 share: float | None = None) -> float:
    """A gradient's bytes on one TP rank: the splittable part divided by tp (or times the
    rank's ``share`` with uneven shards)."""
    lay = workload.layers[layer]
    if tp == 1 or not lay.param_bytes or not lay.tp_split_bytes:
        return float(nbytes)
    frac = min(lay.tp_split_bytes / lay.param_bytes, 1.0)
    return nbytes * (1 - frac + (frac / tp if share is None else frac * share))


class _ScalarCalc:
    """The size-dependent costs of a sync path at one size (floats): the simulator's path."""

    @staticmethod
    def time(model: TimeModel, nbytes: float) -> float:
        return model(nbytes)

    @staticmethod
    def wire(comp: CompressionCost, nbytes: float) -> float:
        return comp.wire_bytes(nbytes)

    @staticmethod
    def comm(costs: CostModel, routine: str, nbytes: float, group: int, link: str) -> float:
        return costs.comm.time_s(routine, nbytes, group, link)  # type: ignore[arg-type]


class _ArrayCalc(_ScalarCalc):
    """The same costs at many sizes at once (numpy arrays), bit-identical to
    :class:`_ScalarCalc` element by element (same float operations; see
    :func:`~hetplan.cost_models.compression.time_array`)."""

    @staticmethod
    def time(model: TimeModel, nbytes: np.ndarray) -> np.ndarray:  # type: ignore[override]
        return time_array(model, nbytes)

    @staticmethod
    def wire(comp: CompressionCost, nbytes: np.ndarray) -> np.ndarray:  # type: ignore[override]
        if comp.compressor == "powersgd":  # the ratio depends on the size
            return np.array([comp.wire_bytes(float(x)) for x in nbytes], dtype=float)
        return nbytes * comp.wire_ratio()

    @staticmethod
    def comm(costs: CostModel, routine: str, nbytes: np.ndarray, group: int,  # type: ignore[override]
             link: str) -> np.ndarray:
        if (nbytes < 0).any():
            raise ValueError(f"nbytes must be >= 0, got {float(nbytes.min())!r}")
        line = costs.comm.alpha_beta(routine, group, link)  # type: ignore[arg-type]
        return np.where(nbytes > 0, line.alpha_s + line.beta_s_per_byte * nbytes, 0.0)


def _strategy_ops(
    strategy: SyncStrategy,
    nbytes: float,
    costs: CostModel,
    st: Stage,
    dp: int,
    link: str,
    nodes: int,
    per_node: int,
) -> tuple[Op, ...]:
    """The ops of one sync unit under ``strategy`` (see the gradient-sync plan section)."""
    dev = costs.devices[st.ranks[0]]
    ops: list[Op] = []
    payload = nbytes
    calc = _ArrayCalc if isinstance(nbytes, np.ndarray) else _ScalarCalc
    if isinstance(strategy, CastSync):
        ops.append(Op(GPU, 2 * nbytes / dev.mem_bandwidth_bytes_per_s, "cast"))
        payload = nbytes / 2
    comp = None
    if isinstance(strategy, CompressedSync):
        comp = costs.compression.cost(
            strategy.compressor, strategy.compress_device, dev.type,
            **{k: v for k, v in strategy.params.items() if k in ("ratio", "levels", "rank")},
        )
        if strategy.uncompressed_dtype != "fp32":
            payload = nbytes / 2
    if isinstance(strategy, CompressedSync) and strategy.actions and comp is not None:
        return _action_ops(strategy, payload, comp, costs, dev, dp, link, nodes, per_node, calc)
    compressed_done = False
    for step in strategy.steps:
        if step.compressed and comp is not None and not compressed_done:
            res = _comp_resource(strategy.compress_device, dev)
            ops.append(Op(res, calc.time(comp.compress, payload), "compress"))
            compressed_done = True
        size = calc.wire(comp, payload) if step.compressed and comp else payload
        group, lk, channel = _level_group(step.level, dev, dp, link, nodes, per_node)
        ops.append(Op(channel, calc.comm(costs, step.routine, size, group, lk), step.routine))
    if compressed_done and comp is not None and isinstance(strategy, CompressedSync):
        res = _comp_resource(strategy.decompress_device, dev)
        ops.append(Op(res, calc.time(comp.decompress, payload), "decompress"))
    return tuple(ops)


def _comp_resource(device: str | None, dev: Device) -> str:
    """The simulator resource of a (de)compression on ``device`` (``gpu`` / ``cpu``) of a
    gradient held by ``dev``: the compute resource or the host's CPU pool. On the ``cpu``
    device type the host CPU *is* the compute resource (the training process's cores run
    the compressors; there are no spare host cores to offload to), so both choices take
    turns with backprop there (decision in ``docs/decisions.md``, "End-to-end runs")."""
    return GPU if device == "gpu" or dev.type == "cpu" else CPU


def _level_group(
    level: str, dev: Device, dp: int, link: str, nodes: int, per_node: int
) -> tuple[int, str, str]:
    """(group size, link, simulator channel) of a sync step at ``level``."""
    if level == "flat":
        group, lk = dp, link
    elif level == "intra":
        group, lk = per_node, "intra"
    else:
        group, lk = nodes, "inter"
    channel = "net" if level == "flat" else level
    if not dev.comm_overlaps_compute:
        channel = GPU  # takes turns with backprop on the compute resource
    return group, lk, channel


def _action_ops(
    strategy: CompressedSync,
    payload: float,
    comp: CompressionCost,
    costs: CostModel,
    dev: Device,
    dp: int,
    link: str,
    nodes: int,
    per_node: int,
    calc: type[_ScalarCalc] = _ScalarCalc,
) -> tuple[Op, ...]:
    """The ops of an Espresso path (``strategy.actions``), following one GPU's data.

    State along the path: ``frac`` (the share of the tensor this GPU holds: a divisible
    first step divides it by the group size, its second step multiplies it back),
    ``copies`` (compressed pieces not yet aggregated: an allgather or alltoall of compressed
    data multiplies them, a decompression sums them back to one) and ``active`` (GPUs per
    node still carrying data: a root-type intra step leaves only the root). Sizes follow
    :mod:`~hetplan.cost_models.comm`'s convention (gathers count their total output). The
    inter-node NIC is shared by the ``active`` GPUs of a node, so an inter step moves
    ``active`` times one GPU's bytes; with the full-size convention this gives the same
    times as the uncompressed hierarchical steps above. A (de)compression handles all of
    this GPU's pieces in one call.
    """
    ops: list[Op] = []
    frac, copies, compressed, active = 1.0, 1, False, max(per_node, 1)
    for a in strategy.actions:
        if a.task in ("comp", "decomp"):
            res = _comp_resource(a.device, dev)
            if a.task == "comp":
                ops.append(Op(res, calc.time(comp.compress, payload * frac), "compress"))
                compressed, copies = True, 1
            else:
                ops.append(Op(res, calc.time(comp.decompress, payload * frac * copies),
                              "decompress"))
                compressed, copies = False, 1
            continue
        group, lk, channel = _level_group(a.level, dev, dp, link, nodes, per_node)
        unit = calc.wire(comp, payload * frac) * copies if compressed else payload * frac
        routine = a.routine or "allreduce"
        size = unit * group if routine in ("allgather", "gather") else unit
        if a.level == "inter":
            size *= active
        ops.append(Op(channel, calc.comm(costs, routine, size, group, lk), routine))
        if routine in ("reduce_scatter", "alltoall"):
            frac /= group
            copies *= group if routine == "alltoall" else 1
        elif routine == "allgather":
            if a.task == "comm_comp":
                copies *= group
            else:
                frac *= group
        elif routine in ("reduce", "gather"):
            copies *= group if routine == "gather" else 1
            if a.level == "intra":
                active = 1
        elif routine == "broadcast" and a.level == "intra":
            active = max(per_node, 1)
    return tuple(ops)


def _optimizer_s(
    workload: WorkloadSummary, stages: tuple[Stage, ...], layout: Layout, costs: CostModel,
    tp_section: TensorParallel | None = None,
) -> float:
    worst = 0.0
    for st in stages:
        shares = max_layer_shares(workload, st, layout.tp, tp_section)
        pbytes = sum(
            _shard_bytes(workload, lay.param_bytes, st.first_layer + k, layout.tp,
                         None if shares is None else shares[k])
            for k, lay in enumerate(workload.layers[st.first_layer : st.last_layer + 1])
        )
        bw = min(d.mem_bandwidth_bytes_per_s for d in rank_devices(costs, st))
        worst = max(worst, OPTIMIZER_BYTES_PER_PARAM_BYTE * pbytes / bw)
    return worst


def _memory(
    workload: WorkloadSummary,
    stages: tuple[Stage, ...],
    layout: Layout,
    costs: CostModel,
    scale: float,
    tp_section: TensorParallel | None = None,
) -> tuple[MemoryBreakdown, ...]:
    per_rank: dict[int, MemoryBreakdown] = {}
    for st in stages:
        flight = in_flight_micro_batches(
            layout.schedule, st.index, layout.pp, layout.micro_batches, layout.virtual_stages
        )
        mem = stage_memory(
            list(workload.layers[st.first_layer : st.last_layer + 1]),
            tp=layout.tp,
            micro_batch_scale=scale,
            in_flight=flight,
            optimizer=costs.optimizer,
        )
        for r in st.ranks:
            per_rank[r] = mem
        for r, shares in rank_layer_shares(workload, st, layout.tp, tp_section).items():
            per_rank[r] = stage_memory(
                list(workload.layers[st.first_layer : st.last_layer + 1]), tp=layout.tp,
                micro_batch_scale=scale, in_flight=flight, optimizer=costs.optimizer,
                shares=shares)
    return tuple(per_rank[r] for r in sorted(per_rank))
