"""The gradient path: post-accumulate-grad hooks → the plan's buckets → one collective each.

The runtime owns gradient synchronisation (not DDP, which re-buckets after the first
iteration and keys hook state by bucket index) so that the fusion and compression passes can
plug their strategies in. For every bucket of the plan that holds parameters of this rank:

- each parameter's ``register_post_accumulate_grad_hook`` marks it ready;
- when every parameter of a bucket is ready, and every earlier bucket has been launched (the
  plan's order is the backward-ready order, identical on every rank, which keeps collectives
  matched across ranks), its gradients are flattened into one buffer and an asynchronous
  collective starts (overlapping the rest of backward);
- a pipeline, whose hooks are held back for the whole schedule, may instead launch a
  stage's buckets when that stage's last backward has ended (:meth:`GradSync.launch_final`,
  flat allreduce buckets on NCCL only);
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
micro-batch, so hooks only fire the collectives once per iteration (one backward with sync
enabled per iteration: a bucket is ready when its count of pending hooks reaches zero).

**Gradients as views of the bucket** (``grad_views=True``, what DDP's
``gradient_as_bucket_view`` does): on the fast path, each bucket whose parameters share one
dtype and device and are plain contiguous tensors gets one flat gradient buffer, allocated
once, and every parameter's ``.grad`` is a view of its slice. Autograd accumulates into an
existing ``.grad`` in place, so backward (every micro-batch) writes straight into the bucket:
no flatten before the collective, no copy back after it; the average is one in-place
division of the buffer (a cast path casts into a wire buffer, also allocated once, and back
into the bucket before it: the same values as the copy path's, bit for bit). The buffer is
zeroed by :meth:`GradSync.zero_grad` (the handler calls it after the optimizer step) instead
of the gradients being set to None, and a gradient that something else replaced or dropped
meanwhile (an optimizer's ``zero_grad(set_to_none=True)``) is copied back into its slice
(or its slice zeroed) and re-pointed at launch, so the result never depends on who touched
``.grad``. A parameter that got no gradient in an iteration then holds zeros, as it did
before (the copy path syncs zeros for it). Paths that need their own buffers keep the
flatten-and-copy code: the worker-thread paths (compressed, hierarchical, non-allreduce
routings), buckets of mixed dtypes or devices, DTensor or non-contiguous parameters, and
whatever the handler builds without views (pipelines: views are built and tested for the
single-stage step only).

The last bucket in the plan's order gets no hooks: it can only launch once every other
bucket has and all of its own gradients are accumulated; the plan's order is the
backward-ready order, so that is when backward ends, where :meth:`GradSync.finish`
launches it anyway (a one-bucket plan runs no Python per parameter during backward).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Collection, Iterator
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
    hooked: int = 0  # parameters with a hook (0: the last bucket, launched by finish)
    pending: int = 0  # hooks still to fire this iteration
    flat: torch.Tensor | None = None  # the gradient buffer the params' .grad view (views)
    wire: torch.Tensor | None = None  # a view bucket's buffer in the wire dtype (cast path)
    views: list[torch.Tensor] = field(default_factory=list)
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
        grad_views: make the fast path's gradients views of their bucket's buffer (module
            docstring); the caller then calls :meth:`zero_grad` after each optimizer step.
    """

    def __init__(
        self,
        named_params: list[tuple[str, torch.nn.Parameter]],
        sync: GradientSync | None,
        group: Any,
        world: int,
        levels: SyncLevels | None = None,
        grad_views: bool = False,
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
        self._next = 0
        self._final: set[int] = set()  # launch_final: parameters final this step
        self._runner: PathRunner | None = None
        self._pool: ThreadPoolExecutor | None = None
        if group is not None and any(not _simple(b.strategy) for b in self.buckets):
            self._start_paths(group, levels)
        if group is not None and grad_views and self._pool is None:
            for b in self.buckets:
                _make_views(b)
        self._hooks: list[Any] = []
        if group is not None:
            for bi, b in enumerate(self.buckets[:-1]):  # the last one: finish launches it
                on_ready = functools.partial(self._on_ready, bi)
                self._hooks += [p.register_post_accumulate_grad_hook(on_ready)
                                for p in b.params]
                b.hooked = b.pending = len(b.params)

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

    @property
    def views(self) -> bool:
        """Whether any bucket's gradients are views of its buffer."""
        return any(b.flat is not None for b in self.buckets)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (all micro-batches but the last)."""
        old, self.sync_enabled = self.sync_enabled, False
        try:
            yield
        finally:
            self.sync_enabled = old

    def _on_ready(self, bi: int, _p: torch.Tensor) -> None:
        if not self.sync_enabled:
            return
        b = self.buckets[bi]
        b.pending -= 1
        if b.pending == 0 and bi == self._next:
            self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        while self._next < len(self.buckets):
            b = self.buckets[self._next]
            if b.work is not None:  # launched already (launch_final)
                self._next += 1
                continue
            if not force and (b.hooked == 0 or b.pending > 0):
                return
            self._launch(b)
            self._next += 1

    def launch_final(self, final: Collection[int]) -> int:
        """Add ``final`` (parameter ``id`` s whose gradients are final for this step) to the
        step's final set, and launch now every flat-allreduce bucket not launched yet whose
        parameters are all in it; the number launched.

        A pipeline runs every micro-batch's backward inside one schedule step, with the hooks
        held back; its stage handler calls this when a stage's last backward has ended (the
        schedule's ``REDUCE_GRAD`` action for it), so that stage's buckets sync while the
        rank's later stages (chunks) still compute. That lies between the cost model's
        ``dp_overlap`` modes: ``backward`` overlaps a stage's sync with its own last backward,
        ``after-flush`` starts every sync after the schedule; with one stage per rank it is
        nearly the latter. Every data-parallel peer runs the same action list, so all launch
        the same buckets in the same order. Only the flat allreduce path launches here: its
        collective is queued from this thread, in order with the blocking ones later handlers
        issue on the same group; a worker-thread path (compressed, hierarchical) would race
        with them, and waits for :meth:`finish`, which launches the rest and waits for all."""
        if self.group is None or self._pool is not None:
            return 0
        self._final.update(final)
        launched = 0
        for b in self.buckets:
            if b.work is None and _simple(b.strategy) and all(id(p) in self._final
                                                               for p in b.params):
                self._launch(b)
                launched += 1
        return launched

    def _launch(self, b: _Bucket) -> None:
        if b.flat is not None:
            _adopt(b)
            flat = b.flat if b.wire is None else b.wire.copy_(b.flat)
        else:
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

    def wait_submitted(self) -> None:
        """Wait for every bucket already handed to the worker thread (the compressed and
        hierarchical paths), so that the caller may issue collectives on the same groups from
        this thread without racing it; :meth:`finish` still collects their results."""
        for b in self.buckets:
            if isinstance(b.work, Future):
                b.work.result()

    def finish(self) -> None:
        """Launch what is left, wait for every collective, leave averaged gradients in
        ``.grad`` (in place in a view bucket's buffer; copied back otherwise)."""
        if self.group is None:
            return
        self._launch_ready(force=True)
        for b in self.buckets:
            if isinstance(b.work, Future):
                b.buffer = b.work.result()
            else:
                b.work.wait()
                link = throttled("flat") if b.link_end is not None else None
                if link is not None and b.link_end is not None:
                    link.wait(b.link_end)
            assert b.buffer is not None
            if b.flat is not None:
                if b.buffer is not b.flat:  # the cast path: back from the wire dtype
                    b.flat.copy_(b.buffer)
                b.flat.div_(self.world)
            else:
                _copy_back(b, b.buffer.to(b.params[0].dtype) / self.world)
            b.pending = b.hooked
            b.buffer = b.work = b.link_end = None
        self._next = 0
        self._final.clear()
        if self._runner is not None:
            self._runner.iteration += 1

    def zero_grad(self) -> None:
        """Zero the view buckets' gradients in place (after the optimizer step; what the
        other parameters get from the optimizer's ``zero_grad``): one fill per buffer, and
        the views put back where the optimizer set ``.grad`` to None."""
        for b in self.buckets:
            if b.flat is not None:
                b.flat.zero_()
                for p, v in zip(b.params, b.views, strict=True):
                    if p.grad is not v:
                        p.grad = v

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


def _make_views(b: _Bucket) -> None:
    """Give ``b`` one flat gradient buffer and point every parameter's ``.grad`` at its
    slice (a gradient already there is copied in), where the bucket allows it: its
    parameters share a dtype and device and are plain contiguous tensors."""
    first = b.params[0]
    if any(type(p.data) is not torch.Tensor or not p.is_contiguous() or p.is_sparse
           or p.dtype != first.dtype or p.device != first.device for p in b.params):
        return
    flat = torch.zeros(sum(p.numel() for p in b.params), dtype=first.dtype,
                       device=first.device)
    offset = 0
    for p in b.params:
        n = p.numel()
        v = flat[offset:offset + n].view_as(p)
        if p.grad is not None:
            v.copy_(p.grad)
        p.grad = v
        b.views.append(v)
        offset += n
    b.flat = flat
    if b.wire_dtype is not None and b.wire_dtype != first.dtype:  # the cast path's buffer
        b.wire = torch.empty(flat.numel(), dtype=b.wire_dtype, device=flat.device)


def _adopt(b: _Bucket) -> None:
    """Make every ``.grad`` of a view bucket its view again before the bucket is sent: a
    gradient something replaced is copied into its slice, a dropped one's slice zeroed."""
    assert b.flat is not None
    for p, v in zip(b.params, b.views, strict=True):
        g = p.grad
        if g is v:
            continue
        if g is None:
            v.zero_()
        else:
            v.copy_(g)
        p.grad = v


def _copy_back(b: _Bucket, flat: torch.Tensor) -> None:
    """The averaged ``flat`` into the bucket's ``.grad`` (the paths with their own buffers)."""
    offset = 0
    for p in b.params:
        n = p.numel()
        g = flat[offset : offset + n].view_as(p)
        if p.grad is None:
            p.grad = g.clone()
        else:
            p.grad.copy_(g)
        offset += n
