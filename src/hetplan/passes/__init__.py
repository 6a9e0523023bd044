"""Optimization passes: one file per pass, each owning one section of the plan.

Adding a pass: ``passes/<name>.py`` with a frozen dataclass that has ``name`` and ``section``,
one entry in :func:`get_all_passes`, and tests. A test checks every key equals its pass's name.
"""

from __future__ import annotations

__all__ = ["get_all_passes", "BASELINE_PASSES"]

#: The baselines every optimizing pass must beat, in pipeline order.
BASELINE_PASSES = ("uniform-stages", "even-tp", "ddp-buckets")


def get_all_passes() -> dict[str, type]:
    """Registry: pass name → pass class (imported lazily)."""
    from hetplan.passes.cupcake import CupcakeFusion
    from hetplan.passes.ddp_buckets import DDPBuckets
    from hetplan.passes.dynpipe import DynPipe
    from hetplan.passes.espresso import Espresso
    from hetplan.passes.even_tp import EvenTP
    from hetplan.passes.tp_resizing import TPResizing
    from hetplan.passes.uniform_stages import UniformStages

    return {cls.name: cls for cls in (UniformStages, EvenTP, DDPBuckets, DynPipe, Espresso,
                                              CupcakeFusion, TPResizing)}
