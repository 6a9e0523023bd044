"""SDPipe's rules (``hetplan.algorithms.sdpipe``) on the worked examples of the digest
(``shared/research/sdpipe.md`` §5, E1–E13), and the simulator on small meshes."""

from __future__ import annotations

import math

import pytest

from hetplan.algorithms.sdpipe import (
    AdamState,
    AdaptiveWindow,
    GroupScheduler,
    SchedulerConfig,
    TumblingWindow,
    adam_scaled_update,
    communicator_count,
    group_average,
    is_valid_group,
    min_group_sizes_ok,
    next_wait,
    sync_matrix,
    theorem_constants,
)
from hetplan.algorithms.sdpipe_sim import ReplicaMesh, simulate, straggler_delays


# -- E1, E2: the averaging rule ---------------------------------------------------------------
def test_e1_group_average_and_w_matrix():
    x = [1.0, 3.0, 10.0]
    assert group_average(x, {0, 1}) == [2.0, 2.0, 10.0]
    assert x == [1.0, 3.0, 10.0]  # not changed in place
    w = sync_matrix(3, {0, 1})
    assert w == [[0.5, 0.5, 0.0], [0.5, 0.5, 0.0], [0.0, 0.0, 1.0]]
    xw = [sum(x[u] * w[u][v] for u in range(3)) for v in range(3)]
    assert xw == [2.0, 2.0, 10.0]
    assert math.isclose(sum(xw) / 3, 14 / 3)


def test_e2_two_groups_in_turn():
    x = group_average([0.0, 4.0, 8.0], {0, 1})
    assert x == [2.0, 2.0, 8.0]
    x = group_average(x, {1, 2})
    assert x == [2.0, 5.0, 5.0]
    assert sum(x) / 3 == 4.0


def test_group_average_rejects_bad_groups():
    with pytest.raises(ValueError, match="out of range"):
        group_average([1.0, 2.0], {0, 2})
    with pytest.raises(ValueError, match="empty"):
        group_average([1.0, 2.0], set())


# -- E3, E4: validation ------------------------------------------------------------------------
def test_e3_sliding_window_validation():
    history = [{0, 1}, {2, 3}]
    assert is_valid_group(history, {1, 2}, n=4, p=3)
    assert not is_valid_group(history, {0, 1}, n=4, p=3)
    assert is_valid_group(history, {0, 1, 2}, n=4, p=3)
    assert not is_valid_group(history, {0, 1, 2}, n=4, p=1)
    assert is_valid_group(history, {0, 1, 2, 3}, n=4, p=1)
    # only the last p - 1 groups count: an older connecting group is out of the window
    assert not is_valid_group([{1, 2}, *history], {0, 1}, n=4, p=3)
    assert is_valid_group([{1, 2}, *history], {0, 1}, n=4, p=4)


def test_e4_necessary_condition():
    assert not min_group_sizes_ok([3, 5], n=8)
    assert min_group_sizes_ok([3, 6], n=8)
    # a window that passes validation always satisfies it
    assert is_valid_group([{0, 1, 2}], {2, 3, 4, 5, 6, 7}, n=8, p=2)


# -- E5: the closed-loop trace under the literal Algorithm 2 ----------------------------------
E5 = {
    1: ([(10, (0, 1, 2, 3)), (20, (0, 1, 2, 3)), (30, (0, 1, 2, 3))], [3, 3, 3, 3]),
    2: ([(4, (0, 1, 2)), (10, (0, 1, 2, 3)), (14, (0, 1, 2)), (20, (0, 1, 2, 3)),
         (24, (0, 1, 2)), (30, (0, 1, 2, 3))], [6, 6, 6, 3]),
    3: ([(4, (0, 1, 2)), (8, (0, 1, 2)), (12, (0, 1, 2, 3)), (16, (0, 1, 2)),
         (20, (0, 1, 2)), (24, (0, 1, 2, 3)), (28, (0, 1, 2))], [7, 7, 7, 2]),
    4: ([(4, (0, 1, 2)), (8, (0, 1, 2)), (10, (3,)), (20, (0, 1, 2, 3)), (24, (0, 1, 2)),
         (28, (0, 1, 2)), (30, (3,))], [5, 5, 5, 3]),
    None: ([(4, (0, 1, 2)), (8, (0, 1, 2)), (10, (3,)), (12, (0, 1, 2)), (16, (0, 1, 2)),
            (20, (0, 1, 2, 3)), (24, (0, 1, 2)), (28, (0, 1, 2)), (30, (3,))], [7, 7, 7, 3]),
}


@pytest.mark.parametrize("p", list(E5), ids=lambda p: f"P={p}")
def test_e5_closed_loop_trace(p):
    """One stage, compute times [4, 4, 4, 10], ticks every T = 1, zero sync cost: the
    scheduler driven by the simulator commits exactly the digest's groups up to t = 30."""
    n = 4
    zero = ((0.0,) * n,)
    mesh = ReplicaMesh(fwd_s=((4.0, 4.0, 4.0, 10.0),), bwd_s=zero, p2p_s=(),
                       avg_s=((0.0,) * (n + 1),), straggle_prob=zero, straggle_delay_s=zero)
    config = SchedulerConfig(num_stages=1, num_pipelines=n, p=p, window_s=1.0,
                             window_mode="ticks", early_close=False)
    res = simulate(mesh, "sdpipe", 8, scheduler=config)
    commits = [(c.time, c.group) for c in res.commits if c.time <= 30]
    expected, per_worker = E5[p]
    assert commits == [(float(t), g) for t, g in expected]
    counts = [sum(w in g for _, g in commits) for w in range(n)]
    assert counts == per_worker


# -- E6: the authors' tumbling window -----------------------------------------------------------
def test_e6_tumbling_window_of_the_authors_code():
    w = TumblingWindow(n=4, p=2)
    expected = [((0, 1), 2, False, [0, 0, 2, 3]), ((2,), 3, False, [0, 0, 2, 3]),
                ((0, 1), 5, False, [0, 0, 2, 3]), ((3,), 6, False, [0, 0, 2, 3]),
                ((0, 1, 2), 9, True, [0, 0, 0, 3])]
    for group, acc, need, roots in expected:
        w.record(group)
        assert (w.acc, w.need_enforce, w.roots()) == (acc, need, roots), group
    assert not w.enforced_valid([0])
    assert not w.enforced_valid([0, 1])
    assert w.enforced_valid([0, 1, 3])
    w.record((0, 1, 3), enforced=True)
    assert (w.acc, w.need_enforce, w.roots()) == (12, False, [0, 1, 2, 3])


# -- E7: the global lock -----------------------------------------------------------------------
def test_e7_only_one_stage_waits_and_the_other_skips():
    s = GroupScheduler(SchedulerConfig(num_stages=2, num_pipelines=3, p=1, window_s=1.0))
    assert s.ready(0, 0, 0.0) == []
    assert s.advance(1.0) == []  # {0} is invalid with P = 1: stage 0 takes the lock, waits
    assert s.lock_holder == 0
    assert s.ready(1, 2, 1.5) == []
    [skip] = s.advance(2.5)  # stage 1 cannot wait: it commits {2} without validation
    assert (skip.stage, skip.group, skip.lock_skipped) == (1, (2,), True)
    assert s.ready(0, 1, 3.0) == []  # the lock holder re-checks on every arrival
    [done] = s.ready(0, 2, 4.0)
    assert (done.stage, done.group, done.enforced, done.lock_skipped) == (0, (0, 1, 2), True,
                                                                           False)
    assert s.lock_holder is None
    assert s.ready(1, 0, 5.0) == []  # now stage 1 may take the lock
    assert s.advance(6.0) == []
    assert s.lock_holder == 1


def test_retired_workers_leave_the_connectivity_requirement():
    s = GroupScheduler(SchedulerConfig(num_stages=1, num_pipelines=3, p=1, window_s=1.0))
    s.ready(0, 0, 0.0)
    s.advance(1.0)
    assert s.lock_holder == 0
    s.ready(0, 1, 1.2)
    assert s.retire(0, 2, 2.0)[0].group == (0, 1)
    with pytest.raises(ValueError, match="retired"):
        s.ready(0, 2, 3.0)


# -- E8: the adaptive window -------------------------------------------------------------------
def test_e8_adaptive_wait_sequence():
    rule = AdaptiveWindow(start_s=1.0, lo_s=0.01, hi_s=10.0)
    used, w = [], rule.start_s
    for size in [1, 1, 1, 1, 3, 3, 1]:
        used.append(w)
        w = next_wait(w, size, rule)
    assert used == pytest.approx([1, 2, 4, 8, 10, 9.0, 8.1])
    assert w == 10.0


def test_adaptive_scheduler_uses_the_first_arrivals_wait():
    rule = AdaptiveWindow(start_s=1.0, lo_s=0.01, hi_s=10.0)
    s = GroupScheduler(SchedulerConfig(num_stages=1, num_pipelines=2, p=None, adaptive=rule))
    s.ready(0, 0, 0.0)
    [c] = s.advance(1.0)
    assert c.group == (0,)
    assert s.wait_s(0, 0) == 2.0 and s.wait_s(0, 1) == 1.0
    s.ready(0, 0, 5.0)
    assert s.next_deadline() == 7.0


# -- E9: the Adam correction -------------------------------------------------------------------
def test_e9_adam_correction_value():
    _, state, update = adam_scaled_update(0.0, 2.0, AdamState(), lr=1e-3, scale=0.25)
    assert (state.m, state.m2, state.v) == pytest.approx((0.2, 0.002, 0.004))
    assert update == pytest.approx(1.99701, abs=5e-6)
    _, _, plain = adam_scaled_update(0.0, 2.0, AdamState(), lr=1e-3, scale=1.0)
    assert plain == pytest.approx(1.0, abs=1e-4)


# -- E10, E11, E13: constants ------------------------------------------------------------------
def test_e10_theorem_constants():
    t1, t2, factor = theorem_constants(n=2, p=1, n1=2)
    assert t2 == pytest.approx(0.75)
    assert t1 == pytest.approx(355.56, abs=0.01)
    assert factor == pytest.approx(115.43, abs=0.01)
    t1, t2, factor = theorem_constants(n=4, p=1, n1=2)
    assert (t1, t2, factor) == pytest.approx((5261.1, 0.968246, 7838.9), rel=1e-4)


def test_e11_communicator_counts():
    assert [communicator_count(n) for n in (2, 4, 8, 16)] == [1, 11, 247, 65_519]


def test_e13_straggler_arithmetic():
    assert 1 - 0.9 ** 16 == pytest.approx(0.8147, abs=1e-4)
    delays = straggler_delays(seed=3, stage=0, pipeline=1, iterations=20_000, prob=0.1,
                              delay_s=0.3)
    assert set(delays) == {0.0, 0.3}
    assert sum(d > 0 for d in delays) / len(delays) == pytest.approx(0.1, abs=0.01)
    assert delays == straggler_delays(3, 0, 1, 20_000, 0.1, 0.3)  # deterministic


# -- the simulator -----------------------------------------------------------------------------
def _mesh(m, n, prob=0.1, delay=0.3, fwd=0.05, bwd=0.1, avg=0.01):
    grid = lambda v: tuple((v,) * n for _ in range(m))  # noqa: E731
    return ReplicaMesh(fwd_s=grid(fwd), bwd_s=grid(bwd), p2p_s=(0.002,) * (m - 1),
                       avg_s=tuple((0.0, 0.0) + tuple(avg for _ in range(2, n + 1))
                                   for _ in range(m)),
                       straggle_prob=grid(prob), straggle_delay_s=grid(delay))


def test_simulator_without_stragglers_all_policies_agree_on_the_compute_bound():
    mesh = _mesh(2, 2, prob=0.0, avg=0.0)
    config = SchedulerConfig(num_stages=2, num_pipelines=2, p=10, window_s=0.075)
    times = {pol: simulate(mesh, pol, 20, scheduler=config).makespan_s
             for pol in ("allreduce", "sdpipe", "adpsgd", "local")}
    assert len(set(round(t, 9) for t in times.values())) == 1, times


def test_simulator_sdpipe_beats_allreduce_under_stragglers_and_is_deterministic():
    mesh = _mesh(2, 4)
    config = SchedulerConfig(num_stages=2, num_pipelines=4, p=10, window_s=0.15 / 4)
    ar = simulate(mesh, "allreduce", 100, seed=1)
    sd = simulate(mesh, "sdpipe", 100, seed=1, scheduler=config)
    assert sd.iters_per_s > 1.2 * ar.iters_per_s
    assert 1 < sd.mean_group_size < 4
    assert ar.mean_group_size == 4
    assert simulate(mesh, "sdpipe", 100, seed=1, scheduler=config) == sd


def test_simulator_allreduce_matches_the_expected_straggler_cost():
    """One stage: all-reduce pays, per iteration, the largest delay of the N replicas."""
    mesh = _mesh(1, 4, fwd=0.1, bwd=0.0, avg=0.0)
    res = simulate(mesh, "allreduce", 200, seed=5)
    delays = [straggler_delays(5, 0, i, 200, 0.1, 0.3) for i in range(4)]
    expected = sum(0.1 + max(d[b] for d in delays) for b in range(200))
    assert res.makespan_s == pytest.approx(expected)


def test_flush_schedule_serialises_each_iteration():
    """With a flush every iteration, a 2-stage pipeline takes fwd0+fwd1+bwd1+bwd0 per
    iteration (no stragglers, no sync cost); 1F1B overlaps the stages."""
    mesh = _mesh(2, 1, prob=0.0, fwd=0.1, bwd=0.2, avg=0.0)
    flush = simulate(mesh, "allreduce", 10, schedule="flush")
    assert flush.makespan_s == pytest.approx(10 * (0.6 + 2 * 0.002))
    assert simulate(mesh, "allreduce", 10).makespan_s < flush.makespan_s
