"""Predict one iteration of a plan: the single objective of layout search and every pass.

:func:`evaluate` turns (workload, layout, stages, tensor-parallel and gradient-sync sections)
into an iteration time, a breakdown, the memory of every rank and the pipeline bubble:

1. **Stage times.** For every pipeline stage, each layer's forward and backward time for one
   micro-batch on every distinct device of the stage (:class:`ComputeModel`, each device type
   in its own compute dtype: ``costs.precision``); a synchronous stage runs at its slowest
   device. Layers with Megatron pairs are split ``tp`` ways and add one all-reduce of their
   output per pair in forward and in backward on the TP group's link (with sequence
   parallelism a reduce-scatter and an all-gather, which cost the same). Backward adds the
   stage's recomputation; ZeRO-3 adds the weights' all-gathers not hidden by prefetch.
2. **Pipeline.** The schedule is simulated over the stage times with point-to-point
   activation transfers between stages (:func:`simulate_pipeline`; interleaved chunks, one
   plan stage each, with their own times), giving each stage's end of its last backward.
3. **Gradient sync.** Each stage's data-parallel group syncs that stage's gradients while the
   stage runs its last micro-batch's backward (``costs.dp_overlap == "backward"``; with
   ``"after-flush"`` the sync starts when that backward has ended, as in Megatron-LM
   before its overlapped gradient reduce): the DP timeline (:func:`simulate_dp`) over that
   backward, with one sync unit per bucket (or per tensor), gives the time the stage finishes
   after its backward ends (exposed communication, GPU compression delays). Gradients move in
   the precision section's reduce dtype; ZeRO's reduce-scatter and all-gather are priced as
   :func:`_strategy_ops` says.
4. **Iteration** ``= max over stages (last backward end + exposed sync) + optimizer step``; the
   optimizer step is memory-bound, priced by the bytes its kernels move plus a launch per
   kernel (:mod:`hetplan.cost_models.optimizer_step`; ZeRO divides the bytes).
5. **Memory** per rank (:mod:`hetplan.cost_models.memory`): model state in the precision's
   dtypes and ZeRO's sharding, activations under each stage's recomputation at the peak of
   the rank's action list, ZeRO buffers and the allocator margin;
   :class:`~hetplan.errors.InfeasiblePlanError` with the breakdown when a rank does not fit.

Everything here is deterministic and free of torch.

Why one file (about 680 lines, over the project's ~600): it is the definition of the
objective, read top to bottom as the steps above. The largest part after :func:`evaluate`
itself is step 3's pricing of a sync strategy (:class:`StageSync`, the strategy-op builders):
the gradient-sync passes score their candidates through :class:`StageSync` precisely so that
they price sync with the code :func:`evaluate` uses, and keeping both in this module is what
guarantees that. The seams that do exist (step 1's stage times, step 5's per-rank memory,
the pipeline and DP timelines, TP shares) are modules of their own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

import numpy as np

from hetplan.algorithms.dp_timeline import simulate_dp
from hetplan.algorithms.dp_types import CPU, GPU, DPTimeline, Op, SyncUnit
from hetplan.algorithms.pipeline_schedules import build_schedule
from hetplan.cost_models.compression import CompressionCost, TimeModel, time_array
from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.memory import (
    MemoryBreakdown,
    StatePrecision,
    capture_bytes,
    check_fits,
)
from hetplan.cost_models.optimizer_step import step_bytes, step_kernels, step_seconds
from hetplan.cost_models.pipeline import PipelineSimResult, simulate_pipeline, simulate_schedule
from hetplan.cost_models.precision import state_precision
from hetplan.cost_models.rank_memory import rank_memory, stage_precision
from hetplan.cost_models.stage_times import (
    group_link,
    nic_share,
    p2p_ms,
    rank_devices,
    shard_bytes,
    stage_times,
)
from hetplan.cost_models.sparse import sparse_ops
from hetplan.cost_models.tp_shares import max_layer_shares, stage_compute
from hetplan.errors import SpecError
from hetplan.ir.cluster import Device
from hetplan.ir.plan_sections import (
    CastSync,
    CompressedSync,
    GradientSync,
    LayerCost,
    Layout,
    NoSync,
    Stage,
    SyncStrategy,
    TensorParallel,
    WorkloadSummary,
)
from hetplan.ir.plan_sparse import SparseSync, SparseTensorSync

__all__ = ["Evaluation", "StageCost", "StageSync", "stage_syncs", "evaluate", "rank_devices",
           "OPTIMIZER_BYTES_PER_PARAM_BYTE"]

#: A sync unit's strategy: a gradient-sync strategy, or a sparse gradient's own scheme.
UnitStrategy = Union[SyncStrategy, SparseTensorSync]

#: Bytes the optimizer step moves per fp32 parameter byte in fp32 Adam (torch's foreach
#: Adam: 72 bytes per element, :data:`hetplan.cost_models.optimizer_step.UPDATE_BYTES`);
#: :func:`_step_bytes` gives every precision and optimizer.
OPTIMIZER_BYTES_PER_PARAM_BYTE = 18.0


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
    sparse_sync: SparseSync | None = None,
) -> Evaluation:
    """Predict one iteration (see module docstring).

    ``sparse_sync``: the plan's sparse-sync section; each of its tensors with a scheme other
    than ``dense`` leaves its gradient-sync unit and is its own unit, priced by
    :func:`hetplan.cost_models.sparse.sparse_ops`.

    ``tensor_parallel``: the plan's TP section; with uneven shard sizes or resizing roles
    the stage compute follows :mod:`hetplan.cost_models.tp_shares` (each TP layer at its
    slowest rank's share), else every TP layer is split evenly.

    Raises:
        SpecError: the layout and the stages disagree (a validated plan also names only the
            workload's gradients and keeps each bucket in one stage: hetplan.ir.plan_checks).
        InfeasiblePlanError: a rank runs out of memory (with ``check_memory``).
    """
    if not stages:
        stages = (
            Stage(index=0, first_layer=0, last_layer=len(workload.layers) - 1,
                  ranks=tuple(range(layout.num_ranks))),
        )
    v = layout.virtual_stages
    if len(stages) != layout.pp * v:
        chunks = f" × virtual_stages={v}" if v > 1 else ""
        raise SpecError(f"layout has pp={layout.pp}{chunks} but the plan lists {len(stages)} "
                        f"stage(s); it needs {layout.pp * v}")
    mb = layout.micro_batch_size
    scale = mb / workload.batch_size
    stage_of = [0] * len(workload.layers)
    for st in stages:
        for i in range(st.first_layer, st.last_layer + 1):
            stage_of[i] = st.index

    fwd, bwd, tp_comm, bwd_layers, sources = [], [], [], [], []
    for st in stages:
        f, b, c, per_layer, src = stage_times(workload, st, layout, costs, mb, scale,
                                               tensor_parallel)
        fwd.append(f)
        bwd.append(b)
        tp_comm.append(c)
        bwd_layers.append(per_layer)
        sources.append(src)

    p2p = p2p_ms(workload, layout, stages, costs, scale)
    key = (tuple(fwd), tuple(bwd), layout.micro_batches, layout.schedule, v, tuple(p2p))
    cached = costs.pipeline_cache.get(key)
    if cached is None:
        fwd_ms, bwd_ms = [x * 1e3 for x in fwd], [x * 1e3 for x in bwd]
        if v > 1:  # one time per virtual stage (chunks may differ)
            sched = build_schedule(layout.schedule, layout.pp, layout.micro_batches, v)
            pipe = simulate_schedule(sched, fwd_ms, bwd_ms, p2p_fwd_ms=p2p, p2p_bwd_ms=p2p)
        else:  # (one rank of an interleaved layout: no pipeline, no chunks)
            name = "1f1b" if layout.schedule == "interleaved-1f1b" else layout.schedule
            pipe = simulate_pipeline(fwd_ms, bwd_ms, layout.micro_batches, name,
                                     p2p_fwd_ms=p2p or 0, p2p_bwd_ms=p2p or 0)
        ends = [0.0] * len(stages)
        for ev in pipe.events:
            if ev.kind.value == "B":
                s = ev.stage if v > 1 else ev.rank
                ends[s] = max(ends[s], ev.end_ms * 1e-3)
        cached = costs.pipeline_cache[key] = (pipe, tuple(ends))
    pipe, last_bwd_end = cached

    strategies = _units_by_stage(workload, gradient_sync, stage_of, len(stages), sparse_sync)
    stage_costs, timelines = [], []
    comm_busy = compression = 0.0
    finish = []
    for s, st in enumerate(stages):
        tl = None
        exposed = busy = comp = 0.0
        if layout.dp > 1 and strategies[s]:
            # after the flush, sync starts when the stage's last backward has ended: the
            # timeline runs over no backprop (every gradient is ready at once)
            overlap = costs.dp_overlap == "backward"
            backprop = bwd_layers[s] if overlap else [0.0] * len(bwd_layers[s])
            tl, units = _sync_stage(workload, st, layout, costs, strategies[s], backprop,
                                    record,
                                    max_layer_shares(workload, st, layout.tp, tensor_parallel))
            exposed = tl.iteration_s - (bwd[s] if overlap else 0.0)
            busy, comp = _comm_and_compression_s(units)
        stage_costs.append(StageCost(fwd[s], bwd[s], tp_comm[s], exposed, busy, comp, sources[s]))
        timelines.append(tl)
        comm_busy = max(comm_busy, busy)
        compression = max(compression, comp)
        finish.append(last_bwd_end[s] + max(exposed, 0.0))

    optimizer_s = _optimizer_s(workload, stages, layout, costs, tensor_parallel)
    iteration = max(finish) + optimizer_s
    per_rank = [0.0] * layout.pp
    for s, (f, b) in enumerate(zip(fwd, bwd)):
        per_rank[s % layout.pp] += (f + b) * layout.micro_batches
    compute = max(per_rank)
    memory = rank_memory(workload, stages, layout, costs, scale, tensor_parallel)
    if check_memory:
        check_fits(
            list(memory),
            [d.memory_bytes for d in costs.devices[: len(memory)]],
            what=f"layout dp={layout.dp} pp={layout.pp} tp={layout.tp} "
            f"micro-batch {layout.micro_batch_size}"
            + (f", ZeRO-{layout.zero_stage}" if layout.zero_stage else "")
            + _recompute_note(stages),
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


def _recompute_note(stages: Sequence[Stage]) -> str:
    modes = sorted({st.recompute for st in stages} - {"none"})
    return f", {'/'.join(modes)} recomputation" if modes else ""


def _units_by_stage(
    workload: WorkloadSummary,
    sync: GradientSync | None,
    stage_of: list[int],
    num_stages: int,
    sparse: SparseSync | None = None,
) -> list[list[tuple[list[int], UnitStrategy]]]:
    """Per stage: (gradient indices, strategy) per sync unit, in backward-ready order.

    Without a gradient-sync section every gradient is its own fp32 allreduce (layer-wise).
    A sparse gradient synced by its own scheme (``sparse``) is its own unit, out of its bucket."""
    index = {g.name: i for i, g in enumerate(workload.grads)}
    out: list[list[tuple[list[int], UnitStrategy]]] = [[] for _ in range(num_stages)]
    covered: set[int] = set()
    for name, entry in (sparse.synced() if sparse is not None else {}).items():
        if name in index:
            i = index[name]
            out[stage_of[workload.grads[i].layer_index]].append(([i], entry))
            covered.add(i)
    if sync is not None:
        per_tensor = {t.name: t.strategy for t in sync.tensors}
        groups = [(list(b.tensors), b.strategy) for b in sync.buckets]
        in_bucket = {n for names, _ in groups for n in names}
        groups += [([n], s) for n, s in per_tensor.items() if n not in in_bucket]
        for names, strategy in groups:
            # Every name is a gradient of the workload and a bucket stays in one stage: the
            # plan's validation checks both (hetplan.ir.plan_checks, rule 6).
            idx = sorted(index[n] for n in names if index[n] not in covered)
            if not idx:
                continue
            stages = {stage_of[workload.grads[i].layer_index] for i in idx}
            assert len(stages) == 1, (names[:3], sorted(stages))
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
    units: list[tuple[list[int], UnitStrategy]],
    bwd_per_layer: list[float],
    record: bool,
    shares: list[float] | None = None,
) -> tuple[DPTimeline, list[SyncUnit]]:
    """DP timeline of one stage over its last micro-batch's backward, and its sync units
    (``shares``: the largest TP share of each layer of the stage with uneven shards, else
    None: ``1 / tp``)."""
    grad_idx, segments = _stage_segments(workload, st, bwd_per_layer)
    position = {i: k for k, i in enumerate(grad_idx)}
    dp_ranks = [r for k, r in enumerate(st.ranks) if k % layout.tp == 0]
    link, nodes, per_node = group_link(costs, dp_ranks)
    dtypes = _sync_dtypes(workload, st, layout, costs)
    sync_units = []
    for idx, strategy in units:
        nbytes = sum(
            shard_bytes(workload, workload.grads[i].size_bytes, workload.grads[i].layer_index,
                         layout.tp, None if shares is None
                         else shares[workload.grads[i].layer_index - st.first_layer])
            for i in idx
        )
        if isinstance(strategy, SparseTensorSync):
            channel = _level_group("flat", costs.devices[st.ranks[0]], layout.dp, link, nodes,
                                   per_node)[2]
            ops = sparse_ops(strategy, layout.dp, costs, costs.devices[st.ranks[0]], link,
                             channel)
        else:
            ops = _strategy_ops(strategy, nbytes, costs, st, layout.dp, link, nodes, per_node,
                                dtypes)
        sync_units.append(SyncUnit(position[idx[-1]], ops, workload.grads[idx[-1]].name))
    sync_units.sort(key=lambda u: u.last_tensor)
    return simulate_dp(segments, sync_units, record=record), sync_units


#: Op labels that are (de)compression, casting or sparse-encoding work (Zen's hashing,
#: aggregation and decoding: :mod:`~hetplan.cost_models.sparse`); every other op communicates.
_COMPRESSION_LABELS = frozenset({"compress", "decompress", "cast", "zen-hash",
                                 "zen-aggregate", "zen-decode"})


def _comm_and_compression_s(units: Sequence[SyncUnit]) -> tuple[float, float]:
    """(communication, compression) seconds of a stage's sync ops, told apart by what each
    op does (its label), not by the resource it runs on: on a device whose collectives take
    turns with compute (``comm_overlaps_compute: false``, the ``cpu`` type) communication
    runs on the compute resource too, and counting that resource's extra time as
    compression reported a plan that compresses nothing as compressing."""
    comm = comp = 0.0
    for u in units:
        for op in u.ops:
            if op.label in _COMPRESSION_LABELS:
                comp += op.duration_s
            else:
                comm += op.duration_s
    return comm, comp


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
class SyncDtypes:
    """What a data-parallel group's gradients and ZeRO do to the bytes it moves.

    Attributes:
        grad_scale: bytes of the gradients as kept and reduced (the precision section's
            reduce dtype) per captured byte: 0.5 for 16-bit gradients of an fp32 capture.
        param_scale: bytes of the working weights per captured byte.
        zero_stage: the layout's ZeRO stage.
        nic_share: how many data-parallel groups share a node's network interfaces while
            they sync (:func:`~hetplan.cost_models.stage_times.nic_share`): an inter-node
            step moves this many times its bytes through the node's links.
    """

    grad_scale: float = 1.0
    param_scale: float = 1.0
    zero_stage: int = 0
    nic_share: float = 1.0


def _sync_dtypes(workload: WorkloadSummary, st: Stage, layout: Layout,
                 costs: CostModel) -> SyncDtypes:
    prec = stage_precision(workload, st, costs)
    dp_ranks = [r for k, r in enumerate(st.ranks) if k % layout.tp == 0]
    return SyncDtypes(prec.grad_bytes / prec.capture_bytes,
                      prec.weight_bytes / prec.capture_bytes, layout.zero_stage,
                      nic_share(costs, dp_ranks))


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
        dtypes: the gradients' reduce dtype and ZeRO (see :class:`SyncDtypes`).
    """

    stage: Stage
    grads: tuple[int, ...]
    backprop_s: tuple[float, ...]
    nbytes: tuple[float, ...]
    dp: int
    link: str
    nodes: int
    per_node: int
    dtypes: SyncDtypes = SyncDtypes()

    def ops(self, strategy: SyncStrategy, nbytes: float, costs: CostModel) -> tuple[Op, ...]:
        """The simulator ops of syncing ``nbytes`` with ``strategy`` in this group."""
        return _strategy_ops(strategy, nbytes, costs, self.stage, self.dp, self.link,
                             self.nodes, self.per_node, self.dtypes)

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
                            self.per_node, self.dtypes)
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
        _, _, _, per_layer, _ = stage_times(workload, st, layout, costs,
                                             layout.micro_batch_size,
                                             layout.micro_batch_size / workload.batch_size)
        grads, segments = _stage_segments(workload, st, per_layer)
        if not grads:
            continue
        dp_ranks = [r for k, r in enumerate(st.ranks) if k % layout.tp == 0]
        link, nodes, per_node = group_link(costs, dp_ranks)
        nbytes = tuple(shard_bytes(workload, workload.grads[i].size_bytes,
                                    workload.grads[i].layer_index, layout.tp) for i in grads)
        out.append(StageSync(st, tuple(grads), tuple(segments), nbytes, layout.dp, link, nodes,
                             per_node, _sync_dtypes(workload, st, layout, costs)))
    return out


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
    dtypes: SyncDtypes = SyncDtypes(),
) -> tuple[Op, ...]:
    """The ops of one sync unit under ``strategy`` (see the gradient-sync plan section).

    ``nbytes`` is the unit's gradients at the captured dtype; ``dtypes`` says what they are
    kept and reduced in. Uncompressed steps carry them in that dtype (a ``cast`` strategy
    casts only fp32 gradients to 16 bits; 16-bit ones already are). Under ZeRO the
    reduce-scatter of gradients and the all-gather of updated weights cost what the
    all-reduce does (ring: ``2(n-1)/n`` of the bytes either way), so an uncompressed unit is
    priced by its steps as they are; ZeRO-3 keeps no replicated weights to gather after the
    step, so its all-reduce steps become reduce-scatters. A cast or compressed strategy
    under ZeRO-1 delivers full gradients and then all-gathers the updated weight shards
    (an extra op); ZeRO-2 and -3 shard gradients during backward, which compression does
    not (refused).
    """
    dev = costs.devices[st.ranks[0]]
    ops: list[Op] = []
    g = dtypes.grad_scale
    payload = nbytes * g
    calc = _ArrayCalc if isinstance(nbytes, np.ndarray) else _ScalarCalc
    if not isinstance(strategy, NoSync) and dtypes.zero_stage >= 2:
        raise SpecError(
            f"a {strategy.kind} gradient sync needs zero_stage <= 1 (ZeRO-{dtypes.zero_stage} "
            "reduce-scatters gradients during backward, which compression and casting do not "
            "compose with); use the 'fp32' (uncompressed) strategy or zero_stage 0 or 1")
    if isinstance(strategy, CastSync):
        if g >= 1:
            ops.append(Op(GPU, 2 * nbytes / dev.mem_bandwidth_bytes_per_s, "cast"))
        payload = nbytes * min(g, 0.5)
    comp = None
    dense = payload  # bytes of the uncompressed steps
    if isinstance(strategy, CompressedSync):
        comp = costs.compression.cost(
            strategy.compressor, strategy.compress_device, dev.type,
            **{k: v for k, v in strategy.params.items() if k in ("ratio", "levels", "rank")},
        )
        # 16-bit uncompressed steps: only their bytes shrink; the compressor still sees (and
        # its wire size follows) the gradients as kept, and the casts are GPU kernels
        narrow = strategy.uncompressed_dtype != "fp32" and g >= 1
        if strategy.actions:
            out = _action_ops(strategy, payload, comp, costs, dev, dp, link, nodes, per_node,
                              calc, dtypes.nic_share, narrow)
            return out + _zero_gather(strategy, nbytes, dtypes, costs, dev, dp, link, nodes,
                                      per_node, calc)
        if strategy.uncompressed_dtype != "fp32":
            dense = nbytes * min(g, 0.5)
            if narrow and any(not s.compressed for s in strategy.steps):
                ops.append(Op(GPU, 2 * payload / dev.mem_bandwidth_bytes_per_s, "cast"))
    compressed_done = False
    for step in strategy.steps:
        if step.compressed and comp is not None and not compressed_done:
            res = _comp_resource(strategy.compress_device, dev)
            ops.append(Op(res, calc.time(comp.compress, payload), "compress"))
            compressed_done = True
        size = calc.wire(comp, payload) if step.compressed and comp else dense
        group, lk, channel = _level_group(step.level, dev, dp, link, nodes, per_node)
        routine = step.routine
        if dtypes.zero_stage >= 3 and routine == "allreduce":
            routine = "reduce_scatter"
        if lk == "inter":
            size = size * dtypes.nic_share
        ops.append(Op(channel, calc.comm(costs, routine, size, group, lk), routine))
    if compressed_done and comp is not None and isinstance(strategy, CompressedSync):
        res = _comp_resource(strategy.decompress_device, dev)
        ops.append(Op(res, calc.time(comp.decompress, payload), "decompress"))
    return tuple(ops) + _zero_gather(strategy, nbytes, dtypes, costs, dev, dp, link, nodes,
                                     per_node, calc)


def _zero_gather(strategy: SyncStrategy, nbytes: float, dtypes: SyncDtypes, costs: CostModel,
                 dev: Device, dp: int, link: str, nodes: int, per_node: int,
                 calc: type[_ScalarCalc]) -> tuple[Op, ...]:
    """ZeRO-1's all-gather of the updated weight shards after a cast or compressed sync
    (see :func:`_strategy_ops`); nothing otherwise."""
    if dtypes.zero_stage != 1 or isinstance(strategy, NoSync):
        return ()
    group, lk, channel = _level_group("flat", dev, dp, link, nodes, per_node)
    size = nbytes * dtypes.param_scale * (dtypes.nic_share if lk == "inter" else 1.0)
    return (Op(channel, calc.comm(costs, "allgather", size, group, lk), "allgather"),)


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
    share: float = 1.0,
    narrow: bool = False,
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

    With ``narrow`` (a 16-bit ``uncompressed_dtype`` on fp32 gradients) the uncompressed
    steps move half the bytes; compressed steps move what the compressor makes of the fp32
    values, and (de)compression times stay those of the fp32 values. Each stretch of
    uncompressed steps is cast to 16 bits before its first step and back after its last
    (``cast``: read plus write over the memory bandwidth, ``payload * frac / mem_bw`` per
    direction, so a round trip costs what :class:`CastSync`'s cast does). A cast next to a
    GPU (de)compression is part of that kernel (it reads or writes the 16-bit values), so
    it adds to that op instead of being an op of its own.
    """
    ops: list[Op] = []
    frac, copies, compressed, active = 1.0, 1, False, max(per_node, 1)
    half = False  # the dense values are 16-bit now
    bw = dev.mem_bandwidth_bytes_per_s

    def cast(nb: float) -> None:
        """A cast of ``nb`` fp32 bytes, merged into a GPU (de)compression right before."""
        dur = nb / bw
        if ops and ops[-1].resource == GPU and ops[-1].label in ("decompress", "compress"):
            last = ops.pop()
            ops.append(Op(GPU, last.duration_s + dur, last.label + "+cast"))
        else:
            ops.append(Op(GPU, dur, "cast"))

    for a in strategy.actions:
        if a.task in ("comp", "decomp"):
            res = _comp_resource(a.device, dev)
            if a.task == "comp":
                t = calc.time(comp.compress, payload * frac)
                label = "compress"
                if half:  # back to fp32 first: fused into a GPU compression
                    if res == GPU:
                        t, label = t + payload * frac / bw, "cast+compress"
                    else:
                        cast(payload * frac)
                    half = False
                ops.append(Op(res, t, label))
                compressed, copies = True, 1
            else:
                ops.append(Op(res, calc.time(comp.decompress, payload * frac * copies),
                              "decompress"))
                compressed, copies = False, 1
            continue
        group, lk, channel = _level_group(a.level, dev, dp, link, nodes, per_node)
        if narrow and not compressed and not half:
            cast(payload * frac)
            half = True
        unit = (calc.wire(comp, payload * frac) * copies if compressed
                else payload * frac * (0.5 if half else 1.0))
        routine = a.routine or "allreduce"
        size = unit * group if routine in ("allgather", "gather") else unit
        if a.level == "inter":
            size *= active * share
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
    if half:
        ops.append(Op(GPU, payload * frac / bw, "cast"))
    return tuple(ops)


def _optimizer_s(
    workload: WorkloadSummary, stages: tuple[Stage, ...], layout: Layout, costs: CostModel,
    tp_section: TensorParallel | None = None,
) -> float:
    """The optimizer step of the slowest pipeline rank (:mod:`hetplan.cost_models.optimizer_step`):
    the bytes its kernels move over memory bandwidth plus a launch per kernel; under ZeRO
    each rank steps ``1/dp`` of the elements. A rank holding several stages (interleaved
    chunks) steps them all in one optimizer.

    Where the profile DB has a measured optimizer step for the rank's device types
    (:class:`~hetplan.cost_models.profile_db.OptimizerRecord`, ``hetplan profile --what
    step``), that line prices it instead: a cost per parameter tensor stepped (the optimizer's
    Python and dispatch per tensor, what dominates a small model on a CPU) plus a cost per
    fp32 byte, measured with as many processes stepping at once as the node has ranks."""
    measured = _measured_step_s(workload, stages, layout, costs, tp_section)
    if measured is not None:
        return measured
    dp = layout.dp if layout.zero_stage >= 1 else 1
    nbytes: dict[int, float] = {}
    tensors: dict[int, int] = {}
    precs: dict[int, StatePrecision] = {}
    bws: dict[int, float] = {}
    for st in stages:
        shares = max_layer_shares(workload, st, layout.tp, tp_section)
        prec = stage_precision(workload, st, costs)
        pbytes = sum(
            shard_bytes(workload, lay.param_bytes, st.first_layer + k, layout.tp,
                         None if shares is None else shares[k])
            for k, lay in enumerate(workload.layers[st.first_layer : st.last_layer + 1])
        )
        s = st.index % layout.pp
        per_elem = step_bytes(prec, costs.optimizer, dp=dp)
        nbytes[s] = nbytes.get(s, 0.0) + per_elem * pbytes / prec.capture_bytes
        tensors[s] = tensors.get(s, 0) + sum(
            1 for g in workload.grads if st.first_layer <= g.layer_index <= st.last_layer)
        precs.setdefault(s, prec)
        bw = min(d.mem_bandwidth_bytes_per_s for d in rank_devices(costs, st))
        bws[s] = min(bws.get(s, bw), bw)
    return max((step_seconds(nbytes[s], step_kernels(precs[s], costs.optimizer, tensors[s],
                                                      dp=dp), bws[s])
                for s in nbytes), default=0.0)


def _measured_step_s(workload: WorkloadSummary, stages: tuple[Stage, ...], layout: Layout,
                     costs: CostModel, tp_section: TensorParallel | None) -> float | None:
    """The slowest pipeline rank's optimizer step from the profile's measured lines (see
    :func:`_optimizer_s`); None when the DB lacks one for a device type of the plan. Under
    ZeRO-1/2 a rank steps views of its ``1/dp`` chunk of each parameter (about ``tensors /
    dp`` of them) and ``1/dp`` of the bytes; FSDP2 (ZeRO-3) steps every parameter's local
    shard."""
    if costs.db is None or not costs.db.optimizer_steps:
        return None
    sharded = layout.zero_stage >= 1 and layout.dp > 1
    per_rank: dict[int, float] = {}
    for st in stages:
        shares = max_layer_shares(workload, st, layout.tp, tp_section)
        prec = stage_precision(workload, st, costs)
        pbytes = sum(
            shard_bytes(workload, lay.param_bytes, st.first_layer + k, layout.tp,
                         None if shares is None else shares[k])
            for k, lay in enumerate(workload.layers[st.first_layer : st.last_layer + 1])
        )
        tensors = float(sum(1 for g in workload.grads
                            if st.first_layer <= g.layer_index <= st.last_layer))
        fp32_bytes = pbytes / prec.capture_bytes * 4.0
        if sharded:
            fp32_bytes /= layout.dp
            if layout.zero_stage <= 2:
                tensors = math.ceil(tensors / layout.dp)
        worst = 0.0
        for dev in rank_devices(costs, st):
            rec = costs.db.optimizer_step(costs.optimizer, dev.type,
                                          costs.node_sizes[dev.node_index])
            if rec is None:
                return None
            worst = max(worst, rec.time_s(tensors, fp32_bytes) * dev.slowdown)
        s = st.index % layout.pp
        per_rank[s] = per_rank.get(s, 0.0) + worst
    return max(per_rank.values(), default=0.0)


def _step_bytes(prec: StatePrecision, optimizer: str) -> float:
    """Bytes the optimizer step moves per parameter element without ZeRO
    (:func:`hetplan.cost_models.optimizer_step.step_bytes`; the search's lower bound uses it)."""
    return step_bytes(prec, optimizer)
