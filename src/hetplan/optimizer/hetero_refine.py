"""CP-SAT refinement of a coarse heterogeneous plan (large clusters).

Where the exact DP's device-use space is too large (512 GPUs of three types), the DP runs
with stages that use multiples of a device unit (:func:`~hetplan.cost_models.hetero.
coarse_units`, 32 GPUs on ``mixed-512``). :func:`refine_stages` re-solves a neighbourhood
of its plan with CP-SAT (:func:`~hetplan.algorithms.hetero_cpsat.solve_cpsat`) at
one-device resolution:

1. the search tables at unit 1 (:func:`~hetplan.cost_models.hetero.build_problem`, the
   same per-option tables the DP used, with every ``(dp, tp)`` the cost model allows);
2. the coarse plan mapped onto them as the warm start (same class, degrees, mode, layers);
3. the neighbourhood: as many stages, each of any option, each boundary within ``window``
   layers of the coarse plan's (:func:`~hetplan.algorithms.hetero_cpsat.window_arcs`);
4. CP-SAT with one worker and a deterministic limit (reproducible plans).

The caller (:func:`hetplan.optimizer.hetero.search_hetero`) re-predicts the result with the
simulator and keeps the faster plan; the CP-SAT status, bound and gap (within the
neighbourhood) go into the plan either way (:class:`~hetplan.ir.plan_cpsat.CpSatRecord`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from hetplan.algorithms.hetero_cpsat import CpSatResult, solve_cpsat, window_arcs
from hetplan.algorithms.hetero_search import StageChoice, objective
from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.hetero import DeviceClass, OptionInfo, build_problem
from hetplan.ir.plan_cpsat import CpSatRecord
from hetplan.ir.plan_sections import WorkloadSummary

__all__ = ["Refinement", "refine_stages", "WINDOW", "DETERMINISTIC_LIMIT"]

#: Layers each stage boundary of the coarse plan may move. 1: on mixed-512 (batch 1024) both
#: bench models are proven optimal in their neighbourhood within 0.01-0.03 deterministic
#: units; windows of 2 and 3 layers around 8- and 10-stage plans (10-25 k booleans) found no
#: solution within 2 units (with presolve probing, since turned off).
WINDOW = 1
#: CP-SAT's ``max_deterministic_time``: the solves above need at most 0.03; a unit took
#: 3-9 s of wall time on the shared 2-core development machine (load 9-20), so the limit
#: bounds CP-SAT's share of the 5-s search budget to about a second there.
DETERMINISTIC_LIMIT = 0.1


@dataclass(frozen=True)
class Refinement:
    """A CP-SAT solve around a coarse plan: its result and the options its stage indices
    refer to."""

    result: CpSatResult
    infos: tuple[OptionInfo, ...]
    record: CpSatRecord


def refine_stages(workload: WorkloadSummary, costs: CostModel,
                  classes: Sequence[DeviceClass], micro_batch: int, micro_batches: int,
                  stages: Sequence[tuple[OptionInfo, StageChoice]], *, max_tp: int = 8,
                  window: int = WINDOW, limit: float = DETERMINISTIC_LIMIT
                  ) -> Refinement | None:
    """CP-SAT over the neighbourhood of ``stages`` (each the coarse plan's option and
    stage) at one-device resolution (see the module docstring); None when the coarse plan
    has no counterpart at unit 1 (it always has: the unit-1 options are a superset of the
    coarse ones, with the same tables)."""
    problem, infos = build_problem(workload, costs, classes, micro_batch, micro_batches,
                                   max_tp=max_tp)
    index = {(o.device_class, o.dp, o.tp): k for k, o in enumerate(infos)}
    hint = []
    for info, s in stages:
        k = index.get((info.device_class, info.dp, info.tp))
        if k is None:
            return None
        hint.append(StageChoice(k, s.mode, s.first, s.end))
    if not math.isfinite(objective(problem, tuple(hint))):
        return None
    slots, arcs = window_arcs(problem, hint, window)
    res = solve_cpsat(problem, hint=hint, max_slots=slots, arcs=arcs,
                      deterministic_limit=limit)
    found = bool(res.stages)
    record = CpSatRecord(
        status=res.status,  # type: ignore[arg-type]
        objective_ms=(res.objective if found else res.hint_objective) * 1e3,
        bound_ms=min(res.bound, res.hint_objective) * 1e3 if found else 0.0,
        gap=res.gap if found else 1.0, hint_objective_ms=res.hint_objective * 1e3,
        window=window, slots=slots, booleans=res.booleans, deterministic_limit=limit,
        deterministic_time=round(res.deterministic_time, 6))
    return Refinement(res, tuple(infos), record)
