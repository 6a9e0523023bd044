"""Measured sparsity end to end: ``hetplan profile --sparsity`` on the Embedding + MLP fixture
writes a sparsity record, and ``hetplan plan --profile DB --sparse zen`` uses it (marked
``profiled`` in the plan and in ``inspect``); a record at another batch is scaled by the Zipf
model and the pass says so; a record for another n, table or model is not used."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hetplan.algorithms.zen import zipf_stats
from hetplan.cli import app
from hetplan.cost_models.profile_db import ProfileDB, SparsityRecord
from hetplan.ir.plan import Plan

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
MODULE = "zen_model:embedding_mlp"
# dp = 16, pp = 2, micro-batch 8 x 2 micro-batches: each rank's sync covers 16 samples
LAYOUT = ["--cluster", "mixed-generations", "--batch-size", "256", "--dp", "16", "--pp", "2",
          "--micro-batch-size", "8"]


@pytest.fixture(autouse=True)
def _fixtures_importable() -> None:
    sys.path.insert(0, str(FIXTURES))


def _plan(tmp_path: Path, db: Path, name: str = "plan") -> Plan:
    out = tmp_path / f"{name}.json"
    res = CliRunner().invoke(app, ["plan", "--module", MODULE, *LAYOUT, "--sparse", "zen",
                                   "--profile", str(db), "-o", str(out)])
    assert res.exit_code == 0, res.output
    plan = Plan.from_json(out.read_text())
    assert (plan.layout.dp, plan.layout.micro_batch_size * plan.layout.micro_batches) == (16, 16)
    return plan


def _zen_notes(plan: Plan) -> list[str]:
    return [n for e in plan.pass_log if e.name == "zen" for n in e.notes]


def test_profile_sparsity_then_plan_uses_the_record(tmp_path: Path) -> None:
    db_path = tmp_path / "db.json"
    res = CliRunner().invoke(app, ["profile", "--module", MODULE, "--sparsity", "--workers",
                                   "16", "--batch-size", "16", "--steps", "2",
                                   "-o", str(db_path)])
    assert res.exit_code == 0, res.output
    said = " ".join(res.output.split())  # rich wraps at the terminal's width
    assert "emb.weight: d=" in said and "1 sparsity record(s)" in said
    (rec,) = ProfileDB.load(db_path).sparsity
    assert rec.key == ("EmbeddingMLP", "emb.weight", 16, 16)
    assert (rec.rows, rec.steps, rec.data) == (20000, 2, "zipf")

    plan = _plan(tmp_path, db_path)
    (t,) = plan.sparse_sync.tensors  # type: ignore[union-attr]
    assert t.stats.source == "profiled"
    # measured at exactly the plan's n and batch: the record's numbers, unscaled
    assert (t.stats.density, t.stats.density_n, t.stats.skew) == (
        rec.density, rec.density_n, rec.skew)
    assert not any("scaled" in n for n in _zen_notes(plan))
    text = CliRunner().invoke(app, ["inspect", str(tmp_path / "plan.json")]).output
    row = next(line for line in text.splitlines() if line.startswith("│ emb.weight"))
    assert "profiled" in row


def _db(tmp_path: Path, *records: SparsityRecord) -> Path:
    path = tmp_path / "db.json"
    ProfileDB(sparsity=records).save(path)
    return path


def _rec(**kw: object) -> SparsityRecord:
    base: dict[str, object] = dict(model="EmbeddingMLP", gradient="emb.weight", workers=16,
                                   batch_size=8, rows=20000, density=0.004, density_n=0.04,
                                   skew=9.0, steps=4, data="zipf", zipf_alpha=1.0)
    base.update(kw)
    return SparsityRecord(**base)  # type: ignore[arg-type]


def test_a_record_at_another_batch_is_scaled_by_the_zipf_model(tmp_path: Path) -> None:
    """Measured at 8 samples per rank, planned at 16: each statistic times the Zipf(1) model's
    ratio between 16 x 16 and 8 x 16 ids per rank (16 lookups per sample)."""
    plan = _plan(tmp_path, _db(tmp_path, _rec(), _rec(batch_size=64, density=0.02,
                                                      density_n=0.2)))
    (t,) = plan.sparse_sync.tensors  # type: ignore[union-attr]
    at, to = zipf_stats(20000, 32, 8 * 16, 16), zipf_stats(20000, 32, 16 * 16, 16)
    assert t.stats.source == "profiled"
    assert t.stats.density == pytest.approx(0.004 * to.density / at.density, rel=1e-12)
    assert t.stats.density_n == pytest.approx(0.04 * to.density_n / at.density_n, rel=1e-12)
    assert t.stats.skew == pytest.approx(9.0 * to.skew / at.skew, rel=1e-12)
    (note,) = [n for n in _zen_notes(plan) if "scaled" in n]
    assert "profiled at batch 8 per rank" in note and "scaled to batch 16" in note


@pytest.mark.parametrize("record, says", [
    (_rec(workers=4), "profiled on n=[4] workers, not n=16"),
    (_rec(rows=10000), "the sparsity record has 10000 rows, the model 20000"),
    (_rec(model="OtherModel"), None),
    (_rec(gradient="other.weight"), None),
])
def test_a_record_that_does_not_match_leaves_the_default(tmp_path: Path, record: SparsityRecord,
                                                        says: str | None) -> None:
    plan = _plan(tmp_path, _db(tmp_path, record))
    (t,) = plan.sparse_sync.tensors  # type: ignore[union-attr]
    assert t.stats.source == "assumed"
    notes = _zen_notes(plan)
    if says is None:
        assert not any("profiled" in n for n in notes), notes
    else:
        assert any(says in n for n in notes), notes


def test_profile_sparsity_options_are_checked_first(tmp_path: Path) -> None:
    out = str(tmp_path / "db.json")
    res = CliRunner().invoke(app, ["profile", "--sparsity", "-o", out])
    assert res.exit_code == 2 and "--sparsity needs a MODEL" in res.output
    res = CliRunner().invoke(app, ["profile", "--module", MODULE, "--zipf-alpha", "1.2",
                                   "-o", out])
    assert res.exit_code == 2 and "add --sparsity" in res.output
    res = CliRunner().invoke(app, ["profile", "mlp", "--sparsity", "-o", out])
    assert res.exit_code == 2 and "has no sparse gradient" in res.output
