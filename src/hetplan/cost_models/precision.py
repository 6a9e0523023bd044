"""Mixed precision per device type: which dtype each device computes in, and what follows
for the bytes a rank holds and the peak its compute is priced at.

:func:`resolve_precision` turns a policy into the plan's
:class:`~hetplan.ir.plan_sections.Precision` section for a cluster:

- ``mixed`` (the default, what practitioners train in): bf16 on a device type that lists a
  bf16 peak (A100, H100 and newer), else fp16 with dynamic loss scaling where it lists fp16
  (V100 and other pre-Ampere GPUs), else fp32 (CPUs);
- ``fp32``, ``bf16``, ``fp16``: that dtype everywhere. A device type without a peak for it
  is priced at its fp32 peak (no tensor-core path: bf16 on a V100 or a CPU computes through
  fp32 units) but stores the 16-bit bytes.

With any 16-bit compute the optimizer keeps fp32 master weights; optimizer state is fp32;
gradients are kept and reduced in the data-parallel group's compute dtype (fp32 where its
ranks compute in different dtypes). :func:`state_precision` gives the bytes per element a rank
of a group holds (:class:`~hetplan.cost_models.memory.StatePrecision`).
"""

from __future__ import annotations

from collections.abc import Iterable

from hetplan.cost_models.memory import StatePrecision
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan_sections import DevicePrecision, Precision

__all__ = ["POLICIES", "DTYPE_SIZE", "resolve_precision", "state_precision", "peak_dtype"]

#: The precision policies ``compile`` accepts (``CompileOptions.dtype``).
POLICIES = ("mixed", "fp32", "bf16", "fp16")
#: Bytes per element of the compute dtypes.
DTYPE_SIZE = {"fp32": 4, "bf16": 2, "fp16": 2}


def _mixed_dtype(peaks: Iterable[str]) -> str:
    listed = set(peaks)
    if "bf16" in listed:
        return "bf16"
    if "fp16" in listed:
        return "fp16"
    return "fp32"


def peak_dtype(dtype: str, peaks: Iterable[str]) -> str:
    """The peak a device listing ``peaks`` computes ``dtype`` at: its own if listed, else
    fp32's."""
    return dtype if dtype in set(peaks) else "fp32"


def resolve_precision(policy: str, cluster: ClusterSpec) -> Precision:
    """The precision section of ``policy`` on ``cluster`` (see module docstring).

    ``policy`` may also be another dtype a device lists a peak for (``tf32``, as plans of
    earlier versions could name): it computes and stores fp32, priced at that peak.
    """
    devices: dict[str, DevicePrecision] = {}
    for dev in cluster.devices():
        if dev.type in devices:
            continue
        peaks = [name for name, _ in dev.peak_flops]
        dtype = _mixed_dtype(peaks) if policy == "mixed" else policy
        compute = dtype if dtype in DTYPE_SIZE else "fp32"
        devices[dev.type] = DevicePrecision(
            compute_dtype=compute,  # type: ignore[arg-type]
            loss_scaling="dynamic" if compute == "fp16" else "none",
            peak_dtype=peak_dtype(dtype, peaks),
        )
    half = any(d.compute_dtype != "fp32" for d in devices.values())
    return Precision(
        policy=policy if policy in POLICIES else "fp32",  # type: ignore[arg-type]
        devices=dict(sorted(devices.items())),
        master_weights_dtype="fp32" if half else None,
    )


def state_precision(precision: Precision, device_type: str, group_types: Iterable[str],
                    capture_bytes: int = 4) -> StatePrecision:
    """Bytes per element a rank of ``device_type`` holds when its data-parallel group spans
    ``group_types``; ``capture_bytes``: the workload's captured floating dtype."""
    compute = DTYPE_SIZE[precision.compute_dtype(device_type)]
    dtypes = {precision.compute_dtype(t) for t in group_types} | {
        precision.compute_dtype(device_type)}
    grads = 4 if precision.grad_reduce_dtype == "fp32" or len(dtypes) > 1 else compute
    master = 4 if compute < 4 else 0
    return StatePrecision(weight_bytes=compute, grad_bytes=grads, master_bytes=master,
                          act_bytes=compute, capture_bytes=capture_bytes)
