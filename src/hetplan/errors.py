"""The exception hierarchy of hetplan.

Every error a user can cause derives from :class:`HetplanError`. Messages follow one shape:
what was wrong, where (file, field path, module qualname), what was expected, and how to fix
it. The CLI prints ``str(err)`` without a traceback and exits with code 2.
"""

from __future__ import annotations

__all__ = [
    "HetplanError",
    "SpecError",
    "TraceError",
    "PassError",
    "InfeasiblePlanError",
    "OutOfMemoryError",
    "MissingProfileError",
    "PlanVersionError",
    "PlanMismatchError",
]


class HetplanError(Exception):
    """Base class of every error hetplan raises on bad input or an impossible request."""


class SpecError(HetplanError, ValueError):
    """A cluster spec, plan, workload or profile file is malformed or inconsistent."""


class TraceError(HetplanError):
    """A model could not be captured into the IR.

    Attributes:
        module: qualified name of the module where capture failed ("" for the root).
        reason: the underlying failure, in one line.
    """

    def __init__(self, message: str, *, module: str = "", reason: str = "") -> None:
        super().__init__(message)
        self.module = module
        self.reason = reason


class PassError(HetplanError):
    """An optimization pass failed; the message names the pass and the passes before it."""


class InfeasiblePlanError(HetplanError):
    """No plan satisfies the constraints; the message states the binding one in numbers."""


class OutOfMemoryError(InfeasiblePlanError):
    """A rank of the plan needs more memory than its device has (the message gives the
    rank's breakdown); the layout search tells it apart from structural refusals."""


class MissingProfileError(HetplanError):
    """A profiled cost was required (strict mode) but the profile DB has no entry for it."""


class PlanVersionError(SpecError):
    """A plan (or profile DB) was written with a schema version this hetplan does not read."""


class PlanMismatchError(HetplanError):
    """A plan does not belong to the model or cluster it is used with (fingerprint mismatch)."""
