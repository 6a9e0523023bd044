"""Baseline pass ``uniform-stages``: equal layer counts per pipeline stage (Megatron style).

Owns ``plan.stages``. Layers are split into ``pp`` contiguous stages whose sizes differ by at
most one (the first ``L mod pp`` stages get the extra layer). Complexity O(L + ranks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hetplan.algorithms.partition import uniform_partition
from hetplan.errors import PassError
from hetplan.ir.plan import Plan
from hetplan.passes.base import PassContext, PassResult, stages_from_bounds

__all__ = ["UniformStages"]


@dataclass(frozen=True)
class UniformStages:
    """Split layers evenly by count (the baseline every pipeline pass must beat)."""

    name: ClassVar[str] = "uniform-stages"
    sections: ClassVar[tuple[str, ...]] = ("stages",)
    refines: ClassVar[bool] = False

    def run(self, plan: Plan, ctx: PassContext) -> PassResult:
        n, pp = len(ctx.workload.layers), ctx.layout.pp
        if pp > n:
            raise PassError(f"{self.name}: {pp} pipeline stages but only {n} layers")
        base, extra = divmod(n, pp)
        stages = stages_from_bounds(list(uniform_partition(n, pp)), ctx)
        return PassResult(plan.model_copy(update={"stages": stages}), True,
                          (f"{pp} stage(s) of {base}-{base + (1 if extra else 0)} layers",))
