"""Baseline pass ``uniform-stages``: equal layer counts per pipeline stage (Megatron style).

Owns ``plan.stages``. Layers are split into ``pp`` contiguous stages (``pp * virtual_stages``
interleaved chunks) whose sizes differ by at most one (the first ``L mod pp`` stages get the
extra layer). Each stage's activation recomputation is the ``recompute`` option, or with
``auto`` the cheapest that fits (:func:`~hetplan.cost_models.rank_memory.choose_recompute`).
Complexity O(L + ranks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hetplan.algorithms.partition import uniform_partition
from hetplan.cost_models.rank_memory import RECOMPUTE_ORDER, choose_recompute
from hetplan.errors import PassError, SpecError
from hetplan.ir.plan import Plan
from hetplan.passes.base import PassContext, PassResult, stages_from_bounds

__all__ = ["UniformStages"]


@dataclass(frozen=True)
class UniformStages:
    """Split layers evenly by count (the baseline every pipeline pass must beat).

    Attributes:
        recompute: ``auto`` (the cheapest recomputation that fits, per stage) or one mode
            for every stage: ``none``, ``selective``, ``full``.
    """

    recompute: str = "auto"
    name: ClassVar[str] = "uniform-stages"
    sections: ClassVar[tuple[str, ...]] = ("stages",)
    refines: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.recompute not in ("auto", *RECOMPUTE_ORDER):
            raise SpecError(f"{self.name}{{recompute={self.recompute}}}: expected auto, "
                            f"{', '.join(RECOMPUTE_ORDER)}")

    def run(self, plan: Plan, ctx: PassContext) -> PassResult:
        n, pp = len(ctx.workload.layers), ctx.layout.pp * ctx.layout.virtual_stages
        if pp > n:
            raise PassError(f"{self.name}: {pp} pipeline stages but only {n} layers")
        base, extra = divmod(n, pp)
        cut = [x.cuttable_before for x in ctx.workload.layers]
        stages = stages_from_bounds(list(uniform_partition(n, pp, cut)), ctx)
        stages = choose_recompute(ctx.workload, ctx.layout, stages, ctx.costs,
                                  mode=self.recompute)
        modes = sorted({st.recompute for st in stages} - {"none"})
        note = f"{pp} stage(s) of {base}-{base + (1 if extra else 0)} layers"
        return PassResult(plan.model_copy(update={"stages": stages}), True,
                          (note + (f", recompute {'/'.join(modes)}" if modes else ""),))
