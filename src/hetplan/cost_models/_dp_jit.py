"""Compiled kernels of the resumable data-parallel timeline (:class:`~.timeline.DPSession`).

The pure-Python :class:`~hetplan.cost_models.timeline.DPSession` replays a few hundred events
per trial; Espresso's Algorithm 4.1 runs thousands of trials that are nearly all close calls
(within ~0.3 % of the time they must beat), so no bound stops them early. These kernels run
the *same* event loop, with the same float operations in the same order, compiled with numba:
a trial returns the same value bit for bit (``tests/unit/test_timeline_session.py`` runs both
implementations against :func:`~hetplan.cost_models.timeline.simulate_dp`).

Data layout (all numpy):

- resources are small integers: ``0`` the GPU stream, ``1`` the CPU pool, ``2..`` the
  communication channels (:class:`~.timeline.DPSession` keeps the name -> id map);
- a strategy's ops are flat arrays ``res``/``dur`` with ``ustart[i]``/``ucount[i]`` giving
  tensor ``i``'s slice;
- a heap entry is a row ``(runnable time, unit ready time, unit, op index)`` of a float64
  ``(cap, 4)`` array, ordered lexicographically like the Python tuples (``unit`` and ``op``
  are small integers, exact in float64); entries are distinct, so any binary heap pops them
  in the same order as :mod:`heapq`;
- the state before every backprop segment of the base run (the Python session's ``_snaps``)
  is kept in ``snap_*`` arrays, the two heaps of state ``i`` in a pool at
  ``[roff[i], roff[i + 1])`` / ``[goff[i], goff[i + 1])``.

Nothing here is imported unless numba is installed; ``HETPLAN_JIT=0`` turns the kernels off.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from hetplan.cost_models.timeline import CPU as _CPU
from hetplan.cost_models.timeline import GPU as _GPU

GPU_ID = 0
CPU_ID = 1
#: At most this many resources (GPU, CPU and channels) per session.
MAX_RESOURCES = 16
#: relative slack of the trial bounds (as :data:`~.timeline._EPS_BOUND`)
_EPS_BOUND = 1e-12
#: relative slack of the release bound (:func:`release_bounds`), which sums in another order
_EPS_RELEASE = 1e-9


@njit(cache=True)
def _less(h, a, b):  # pragma: no cover - compiled
    for c in range(4):
        x = h[a, c]
        y = h[b, c]
        if x != y:
            return x < y
    return False


@njit(cache=True)
def _swap(h, a, b):  # pragma: no cover - compiled
    for c in range(4):
        t = h[a, c]
        h[a, c] = h[b, c]
        h[b, c] = t


@njit(cache=True)
def _push(h, size, t, r, k, j):  # pragma: no cover - compiled
    i = size
    h[i, 0] = t
    h[i, 1] = r
    h[i, 2] = k
    h[i, 3] = j
    while i > 0:
        p = (i - 1) >> 1
        if _less(h, i, p):
            _swap(h, i, p)
            i = p
        else:
            break
    return size + 1


@njit(cache=True)
def _pop(h, size):  # pragma: no cover - compiled
    """Remove the top (the caller has read row 0); the new size."""
    size -= 1
    if size > 0:
        for c in range(4):
            h[0, c] = h[size, c]
        i = 0
        while True:
            left = 2 * i + 1
            if left >= size:
                break
            m = left
            right = left + 1
            if right < size and _less(h, right, left):
                m = right
            if _less(h, m, i):
                _swap(h, m, i)
                i = m
            else:
                break
    return size


@njit(cache=True)
def _event(ev, o, s, e, k, comm):  # pragma: no cover - compiled
    """Record op ``o``'s interval: row ``o`` is ``(start, end, unit, 1.0 if on a channel)``."""
    ev[o, 0] = s
    ev[o, 1] = e
    ev[o, 2] = k
    ev[o, 3] = 1.0 if comm else 0.0


@njit(cache=True)
def _restore(m, snap_gpu, snap_sync, snap_free, snap_cpu, roff, rpool, goff, gpool,
             run_h, gq_h, free, cpu):  # pragma: no cover - compiled
    """Load the saved state before segment ``m`` into the work arrays; returns
    ``(gpu_free, sync_end, runnable size, gpu-queue size)``."""
    rn = roff[m + 1] - roff[m]
    for x in range(rn):
        for c in range(4):
            run_h[x, c] = rpool[roff[m] + x, c]
    gn = goff[m + 1] - goff[m]
    for x in range(gn):
        for c in range(4):
            gq_h[x, c] = gpool[goff[m] + x, c]
    for r in range(free.shape[0]):
        free[r] = snap_free[m, r]
    for w in range(cpu.shape[0]):
        cpu[w] = snap_cpu[m, w]
    return snap_gpu[m], snap_sync[m], rn, gn


@njit(cache=True)
def _has_changed(h, hn, changed_mask):  # pragma: no cover - compiled
    for x in range(hn):
        if changed_mask[int(h[x, 2])]:
            return True
    return False


@njit(cache=True)
def _same_rows(h, hn, pool, start):  # pragma: no cover - compiled
    """Whether heap ``h[:hn]`` holds the rows ``pool[start:start + hn]`` (in any order); a
    row's (unit, op) identifies it."""
    for x in range(hn):
        found = False
        for y in range(start, start + hn):
            if pool[y, 2] == h[x, 2] and pool[y, 3] == h[x, 3]:
                found = pool[y, 0] == h[x, 0] and pool[y, 1] == h[x, 1]
                break
        if not found:
            return False
    return True


@njit(cache=True)
def _converged(m, run_h, rn, gq_h, gn, free, cpu, sync_end, changed_mask, snap_gpu,
               snap_sync, snap_free, snap_cpu, roff, rpool, goff, gpool):  # pragma: no cover
    """:meth:`~.timeline.DPSession._converged` on arrays."""
    now = snap_gpu[m]
    if max(sync_end, now) != max(snap_sync[m], now):
        return False
    if rn != roff[m + 1] - roff[m] or gn != goff[m + 1] - goff[m]:
        return False
    if rn > 0:
        for c in range(4):
            if run_h[0, c] != rpool[roff[m], c]:
                return False
    if gn > 0:
        for c in range(4):
            if gq_h[0, c] != gpool[goff[m], c]:
                return False
    for r in range(free.shape[0]):
        if max(free[r], now) != max(snap_free[m, r], now):
            return False
    a = np.sort(np.maximum(cpu, now))
    b = np.sort(np.maximum(snap_cpu[m], now))
    for w in range(a.shape[0]):
        if a[w] != b[w]:
            return False
    if _has_changed(run_h, rn, changed_mask) or _has_changed(gq_h, gn, changed_mask):
        return False
    return _same_rows(run_h, rn, rpool, roff[m]) and _same_rows(gq_h, gn, gpool, goff[m])


@njit(cache=True)
def _run(bp, suffix_bp, release, res, dur, ustart, ucount, fwd, opt,
         gpu_free, next_bp, run_h, rn, gq_h, gn, free, cpu, sync_end,
         record, snap_gpu, snap_sync, snap_free, snap_cpu, roff, rpool, goff, gpool,
         bound, use_rem, rem, changed_mask, n_moving, last_changed, base_s,
         events, ev, ev_ready):  # pragma: no cover - compiled
    """:meth:`~.timeline.DPSession._run` on arrays. With ``record`` the state before every
    segment is saved (the base run; returns ``-1.0`` when a snapshot pool is full);
    otherwise a trial: bound checks when ``use_rem``, and the convergence test. With
    ``events`` every op's interval is written to ``ev`` (:func:`_event`, row = op index) and
    every tensor's ready time to ``ev_ready``."""
    n = bp.shape[0]
    inf = np.inf
    bp_end = 0.0
    single_cpu = cpu.shape[0] == 1
    limit = bound + _EPS_BOUND * max(1.0, abs(bound)) - fwd - opt
    release_limit = limit + _EPS_RELEASE * max(1.0, abs(limit))
    while True:
        horizon = run_h[0, 0] if rn > 0 else inf
        while gpu_free < horizon:
            if gn > 0 and gq_h[0, 0] <= gpu_free:
                r = gq_h[0, 1]
                k = int(gq_h[0, 2])
                j = int(gq_h[0, 3])
                gn = _pop(gq_h, gn)
                d = dur[ustart[k] + j]
                if use_rem:
                    left = rem[GPU_ID]
                    if gpu_free + left + suffix_bp[next_bp] > limit:
                        return inf
                    rem[GPU_ID] = left - d
                e = gpu_free + d
                if events:
                    _event(ev, ustart[k] + j, gpu_free, e, k, False)
                gpu_free = e
                if j + 1 < ucount[k]:
                    rn = _push(run_h, rn, e, r, k, j + 1)
                    if e < horizon:
                        horizon = e
                else:
                    if e > sync_end:
                        sync_end = e
                    if n_moving > 0 and changed_mask[k]:
                        n_moving -= 1
            elif next_bp < n:
                if record:
                    i = next_bp
                    if roff[i] + rn > rpool.shape[0] or goff[i] + gn > gpool.shape[0]:
                        return -1.0
                    snap_gpu[i] = gpu_free
                    snap_sync[i] = sync_end
                    for rr in range(free.shape[0]):
                        snap_free[i, rr] = free[rr]
                    for w in range(cpu.shape[0]):
                        snap_cpu[i, w] = cpu[w]
                    for x in range(rn):
                        for c in range(4):
                            rpool[roff[i] + x, c] = run_h[x, c]
                    roff[i + 1] = roff[i] + rn
                    for x in range(gn):
                        for c in range(4):
                            gpool[goff[i] + x, c] = gq_h[x, c]
                    goff[i + 1] = goff[i] + gn
                elif use_rem and next_bp > last_changed \
                        and gpu_free + release[next_bp] > release_limit:
                    return inf
                elif n_moving == 0 and next_bp > last_changed \
                        and gpu_free == snap_gpu[next_bp] \
                        and _converged(next_bp, run_h, rn, gq_h, gn, free, cpu, sync_end,
                                       changed_mask, snap_gpu, snap_sync, snap_free, snap_cpu,
                                       roff, rpool, goff, gpool):
                    return base_s
                e = gpu_free + bp[next_bp]
                gpu_free = e
                if events:
                    ev_ready[next_bp] = e
                if ucount[next_bp] > 0:
                    rn = _push(run_h, rn, e, e, next_bp, 0)
                    if e < horizon:
                        horizon = e
                next_bp += 1
                if next_bp == n:
                    bp_end = e
            elif gn > 0:
                gpu_free = max(gpu_free, gq_h[0, 0])
            else:
                break
        if rn == 0:
            if gn > 0 or next_bp < n:
                continue
            break
        t = run_h[0, 0]
        r = run_h[0, 1]
        k = int(run_h[0, 2])
        j = int(run_h[0, 3])
        rn = _pop(run_h, rn)
        o = ustart[k] + j
        rid = res[o]
        if rid == GPU_ID:
            gn = _push(gq_h, gn, t, r, k, j)
            continue
        d = dur[o]
        if rid == CPU_ID:
            w = 0
            if not single_cpu:
                for x in range(1, cpu.shape[0]):
                    if cpu[x] < cpu[w]:
                        w = x
            s = cpu[w]
            if t > s:
                s = t
            cpu[w] = s + d
        else:
            s = free[rid]
            if t > s:
                s = t
            free[rid] = s + d
        e = s + d
        if events:
            _event(ev, o, s, e, k, rid != CPU_ID)
        if use_rem:
            left = rem[rid]
            if rid != CPU_ID and s + left > limit:
                return inf
            rem[rid] = left - d
        if j + 1 < ucount[k]:
            rn = _push(run_h, rn, e, r, k, j + 1)
        else:
            if e > sync_end:
                sync_end = e
            if n_moving > 0 and changed_mask[k]:
                n_moving -= 1
    if n == 0:
        bp_end = 0.0
    return fwd + max(bp_end, sync_end) + opt


@njit(cache=True)
def rebase_run(bp, suffix_bp, res, dur, ustart, ucount, fwd, opt, m, workers,
               snap_gpu, snap_sync, snap_free, snap_cpu, roff, rpool, goff, gpool,
               run_h, gq_h, ev, ready):  # pragma: no cover - compiled
    """Simulate the base from the state saved before segment ``m`` (``m == 0``: the empty
    start), saving the states from ``m`` on. Returns the iteration time, or ``-1.0`` when a
    snapshot pool is too small (the caller grows it and calls again). Every op run is
    recorded in ``ev`` (row = op index) and every tensor's ready time from ``m`` on in
    ``ready``: the ops before that state ran as recorded by the earlier runs (the prefix
    is the same), so ``ev`` and ``ready`` always hold the whole base run."""
    free = np.zeros(snap_free.shape[1])
    cpu = np.zeros(workers)
    if m == 0:
        gpu_free, sync_end, rn, gn = 0.0, 0.0, 0, 0
        roff[0] = 0
        goff[0] = 0
    else:
        gpu_free, sync_end, rn, gn = _restore(m, snap_gpu, snap_sync, snap_free, snap_cpu,
                                              roff, rpool, goff, gpool, run_h, gq_h, free,
                                              cpu)
    no_rem = np.zeros(1)
    no_mask = np.zeros(1, dtype=np.bool_)
    no_release = np.full(bp.shape[0] + 1, -np.inf)  # not read without a bound
    return _run(bp, suffix_bp, no_release, res, dur, ustart, ucount, fwd, opt, gpu_free, m,
                run_h, rn, gq_h, gn, free, cpu, sync_end, True, snap_gpu, snap_sync, snap_free,
                snap_cpu, roff, rpool, goff, gpool, np.inf, False, no_rem, no_mask, 0,
                bp.shape[0], 0.0, True, ev, ready)


@njit(cache=True)
def _trial(bp, suffix_bp, suffix, release, res, dur, ustart, ucount, fwd, opt, workers,
           snap_gpu, snap_sync, snap_free, snap_cpu, roff, rpool, goff, gpool, base_s,
           t_res, t_dur, t_start, t_count, changed, bound, run_h, gq_h, free, cpu, rem,
           changed_mask):  # pragma: no cover - compiled
    """One trial: the base with tensor ``changed[x]``'s ops replaced by the slice
    ``[t_start[x], t_start[x] + t_count[x])`` of ``t_res``/``t_dur`` (see
    :meth:`~.timeline.DPSession.trial`). ``changed`` is sorted; the work arrays are
    overwritten."""
    n_base = res.shape[0]
    n_new = 0
    for x in range(changed.shape[0]):
        n_new += t_count[x]
    a_res = np.empty(n_base + n_new, dtype=res.dtype)
    a_dur = np.empty(n_base + n_new)
    a_res[:n_base] = res
    a_dur[:n_base] = dur
    a_start = ustart.copy()
    a_count = ucount.copy()
    pos = n_base
    n_moving = 0
    for x in range(changed.shape[0]):
        i = changed[x]
        changed_mask[i] = True
        a_start[i] = pos
        a_count[i] = t_count[x]
        for y in range(t_count[x]):
            a_res[pos + y] = t_res[t_start[x] + y]
            a_dur[pos + y] = t_dur[t_start[x] + y]
        pos += t_count[x]
        if t_count[x] > 0:
            n_moving += 1
    first = changed[0]
    last_changed = changed[changed.shape[0] - 1]
    gpu_free, sync_end, rn, gn = _restore(first, snap_gpu, snap_sync, snap_free, snap_cpu,
                                          roff, rpool, goff, gpool, run_h, gq_h, free, cpu)
    use_rem = bound < np.inf
    if use_rem:
        # in-flight work at the saved state, then the work of the tensors from ``first`` on
        for r in range(rem.shape[0]):
            rem[r] = 0.0
        for x in range(rn):
            k = int(run_h[x, 2])
            for o in range(ustart[k] + int(run_h[x, 3]), ustart[k] + ucount[k]):
                rem[res[o]] += dur[o]
        for x in range(gn):
            k = int(gq_h[x, 2])
            for o in range(ustart[k] + int(gq_h[x, 3]), ustart[k] + ucount[k]):
                rem[res[o]] += dur[o]
        for r in range(rem.shape[0]):
            rem[r] += suffix[first, r]
        for x in range(changed.shape[0]):
            i = changed[x]
            for o in range(ustart[i], ustart[i] + ucount[i]):
                rem[res[o]] -= dur[o]
            for o in range(a_start[i], a_start[i] + a_count[i]):
                rem[a_res[o]] += a_dur[o]
        # the lower bound at the resume point (DPSession._bound)
        now = gpu_free
        end = max(sync_end, now + suffix_bp[first] + rem[GPU_ID])
        for r in range(1, rem.shape[0]):
            d = rem[r]
            if d <= 0.0:
                continue
            if r == CPU_ID:
                acc = 0.0
                for w in range(cpu.shape[0]):
                    acc += max(cpu[w], now)
                end = max(end, (acc + d) / cpu.shape[0])
            else:
                end = max(end, max(free[r], now) + d)
        if fwd + end + opt > bound + _EPS_BOUND * max(1.0, abs(bound)):
            for x in range(changed.shape[0]):
                changed_mask[changed[x]] = False
            return np.inf
    f = _run(bp, suffix_bp, release, a_res, a_dur, a_start, a_count, fwd, opt, gpu_free,
             first, run_h, rn, gq_h, gn, free, cpu, sync_end, False, snap_gpu, snap_sync,
             snap_free, snap_cpu, roff, rpool, goff, gpool, bound, use_rem, rem, changed_mask,
             n_moving, last_changed, base_s, False, run_h, rem)
    for x in range(changed.shape[0]):
        changed_mask[changed[x]] = False
    return f


@njit(cache=True)
def _work(n, n_res, workers):  # pragma: no cover - compiled
    """Work arrays of a trial: two heaps, channel and CPU free times, remaining work, mask."""
    return (np.empty((n + 1, 4)), np.empty((n + 1, 4)), np.empty(n_res), np.empty(workers),
            np.empty(n_res), np.zeros(n, dtype=np.bool_))


@njit(cache=True)
def trial(bp, suffix_bp, suffix, release, res, dur, ustart, ucount, fwd, opt, workers,
          snap_gpu, snap_sync, snap_free, snap_cpu, roff, rpool, goff, gpool, base_s,
          t_res, t_dur, t_start, t_count, changed, bound):  # pragma: no cover - compiled
    """:func:`_trial` with fresh work arrays."""
    run_h, gq_h, free, cpu, rem, mask = _work(bp.shape[0], snap_free.shape[1], workers)
    return _trial(bp, suffix_bp, suffix, release, res, dur, ustart, ucount, fwd, opt, workers,
                  snap_gpu, snap_sync, snap_free, snap_cpu, roff, rpool, goff, gpool, base_s,
                  t_res, t_dur, t_start, t_count, changed, bound, run_h, gq_h, free, cpu, rem,
                  mask)


@njit(cache=True)
def best_option(bp, suffix_bp, suffix, release, res, dur, ustart, ucount, fwd, opt, workers,
                snap_gpu, snap_sync, snap_free, snap_cpu, roff, rpool, goff, gpool, base_s,
                j, c_res, c_dur, c_start, c_count, c_back, best, eps):  # pragma: no cover
    """Algorithm 4.1's ``GetBestOption`` for tensor ``j`` over candidate op lists
    ``[c_start[c], c_start[c] + c_count[c])``: candidate ``c`` is kept when its time is
    below ``best - eps``, or at most ``best + eps`` if ``c_back[c]`` (the baseline option,
    preferred on a tie); each trial is bounded by what it must beat. Returns
    ``(index of the kept candidate or -1, its time or best)``."""
    run_h, gq_h, free, cpu, rem, mask = _work(bp.shape[0], snap_free.shape[1], workers)
    changed = np.array([j])
    t_start = np.zeros(1, dtype=np.int64)
    t_count = np.zeros(1, dtype=np.int64)
    chosen = -1
    for c in range(c_start.shape[0]):
        back = c_back[c]
        t_start[0] = c_start[c]
        t_count[0] = c_count[c]
        limit = best - eps
        if back:
            limit = best + eps
        f = _trial(bp, suffix_bp, suffix, release, res, dur, ustart, ucount, fwd, opt, workers,
                   snap_gpu, snap_sync, snap_free, snap_cpu, roff, rpool, goff, gpool, base_s,
                   c_res, c_dur, t_start, t_count, changed, limit,
                   run_h, gq_h, free, cpu, rem, mask)
        if f < best - eps or (back and f <= best + eps):
            best = f
            chosen = c
    return chosen, best


@njit(cache=True)
def _offload_trial(u, g_off, members, tensors, slots, bp, suffix_bp, suffix, release, res,
                   dur, ustart, ucount, fwd, opt, workers, snap_gpu, snap_sync, snap_free,
                   snap_cpu, roff, rpool, goff, gpool, base_s, o_res, o_dur, o_start, o_count,
                   bound, run_h, gq_h, free, cpu, rem, mask):  # pragma: no cover - compiled
    """The base with the first ``u[g]`` members of every group offloaded (see
    :func:`best_offload`), bounded by ``bound``; the base's time when ``u`` is all zeros."""
    m = 0
    for h in range(u.shape[0]):
        for x in range(g_off[h], g_off[h] + u[h]):
            tensors[m] = members[x]
            slots[m] = x
            m += 1
    if m == 0:  # coordinate descent can step back to the base
        return base_s
    order = np.argsort(tensors[:m])
    return _trial(bp, suffix_bp, suffix, release, res, dur, ustart, ucount, fwd, opt, workers,
                  snap_gpu, snap_sync, snap_free, snap_cpu, roff, rpool, goff, gpool, base_s,
                  o_res, o_dur, o_start[slots[:m][order]], o_count[slots[:m][order]],
                  tensors[:m][order], bound, run_h, gq_h, free, cpu, rem, mask)


@njit(cache=True)
def _next_vector(u, g_size):  # pragma: no cover - compiled
    """Step ``u`` to the next vector in :func:`itertools.product` order (the last group
    moves fastest); False after the last one."""
    g = u.shape[0] - 1
    while g >= 0 and u[g] == g_size[g]:
        u[g] = 0
        g -= 1
    if g < 0:
        return False
    u[g] += 1
    return True


@njit(cache=True)
def best_offload(bp, suffix_bp, suffix, release, res, dur, ustart, ucount, fwd, opt, workers,
                 snap_gpu, snap_sync, snap_free, snap_cpu, roff, rpool, goff, gpool, base_s,
                 g_size, members, o_res, o_dur, o_start, o_count, best, eps,
                 exhaustive):  # pragma: no cover - compiled
    """Algorithm 4.2 over offloading vectors ``u`` (``0 <= u[g] <= g_size[g]``; ``u``
    offloads the first ``u[g]`` members of group ``g``; ``members`` lists the groups one
    after another, each earliest-ready first; member ``x``'s offloaded ops are the slice
    ``[o_start[x], o_start[x] + o_count[x])`` of ``o_res``/``o_dur``). A vector is kept when
    its time is below ``best - eps``. With ``exhaustive``, every vector in
    :func:`itertools.product` order (Theorem 4.1; the first of equals wins); otherwise
    coordinate descent: one group's count at a time, repeated until no group changes.
    Returns ``(u, time, trials)``; ``u`` is all zeros when no vector beats ``best``."""
    run_h, gq_h, free, cpu, rem, mask = _work(bp.shape[0], snap_free.shape[1], workers)
    trials = 0
    n_groups = g_size.shape[0]
    g_off = np.zeros(n_groups + 1, dtype=np.int64)
    for g in range(n_groups):
        g_off[g + 1] = g_off[g] + g_size[g]
    u = np.zeros(n_groups, dtype=np.int64)
    best_u = np.zeros(n_groups, dtype=np.int64)
    tensors = np.empty(members.shape[0], dtype=np.int64)
    slots = np.empty(members.shape[0], dtype=np.int64)
    if exhaustive:
        while _next_vector(u, g_size):
            trials += 1
            f = _offload_trial(u, g_off, members, tensors, slots, bp, suffix_bp, suffix,
                               release, res, dur, ustart, ucount, fwd, opt, workers,
                               snap_gpu, snap_sync, snap_free, snap_cpu, roff, rpool, goff,
                               gpool, base_s, o_res, o_dur, o_start, o_count, best - eps,
                               run_h, gq_h, free, cpu, rem, mask)
            if f < best - eps:
                best = f
                best_u[:] = u
        return best_u, best, trials
    changed = True
    while changed:
        changed = False
        for g in range(n_groups):
            for k in range(g_size[g] + 1):
                if k == best_u[g]:
                    continue
                u[:] = best_u
                u[g] = k
                trials += 1
                f = _offload_trial(u, g_off, members, tensors, slots, bp, suffix_bp, suffix,
                                   release, res, dur, ustart, ucount, fwd, opt, workers,
                                   snap_gpu, snap_sync, snap_free, snap_cpu, roff, rpool, goff,
                                   gpool, base_s, o_res, o_dur, o_start, o_count, best - eps,
                                   run_h, gq_h, free, cpu, rem, mask)
                if f < best - eps:
                    best = f
                    best_u[:] = u
                    changed = True
    return best_u, best, trials


@njit(cache=True)
def best_classes(bp, suffix_bp, suffix, release, res, dur, ustart, ucount, fwd, opt, workers,
                 snap_gpu, snap_sync, snap_free, snap_cpu, roff, rpool, goff, gpool, base_s,
                 class_idx, s_res, s_dur, s_cnt):  # pragma: no cover - compiled
    """The fastest of ``S`` strategies in which tensor ``i`` gets strategy ``s``'s ops of
    class ``class_idx[i]`` (the slice ``[:s_cnt[s, c]]`` of ``s_res[s, c]``/``s_dur[s, c]``),
    each trial bounded by the best so far; the first of equals wins. Returns
    ``(index, time)``."""
    run_h, gq_h, free, cpu, rem, mask = _work(bp.shape[0], snap_free.shape[1], workers)
    n = bp.shape[0]
    changed = np.arange(n)
    t_start = np.empty(n, dtype=np.int64)
    t_count = np.empty(n, dtype=np.int64)
    t_res = np.empty(n * s_res.shape[2], dtype=np.int64)
    t_dur = np.empty(n * s_res.shape[2])
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
        f = _trial(bp, suffix_bp, suffix, release, res, dur, ustart, ucount, fwd, opt, workers,
                   snap_gpu, snap_sync, snap_free, snap_cpu, roff, rpool, goff, gpool, base_s,
                   t_res, t_dur, t_start, t_count, changed, best_f, run_h, gq_h, free, cpu,
                   rem, mask)
        if best_s < 0 or f < best_f:
            best_f = f
            best_s = s
    return best_s, best_f


@njit(cache=True)
def bubble_mask(ev, ready, eps):  # pragma: no cover - compiled
    """:func:`~hetplan.cost_models.timeline.before_last_busy_period`'s gap rules on a
    run's intervals (``ev``, one row ``(start, end, unit, on a channel)`` per op) and the
    tensors' ready times. Returns a mask over tensors. Needs ``eps >= 0`` and intervals that
    end no earlier than they start (durations >= 0), as the simulator's always do: then of
    intervals starting together only the first can open a gap, so sorting by start alone
    gives the reference's result."""
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
    last_start = cs[order[0]]
    reach = ce[order[0]]
    for y in range(1, nc):
        s = cs[order[y]]
        if s > reach + eps:
            spanned = False
            for u in range(n):
                if done[u] >= 0.0 and ready[u] < s - eps and done[u] > reach + eps:
                    spanned = True
                    break
            if not spanned:
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


@njit(cache=True)
def suffix_work(res, dur, ustart, ucount, suffix, last):  # pragma: no cover - compiled
    """``suffix[i, r]``: work on resource ``r`` of tensors ``i..n-1``, recomputed from tensor
    ``last`` down (rows after it are kept)."""
    for i in range(last, -1, -1):
        for r in range(suffix.shape[1]):
            suffix[i, r] = suffix[i + 1, r]
        for o in range(ustart[i], ustart[i] + ucount[i]):
            suffix[i, res[o]] += dur[o]


@njit(cache=True)
def release_bounds(bp, res, dur, ustart, ucount, workers, suffix,
                   out):  # pragma: no cover - compiled
    """:func:`~hetplan.cost_models.timeline._release_bounds` on arrays (same float
    operations in the same order; ``suffix`` as :func:`suffix_work` leaves it), into
    ``out`` (``n + 1`` values)."""
    n = bp.shape[0]
    inf = np.inf
    lead = np.full(MAX_RESOURCES, inf)  # over tensors >= k: finite once a resource has ops
    tail = np.full(MAX_RESOURCES, inf)
    first = np.zeros(MAX_RESOURCES)  # this tensor's lead / tail per resource
    last = np.zeros(MAX_RESOURCES)
    has = np.zeros(MAX_RESOURCES, dtype=np.bool_)  # whether this tensor has ops there
    got = np.zeros(MAX_RESOURCES, dtype=np.bool_)  # whether its tail there is set
    before = 0.0
    for i in range(n):
        before += bp[i]
    best = -inf
    out[n] = -inf
    for k in range(n - 1, -1, -1):
        pre = 0.0
        for o in range(ustart[k], ustart[k] + ucount[k]):
            r = res[o]
            if r != GPU_ID and not has[r]:
                has[r] = True
                first[r] = pre
            pre += dur[o]
        post = 0.0
        for o in range(ustart[k] + ucount[k] - 1, ustart[k] - 1, -1):
            r = res[o]
            if r != GPU_ID and not got[r]:
                got[r] = True
                last[r] = post
            post += dur[o]
        for r in range(MAX_RESOURCES):
            if has[r]:
                lead[r] = min(lead[r], first[r])
                tail[r] = min(tail[r], last[r])
                has[r] = False
                got[r] = False
            if lead[r] < inf:
                w = suffix[k, r] / workers if r == CPU_ID else suffix[k, r]
                span = lead[r] + w + tail[r]
                if before + span > best:
                    best = before + span
        before -= bp[k]
        out[k] = best - before


class JitDPSession:
    """:class:`~hetplan.cost_models.timeline.DPSession` on the compiled kernels: the same
    methods, the same results bit for bit (see the module docstring). ``share``: another
    session whose caches of ops converted to arrays this one uses too (sessions of one
    problem see the same op tuples; the resource ids only name the channels)."""

    __slots__ = ("_bp", "_suffix_bp", "_fwd", "_opt", "_workers", "_rid", "_conv", "_ops",
                 "_res", "_dur", "_ustart", "_ucount", "_valid", "_snap_gpu", "_snap_sync",
                 "_snap_free", "_snap_cpu", "_roff", "_goff", "_rpool", "_gpool", "_suffix",
                 "_ev", "_ready", "_release",
                 "_packed", "base_s", "trials")

    def __init__(self, backprop_s, *, forward_s=0.0, optimizer_s=0.0, cpu_workers=1,
                 share=None):
        if cpu_workers < 1:
            raise ValueError(f"cpu_workers must be >= 1, got {cpu_workers}")
        bp = [float(b) for b in backprop_s]
        n = len(bp)
        suffix_bp = [0.0] * (n + 1)
        for i in range(n - 1, -1, -1):  # the Python session's float order
            suffix_bp[i] = suffix_bp[i + 1] + bp[i]
        self._bp = np.array(bp, dtype=np.float64)
        self._suffix_bp = np.array(suffix_bp, dtype=np.float64)
        self._fwd = float(forward_s)
        self._opt = float(optimizer_s)
        self._workers = int(cpu_workers)
        self._rid: dict[str, int]  # resource name -> id
        self._conv: dict[int, tuple[tuple, np.ndarray, np.ndarray]]  # id(ops) -> arrays
        self._packed: dict[tuple[int, ...], tuple]  # candidate lists, packed
        if isinstance(share, JitDPSession):  # one problem's sessions: convert ops once
            self._rid, self._conv, self._packed = share._rid, share._conv, share._packed
        else:
            self._rid, self._conv, self._packed = {_GPU: GPU_ID, _CPU: CPU_ID}, {}, {}
        self.trials = 0  # trials run by best_offload
        self._ops: list[tuple] = []
        self._valid = False
        r = MAX_RESOURCES
        self._snap_gpu = np.zeros(n + 1)
        self._snap_sync = np.zeros(n + 1)
        self._snap_free = np.zeros((n + 1, r))
        self._snap_cpu = np.zeros((n + 1, self._workers))
        self._roff = np.zeros(n + 2, dtype=np.int64)
        self._goff = np.zeros(n + 2, dtype=np.int64)
        self._rpool = np.zeros((4 * n + 16, 4))
        self._gpool = np.zeros((4 * n + 16, 4))
        self._suffix = np.zeros((n + 1, r))
        self._release = np.zeros(n + 1)
        self._ev = np.zeros((0, 4))  # the base run's op intervals (row = op index)
        self._ready = np.zeros(n)  # and the tensors' ready times
        self.base_s = 0.0

    @property
    def base_ops(self):
        """The base strategy's ops per tensor (do not modify)."""
        return self._ops

    def _arrays_of(self, many):
        """(resource ids, durations) of each ops tuple in ``many``, cached per tuple; the
        ones not cached yet are converted together (two numpy arrays for all of them, each
        tuple's a slice)."""
        conv = self._conv
        out = []
        missing = []  # (position in out, ops)
        for ops in many:
            got = conv.get(id(ops))
            if got is not None and got[0] is ops:
                out.append((got[1], got[2]))
            else:
                missing.append((len(out), ops))
                out.append(None)
        if not missing:
            return out
        rid = self._rid
        ids = []
        durs = []
        for _, ops in missing:
            for op in ops:
                r = rid.get(op.resource)
                if r is None:
                    if len(rid) == MAX_RESOURCES:
                        raise ValueError(f"more than {MAX_RESOURCES} resources in one session")
                    r = rid[op.resource] = len(rid)
                ids.append(r)
                durs.append(op.duration_s)
        res = np.array(ids, dtype=np.int64)
        dur = np.array(durs, dtype=np.float64)
        at = 0
        for x, ops in missing:
            k = len(ops)
            out[x] = (res[at:at + k], dur[at:at + k])
            conv[id(ops)] = (ops, *out[x])
            at += k
        return out

    def _pack(self, unit_ops):
        parts = self._arrays_of(unit_ops)
        counts = np.array([len(o) for o in unit_ops], dtype=np.int64)
        starts = np.zeros(len(parts), dtype=np.int64)
        if len(parts) > 1:
            np.cumsum(counts[:-1], out=starts[1:])
        if parts:
            res = np.concatenate([p[0] for p in parts])
            dur = np.concatenate([p[1] for p in parts])
        else:
            res, dur = np.zeros(0, dtype=np.int64), np.zeros(0)
        return res, dur, starts, counts

    def rebase(self, unit_ops):
        """Simulate ``unit_ops`` as the new base (from the first changed tensor on)."""
        n = len(self._bp)
        if len(unit_ops) != n:
            raise ValueError(f"{len(unit_ops)} units for {n} tensors: one per tensor")
        new = list(unit_ops)
        m, last = 0, n - 1
        if self._valid and n:
            old = self._ops
            while m < n and (new[m] is old[m] or new[m] == old[m]):
                m += 1
            if m == n:
                self._ops = new
                return self.base_s
            while new[last] is old[last] or new[last] == old[last]:
                last -= 1
            # splice the changed tensors' ops into the base arrays
            res, dur, _, counts = self._pack(new[m:last + 1])
            lo = self._ustart[m]
            hi = self._ustart[last] + self._ucount[last]
            self._res = np.concatenate((self._res[:lo], res, self._res[hi:]))
            self._dur = np.concatenate((self._dur[:lo], dur, self._dur[hi:]))
            self._ev = np.concatenate((self._ev[:lo], np.zeros((len(res), 4)), self._ev[hi:]))
            self._ucount[m:last + 1] = counts
            np.cumsum(self._ucount[:-1], out=self._ustart[1:])
        else:
            self._suffix[:] = 0.0
            self._res, self._dur, self._ustart, self._ucount = self._pack(new)
            self._ev = np.zeros((len(self._res), 4))
        self._ops = new
        run_h = np.empty((n + 1, 4))
        gq_h = np.empty((n + 1, 4))
        while True:
            f = rebase_run(self._bp, self._suffix_bp, self._res, self._dur, self._ustart,
                           self._ucount, self._fwd, self._opt, m, self._workers,
                           self._snap_gpu, self._snap_sync, self._snap_free, self._snap_cpu,
                           self._roff, self._rpool, self._goff, self._gpool, run_h, gq_h,
                           self._ev, self._ready)
            if f >= 0.0:
                break
            for name in ("_rpool", "_gpool"):  # grow a full pool, keeping the saved states
                pool = getattr(self, name)
                grown = np.zeros((2 * pool.shape[0], 4))
                grown[:pool.shape[0]] = pool
                setattr(self, name, grown)
        self.base_s = f
        self._valid = True
        if n:
            suffix_work(self._res, self._dur, self._ustart, self._ucount, self._suffix, last)
            release_bounds(self._bp, self._res, self._dur, self._ustart, self._ucount,
                           self._workers, self._suffix, self._release)
        return f

    def _state(self):
        """The base and its saved states: the first arguments of every trial kernel."""
        return (self._bp, self._suffix_bp, self._suffix, self._release, self._res, self._dur,
                self._ustart, self._ucount, self._fwd, self._opt, self._workers, self._snap_gpu,
                self._snap_sync, self._snap_free, self._snap_cpu, self._roff, self._rpool,
                self._goff, self._gpool, self.base_s)

    def _check(self, idx):
        n = len(self._bp)
        if idx and (min(idx) < 0 or max(idx) >= n):
            raise ValueError(f"tensor index outside 0..{n - 1}: {sorted(idx)}")

    def trial(self, changes, *, bound=float("inf")):
        """The base with tensor ``i``'s ops replaced by ``changes[i]``; ``inf`` once proven
        longer than ``bound``."""
        if not changes:
            return self.base_s
        idx = sorted(changes)
        self._check(idx)
        t_res, t_dur, t_start, t_count = self._pack([changes[i] for i in idx])
        return trial(*self._state(), t_res, t_dur, t_start, t_count,
                     np.array(idx, dtype=np.int64), float(bound))

    def best_classes(self, class_idx, strategies):
        """:meth:`hetplan.cost_models.timeline.DPSession.best_classes` in one compiled call."""
        n = len(self._bp)
        if len(class_idx) != n:
            raise ValueError(f"{len(class_idx)} class indices for {n} tensors: one per tensor")
        if not strategies:
            return -1, float("inf")
        if n == 0:
            return 0, self.base_s
        if any(len(sd) != len(strategies[0]) for sd in strategies):
            raise ValueError("best_classes: every strategy needs ops for the same classes")
        parts = self._arrays_of([o for sd in strategies for o in sd])
        counts = np.array([len(r) for r, _ in parts], dtype=np.int64)
        shape = (len(strategies), len(strategies[0]), max(1, int(counts.max())))
        s_res = np.zeros(shape, dtype=np.int64)
        s_dur = np.zeros(shape)
        s_cnt = counts.reshape(shape[:2])
        # scatter every (strategy, class)'s ops into its padded row at once
        rows = np.repeat(np.arange(len(parts)), counts)
        cols = np.arange(len(rows)) - np.repeat(np.cumsum(counts) - counts, counts)
        s_res.reshape(-1, shape[2])[rows, cols] = np.concatenate([r for r, _ in parts])
        s_dur.reshape(-1, shape[2])[rows, cols] = np.concatenate([d for _, d in parts])
        idx, f = best_classes(*self._state(), np.asarray(class_idx, dtype=np.int64), s_res,
                              s_dur, s_cnt)
        return int(idx), float(f)

    def best_option(self, j, candidates, backs, best, eps):
        """Algorithm 4.1's ``GetBestOption`` for tensor ``j`` (see
        :meth:`hetplan.cost_models.timeline.DPSession.best_option`)."""
        if not candidates:
            return -1, best
        self._check([j])
        sig = tuple(id(o) for o in candidates)
        packed = self._packed.get(sig)
        if packed is None or packed[0] != candidates:  # the ids' tuples may have been freed
            packed = self._packed[sig] = (list(candidates), *self._pack(candidates))
        _, c_res, c_dur, c_start, c_count = packed
        idx, f = best_option(*self._state(), j, c_res, c_dur, c_start, c_count,
                             np.array(backs, dtype=np.bool_), float(best), float(eps))
        return int(idx), float(f)

    def best_offload(self, groups, offloaded, best, eps, exhaustive=True):
        """Algorithm 4.2 over offloading vectors (see
        :meth:`hetplan.cost_models.timeline.DPSession.best_offload`)."""
        members = [i for g in groups for i in g]
        if not members:
            return [0] * len(groups), best
        self._check(members)
        o_res, o_dur, o_start, o_count = self._pack([offloaded[i] for i in members])
        u, f, trials = best_offload(*self._state(),
                                    np.array([len(g) for g in groups], dtype=np.int64),
                                    np.array(members, dtype=np.int64), o_res, o_dur, o_start,
                                    o_count, float(best), float(eps), bool(exhaustive))
        self.trials += int(trials)
        return [int(x) for x in u], float(f)

    def before_bubbles(self, eps):
        """Tensors of the base communicated before its last communication busy period (see
        :func:`hetplan.cost_models.timeline.before_last_busy_period`)."""
        if eps < 0:
            raise ValueError(f"before_bubbles needs eps >= 0, got {eps}")
        if not len(self._bp):
            return set()
        mask = bubble_mask(self._ev, self._ready, float(eps))  # from the base run's record
        return {int(i) for i in np.flatnonzero(mask)}
