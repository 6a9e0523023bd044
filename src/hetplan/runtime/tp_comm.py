"""The collectives of tensor parallelism: Megatron's ``f`` and ``g``, gathering uneven shards,
and sequence parallelism's scatter / gather / reduce-scatter along the sequence.

Every collective is an ``all_reduce`` (of partial products, of gradients, or of zero-padded
buffers when gathering), so any shard sizes work on every backend: gloo's ``all_gather``
rejects uneven sizes and it has no ``reduce_scatter``. A reduce-scatter is therefore an
all-reduce and a slice (twice the bytes of a ring reduce-scatter; correct, and the same code on
NCCL). The sequence is dim 1 (batch-first activations); its slices are even, the first ranks
taking the remainder (:func:`seq_sizes`). A model that flattens the tokens to 2-D before its
MLP (HF OPT) hands the column linear ``(batch · slice, features)``: it is gathered and
scattered as ``(batch, slice, features)`` and flattened back (the MLP is token-wise).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from hetplan.algorithms.skewed_shards import even_shards

__all__ = [
    "SeqState",
    "all_reduce_sum",
    "copy_to_tp",
    "gather_seq",
    "gather_shards",
    "reduce_from_tp",
    "scatter_seq",
    "seq_sizes",
    "sp_column_input",
    "sp_row_output",
]


def all_reduce_sum(t: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum ``t`` over ``group`` in place; returns it."""
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


class _CopyToTP(torch.autograd.Function):
    """Megatron's ``f``: identity in forward, all-reduce of the gradient in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_reduce_sum(grad.contiguous().clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's ``g``: all-reduce in forward, identity of the gradient in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        return all_reduce_sum(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_tp(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Identity whose backward all-reduces the gradient over ``group`` (``None``: world)."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """All-reduce (sum) over ``group`` whose backward passes the gradient through."""
    return _ReduceFromTP.apply(x, group)


def gather_shards(local: torch.Tensor, shard_sizes: Sequence[int], rank: int, dim: int,
                  group: Any = None) -> torch.Tensor:
    """Rebuild a full tensor from uneven shards along ``dim`` (a collective call).

    Every rank writes its shard into a zero buffer of the full shape and the buffers are
    summed with ``all_reduce`` (gloo's ``all_gather`` rejects uneven sizes).

    Args:
        local: this rank's shard (``shard_sizes[rank]`` long along ``dim``).
        shard_sizes: the share of every rank of the group.
        rank: this rank's index in the group.
        dim: the split dimension.
        group: the process group (``None``: the default group).
    """
    if local.size(dim) != shard_sizes[rank]:
        raise ValueError(f"shard of rank {rank} has {local.size(dim)} features along dim "
                         f"{dim}, expected {shard_sizes[rank]}")
    shape = list(local.shape)
    shape[dim] = sum(shard_sizes)
    full = torch.zeros(shape, dtype=local.dtype, device=local.device)
    start = sum(shard_sizes[:rank])
    full.narrow(dim, start, shard_sizes[rank]).copy_(local.detach())
    if len(shard_sizes) > 1:
        all_reduce_sum(full, group)
    return full


def seq_sizes(length: int, tp: int) -> tuple[int, ...]:
    """Tokens of every rank's sequence slice (even; the first ranks get the remainder)."""
    return tuple(even_shards(length, tp))


class _ScatterSeq(torch.autograd.Function):
    """This rank's slice of dim 1; backward all-gathers the slices' gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rank: int, tp: int, group: Any) -> torch.Tensor:
        sizes = seq_sizes(x.size(1), tp)
        ctx.sizes, ctx.rank, ctx.group = sizes, rank, group
        return x.narrow(1, sum(sizes[:rank]), sizes[rank]).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return gather_shards(grad.contiguous(), ctx.sizes, ctx.rank, 1, ctx.group), None, None, None


class _GatherSeq(torch.autograd.Function):
    """All slices of dim 1 concatenated; backward keeps this rank's slice of the gradient
    (``reduce=False``: the consumers compute replicated gradients) or sums the gradients over
    the group first (``reduce=True``: each rank's consumer saw its own part, Megatron's
    reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rank: int, tp: int, total: int, group: Any,
                reduce: bool) -> torch.Tensor:
        sizes = seq_sizes(total, tp)
        ctx.sizes, ctx.rank, ctx.group, ctx.reduce = sizes, rank, group, reduce
        return gather_shards(x.contiguous(), sizes, rank, 1, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        g = grad.contiguous().clone()
        if ctx.reduce:
            all_reduce_sum(g, ctx.group)
        start = sum(ctx.sizes[:ctx.rank])
        return g.narrow(1, start, ctx.sizes[ctx.rank]).contiguous(), None, None, None, None, None


class _ReduceScatterSeq(torch.autograd.Function):
    """Sum over the group, keep this rank's slice of dim 1; backward all-gathers."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rank: int, tp: int, group: Any) -> torch.Tensor:
        sizes = seq_sizes(x.size(1), tp)
        ctx.sizes, ctx.rank, ctx.group = sizes, rank, group
        full = all_reduce_sum(x.contiguous().clone(), group)
        return full.narrow(1, sum(sizes[:rank]), sizes[rank]).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return gather_shards(grad.contiguous(), ctx.sizes, ctx.rank, 1, ctx.group), None, None, None


class SeqState:
    """The full sequence length of the current forward (set where the stream is scattered)."""

    total = 0


def scatter_seq(x: torch.Tensor, rank: int, tp: int, group: Any) -> torch.Tensor:
    """This rank's slice of the sequence (backward: all-gather)."""
    return _ScatterSeq.apply(x, rank, tp, group)


def gather_seq(x: torch.Tensor, rank: int, tp: int, total: int, group: Any,
               reduce: bool) -> torch.Tensor:
    """The whole sequence of ``total`` tokens from every rank's slice (see
    :class:`_GatherSeq` for ``reduce``)."""
    return _GatherSeq.apply(x, rank, tp, total, group, reduce)


def sp_column_input(x: torch.Tensor, rank: int, tp: int, group: Any) -> torch.Tensor:
    """A sequence-parallel column linear's input: all slices (backward: reduce-scatter).
    A 2-D input is the batch's tokens flattened batch-major (HF OPT flattens them before its
    MLP): it is gathered as ``(batch, slice, features)`` and flattened back, so the row
    linear's :func:`sp_row_output` returns this rank's tokens in the order they came."""
    if x.dim() == 2:
        local = seq_sizes(SeqState.total, tp)[rank]
        if local < 1 or x.size(0) % local:
            raise ValueError(f"a flattened input of {x.size(0)} tokens is no whole number of "
                             f"this rank's {local}-token sequence slices")
        batch = x.size(0) // local
        full = _GatherSeq.apply(x.reshape(batch, local, x.size(1)), rank, tp, SeqState.total,
                                group, True)
        return full.reshape(batch * SeqState.total, x.size(1))
    return _GatherSeq.apply(x, rank, tp, SeqState.total, group, True)


def sp_row_output(y: torch.Tensor, rank: int, tp: int, group: Any) -> torch.Tensor:
    """A sequence-parallel row linear's output: summed partial products, this rank's slice
    (a 2-D output: the flattened tokens of :func:`sp_column_input`, flattened back alike)."""
    if y.dim() == 2:
        total = SeqState.total
        if total < 1 or y.size(0) % total:
            raise ValueError(f"a flattened output of {y.size(0)} tokens is no whole number of "
                             f"{total}-token sequences")
        batch = y.size(0) // total
        part = _ReduceScatterSeq.apply(y.reshape(batch, total, y.size(1)), rank, tp, group)
        return part.reshape(-1, y.size(1))
    return _ReduceScatterSeq.apply(y, rank, tp, group)
