"""The fast selection path (resumable, early-stopping simulations) against the slow reference
(every candidate simulated from scratch with ``simulate_dp``): on random small instances both
pick the same strategies with the same predicted times, with seeds, offloading and several
channels. The fast path runs the session's kernels both ways: compiled (the default when numba
is installed) and uncompiled (``HETPLAN_JIT=0``)."""

from __future__ import annotations

import os
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetplan.algorithms.dp_session import jit_enabled
from hetplan.algorithms.dp_types import CPU, GPU, Op
from hetplan.algorithms.espresso import SelectionProblem, cpu_offload, gpu_decisions, select

_JIT = ["0", pytest.param("1", marks=pytest.mark.skipif(
    not jit_enabled(), reason="numba not installed or HETPLAN_JIT=0"))]

_t = st.integers(1, 8).map(lambda x: x * 0.25)
_OPTS = ("N", "G1", "G2", "H", "C1", "C2")


@st.composite
def _problem(draw: st.DrawFn) -> SelectionProblem[str]:
    n = draw(st.integers(2, 7))
    bp = draw(st.lists(_t, min_size=n, max_size=n))
    sizes = draw(st.lists(st.integers(1, 3), min_size=n, max_size=n))
    raw = [draw(_t) * s for s in sizes]
    comp = draw(_t)
    dec = draw(_t)
    cpu = draw(_t)

    def ops(i: int, k: str) -> tuple[Op, ...]:
        if k == "N":
            return (Op("net", raw[i]),)
        if k == "H":  # two channels in sequence, uncompressed
            return (Op("intra", raw[i] / 4), Op("inter", raw[i] / 2), Op("intra", raw[i] / 4))
        dev, c = (GPU, comp) if k.startswith("G") else (CPU, cpu * sizes[i])
        wire = raw[i] / (4 if k.endswith("1") else 8)
        extra = (Op(dev, dec),) if k.endswith("2") else ()
        return (Op(dev, c), Op("net", wire), *extra)

    return SelectionProblem(
        backprop_s=bp, sizes=sizes, baseline=["N"] * n,
        gpu_options=[["G1", "G2", "H"]] * n, ops=ops,
        compressed=lambda k: k not in ("N", "H"),
        offload=lambda k: "C" + k[1] if k.startswith("G") else None,
        cpu_workers=draw(st.integers(1, 2)),
        # tensors with equal (raw, size) have equal ops: lets uniform seeds run per class
        ops_class=[(raw[i], sizes[i]) for i in range(n)] if draw(st.booleans()) else None,
    )


@pytest.mark.parametrize("jit", _JIT)
@settings(max_examples=150, deadline=None)
@given(p=_problem(), prune=st.booleans())
def test_fast_gpu_decisions_and_offload_equal_reference(jit: str, p: SelectionProblem[str],
                                                        prune: bool) -> None:
    with mock.patch.dict(os.environ, {"HETPLAN_JIT": jit}):
        fast = gpu_decisions(p, prune=prune, fast=True)
        fast_offload = cpu_offload(p, fast[0], fast=True)
        fast_descent = cpu_offload(p, fast[0], limit=1, fast=True)
    slow = gpu_decisions(p, prune=prune, fast=False)
    assert fast == slow
    assert fast_offload == cpu_offload(p, slow[0], fast=False)
    # the coordinate-descent fallback too
    assert fast_descent == cpu_offload(p, slow[0], limit=1, fast=False)


@pytest.mark.parametrize("jit", _JIT)
@settings(max_examples=100, deadline=None)
@given(p=_problem())
def test_fast_select_equals_reference(jit: str, p: SelectionProblem[str]) -> None:
    n = len(p.sizes)
    seeds = [[k] * n for k in _OPTS]
    with mock.patch.dict(os.environ, {"HETPLAN_JIT": jit}):
        a = select(p, exhaustive_limit=0, seeds=seeds, fast=True)
    b = select(p, exhaustive_limit=0, seeds=seeds, fast=False)
    assert (a.strategy, a.iteration_s, a.baseline_s, a.benefit_s, a.method) == (
        b.strategy, b.iteration_s, b.baseline_s, b.benefit_s, b.method)


def test_candidates_skip_step_for_step_dominated_options() -> None:
    """Algorithm 4.1 does not try an option whose ops are another option's step for step on
    the same resources, each at least as long and one longer (B against A); an option on
    another path (C) or with a shorter step (D against A) is tried, duplicates once, and the
    baseline always, even when dominated (E)."""
    from hetplan.algorithms.espresso_candidates import Candidates

    table = {
        "N": (Op("net", 4.0),),
        "A": (Op(GPU, 1.0), Op("net", 1.0)),
        "B": (Op(GPU, 1.0), Op("net", 2.0)),
        "C": (Op(GPU, 2.0), Op("net", 0.5), Op(GPU, 0.1)),
        "D": (Op(GPU, 0.5), Op("net", 1.5)),
        "A2": (Op(GPU, 1.0), Op("net", 1.0)),
        "E": (Op("net", 3.0),),
    }
    p = SelectionProblem(backprop_s=[1.0], sizes=[1], baseline=["N"],
                         gpu_options=[["A", "B", "C", "D", "A2", "E"]],
                         ops=lambda i, k: table[k], compressed=lambda k: k != "N")
    assert [k for k, *_ in Candidates(p, prune=True).candidates(0)] == ["N", "A", "C", "D", "E"]
    assert [k for k, *_ in Candidates(p, prune=False).candidates(0)] == [
        "N", "A", "B", "C", "D", "E"]


def test_select_sees_a_problem_changed_since_an_earlier_select() -> None:
    """Candidate lists live for one selection: after an option list is extended in place,
    the next ``select`` chooses what a fresh problem with that list chooses."""
    table = {
        "N": (Op("net", 4.0),),
        "A": (Op(GPU, 1.0), Op("net", 3.0)),
        "B": (Op(GPU, 0.5), Op("net", 0.5)),
    }

    def problem(opts: list[str]) -> SelectionProblem[str]:
        return SelectionProblem(backprop_s=[1.0] * 4, sizes=[1] * 4, baseline=["N"] * 4,
                                gpu_options=[opts] * 4, ops=lambda i, k: table[k],
                                compressed=lambda k: k != "N", ops_class=[0] * 4)

    opts = ["A"]
    p = problem(opts)
    before = select(p, exhaustive_limit=0)
    opts.append("B")
    after = select(p, exhaustive_limit=0)
    fresh = select(problem(["A", "B"]), exhaustive_limit=0)
    assert (after.strategy, after.iteration_s) == (fresh.strategy, fresh.iteration_s)
    assert after.strategy != before.strategy  # B is better: the test can tell
