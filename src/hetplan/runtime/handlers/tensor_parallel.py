"""The ``tensor_parallel`` section: uneven shards, and the resizing controller that runs on them.

:class:`TensorParallelHandler` replaces the model's Megatron MLP pairs by uneven column/row
parallel linears with the plan's per-rank shard sizes
(:func:`~hetplan.runtime.tensor_parallel.shard_model`). :class:`ResizingHandler` executes
``tensor_parallel.controller``: with a variant other than ``off`` the sharded linears become
resizable and the ZERO / migration / SEMI controller runs after every step, starting from the
group's ``roles`` (:mod:`hetplan.runtime.resizing`); with only an emulated straggler the
linears compute in full and the clock measures them.
"""

from __future__ import annotations

from hetplan.errors import SpecError
from hetplan.runtime.handlers.base import Handler, RuntimeContext
from hetplan.runtime.resizing import Clock, ResizingRuntime, attach_resizing, end_iteration
from hetplan.runtime.tensor_parallel import shard_model

__all__ = ["ResizingHandler", "TensorParallelHandler"]


class TensorParallelHandler(Handler):
    """Shards the model's tensor-parallel linears as the plan says (``tp > 1``)."""

    section = "tensor_parallel"

    def setup(self, ctx: RuntimeContext) -> None:
        layout = ctx.layout
        if layout.tp == 1:
            return
        if layout.pp > 1:
            raise SpecError(
                f"the runtime runs pipeline (pp={layout.pp}) or tensor parallelism "
                f"(tp={layout.tp}) with data parallelism, not both at once yet; re-plan with "
                "--pp 1 or --tp 1"
            )
        assert ctx.groups is not None  # tp > 1 passed the world-size check: distributed
        shard_model(ctx.model, ctx.model_ir().layers, ctx.plan.tensor_parallel,
                    ctx.groups.tp_group, ctx.groups.tp_rank, layout.tp)


class ResizingHandler(Handler):
    """Runs the heterogeneous-TP resizing controller after every step (``tp > 1``).

    Attributes:
        clock: times the sharded linears' matmuls (None: nothing to time).
        controller: the controller (None: variant ``off``, or no TP).
    """

    section = "tensor_parallel.controller"

    def __init__(self) -> None:
        self.clock: Clock | None = None
        self.controller: ResizingRuntime | None = None

    def setup(self, ctx: RuntimeContext) -> None:
        if ctx.layout.tp == 1:
            return
        assert ctx.groups is not None
        self.clock, self.controller = attach_resizing(
            ctx.model, ctx.plan.tensor_parallel, ctx.groups.tp_group, ctx.groups.tp_rank,
            ctx.layout.tp, ctx.straggler)

    def after_step(self, ctx: RuntimeContext) -> None:
        assert ctx.last_times is not None
        end_iteration(self.clock, self.controller, ctx.last_times.compute_s)
