"""Algorithm 4.1's candidate filter over whole cost tables: every size class of a rung at once.

A caller whose options' ops depend on a tensor's class alone (the plan pass: a tensor's size)
can give :class:`~hetplan.algorithms.espresso.SelectionProblem` an ``ops_table``: per option,
the resources of its ops (one path, the same for every class), their durations at every
class (one row per class) and, per class, the number its ops' values are interned to
(``ops_fields``). :func:`keep_by_row` then decides, for every class at once, which options
Algorithm 4.1 simulates: what :class:`~hetplan.algorithms.espresso_candidates.Candidates`
decides one class at a time from the ops tuples (the first option of equal ops stands for
them; with ``prune``, an option whose ops are another's ops step for step, every step at
least as long and one longer, is dropped; the baseline always stays), with numpy over the
tables instead of Python over the tuples. Same lists, same order:
``tests/unit/test_espresso_tables.py`` compares the two on random instances, and
``bench/espresso_choices.py`` gives the same choices in the 36 bench cases.

Why: with 17-20 size classes and up to 128 options per rung, the per-tuple filter was a
third of vgg16's GPU selection (17 of 46 ms) and 10 % of ugatit's
(``docs/decisions/espresso-speed.md``, "Round 7").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from hetplan.algorithms.dp_types import Op

__all__ = ["OpsTable", "keep_by_row"]


class OpsTable(NamedTuple):
    """An option's ops at every class (one row per class).

    Attributes:
        resources: the resources of its ops, in order (the same in every row).
        durations: ``[rows, ops]`` float64, row ``r`` the durations of class ``r``'s ops.
        sigs: per row, the identity of its ops' values (``SelectionProblem.ops_fields`` of
            that row's ops; equal exactly for equal ``(resource, duration_s, label)``).
        ops: per row, the ops tuple itself (the object ``SelectionProblem.ops`` returns).
    """

    resources: tuple[str, ...]
    durations: np.ndarray
    sigs: Sequence[int]
    ops: Sequence[tuple[Op, ...]]


def keep_by_row(tables: Sequence[OpsTable], prune: bool) -> list[list[int]]:
    """For each class (table row), the indices into ``tables`` of the options Algorithm 4.1
    simulates, ascending; ``tables[0]`` is the baseline's, always kept.

    An option is kept when it is the first of its ops' values (equal interned identity) in
    that row and, with ``prune``, no option with the same resources has durations at most
    its own step for step in that row, and different.
    """
    if not tables:
        return []
    sig = np.array([t.sigs for t in tables], dtype=np.int64)  # [options, rows]
    n, rows = sig.shape
    dominated = np.zeros((n, rows), dtype=np.bool_)
    if prune:
        paths: dict[tuple[str, ...], list[int]] = {}
        for i, t in enumerate(tables):
            paths.setdefault(t.resources, []).append(i)
        # paths with as many options and steps go through numpy together
        shapes: dict[tuple[int, int], list[list[int]]] = {}
        for members in paths.values():
            if len(members) >= 2 and tables[members[0]].resources:
                shapes.setdefault((len(members), len(tables[members[0]].resources)),
                                  []).append(members)
        for (m, steps), groups in shapes.items():
            idx = [i for g in groups for i in g]
            d = np.stack([tables[i].durations for i in idx]).reshape(len(groups), m, rows,
                                                                     steps)
            # le[g, a, b, r]: in path g, b's steps at most a's in row r; ne: not all equal
            le = (d[:, None] <= d[:, :, None]).all(axis=-1)
            ne = (d[:, None] != d[:, :, None]).any(axis=-1)
            dominated[idx] = (le & ne).any(axis=2).reshape(len(idx), rows)
    # the first of equal identities in each row: sort each column (stable), mark where the
    # sorted value changes
    order = np.argsort(sig, axis=0, kind="stable")
    ranked = np.take_along_axis(sig, order, axis=0)
    starts = np.ones((n, rows), dtype=np.bool_)
    starts[1:] = ranked[1:] != ranked[:-1]
    first = np.zeros((n, rows), dtype=np.bool_)
    np.put_along_axis(first, order, starts, axis=0)
    keep = first & ~dominated
    keep[0] = True
    return [np.flatnonzero(keep[:, r]).tolist() for r in range(rows)]
