"""The inner loop of the heterogeneous pipeline DP (:func:`~.hetero_search.solve_exact`).

Plain Python over numpy arrays, compiled with ``numba.njit(cache=True)`` when numba is
available and ``HETPLAN_JIT`` is not ``0`` (:func:`kernel`); otherwise the same function
runs uncompiled (same results, about a hundred times slower). The numpy version this
replaces spent 19 of GPT-2's 22 s on mixed-generations in per-(option, range, depth) numpy
calls over arrays of a few hundred states (cProfile, this 2-core machine).

Data layout: the stages the DP may place are *arcs* ``n`` (option ``arc_o[n]`` over layers
``[arc_i[n], arc_j[n])``) sorted by first layer descending, then option, then end layer
(the order of the numpy version, so ties resolve identically). ``arc_a[n, q]``,
``arc_v[n, q]`` and ``arc_mode[n, q]`` are the stage's ``a``, ``v`` and recomputation mode
when ``min(Q - 1, q)`` stages follow it (``inf`` / ``-1`` where no mode fits). Only arcs
whose both ends are allowed cuts come in (``HeteroProblem.cuttable``, filtered by
:func:`~.hetero_search._arcs`), so the kernel needs no mask of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from hetplan.algorithms._jit_env import jit_switched_off

__all__ = ["dp_pass", "kernel"]

_COMPILED: list[Callable[..., None]] = []


def dp_pass(arc_o: np.ndarray, arc_i: np.ndarray, arc_j: np.ndarray, arc_a: np.ndarray,
            arc_v: np.ndarray, arc_mode: np.ndarray, opt_class: np.ndarray,
            opt_step: np.ndarray, shape: np.ndarray, strides: np.ndarray, tau: float,
            num_layers: int, cap_stages: bool, best: np.ndarray, back: np.ndarray) -> None:
    """One DP pass at threshold ``tau`` (every stage ``v <= tau``), filling ``best`` and
    ``back`` in place.

    ``best[i, q, u]``: least ``sum a`` of stages covering ``[i, L)``, ``min(count, Q)`` =
    ``q + 1`` in number, using the device vector of flat index ``u`` (in units, class ``c``
    at stride ``strides[c]``, ``shape[c]`` values). ``back[i, :, q, u]``: (option, mode, end
    layer, suffix q, suffix u) of its first stage. ``cap_stages``: ``Q`` is the micro-batch
    count and a pipeline has at most that many stages (no stage goes before a suffix of
    index ``Q - 1``); otherwise suffixes of ``Q`` or more stages share index ``Q - 1``."""
    L = num_layers
    Q = best.shape[1]
    size = best.shape[2]
    best[:] = np.inf  # back[] is read only where best[] is finite, so it is not cleared
    alive = np.zeros((L + 1, Q), np.bool_)  # [i, q]: some best[i, q, :] is finite
    for n in range(arc_o.shape[0]):
        o = arc_o[n]
        i = arc_i[n]
        j = arc_j[n]
        c = opt_class[o]
        step = opt_step[o]
        if step >= shape[c]:
            continue
        stride = strides[c]
        shift = step * stride
        if j == L:  # the last stage: only its own devices
            if arc_v[n, 0] <= tau and arc_a[n, 0] < best[i, 0, shift]:
                best[i, 0, shift] = arc_a[n, 0]
                alive[i, 0] = True
                back[i, 0, 0, shift] = o
                back[i, 1, 0, shift] = arc_mode[n, 0]
                back[i, 2, 0, shift] = j
                back[i, 3, 0, shift] = -1
                back[i, 4, 0, shift] = -1
            continue
        limit = shape[c] - step
        block = shape[c] * stride  # the flat span of one value of the higher digits
        for q in range(Q):
            if cap_stages and q + 1 >= Q:
                break
            if not alive[j, q]:
                continue
            qq = min(q + 1, Q - 1)
            av = arc_a[n, qq]
            if not (arc_v[n, qq] <= tau) or not (av < np.inf):
                continue
            mode = arc_mode[n, qq]
            # the suffix vectors u whose class-c digit leaves room for this stage:
            # u = hi * block + d * stride + lo with d < limit (no division per state)
            for hi in range(0, size, block):
                for d in range(limit):
                    base = hi + d * stride
                    for u in range(base, base + stride):
                        s = best[j, q, u]
                        if s == np.inf:
                            continue
                        cand = s + av
                        w = u + shift
                        if cand < best[i, qq, w]:
                            best[i, qq, w] = cand
                            back[i, 0, qq, w] = o
                            back[i, 1, qq, w] = mode
                            back[i, 2, qq, w] = j
                            back[i, 3, qq, w] = q
                            back[i, 4, qq, w] = u
                            alive[i, qq] = True


def kernel() -> Callable[..., Any]:
    """:func:`dp_pass`, compiled with numba when it can be (``HETPLAN_JIT=0``: never)."""
    if jit_switched_off():
        return dp_pass
    if not _COMPILED:
        try:
            import numba

            _COMPILED.append(numba.njit(cache=True)(dp_pass))
        except Exception:  # numba missing or no cache dir: the plain function, same results
            _COMPILED.append(dp_pass)
    return _COMPILED[0]
