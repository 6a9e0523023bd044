"""Where each rank sits in a plan with per-stage degrees (the ``hetero`` section), and the
layout one stage runs.

Pure (no torch): the launcher reads :func:`plan_world_size` before any process exists, and
the runtime builds its process groups and stage layout from :func:`hetero_coords` and
:func:`stage_layout`.

The mapping is the section's own (:mod:`hetplan.ir.plan_hetero`): stage ``k`` lists its
``dp_k * tp_k`` ranks in ``plan.stages[k].ranks`` **tp innermost**, so the TP group of
replica ``d`` is ``ranks[d*tp_k : (d+1)*tp_k]`` and the data-parallel group of TP rank ``t``
is ``ranks[t::tp_k]``. A plan without the section maps ranks with
:meth:`~hetplan.ir.plan_sections.Layout.rank_of` as always.

Rows: the global batch is ``layout.micro_batches`` micro-batches of
``layout.micro_batch_size`` rows; replica ``d`` of stage ``k`` computes rows
``[d*b_k, (d+1)*b_k)`` of every micro-batch, ``b_k = micro_batch_size / dp_k``
(:func:`replica_rows`, :func:`row_overlaps`).
"""

from __future__ import annotations

from dataclasses import dataclass

from hetplan.errors import PlanMismatchError, SpecError
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import Layout

__all__ = [
    "HeteroCoords",
    "hetero_coords",
    "hetero_refusals",
    "plan_world_size",
    "replica_rows",
    "row_overlaps",
    "stage_layout",
]


@dataclass(frozen=True)
class HeteroCoords:
    """One rank's place in a heterogeneous pipeline.

    Attributes:
        rank: the global rank.
        stage: its pipeline stage (index in ``plan.stages``).
        dp_rank / tp_rank: its replica and its rank inside the replica's TP group.
        dp / tp: the stage's degrees.
        stage_ranks: every rank of the stage, tp innermost.
    """

    rank: int
    stage: int
    dp_rank: int
    tp_rank: int
    dp: int
    tp: int
    stage_ranks: tuple[int, ...]

    @property
    def tp_ranks(self) -> tuple[int, ...]:
        """The global ranks of this rank's TP group (its replica)."""
        d, tp = self.dp_rank, self.tp
        return self.stage_ranks[d * tp : (d + 1) * tp]

    @property
    def dp_ranks(self) -> tuple[int, ...]:
        """The global ranks of this rank's data-parallel group (same TP rank, every replica)."""
        return self.stage_ranks[self.tp_rank :: self.tp]


def plan_world_size(plan: Plan) -> int:
    """The number of processes that run ``plan``: ``dp * pp * tp`` of the layout, or, with
    per-stage degrees, the ranks the stages list (every rank holds exactly one stage)."""
    lay = plan.layout
    if lay is None:
        raise SpecError("the plan has no layout; compile it with `hetplan plan`")
    if plan.hetero is None:
        return lay.num_ranks
    ranks = sorted(r for st in plan.stages for r in st.ranks)
    if ranks != list(range(len(ranks))):
        idle = sorted(set(range(max(ranks, default=-1) + 1)) - set(ranks))
        raise PlanMismatchError(
            f"stages[*].ranks: the heterogeneous stages list ranks {ranks}, leaving "
            f"rank(s) {idle} without a stage; the runtime runs every process as one stage "
            "rank: re-plan (`hetplan plan --hetero`) on a cluster file with only the devices "
            "the stages use")
    return len(ranks)


def hetero_coords(plan: Plan, rank: int) -> HeteroCoords:
    """``rank``'s stage, replica and TP rank under ``plan.hetero`` (which must be set)."""
    if plan.hetero is None:
        raise SpecError("hetero_coords needs a plan with a hetero section")
    shapes = {s.stage: s for s in plan.hetero.stages}
    for st in plan.stages:
        if rank in st.ranks:
            shape = shapes[st.index]
            i = st.ranks.index(rank)
            return HeteroCoords(rank=rank, stage=st.index, dp_rank=i // shape.tp,
                                tp_rank=i % shape.tp, dp=shape.dp, tp=shape.tp,
                                stage_ranks=tuple(st.ranks))
    raise PlanMismatchError(f"rank {rank} is in none of the plan's stages "
                            f"{[list(s.ranks) for s in plan.stages]}")


def stage_layout(plan: Plan, rank: int) -> Layout:
    """The layout ``rank``'s handlers run with: the stage's ``dp`` and ``tp``, its ZeRO stage
    and per-replica micro-batch, the pipeline's ``pp``, micro-batch count and schedule.

    Handlers that shard (tensor parallelism, ZeRO, gradient sync) read their degrees from it;
    the pipeline itself is the ``hetero`` executor's (:mod:`hetplan.runtime.handlers.hetero`).
    """
    lay = plan.layout
    assert lay is not None and plan.hetero is not None
    me = hetero_coords(plan, rank)
    shape = plan.hetero.stages[me.stage]
    return lay.model_copy(update={
        "dp": me.dp, "tp": me.tp, "zero_stage": shape.zero_stage,
        "micro_batch_size": shape.micro_batch_size, "ranks": ()})


def replica_rows(micro_batch_size: int, dp: int, dp_rank: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of one global micro-batch that replica ``dp_rank`` of ``dp`` computes."""
    b = micro_batch_size // dp
    if b * dp != micro_batch_size:
        raise SpecError(f"a micro-batch of {micro_batch_size} rows does not split over "
                        f"dp={dp} replicas")
    return dp_rank * b, (dp_rank + 1) * b


def row_overlaps(micro_batch_size: int, dp_from: int, dp_to: int
                 ) -> list[tuple[int, int, int, int]]:
    """At a stage boundary: ``(sender replica, receiver replica, lo, hi)`` for every pair whose
    rows of a micro-batch overlap, ``[lo, hi)`` in micro-batch rows, in (sender, receiver)
    order."""
    out = []
    for s in range(dp_from):
        a, b = replica_rows(micro_batch_size, dp_from, s)
        for r in range(dp_to):
            c, d = replica_rows(micro_batch_size, dp_to, r)
            lo, hi = max(a, c), min(b, d)
            if lo < hi:
                out.append((s, r, lo, hi))
    return out


def hetero_refusals(plan: Plan) -> list[str]:
    """What the heterogeneous pipeline does not execute (empty: it runs), one line each."""
    if plan.hetero is None or plan.layout is None:
        return []
    lay, out = plan.layout, list[str]()
    fix = "re-plan with --hetero off"
    if lay.sequence_parallel:
        out.append("layout.sequence_parallel: sequence parallelism in a pipeline of per-stage "
                   "degrees (the boundary would scatter and gather the sequence); "
                   f"re-plan with --no-sp or {fix}")
    if lay.schedule not in ("gpipe", "1f1b"):
        out.append(f"layout.schedule: {lay.schedule!r} with per-stage degrees; the "
                   "heterogeneous pipeline runs gpipe and 1f1b: re-plan with --schedule 1f1b")
    out += _rebalancing_refusals(plan)
    if plan.group_sync is not None and plan.group_sync.policy == "sdpipe":
        out.append(f"group_sync: SDPipe group sync with per-stage degrees; {fix}")
    return out


def _rebalancing_refusals(plan: Plan) -> list[str]:
    """The applied re-balancing events the heterogeneous pipeline does not execute. Moves
    between stages of any data- and tensor-parallel degrees and ZeRO stage (0 or 1 per
    stage) run (:mod:`hetplan.runtime.handlers.hetero_rebalancing`); an event with another
    stage count (re-packing) is already refused by the plan's validator."""
    reb, tp = plan.rebalancing, plan.tensor_parallel
    if reb is None or not any(e.applied for e in reb.events):
        return []
    if tp is not None and tp.controller.variant != "off":
        return [f"tensor_parallel.controller: the TP resizing controller "
                f"({tp.controller.variant}) with applied re-balancing events on per-stage "
                "degrees (the controller's per-linear state is built for the stage's layers "
                "at setup and is not moved with a layer); re-plan with --tp-controller off, "
                "or without --dynamics"]
    return []
