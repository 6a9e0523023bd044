"""The runtime's own ZeRO-1/2 optimizer, and the fp32 master weights of mixed precision.

Layout. The parameters of this rank are cut into **segments** — the plan's gradient-sync
buckets (one per tensor the plan does not bucket), in the plan's order — and each segment's
elements, flattened and padded to a multiple of the data-parallel size ``w``, into ``w``
equal chunks: replica ``d`` owns chunk ``d`` of every segment. Its **master shard** is those
chunks in fp32 (an fp64 model's in fp64), one flat buffer; the inner optimizer (the user's factory: SGD, Adam, …) sees
one parameter per (segment, parameter) piece of it, views of that buffer, so an element-wise
optimizer updates exactly what it would update on the whole parameters (an optimizer that
reduces over a whole parameter — LAMB's trust ratio, a global norm clip — would not; use
ZeRO-0 for those). With ``w = 1`` the shard is the whole model: that is the fp32 master copy
of mixed precision without ZeRO.

One step (:meth:`ShardedOptimizer.step`):

1. this replica's gradient chunk in fp32: sliced from the averaged full gradients the
   gradient path left on the parameters (ZeRO-0/1: the plan's path — compressed, fused,
   hierarchical — is untouched), or the chunk :class:`GradReducer` reduce-scattered during
   backward (ZeRO-2);
2. with a loss scale (fp16): unscale, check for inf/NaN on every rank of the job (the
   pipeline and tensor-parallel ranks skip a step together), maybe skip;
3. the inner optimizer updates the master shard;
4. every replica's updated chunk, cast to the working weights' dtype, is all-gathered over
   the data-parallel group, segment by segment, into the parameters.

:class:`GradReducer` is ZeRO-2's gradient path: a ``register_post_accumulate_grad_hook`` per
parameter marks it ready; when a segment is complete (segments are launched in order, as
:class:`~hetplan.runtime.grad_sync.GradSync` does, so collectives match across replicas) its
gradients are flattened, reduce-scattered (in the plan's wire dtype for a ``cast`` strategy),
averaged and added to the replica's chunk, and the full gradients are freed. Every backward
reduces (micro-batches too), so a rank never holds more than one segment's full gradients.

Gradients as bucket views: under ZeRO-0/1 without a pipeline the full gradients this
optimizer reads are views of the gradient path's bucket buffers
(:class:`~hetplan.runtime.grad_sync.GradSync` with ``grad_views``); :meth:`ShardedOptimizer.
zero_grad` still sets them to None, and the gradient-sync handler points them back at the
zeroed buffers after the step. :class:`GradReducer` keeps its own flatten-and-free code: it
frees each segment's full gradients once they are reduce-scattered, which views of a
persistent full-size buffer would defeat (ZeRO-2's memory saving).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hetplan.runtime.precision import DynamicLossScale, unscale_and_check

__all__ = ["GradReducer", "Segment", "ShardedOptimizer", "segments_of"]


def _all_gather(out: torch.Tensor, mine: torch.Tensor, group: Any) -> None:
    """Every replica's ``mine`` into ``out``: ``all_gather_single`` where torch has it (it
    deprecates ``all_gather_into_tensor`` with a FutureWarning that every rank printed in
    every ZeRO run), the older name otherwise."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, mine, group=group)


@dataclass
class Segment:
    """One segment of the flat layout (see module docstring).

    Attributes:
        params: its parameters, in order.
        numel: their elements; ``chunk``: elements per replica (padded).
        wire_dtype: ZeRO-2's reduce-scatter dtype (None: the gradients' dtype).
        offset: where its chunk starts in the master shard.
    """

    params: list[nn.Parameter]
    numel: int
    chunk: int
    wire_dtype: torch.dtype | None = None
    offset: int = 0

    def bounds(self) -> list[tuple[int, int]]:
        """Each parameter's [start, end) in the segment's flat order."""
        out, a = [], 0
        for p in self.params:
            out.append((a, a + p.numel()))
            a += p.numel()
        return out


def segments_of(groups: Sequence[tuple[Sequence[nn.Parameter], torch.dtype | None]],
                world: int) -> list[Segment]:
    """Segments for parameter groups ``(params, wire_dtype)`` over ``world`` replicas."""
    out, offset = [], 0
    for params, wire in groups:
        numel = sum(p.numel() for p in params)
        chunk = -(-numel // world)
        out.append(Segment(list(params), numel, chunk, wire, offset))
        offset += chunk
    return out


class ShardedOptimizer(torch.optim.Optimizer):
    """fp32 master shard + the user's optimizer over it (see module docstring).

    Args:
        segments: the flat layout of this rank's parameters.
        make_inner: builds the inner optimizer from the master pieces.
        group / world / rank: the data-parallel group, its size, this replica's index
            (``world == 1``: no sharding, ``group`` unused).
        reducer: ZeRO-2's gradient path (None: read the full gradients off the parameters).
        scaler: the fp16 loss scale (None: no loss scaling).
        initial: the master weights' starting values by ``id`` of their parameter (the
            weights before a 16-bit cast); a parameter not in it starts from its own value.
    """

    def __init__(self, segments: list[Segment],
                 make_inner: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                 group: Any, world: int, rank: int, reducer: GradReducer | None = None,
                 scaler: DynamicLossScale | None = None,
                 initial: dict[int, torch.Tensor] | None = None) -> None:
        self.segments, self.group, self.world, self.rank = segments, group, world, rank
        self.reducer, self.scaler = reducer, scaler
        total = sum(s.chunk for s in segments)
        first = segments[0].params[0] if segments else torch.zeros(())  # host: a dtype only
        # fp32 beside 16-bit working weights; an fp32 or fp64 model is its own master dtype
        self.master = torch.zeros(total, dtype=torch.promote_types(torch.float32, first.dtype),
                                  device=first.device)
        # (segment, param index, [lo, hi) in the param's flat order, master offset)
        self._pieces: list[tuple[int, int, int, int, int]] = []
        with torch.no_grad():
            for si, seg in enumerate(segments):
                lo_chunk = rank * seg.chunk
                for pi, (a, b) in enumerate(seg.bounds()):
                    lo, hi = max(a, lo_chunk), min(b, lo_chunk + seg.chunk)
                    if lo >= hi:
                        continue
                    at = seg.offset + lo - lo_chunk
                    p = seg.params[pi]
                    flat = (initial or {}).get(id(p), p.detach()).reshape(-1)
                    self.master[at : at + hi - lo].copy_(flat[lo - a : hi - a])
                    self._pieces.append((si, pi, lo - a, hi - a, at))
        self.pieces = [nn.Parameter(self.master[at : at + hi - lo])
                       for (_, _, lo, hi, at) in self._pieces]
        self.inner = make_inner(self.pieces)
        super().__init__(self.pieces, {})
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state

    # -- step ---------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """One update of the master shard and the all-gather of the working weights."""
        grad = self._grad_chunk()
        if self.scaler is not None:
            bad = unscale_and_check([grad], self.scaler.scale)
            if dist.is_initialized():
                dist.all_reduce(bad, op=dist.ReduceOp.MAX)
            if not self.scaler.update(bool(bad.item() > 0)):
                return
        for piece, (_, _, lo, hi, at) in zip(self.pieces, self._pieces, strict=True):
            piece.grad = grad[at : at + hi - lo]
        self.inner.step()
        for piece in self.pieces:
            piece.grad = None
        self.write_working_weights()

    def _grad_chunk(self) -> torch.Tensor:
        """This replica's gradient chunk of every segment, fp32, in master order."""
        if self.reducer is not None:
            return self.reducer.take_chunk(self.master.dtype)
        src, where = [], []
        for si, pi, lo, hi, at in self._pieces:
            g = self.segments[si].params[pi].grad
            if g is not None:
                src.append(g.reshape(-1)[lo:hi])
                where.append((at, hi - lo))
        # every element written (one replica, every gradient present): no zero fill needed
        full = sum(n for _, n in where) == self.master.numel()
        out = torch.empty_like(self.master) if full else torch.zeros_like(self.master)
        dst = [out[at : at + n] for at, n in where]
        if dst:  # one multi-tensor copy (and cast), not one copy per parameter
            torch._foreach_copy_(dst, src)
        return out

    def write_working_weights(self) -> None:
        """Every replica's chunk of the master, in the working dtype, into the parameters (what
        a step ends with; also after the masters were changed outside a step, e.g. averaged)."""
        if self.world == 1:  # the master is the whole model: one multi-tensor copy (and cast)
            dst, src = [], []
            for seg in self.segments:
                for p, (a, b) in zip(seg.params, seg.bounds(), strict=True):
                    dst.append(p.detach())
                    src.append(self.master[seg.offset + a : seg.offset + b].view_as(p))
            if dst:
                torch._foreach_copy_(dst, src)
            return
        for seg in self.segments:
            if not seg.params:
                continue
            dtype = seg.params[0].dtype
            mine = self.master[seg.offset : seg.offset + seg.chunk].to(dtype)
            full = torch.empty(seg.chunk * self.world, dtype=dtype, device=mine.device)
            _all_gather(full, mine, self.group)
            torch._foreach_copy_([p.detach() for p in seg.params],
                                 [full[a:b].view_as(p) for p, (a, b)
                                  in zip(seg.params, seg.bounds(), strict=True)])

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the working weights' gradients and the reduced chunk."""
        for seg in self.segments:
            for p in seg.params:
                p.grad = None
        if self.reducer is not None:
            self.reducer.clear()

    # -- what tests and the run report read ---------------------------------------------------
    def full_master(self) -> list[torch.Tensor]:
        """Every parameter's fp32 master value, gathered from all replicas (collective)."""
        return self._gather_flat(self.master)

    # -- re-balancing: the state as whole parameters ------------------------------------------
    def full_state(self) -> dict[nn.Parameter, tuple[torch.Tensor, dict[str, Any]]]:
        """Per parameter: its master value and the inner optimizer's state, whole (gathered
        from every replica's chunks; a collective over the data-parallel group). A state
        tensor of the piece's shape (Adam's moments) becomes one of the parameter's shape; any
        other state (Adam's ``step``, equal on every piece) is taken from this rank's first
        piece. Re-balancing moves parameters with it and rebuilds the layout
        (:meth:`load_full_state`)."""
        masters = self.full_master()
        params = [p for seg in self.segments for p in seg.params]
        first: dict[str, Any] = next(
            (self.inner.state[x] for x in self.pieces if x in self.inner.state), {})
        keys = sorted(k for k, v in first.items() if torch.is_tensor(v) and v.dim() == 1)
        other = {k: (v.detach().clone() if torch.is_tensor(v) else v)
                 for k, v in first.items() if k not in keys}
        if self.world > 1:
            # every replica gathers the same keys, in the same order, even one whose chunk
            # holds no piece with state yet (padding only): else the gathers would not pair
            views: list[Any] = [None] * self.world
            mine = {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in other.items()}
            dist.all_gather_object(views, (keys, mine), group=self.group)
            keys = sorted({k for ks, _ in views for k in ks})
            if not other:  # this replica had none: a replica's that did (Adam's step)
                other = next((o for _, o in views if o), other)
        per_key: dict[str, list[torch.Tensor]] = {}
        for key in keys:
            buf = torch.zeros_like(self.master)
            for piece, (_, _, lo, hi, at) in zip(self.pieces, self._pieces, strict=True):
                value = self.inner.state.get(piece, {}).get(key)
                if value is not None:
                    buf[at : at + hi - lo].copy_(value)
            per_key[key] = self._gather_flat(buf)
        return {p: (m, {**other, **{k: per_key[k][i] for k in keys}})
                for i, (p, m) in enumerate(zip(params, masters, strict=True))}

    def _gather_flat(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """Every parameter's values of a buffer laid out like the master shard, gathered."""
        out: list[torch.Tensor] = []
        for seg in self.segments:
            mine = buf[seg.offset : seg.offset + seg.chunk]
            if self.world > 1:
                full = torch.empty(seg.chunk * self.world, dtype=mine.dtype, device=mine.device)
                _all_gather(full, mine.contiguous(), self.group)
            else:
                full = mine
            out.extend(full[a:b].view(p.shape).clone() for p, (a, b)
                       in zip(seg.params, seg.bounds(), strict=True))
        return out

    def load_full_state(self, values: Mapping[nn.Parameter, tuple[torch.Tensor | None,
                                                                  dict[str, Any]]]) -> None:
        """Set this replica's chunk of the master and of the inner optimizer's state from
        whole-parameter values (:meth:`full_state`'s form; a None master keeps the one built
        from the working weights). Parameters not in ``values`` start fresh."""
        with torch.no_grad():
            for piece, (si, pi, lo, hi, at) in zip(self.pieces, self._pieces, strict=True):
                p = self.segments[si].params[pi]
                if p not in values:
                    continue
                master, state = values[p]
                if master is not None:
                    self.master[at : at + hi - lo].copy_(master.reshape(-1)[lo:hi])
                if state:
                    self.inner.state[piece] = {
                        k: (v.reshape(-1)[lo:hi].clone() if torch.is_tensor(v)
                            and tuple(v.shape) == tuple(p.shape)
                            else v.clone() if torch.is_tensor(v) else v)
                        for k, v in state.items()}
        self.write_working_weights()


class GradReducer:
    """ZeRO-2's gradient path: reduce-scatter each segment as backward completes it.

    Args:
        segments: the flat layout (shared with the :class:`ShardedOptimizer`).
        group / world: the data-parallel group and its size.
        accumulate_dtype: the dtype the replica's chunk is accumulated in (None: the
            gradients' dtype, at least fp32).
        eager: reduce each segment as backward completes it (hooks). False: every segment
            is reduced by :meth:`finish`, after the step's whole backward — for gradients
            that other handlers still change after backward (a pipeline schedule's scaling by
            ``1 / micro_batches``, tied weights' and sequence-parallel sums).
    """

    def __init__(self, segments: list[Segment], group: Any, world: int,
                 accumulate_dtype: torch.dtype | None, eager: bool = True) -> None:
        self.segments, self.group, self.world = segments, group, world
        first = segments[0].params[0].dtype if segments else torch.float32
        self.accumulate_dtype = accumulate_dtype or torch.promote_types(torch.float32, first)
        self.chunk: torch.Tensor | None = None
        self._where: dict[int, tuple[int, int]] = {}
        self._ready: list[set[int]] = [set() for _ in segments]
        self._next = 0
        for si, seg in enumerate(segments):
            for pi, p in enumerate(seg.params):
                self._where[id(p)] = (si, pi)
        self.eager = eager
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_ready)
                       for seg in segments for p in seg.params] if eager else []

    def _on_ready(self, p: torch.Tensor) -> None:
        si, pi = self._where[id(p)]
        self._ready[si].add(pi)
        self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        while self._next < len(self.segments):
            seg = self.segments[self._next]
            if not force and len(self._ready[self._next]) < len(seg.params):
                return
            self._reduce(seg)
            self._ready[self._next].clear()
            self._next += 1
        self._next = 0  # every segment reduced: the next backward starts again

    def _reduce(self, seg: Segment) -> None:
        dtype = seg.wire_dtype or seg.params[0].dtype
        flat = torch.zeros(seg.chunk * self.world, dtype=dtype, device=seg.params[0].device)
        for p, (a, b) in zip(seg.params, seg.bounds(), strict=True):
            if p.grad is not None:
                flat[a:b].copy_(p.grad.reshape(-1))
                p.grad = None  # the full gradient is freed once it is in the bucket
        out = torch.empty(seg.chunk, dtype=dtype, device=flat.device)
        dist.reduce_scatter_tensor(out, flat, group=self.group)
        del flat
        if self.chunk is None:
            total = sum(s.chunk for s in self.segments)
            self.chunk = torch.zeros(total, dtype=self.accumulate_dtype, device=out.device)
        self.chunk[seg.offset : seg.offset + seg.chunk].add_(out.to(self.accumulate_dtype),
                                                               alpha=1.0 / self.world)

    def finish(self) -> None:
        """Reduce the segments backward left incomplete (parameters without a gradient);
        without eager hooks, every segment."""
        if not self.eager or self._next or any(self._ready):
            self._launch_ready(force=True)

    def take_chunk(self, dtype: torch.dtype) -> torch.Tensor:
        """A copy of the reduced chunk in ``dtype`` (zeros when nothing was reduced)."""
        total = sum(s.chunk for s in self.segments)
        if self.chunk is None:
            device = self.segments[0].params[0].device if self.segments else None
            return torch.zeros(total, dtype=dtype, device=device)
        return self.chunk.to(dtype, copy=True)

    def clear(self) -> None:
        """Drop the reduced chunk (after the optimizer step)."""
        self.chunk = None

    def close(self) -> None:
        """Remove the hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
