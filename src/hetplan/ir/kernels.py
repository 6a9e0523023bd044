"""The kernels a layer runs, as capture saw them: what the compute cost model prices
shape by shape (:mod:`hetplan.cost_models.kernels`).

A layer's FLOPs alone do not say how long it takes: a matrix multiply's efficiency depends
on its shape, and the element-wise, normalisation, softmax and dropout kernels between the
matrix multiplies take time by the bytes they move, not by FLOPs. Capture records, per
layer and pass, every matrix multiply's shape (:class:`Gemm`) and the bytes the other
kernels read and write (``LayerIR.mem_fwd_bytes`` ...), each at the captured batch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from hetplan.ir.fields import Int

__all__ = ["Gemm"]


class Gemm(BaseModel):
    """``count`` matrix multiplies of one shape: ``batch`` independent products of an
    ``m x k`` and a ``k x n`` matrix (``batch`` 1: ``mm`` / ``addmm``; more: ``bmm``).

    Attributes:
        phase: ``fwd`` or ``bwd`` (backward's two products per forward one: input and
            weight gradients).
        core: inside the attention core (the score and score-times-value products), which
            a fused attention kernel runs without writing the scores to memory.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    phase: Literal["fwd", "bwd"]
    core: bool = False
    batch: Int = Field(ge=1)
    m: Int = Field(ge=0)
    n: Int = Field(ge=0)
    k: Int = Field(ge=0)
    count: Int = Field(default=1, ge=1)

    @property
    def flops(self) -> int:
        """FLOPs of all ``count`` products (2 per multiply-add)."""
        return 2 * self.count * self.batch * self.m * self.n * self.k
