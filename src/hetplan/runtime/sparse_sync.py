"""Sparse gradient sync on a process group: Zen (Balanced Parallelism) and AGsparse.

The gradient of an ``nn.Embedding`` weight is a dense ``rows x dim`` tensor whose non-zero
rows are the ids the iteration looked up. :func:`zen_allreduce` sums it over the group as
thesis ch. 3 does, with the pure rules of :mod:`hetplan.algorithms.zen_hashing`:

1. **hash**: the non-zero row ids go through Algorithm 3.2 (``h_0`` picks the server, the
   same on every rank for the plan's seed); each partition is gathered as (ids, rows);
2. **push**: the partition sizes are exchanged, then ids and rows go to their servers with
   ``all_to_all_single`` and uneven split sizes (which gloo and NCCL both support);
3. **aggregate**: each server sums the rows it received by id;
4. **pull**: each server sends its aggregated partition to every rank, as a hash bitmap over
   its fixed id set ``𝕀_j`` (Algorithm 3.3; the bitmaps' sizes are known to all, so no size
   exchange) followed by the values, or as COO ids + values; again ``all_to_all_single``,
   since gloo's ``all_gather`` refuses uneven sizes;
5. **decode**: the ids of every partition are recovered and the rows written into a zeroed
   gradient.

The result is the exact sum (the same additions as a dense all-reduce, in a different
order, so equal to float rounding). :func:`agsparse_allreduce` is the all-gather of every
rank's COO tensor, the baseline the thesis compares with. With ``HETPLAN_EMULATE_BW`` set,
each exchange also occupies the emulated link (:mod:`hetplan.runtime.link_emulation`) for the
bytes this rank sends or receives, whichever is more (the most loaded partition sets the
time).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hetplan.algorithms.zen_hashing import (
    bitmap_decode,
    hash_bitmap_encode,
    hierarchical_hash,
    partition_sets,
)
from hetplan.runtime.link_emulation import throttled

__all__ = ["agsparse_allreduce", "nonzero_rows", "zen_allreduce", "ZenState"]


def nonzero_rows(grad: torch.Tensor) -> torch.Tensor:
    """The ids of the rows of ``grad`` (2-D) that are not all zero, sorted (int64)."""
    return torch.nonzero(grad.ne(0).any(dim=1)).reshape(-1)


def _occupy(collective: str, nbytes: float, world: int) -> None:
    link = throttled("flat")
    if link is not None and world > 1 and nbytes > 0:
        link.wait(link.reserve(collective, nbytes, world))


def _exchange(send: torch.Tensor, send_splits: list[int], recv_splits: list[int],
              group: Any) -> torch.Tensor:
    """``all_to_all_single`` with uneven splits along dim 0 (rows of ``send``)."""
    out = torch.empty((sum(recv_splits), *send.shape[1:]), dtype=send.dtype, device=send.device)
    dist.all_to_all_single(out, send.contiguous(), recv_splits, send_splits, group=group)
    return out


class ZenState:
    """What a rank keeps between iterations for one sparse gradient: the sorted id sets
    ``𝕀_j`` of every server (fixed for ``h_0``, computed once)."""

    def __init__(self, rows: int, world: int, seed: int, hash_k: int = 3) -> None:
        self.rows, self.world, self.seed, self.hash_k = rows, world, seed, hash_k
        self.part_sets = partition_sets(rows, world, seed)
        self.words = [-(-len(s) // 32) for s in self.part_sets]


def zen_allreduce(grad: torch.Tensor, state: ZenState, group: Any, rank: int,
                  pull: str = "bitmap") -> torch.Tensor:
    """The sum over ``group`` of the row-sparse ``grad`` (``rows x dim``), by Zen (see the
    module docstring); every rank gets the same dense result."""
    n, dim = state.world, grad.shape[1]
    ids = nonzero_rows(grad)
    res = hierarchical_hash(ids.numpy() if ids.device.type == "cpu" else ids.cpu().numpy(),
                            n, state.seed, k=state.hash_k)
    order = torch.from_numpy(np.concatenate(res.partitions)).to(grad.device)
    counts = [len(p) for p in res.partitions]
    # push: sizes, then ids and rows, to their servers
    recv_counts = _exchange(torch.tensor(counts, dtype=torch.int64, device=grad.device),
                            [1] * n, [1] * n, group)
    rc = [int(c) for c in recv_counts]
    row_bytes = dim * grad.element_size() + 8
    _occupy("alltoall", max(sum(counts) - counts[rank], sum(rc) - rc[rank]) * row_bytes
            * n / max(n - 1, 1), n)
    got_ids = _exchange(order, counts, rc, group)
    got_rows = _exchange(grad.index_select(0, order), counts, rc, group)
    # aggregate: sum by id over this server's partition
    uniq, inverse = torch.unique(got_ids, sorted=True, return_inverse=True)
    agg = torch.zeros((len(uniq), dim), dtype=grad.dtype, device=grad.device)
    agg.index_add_(0, inverse, got_rows)
    out = torch.zeros_like(grad)
    if pull == "coo":
        sizes = _exchange(torch.tensor([len(uniq)] * n, dtype=torch.int64, device=grad.device),
                          [1] * n, [1] * n, group)
        sz = [int(s) for s in sizes]
        _occupy("allgather", sum(sz) * row_bytes, n)
        all_ids = _exchange(uniq.repeat(n), [len(uniq)] * n, sz, group)
        all_rows = _exchange(agg.repeat(n, 1), [len(uniq)] * n, sz, group)
        out.index_copy_(0, all_ids, all_rows)
        return out
    # pull as hash bitmaps: fixed sizes, so no size exchange before them
    mine = hash_bitmap_encode(uniq.cpu().numpy(), state.part_sets[rank]).view(np.int32)
    bits = torch.from_numpy(np.tile(mine, n)).to(grad.device)
    all_bits = _exchange(bits, [len(mine)] * n, state.words, group)
    offsets = np.cumsum([0] + state.words)
    got = [state.part_sets[j][bitmap_decode(all_bits[offsets[j]:offsets[j + 1]].cpu().numpy()
                                            .view(np.uint32))] for j in range(n)]
    sz = [len(g) for g in got]
    _occupy("allgather", sum(sz) * dim * grad.element_size() + sum(state.words) * 4, n)
    all_rows = _exchange(agg.repeat(n, 1), [len(uniq)] * n, sz, group)
    all_ids = torch.from_numpy(np.concatenate(got)).to(grad.device)
    out.index_copy_(0, all_ids, all_rows)
    return out


def agsparse_allreduce(grad: torch.Tensor, group: Any, world: int) -> torch.Tensor:
    """The sum over ``group`` of the row-sparse ``grad`` by AGsparse: every rank gathers
    every rank's COO tensor (ids + rows) and adds them up."""
    n, dim = world, grad.shape[1]
    ids = nonzero_rows(grad)
    sizes = _exchange(torch.tensor([len(ids)] * n, dtype=torch.int64, device=grad.device),
                      [1] * n, [1] * n, group)
    sz = [int(s) for s in sizes]
    _occupy("allgather", sum(sz) * (dim * grad.element_size() + 8), n)
    all_ids = _exchange(ids.repeat(n), [len(ids)] * n, sz, group)
    all_rows = _exchange(grad.index_select(0, ids).repeat(n, 1), [len(ids)] * n, sz, group)
    out = torch.zeros_like(grad)
    out.index_add_(0, all_ids, all_rows)
    return out
