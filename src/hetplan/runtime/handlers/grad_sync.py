"""The ``gradient_sync`` section: the plan's buckets and strategies on the data-parallel group.

A thin adapter over :class:`~hetplan.runtime.grad_sync.GradSync`: built over this rank's
parameters once the stage handler chose them, hooks held back while gradients accumulate,
every bucket finished (and averaged) after the last backward, rebuilt when re-balancing moves
parameters. Under ZeRO-2 and -3 the ZeRO handler owns the gradient path (reduce-scatter), and
this handler syncs nothing.

Without a pipeline (``pp == 1``, no per-stage degrees) the fast path's gradients are views of
their bucket's buffer (``GradSync(grad_views=True)``): backward accumulates straight into the
buffer the collective sends, and :meth:`GradSyncHandler.after_step` zeroes the buffers after
the optimizer step (whose ``zero_grad`` set the gradients to None) and points the gradients
back at them. A pipeline keeps the copy path (views are built and tested for the
single-stage step only; the stage handler sums a tied weight's copies after this sync, and
a copy path writes a synced zero gradient to a stage's unused alias of it). Every bucket
of a pipeline on NCCL is launched stage by stage: when a stage's last backward of the step
has ended, its flat-allreduce buckets start syncing while the rank's later stages still
compute (:func:`overlaps_compute`; on gloo, and for the other paths, every bucket launches
after the schedule); :meth:`GradSyncHandler.after_backward` launches what is left and waits
for all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection
from contextlib import AbstractContextManager
from typing import Any

from hetplan.runtime.composition import effective_zero_stage
from hetplan.runtime.grad_sync import GradSync
from hetplan.runtime.handlers.base import Handler, RuntimeContext
from hetplan.runtime.handlers.sparse_sync import sparse_names

__all__ = ["GradSyncHandler"]


class GradSyncHandler(Handler):
    """Synchronises gradients across data-parallel replicas as the plan's section says.

    Attributes:
        sync: the gradient path over this rank's current parameters (None before setup).
    """

    section = "gradient_sync"

    def __init__(self) -> None:
        self.sync: GradSync | None = None
        self.early = False  # launch a pipeline stage's buckets as it finishes (setup)

    def setup(self, ctx: RuntimeContext) -> None:
        if effective_zero_stage(ctx.layout) >= 2:
            return  # ZeroHandler reduce-scatters the gradients
        groups = ctx.groups
        sparse = sparse_names(ctx)  # synced by the sparse-sync handler instead
        sp = _sequence_parallel_ids(ctx)  # averaged by the TP handler after its TP sum
        named = [(n, p) for n, p in ctx.named_params if n not in sparse and id(p) not in sp]
        if ctx.plan.group_sync is not None and ctx.plan.group_sync.policy == "sdpipe":
            groups = None  # gradients stay local: the group-sync handler averages parameters
        self.sync = GradSync(named, ctx.plan.gradient_sync,
                             groups.dp_group if groups is not None else None,
                             len(groups.dp_ranks) if groups is not None else 1,
                             groups.sync_levels() if groups is not None else None,
                             grad_views=ctx.layout.pp == 1 and ctx.plan.hetero is None)
        self.early = self.sync.group is not None and overlaps_compute(self.sync.group)

    def accumulating(self, ctx: RuntimeContext) -> AbstractContextManager[None]:
        return self.sync.no_sync() if self.sync is not None else contextlib.nullcontext()

    def stage_gradients_final(self, ctx: RuntimeContext, params: Collection[int]) -> None:
        if self.sync is not None and self.early:  # a stage's buckets, while others compute
            self.sync.launch_final(params)

    def after_backward(self, ctx: RuntimeContext) -> None:
        if self.sync is not None:
            self.sync.finish()

    def after_step(self, ctx: RuntimeContext) -> None:
        if self.sync is not None:
            self.sync.zero_grad()

    def params_changed(self, ctx: RuntimeContext) -> None:
        self.close(ctx)
        self.setup(ctx)

    def close(self, ctx: RuntimeContext) -> None:
        if self.sync is not None:
            self.sync.close()
            self.sync = None


def overlaps_compute(group: Any) -> bool:
    """Whether a collective on ``group`` runs beside the stages' compute: NCCL (its own
    streams and SMs), not gloo, which reduces and copies on the CPU cores the stages compute
    on (the cost model's ``comm_overlaps_compute: false`` for the ``cpu`` type). Measured on
    the CPU presets' machine, launching a pipeline stage's buckets early moved 3.7 ms a step
    from the exposed sync into the bubble and left the step 1.8 ms slower (three pairs of
    runs, ``docs/decisions/cpu-fidelity.md`` section 16), so gloo groups keep launching
    after the schedule."""
    import torch.distributed as dist

    return str(dist.get_backend(group)) == "nccl"


def _sequence_parallel_ids(ctx: RuntimeContext) -> set[int]:
    """``id`` of the parameters whose gradients the TP handler sums over the TP group and
    then averages over the data-parallel group itself (sequence parallelism)."""
    from hetplan.runtime.handlers.tensor_parallel import (
        TensorParallelHandler,
        dp_averages_sp_params,
    )

    tp = next((h for h in ctx.handlers if isinstance(h, TensorParallelHandler)), None)
    if tp is None or not dp_averages_sp_params(ctx):
        return set()
    return {id(p) for p in tp.sp_params}
