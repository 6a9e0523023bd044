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
   :func:`_strategy_ops` says. With interleaved stages a rank's chunks then share its links:
   their units run in one timeline per rank (:func:`_share_rank_channels`).
4. **Iteration** ``= max over stages (last backward end + exposed sync) + optimizer step``; the
   optimizer step is memory-bound, priced by the bytes its kernels move plus a launch per
   kernel (:mod:`hetplan.cost_models.optimizer_step`; ZeRO divides the bytes). Before it, a
   head tied to the embedding of another stage sums the two copies' gradients
   (:func:`~hetplan.cost_models.stage_times.tied_sync_s`, counted in ``optimizer_s``).
5. **Memory** per rank (:mod:`hetplan.cost_models.memory`): model state in the precision's
   dtypes and ZeRO's sharding, activations under each stage's recomputation at the peak of
   the rank's action list, ZeRO buffers and the allocator margin;
   :class:`~hetplan.errors.InfeasiblePlanError` with the breakdown when a rank does not fit.

**Chimera** (``docs/decisions.md``, "Chimera: what is priced"): pipeline rank ``r`` holds
stage ``r`` of the down replica and stage ``pp-1-r`` of the up one (the plan lists each
stage on its down ranks only; ``_Prefix.held`` adds the up copy's). So a stage's time is at
the slowest device of both copies and each action pays its own stage's (step 2); a stage's
gradients are averaged over the ``2·dp`` ranks holding a copy, priced as any group over
those ranks and their links, from the end of the stage's last backward on either copy, and
each rank syncs both its stages' units in one timeline (step 3); a rank computes and steps
both stages (half the micro-batches each), and holds both stages' model state (step 5).

Everything here is deterministic and free of torch.

Why one file (about 1,100 lines, over the project's ~600): it is the definition of the
objective, read top to bottom as the steps above. The largest part after :func:`evaluate`
itself is step 3's pricing of a sync strategy (:class:`StageSync`, the strategy-op builders,
and :class:`SyncScorer`, which re-prices only step 3 for many sync sections of one plan):
the gradient-sync passes score their candidates through them precisely so that they price
sync with the code :func:`evaluate` uses, bit for bit, and keeping them in this module is
what guarantees that; splitting the strategy-op builders into a module of their own is the
next cut. The seams that do exist (step 1's stage times, step 5's per-rank memory,
the pipeline and DP timelines, TP shares) are modules of their own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Union

import numpy as np

from hetplan.algorithms.dp_timeline import simulate_dp
from hetplan.algorithms.dp_types import CPU, GPU, DPTimeline, Op, SyncUnit
from hetplan.algorithms.pipeline_schedules import decode_schedule
from hetplan.cost_models.compression import (
    DEFAULT_SPARSITY_RATIO,
    SPARSIFIERS,
    CompressionCost,
    TimeModel,
    time_array,
    wire_ratio,
)
from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.memory import (
    MemoryBreakdown,
    StatePrecision,
    capture_bytes,
    check_fits,
)
from hetplan.cost_models.optimizer_step import step_bytes, step_kernels, step_seconds
from hetplan.cost_models.pipeline import (
    PipelineSchedule,
    PipelineSimResult,
    build_schedule,
    simulate_named,
    simulate_pipeline,
    simulate_schedule,
)
from hetplan.cost_models.precision import state_precision
from hetplan.cost_models.rank_memory import held_stages, rank_memory, stage_precision
from hetplan.cost_models.stage_times import (
    group_link,
    nic_share,
    p2p_ms,
    rank_devices,
    shard_bytes,
    stage_times,
    tied_sync_s,
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
    PipelineActions,
    Stage,
    SyncStrategy,
    TensorParallel,
    WorkloadSummary,
)
from hetplan.ir.plan_sparse import SparseSync, SparseTensorSync

__all__ = ["Evaluation", "StageCost", "StageSync", "SyncScorer", "stage_syncs", "evaluate",
           "edited_lists", "rank_devices", "OPTIMIZER_BYTES_PER_PARAM_BYTE"]

#: A sync unit's strategy: a gradient-sync strategy, or a sparse gradient's own scheme.
UnitStrategy = Union[SyncStrategy, SparseTensorSync]
#: Per stage: (gradient indices, strategy) per sync unit (:func:`_units_by_stage`).
_Units = list[list[tuple[list[int], UnitStrategy]]]

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
    actions: PipelineActions | None = None,
) -> Evaluation:
    """Predict one iteration (see module docstring).

    ``actions``: the plan's ``pipeline_actions`` section, the lists the runtime executes;
    the pipeline is simulated over them where they differ from the lists the layout's
    schedule generates (a plan edited by hand), else over the generated ones (the search's
    candidates carry none; lists for another pipeline shape than ``layout``'s, as an
    alternative that changes the layout is handed: :func:`edited_lists`). Equal lists give
    the same prediction to the bit.

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
    pre = _prefix(workload, layout, stages, costs, tensor_parallel, actions)
    stages = pre.stages
    units = _units_by_stage(workload, gradient_sync, pre.stage_of, len(stages), sparse_sync)
    stage_costs, timelines, comm_busy, compression, finish = _sync_all(
        workload, layout, costs, pre, units, record, tensor_parallel)
    iteration = max(finish) + pre.optimizer_s
    fwd, bwd, tp_comm = pre.fwd, pre.bwd, pre.tp_comm
    per_rank = [0.0] * layout.pp
    copies = layout.stage_copies  # Chimera: each holder runs half the micro-batches
    for s, (f, b) in enumerate(zip(fwd, bwd)):
        for r in layout.stage_holders(s):
            per_rank[r] += (f + b) * layout.micro_batches / copies
    compute = max(per_rank)
    memory = rank_memory(workload, stages, layout, costs, pre.scale, tensor_parallel,
                         schedule=pre.edited)
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
        exposed_comm_s=max(max(f - e, 0.0) for f, e in zip(finish, pre.last_bwd_end)),
        bubble_s=max(pre.pipe.iteration_ms * 1e-3 - compute, 0.0),
        compression_s=compression,
        optimizer_s=pre.optimizer_s,
        bubble_ratio=pre.pipe.bubble_ratio,
        memory=memory,
        stages=tuple(stage_costs),
        pipeline=pre.pipe,
        dp_timelines=tuple(timelines),
    )


def _sync_wait_s(costs: CostModel, prep: _SyncPrep, dp: int, bwd_s: float,
                 units: list[tuple[list[int], UnitStrategy]],
                 step_s: float | None = None) -> float:
    """The profiled hand-over wait of a stage's gradient sync: its first collective is issued
    after every rank's backward (``bwd_s``) and waits for the slowest rank and for a core
    (:meth:`~hetplan.cost_models.comm.CommModel.wait_s` of an all-reduce over the stage's
    data-parallel group, at the first unit's message: :func:`_first_message_bytes`; 0 s
    without a hand-over record). Where the profile timed the sync inside the runtime's own
    step for this group (an ``allreduce_step`` record, :mod:`hetplan.profiling.sync_step`),
    that record is charged instead, after a step of ``step_s`` (the rank's forward and
    backward over its micro-batches and its optimizer step; None where the runtime's sync is
    not that path: ZeRO-2/3 reduce-scatter inside backward), when the first message is an
    uncompressed bucket synced over the flat group, as the record's is
    (:func:`_allreduced`; a reduce and a broadcast, :func:`_reduce_broadcast`, are charged
    the ``reduce_broadcast_step`` record of that path where the profile has one; the first
    unit decides, though the runtime moves every bucket to its worker thread once any
    bucket's path is not the all-reduce fast path: ``docs/decisions/cpu-fidelity.md``
    section 23); likewise
    the ``allgather_step`` record (the
    step with a compressed bucket synced by one all-gather, less the compressor's work,
    which the plan's compressor is priced for apart) when the first unit's path is that
    one all-gather (:func:`_allgathered`). Once per sync: the later collectives of the
    phase follow back to back, at the line's cost. Called only when the profile has
    hand-over records (``CommModel.has_handovers``): GPU and analytic plans skip it."""
    link = prep.link
    nbytes = _first_message_bytes(prep, units)
    if step_s is not None:
        if (nbytes is not None and _reduce_broadcast(_first_unit(prep, units)[1])
                and costs.comm.has_handover("reduce_broadcast_step", dp,
                                            link)):  # type: ignore[arg-type]
            return costs.comm.wait_s("reduce_broadcast_step", dp,  # type: ignore[arg-type]
                                     link, step_s, nbytes)
        if (nbytes is not None and _allreduced(_first_unit(prep, units)[1])
                and costs.comm.has_handover("allreduce_step", dp,
                                            link)):  # type: ignore[arg-type]
            return costs.comm.wait_s("allreduce_step", dp, link,  # type: ignore[arg-type]
                                     step_s, nbytes)
        gathered = _gathered_bytes(prep, units, dp)
        if gathered is not None and costs.comm.has_handover(
                "allgather_step", dp, link):  # type: ignore[arg-type]
            return costs.comm.wait_s("allgather_step", dp, link,  # type: ignore[arg-type]
                                     step_s, gathered)
    return costs.comm.wait_s("allreduce", dp, link, bwd_s, nbytes)  # type: ignore[arg-type]


def _first_unit(prep: _SyncPrep, units: list[tuple[list[int], UnitStrategy]]
                ) -> tuple[list[int], UnitStrategy]:
    """The unit whose last gradient is ready first (``units`` not empty)."""
    return min(units, key=lambda u: prep.position[u[0][-1]])


def _allreduced(strategy: UnitStrategy) -> bool:
    """Whether ``strategy`` syncs uncompressed (fp32, or cast to 16 bits) over the flat
    group, as the ``allreduce_step`` record's all-reduce does (a flat reduce-scatter and
    all-gather too: the same group's hand-overs after the same step); a hierarchical path's
    collectives run on other groups and links, and keep the burst record's charge."""
    return isinstance(strategy, (NoSync, CastSync)) and strategy.hierarchy == "flat"


def _reduce_broadcast(strategy: UnitStrategy) -> bool:
    """Whether ``strategy`` syncs uncompressed over the flat group by a reduce to one rank
    and a broadcast back (Espresso's root-type routing), the path the
    ``reduce_broadcast_step`` record timed: the runtime runs it on the gradient path's
    worker thread, not as the all-reduce's asynchronous launch from the hooks (without that
    record it keeps :func:`_allreduced`'s charge)."""
    return (_allreduced(strategy)
            and tuple(s.routine for s in strategy.steps) == ("reduce", "broadcast"))


def _allgathered(strategy: UnitStrategy) -> bool:
    """Whether ``strategy`` sparsifies (DGC, top-k, random-k: the payloads of a small
    fraction of the bucket, like the record's) and syncs by one flat all-gather of the
    payloads (:class:`CompressedSync`'s default path), the sync the ``allgather_step``
    record timed; quantizers, casts, low-rank and multi-step paths are not."""
    return (isinstance(strategy, CompressedSync) and strategy.compressor in SPARSIFIERS
            and len(strategy.steps) == 1 and strategy.steps[0].level == "flat"
            and strategy.steps[0].routine == "allgather" and strategy.steps[0].compressed)


def _gathered_bytes(prep: _SyncPrep, units: list[tuple[list[int], UnitStrategy]],
                    dp: int) -> float | None:
    """The bytes the first unit's all-gather gathers (every member's payload: the unit's
    gradient bytes times the sparsifier's wire ratio, times ``dp``), where that unit is one
    :func:`_allgathered` syncs; else None."""
    if not units:
        return None
    idx, strategy = _first_unit(prep, units)
    nbytes = prep.nbytes.get(tuple(idx))
    if nbytes is None or not isinstance(strategy, CompressedSync) or not _allgathered(
            strategy):
        return None
    ratio = float(strategy.params.get("ratio", DEFAULT_SPARSITY_RATIO))  # type: ignore[arg-type]
    return nbytes * wire_ratio(strategy.compressor, ratio=ratio) * dp


def _synced_in_backward(costs: CostModel, layout: Layout, prep: _SyncPrep) -> bool:
    """Whether the stage's backward already holds its gradient sync: ZeRO-3 priced from the
    profile's ``zero3_backward`` record, the runtime's FSDP2 backward measured with its
    reduce-scatters, which the root's backward waits for
    (:func:`hetplan.cost_models.stage_times.zero_stage_times`)."""
    return layout.zero_stage >= 3 and costs.comm.has_handover(
        "zero3_backward", layout.dp, prep.link)  # type: ignore[arg-type]


def _rank_step_s(pre: _Prefix, layout: Layout, s: int) -> float | None:
    """The step of the rank that holds stage ``s`` without its sync: forward and backward of
    each of its stages (virtual stages ``s % pp``) over the micro-batches (under Chimera
    stages ``s`` and ``pp-1-s``, half of the micro-batches each), and the optimizer step;
    None under ZeRO-2/3 (their gradients are reduce-scattered inside backward, not synced
    by the runtime's bucket all-reduce after it)."""
    if layout.zero_stage >= 2:
        return None
    if layout.stage_copies > 1:
        held = layout.stage_holders(s)
        return sum((pre.fwd[k] + pre.bwd[k]) * layout.micro_batches / 2 for k in held
                   ) + pre.optimizer_s
    per_mb = sum(f + b for k, (f, b) in enumerate(zip(pre.fwd, pre.bwd))
                 if k % layout.pp == s % layout.pp)
    return per_mb * layout.micro_batches + pre.optimizer_s


def _first_message_bytes(prep: _SyncPrep,
                         units: list[tuple[list[int], UnitStrategy]]) -> float | None:
    """The per-rank bytes of the first collective a stage's sync issues (the unit whose last
    gradient is ready first), as reduced: an uncompressed unit's gradients in the reduce
    dtype, a cast one's in 16 bits; None (the smallest size a hand-over was measured at)
    for compressed and sparse units, whose first message is not the bucket."""
    if not units:
        return None
    idx, strategy = _first_unit(prep, units)
    nbytes = prep.nbytes.get(tuple(idx))
    if nbytes is None:
        return None
    g = prep.dtypes.grad_scale
    if isinstance(strategy, NoSync):
        return float(nbytes * g)
    if isinstance(strategy, CastSync):
        return float(nbytes * min(g, 0.5))
    return None


@dataclass(frozen=True)
class _Prefix:
    """Steps 1 and 2 and the optimizer step of :func:`evaluate`: everything it computes
    before gradient sync, which does not depend on the gradient-sync section.

    ``held``: the stages with the ranks holding a copy of each
    (:func:`~hetplan.cost_models.rank_memory.held_stages`: ``stages`` itself but under
    Chimera), whose slowest device times the stage and whose group syncs its gradients."""

    stages: tuple[Stage, ...]
    held: tuple[Stage, ...]
    stage_of: list[int]
    scale: float
    fwd: list[float]
    bwd: list[float]
    tp_comm: list[float]
    bwd_layers: list[list[float]]
    sources: list[dict[str, int]]
    pipe: PipelineSimResult
    last_bwd_end: tuple[float, ...]
    optimizer_s: float
    edited: PipelineSchedule | None = None  # the plan's own lists, where not the generated


def _prefix(
    workload: WorkloadSummary,
    layout: Layout,
    stages: tuple[Stage, ...],
    costs: CostModel,
    tensor_parallel: TensorParallel | None,
    actions: PipelineActions | None = None,
) -> _Prefix:
    """Stage times, the pipeline simulation and the optimizer step (steps 1, 2 and 4's
    optimizer term of the module docstring); the pipeline over ``actions`` where they are
    not the generated lists (:func:`edited_lists`)."""
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

    held = held_stages(stages, layout)
    fwd, bwd, tp_comm, bwd_layers, sources = [], [], [], [], []
    for st in held:
        f, b, c, per_layer, src = stage_times(workload, st, layout, costs, mb, scale,
                                               tensor_parallel)
        fwd.append(f)
        bwd.append(b)
        tp_comm.append(c)
        bwd_layers.append(per_layer)
        sources.append(src)

    p2p = p2p_ms(workload, layout, stages, costs, scale,
                 [(f + b) / 2 for f, b in zip(fwd, bwd)])
    edited = edited_lists(layout, actions)
    key = (tuple(fwd), tuple(bwd), layout.micro_batches, layout.schedule, v, tuple(p2p),
           None if edited is None else edited.encode())
    cached = costs.pipeline_cache.get(key)
    if cached is None:
        fwd_ms, bwd_ms = [x * 1e3 for x in fwd], [x * 1e3 for x in bwd]
        if edited is not None:  # the plan's own lists, as the runtime runs them
            pipe = simulate_schedule(edited, fwd_ms, bwd_ms, p2p_fwd_ms=p2p or 0,
                                     p2p_bwd_ms=p2p or 0)
        elif v > 1:  # one time per virtual stage (chunks may differ)
            pipe = simulate_named(layout.schedule, layout.pp, layout.micro_batches, v,
                                  fwd_ms, bwd_ms, p2p_fwd_ms=p2p, p2p_bwd_ms=p2p)
        else:  # (one rank of an interleaved layout: no pipeline, no chunks)
            # (Chimera: per stage, each action at its own stage's time)
            name = "1f1b" if layout.schedule == "interleaved-1f1b" else layout.schedule
            pipe = simulate_pipeline(fwd_ms, bwd_ms, layout.micro_batches, name,
                                     p2p_fwd_ms=p2p or 0, p2p_bwd_ms=p2p or 0)
        # each stage's (or, one chunk per rank, each rank's) end of its last backward; under
        # Chimera the stage's, on whichever of its two ranks ends last: its gradients are
        # complete, and its group can finish their sync, only then
        per_stage_ends = v > 1 or layout.stage_copies > 1
        ends = pipe.stage_bwd_end_ms if per_stage_ends else pipe.rank_bwd_end_ms
        cached = costs.pipeline_cache[key] = (pipe, tuple(max(0.0, e * 1e-3) for e in ends))
    pipe, last_bwd_end = cached
    optimizer_s = (_optimizer_s(workload, stages, layout, costs, tensor_parallel)
                   + tied_sync_s(workload, stages, layout, costs))
    return _Prefix(stages, held, stage_of, scale, fwd, bwd, tp_comm, bwd_layers, sources,
                   pipe, last_bwd_end, optimizer_s, edited)


def edited_lists(layout: Layout, actions: PipelineActions | None) -> PipelineSchedule | None:
    """The plan's action lists when it has them, they are lists for ``layout`` and they are
    not those the layout's schedule generates; None otherwise: the named schedule is
    simulated, as for a candidate of the search. O(P * M * v).

    Lists for another pipeline than ``layout``'s (another schedule, micro-batch count, stage
    or rank count: what ``explain`` and ``export`` price when an alternative changes the
    layout) are not this layout's, so that layout's generated lists run; they never reach the
    decoder. A plan's own lists always match its layout (validator rule 4).

    Raises:
        PipelineScheduleError: lists of the layout's shape that cannot run (the plan's
            validator refuses them first).
    """
    if actions is None or layout.pp == 1 or not _lists_fit(layout, actions):
        return None
    generated = build_schedule(layout.schedule, layout.pp, layout.micro_batches,
                               layout.virtual_stages)
    if tuple(actions.ranks) == generated.encode():
        return None
    return decode_schedule(actions.schedule, actions.micro_batches, actions.num_stages,
                           actions.ranks)


def _lists_fit(layout: Layout, actions: PipelineActions) -> bool:
    """Whether ``actions`` are lists for ``layout``'s pipeline (what rule 4 of the validator
    requires of a plan's own lists)."""
    return (actions.schedule == layout.schedule
            and actions.micro_batches == layout.micro_batches
            and actions.num_stages == layout.pp * layout.virtual_stages
            and len(actions.ranks) == layout.pp)


#: Per stage with a DP sync: (its backprop segments per layer, its :class:`_SyncPrep`, its
#: simulator units).
_Built = dict[int, tuple[list[float], "_SyncPrep", list[SyncUnit]]]


def _build_units(
    workload: WorkloadSummary,
    layout: Layout,
    costs: CostModel,
    pre: _Prefix,
    strategies: list[list[tuple[list[int], UnitStrategy]]],
    tensor_parallel: TensorParallel | None,
    preps: dict[int, _SyncPrep] | None = None,
) -> _Built:
    """The simulator units of every stage that syncs (step 3's inputs); ``preps`` keeps each
    stage's :class:`_SyncPrep` between calls on the same prefix."""
    built: _Built = {}
    for s, st in enumerate(pre.held):
        if layout.sync_group_size > 1 and strategies[s]:
            # after the flush, sync starts when the stage's last backward has ended: the
            # timeline runs over no backprop (every gradient is ready at once)
            backprop = (pre.bwd_layers[s] if costs.dp_overlap == "backward"
                        else [0.0] * len(pre.bwd_layers[s]))
            prep = None if preps is None else preps.get(s)
            if prep is None:
                prep = _sync_prep(workload, st, layout, costs, backprop,
                                  max_layer_shares(workload, st, layout.tp, tensor_parallel))
                if preps is not None:
                    preps[s] = prep
            built[s] = (backprop, prep,
                        _stage_units(workload, st, layout, costs, strategies[s], prep))
    return built


def _sync_floor(pre: _Prefix, built: _Built, costs: CostModel) -> float:
    """A lower bound of the iteration step 3 and 4 give for ``built``: each stage's
    :func:`_timeline_floor` in place of its simulated timeline, less a relative ``1e-9``
    (the floor adds the same durations in another order than the simulator)."""
    overlap = costs.dp_overlap == "backward"
    floor = pre.optimizer_s + max(
        pre.last_bwd_end[s] + (max(_timeline_floor(built[s][1].segments, built[s][2])
                                   - (pre.bwd[s] if overlap else 0.0), 0.0)
                               if s in built else 0.0)
        for s in range(len(pre.stages)))
    return floor * (1.0 - 1e-9)


def _sync_all(
    workload: WorkloadSummary,
    layout: Layout,
    costs: CostModel,
    pre: _Prefix,
    strategies: list[list[tuple[list[int], UnitStrategy]]],
    record: bool,
    tensor_parallel: TensorParallel | None,
    built: _Built | None = None,
) -> tuple[list[StageCost], list[DPTimeline | None], float, float, list[float]]:
    """Step 3 for every stage: (stage costs, DP timelines, busiest channel, largest
    compression time, each stage's finish: last backward end + exposed sync); ``built``:
    :func:`_build_units` of ``strategies`` if already made."""
    if built is None:
        built = _build_units(workload, layout, costs, pre, strategies, tensor_parallel)
    overlap = costs.dp_overlap == "backward"
    stage_costs, timelines = [], []
    comm_busy = compression = 0.0
    finish = []
    waits: dict[int, float] = {}  # each stage's hand-over wait (gloo profiles)
    # stages with the same backprop segments and the same units (a deep pipeline of repeated
    # blocks on one device class) have the same timeline: simulated once
    same: dict[tuple[float, ...], list[tuple[list[SyncUnit], DPTimeline]]] = {}
    for s in range(len(pre.stages)):
        tl = None
        exposed = busy = comp = 0.0
        if s in built:
            backprop, prep, units = built[s]
            seen = same.setdefault(tuple(prep.segments), []) if not record else []
            tl = next((t for u, t in seen if _same_units(u, units)), None)
            if tl is None:
                tl = simulate_dp(prep.segments, units, record=record)
                seen.append((units, tl))
            exposed = tl.iteration_s - (pre.bwd[s] if overlap else 0.0)
            if costs.comm.has_handovers:  # gloo profiles; GPU and analytic plans skip it
                waits[s] = _sync_wait_s(costs, prep, prep.group, pre.bwd[s], strategies[s],
                                        _rank_step_s(pre, layout, s))
                exposed += waits[s]
                if _synced_in_backward(costs, layout, prep):
                    exposed = 0.0
            busy, comp = _comm_and_compression_s(units)
        stage_costs.append(StageCost(pre.fwd[s], pre.bwd[s], pre.tp_comm[s], exposed, busy,
                                     comp, pre.sources[s]))
        timelines.append(tl)
        comm_busy = max(comm_busy, busy)
        compression = max(compression, comp)
        finish.append(pre.last_bwd_end[s] + max(exposed, 0.0))
    if layout.virtual_stages > 1 or layout.stage_copies > 1:
        _share_rank_channels(layout, costs, pre, built, waits, stage_costs, finish)
    if layout.stage_copies > 1:  # a Chimera rank's links carry both its stages' syncs
        comm_busy = max([comm_busy] + [sum(stage_costs[s].sync_busy_s for s in pair)
                                        for pair in _rank_chunks(layout, len(pre.stages))])
    return stage_costs, timelines, comm_busy, compression, finish


def _share_rank_channels(layout: Layout, costs: CostModel, pre: _Prefix, built: _Built,
                         waits: dict[int, float], stage_costs: list[StageCost],
                         finish: list[float]) -> None:
    """Interleaved stages: a rank's chunks sync through the same links, one after another
    (under Chimera a rank's two stages ``r`` and ``pp-1-r``, likewise: :func:`_rank_chunks`).

    Each chunk's timeline above has the links to itself; here the units of every chunk a
    rank holds run in one timeline, as they do on the rank's NICs and NVLink: with
    ``dp_overlap="backward"`` each chunk's units become ready during its own last backward
    (the rank's other work between those backwards is compute the sync does not wait for);
    after the flush all of them start when the rank's last backward has ended, chunk by
    chunk (Megatron-LM all-reduces its model chunks in order). The rank's last chunk then
    finishes when that timeline does (plus the largest of its chunks' hand-over waits, on
    gloo profiles: one sync phase per rank);
    ``finish`` and that chunk's :class:`StageCost` are updated in place. A chunk whose sync
    runs inside its backward (ZeRO-3 on gloo, measured) takes no part."""
    overlap = costs.dp_overlap == "backward"
    for held in _rank_chunks(layout, len(pre.stages)):
        chunks = [s for s in held
                  if s in built and not (costs.comm.has_handovers
                                         and _synced_in_backward(costs, layout, built[s][1]))]
        if len(chunks) < 2:
            continue
        last = max(chunks, key=lambda s: (pre.last_bwd_end[s], s))
        end = pre.last_bwd_end[last]
        segments: list[float] = []
        units: list[SyncUnit] = []
        t0 = t = end  # after the flush: every chunk's units are ready at the rank's end
        if overlap:  # each chunk's segments where its last backward ran
            chunks.sort(key=lambda s: (pre.last_bwd_end[s], s))
            t0 = t = pre.last_bwd_end[chunks[0]] - pre.bwd[chunks[0]]
        for s in chunks:
            seg = built[s][1].segments
            if overlap:
                start = pre.last_bwd_end[s] - pre.bwd[s]
                if start > t:  # the rank's other work between two chunks' backwards
                    segments.append(start - t)
                    t = start
                t += sum(seg)
            base = len(segments)
            segments.extend(seg if overlap else [0.0] * len(seg))
            units.extend(replace(u, last_tensor=u.last_tensor + base) for u in built[s][2])
        if not units:
            continue
        tl = simulate_dp(segments, units)
        done = t0 + tl.iteration_s
        # the hand-over wait once per rank: the runtime syncs all of a rank's chunks in one
        # phase (one GradSync over its parameters), which the records time once
        done += max((waits.get(s, 0.0) for s in chunks), default=0.0)
        if done > finish[last]:
            finish[last] = done
            c = stage_costs[last]
            stage_costs[last] = replace(c, exposed_sync_s=done - end)


def _rank_chunks(layout: Layout, n: int) -> list[list[int]]:
    """The stages whose syncs share one rank's links, per rank: its interleaved chunks
    ``r, r + pp, ...``; under Chimera the pair ``r, pp-1-r``, listed once (both pipeline
    ranks of the pair hold both stages and sync both, over the same group)."""
    if layout.stage_copies > 1:
        return [[r, layout.pp - 1 - r] for r in range(layout.pp // 2)]
    return [list(range(r, n, layout.pp)) for r in range(layout.pp)]


def _same_units(a: list[SyncUnit], b: list[SyncUnit]) -> bool:
    """Whether :func:`simulate_dp` times ``a`` and ``b`` alike (same ready tensors and ops; a
    unit's name only labels it)."""
    return len(a) == len(b) and all(x.last_tensor == y.last_tensor and x.ops == y.ops
                                    for x, y in zip(a, b))


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
    return _units_from_groups(workload, _sync_groups(sync), stage_of, num_stages, sparse)


def _sync_groups(sync: GradientSync | None) -> list[tuple[list[str], SyncStrategy]]:
    """The sync units a gradient-sync section names: each bucket, then each per-tensor
    entry outside the buckets, with its strategy."""
    if sync is None:
        return []
    per_tensor = {t.name: t.strategy for t in sync.tensors}
    groups = [(list(b.tensors), b.strategy) for b in sync.buckets]
    in_bucket = {n for names, _ in groups for n in names}
    groups += [([n], s) for n, s in per_tensor.items() if n not in in_bucket]
    return [(names, sync.strategies[s]) for names, s in groups]


def _units_from_groups(
    workload: WorkloadSummary,
    groups: list[tuple[list[str], SyncStrategy]],
    stage_of: list[int],
    num_stages: int,
    sparse: SparseSync | None = None,
) -> list[list[tuple[list[int], UnitStrategy]]]:
    """:func:`_units_by_stage` of the units ``groups`` (see :func:`_sync_groups`)."""
    index = _grad_index(workload)
    out: list[list[tuple[list[int], UnitStrategy]]] = [[] for _ in range(num_stages)]
    covered: set[int] = set()
    for name, entry in (sparse.synced() if sparse is not None else {}).items():
        if name in index:
            i = index[name]
            out[stage_of[workload.grads[i].layer_index]].append(([i], entry))
            covered.add(i)
    for names, strategy in groups:
        # Every name is a gradient of the workload and a bucket stays in one stage: the
        # plan's validation checks both (hetplan.ir.plan_checks, rule 6).
        idx = sorted(index[n] for n in names if index[n] not in covered)
        if not idx:
            continue
        stages = {stage_of[workload.grads[i].layer_index] for i in idx}
        assert len(stages) == 1, (names[:3], sorted(stages))
        out[stages.pop()].append((idx, strategy))
        covered.update(idx)
    default = NoSync()
    for i, g in enumerate(workload.grads):
        if i not in covered:
            out[stage_of[g.layer_index]].append(([i], default))
    for units in out:
        units.sort(key=lambda u: u[0][-1])
    return out


#: :func:`_grad_index` of the last few workloads, by id (with the workload, which keeps its id
#: unique while it is cached).
_GRAD_INDEX: dict[int, tuple[WorkloadSummary, dict[str, int]]] = {}


def _grad_index(workload: WorkloadSummary) -> dict[str, int]:
    """``{gradient name: its index in workload.grads}``, built once per workload (a search
    prices thousands of sync sections of the same workload)."""
    hit = _GRAD_INDEX.get(id(workload))
    if hit is not None and hit[0] is workload:
        return hit[1]
    if len(_GRAD_INDEX) >= 8:
        _GRAD_INDEX.clear()
    index = {g.name: i for i, g in enumerate(workload.grads)}
    _GRAD_INDEX[id(workload)] = (workload, index)
    return index


@dataclass
class _SyncPrep:
    """What a stage's DP timeline needs that does not depend on the sync strategies: the
    stage's gradients (ready order) and backprop segments, its DP group (``group`` ranks:
    ``Layout.sync_group_size``), the reduce dtype, the TP shares, and each unit's bytes by
    its gradient indices (filled as asked)."""

    grad_idx: list[int]
    segments: list[float]
    position: dict[int, int]
    group: int
    link: str
    nodes: int
    per_node: int
    dtypes: SyncDtypes
    shares: list[float] | None
    nbytes: dict[tuple[int, ...], float]


def _sync_prep(workload: WorkloadSummary, st: Stage, layout: Layout, costs: CostModel,
               bwd_per_layer: list[float], shares: list[float] | None) -> _SyncPrep:
    """``st`` with the ranks holding it (``_Prefix.held``): its group is one rank of each
    TP group among them."""
    grad_idx, segments = _stage_segments(workload, st, bwd_per_layer, costs)
    dp_ranks = [r for k, r in enumerate(st.ranks) if k % layout.tp == 0]
    link, nodes, per_node = group_link(costs, dp_ranks)
    return _SyncPrep(grad_idx, segments, {i: k for k, i in enumerate(grad_idx)},
                     layout.sync_group_size, link, nodes, per_node,
                     _sync_dtypes(workload, st, layout, costs), shares, {})


def _stage_units(
    workload: WorkloadSummary,
    st: Stage,
    layout: Layout,
    costs: CostModel,
    units: list[tuple[list[int], UnitStrategy]],
    prep: _SyncPrep,
) -> list[SyncUnit]:
    """The simulator's sync units of one stage, in ready order. A strategy's ops at one size
    are built once per call: units of equal bytes and strategy (a repeated block's buckets)
    share them."""
    shares = prep.shares
    dev = costs.devices[st.ranks[0]]
    built: dict[tuple[int, float], tuple[Op, ...]] = {}
    sync_units = []
    for idx, strategy in units:
        key_idx = tuple(idx)
        nbytes = prep.nbytes.get(key_idx)
        if nbytes is None:
            split = costs.memory_layers(workload)
            nbytes = prep.nbytes[key_idx] = sum(
                shard_bytes(split, workload.grads[i].size_bytes,
                            workload.grads[i].layer_index, layout.tp,
                            None if shares is None
                            else shares[workload.grads[i].layer_index - st.first_layer])
                for i in idx
            )
        if isinstance(strategy, SparseTensorSync):
            channel = _level_group("flat", dev, prep.group, prep.link, prep.nodes,
                                   prep.per_node)[2]
            ops = sparse_ops(strategy, prep.group, costs, dev, prep.link, channel)
        else:
            # the strategy objects live through this call, so their ids are stable keys
            okey = (id(strategy), nbytes)
            got = built.get(okey)
            if got is None:
                got = built[okey] = _strategy_ops(strategy, nbytes, costs, st, prep.group,
                                                  prep.link, prep.nodes, prep.per_node,
                                                  prep.dtypes)
            ops = got
        sync_units.append(SyncUnit(prep.position[idx[-1]], ops, workload.grads[idx[-1]].name))
    sync_units.sort(key=lambda u: u.last_tensor)
    return sync_units


def _timeline_floor(segments: list[float], units: list[SyncUnit]) -> float:
    """A time :func:`simulate_dp` ``(segments, units).iteration_s`` is never below (up to
    float rounding: the simulator adds the same durations in another order): backprop alone;
    backprop plus every GPU op (one compute stream); every op of one communication channel
    one after the other (FIFO, from time 0); and each unit's ops one after the other from
    its tensor's ready time with undelayed backprop."""
    ready = []
    t = 0.0
    for b in segments:
        t += b
        ready.append(t)
    floor = t
    busy: dict[str, float] = {}
    for u in units:
        chain = ready[u.last_tensor]
        for op in u.ops:
            chain += op.duration_s
            if op.resource != CPU:  # the CPU pool has several workers
                busy[op.resource] = busy.get(op.resource, 0.0) + op.duration_s
        floor = max(floor, chain)
    floor = max(floor, t + busy.pop(GPU, 0.0), *busy.values())
    return floor


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
    workload: WorkloadSummary, st: Stage, bwd_per_layer: list[float],
    costs: CostModel | None = None,
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
    grads = ([i for i, g in enumerate(workload.grads) if first <= g.layer_index <= st.last_layer]
             if costs is None else _stage_grads(workload, costs, first, st.last_layer))
    segments = []
    prev = 0.0
    for i in grads:
        ready = max(end_of_layer[workload.grads[i].layer_index], prev)
        segments.append(ready - prev)
        prev = ready
    if segments:
        segments[-1] += t - prev
    return grads, segments


def _stage_grads(workload: WorkloadSummary, costs: CostModel, first: int,
                 last: int) -> list[int]:
    """The gradients of layers ``first..last`` (workload indices, ready order), from a
    per-workload table of each layer's gradients kept in ``costs.memo``."""
    key = ("grads_by_layer", id(workload))
    by_layer: list[list[int]] | None = costs.memo.get(key)
    if by_layer is None:
        costs.memo[("workload", id(workload))] = workload  # its id stays unique while cached
        by_layer = [[] for _ in workload.layers]
        for i, g in enumerate(workload.grads):
            by_layer[g.layer_index].append(i)
        costs.memo[key] = by_layer
    if last - first + 1 == len(by_layer):
        return list(range(len(workload.grads)))
    return sorted(i for layer in by_layer[first:last + 1] for i in layer)


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
    """One :class:`StageSync` per stage that has gradients (none when its group has one
    rank: ``dp == 1`` but under Chimera). The group is the ranks holding a copy of the
    stage (:func:`~hetplan.cost_models.rank_memory.held_stages`): its ``dp`` replicas, and
    under Chimera also those of its mirror ``pp-1-s`` (``StageSync.dp`` is
    ``Layout.sync_group_size``, ``link`` / ``nodes`` / ``per_node`` those ranks'), as
    :func:`evaluate` syncs it."""
    if layout.sync_group_size <= 1:
        return []
    if not stages:
        stages = (Stage(index=0, first_layer=0, last_layer=len(workload.layers) - 1,
                        ranks=tuple(range(layout.num_ranks))),)
    out = []
    for plan_st, st in zip(stages, held_stages(stages, layout)):
        _, _, _, per_layer, _ = stage_times(workload, st, layout, costs,
                                             layout.micro_batch_size,
                                             layout.micro_batch_size / workload.batch_size)
        grads, segments = _stage_segments(workload, st, per_layer, costs)
        if not grads:
            continue
        dp_ranks = [r for k, r in enumerate(st.ranks) if k % layout.tp == 0]
        link, nodes, per_node = group_link(costs, dp_ranks)
        split = costs.memory_layers(workload)
        nbytes = tuple(shard_bytes(split, workload.grads[i].size_bytes,
                                   workload.grads[i].layer_index, layout.tp) for i in grads)
        out.append(StageSync(plan_st, tuple(grads), tuple(segments), nbytes,
                             layout.sync_group_size, link, nodes, per_node,
                             _sync_dtypes(workload, st, layout, costs)))
    return out


class SyncScorer:
    """The predicted iteration time of many gradient-sync sections of one plan, for passes
    that score candidates (Espresso's routings): :func:`evaluate`'s ``iteration_s`` with
    ``check_memory=False``, bit for bit (the same functions, the same float operations in
    the same order), with what does not depend on the sync — stage times, the pipeline, the
    optimizer step, each stage's backprop segments, DP group and unit bytes — computed once.

    Args:
        workload / layout / stages / costs / tensor_parallel / sparse_sync: as for
            :func:`evaluate`.
    """

    def __init__(self, workload: WorkloadSummary, layout: Layout, stages: tuple[Stage, ...],
                 costs: CostModel, *, tensor_parallel: TensorParallel | None = None,
                 sparse_sync: SparseSync | None = None) -> None:
        self._workload, self._layout, self._costs = workload, layout, costs
        self._tp, self._sparse = tensor_parallel, sparse_sync
        self._pre = _prefix(workload, layout, stages, costs, tensor_parallel)
        self._preps: dict[int, _SyncPrep] = {}
        #: the section rerouted last, and its units with a placeholder strategy
        self._rerouted: tuple[GradientSync, _Units] | None = None

    def iteration_s(self, gradient_sync: GradientSync | None,
                    below: float | None = None) -> float:
        """``evaluate(..., gradient_sync, check_memory=False).iteration_s``.

        ``below``: a threshold the caller compares with; when a lower bound of the time
        (:func:`_sync_floor`) shows it is not below ``below``, that bound is returned without
        simulating the sync (a number ``>= below``, so ``result < below`` is decided as
        the exact time would decide it)."""
        pre = self._pre
        units = _units_from_groups(self._workload, _sync_groups(gradient_sync), pre.stage_of,
                                   len(pre.stages), self._sparse)
        return self._iteration(units, below)

    def rerouted_s(self, gradient_sync: GradientSync, strategy: SyncStrategy,
                   below: float | None = None) -> float:
        """:meth:`iteration_s` of ``gradient_sync``'s buckets all synced by ``strategy``,
        without per-tensor entries: the section ``GradientSync(strategies={name:
        strategy}, buckets=<its buckets, each on name>)``, without building it."""
        if self._rerouted is None or self._rerouted[0] is not gradient_sync:
            groups = [(list(b.tensors), _PLACEHOLDER) for b in gradient_sync.buckets]
            pre = self._pre
            self._rerouted = (gradient_sync, _units_from_groups(
                self._workload, groups, pre.stage_of, len(pre.stages), self._sparse))
        units = [[(idx, strategy if st is _PLACEHOLDER else st) for idx, st in stage]
                 for stage in self._rerouted[1]]
        return self._iteration(units, below)

    def _iteration(self, units: _Units, below: float | None) -> float:
        pre = self._pre
        built = _build_units(self._workload, self._layout, self._costs, pre, units, self._tp,
                             self._preps)
        if below is not None:
            floor = _sync_floor(pre, built, self._costs)
            if floor >= below:
                return floor
        finish = _sync_all(self._workload, self._layout, self._costs, pre, units, False,
                           self._tp, built)[4]
        return max(finish) + pre.optimizer_s


#: The strategy :meth:`SyncScorer.rerouted_s` puts in place of its argument.
_PLACEHOLDER = NoSync()


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


def optimizer_step_s(workload: WorkloadSummary, stages: tuple[Stage, ...], layout: Layout,
                     costs: CostModel) -> float:
    """The optimizer step of the slowest pipeline rank of ``stages`` under ``layout``, as
    :func:`evaluate` prices it (see :func:`_optimizer_s`): what a heterogeneous plan's
    stages are priced with too, each on its projection as a plan of its own."""
    return _optimizer_s(workload, stages, layout, costs)


def _optimizer_s(
    workload: WorkloadSummary, stages: tuple[Stage, ...], layout: Layout, costs: CostModel,
    tp_section: TensorParallel | None = None,
) -> float:
    """The optimizer step of the slowest pipeline rank (:mod:`hetplan.cost_models.optimizer_step`):
    the bytes its kernels move over memory bandwidth plus a launch per kernel; under ZeRO
    each rank steps ``1/dp`` of the elements. A rank holding several stages (interleaved
    chunks; under Chimera its stages ``r`` and ``pp-1-r``) steps them all in one optimizer,
    and ZeRO shards over the group averaging their gradients (``Layout.sync_group_size``).

    Where the profile DB has a measured optimizer step for the rank's device types
    (:class:`~hetplan.cost_models.profile_db.OptimizerRecord`, ``hetplan profile --what
    step``), that line prices it instead: a cost per parameter tensor stepped (the optimizer's
    Python and dispatch per tensor, what dominates a small model on a CPU) plus a cost per
    fp32 byte, measured with as many processes stepping at once as the node has ranks.
    Under ZeRO-3, where a gloo profile timed FSDP2's step over the sharded model
    (``zero3_step`` record, :func:`_measured_zero3_step_s`), that step prices it."""
    measured = _measured_zero3_step_s(workload, stages, layout, costs, tp_section)
    if measured is None:
        measured = _measured_step_s(workload, stages, layout, costs, tp_section)
    if measured is not None:
        return measured
    dp = layout.sync_group_size if layout.zero_stage >= 1 else 1
    nbytes: dict[int, float] = {}
    tensors: dict[int, int] = {}
    precs: dict[int, StatePrecision] = {}
    bws: dict[int, float] = {}
    for st in stages:
        prec = stage_precision(workload, st, costs)
        pbytes, count = _stage_params(workload, st, layout, costs, tp_section)
        per_elem = step_bytes(prec, costs.optimizer, dp=dp)
        bw = min(d.mem_bandwidth_bytes_per_s for d in rank_devices(costs, st))
        for s in layout.stage_holders(st.index):
            nbytes[s] = nbytes.get(s, 0.0) + per_elem * pbytes / prec.capture_bytes
            tensors[s] = tensors.get(s, 0) + count
            precs.setdefault(s, prec)
            bws[s] = min(bws.get(s, bw), bw)
    return max((step_seconds(nbytes[s], step_kernels(precs[s], costs.optimizer, tensors[s],
                                                      dp=dp), bws[s])
                for s in nbytes), default=0.0)


def _stage_params(workload: WorkloadSummary, st: Stage, layout: Layout, costs: CostModel,
                  tp_section: TensorParallel | None) -> tuple[float, int]:
    """A stage's parameter bytes on its most loaded TP rank (capture dtype) and its number
    of parameter tensors: what one rank's optimizer step of that stage touches."""
    shares = max_layer_shares(workload, st, layout.tp, tp_section)
    split = costs.memory_layers(workload)
    pbytes = sum(
        shard_bytes(split, lay.param_bytes, st.first_layer + k, layout.tp,
                     None if shares is None else shares[k])
        for k, lay in enumerate(workload.layers[st.first_layer : st.last_layer + 1])
    )
    return pbytes, len(_stage_grads(workload, costs, st.first_layer, st.last_layer))


def _measured_zero3_step_s(workload: WorkloadSummary, stages: tuple[Stage, ...],
                           layout: Layout, costs: CostModel,
                           tp_section: TensorParallel | None) -> float | None:
    """The slowest pipeline rank's ZeRO-3 optimizer step from the profile's ``zero3_step``
    record of its data-parallel group (:mod:`hetplan.profiling.sync_step`: FSDP2's step over
    the profiled model's sharded parameters, as the runtime's ZeRO-3 runs it), scaled by
    the stage's fp32 parameter bytes over the profiled model's, as the ZeRO-3 phases are
    (:func:`~hetplan.cost_models.stage_times.stage_times`). None below ZeRO-3 or without
    the record (GPU and analytic plans, older profiles)."""
    if layout.zero_stage < 3 or layout.dp < 2 or not costs.comm.has_handovers:
        return None
    per_rank: dict[int, float] = {}
    for st in stages:
        dp_ranks = [r for k, r in enumerate(st.ranks) if k % layout.tp == 0]
        link, _, _ = group_link(costs, dp_ranks)
        rec = costs.comm.measured_s("zero3_step", layout.dp, link, 0.0)
        if rec is None:
            return None
        prec = stage_precision(workload, st, costs)
        pbytes, _ = _stage_params(workload, st, layout, costs, tp_section)
        s = st.index % layout.pp
        per_rank[s] = per_rank.get(s, 0.0) + rec[0] * pbytes / prec.capture_bytes * 4 / rec[1]
    return max(per_rank.values(), default=0.0)


def _measured_step_s(workload: WorkloadSummary, stages: tuple[Stage, ...], layout: Layout,
                     costs: CostModel, tp_section: TensorParallel | None) -> float | None:
    """The slowest pipeline rank's optimizer step from the profile's measured lines (see
    :func:`_optimizer_s`); None when the DB lacks one for a device type of the plan. Under
    ZeRO-1/2 a rank steps views of its ``1/dp`` chunk of each parameter (about ``tensors /
    dp`` of them) and ``1/dp`` of the bytes; FSDP2 (ZeRO-3) steps every parameter's local
    shard."""
    if costs.db is None or not costs.db.optimizer_steps:
        return None
    group = layout.sync_group_size  # Chimera: 2·dp ranks hold each stage
    sharded = layout.zero_stage >= 1 and group > 1
    per_rank: dict[int, float] = {}
    for st in stages:
        prec = stage_precision(workload, st, costs)
        pbytes, count = _stage_params(workload, st, layout, costs, tp_section)
        tensors = float(count)
        fp32_bytes = pbytes / prec.capture_bytes * 4.0
        if sharded:
            fp32_bytes /= group
            if layout.zero_stage <= 2:
                tensors = math.ceil(tensors / group)
        worst = 0.0
        for dev in rank_devices(costs, st):
            rec = costs.db.optimizer_step(costs.optimizer, dev.type,
                                          costs.node_sizes[dev.node_index])
            if rec is None:
                return None
            worst = max(worst, rec.time_s(tensors, fp32_bytes) * dev.slowdown)
        for s in layout.stage_holders(st.index):
            per_rank[s] = per_rank.get(s, 0.0) + worst
    return max(per_rank.values(), default=0.0)


def _step_bytes(prec: StatePrecision, optimizer: str) -> float:
    """Bytes the optimizer step moves per parameter element without ZeRO
    (:func:`hetplan.cost_models.optimizer_step.step_bytes`; the search's lower bound uses it)."""
    return step_bytes(prec, optimizer)
