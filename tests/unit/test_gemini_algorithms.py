"""Gemini's pure algorithms against the thesis's worked values (digest Part C, G1-G9) and
the enumeration reference."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

from hetplan.algorithms import gemini as g
from hetplan.errors import SpecError


def test_eq61_mt_nlg_wasted_time_is_105_minutes() -> None:
    assert g.expected_wasted_time(42, 42, 42) == 105.0


@pytest.mark.parametrize(("n", "m", "groups", "strategy"), [
    (4, 2, [[1, 2], [3, 4]], "group"),
    (5, 2, [[1, 2], [3, 4, 5]], "mixed"),
    (6, 3, [[1, 2, 3], [4, 5, 6]], "group"),
    (7, 3, [[1, 2, 3], [4, 5, 6, 7]], "mixed"),
    (8, 3, [[1, 2, 3], [4, 5, 6, 7, 8]], "mixed"),
    (16, 3, [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12], [13, 14, 15, 16]], "mixed"),
])
def test_algorithm_61_groups(n: int, m: int, groups: list[list[int]], strategy: str) -> None:
    got, strat = g.placement_groups(n, m)
    assert [[x + 1 for x in grp] for grp in got] == groups  # the thesis counts from 1
    assert strat == strategy


def test_place_holders() -> None:
    assert g.place(4, 2) == ((0, 1), (1, 0), (2, 3), (3, 2))
    # Fig 6.3c: N=5, m=2: a group {0,1} and a ring over {2,3,4}
    assert g.place(5, 2) == ((0, 1), (1, 0), (2, 3), (3, 4), (4, 2))
    assert g.place(4, 2, "ring") == ((0, 1), (1, 2), (2, 3), (3, 0))
    for n, m in [(7, 3), (16, 3), (9, 4)]:
        holders = g.place(n, m)
        assert all(len(set(h)) == m and h[0] == i for i, h in enumerate(holders))
        # every node sends and receives m - 1 copies (communication optimality)
        received = [sum(i in h[1:] for h in holders) for i in range(n)]
        assert received == [m - 1] * n


def test_bad_placement_input_names_the_fix() -> None:
    with pytest.raises(SpecError, match="--replicas"):
        g.place(1, 2)
    with pytest.raises(SpecError, match="mixed"):
        g.place(5, 2, "group")
    with pytest.raises(SpecError, match="k must be"):
        g.recovery_probability(4, 2, 5)


def test_corollary_61_thesis_values() -> None:
    assert g.recovery_probability(16, 2, 2) == Fraction(14, 15)
    assert g.recovery_probability(16, 2, 3) == Fraction(4, 5)
    assert float(g.recovery_probability(16, 2, 3)) == pytest.approx(0.800)
    assert g.recovery_probability(16, 2, 1) == 1


def test_fig_63_group_beats_ring() -> None:
    assert g.recovery_probability(4, 2, 2, "group") == Fraction(2, 3)
    assert g.recovery_probability(4, 2, 2, "ring") == Fraction(1, 3)


def test_fig_63c_mixed_and_theorem_61_gap() -> None:
    assert g.recovery_probability(5, 2, 2, "mixed") == Fraction(3, 5)
    assert g.theorem61_upper_bound(5, 2) == Fraction(7, 10)
    assert g.mixed_recovery_closed_form(5, 2) == Fraction(3, 5)


@pytest.mark.parametrize(("n", "m", "k", "bound", "exact"), [
    (8, 2, 2, 0.857143, 0.857143), (8, 2, 3, 0.571429, 0.571429),
    (8, 2, 4, 0.142857, 0.228571), (16, 2, 4, 0.600000, 0.615385),
    (16, 2, 5, 0.333333, 0.410256), (32, 2, 4, 0.806452, 0.809789),
    (64, 2, 3, 0.952381, 0.952381), (128, 2, 2, 0.992126, 0.992126),
    (1024, 2, 2, 0.999022, 0.999022), (6, 3, 3, 0.900000, 0.900000),
    (12, 3, 6, 0.636364, 0.642857), (15, 3, 4, 0.956044, 0.956044),
    (48, 3, 6, 0.981499, 0.981508), (4, 2, 4, 0.0, 0.0),
])
def test_exact_against_eq64_bound(n: int, m: int, k: int, bound: float, exact: float) -> None:
    got = g.recovery_probability(n, m, k)
    assert float(got) == pytest.approx(exact, abs=5e-7)
    assert float(g.eq64_bound(n, m, k)) == pytest.approx(bound, abs=5e-7)
    assert got >= g.eq64_bound(n, m, k)
    if k < 2 * m:
        assert got == g.eq64_bound(n, m, k)  # Eq. 6.5 is exact below 2m


def test_k_at_least_2m_exact_value_8_2_4() -> None:
    assert g.recovery_probability(8, 2, 4) == Fraction(8, 35)
    assert g.eq64_bound(8, 2, 4) == Fraction(1, 7)


def test_mixed_16_3_3() -> None:
    assert g.recovery_probability(16, 3, 3, "mixed") == Fraction(69, 70)
    assert g.theorem61_upper_bound(16, 3) == Fraction(277, 280)
    with pytest.raises(SpecError, match="divides"):
        g.eq64_bound(16, 3, 3)


def test_ring_comparison_g8() -> None:
    assert g.recovery_probability(16, 2, 3, "ring") == Fraction(22, 35)
    assert g.recovery_probability(16, 2, 2, "ring") == Fraction(13, 15)


def _partition(spans: list[float], m: int) -> list[tuple[int, int, float, float]]:
    chunks = g.partition_checkpoint(spans, ckpt_bytes=10, remote_copies=m - 1,
                                    buffer_bytes=16, sub_buffers=4, alpha_s=1, bw=1, mu=0.5)
    return [(c.span, c.replica, c.offset, c.size) for c in chunks]


def test_algorithm_62_worked_example_g9() -> None:
    assert _partition([12, 6, 3], 3) == [
        (0, 0, 0, 4), (1, 0, 4, 2), (2, 0, 6, 0.5), (3, 0, 6.5, 3.5),
        (3, 1, 0, 4), (3, 1, 4, 4), (3, 1, 8, 2)]
    assert _partition([30, 20, 14], 2) == [(0, 0, 0, 4), (0, 0, 4, 4), (0, 0, 8, 2)]


def test_algorithm_62_terminates_on_span_at_most_alpha() -> None:
    # G2: a budget of exactly alpha would loop forever in the printed listing
    assert _partition([2.0, 2.0], 2)[0][0] == 2


def test_algorithm_62_units_and_errors() -> None:
    chunks = g.partition_checkpoint([7.3], ckpt_bytes=64, remote_copies=1, buffer_bytes=64,
                                    sub_buffers=4, alpha_s=0.5, bw=4, mu=1.0, unit=4)
    assert all(c.size % 4 == 0 for c in chunks)
    assert sum(c.size for c in chunks) == 64
    assert g.partition_checkpoint([1.0], ckpt_bytes=8, remote_copies=0, buffer_bytes=8,
                                  sub_buffers=1, alpha_s=0, bw=1, mu=1) == ()
    with pytest.raises(SpecError, match="mu"):
        g.partition_checkpoint([1.0], ckpt_bytes=8, remote_copies=1, buffer_bytes=8,
                               sub_buffers=1, alpha_s=0, bw=1, mu=0)


def test_checkpoint_every() -> None:
    assert g.checkpoint_every(10.0, 0.0, 0.03) == 1
    assert g.checkpoint_every(10.0, 0.3, 0.03) == 1
    assert g.checkpoint_every(10.0, 0.31, 0.03) == 2
    assert math.isclose(g.expected_wasted_time(62, 62, 0), 93.0)
