"""The stages' ``recompute`` field: activation recomputation of this rank's blocks.

Without a pipeline the rank runs every stage of the plan (one), so each block of the model
gets its stage's mode (:func:`~hetplan.runtime.recompute.apply_recompute`: ``full`` a
non-reentrant checkpoint per block, ``selective`` per attention core). Pipeline stages are
traced into graph modules whose blocks are no longer modules of their own, so a pipeline plan
that recomputes is refused before setup (:mod:`hetplan.runtime.composition`).
"""

from __future__ import annotations

from torch import nn

from hetplan.runtime.handlers.base import Handler, RuntimeContext
from hetplan.runtime.recompute import apply_recompute, unwrap

__all__ = ["RecomputeHandler"]


class RecomputeHandler(Handler):
    """Applies each stage's recomputation to the blocks this rank runs.

    Attributes:
        wrapped: the modules whose forward now recomputes (restored by :meth:`close`).
    """

    section = "stages.recompute"

    def __init__(self) -> None:
        self.wrapped: list[nn.Module] = []

    def setup(self, ctx: RuntimeContext) -> None:
        modes = {st.recompute for st in ctx.plan.stages}
        if not modes or modes == {"none"}:
            return
        layers = ctx.model_ir().layers
        for st in ctx.plan.stages:
            self.wrapped += apply_recompute(ctx.model, layers[st.first_layer : st.last_layer + 1],
                                            st.recompute)

    def close(self, ctx: RuntimeContext) -> None:
        unwrap(self.wrapped)
        self.wrapped = []
