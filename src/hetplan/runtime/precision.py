"""Mixed precision as the plan's ``precision`` section says: which dtype a rank computes in,
autocast around its forward, and dynamic loss scaling for fp16.

- :func:`rank_compute_dtype` decides this rank's compute dtype: its device type's
  ``DevicePrecision.compute_dtype`` (the device type from the plan's embedded cluster spec,
  else the layout's rank placement, else the section's only device type); a plan without the
  section computes in ``CostSettings.dtype`` everywhere, as it was predicted.
- :class:`Autocast` enters ``torch.autocast`` in a forward pre-hook of the modules this rank
  runs and leaves it in their forward hook, so the step's code (the stage handler's
  micro-batches) needs no change. The working weights are cast to the compute dtype by
  :func:`cast_working_weights`; the fp32 master copy lives in the optimizer
  (:mod:`hetplan.runtime.sharded_optimizer`), so the optimizer never updates 16-bit weights.
- :class:`DynamicLossScale` is the fp16 loss scale (torch's ``GradScaler`` defaults: start at
  2^16, halve on an overflow and skip that step, double after 2000 clean steps). It scales
  the gradient flowing out of the loss (:func:`fp32_loss_fn`: identity forward, ``· scale``
  in backward), so the loss the runtime reports is the true one; the optimizer unscales and
  asks :meth:`DynamicLossScale.update` whether to step. Where the runtime does not build
  the optimizer around a master copy (ZeRO-3: FSDP2 keeps fp32 shards and gathers 16-bit
  weights), :class:`LossScaledOptimizer` puts the user's optimizer behind the scale.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hetplan.errors import SpecError
from hetplan.ir.plan import Plan

__all__ = [
    "DTYPES",
    "Autocast",
    "DynamicLossScale",
    "LossScaledOptimizer",
    "cast_working_weights",
    "rank_compute_dtype",
    "fp32_loss_fn",
    "unscale_and_check",
]

#: The plan's dtype names.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def rank_compute_dtype(plan: Plan, rank: int) -> str:
    """The compute dtype (``fp32``, ``bf16``, ``fp16``) of global ``rank`` in ``plan``.

    Raises:
        SpecError: the section lists several device types and the plan says of none which
            device ``rank`` is (no embedded cluster spec, no rank placement).
    """
    prec = plan.precision
    if prec is None:
        dtype = plan.cost_settings.dtype if plan.cost_settings is not None else "fp32"
        if dtype not in DTYPES:
            raise SpecError(f"cost_settings.dtype {dtype!r} of a plan without a precision "
                            "section is not one the runtime computes in (fp32, bf16, fp16); "
                            "re-run `hetplan plan`")
        return dtype
    if not prec.devices:
        return "fp32"
    spec = plan.cluster.spec
    if spec is not None and rank < spec.world_size:
        return prec.compute_dtype(spec.devices()[rank].type)
    layout = plan.layout
    if layout is not None and rank < len(layout.ranks) and layout.ranks[rank].device:
        return prec.compute_dtype(layout.ranks[rank].device)
    kinds = {d.compute_dtype for d in prec.devices.values()}
    if len(kinds) == 1:
        return kinds.pop()
    raise SpecError(f"the precision section computes in {sorted(kinds)} on device types "
                    f"{sorted(prec.devices)}, but the plan does not say which device rank {rank} "
                    "is (no embedded cluster spec, no layout.ranks); re-run `hetplan plan`")


def cast_working_weights(modules: list[nn.Module], dtype: torch.dtype) -> None:
    """Cast the floating parameters and buffers of ``modules`` to ``dtype`` in place (the
    parameter objects stay the same, so hooks and names keep working)."""
    for m in modules:
        for p in m.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
        for b in m.buffers():
            if b.is_floating_point() and b.dtype != dtype:
                b.data = b.data.to(dtype)


class Autocast:
    """``torch.autocast(device, dtype)`` around every forward of the given modules.

    Entered by a forward pre-hook, left by a forward hook that always runs (also when the
    forward raises); nested modules enter once (a depth counter).

    Args:
        modules: the top modules this rank calls (the model, or its pipeline stages).
        dtype: the compute dtype.
        io_dtype: pipeline stages: their floating inputs are cast to ``dtype`` (what the
            unsplit model's next layer would receive) and their floating outputs returned in
            ``io_dtype``, the dtype the stages were traced in (the model's before the cast to
            ``dtype``), which fixes the dtype of their P2P buffers; the casts are exact both
            ways for a 16-bit activation. A float64 model's stages send float64: an fp32
            output received into their float64 buffers came out as NaN.
    """

    def __init__(self, modules: list[nn.Module], dtype: torch.dtype,
                 io_dtype: torch.dtype | None = None) -> None:
        self.dtype = dtype
        self.io_dtype = io_dtype
        self._stack: list[Any] = []
        self._handles = []
        for m in modules:
            self._handles.append(m.register_forward_pre_hook(self._enter))
            self._handles.append(m.register_forward_hook(self._exit, always_call=True))

    def _enter(self, module: nn.Module, args: Any) -> Any:
        device = next((p.device.type for p in module.parameters()), "cpu")
        ctx = torch.autocast(device_type=device, dtype=self.dtype)
        ctx.__enter__()
        self._stack.append(ctx)
        if self.io_dtype is None:
            return None
        return tuple(a.to(self.dtype) if isinstance(a, torch.Tensor) and a.is_floating_point()
                     else a for a in args)

    def _exit(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self._stack:
            self._stack.pop().__exit__(None, None, None)
        return None if self.io_dtype is None else _upcast(output, self.io_dtype)

    def remove(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []


@dataclass
class DynamicLossScale:
    """The fp16 dynamic loss scale (the defaults of ``torch.amp.GradScaler``).

    Attributes:
        scale: the current scale.
        growth_factor / backoff_factor: multiply the scale after ``growth_interval`` clean
            steps / after an overflow.
        growth_interval: clean steps before the scale grows.
        clean_steps: clean steps since the last change.
        skipped: steps skipped because a gradient overflowed.
    """

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    clean_steps: int = 0
    skipped: int = 0

    def update(self, found_inf: bool) -> bool:
        """Record a step's overflow check; True when the optimizer may step."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            self.skipped += 1
            return False
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0
        return True


class LossScaledOptimizer(torch.optim.Optimizer):
    """The user's optimizer behind the fp16 loss scale, for parameters that are their own
    master weights (ZeRO-3: FSDP2's fp32 shards, whose gradients arrive scaled).

    A step divides every gradient (a DTensor's local shard, in place) by the scale, agrees
    with every rank of the job on whether one is not finite (a MAX all-reduce: every rank
    keeps the same scale and skips the same steps, as
    :class:`~hetplan.runtime.sharded_optimizer.ShardedOptimizer` does), and steps the inner
    optimizer only when none is. Its parameter groups and state are the inner optimizer's.
    """

    def __init__(self, inner: torch.optim.Optimizer, scaler: DynamicLossScale) -> None:
        self.inner, self.scaler = inner, scaler
        params = [p for g in inner.param_groups for p in g["params"]]
        super().__init__(params, {})
        self.param_groups = inner.param_groups
        self.state = inner.state

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Unscale, check, and step unless a gradient overflowed (then the step is skipped
        and the scale backs off)."""
        params = [p for g in self.param_groups for p in g["params"]]
        local = [_local(p.grad) for p in params if p.grad is not None]
        bad = unscale_and_check(local, self.scaler.scale, params[0].device if params else None)
        if dist.is_initialized():
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if not self.scaler.update(bool(bad.item() > 0)):
            return None
        return self.inner.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)


def unscale_and_check(grads: Sequence[torch.Tensor], scale: float,
                      device: torch.device | None = None) -> torch.Tensor:
    """Divide ``grads`` by ``scale`` in place; a one-element float32 flag, 1 where one of
    them holds an infinity or a NaN, else 0.

    One fused kernel (torch's ``_amp_foreach_non_finite_check_and_unscale_``, what
    ``GradScaler`` runs) and no host synchronisation: the flag stays on the gradients'
    device (``device`` when there are none), where the job's collective can reduce it (an
    NCCL group takes no CPU tensor). ``DynamicLossScale``'s default scales are powers of two, so
    multiplying by the inverse is the division."""
    where = grads[0].device if grads else (device or torch.device("cpu"))
    found = torch.zeros(1, dtype=torch.float32, device=where)
    if grads:
        inv = torch.full((1,), 1.0 / scale, dtype=torch.float32, device=where)
        torch._amp_foreach_non_finite_check_and_unscale_(list(grads), found, inv)
    return found


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view: in-place changes reach it); any other tensor as is."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class _ScaleGrad(torch.autograd.Function):
    """Identity in forward; multiplies the incoming gradient by ``scale`` in backward."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, scale: float) -> torch.Tensor:  # noqa: D102
        ctx.scale = scale
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: D102
        return grad * ctx.scale, None


def fp32_loss_fn(loss_fn: Any, scaler: DynamicLossScale | None = None) -> Any:
    """``loss_fn`` on the model's output upcast to fp32 (the loss and its softmax in fp32, as
    Megatron computes its cross-entropy); with ``scaler`` its backward starts at
    ``scaler.scale`` (the value it returns is the unscaled loss)."""

    def wrapped(output: Any, target: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(_upcast(output), target)
        return loss if scaler is None else _ScaleGrad.apply(loss, scaler.scale)

    return wrapped


def _upcast(output: Any, dtype: torch.dtype = torch.float32) -> Any:
    """Floating tensors of a model output (a tensor, a tuple or list, an object with
    ``logits``) in ``dtype``."""
    if isinstance(output, torch.Tensor):
        return output.to(dtype) if output.is_floating_point() else output
    if isinstance(output, (tuple, list)):
        return type(output)(_upcast(x, dtype) for x in output)
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        output.logits = _upcast(logits, dtype)
    return output
