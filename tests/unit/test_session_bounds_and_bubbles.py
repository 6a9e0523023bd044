"""Two things the session recomputes after every accepted change, against references.

The trial bounds' tables after replaced tensors equal a fresh session's (they are updated
over the session's resources only). Property #1's bubble test (``_dp_search.bubble_mask``)
against its definition written out:
a gap between communication intervals is a bubble unless some unit spans it, a unit is
before the last busy period when its communication ends at or before that period's start.
The kernel scans the gaps in increasing start time and keeps the latest end among the units
ready before each; the reference here looks at every unit for every gap, as the kernel did
before (``docs/decisions/espresso-speed.md``, "Round 8"). Ready times in any order (the
session's are increasing; the definition does not need it), compiled and not."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetplan.algorithms import _dp_search
from hetplan.algorithms.dp_session import _kernels, jit_enabled


def _reference(ev: np.ndarray, ready: np.ndarray, eps: float) -> np.ndarray:
    n = ready.shape[0]
    done = np.full(n, -1.0)
    for s, e, k, _ in ev:
        done[int(k)] = max(done[int(k)], e)
    comm = sorted((s, e, int(k)) for s, e, k, c in ev if c > 0.5)
    out = np.zeros(n, dtype=np.bool_)
    if not comm:
        return out
    comm_by_start = sorted(comm, key=lambda r: r[0])
    last_start, reach = comm_by_start[0][0], comm_by_start[0][1]
    for s, e, _ in comm_by_start[1:]:
        if s > reach + eps and not any(
                done[u] >= 0.0 and ready[u] < s - eps and done[u] > reach + eps
                for u in range(n)):
            last_start = s
        reach = max(reach, e)
    ends = np.full(n, -1.0)
    for s, e, k in comm:
        ends[k] = max(ends[k], e)
    return (ends >= 0.0) & (ends <= last_start + eps)


_t = st.integers(0, 12).map(lambda x: x * 0.5)


@st.composite
def _runs(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    n = draw(st.integers(1, 7))
    ready = np.array(draw(st.lists(_t, min_size=n, max_size=n)))
    rows = []
    for _ in range(draw(st.integers(0, 14))):
        k = draw(st.integers(0, n - 1))
        s = float(ready[k]) + draw(_t)
        rows.append((s, s + draw(_t), float(k), float(draw(st.booleans()))))
    return np.array(rows, dtype=np.float64).reshape(len(rows), 4), ready


@pytest.mark.parametrize("jit", [False, pytest.param(True, marks=pytest.mark.skipif(
    not jit_enabled(), reason="numba not installed or HETPLAN_JIT=0"))])
@settings(max_examples=300, deadline=None)
@given(run=_runs(), eps=st.sampled_from([0.0, 1e-9, 0.5]))
def test_bubble_mask_is_its_definition(jit: bool, run: tuple[np.ndarray, np.ndarray],
                                       eps: float) -> None:
    ev, ready = run
    got = _kernels(jit).bubble_mask(ev, ready, eps)
    assert list(got) == list(_reference(ev, ready, eps))


def test_a_gap_spanned_by_an_earlier_unit_is_no_bubble() -> None:
    """Hand-checked: unit 0 communicates [0, 1] and again [3, 4] (its decompression between),
    unit 1 [2, 2.5]; the gap at 2 is spanned by unit 0 (ready at 0, ends at 4), so the last
    busy period starts at 0 and no unit is before it but those ending by 0: none. Unit 0
    without its late interval leaves the gap at 2 unspanned: unit 0 is before it."""
    ready = np.array([0.0, 2.0])
    spanned = np.array([[0.0, 1.0, 0, 1], [3.0, 4.0, 0, 1], [2.0, 2.5, 1, 1]], dtype=float)
    assert list(_dp_search.bubble_mask(spanned, ready, 1e-9)) == [False, False]
    open_gap = np.array([[0.0, 1.0, 0, 1], [2.0, 2.5, 1, 1]], dtype=float)
    assert list(_dp_search.bubble_mask(open_gap, ready, 1e-9)) == [True, False]


@pytest.mark.parametrize("jit", [False, pytest.param(True, marks=pytest.mark.skipif(
    not jit_enabled(), reason="numba not installed or HETPLAN_JIT=0"))])
@settings(max_examples=100, deadline=None)
@given(data=st.data(), n=st.integers(1, 6))
def test_bounds_after_replaces_equal_a_fresh_session(jit: bool, data: st.DataObject,
                                                     n: int) -> None:
    """The trial bounds' tables (work per resource from each tensor on, release bounds),
    updated over the session's resources only after each replaced tensor, equal those of a
    session that simulates the final ops from scratch, also when a channel no tensor uses
    any more had work before."""
    from hetplan.algorithms.dp_session import DPSession
    from hetplan.algorithms.dp_types import CPU, GPU, Op

    op = st.tuples(st.sampled_from([GPU, CPU, "net", "intra", "inter"]),
                   st.integers(0, 6).map(lambda x: x * 0.5)).map(lambda t: Op(t[0], t[1]))
    ops = st.lists(op, max_size=3).map(tuple)
    bp = [0.5] * n
    base = data.draw(st.lists(ops, min_size=n, max_size=n))
    sess = DPSession(bp, jit=jit, cpu_workers=2)
    sess.rebase(base)
    now = list(base)
    for _ in range(data.draw(st.integers(1, 4))):
        j = data.draw(st.integers(0, n - 1))
        now[j] = data.draw(ops)
        sess.replace(j, now[j])
    fresh = DPSession(bp, jit=jit, cpu_workers=2)
    assert fresh.rebase(now) == sess.base_s
    # the same columns by resource name (each session numbers the channels it meets);
    # a channel only the replaced ops used has no work left
    for name, col in sess._rid.items():
        want = fresh._b.suffix[:, fresh._rid[name]] if name in fresh._rid else 0.0 * bp[0]
        assert (sess._b.suffix[:, col] == want).all(), name
    assert fresh._b.release.tolist() == sess._b.release.tolist()
