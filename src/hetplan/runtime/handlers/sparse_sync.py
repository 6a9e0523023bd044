"""The ``sparse_sync`` section: each sparse gradient synced by its own scheme (Zen, AGsparse).

For every tensor of the section whose scheme is not ``dense`` and whose parameter this rank
holds, the gradient is summed over the data-parallel group after the last backward
(:func:`~hetplan.runtime.sparse_sync.zen_allreduce` or
:func:`~hetplan.runtime.sparse_sync.agsparse_allreduce`) and averaged, as the dense path
does. The gradient-sync handler leaves these parameters out of its buckets. The sparse
exchanges run after the dense path's collectives are finished, so the two never interleave
on the group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hetplan.runtime.handlers.base import Handler, RuntimeContext
from hetplan.runtime.sparse_sync import ZenState, agsparse_allreduce, zen_allreduce

__all__ = ["SparseSyncHandler", "sparse_names"]


def sparse_names(ctx: RuntimeContext) -> set[str]:
    """The parameters the section syncs itself (the dense path must skip them)."""
    section = ctx.plan.sparse_sync
    return set(section.synced()) if section is not None else set()


class SparseSyncHandler(Handler):
    """Synchronises the plan's sparse gradients across data-parallel replicas."""

    section = "sparse_sync"

    def __init__(self) -> None:
        self.params: list[tuple[str, torch.nn.Parameter]] = []
        self.states: dict[str, ZenState] = {}

    def setup(self, ctx: RuntimeContext) -> None:
        section = ctx.plan.sparse_sync
        groups = ctx.groups
        self.params, self.states = [], {}
        if section is None or groups is None or groups.dp_group is None:
            return
        synced = section.synced()
        self.params = [(n, p) for n, p in ctx.named_params if n in synced and p.requires_grad]
        for n, p in self.params:
            e = synced[n]
            if p.dim() != 2 or tuple(p.shape) != (e.rows, e.row_elems):
                raise ValueError(f"sparse_sync: {n!r} is {tuple(p.shape)} on this rank but the "
                                 f"plan says {e.rows}x{e.row_elems}; re-plan for this model")
            if e.scheme == "zen":
                self.states[n] = ZenState(e.rows, ctx.layout.dp, e.seed, e.hash_k)

    def after_backward(self, ctx: RuntimeContext) -> None:
        section, groups = ctx.plan.sparse_sync, ctx.groups
        if not self.params or section is None or groups is None:
            return
        synced = section.synced()
        group, world = groups.dp_group, ctx.layout.dp
        rank = dist.get_rank(group)
        for n, p in self.params:
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            if n in self.states:
                total = zen_allreduce(grad, self.states[n], group, rank, synced[n].pull)
            else:
                total = agsparse_allreduce(grad, group, world)
            if p.grad is None:
                p.grad = total / world
            else:
                p.grad.copy_(total / world)

    def params_changed(self, ctx: RuntimeContext) -> None:
        self.setup(ctx)
