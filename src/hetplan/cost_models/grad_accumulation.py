"""Gradient accumulation across micro-batches: the memory-bound work the training engine does
after each micro-batch's backward to add that micro-batch's gradients to the iteration's.

The cost setting ``grad_accumulation`` (``CostSettings.grad_accumulation``) says how the
engine accumulates; per parameter element a rank accumulates and per micro-batch, with
``g`` the bytes of the gradient autograd produces (the parameters' dtype, the working
weights' ``weight_bytes``) and ``m`` micro-batches per iteration:

- ``unpriced``: not priced; what a plan written before this setting existed (no field in
  its JSON) is re-priced with, so such plans stay byte-identical. ``CostModel``'s default.
- ``autograd``: PyTorch's own accumulation (DDP under ``no_sync``, or no DDP). The first
  micro-batch's gradient becomes ``.grad`` (``zero_grad`` leaves it None); each later one is
  added in place by ``AccumulateGrad`` at the gradient's dtype: read ``.grad``, read the new
  gradient, write ``.grad``, ``3·g`` for micro-batches 2..m, so ``3·g·(m-1)/m`` per
  micro-batch on average. The hetplan runtime accumulates this way, so it is the default of
  ``hetplan.compile`` and ``hetplan plan`` (``docs/decisions/grad-accumulation-default.md``).
- ``hook16`` / ``hook32``: Megatron-LM's local DDP, a hook on every parameter's
  ``AccumulateGrad`` that runs ``param.main_grad.add_(param.grad.data)`` after every
  micro-batch (the first included: ``main_grad`` is zeroed at the start of the iteration):
  read the gradient (``g``) and read-modify-write the ``main_grad`` buffer, in the
  parameters' dtype (``hook16``: ``3·g``, 6 bytes at 16 bits) or in fp32 with
  ``--accumulate-allreduce-grads-in-fp32`` (``hook32``: ``g + 8``, 10 bytes at 16 bits).
- ``fused``: Megatron-LM's ``--gradient-accumulation-fusion``: the weight-gradient GEMM of
  every linear accumulates into the fp32 ``main_grad`` itself (a ``beta = 1`` epilogue),
  so the linears' weights cost nothing more; every other parameter (embeddings, norms,
  biases) still goes through the fp32 hook (``hook32``). Megatron-LM allows the fusion only
  with fp32 accumulation.

Not counted: zeroing the ``main_grad`` buffer once per iteration (``hook*``: at most ``4/m``
bytes per element and micro-batch), and the host's kernel launches.

**Which elements.** A rank accumulates the gradients of the parameters it holds after the
tensor- and pipeline-parallel split (:func:`~hetplan.cost_models.stage_times.shard_bytes`
over :meth:`~hetplan.cost_models.costs.CostModel.memory_layers`). ZeRO-0 and ZeRO-1 (the
distributed optimizer) accumulate the whole gradient and reduce it once per iteration.
ZeRO-2 and ZeRO-3 reduce-scatter every micro-batch's gradient (as the cost model prices
them, :func:`~hetplan.cost_models.stage_times.stage_times`) and each rank adds only its
``1/dp`` shard of the result to the shard it accumulates (FSDP's sharded-gradient
accumulation): ``1/dp`` of the elements, with the same bytes per element.

**Where.** The add runs on the compute stream as each parameter's gradient is ready, inside
every micro-batch's backward: it lengthens each micro-batch's backward of the stage (and its
layers' gradient-ready times), at the device's streaming bandwidth (the datasheet bandwidth
times :attr:`~hetplan.cost_models.kernels.GemmCurve.stream` where the device type has a
curve, the datasheet bandwidth elsewhere).
"""

from __future__ import annotations

from typing import Literal

from hetplan.cost_models.kernels import curve_for
from hetplan.ir.cluster import Device
from hetplan.ir.plan_sections import LayerCost

__all__ = ["GradAccumulation", "GRAD_ACCUMULATIONS", "accumulation_bytes", "linear_weight_elems",
           "streaming_bandwidth"]

GradAccumulation = Literal["unpriced", "autograd", "hook16", "hook32", "fused"]
#: How the engine accumulates gradients across micro-batches (see module docstring).
GRAD_ACCUMULATIONS: tuple[str, ...] = ("unpriced", "autograd", "hook16", "hook32", "fused")


def accumulation_bytes(mode: str, grad_bytes: int, micro_batches: int) -> tuple[float, float]:
    """Bytes moved per parameter element and micro-batch, averaged over the iteration's
    ``micro_batches``: (for a linear's weight, for any other parameter).

    Args:
        mode: one of :data:`GRAD_ACCUMULATIONS`.
        grad_bytes: bytes per element of the gradient autograd produces (the parameters'
            dtype).
        micro_batches: micro-batches per iteration (``m``).

    Example: ``accumulation_bytes("autograd", 2, 4) == (4.5, 4.5)`` (``3·2·3/4``).
    """
    if mode not in GRAD_ACCUMULATIONS:
        raise ValueError(f"unknown grad_accumulation {mode!r}; expected one of "
                         f"{', '.join(GRAD_ACCUMULATIONS)}")
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be at least 1, got {micro_batches}")
    g = float(grad_bytes)
    if mode == "unpriced":
        return 0.0, 0.0
    if mode == "autograd":
        per = 3.0 * g * (micro_batches - 1) / micro_batches
        return per, per
    hook32 = g + 8.0
    if mode == "hook16":
        return 3.0 * g, 3.0 * g
    if mode == "hook32":
        return hook32, hook32
    return 0.0, hook32  # fused


def linear_weight_elems(lay: LayerCost, tokens: int) -> int:
    """Elements of ``lay``'s linear weights (whole, before any TP split): the ``k x n``
    operand of each forward matrix multiply outside the attention core whose rows are the
    captured batch's ``tokens`` (a weight-gradient GEMM per weight); 0 when capture
    recorded no such product."""
    return sum(g.k * g.n * g.count for g in lay.gemms
               if g.phase == "fwd" and not g.core and g.batch == 1 and g.m == tokens)


def streaming_bandwidth(device: Device) -> float:
    """Bytes per second a streaming (element-wise) kernel reaches on ``device``."""
    curve = curve_for(device.type)
    return device.mem_bandwidth_bytes_per_s * (curve.stream if curve is not None else 1.0)
