"""The CP-SAT record of a heterogeneous search (``hetero.search.cpsat``).

On large clusters the exact DP runs in a coarser space (stages use multiples of a device
unit, :mod:`hetplan.optimizer.hetero`); CP-SAT (:mod:`hetplan.algorithms.hetero_cpsat`)
then re-solves a neighbourhood of the coarse plan at one-device resolution, warm-started
from it. This record says what that solve covered and proved, whether or not its plan was
taken. Everything here is reproducible (no wall-clock time: the limit and the work spent
are CP-SAT's deterministic units), so plan JSON stays byte-identical.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from hetplan.ir.plan_sections import Ms, NonNegInt, PosInt, _Section

__all__ = ["CpSatRecord"]


class CpSatRecord(_Section):
    """One CP-SAT solve of the heterogeneous search.

    Attributes:
        status: CP-SAT's status: ``OPTIMAL`` (proven optimal in its neighbourhood),
            ``FEASIBLE`` (stopped by the limit), ``UNKNOWN`` (no solution within the limit:
            the warm start stands) or ``INFEASIBLE``.
        objective_ms: the search objective of its best stages (its warm start's when it
            found none).
        bound_ms: the lower bound it proved on the objective *within its neighbourhood*.
        gap: ``(objective - bound) / objective`` within the neighbourhood (0: optimal there).
        hint_objective_ms: the objective of the warm start (the coarse DP's plan, at
            one-device resolution).
        window: layers each stage boundary of the warm start may move.
        slots: pipeline stages the model had room for (the warm start's count).
        booleans: arc booleans in the model.
        deterministic_limit / deterministic_time: CP-SAT's work limit and work spent (its
            reproducible time units).
        taken: its plan was re-predicted faster than the coarse DP's and is the plan's.
        predicted_ms: the simulator's time of its plan (0: not predicted or did not fit).
    """

    status: Literal["OPTIMAL", "FEASIBLE", "UNKNOWN", "INFEASIBLE", "MODEL_INVALID"]
    objective_ms: Ms = 0.0
    bound_ms: Ms = 0.0
    gap: float = Field(default=0.0, ge=0.0, le=1.0)
    hint_objective_ms: Ms = 0.0
    window: NonNegInt = 0
    slots: PosInt = 1
    booleans: NonNegInt = 0
    deterministic_limit: float = Field(default=0.0, ge=0.0)
    deterministic_time: float = Field(default=0.0, ge=0.0)
    taken: bool = False
    predicted_ms: Ms = 0.0
