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
    if name == "compile":
        from hetplan.optimizer.compile import compile

        return compile
    if name == "simulate":
        from hetplan.cost_models.predict import simulate

        return simulate
    if name == "CompileOptions":
        from hetplan.optimizer.options import CompileOptions

        return CompileOptions
    raise AttributeError(f"module 'hetplan' has no attribute {name!r}")


__all__ = [
    "__version__",
    "capture",
    "compile",
    "simulate",
    "CompileOptions",
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
