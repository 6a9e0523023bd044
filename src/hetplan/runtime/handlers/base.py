"""The handler protocol and the state handlers share (see :mod:`hetplan.runtime.handlers`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch
from torch import nn

from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import Layout

if TYPE_CHECKING:
    from hetplan.ir.model import ModelIR
    from hetplan.runtime.groups import ParallelGroups
    from hetplan.runtime.resizing import StragglerSpec

__all__ = ["Handler", "LocalStage", "LossFn", "OptimizerFactory", "RuntimeContext", "StepTimes"]

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
_H = TypeVar("_H", bound="Handler")


@dataclass
class StepTimes:
    """Measured times of one iteration on this rank (seconds).

    ``iteration_s = compute_s + bubble_s + sync_wait_s + optimizer_s``: forward and backward
    (for a pipeline rank, the time its stages computed), the pipeline wait (schedule time not
    spent computing: bubble and unhidden activation transfers; 0 without a pipeline), the wait
    for gradient sync after backward, and the optimizer step. ``cpu_s`` is the CPU time the
    whole process (all its threads: the communication library's included) used in the step:
    on a host with more ranks than cores, what the ranks together ask of the cores
    (``docs/decisions/cpu-fidelity.md``, section 15).
    """

    iteration_s: float
    compute_s: float
    sync_wait_s: float
    optimizer_s: float
    bubble_s: float = 0.0
    cpu_s: float = 0.0


@dataclass
class LocalStage:
    """A pipeline stage this rank runs with an executor of the runtime's own (a heterogeneous
    pipeline, Chimera) instead of torch's ``PipelineStage``: its module (parameters shared
    with the model) and index, what the precision and recomputation handlers read from a
    pipeline stage."""

    submod: nn.Module
    stage_index: int


@dataclass
class RuntimeContext:
    """What the handlers of one :class:`~hetplan.runtime.executor.Runtime` share.

    Set by the runtime: the plan, model, loss, optimizer factory, groups and timeout; the
    handlers read them. Handlers write: ``named_params`` (the stage handler: this rank's
    trainable parameters), ``optimizer`` (the runtime builds it after setup; re-balancing
    rebuilds it), ``released`` (re-balancing: this rank left the pipeline), ``bubble_s`` (the
    stage handler, per step). The runtime keeps ``iteration`` (counted from 0) and
    ``last_times``.

    Attributes:
        plan / layout: the plan and its layout.
        model: the model, with real weights on this rank's device.
        loss_fn / make_optimizer / example_args / example_kwargs: as given to the runtime.
        forward_kwargs: the example's non-tensor keyword inputs (``use_cache=False``), passed
            to every forward.
        groups: this rank's process groups (None in a single process).
        timeout: the timeout of every process group the runtime creates.
        straggler: the emulated straggler of tests and benchmarks, if any.
        handlers: the handlers, in setup order.
        captured: the model captured on ``meta`` (:meth:`model_ir` fills it on first use).
    """

    plan: Plan
    layout: Layout
    model: nn.Module
    loss_fn: LossFn
    make_optimizer: OptimizerFactory
    example_args: Sequence[Any]
    example_kwargs: dict[str, Any]
    forward_kwargs: dict[str, Any]
    groups: ParallelGroups | None
    timeout: timedelta
    straggler: StragglerSpec | None = None
    handlers: tuple[Handler, ...] = ()
    named_params: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    optimizer: torch.optim.Optimizer | None = None
    released: bool = False
    iteration: int = 0
    bubble_s: float = 0.0
    last_times: StepTimes | None = None
    captured: ModelIR | None = field(default=None, repr=False)

    def model_ir(self) -> ModelIR:
        """The model captured on ``meta`` with the example inputs (once, then cached)."""
        if self.captured is None:
            from hetplan.ir.capture import capture

            self.captured = capture(self.model, tuple(self.example_args),
                                     dict(self.example_kwargs), name=self.plan.model.name)
        return self.captured

    def handler(self, kind: type[_H]) -> _H:
        """The handler of class ``kind`` (a handler that builds on another one's state)."""
        for h in self.handlers:
            if isinstance(h, kind):
                return h
        raise LookupError(f"no {kind.__name__} among the runtime's handlers "
                          f"{[type(h).__name__ for h in self.handlers]}")

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """Every handler's :meth:`Handler.accumulating` context: backward passes run inside it
        accumulate gradients locally (all micro-batches but the last; a whole pipeline
        schedule)."""
        with contextlib.ExitStack() as stack:
            for h in self.handlers:
                stack.enter_context(h.accumulating(self))
            yield

    def params_changed(self) -> None:
        """Tell every handler that ``named_params`` changed (re-balancing moved layers)."""
        for h in self.handlers:
            h.params_changed(self)


class Handler:
    """Executes one plan section; subclasses override the hooks their section needs.

    The runtime calls, per handler in order: :meth:`setup` once; per step
    :meth:`run_micro_batches` (until one handler returns a loss), :meth:`after_backward`, the
    optimizer step, :meth:`after_step`; :meth:`close` at the end. Every hook is a no-op here.

    Attributes:
        section: the plan section (a ``Plan`` field, dotted for a part of one) it executes.
    """

    section: ClassVar[str]

    def setup(self, ctx: RuntimeContext) -> None:
        """Build what the section needs (shards, stages, hooks), before the first step."""

    def run_micro_batches(self, ctx: RuntimeContext, inputs: Sequence[torch.Tensor],
                          target: torch.Tensor) -> float | torch.Tensor | None:
        """Forward and backward of this rank's share of the global batch; the loss (a float,
        or a 0-d tensor the runtime reads after the optimizer step is queued), or None when
        this handler does not run the step's computation (exactly one handler does)."""
        return None

    def accumulating(self, ctx: RuntimeContext) -> AbstractContextManager[None]:
        """A context in which backward passes only accumulate gradients (see
        :meth:`RuntimeContext.accumulating`)."""
        return contextlib.nullcontext()

    def stage_gradients_final(self, ctx: RuntimeContext, params: Collection[int]) -> None:
        """Inside a pipeline step: one of this rank's stages ran its last backward of the
        step, so the gradients of ``params`` (their ``id``) hold their final values from now
        through :meth:`after_backward` (tied parameters, which the stage handler sums then,
        are left out); a handler may start syncing them."""

    def after_backward(self, ctx: RuntimeContext) -> None:
        """After every micro-batch's backward, before the optimizer step (timed as the wait
        for gradient sync)."""

    def after_sync(self, ctx: RuntimeContext) -> None:
        """After every handler's :meth:`after_backward` (the gradients are synced across the
        data-parallel replicas, where the plan syncs them), before the optimizer step."""

    def after_step(self, ctx: RuntimeContext) -> None:
        """After the optimizer step of iteration ``ctx.iteration``; ``ctx.last_times`` holds
        its measured times."""

    def params_changed(self, ctx: RuntimeContext) -> None:
        """``ctx.named_params`` changed: rebuild what was built over the old parameters."""

    def close(self, ctx: RuntimeContext) -> None:
        """Release hooks, threads and process-group references."""
