"""A stochastic multi-iteration simulator of pipeline replicas under random stragglers.

It decides nothing itself; it predicts how fast an M × N mesh (M stages, N pipelines) trains
under one synchronisation policy, so the group-sync pass can choose between them:

- ``"allreduce"``: after each backward, the N replicas of a stage average together (every
  stage runs at the pace of its slowest replica);
- ``"sdpipe"``: groups formed by :class:`hetplan.algorithms.sdpipe.GroupScheduler`;
- ``"adpsgd"``: AD-PSGD-style gossip: after mini-batch b, each replica averages with one
  partner, pairs drawn by a random permutation of the stage that every replica shares;
- ``"local"``: no synchronisation (an upper bound on speed).

The objective is throughput over K iterations, not the time of one: each pipeline trains K
mini-batches; the throughput is the mean per-pipeline rate of completed mini-batches (stage
0's average after its backward) until the first pipeline finishes (so a persistently faster
pipeline counts for more, as in the paper's samples per second), and the makespan of all K is
reported beside it. Each pipeline trains K
mini-batches with PipeDream's 1F1B (no flush: stage j runs ``M-1-j`` warm-up forwards, then
alternates forward and backward); a replica averages after each backward (local update
first, then the average, as in Algorithm 1). Forward of mini-batch b on stage j waits for
stage j-1's forward plus the activation transfer; backward waits for stage j+1's backward.

Stragglers follow the paper's model: before each forward, replica (j, i) is delayed by
``delay_s[j][i]`` with probability ``prob[j][i]``, independently per iteration
(:func:`straggler_delays`, which the runtime's emulation calls too, so a measured run and its
prediction see the same delays for the same seed). The run is deterministic: the same inputs
and seed give the same result, and every policy sees the same delays.

Complexity: O(M·N·K·log(M·N)) events, each O(P·N) in the scheduler.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass
from typing import Literal, get_args

from hetplan.algorithms.sdpipe import Commit, GroupScheduler, SchedulerConfig

__all__ = ["POLICIES", "Policy", "ReplicaMesh", "SimResult", "simulate", "straggler_delays"]

Policy = Literal["allreduce", "sdpipe", "adpsgd", "local"]
POLICIES: tuple[str, ...] = get_args(Policy)

_Grid = tuple[tuple[float, ...], ...]


@dataclass(frozen=True, slots=True)
class ReplicaMesh:
    """Times of an M × N mesh, all in seconds; grids are indexed ``[stage][pipeline]``.

    Attributes:
        fwd_s / bwd_s: forward / backward of one mini-batch (static slowdowns included);
            ``bwd_s`` includes the local optimizer step.
        p2p_s: activation (and gradient) transfer between stage j and j+1 (M-1 entries).
        avg_s: ``avg_s[j][s]`` is the time to average stage j's parameters in a group of s
            replicas (``s`` from 0 to N; entries 0 and 1 are 0).
        straggle_prob / straggle_delay_s: the Bernoulli delay model per replica.
    """

    fwd_s: _Grid
    bwd_s: _Grid
    p2p_s: tuple[float, ...]
    avg_s: _Grid
    straggle_prob: _Grid
    straggle_delay_s: _Grid

    @property
    def num_stages(self) -> int:
        return len(self.fwd_s)

    @property
    def num_pipelines(self) -> int:
        return len(self.fwd_s[0])

    def __post_init__(self) -> None:
        m, n = len(self.fwd_s), len(self.fwd_s[0]) if self.fwd_s else 0
        if m < 1 or n < 1:
            raise ValueError("a replica mesh needs at least one stage and one pipeline")
        for name in ("fwd_s", "bwd_s", "straggle_prob", "straggle_delay_s"):
            grid = getattr(self, name)
            if len(grid) != m or any(len(row) != n for row in grid):
                raise ValueError(f"{name} must be {m} x {n} ([stage][pipeline])")
        if len(self.p2p_s) != m - 1:
            raise ValueError(f"p2p_s needs {m - 1} entries (one per stage boundary), "
                             f"got {len(self.p2p_s)}")
        if len(self.avg_s) != m or any(len(row) != n + 1 for row in self.avg_s):
            raise ValueError(f"avg_s must be {m} rows of {n + 1} group sizes (0..{n})")


@dataclass(frozen=True, slots=True)
class SimResult:
    """What one simulated run gives.

    Attributes:
        policy: the synchronisation policy simulated.
        iterations: K, mini-batches per pipeline.
        makespan_s: time until the last replica finished its last average.
        iters_per_s: mean iterations per second of a pipeline until the first pipeline
            finished its K (iterations end with stage 0's average).
        makespan_iters_per_s: K / makespan (every pipeline trains exactly K).
        mean_group_size: mean size of the groups that averaged (1 for ``local``).
        groups: number of group averages over all stages.
        lock_skips: SDPipe groups committed without validation (another stage held the lock).
        deadlocked: the run stopped with replicas waiting forever; ``stuck`` lists them as
            ``(stage, pipeline, next operation)``.
        commits: SDPipe's committed groups in order (empty for the other policies).
    """

    policy: str
    iterations: int
    makespan_s: float
    iters_per_s: float
    makespan_iters_per_s: float
    mean_group_size: float
    groups: int
    lock_skips: int
    deadlocked: bool = False
    stuck: tuple[tuple[int, int, str], ...] = ()
    commits: tuple[Commit, ...] = ()


def straggler_delays(seed: int, stage: int, pipeline: int, iterations: int, prob: float,
                     delay_s: float) -> list[float]:
    """The extra delay of replica (stage, pipeline) before each of its forwards: ``delay_s``
    with probability ``prob``, else 0; one independent stream per replica and seed."""
    rng = random.Random(f"sdpipe-straggler/{seed}/{stage}/{pipeline}")
    return [delay_s if rng.random() < prob else 0.0 for _ in range(iterations)]


def _ops(m: int, j: int, k: int, schedule: str = "1f1b") -> list[tuple[str, int]]:
    """Stage j of m: ``("F", b)``, ``("B", b)`` and ``("S", b)`` in order; ``1f1b``: PipeDream
    without flush (``m-1-j`` warm-up forwards); ``flush``: every mini-batch's forward and
    backward before the next one's forward (a pipeline that flushes every iteration, as the
    runtime's schedules do, at the granularity of whole iterations)."""
    warm = min(m - 1 - j, k) if schedule == "1f1b" else 0
    ops: list[tuple[str, int]] = [("F", b) for b in range(warm)]
    for b in range(k - warm):
        ops += [("F", warm + b), ("B", b), ("S", b)]
    for b in range(k - warm, k):
        ops += [("B", b), ("S", b)]
    return ops


class _Run:
    """The discrete-event loop of one :func:`simulate` call."""

    def __init__(self, mesh: ReplicaMesh, policy: str, k: int, seed: int,
                 scheduler: SchedulerConfig | None, schedule: str) -> None:
        self.mesh, self.policy, self.k = mesh, policy, k
        m, n = mesh.num_stages, mesh.num_pipelines
        self.m, self.n = m, n
        self.ops = [[_ops(m, j, k, schedule) for _ in range(n)] for j in range(m)]
        self.idx = [[0] * n for _ in range(m)]
        self.busy = [[False] * n for _ in range(m)]
        self.f_done: list[list[list[float]]] = [[[] for _ in range(n)] for _ in range(m)]
        self.b_done: list[list[list[float]]] = [[[] for _ in range(n)] for _ in range(m)]
        self.finish = [[0.0] * n for _ in range(m)]
        self.s0_done: list[list[float]] = [[] for _ in range(n)]
        self.delays = [[straggler_delays(seed, j, i, k, mesh.straggle_prob[j][i],
                                         mesh.straggle_delay_s[j][i]) for i in range(n)]
                       for j in range(m)]
        self.heap: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.sizes: list[int] = []
        self.arrived: dict[tuple[int, int], list[tuple[int, float]]] = {}
        self.partner: list[list[list[int]]] = []
        if policy == "adpsgd":
            for j in range(m):
                rng = random.Random(f"sdpipe-adpsgd/{seed}/{j}")
                rows = []
                for _ in range(k):
                    perm = list(range(n))
                    rng.shuffle(perm)
                    mate = list(range(n))
                    for q in range(0, n - 1, 2):
                        mate[perm[q]], mate[perm[q + 1]] = perm[q + 1], perm[q]
                    rows.append(mate)
                self.partner.append(rows)
        self.sched: GroupScheduler | None = None
        self.tick_at: float | None = None
        if policy == "sdpipe":
            if scheduler is None:
                raise ValueError("policy 'sdpipe' needs a SchedulerConfig")
            if (scheduler.num_stages, scheduler.num_pipelines) != (m, n):
                raise ValueError(
                    f"scheduler is for {scheduler.num_stages} x {scheduler.num_pipelines}, "
                    f"the mesh is {m} x {n}")
            self.sched = GroupScheduler(scheduler)

    # events: (time, priority, seq, stage, pipeline); priority 0 = op done, 1 = tick
    def _push(self, t: float, prio: int, j: int, i: int) -> None:
        heapq.heappush(self.heap, (t, prio, self.seq, j, i))
        self.seq += 1

    def run(self) -> SimResult:
        for j in range(self.m):
            for i in range(self.n):
                self._try_start(j, i, 0.0)
        while self.heap:
            t, prio, _, j, i = heapq.heappop(self.heap)
            if prio == 1:
                if self.tick_at is not None and t == self.tick_at:
                    self.tick_at = None
                    assert self.sched is not None
                    self._apply(self.sched.advance(t))
                    self._schedule_tick(t)
                continue
            self._op_done(j, i, t)
        return self._result()

    def _op_done(self, j: int, i: int, t: float) -> None:
        kind, b = self.ops[j][i][self.idx[j][i]]
        self.busy[j][i] = False
        self.idx[j][i] += 1
        self.finish[j][i] = t
        if kind == "S" and j == 0:
            self.s0_done[i].append(t)
        if kind == "F":
            self.f_done[j][i].append(t)
            if j + 1 < self.m:
                self._try_start(j + 1, i, t)
        elif kind == "B":
            self.b_done[j][i].append(t)
            if j > 0:
                self._try_start(j - 1, i, t)
        elif (kind == "S" and self.sched is not None
              and self.idx[j][i] == len(self.ops[j][i])):
            self._apply(self.sched.retire(j, i, t))
            self._schedule_tick(t)
        self._try_start(j, i, t)

    def _try_start(self, j: int, i: int, now: float) -> None:
        if self.busy[j][i] or self.idx[j][i] == len(self.ops[j][i]):
            return
        kind, b = self.ops[j][i][self.idx[j][i]]
        mesh = self.mesh
        if kind == "S":
            self.busy[j][i] = True
            self._sync(j, i, b, now)
            return
        ready = now
        if kind == "F" and j > 0:
            if len(self.f_done[j - 1][i]) <= b:
                return
            ready = max(ready, self.f_done[j - 1][i][b] + mesh.p2p_s[j - 1])
        if kind == "B" and j + 1 < self.m:
            if len(self.b_done[j + 1][i]) <= b:
                return
            ready = max(ready, self.b_done[j + 1][i][b] + mesh.p2p_s[j])
        dur = (mesh.fwd_s[j][i] + self.delays[j][i][b]) if kind == "F" else mesh.bwd_s[j][i]
        self.busy[j][i] = True
        self._push(ready + dur, 0, j, i)

    def _sync(self, j: int, i: int, b: int, t: float) -> None:
        if self.policy == "local":
            self.sizes.append(1)
            self._push(t, 0, j, i)
            return
        if self.policy == "sdpipe":
            assert self.sched is not None
            self._apply(self.sched.ready(j, i, t))
            self._schedule_tick(t)
            return
        if self.policy == "allreduce":
            group = tuple(range(self.n))
        else:
            mate = self.partner[j][b][i]
            group = tuple(sorted({i, mate}))
        waiting = self.arrived.setdefault((j, b * self.n + group[0]), [])
        waiting.append((i, t))
        if len(waiting) == len(group):
            start = max(at for _, at in waiting)
            self.sizes.append(len(group))
            for member, _ in waiting:
                self._push(start + self.mesh.avg_s[j][len(group)], 0, j, member)
            del self.arrived[(j, b * self.n + group[0])]

    def _apply(self, commits: list[Commit]) -> None:
        for c in commits:
            self.sizes.append(len(c.group))
            for member in c.group:
                self._push(c.time + self.mesh.avg_s[c.stage][len(c.group)], 0, c.stage, member)

    def _schedule_tick(self, now: float) -> None:
        assert self.sched is not None
        nd = self.sched.next_deadline()
        if nd is None or (self.tick_at is not None and self.tick_at <= max(nd, now)):
            return
        self.tick_at = max(nd, now)
        self._push(self.tick_at, 1, 0, 0)

    def _result(self) -> SimResult:
        stuck = tuple((j, i, "{}{}".format(*self.ops[j][i][self.idx[j][i]]))
                      for j in range(self.m) for i in range(self.n)
                      if self.idx[j][i] < len(self.ops[j][i]))
        makespan = max(max(row) for row in self.finish)
        sched = self.sched
        rate = 0.0
        if not stuck and makespan > 0:
            first = min(done[-1] for done in self.s0_done)
            counted = sum(sum(1 for at in done if at <= first) for done in self.s0_done)
            rate = counted / self.n / first if first > 0 else self.k / makespan
        return SimResult(
            policy=self.policy,
            iterations=self.k,
            makespan_s=makespan,
            iters_per_s=rate,
            makespan_iters_per_s=self.k / makespan if makespan > 0 and not stuck else 0.0,
            mean_group_size=sum(self.sizes) / len(self.sizes) if self.sizes else 0.0,
            groups=len(self.sizes),
            lock_skips=0 if sched is None else sum(c.lock_skipped for c in sched.commits),
            deadlocked=bool(stuck),
            stuck=stuck,
            commits=() if sched is None else tuple(sched.commits),
        )


def simulate(mesh: ReplicaMesh, policy: str, iterations: int, *, seed: int = 0,
             scheduler: SchedulerConfig | None = None,
             schedule: Literal["1f1b", "flush"] = "1f1b") -> SimResult:
    """Simulate K = ``iterations`` mini-batches per pipeline under ``policy``.

    Args:
        mesh: the mesh's times and straggler model.
        policy: one of :data:`POLICIES`.
        iterations: mini-batches per pipeline (K ≥ 1).
        seed: seeds the straggler delays (and AD-PSGD's pairing).
        scheduler: SDPipe's settings (required for ``"sdpipe"``; its mesh must match).
        schedule: ``1f1b`` (PipeDream, the paper's) or ``flush`` (see :func:`_ops`).

    Returns:
        A :class:`SimResult`; ``deadlocked`` is True (and ``iters_per_s`` 0) when replicas
        wait forever, which only happens with SDPipe's deadlock prevention turned off.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; expected one of {', '.join(POLICIES)}")
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    if schedule not in ("1f1b", "flush"):
        raise ValueError(f"unknown schedule {schedule!r}; expected '1f1b' or 'flush'")
    return _Run(mesh, policy, iterations, seed, scheduler, schedule).run()
