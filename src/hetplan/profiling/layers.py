"""Per-layer forward and backward times, measured by running real training steps.

:func:`profile_layers` captures the model (:func:`hetplan.capture`) for its layers and their
signatures, then runs forward + backward on real tensors with hooks on every layer unit
module (the IR's layer names are module qualnames; the ``k``-th call of a module in one step
is invocation ``name@k``, as in the IR) and turns the hook timestamps into one
:class:`~hetplan.cost_models.profile_db.ComputeRecord` per distinct layer signature.

**Attribution — consistent with the IR.** Capture attributes glue code outside every layer
(residual adds, masks, reshapes, and the loss) to the *next* layer in dataflow order, or to
the last layer when nothing follows. The measurement does the same by timing *gaps* between
hook timestamps instead of the inside of each module:

* forward: a forward post-hook stamps the end of every layer invocation. Layer ``k``'s forward
  time is ``end[k] - end[k-1]`` (``end[-1]`` = start of the step), so the glue run before a
  layer is counted in that layer; the time from the last layer's end to the end of the loss
  (trailing glue) is added to the last layer.
* backward: a gradient hook on every output tensor of a layer invocation stamps when the
  gradient of its output is ready, i.e. when that layer's backward starts (the last such
  stamp over its outputs). Backprop visits layers in reverse, and the backward of the glue
  before layer ``k`` runs right after layer ``k``'s own backward, so layer ``k``'s backward
  time is ``start[next layer to start] - start[k]`` (the first layer: end of backward -
  start); the time from the start of ``loss.backward()`` to the first stamp (the loss and
  trailing glue) goes to the last layer, as in forward.

So per step the layer times add up exactly to the measured forward + backward wall time: no
remainder is left to distribute. Layers the hooks never see (a parameter-only ``params``
layer, or a module whose weight is used without calling it, such as ``pos_emb.weight[:t]``)
get 0 ms: their work is inside the neighbouring gaps. The loss is ``loss_fn(output)``; the
default, the sum of every floating output, is what capture differentiates.

**Timing.** On CPU, ``time.perf_counter`` in the hooks (the autograd engine runs CPU work on
the calling thread); on CUDA, ``torch.cuda.Event`` records read after a synchronize. Identical
blocks share a signature; their per-layer means are averaged into one record whose
``samples`` counts iterations × layers.

**Contention.** Times depend on how many threads and processes share the CPU. For data
parallelism on one machine, :func:`profile_layers_concurrent` runs the profiling on ``n``
processes at once with the threads each training process would get; see ``bench/fidelity.py``
for what that changes.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from hetplan.cost_models.profile_db import ComputeRecord
from hetplan.ir.model import LayerKind, ModelIR

if TYPE_CHECKING:
    from rich.progress import Progress

__all__ = [
    "LayerTiming",
    "alias_records",
    "default_loss",
    "profile_layers",
    "profile_layers_concurrent",
    "records_from_timing",
    "time_layers",
    "training_threads",
]


def default_loss(output: Any) -> torch.Tensor:
    """The loss capture differentiates: the sum of every floating tensor of ``output``."""
    parts = [t.float().sum() for t in tree_leaves(output)
             if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    if not parts:
        raise ValueError("the model output has no floating tensor that requires grad; "
                         "pass loss_fn= to turn the output into a scalar loss")
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total


@dataclass
class LayerTiming:
    """Per-invocation times of every measured step (milliseconds).

    Attributes:
        fwd_ms / bwd_ms: layer invocation name → one value per timed step.
        step_ms: forward + backward wall time of every timed step.
    """

    fwd_ms: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    bwd_ms: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    step_ms: list[float] = field(default_factory=list)


class _Clock:
    """Timestamps in ms: perf_counter on CPU, CUDA events (resolved later) on GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._events: list[Any] = []

    def now(self) -> Any:
        if not self.cuda:
            return time.perf_counter() * 1e3
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        self._events.append(ev)
        return ev

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def resolve(self, stamp: Any, origin: Any) -> float:
        if not self.cuda:
            return float(stamp - origin)
        return float(origin.elapsed_time(stamp))


class _Hooks:
    """Forward post-hooks and output-gradient hooks on the layer unit modules."""

    def __init__(self, model: nn.Module, names: Sequence[str], clock: _Clock) -> None:
        self.clock = clock
        self.fwd_end: list[tuple[str, Any]] = []
        self.bwd_start: dict[str, Any] = {}
        self.bwd_order: list[str] = []
        self.calls: dict[str, int] = defaultdict(int)
        self.handles = []
        for name in names:
            module = model.get_submodule(name) if name else model
            self.handles.append(module.register_forward_hook(self._post(name)))

    def reset(self) -> None:
        self.fwd_end.clear()
        self.bwd_start.clear()
        self.bwd_order.clear()
        self.calls.clear()

    def _post(self, name: str) -> Callable[..., None]:
        def hook(_m: nn.Module, _inp: Any, out: Any) -> None:
            k = self.calls[name]
            self.calls[name] += 1
            inv = name if k == 0 else f"{name}@{k}"
            self.fwd_end.append((inv, self.clock.now()))
            if not torch.is_grad_enabled():
                return
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None:
                    t.register_hook(self._grad(inv))

        return hook

    def _grad(self, inv: str) -> Callable[[torch.Tensor], None]:
        def hook(_g: torch.Tensor) -> None:
            # the layer's backward starts once the gradient of its last output is ready
            if inv in self.bwd_start:
                self.bwd_order.remove(inv)
            self.bwd_start[inv] = self.clock.now()
            self.bwd_order.append(inv)

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _to(x: Any, device: torch.device) -> Any:
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, x)


def time_layers(
    model: nn.Module,
    example_inputs: Sequence[Any] | Any,
    example_kwargs: Mapping[str, Any] | None,
    layer_names: Sequence[str],
    *,
    last_layer: str,
    warmup: int = 2,
    iters: int = 5,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    progress: Callable[[], None] | None = None,
    dtype: str = "fp32",
) -> LayerTiming:
    """Time every layer invocation over ``iters`` forward + backward steps (after ``warmup``).

    The model and inputs must already be on the device to measure. See the module docstring
    for how gaps between hook timestamps become layer times.

    Args:
        model: the model (training mode is the caller's choice).
        example_inputs / example_kwargs: one micro-batch.
        layer_names: qualnames of the modules to hook (the IR's layer units).
        last_layer: the IR's last layer (receives trailing glue and the loss).
        warmup / iters: untimed and timed steps.
        loss_fn: output → scalar loss (default :func:`default_loss`).
        progress: called after every step.
        dtype: compute dtype: ``fp32`` as the model is, or ``bf16`` / ``fp16`` under
            ``torch.autocast`` on the model's device (how the runtime runs a mixed plan).

    Returns:
        The per-step times.
    """
    args = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    kwargs = dict(example_kwargs or {})
    loss_fn = loss_fn or default_loss
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    clock = _Clock(device)
    hooks = _Hooks(model, layer_names, clock)
    out = LayerTiming()
    try:
        for step in range(warmup + iters):
            hooks.reset()
            model.zero_grad(set_to_none=True)
            clock.sync()
            t0 = clock.now()
            with _autocast(device, dtype):
                loss = loss_fn(model(*args, **kwargs))
            t1 = clock.now()
            loss.backward()
            t2 = clock.now()
            clock.sync()
            if step >= warmup:
                _attribute(hooks, clock, t0, t1, t2, last_layer, out)
            if progress is not None:
                progress()
    finally:
        hooks.remove()
        model.zero_grad(set_to_none=True)
    return out


_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _autocast(device: torch.device, dtype: str) -> Any:
    """``torch.autocast`` for a reduced compute dtype, a no-op context for fp32."""
    if dtype == "fp32":
        return contextlib.nullcontext()
    if dtype not in _AUTOCAST:
        raise ValueError(f"dtype must be fp32, bf16 or fp16, got {dtype!r}")
    return torch.autocast(device.type, dtype=_AUTOCAST[dtype])


def _attribute(
    hooks: _Hooks, clock: _Clock, t0: Any, t1: Any, t2: Any, last: str, out: LayerTiming
) -> None:
    """Turn one step's stamps into layer times (module docstring)."""
    fwd: dict[str, float] = defaultdict(float)
    prev = 0.0
    for inv, stamp in hooks.fwd_end:
        t = clock.resolve(stamp, t0)
        fwd[inv] += max(t - prev, 0.0)
        prev = max(prev, t)
    fwd_total = clock.resolve(t1, t0)
    fwd[last] += max(fwd_total - prev, 0.0)

    bwd: dict[str, float] = defaultdict(float)
    starts = [(clock.resolve(hooks.bwd_start[inv], t0), inv) for inv in hooks.bwd_order]
    starts.sort()
    end = clock.resolve(t2, t0)
    if starts:
        bwd[last] += max(starts[0][0] - fwd_total, 0.0)
        for (t, inv), nxt in zip(starts, [s for s, _ in starts[1:]] + [end]):
            bwd[inv] += max(nxt - t, 0.0)
    else:
        bwd[last] += end - fwd_total
    for inv in set(fwd) | set(bwd) | set(out.fwd_ms):
        out.fwd_ms[inv].append(fwd.get(inv, 0.0))
        out.bwd_ms[inv].append(bwd.get(inv, 0.0))
    out.step_ms.append(end)


def _hooked_units(ir: ModelIR) -> list[str]:
    """Module qualnames to hook: every layer unit except parameter-only containers."""
    names: list[str] = []
    for lay in ir.layers:
        base = lay.name.split("@", 1)[0]
        if lay.kind is LayerKind.PARAMS or base in names:
            continue
        names.append(base)
    return names


def records_from_timing(
    ir: ModelIR, timing: LayerTiming, device_type: str, iters: int, dtype: str = "fp32"
) -> list[ComputeRecord]:
    """One record per distinct layer signature: per-layer means averaged over equal layers.

    Args:
        ir: the captured model (layers and signatures).
        timing: per-step times of every layer invocation.
        device_type: cluster device type the times were measured on.
        iters: timed steps (``samples`` = iters × layers sharing the signature).
        dtype: the compute dtype the times were measured in.
    """
    by_sig: dict[str, list[tuple[list[float], list[float], str]]] = defaultdict(list)
    for lay in ir.layers:
        f = timing.fwd_ms.get(lay.name) or [0.0] * iters
        b = timing.bwd_ms.get(lay.name) or [0.0] * iters
        by_sig[lay.signature(ir.batch_size)].append((f, b, f"{lay.module_type} {lay.name}"))
    records = []
    for sig, group in by_sig.items():
        fwd = [v for f, _, _ in group for v in f]
        bwd = [v for _, b, _ in group for v in b]
        label = group[0][2] + (f" (+{len(group) - 1} equal)" if len(group) > 1 else "")
        records.append(ComputeRecord(
            signature=sig,
            device_type=device_type,
            dtype=dtype,  # type: ignore[arg-type]  # validated by the record
            batch_size=ir.batch_size,
            fwd_ms=statistics.fmean(fwd),
            bwd_ms=statistics.fmean(bwd),
            samples=max(len(fwd), 1),
            fwd_stdev_ms=statistics.pstdev(fwd) if len(fwd) > 1 else 0.0,
            bwd_stdev_ms=statistics.pstdev(bwd) if len(bwd) > 1 else 0.0,
            label=label,
        ))
    return sorted(records, key=lambda r: r.key)


def alias_records(records: Sequence[ComputeRecord], ir: ModelIR,
                  planning_ir: ModelIR) -> list[ComputeRecord]:
    """Records of ``records`` filed again under the signatures ``planning_ir`` gives the same
    layers (matched by name), where those differ.

    Signatures are per sample, but a layer with an input that does not grow with the batch
    (a position embedding's ``(1, seq)`` index, a block fed a ``(1, 1, seq, seq)`` mask) gets
    a batch-specific one: tiny-gpt2 profiled at micro-batch 2 and planned from the zoo's
    batch-1 capture matched 4 of its 6 layers, and the other 2 (the position embedding, and
    the first block, which carries the mask creation) fell back to the roofline. The
    profiler knows both captures of the same layer, so it files the measured time under both
    keys; the record keeps the micro-batch it was measured at (the compute model scales from
    it). Returns only the new records."""
    planned = {lay.name: lay.signature(planning_ir.batch_size) for lay in planning_ir.layers}
    by_key = {(r.signature, r.dtype): r for r in records}
    taken = set(by_key)
    out = []
    for lay in ir.layers:
        sig, alias = lay.signature(ir.batch_size), planned.get(lay.name)
        for dtype in sorted({r.dtype for r in records}):
            if alias is None or (alias, dtype) in taken or (sig, dtype) not in by_key:
                continue
            taken.add((alias, dtype))
            out.append(by_key[(sig, dtype)].model_copy(update={
                "signature": alias,
                "label": f"{lay.module_type} {lay.name} (as captured at batch "
                         f"{planning_ir.batch_size})"}))
    return out


def profile_layers(
    model: nn.Module,
    example_inputs: Sequence[Any] | Any,
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    device_type: str,
    device: str | torch.device = "cpu",
    warmup: int = 2,
    iters: int = 5,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    ir: ModelIR | None = None,
    num_threads: int | None = None,
    progress: Progress | None = None,
    dtype: str = "fp32",
) -> list[ComputeRecord]:
    """Measure forward and backward time of every layer signature of ``model``.

    Args:
        model: the model, with real (not ``meta``) weights; it is moved to ``device`` and its
            gradients are cleared afterwards. Training mode is kept as given.
        example_inputs / example_kwargs: one micro-batch, at the batch size the plan will be
            made with (records are keyed by signature, which includes activation sizes).
        device_type: the cluster device type to file the records under (``cpu``,
            ``A100-80GB`` ...).
        device: where to run (``cpu``, ``cuda``, ``cuda:1`` ...).
        warmup / iters: untimed and timed steps (≥ 0, ≥ 1).
        loss_fn: output → scalar loss (default: sum of floating outputs, as capture does).
        ir: the model's IR if already captured with these inputs (else captured here).
        num_threads: ``torch.set_num_threads`` during the measurement (restored after).
        progress: a ``rich.progress.Progress`` to show a task on.
        dtype: compute dtype, ``fp32`` or ``bf16`` / ``fp16`` under autocast.

    Returns:
        One :class:`ComputeRecord` per distinct ``LayerIR.signature()``, sorted by key.

    Example:
        >>> import torch
        >>> mlp = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
        ...                           torch.nn.Linear(64, 8))
        >>> recs = profile_layers(mlp, torch.randn(16, 64), device_type="cpu", iters=2)
        >>> len(recs), all(r.fwd_ms > 0 for r in recs)
        (2, True)
    """
    if iters < 1 or warmup < 0:
        raise ValueError(f"need iters >= 1 and warmup >= 0, got iters={iters}, warmup={warmup}")
    if ir is None:
        from hetplan.ir.capture import capture

        ir = capture(model, example_inputs, example_kwargs)
    dev = torch.device(device)
    model = model.to(dev)
    args = _to(example_inputs, dev)
    kwargs = _to(dict(example_kwargs or {}), dev)
    step: Callable[[], None] | None = None
    if progress is not None:
        task = progress.add_task(f"layers of {ir.name}", total=warmup + iters)
        step = functools.partial(progress.advance, task)
    old_threads = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        timing = time_layers(
            model, args, kwargs, _hooked_units(ir), last_layer=ir.layers[-1].name,
            warmup=warmup, iters=iters, loss_fn=loss_fn,
            progress=step, dtype=dtype,
        )
    finally:
        torch.set_num_threads(old_threads)
    return records_from_timing(ir, timing, device_type, iters, dtype)


def _concurrent_worker(
    rank: int,
    world_size: int,
    model: nn.Module,
    args: Any,
    kwargs: Any,
    layer_names: list[str],
    last_layer: str,
    warmup: int,
    iters: int,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    device: str,
    dtype: str = "fp32",
) -> LayerTiming:
    import torch.distributed as dist

    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", rank % torch.cuda.device_count())
    model = model.to(dev)
    dist.barrier()  # start together, so the processes contend as training would
    timing = time_layers(model, _to(args, dev), _to(kwargs, dev), layer_names,
                         last_layer=last_layer, warmup=warmup, iters=iters, loss_fn=loss_fn,
                         dtype=dtype)
    return LayerTiming(dict(timing.fwd_ms), dict(timing.bwd_ms), timing.step_ms)


def training_threads(processes: int) -> int:
    """The torch threads each of ``processes`` training processes on one machine gets under
    torchrun (and ``hetplan run``): ``OMP_NUM_THREADS`` when it is set to a positive
    integer; else 1 with more than one process (torchrun sets ``OMP_NUM_THREADS=1`` then)
    and every core with one. It was ``cores // processes``, which matches a run only where
    there are no more cores than processes: on a 16-core host 4 profiling processes got 4
    threads each, 4 ranks of a run one."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if value.isdigit() and int(value) > 0:
        return int(value)
    return 1 if processes > 1 else max(1, os.cpu_count() or 1)


def profile_layers_concurrent(
    model: nn.Module,
    example_inputs: Sequence[Any] | Any,
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    processes: int,
    device_type: str,
    device: str = "cpu",
    threads_per_process: int | None = None,
    warmup: int = 2,
    iters: int = 5,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    ir: ModelIR | None = None,
    timeout_s: float = 600.0,
    dtype: str = "fp32",
) -> list[ComputeRecord]:
    """:func:`profile_layers` on ``processes`` local processes at once; times averaged.

    Data-parallel training on one machine runs one process per device; on a CPU-only machine
    they share cores and memory bandwidth, so a layer runs slower than when profiled alone.
    This runs the same measurement in every process simultaneously (the model and inputs are
    pickled to each; ``loss_fn`` must be a module-level function) with the threads each
    training process would get, and averages the processes' times.

    Args:
        processes: concurrent processes (the data-parallel degree on this machine).
        threads_per_process: torch threads per process; default: what a rank of
            ``hetplan run`` with this many ranks on the machine gets
            (:func:`training_threads`).
        device: ``cpu``, or ``cuda`` (process ``r`` uses GPU ``r``).
        timeout_s: limit on the whole run.
        Others: as in :func:`profile_layers`.

    Returns:
        One :class:`ComputeRecord` per distinct layer signature.
    """
    from hetplan.profiling._spawn import run_local_ranks

    if ir is None:
        from hetplan.ir.capture import capture

        ir = capture(model, example_inputs, example_kwargs)
    if threads_per_process is None:
        threads_per_process = training_threads(processes)
    args = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    on_cpu = all(t.device.type == "cpu" for t in [*model.parameters(), *model.buffers()])
    cpu_model = model if on_cpu else copy.deepcopy(model).cpu()  # never move the caller's
    timings: list[LayerTiming] = run_local_ranks(
        _concurrent_worker,
        processes,
        (cpu_model, _to(tuple(args), torch.device("cpu")),
         _to(dict(example_kwargs or {}), torch.device("cpu")), _hooked_units(ir),
         ir.layers[-1].name, warmup, iters, loss_fn, device, dtype),
        backend="gloo",
        timeout_s=timeout_s,
        threads_per_process=threads_per_process,
    )
    merged = LayerTiming()
    for t in timings:
        for inv, vals in t.fwd_ms.items():
            merged.fwd_ms[inv].extend(vals)
        for inv, vals in t.bwd_ms.items():
            merged.bwd_ms[inv].extend(vals)
        merged.step_ms.extend(t.step_ms)
    return records_from_timing(ir, merged, device_type, iters * processes, dtype)
