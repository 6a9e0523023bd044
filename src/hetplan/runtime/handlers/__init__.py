"""The runtime's handlers: one per plan section; :class:`~hetplan.runtime.executor.Runtime`
only composes them.

A handler (:class:`Handler`) declares the plan section it executes (``section``), sets up
from the plan (:meth:`Handler.setup`) and hooks into the step. One step of the runtime is::

    loss = first non-None h.run_micro_batches(ctx, inputs, target)   # forward + backward
    h.after_backward(ctx)            for every handler               # e.g. finish grad sync
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
TensorParallelHandler      ``tensor_parallel``             Megatron TP: uneven MLP shards,
                                                           attention by heads, vocabulary-
                                                           parallel embedding / head / loss,
                                                           sequence parallelism
ResizingHandler            ``tensor_parallel.controller``  ZERO / migration / SEMI per step
StagesHandler              ``stages``,                     this rank's stages; runs the
                           ``pipeline_actions``            plan's action list (or the
                                                           micro-batches locally); sums
                                                           tied weights' gradients
GradSyncHandler            ``gradient_sync``               buckets, compression, all-reduce
RebalancingHandler         ``rebalancing``                 planned stage moves, re-packing
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
from hetplan.runtime.handlers.grad_sync import GradSyncHandler
from hetplan.runtime.handlers.rebalancing import RebalancingHandler
from hetplan.runtime.handlers.stages import StagesHandler
from hetplan.runtime.handlers.tensor_parallel import ResizingHandler, TensorParallelHandler

__all__ = [
    "DEFAULT_HANDLERS",
    "GradSyncHandler",
    "Handler",
    "LossFn",
    "OptimizerFactory",
    "RebalancingHandler",
    "ResizingHandler",
    "RuntimeContext",
    "StagesHandler",
    "StepTimes",
    "TensorParallelHandler",
]

#: The handlers a :class:`~hetplan.runtime.executor.Runtime` composes, in setup order.
DEFAULT_HANDLERS: tuple[type[Handler], ...] = (
    TensorParallelHandler,
    ResizingHandler,
    StagesHandler,
    GradSyncHandler,
    RebalancingHandler,
)
