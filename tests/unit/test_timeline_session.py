"""``DPSession`` (resumable simulation) against ``simulate_dp``: bit-identical iteration times
for rebased strategies and for trials that change any set of tensors, and early stopping that
only ever stops trials proven longer than the bound."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetplan.cost_models.timeline import CPU, GPU, DPSession, Op, SyncUnit, simulate_dp

# durations on a coarse grid so that ties (same instant on one resource) are frequent
_dur = st.integers(0, 6).map(lambda x: x * 0.5)
_op = st.tuples(st.sampled_from([GPU, CPU, "net", "intra", "inter"]), _dur).map(
    lambda t: Op(t[0], t[1]))
_ops = st.lists(_op, max_size=4).map(tuple)


def _reference(bp: list[float], ops: list[tuple[Op, ...]], workers: int, fwd: float,
               opt: float) -> float:
    units = [SyncUnit(i, o) for i, o in enumerate(ops)]
    return simulate_dp(bp, units, forward_s=fwd, optimizer_s=opt,
                       cpu_workers=workers).iteration_s


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    n=st.integers(1, 8),
    workers=st.integers(1, 3),
    fwd=_dur,
    opt=_dur,
)
def test_rebase_and_trials_equal_simulate_dp(data: st.DataObject, n: int, workers: int,
                                             fwd: float, opt: float) -> None:
    bp = data.draw(st.lists(_dur, min_size=n, max_size=n))
    base = data.draw(st.lists(_ops, min_size=n, max_size=n))
    sess = DPSession(bp, forward_s=fwd, optimizer_s=opt, cpu_workers=workers)
    assert sess.rebase(base) == _reference(bp, base, workers, fwd, opt)
    for _ in range(4):
        idx = data.draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=n))
        changes = {i: data.draw(_ops) for i in idx}
        trial = [changes.get(i, o) for i, o in enumerate(base)]
        exact = _reference(bp, trial, workers, fwd, opt)
        assert sess.trial(changes) == exact  # bit for bit, not approximately
        bound = data.draw(st.sampled_from([exact - 1.0, exact - 1e-6, exact, exact + 1.0]))
        got = sess.trial(changes, bound=bound)
        assert got == exact or (got == float("inf") and exact > bound)
        if exact <= bound:
            assert got == exact


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    n=st.integers(1, 8),
    workers=st.integers(1, 3),
)
def test_incremental_rebases_behave_like_a_fresh_session(data: st.DataObject, n: int,
                                                         workers: int) -> None:
    """``rebase`` re-simulates only from the first changed tensor: after a chain of rebases
    the base time, every trial and every bounded trial equal those of a session based on the
    same strategy from scratch (saved states, suffix work and in-flight work all updated)."""
    bp = data.draw(st.lists(_dur, min_size=n, max_size=n))
    base = data.draw(st.lists(_ops, min_size=n, max_size=n))
    sess = DPSession(bp, forward_s=0.5, optimizer_s=1.0, cpu_workers=workers)
    sess.rebase(base)
    for _ in range(4):
        idx = data.draw(st.sets(st.integers(0, n - 1), max_size=3))
        changes = {i: data.draw(_ops) for i in idx}
        probe = {i: data.draw(_ops) for i in data.draw(st.sets(st.integers(0, n - 1),
                                                               min_size=1, max_size=2))}
        sess.trial(probe, bound=sess.base_s)  # leaves cached in-flight work behind
        base = [changes.get(i, o) for i, o in enumerate(base)]
        fresh = DPSession(bp, forward_s=0.5, optimizer_s=1.0, cpu_workers=workers)
        assert sess.rebase(base) == fresh.rebase(base) == _reference(bp, base, workers, 0.5,
                                                                     1.0)
        for _ in range(3):
            trial = {i: data.draw(_ops) for i in data.draw(
                st.sets(st.integers(0, n - 1), min_size=1, max_size=n))}
            exact = _reference(bp, [trial.get(i, o) for i, o in enumerate(base)], workers,
                               0.5, 1.0)
            assert sess.trial(trial) == exact
            for bound in (exact - 1.0, exact, exact + 1.0):
                assert sess.trial(trial, bound=bound) == fresh.trial(trial, bound=bound)


def test_trial_without_changes_is_the_base() -> None:
    sess = DPSession([1.0, 1.0])
    f = sess.rebase([(Op("net", 2.0),), (Op(GPU, 0.5), Op("net", 1.0))])
    assert sess.trial({}) == f
    # hand check: T0 comm [1,3]; T1 ready 2, compress [2,2.5], comm [3,4]
    assert f == pytest.approx(4.0)


def test_bound_stops_a_trial_that_only_adds_work() -> None:
    sess = DPSession([1.0] * 4)
    sess.rebase([(Op("net", 1.0),)] * 4)  # channel [1,2] [2,3] [3,4] [4,5]
    assert sess.base_s == pytest.approx(5.0)
    assert sess.trial({0: (Op("net", 3.0),)}, bound=5.0) == float("inf")
    assert sess.trial({0: (Op("net", 3.0),)}) == pytest.approx(7.0)


def test_bad_input() -> None:
    sess = DPSession([1.0, 1.0])
    with pytest.raises(ValueError, match="one per tensor"):
        sess.rebase([()])
    sess.rebase([(), ()])
    with pytest.raises(ValueError, match="outside"):
        sess.trial({2: ()})
    with pytest.raises(ValueError, match="cpu_workers"):
        DPSession([1.0], cpu_workers=0)
