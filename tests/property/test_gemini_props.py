"""Gemini's recovery probability: counting and closed forms against enumeration."""

from __future__ import annotations

from fractions import Fraction

from hypothesis import given, settings
from hypothesis import strategies as st

from hetplan.algorithms import gemini as g


@st.composite
def _case(draw: st.DrawFn) -> tuple[int, int, int]:
    m = draw(st.integers(1, 4))
    n = draw(st.integers(m, 13))
    k = draw(st.integers(0, n))
    return n, m, k


@settings(max_examples=150, deadline=None)
@given(_case(), st.sampled_from(["ring", "mixed", "group"]))
def test_counting_equals_enumeration(case: tuple[int, int, int], placement: str) -> None:
    n, m, k = case
    if placement == "group" and n % m:
        placement = "mixed"
    holders = g.place(n, m, placement)  # type: ignore[arg-type]
    enumerated = g.recovery_probability_enumerated(holders, k)
    old = g.ENUMERATION_LIMIT
    g.ENUMERATION_LIMIT = 0  # force the counting path
    try:
        counted = g.recovery_probability(n, m, k, placement)  # type: ignore[arg-type]
    finally:
        g.ENUMERATION_LIMIT = old
    assert counted == enumerated


@settings(max_examples=100, deadline=None)
@given(_case())
def test_closed_forms_and_bounds(case: tuple[int, int, int]) -> None:
    n, m, k = case
    exact = g.recovery_probability(n, m, k, "mixed")
    if k == m:
        assert exact == g.mixed_recovery_closed_form(n, m)
        assert exact <= g.theorem61_upper_bound(n, m)
        gap = g.theorem61_upper_bound(n, m) - exact
        from math import comb
        assert gap <= Fraction(max(0, 2 * m - 3), comb(n, m))
    if n % m == 0:
        assert exact == g.group_recovery_closed_form(n, m, k)
        assert exact >= g.eq64_bound(n, m, k)
        if k < 2 * m:
            assert exact == g.eq64_bound(n, m, k)
    # group (or mixed) placement is never worse than ring at k = m
    if k == m:
        assert exact >= g.recovery_probability(n, m, k, "ring")
