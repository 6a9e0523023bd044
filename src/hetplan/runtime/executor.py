"""Execute a plan inside a ``torchrun``-launched process: ``Runtime(plan, model, …)``.

The runtime is thin: it does what the plan says and knows nothing about search. It only
composes handlers, one per plan section (:mod:`hetplan.runtime.handlers`):

1. **Refuse a mismatch**: first the ranks agree on the plan (its digest, gathered from every
   rank: ranks that loaded different plans all refuse, naming who has which); then, before
   any other collective, the model is captured on ``meta`` with the given example inputs and
   its fingerprint compared with the plan's, and the world size must be the plan's
   ``dp · pp · tp`` (with per-stage degrees, the ranks its stages list).
2. **Groups** for the layout (:class:`ParallelGroups`), each with the runtime's timeout; a
   plan with per-stage degrees gets each stage's own groups and its rank's handlers the
   stage's layout (:mod:`hetplan.runtime.handlers.hetero`).
   This rank's heartbeat in the job's store (:class:`~hetplan.runtime.liveness.Heartbeat`)
   beats from the start, so a collective of the setup that fails because a peer froze or
   died names that peer too.
3. **Handlers**: every handler of :data:`~hetplan.runtime.handlers.DEFAULT_HANDLERS` (or of
   ``handlers``) sets up from its section, in order — tensor-parallel shards, the resizing
   controller, this rank's pipeline stages and the plan's action list, gradient sync,
   re-balancing events — then the optimizer is built over this rank's parameters.
4. :meth:`Runtime.train_step` runs one iteration over the global batch: the handlers' step
   hooks around the optimizer step, timed into :class:`StepTimes`; returns the loss. A
   step whose collective fails because a peer froze or died raises
   :class:`~hetplan.runtime.liveness.PeerFailureError` naming that peer.
5. :meth:`Runtime.start_trace` (``hetplan run --trace``) marks the steps' phases and
   pipeline actions in a :class:`~hetplan.runtime.trace.StepTrace` while it records; without
   it nothing is marked.
6. :meth:`Runtime.close` releases hooks, threads, the heartbeat and the group references.

Adding a plan section's execution adds a handler; nothing here changes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hetplan.errors import PlanMismatchError, SpecError
from hetplan.ir.model import ModelIR
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import Layout
from hetplan.ir.rebalancing import PlannedEvent
from hetplan.runtime.groups import ParallelGroups, agree_on_plan, job_timeout
from hetplan.runtime.handlers import (
    DEFAULT_HANDLERS,
    GradSyncHandler,
    Handler,
    LossFn,
    OptimizerFactory,
    RebalancingHandler,
    ResizingHandler,
    RuntimeContext,
    StagesHandler,
    StepTimes,
)
from hetplan.runtime.handlers.hetero import hetero_groups
from hetplan.runtime.handlers.stages import stage_modules
from hetplan.runtime.hetero_ranks import plan_world_size, stage_layout
from hetplan.runtime.liveness import Heartbeat
from hetplan.runtime.resizing import ResizingRuntime, StragglerSpec
from hetplan.runtime.trace import StepTrace, mark_grad_sync

__all__ = ["Runtime", "StepTimes"]


def _default_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    out = getattr(output, "logits", output)
    if isinstance(out, (tuple, list)):
        out = out[0]
    if target.dtype in (torch.long, torch.int64, torch.int32):
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
    return nn.functional.mse_loss(out, target)


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01)


def plan_optimizer(name: str) -> OptimizerFactory:
    """The optimizer the plan was costed with (``cost_settings.optimizer``), so that what runs
    holds the state the memory model counted: ``adam`` / ``adamw`` (lr 1e-4; two fp32 moments),
    ``sgd-momentum`` (lr 0.01, momentum 0.9; one buffer) or ``sgd`` (lr 0.01; none). The
    learning rates are fixed, reasonable defaults for the synthetic-data runs of ``hetplan
    run``; a training script passes its own optimizer."""
    factories: dict[str, OptimizerFactory] = {
        "adam": lambda ps: torch.optim.Adam(ps, lr=1e-4),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-4),
        "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
        "sgd": _sgd,
    }
    if name not in factories:
        raise ValueError(f"unknown optimizer {name!r}; known: {sorted(factories)}")
    return factories[name]


@dataclass
class Runtime:
    """Run ``plan`` for ``model`` on this process (see module docstring).

    Args:
        plan: the plan (its fingerprint must match ``model``).
        model: the model the plan was compiled from, with real weights on this device.
        example_args / example_kwargs: the inputs the plan's model was captured with (for
            zoo models: batch 1); used only to verify the fingerprint, on ``meta``.
        loss_fn: ``loss_fn(output, target)``; default cross-entropy for integer targets and
            MSE otherwise.
        optimizer: builds the optimizer from this rank's parameters (default SGD lr 0.01).
        verify: check the model's fingerprint (skip only in tests that build plans by hand).
        straggler: emulate a slow rank in the TP group (tests and benchmarks): its matmuls
            take ``1 + chi`` times as long.
        timeout: of every process group the runtime creates, so that every point-to-point
            operation and collective on them fails after it (default: the default process
            group's timeout).
        handlers: the handler classes to compose, in setup order.

    Attributes:
        ctx: the state the handlers share (``ctx.named_params``, ``ctx.optimizer`` ...).
        heartbeat: this rank's heartbeat (None without a process group, or after
            :meth:`close`).
    """

    plan: Plan
    model: nn.Module
    example_args: Sequence[Any] = ()
    example_kwargs: dict[str, Any] = field(default_factory=dict)
    loss_fn: LossFn = _default_loss
    optimizer: OptimizerFactory = _sgd
    verify: bool = True
    straggler: StragglerSpec | None = None
    timeout: timedelta | None = None
    handlers: Sequence[Callable[[], Handler]] = DEFAULT_HANDLERS
    ctx: RuntimeContext = field(init=False, repr=False)
    heartbeat: Heartbeat | None = field(init=False, default=None, repr=False)
    trace: StepTrace | None = field(init=False, default=None, repr=False)
    _cuda: bool = field(init=False, default=False, repr=False)  # the step clock's device

    def __post_init__(self) -> None:
        self.heartbeat = Heartbeat.of_default_group()
        try:
            self._setup()
        except BaseException as e:
            heartbeat, self.heartbeat = self.heartbeat, None
            explained = (heartbeat.explain(e) if heartbeat is not None
                         and isinstance(e, RuntimeError) else None)
            if heartbeat is not None:
                heartbeat.stop()
            if explained is not None:
                raise explained from e
            raise

    def _setup(self) -> None:
        if dist.is_initialized():
            agree_on_plan(self.plan)  # every rank, before anything a rank could refuse alone
        layout = self.plan.layout
        if layout is None:
            raise SpecError("the plan has no layout; compile it with `hetplan plan`")
        model_ir = self._verified_ir() if self.verify else None
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world != (need := plan_world_size(self.plan)):
            shape = (self.plan.hetero.describe() if self.plan.hetero is not None
                     else f"dp={layout.dp} pp={layout.pp} tp={layout.tp}")
            raise PlanMismatchError(
                f"the plan needs {need} processes ({shape}) but this job has {world}; launch "
                f"it with `hetplan run` or torchrun --nproc-per-node matching the plan"
            )
        timeout = self.timeout if self.timeout is not None else job_timeout()
        spec = self.plan.cluster.spec
        groups = None
        if dist.is_initialized() and self.plan.hetero is not None:
            # per-stage degrees: the stage's groups, and its own (dp, tp) for the handlers
            groups = hetero_groups(self.plan, dist.get_rank(), timeout)
            layout = stage_layout(self.plan, dist.get_rank())
        elif dist.is_initialized():
            groups = ParallelGroups.build(layout, dist.get_rank(), timeout=timeout,
                                          node_of=spec.node_of if spec is not None else None)
        self.ctx = RuntimeContext(
            plan=self.plan, layout=layout, model=self.model, loss_fn=self.loss_fn,
            make_optimizer=self.optimizer, example_args=self.example_args,
            example_kwargs=self.example_kwargs,
            # non-tensor keyword inputs (``use_cache=False``) are passed to every forward
            forward_kwargs={k: v for k, v in self.example_kwargs.items()
                            if not isinstance(v, torch.Tensor)},
            groups=groups, timeout=timeout, straggler=self.straggler,
            handlers=tuple(make() for make in self.handlers), captured=model_ir)
        for h in self.ctx.handlers:
            h.setup(self.ctx)
        self._cuda = _StepClock.on_cuda(self.model)
        # a handler may have wrapped the factory (ZeRO's sharded optimizer, master weights)
        self.ctx.optimizer = self.ctx.make_optimizer([p for _, p in self.ctx.named_params])

    def _verified_ir(self) -> ModelIR:
        """The model captured on ``meta``; refuses a model the plan was not made for."""
        from hetplan.ir.capture import capture

        ir = capture(self.model, tuple(self.example_args), dict(self.example_kwargs),
                     name=self.plan.model.name)
        if ir.fingerprint() != self.plan.model.fingerprint:
            raise PlanMismatchError(
                f"the model does not match the plan: its fingerprint is {ir.fingerprint()}, "
                f"the plan was compiled for {self.plan.model.name!r} with fingerprint "
                f"{self.plan.model.fingerprint}; re-run `hetplan plan` for this model (and the "
                "same example input shapes)"
            )
        return ir

    def train_step(self, inputs: Any, target: torch.Tensor) -> float:
        """One iteration on the global batch ``(inputs, target)``; returns this replica's
        loss (mean over its rows; NaN on pipeline ranks that do not hold the last stage and
        on ranks re-packing released).

        Raises:
            PeerFailureError: a collective failed and some ranks stopped beating (frozen or
                dead); names them. Other failures propagate unchanged.
        """
        try:
            return self._step(inputs, target)
        except RuntimeError as e:
            explained = self.heartbeat.explain(e) if self.heartbeat is not None else None
            if explained is None:
                raise
            raise explained from e

    def _step(self, inputs: Any, target: torch.Tensor) -> float:
        """One iteration. The loss stays on the device until the optimizer step has been
        issued: reading it is the step's only host synchronisation, at its end (as a timed
        training loop synchronises once per step), so on a GPU the host queues backward,
        gradient sync and the optimizer step without waiting for the device in between."""
        ctx = self.ctx
        clock = _StepClock(self._cuda)
        ctx.bubble_s = 0.0
        xs = list(inputs) if isinstance(inputs, (tuple, list)) else [inputs]
        loss = next((x for h in ctx.handlers
                     if (x := h.run_micro_batches(ctx, xs, target)) is not None), None)
        if loss is None:
            raise SpecError(f"none of the runtime's handlers "
                            f"{[type(h).__name__ for h in ctx.handlers]} runs the step's "
                            "micro-batches; include StagesHandler")
        clock.mark()
        trace = self.trace if self.trace is not None and self.trace.recording else None
        t_prev = clock.host[-1]
        for h in ctx.handlers:
            h.after_backward(ctx)
            if trace is not None:  # the handlers that do something after backward
                t_prev, t0 = time.perf_counter(), t_prev
                if type(h).after_backward is not Handler.after_backward:
                    trace.add(f"after_backward {type(h).__name__}", "phase", t0, t_prev)
        for h in ctx.handlers:
            if type(h).after_sync is Handler.after_sync:
                continue
            h.after_sync(ctx)
            if trace is not None:
                t_prev, t0 = time.perf_counter(), t_prev
                trace.add(f"after_sync {type(h).__name__}", "phase", t0, t_prev)
        clock.mark()
        if ctx.optimizer is not None:
            ctx.optimizer.step()
            ctx.optimizer.zero_grad(set_to_none=True)
        clock.mark()
        value = float(loss)  # the step's one host synchronisation
        ctx.last_times = clock.times(ctx.bubble_s)
        if trace is not None:
            self._trace_phases(trace, clock.host)
        for h in ctx.handlers:
            h.after_step(ctx)
        ctx.iteration += 1
        return value

    def start_trace(self) -> StepTrace:
        """The trace this runtime's marks write (created on the first call): record a step
        with ``trace.start(step)`` before it and ``trace.stop()`` after it."""
        if self.trace is None:
            import socket

            groups = self.ctx.groups
            rank = groups.rank if groups is not None else 0
            coords = self.ctx.layout.coords(rank)
            self.trace = StepTrace(rank, (coords[0], coords[1], coords[2]), socket.gethostname())
            self.ctx.handler(StagesHandler).start_trace(self.trace)
            try:
                sync = self.ctx.handler(GradSyncHandler).sync
            except LookupError:  # composed without it
                sync = None
            if sync is not None:
                mark_grad_sync(sync, self.trace)
        return self.trace

    @staticmethod
    def _trace_phases(trace: StepTrace, marks: Sequence[float]) -> None:
        """The step's phases from its clock's host marks (start, micro-batches, after
        backward, optimizer): the micro-batches, and the optimizer step up to the loss read
        (the after-backward spans are per handler)."""
        trace.add("micro-batches", "phase", marks[0], marks[1])
        trace.add("optimizer step", "phase", marks[2], time.perf_counter())

    def handler(self, kind: type[Any]) -> Any:
        """The composed handler of class ``kind`` (e.g. ``StagesHandler``)."""
        return self.ctx.handler(kind)

    # -- what callers read (views of the handlers' state) ----------------------------------
    @property
    def layout(self) -> Layout:
        """The plan's layout."""
        return self.ctx.layout

    @property
    def named_params(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's trainable parameters by name (its stages', or the whole model's)."""
        return self.ctx.named_params

    @property
    def stage_modules(self) -> list[nn.Module]:
        """This rank's pipeline stage modules (the traced submodules it runs; empty without a
        pipeline)."""
        return stage_modules(self.ctx)

    @property
    def opt(self) -> torch.optim.Optimizer | None:
        """The optimizer over :attr:`named_params` (None once re-packing released the rank)."""
        return self.ctx.optimizer

    @property
    def last_times(self) -> StepTimes | None:
        """The measured times of the last step."""
        return self.ctx.last_times

    @property
    def resizing(self) -> ResizingRuntime | None:
        """The TP resizing controller (None: variant ``off`` or no TP)."""
        return self.ctx.handler(ResizingHandler).controller

    @property
    def rebalanced_at(self) -> list[int]:
        """The iterations whose re-balancing events ran."""
        return self.ctx.handler(RebalancingHandler).rebalanced_at

    @property
    def rebalance_s(self) -> list[float]:
        """Seconds each executed re-balancing event took."""
        return self.ctx.handler(RebalancingHandler).rebalance_s

    @property
    def skipped_events(self) -> list[tuple[PlannedEvent, str]]:
        """The plan's events this runtime does not execute, with the reason."""
        return self.ctx.handler(RebalancingHandler).skipped

    def close(self) -> None:
        """Release what the runtime holds on to: gradient hooks, the sync thread, the
        heartbeat and the references to its process groups (call before
        ``destroy_process_group``; calling it again does nothing)."""
        if self.heartbeat is not None:
            self.heartbeat.stop()
            self.heartbeat = None
        for h in self.ctx.handlers:
            h.close(self.ctx)
        self.ctx.groups = None


class _StepClock:
    """The times of one step's three phases (micro-batches, after-backward, optimizer).

    On the CPU the host's clock is the device's: ``perf_counter`` at each mark. On a GPU the
    host only queues the work, so each mark also records a CUDA event on the current stream,
    and the phases are read from the events once the step has synchronised (reading the
    loss); the iteration is the host's wall time from the start to that synchronisation.
    Recording an event does not wait for the device.
    """

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.cpu0 = time.process_time()
        self.host = [time.perf_counter()]
        self.events: list[Any] = []
        if cuda:
            self.events.append(_event())

    @staticmethod
    def on_cuda(model: nn.Module) -> bool:
        """Whether ``model``'s device is a GPU (the runtime asks once, at setup)."""
        p = next(model.parameters(), None)
        return p is not None and p.device.type == "cuda"

    def mark(self) -> None:
        """The end of a phase."""
        self.host.append(time.perf_counter())
        if self.cuda:
            self.events.append(_event())

    def times(self, bubble_s: float) -> StepTimes:
        """The step's times; call after the step synchronised with its device."""
        if self.cuda:  # a no-op when the loss was read (a pipeline rank's loss may be a float)
            self.events[-1].synchronize()
        end = time.perf_counter()
        if self.cuda:
            phases = [a.elapsed_time(b) / 1e3 for a, b in zip(self.events, self.events[1:])]
        else:
            phases = [b - a for a, b in zip(self.host, self.host[1:])]
        compute, sync, opt = phases
        iteration = (end if self.cuda else self.host[-1]) - self.host[0]
        return StepTimes(iteration, max(compute - bubble_s, 0.0) if self.cuda
                         else compute - bubble_s, sync, opt, bubble_s,
                         cpu_s=time.process_time() - self.cpu0)


def _event() -> Any:
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev
