"""SDPipe's group synchronization rules (Miao et al., PVLDB 2023), on plain numbers (no torch).

SDPipe lets the N replicas of each pipeline stage average their parameters in small groups of
the replicas that are ready, instead of all N at once, so that a straggler stalls only itself.
A central scheduler forms the groups; the heavy averaging happens inside each group. This
module holds every rule the scheduler and the workers apply, so the runtime
(:mod:`hetplan.runtime.handlers.group_sync`), the multi-iteration simulator
(:mod:`hetplan.algorithms.sdpipe_sim`) and the tests run the same code:

1. :func:`group_average` / :func:`sync_matrix` — the averaging rule, eq. (2): members of the
   group get their mean, the others keep their values (W is doubly stochastic, so the mean of
   all replicas never changes).
2. :func:`is_valid_group` — Assumption 1 (sync-graph connectivity): the union of the cliques of
   the last ``p - 1`` committed groups and the candidate connects all ``n`` replicas
   (a union-find, :class:`UnionFind`). ``p = 1`` admits only the full group (all-reduce).
   :class:`TumblingWindow` is the authors' code's approximation, kept as a reference.
3. :class:`GroupScheduler` — Algorithm 2 as an event-driven state machine over every stage:
   ``ready(stage, worker, t)`` and ``advance(t)`` return the groups committed; a window of
   ``T`` seconds (fixed, or adapted per worker by :func:`next_wait`) collects ready signals;
   an invalid group keeps waiting for more workers; the global enforcement lock
   (:class:`GroupScheduler`'s ``lock_holder``) lets only one stage wait at a time, any other
   stage commits its invalid group anyway and the commit is logged as a lock skip
   (``Commit.lock_skipped``) — the paper's deadlock prevention (§3.4, Fig. 3).
4. :func:`adam_scaled_update` — the Adam variance correction of §4: with local Adam moments
   and averaged parameters, the second moment is rebuilt as ``m2² + (v - m2²) · scale``.

Conventions (decided in ``docs/decisions/sdpipe.md``): workers are indexed ``0..n-1`` within
their stage; the connectivity window is sliding and counted in committed groups of the stage
(the paper's unit), seeded with one virtual full group because all replicas start identical;
a singleton group counts as a group; times are in seconds.

Complexity: :func:`is_valid_group` is O(p·n·α(n)); each scheduler event is O(p·n).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "AdamState",
    "AdaptiveWindow",
    "Commit",
    "GroupScheduler",
    "SchedulerConfig",
    "TumblingWindow",
    "UnionFind",
    "adam_scaled_update",
    "communicator_count",
    "components",
    "group_average",
    "is_valid_group",
    "min_group_sizes_ok",
    "next_wait",
    "sync_matrix",
    "theorem_constants",
    "window_connected",
]


# --------------------------------------------------------------------------------------
# 1. the averaging rule
# --------------------------------------------------------------------------------------
def _check_group(group: Iterable[int], n: int) -> tuple[int, ...]:
    members = tuple(sorted(set(group)))
    if not members:
        raise ValueError("a group needs at least one member, got an empty group")
    bad = [w for w in members if not 0 <= w < n]
    if bad:
        raise ValueError(f"group members {bad} out of range for {n} replicas (0..{n - 1})")
    return members


def group_average(values: Sequence[float], group: Iterable[int]) -> list[float]:
    """One group-sync of scalar replicas: members get their mean, the others keep theirs.

    Args:
        values: one value per replica of a stage (``values[i]`` is replica i's).
        group: the indices of the replicas that average.

    Returns:
        The new values (a new list; ``values`` is not changed).

    Example:
        >>> group_average([1.0, 3.0, 10.0], {0, 1})
        [2.0, 2.0, 10.0]
    """
    members = _check_group(group, len(values))
    mean = math.fsum(values[w] for w in members) / len(members)
    out = list(values)
    for w in members:
        out[w] = mean
    return out


def sync_matrix(n: int, group: Iterable[int]) -> list[list[float]]:
    """The synchronisation matrix W of eq. (2): ``1/|S|`` between members, 1 on the diagonal
    of non-members, 0 elsewhere (symmetric and doubly stochastic)."""
    members = set(_check_group(group, n))
    size = len(members)
    return [
        [
            (1.0 / size if (u in members and v in members) else (1.0 if u == v else 0.0))
            for v in range(n)
        ]
        for u in range(n)
    ]


# --------------------------------------------------------------------------------------
# 2. connectivity (Assumption 1)
# --------------------------------------------------------------------------------------
class UnionFind:
    """A disjoint-set forest over ``0..n-1`` (path halving, union by size)."""

    def __init__(self, n: int) -> None:
        self.parent = list(range(n))
        self.size = [1] * n
        self.count = n

    def find(self, x: int) -> int:
        """The representative of ``x``'s set."""
        parent = self.parent
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(self, a: int, b: int) -> bool:
        """Merge the sets of ``a`` and ``b``; True when they were separate."""
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return False
        if self.size[ra] < self.size[rb]:
            ra, rb = rb, ra
        self.parent[rb] = ra
        self.size[ra] += self.size[rb]
        self.count -= 1
        return True

    def union_all(self, members: Sequence[int]) -> None:
        """Merge every member's set into the first member's (a clique's connectivity)."""
        for w in members[1:]:
            self.union(members[0], w)


def components(n: int, groups: Iterable[Iterable[int]], among: Iterable[int] | None = None
               ) -> int:
    """Connected components of the graph on ``among`` (default all ``n`` replicas) whose
    edges are the cliques of ``groups`` (members outside ``among`` are dropped)."""
    nodes = sorted(set(range(n) if among is None else among))
    index = {w: k for k, w in enumerate(nodes)}
    uf = UnionFind(len(nodes))
    for group in groups:
        uf.union_all([index[w] for w in sorted(set(group)) if w in index])
    return uf.count


def window_connected(n: int, groups: Iterable[Iterable[int]],
                     among: Iterable[int] | None = None) -> bool:
    """Whether the union of the groups' cliques connects all replicas (``among`` if given)."""
    return components(n, groups, among) <= 1


def is_valid_group(history: Sequence[Iterable[int]], group: Iterable[int], n: int, p: int
                   ) -> bool:
    """Assumption 1 for a candidate group: the cliques of the last ``p - 1`` groups of
    ``history`` (oldest first, newest last) and of ``group`` connect all ``n`` replicas.

    Args:
        history: the stage's committed groups, newest last.
        group: the candidate.
        n: replicas of the stage.
        p: the connectivity window P ≥ 1, in groups; ``p = 1`` admits only the full group.

    Example:
        >>> is_valid_group([{0, 1}, {2, 3}], {1, 2}, n=4, p=3)
        True
        >>> is_valid_group([{0, 1}, {2, 3}], {0, 1}, n=4, p=3)
        False
    """
    if p < 1:
        raise ValueError(f"p (the connectivity window) must be >= 1, got {p}")
    members = _check_group(group, n)
    window = list(history)[len(history) - (p - 1):] if p > 1 else []
    return window_connected(n, [*window, members])


def min_group_sizes_ok(sizes: Sequence[int], n: int) -> bool:
    """The necessary condition on P consecutive group sizes: a group of s replicas merges at
    most s - 1 components, so the window connects n replicas only if Σ(s - 1) ≥ n - 1."""
    return sum(s - 1 for s in sizes) >= n - 1


# --------------------------------------------------------------------------------------
# 3. the window T and its adaptation
# --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class AdaptiveWindow:
    """The per-worker adaptive wait of the authors' code: a worker that got a group smaller
    than ``min_group`` waits ``grow`` times longer next time (at most ``hi_s``), otherwise
    ``shrink`` times as long (at least ``lo_s``). ``start_s`` is the first wait."""

    start_s: float
    lo_s: float
    hi_s: float
    min_group: int = 2
    grow: float = 2.0
    shrink: float = 0.9

    def __post_init__(self) -> None:
        if not 0 < self.lo_s <= self.start_s <= self.hi_s:
            raise ValueError(
                f"adaptive window needs 0 < lo_s <= start_s <= hi_s, got lo_s={self.lo_s}, "
                f"start_s={self.start_s}, hi_s={self.hi_s}"
            )


def next_wait(wait_s: float, group_size: int, rule: AdaptiveWindow) -> float:
    """The wait a worker uses next, after receiving a group of ``group_size`` members."""
    if group_size < rule.min_group:
        return min(wait_s * rule.grow, rule.hi_s)
    return max(wait_s * rule.shrink, rule.lo_s)


# --------------------------------------------------------------------------------------
# 4. the scheduler (Algorithm 2 with validation and the global lock)
# --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """What the scheduler decides with.

    Attributes:
        num_stages: M, stages (one group-formation state per stage).
        num_pipelines: N, replicas per stage.
        p: the connectivity window P in committed groups; None turns validation off (groups
            are whatever the window collects).
        window_s: the window T: how long the first ready signal of a formation waits for more.
        window_mode: ``"first_arrival"`` (the window opens at the first ready signal; the
            authors' code) or ``"ticks"`` (a free-running clock with period T; Algorithm 2
            read literally: the formation closes at the next multiple of T).
        adaptive: adapt T per worker (:class:`AdaptiveWindow`; the first arrival's wait sets
            the deadline), or None for the fixed ``window_s``.
        early_close: commit as soon as every active replica of the stage is ready.
        deadlock_prevention: the global enforcement lock; False lets every stage block
            waiting for a valid group (only to demonstrate the deadlock of Fig. 3).
    """

    num_stages: int
    num_pipelines: int
    p: int | None = 10
    window_s: float = 0.0
    window_mode: Literal["first_arrival", "ticks"] = "first_arrival"
    adaptive: AdaptiveWindow | None = None
    early_close: bool = True
    deadlock_prevention: bool = True

    def __post_init__(self) -> None:
        if self.num_stages < 1 or self.num_pipelines < 1:
            raise ValueError(
                f"need num_stages >= 1 and num_pipelines >= 1, got {self.num_stages} x "
                f"{self.num_pipelines}"
            )
        if self.p is not None and self.p < 1:
            raise ValueError(f"p (the connectivity window) must be >= 1 or None, got {self.p}")
        if self.window_s < 0 or not math.isfinite(self.window_s):
            raise ValueError(f"window_s must be a finite number >= 0, got {self.window_s}")
        if self.window_mode == "ticks" and self.window_s <= 0:
            raise ValueError("window_mode 'ticks' needs window_s > 0 (the tick period)")


@dataclass(frozen=True, slots=True)
class Commit:
    """One committed group: stage, its per-stage index k, the commit time, the sorted
    members, whether the stage waited beyond its window for it (``enforced``), and whether it
    was committed without passing validation because another stage held the lock
    (``lock_skipped``)."""

    stage: int
    index: int
    time: float
    group: tuple[int, ...]
    enforced: bool = False
    lock_skipped: bool = False


@dataclass(slots=True)
class _StageState:
    pending: list[int] = field(default_factory=list)
    deadline: float | None = None
    history: deque[tuple[int, ...]] = field(default_factory=deque)
    count: int = 0
    retired: set[int] = field(default_factory=set)
    waiting: bool = False  # the pending group failed validation; it waits for more workers


class GroupScheduler:
    """SDPipe's central scheduler for every stage of an M × N mesh (a pure state machine).

    Feed it ready signals and the clock; it answers with the groups it commits, in order. It
    never reads a clock itself, so the runtime drives it with wall time and the simulator
    with simulated time, and both get the same groups for the same event order.

    Rules (Algorithm 2, §3.4, and ``docs/decisions/sdpipe.md``):

    - the first ready signal of a formation sets its deadline (``window_s`` or the worker's
      adaptive wait; the next tick in ``ticks`` mode); later ones join it;
    - at the deadline, or when every active replica is ready (``early_close``), the pending
      group is committed if it is valid (:func:`is_valid_group` over the stage's last P-1
      groups); if it is not, the stage takes the global lock and keeps waiting — every new
      ready signal re-checks (every tick in ``ticks`` mode) — until the group becomes valid;
      if another stage holds the lock, the group is committed anyway and logged as a lock
      skip;
    - a retired worker (its training is over) leaves the connectivity requirement: only the
      stage's active workers must be connected.

    Example:
        >>> s = GroupScheduler(SchedulerConfig(num_stages=1, num_pipelines=2, p=2,
        ...                                    window_s=0.5))
        >>> s.ready(0, 1, t=0.0)
        []
        >>> s.advance(0.5)
        [Commit(stage=0, index=0, time=0.5, group=(1,), enforced=False, lock_skipped=False)]
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        n = config.num_pipelines
        keep = 0 if config.p is None else config.p - 1
        self._stages = [_StageState(history=deque(maxlen=keep)) for _ in range(config.num_stages)]
        for state in self._stages:
            if keep:  # all replicas start identical: a virtual full group seeds the window
                state.history.append(tuple(range(n)))
        start = config.adaptive.start_s if config.adaptive is not None else config.window_s
        self._wait = [[start] * n for _ in range(config.num_stages)]
        self.lock_holder: int | None = None
        self.commits: list[Commit] = []

    # -- queries ----------------------------------------------------------------------------
    def pending(self, stage: int) -> tuple[int, ...]:
        """The workers of ``stage`` waiting for a group, in arrival order."""
        return tuple(self._stages[stage].pending)

    def next_deadline(self) -> float | None:
        """The earliest deadline of a formation that is not waiting on the lock, or None."""
        ticks = self.config.window_mode == "ticks"
        times = [s.deadline for s in self._stages
                 if s.deadline is not None and s.pending and (ticks or not s.waiting)]
        return min(times) if times else None

    def wait_s(self, stage: int, worker: int) -> float:
        """The window the worker's next ready signal opens (adaptive or fixed)."""
        return self._wait[stage][worker]

    # -- events -----------------------------------------------------------------------------
    def ready(self, stage: int, worker: int, t: float) -> list[Commit]:
        """Worker ``worker`` of ``stage`` is ready at time ``t``; returns the commits."""
        self._check(stage, worker)
        state = self._stages[stage]
        if worker in state.pending:
            raise ValueError(f"worker {worker} of stage {stage} is already waiting for a group")
        if worker in state.retired:
            raise ValueError(f"worker {worker} of stage {stage} retired; it cannot sync again")
        if not state.pending:
            state.deadline = self._deadline(stage, worker, t)
        state.pending.append(worker)
        out: list[Commit] = []
        if state.waiting and self.config.window_mode == "first_arrival":
            self._try_commit(stage, t, out, at_deadline=False)
        elif self.config.early_close and len(state.pending) == self._active(stage):
            self._try_commit(stage, t, out, at_deadline=True)
        return out

    def advance(self, t: float) -> list[Commit]:
        """The clock reached ``t``: close every formation whose deadline has passed."""
        out: list[Commit] = []
        ticks = self.config.window_mode == "ticks"
        while True:
            due = [(s.deadline, j) for j, s in enumerate(self._stages)
                   if s.pending and s.deadline is not None and s.deadline <= t
                   and (ticks or not s.waiting)]
            if not due:
                return out
            # earliest deadline first, stage index breaks ties: a fixed order; a stage that
            # fails validation starts waiting and drops out of ``due``
            self._try_commit(min(due)[1], t, out, at_deadline=True)

    def retire(self, stage: int, worker: int, t: float) -> list[Commit]:
        """Worker ``worker`` of ``stage`` has finished training; returns the commits its
        leaving unblocks (a waiting formation may now connect every active worker)."""
        self._check(stage, worker)
        state = self._stages[stage]
        if worker in state.pending:
            raise ValueError(f"worker {worker} of stage {stage} retires while waiting for a group")
        state.retired.add(worker)
        out: list[Commit] = []
        recheck = state.waiting and self.config.window_mode == "first_arrival"
        full = self.config.early_close and len(state.pending) == self._active(stage)
        if state.pending and (recheck or full):
            self._try_commit(stage, t, out, at_deadline=not state.waiting)
        return out

    # -- internals --------------------------------------------------------------------------
    def _check(self, stage: int, worker: int) -> None:
        if not 0 <= stage < self.config.num_stages:
            raise ValueError(f"stage {stage} out of range 0..{self.config.num_stages - 1}")
        if not 0 <= worker < self.config.num_pipelines:
            raise ValueError(f"worker {worker} out of range 0..{self.config.num_pipelines - 1}")

    def _active(self, stage: int) -> int:
        return self.config.num_pipelines - len(self._stages[stage].retired)

    def _deadline(self, stage: int, worker: int, t: float) -> float:
        if self.config.window_mode == "ticks":
            period = self.config.window_s
            return math.ceil(t / period - 1e-12) * period
        return t + self._wait[stage][worker]

    def _valid(self, stage: int) -> bool:
        state = self._stages[stage]
        if self.config.p is None:
            return True
        active = [w for w in range(self.config.num_pipelines) if w not in state.retired]
        return window_connected(self.config.num_pipelines, [*state.history, state.pending],
                                among=active)

    def _try_commit(self, stage: int, t: float, out: list[Commit], *, at_deadline: bool
                    ) -> None:
        state = self._stages[stage]
        if self._valid(stage):
            self._commit(stage, t, out, enforced=state.waiting, skipped=False)
            return
        if not self.config.deadlock_prevention or self.lock_holder in (None, stage):
            # wait for more workers; without the lock every stage may (Fig. 3 can happen)
            if self.config.deadlock_prevention:
                self.lock_holder = stage
            state.waiting = True
            if self.config.window_mode == "ticks":  # Algorithm 2: re-check at the next tick
                period = self.config.window_s
                state.deadline = (math.floor(t / period + 1e-12) + 1) * period
            return
        assert at_deadline  # a stage that does not wait tries only at its deadline or full
        self._commit(stage, t, out, enforced=False, skipped=True)

    def _commit(self, stage: int, t: float, out: list[Commit], *, enforced: bool,
                skipped: bool) -> None:
        state = self._stages[stage]
        group = tuple(sorted(state.pending))
        commit = Commit(stage, state.count, t, group, enforced=enforced, lock_skipped=skipped)
        state.history.append(group)
        state.count += 1
        state.pending = []
        state.deadline = None
        state.waiting = False
        if self.lock_holder == stage:
            self.lock_holder = None
        rule = self.config.adaptive
        if rule is not None:
            for w in group:
                self._wait[stage][w] = next_wait(self._wait[stage][w], len(group), rule)
        self.commits.append(commit)
        out.append(commit)


class TumblingWindow:
    """The authors' code's approximation of Assumption 1 for one stage (``ReduceStat``, N ≤ 8),
    kept as a reference for the digest's E6; :class:`GroupScheduler` uses the sliding window.

    Every committed group is merged into one disjoint set; once the stage has committed
    ``n·p`` worker updates since the last enforcement (``acc``), the next formation is
    enforced: it waits, without a timeout, until the disjoint set merged with the pending
    group connects all ``n`` workers; after it the set is reset.
    """

    def __init__(self, n: int, p: int) -> None:
        if n < 1 or p < 1:
            raise ValueError(f"need n >= 1 and p >= 1, got n={n}, p={p}")
        self.n, self.bound = n, n * p
        self.acc = 0
        self.need_enforce = False
        self._uf = UnionFind(n)

    def roots(self) -> list[int]:
        """Each worker's component, named by its smallest member."""
        smallest: dict[int, int] = {}
        for w in range(self.n):
            smallest.setdefault(self._uf.find(w), w)
        return [smallest[self._uf.find(w)] for w in range(self.n)]

    def enforced_valid(self, pending: Sequence[int]) -> bool:
        """Whether an enforced formation with ``pending`` ready may commit."""
        uf = UnionFind(self.n)
        for w in range(self.n):
            uf.union(w, self._uf.find(w))
        uf.union_all(sorted(set(pending)))
        return uf.count == 1

    def record(self, group: Sequence[int], *, enforced: bool = False) -> None:
        """A group was committed (``enforced``: by an enforced formation)."""
        before = self.acc // self.bound
        if enforced:
            self._uf = UnionFind(self.n)
            self.need_enforce = False
        else:
            self._uf.union_all(sorted(set(group)))
        self.acc += len(group)
        if self.acc // self.bound > before:
            self.need_enforce = True


# --------------------------------------------------------------------------------------
# 5. the optimizer-state correction
# --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class AdamState:
    """Per-element Adam state with SDPipe's extra first moment ``m2`` (an EMA with β2)."""

    m: float = 0.0
    m2: float = 0.0
    v: float = 0.0
    step: int = 0


def adam_scaled_update(param: float, grad: float, state: AdamState, *, lr: float,
                       beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-7,
                       weight_decay: float = 0.0, scale: float = 1.0
                       ) -> tuple[float, AdamState, float]:
    """One AdamW step with SDPipe's variance correction (the authors' ``adamw_scaled``).

    The second moment used is ``m2² + (v - m2²) · scale`` (``scale = 1/N``): the local
    gradient variance is N times the variance of an average over N replicas, so the
    variance part of ``v`` is scaled down. ``scale = 1`` is plain AdamW.

    Returns:
        ``(new_param, new_state, update)`` where ``update`` is the bias-corrected direction
        before the learning rate (E9 of the digest: g = 2, scale = 1/4 gives 1.99701).
    """
    step = state.step + 1
    m = beta1 * state.m + (1 - beta1) * grad
    m2 = beta2 * state.m2 + (1 - beta2) * grad
    v = beta2 * state.v + (1 - beta2) * grad * grad
    scaled_v = m2 * m2 + (v - m2 * m2) * scale
    m_hat = m / (1 - beta1 ** step)
    v_hat = max(scaled_v, 0.0) / (1 - beta2 ** step)
    update = m_hat / (math.sqrt(v_hat) + eps)
    new_param = param - lr * (update + weight_decay * param)
    return new_param, AdamState(m=m, m2=m2, v=v, step=step), update


# --------------------------------------------------------------------------------------
# 6. small facts the plan and the docs quote
# --------------------------------------------------------------------------------------
def communicator_count(n: int) -> int:
    """Distinct groups of two or more among n replicas (2^n - n - 1): the communicators a
    stage needs when every possible group is pre-built."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return 2 ** n - n - 1


def theorem_constants(n: int, p: int, n1: float) -> tuple[float, float, float]:
    """The constants of Theorem 1 (ART form): ``t1 = 4N((1 + n1^{NP}) / (1 - n1^{-NP}))²``,
    ``t2 = (1 - n1^{-NP})^{2/(NP)}`` and the factor ``1/(1 - t2) + 2/(1 - √t2)²``.

    They grow astronomically with N·P (N = 4, P = 10 overflows the factor), which is why P is
    a user setting and not derived from the bound.
    """
    np_ = n * p
    t1 = 4 * n * ((1 + n1 ** np_) / (1 - n1 ** (-np_))) ** 2
    t2 = (1 - n1 ** (-np_)) ** (2 / np_)
    factor = 1 / (1 - t2) + 2 / (1 - math.sqrt(t2)) ** 2
    return t1, t2, factor
