"""The gradient path: post-accumulate-grad hooks → the plan's buckets → one collective each.

The runtime owns gradient synchronisation (not DDP, which re-buckets after the first
iteration and keys hook state by bucket index) so that the fusion and compression passes can
plug their strategies in. For every bucket of the plan that holds parameters of this rank:

- each parameter's ``register_post_accumulate_grad_hook`` marks it ready;
- when every parameter of a bucket is ready, and every earlier bucket has been launched (the
  plan's order is the backward-ready order, identical on every rank, which keeps collectives
  matched across ranks), its gradients are flattened into one buffer and an asynchronous
  collective starts (overlapping the rest of backward);
- :meth:`GradSync.finish` launches what is left, waits, and writes the averaged gradients back.

Strategies: a flat fp32 or fp16/bf16 allreduce runs as one asynchronous ``all_reduce`` (the
fast path). Every other path — ``CompressedSync`` (flatten, compress once per site, the plan's
routine steps flat or hierarchical, decompress, unflatten; error feedback per bucket and
site), and the non-allreduce or hierarchical routings of ``NoSync``/``CastSync`` — runs in
:class:`~hetplan.runtime.routines.PathRunner` on one worker thread, in the plan's bucket order
(so collectives stay matched across ranks and overlap the rest of backward). When a plan has
any such path, every bucket goes through the worker (mixing threads on one process group
could issue collectives in different orders on different ranks). Tensors without a bucket
use their per-tensor strategy (one "bucket" each).

Bandwidth emulation (benchmarks, tests): with ``HETPLAN_EMULATE_BW`` set, collectives that
cross nodes also occupy an emulated link (:mod:`hetplan.runtime.link_emulation`); ``finish``
waits for the asynchronous allreduces' emulated ends.

Gradient accumulation: :meth:`GradSync.sync_enabled` is False during all but the last
micro-batch, so hooks only fire the collectives once per iteration.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hetplan.errors import SpecError
from hetplan.ir.plan_sections import CastSync, CompressedSync, GradientSync, NoSync
from hetplan.runtime.link_emulation import throttled
from hetplan.runtime.routines import Level, PathRunner, SyncLevels

__all__ = ["GradSync"]

_WIRE = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class _Bucket:
    names: list[str]
    params: list[torch.nn.Parameter]
    strategy: NoSync | CastSync | CompressedSync
    wire_dtype: torch.dtype | None
    ready: set[int] = field(default_factory=set)
    buffer: torch.Tensor | None = None
    work: Any = None
    link_end: float | None = None  # its end on the emulated link (HETPLAN_EMULATE_BW)


class GradSync:
    """Synchronise the gradients of ``named_params`` over ``group`` as ``sync`` says.

    Args:
        named_params: this rank's parameters by name (the plan's canonical names).
        sync: the plan's gradient-sync section (None: one fp32 allreduce per tensor).
        group: the data-parallel process group (None: nothing to sync).
        world: its size.
        levels: the flat/intra/inter groups for paths other than a flat allreduce (None: the
            flat level is ``group``; a hierarchical path then raises :class:`SpecError`).
    """

    def __init__(
        self,
        named_params: list[tuple[str, torch.nn.Parameter]],
        sync: GradientSync | None,
        group: Any,
        world: int,
        levels: SyncLevels | None = None,
    ) -> None:
        self.group = group
        self.world = world
        self.sync_enabled = True
        params = {n: p for n, p in named_params if p.requires_grad}
        self.buckets: list[_Bucket] = []
        covered: set[str] = set()
        if sync is not None:
            for pb in sync.buckets:
                local = [n for n in pb.tensors if n in params]
                if local:
                    self.buckets.append(self._bucket(local, params, sync.strategies[pb.strategy]))
                    covered.update(local)
            for t in sync.tensors:
                if t.name in params and t.name not in covered:
                    self.buckets.append(
                        self._bucket([t.name], params, sync.strategies[t.strategy])
                    )
                    covered.add(t.name)
        for n in params:  # anything the plan does not mention: fp32, one tensor each
            if n not in covered:
                self.buckets.append(self._bucket([n], params, NoSync()))
        self._where: dict[int, tuple[int, int]] = {}
        for bi, b in enumerate(self.buckets):
            for pi, p in enumerate(b.params):
                self._where[id(p)] = (bi, pi)
        self._next = 0
        self._runner: PathRunner | None = None
        self._pool: ThreadPoolExecutor | None = None
        if group is not None and any(not _simple(b.strategy) for b in self.buckets):
            self._start_paths(group, levels)
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_ready) for b in self.buckets
            for p in b.params
        ] if group is not None else []

    @staticmethod
    def _bucket(names: list[str], params: dict[str, torch.nn.Parameter], strategy: Any) -> _Bucket:
        if not isinstance(strategy, (NoSync, CastSync, CompressedSync)):
            raise SpecError(f"unknown gradient-sync strategy {strategy!r}")
        wire = _WIRE[strategy.dtype] if isinstance(strategy, CastSync) else None
        return _Bucket(list(names), [params[n] for n in names], strategy, wire)

    def _start_paths(self, group: Any, levels: SyncLevels | None) -> None:
        rank = dist.get_rank()
        if levels is None:
            levels = SyncLevels(Level.of(group, dist.get_process_group_ranks(group), rank))
        for b in self.buckets:  # refuse now, not in the middle of backward
            if b.strategy.hierarchy == "hierarchical":
                for level in ("intra", "inter"):
                    levels.get(level)
        cuda = str(dist.get_backend(group)) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self._runner = PathRunner(levels, device)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hetplan-grad-sync")

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (all micro-batches but the last)."""
        old, self.sync_enabled = self.sync_enabled, False
        try:
            yield
        finally:
            self.sync_enabled = old

    def _on_ready(self, p: torch.Tensor) -> None:
        if not self.sync_enabled:
            return
        bi, pi = self._where[id(p)]
        self.buckets[bi].ready.add(pi)
        self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        while self._next < len(self.buckets):
            b = self.buckets[self._next]
            if not force and len(b.ready) < len(b.params):
                return
            self._launch(b)
            self._next += 1

    def _launch(self, b: _Bucket) -> None:
        grads = [
            p.grad if p.grad is not None else torch.zeros_like(p) for p in b.params
        ]
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self._pool is not None and self._runner is not None:
            site = self.buckets.index(b)
            b.work = self._pool.submit(self._runner.run, flat, b.strategy, site)
            return
        if b.wire_dtype is not None:
            flat = flat.to(b.wire_dtype)
        b.buffer = flat
        b.work = dist.all_reduce(flat, group=self.group, async_op=True)
        link = throttled("flat")
        if link is not None and self.world > 1:
            b.link_end = link.reserve("allreduce", flat.numel() * flat.element_size(),
                                      self.world)

    def finish(self) -> None:
        """Launch what is left, wait for every collective, write averaged gradients back."""
        if self.group is None:
            return
        self._launch_ready(force=True)
        for b in self.buckets:
            if isinstance(b.work, Future):
                b.buffer = b.work.result()
            else:
                b.work.wait()
                link = throttled("flat")
                if link is not None and b.link_end is not None:
                    link.wait(b.link_end)
            assert b.buffer is not None
            flat = b.buffer.to(b.params[0].dtype) / self.world
            offset = 0
            for p in b.params:
                n = p.numel()
                g = flat[offset : offset + n].view_as(p)
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
                offset += n
            b.ready.clear()
            b.buffer = b.work = b.link_end = None
        self._next = 0
        if self._runner is not None:
            self._runner.iteration += 1

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _simple(strategy: NoSync | CastSync | CompressedSync) -> bool:
    """A flat, uncompressed allreduce (the asynchronous fast path)."""
    return (not isinstance(strategy, CompressedSync) and strategy.hierarchy == "flat"
            and [(s.routine, s.compressed) for s in strategy.steps] == [("allreduce", False)])
