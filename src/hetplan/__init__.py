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
from hetplan.ir.cluster import ClusterSpec, list_presets
from hetplan.ir.model import GradTensor, LayerIR, ModelIR
from hetplan.ir.plan import Plan, check_plan_matches, load_plan


def __getattr__(name: str) -> object:
    # ``capture`` imports torch (seconds); load it on first use so that the CLI's plan and
    # cluster commands, and plain schema work, stay fast.
    if name == "capture":
        from hetplan.ir.capture import capture

        return capture
    if name in ("compile", "simulate"):
        from hetplan.optimizer import compile as _compile_module

        return getattr(_compile_module, name)
    raise AttributeError(f"module 'hetplan' has no attribute {name!r}")


__all__ = [
    "__version__",
    "capture",
    "compile",
    "simulate",
    "ClusterSpec",
    "list_presets",
    "Plan",
    "load_plan",
    "check_plan_matches",
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
