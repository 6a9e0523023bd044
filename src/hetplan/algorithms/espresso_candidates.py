"""Algorithm 4.1's candidate lists: what each tensor's ``GetBestOption`` simulates.

:class:`Candidates` decides, per tensor and the option it holds, which of its options a sweep
of :func:`~hetplan.algorithms.espresso.gpu_decisions` tries (distinct ops only, step-for-step
dominance, the resource-footprint skip; see that module's docstring), once per class of
tensors sharing their ops, from the ops tuples or, with ``SelectionProblem.ops_table``, from
whole cost tables (:mod:`~hetplan.algorithms.espresso_tables`); it also keeps the lists of
the candidate screen and each list packed for the session, so that a sweep builds each once.
Split from :mod:`hetplan.algorithms.espresso` (the selection itself) to keep both readable.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from hetplan.algorithms.dp_session import DPSession
from hetplan.algorithms.dp_types import CPU, GPU, Op
from hetplan.algorithms.espresso_tables import OpsTable, keep_by_row

__all__ = ["Candidates", "EPS"]

K = TypeVar("K", bound=Hashable)


class SelectionProblem(Protocol[K]):
    """What the candidate lists read of :class:`hetplan.algorithms.espresso.SelectionProblem`
    (its fields of the same names)."""

    @property
    def baseline(self) -> Sequence[K]: ...
    @property
    def gpu_options(self) -> Sequence[Sequence[K]]: ...
    @property
    def ops(self) -> Callable[[int, K], tuple[Op, ...]]: ...
    @property
    def ops_class(self) -> Sequence[Hashable] | None: ...
    @property
    def ops_fields(self) -> Callable[[tuple[Op, ...]], Hashable] | None: ...
    @property
    def ops_table(self) -> Callable[[K], OpsTable] | None: ...
    @property
    def table_rows(self) -> Sequence[int] | None: ...

#: Algorithm 4.1's tolerance: a candidate is kept when faster by more than this (seconds),
#: the baseline on a tie within it; the footprint skip compares with it too.
EPS = 1e-9


#: A candidate of one tensor: (option, its ops, their (communication, GPU, CPU) busy time,
#: the identity of the ops' values).
_Cand = tuple[K, tuple[Op, ...], tuple[float, float, float], Hashable]
#: The candidates of one tensor that Algorithm 4.1 simulates: (options, their ops, baseline?).
_Tried = tuple[list[K], list[tuple[Op, ...]], list[bool]]


_FIELDS = operator.attrgetter("resource", "duration_s", "label")
_RESOURCE = operator.attrgetter("resource")
_DURATION = operator.attrgetter("duration_s")


def _footprint(ops: tuple[Op, ...]) -> tuple[float, float, float]:
    """(communication, GPU, CPU) busy time of a tensor's ops."""
    comm = gpu = cpu = 0.0
    for op in ops:
        if op.resource == GPU:
            gpu += op.duration_s
        elif op.resource == CPU:
            cpu += op.duration_s
        else:
            comm += op.duration_s
    return comm, gpu, cpu


def _dominated(cand: tuple[float, float, float], cur: tuple[float, float, float]) -> bool:
    return all(c >= k - EPS for c, k in zip(cand, cur))


class Candidates(Generic[K]):
    """Each tensor's distinct candidates for Algorithm 4.1, baseline first, in option order
    (the first option of equal ops stands for them), each as ``(option, ops, footprint)``.
    With ``prune``, a candidate whose ops are another candidate's ops step for step (same
    resources in the same order) with every step at least as long, and one longer, is not
    tried (the baseline always is). Computed once per distinct list of candidate ops, and,
    with ``ops_class``, once per class of tensors. One instance serves one :func:`select`
    (both of its sweeps); the problem must not change while it is in use."""

    def __init__(self, problem: SelectionProblem[K], prune: bool) -> None:
        self._problem = problem
        self.prune = prune
        self._cache: dict[tuple[Hashable, ...], list[int]] = {}
        self._fp: dict[Hashable, tuple[float, float, float]] = {}  # value identity -> footprint
        # (class, baseline) -> (the option list it was computed for, the candidates)
        self._by_class: dict[tuple[Hashable, K], tuple[Sequence[K], list[_Cand[K]]]] = {}
        # (class, baseline, current option) -> (the option list it was made from, tried)
        self._tried: dict[tuple[Hashable, K, K], tuple[Sequence[K], _Tried[K]]] = {}
        # with ops_table: baseline -> (the option list, its tables (baseline first), kept
        # indices per row, row -> candidates)
        self._rows: dict[K, tuple[Sequence[K], list[OpsTable], list[list[int]],
                                  dict[int, list[_Cand[K]]]]] = {}
        # id of such a candidate list -> (the list, identities, footprints [m, 3])
        self._arrays: dict[int, tuple[list[_Cand[K]], np.ndarray, np.ndarray]] = {}
        # id of a tried ops list -> (the list, its baseline flags, packed, the flags' array)
        self._packs: dict[int, tuple[list[tuple[Op, ...]], list[bool], tuple[Any, ...],
                                     np.ndarray]] = {}
        # (id of a tried options list, the screen's version of its class) -> (the list,
        # the screened lists)
        self._screens: dict[tuple[int, int], tuple[list[K], _Tried[K]]] = {}
        self._versions = 0
        self._lock = threading.Lock()

    def next_version(self, count: int) -> int:
        """The first of ``count`` numbers no earlier call returned (screen versions), also
        when two sweeps on two threads ask at once (``select(parallel=True)``; the other
        caches are filled with equal values whichever thread fills them)."""
        with self._lock:
            first = self._versions
            self._versions += count
        return first

    def packed(self, sess: DPSession, cands: list[tuple[Op, ...]], backs: list[bool]
               ) -> tuple[tuple[Any, ...], np.ndarray]:
        """``cands`` packed for ``sess.best_packed`` once per list (lists from :meth:`tried`
        and :meth:`screened` are kept and not modified), with ``backs`` as an array."""
        got = self._packs.get(id(cands))
        if (got is None or got[0] is not cands or got[1] is not backs
                or got[2][0] is not sess.pack_scope):
            got = self._packs[id(cands)] = (cands, backs, sess.pack(cands),
                                            np.array(backs, dtype=np.bool_))
        return got[2], got[3]

    def screened(self, tried: _Tried[K], keep: set[K], version: int) -> _Tried[K]:
        """:func:`_screened` of ``tried`` (a :meth:`tried` result) to ``keep``, once per
        (list, ``version``): the caller bumps ``version`` whenever ``keep`` grows."""
        key = (id(tried[0]), version)
        got = self._screens.get(key)
        if got is None or got[0] is not tried[0]:
            got = self._screens[key] = (tried[0], _screened(*tried, keep))
        return got[1]

    def candidates(self, j: int) -> list[_Cand[K]]:
        p = self._problem
        if p.ops_table is not None and p.table_rows is not None:
            return self._from_table(j, p.ops_table, p.table_rows)
        if p.ops_class is None:
            return self._compute(j)
        cls = (p.ops_class[j], p.baseline[j])
        got = self._by_class.get(cls)
        if got is None or got[0] is not p.gpu_options[j]:
            got = self._by_class[cls] = (p.gpu_options[j], self._compute(j))
        return got[1]

    def tried(self, j: int, current: K) -> _Tried[K]:
        """What Algorithm 4.1 simulates for tensor ``j`` while it holds ``current``: the
        candidates (``(options, ops, is the baseline)``) other than ``current``'s own ops
        and, with ``prune``, other than those no shorter than it on every resource (see
        :func:`gpu_decisions`). With ``ops_class``, computed once per (class, current
        option): every tensor of a class starts a sweep on the same option when the start
        is uniform. The lists are shared: do not modify them."""
        p = self._problem
        key = None
        if p.ops_class is not None:
            key = (p.ops_class[j], p.baseline[j], current)
            got = self._tried.get(key)
            # made from this option list (its candidates are then the same)
            if got is not None and got[0] is p.gpu_options[j]:
                return got[1]
        cands = self.candidates(j)
        cur_ops = p.ops(j, current)
        cur_sig = self._sig(cur_ops)
        cur_fp = self._footprint(cur_sig, cur_ops)
        keys: list[K] = []
        ops_list: list[tuple[Op, ...]] = []
        arrays = self._arrays.get(id(cands))
        if arrays is not None and arrays[0] is cands:  # the table's lists: numpy filters
            keep = arrays[1] != cur_sig
            if self.prune:  # _dominated, element for element
                keep &= ~(arrays[2] >= np.array(cur_fp) - EPS).all(axis=1)
            for x in np.flatnonzero(keep).tolist():
                keys.append(cands[x][0])
                ops_list.append(cands[x][1])
        else:
            for cand, ops, fp, sg in cands:
                if sg == cur_sig or (self.prune and _dominated(fp, cur_fp)):
                    continue
                keys.append(cand)
                ops_list.append(ops)
        out = (keys, ops_list, [k == p.baseline[j] for k in keys])
        if key is not None:
            self._tried[key] = (p.gpu_options[j], out)
        return out

    def _from_table(self, j: int, table: Callable[[K], OpsTable], rows: Sequence[int]
                    ) -> list[_Cand[K]]:
        """:meth:`_compute`'s list for tensor ``j`` from the filter of every row at once
        (:func:`~hetplan.algorithms.espresso_tables.keep_by_row`), made once per (option
        list, baseline)."""
        p = self._problem
        base, opts = p.baseline[j], p.gpu_options[j]
        got = self._rows.get(base)
        if got is None or got[0] is not opts:
            tabs = [table(k) for k in (base, *opts)]
            got = self._rows[base] = (opts, tabs, keep_by_row(tabs, self.prune), {})
        row = rows[j]
        out = got[3].get(row)
        if out is None:
            keys, tabs = [base, *opts], got[1]
            out = []
            for i in got[2][row]:
                ops, sg = tabs[i].ops[row], tabs[i].sigs[row]
                out.append((keys[i], ops, self._footprint(sg, ops), sg))
            got[3][row] = out
            # identities and footprints as arrays, for tried()'s filter
            self._arrays[id(out)] = (out, np.array([c[3] for c in out], dtype=np.int64),
                                     np.array([c[2] for c in out], dtype=np.float64))
        return out

    def _compute(self, j: int) -> list[_Cand[K]]:
        p = self._problem
        keys = [p.baseline[j], *p.gpu_options[j]]
        all_ops = [p.ops(j, k) for k in keys]
        # plain tuples hash in C (an Op's dataclass hash runs Python code per op)
        sigs = [self._sig(ops) for ops in all_ops]
        sig = tuple(sigs)  # the ops' values (ids of freed tuples can come back)
        keep = self._cache.get(sig)
        if keep is None:
            keep = self._cache[sig] = self._select(all_ops, sigs)
        return [(keys[i], all_ops[i], self._footprint(sigs[i], all_ops[i]), sigs[i])
                for i in keep]

    def _sig(self, ops: tuple[Op, ...]) -> Hashable:
        """The identity of ``ops``' values (equal exactly when the ops' fields are)."""
        fields = self._problem.ops_fields
        return tuple(map(_FIELDS, ops)) if fields is None else fields(ops)

    def _footprint(self, sig: Hashable, ops: tuple[Op, ...]) -> tuple[float, float, float]:
        got = self._fp.get(sig)
        if got is None:
            got = self._fp[sig] = _footprint(ops)
        return got

    def _select(self, all_ops: list[tuple[Op, ...]], sigs: list[Hashable]) -> list[int]:
        first: dict[Hashable, int] = {}
        for i, sg in enumerate(sigs):
            first.setdefault(sg, i)
        idx = sorted(first.values())
        if not self.prune:
            return idx
        by_path: dict[tuple[str, ...], list[int]] = {}
        for i in idx:
            by_path.setdefault(tuple(map(_RESOURCE, all_ops[i])), []).append(i)
        dropped: set[int] = set()
        for members in by_path.values():
            if len(members) < 2 or not all_ops[members[0]]:
                continue
            # a path has a few options (at most 4 in the bench's cases): plain loops
            rows = [tuple(map(_DURATION, all_ops[i])) for i in members]
            gone = [any(b != a and all(map(operator.le, b, a)) for b in rows)
                    for a in rows]  # b != a and b <= a step for step: one step shorter
            dropped.update(i for i, g in zip(members, gone) if g)
        dropped.discard(idx[0])  # the baseline stays a candidate (Algorithm 4.1 may go back)
        return [i for i in idx if i not in dropped]


def _screened(keys: list[K], cands: list[tuple[Op, ...]], backs: list[bool], keep: set[K]
              ) -> _Tried[K]:
    """The candidates among ``keys`` (with their ops and baseline flags) that are the
    baseline or in ``keep``, in their order."""
    pick = [x for x, (k, b) in enumerate(zip(keys, backs)) if b or k in keep]
    return [keys[x] for x in pick], [cands[x] for x in pick], [backs[x] for x in pick]
