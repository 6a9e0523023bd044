"""Espresso's decision algorithm: per-tensor compression options (thesis §4.7, digest §E.5–E.6).

Every candidate strategy is scored by the shared data-parallel timeline simulator
(:func:`hetplan.algorithms.dp_timeline.simulate_dp`); the caller says what the ops of a tensor
under an option are (:class:`SelectionProblem.ops`), so the same algorithm serves the plan pass
(options are decision-tree paths, ops come from ``cost_models.evaluate``) and the figure tests
(hand-made options and durations).

1. **GPU decisions** (Algorithm 4.1, :func:`gpu_decisions`). Start with every tensor
   uncompressed. Tensors are grouped by size, groups in descending size, each group latest-ready
   first (Property #2; "closer to the output layer" = later in backprop). ``Remove()`` drops the
   uncompressed tensors communicated before a bubble (Property #1) and is re-run after each
   decision. For each remaining tensor every GPU-only option is simulated with the others fixed
   and the one with the smallest iteration time kept (Property #3; ties keep the current option).
2. **CPU offloading** (Algorithm 4.2 with Lemma 4.1 / Theorem 4.1, :func:`cpu_offload`). The
   compressed tensors are grouped by (size, option), each group earliest-ready first; every
   vector ``(u_1..u_d)``, ``0 <= u_i <= |G_i|``, offloads the first ``u_i`` tensors of group ``i``;
   the best is kept. That is ``prod(|G_i| + 1)`` simulations, optimal among offloading subsets
   when Lemma 4.1 holds for the simulator.
3. :func:`select` runs both, or searches exhaustively when the whole strategy space is small,
   and never returns a strategy predicted slower than the uncompressed one or than any of the
   caller's ``seeds`` (e.g. uniform strategies): Algorithm 4.1 is one greedy sweep and can
   lock in a choice made while every later tensor was still uncompressed, so when a seed is
   better the sweep is repeated from that seed (an extension; the method says which won).

Decisions on the ambiguities (``research/zen_espresso.md`` §H; also in ``docs/decisions.md``):

- §H.3: ready order is the order of ``backprop_s`` (tensor 0 is produced first); Algorithm 4.1
  ties go to the latest-ready tensor, offloading (Lemma 4.1) goes to the earliest-ready first.
- §H.4: timeline semantics are those of ``simulate_dp``: GPU (de)compression preempts the
  remaining backprop, one FIFO per communication channel, a pool of ``cpu_workers`` CPU
  workers; host↔device copies are not modelled separately.
- §H.5: bubbles are gaps longer than 1e-9 s in the union of all communication channels that
  no tensor spans (a tensor spans a gap when it became ready before it and still has ops
  after it: a gap inside one tensor's path, e.g. its own decompression after it waited
  behind earlier tensors, is no bubble, since shortening the earlier communication moves it
  too); a zero-length gap is not a bubble. A tensor is "communicated before a bubble" when
  its last communication ends at or before the start of the last busy period. Removed
  tensors stay removed.
- §H.6: the GPU candidates of a tensor are all its GPU-only options the caller allows (the
  pass gives flat and hierarchical ones on a multi-node group; tensors may mix them).
- §H.7: offloading moves *all* of a tensor's (de)compressions to the CPU (``offload``);
  groups are keyed by (size, option) as in the thesis. When ``prod(|G_i|+1)`` exceeds
  ``offload_limit`` the groups are optimized one at a time (coordinate descent, repeated until
  no group changes) instead — not optimal, stated in :attr:`Selection.method`.
- Speed (§H.8): every candidate is scored with a resumable simulation
  (:class:`~hetplan.algorithms.dp_session.DPSession`) that starts at the state saved at the
  changed tensor's ready time (the prefix cannot change), stops once the candidate is
  proven unable to be kept (a lower bound on its time exceeds what it must beat) and
  returns the base's time once its state becomes equivalent to the base's. Values it
  returns are bit-identical to :func:`simulate_dp`'s, so ``fast=True`` chooses exactly what
  ``fast=False`` (every candidate simulated from scratch) chooses; tests compare the two.
  Candidates with the same ops as one already scored for the tensor are not
  re-simulated, and a candidate that is no shorter than the current option on every
  resource (communication, GPU and CPU busy time) is skipped (it cannot shorten the timeline
  in the common case; only improvements are ever accepted, so skipping never makes the
  result worse than the start). A tensor goes back to its baseline (uncompressed) option
  on a tie: compression is kept only where it is predicted to pay.
- Speed, compiled: the session's kernels are compiled with numba when it is installed
  (:mod:`~hetplan.algorithms.dp_session`; ``HETPLAN_JIT=0`` runs the same kernels
  uncompiled, same values bit for bit), and ``GetBestOption`` for one tensor, Algorithm 4.2 (exact or
  coordinate descent), the uniform seeds and the bubble test each run as one compiled call;
  with ``SelectionProblem.ops_class`` the candidates of tensors that share their ops are
  filtered once, and with ``SelectionProblem.ops_table`` (the plan pass gives it) the filter
  and the uniform seeds work on each option's whole cost table, every size class at once
  (:mod:`~hetplan.algorithms.espresso_tables`); a sweep packs each candidate list it tries
  once, replaces one tensor's ops on an accepted change (``DPSession.replace``) and keeps
  ``Remove()``'s tensors as a bool per tensor. Same choices; measured in
  ``docs/decisions/espresso-speed.md``, "Round 7". With ``select(parallel=True)`` the
  seeds and the sweep from the best one run on a second thread beside the first sweep
  (:mod:`~hetplan.algorithms.espresso_parallel`; the kernels release the GIL): the same
  choices, less wall time on two free cores, some CPU time on seed sweeps that turn out
  unneeded ("Round 8").
- Floor (``select(floor=...)``, off by default here; the plan pass sets it at its lower
  bound plus ``bound_within``): a strategy at or below the floor is final. The seeds are
  scored first; the best, if at the floor, is returned after one sweep in which each tensor
  tries only its baseline (ties keep the baseline, as in Algorithm 4.1), with no other
  sweep and no offloading; else a sweep stops once it reaches the floor (at its start or
  at an accepted change), and the sweep from the best seed is not run after a first sweep
  that reached it. Where the floor is never reached the result and the evaluation count
  are those without it ("Round 9").
- Step-for-step dominance (with ``prune``,
  :class:`~hetplan.algorithms.espresso_candidates.Candidates`): an option whose ops are
  another option's ops on the same resources in the same order, each step at least as long
  and one longer, is not tried (the baseline always is). The simulator is not monotone in op
  durations in every case, so this can change the result: on the 36 cases of
  ``bench/espresso.py`` it halved the trials; 29 choices were unchanged, 6 predicted faster
  (up to 3.6 %) and 1 slower (2.5 %) than trying every distinct option.
- Candidate screen (``screen``, an approximation the plan pass turns on; off by default
  here). Tensors of one ``ops_class`` have the same candidates, and the sweep reaches them
  one after another. The first ``screen`` of a class in a sweep try every candidate; each
  later one tries only its baseline and the options some tensor of its class held when the
  sweep started or has taken in it. On the large workloads most tensors sit in a few
  classes (gpt2: 74 of 148 tensors in one size class, bert 110 of 199, resnet101 100 of
  314), and their trials were most of the time. The choices change (the greedy sweep is
  path dependent); ``select(seed_within=...)`` also sweeps from the best seed when it is
  nearly as fast, which wins back most of what the screen loses. Measured on the 36
  cases of ``bench/espresso.py`` in ``docs/decisions/espresso-speed.md``, "Round 6".
- Not optimal: Algorithm 4.1 + 4.2 is a heuristic. On Fig. 4.2's example it returns NCG
  (39.6) where the optimum is CNG (36.2): Algorithm 4.2 only offloads tensors Algorithm 4.1
  compressed on the GPU. :func:`select` therefore searches exhaustively when the strategy
  space has at most ``exhaustive_limit`` strategies.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np

from hetplan.algorithms._dp_search import next_offload
from hetplan.algorithms.dp_session import DPSession
from hetplan.algorithms.dp_timeline import before_last_busy_period, simulate_dp
from hetplan.algorithms.dp_types import Op, SyncUnit
from hetplan.algorithms.espresso_candidates import EPS, Candidates
from hetplan.algorithms.espresso_parallel import SeedSweep, detached, sweeps_seed
from hetplan.algorithms.espresso_tables import OpsTable

__all__ = [
    "SelectionProblem",
    "Selection",
    "gpu_decisions",
    "cpu_offload",
    "select",
    "tensors_before_bubbles",
    "processing_order",
    "search_offload",
    "tensor_benefits",
]

K = TypeVar("K", bound=Hashable)
_EPS = EPS  # Algorithm 4.1's tolerance (ties, improvements)


@dataclass
class SelectionProblem(Generic[K]):
    """One data-parallel group's gradient tensors and their options.

    Attributes:
        backprop_s: backprop time before each tensor becomes ready (ready order).
        sizes: tensor sizes (bytes); Algorithm 4.1 groups by them.
        baseline: each tensor's uncompressed option (the start of Algorithm 4.1).
        gpu_options: each tensor's candidate GPU-only options (may include ``baseline``).
        ops: the simulator ops of tensor ``i`` under an option.
        compressed: whether an option compresses.
        offload: the option with its (de)compressions on the CPU, or None (not allowed).
        all_options: each tensor's full option set for exhaustive search (default: the GPU
            options, their offloaded versions and the baseline).
        forward_s / optimizer_s / cpu_workers: passed to the simulator.
        ops_class: optional; tensors with equal values have equal ops under every option (e.g.
            tensors of one size in one group), so per-tensor work is shared between them.
        ops_fields: optional; the identity of an ops tuple's values: equal for two tuples
            exactly when their ops' ``(resource, duration_s, label)`` are equal (e.g. those
            fields as a tuple, or a number the caller interned them to); lets a caller that
            keeps its ops tuples compute it once for all its selections (default: the fields
            as a tuple, computed each time).
        share: optional; a :class:`~hetplan.algorithms.dp_session.DPSession` whose caches of
            ops converted to arrays every session of every :func:`select` on this problem
            uses (e.g. arrays the caller registered for all its ops ahead); no effect on
            results. Default: each selection's sessions share their own.
        ops_table / table_rows: optional, together, with ``ops_fields``; an option's ops at
            every class at once (:data:`~hetplan.algorithms.espresso_tables.OpsTable`:
            resources, durations per row, the ``ops_fields`` value of each row's ops), and
            the row of each tensor: ``ops(i, k)`` has ``ops_table(k)``'s resources with the
            durations of row ``table_rows[i]``. The candidate filter and the uniform seeds
            then work on whole tables (:mod:`~hetplan.algorithms.espresso_tables`); no
            effect on results.
    """

    backprop_s: Sequence[float]
    sizes: Sequence[int]
    baseline: Sequence[K]
    gpu_options: Sequence[Sequence[K]]
    ops: Callable[[int, K], tuple[Op, ...]]
    compressed: Callable[[K], bool]
    offload: Callable[[K], K | None] = lambda k: None
    all_options: Sequence[Sequence[K]] | None = None
    forward_s: float = 0.0
    optimizer_s: float = 0.0
    cpu_workers: int = 1
    ops_class: Sequence[Hashable] | None = None
    ops_fields: Callable[[tuple[Op, ...]], Hashable] | None = None
    share: DPSession | None = None
    ops_table: Callable[[K], OpsTable] | None = None
    table_rows: Sequence[int] | None = None
    evaluations: int = field(default=0, init=False)
    # the last session made, whose caches of ops converted to arrays the next one shares
    # (their entries are checked against the ops themselves, so they cannot go stale);
    # select() drops it when it starts and when it returns
    _last_session: DPSession | None = field(default=None, init=False, repr=False,
                                            compare=False)

    def __post_init__(self) -> None:
        n = len(self.backprop_s)
        if not (len(self.sizes) == len(self.baseline) == len(self.gpu_options) == n):
            raise ValueError(
                f"{n} backprop times, {len(self.sizes)} sizes, {len(self.baseline)} baseline "
                f"options and {len(self.gpu_options)} option lists: one of each per tensor"
            )
        if (self.ops_table is None) != (self.table_rows is None) or (
                self.ops_table is not None and self.ops_fields is None):
            raise ValueError("ops_table needs table_rows and ops_fields (the rows' identities "
                             "are ops_fields values); give all three or no ops_table")
        if self.table_rows is not None and len(self.table_rows) != n:
            raise ValueError(f"{len(self.table_rows)} table rows for {n} tensors: one per "
                             "tensor")

    def units(self, strategy: Sequence[K]) -> list[SyncUnit]:
        return [SyncUnit(i, self.ops(i, k)) for i, k in enumerate(strategy)]

    def iteration_s(self, strategy: Sequence[K]) -> float:
        """Predicted iteration time of ``strategy`` (one option per tensor)."""
        self.evaluations += 1
        return simulate_dp(self.backprop_s, self.units(strategy), forward_s=self.forward_s,
                           optimizer_s=self.optimizer_s, cpu_workers=self.cpu_workers).iteration_s

    def session(self, strategy: Sequence[K]) -> DPSession:
        """A :class:`~hetplan.algorithms.dp_session.DPSession` based on ``strategy``: trials
        that change a few tensors resume from the first changed one (same times as
        :meth:`iteration_s`, bit for bit)."""
        sess = DPSession(self.backprop_s, forward_s=self.forward_s,
                         optimizer_s=self.optimizer_s, cpu_workers=self.cpu_workers,
                         share=self._last_session or self.share)
        self._last_session = sess
        self.evaluations += 1
        sess.rebase([self.ops(i, k) for i, k in enumerate(strategy)])
        return sess

    def trial_s(self, sess: DPSession, changes: dict[int, K], bound: float = float("inf")
                ) -> float:
        """The session's base with ``changes`` (tensor -> option); ``inf`` once proven longer
        than ``bound``."""
        self.evaluations += 1
        return sess.trial({i: self.ops(i, k) for i, k in changes.items()}, bound=bound)


@dataclass(frozen=True)
class Selection(Generic[K]):
    """The chosen strategy and how it was found.

    Attributes:
        strategy: one option per tensor.
        iteration_s: its predicted iteration time.
        baseline_s: the all-uncompressed strategy's.
        benefit_s: per tensor, how much longer the iteration is if that tensor alone goes
            back to its baseline option (0 for tensors left at baseline).
        method: ``exhaustive``, ``espresso`` (Algorithms 4.1 + 4.2), with ``+greedy-offload``
            when Algorithm 4.2 ran group by group, or ``seed:<i>`` when a caller's seed won;
            `` (at the floor)`` where a floor stopped the search (``select(floor=...)``).
        gpu_s / cpu_s: wall-clock time of the GPU decisions and of the CPU offloading.
        evaluations: simulations run.
        gpu_process_s: the process's CPU time during the GPU decisions (``gpu_s`` without
            what other processes on a shared machine took of it).
    """

    strategy: tuple[K, ...]
    iteration_s: float
    baseline_s: float
    benefit_s: tuple[float, ...]
    method: str
    gpu_s: float
    cpu_s: float
    evaluations: int
    gpu_process_s: float = 0.0


def processing_order(sizes: Sequence[int]) -> list[int]:
    """Algorithm 4.1's order: size groups largest first, each latest-ready first."""
    return sorted(range(len(sizes)), key=lambda i: (-sizes[i], -i))


def tensors_before_bubbles(problem: SelectionProblem[K], strategy: Sequence[K]) -> set[int]:
    """Tensors whose communication ends no later than the start of the last busy period of
    the communication timeline (Property #1; see the module docstring, §H.5).

    A gap in the communication timeline is a bubble only if no tensor *spans* it (became
    ready before the gap and still has ops after it): a gap inside one tensor's own path,
    e.g. its decompression between two communication steps after it waited behind earlier
    tensors on a channel, is no bubble, because shortening the earlier communication would
    move that tensor's later steps earlier too.
    """
    return before_last_busy_period(problem.backprop_s, problem.units(strategy),
                                   problem.cpu_workers, _EPS)


def gpu_decisions(
    problem: SelectionProblem[K],
    *,
    prune: bool = True,
    start: Sequence[K] | None = None,
    fast: bool = True,
    candidates: Candidates[K] | None = None,
    screen: int = 0,
    stop: threading.Event | None = None,
    progress: Callable[[float], None] | None = None,
) -> tuple[list[K], float]:
    """Algorithm 4.1: GPU compression decisions (see the module docstring).

    Args:
        problem: the tensors and their options.
        prune: skip candidates no shorter than the current option on every resource.
        start: the initial strategy (default: the baseline, as in the thesis); a tensor's
            baseline option is always among its candidates.
        fast: score candidates with a resumable simulation that starts at the candidate's
            tensor and stops once a candidate is proven slower than the best so far (same
            result as ``fast=False``, which simulates every candidate from scratch).
        candidates: the candidate lists of an earlier sweep of the same, unchanged problem
            with the same ``prune`` (:func:`select` shares one between its sweeps); default:
            computed here.
        screen: with ``problem.ops_class``, the candidate screen (an approximation; 0, the
            default, is Algorithm 4.1 as written): in each class of tensors the first
            ``screen`` the sweep reaches try every candidate; each later one tries only its
            baseline and the options that some tensor of its class held when the sweep
            started or took in it (see the module docstring, "Candidate screen").
        stop: when set (by another thread), the sweep returns what it holds at the next
            tensor: a sweep whose result is no longer wanted (``select(parallel=True)``).
        progress: called with the start's time, then with the incumbent's after every
            change the sweep accepts.

    Returns:
        (strategy, its iteration time).
    """
    strategy = list(problem.baseline if start is None else start)
    sess = problem.session(strategy) if fast else None
    best = sess.base_s if sess is not None else problem.iteration_s(strategy)
    if progress is not None:
        progress(best)

    # Remove(): tensors left uncompressed and communicated before a bubble, once removed
    # always removed (one bool per tensor; the session's mask is the same set as
    # tensors_before_bubbles)
    plain = np.array([not problem.compressed(k) for k in strategy], dtype=np.bool_)

    def removed_now() -> np.ndarray:
        if sess is not None:
            return sess.bubble_mask(_EPS) & plain
        before = np.zeros(len(strategy), dtype=np.bool_)
        before[list(tensors_before_bubbles(problem, strategy))] = True
        return before & plain

    removed = removed_now()
    if candidates is not None and candidates.prune != prune:
        raise ValueError(f"candidate lists made with prune={candidates.prune}, sweep asks "
                         f"prune={prune}")
    pareto = candidates if candidates is not None else Candidates(problem, prune)
    if screen < 0:
        raise ValueError(f"screen must be >= 0 (0: no screen), got {screen}")
    cls = problem.ops_class if screen else None
    reached: dict[Hashable, int] = {}  # class -> its tensors the sweep has reached
    held: dict[Hashable, set[K]] = {}  # class -> options its tensors held or took
    version: dict[Hashable, int] = {}  # class -> a number that changes when held grows
    if cls is not None:
        for i, k in enumerate(strategy):
            held.setdefault(cls[i], set()).add(k)
        # numbered per sweep and class: a screened list is reused only within one sweep's
        # unchanged held set
        first = pareto.next_version(len(held))
        version = {c: first + x for x, c in enumerate(held)}
    # tensors the sweep has yet to reach: Remove() can only matter for those still plain
    ahead = np.ones(len(strategy), dtype=np.bool_)
    for j in processing_order(problem.sizes):
        if stop is not None and stop.is_set():
            break
        ahead[j] = False
        if removed[j]:
            continue
        current = strategy[j]
        tried = keys, cands, backs = pareto.tried(j, current)
        if cls is not None:
            n_reached = reached.get(cls[j], 0)
            reached[cls[j]] = n_reached + 1
            if n_reached >= screen:
                keys, cands, backs = pareto.screened(tried, held[cls[j]], version[cls[j]])
        if sess is not None:
            # a candidate is kept only if f < best - eps, or f <= best + eps for the
            # baseline: each trial stops once proven longer than that
            problem.evaluations += len(cands)
            packed, flags = pareto.packed(sess, cands, backs)
            idx, best = sess.best_packed(j, packed, flags, best, _EPS)
            if idx >= 0:
                current = keys[idx]
                if progress is not None:
                    progress(best)
        else:
            for cand, back in zip(keys, backs):
                trial = strategy.copy()
                trial[j] = cand
                f = problem.iteration_s(trial)
                if f < best - _EPS or (back and f <= best + _EPS):
                    best, current = f, cand
                    if progress is not None:
                        progress(best)
        if current != strategy[j]:
            strategy[j] = current
            plain[j] = not problem.compressed(current)
            if cls is not None and current not in held[cls[j]]:
                held[cls[j]].add(current)
                version[cls[j]] = pareto.next_version(1)
            if sess is not None:
                problem.evaluations += 1
                sess.replace(j, problem.ops(j, current))
            if (ahead & plain & ~removed).any():  # else no tensor ahead could be removed
                removed |= removed_now()
    return strategy, best


def _offload_groups(problem: SelectionProblem[K], strategy: Sequence[K]) -> list[list[int]]:
    """Compressed tensors that can be offloaded, grouped by (size, option), each group
    earliest-ready first; groups in order of their first tensor."""
    groups: dict[tuple[int, K], list[int]] = {}
    for i, k in enumerate(strategy):
        if problem.compressed(k):
            cpu = problem.offload(k)
            if cpu is not None and cpu != k:
                groups.setdefault((problem.sizes[i], k), []).append(i)
    return sorted(groups.values(), key=lambda g: g[0])


def _apply(problem: SelectionProblem[K], strategy: Sequence[K], groups: list[list[int]],
           counts: Sequence[int]) -> list[K]:
    out = list(strategy)
    for g, u in zip(groups, counts):
        for i in g[:u]:
            cpu = problem.offload(strategy[i])
            assert cpu is not None
            out[i] = cpu
    return out


def search_offload(
    counts: Sequence[int],
    score: Callable[[Sequence[int], float], float],
    best: float,
    eps: float,
    exhaustive: bool = True,
) -> tuple[list[int], float]:
    """Algorithm 4.2's search over vectors ``u`` with ``0 <= u[g] <= counts[g]``, each scored
    by ``score(u, bound)`` (``u``'s time, or anything above ``bound`` once proven longer).
    A vector is kept when its time is below ``best - eps``. The vectors come in the order of
    :func:`~hetplan.algorithms._dp_search.next_offload`, which the session's kernel walks
    too: with ``exhaustive`` every vector in :func:`itertools.product` order (Theorem 4.1;
    the first of equals wins), otherwise coordinate descent. Returns ``(u, its time)``, ``u``
    all zeros when none beats ``best``. The reference for ``cpu_offload(fast=False)``."""
    sizes = np.array(counts, dtype=np.int64)
    u = np.zeros(len(counts), dtype=np.int64)
    best_u = np.zeros(len(counts), dtype=np.int64)
    at = np.array([0, -1, 0])
    while next_offload(u, best_u, sizes, exhaustive, at):
        f = score([int(x) for x in u], best - eps)
        if f < best - eps:
            best = f
            best_u[:] = u
            at[2] = 1
    return [int(x) for x in best_u], best


def cpu_offload(
    problem: SelectionProblem[K],
    strategy: Sequence[K],
    *,
    limit: int = 1 << 15,
    fast: bool = True,
) -> tuple[list[K], float, bool]:
    """Algorithm 4.2: the best CPU offloading of ``strategy``'s compressed tensors.

    Args:
        problem / strategy: the tensors and Algorithm 4.1's strategy.
        limit: exact search (Theorem 4.1) up to this many offloading vectors.
        fast: resumable, early-stopping simulations (same result as ``fast=False``).

    Returns:
        (strategy, its iteration time, whether the exact search of Theorem 4.1 ran; False
        means the coordinate-descent fallback for more than ``limit`` vectors).
    """
    groups = _offload_groups(problem, strategy)
    base = list(strategy)
    sess = problem.session(base) if fast else None
    best_f = sess.base_s if sess is not None else problem.iteration_s(base)
    if not groups:
        return base, best_f, True

    total = 1
    for g in groups:
        total *= len(g) + 1
    if sess is not None:  # each trial bounded by what it must beat
        offloaded = {i: problem.ops(i, problem.offload(base[i]))  # type: ignore[arg-type]
                     for g in groups for i in g}
        before = sess.trials
        best_u, best_f = sess.best_offload(groups, offloaded, best_f, _EPS,
                                           exhaustive=total <= limit)
        problem.evaluations += sess.trials - before
        return _apply(problem, base, groups, best_u), best_f, total <= limit

    best_u, best_f = search_offload(  # the reference: a full simulation per vector
        [len(g) for g in groups],
        lambda u, bound: problem.iteration_s(_apply(problem, base, groups, u)),
        best_f, _EPS, exhaustive=total <= limit)
    return _apply(problem, base, groups, best_u), best_f, total <= limit


def _full_options(problem: SelectionProblem[K], i: int) -> list[K]:
    """Tensor ``i``'s full option set for the exhaustive search."""
    if problem.all_options is not None:
        return list(problem.all_options[i])
    seen: list[K] = [problem.baseline[i]]
    for k in problem.gpu_options[i]:
        for x in (k, problem.offload(k)):
            if x is not None and x not in seen:
                seen.append(x)
    return seen


def _exhaustive(problem: SelectionProblem[K], options: list[list[K]]) -> tuple[list[K], float]:
    best: tuple[float, list[K]] | None = None
    for combo in itertools.product(*options):
        f = problem.iteration_s(combo)
        if best is None or f < best[0] - _EPS:
            best = (f, list(combo))
    assert best is not None
    return best[1], best[0]


def _uniform(strategy: Sequence[K]) -> bool:
    """Every tensor on one option (what ``len(set(strategy)) == 1`` says, without hashing
    every entry: a uniform seed repeats one object)."""
    return len(strategy) > 0 and strategy.count(strategy[0]) == len(strategy)


def _best_seed(
    problem: SelectionProblem[K], seeds: Sequence[Sequence[K]], fast: bool
) -> tuple[float, int] | None:
    """``min((F(seed), index))`` over the seeds; the fast path stops a seed's simulation once
    it is proven longer than the best seed so far (which then cannot be the minimum)."""
    if not fast or not seeds:
        return min(((problem.iteration_s(sd), n) for n, sd in enumerate(seeds)), default=None)
    sess = problem.session(problem.baseline)
    best: tuple[float, int] | None = None
    rest = list(range(len(seeds)))
    table, rows = problem.ops_table, problem.table_rows
    if table is not None and rows is not None:  # uniform seeds from the tables, one call
        uniform = [n for n, sd in enumerate(seeds) if _uniform(sd)]
        if uniform:
            problem.evaluations += len(uniform)
            tabs = [table(seeds[n][0]) for n in uniform]
            at, f = sess.best_tables(rows, [(t.resources, t.durations) for t in tabs])
            best = (f, uniform[at])
            done = set(uniform)
            rest = [n for n in rest if n not in done]
    elif problem.ops_class is not None:  # uniform seeds: one compiled call over all of them
        classes: dict[Hashable, int] = {}
        class_idx = [classes.setdefault(c, len(classes)) for c in problem.ops_class]
        reps = {c: i for i, c in reversed(list(enumerate(class_idx)))}  # a tensor per class
        uniform = [n for n, sd in enumerate(seeds) if _uniform(sd)]
        if uniform:
            problem.evaluations += len(uniform)
            at, f = sess.best_classes(class_idx, [
                [problem.ops(reps[c], seeds[n][0]) for c in range(len(classes))]
                for n in uniform])
            best = (f, uniform[at])
            done = set(uniform)
            rest = [n for n in rest if n not in done]
    for n in rest:
        sd = seeds[n]
        changes = {i: k for i, k in enumerate(sd) if k != problem.baseline[i]}
        f = problem.trial_s(sess, changes, bound=best[0] if best else float("inf"))
        if best is None or (f, n) < best:
            best = (f, n)
    return best


def tensor_benefits(problem: SelectionProblem[K], strategy: Sequence[K], iteration_s: float,
                    *, fast: bool = True) -> tuple[float, ...]:
    """:attr:`Selection.benefit_s` of ``strategy`` (predicted ``iteration_s``): per tensor,
    how much longer the iteration is if that tensor alone goes back to its baseline option
    (0 for tensors at baseline). One simulation per tensor off its baseline (resumed from
    that tensor with ``fast``)."""
    out = []
    sess = problem.session(strategy) if fast else None
    for i, k in enumerate(strategy):
        if k == problem.baseline[i]:
            out.append(0.0)
        elif sess is not None:
            out.append(problem.trial_s(sess, {i: problem.baseline[i]}) - iteration_s)
        else:
            trial = list(strategy)
            trial[i] = problem.baseline[i]
            out.append(problem.iteration_s(trial) - iteration_s)
    return tuple(out)


def _ties_to_baseline(problem: SelectionProblem[K], strategy: Sequence[K], fast: bool
                      ) -> tuple[list[K], float]:
    """One sweep of Algorithm 4.1 from ``strategy`` in which each tensor tries its baseline
    option alone: a tensor goes back to it where that is predicted no slower (a tie keeps
    the baseline, as in every sweep), so a seed taken as final compresses only what pays."""
    bare = detached(problem)
    none: list[K] = []
    bare.gpu_options = [none] * len(strategy)
    out = gpu_decisions(bare, prune=False, start=strategy, fast=fast)
    problem.evaluations += bare.evaluations
    return out


def _sweeps(
    problem: SelectionProblem[K], seeds: Sequence[Sequence[K]], *, prune: bool, fast: bool,
    start: Sequence[K] | None, screen: int, seed_within: float, parallel: bool,
    floor: float, pre_seed: tuple[float, int] | None, offload_limit: int, t0: float,
    p0: float,
) -> tuple[list[K], float, str, float, float, float]:
    """:func:`select`'s Algorithm 4.1 (the first sweep and the sweep from the best seed) and
    4.2: ``(strategy, time, method, gpu_s, gpu_process_s, cpu_s)``. ``pre_seed``: the best
    seed when already scored (with a floor)."""
    pareto = Candidates(problem, prune)  # both sweeps' candidate lists

    def scored(p: SelectionProblem[K]) -> tuple[float, int] | None:
        return pre_seed if pre_seed is not None else _best_seed(p, seeds, fast)

    side = None
    if parallel and fast and seeds:
        side = SeedSweep(
            problem, seeds, start, seed_within, floor=floor, best_seed=scored,
            sweep=lambda p, sd, stop: gpu_decisions(p, prune=prune, start=sd, fast=True,
                                                    candidates=pareto, screen=screen,
                                                    stop=stop))
    reached = threading.Event()  # the first sweep holds a strategy at or below the floor

    def progress(best: float) -> None:
        if best <= floor:
            reached.set()
        if side is not None:
            side.progress(best)

    try:
        strategy, f = gpu_decisions(problem, prune=prune, fast=fast, candidates=pareto,
                                    start=start, screen=screen,
                                    stop=reached if floor > 0.0 else None,
                                    progress=progress if side is not None or floor > 0.0
                                    else None)
    except BaseException:
        if side is not None:
            side.cancel()
        raise
    method = "espresso" if start is None else "espresso from the narrower choice"
    if reached.is_set():
        method += " (at the floor)"
    if side is not None:
        best_seed, swept = side.result(problem, f, strategy)
    else:
        best_seed, swept = scored(problem), None
        if best_seed is not None and sweeps_seed(best_seed, f, strategy, seeds, seed_within,
                                                 floor):
            swept = gpu_decisions(problem, prune=prune, start=seeds[best_seed[1]],
                                  fast=fast, candidates=pareto, screen=screen)
    if swept is not None and best_seed is not None:
        refined, fr = swept
        if fr < f - _EPS:
            strategy, f, method = refined, fr, f"espresso from seed {best_seed[1]}"
    gpu_s = time.perf_counter() - t0
    gpu_process_s = time.process_time() - p0
    t1 = time.perf_counter()
    strategy, f, exact = cpu_offload(problem, strategy, limit=offload_limit, fast=fast)
    cpu_s = time.perf_counter() - t1
    method += "" if exact else "+greedy-offload"
    return strategy, f, method, gpu_s, gpu_process_s, cpu_s


def select(
    problem: SelectionProblem[K],
    *,
    exhaustive_limit: int = 4096,
    offload_limit: int = 1 << 15,
    seeds: Sequence[Sequence[K]] = (),
    prune: bool = True,
    fast: bool = True,
    start: Sequence[K] | None = None,
    benefits: bool = True,
    screen: int = 0,
    seed_within: float = 0.0,
    parallel: bool = False,
    floor: float = 0.0,
) -> Selection[K]:
    """Choose one option per tensor (see the module docstring).

    Args:
        problem: the tensors and their options.
        exhaustive_limit: search every strategy when there are at most this many.
        offload_limit: Algorithm 4.2's exact search up to this many offloading vectors.
        seeds: further whole strategies (e.g. uniform ones). When the best seed beats
            Algorithm 4.1's result, Algorithm 4.1 runs again starting from that seed (each
            tensor may then also go back to its baseline), and the better result goes on to
            Algorithm 4.2. Never worse than the best seed.
        prune: see :func:`gpu_decisions`.
        fast: resumable, early-stopping simulations everywhere (see :func:`gpu_decisions`);
            ``False`` is the slow reference (same strategies and times; the tests compare).
        start: the choice of a narrower search (a subset of these options, e.g. fewer
            compressions per tensor): Algorithm 4.1's first sweep starts from it instead of
            the baseline, and the result is never predicted slower than it (on a tie it is
            returned), so widening a search in steps, each seeded with the last, never
            yields a slower choice.
        benefits: compute :attr:`Selection.benefit_s` (one simulation per tensor off its
            baseline); False leaves zeros, for a caller that keeps only some selections
            and computes it for those with :func:`tensor_benefits`.
        screen: the candidate screen of every sweep (:func:`gpu_decisions`; 0: none).
        seed_within: Algorithm 4.1 also runs again from the best seed when that seed is
            at most this fraction slower than the first sweep's result (not only when it
            is faster); the better of the two sweeps is kept, so this never returns a
            slower selection of the same problem. 0 (the default): only when faster.
        parallel: with ``fast`` and ``seeds``, score the seeds and sweep from the best of
            them on a second thread while the first sweep runs (the compiled kernels
            release the GIL), instead of after it. The same result and evaluation count
            (:class:`~hetplan.algorithms.espresso_parallel.SeedSweep`); less wall time on
            two free cores, more CPU time when the first sweep's result makes the seed's
            sweep unneeded (it is stopped then). The problem's callables must be safe to
            call from two threads (the plan pass's are: every cost table is built before
            the search).
        floor: a time at or below which a strategy is final, e.g. a lower bound on every
            strategy of the problem times ``1 + epsilon`` (the plan pass's ``bound_within``):
            the search then stops as soon as it holds one. With a floor (> 0) the seeds are
            scored before the first sweep, and the best, if at or below the floor, is
            returned without any sweep or offloading; else the first sweep stops at its
            start or at the change that reaches the floor, and the sweep from the best
            seed runs only when the first sweep's result is above it. Where the floor is
            never reached the result is the one without it. 0 (the default): no floor.
    """
    if seed_within < 0.0:
        raise ValueError(f"seed_within must be >= 0 (0: a seed is swept only when faster), "
                         f"got {seed_within}")
    if floor < 0.0:
        raise ValueError(f"floor must be >= 0 (0: none), got {floor}")
    problem._last_session = None  # the problem may have changed since an earlier call
    baseline_s = problem.iteration_s(problem.baseline)
    space = 1
    for i in range(len(problem.backprop_s)):
        space *= len(_full_options(problem, i))
        if space > exhaustive_limit:
            break
    t0, p0 = time.perf_counter(), time.process_time()
    cpu_s = 0.0
    if space <= exhaustive_limit:
        strategy, f = _exhaustive(problem, [_full_options(problem, i)
                                             for i in range(len(problem.backprop_s))])
        gpu_s, method = time.perf_counter() - t0, "exhaustive"
        gpu_process_s = time.process_time() - p0
    else:
        # with a floor the seeds are scored first: the best may be final (no sweep)
        pre_seed = _best_seed(problem, seeds, fast) if floor > 0.0 and seeds else None
        if pre_seed is not None and pre_seed[0] <= floor:
            strategy, f = _ties_to_baseline(problem, seeds[pre_seed[1]], fast)
            method = f"seed {pre_seed[1]} (at the floor)"
            gpu_s = time.perf_counter() - t0
            gpu_process_s = time.process_time() - p0
        else:
            strategy, f, method, gpu_s, gpu_process_s, cpu_s = _sweeps(
                problem, seeds, prune=prune, fast=fast, start=start, screen=screen,
                seed_within=seed_within, parallel=parallel, floor=floor,
                pre_seed=pre_seed, offload_limit=offload_limit, t0=t0, p0=p0)
    if baseline_s <= f + _EPS and list(problem.baseline) != strategy:
        strategy, f = list(problem.baseline), baseline_s
    if start is not None and list(start) != strategy:
        start_s = problem.iteration_s(start)
        if start_s <= f + _EPS:
            strategy, f, method = list(start), start_s, "the narrower choice"
    benefit = (tensor_benefits(problem, strategy, f, fast=fast) if benefits
               else (0.0,) * len(strategy))
    problem._last_session = None  # its caches are not kept past the selection
    return Selection(tuple(strategy), f, baseline_s, benefit, method, gpu_s, cpu_s,
                     problem.evaluations, gpu_process_s)
