"""Baseline pass ``even-tp``: every tensor-parallel group splits every linear evenly.

Owns ``plan.tensor_parallel``. With ``tp == 1`` the section stays empty. Otherwise one group
per (pipeline stage, data-parallel replica), listing its ranks; an empty ``linears`` list
means "every splittable linear of the stage, split evenly" (Megatron's default), which keeps
plans of large models small. Uneven shards (heterogeneous TP) are written per linear by the
TP-resizing pass. Complexity O(ranks + linears).

Attention the runtime cannot split (decision, ``docs/decisions.md``, "TP resizing pass"):
the runtime splits an attention module by whole heads, or whole key/value groups under
grouped-query attention, and keeps it whole on every rank (with a warning) where it has
fewer than ``tp`` of them. The cost model divides every TP layer by ``tp``, so the pass says
so in a note naming those modules (:func:`unsplit_attention`, from the IR's ``split_unit``
on the output projections): the prediction is then optimistic for that attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hetplan.ir.model import LinearInfo, ModelIR, TPRole
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import TensorParallel, TPGroup
from hetplan.passes.base import PassContext, PassResult, rank_of

__all__ = ["EvenTP", "unsplit_attention"]


def unsplit_attention(model_ir: ModelIR | None, tp: int) -> list[tuple[str, int]]:
    """(output projection, whole heads or key/value groups) of every attention module of
    ``model_ir`` with fewer of them than ``tp``: the runtime keeps those whole on every rank.
    Read from the IR's ``split_unit`` on row linears (the output projection's unit is one
    head, or one group's query heads under GQA); empty without an IR."""
    if model_ir is None:
        return []
    rows: list[LinearInfo] = [lin for lay in model_ir.layers for lin in lay.linears
                              if lin.split_unit and lin.tp_role == TPRole.ROW]
    return [(lin.name, lin.in_features // lin.split_unit) for lin in rows
            if lin.split_unit and lin.in_features // lin.split_unit < tp]


def unsplit_note(found: list[tuple[str, int]], tp: int) -> str:
    """The pass note for :func:`unsplit_attention`'s modules."""
    name, units = found[0]
    return (f"{len(found)} attention module(s) run replicated at tp={tp}: fewer whole heads "
            f"(key/value groups) than ranks (e.g. {name}: {units}); the runtime keeps them "
            f"whole on every rank, the prediction divides them by tp")


@dataclass(frozen=True)
class EvenTP:
    """Even tensor-parallel shards (the baseline the TP-resizing pass must beat)."""

    name: ClassVar[str] = "even-tp"
    sections: ClassVar[tuple[str, ...]] = ("tensor_parallel",)
    refines: ClassVar[bool] = False

    def run(self, plan: Plan, ctx: PassContext) -> PassResult:
        lay = ctx.layout
        if lay.tp == 1:
            return PassResult(plan.model_copy(update={"tensor_parallel": None}), False)
        groups = tuple(
            TPGroup(
                ranks=tuple(rank_of(lay, d, s, t) for t in range(lay.tp)),
                stage=s,
            )
            for s in range(lay.pp)
            for d in range(lay.dp)
        )
        tp = TensorParallel(groups=groups)
        notes = [f"{len(groups)} group(s) of {lay.tp}, even shards"]
        unsplit = unsplit_attention(ctx.model_ir, lay.tp)
        if unsplit:
            notes.append(unsplit_note(unsplit, lay.tp))
        return PassResult(plan.model_copy(update={"tensor_parallel": tp}), True, tuple(notes))
