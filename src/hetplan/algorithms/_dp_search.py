"""Espresso's search loops over the data-parallel session, as kernels.

Algorithm 4.1's ``GetBestOption`` for one tensor (:func:`best_option`), Algorithm 4.2's
search over offloading vectors (:func:`best_offload`, in the order of
:func:`next_offload`), the uniform seeds (:func:`best_classes`) and Property #1's bubble
test (:func:`bubble_mask`), each one call over many trials of
:mod:`~hetplan.algorithms._dp_kernels`. Like those, plain Python over numpy arrays that
:mod:`~hetplan.algorithms.dp_session` compiles with numba (or runs uncompiled); the entry
points take the base as a :class:`~hetplan.algorithms._dp_kernels.Base` or a plain tuple of
its fields, and candidates as an :class:`~hetplan.algorithms._dp_kernels.Ops` or a plain
tuple.
"""

from __future__ import annotations

import numpy as np

from hetplan.algorithms._dp_kernels import Base, Ops, _trial, new_work

#: The functions that are compiled (with the kernels they call).
KERNELS = ("best_option", "next_offload", "_offload_trial", "best_offload", "best_classes",
           "bubble_mask")


def best_option(base, j, c, backs, best, eps):
    """Algorithm 4.1's ``GetBestOption`` for tensor ``j`` over candidates ``c`` (an
    :class:`Ops` whose entry ``x`` is candidate ``x``'s ops): candidate ``x`` is kept when its
    time is below ``best - eps``, or at most ``best + eps`` if ``backs[x]`` (the baseline
    option, preferred on a tie); each trial is bounded by what it must beat. Returns
    ``(index of the kept candidate or -1, its time or best)``."""
    b = Base(*base)
    c = Ops(*c)
    w = new_work(b, c.count.max() if c.count.shape[0] > 0 else 0)
    changed = np.array([j])
    t_start = np.zeros(1, dtype=np.int64)
    t_count = np.zeros(1, dtype=np.int64)
    one = Ops(c.res, c.dur, t_start, t_count)
    c_start, c_count = c.start, c.count
    chosen = -1
    for x in range(c_start.shape[0]):
        back = backs[x]
        t_start[0] = c_start[x]
        t_count[0] = c_count[x]
        limit = best - eps
        if back:
            limit = best + eps
        f = _trial(b, w, one, changed, limit)
        if f < best - eps or (back and f <= best + eps):
            best = f
            chosen = x
    return chosen, best


def next_offload(u, best_u, sizes, exhaustive, at):
    """Step ``u`` to the next offloading vector Algorithm 4.2 tries (``0 <= u[g] <=
    sizes[g]``); False when none is left. The one definition of the search order: the
    kernel :func:`best_offload` and the reference (``algorithms/espresso.py``) both walk it.

    With ``exhaustive``, every vector after ``u`` in :func:`itertools.product` order (the last
    group moves fastest; start from all zeros, which is never tried itself). Otherwise
    coordinate descent: ``u`` is ``best_u`` with one group's count changed, for each group in
    turn and each count other than ``best_u``'s, in sweeps repeated until one keeps nothing;
    ``at`` (three ints, start ``[0, -1, 0]``) is the position ``(group, count, kept since the
    sweep began)``: the caller sets ``at[2] = 1`` when it keeps ``u`` as ``best_u``."""
    n_groups = len(u)
    if exhaustive:
        g = n_groups - 1
        while g >= 0 and u[g] == sizes[g]:
            u[g] = 0
            g -= 1
        if g < 0:
            return False
        u[g] += 1
        return True
    g = at[0]
    k = at[1]
    while True:
        k += 1
        if g < n_groups and k > sizes[g]:
            g += 1
            k = 0
        if g >= n_groups:
            if at[2] == 0:
                return False
            at[2] = 0
            g = 0
            k = 0
        if k != best_u[g]:
            break
    at[0] = g
    at[1] = k
    for h in range(n_groups):
        u[h] = best_u[h]
    u[g] = k
    return True


def _offload_trial(b, w, u, g_off, members, o, tensors, slots, bound):
    """The base with the first ``u[g]`` members of every group offloaded (see
    :func:`best_offload`), bounded by ``bound``; the base's time when ``u`` is all zeros."""
    m = 0
    for h in range(u.shape[0]):
        for x in range(g_off[h], g_off[h] + u[h]):
            tensors[m] = members[x]
            slots[m] = x
            m += 1
    if m == 0:  # coordinate descent can step back to the base
        return b.base_s
    order = np.argsort(tensors[:m])
    picked = slots[:m][order]
    t = Ops(o.res, o.dur, o.start[picked], o.count[picked])
    return _trial(b, w, t, tensors[:m][order], bound)


def best_offload(base, sizes, members, o, best, eps, exhaustive):
    """Algorithm 4.2 over offloading vectors ``u`` (:func:`next_offload`; ``u`` offloads the
    first ``u[g]`` members of group ``g``; ``members`` lists the groups one after another,
    each earliest-ready first; member ``x``'s offloaded ops are entry ``x`` of ``o``). A
    vector is kept when its time is below ``best - eps``, each trial bounded by that; the
    first of equals wins. Returns ``(u, time, trials)``; ``u`` is all zeros when no vector
    beats ``best``."""
    b = Base(*base)
    o = Ops(*o)
    w = new_work(b, o.res.shape[0])
    n_groups = sizes.shape[0]
    g_off = np.zeros(n_groups + 1, dtype=np.int64)
    for g in range(n_groups):
        g_off[g + 1] = g_off[g] + sizes[g]
    u = np.zeros(n_groups, dtype=np.int64)
    best_u = np.zeros(n_groups, dtype=np.int64)
    at = np.array([0, -1, 0])
    tensors = np.empty(members.shape[0], dtype=np.int64)
    slots = np.empty(members.shape[0], dtype=np.int64)
    trials = 0
    while next_offload(u, best_u, sizes, exhaustive, at):
        trials += 1
        f = _offload_trial(b, w, u, g_off, members, o, tensors, slots, best - eps)
        if f < best - eps:
            best = f
            best_u[:] = u
            at[2] = 1
    return best_u, best, trials


def best_classes(base, class_idx, s_res, s_dur, s_cnt):
    """The fastest of ``S`` whole strategies in which tensor ``i`` gets strategy ``s``'s ops
    of class ``class_idx[i]`` (the slice ``[:s_cnt[s, c]]`` of ``s_res[s, c]`` /
    ``s_dur[s, c]``), each trial bounded by the best so far; the first of equals wins.
    Returns ``(index, time)``."""
    b = Base(*base)
    n = b.bp.shape[0]
    w = new_work(b, n * s_res.shape[2])
    changed = np.arange(n)
    t_res = np.empty(n * s_res.shape[2], dtype=np.int64)
    t_dur = np.empty(n * s_res.shape[2])
    t_start = np.empty(n, dtype=np.int64)
    t_count = np.empty(n, dtype=np.int64)
    t = Ops(t_res, t_dur, t_start, t_count)
    best_f = np.inf
    best_s = -1
    for s in range(s_cnt.shape[0]):
        pos = 0
        for i in range(n):
            c = class_idx[i]
            t_start[i] = pos
            t_count[i] = s_cnt[s, c]
            for y in range(s_cnt[s, c]):
                t_res[pos + y] = s_res[s, c, y]
                t_dur[pos + y] = s_dur[s, c, y]
            pos += s_cnt[s, c]
        f = _trial(b, w, t, changed, best_f)
        if best_s < 0 or f < best_f:
            best_f = f
            best_s = s
    return best_s, best_f


def bubble_mask(ev, ready, eps):
    """Espresso's Property #1 (see :func:`~hetplan.algorithms.dp_timeline.
    before_last_busy_period`) on a run's op intervals (``ev``, one row ``(start, end, unit,
    1.0 if on a channel)`` per op, in any order) and the tensors' ready times (unit ``i`` is
    tensor ``i``): a mask of the units whose communication ends no later than the start of
    the last busy period of the channels, where a gap longer than ``eps`` is one only if no
    unit spans it (ready before it, ops after it). Needs ``eps >= 0`` and intervals that end
    no earlier than they start (durations >= 0), as the simulator's always do: then of
    intervals starting together only the first can open a gap, so sorting by start alone
    gives the result of sorting by (start, end, unit)."""
    n = ready.shape[0]
    ne = ev.shape[0]
    done = np.full(n, -1.0)
    nc = 0
    for x in range(ne):
        k = int(ev[x, 2])
        if ev[x, 1] > done[k]:
            done[k] = ev[x, 1]
        if ev[x, 3] > 0.5:
            nc += 1
    out = np.zeros(n, dtype=np.bool_)
    if nc == 0:
        return out
    cs = np.empty(nc)
    ce = np.empty(nc)
    cu = np.empty(nc, dtype=np.int64)
    y = 0
    for x in range(ne):
        if ev[x, 3] > 0.5:
            cs[y] = ev[x, 0]
            ce[y] = ev[x, 1]
            cu[y] = int(ev[x, 2])
            y += 1
    order = np.argsort(cs)  # by start alone (see the docstring)
    # a gap at s is spanned when some unit with ops, ready before s - eps, ends after
    # reach + eps: the gaps come in increasing s, so the units ready before it are a
    # growing prefix of them by ready time, and it is enough to keep their latest end
    by_ready = np.argsort(ready, kind="mergesort")
    seen = 0  # units of by_ready[:seen] are ready before the gap
    latest = -1.0  # the latest end among them (units without ops: -1)
    last_start = cs[order[0]]
    reach = ce[order[0]]
    for y in range(1, nc):
        s = cs[order[y]]
        if s > reach + eps:
            while seen < n and ready[by_ready[seen]] < s - eps:
                if done[by_ready[seen]] > latest:
                    latest = done[by_ready[seen]]
                seen += 1
            if not (latest >= 0.0 and latest > reach + eps):
                last_start = s
        reach = max(reach, ce[order[y]])
    ends = np.full(n, -1.0)
    for y in range(nc):
        u = cu[y]
        if ce[y] > ends[u]:
            ends[u] = ce[y]
    for u in range(n):
        if ends[u] >= 0.0 and ends[u] <= last_start + eps:
            out[u] = True
    return out
