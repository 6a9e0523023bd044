"""The ``precision`` section: this rank computes in its device type's dtype.

With a 16-bit compute dtype (:func:`~hetplan.runtime.precision.rank_compute_dtype`) the
handler casts the working weights to it (unless ZeRO-3's FSDP keeps the fp32 shards and casts
on all-gather), runs every forward under ``torch.autocast``, computes the loss in fp32 and,
for fp16, scales its gradient by the dynamic loss scale. The fp32 master weights and the
unscaling belong to the optimizer (:class:`~hetplan.runtime.handlers.zero.ZeroHandler`
builds it), which reads :attr:`PrecisionHandler.dtype` and :attr:`PrecisionHandler.scaler`.
An fp32 rank changes nothing.
"""

from __future__ import annotations

import torch

from hetplan.runtime.composition import effective_zero_stage
from hetplan.runtime.handlers.base import Handler, RuntimeContext
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
        fp32_weights: the weights as they were before the cast, by ``id`` of their parameter
            (the master weights start from them, not from their 16-bit rounding); emptied by
            :meth:`take_fp32_weights`.
    """

    section = "precision"

    def __init__(self) -> None:
        self.dtype = "fp32"
        self.scaler: DynamicLossScale | None = None
        self.autocast: Autocast | None = None
        self.fp32_weights: dict[int, torch.Tensor] = {}

    def setup(self, ctx: RuntimeContext) -> None:
        rank = ctx.groups.rank if ctx.groups is not None else 0
        self.dtype = rank_compute_dtype(ctx.plan, rank)
        if self.dtype == "fp32":
            return
        dtype = DTYPES[self.dtype]
        if effective_zero_stage(ctx.layout) < 3:
            self.fp32_weights = {id(p): p.detach().clone() for p in ctx.model.parameters()
                                 if p.is_floating_point()}
            cast_working_weights([ctx.model], dtype)
        self.autocast = Autocast([ctx.model], dtype)
        if self.dtype == "fp16":
            self.scaler = DynamicLossScale()
        ctx.loss_fn = fp32_loss_fn(ctx.loss_fn, self.scaler)

    def take_fp32_weights(self) -> dict[int, torch.Tensor]:
        """The pre-cast weights (once: the handler forgets them)."""
        out, self.fp32_weights = self.fp32_weights, {}
        return out

    def close(self, ctx: RuntimeContext) -> None:
        if self.autocast is not None:
            self.autocast.remove()
            self.autocast = None
