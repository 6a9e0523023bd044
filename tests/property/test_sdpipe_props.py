"""SDPipe's scheduler on random inputs (``hetplan.algorithms.sdpipe``, driven directly and
through the simulator ``hetplan.algorithms.sdpipe_sim``).

- Assumption 1: in every accepted schedule, each window of P consecutive groups of a stage
  (the virtual initial full group included) connects its replicas, except windows that end in
  a logged lock skip.
- No deadlock: on random straggler patterns over 1F1B pipelines, every replica finishes; with
  the lock turned off, the Fig. 3 deadlock does happen (so the check can fail).
- Averaging preserves the mean of the replicas.
"""

from __future__ import annotations

import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from hetplan.algorithms.sdpipe import (
    GroupScheduler,
    SchedulerConfig,
    group_average,
    window_connected,
)
from hetplan.algorithms.sdpipe_sim import ReplicaMesh, simulate


def _check_assumption_1(commits, m, n, p, k=None):
    """Every window of P consecutive groups of a stage ends in a logged lock skip or connects
    the stage's replicas; with ``k`` syncs per replica, only windows before the first replica
    finished (a finished replica leaves the requirement)."""
    for j in range(m):
        groups = [tuple(range(n))] + [c.group for c in commits if c.stage == j]
        flags = [False] + [c.lock_skipped for c in commits if c.stage == j]
        synced = [0] * n
        for end in range(1, len(groups)):
            if k is not None and max(synced) >= k:
                break
            window = groups[max(0, end - p + 1): end + 1]
            if not flags[end]:
                assert window_connected(n, window), (j, end, window)
            for w in groups[end]:
                synced[w] += 1


@settings(max_examples=150, deadline=None)
@given(
    m=st.integers(1, 3),
    n=st.integers(2, 5),
    p=st.integers(1, 6),
    data=st.data(),
)
def test_random_ready_orders_satisfy_assumption_1_and_never_block(m, n, p, data):
    """Workers become ready in a random order at random times, each re-arriving only after
    its last group was committed; the scheduler keeps committing (no worker waits forever:
    the last-arriving worker of a stage always completes a valid group) and every commit
    that is not a logged lock skip passes Assumption 1."""
    s = GroupScheduler(SchedulerConfig(num_stages=m, num_pipelines=n, p=p, window_s=1.0))
    waiting: set[tuple[int, int]] = set()
    t = 0.0
    for _ in range(data.draw(st.integers(5, 80))):
        free = sorted({(j, i) for j in range(m) for i in range(n)} - waiting)
        if free and data.draw(st.booleans()):
            j, i = data.draw(st.sampled_from(free))
            waiting.add((j, i))
            commits = s.ready(j, i, t)
        else:
            t += data.draw(st.floats(0.0, 2.0))
            commits = s.advance(t)
        for c in commits:
            waiting -= {(c.stage, w) for w in c.group}
    # liveness: while released workers keep coming back, every waiting one is released
    stuck = set(waiting)
    for _ in range(2 * m + 2):
        for j, i in sorted({(j, i) for j in range(m) for i in range(n)} - waiting):
            waiting.add((j, i))
            for c in s.ready(j, i, t):
                waiting -= {(c.stage, w) for w in c.group}
        t += 2.0
        for c in s.advance(t):
            waiting -= {(c.stage, w) for w in c.group}
        stuck &= waiting
    assert not stuck
    _check_assumption_1(s.commits, m, n, p)


def _mesh(m, n, fwd, delays, prob):
    grid = lambda rows: tuple(tuple(r) for r in rows)  # noqa: E731
    return ReplicaMesh(
        fwd_s=grid(fwd), bwd_s=grid([[2 * f for f in row] for row in fwd]),
        p2p_s=(0.01,) * (m - 1),
        avg_s=tuple((0.0, 0.0) + tuple(0.005 * s for s in range(2, n + 1)) for _ in range(m)),
        straggle_prob=grid([[prob] * n for _ in range(m)]), straggle_delay_s=grid(delays))


@settings(max_examples=60, deadline=None)
@given(
    m=st.integers(2, 3),
    n=st.integers(2, 4),
    p=st.integers(1, 4),
    seed=st.integers(0, 10_000),
    data=st.data(),
)
def test_pipelines_never_deadlock_with_the_lock(m, n, p, seed, data):
    fwd = [[data.draw(st.floats(0.01, 0.2)) for _ in range(n)] for _ in range(m)]
    delays = [[data.draw(st.floats(0.0, 1.0)) for _ in range(n)] for _ in range(m)]
    mesh = _mesh(m, n, fwd, delays, prob=0.3)
    config = SchedulerConfig(num_stages=m, num_pipelines=n, p=p,
                             window_s=data.draw(st.floats(0.0, 0.3)))
    res = simulate(mesh, "sdpipe", 12, seed=seed, scheduler=config)
    assert not res.deadlocked, res.stuck
    _check_assumption_1(res.commits, m, n, p, k=12)


def test_without_the_lock_fig3_deadlock_happens():
    """Random 2 x 2 meshes with the lock turned off: one deadlocks as in Fig. 3 (stage 0 of
    one pipeline and stage 1 of the other wait for a group, each blocking the other's
    partner); with the lock, none of the same runs does."""
    found = None
    for seed in range(300):
        rng = random.Random(seed)
        fwd = [[rng.uniform(0.01, 0.2) for _ in range(2)] for _ in range(2)]
        delays = [[rng.uniform(0.0, 1.0) for _ in range(2)] for _ in range(2)]
        mesh = _mesh(2, 2, fwd, delays, prob=0.5)
        window = rng.uniform(0.0, 0.05)
        with_lock = simulate(mesh, "sdpipe", 30, seed=seed, scheduler=SchedulerConfig(
            num_stages=2, num_pipelines=2, p=2, window_s=window))
        assert not with_lock.deadlocked, seed
        res = simulate(mesh, "sdpipe", 30, seed=seed, scheduler=SchedulerConfig(
            num_stages=2, num_pipelines=2, p=2, window_s=window, deadlock_prevention=False))
        if res.deadlocked:
            found = res
            break
    assert found is not None
    waiting_sync = {(j, i) for j, i, op in found.stuck if op.startswith("S")}
    assert {j for j, _ in waiting_sync} == {0, 1}  # one replica of each stage waits


@given(values=st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=8), data=st.data())
def test_group_average_preserves_the_mean(values, data):
    group = data.draw(st.sets(st.integers(0, len(values) - 1), min_size=1))
    out = group_average(values, group)
    assert math.isclose(math.fsum(out), math.fsum(values), rel_tol=1e-9, abs_tol=1e-6)
    assert len({out[w] for w in group}) == 1
