"""The pipeline replay's event loop (:func:`hetplan.cost_models.pipeline.simulate_named`),
over numpy arrays, compiled with ``numba.njit(cache=True)`` for large schedules.

The loop is the one of ``cost_models.pipeline._simulate``, action for action and operation
for operation (so the same float64 results, bit for bit; ``tests/unit/test_pipeline_kernel.py``
compares the two on every schedule): each rank runs its list in order until an action waits
for one not yet timed, and is put back on the stack, in the order it began waiting, when
that action ends. Where the Python loop keeps ``end`` as ``None`` for "not yet", the kernel
keeps -1 (every time is >= 0); where it keeps a dict of lists of waiting ranks, the kernel
keeps one queue per action as linked ranks (a rank waits for one action at a time). The
numbers are the same; their types only where the Python loop keeps the int 0 a rank starts
at (its first action's start): the kernel's is 0.0.

Why: a 1T-parameter GPT's search replays 150 schedules of 32-48 stages and 128-384
micro-batches, up to 37,000 actions each; the Python loop took 2.5 s of its 20 s (17 ms a
schedule), the kernel well under a millisecond each. numba's import (about 0.25 s here) is
paid only when a schedule is large enough (:data:`MIN_ACTIONS`), so the demo's small
pipelines never import it. ``HETPLAN_JIT=0``, or numba missing or unable to cache, leaves
the Python loop in use (:func:`kernel` returns None).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from hetplan.algorithms._jit_env import jit_switched_off

__all__ = ["JIT_AFTER_ACTIONS", "MIN_ACTIONS", "kernel", "kernel_for", "replay", "warm_up"]

#: Schedules with fewer actions (``2 * M * S``) are always replayed by the Python loop (at
#: ~0.5 µs an action, about 2 ms for this many).
MIN_ACTIONS = 4096
#: Actions of large schedules the Python loop replays before the kernel is loaded: about
#: as long as loading it takes.
JIT_AFTER_ACTIONS = 400_000

_COMPILED: list[Callable[..., int] | None] = []
_PYTHON_ACTIONS = [0]  # actions of large schedules the Python loop has replayed so far


def replay(
    codes: np.ndarray, row_start: np.ndarray, n: int, s_total: int, per_stage: bool,
    dur_f: np.ndarray, dur_b: np.ndarray, hop_f: np.ndarray, hop_b: np.ndarray,
    end: np.ndarray, pos: np.ndarray, free: np.ndarray, busy: np.ndarray,
    rank_bwd: np.ndarray, stage_bwd: np.ndarray,
    done_start: np.ndarray, done_rank: np.ndarray, done_code: np.ndarray,
    done_end: np.ndarray,
) -> int:
    """Replay the action lists; returns how many actions ran (``len(codes)`` unless stuck).

    Args:
        codes: every rank's action codes (``Schedule.index``), rank after rank.
        row_start: ``P + 1`` offsets: rank ``r``'s codes are ``codes[row_start[r]:
            row_start[r + 1]]``.
        n: ``M * S``, the first backward code.
        s_total: ``S``.
        per_stage: durations per virtual stage (else per rank).
        dur_f, dur_b: forward / backward time per rank or per stage.
        hop_f, hop_b: per ``m * S + s``, the transfer time into that stage.
        end: ``2 n`` floats set to -1 (written: each action's end).
        pos, free, busy, rank_bwd: per rank, zeros (written: the next action's index in the
            rank's list, its free time, its busy time, its last backward's end).
        stage_bwd: per virtual stage, zeros (written: its last backward's end).
        done_start, done_rank, done_code, done_end: ``len(codes)`` entries (written: the
            actions in the order they were timed).
    """
    p = row_start.shape[0] - 1
    wait_head = np.full(2 * n, -1, np.int64)
    wait_tail = np.full(2 * n, -1, np.int64)
    wait_next = np.full(p, -1, np.int64)
    stack = np.empty(p, np.int64)
    top = 0
    for r in range(p - 1, -1, -1):
        stack[top] = r
        top += 1
    count = 0
    while top > 0:
        top -= 1
        r = stack[top]
        k = pos[r]
        t_free = free[r]
        stop = row_start[r + 1] - row_start[r]
        while k < stop:
            code = codes[row_start[r] + k]
            waits = -1
            if code < n:  # F(m, s) waits for F(m, s-1) + activation transfer
                d = dur_f[code % s_total] if per_stage else dur_f[r]
                dep = code - 1
                hop = hop_f[code]
                start = t_free
                if code % s_total == 0:
                    dep = -1
            else:  # B(m, s) waits for F(m, s) and B(m, s+1) + gradient transfer
                i = code - n
                t = end[i]
                if t < 0:
                    waits = i
                d = dur_b[i % s_total] if per_stage else dur_b[r]
                dep = code + 1
                hop = hop_b[i]
                start = max(t, t_free)
                if (i + 1) % s_total == 0:
                    dep = -1
            if waits < 0 and dep >= 0:
                t = end[dep]
                if t < 0:
                    waits = dep
                else:
                    start = max(start, t + hop)
            if waits >= 0:
                wait_next[r] = -1
                if wait_head[waits] < 0:
                    wait_head[waits] = r
                else:
                    wait_next[wait_tail[waits]] = r
                wait_tail[waits] = r
                break
            t_free = start + d
            end[code] = t_free
            busy[r] += d
            if code >= n:
                rank_bwd[r] = max(rank_bwd[r], t_free)
                s = (code - n) % s_total
                stage_bwd[s] = max(stage_bwd[s], t_free)
            done_start[count] = start
            done_rank[count] = r
            done_code[count] = code
            done_end[count] = t_free
            count += 1
            k += 1
            w = wait_head[code]
            while w >= 0:
                stack[top] = w
                top += 1
                w = wait_next[w]
            wait_head[code] = -1
            wait_tail[code] = -1
        pos[r] = k
        free[r] = t_free
    return count


def kernel() -> Callable[..., int] | None:
    """:func:`replay` compiled with numba, or None when it is not to be used or cannot be
    (``HETPLAN_JIT=0``, read at each call as :func:`~.dp_session.jit_enabled` does; numba
    missing; no cache directory; a compiler error, logged once as a warning): the caller
    then runs its Python loop, with the same results. numba compiles at a function's first
    call, so this runs it once on a small schedule here, where a failure is caught, not in
    the middle of a search."""
    if jit_switched_off():
        return None
    if not _COMPILED:
        compiled: Callable[..., int] | None = None
        try:
            import numba
        except ImportError:  # the DP kernels' warning says so already
            numba = None
        if numba is not None:
            try:
                compiled = numba.njit(cache=True)(replay)
                if _run(compiled, *_SMALL) != 8:  # pragma: no cover - a miscompiled kernel
                    raise RuntimeError("the compiled replay ran a 1F1B of 8 actions wrongly")
            except Exception as e:  # noqa: BLE001 - the Python loop then, same results
                compiled = None
                logging.getLogger("hetplan").warning(
                    "the pipeline replay could not be compiled (%s: %s); large pipeline "
                    "schedules are replayed in Python (same results, slower)",
                    type(e).__name__, e)
        _COMPILED.append(compiled)
    return _COMPILED[0]


def kernel_for(actions: int) -> Callable[..., int] | None:
    """The kernel for a schedule of ``actions`` (at least :data:`MIN_ACTIONS`), or None: the
    caller replays it in Python, which this counts, until :data:`JIT_AFTER_ACTIONS` such
    actions have been; then (or when the kernel is loaded already) :func:`kernel`."""
    if not _COMPILED and _PYTHON_ACTIONS[0] < JIT_AFTER_ACTIONS:
        _PYTHON_ACTIONS[0] += actions
        return None
    return kernel()


def warm_up() -> bool:
    """Compile :func:`replay` (or load it from numba's on-disk cache) on a two-rank,
    two-micro-batch 1F1B, so that the first large search does not wait for the compiler
    (``scripts/setup.sh``). Returns whether the compiled kernel is in use."""
    return kernel() is not None


#: 1F1B on two ranks, two micro-batches (codes of ``Schedule.index``: F(m, s) = 2m + s,
#: B(m, s) = 4 + 2m + s), ``n`` and ``S``: what :func:`kernel` runs once (8 actions)
_SMALL: tuple[list[list[int]], int, int] = ([[0, 2, 4, 6], [1, 5, 3, 7]], 4, 2)


def _run(k: Callable[..., Any], rows: list[list[int]], n: int, s_total: int) -> int:
    """``k`` on the action lists ``rows`` with unit durations and no transfers; the number
    of actions it ran."""
    codes = np.array([c for row in rows for c in row], np.int64)
    row_start = np.cumsum([0] + [len(row) for row in rows]).astype(np.int64)
    p, a = len(rows), len(codes)
    ones, hops = np.ones(p), np.zeros(n)
    return int(k(codes, row_start, n, s_total, False, ones, ones, hops, hops,
                 np.full(2 * n, -1.0), np.zeros(p, np.int64), np.zeros(p), np.zeros(p),
                 np.zeros(p), np.zeros(s_total), np.zeros(a), np.zeros(a, np.int64),
                 np.zeros(a, np.int64), np.zeros(a)))
