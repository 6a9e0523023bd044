"""Baseline pass ``ddp-buckets``: PyTorch DDP's gradient bucketing with fp32 allreduce.

Owns ``plan.gradient_sync``. Gradients are taken in backward-ready order, per pipeline stage
(a bucket never mixes stages: each stage's data-parallel group syncs its own gradients), and
packed the way PyTorch's ``compute_bucket_assignment_by_size`` (reducer.cpp) does: a tensor is
added to the open bucket, and the bucket closes as soon as its size reaches the limit — 1 MiB
for the first bucket of each stage (so communication starts early), ``bucket_cap_mb`` after.
A bucket can therefore exceed the cap by its last tensor. Every bucket is one flat fp32
allreduce. Complexity O(N).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import Bucket, GradientSync, NoSync
from hetplan.passes.base import PassContext, PassResult

__all__ = ["DDPBuckets", "stage_of_layer"]

MiB = 2**20


def stage_of_layer(plan: Plan, num_layers: int) -> list[int]:
    """Stage index of every layer (all 0 without stages)."""
    out = [0] * num_layers
    for st in plan.stages:
        for i in range(st.first_layer, st.last_layer + 1):
            out[i] = st.index
    return out


@dataclass(frozen=True)
class DDPBuckets:
    """DDP-style buckets (25 MiB, first bucket 1 MiB), uncompressed fp32 allreduce."""

    bucket_cap_mb: float = 25.0
    first_bucket_mb: float = 1.0
    name: ClassVar[str] = "ddp-buckets"
    section: ClassVar[str] = "gradient_sync"

    def run(self, plan: Plan, ctx: PassContext) -> PassResult:
        stage = stage_of_layer(plan, len(ctx.workload.layers))
        buckets: list[Bucket] = []
        open_: dict[int, tuple[list[str], int]] = {}
        started: set[int] = set()

        def close(s: int) -> None:
            names, size = open_.pop(s)
            buckets.append(Bucket(tensors=tuple(names), size_bytes=size, strategy="fp32"))
            started.add(s)

        for g in ctx.workload.grads:
            s = stage[g.layer_index]
            cap = (self.bucket_cap_mb if s in started else self.first_bucket_mb) * MiB
            names, size = open_.get(s, ([], 0))
            open_[s] = (names + [g.name], size + g.size_bytes)
            if size + g.size_bytes >= cap:
                close(s)
        for s in sorted(open_):
            close(s)
        sync = GradientSync(strategies={"fp32": NoSync()}, buckets=tuple(buckets))
        note = f"{len(buckets)} bucket(s), cap {self.bucket_cap_mb:g} MiB"
        return PassResult(plan.model_copy(update={"gradient_sync": sync}), True, (note,))
