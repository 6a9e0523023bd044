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

Strategies: ``none`` (fp32 allreduce) and ``cast`` (fp16/bf16 on the wire). Compressed
strategies are executed by the compression runtime, which is not part of this module yet:
building a GradSync for a plan that uses one raises :class:`SpecError` saying so.

Gradient accumulation: :meth:`GradSync.sync_enabled` is False during all but the last
micro-batch, so hooks only fire the collectives once per iteration.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hetplan.errors import SpecError
from hetplan.ir.plan_sections import CastSync, CompressedSync, GradientSync, NoSync

__all__ = ["GradSync"]

_WIRE = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class _Bucket:
    names: list[str]
    params: list[torch.nn.Parameter]
    wire_dtype: torch.dtype | None
    ready: set[int] = field(default_factory=set)
    buffer: torch.Tensor | None = None
    work: Any = None


class GradSync:
    """Synchronise the gradients of ``named_params`` over ``group`` as ``sync`` says.

    Args:
        named_params: this rank's parameters by name (the plan's canonical names).
        sync: the plan's gradient-sync section (None: one fp32 allreduce per tensor).
        group: the data-parallel process group (None: nothing to sync).
        world: its size.
    """

    def __init__(
        self,
        named_params: list[tuple[str, torch.nn.Parameter]],
        sync: GradientSync | None,
        group: Any,
        world: int,
    ) -> None:
        self.group = group
        self.world = world
        self.sync_enabled = True
        params = {n: p for n, p in named_params if p.requires_grad}
        self.buckets: list[_Bucket] = []
        covered: set[str] = set()
        if sync is not None:
            for b in sync.buckets:
                local = [n for n in b.tensors if n in params]
                if local:
                    self.buckets.append(self._bucket(local, params, sync.strategies[b.strategy]))
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
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_ready) for b in self.buckets
            for p in b.params
        ] if group is not None else []

    @staticmethod
    def _bucket(names: list[str], params: dict[str, torch.nn.Parameter], strategy: Any) -> _Bucket:
        if isinstance(strategy, CompressedSync):
            raise SpecError(
                f"bucket {names[:3]} uses compressor {strategy.compressor!r}: compressed "
                "gradient sync needs the compression runtime, which this hetplan does not have "
                "yet; compile the plan without the compression pass"
            )
        if not isinstance(strategy, (NoSync, CastSync)):
            raise SpecError(f"unknown gradient-sync strategy {strategy!r}")
        if strategy.hierarchy != "flat" or [s.routine for s in strategy.steps] != ["allreduce"]:
            raise SpecError(
                f"bucket {names[:3]}: the runtime executes flat allreduce paths; got "
                f"{[(s.level, s.routine) for s in strategy.steps]}"
            )
        wire = _WIRE[strategy.dtype] if isinstance(strategy, CastSync) else None
        return _Bucket(list(names), [params[n] for n in names], wire)

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
        if b.wire_dtype is not None:
            flat = flat.to(b.wire_dtype)
        b.buffer = flat
        b.work = dist.all_reduce(flat, group=self.group, async_op=True)

    def finish(self) -> None:
        """Launch what is left, wait for every collective, write averaged gradients back."""
        if self.group is None:
            return
        self._launch_ready(force=True)
        for b in self.buckets:
            b.work.wait()
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
            b.buffer = b.work = None
        self._next = 0

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
