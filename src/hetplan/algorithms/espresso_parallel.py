"""The sweep from the best seed on a second thread, beside the first sweep.

:func:`~hetplan.algorithms.espresso.select` sweeps (Algorithm 4.1) from its start, then
scores the uniform seeds, then sweeps again from the best seed when the first sweep's
result asks for it (:func:`sweeps_seed`). The second sweep is 20-33 % of the large
workloads' GPU selection (``docs/decisions/espresso-speed.md``, "Round 8"), and it does
not depend on the first sweep except through that decision. With
``select(parallel=True)`` the seeds and the second sweep run on a thread of their own
(:class:`SeedSweep`) while the first sweep runs; the compiled kernels release the GIL, so
the two overlap on two cores. The choice, the method and the evaluation count are those
of the sequential ``select`` whatever the threads' timing: the decision is taken on the
first sweep's result as before, and a second sweep it does not want is stopped and
dropped (its CPU time is the price of not waiting for the decision).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Generic, Protocol, TypeVar

from hetplan.algorithms.dp_session import DPSession
from hetplan.algorithms.espresso_candidates import EPS

__all__ = ["SeedSweep", "detached", "sweeps_seed"]

K = TypeVar("K", bound=Hashable)


class _Problem(Protocol):
    """What a :class:`SeedSweep` uses of :class:`hetplan.algorithms.espresso.
    SelectionProblem` (its members of the same names)."""

    evaluations: int
    _last_session: DPSession | None

    @property
    def baseline(self) -> Sequence[Any]: ...

    def session(self, strategy: Sequence[Any]) -> DPSession: ...


P = TypeVar("P", bound=_Problem)


def detached(problem: P) -> P:
    """A shallow copy of ``problem`` with its own evaluation count (0) and no session: a
    search on it (another thread's, or a side sweep) leaves ``problem``'s untouched; the
    caller adds the copy's evaluations back."""
    out = copy.copy(problem)
    out.evaluations = 0
    out._last_session = None
    return out


def sweeps_seed(best_seed: tuple[float, int] | None, f: float, strategy: Sequence[K],
                seeds: Sequence[Sequence[K]], seed_within: float, floor: float = 0.0) -> bool:
    """Whether ``select`` sweeps again from ``best_seed`` (``(time, index)``) after a first
    sweep that returned ``strategy`` in time ``f``: when the seed is faster, or, with
    ``seed_within``, at most that fraction slower and not the same strategy; never when
    ``f`` is at or below ``floor`` (``select(floor=...)``)."""
    return best_seed is not None and f > floor and (best_seed[0] < f - EPS or (
        seed_within > 0.0 and best_seed[0] <= f * (1.0 + seed_within)
        and list(seeds[best_seed[1]]) != list(strategy)))


class SeedSweep(Generic[P]):
    """The best seed and the sweep from it, computed on a thread on a copy of the problem
    (its own evaluation count and sessions; the candidate lists and the ops' arrays are
    shared, and filled with equal values whichever thread fills them).

    The sweep from the seed starts before the first sweep's result is known, so it runs
    as long as some result could ask for it: the first sweep returns at most the time of
    the strategy it holds plus ``EPS`` per tensor (a candidate is accepted only below the
    incumbent minus ``EPS``, or a baseline within ``EPS`` above it, once per tensor), and
    once the best seed is too slow for :func:`sweeps_seed` against that (checked at the
    start and at every change the first sweep accepts, :meth:`progress`), it is stopped.
    A stopped sweep's result is never used: only a sweep that ran to its end is wanted.

    Args:
        problem: the selection problem (not modified until :meth:`result`).
        seeds / start / seed_within / floor: as for ``select``.
        best_seed: ``_best_seed`` of a problem over ``seeds``.
        sweep: the second sweep on a problem from a seed, stopping when the event is set.
    """

    def __init__(self, problem: P, seeds: Sequence[Sequence[Any]], start: Sequence[Any] | None,
                 seed_within: float, *, floor: float = 0.0,
                 best_seed: Callable[[P], tuple[float, int] | None],
                 sweep: Callable[[P, Sequence[Any], threading.Event], tuple[list[Any], float]]
                 ) -> None:
        self._problem = detached(problem)
        self._seeds, self._start, self._within = seeds, start, seed_within
        self._floor = floor
        self._score, self._sweep = best_seed, sweep
        self._stop = threading.Event()
        self._seeded = threading.Event()
        self._best_seed: tuple[float, int] | None = None
        self._seed_evals = 0
        self._swept: tuple[list[Any], float] | None = None
        self._swept_evals = 0
        self._held = float("inf")  # the least time the first sweep has held
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="espresso-seed-sweep",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            p = self._problem
            self._best_seed = best = self._score(p)
            self._seed_evals = p.evaluations
            self._seeded.set()
            if best is None or self._stop.is_set():
                return
            start = self._start if self._start is not None else p.baseline
            self.progress(min(p.session(list(start)).base_s, self._held))
            if self._stop.is_set():
                return  # no result of the first sweep can ask for it
            before = p.evaluations
            swept = self._sweep(p, self._seeds[best[1]], self._stop)
            if not self._stop.is_set():  # else it may have returned before its end
                self._swept = swept
                self._swept_evals = p.evaluations - before
        except BaseException as e:  # re-raised on the caller's thread by result()
            self._error = e
        finally:
            self._seeded.set()

    def progress(self, best: float) -> None:
        """The first sweep holds a strategy of time ``best`` (its start, then each change
        it accepts; called from either thread): it returns at most ``best`` plus ``EPS``
        per tensor, so once the best seed is too slow for :func:`sweeps_seed` against
        that, the seed's sweep is stopped (or never started)."""
        self._held = best = min(self._held, best)  # it returns at most the least + EPS each
        seed = self._best_seed
        if seed is None or self._stop.is_set():
            return
        upper = best + (len(self._problem.baseline) + 1) * EPS
        if upper <= self._floor or not (seed[0] < upper - EPS
                or (self._within > 0.0 and seed[0] <= upper * (1.0 + self._within))):
            self._stop.set()

    def result(self, problem: P, f: float, strategy: Sequence[Any]
               ) -> tuple[tuple[float, int] | None, tuple[list[Any], float] | None]:
        """``(the best seed, the sweep from it or None)`` as the sequential ``select``
        computes them after a first sweep that returned ``strategy`` in time ``f``; adds
        their evaluations to ``problem``'s. Waits for the thread."""
        self._seeded.wait()
        wanted = self._error is None and sweeps_seed(self._best_seed, f, strategy,
                                                     self._seeds, self._within, self._floor)
        if not wanted:
            self._stop.set()
        self._thread.join()
        if self._error is not None:
            raise self._error
        problem.evaluations += self._seed_evals
        if not wanted:
            return self._best_seed, None
        if self._swept is None:  # not expected (the bound above holds): run it here
            assert self._best_seed is not None
            p = self._problem
            before = p.evaluations
            self._swept = self._sweep(p, self._seeds[self._best_seed[1]], threading.Event())
            self._swept_evals = p.evaluations - before
        problem.evaluations += self._swept_evals
        return self._best_seed, self._swept

    def cancel(self) -> None:
        """Stop the thread and wait for it (the first sweep failed)."""
        self._stop.set()
        self._thread.join()
