"""The gradient compressors a plan may name, and their default parameters.

A plan's ``CompressedSync.compressor`` is one of :data:`COMPRESSORS`; its ``params`` are
those :data:`PARAMS` lists for it (checked by :func:`compressor_problems` when a plan is
validated) and default to the values here. Both the cost model (:mod:`hetplan.cost_models.compression`: wire ratios
and (de)compression times) and the runtime (:mod:`hetplan.runtime.compressors`: the
implementations) read this one table, so the names and defaults they agree on live below
both of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, get_args

from hetplan.ir.validation import did_you_mean

__all__ = ["COMPRESSORS", "DEFAULT_POWERSGD_RANK", "DEFAULT_QSGD_LEVELS",
           "DEFAULT_SPARSITY_RATIO", "PARAMS", "Compressor", "Param", "compressor_problems"]

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


@dataclass(frozen=True)
class Param:
    """One compressor parameter a plan may set: its type and its closed or half-open range."""

    kind: type  # int or float
    low: float
    high: float
    low_open: bool = False

    def problem(self, value: object) -> str | None:
        """Why ``value`` is not allowed (None: it is)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"expected {'an integer' if self.kind is int else 'a number'}, got {value!r}"
        if self.kind is int and not isinstance(value, int):
            return f"expected an integer, got {value!r}"
        low_ok = value > self.low if self.low_open else value >= self.low
        if not (low_ok and value <= self.high):
            left = "(" if self.low_open else "["
            return f"must be in {left}{self.low:g}, {self.high:g}], got {value!r}"
        return None


_FRACTION = Param(float, 0.0, 1.0, low_open=True)

#: The parameters each compressor takes (the runtime's constructors take exactly these).
PARAMS: dict[str, dict[str, Param]] = {
    "fp16": {}, "bf16": {},
    "topk": {"ratio": _FRACTION}, "randomk": {"ratio": _FRACTION},
    "dgc": {"ratio": _FRACTION, "sample_fraction": _FRACTION},
    "efsignsgd": {}, "onebit": {},
    "qsgd": {"levels": Param(int, 1, 127)},  # int8 on the wire with the sign
    "powersgd": {"rank": Param(int, 1, 2**16)},
}


def compressor_problems(name: str, params: Mapping[str, object]) -> list[str]:
    """Why compressor ``name`` with ``params`` is not one a plan may name (empty: it is).

    Each problem is one line: an unknown name (with the nearest known one), a parameter the
    compressor does not take (with those it does), or a value of the wrong type or range.
    """
    if name not in PARAMS:
        return [f"unknown compressor {name!r}{did_you_mean(name, COMPRESSORS)} (known: "
                f"{', '.join(COMPRESSORS)})"]
    allowed = PARAMS[name]
    out = []
    for key, value in sorted(params.items()):
        spec = allowed.get(key)
        if spec is None:
            takes = ", ".join(allowed) or "no parameters"
            out.append(f"params.{key}: compressor {name!r} takes {takes}"
                       f"{did_you_mean(key, list(allowed))}")
        elif (why := spec.problem(value)) is not None:
            out.append(f"params.{key}: {name} {key} {why}")
    return out
