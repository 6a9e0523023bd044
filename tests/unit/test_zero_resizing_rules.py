"""ZERO-resizing / SEMI-migration rules (``hetplan.algorithms.zero_resizing``).

Expectations are worked out by hand from the paper's formulas (digest
``research/zero_resizing.md`` §5: TC-2 … TC-6, Fig. 4) and stated with their arithmetic;
the properties check the invariants Eq. (1)/(2) are built on.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetplan.algorithms.zero_resizing import (
    CostCoefficients,
    choose_migrators,
    eq1_gamma,
    eq2_beta,
    eq3_f,
    gamma_workload,
    n_columns,
    pridiff_ratio,
    receiver_ranges,
    renormalise_ratios,
    select_pruned,
    semi_decision,
    unbalanced_times,
    update_wvar,
    virtual_rank,
    zero_decision,
)
from hetplan.errors import SpecError


# -- Eq. (1) ---------------------------------------------------------------------------------
def test_tc2_eq1_with_average_and_min() -> None:
    # e = 4, T = [10, 10, 10, 20] ms, M_4 = 15 ms: T_avg = 12.5 → γ = 7.5 / 15 = 0.5;
    # SEMI (T_min = 10): γ = 10 / 15 = 2/3.
    t, m = [10.0, 10.0, 10.0, 20.0], [15.0] * 4
    dec = zero_decision(t, m, gamma_max=0.9)
    assert [d.role for d in dec] == ["normal"] * 3 + ["resize"]
    assert dec[3].resize == pytest.approx(0.5)
    assert eq1_gamma(20.0, 10.0, 15.0, cap=1.0) == pytest.approx(2 / 3)


def test_eq1_clamps() -> None:
    assert eq1_gamma(5.0, 10.0, 3.0, cap=0.9) == 0.0  # faster than the reference
    assert eq1_gamma(40.0, 10.0, 15.0, cap=0.9) == 0.9  # (40-10)/15 = 2 → capped
    assert eq1_gamma(40.0, 10.0, 0.0, cap=0.9) == 0.0  # no matmul time: nothing to prune


def test_feedback_fix_recovers_unpruned_time() -> None:
    # A straggler un-pruned: T = 20, M = 15. Pruning 0.5 of its columns saves 7.5: measured
    # T = 12.5, M = 7.5. The estimate must give back (20, 15), hence the same γ again.
    t_raw, m_raw = unbalanced_times(12.5, 7.5, skipped=0.5)
    assert (t_raw, m_raw) == pytest.approx((20.0, 15.0))
    # a receiver that spent 3 s on migrated columns: its own raw time excludes them
    assert unbalanced_times(13.0, 6.0, skipped=0.0, received=3.0) == pytest.approx((10.0, 6.0))
    with pytest.raises(SpecError):
        unbalanced_times(1.0, 1.0, skipped=1.0)


# -- Alg. 1 / PriDiff (TC-3) -----------------------------------------------------------------
DELTA = [0.5, 0.1, 0.9, 0.05, 0.3, 0.2, 0.7, 0.01]


def test_tc3a_candidates_dominate_floor() -> None:
    # θ = 0.25: candidates {1,3,5,7} → 4/8 = 0.5 ≥ α γ = 0.8 · 0.25 = 0.2
    g = pridiff_ratio(DELTA, theta=0.25, gamma=0.25, alpha=0.8, gamma_max=1.0)
    assert g == pytest.approx(0.5)
    assert select_pruned(DELTA, n_columns(g, 8)) == (1, 3, 5, 7)


def test_tc3b_floor_dominates() -> None:
    # γ = 0.9375 → α γ = 0.75 > 0.5; 6 of 8 pruned, kept {2, 6} (δ 0.9, 0.7)
    g = pridiff_ratio(DELTA, theta=0.25, gamma=0.9375, alpha=0.8, gamma_max=1.0)
    assert g == pytest.approx(0.75)
    assert select_pruned(DELTA, n_columns(g, 8)) == (0, 1, 3, 4, 5, 7)
    # the cap applies after the floor
    assert pridiff_ratio(DELTA, 0.25, 0.9375, 0.8, gamma_max=0.6) == pytest.approx(0.6)


def test_tc3c_incremental_update_freezes_pruned() -> None:
    new = [0.4, 0.0, 0.8, 0.0, 0.35, 0.0, 0.6, 0.0]
    assert update_wvar(DELTA, new, pruned=(1, 3, 5, 7)) == [0.4, 0.1, 0.8, 0.05, 0.35, 0.2,
                                                            0.6, 0.01]


def test_tc3d_rounding_half_up() -> None:
    # γ = 0.75: max(candidates 0.5, α γ = 0.6) = 0.6; 8 · 0.6 = 4.8 → 5 columns (TC-3d)
    g = pridiff_ratio(DELTA, 0.25, 0.75, 0.8, 1.0)
    assert g == pytest.approx(0.6)
    assert n_columns(g, 8) == 5
    assert n_columns(0.5 / 8, 8) == 1 and n_columns(0.49 / 8, 8) == 0
    assert n_columns(1.2, 8) == 8


def test_no_pruning_without_straggling() -> None:
    assert pridiff_ratio(DELTA, 0.25, 0.0, 0.8, 1.0) == 0.0


def test_select_ties_by_index() -> None:
    assert select_pruned([1.0, 0.0, 0.0, 0.0], 2) == (1, 2)
    with pytest.raises(SpecError):
        select_pruned([1.0], 2)


# -- renumbering (Fig. 4, TC-4) --------------------------------------------------------------
def test_fig4_renumbering() -> None:
    # e = 3, straggler task-1 (position 0), 2 columns: task-2 gets [0,0], task-3 [1,1]
    assert receiver_ranges(0, [1, 2], 3, 2) == {1: (0, 1), 2: (1, 2)}


def test_tc4_renumbering_e8() -> None:
    # straggler 5, 14 columns, m = 2: r'(6) = 1 → [0,1], r'(7) = 2 → [2,3], r'(0) = 3 →
    # [4,5], r'(4) = 7 → [12,13]
    rng = receiver_ranges(5, [0, 1, 2, 3, 4, 6, 7], 8, 14)
    assert virtual_rank(4, 5, 8) == 7
    assert rng[6] == (0, 2) and rng[7] == (2, 4) and rng[0] == (4, 6) and rng[4] == (12, 14)


def test_renumbering_remainder_goes_first() -> None:
    # 5 columns on receivers 2, 3, 0 (straggler 1, e = 4): 2, 2, 1
    assert receiver_ranges(1, [0, 2, 3], 4, 5) == {2: (0, 2), 3: (2, 4), 0: (4, 5)}
    with pytest.raises(SpecError):
        receiver_ranges(1, [1, 2], 4, 5)


# -- Eq. (2) (TC-5) --------------------------------------------------------------------------
def test_tc5_eq2_linear() -> None:
    # β = (2 + 0.004·1000) / (1000 (0.004 + 0.006 + 0.01/7)) = 6 / 11.428571 = 0.525
    c = CostCoefficients(omega1=2.0, omega2=0.004, phi1=0.006, phi2=0.01)
    beta = eq2_beta(1000.0, 8, c)
    assert beta == pytest.approx(0.525)
    # both sides of Eq. (2) balance: 2 + 0.004·475 = 3.9 = 0.006·525 + 0.01·75
    lhs = 2.0 + 0.004 * 1000 * (1 - beta)
    rhs = 0.006 * 1000 * beta + 0.01 * 1000 * beta / 7
    assert lhs == pytest.approx(3.9) and rhs == pytest.approx(3.9)


def test_eq2_edges() -> None:
    assert eq2_beta(0.0, 8, CostCoefficients(1, 1, 1, 1)) == 0.0
    assert eq2_beta(100.0, 1, CostCoefficients(1, 1, 1, 1)) == 0.0
    assert eq2_beta(100.0, 4, CostCoefficients()) == 0.0
    assert eq2_beta(1.0, 4, CostCoefficients(omega1=100.0, phi1=1.0)) == 1.0  # clipped


# -- Eq. (3) / Alg. 2 (TC-6) -----------------------------------------------------------------
T6 = [9.0, 7.0, 5.0, 3.0, 1.0, 1.0, 1.0, 1.0]
L6 = [2048.0] * 8


def test_tc6_gamma_and_f() -> None:
    # Γ(1) = 2048 · 8/9 = 1820.44; f(1) = 8 − 0.3·1.82044 − 1820.44/7 · 7/2048 = 6.565
    assert gamma_workload(T6, L6, 1, 1.0) == pytest.approx(2048 * 8 / 9)
    expected = {1: 6.565, 2: 3.472, 3: 0.908, 4: -0.777}
    for x, f in expected.items():
        assert eq3_f(T6, L6, x, 1.0, phi1=3e-4) == pytest.approx(f, abs=2e-3)
    assert choose_migrators(T6, L6, z=4, phi1=3e-4) == 3
    assert choose_migrators(T6, L6, z=4, phi1=0.0) == 4  # f never ≤ 0: x = z (§7.21)


def test_tc6_semi_decision_roles() -> None:
    # M = T - 1 (only matmuls slowed); the top 3 migrate, the 4th (T = 3) resizes (3-1)/2
    m = [t - 1.0 if t > 1 else 0.5 for t in T6]
    dec = semi_decision(T6, m, [2048] * 8, CostCoefficients(phi1=3e-4), gamma_max=0.9,
                        eps=0.05)
    assert [d.role for d in dec[:4]] == ["migrate_src"] * 3 + ["resize"]
    assert all(d.role == "normal" for d in dec[4:])
    assert dec[0].migrate == pytest.approx(1.0)  # (9-1)/8
    assert dec[3].resize == pytest.approx(0.9)  # (3-1)/2 = 1 → capped
    assert dec[0].receivers == (3, 4, 5, 6, 7)  # every non-migrating rank


def test_semi_single_straggler_splits_by_beta() -> None:
    # e = 4, T = [1,1,1,3], M_3 = 4 → γ = (3-1)/4 = 0.5; L = 1000 → G = 500;
    # costs b = c = d = 0.001, Ω1 = 0 → β = b G / (G (b + c + d/3)) = 1 / (2 + 1/3) = 3/7
    dec = semi_decision([1.0, 1.0, 1.0, 3.0], [0.5, 0.5, 0.5, 4.0], [1000] * 4,
                        CostCoefficients(omega2=1e-3, phi1=1e-3, phi2=1e-3), 0.9, 0.05)
    s = dec[3]
    assert s.role == "migrate_src" and s.receivers == (0, 1, 2)
    assert s.migrate == pytest.approx(0.5 * 3 / 7)
    assert s.resize == pytest.approx(0.5 * 4 / 7)
    assert all(d.role == "normal" for d in dec[:3])


def test_semi_within_tolerance_is_noop() -> None:
    dec = semi_decision([1.0, 1.04, 1.0], [0.5] * 3, [8] * 3, CostCoefficients(), 0.9, 0.05)
    assert all(d.role == "normal" for d in dec)


def test_migration_variant_moves_everything() -> None:
    dec = semi_decision([1.0, 1.0, 2.0], [0.5, 0.5, 2.0], [8] * 3, CostCoefficients(), 0.9,
                        0.05, variant="migration")
    assert dec[2].role == "migrate_src" and dec[2].migrate == pytest.approx(0.5)
    assert dec[2].resize == 0.0 and dec[2].receivers == (0, 1)


# -- properties --------------------------------------------------------------------------------
times = st.floats(0.01, 100.0)


@settings(max_examples=200, deadline=None)
@given(t=times, ref=times, m=times, cap=st.floats(0.0, 1.0), extra=st.floats(0.0, 50.0))
def test_gamma_bounded_and_monotone(t: float, ref: float, m: float, cap: float,
                                    extra: float) -> None:
    g = eq1_gamma(t, ref, m, cap)
    assert 0.0 <= g <= cap
    assert eq1_gamma(t + extra, ref, m, cap) >= g  # slower straggler: never less pruning


@settings(max_examples=200, deadline=None)
@given(base=st.lists(times, min_size=2, max_size=8), chi=st.floats(0.0, 8.0),
       frac=st.floats(0.05, 0.95), who=st.integers(0, 7))
def test_zero_split_balances_to_average(base: list[float], chi: float, frac: float,
                                        who: int) -> None:
    # every rank: T = T0, M = frac · T0; the straggler's matmuls are (1 + χ) slower
    s = who % len(base)
    m = [frac * t for t in base]
    t = list(base)
    t[s] += chi * m[s]
    m[s] *= 1 + chi
    avg = sum(t) / len(t)
    for r, d in enumerate(zero_decision(t, m, gamma_max=1.0)):
        after = t[r] - d.resize * m[r]
        if t[r] <= avg:
            assert d.resize == 0  # at or below the average: nothing to shed
        elif (t[r] - avg) <= m[r]:
            assert after == pytest.approx(avg)  # unclamped: exactly the average
        else:
            assert after > avg  # clamped (γ = 1): as close as its matmuls allow, not below


@settings(max_examples=200, deadline=None)
@given(base=st.floats(0.5, 10.0), e=st.integers(2, 8), chi=st.floats(0.2, 8.0),
       costs=st.tuples(*[st.floats(0.0, 1e-2)] * 4))
def test_semi_single_straggler_reaches_tmin(base: float, e: int, chi: float,
                                            costs: tuple[float, ...]) -> None:
    m0 = 0.6 * base
    t = [base] * e
    m = [m0] * e
    t[-1] = base + chi * m0
    m[-1] = m0 * (1 + chi)
    d = semi_decision(t, m, [64] * e, CostCoefficients(*costs), gamma_max=1.0, eps=0.05)[-1]
    assert 0.0 <= d.migrate <= 1.0 and 0.0 <= d.resize <= 1.0
    # removed fraction = Eq. (1) with T_min: the straggler's predicted time is T_min
    assert t[-1] - (d.migrate + d.resize) * m[-1] == pytest.approx(base)


@settings(max_examples=200, deadline=None)
@given(e=st.integers(2, 9), s=st.integers(0, 8), n=st.integers(0, 300))
def test_receiver_ranges_partition(e: int, s: int, n: int) -> None:
    s %= e
    rec = [r for r in range(e) if r != s]
    rng = receiver_ranges(s, rec, e, n)
    spans = sorted(rng.values())
    assert spans[0][0] == 0 and spans[-1][1] == n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    sizes = [hi - lo for lo, hi in rng.values()]
    assert max(sizes) - min(sizes) <= 1


def test_zero_with_min_criterion_and_tolerance() -> None:
    # T_min = 10: rank 3 (20) → (20-10)/15 = 2/3; rank 2 (10.4) is within eps = 0.05 of T_min
    dec = zero_decision([10.0, 10.0, 10.4, 20.0], [15.0] * 4, 0.9, criterion="min", eps=0.05)
    assert [d.role for d in dec] == ["normal"] * 3 + ["resize"]
    assert dec[3].resize == pytest.approx(2 / 3)


def test_semi_normal_receivers_exclude_resizing_stragglers() -> None:
    # TC-6 again with receivers='normal': the migrators send only to ranks 4..7
    m = [t - 1.0 if t > 1 else 0.5 for t in T6]
    dec = semi_decision(T6, m, [2048] * 8, CostCoefficients(phi1=3e-4), 0.9, 0.05,
                        receivers="normal")
    assert dec[0].receivers == (4, 5, 6, 7) and dec[3].role == "resize"


# -- §7.8 renormalisation ---------------------------------------------------------------------
def test_renormalise_raises_to_gamma() -> None:
    # equal weights, both layers at the floor 0.4 (= 0.8 · 0.5): +0.1 each
    assert renormalise_ratios([0.4, 0.4], [1, 1], 0.5, 0.9) == pytest.approx([0.5, 0.5])
    # weights 1:3, ratios 0.8 / 0.2, γ 0.5: t = 0.15 would push the first past the cap 0.9,
    # so it stops at 0.9 and (0.9 + 3 (0.2 + t)) / 4 = 0.5 gives t = 1/6
    assert renormalise_ratios([0.8, 0.2], [1, 3], 0.5, 0.9) == pytest.approx([0.9, 0.2 + 1 / 6])
    # already at or above γ: unchanged
    assert renormalise_ratios([0.9, 0.1], [1, 1], 0.4, 0.9) == [0.9, 0.1]


@settings(max_examples=200, deadline=None)
@given(pairs=st.lists(st.tuples(st.floats(0.0, 0.9), st.floats(0.1, 10.0)), min_size=1,
                      max_size=6), gamma=st.floats(0.0, 1.0))
def test_renormalise_properties(pairs: list[tuple[float, float]], gamma: float) -> None:
    ratios, weights = [p[0] for p in pairs], [p[1] for p in pairs]
    out = renormalise_ratios(ratios, weights, gamma, 0.9)
    assert all(r <= o <= 0.9 + 1e-12 for r, o in zip(ratios, out, strict=True))
    mean = sum(o * w for o, w in zip(out, weights, strict=True)) / sum(weights)
    assert mean >= min(gamma, 0.9) - 1e-9
