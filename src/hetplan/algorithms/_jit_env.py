"""``HETPLAN_JIT``: whether the search kernels are compiled with numba (the default) or run as
plain Python (``0``), read at each use by :mod:`~hetplan.algorithms.dp_session`,
:mod:`~hetplan.algorithms._pipeline_kernel` and :mod:`~hetplan.algorithms._hetero_kernels`.
The usual spellings of a switch are taken (``0``/``1``, ``false``/``true``, ``no``/``yes``,
``off``/``on``); anything else is refused rather than read as "on"."""

from __future__ import annotations

import os

from hetplan.errors import SpecError

__all__ = ["JIT_ENV", "jit_switched_off"]

JIT_ENV = "HETPLAN_JIT"
_OFF = ("0", "false", "no", "off")
_ON = ("", "1", "true", "yes", "on")


def jit_switched_off() -> bool:
    """Whether ``HETPLAN_JIT`` turns the compiled kernels off.

    Raises:
        SpecError: a value that is no switch (``HETPLAN_JIT=fast``), with the ones there are.
    """
    raw = os.environ.get(JIT_ENV, "").strip().lower()
    if raw in _OFF:
        return True
    if raw in _ON:
        return False
    raise SpecError(f"{JIT_ENV}={os.environ[JIT_ENV]!r}: use {JIT_ENV}=0 to run the search "
                    "kernels uncompiled, or 1 (the default) to compile them with numba")
