"""The resumable data-parallel timeline for searches: :class:`DPSession` on the kernels.

Searches that score thousands of candidates, each changing a few tensors of a base strategy
(Espresso's Algorithms 4.1 and 4.2), cannot afford a full
:func:`~hetplan.algorithms.dp_timeline.simulate_dp` per candidate. A session simulates the
base once, keeps the simulator's state before every backprop segment, and resumes each trial
from the first changed tensor. The event loop and the search loops are the kernels of
:mod:`hetplan.algorithms._dp_kernels` and :mod:`hetplan.algorithms._dp_search`: compiled
with numba when it is available, otherwise the same functions run uncompiled (same results
bit for bit, much slower):

- ``HETPLAN_JIT=0`` runs them uncompiled on purpose;
- when numba is missing or cannot compile or cache them, :func:`jit_enabled` logs a warning
  once and :func:`jit_error` says why;
- :func:`warm_up` compiles them ahead (``scripts/setup.sh``), or loads numba's on-disk cache.
"""

from __future__ import annotations

import logging
import threading
import types
from collections.abc import Sequence
from typing import Any

import numpy as np

from hetplan.algorithms import _dp_kernels, _dp_search
from hetplan.algorithms._jit_env import jit_switched_off
from hetplan.algorithms._dp_kernels import Base, Ops
from hetplan.algorithms.dp_types import CPU, GPU, MAX_RESOURCES, Op, ResourceIds

__all__ = ["DPSession", "jit_enabled", "jit_error", "warm_up"]

_MODULES = (_dp_kernels, _dp_search)
#: The kernels as plain functions: what runs uncompiled.
_PLAIN = types.SimpleNamespace(**{n: getattr(m, n) for m in _MODULES for n in m.KERNELS})
_COMPILED: list[types.SimpleNamespace] = []  # the compiled kernels, once built
_JIT_ERROR: list[str] = []  # why the kernels could not be compiled, once known
#: Held while a session gives resource names their ids: sessions that share ids
#: (``share``) may run on several threads (``espresso.select(parallel=True)``), and a new
#: name's id is the table's length when it is added.
_RID_LOCK = threading.Lock()


def _compile() -> types.SimpleNamespace:
    """The kernels compiled with ``numba.njit(cache=True)``: each function is copied with a
    copy of its module's namespace in which every kernel is the compiled one, so compiled
    kernels call compiled kernels (the modules themselves keep the plain functions; numba's
    global ``DISABLE_JIT`` cannot give both in one process, which the tests need)."""
    import numba

    spaces = [dict(vars(m)) for m in _MODULES]
    compiled = {}
    for mod, glb in zip(_MODULES, spaces):
        for name in mod.KERNELS:
            f = glb[name]
            copy = types.FunctionType(f.__code__, glb, f.__name__, f.__defaults__,
                                      f.__closure__)
            copy.__qualname__ = f.__qualname__
            copy.__doc__ = f.__doc__
            # helpers that only touch elements of arrays their caller holds skip reference
            # counting (see _dp_kernels.UNCOUNTED); every kernel releases the GIL, so that
            # searches on other threads run meanwhile (it reads and writes only the arrays
            # it is given, which no other thread writes)
            counted = name not in _dp_kernels.UNCOUNTED
            compiled[name] = numba.njit(cache=True, nogil=True, _nrt=counted)(copy)
    for glb in spaces:  # compiled when first called: every name is set by then
        glb.update((name, k) for name, k in compiled.items() if name in glb)
    return types.SimpleNamespace(**compiled)


def jit_enabled() -> bool:
    """Whether sessions run the compiled kernels by default: ``HETPLAN_JIT`` is not ``0``
    and numba is installed and can cache them (compilation itself happens at a kernel's
    first call, or in :func:`warm_up`). When it is not, the kernels run uncompiled and
    :func:`jit_error` says why."""
    if jit_switched_off():
        return False
    return _kernels(True) is not _PLAIN


def jit_error() -> str | None:
    """Why the compiled kernels are not in use (None when they are, or were never tried)."""
    return _JIT_ERROR[0] if _JIT_ERROR else None


def _kernels(jit: bool) -> Any:
    """The compiled kernels when ``jit`` and they can be built, else the plain ones."""
    if not jit or _JIT_ERROR:
        return _PLAIN
    if not _COMPILED:
        try:
            _COMPILED.append(_compile())
        except Exception as e:  # ImportError without numba; RuntimeError without a cache dir
            _JIT_ERROR.append(f"{type(e).__name__}: {e}")
            logging.getLogger("hetplan").warning(
                "the simulator kernels could not be compiled (%s); running them uncompiled "
                "(same results, much slower); install numba, or set HETPLAN_JIT=0 to silence "
                "this", _JIT_ERROR[0])
            return _PLAIN
    return _COMPILED[0]


class DPSession:
    """Fast, resumable :func:`~hetplan.algorithms.dp_timeline.simulate_dp` for one sync unit
    per tensor (unit ``i`` ends at tensor ``i``), for searches that change a few tensors'
    ops at a time (Espresso).

    :meth:`rebase` simulates a *base* strategy and keeps the simulator's state at the start
    of every backprop segment. That state depends only on the ops of the earlier tensors:
    unit ``i`` enters the timeline when segment ``i`` ends, and the event order is a fixed
    function of the state. :meth:`trial` therefore resumes from the state at the first
    tensor whose ops differ from the base and replays the same float operations in the same
    order as ``simulate_dp``'s general event loop: its result equals
    ``simulate_dp(...).iteration_s`` bit for bit (``tests/unit/test_timeline_session.py``
    checks this on random instances, with and without GPU and CPU ops, compiled and not).

    With ``bound`` a trial may stop early and return ``inf`` once the iteration is proven
    longer than ``bound``: the lower bound ``max over resources r of (r's free time + the
    work still to start on r)`` (the GPU counts the remaining backprop too; CPU work is spread
    over the pool) is checked at the resume point, ``op start + the work on its resource
    from this op on`` (plus the remaining backprop for the GPU) at every channel and GPU op,
    and the release bound of the later tensors' work (``_dp_kernels._release_bounds``) at
    every segment start after the changed tensors. A returned finite value is always exact.
    A trial also stops, returning the base's time, when its state at a segment start after
    every changed tensor is equivalent to the base's there (``_dp_kernels._converged``): the
    rest of the run is then the base's.

    Args:
        backprop_s: backprop time before each tensor becomes ready.
        forward_s / optimizer_s / cpu_workers: as for ``simulate_dp``.
        jit: run the compiled kernels (default: :func:`jit_enabled`); False runs the same
            kernels uncompiled.
        share: an earlier session of the same problem whose caches of ops converted to
            arrays this one uses too (sessions of one problem see the same op tuples; the
            resource ids only name the channels), and whose heap pools' size this one starts
            with (a pool that fills up is doubled and the base run repeated: a search's
            fresh sessions would each grow theirs again). No effect on results.
    """

    __slots__ = ("_k", "_n", "_workers", "_rid", "_conv", "_packed", "_pools", "_ops",
                 "_valid", "_b",
                 "_bt", "trials")

    def __init__(
        self,
        backprop_s: Sequence[float],
        *,
        forward_s: float = 0.0,
        optimizer_s: float = 0.0,
        cpu_workers: int = 1,
        jit: bool | None = None,
        share: DPSession | None = None,
    ) -> None:
        if cpu_workers < 1:
            raise ValueError(f"cpu_workers must be >= 1, got {cpu_workers}")
        self._k = _kernels(jit_enabled() if jit is None else jit)
        bp = [float(b) for b in backprop_s]
        n = self._n = len(bp)
        suffix_bp = [0.0] * (n + 1)
        for i in range(n - 1, -1, -1):  # right to left, the order the kernels assume
            suffix_bp[i] = suffix_bp[i + 1] + bp[i]
        self._workers = int(cpu_workers)
        self._rid: ResourceIds
        self._conv: dict[int, tuple[tuple[Op, ...], np.ndarray, np.ndarray]]  # id(ops) ->
        self._packed: dict[tuple[int, ...], tuple[Any, ...]]  # candidate lists, packed
        self._pools: dict[int, int]  # tensors -> rows of the largest heap pool needed
        if share is not None:
            self._rid, self._conv, self._packed = share._rid, share._conv, share._packed
            self._pools = share._pools
        else:
            self._rid, self._conv, self._packed, self._pools = ResourceIds(), {}, {}, {}
        rows = max(4 * n + 16, self._pools.get(n, 0))
        self.trials = 0  # trials run by best_offload
        self._ops: list[tuple[Op, ...]] = []
        self._valid = False
        r = MAX_RESOURCES
        self._set_base(Base(
            bp=np.array(bp, dtype=np.float64), suffix_bp=np.array(suffix_bp, dtype=np.float64),
            fwd=float(forward_s), opt=float(optimizer_s), base_s=0.0,
            res=np.zeros(0, dtype=np.int64), dur=np.zeros(0), start=np.zeros(n, dtype=np.int64),
            count=np.zeros(n, dtype=np.int64),
            suffix=np.zeros((n + 1, r)), release=np.zeros(n + 1),
            snap_gpu=np.zeros(n + 1), snap_sync=np.zeros(n + 1),
            snap_free=np.zeros((n + 1, r)), snap_cpu=np.zeros((n + 1, self._workers)),
            # the heap pools are not zeroed: the kernels read only the rows [roff[i],
            # roff[i + 1]) a base run wrote (zeroing the grown pools, 2.6 MB each for
            # resnet101, took 0.1-1.5 ms a session)
            roff=np.zeros(n + 2, dtype=np.int64), rpool=np.empty((rows, 4)),
            goff=np.zeros(n + 2, dtype=np.int64), gpool=np.empty((rows, 4)),
            ev=np.zeros((0, 4)), ready=np.zeros(n)))

    def _set_base(self, b: Base) -> None:
        """Keep ``b``, and its fields as a plain tuple, which is what the kernels are passed
        (see :mod:`~hetplan.algorithms._dp_kernels`: cheaper to dispatch)."""
        self._b = b
        self._bt = tuple(b)

    @property
    def base_s(self) -> float:
        """The base strategy's iteration time."""
        return self._b.base_s

    @property
    def base_ops(self) -> list[tuple[Op, ...]]:
        """The base strategy's ops per tensor (do not modify)."""
        return self._ops

    @property
    def compiled(self) -> bool:
        """Whether this session runs the compiled kernels."""
        return self._k is not _PLAIN

    def _arrays_of(self, many: Sequence[tuple[Op, ...]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """(resource ids, durations) of each ops tuple in ``many``, cached per tuple; the
        ones not cached yet are converted together (two numpy arrays for all of them, each
        tuple's a slice)."""
        conv = self._conv
        out: list[Any] = []
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
        with _RID_LOCK:
            ids = [rid[op.resource] for _, ops in missing for op in ops]
        durs = [op.duration_s for _, ops in missing for op in ops]
        res = np.array(ids, dtype=np.int64)
        dur = np.array(durs, dtype=np.float64)
        at = 0
        for x, ops in missing:
            k = len(ops)
            out[x] = (res[at:at + k], dur[at:at + k])
            conv[id(ops)] = (ops, *out[x])
            at += k
        return out

    def register(self, rows: Sequence[tuple[Op, ...]], resources: Sequence[str],
                 durations: np.ndarray) -> None:
        """Give ops tuples their arrays ahead, without converting them op by op: every
        tuple of ``rows`` has one op per entry of ``resources`` (the resource names, in
        order), and ``durations[x]`` (float64, one row per tuple) holds tuple ``x``'s
        durations, the same doubles as its ops'. Sessions sharing this one's caches
        (``share``) find them there. No effect on results; the caller keeps the tuples
        alive as long as it registers them (the cache is keyed by their ids and holds them)."""
        if durations.shape != (len(rows), len(resources)):
            raise ValueError(f"durations of shape {durations.shape} for {len(rows)} tuples "
                             f"of {len(resources)} ops")
        with _RID_LOCK:
            ids = np.array([self._rid[r] for r in resources], dtype=np.int64)
        conv = self._conv
        for ops, row in zip(rows, durations):
            conv[id(ops)] = (ops, ids, row)

    def _pack(self, unit_ops: Sequence[tuple[Op, ...]]) -> Ops:
        """``unit_ops`` as one :class:`~hetplan.algorithms._dp_kernels.Ops`."""
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
        return Ops(res, dur, starts, counts)

    def rebase(self, unit_ops: Sequence[tuple[Op, ...]]) -> float:
        """Simulate ``unit_ops`` (one ops tuple per tensor) as the new base; its iteration time.

        Only the tensors from the first one whose ops differ from the current base's are
        re-simulated (the saved states before it do not depend on them), from that state."""
        n = self._n
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
                return self._b.base_s
            while new[last] is old[last] or new[last] == old[last]:
                last -= 1
        return self._rebase(new, m, last)

    def replace(self, j: int, ops: tuple[Op, ...]) -> float:
        """:meth:`rebase` on the base with tensor ``j``'s ops replaced by ``ops`` (the same
        states and time), without comparing the other tensors' ops."""
        self._check([j])
        if not self._valid:
            raise ValueError("replace needs a base: rebase the session first")
        old = self._ops[j]
        new = list(self._ops)
        new[j] = ops
        if ops is old or ops == old:
            self._ops = new
            return self._b.base_s
        # splice tensor j's new ops into the base arrays (what _rebase does for a range,
        # without packing a list of one)
        b = self._b
        res, dur = self._arrays_of([ops])[0]
        lo = int(b.start[j])
        hi = lo + int(b.count[j])
        count = b.count.copy()
        count[j] = len(ops)
        start = b.start
        if len(ops) != hi - lo:
            start = start.copy()
            start[j + 1:] += len(ops) - (hi - lo)
        self._ops = new
        return self._run_base(b._replace(
            res=np.concatenate((b.res[:lo], res, b.res[hi:])),
            dur=np.concatenate((b.dur[:lo], dur, b.dur[hi:])), start=start, count=count,
            ev=np.concatenate((b.ev[:lo], np.zeros((len(ops), 4)), b.ev[hi:]))), j, j)

    def _rebase(self, new: list[tuple[Op, ...]], m: int, last: int) -> float:
        """The new base ``new``, whose tensors before ``m`` and after ``last`` have the current
        base's ops (all of them re-simulated when the base is not valid yet)."""
        n = self._n
        b = self._b
        if self._valid and n:
            # splice the changed tensors' ops into the base arrays
            part = self._pack(new[m:last + 1])
            lo = b.start[m]
            hi = b.start[last] + b.count[last]
            count = b.count.copy()
            count[m:last + 1] = part.count
            start = np.zeros(n, dtype=np.int64)
            np.cumsum(count[:-1], out=start[1:])
            ops = Ops(np.concatenate((b.res[:lo], part.res, b.res[hi:])),
                      np.concatenate((b.dur[:lo], part.dur, b.dur[hi:])), start, count)
            ev = np.concatenate((b.ev[:lo], np.zeros((len(part.res), 4)), b.ev[hi:]))
        else:
            b.suffix[:] = 0.0
            ops = self._pack(new)
            ev = np.zeros((len(ops.res), 4))
        self._ops = new
        return self._run_base(b._replace(res=ops.res, dur=ops.dur, start=ops.start,
                                         count=ops.count, ev=ev), m, last)

    def _run_base(self, b: Base, m: int, last: int) -> float:
        """Run the base ``b`` (its ops set, its states before segment ``m`` valid) from
        segment ``m``, ``last`` the last tensor whose ops changed; keep it; its time."""
        n = self._n
        while True:
            f = self._k.rebase_run(tuple(b), m, last, len(self._rid))
            if f >= 0.0:
                break
            # a heap pool is full: grow both, keeping the saved states
            b = b._replace(rpool=_grown(b.rpool), gpool=_grown(b.gpool))
            self._pools[n] = max(b.rpool.shape[0], b.gpool.shape[0])
        self._set_base(b._replace(base_s=float(f)))
        self._valid = True
        return self._b.base_s

    def _check(self, idx: Sequence[int]) -> None:
        if idx and (min(idx) < 0 or max(idx) >= self._n):
            raise ValueError(f"tensor index outside 0..{self._n - 1}: {sorted(idx)}")

    def trial(self, changes: dict[int, tuple[Op, ...]], *, bound: float = float("inf")) -> float:
        """Iteration time of the base strategy with tensor ``i``'s ops replaced by
        ``changes[i]``; ``inf`` when ``bound`` is finite and the time is proven > ``bound``."""
        if not changes:
            return self._b.base_s
        idx = sorted(changes)
        self._check(idx)
        t = self._pack([changes[i] for i in idx])
        return float(self._k.trial(self._bt, tuple(t), np.array(idx, dtype=np.int64),
                                   float(bound)))

    def best_option(self, j: int, candidates: Sequence[tuple[Op, ...]], backs: Sequence[bool],
                    best: float, eps: float) -> tuple[int, float]:
        """Algorithm 4.1's ``GetBestOption`` for tensor ``j``: try ``candidates`` (ops lists)
        in order; candidate ``c`` is kept when its time is below ``best - eps``, or at most
        ``best + eps`` when ``backs[c]`` (the baseline option, preferred on a tie). Each trial
        is bounded by what it must beat. Returns ``(index of the kept candidate or -1, its
        time or best)``."""
        if not candidates:
            return -1, best
        self._check([j])
        sig = tuple(id(o) for o in candidates)
        packed = self._packed.get(sig)
        if packed is None or packed[0] != candidates:  # the ids' tuples may have been freed
            packed = self._packed[sig] = (list(candidates), tuple(self._pack(candidates)))
        idx, f = self._k.best_option(self._bt, j, packed[1], np.array(backs, dtype=np.bool_),
                                     float(best), float(eps))
        return int(idx), float(f)

    @property
    def pack_scope(self) -> object:
        """What :meth:`pack`'s result depends on besides the ops (the resource ids): equal
        (``is``) for sessions that can use each other's packed candidates."""
        return self._rid

    def pack(self, candidates: Sequence[tuple[Op, ...]]) -> tuple[Any, ...]:
        """``candidates`` (ops lists) packed for :meth:`best_packed`, valid for the sessions
        that share this one's resource ids (``share``): a caller that tries one list many
        times packs it once."""
        return (self._rid, tuple(self._pack(candidates)))

    def best_packed(self, j: int, packed: tuple[Any, ...], backs: np.ndarray, best: float,
                    eps: float) -> tuple[int, float]:
        """:meth:`best_option` on candidates :meth:`pack` made (``backs`` a bool array, one
        entry per candidate): the same trials and result."""
        rid, ops = packed
        if rid is not self._rid:
            raise ValueError("candidates packed by a session with other resource ids: pack "
                             "them with this session (or one it shares with)")
        if len(backs) != len(ops[2]):
            raise ValueError(f"{len(backs)} baseline flags for {len(ops[2])} candidates")
        if not len(backs):
            return -1, best
        if not 0 <= j < self._n:
            self._check([j])
        idx, f = self._k.best_option(self._bt, j, ops, backs, float(best), float(eps))
        return int(idx), float(f)

    def best_classes(self, class_idx: Sequence[int],
                     strategies: Sequence[Sequence[tuple[Op, ...]]]) -> tuple[int, float]:
        """The fastest of whole strategies given per class of tensors: in strategy ``s``
        tensor ``i`` gets the ops ``strategies[s][class_idx[i]]`` (e.g. uniform strategies,
        tensors of one size sharing their ops). Each trial is bounded by the best so far; the
        first of equals wins. Returns ``(index, time)``; ``(-1, inf)`` without strategies."""
        n = self._n
        if len(class_idx) != n:
            raise ValueError(f"{len(class_idx)} class indices for {n} tensors: one per tensor")
        if not strategies:
            return -1, float("inf")
        if any(len(sd) != len(strategies[0]) for sd in strategies):
            raise ValueError("best_classes: every strategy needs ops for the same classes")
        if n == 0:
            return 0, self._b.base_s
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
        idx, f = self._k.best_classes(self._bt, np.asarray(class_idx, dtype=np.int64), s_res,
                                      s_dur, s_cnt)
        return int(idx), float(f)

    def best_tables(self, class_idx: Sequence[int],
                    strategies: Sequence[tuple[Sequence[str], np.ndarray]]) -> tuple[int, float]:
        """:meth:`best_classes` with each strategy given as one table: ``(resources,
        durations)``, class ``c``'s ops being those resources with the durations of row
        ``c`` (``durations[c]``, float64). The same trials as :meth:`best_classes` on the
        ops tuples those tables hold, without a tuple per class."""
        n = self._n
        if len(class_idx) != n:
            raise ValueError(f"{len(class_idx)} class indices for {n} tensors: one per tensor")
        if not strategies:
            return -1, float("inf")
        classes = strategies[0][1].shape[0]
        if any(d.shape != (classes, len(r)) for r, d in strategies):
            raise ValueError("best_tables: every strategy needs a row per class and a "
                             "duration per resource")
        if n and not 0 <= min(class_idx) <= max(class_idx) < classes:
            raise ValueError(f"class index {max(class_idx)} or {min(class_idx)} outside the "
                             f"tables' {classes} rows")
        if n == 0:
            return 0, self._b.base_s
        width = max(1, max(len(r) for r, _ in strategies))
        s_res = np.zeros((len(strategies), classes, width), dtype=np.int64)
        s_dur = np.zeros((len(strategies), classes, width))
        s_cnt = np.empty((len(strategies), classes), dtype=np.int64)
        rid = self._rid
        for s, (res, dur) in enumerate(strategies):
            k = len(res)
            with _RID_LOCK:
                s_res[s, :, :k] = [rid[r] for r in res]
            s_dur[s, :, :k] = dur
            s_cnt[s] = k
        idx, f = self._k.best_classes(self._bt, np.asarray(class_idx, dtype=np.int64), s_res,
                                      s_dur, s_cnt)
        return int(idx), float(f)

    def best_offload(self, groups: Sequence[Sequence[int]],
                     offloaded: dict[int, tuple[Op, ...]], best: float, eps: float,
                     exhaustive: bool = True) -> tuple[list[int], float]:
        """Algorithm 4.2 over offloading vectors ``u`` (``0 <= u[g] <= len(groups[g])``;
        ``u`` replaces the ops of the first ``u[g]`` tensors of each group by
        ``offloaded[i]``). A vector is kept when its time is below ``best - eps``, each trial
        bounded by that. With ``exhaustive``, every vector in :func:`itertools.product` order
        (Theorem 4.1; the first of equals wins); otherwise coordinate descent: one group's
        count at a time, repeated until no group changes (``_dp_search.next_offload``).
        Returns ``(u, its time)``, ``u`` all zeros when none beats ``best``."""
        members = [i for g in groups for i in g]
        if not members:
            return [0] * len(groups), best
        self._check(members)
        o = self._pack([offloaded[i] for i in members])
        u, f, trials = self._k.best_offload(
            self._bt, np.array([len(g) for g in groups], dtype=np.int64),
            np.array(members, dtype=np.int64), tuple(o), float(best), float(eps),
            bool(exhaustive))
        self.trials += int(trials)
        return [int(x) for x in u], float(f)

    def before_bubbles(self, eps: float) -> set[int]:
        """Tensors of the base communicated before its last communication busy period (see
        :func:`~hetplan.algorithms.dp_timeline.before_last_busy_period`), from the base
        run's record."""
        if eps < 0:
            raise ValueError(f"before_bubbles needs eps >= 0, got {eps}")
        if not self._n:
            return set()
        return {int(i) for i in np.flatnonzero(self.bubble_mask(eps))}

    def bubble_mask(self, eps: float) -> np.ndarray:
        """:meth:`before_bubbles` as a bool array, one entry per tensor."""
        if eps < 0:
            raise ValueError(f"before_bubbles needs eps >= 0, got {eps}")
        if not self._n:
            return np.zeros(0, dtype=np.bool_)
        return np.asarray(self._k.bubble_mask(self._b.ev, self._b.ready, float(eps)),
                          dtype=np.bool_)


def _grown(pool: np.ndarray) -> np.ndarray:
    out = np.empty((2 * pool.shape[0], 4))  # rows past the copy are written before read
    out[:pool.shape[0]] = pool
    return out


def warm_up() -> bool:
    """Compile (or load from numba's on-disk cache) every kernel by running each once on a
    two-tensor problem; ``scripts/setup.sh`` calls it so that the first plan does not wait
    for the compiler. Returns whether the compiled kernels are in use."""
    if not jit_enabled():
        return False
    s = DPSession([1.0, 1.0], jit=True)
    s.rebase([(Op("net", 2.0),), (Op(GPU, 0.5), Op("net", 1.0))])
    s.trial({0: (Op("net", 3.0),)}, bound=9.0)
    s.best_option(1, [(Op("net", 0.1),)], [False], s.base_s, 1e-9)
    s.best_offload([[0]], {0: (Op(CPU, 1.0),)}, 9.0, 1e-9)
    s.best_offload([[0]], {0: (Op(CPU, 1.0),)}, 9.0, 1e-9, exhaustive=False)
    s.best_classes([0, 0], [[(Op("net", 1.0),)]])
    s.before_bubbles(1e-9)
    return True
