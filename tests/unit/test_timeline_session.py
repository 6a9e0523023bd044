"""``DPSession`` (resumable simulation) against ``simulate_dp``: bit-identical iteration times
for rebased strategies and for trials that change any set of tensors, and early stopping that
only ever stops trials proven longer than the bound. Every test runs the session's kernels
both ways: uncompiled (``jit=False``, what runs without numba or with ``HETPLAN_JIT=0``) and
compiled with numba (``jit=True``); one test holds the two against each other."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetplan.algorithms.dp_session import DPSession, jit_enabled
from hetplan.algorithms.dp_timeline import before_last_busy_period, simulate_dp
from hetplan.algorithms.dp_types import CPU, GPU, Op, SyncUnit
from hetplan.algorithms.espresso import search_offload

_IMPLS = ["uncompiled", pytest.param("jit", marks=pytest.mark.skipif(
    not jit_enabled(), reason="numba not installed or HETPLAN_JIT=0"))]


def _session(impl: str, bp: list[float], **kw: float) -> DPSession:
    return DPSession(bp, jit=impl == "jit", **kw)  # type: ignore[arg-type]

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


@pytest.mark.parametrize("impl", _IMPLS)
@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    n=st.integers(1, 8),
    workers=st.integers(1, 3),
    fwd=_dur,
    opt=_dur,
)
def test_rebase_and_trials_equal_simulate_dp(impl: str, data: st.DataObject, n: int, workers: int,
                                             fwd: float, opt: float) -> None:
    bp = data.draw(st.lists(_dur, min_size=n, max_size=n))
    base = data.draw(st.lists(_ops, min_size=n, max_size=n))
    sess = _session(impl, bp, forward_s=fwd, optimizer_s=opt, cpu_workers=workers)
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


@pytest.mark.parametrize("impl", _IMPLS)
@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    n=st.integers(1, 8),
    workers=st.integers(1, 3),
)
def test_incremental_rebases_behave_like_a_fresh_session(impl: str, data: st.DataObject, n: int,
                                                         workers: int) -> None:
    """``rebase`` re-simulates only from the first changed tensor: after a chain of rebases
    the base time, every trial and every bounded trial equal those of a session based on the
    same strategy from scratch (saved states, suffix work and in-flight work all updated)."""
    bp = data.draw(st.lists(_dur, min_size=n, max_size=n))
    base = data.draw(st.lists(_ops, min_size=n, max_size=n))
    sess = _session(impl, bp, forward_s=0.5, optimizer_s=1.0, cpu_workers=workers)
    sess.rebase(base)
    for _ in range(4):
        idx = data.draw(st.sets(st.integers(0, n - 1), max_size=3))
        changes = {i: data.draw(_ops) for i in idx}
        probe = {i: data.draw(_ops) for i in data.draw(st.sets(st.integers(0, n - 1),
                                                               min_size=1, max_size=2))}
        sess.trial(probe, bound=sess.base_s)  # leaves cached in-flight work behind
        base = [changes.get(i, o) for i, o in enumerate(base)]
        fresh = _session(impl, bp, forward_s=0.5, optimizer_s=1.0, cpu_workers=workers)
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


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    n=st.integers(1, 8),
    workers=st.integers(1, 3),
)
def test_release_bounds_are_lower_bounds_and_agree(data: st.DataObject, n: int,
                                                   workers: int) -> None:
    """The release bound of every saved state (GPU time there + ``_release[m]``) is at most
    the base's iteration time, and both implementations compute the same values bit for
    bit (a trial stops on it, so they must agree on when)."""
    bp = data.draw(st.lists(_dur, min_size=n, max_size=n))
    base = data.draw(st.lists(_ops, min_size=n, max_size=n))
    impls = ["uncompiled"] + (["jit"] if jit_enabled() else [])
    got = []
    for impl in impls:
        sess = _session(impl, bp, forward_s=0.5, optimizer_s=1.0, cpu_workers=workers)
        sess.rebase(base)
        release = [float(x) for x in sess._b.release]
        for m in range(n):
            gpu_m = sess._b.snap_gpu[m]
            assert 0.5 + gpu_m + release[m] + 1.0 <= sess.base_s
        got.append(release)
    assert all(r == got[0] for r in got)


# durations not exact in binary, so sums round (and round differently in another order)
_fine = st.floats(0.0, 3.0, allow_nan=False).map(lambda x: round(x, 7))
_fine_ops = st.lists(st.tuples(st.sampled_from([GPU, CPU, "net", "inter"]), _fine).map(
    lambda t: Op(t[0], t[1])), max_size=4).map(tuple)


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    n=st.integers(1, 12),
    workers=st.integers(1, 3),
    scale=st.sampled_from([1e-3, 1.0, 1e6, 1e9]),
)
def test_bounded_trials_with_rounding_and_large_times(data: st.DataObject, n: int, workers: int,
                                                      scale: float) -> None:
    """With durations that round and times from milliseconds to 1e9 units, a trial bounded
    by its own exact time is never stopped (the release bound's slack is relative), and both
    implementations agree on the release bounds and on every bounded trial."""
    def scaled(ops: tuple[Op, ...]) -> tuple[Op, ...]:
        return tuple(Op(o.resource, o.duration_s * scale) for o in ops)

    bp = [x * scale for x in data.draw(st.lists(_fine, min_size=n, max_size=n))]
    base = [scaled(o) for o in data.draw(st.lists(_fine_ops, min_size=n, max_size=n))]
    impls = ["uncompiled"] + (["jit"] if jit_enabled() else [])
    sessions = [_session(impl, bp, cpu_workers=workers) for impl in impls]
    for sess in sessions:
        sess.rebase(base)
    releases = {tuple(float(x) for x in s._b.release) for s in sessions}
    assert len(releases) == 1
    for _ in range(4):
        idx = data.draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=2))
        changes = {i: scaled(data.draw(_fine_ops)) for i in idx}
        exact = _reference(bp, [changes.get(i, o) for i, o in enumerate(base)], workers, 0.0,
                           0.0)
        for bound in (exact, exact * (1 - 1e-12), exact * 0.9):
            got = [s.trial(changes, bound=bound) for s in sessions]
            assert len(set(got)) == 1
            assert got[0] == exact or (got[0] == float("inf") and exact > bound)
            if exact <= bound:
                assert got[0] == exact


@pytest.mark.parametrize("impl", _IMPLS)
def test_release_bound_follows_the_last_tensor(impl: str) -> None:
    """Tensor 1 is ready at 11 and then needs 5 on the channel and 1 on the GPU: from the
    start the run cannot end before 17, nor before 1 + 16 from segment 1 on (hand check;
    the channel's backlog alone says 6 and 5)."""
    sess = _session(impl, [1.0, 10.0])
    assert sess.rebase([(Op("net", 1.0),), (Op("net", 5.0), Op(GPU, 1.0))]) == 17.0
    assert [float(x) for x in sess._b.release[:2]] == [17.0, 16.0]


@pytest.mark.parametrize("impl", _IMPLS)
def test_trial_without_changes_is_the_base(impl: str) -> None:
    sess = _session(impl, [1.0, 1.0])
    f = sess.rebase([(Op("net", 2.0),), (Op(GPU, 0.5), Op("net", 1.0))])
    assert sess.trial({}) == f
    # hand check: T0 comm [1,3]; T1 ready 2, compress [2,2.5], comm [3,4]
    assert f == pytest.approx(4.0)


@pytest.mark.parametrize("impl", _IMPLS)
def test_bound_stops_a_trial_that_only_adds_work(impl: str) -> None:
    sess = _session(impl, [1.0] * 4)
    sess.rebase([(Op("net", 1.0),)] * 4)  # channel [1,2] [2,3] [3,4] [4,5]
    assert sess.base_s == pytest.approx(5.0)
    assert sess.trial({0: (Op("net", 3.0),)}, bound=5.0) == float("inf")
    assert sess.trial({0: (Op("net", 3.0),)}) == pytest.approx(7.0)


@pytest.mark.parametrize("impl", _IMPLS)
def test_equal_runnable_times_go_to_the_lower_unit(impl: str) -> None:
    """The heaps order rows by (time, unit) alone, which must be the reference's order of
    whole rows (time, ready, unit, op). Hand check: unit 0 (ready at 0) runs on "net" [0, 2]
    and unit 1 (ready at 1) on "intra" [1, 2]; both next ops are runnable on "inter" at 2,
    and unit 0 goes first: [2, 3], then its "intra" op [3, 8], while unit 1's runs [3, 8]:
    8 (unit 1 first would give unit 0 [7, 8] on "inter" and [8, 13] on "intra": 13)."""
    bp = [0.0, 1.0]
    base = [(Op("net", 2.0), Op("inter", 1.0), Op("intra", 5.0)),
            (Op("intra", 1.0), Op("inter", 5.0))]
    sess = _session(impl, bp)
    assert sess.rebase(base) == 8.0 == _reference(bp, base, 1, 0.0, 0.0)
    for changes in ({1: (Op("intra", 1.0), Op("inter", 4.0))}, {0: (Op("net", 2.0),)},
                    {0: (Op("net", 2.0), Op("inter", 2.0)), 1: (Op(GPU, 1.0),)}):
        ops = [changes.get(i, o) for i, o in enumerate(base)]
        assert sess.trial(changes) == _reference(bp, ops, 1, 0.0, 0.0)


@pytest.mark.parametrize("impl", _IMPLS)
def test_shared_sessions_start_with_the_grown_heap_pools(
        impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Forty units ready at once on one channel keep up to forty rows in the runnable heap
    at each of the forty saved states: the pools outgrow their 4 n + 16 rows, and the base
    run is repeated after each doubling. A session made with ``share=`` starts at the
    grown size: one base run, and the same times."""
    n = 40
    bp = [0.0] * n
    ops = [(Op("net", 1.0 + (i % 3)), Op(GPU, 0.5)) for i in range(n)]
    first = _session(impl, bp)
    runs: list[int] = []
    kernel = first._k.rebase_run
    monkeypatch.setattr(first._k, "rebase_run", lambda *a: runs.append(1) or kernel(*a))
    f = first.rebase(ops)
    assert len(runs) > 1 and first._b.rpool.shape[0] > 4 * n + 16  # it grew
    runs.clear()
    second = DPSession(bp, jit=impl == "jit", share=first)
    assert second._b.rpool.shape[0] == first._b.rpool.shape[0]
    assert second.rebase(ops) == f == _reference(bp, ops, 1, 0.0, 0.0)
    assert len(runs) == 1
    change = {7: (Op("net", 0.5),)}
    assert second.trial(change) == first.trial(change)


@pytest.mark.parametrize("impl", _IMPLS)
def test_bad_input(impl: str) -> None:
    sess = _session(impl, [1.0, 1.0])
    with pytest.raises(ValueError, match="one per tensor"):
        sess.rebase([()])
    sess.rebase([(), ()])
    with pytest.raises(ValueError, match="outside"):
        sess.trial({2: ()})
    with pytest.raises(ValueError, match="cpu_workers"):
        _session(impl, [1.0], cpu_workers=0)
    # the kernels keep per-resource arrays of a fixed width: a 17th resource is refused
    channels = [(Op(f"link{i}", 1.0),) for i in range(14)]
    wide = _session(impl, [1.0] * 15)
    wide.rebase([*channels, ()])
    with pytest.raises(ValueError, match="at most 16"):
        wide.trial({14: (Op("one-too-many", 1.0),)})
    # the bubble rule needs one unit per tensor, unit i ending at tensor i
    with pytest.raises(ValueError, match="one unit per tensor"):
        before_last_busy_period([1.0, 1.0], [SyncUnit(1, (Op("net", 1.0),))])


@pytest.mark.parametrize("impl", _IMPLS)
@settings(max_examples=200, deadline=None)
@given(data=st.data(), n=st.integers(1, 8), workers=st.integers(1, 3))
def test_best_option_and_bubbles_equal_the_reference(impl: str, data: st.DataObject, n: int,
                                                     workers: int) -> None:
    """``best_option`` keeps what a plain loop over ``simulate_dp`` keeps (Algorithm 4.1's
    rule: strictly better, or no worse for the baseline), and ``before_bubbles`` equals
    :func:`before_last_busy_period` on the base."""
    bp = data.draw(st.lists(_dur, min_size=n, max_size=n))
    base = data.draw(st.lists(_ops, min_size=n, max_size=n))
    sess = _session(impl, bp, forward_s=0.5, cpu_workers=workers)
    sess.rebase(base)
    units = [SyncUnit(i, o) for i, o in enumerate(base)]
    assert sess.before_bubbles(1e-9) == before_last_busy_period(bp, units, workers, 1e-9)
    j = data.draw(st.integers(0, n - 1))
    cands = data.draw(st.lists(_ops, max_size=5))
    backs = data.draw(st.lists(st.booleans(), min_size=len(cands), max_size=len(cands)))
    best, want = sess.base_s, -1
    for c, (ops, back) in enumerate(zip(cands, backs)):
        trial = base.copy()
        trial[j] = ops
        f = simulate_dp(bp, [SyncUnit(i, o) for i, o in enumerate(trial)], forward_s=0.5,
                        cpu_workers=workers).iteration_s
        if f < best - 1e-9 or (back and f <= best + 1e-9):
            best, want = f, c
    assert sess.best_option(j, cands, backs, sess.base_s, 1e-9) == (want, best)
    # rebases that change a few tensors resume mid-run: the bubble test must still see the
    # whole base run (the compiled session keeps the earlier runs' record of the prefix)
    for _ in range(3):
        changes = data.draw(st.dictionaries(st.integers(0, n - 1), _ops, max_size=2))
        base = [changes.get(i, o) for i, o in enumerate(base)]
        sess.rebase(base)
        units = [SyncUnit(i, o) for i, o in enumerate(base)]
        assert sess.before_bubbles(1e-9) == before_last_busy_period(bp, units, workers, 1e-9)


@pytest.mark.parametrize("impl", _IMPLS)
@settings(max_examples=150, deadline=None)
@given(data=st.data(), n=st.integers(1, 8), workers=st.integers(1, 3))
def test_best_classes_and_offload_equal_the_reference(impl: str, data: st.DataObject, n: int,
                                                      workers: int) -> None:
    """``best_classes`` returns the first strategy of least time (each tensor's ops by its
    class), and ``best_offload`` the first offloading vector of least time below the bound,
    as plain loops over ``simulate_dp`` find them."""
    bp = data.draw(st.lists(_dur, min_size=n, max_size=n))
    base = data.draw(st.lists(_ops, min_size=n, max_size=n))
    sess = _session(impl, bp, optimizer_s=0.5, cpu_workers=workers)
    sess.rebase(base)

    def time(ops: list[tuple[Op, ...]]) -> float:
        return simulate_dp(bp, [SyncUnit(i, o) for i, o in enumerate(ops)], optimizer_s=0.5,
                           cpu_workers=workers).iteration_s

    n_cls = data.draw(st.integers(1, 3))
    class_idx = data.draw(st.lists(st.integers(0, n_cls - 1), min_size=n, max_size=n))
    strategies = data.draw(st.lists(st.lists(_ops, min_size=n_cls, max_size=n_cls),
                                    min_size=1, max_size=4))
    times = [time([sd[c] for c in class_idx]) for sd in strategies]
    want = min(range(len(times)), key=lambda s: (times[s], s))
    assert sess.best_classes(class_idx, strategies) == (want, times[want])
    # offloading: two groups of tensors, each tensor with its own replacement ops
    members = data.draw(st.permutations(range(n)))
    cut = data.draw(st.integers(0, n))
    groups = [list(members[:cut]), list(members[cut:])]
    offloaded = {i: data.draw(_ops) for i in range(n)}
    best, best_u = sess.base_s, [0, 0]
    for u0 in range(len(groups[0]) + 1):
        for u1 in range(len(groups[1]) + 1):
            if u0 == u1 == 0:
                continue
            trial = base.copy()
            for i in groups[0][:u0] + groups[1][:u1]:
                trial[i] = offloaded[i]
            f = time(trial)
            if f < best - 1e-9:
                best, best_u = f, [u0, u1]
    assert sess.best_offload(groups, offloaded, sess.base_s, 1e-9) == (best_u, best)

    # coordinate descent (it may step a group back to 0, i.e. back to the base), written out
    # here as plain loops: the session and ``search_offload`` share the kernels' order
    def full(u: list[int]) -> float:
        trial = base.copy()
        for g, k in zip(groups, u):
            for i in g[:k]:
                trial[i] = offloaded[i]
        return time(trial)

    best, best_u, again, tried = sess.base_s, [0, 0], True, 0
    while again:
        again = False
        for g in range(2):
            for k in range(len(groups[g]) + 1):
                if k != best_u[g]:
                    u = best_u.copy()
                    u[g] = k
                    tried += 1
                    if (f := full(u)) < best - 1e-9:
                        best, best_u, again = f, u, True
    before = sess.trials
    assert sess.best_offload(groups, offloaded, sess.base_s, 1e-9,
                             exhaustive=False) == (best_u, best)
    assert sess.trials - before == tried
    assert search_offload([len(g) for g in groups], lambda u, bound: full(list(u)),
                          sess.base_s, 1e-9, exhaustive=False) == (best_u, best)


def test_runs_uncompiled_when_the_kernels_cannot_be_compiled(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without numba (or without a writable cache) the kernels run uncompiled and
    ``jit_error`` says why; ``HETPLAN_JIT=0`` turns compilation off on purpose."""
    import sys

    from hetplan.algorithms import dp_session

    monkeypatch.setattr(dp_session, "_JIT_ERROR", [])
    monkeypatch.setattr(dp_session, "_COMPILED", [])
    monkeypatch.setitem(sys.modules, "numba", None)  # import fails
    monkeypatch.delenv("HETPLAN_JIT", raising=False)
    assert not dp_session.jit_enabled()
    assert "numba" in (dp_session.jit_error() or "")
    sess = DPSession([1.0])
    assert not sess.compiled
    assert sess.rebase([(Op("net", 2.0),)]) == 3.0
    monkeypatch.setattr(dp_session, "_JIT_ERROR", [])
    monkeypatch.setenv("HETPLAN_JIT", "0")
    assert not dp_session.jit_enabled() and dp_session.jit_error() is None
    assert not DPSession([1.0]).compiled


def _same_base(a: DPSession, b: DPSession) -> bool:
    """The two sessions' base records (saved states, suffix work, release bounds, the run's
    intervals and ready times) are equal bit for bit; heap pools up to their used rows."""
    x, y = a._b, b._b
    n = len(x.bp)
    pools = [(x.rpool, y.rpool, x.roff[n]), (x.gpool, y.gpool, x.goff[n])]
    return (x.base_s == y.base_s
            and all(np.array_equal(getattr(x, f), getattr(y, f)) for f in (
                "suffix", "release", "snap_gpu", "snap_sync", "snap_free", "snap_cpu", "ev",
                "ready"))
            and np.array_equal(x.roff[:n + 1], y.roff[:n + 1])
            and np.array_equal(x.goff[:n + 1], y.goff[:n + 1])
            and all(np.array_equal(p[:used], q[:used]) for p, q, used in pools))


@pytest.mark.skipif(not jit_enabled(), reason="numba not installed or HETPLAN_JIT=0")
@settings(max_examples=150, deadline=None)
@given(data=st.data(), n=st.integers(1, 8), workers=st.integers(1, 3))
def test_compiled_kernels_equal_the_same_kernels_uncompiled(data: st.DataObject, n: int,
                                                           workers: int) -> None:
    """The compiled kernels and the same functions run uncompiled leave the same base record
    after every rebase (full and partial) and return the same values from every entry
    point, bit for bit (small instances: the uncompiled kernels are slow)."""
    bp = data.draw(st.lists(_fine, min_size=n, max_size=n))
    base = data.draw(st.lists(_fine_ops, min_size=n, max_size=n))
    kw = {"forward_s": 0.25, "optimizer_s": 0.5, "cpu_workers": workers}
    plain, jit = DPSession(bp, jit=False, **kw), DPSession(bp, jit=True, **kw)
    assert not plain.compiled and jit.compiled
    for _ in range(3):
        assert plain.rebase(base) == jit.rebase(base)
        assert _same_base(plain, jit)
        assert plain.before_bubbles(1e-9) == jit.before_bubbles(1e-9)
        changes = {i: data.draw(_fine_ops) for i in data.draw(
            st.sets(st.integers(0, n - 1), min_size=1, max_size=n))}
        exact = plain.trial(changes)
        assert exact == jit.trial(changes)
        for bound in (exact * 0.9, exact, exact * 1.1):
            assert plain.trial(changes, bound=bound) == jit.trial(changes, bound=bound)
        j = data.draw(st.integers(0, n - 1))
        cands = data.draw(st.lists(_fine_ops, max_size=4))
        backs = data.draw(st.lists(st.booleans(), min_size=len(cands), max_size=len(cands)))
        assert plain.best_option(j, cands, backs, plain.base_s, 1e-9) == jit.best_option(
            j, cands, backs, jit.base_s, 1e-9)
        class_idx = data.draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
        strategies = data.draw(st.lists(st.lists(_fine_ops, min_size=2, max_size=2),
                                        min_size=1, max_size=3))
        assert plain.best_classes(class_idx, strategies) == jit.best_classes(class_idx,
                                                                            strategies)
        members = data.draw(st.permutations(range(n)))
        cut = data.draw(st.integers(0, n))
        groups = [list(members[:cut]), list(members[cut:])]
        offloaded = {i: data.draw(_fine_ops) for i in range(n)}
        for exhaustive in (True, False):
            assert plain.best_offload(groups, offloaded, plain.base_s, 1e-9, exhaustive) == \
                jit.best_offload(groups, offloaded, jit.base_s, 1e-9, exhaustive)
        assert plain.trials == jit.trials
        base = [changes.get(i, o) for i, o in enumerate(base)]
