"""The reference gradient sync: PyTorch DDP's bucketing with fp32 allreduce.

Gradients are taken in backward-ready order, per pipeline stage (a bucket never mixes stages:
each stage's data-parallel group syncs its own gradients), and packed the way PyTorch's
``compute_bucket_assignment_by_size`` (reducer.cpp) does: a tensor is added to the open
bucket, and the bucket closes as soon as its size reaches the limit — ``first_bucket_mb`` for
the first bucket of each stage (so communication starts early), ``bucket_cap_mb`` after. A
bucket can therefore exceed the cap by its last tensor. Every bucket is one flat fp32
allreduce. Complexity O(N).

The ``ddp-buckets`` pass writes this sync into a plan; passes that choose something else
(stage partitions, say) price their candidates with it, through this module rather than by
calling that pass.
"""

from __future__ import annotations

from collections.abc import Sequence

from hetplan.ir.plan_sections import Bucket, GradientSync, NoSync, Stage, WorkloadSummary

__all__ = ["ddp_gradient_sync", "stage_of_layer"]

MiB = 2**20


def stage_of_layer(stages: Sequence[Stage], num_layers: int) -> list[int]:
    """Stage index of every layer (all 0 without stages)."""
    out = [0] * num_layers
    for st in stages:
        for i in range(st.first_layer, st.last_layer + 1):
            out[i] = st.index
    return out


def ddp_gradient_sync(workload: WorkloadSummary, stages: Sequence[Stage],
                      bucket_cap_mb: float = 25.0, first_bucket_mb: float = 1.0) -> GradientSync:
    """DDP's buckets of ``workload``'s gradients for ``stages`` (see module docstring)."""
    stage = stage_of_layer(stages, len(workload.layers))
    buckets: list[Bucket] = []
    open_: dict[int, tuple[list[str], int]] = {}
    started: set[int] = set()

    def close(s: int) -> None:
        names, size = open_.pop(s)
        buckets.append(Bucket(tensors=tuple(names), size_bytes=size, strategy="fp32"))
        started.add(s)

    for g in workload.grads:
        s = stage[g.layer_index]
        cap = (bucket_cap_mb if s in started else first_bucket_mb) * MiB
        names, size = open_.get(s, ([], 0))
        open_[s] = (names + [g.name], size + g.size_bytes)
        if size + g.size_bytes >= cap:
            close(s)
    for s in sorted(open_):
        close(s)
    return GradientSync(strategies={"fp32": NoSync()}, buckets=tuple(buckets))
