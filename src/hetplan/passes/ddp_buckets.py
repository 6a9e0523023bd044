"""Baseline pass ``ddp-buckets``: PyTorch DDP's gradient bucketing with fp32 allreduce.

Owns ``plan.gradient_sync``. The buckets are :func:`~hetplan.cost_models.ddp.ddp_gradient_sync`
of the plan's stages (DDP's ``compute_bucket_assignment_by_size``, per stage; see there).
Complexity O(N).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hetplan.cost_models.ddp import ddp_gradient_sync
from hetplan.errors import SpecError
from hetplan.ir.plan import Plan
from hetplan.passes.base import PassContext, PassResult

__all__ = ["DDPBuckets"]


@dataclass(frozen=True)
class DDPBuckets:
    """DDP-style buckets (25 MiB, first bucket 1 MiB), uncompressed fp32 allreduce."""

    bucket_cap_mb: float = 25.0
    first_bucket_mb: float = 1.0
    name: ClassVar[str] = "ddp-buckets"
    sections: ClassVar[tuple[str, ...]] = ("gradient_sync",)
    refines: ClassVar[bool] = False

    def __post_init__(self) -> None:
        for option, value in (("bucket-cap-mb", self.bucket_cap_mb),
                              ("first-bucket-mb", self.first_bucket_mb)):
            if not value >= 0:  # nan too
                raise SpecError(f"ddp-buckets: {option} must be >= 0 MiB (0: one bucket per "
                                f"gradient; DDP's defaults are 25 and 1), got {value!r}")

    def run(self, plan: Plan, ctx: PassContext) -> PassResult:
        sync = ddp_gradient_sync(ctx.workload, plan.stages, self.bucket_cap_mb,
                                 self.first_bucket_mb)
        note = f"{len(sync.buckets)} bucket(s), cap {self.bucket_cap_mb:g} MiB"
        return PassResult(plan.model_copy(update={"gradient_sync": sync}), True, (note,))
