"""Baseline pass ``even-tp``: every tensor-parallel group splits every linear evenly.

Owns ``plan.tensor_parallel``. With ``tp == 1`` the section stays empty. Otherwise one group
per (pipeline stage, data-parallel replica), listing its ranks; an empty ``linears`` list
means "every splittable linear of the stage, split evenly" (Megatron's default), which keeps
plans of large models small. Uneven shards (heterogeneous TP) are written per linear by the
TP-resizing pass. Complexity O(ranks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import TensorParallel, TPGroup
from hetplan.passes.base import PassContext, PassResult, rank_of

__all__ = ["EvenTP"]


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
        note = f"{len(groups)} group(s) of {lay.tp}, even shards"
        return PassResult(plan.model_copy(update={"tensor_parallel": tp}), True, (note,))
