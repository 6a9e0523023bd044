"""The ``precision`` section: this rank computes in its device type's dtype.

With a 16-bit compute dtype (:func:`~hetplan.runtime.precision.rank_compute_dtype`) the
handler casts the working weights to it (unless ZeRO-3's FSDP keeps the fp32 shards and casts
on all-gather), runs every forward under ``torch.autocast``, computes the loss in fp32 and,
for fp16, scales its gradient by the dynamic loss scale. With a pipeline the same holds per
stage: the stage modules (traced in the model's dtype, fp32 as a rule, sharing the model's
parameters) run under autocast and hand activations in that dtype to the next stage — the
dtype their P2P buffers were traced with (twice the bytes of a 16-bit boundary in fp32; the
activations are 16-bit inside the stage). The fp32 master weights and the
unscaling belong to the optimizer (:class:`~hetplan.runtime.handlers.zero.ZeroHandler`
builds it), which reads :attr:`PrecisionHandler.dtype` and :attr:`PrecisionHandler.scaler`.
An fp32 rank changes nothing.
"""

from __future__ import annotations

import torch

from hetplan.runtime.composition import effective_zero_stage
from hetplan.runtime.handlers.base import Handler, RuntimeContext
from hetplan.runtime.handlers.stages import stage_modules
from hetplan.runtime.precision import (
    DTYPES,
    Autocast,
    DynamicLossScale,
    cast_working_weights,
    fp32_loss_fn,
    rank_compute_dtype,
)

__all__ = ["PrecisionHandler"]


class PrecisionHandler(Handler):
    """Mixed precision on this rank, as the plan's ``precision`` section says.

    Attributes:
        dtype: this rank's compute dtype (``fp32``, ``bf16``, ``fp16``).
        scaler: the fp16 loss scale (None otherwise).
        autocast: the autocast hooks (None in fp32).
        io_dtype: the dtype the pipeline stages were traced in, which they receive and send.
        fp32_weights: the weights as they were before the cast, by ``id`` of their parameter
            (the master weights start from them, not from their 16-bit rounding); emptied by
            :meth:`take_fp32_weights`.
    """

    section = "precision"

    def __init__(self) -> None:
        self.dtype = "fp32"
        self.scaler: DynamicLossScale | None = None
        self.autocast: Autocast | None = None
        self.io_dtype = torch.float32
        self.fp32_weights: dict[int, torch.Tensor] = {}

    def setup(self, ctx: RuntimeContext) -> None:
        rank = ctx.groups.rank if ctx.groups is not None else 0
        self.dtype = rank_compute_dtype(ctx.plan, rank)
        if self.dtype == "fp32":
            return
        dtype = DTYPES[self.dtype]
        self.io_dtype = _traced_dtype(ctx)
        if effective_zero_stage(ctx.layout) < 3:
            self.fp32_weights = {id(p): p.detach().clone() for p in ctx.model.parameters()
                                 if p.is_floating_point()}
            cast_working_weights([ctx.model, *stage_modules(ctx)], dtype)
        self._hook(ctx)
        if self.dtype == "fp16":
            self.scaler = DynamicLossScale()
        ctx.loss_fn = fp32_loss_fn(ctx.loss_fn, self.scaler)

    def _hook(self, ctx: RuntimeContext) -> None:
        """Autocast around the modules this rank calls: the model, or its pipeline stages
        (whose outputs go back to the dtype they were traced in, that of their P2P
        buffers)."""
        stages = stage_modules(ctx)
        self.autocast = Autocast(stages or [ctx.model], DTYPES[self.dtype],
                                 io_dtype=self.io_dtype if stages else None)

    def params_changed(self, ctx: RuntimeContext) -> None:
        """Re-balancing built new stages: cast them and move the autocast hooks onto them."""
        if self.autocast is None:
            return
        self.autocast.remove()
        cast_working_weights(stage_modules(ctx), DTYPES[self.dtype])
        self._hook(ctx)

    def take_fp32_weights(self) -> dict[int, torch.Tensor]:
        """The pre-cast weights (once: the handler forgets them)."""
        out, self.fp32_weights = self.fp32_weights, {}
        return out

    def close(self, ctx: RuntimeContext) -> None:
        if self.autocast is not None:
            self.autocast.remove()
            self.autocast = None


def _traced_dtype(ctx: RuntimeContext) -> torch.dtype:
    """The floating dtype the model's pipeline stages were traced in: that of its parameters
    before the cast to the compute dtype (fp32 where it has none)."""
    return next((p.dtype for p in ctx.model.parameters() if p.is_floating_point()),
                torch.float32)
