"""Zen's pure algorithms: the thesis's worked values (``zen_espresso.md`` §F.4) and the
invariants of Algorithm 3.2 as property tests."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetplan.algorithms.zen import (
    SparseStats,
    ZenLink,
    bitmap_decode,
    bitmap_encode,
    choose_scheme,
    hash_bitmap_decode,
    hash_bitmap_encode,
    hash_partition,
    hierarchical_hash,
    hierarchy_incremental_volume,
    partition_sets,
    ps_broadcast_over_bp,
    push_imbalance,
    ring_incremental_first_step,
    scheme_times,
    skew_of,
    zipf_stats,
)
from hetplan.algorithms.zen_hashing import partition_of

_LINK = ZenLink(bandwidth_bytes_per_s=25e9 / 8)


# ---- Fig. 3.6: push imbalance --------------------------------------------------------------
def test_fig_3_6_even_split_is_imbalanced_2() -> None:
    # 3 GPUs, 15 gradients, 6 non-zeros per GPU; the even split puts (1, 4, 1) in the partitions
    assert push_imbalance([1, 4, 1]) == pytest.approx(2.0)
    # GPU 1 receives 2 * 4 = 8 non-zeros, GPUs 0 and 2 receive 2: 4x
    assert (3 - 1) * 4 / ((3 - 1) * 1) == 4


def test_fig_3_6_balanced_split_is_1() -> None:
    assert push_imbalance([2, 2, 2]) == pytest.approx(1.0)


def test_push_imbalance_bounds() -> None:
    assert push_imbalance([0, 0, 9]) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="at least one partition"):
        push_imbalance([])


# ---- Lemma 3.4: Sparse PS / BP = s, PS-with-broadcast / BP > 1 ------------------------------
def _elementwise(d: float, gamma: float, skew: float, units: int = 1 << 20) -> SparseStats:
    return SparseStats(units=units, unit_elems=1, density=d, density_n=d * gamma, skew=skew)


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(2, 256),
    skew=st.floats(1.0, 50.0),
    d=st.floats(1e-4, 0.02),
    gamma_frac=st.floats(0.0, 1.0),
)
def test_sparse_ps_over_bp_is_skew(n: int, skew: float, d: float, gamma_frac: float) -> None:
    gamma = 1.0 + gamma_frac * (n - 1) * 0.999
    stats = _elementwise(d, min(gamma, 1 / d), skew)
    t = scheme_times(stats, n, _LINK, pull="coo")
    assert t["sparse_ps"] / t["zen"] == pytest.approx(skew, rel=1e-9)


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(2, 256),
    skew=st.floats(1.0, 50.0),
    gamma_frac=st.floats(0.0, 1.0),
    rounds=st.one_of(st.just(0.0), st.floats(1.0, 10.0)),
)
def test_ps_broadcast_over_bp_exceeds_1(n: int, skew: float, gamma_frac: float,
                                        rounds: float) -> None:
    gamma = 1.0 + gamma_frac * (n - 1) * 0.999
    d = 0.5 / n
    link = ZenLink(bandwidth_bytes_per_s=1e9, broadcast_rounds=rounds)
    t = scheme_times(_elementwise(d, gamma, skew), n, link, pull="coo")
    b = link.rounds(n)
    ratio = t["ps_broadcast"] / t["zen"]
    assert ratio == pytest.approx(ps_broadcast_over_bp(skew, gamma, n, b), rel=1e-9)
    assert ratio > (skew + b * gamma) / (1 + gamma) - 1e-12
    assert ratio > 1.0


# ---- Lemma 3.5 ----------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(n=st.integers(2, 128), d=st.floats(1e-4, 0.05),
       steps=st.lists(st.floats(0.0, 0.01), min_size=127, max_size=127))
def test_ring_incremental_is_at_least_bp_first_step(n: int, d: float,
                                                    steps: list[float]) -> None:
    dens = list(np.minimum(1.0, d + np.cumsum(steps[: n - 1])))  # non-decreasing, >= d
    bp_first = 2 * (n - 1) * d * 1e6 / n / 1e9
    assert ring_incremental_first_step(dens, 1e6, n, 1e9) >= bp_first * (1 - 1e-12)


@pytest.mark.parametrize("log_n", range(1, 9))
def test_hierarchy_volume_identity_and_bound(log_n: int) -> None:
    n, m = 2 ** log_n, 1000.0
    # sum_{i=1}^{log n} 1/2^{i-1} * M n = 2 (n - 1) M
    assert hierarchy_incremental_volume([1.0] * log_n, m, n) == pytest.approx(2 * (n - 1) * m)
    d = 0.01
    grown = [min(1.0, d * 1.5 ** i) for i in range(log_n)]
    assert hierarchy_incremental_volume(grown, m, n) >= 2 * (n - 1) * d * m * (1 - 1e-12)


# ---- Fig. 3.10, Theorem 3.3: hash bitmap --------------------------------------------------
def test_fig_3_10_hash_bitmap_round_trip() -> None:
    # |G| = 15, server 0's index set (1-based as in the figure) holds 5 and 7 at its 2nd and
    # 3rd positions; in our 0-based positions those are bits 1 and 2.
    part0 = np.array([1, 5, 7, 10, 14])
    bits = hash_bitmap_encode([5, 7], part0)
    assert list(bitmap_decode(bits)) == [1, 2]  # the figure's bits {2, 3}, 1-based
    assert list(hash_bitmap_decode(part0, bits)) == [5, 7]


@settings(max_examples=100, deadline=None)
@given(size=st.integers(1, 5000), data=st.data())
def test_bitmap_round_trip(size: int, data: st.DataObject) -> None:
    idx = np.array(sorted(data.draw(st.sets(st.integers(0, size - 1), max_size=200))),
                   dtype=np.int64)
    words = bitmap_encode(idx, size)
    assert words.size == math.ceil(size / 32)
    assert np.array_equal(bitmap_decode(words), idx)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 16, 128])
def test_hash_bitmap_total_is_g_over_32_for_any_n(n: int) -> None:
    size = 856 * 1024  # bits: one per element of G
    sets = partition_sets(size, n, seed=3)
    assert sorted(np.concatenate(sets).tolist()) == list(range(size))
    total_bits = sum(s.size for s in sets)
    assert total_bits == size  # |G|/32 words of 32 bits, per worker, for any n
    total_words = sum(bitmap_encode([], s.size).size for s in sets)
    assert size / 32 <= total_words <= size / 32 + n  # at most one padding word per server


def test_bitmap_sizes_of_the_thesis() -> None:
    mb = 856.0
    assert mb / 32 == pytest.approx(26.75)  # plain bitmap, even partitions: ~27 MB
    assert mb / 32 * 16 == pytest.approx(428.0)  # hashed placement, 16 servers


def test_hash_bitmap_rejects_foreign_index() -> None:
    with pytest.raises(ValueError, match="partition's index set"):
        hash_bitmap_encode([6], np.array([1, 5, 7]))


# ---- Algorithm 3.2 invariants -------------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(
    idx=st.sets(st.integers(0, 10**6), max_size=400),
    n=st.integers(1, 16),
    seed=st.integers(0, 2**31 - 1),
    k=st.integers(1, 4),
)
def test_every_index_once_in_its_h0_partition(idx: set[int], n: int, seed: int,
                                              k: int) -> None:
    arr = np.array(sorted(idx), dtype=np.int64)
    res = hierarchical_hash(arr, n, seed, k=k)
    out = np.concatenate(res.partitions)
    assert sorted(out.tolist()) == sorted(idx)  # no loss, no duplicate
    for j, part in enumerate(res.partitions):
        assert np.all(partition_of(part, n, seed) == j)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(2, 16), data=st.data())
def test_partition_is_h0_on_every_rank(seed: int, n: int, data: st.DataObject) -> None:
    # two workers with different, overlapping index sets put a shared index in one partition
    a = np.array(sorted(data.draw(st.sets(st.integers(0, 5000), min_size=1, max_size=300))))
    b = np.array(sorted(data.draw(st.sets(st.integers(0, 5000), min_size=1, max_size=300))))
    pa, pb = hash_partition(a, n, seed), hash_partition(b, n, seed)
    where_a = {int(i): j for j, p in enumerate(pa) for i in p}
    where_b = {int(i): j for j, p in enumerate(pb) for i in p}
    for i in set(where_a) & set(where_b):
        assert where_a[i] == where_b[i]


def _zipf_indices(rng: np.random.Generator, rows: int, draws: int, a: float) -> np.ndarray:
    p = 1.0 / np.arange(1, rows + 1) ** a
    return np.unique(rng.choice(rows, size=draws, p=p / p.sum()))


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.sampled_from([2, 4, 8, 16]),
       a=st.floats(0.8, 1.1))
def test_push_imbalance_on_zipf_indices_is_at_most_1_15(seed: int, n: int, a: float) -> None:
    rng = np.random.default_rng(seed)
    idx = _zipf_indices(rng, 2_000_000, 100_000, a)
    assert idx.size >= 10_000
    res = hierarchical_hash(idx, n, seed)
    assert push_imbalance(res.counts) <= 1.15
    # the even split of the same skewed indices is far from balanced (the Sparse PS case)
    assert skew_of(idx, 2_000_000, n) > 1.5


def test_serial_memory_is_rare_with_thesis_parameters() -> None:
    rng = np.random.default_rng(0)
    idx = _zipf_indices(rng, 1_000_000, 40_000, 1.0)
    res = hierarchical_hash(idx, 8, seed=11, k=3)
    assert sum(res.serial) / idx.size < 0.05
    assert res.overflow == 0
    res4 = hierarchical_hash(idx, 8, seed=11, k=4)
    assert sum(res4.serial) <= sum(res.serial)


def test_hashing_is_deterministic_and_seeded() -> None:
    idx = np.arange(0, 30000, 7)
    a = hierarchical_hash(idx, 4, seed=5)
    b = hierarchical_hash(idx, 4, seed=5)
    c = hierarchical_hash(idx, 4, seed=6)
    assert all(np.array_equal(x, y) for x, y in zip(a.partitions, b.partitions))
    assert any(not np.array_equal(x, y) for x, y in zip(a.partitions, c.partitions))


def test_hashing_rejects_duplicates() -> None:
    with pytest.raises(ValueError, match="distinct"):
        hierarchical_hash([3, 3], 2, 0)


# ---- choice and statistics ----------------------------------------------------------------
def test_choice_picks_zen_for_a_sparse_table_and_dense_when_dense() -> None:
    sparse = zipf_stats(100_000, 32, tokens_per_worker=2000, n=16)
    assert sparse.density < 0.03
    ch = choose_scheme(sparse, 16, _LINK)
    assert ch.scheme == "zen" and ch.benefit > 3.0
    full = SparseStats(units=1000, unit_elems=32, density=1.0, density_n=1.0)
    assert choose_scheme(full, 16, _LINK).scheme == "dense"


def test_zipf_stats_are_consistent() -> None:
    s = zipf_stats(50_000, 16, 1000, n=8)
    assert s.density <= s.density_n <= min(1.0, 8 * s.density)
    assert 1.0 < s.gamma < 8.0  # partial overlap (C2)
    assert s.skew > 1.0  # skewed (C3)


def test_bad_stats_name_the_field() -> None:
    with pytest.raises(ValueError, match="density must be in"):
        SparseStats(units=10, unit_elems=1, density=0.0, density_n=0.1)
    with pytest.raises(ValueError, match="skew must be"):
        SparseStats(units=10, unit_elems=1, density=0.1, density_n=0.1, skew=0.5)
