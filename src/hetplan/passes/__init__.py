"""Optimization passes: one file per pass, each owning the plan sections it declares.

Adding a pass: ``passes/<name>.py`` with a frozen dataclass that has ``name``, ``sections``
(the plan fields it writes; the manager enforces them), ``refines`` and ``run``; one entry in
:func:`get_all_passes`; and tests. A test checks every key equals its pass's name. Its options
are its dataclass fields, spelled in a pipeline spec as ``name{option=value}``
(:mod:`hetplan.passes.spec`).
"""

from __future__ import annotations

__all__ = ["get_all_passes", "BASELINE_PASSES", "BASELINE_PIPELINE", "DEFAULT_PASSES",
           "DEFAULT_PIPELINE"]

#: The pipeline ``compile`` runs by default: balanced pipeline stages (``dynpipe``;
#: ``uniform-stages`` stays the baseline), then the baseline TP and buckets, then
#: ``espresso`` (per-tensor gradient-sync options), then ``cupcake-fusion`` (optimal buckets
#: of consecutive tensors sharing a strategy; never predicted slower than its input), then
#: ``tp-resizing`` (TP shards by device speed, resizing controller settings; last, so its
#: predicted effect uses the final gradient sync).
DEFAULT_PIPELINE = "dynpipe,even-tp,ddp-buckets,espresso,cupcake-fusion,tp-resizing"
DEFAULT_PASSES: tuple[str, ...] = tuple(DEFAULT_PIPELINE.split(","))

#: The baselines every optimizing pass must beat, in pipeline order.
BASELINE_PIPELINE = "uniform-stages,even-tp,ddp-buckets"
BASELINE_PASSES: tuple[str, ...] = tuple(BASELINE_PIPELINE.split(","))


def get_all_passes() -> dict[str, type]:
    """Registry: pass name → pass class (imported lazily)."""
    from hetplan.passes.cupcake import CupcakeFusion
    from hetplan.passes.ddp_buckets import DDPBuckets
    from hetplan.passes.dynpipe import DynPipe
    from hetplan.passes.espresso import Espresso
    from hetplan.passes.espresso_reference import EspressoReference
    from hetplan.passes.gemini import Gemini
    from hetplan.passes.even_tp import EvenTP
    from hetplan.passes.sdpipe import SDPipe
    from hetplan.passes.tp_resizing import TPResizing
    from hetplan.passes.uniform_stages import UniformStages
    from hetplan.passes.zen import Zen

    return {cls.name: cls for cls in (UniformStages, EvenTP, DDPBuckets, DynPipe, Espresso,
                                      CupcakeFusion, TPResizing, Zen, Gemini, SDPipe,
                                      EspressoReference)}
