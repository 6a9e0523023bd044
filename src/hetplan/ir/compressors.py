"""The gradient compressors a plan may name, and their default parameters.

A plan's ``CompressedSync.compressor`` is one of :data:`COMPRESSORS`; its ``params`` default
to the values here. Both the cost model (:mod:`hetplan.cost_models.compression`: wire ratios
and (de)compression times) and the runtime (:mod:`hetplan.runtime.compressors`: the
implementations) read this one table, so the names and defaults they agree on live below
both of them.
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["COMPRESSORS", "DEFAULT_POWERSGD_RANK", "DEFAULT_QSGD_LEVELS",
           "DEFAULT_SPARSITY_RATIO", "Compressor"]

Compressor = Literal[
    "fp16", "bf16", "topk", "randomk", "dgc", "efsignsgd", "qsgd", "onebit", "powersgd"
]
#: Every compressor name, in a fixed order.
COMPRESSORS: tuple[str, ...] = get_args(Compressor)

#: Fraction of the elements the sparsifiers (``topk``, ``randomk``, ``dgc``) keep.
DEFAULT_SPARSITY_RATIO = 0.01
#: Quantization levels ``s`` of ``qsgd`` (8 bits on the wire with the sign).
DEFAULT_QSGD_LEVELS = 127
#: Rank ``r`` of ``powersgd``'s low-rank factors.
DEFAULT_POWERSGD_RANK = 4
