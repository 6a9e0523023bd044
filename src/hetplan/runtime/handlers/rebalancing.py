"""The ``rebalancing`` section: move the pipeline to a planned stage assignment mid-training.

After the optimizer step of an applied event's iteration ``k`` (counted from 0 by this
runtime) the pipeline moves to the event's stage assignment — parameters and optimizer state
of the moved layers go point to point, and the stages, schedule, gradient sync and optimizer
are rebuilt — so iteration ``k + 1`` runs on the new stages (:mod:`hetplan.runtime.rebalance`).
``ctx.plan.stages`` becomes that assignment on every rank, as with per-stage degrees: what
reads the plan's stages later (sequence parallelism's per-stage regions when the stages are
rebuilt, recomputation per stage, the next event) sees the stages that run.
A re-packing event (fewer stages) releases the ranks past the new stage count: they idle from
then on (``ctx.released``), and the schedule's action lists are generated for the new stage
count by the same pure function as the plan's. Events of interleaved pipelines, or that would
grow back onto released ranks, are not executed; they are listed in ``skipped``.

On a plan with per-stage degrees (``hetero``) the stages keep their ranks and degrees and
the moved layers' weights and optimizer state travel as full tensors, gathered from the
source stage's TP shards and cut into the destination stage's
(:mod:`hetplan.runtime.handlers.hetero_rebalancing`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from hetplan.ir.rebalancing import PlannedEvent
from hetplan.runtime.handlers.base import Handler, RuntimeContext
from hetplan.runtime.handlers.hetero_rebalancing import rebalance_hetero
from hetplan.runtime.handlers.stages import StagesHandler
from hetplan.runtime.rebalance import (
    carry_optimizer,
    exchange_params,
    executable_events,
    plan_param_moves,
)

__all__ = ["RebalancingHandler"]


class RebalancingHandler(Handler):
    """Executes the plan's applied re-balancing events at their iterations.

    Attributes:
        pending: events still to run, in iteration order.
        skipped: ``(event, reason)`` for the events this runtime does not execute.
        rebalanced_at: the iterations whose events ran.
        rebalance_s: the seconds each of them took.
    """

    section = "rebalancing"

    def __init__(self) -> None:
        self.pending: list[PlannedEvent] = []
        self.skipped: list[tuple[PlannedEvent, str]] = []
        self.rebalanced_at: list[int] = []
        self.rebalance_s: list[float] = []

    def setup(self, ctx: RuntimeContext) -> None:
        plan, pp = ctx.plan, ctx.layout.pp
        per_rank = len(plan.stages) // max(pp, 1) if plan.stages else 1
        self.pending, self.skipped = executable_events(plan.rebalancing, pp, per_rank)

    def after_step(self, ctx: RuntimeContext) -> None:
        while self.pending and self.pending[0].iteration <= ctx.iteration:
            event = self.pending.pop(0)
            t0 = time.perf_counter()
            self._rebalance(ctx, event.stages)
            self.rebalanced_at.append(event.iteration)
            self.rebalance_s.append(time.perf_counter() - t0)

    def _shrunk_pipeline(self, ctx: RuntimeContext, k: int) -> tuple[Any, tuple[int, ...]]:
        """The pipeline group and ranks of this rank's replica on the first ``k`` stages.
        Creating groups is collective over the world: every rank, released ones included,
        creates every replica's group in the same order."""
        assert ctx.groups is not None
        mine: tuple[Any, tuple[int, ...]] = (None, ())
        for d in range(ctx.layout.dp):
            members = tuple(ctx.layout.rank_of(d, s, 0) for s in range(k))
            group = dist.new_group(list(members), timeout=ctx.timeout) if k > 1 else None
            if d == ctx.groups.dp_rank:
                mine = (group, members)
        return mine

    def _rebalance(self, ctx: RuntimeContext, bounds: Sequence[tuple[int, int]]) -> None:
        """Move to the stage assignment ``bounds`` (collective over the pipeline group; with
        fewer stages — re-packing — the ranks past them are released and idle from then on).

        Builds the new stage from the model (its parameters are the model's), sends every
        parameter whose stage changes with its optimizer state point to point, then rebuilds
        the schedule, the gradient sync and the optimizer with the carried state.
        """
        assert ctx.groups is not None
        if ctx.plan.hetero is not None:  # stages of their own degrees: full tensors travel
            rebalance_hetero(ctx, bounds)
            return
        stages_h = ctx.handler(StagesHandler)
        old_group, old_ranks = stages_h.pp_group, stages_h.pp_ranks
        new_group, new_ranks = (self._shrunk_pipeline(ctx, len(bounds))
                                if len(bounds) < stages_h.num_stages else (old_group, old_ranks))
        # every rank (released ones too) carries the new assignment: the stages are built
        # from it, and so is what reads the plan's stages after this (sequence parallelism's
        # regions per stage, recomputation per stage, the next event)
        stages = _moved_stages(ctx, bounds)
        ctx.plan = ctx.plan.model_copy(update={"stages": tuple(stages)})
        if ctx.released:
            stages_h.pp_group, stages_h.pp_ranks = new_group, new_ranks
            stages_h.num_stages = len(bounds)
            return
        me = ctx.groups.pp_rank
        sending, old_opt = dict(ctx.named_params), ctx.optimizer
        assert old_opt is not None  # a rank still in the pipeline has an optimizer
        stages_h.drop()
        if me < len(bounds) and len(bounds) > 1:
            stages_h.build(ctx, stages, new_group)
        elif me == 0:  # one stage left: this rank trains the whole model, no pipeline
            ctx.named_params = list(ctx.model.named_parameters())
        else:
            ctx.named_params = []
        receiving = dict(ctx.named_params)
        held: list[Any] = [(sorted(sending), sorted(receiving))] * len(old_ranks)
        if old_group is not None:  # None: a one-stage pipeline, nothing to gather
            dist.all_gather_object(held, held[0], group=old_group)
        moves = plan_param_moves([h[0] for h in held], [h[1] for h in held])
        received = exchange_params(moves, sending, receiving, old_opt, me, old_ranks)
        stages_h.pp_group, stages_h.pp_ranks = new_group, new_ranks
        stages_h.num_stages = len(bounds)
        ctx.params_changed()
        if me >= len(bounds):
            ctx.released, ctx.optimizer = True, None
            return
        ctx.optimizer = carry_optimizer(old_opt, ctx.make_optimizer(
            [p for _, p in ctx.named_params]), received)


def _moved_stages(ctx: RuntimeContext, bounds: Sequence[tuple[int, int]]) -> list[Any]:
    """The plan's stages ``0 .. len(bounds) - 1`` (their ranks, recompute mode ...) holding
    the layers ``bounds`` give them; their predicted times and memory no longer apply."""
    old = {s.index: s for s in ctx.plan.stages}
    names = [x.name for x in ctx.model_ir().layers]
    return [old[i].model_copy(update={"first_layer": a, "last_layer": b, "fwd_ms": 0.0,
                                      "bwd_ms": 0.0, "memory_bytes": None,
                                      "layer_names": tuple(names[a:b + 1])})
            for i, (a, b) in enumerate(bounds)]
