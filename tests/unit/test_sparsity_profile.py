"""``hetplan profile --sparsity``: the statistics (Definitions 3.4-3.5) on hand-made index
sets and against a set-based reference, the profiler on a Zipf stream against
``zipf_stats``'s expectation, user batch scripts, and the profile DB's sparsity records."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetplan.algorithms.zen import zipf_stats
from hetplan.cost_models.profile_db import ProfileDB, SparsityRecord, merge
from hetplan.errors import HetplanError, SpecError
from hetplan.ir.capture import capture
from hetplan.profiling.sparsity import profile_sparsity, sparsity_stats

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


# -- the statistics on hand-made index sets ------------------------------------------------
def test_two_workers_by_hand() -> None:
    """8 rows, n = 2 (partitions [0, 4) and [4, 8)). Worker 0 touches {0, 1} (a repeat of 1
    counts once), worker 1 touches {1, 5}: d = mean(2, 2) / 8 = 0.25; the union {0, 1, 5}
    gives d^n = 3/8; worker 0's rows both lie in partition 0: (2/4) / (2/8) = 2; worker 1 has
    one per partition: (1/4) / (2/8) = 1; s = mean(2, 1) = 1.5."""
    st_ = sparsity_stats([np.array([0, 1, 1]), np.array([[5, 1]])], rows=8)
    assert (st_.density, st_.density_n, st_.skew) == (0.25, 0.375, 1.5)


def test_three_workers_with_an_idle_one_by_hand() -> None:
    """9 rows, n = 3 (partitions of 3). Workers touch {0, 1, 2}, {2, 8} and nothing:
    d = mean(3, 2, 0) / 9 = 5/27, d^n = |{0, 1, 2, 8}| / 9 = 4/9; skews (3/3)/(3/9) = 3,
    (1/3)/(2/9) = 1.5, and 1 for the empty set: s = 5.5 / 3."""
    st_ = sparsity_stats([np.array([2, 0, 1]), np.array([8, 2]), np.array([], np.int64)], 9)
    assert st_.density == pytest.approx(5 / 27, abs=1e-15)
    assert st_.density_n == pytest.approx(4 / 9, abs=1e-15)
    assert st_.skew == pytest.approx(5.5 / 3, abs=1e-15)


def test_one_worker_has_no_overlap_or_skew() -> None:
    st_ = sparsity_stats([np.array([3, 3, 7])], rows=10)
    assert (st_.density, st_.density_n, st_.skew) == (0.2, 0.2, 1.0)


def test_ids_outside_the_table_are_refused() -> None:
    with pytest.raises(ValueError, match=r"row ids must be in \[0, 8\)"):
        sparsity_stats([np.array([0, 8])], rows=8)


def _reference(sets: list[list[int]], rows: int) -> tuple[float, float, float]:
    """Definitions 3.4-3.5 with Python sets and an explicit loop over the partitions."""
    n = len(sets)
    uniq = [set(s) for s in sets]
    d = sum(len(u) for u in uniq) / n / rows
    dn = len(set().union(*uniq)) / rows
    bounds = [math.floor(j * rows / n) for j in range(n + 1)]
    skews = []
    for u in uniq:
        if not u:
            skews.append(1.0)
            continue
        parts = [sum(1 for i in u if bounds[j] <= i < bounds[j + 1])
                 / max(bounds[j + 1] - bounds[j], 1) for j in range(n)]
        skews.append(max(parts) / (len(u) / rows))
    return d, dn, sum(skews) / n


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 40).flatmap(lambda rows: st.tuples(
    st.just(rows),
    st.lists(st.lists(st.integers(0, rows - 1), max_size=30), min_size=1, max_size=6))))
def test_statistics_match_a_set_based_reference(case: tuple[int, list[list[int]]]) -> None:
    rows, sets = case
    got = sparsity_stats([np.array(s, dtype=np.int64) for s in sets], rows)
    d, dn, skew = _reference(sets, rows)
    assert got.density == pytest.approx(d, rel=1e-12, abs=1e-15)
    assert got.density_n == pytest.approx(dn, rel=1e-12, abs=1e-15)
    assert got.skew == pytest.approx(skew, rel=1e-9)
    # Definition 3.4's bounds: the union is no smaller than the mean set, no larger than the sum
    assert got.density - 1e-12 <= got.density_n <= len(sets) * got.density + 1e-12


# -- the profiler on the fixture model -----------------------------------------------------
def _fixture_model() -> tuple:
    sys.path.insert(0, str(FIXTURES))
    from zen_model import embedding_mlp

    model, args = embedding_mlp()
    return model, args, capture(model, args, {}, name="EmbeddingMLP")


@pytest.mark.parametrize("alpha", [1.0, 1.3])
def test_zipf_stream_matches_the_analytic_expectation(alpha: float) -> None:
    """n = 4 workers x K = 32 steps of 8 x 16 Zipf tokens over 20000 rows (T = 128 ids per
    worker per step) against ``zipf_stats(20000, 32, 128, 4, alpha)``.

    Bound: a step's ``|I|`` counts the rows hit by T i.i.d. draws; the hit indicators are
    negatively associated, so ``Var|I| <= sum p_r (1 - p_r) <= E|I|``. Steps and workers are
    independent, so the mean over ``nK`` of them has ``sd(d) <= sqrt(d / (R n K))``; likewise
    ``sd(d^n) <= sqrt(d^n / (R K))`` (the union is ``nT`` draws). The skew is ``n c_1 / |I|``
    (``c_1`` the rows hit in the first partition, the densest one under Zipf); to first order
    a ratio's relative sd is at most the sum of its parts', each ``<= 1 / sqrt(E)``, so
    ``sd(s) / s <= (1/sqrt(E c_1) + 1/sqrt(E|I|)) / sqrt(nK)``. Each statistic must lie within
    5 of those sds of the expectation: under the normal approximation of a mean of 128 (32 for
    ``d^n``) independent samples a correct profiler fails with probability < 1e-6 per
    statistic (and the stream is seeded, so the outcome is fixed). For alpha = 1 the bounds
    are 4.5 %, 5.0 % and 9.5 % of d, d^n and s."""
    model, args, ir = _fixture_model()
    n, k, rows = 4, 32, 20000
    (rec,) = profile_sparsity(model, args, {}, ir=ir, workers=n, batch_size=8, steps=k,
                              zipf_alpha=alpha)
    exp = zipf_stats(rows, 32, 8 * 16, n, alpha)
    sd_d = math.sqrt(exp.density / (rows * n * k))
    sd_dn = math.sqrt(exp.density_n / (rows * k))
    hits = exp.density * rows
    first = exp.skew * hits / n  # expected rows hit in the first partition
    sd_s = exp.skew * (1 / math.sqrt(first) + 1 / math.sqrt(hits)) / math.sqrt(n * k)
    assert abs(rec.density - exp.density) <= 5 * sd_d, (rec.density, exp.density, sd_d)
    assert abs(rec.density_n - exp.density_n) <= 5 * sd_dn, (rec.density_n, exp.density_n)
    assert abs(rec.skew - exp.skew) <= 5 * sd_s, (rec.skew, exp.skew, sd_s)
    assert (rec.model, rec.gradient, rec.workers, rec.batch_size, rec.rows, rec.steps) == (
        "EmbeddingMLP", "emb.weight", n, 8, rows, k)
    assert (rec.data, rec.zipf_alpha) == ("zipf", alpha)


def test_the_profiler_is_deterministic_and_restores_the_model() -> None:
    model, args, ir = _fixture_model()
    model.train()
    a = profile_sparsity(model, args, {}, ir=ir, workers=3, batch_size=4, steps=2, seed=7)
    b = profile_sparsity(model, args, {}, ir=ir, workers=3, batch_size=4, steps=2, seed=7)
    c = profile_sparsity(model, args, {}, ir=ir, workers=3, batch_size=4, steps=2, seed=8)
    assert a == b and a != c
    assert model.training and not model.emb._forward_pre_hooks


def test_a_script_gives_the_batches() -> None:
    """The script's ids all lie in rows [0, 1000), inside the first of 4 partitions of 5000
    rows, so every worker's skew is exactly n = 4 (see tests/fixtures/zen_batches.py)."""
    model, args, ir = _fixture_model()
    (rec,) = profile_sparsity(model, args, {}, ir=ir, workers=4, batch_size=8, steps=3,
                              script=FIXTURES / "zen_batches.py")
    assert (rec.data, rec.zipf_alpha, rec.steps) == ("script", None, 3)
    assert rec.skew == 4.0
    assert 0 < rec.density <= 128 / 20000 and rec.density_n <= 1000 / 20000


def test_bad_scripts_and_counts_are_clear(tmp_path: Path) -> None:
    model, args, ir = _fixture_model()
    with pytest.raises(SpecError, match="no such file"):
        profile_sparsity(model, args, {}, ir=ir, script=tmp_path / "missing.py")
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    with pytest.raises(SpecError, match="defines no function sparsity_batches"):
        profile_sparsity(model, args, {}, ir=ir, script=empty)
    short = tmp_path / "short.py"
    short.write_text("import torch\ndef sparsity_batches(w, n, b):\n"
                     "    yield torch.zeros(b, 4, dtype=torch.long)\n")
    with pytest.raises(SpecError, match="gave worker 0 1 batch.*--steps asks for 3"):
        profile_sparsity(model, args, {}, ir=ir, steps=3, script=short)
    boom = tmp_path / "boom.py"
    boom.write_text("def sparsity_batches(w, n, b):\n    raise RuntimeError('no data')\n")
    with pytest.raises(HetplanError, match="raised RuntimeError: no data"):
        profile_sparsity(model, args, {}, ir=ir, script=boom)
    with pytest.raises(SpecError, match="--workers, --batch-size and --steps must be >= 1"):
        profile_sparsity(model, args, {}, ir=ir, workers=0)


# -- the profile DB ------------------------------------------------------------------------
def _rec(batch: int = 8, steps: int = 4, workers: int = 4, **kw: object) -> SparsityRecord:
    base: dict[str, object] = dict(model="EmbeddingMLP", gradient="emb.weight",
                                   workers=workers, batch_size=batch, rows=20000,
                                   density=0.005, density_n=0.015, skew=3.3, steps=steps,
                                   data="zipf", zipf_alpha=1.0)
    base.update(kw)
    return SparsityRecord(**base)  # type: ignore[arg-type]


def test_sparsity_records_round_trip_through_the_db(tmp_path: Path) -> None:
    db = ProfileDB(sparsity=(_rec(32), _rec(8), _rec(8, workers=2),
                             _rec(16, data="script", zipf_alpha=None)))
    path = tmp_path / "db.json"
    db.save(path)
    again = ProfileDB.load(path)
    assert again == db and again.to_json() == db.to_json()
    assert [r.key for r in again.sparsity] == sorted(r.key for r in db.sparsity)
    # nearest batch by ratio (12 is 1.33x from 16 and 1.5x from 8); exact n only
    def nearest(batch: int) -> int | None:
        rec = again.sparsity_record("EmbeddingMLP", "emb.weight", 4, batch)
        return None if rec is None else rec.batch_size

    assert (nearest(12), nearest(1000), nearest(8)) == (16, 32, 8)
    assert again.sparsity_record("EmbeddingMLP", "emb.weight", 3, 8) is None
    assert again.sparsity_record("Other", "emb.weight", 4, 8) is None


def test_an_older_v2_file_without_sparsity_loads_and_is_written_unchanged() -> None:
    old = {"schema_version": 2, "machines": [], "compute": [], "collectives": [],
           "compressors": []}
    db = ProfileDB.from_dict(old)
    assert db.sparsity == ()
    assert json.loads(db.to_json()) == old  # no "sparsity" key: older readers still read it


def test_merge_keeps_the_record_with_more_steps() -> None:
    a, b = ProfileDB(sparsity=(_rec(steps=4, skew=3.0),)), ProfileDB(sparsity=(_rec(steps=9),))
    assert merge(a, b).sparsity == b.sparsity and merge(b, a).sparsity == b.sparsity
    tie = ProfileDB(sparsity=(_rec(steps=4, skew=5.0),))
    assert merge(tie, a).sparsity == tie.sparsity  # a tie keeps the earlier argument's


@pytest.mark.parametrize("bad, match", [
    ({"density_n": 0.001}, "density_n 0.001 is below density"),
    ({"data": "script"}, "give zipf_alpha exactly when data is 'zipf'"),
    ({"density": 0.0}, r"sparsity\[0\]\.density: Input should be greater than 0"),
    ({"skew": 0.5}, r"sparsity\[0\]\.skew: Input should be greater than or equal to 1"),
])
def test_bad_sparsity_records_name_the_field(bad: dict, match: str) -> None:
    data = json.loads(ProfileDB(sparsity=(_rec(),)).to_json())
    data["sparsity"][0].update(bad)
    with pytest.raises(SpecError, match=match):
        ProfileDB.from_dict(data)


def test_a_duplicate_sparsity_key_is_refused() -> None:
    data = json.loads(ProfileDB(sparsity=(_rec(),)).to_json())
    data["sparsity"].append(dict(data["sparsity"][0]))
    with pytest.raises(SpecError, match="sparsity key .* appears 2 times"):
        ProfileDB.from_dict(data)
