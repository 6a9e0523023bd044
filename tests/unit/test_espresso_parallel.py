"""The sweep from the best seed on a second thread (``select(parallel=True)``,
``hetplan.algorithms.espresso_parallel``): the same selection, method and evaluation count
as the sequential ``select`` on random problems, whether the seed's sweep is wanted, not
wanted or never possible; a failure on either thread reaches the caller."""

from __future__ import annotations

import random

import pytest

from hetplan.algorithms import espresso as ea
from hetplan.algorithms.dp_types import CPU, GPU, Op
from hetplan.algorithms.espresso import SelectionProblem, select
from hetplan.algorithms.espresso_parallel import SeedSweep, sweeps_seed

_KEYS = ("base", "p", "q", "r", "s")


def _problem(seed: int, n: int = 7) -> SelectionProblem[str]:
    rng = random.Random(seed)
    table = {k: tuple(Op(r, rng.uniform(0.05, 2.0))
                      for r in rng.sample(["net", "inter", GPU, CPU], rng.randint(1, 4)))
             for k in _KEYS[1:]}
    table["base"] = (Op("net", rng.uniform(0.5, 2.0)),)
    bp = [rng.uniform(0.0, 1.0) for _ in range(n)]
    sizes = [rng.choice([1, 2]) for _ in range(n)]
    return SelectionProblem(
        backprop_s=bp, sizes=sizes, baseline=["base"] * n, gpu_options=[list(_KEYS[1:])] * n,
        ops=lambda i, k: table[k], compressed=lambda k: k != "base",
        ops_class=[float(s) for s in sizes])


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("within", [0.0, 0.1, 0.5])
def test_parallel_selects_what_the_sequential_select_selects(seed: int, within: float) -> None:
    n = 7
    seeds = [[k] * n for k in _KEYS[1:]]
    got = []
    for parallel in (False, True):
        sel = select(_problem(seed, n), exhaustive_limit=0, seeds=seeds, screen=1 + seed % 3,
                     seed_within=within, parallel=parallel)
        got.append((sel.strategy, sel.iteration_s, sel.method, sel.evaluations))
    assert got[0] == got[1]


def test_both_outcomes_of_the_decision_are_covered() -> None:
    """The cases above include rungs where the seed's sweep is kept, and ones where it is
    not run at all (else the parallel path would be tested on one branch only)."""
    methods = set()
    n = 7
    seeds = [[k] * n for k in _KEYS[1:]]
    for seed in range(40):
        methods.add(select(_problem(seed, n), exhaustive_limit=0, seeds=seeds, screen=1,
                           seed_within=0.5, parallel=True).method.split(" ")[-1])
    assert "espresso" in methods and any(m.isdigit() for m in methods)


def test_the_decision_rule() -> None:
    seeds = [["a"], ["b"]]
    assert sweeps_seed((1.0, 0), 2.0, ["b"], seeds, 0.0)  # faster
    assert not sweeps_seed((2.0, 0), 2.0, ["b"], seeds, 0.0)  # a tie is not faster
    assert sweeps_seed((2.1, 0), 2.0, ["b"], seeds, 0.1)  # within 10 %
    assert not sweeps_seed((2.1, 1), 2.0, ["b"], seeds, 0.1)  # the same strategy
    assert not sweeps_seed((2.3, 0), 2.0, ["b"], seeds, 0.1)
    assert not sweeps_seed(None, 2.0, ["b"], seeds, 0.1)


def test_a_failure_on_either_thread_reaches_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    n = 7
    seeds = [[k] * n for k in _KEYS[1:]]

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("seed scoring failed")

    monkeypatch.setattr(ea, "_best_seed", broken)
    with pytest.raises(RuntimeError, match="seed scoring failed"):
        select(_problem(0, n), exhaustive_limit=0, seeds=seeds, parallel=True)
    monkeypatch.undo()

    calls = []
    sweep = ea.gpu_decisions

    def first_fails(*args: object, **kwargs: object) -> object:
        calls.append(kwargs.get("stop"))
        if kwargs.get("stop") is None:  # the first sweep, on the caller's thread
            raise RuntimeError("first sweep failed")
        return sweep(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ea, "gpu_decisions", first_fails)
    with pytest.raises(RuntimeError, match="first sweep failed"):
        select(_problem(0, n), exhaustive_limit=0, seeds=seeds, seed_within=0.5, parallel=True)


@pytest.mark.parametrize("seed", range(12))
def test_a_seed_sweep_stopped_while_wanted_is_run_again(seed: int,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Were the bound that stops the seed's sweep ever wrong, the sweep would be stopped
    while its result is wanted: ``result`` then runs it on the caller's thread, so the
    selection is still the sequential one (here every sweep is stopped at once)."""
    n = 7
    seeds = [[k] * n for k in _KEYS[1:]]
    want = select(_problem(seed, n), exhaustive_limit=0, seeds=seeds, seed_within=0.5)
    monkeypatch.setattr(SeedSweep, "progress", lambda self, best: self._stop.set())
    got = select(_problem(seed, n), exhaustive_limit=0, seeds=seeds, seed_within=0.5,
                 parallel=True)
    assert (got.strategy, got.iteration_s, got.method, got.evaluations) == (
        want.strategy, want.iteration_s, want.method, want.evaluations)
