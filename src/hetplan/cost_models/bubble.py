"""Bubble ratios beside the simulated one: the balanced-stage bubble and the seed's Eq. (1).

The simulator's bubble of the plan's stages (``Evaluation.bubble_ratio``) includes both the
schedule's inherent bubble and the bubble unbalanced stages add (the seed's red bubbles).
:func:`bubble_ratios` separates them: the same schedule simulated with every stage at the
mean stage time gives the inherent part, and Eq. (1) gives the seed's closed form (Chimera,
``B = P``). ``T_C = 0`` in Eq. (1): the simulator puts transfers on links, so only their
exposed part shows — and it does so in the simulated bubble. O(P · M) for the simulation.
"""

from __future__ import annotations

from hetplan.cost_models.evaluate import Evaluation
from hetplan.cost_models.pipeline import bubble_ratio_eq1, simulate_pipeline
from hetplan.ir.plan_sections import Layout

__all__ = ["bubble_ratios"]


def bubble_ratios(ev: Evaluation, layout: Layout) -> tuple[float | None, float | None]:
    """(balanced-stage simulated bubble, Eq. (1)) for a pipeline; (None, None) without one.
    Interleaved chunks count per pipeline rank (a rank's time is the sum of its chunks')."""
    p = layout.pp if layout.virtual_stages > 1 else len(ev.stages)
    if p < 2:
        return None, None
    t_f = sum(s.fwd_s for s in ev.stages) / p * 1e3
    t_b = sum(s.bwd_s for s in ev.stages) / p * 1e3
    balanced = simulate_pipeline([t_f] * p, [t_b] * p, layout.micro_batches, layout.schedule,
                                 virtual_stages=layout.virtual_stages).bubble_ratio
    eq1 = bubble_ratio_eq1(p, t_f, t_b, 0.0) if t_f + t_b > 0 else 0.0
    return min(max(balanced, 0.0), 1.0), min(max(float(eq1), 0.0), 1.0)
