"""Run a plan's per-rank pipeline action lists with ``torch.distributed.pipelining``.

The plan carries, per pipeline rank, the ordered actions (``"0F0 0F1 0B0 …"``) that the
simulator costs (:mod:`hetplan.algorithms.pipeline_schedules`). :func:`make_schedule` hands
exactly those lists to torch's ``_PipelineScheduleRuntime`` (``compute_only`` format), which
lowers them — a send after every forward or backward whose next stage lives on another rank,
and the matching receive posted on that rank — and executes each rank's list in order.

Why torch's schedule runtime and not an own loop over point-to-point sends and receives:

* **Matching.** Point-to-point messages between two ranks carry no micro-batch tag; they pair
  up in posting order. Torch's lowering (``_add_send_recv``) posts every receive in the order
  the peer sends, so any complete, deadlock-free list runs correctly. A loop that receives
  just before each computation would, for a list whose order differs between two ranks
  (legal, and deadlock-free), silently swap two micro-batches of equal shape.
* **Stages.** Several stages on a rank (interleaved 1F1B) hand activations over locally, the
  loss is computed where the last stage runs, and gradients are scaled by
  ``1 / micro_batches``: all torch's own code, as for its built-in schedules.
* **Timeouts.** Every send and receive runs on the pipeline process group, which the runtime
  creates with its timeout (:class:`~hetplan.runtime.groups.ParallelGroups`): gloo fails a
  receive that waited that long (checked: a receive without sender raises after the group's
  timeout), NCCL's watchdog aborts a collective past it.

What it costs: the entry points are private (``_PipelineScheduleRuntime``, its
``_prepare_schedule_with_comms`` — ``_load_actions`` in older releases — and ``_Action``);
they are used here only, behind a clear error. And the multi-stage runtime sends only between
adjacent stages: a tensor a traced stage passes past the next stage is relayed through the
stages in between when the stages are built (``pipeline._relay_skips``); a stage list that
still does (a manual split) is refused with a :class:`SpecError` at its first step.

:class:`StageMonitor` wraps the stages' compute calls: the seconds spent computing (the rest of
a step is bubble and unhidden transfers) and the actions executed, in order — what the
executed-actions test compares with the plan's lists.

Loss reduction (:func:`step`): every micro-batch's loss is ``loss_fn(output, target)`` (a mean
over that micro-batch) and the gradients are scaled by ``1 / micro_batches``, so the gradient
is that of the mean over micro-batches of the per-micro-batch mean loss; :func:`step` returns
that mean. With equal-sized micro-batches (enforced) this is exactly the mean over the whole
batch, i.e. what a single-process ``loss_fn(model(batch), target)`` computes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.pipelining import schedules as torch_schedules

from hetplan.algorithms.pipeline_schedules import (
    Action,
    ActionKind,
    PipelineSchedule,
    PipelineScheduleError,
    build_schedule,
    last_stage_order_problem,
)
from hetplan.errors import SpecError
from hetplan.ir.plan_sections import Layout
from hetplan.runtime.busy_clock import BusyClock
from hetplan.runtime.composition import SUPPORTED_SCHEDULES

if TYPE_CHECKING:  # the common base of traced (``_PipelineStage``) and manual stages
    from torch.distributed.pipelining.stage import _PipelineStageBase

    from hetplan.runtime.trace import StepTrace

__all__ = ["SUPPORTED_SCHEDULES", "StageMonitor", "make_schedule", "step", "trace_schedule"]



def make_schedule(
    stage: _PipelineStageBase | Sequence[_PipelineStageBase],
    layout: Layout,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    actions: PipelineSchedule | None = None,
) -> Any:
    """A torch schedule that runs ``actions`` (default: the lists generated for ``layout``).

    Args:
        stage: this rank's stage, or its stages (``layout.virtual_stages`` of them) for
            ``interleaved-1f1b``.
        layout: the plan's layout (schedule name, pipeline size, ``micro_batches``).
        loss_fn: ``loss_fn(output, target)``, a mean over one micro-batch. A traced last
            stage returns the model output's tensor leaves (an HF ``CausalLMOutput`` arrives
            as the bare ``logits`` tensor when it is the only one).
        actions: the plan's per-rank lists (``Plan.pipeline_actions`` decoded); their rank
            ``r`` is pipeline-group rank ``r``.

    Returns:
        A ``_PipelineScheduleRuntime`` loaded with the lists; run it with :func:`step`.

    Raises:
        SpecError: a schedule the runtime does not run, lists that do not fit the layout or
            the stages this rank holds, or a torch without the schedule runtime.
    """
    name = layout.schedule
    if name == "chimera":
        raise SpecError("schedule 'chimera' runs on the runtime's Chimera executor "
                        "(hetplan.runtime.handlers.chimera), not torch's schedule runtime")
    if name not in SUPPORTED_SCHEDULES:
        raise SpecError(f"the plan's schedule {name!r} is not executed by the runtime, which "
                        f"runs {list(SUPPORTED_SCHEDULES)}; re-plan with one of them")
    local: list[_PipelineStageBase] = (
        list(stage) if isinstance(stage, (list, tuple)) else [stage])  # type: ignore[list-item]
    if len(local) != layout.virtual_stages:
        raise SpecError(f"schedule {name!r} with virtual_stages={layout.virtual_stages} needs "
                        f"that many stages on this rank, got {len(local)}")
    try:
        sched = actions if actions is not None else build_schedule(
            name, layout.pp, layout.micro_batches, layout.virtual_stages)
        owner = sched.stage_ranks()
    except PipelineScheduleError as e:
        raise SpecError(f"the plan's pipeline actions cannot run: {e}; re-run `hetplan plan`") \
            from e
    _check_fit(sched, layout, local, owner)
    runtime = torch_schedules._PipelineScheduleRuntime(
        local, n_microbatches=sched.num_microbatches, loss_fn=loss_fn, scale_grads=True)
    load = (getattr(runtime, "_prepare_schedule_with_comms", None)
            or getattr(runtime, "_load_actions", None))
    if load is None:
        raise SpecError(f"torch {torch.__version__} has no _PipelineScheduleRuntime loader "
                        "(_prepare_schedule_with_comms or _load_actions); use torch 2.5 to "
                        "2.13, whose pipelining runs externally supplied action lists")
    load({r: [_torch_action(a) for a in acts] for r, acts in enumerate(sched.actions)},
         format="compute_only")
    return runtime


def _check_fit(sched: PipelineSchedule, layout: Layout, local: Sequence[_PipelineStageBase],
               owner: dict[int, int]) -> None:
    """The lists' sizes equal the layout's, and pipeline rank ``r``'s list runs exactly the
    stages this rank holds."""
    want = (layout.pp, layout.micro_batches, layout.pp * layout.virtual_stages)
    got = (sched.num_ranks, sched.num_microbatches, sched.num_stages)
    if got != want:
        raise SpecError(f"the plan's pipeline actions are for (ranks, micro-batches, stages) = "
                        f"{got}, its layout needs {want}; re-run `hetplan plan`")
    me = local[0].group_rank
    held = sorted(st.stage_index for st in local)
    listed = sorted(s for s, r in owner.items() if r == me)
    if held != listed:
        raise SpecError(f"pipeline rank {me} holds stages {held}, but the plan's actions for "
                        f"it run stages {listed}; the plan's stages and actions disagree, "
                        "re-run `hetplan plan`")
    if (bad := last_stage_order_problem(sched)) is not None:
        raise SpecError(f"pipeline_actions.ranks[{bad[0]}]: the last stage runs its forwards "
                        f"for micro-batches {bad[1][:8]}; torch's schedule runtime reads "
                        "micro-batch m's loss at position m of the losses in forward order, "
                        "so they must run in micro-batch order: re-run `hetplan plan`")


def _torch_action(a: Action) -> Any:
    return torch_schedules._Action(a.stage, torch_schedules._ComputationType(a.kind.value),
                                   a.microbatch)


class StageMonitor:
    """Seconds this rank's stages spent computing, and the actions they executed, in order.

    Wraps each stage's ``forward_one_chunk`` and ``backward_one_chunk`` (the schedule issues
    point-to-point receives and sends outside them), and with :meth:`watch_loss` the
    schedule's loss of the last stage (computed after its forward, outside it: the
    vocabulary-parallel cross-entropy runs three all-reduces there), so ``step time -
    busy_s`` is the time the rank waited: the pipeline bubble plus activation transfers it
    could not overlap.
    ``executed`` lists the actions as they started (``Action(F, microbatch, stage)``). Call
    :meth:`reset` before a step and :meth:`settle` after it, then read both. With ``trace``
    set (``hetplan run --trace``), every call is also a ``compute`` span of it while it
    records (host times).

    On a GPU (``events``: :func:`~hetplan.runtime.busy_clock.cuda_events`) the calls and the
    step are timed by the device's events (:class:`~hetplan.runtime.busy_clock.BusyClock`):
    the host only queues the kernels, so its clock would time their launch.
    """

    _METHODS = {"forward_one_chunk": ActionKind.F, "backward_one_chunk": ActionKind.B}

    def __init__(self, stages: Sequence[_PipelineStageBase],
                 events: Callable[[], Any] | None = None) -> None:
        self.clock = BusyClock(events)
        self.executed: list[Action] = []
        self.trace: StepTrace | None = None
        #: called with a stage's index once its last backward of the step has ended (after
        #: the schedule's ``REDUCE_GRAD`` action for it: the gradients are scaled and final)
        self.on_gradients_final: Callable[[int], None] | None = None
        #: seconds spent in it (launching gradient syncs: neither compute nor bubble)
        self.sync_launch_s = 0.0
        for st in stages:
            for name, kind in self._METHODS.items():
                setattr(st, name, self._timed(getattr(st, name), kind, st.stage_index))
            if hasattr(st, "perform_reduce_grad"):
                st.perform_reduce_grad = self._final(  # type: ignore[method-assign]
                    st.perform_reduce_grad, st.stage_index)

    def _final(self, fn: Callable[..., Any], stage: int) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            if self.on_gradients_final is not None:
                t0 = time.perf_counter()
                self.on_gradients_final(stage)
                self.sync_launch_s += time.perf_counter() - t0
            return out

        return run

    def _timed(self, fn: Callable[..., Any], kind: ActionKind, stage: int) -> Callable[..., Any]:
        def run(chunk: int, *args: Any, **kwargs: Any) -> Any:
            self.executed.append(Action(kind, chunk, stage))
            with self.clock.busy() as host:
                out = fn(chunk, *args, **kwargs)
            if self.trace is not None and self.trace.recording:
                self.trace.add(f"{kind.value}{chunk} s{stage}", "compute", host[0], host[1],
                               kind=kind.value, microbatch=chunk, stage=stage)
            return out

        return run

    def watch_loss(self, schedule: Any) -> None:
        """Count the last stage's loss (``schedule._maybe_compute_loss``, wrapped on the
        instance) as computing time."""
        compute_loss = schedule._maybe_compute_loss

        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.clock.busy():
                return compute_loss(*args, **kwargs)

        schedule._maybe_compute_loss = timed

    @property
    def busy_s(self) -> float:
        """Seconds this step's stage calls and loss computed (complete after
        :meth:`settle`)."""
        return self.clock.busy_s

    def reset(self) -> None:
        """Forget the previous step's time and actions (on a GPU: mark the step's start)."""
        self.clock.reset()
        self.sync_launch_s = 0.0
        self.executed = []

    def settle(self, host_s: float) -> float:
        """After the step (``host_s``: its host time): its span, the device's on a GPU
        (:meth:`BusyClock.settle <hetplan.runtime.busy_clock.BusyClock.settle>`)."""
        return self.clock.settle(host_s)


def trace_schedule(schedule: Any, trace: StepTrace) -> None:
    """Marks in torch's schedule runtime for ``trace`` (``hetplan run --trace``): the
    ``action`` spans (every action of the rank's lowered list), the ``wait`` of each
    forward or backward for what it receives, and the last stage's ``loss`` per micro-batch.

    Hooks, all on ``schedule``'s own attributes (private to torch, like the loader):

    * the runtime asks ``action.computation_type in _comp_type_to_function_map`` exactly
      once per action, right before running it: the map becomes a dict that notes the time
      of each ask (the k-th ask is the k-th action of ``pipeline_order_with_comms[rank]``);
    * a forward (backward) takes its posted receive out of ``fwd_recv_ops``
      (``bwd_recv_ops``) with ``pop`` and waits on it: the dicts' ``pop`` waits itself and
      times that wait, and hands back nothing left to wait on (a gloo receive must not be
      waited twice);
    * ``_maybe_compute_loss`` is timed on the instance, and ``_update_losses`` (called once
      the last action and the sends' waits are done) ends the last action.

    Nothing is timed while ``trace`` does not record.
    """
    marks: list[float] = []
    order = schedule.pipeline_order_with_comms[schedule.rank]

    def close(end: float) -> None:
        for k, t0 in enumerate(marks):
            a = order[k]
            t1 = marks[k + 1] if k + 1 < len(marks) else end
            mb = "" if a.microbatch_index is None else a.microbatch_index
            trace.add(f"{a.computation_type.value}{mb} s{a.stage_index}",
                      "action", t0, t1, index=k, kind=a.computation_type.value,
                      microbatch=a.microbatch_index, stage=a.stage_index)
        marks.clear()

    class _ActionMarks(dict[Any, Any]):
        def __contains__(self, key: object) -> bool:
            if trace.recording:
                marks.append(time.perf_counter())
            return super().__contains__(key)

    class _TimedWaits(dict[Any, Any]):
        def __init__(self, what: str) -> None:
            super().__init__()
            self.what = what

        def pop(self, key: Any, *default: Any) -> Any:
            works = super().pop(key, *default)
            if not trace.recording or not isinstance(works, list):
                return works
            t0 = time.perf_counter()
            for w in works:
                w.wait()
            stage, mb = key
            trace.add(f"wait {self.what}{mb} s{stage}", "wait", t0, time.perf_counter(),
                      kind=self.what, microbatch=mb, stage=stage)
            return []

    compute_loss = schedule._maybe_compute_loss
    update_losses = schedule._update_losses

    def timed_loss(stage: Any, output: Any, target_mbs: Any, mb_index: int,
                   *args: Any, **kwargs: Any) -> Any:
        if not (trace.recording and stage.is_last):
            return compute_loss(stage, output, target_mbs, mb_index, *args, **kwargs)
        t0 = time.perf_counter()
        try:
            return compute_loss(stage, output, target_mbs, mb_index, *args, **kwargs)
        finally:
            trace.add(f"loss{mb_index} s{stage.stage_index}", "loss", t0,
                      time.perf_counter(), microbatch=mb_index, stage=stage.stage_index)

    def end_actions(*args: Any, **kwargs: Any) -> Any:
        close(time.perf_counter())
        return update_losses(*args, **kwargs)

    marked = _ActionMarks()
    marked.update(schedule._comp_type_to_function_map)
    schedule._comp_type_to_function_map = marked
    for attr, what in (("fwd_recv_ops", "F"), ("bwd_recv_ops", "B")):
        waits = _TimedWaits(what)
        waits.update(getattr(schedule, attr))
        setattr(schedule, attr, waits)
    schedule._maybe_compute_loss = timed_loss
    schedule._update_losses = end_actions


def step(
    schedule: Any,
    stage_index: int | Sequence[int],
    num_stages: int,
    batch: Sequence[Any] | torch.Tensor | None,
    target: Any = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """One training iteration (forward and backward of every micro-batch, no optimizer step).

    Args:
        schedule: from :func:`make_schedule`.
        stage_index: this rank's stage index (or indices, for interleaved 1F1B).
        num_stages: number of stages of the pipeline.
        batch: the whole batch's positional inputs (used on the rank holding stage 0).
        target: the whole batch's target (used on the rank holding the last stage).
        **kwargs: tensor keyword inputs of the model, chunked like ``batch`` (first stage).

    Returns:
        On the rank holding the last stage: the mean over micro-batches of the per-micro-batch
        loss (detached scalar), equal to the whole-batch mean loss (see module doc); else None.

    Raises:
        SpecError: the batch does not split into equal micro-batches, or the stages pass a
            tensor past the next stage (not supported by the schedule runtime).
    """
    indices = {stage_index} if isinstance(stage_index, int) else set(stage_index)
    first, last = 0 in indices, num_stages - 1 in indices
    n_mb = schedule._n_microbatches
    args: tuple = ()
    if first:
        args = (batch,) if isinstance(batch, torch.Tensor) else tuple(batch or ())
    for what, t in (("batch", args[0] if args else None), ("target", target if last else None)):
        if isinstance(t, torch.Tensor) and t.size(0) % n_mb:
            raise SpecError(f"the {what}'s size {t.size(0)} does not split into {n_mb} equal "
                            "micro-batches; the loss would differ from the whole-batch mean")
    losses: list[torch.Tensor] = []
    extra: dict[str, Any] = {"target": target, "losses": losses} if last else {}
    try:
        schedule.step(*args, **(kwargs if first else {}), **extra)
    except RuntimeError as e:
        if "adjacent-stage" not in str(e):
            raise
        raise SpecError(f"the pipeline's stages pass a tensor past the next stage ({e}); the "
                        "runtime sends only between adjacent stages: re-plan with fewer "
                        "stages or other stage boundaries") from e
    if not last:
        return None
    return torch.stack([loss.detach() for loss in losses]).mean()
