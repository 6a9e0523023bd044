"""Memory per rank: parameters, gradients, optimizer state, activations, buffers.

One pipeline stage's rank holds (bytes):

- parameters: the stage's parameter bytes, with the tensor-parallel-splittable part divided
  by ``tp``;
- gradients: the same again (gradients have the parameters' dtype);
- optimizer state: Adam's two moments, ``2 ×`` the parameter bytes; SGD with momentum ``1 ×``;
  plain SGD ``0``;
- activations: the bytes autograd saves for backward (``act_saved_bytes``, scaled to the
  micro-batch size; the split layers' share divided by ``tp``) times the number of
  micro-batches in flight on that stage under the schedule: GPipe keeps all ``M``; 1F1B keeps
  ``min(M, pp - stage)``; interleaved 1F1B about ``min(M·v, (pp - stage) · v + pp - 1)``
  chunks of ``1/v`` of the stage — see :func:`in_flight_micro_batches`;
- buffers: extra bytes a pass asks for (compression buffers, fusion buffers).

A rank's capacity is ``usable_fraction ×`` its device memory (default 0.9: allocator
fragmentation and the framework's own workspace). :func:`check_fits` raises
:class:`~hetplan.errors.InfeasiblePlanError` naming the first rank that does not fit, with
the breakdown in numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetplan.errors import InfeasiblePlanError
from hetplan.ir.plan_sections import LayerCost

__all__ = [
    "MemoryBreakdown",
    "stage_memory",
    "in_flight_micro_batches",
    "check_fits",
    "OPTIMIZER_STATE_FACTOR",
    "USABLE_FRACTION",
]

#: Optimizer state bytes per parameter byte.
OPTIMIZER_STATE_FACTOR = {"adam": 2.0, "adamw": 2.0, "sgd-momentum": 1.0, "sgd": 0.0}
#: Fraction of device memory a plan may use.
USABLE_FRACTION = 0.9

GiB = float(2**30)


@dataclass(frozen=True, slots=True)
class MemoryBreakdown:
    """Bytes one rank holds; ``total`` is their sum."""

    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers

    def describe(self) -> str:
        parts = (
            ("params", self.params),
            ("grads", self.grads),
            ("optimizer", self.optimizer),
            ("activations", self.activations),
            ("buffers", self.buffers),
        )
        return ", ".join(f"{name} {value / GiB:.2f}" for name, value in parts if value) + " GiB"


def in_flight_micro_batches(
    schedule: str, stage: int, pp: int, micro_batches: int, virtual_stages: int = 1
) -> float:
    """Micro-batches whose activations stage ``stage`` holds at its peak (in units of a
    whole stage's activations)."""
    if schedule == "gpipe":
        return float(micro_batches)
    if schedule == "interleaved-1f1b" and virtual_stages > 1:
        chunks = min(micro_batches * virtual_stages, (pp - stage) * virtual_stages + pp - 1)
        return chunks / virtual_stages
    return float(min(micro_batches, pp - stage))


def stage_memory(
    layers: list[LayerCost],
    *,
    tp: int,
    micro_batch_scale: float,
    in_flight: float,
    optimizer: str = "adam",
    buffers: int = 0,
    shares: list[float] | None = None,
) -> MemoryBreakdown:
    """Peak bytes of one rank of a stage made of ``layers`` (see module docstring).

    ``shares``: this rank's fraction of each layer's split parameters and activations
    (uneven tensor-parallel shards), one per layer; None: ``1 / tp`` everywhere.
    """
    if optimizer not in OPTIMIZER_STATE_FACTOR:
        raise ValueError(
            f"unknown optimizer {optimizer!r}; expected one of {sorted(OPTIMIZER_STATE_FACTOR)}"
        )
    params = 0.0
    acts = 0.0
    for k, lay in enumerate(layers):
        split = min(lay.tp_split_bytes, lay.param_bytes)
        share = shares[k] if shares is not None else None
        params += lay.param_bytes - split + (split / tp if share is None else split * share)
        saved = lay.act_saved_bytes * micro_batch_scale
        if lay.tp_pairs:
            saved = saved / tp if share is None else saved * share
        acts += saved
    p = int(params)
    return MemoryBreakdown(
        params=p,
        grads=p,
        optimizer=int(p * OPTIMIZER_STATE_FACTOR[optimizer]),
        activations=int(acts * in_flight),
        buffers=buffers,
    )


def check_fits(
    per_rank: list[MemoryBreakdown], capacity_bytes: list[int], *, what: str = ""
) -> None:
    """Raise InfeasiblePlanError for the first rank whose memory exceeds its capacity."""
    for rank, (mem, cap) in enumerate(zip(per_rank, capacity_bytes)):
        usable = cap * USABLE_FRACTION
        if mem.total > usable:
            raise InfeasiblePlanError(
                f"{what + ': ' if what else ''}rank {rank} needs {mem.total / GiB:.2f} GiB "
                f"({mem.describe()}) but its device has {cap / GiB:.2f} GiB "
                f"({usable / GiB:.2f} GiB usable at {USABLE_FRACTION:.0%}); use more pipeline "
                "or tensor parallelism, a smaller micro-batch, or devices with more memory"
            )
