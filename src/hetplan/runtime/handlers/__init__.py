"""The runtime's handlers: one per plan section; :class:`~hetplan.runtime.executor.Runtime`
only composes them.

A handler (:class:`Handler`) declares the plan section it executes (``section``), sets up
from the plan (:meth:`Handler.setup`) and hooks into the step. One step of the runtime is::

    loss = first non-None h.run_micro_batches(ctx, inputs, target)   # forward + backward
    h.after_backward(ctx)            for every handler               # e.g. finish grad sync
    h.after_sync(ctx)                for every handler               # e.g. sum tied copies
    optimizer step                                                   # ctx.optimizer
    h.after_step(ctx)                for every handler               # e.g. controller, events

plus :meth:`Handler.accumulating` (backward passes that only accumulate gradients),
:meth:`Handler.params_changed` (re-balancing moved parameters) and :meth:`Handler.close`.
Handlers share one :class:`RuntimeContext`; a handler that builds on another's state looks it
up with :meth:`RuntimeContext.handler` (re-balancing rebuilds the stage handler's stages).

:data:`DEFAULT_HANDLERS`, in setup order (each may use what the earlier ones set up):

========================== =============================== ================================
handler                    section                         does
========================== =============================== ================================
CompositionHandler         (all)                           refuses combinations the runtime
                                                           does not compose
TensorParallelHandler      ``tensor_parallel``             Megatron TP: uneven MLP shards,
                                                           attention by heads, vocabulary-
                                                           parallel embedding / head / loss,
                                                           sequence parallelism
ResizingHandler            ``tensor_parallel.controller``  ZERO / migration / SEMI per step
StagesHandler              ``stages``,                     this rank's stages; runs the
                           ``pipeline_actions``,           plan's action list (or the
                           ``hetero``                      micro-batches locally); sums
                                                           tied weights' gradients after
                                                           the sync; per-stage degrees:
                                                           ``hetero.py``; Chimera:
                                                           ``chimera.py``
PrecisionHandler           ``precision``                   16-bit working weights, autocast,
                                                           fp32 loss, fp16 loss scale
RecomputeHandler           ``stages.recompute``            checkpoint per block / per
                                                           attention core
ZeroHandler                ``layout.zero_stage``           fp32 master shard, ZeRO-1/2
                                                           optimizer, ZeRO-3 (FSDP2)
GradSyncHandler            ``gradient_sync``               buckets, compression, all-reduce
SparseSyncHandler          ``sparse_sync``                 Zen / AGsparse for embeddings
RebalancingHandler         ``rebalancing``                 planned stage moves, re-packing
CheckpointingHandler       ``checkpointing``               Gemini snapshots, replicas to
                                                           holders, recovery on restart
GroupSyncHandler           ``group_sync``                  SDPipe: local step, then average
                                                           with the scheduler's group
========================== =============================== ================================

**Adding a plan section's execution** is adding a handler: a module here with a
:class:`Handler` subclass that names its ``section`` and overrides the hooks it needs, and its
class in :data:`DEFAULT_HANDLERS` at the place its setup belongs. Nothing in ``Runtime``
changes.
"""

from __future__ import annotations

from hetplan.runtime.handlers.base import (
    Handler,
    LossFn,
    OptimizerFactory,
    RuntimeContext,
    StepTimes,
)
from hetplan.runtime.handlers.checkpointing import CheckpointingHandler
from hetplan.runtime.handlers.composition import CompositionHandler
from hetplan.runtime.handlers.grad_sync import GradSyncHandler
from hetplan.runtime.handlers.group_sync import GroupSyncHandler
from hetplan.runtime.handlers.precision import PrecisionHandler
from hetplan.runtime.handlers.rebalancing import RebalancingHandler
from hetplan.runtime.handlers.recompute import RecomputeHandler
from hetplan.runtime.handlers.sparse_sync import SparseSyncHandler
from hetplan.runtime.handlers.stages import StagesHandler
from hetplan.runtime.handlers.tensor_parallel import ResizingHandler, TensorParallelHandler
from hetplan.runtime.handlers.zero import ZeroHandler

__all__ = [
    "DEFAULT_HANDLERS",
    "CheckpointingHandler",
    "CompositionHandler",
    "GradSyncHandler",
    "GroupSyncHandler",
    "Handler",
    "LossFn",
    "OptimizerFactory",
    "PrecisionHandler",
    "RebalancingHandler",
    "RecomputeHandler",
    "ResizingHandler",
    "RuntimeContext",
    "SparseSyncHandler",
    "StagesHandler",
    "StepTimes",
    "TensorParallelHandler",
    "ZeroHandler",
]

#: The handlers a :class:`~hetplan.runtime.executor.Runtime` composes, in setup order.
DEFAULT_HANDLERS: tuple[type[Handler], ...] = (
    CompositionHandler,
    TensorParallelHandler,
    ResizingHandler,
    StagesHandler,
    PrecisionHandler,
    RecomputeHandler,
    ZeroHandler,
    GradSyncHandler,
    SparseSyncHandler,
    RebalancingHandler,
    CheckpointingHandler,
    GroupSyncHandler,
)
