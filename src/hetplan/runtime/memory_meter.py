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
worker measures the last warm-up step (an extra one after the timed ones without two
warm-up steps).

**Pipelines.** A pipeline rank runs its stage module once per micro-batch before any
backward (1F1B's warm-up, GPipe, interleaved chunks). ``MemTracker`` keeps statistics per
module and refuses a root module's second forward before its backward ("multiple iterative
calls"); :class:`_StageTracker` lets that call through without per-module statistics, which
this meter does not read. The peak of live bytes is counted by the dispatch mode either way,
and each module's gradient hooks (which file its gradients as ``Gradient``) are installed
at its first forward. The tracked modules are then this rank's stages (``modules``), not the
whole model, whose other stages' parameters this rank does not train.
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
        temporaries: of ``activations``, the bytes backward created (gradients of
            activations, and recomputed activations) at that moment; a 1F1B stage's peak
            falls in a backward, and the plan's breakdown has no term for its gradients.
    """

    peak_bytes: int = 0
    at_peak: dict[str, int] = field(default_factory=dict)
    temporaries: int = 0


def _stage_tracker() -> Any:
    """A ``MemTracker`` that lets a root module run its forward again before its backward
    (the next micro-batch of a pipeline stage; see module docstring)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class _StageTracker(MemTracker):
        def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
            try:
                super()._pre_fw_hook(module, inputs)
            except NotImplementedError as e:  # raised before it changes any state
                if "multiple iterative calls" not in str(e):
                    raise

    return _StageTracker()


@contextmanager
def peak_memory(model: nn.Module, optimizer: Any = None,
                extra: Sequence[torch.Tensor | None] = (),
                modules: Sequence[nn.Module] = ()) -> Iterator[MemoryPeak]:
    """Measure the peak of live tensor bytes inside the ``with`` block (see module
    docstring); ``extra``: tensors held outside the model and the optimizer's state (None
    entries are skipped); ``modules``: a pipeline rank's stage modules, tracked instead of
    ``model``."""
    out = MemoryPeak()
    tracker = _stage_tracker()
    external: list[Any] = list(modules) or [model]
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
            name = str(getattr(kind, "value", kind))
            part = KINDS.get(name)
            if part is not None:
                out.at_peak[part] = out.at_peak.get(part, 0) + int(value)
            if name == "Temp":
                out.temporaries += int(value)


def compare(measured_bytes: int, predicted: Any) -> dict[str, float]:
    """``measured_bytes`` against a predicted ``RankMemory`` without its allocator margin:
    ``{"measured": …, "predicted": …, "ratio": measured / predicted}``."""
    pred = int(predicted.total - predicted.margin)
    return {"measured_bytes": float(measured_bytes), "predicted_bytes": float(pred),
            "ratio": measured_bytes / pred if pred else float("nan")}
