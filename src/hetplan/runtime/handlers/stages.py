"""The ``stages`` and ``pipeline_actions`` sections: this rank's stages and the schedule.

With a pipeline (``pp > 1``) the handler builds the stages this rank holds — one, or
``virtual_stages`` for interleaved 1F1B: every plan stage whose ``ranks`` name this rank —
from the plan's split (:mod:`hetplan.runtime.pipeline`), and a schedule that executes the
plan's action list for its pipeline rank (:mod:`hetplan.runtime.schedule`). A plan written
before ``pipeline_actions`` existed runs the lists generated for its layout by the same pure
function the simulator uses (:func:`~hetplan.algorithms.pipeline_schedules.plan_schedule`).
Without a pipeline the rank trains the whole model, micro-batch after micro-batch
(gradient accumulation; the gradient sync of the last one overlaps its backward).

Tied parameters (GPT-2's ``wte``/``lm_head``): a parameter that layers of different stages
read is kept on every stage that reads it, as Megatron keeps the word embedding on the first
and last stage. Each copy accumulates the gradient of its own uses; after the schedule, the
copies' gradients are summed over the *tie group* (the ranks of one data- and tensor-parallel
coordinate that hold such a stage) and every copy gets the sum. The sum comes after the
data-parallel gradient sync (Megatron-LM's order): the plan lists a tied tensor once, so the
copies may sync through different buckets and strategies (the first stage's in the plan's
bucket, perhaps compressed or cast; the last stage's, under another name, in fp32), and a
sum before the sync would let the copies' lossy rounding differ and the copies drift apart.
Summed after it, both get the same gradient bit for bit. Under ZeRO-2, whose reduce-scatter
leaves each rank a shard of a flat buffer the copies do not share, the sum stays before the
sync. The copies start equal (every rank builds the model with the same weights) and take
the same optimizer steps, so they stay equal: the gradient is the unsplit model's (up to
the sync's own loss, where it compresses).

Data: every rank is given the same global batch; data-parallel replica ``d`` trains on rows
``[d·b, (d+1)·b)`` with ``b = batch / dp``, split into the plan's micro-batches.

A plan with per-stage degrees (``hetero``) builds this rank's one stage module and runs it
with :class:`~hetplan.runtime.handlers.hetero.HeteroPipeline`, which moves activations
between stages of different data- and tensor-parallel degrees itself (torch's stages talk to
one peer per neighbour); its replicas take rows of every micro-batch instead. A Chimera plan
builds this rank's two stages (``r`` and ``P-1-r``) and runs them with
:class:`~hetplan.runtime.handlers.chimera.ChimeraPipeline`; the data-parallel group becomes
the group of both directions' copies.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from hetplan.algorithms.pipeline_schedules import (
    Action,
    PipelineSchedule,
    PipelineScheduleError,
    build_schedule,
    plan_schedule,
)
from hetplan.errors import SpecError
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import Layout, Stage
from hetplan.runtime.busy_clock import cuda_events
from hetplan.runtime.composition import effective_zero_stage
from hetplan.runtime.handlers.base import Handler, LocalStage, RuntimeContext

if TYPE_CHECKING:
    from hetplan.runtime.handlers.chimera import ChimeraPipeline
    from hetplan.runtime.handlers.hetero import HeteroPipeline
    from hetplan.runtime.schedule import StageMonitor
    from hetplan.runtime.trace import StepTrace

__all__ = ["StagesHandler", "stage_modules", "trace_example"]


class StagesHandler(Handler):
    """Runs the step's micro-batches: through the plan's pipeline schedule, or locally.

    Attributes:
        stages: this rank's pipeline stages (empty without a pipeline).
        schedule: the torch schedule running ``actions`` (None without a pipeline).
        actions: the plan's per-rank action lists in use (None without a pipeline).
        ties: the parameters tied across stages and this rank's group for each.
        monitor: compute time and executed actions of the last step (None without one).
        pp_group / pp_ranks: the pipeline group of this rank's replica and its global ranks.
        num_stages: the pipeline's current stage count (re-packing lowers it).
        trace: the step trace its marks write (``hetplan run --trace``; None: no marks).
    """

    section = "stages, pipeline_actions, hetero"

    def __init__(self) -> None:
        self.stages: list[Any] = []
        self.schedule: Any = None
        self.actions: PipelineSchedule | None = None
        self.monitor: StageMonitor | None = None
        self.pp_group: Any = None
        self.pp_ranks: tuple[int, ...] = ()
        self.num_stages = 1
        self.ties: list[_Tie] = []
        self.ties_synced = False  # _tie_groups made a group for every tie (this rank's or not)
        self.hetero: HeteroPipeline | None = None
        self.chimera: ChimeraPipeline | None = None
        self.trace: StepTrace | None = None

    @property
    def executed(self) -> tuple[Action, ...]:
        """The actions this rank's stages executed in the last step, in order."""
        return tuple(self.monitor.executed) if self.monitor is not None else ()

    @property
    def stage_indices(self) -> list[int]:
        """The plan stage indices this rank holds."""
        return [st.stage_index for st in self.stages]

    def start_trace(self, trace: StepTrace) -> None:
        """Mark this rank's micro-batches in ``trace``: the pipeline schedule's actions, the
        waits for what they receive, the stages' compute and the loss
        (:func:`~hetplan.runtime.schedule.trace_schedule`); without a pipeline, the forward
        and backward of every micro-batch. A plan with per-stage degrees is not marked."""
        self.trace = trace
        self._mark_schedule()

    def _mark_schedule(self) -> None:
        if self.chimera is not None:
            self.chimera.trace = self.trace
        if self.trace is None or self.schedule is None or self.monitor is None:
            return
        from hetplan.runtime.schedule import trace_schedule

        self.monitor.trace = self.trace
        trace_schedule(self.schedule, self.trace)

    def setup(self, ctx: RuntimeContext) -> None:
        layout = ctx.layout
        self.num_stages = layout.pp
        if ctx.groups is not None:
            self.pp_group, self.pp_ranks = ctx.groups.pp_group, ctx.groups.pp_ranks
        if layout.pp == 1:
            ctx.named_params = list(ctx.model.named_parameters())
            return
        if ctx.plan.hetero is not None:
            self._build_hetero(ctx)
            return
        if layout.schedule == "chimera":
            self._build_chimera(ctx)
            return
        actions = _plan_actions(layout, ctx.plan)
        self.ties = _tie_groups(ctx, ctx.plan.stages)
        self.ties_synced = True
        self.build(ctx, ctx.plan.stages, self.pp_group, actions)

    def build(self, ctx: RuntimeContext, stages: Sequence[Stage], pp_group: Any,
              actions: PipelineSchedule | None = None) -> None:
        """Build this rank's stages of ``stages`` on ``pp_group`` and the schedule running
        ``actions`` (default: the lists generated for the layout's schedule over
        ``len(stages) / virtual_stages`` ranks); ``ctx.named_params`` becomes theirs."""
        layout = ctx.layout
        assert ctx.groups is not None  # pp > 1 passed the world-size check: distributed
        v = layout.virtual_stages
        ranks = len(stages) // v
        if len(stages) != ranks * v or ranks < 2:
            raise SpecError(f"the plan has {len(stages)} stage(s) for a pipeline of "
                            f"{layout.pp} ranks with virtual_stages={v}; it needs "
                            f"{layout.pp * v}: re-run `hetplan plan`")
        if layout.micro_batches < ranks:
            raise SpecError(f"the plan pipelines {ranks} stages over {layout.micro_batches} "
                            "micro-batch(es); the runtime's schedules need at least one per "
                            "stage: re-plan")
        # torch.distributed.pipelining takes seconds to import: only pipelines pay for it
        from hetplan.runtime.pipeline import build_stages, stage_indices_of_rank
        from hetplan.runtime.schedule import StageMonitor, make_schedule

        indices = stage_indices_of_rank(stages, ctx.groups.rank)
        example = trace_example(ctx)
        device = next(ctx.model.parameters()).device
        for tie in self.ties:
            if _tie_members(ctx, stages, tie.names) != tie.ranks:
                raise SpecError(f"the parameters tied across stages {list(tie.names)} moved to "
                                f"other ranks than {list(tie.ranks)} (re-balancing); the "
                                "runtime sums their gradients over the ranks of the plan's "
                                "own stages only: re-plan without re-balancing")
        unsharded, units, required = _tensor_parallel_source(ctx)
        kept: list[tuple[int, tuple[str, ...]]] = []
        self.stages = build_stages(
            ctx.model, example, ctx.forward_kwargs, stages, indices, pp_group, device,
            ir_layer_names=[x.name for x in ctx.model_ir().layers],
            allow_cross_stage_ties=self.ties_synced, traced_from=unsharded,
            eager_units=units, eager_required=required, kept=kept)
        if unsharded is not None:
            _tensor_parallel_in_stages(ctx, indices, kept)
        sized = layout if ranks == layout.pp else layout.model_copy(update={"pp": ranks})
        if actions is None:
            actions = build_schedule(layout.schedule, ranks, layout.micro_batches, v)
        # through ctx: handlers set up later (precision's fp32 loss) wrap ctx.loss_fn
        self.schedule = make_schedule(self.stages, sized, lambda out, y: ctx.loss_fn(out, y),
                                      actions)
        self.actions = actions
        self.monitor = StageMonitor(self.stages, cuda_events(ctx.model))
        self.monitor.watch_loss(self.schedule)
        self.monitor.on_gradients_final = functools.partial(self._gradients_final, ctx)
        self._mark_schedule()  # a re-built schedule (re-balancing) keeps the trace's marks
        self.pp_group, self.num_stages = pp_group, ranks
        ctx.named_params = _owned_params(self.stages, stages, ctx.model_ir().layers)

    def _build_hetero(self, ctx: RuntimeContext) -> None:
        """This rank's stage of a plan with per-stage degrees, and its executor."""
        from hetplan.runtime.handlers.hetero import HeteroPipeline

        plan, groups = ctx.plan, ctx.groups
        assert plan.layout is not None and groups is not None
        sched = _plan_actions(plan.layout, plan)
        k = groups.pp_rank
        mine = sched.actions[k]
        if any(a.stage != k for a in mine):
            raise SpecError(f"pipeline_actions.ranks[{k}]: actions of other stages "
                            f"({[str(a) for a in mine if a.stage != k][:3]}); a pipeline of "
                            "per-stage degrees runs one stage per position (gpipe, 1f1b)")
        self.stages = [LocalStage(self._hetero_module(ctx, plan.stages, k), k)]
        self.hetero = HeteroPipeline(ctx, self.stages[0],
                                     [(a.kind.value, a.microbatch) for a in mine])
        self.num_stages = len(plan.stages)
        ctx.named_params = _owned_params(self.stages, plan.stages, ctx.model_ir().layers)

    def _build_chimera(self, ctx: RuntimeContext) -> None:
        """This rank's two stages of a Chimera plan, its executor, and the Chimera groups;
        the data-parallel group becomes the sync group of the stages' copies
        (:mod:`hetplan.runtime.handlers.chimera`)."""
        from hetplan.runtime.handlers.chimera import (
            ChimeraPipeline,
            boundaries,
            check_chimera_shape,
            check_transfer_order,
            chimera_groups,
            warm_up,
        )
        from hetplan.runtime.pipeline import stage_modules as split_stages
        from hetplan.runtime.pipeline import stage_owning, tied_across_stages

        plan, groups = ctx.plan, ctx.groups
        assert plan.layout is not None and groups is not None
        sched = _plan_actions(plan.layout, plan)
        check_chimera_shape(sched)
        check_transfer_order(sched)
        mine = sorted({a.stage for a in sched.actions[groups.pp_rank]})
        layer_names = [x.name for x in ctx.model_ir().layers]
        ties = tied_across_stages(ctx.model, plan.stages, layer_names)
        for names in ties:
            owners = {stage_owning(plan.stages, layer_names, n) for n in names}
            holders = [{a.stage for a in acts} for acts in sched.actions]
            if not any(owners <= h for h in holders):
                raise SpecError(f"parameters tied across stages {list(names)} (stages "
                                f"{sorted(o for o in owners if o is not None)}) are held by "
                                "no single rank of the Chimera pipeline, whose ranks hold "
                                "stages r and P-1-r; re-plan with --schedule 1f1b")
        every = list(range(len(plan.stages)))
        modules = split_stages(ctx.model, trace_example(ctx), ctx.forward_kwargs, plan.stages,
                               every, ir_layer_names=layer_names, allow_ties=True)
        sent = boundaries([modules[i] for i in every], trace_example(ctx))
        for names in ties:
            _retie([modules[i] for i in mine], names)
        cg = chimera_groups(ctx)
        warm_up(sched, cg, groups.pp_ranks, groups.pp_rank,
                next(ctx.model.parameters()).device)
        ctx.groups = cg.data_parallel(groups)
        self.stages = [LocalStage(modules[i], i) for i in mine]
        self.chimera = ChimeraPipeline(ctx, {i: modules[i] for i in mine}, sched, sent, cg)
        self.actions = sched
        self.num_stages = len(plan.stages)
        seen: set[int] = set()
        ctx.named_params = []
        for n, p in _owned_params(self.stages, plan.stages, ctx.model_ir().layers):
            if id(p) not in seen:  # a re-tied parameter under its first stage's name
                seen.add(id(p))
                ctx.named_params.append((n, p))

    def rebuild_hetero(self, ctx: RuntimeContext, stages: Sequence[Stage]) -> None:
        """Re-balancing on a plan with per-stage degrees: this rank's stage module rebuilt
        for ``stages`` (same stage index, ranks and degrees; other layers), put into the
        executor, which keeps its action list; ``ctx.named_params`` becomes its own."""

        assert self.hetero is not None and self.stages
        k = self.stages[0].stage_index
        self.stages = [LocalStage(self._hetero_module(ctx, stages, k), k)]
        self.hetero.stage = self.stages[0]
        ctx.named_params = _owned_params(self.stages, stages, ctx.model_ir().layers)

    @staticmethod
    def _hetero_module(ctx: RuntimeContext, stages: Sequence[Stage], k: int) -> Any:
        """Stage ``k`` of ``stages`` as a module whose parameters are the model's (its
        tensor-parallel modules where the stage's layers run sharded)."""
        from hetplan.runtime.pipeline import stage_modules

        example = trace_example(ctx)
        unsharded, units, required = _tensor_parallel_source(ctx)
        kept: list[tuple[int, tuple[str, ...]]] = []
        module = stage_modules(
            ctx.model, example, ctx.forward_kwargs, stages, [k],
            ir_layer_names=[x.name for x in ctx.model_ir().layers], traced_from=unsharded,
            eager_units=units, eager_required=required, kept=kept)[k]
        if unsharded is not None:
            _tensor_parallel_in_stages(ctx, [k], kept)
        return module

    def drop(self) -> None:
        """Forget the stages and the schedule (before re-balancing builds new ones)."""
        self.stages, self.schedule, self.actions, self.monitor = [], None, None, None

    def run_micro_batches(self, ctx: RuntimeContext, inputs: Sequence[torch.Tensor],
                          target: torch.Tensor) -> float | torch.Tensor | None:
        if self.hetero is not None:  # the replica's rows of every micro-batch: its own
            return _own_executor(ctx, self.hetero, inputs, target)
        xs = [_local_rows(ctx, x) for x in inputs]
        y = _local_rows(ctx, target)
        if self.chimera is not None:
            return _own_executor(ctx, self.chimera, xs, y)
        if ctx.released:
            return float("nan")
        if self.schedule is not None:
            return self._pipeline(ctx, xs, y)
        m = ctx.layout.micro_batches
        chunks = [torch.chunk(x, m) for x in xs]
        ys = torch.chunk(y, m)
        losses = []
        micro_batch = (self._micro_batch if self.trace is None or not self.trace.recording
                       else self._traced_micro_batch)
        for i in range(m):
            if i < m - 1:
                with ctx.accumulating():
                    losses.append(micro_batch(ctx, [c[i] for c in chunks], ys[i], m))
            else:
                losses.append(micro_batch(ctx, [c[i] for c in chunks], ys[i], m))
        # summed on the device: the runtime reads it once the step is queued (no host sync)
        return losses[0] if m == 1 else torch.stack(losses).sum()

    @staticmethod
    def _micro_batch(ctx: RuntimeContext, xs: list[torch.Tensor], y: torch.Tensor,
                     m: int) -> torch.Tensor:
        out = ctx.model(*xs, **ctx.forward_kwargs)
        loss = ctx.loss_fn(out, y) / m
        loss.backward()
        return loss.detach()

    def _traced_micro_batch(self, ctx: RuntimeContext, xs: list[torch.Tensor],
                            y: torch.Tensor, m: int) -> torch.Tensor:
        """:meth:`_micro_batch` with its forward (the loss included) and backward (the last
        one's gradient hooks included) as ``compute`` spans of the trace."""
        assert self.trace is not None
        mb = len([s for s in self.trace.spans if s.cat == "compute" and s.args.get("kind")
                  == "F"])
        t0 = time.perf_counter()
        out = ctx.model(*xs, **ctx.forward_kwargs)
        loss = ctx.loss_fn(out, y) / m
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        self.trace.add(f"F{mb} s0", "compute", t0, t1, kind="F", microbatch=mb, stage=0)
        self.trace.add(f"B{mb} s0", "compute", t1, t2, kind="B", microbatch=mb, stage=0)
        return loss.detach()

    def _pipeline(self, ctx: RuntimeContext, xs: list[torch.Tensor], y: torch.Tensor) -> float:
        """One schedule step. It runs every micro-batch's backward; a stage whose last
        backward has ended tells the handlers (:meth:`_gradients_final`: on NCCL its
        gradients then sync while the rank's later stages compute); ``ctx.bubble_s`` gets the
        schedule time the stages neither computed nor spent launching syncs."""
        from hetplan.runtime.schedule import step

        assert self.monitor is not None
        self.monitor.reset()
        t0 = time.perf_counter()
        with ctx.accumulating():
            loss = step(self.schedule, self.stage_indices, self.num_stages, xs, y)
        span = self.monitor.settle(time.perf_counter() - t0)
        ctx.bubble_s = max(span - self.monitor.busy_s - self.monitor.sync_launch_s, 0.0)
        return float(loss) if loss is not None else float("nan")

    def _gradients_final(self, ctx: RuntimeContext, stage_index: int) -> None:
        """Tell every handler that stage ``stage_index``'s gradients are final for this step
        (tied parameters too, unless their copies are summed before the sync:
        :meth:`after_backward`)."""
        tied = {n for tie in self.ties for n in tie.names} if _sum_before_sync(ctx) else set()
        st = next(s for s in self.stages if s.stage_index == stage_index)
        final = {id(p) for n, p in st.submod.named_parameters(remove_duplicate=False)
                 if n not in tied}
        for h in ctx.handlers:
            h.stage_gradients_final(ctx, final)

    def after_backward(self, ctx: RuntimeContext) -> None:
        """Under ZeRO-2, whose reduce-scatter (the ZeRO handler's, after this one) leaves each
        rank a shard of a flat buffer that the copies do not share: sum the gradients of
        every tied parameter's copies over its tie group before the sync."""
        if _sum_before_sync(ctx):
            for tie in self.ties:
                _sum_tied(self.stages, tie)

    def after_sync(self, ctx: RuntimeContext) -> None:
        """Sum the gradients of every tied parameter's copies over its tie group after the
        data-parallel sync (as Megatron-LM sums the embedding group's after its data-parallel
        all-reduce), so every copy takes the same step even where the plan syncs one copy
        lossily or with another strategy than the other (module docstring). Under ZeRO-3 the
        gradients are FSDP's shards, reduced during backward, one shard per parameter: summed
        shard by shard."""
        if not _sum_before_sync(ctx):
            for tie in self.ties:
                _sum_tied(self.stages, tie)

    def close(self, ctx: RuntimeContext) -> None:
        self.drop()
        self.hetero = None
        self.chimera = None
        self.pp_group = None
        self.ties = []
        self.ties_synced = False


def _plan_actions(layout: Layout, plan: Plan) -> PipelineSchedule:
    """The plan's per-rank action lists, decoded and checked (a :class:`SpecError` naming
    the fix when they cannot run)."""
    try:
        return plan_schedule(layout, plan.pipeline_actions)
    except PipelineScheduleError as e:
        raise SpecError(f"the plan's pipeline_actions cannot run: {e}; re-run "
                        "`hetplan plan`") from e


def _own_executor(ctx: RuntimeContext, executor: HeteroPipeline | ChimeraPipeline,
                  xs: Sequence[torch.Tensor], y: torch.Tensor) -> float:
    """One step of a pipeline executor of the runtime's own (heterogeneous, Chimera): every
    backward only accumulates, ``ctx.bubble_s`` is the step's span less its compute."""
    clock = executor.clock
    clock.reset()
    t0 = time.perf_counter()
    with ctx.accumulating():
        loss = executor.step(ctx, xs, y)
    span = clock.settle(time.perf_counter() - t0)
    ctx.bubble_s = max(span - clock.busy_s, 0.0)
    return loss


def stage_modules(ctx: RuntimeContext) -> list[torch.nn.Module]:
    """This rank's pipeline stage modules, the (traced) submodules it runs; empty without a
    pipeline. They share the model's parameters; a traced stage may hold buffers of its own."""
    stages = next((h for h in ctx.handlers if isinstance(h, StagesHandler)), None)
    return [st.submod for st in stages.stages] if stages is not None else []


def _tensor_parallel_source(ctx: RuntimeContext) -> tuple[Any, list[tuple[str, ...]],
                                                          list[str]]:
    """With tensor parallelism: the model as it was before sharding (to trace), the units
    whose sharded modules the stages run, and the names that must run sharded; else
    ``(None, [], [])``."""
    from hetplan.runtime.handlers.tensor_parallel import TensorParallelHandler

    try:
        tp = ctx.handler(TensorParallelHandler)
    except LookupError:
        return None, [], []
    return tp.unsharded, list(tp.eager_units), list(tp.eager_required)


def _tensor_parallel_in_stages(ctx: RuntimeContext, indices: Sequence[int],
                               kept: Sequence[tuple[int, tuple[str, ...]]]) -> None:
    """Sequence parallelism on the stages whose layers all run as the model's sharded
    modules; a warning naming what runs without it, or replicated (modules whose traced
    calls take several inputs)."""
    import warnings

    from hetplan.runtime.handlers.tensor_parallel import TensorParallelHandler

    tp = ctx.handler(TensorParallelHandler)
    layer_names = {x.name for x in ctx.model_ir().layers}
    no_sp = {i for i, u in kept if u[0] in layer_names}
    split_parts = {u for _, u in kept if u[0] not in layer_names}
    if ctx.layout.sequence_parallel:
        tp.sequence_parallel_stages(ctx, set(indices) - no_sp)
    first_tp = ctx.groups is not None and ctx.groups.tp_rank == 0
    if no_sp and ctx.layout.sequence_parallel and first_tp:
        warnings.warn(f"stages {sorted(no_sp)} run without sequence parallelism: their "
                      f"layers {sorted({u[0] for i, u in kept if i in no_sp})} take several "
                      "inputs in the traced stage, and a sequence slice cannot enter them",
                      RuntimeWarning, stacklevel=2)
    if split_parts and first_tp:
        warnings.warn(f"{sorted(split_parts)} run replicated in their traced stages (their "
                      "calls take several inputs); the rest of those layers is split",
                      RuntimeWarning, stacklevel=2)


@dataclass(frozen=True)
class _Tie:
    """Names of one parameter tied across stages, the global ranks of this rank's tie group
    (its data- and tensor-parallel coordinate), and that group (None: one rank)."""

    names: tuple[str, ...]
    ranks: tuple[int, ...]
    group: Any


def _tie_members(ctx: RuntimeContext, stages: Sequence[Stage], names: Sequence[str],
                 rank: int | None = None) -> tuple[int, ...]:
    """The global ranks with ``rank``'s (dp, tp) coordinates (default: this rank's) that hold
    a stage whose layers own one of ``names``."""
    from hetplan.runtime.pipeline import stage_owning

    assert ctx.groups is not None
    layout = ctx.layout
    me = ctx.groups.rank if rank is None else rank
    d, _, t = layout.coords(me)
    layer_names = [x.name for x in ctx.model_ir().layers]
    owners = {stage_owning(stages, layer_names, n) for n in names}
    return tuple(sorted(r for s in stages if s.index in owners for r in s.ranks
                        if layout.coords(r)[0] == d and layout.coords(r)[2] == t))


def _tie_groups(ctx: RuntimeContext, stages: Sequence[Stage]) -> list[_Tie]:
    """One process group per tied parameter and (dp, tp) coordinate, created on every rank in
    the same order (``new_group`` is collective); this rank keeps its own."""
    import torch.distributed as dist

    from hetplan.runtime.pipeline import tied_across_stages

    assert ctx.groups is not None
    layer_names = [x.name for x in ctx.model_ir().layers]
    ties = tied_across_stages(ctx.model, stages, layer_names)
    out = []
    world = ctx.layout.num_ranks
    for names in ties:
        mine: _Tie | None = None
        seen: list[tuple[int, ...]] = []
        for r in range(world):
            members = _tie_members(ctx, stages, names, r)
            if members in seen or r not in members:
                continue
            seen.append(members)
            group = (dist.new_group(list(members), timeout=ctx.timeout) if len(members) > 1
                     else None)
            if ctx.groups.rank in members:
                mine = _Tie(tuple(names), members, group)
        if mine is not None:  # a middle stage of pp > 2 holds no copy
            out.append(mine)
    return out


def _owned_params(local: Sequence[Any], stages: Sequence[Stage],
                  layers: Sequence[Any]) -> list[tuple[str, torch.nn.Parameter]]:
    """The trainable parameters of this rank's stages: those owned by one of the stage's
    layers, or by no layer at all. A traced stage may also carry a tied parameter under the
    name of a layer of another stage (pipelining keeps the attribute), which it never reads;
    training it would only leave a stale copy."""
    from hetplan.runtime.pipeline import stage_owning

    names = [x.name for x in layers]
    out = []
    for st in local:
        for n, p in st.submod.named_parameters():
            owner = stage_owning(stages, names, n)
            if owner is None or owner == st.stage_index:
                out.append((n, p))
    return out


def _sum_before_sync(ctx: RuntimeContext) -> bool:
    """Whether tied copies are summed before the data-parallel sync (ZeRO-2's flat shards:
    :meth:`StagesHandler.after_backward`) rather than after it."""
    return effective_zero_stage(ctx.layout) == 2


def _sum_tied(stages: Sequence[Any], tie: _Tie) -> None:
    """Every local copy of ``tie`` gets the sum of all copies' gradients over its group."""
    import torch.distributed as dist

    copies: dict[int, torch.nn.Parameter] = {}
    for st in stages:
        for n, p in st.submod.named_parameters(remove_duplicate=False):
            if n in tie.names and p.grad is not None:
                copies[id(p)] = p
    local = list(copies.values())
    if not local and tie.group is None:
        return
    # ZeRO-3's grads are DTensor shards, alike on every copy of one data-parallel rank
    grads = [_local(p.grad) for p in local if p.grad is not None]
    total = torch.stack(grads).sum(0) if grads else None
    if tie.group is not None:
        if total is None:  # this rank's stages hold the name but never read it
            raise SpecError(f"tied parameter {list(tie.names)}: no gradient on rank "
                            f"{dist.get_rank()}; its stages do not use it")
        dist.all_reduce(total, group=tie.group)
    for p in local:
        assert p.grad is not None and total is not None
        _local(p.grad).copy_(total)


def _retie(modules: Sequence[torch.nn.Module], names: Sequence[str]) -> None:
    """Point every copy of a tied parameter in ``modules`` (one rank's stages; the split gives
    each stage its own) at the first one, so the rank trains one parameter: autograd sums its
    uses, and the gradient sync and the optimizer see it once."""
    first: torch.nn.Parameter | None = None
    for mod in modules:
        for n in names:
            path, _, attr = n.rpartition(".")
            try:
                owner = mod.get_submodule(path) if path else mod
            except AttributeError:
                continue
            p = owner._parameters.get(attr)
            if p is None:
                continue
            if first is None:
                first = p
            elif p is not first:
                setattr(owner, attr, first)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view of it), else ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


def trace_example(ctx: RuntimeContext) -> list[Any]:
    """One micro-batch of the example inputs, on the model's device, to trace the stages
    with. The worker builds the examples on the CPU and moves the model: traced against a
    model on a GPU, a CPU example failed the trace (an embedding of CPU ids in a CUDA
    table)."""
    device = next((p.device for p in ctx.model.parameters()), torch.device("cpu"))
    return [_example_rows(a.to(device) if isinstance(a, torch.Tensor) else a,
                          ctx.layout.micro_batch_size) for a in ctx.example_args]


def _example_rows(a: Any, rows: int) -> Any:
    """The example input repeated to ``rows`` rows (one micro-batch, for tracing)."""
    if not isinstance(a, torch.Tensor):
        return a
    reps = (rows + a.shape[0] - 1) // a.shape[0]
    return a.repeat(reps, *([1] * (a.dim() - 1)))[:rows].clone()


def _local_rows(ctx: RuntimeContext, t: torch.Tensor) -> torch.Tensor:
    """This data-parallel replica's rows of the global batch."""
    dp = ctx.layout.dp
    b = t.shape[0] // dp
    if b * dp != t.shape[0]:
        raise SpecError(f"global batch of {t.shape[0]} rows does not split over dp={dp}")
    d = ctx.groups.dp_rank if ctx.groups is not None else 0
    return t[d * b : (d + 1) * b]
