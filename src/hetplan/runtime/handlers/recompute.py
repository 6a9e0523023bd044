"""The stages' ``recompute`` field: activation recomputation of this rank's blocks.

Without a pipeline the rank runs every stage of the plan (one), so each block of the model
gets its stage's mode (:func:`~hetplan.runtime.recompute.apply_recompute`: ``full`` a
non-reentrant checkpoint per block, ``selective`` per attention core). With a pipeline each
of the rank's stages gets its own plan stage's mode, applied to the stage module: a traced
stage keeps every block as a submodule under the model's name (a graph module), which is
wrapped; attention cores are found by the classes of the model's modules of the same names,
and a traced ``scaled_dot_product_attention`` (an aten operator) is checkpointed too.
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
        if ctx.layout.pp == 1:
            for st in ctx.plan.stages:
                self.wrapped += apply_recompute(
                    ctx.model, layers[st.first_layer : st.last_layer + 1], st.recompute)
            return
        self._in_stages(ctx)

    def _in_stages(self, ctx: RuntimeContext) -> None:
        """Each of this rank's pipeline stages: its own plan stage's mode on the modules the
        stage calls under its blocks' names (traced, or the model's own where tensor
        parallelism put them back), attention cores found by the model's classes."""
        from hetplan.runtime.handlers.stages import StagesHandler

        layers = ctx.model_ir().layers
        plan_stages = {s.index: s for s in ctx.plan.stages}
        for local in ctx.handler(StagesHandler).stages:
            st = plan_stages[local.stage_index]
            self.wrapped += apply_recompute(
                local.submod, layers[st.first_layer : st.last_layer + 1], st.recompute,
                types_from=ctx.model)

    def params_changed(self, ctx: RuntimeContext) -> None:
        """Re-balancing built new stages: recompute in them."""
        if ctx.layout.pp > 1 and self.wrapped:
            unwrap(self.wrapped)
            self.wrapped = []
            self._in_stages(ctx)

    def close(self, ctx: RuntimeContext) -> None:
        unwrap(self.wrapped)
        self.wrapped = []
