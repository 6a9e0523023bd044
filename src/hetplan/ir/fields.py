"""Strict, bounded number types for every field a user can type (cluster specs, plans).

Pydantic's default ("lax") mode reads ``count: true`` as 1 and ``count: "8"`` as 8, and puts
no ceiling on a number: ``count: 1000000000`` devices is accepted and then makes every
O(devices) step hang. The types here refuse booleans and strings where a number is meant,
and carry an upper bound, so a file is rejected at once with the field named instead.

The ceilings are far above any real value and low enough that the arithmetic downstream
(float64 sums of byte counts and times, numpy int64 arrays) stays exact and finite:

- :data:`MAX_COUNT` (2**53) for counts, bytes and FLOPs: exact as a float64, and a sum of
  a thousand of them still fits an int64;
- :data:`MAX_MS` (1e15 ms, about 31,000 years) for times.

The cluster spec bounds its own fields more tightly (devices, nodes, bandwidths: see
:mod:`hetplan.ir.cluster`).

Adding these validators does not change the JSON Schema except for the ``maximum`` of the
bounded fields.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BeforeValidator, Field

__all__ = [
    "MAX_COUNT",
    "MAX_MS",
    "strict_int",
    "strict_float",
    "Int",
    "Float",
    "NonNegInt",
    "PosInt",
    "NonNegFloat",
    "FiniteFloat",
]

#: Upper bound of every count, byte size and FLOP count in a plan (exact as a float64).
MAX_COUNT = 2**53
#: Upper bound of every time in milliseconds in a plan.
MAX_MS = 1e15


def _is_bool(value: Any) -> bool:
    """A Python or a NumPy boolean (``numpy.bool_`` is no ``bool``, and pydantic reads it as
    an integer)."""
    return isinstance(value, bool) or (type(value).__module__ == "numpy"
                                       and type(value).__name__ in ("bool_", "bool"))


def _kind(value: Any) -> str:
    if _is_bool(value):
        return "a boolean"
    if isinstance(value, (str, bytes)):
        return "a string"
    return type(value).__name__


#: A number in exponent form that YAML 1.1 (PyYAML) reads as text: it reads one as a number
#: only with a decimal point and a signed exponent (``1.0e+3``; ``1e3`` and ``1.0e3`` are text).
_YAML_TEXT_EXPONENT = re.compile(r"^([+-]?[0-9][0-9_]*)(\.[0-9_]*)?([eE])([+-]?)([0-9]+)$")


def _yaml_hint(value: Any) -> str:
    """How to write ``value`` so that YAML reads a number (empty: not that case)."""
    m = _YAML_TEXT_EXPONENT.match(value) if isinstance(value, str) else None
    if m is None:
        return ""
    spelled = f"{m.group(1)}{m.group(2) or '.0'}{m.group(3)}{m.group(4) or '+'}{m.group(5)}"
    if spelled == value:  # a quoted string YAML would read as a number unquoted
        return ""
    return (" (YAML reads an exponent as a number only with a decimal point and a signed "
            f"exponent: write {spelled})")


def strict_int(value: Any) -> Any:
    """Refuse a boolean or a string where an integer is meant (pydantic would read ``true``
    as 1 and ``"8"`` as 8); everything else is left to pydantic's own integer check."""
    if _is_bool(value) or isinstance(value, (str, bytes)):
        raise ValueError(f"expected an integer, got {_kind(value)} {value!r}{_yaml_hint(value)}")
    return value


def strict_float(value: Any) -> Any:
    """Refuse a boolean or a string where a number is meant (see :func:`strict_int`); a
    string such as ``'1e3'`` (YAML 1.1 reads an exponent without a point as text) gets the
    spelling YAML reads as a number."""
    if _is_bool(value) or isinstance(value, (str, bytes)):
        raise ValueError(f"expected a number, got {_kind(value)} {value!r}{_yaml_hint(value)}")
    return value


#: An integer that is not a boolean or a string (no bounds).
Int = Annotated[int, BeforeValidator(strict_int)]
#: A float (an integer is accepted) that is not a boolean or a string (no bounds).
Float = Annotated[float, BeforeValidator(strict_float)]
NonNegInt = Annotated[int, Field(ge=0, le=MAX_COUNT), BeforeValidator(strict_int)]
PosInt = Annotated[int, Field(ge=1, le=MAX_COUNT), BeforeValidator(strict_int)]
FiniteFloat = Annotated[float, Field(ge=-MAX_MS, le=MAX_MS, allow_inf_nan=False),
                        BeforeValidator(strict_float)]
NonNegFloat = Annotated[float, Field(ge=0, le=MAX_MS, allow_inf_nan=False),
                        BeforeValidator(strict_float)]
