"""The optimizer step's time: the bytes its kernels move over memory bandwidth, plus the host's
cost of launching each kernel.

The step is memory-bound: every kernel reads and writes whole parameter-sized tensors once
and does a few FLOPs per element. What one rank runs per step, as the runtime runs it
(:mod:`hetplan.runtime.sharded_optimizer` around torch's optimizers, whose default on GPUs
is the ``foreach`` implementation: one multi-tensor kernel per operation over all
parameters), counted per parameter element the rank updates:

1. **Gradient chunk** (16-bit weights with an fp32 master copy, or ZeRO): zero an fp32
   buffer (write 4) and copy every parameter's gradient into it (read ``grad_bytes``,
   write 4): one copy kernel per parameter tensor.
2. **Update** (:data:`UPDATE_BYTES`, over fp32 tensors, one foreach kernel per operation):

   - Adam: ``m ← lerp(m, g)`` (read m, g; write m: 12), ``v ← β₂v`` (8),
     ``v ← v + (1-β₂)g²`` (read v, g; write v: 12), ``t ← sqrt(v)`` (8), ``t ← t / c₂``
     (8), ``t ← t + ε`` (8), ``p ← p - s·m / t`` (read p, m, t; write p: 16): 72 bytes in
     7 kernels (``torch.optim.adam._multi_tensor_adam``);
   - AdamW: Adam and the decoupled decay ``p ← (1 - lr·λ)p`` (8): 80 bytes in 8;
   - SGD with momentum: ``b ← μb`` (8), ``b ← b + g`` (12), ``p ← p - lr·b`` (12): 32 in 3;
   - SGD: ``p ← p - lr·g``: 12 in 1.

   ``tests/unit/test_optimizer_step.py`` counts these bytes on torch's own optimizers.
3. **Working weights** (16-bit weights): cast the fp32 master to the working dtype (read 4,
   write ``weight_bytes``) and copy each parameter out of it (read and write
   ``weight_bytes``): one copy kernel per parameter tensor.

fp32 training without ZeRO runs the optimizer on the parameters themselves: step 2 only.
Under ZeRO a rank steps ``1/dp`` of the elements; the copy back into its full working
weights (step 3's per-parameter copies) stays whole.

**Time** ``= bytes / memory bandwidth + kernels · LAUNCH_S``. Each eager kernel costs the
host a fixed launch time (Python, the dispatcher, ``cudaLaunchKernel``) independent of its
size; with one or two copies per parameter tensor, a model of a few hundred small tensors
spends more time launching than moving bytes. :data:`LAUNCH_S` is 10 µs, the middle
(geometric mean) of the 5–20 µs per launch that PyTorch traces show on the CPU side
(Holistic Trace Analysis, "CUDA kernel launch statistics": "usually, the launch time on the
CPU side is between 5-20 microseconds"). The two terms add: the host launches the next
copy while the device runs the previous one only when the device is the slower, and the
per-tensor copies are too small for that (a 2.4 MB copy takes about 1 µs at 4.8 TB/s).
"""

from __future__ import annotations

from hetplan.cost_models.memory import MOMENT_BYTES, StatePrecision

__all__ = ["LAUNCH_S", "UPDATE_BYTES", "UPDATE_KERNELS", "step_bytes", "step_kernels",
           "step_seconds"]

#: Host-side seconds to launch one eager kernel (see module docstring).
LAUNCH_S = 10e-6
#: Bytes the update moves per fp32 element, by optimizer (see module docstring).
UPDATE_BYTES = {"adam": 72.0, "adamw": 80.0, "sgd-momentum": 32.0, "sgd": 12.0}
#: Foreach kernels of the update, by optimizer.
UPDATE_KERNELS = {"adam": 7, "adamw": 8, "sgd-momentum": 3, "sgd": 1}


def _check(optimizer: str) -> None:
    if optimizer not in UPDATE_BYTES or optimizer not in MOMENT_BYTES:
        raise ValueError(
            f"unknown optimizer {optimizer!r}; expected one of {sorted(UPDATE_BYTES)}")


def _sharded(prec: StatePrecision, dp: int) -> bool:
    """Whether the step runs on an fp32 chunk beside the working weights (steps 1 and 3)."""
    return prec.master_bytes > 0 or dp > 1


def step_bytes(prec: StatePrecision, optimizer: str, *, dp: int = 1) -> float:
    """Bytes the step moves per parameter element of the rank (see module docstring);
    ``dp``: the ZeRO group whose ``1/dp`` of the elements the rank updates (1: no ZeRO)."""
    _check(optimizer)
    update = UPDATE_BYTES[optimizer]
    if not _sharded(prec, dp):
        return update
    chunk = 4.0 + prec.grad_bytes + 4.0  # zero the fp32 chunk, copy the gradient in
    cast = 4.0 + prec.weight_bytes  # the fp32 master to the working dtype
    copy_out = 2.0 * prec.weight_bytes  # into every parameter (whole under ZeRO)
    return (chunk + update + cast) / dp + copy_out


def step_kernels(prec: StatePrecision, optimizer: str, tensors: int, *, dp: int = 1) -> int:
    """Kernels one rank's step launches over ``tensors`` parameter tensors: the update's
    foreach kernels, and with an fp32 chunk its zeroing, cast and two copies per tensor."""
    _check(optimizer)
    kernels = UPDATE_KERNELS[optimizer]
    if _sharded(prec, dp):
        kernels += 2 + 2 * tensors
    return kernels


def step_seconds(nbytes: float, kernels: int, mem_bandwidth_bytes_per_s: float) -> float:
    """Seconds of a step that moves ``nbytes`` in ``kernels`` launches (module docstring)."""
    return nbytes / mem_bandwidth_bytes_per_s + kernels * LAUNCH_S
