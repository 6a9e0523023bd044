"""Peak memory of one training step on this rank, measured on any device (CPU included).

CPU has no allocator statistics, so :class:`PeakMemory` counts tensor storages instead:
``torch.distributed._tools.mem_tracker.MemTracker`` (a ``TorchDispatchMode``) sees every
storage an operator creates and, through weak references, when it is freed, and keeps the
peak of the live bytes by kind — parameters, buffers, gradients, optimizer state,
activations (forward outputs, recomputed ones included) and temporaries (backward's). The
model, the optimizer's state and the tensors the runtime keeps outside both (the sharded
optimizer's master shard) are registered before the step, so the peak is the rank's whole
footprint. What it does not see: memory outside tensors (the interpreter, gloo's buffers) and
an allocator's fragmentation — the plan's ``margin`` predicts the latter for GPUs, so the
comparison with a prediction leaves the margin out (:func:`compare`).

The tracker dispatches every operator through Python, so a measured step is slow: the
worker measures one extra step after the timed ones.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["MemoryPeak", "compare", "peak_memory"]

#: MemTracker's kinds → the plan's ``RankMemory`` parts they are compared with.
KINDS = {"Parameter": "params", "Buffer": "params", "Gradient": "grads",
         "Optstate": "optimizer", "Activation": "activations", "Temp": "activations",
         "Other": "optimizer"}


@dataclass
class MemoryPeak:
    """The peak of one measured region.

    Attributes:
        peak_bytes: live tensor bytes at the peak.
        at_peak: those bytes by the plan's part (``params``, ``grads``, ``optimizer``,
            ``activations``) at that moment.
    """

    peak_bytes: int = 0
    at_peak: dict[str, int] = field(default_factory=dict)


@contextmanager
def peak_memory(model: nn.Module, optimizer: Any = None,
                extra: Sequence[torch.Tensor | None] = ()) -> Iterator[MemoryPeak]:
    """Measure the peak of live tensor bytes inside the ``with`` block (see module
    docstring); ``extra``: tensors held outside the model and the optimizer's state (None
    entries are skipped)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    out = MemoryPeak()
    tracker = MemTracker()
    external: list[Any] = [model]
    if optimizer is not None:
        external.append(optimizer)
    external += [t for t in extra if isinstance(t, torch.Tensor)]
    tracker.track_external(*external)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with tracker:
            yield out
    snap = tracker.get_tracker_snapshot("peak")
    for dev_snap in snap.values():
        out.peak_bytes += int(dev_snap.get("Total", 0))
        for kind, value in dev_snap.items():
            part = KINDS.get(str(getattr(kind, "value", kind)))
            if part is not None:
                out.at_peak[part] = out.at_peak.get(part, 0) + int(value)


def compare(measured_bytes: int, predicted: Any) -> dict[str, float]:
    """``measured_bytes`` against a predicted ``RankMemory`` without its allocator margin:
    ``{"measured": …, "predicted": …, "ratio": measured / predicted}``."""
    pred = int(predicted.total - predicted.margin)
    return {"measured_bytes": float(measured_bytes), "predicted_bytes": float(pred),
            "ratio": measured_bytes / pred if pred else float("nan")}
