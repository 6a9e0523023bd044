"""Execute a plan inside a ``torchrun``-launched process: ``Runtime(plan, model, …)``.

The runtime is thin: it does what the plan says, one handler per section, and knows nothing
about search.

1. **Refuse a mismatch before any collective**: the model is captured on ``meta`` with the
   given example inputs and its fingerprint compared with the plan's; the world size must be
   the plan's ``dp · pp · tp``.
2. **Groups** for the layout (:class:`ParallelGroups`).
3. **Tensor parallelism** (``tensor_parallel`` section): Megatron MLP pairs replaced by
   uneven column/row-parallel linears (:mod:`hetplan.runtime.tensor_parallel`); with a
   controller variant other than ``off`` (``tensor_parallel.controller``) they become
   resizable and the ZERO / migration / SEMI controller runs after every step, starting from
   the group's ``roles`` (:mod:`hetplan.runtime.resizing`).
4. **Pipeline** (``stages`` + ``layout.schedule``): this rank's stage and the schedule
   (:mod:`hetplan.runtime.pipeline`). Pipeline and tensor parallelism are not combined yet.
5. **Gradient sync** (``gradient_sync``): the plan's buckets on the data-parallel group
   (:class:`GradSync`).
6. :meth:`Runtime.train_step` runs one iteration over the global batch and returns the loss.
7. **Re-balancing** (``rebalancing.events``, applied ones): after the optimizer step of the
   event's iteration (counted from 0 by this runtime) the pipeline moves to the event's stage
   assignment — parameters and optimizer state of the moved layers go point to point, stage,
   schedule, gradient sync and optimizer are rebuilt — and iteration ``k + 1`` runs on the new
   stages (:mod:`hetplan.runtime.rebalance`). A re-packing event (fewer stages) releases the
   ranks past the new stage count: they idle from then on (``released``). Events of
   interleaved pipelines, or that would grow back onto released ranks, are not executed;
   they are listed in ``skipped_events``.

Data: every rank is given the same global batch; data-parallel replica ``d`` trains on rows
``[d·b, (d+1)·b)`` with ``b = batch / dp``, split into the plan's micro-batches.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hetplan.errors import PlanMismatchError, SpecError
from hetplan.ir.plan import Plan
from hetplan.runtime.grad_sync import GradSync
from hetplan.runtime.groups import ParallelGroups
from hetplan.runtime.resizing import (
    Clock,
    ResizingRuntime,
    StragglerSpec,
    attach_resizing,
    end_iteration,
)

__all__ = ["Runtime", "StepTimes"]

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


def _default_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    out = getattr(output, "logits", output)
    if isinstance(out, (tuple, list)):
        out = out[0]
    if target.dtype in (torch.long, torch.int64, torch.int32):
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
    return nn.functional.mse_loss(out, target)


@dataclass
class StepTimes:
    """Measured times of one iteration on this rank (seconds).

    ``iteration_s = compute_s + bubble_s + sync_wait_s + optimizer_s``: forward and backward
    (for a pipeline rank, the time its stages computed), the pipeline wait (schedule time not
    spent computing: bubble and unhidden activation transfers; 0 without a pipeline), the wait
    for gradient sync after backward, and the optimizer step.
    """

    iteration_s: float
    compute_s: float
    sync_wait_s: float
    optimizer_s: float
    bubble_s: float = 0.0  # pipeline: time in the schedule not spent computing (waits)


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
    """

    plan: Plan
    model: nn.Module
    example_args: Sequence[Any] = ()
    example_kwargs: dict[str, Any] = field(default_factory=dict)
    loss_fn: LossFn = _default_loss
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] = (
        lambda params: torch.optim.SGD(params, lr=0.01)
    )
    verify: bool = True
    straggler: StragglerSpec | None = None
    _model_ir: Any = field(default=None, init=False, repr=False)  # captured once, on meta

    def __post_init__(self) -> None:
        layout = self.plan.layout
        if layout is None:
            raise SpecError("the plan has no layout; compile it with `hetplan plan`")
        self.layout = layout
        if self.verify:
            self._verify_model()
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world != layout.num_ranks:
            raise PlanMismatchError(
                f"the plan needs {layout.num_ranks} processes (dp={layout.dp} pp={layout.pp} "
                f"tp={layout.tp}) but this job has {world}; launch it with "
                f"`hetplan run` or torchrun --nproc-per-node matching the plan"
            )
        rank = dist.get_rank() if dist.is_initialized() else 0
        spec = self.plan.cluster.spec
        self.groups = (ParallelGroups.build(layout, rank,
                                            node_of=spec.node_of if spec is not None else None)
                       if dist.is_initialized() else None)
        if layout.tp > 1 and layout.pp > 1:
            raise SpecError(
                f"the runtime runs pipeline (pp={layout.pp}) or tensor parallelism "
                f"(tp={layout.tp}) with data parallelism, not both at once yet; re-plan with "
                "--pp 1 or --tp 1"
            )
        # non-tensor keyword inputs (``use_cache=False``) are passed to every forward
        self.forward_kwargs = {
            k: v for k, v in self.example_kwargs.items() if not isinstance(v, torch.Tensor)
        }
        # this rank's pipeline stage and schedule (torch.distributed.pipelining), if any
        self.stage: Any = None
        self.schedule: Any = None
        self.tp_clock: Clock | None = None
        self.resizing: ResizingRuntime | None = None
        if layout.tp > 1:
            self._shard_tensor_parallel()
        if layout.pp > 1:
            assert self.groups is not None  # pp > 1 passed the world-size check: distributed
            self._build_pipeline_stage(self.plan.stages, self.groups.pp_group)
            self.named_params = list(self.stage.submod.named_parameters())
        else:
            self.named_params = list(self.model.named_parameters())
        group = self.groups.dp_group if self.groups is not None else None
        levels = self.groups.sync_levels() if self.groups is not None else None
        self.grad_sync = GradSync(self.named_params, self.plan.gradient_sync, group, layout.dp,
                                  levels)
        self.opt = self.optimizer([p for _, p in self.named_params])
        self.last_times: StepTimes | None = None
        self._init_rebalancing()

    def _shard_tensor_parallel(self) -> None:
        from hetplan.runtime.tensor_parallel import shard_model

        assert self.groups is not None
        shard_model(self.model, self._ir().layers, self.plan.tensor_parallel,
                    self.groups.tp_group, self.groups.tp_rank, self.layout.tp)
        self.tp_clock, self.resizing = attach_resizing(
            self.model, self.plan.tensor_parallel, self.groups.tp_group, self.groups.tp_rank,
            self.layout.tp, self.straggler)

    def _build_pipeline_stage(self, stages: Sequence[Any], pp_group: Any) -> None:
        """This rank's stage of ``stages`` (pipeline group ``pp_group``) and its schedule."""
        from hetplan.runtime.pipeline import StageClock, build_stage, make_schedule

        assert self.groups is not None
        if self.layout.micro_batches < self.layout.pp:
            raise SpecError(
                f"the plan pipelines {self.layout.pp} stages over {self.layout.micro_batches} "
                "micro-batch(es); the runtime's schedules need at least one per stage: re-plan"
            )
        mb = self.layout.micro_batch_size
        example = [self._example_rows(a, mb) for a in self.example_args]
        device = next(self.model.parameters()).device
        self.stage = build_stage(
            self.model, example, self.forward_kwargs, stages, self.groups.pp_rank, pp_group,
            device,
            ir_layer_names=[x.name for x in self._ir().layers],
        )
        self.schedule = make_schedule(self.stage, self.layout, self.loss_fn)
        self.stage_clock = StageClock(self.stage)

    @staticmethod
    def _example_rows(a: Any, rows: int) -> Any:
        if not isinstance(a, torch.Tensor):
            return a
        reps = (rows + a.shape[0] - 1) // a.shape[0]
        return a.repeat(reps, *([1] * (a.dim() - 1)))[:rows].clone()

    def _ir(self) -> Any:
        if self._model_ir is None:
            from hetplan.ir.capture import capture

            self._model_ir = capture(self.model, tuple(self.example_args),
                                     dict(self.example_kwargs), name=self.plan.model.name)
        return self._model_ir

    def _verify_model(self) -> None:
        ir = self._ir()
        if ir.fingerprint() != self.plan.model.fingerprint:
            raise PlanMismatchError(
                f"the model does not match the plan: its fingerprint is {ir.fingerprint()}, "
                f"the plan was compiled for {self.plan.model.name!r} with fingerprint "
                f"{self.plan.model.fingerprint}; re-run `hetplan plan` for this model (and the "
                "same example input shapes)"
            )

    def _local_rows(self, t: torch.Tensor) -> torch.Tensor:
        b = t.shape[0] // self.layout.dp
        if b * self.layout.dp != t.shape[0]:
            raise SpecError(
                f"global batch of {t.shape[0]} rows does not split over dp={self.layout.dp}"
            )
        d = self.groups.dp_rank if self.groups is not None else 0
        return t[d * b : (d + 1) * b]

    def train_step(self, inputs: Any, target: torch.Tensor) -> float:
        """One iteration on the global batch ``(inputs, target)``; returns this replica's
        loss (mean over its rows; NaN on pipeline ranks that do not hold the last stage)."""
        t0 = time.perf_counter()
        xs = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
        xs = [self._local_rows(x) for x in xs]
        y = self._local_rows(target)
        if self.schedule is not None:
            return self._pipeline_step(xs, y, t0)
        if self.released:
            return self._idle_step(t0)
        m = self.layout.micro_batches
        chunks = [torch.chunk(x, m) for x in xs]
        ys = torch.chunk(y, m)
        total = 0.0
        for i in range(m):
            last = i == m - 1
            ctx = self.grad_sync.no_sync() if not last else contextlib.nullcontext()
            with ctx:
                out = self.model(*[c[i] for c in chunks], **self.forward_kwargs)
                loss = self.loss_fn(out, ys[i]) / m
                loss.backward()
            total += float(loss.detach())
        return self._finish_step(total, t0)

    def _pipeline_step(self, xs: list[torch.Tensor], y: torch.Tensor, t0: float) -> float:
        """One pipeline iteration. The schedule runs every micro-batch's backward, so the
        gradient hooks stay off and the stage's buckets are all sent after it (no overlap
        with the last backward yet)."""
        from hetplan.runtime.pipeline import step

        assert self.groups is not None
        self.stage_clock.reset()
        t_sched = time.perf_counter()
        with self.grad_sync.no_sync():
            loss = step(self.schedule, self.groups.pp_rank, self.num_stages, xs, y)
        waited = max(time.perf_counter() - t_sched - self.stage_clock.busy_s, 0.0)
        return self._finish_step(float(loss) if loss is not None else float("nan"), t0, waited)

    def _finish_step(self, loss: float, t0: float, bubble_s: float = 0.0) -> float:
        t1 = time.perf_counter()
        self.grad_sync.finish()
        t2 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        self.last_times = StepTimes(t3 - t0, t1 - t0 - bubble_s, t2 - t1, t3 - t2, bubble_s)
        end_iteration(self.tp_clock, self.resizing, self.last_times.compute_s)
        self._run_due_events()
        return loss

    # -- re-balancing (the plan's ``rebalancing.events``) -----------------------------------
    def _init_rebalancing(self) -> None:
        """The events this runtime executes (see :func:`~hetplan.runtime.rebalance.
        executable_events`); ``skipped_events`` holds the others with the reason."""
        from hetplan.runtime.rebalance import executable_events

        self.iteration = 0
        self.rebalanced_at: list[int] = []
        self.rebalance_s: list[float] = []
        self.released = False
        self.num_stages = self.layout.pp
        self._pp = (self.groups.pp_group, self.groups.pp_ranks) if self.groups else (None, ())
        per_rank = len(self.plan.stages) // max(self.layout.pp, 1) if self.plan.stages else 1
        self._events, self.skipped_events = executable_events(
            self.plan.rebalancing, self.layout.pp, per_rank)

    def _idle_step(self, t0: float) -> float:
        """An iteration on a rank re-packing released: nothing to compute; it still counts
        iterations, as later events create process groups with every rank."""
        self.last_times = StepTimes(time.perf_counter() - t0, 0.0, 0.0, 0.0)
        self._run_due_events()
        return float("nan")

    def _run_due_events(self) -> None:
        """After the optimizer step of iteration ``i`` (counted from 0 by this runtime), run
        the events planned at iteration ``i``: iterations ``i + 1`` on use the new stages."""
        done, self.iteration = self.iteration, self.iteration + 1
        while self._events and self._events[0].iteration <= done:
            event = self._events.pop(0)
            t0 = time.perf_counter()
            self._rebalance(event.stages)
            self.rebalanced_at.append(event.iteration)
            self.rebalance_s.append(time.perf_counter() - t0)

    def _shrunk_pipeline(self, k: int) -> tuple[Any, tuple[int, ...]]:
        """The pipeline group and ranks of this rank's replica on the first ``k`` stages.
        Creating groups is collective over the world: every rank, released ones included,
        creates every replica's group in the same order."""
        assert self.groups is not None
        mine: tuple[Any, tuple[int, ...]] = (None, ())
        for d in range(self.layout.dp):
            members = tuple(self.layout.rank_of(d, s, 0) for s in range(k))
            group = dist.new_group(list(members)) if k > 1 else None
            if d == self.groups.dp_rank:
                mine = (group, members)
        return mine

    def _rebalance(self, bounds: Sequence[tuple[int, int]]) -> None:
        """Move to the stage assignment ``bounds`` (collective over the pipeline group; with
        fewer stages — re-packing — the ranks past them are released and idle from then on).

        Builds the new stage from the model (its parameters are the model's), sends every
        parameter whose stage changes with its optimizer state point to point, then rebuilds
        the schedule, the gradient sync and the optimizer with the carried state.
        """
        from hetplan.runtime.rebalance import carry_optimizer, exchange_params, plan_param_moves

        assert self.groups is not None
        old_group, old_ranks = self._pp
        new_pp = self._shrunk_pipeline(len(bounds)) if len(bounds) < self.num_stages \
            else self._pp
        if self.released:
            self._pp, self.num_stages = new_pp, len(bounds)
            return
        me = self.groups.pp_rank
        old = {s.index: s for s in self.plan.stages}
        names = [x.name for x in self._ir().layers]
        stages = [old[i].model_copy(update={"first_layer": a, "last_layer": b, "fwd_ms": 0.0,
                                            "bwd_ms": 0.0, "memory_bytes": None,
                                            "layer_names": tuple(names[a:b + 1])})
                  for i, (a, b) in enumerate(bounds)]
        sending, old_opt = dict(self.named_params), self.opt
        self.grad_sync.close()
        self.stage = self.schedule = None
        if me < len(bounds) and len(bounds) > 1:
            self._build_pipeline_stage(stages, new_pp[0])
            self.named_params = list(self.stage.submod.named_parameters())
        elif me == 0:  # one stage left: this rank trains the whole model, no pipeline
            self.named_params = list(self.model.named_parameters())
        else:
            self.named_params = []
        receiving = dict(self.named_params)
        held: list[Any] = [(sorted(sending), sorted(receiving))] * len(old_ranks)
        if old_group is not None:  # None: a one-stage pipeline, nothing to gather
            dist.all_gather_object(held, held[0], group=old_group)
        moves = plan_param_moves([h[0] for h in held], [h[1] for h in held])
        received = exchange_params(moves, sending, receiving, old_opt, me, old_ranks)
        self._pp, self.num_stages = new_pp, len(bounds)
        self.grad_sync = GradSync(self.named_params, self.plan.gradient_sync,
                                  self.groups.dp_group, self.layout.dp, self.groups.sync_levels())
        if me >= len(bounds):
            self.released = True
            return
        self.opt = carry_optimizer(old_opt, self.optimizer([p for _, p in self.named_params]),
                                   received)

    def close(self) -> None:
        """Release what the runtime holds on to: gradient hooks, the sync thread and the
        references to its process groups (call before ``destroy_process_group``)."""
        self.grad_sync.close()
        self.schedule = self.stage = None
        self.groups = None
