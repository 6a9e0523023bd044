"""The kernels of the data-parallel search session (:class:`~.dp_session.DPSession`).

Espresso's Algorithm 4.1 runs thousands of trials that each change a few tensors of a base
strategy and are nearly all close calls (within ~0.3 % of the time they must beat). These
functions run :func:`~hetplan.algorithms.dp_timeline.simulate_dp`'s general event loop, with
the same float operations in the same order, from states saved during the base's run, so a
trial returns the reference's time bit for bit (``tests/unit/test_timeline_session.py``).

They are plain Python over numpy arrays. :mod:`~hetplan.algorithms.dp_session` compiles
them with ``numba.njit(cache=True)`` when numba is available (``HETPLAN_JIT`` unset or not
``0``); otherwise it runs these same functions uncompiled (same results, tens to hundreds
of times slower). So the code here keeps to what numba compiles: numpy arrays, scalars,
tuples and the named tuples below, no Python containers.

Data layout:

- resources are small integers (:mod:`~hetplan.algorithms.dp_types`): ``GPU_ID`` the
  compute stream, ``CPU_ID`` the CPU pool, ``2..`` the communication channels;
- a strategy's ops are an :class:`Ops`: flat ``res``/``dur`` arrays with ``start[i]`` /
  ``count[i]`` giving tensor ``i``'s slice;
- a heap entry is a row ``(runnable time, unit ready time, unit, op index)`` of a float64
  ``(cap, 4)`` array, ordered lexicographically like the reference's tuples (``unit`` and
  ``op`` are small integers, exact in float64); entries are distinct, so any binary heap
  pops them in the same order as :mod:`heapq`;
- :class:`Base` holds the problem, the base strategy and the state before every backprop
  segment of the base run (``snap_*``; the two heaps of state ``i`` in a pool at
  ``[roff[i], roff[i + 1])`` / ``[goff[i], goff[i + 1])``), and that run's record;
- :class:`Work` holds a kernel call's scratch arrays (the run's ops, heaps, free times,
  remaining work).

The entry points (:func:`rebase_run`, :func:`trial` and the search loops of
:mod:`~hetplan.algorithms._dp_search`) take a :class:`Base` and :class:`Ops` as named tuples
or as plain tuples of the same fields and name them again inside: numba's dispatcher types
a plain tuple about 2 µs faster per call than a named one (measured: 1.9 against 4.2 µs for a
call with these arguments), and Espresso's sweeps make thousands of calls.

The bound, convergence and release-bound rules are described on
:class:`~hetplan.algorithms.dp_session.DPSession`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from hetplan.algorithms.dp_types import CPU_ID, EPS_BOUND, EPS_RELEASE, GPU_ID, MAX_RESOURCES

#: The functions that are compiled (together: each calls the others compiled).
KERNELS = ("_push", "_pop", "_record", "_has_changed",
           "_same_rows", "_converged", "_run", "new_work", "rebase_run", "_trial", "trial",
           "_suffix_work", "_release_bounds")
#: Helpers compiled without numba's reference counting (``_nrt=False``): they only read and
#: write elements of arrays their caller holds, and counting a reference to each array
#: argument costs two atomic operations per call, which on the heap steps was most of the
#: atomic work of a trial (callgrind on the Espresso pass for GPT-2: 35.5 M instructions in
#: the counters with, 5.6 M without; the compiled code 818 M instructions with, 727 M
#: without).
UNCOUNTED = ("_push", "_pop", "_record", "_has_changed", "_same_rows")


class Ops(NamedTuple):
    """A strategy's ops, flat: tensor ``i``'s are ``res[start[i]:start[i] + count[i]]``
    (resource ids, int64) with durations ``dur[...]`` (float64)."""

    res: np.ndarray
    dur: np.ndarray
    start: np.ndarray
    count: np.ndarray  # type: ignore[assignment]  # shadows tuple.count, unused here


class Base(NamedTuple):
    """A session's problem and base strategy, and the record of the base's run.

    Attributes:
        bp / suffix_bp: backprop before each tensor (``n``), and from each tensor on
            (``n + 1``, right to left).
        fwd / opt: forward and optimizer time.
        base_s: the base's iteration time (what a trial returns once it converges).
        res / dur / start / count: the base strategy's ops (as in :class:`Ops`).
        suffix: ``(n + 1, MAX_RESOURCES)``: work per resource of tensors ``i..n-1``.
        release: ``(n + 1)``: the release bound from each segment on.
        snap_gpu / snap_sync / snap_free / snap_cpu: the state before each segment: GPU
            stream free time, end of the last finished op, channel and CPU worker free times
            (``snap_cpu`` has one column per CPU worker).
        roff / rpool / goff / gpool: that state's runnable heap and GPU queue.
        ev: the base run's op intervals, one row ``(start, end, unit, on a channel)`` per
            op (row = op index in ``res``); ready: each tensor's ready time.
    """

    bp: np.ndarray
    suffix_bp: np.ndarray
    fwd: float
    opt: float
    base_s: float
    res: np.ndarray
    dur: np.ndarray
    start: np.ndarray
    count: np.ndarray  # type: ignore[assignment]  # shadows tuple.count, unused here
    suffix: np.ndarray
    release: np.ndarray
    snap_gpu: np.ndarray
    snap_sync: np.ndarray
    snap_free: np.ndarray
    snap_cpu: np.ndarray
    roff: np.ndarray
    rpool: np.ndarray
    goff: np.ndarray
    gpool: np.ndarray
    ev: np.ndarray
    ready: np.ndarray


class Work(NamedTuple):
    """A kernel call's scratch: the ops of the run (``res``/``dur``/``start``/``count`` as in
    :class:`Ops`: the base's, with room after them for a trial's changed tensors, whose
    ``start``/``count`` a trial points there and restores after), the runnable heap and the
    GPU queue (``(n + 1, 4)`` each: a unit has at most one entry), channel and CPU worker free
    times, the work left per resource (for the trial bound) and a mask of the changed tensors
    (all False between trials)."""

    res: np.ndarray
    dur: np.ndarray
    start: np.ndarray
    count: np.ndarray  # type: ignore[assignment]  # shadows tuple.count, unused here
    run_h: np.ndarray
    gq_h: np.ndarray
    free: np.ndarray
    cpu: np.ndarray
    rem: np.ndarray
    mask: np.ndarray


def new_work(b, extra):
    """Scratch arrays for runs over the base ``b``, with room for ``extra`` ops of changed
    tensors (a trial writes them there instead of copying the base's ops each time)."""
    n = b.bp.shape[0]
    n_base = b.res.shape[0]
    res = np.empty(n_base + extra, dtype=np.int64)
    dur = np.empty(n_base + extra)
    res[:n_base] = b.res
    dur[:n_base] = b.dur
    return Work(res, dur, b.start.copy(), b.count.copy(), np.empty((n + 1, 4)),
                np.empty((n + 1, 4)), np.empty(MAX_RESOURCES), np.empty(b.snap_cpu.shape[1]),
                np.empty(MAX_RESOURCES), np.zeros(n, dtype=np.bool_))


# -- heaps of rows (time, ready, unit, op) ------------------------------------------------


def _push(h, size, t, r, k, j):
    """Add the row ``(t, r, k, j)``; the new size. Rows are ordered by time, then unit. That
    is the order of the whole row ``(time, ready, unit, op)``: a heap holds at most one row
    per unit, and a unit's ready time never decreases with its index (units become ready as
    the backprop segments end, one after another), so on equal times ``ready`` orders the rows
    as ``unit`` does and ``op`` never decides. Sifts up by moving parents down into the hole
    (one row copy per level instead of a swap)."""
    i = size
    while i > 0:
        p = (i - 1) >> 1
        pt = h[p, 0]
        if t < pt or (t == pt and k < h[p, 2]):
            h[i, 0] = pt
            h[i, 1] = h[p, 1]
            h[i, 2] = h[p, 2]
            h[i, 3] = h[p, 3]
            i = p
        else:
            break
    h[i, 0] = t
    h[i, 1] = r
    h[i, 2] = k
    h[i, 3] = j
    return size + 1


def _pop(h, size):
    """Remove the top (the caller has read row 0); the new size. The last row sifts down
    from the root by moving the smaller child up into the hole."""
    size -= 1
    if size > 0:
        t = h[size, 0]
        r = h[size, 1]
        k = h[size, 2]
        j = h[size, 3]
        i = 0
        while True:
            left = 2 * i + 1
            if left >= size:
                break
            m = left
            right = left + 1
            if right < size:  # comparisons written out: compiled, a call to a helper
                rt = h[right, 0]  # passes every field of h (it was most of a pop's time)
                lt = h[left, 0]
                if rt < lt or (rt == lt and h[right, 2] < h[left, 2]):
                    m = right
            mt = h[m, 0]
            if mt < t or (mt == t and h[m, 2] < k):
                h[i, 0] = mt
                h[i, 1] = h[m, 1]
                h[i, 2] = h[m, 2]
                h[i, 3] = h[m, 3]
                i = m
            else:
                break
        h[i, 0] = t
        h[i, 1] = r
        h[i, 2] = k
        h[i, 3] = j
    return size


# -- the event loop -----------------------------------------------------------------------


def _record(ev, o, s, e, k, comm):
    """Op ``o``'s interval: row ``o`` is ``(start, end, unit, 1.0 if on a channel)``."""
    ev[o, 0] = s
    ev[o, 1] = e
    ev[o, 2] = k
    ev[o, 3] = 1.0 if comm else 0.0


def _has_changed(h, hn, mask):
    for x in range(hn):
        if mask[int(h[x, 2])]:
            return True
    return False


def _same_rows(h, hn, pool, start):
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


def _converged(b, w, m, rn, gn, sync_end):
    """Whether a trial's state at the start of segment ``m`` (every changed tensor before
    ``m``, the same GPU time as the base's there) behaves exactly like the base's, so that
    the rest of the run, and the result, are the base's. Times at or before ``now`` are
    equivalent (every remaining op starts after ``now``, and ``max(t, free)`` then gives
    ``t``; ``sync_end`` only meets the backprop end, which is later), and no changed tensor
    may still have ops in flight."""
    # fields as locals: compiled, a field read inside a loop costs a reference count each time
    run_h, gq_h, free, mask = w.run_h, w.gq_h, w.free, w.mask
    rpool, gpool, snap_free = b.rpool, b.gpool, b.snap_free
    r0, g0 = b.roff[m], b.goff[m]
    now = b.snap_gpu[m]
    if max(sync_end, now) != max(b.snap_sync[m], now):
        return False
    if rn != b.roff[m + 1] - r0 or gn != b.goff[m + 1] - g0:
        return False
    # equal heaps have equal tops: a cheap rejection before the full comparison below
    if rn > 0:
        for c in range(4):
            if run_h[0, c] != rpool[r0, c]:
                return False
    if gn > 0:
        for c in range(4):
            if gq_h[0, c] != gpool[g0, c]:
                return False
    for r in range(free.shape[0]):
        if max(free[r], now) != max(snap_free[m, r], now):
            return False
    x = np.sort(np.maximum(w.cpu, now))
    y = np.sort(np.maximum(b.snap_cpu[m], now))
    for i in range(x.shape[0]):
        if x[i] != y[i]:
            return False
    if _has_changed(run_h, rn, mask) or _has_changed(gq_h, gn, mask):
        return False
    return _same_rows(run_h, rn, rpool, r0) and _same_rows(gq_h, gn, gpool, g0)


def _run(b, w, m, changed, bound, rebase):
    """:func:`~hetplan.algorithms.dp_timeline.simulate_dp`'s general event loop (same float
    operations in the same order) over the ops in ``w``, one unit per tensor, resumed from
    the base's state saved before segment ``m``. Returns the iteration time.

    With ``rebase`` (the base run: ``w`` holds the base's ops alone; ``m == 0`` starts empty)
    the state before every segment from ``m`` on is saved into ``b`` (returns ``-1.0`` when a
    heap pool is full), every op's interval into ``b.ev`` and every tensor's ready time into
    ``b.ready``. Otherwise a trial of the tensors ``changed`` (sorted, ``m`` the first; their
    ops in ``w`` and marked in ``w.mask``): with a finite ``bound`` it returns ``inf`` once
    the time is proven above it, and it returns the base's time once its state at a segment
    start after the last changed tensor equals the base's there.

    Resuming, the bound at the resume point and the loop are one function: compiled, every
    call counts references to each array of its arguments, and a trial is short."""
    # every field the loop reads, as a local (see _converged)
    bp = b.bp
    suffix_bp = b.suffix_bp
    release = b.release
    snap_gpu = b.snap_gpu
    snap_sync = b.snap_sync
    snap_free = b.snap_free
    snap_cpu = b.snap_cpu
    roff = b.roff
    goff = b.goff
    rpool = b.rpool
    gpool = b.gpool
    base_s = b.base_s
    ev = b.ev
    ready = b.ready
    res = w.res
    dur = w.dur
    ustart = w.start
    ucount = w.count
    run_h = w.run_h
    gq_h = w.gq_h
    free = w.free
    cpu = w.cpu
    rem = w.rem
    mask = w.mask
    n = bp.shape[0]
    inf = np.inf

    # 1. resume: the state saved before segment m (nothing before a rebase's segment 0)
    if rebase and m == 0:
        roff[0] = 0
        goff[0] = 0
        free[:] = 0.0
        cpu[:] = 0.0
        gpu_free, sync_end, rn, gn = 0.0, 0.0, 0, 0
    else:
        rn = roff[m + 1] - roff[m]
        gn = goff[m + 1] - goff[m]
        run_h[:rn] = rpool[roff[m]:roff[m + 1]]
        gq_h[:gn] = gpool[goff[m]:goff[m + 1]]
        free[:] = snap_free[m]
        cpu[:] = snap_cpu[m]
        gpu_free, sync_end = snap_gpu[m], snap_sync[m]
    next_bp = m
    # changed tensors whose ops have not all finished: the state cannot equal the base's
    # before they have (a cheap pre-check of _converged)
    n_moving = 0
    for x in range(changed.shape[0]):
        if ucount[changed[x]] > 0:
            n_moving += 1
    last_changed = changed[changed.shape[0] - 1] if changed.shape[0] > 0 else n
    use_rem = bound < inf
    limit = bound + EPS_BOUND * max(1.0, abs(bound)) - b.fwd - b.opt
    release_limit = limit + EPS_RELEASE * max(1.0, abs(limit))

    # 2. a trial's lower bound at the resume point: every op still to start starts at or
    # after ``now`` (the GPU stream only starts a segment while every runnable op is later,
    # and later units are ready after it), and a resource's work then runs one op at a time
    # (the GPU's after the remaining backprop too; the CPU's spread over the pool). ``rem``:
    # the in-flight work at the saved state, then the work of the tensors from m on
    if use_rem:
        b_res, b_dur, b_start, b_count = b.res, b.dur, b.start, b.count
        for r in range(rem.shape[0]):
            rem[r] = 0.0
        for x in range(rn):
            k = int(run_h[x, 2])
            for o in range(b_start[k] + int(run_h[x, 3]), b_start[k] + b_count[k]):
                rem[b_res[o]] += b_dur[o]
        for x in range(gn):
            k = int(gq_h[x, 2])
            for o in range(b_start[k] + int(gq_h[x, 3]), b_start[k] + b_count[k]):
                rem[b_res[o]] += b_dur[o]
        suffix = b.suffix
        for r in range(rem.shape[0]):
            rem[r] += suffix[m, r]
        for x in range(changed.shape[0]):
            i = changed[x]
            for o in range(b_start[i], b_start[i] + b_count[i]):
                rem[b_res[o]] -= b_dur[o]
            for o in range(ustart[i], ustart[i] + ucount[i]):
                rem[res[o]] += dur[o]
        now = gpu_free
        end = max(sync_end, now + suffix_bp[m] + rem[GPU_ID])
        for r in range(1, rem.shape[0]):
            d = rem[r]
            if d <= 0.0:
                continue
            if r == CPU_ID:
                acc = 0.0  # left to right
                for x in range(cpu.shape[0]):
                    acc += max(cpu[x], now)
                end = max(end, (acc + d) / cpu.shape[0])
            else:
                end = max(end, max(free[r], now) + d)
        if b.fwd + end + b.opt > bound + EPS_BOUND * max(1.0, abs(bound)):
            return inf

    # 3. the event loop
    bp_end = 0.0
    single_cpu = cpu.shape[0] == 1
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
                if rebase:
                    _record(ev, ustart[k] + j, gpu_free, e, k, False)
                gpu_free = e
                if j + 1 < ucount[k]:
                    rn = _push(run_h, rn, e, r, k, j + 1)
                    if e < horizon:
                        horizon = e
                else:
                    if e > sync_end:
                        sync_end = e
                    if n_moving > 0 and mask[k]:
                        n_moving -= 1
            elif next_bp < n:
                if rebase:
                    i = next_bp
                    if roff[i] + rn > rpool.shape[0] or goff[i] + gn > gpool.shape[0]:
                        return -1.0
                    snap_gpu[i] = gpu_free
                    b.snap_sync[i] = sync_end
                    b.snap_free[i, :] = free
                    b.snap_cpu[i, :] = cpu
                    rpool[roff[i]:roff[i] + rn] = run_h[:rn]
                    roff[i + 1] = roff[i] + rn
                    gpool[goff[i]:goff[i] + gn] = gq_h[:gn]
                    goff[i + 1] = goff[i] + gn
                elif use_rem and next_bp > last_changed \
                        and gpu_free + release[next_bp] > release_limit:
                    return inf  # the work of the tensors from next_bp on
                elif n_moving == 0 and next_bp > last_changed \
                        and gpu_free == snap_gpu[next_bp] \
                        and _converged(b, w, next_bp, rn, gn, sync_end):
                    return base_s
                e = gpu_free + bp[next_bp]
                gpu_free = e
                if rebase:
                    ready[next_bp] = e
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
            x = 0
            if not single_cpu:
                for y in range(1, cpu.shape[0]):
                    if cpu[y] < cpu[x]:
                        x = y
            s = cpu[x]
            if t > s:  # max(t, cpu[x]) as the reference computes it
                s = t
            cpu[x] = s + d
        else:
            s = free[rid]
            if t > s:
                s = t
            free[rid] = s + d
        e = s + d
        if rebase:
            _record(ev, o, s, e, k, rid != CPU_ID)
        if use_rem:
            left = rem[rid]
            if rid != CPU_ID and s + left > limit:
                return inf  # this and the rest of rid's work run one after another
            rem[rid] = left - d
        if j + 1 < ucount[k]:
            rn = _push(run_h, rn, e, r, k, j + 1)
        else:
            if e > sync_end:
                sync_end = e
            if n_moving > 0 and mask[k]:
                n_moving -= 1
    if n == 0:
        bp_end = 0.0
    return b.fwd + max(bp_end, sync_end) + b.opt


# -- entry points -------------------------------------------------------------------------


def rebase_run(base, m, last, nres):
    """Simulate the base's ops from the state saved before segment ``m`` (``m == 0``: the
    empty start), saving the states from ``m`` on into ``base`` (a :class:`Base`, or its
    fields as a plain tuple), and update what the trial bounds read (:func:`_suffix_work`
    from tensor ``last``, the last whose ops changed, down; :func:`_release_bounds`) for
    the resources ``0..nres-1`` (every resource id the session's bases have used: the
    other columns stay 0). Returns the iteration time, or ``-1.0`` when a heap pool is too
    small (the caller grows it and calls again). Every op run is recorded in ``b.ev`` and
    every tensor's ready time from ``m`` on in ``b.ready``: the ops before that state ran as
    recorded by the earlier runs (the prefix is the same), so ``ev`` and ``ready`` always
    hold the whole base run."""
    b = Base(*base)
    f = _run(b, new_work(b, 0), m, np.zeros(0, dtype=np.int64), np.inf, True)
    if f >= 0.0 and b.bp.shape[0] > 0:
        _suffix_work(b, last, nres)
        _release_bounds(b, nres)
    return f


def _trial(b, w, t, changed, bound):
    """One trial: the base with tensor ``changed[x]``'s ops replaced by the slice
    ``[t.start[x], t.start[x] + t.count[x])`` of ``t.res``/``t.dur``; ``inf`` once proven
    longer than ``bound``. ``changed`` is sorted; ``w`` (made by :func:`new_work` with room
    for the new ops) is left as it was, but for its heaps, free times and ``rem``."""
    t_res, t_dur, t_start, t_count = t.res, t.dur, t.start, t.count  # see _converged
    res, dur, start, count, mask = w.res, w.dur, w.start, w.count, w.mask
    pos = b.res.shape[0]  # the changed tensors' ops go after the base's
    for x in range(changed.shape[0]):
        i = changed[x]
        mask[i] = True
        start[i] = pos
        count[i] = t_count[x]
        for y in range(t_count[x]):
            res[pos + y] = t_res[t_start[x] + y]
            dur[pos + y] = t_dur[t_start[x] + y]
        pos += t_count[x]
    f = _run(b, w, changed[0], changed, bound, False)
    b_start, b_count = b.start, b.count
    for x in range(changed.shape[0]):  # back to the base
        i = changed[x]
        mask[i] = False
        start[i] = b_start[i]
        count[i] = b_count[i]
    return f


def trial(base, t, changed, bound):
    """:func:`_trial` with fresh scratch arrays."""
    b = Base(*base)
    t = Ops(*t)
    return _trial(b, new_work(b, t.res.shape[0]), t, changed, bound)


# -- what the trial bounds read -----------------------------------------------------------


def _suffix_work(b, last, nres):
    """``b.suffix[i, r]``: work on resource ``r`` of tensors ``i..n-1``, recomputed from
    tensor ``last`` down (rows after it are kept) for the resources ``r < nres`` (no op of
    the session's bases is on another: those columns stay 0)."""
    res, dur, start, count, suffix = b.res, b.dur, b.start, b.count, b.suffix
    for i in range(last, -1, -1):
        for r in range(nres):
            suffix[i, r] = suffix[i + 1, r]
        for o in range(start[i], start[i] + count[i]):
            suffix[i, res[o]] += dur[o]


def _release_bounds(b, nres):
    """``b.release[m]``: a lower bound on ``end - now`` (end of the last op, ``now`` the
    GPU's time at the start of segment ``m``) from the work of tensors ``m..n-1`` alone.
    Tensor ``k`` is ready no earlier than ``now + bp[m] + ... + bp[k]``; on a channel all
    work of tensors ``>= k`` (``b.suffix[k]``, as :func:`_suffix_work` leaves it) starts no
    earlier than that plus the shortest lead (ops before a tensor's first op there) and runs
    one op at a time, and the op that ends last is followed by its tensor's tail (ops after
    its last op there): so ``end >= ready_k + lead + work + tail``. On the CPU pool the work
    is spread over the workers. Only the resources ``r < nres`` are looked at (the others
    have no ops: their lead stays infinite and they add nothing)."""
    bp, res, dur, start, count, suffix = b.bp, b.res, b.dur, b.start, b.count, b.suffix
    out = b.release
    workers = b.snap_cpu.shape[1]
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
        for o in range(start[k], start[k] + count[k]):
            r = res[o]
            if r != GPU_ID and not has[r]:
                has[r] = True
                first[r] = pre
            pre += dur[o]
        post = 0.0
        for o in range(start[k] + count[k] - 1, start[k] - 1, -1):
            r = res[o]
            if r != GPU_ID and not got[r]:
                got[r] = True
                last[r] = post
            post += dur[o]
        for r in range(nres):
            if has[r]:
                lead[r] = min(lead[r], first[r])
                tail[r] = min(tail[r], last[r])
                has[r] = False
                got[r] = False
            if lead[r] < inf:
                x = suffix[k, r] / workers if r == CPU_ID else suffix[k, r]
                span = lead[r] + x + tail[r]
                if before + span > best:
                    best = before + span
        before -= bp[k]
        out[k] = best - before  # before = bp[0] + ... + bp[k-1]
