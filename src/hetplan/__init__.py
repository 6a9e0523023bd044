"""hetplan: a compiler for distributed training strategies on imperfect clusters.

The public API (see README):

- :func:`capture` — an ``nn.Module`` (on any device, ``meta`` included) → :class:`ModelIR`.
- :class:`ClusterSpec` — the cluster, from YAML/JSON or a preset.
- :class:`Plan`, :func:`load_plan` — the versioned execution plan.
"""

from __future__ import annotations

from hetplan._version import __version__
from hetplan.errors import (
    HetplanError,
    InfeasiblePlanError,
    MissingProfileError,
    PassError,
    PlanMismatchError,
    PlanVersionError,
    SpecError,
    TraceError,
)
from hetplan.ir.capture import capture
from hetplan.ir.model import GradTensor, LayerIR, ModelIR

__all__ = [
    "__version__",
    "capture",
    "ModelIR",
    "LayerIR",
    "GradTensor",
    "HetplanError",
    "SpecError",
    "TraceError",
    "PassError",
    "InfeasiblePlanError",
    "MissingProfileError",
    "PlanVersionError",
    "PlanMismatchError",
]
