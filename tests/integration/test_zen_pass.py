"""The zen pass end to end: an Embedding + MLP model planned with ``--sparse zen`` and
``auto``; GPT-2-style tied embeddings stay dense."""

from __future__ import annotations

import sys
from pathlib import Path

from typer.testing import CliRunner

from hetplan.cli import app
from hetplan.ir.plan import Plan

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _plan(tmp_path: Path, sparse: str, module: str = "zen_model:embedding_mlp") -> Plan:
    sys.path.insert(0, str(FIXTURES))
    out = tmp_path / f"{sparse}.json"
    res = CliRunner().invoke(app, ["plan", "--module", module, "--cluster", "mixed-generations",
                                   "--batch-size", "256", "--sparse", sparse, "-o", str(out)])
    assert res.exit_code == 0, res.output
    return Plan.from_json(out.read_text())


def test_sparse_zen_syncs_the_embedding_with_zen(tmp_path: Path) -> None:
    plan = _plan(tmp_path, "zen")
    assert plan.sparse_sync is not None
    (t,) = plan.sparse_sync.tensors
    assert (t.name, t.rows, t.row_elems, t.scheme) == ("emb.weight", 20000, 32, "zen")
    assert t.stats.source == "assumed" and 0 < t.stats.density < 0.05
    assert t.stats.density <= t.stats.density_n and t.stats.skew >= 1
    assert t.dense_ms > t.predicted_ms > 0  # Zen predicted faster than dense for this table
    again = _plan(tmp_path, "zen")
    assert again.to_json() == plan.to_json()  # deterministic


def test_sparse_off_has_no_section_and_auto_keeps_a_guarded_choice(tmp_path: Path) -> None:
    assert _plan(tmp_path, "off").sparse_sync is None
    auto = _plan(tmp_path, "auto")
    assert auto.sparse_sync is not None and auto.sparse_sync.mode == "auto"
    assert auto.sparse_sync.tensors[0].scheme in ("dense", "agsparse", "zen")


def test_bad_sparse_value_is_one_line(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["plan", "mlp", "--batch-size", "8", "--sparse", "yes"])
    assert res.exit_code == 2 and "--sparse must be off, auto or zen" in res.output


def test_position_embeddings_made_inside_forward_stay_dense() -> None:
    """GPT-2's position ids come from ``arange`` inside ``forward``: every iteration touches
    the same rows, so ``wpe`` is not a sparse gradient (and ``wte`` is tied to the head)."""
    from hetplan import capture, zoo
    from hetplan.ir.sparse_grads import sparse_gradients

    args, kwargs = zoo.example_inputs("tiny-gpt2", batch=2)
    ir = capture(zoo.build("tiny-gpt2"), args, kwargs)
    assert any(lay.name.endswith("wpe") for lay in ir.layers)
    assert sparse_gradients(ir) == ()


def test_inspect_and_explain_show_the_sparse_scheme(tmp_path: Path) -> None:
    from hetplan.report.explain import explain
    from hetplan.report.inspect import build_report

    plan = _plan(tmp_path, "zen")
    (row,) = build_report(plan)["sync"]["sparse"]
    (t,) = plan.sparse_sync.tensors  # type: ignore[union-attr]
    assert (row["name"], row["scheme"], row["pull"]) == ("emb.weight", "zen", t.pull)
    assert row["predicted_ms"] == round(t.predicted_ms, 6)
    assert row["benefit"] == round(t.dense_ms / t.predicted_ms, 6)
    text = CliRunner().invoke(app, ["inspect", str(tmp_path / "zen.json")]).output
    assert "sparse gradients (Zen)" in text and "emb.weight" in text
    ex = explain(plan, "emb.weight")
    assert any(k == "sparse sync" and v.startswith("zen") for k, v in ex.facts)
    (alt,) = ex.alternatives
    assert alt.name.startswith("dense")
    # the alternative really drops the section: the re-evaluation differs from the plan's
    assert alt.iteration_time_ms != ex.current_ms


def test_a_sparse_sync_naming_a_foreign_or_misshaped_tensor_is_refused(tmp_path: Path) -> None:
    import json

    import pytest

    from hetplan.errors import HetplanError

    plan = _plan(tmp_path, "zen")
    data = json.loads(plan.to_json())
    good = json.dumps(data)
    data["sparse_sync"]["tensors"][0]["name"] = "emb.wieght"
    with pytest.raises(HetplanError, match=r"sparse_sync.tensors\[0\].name: 'emb.wieght'"):
        Plan.from_json(json.dumps(data))
    data = json.loads(good)
    data["sparse_sync"]["tensors"][0]["rows"] = 19999
    with pytest.raises(HetplanError, match=r"rows x row_elems = 19999 x 32"):
        Plan.from_json(json.dumps(data))
    res = CliRunner().invoke(app, ["validate", str(tmp_path / "zen.json")])
    assert res.exit_code == 0, res.output


def test_sparse_zen_stays_dense_under_zero_2(tmp_path: Path) -> None:
    """ZeRO-2 reduce-scatters every gradient during backward, and the sparse schemes need the
    full gradient: the pass leaves the embedding dense, with a note, so `hetplan run`
    executes the plan (it refused the sparse section under ZeRO-2)."""
    from hetplan.runtime.composition import refusals

    sys.path.insert(0, str(FIXTURES))
    out = tmp_path / "z2.json"
    res = CliRunner().invoke(app, ["plan", "--module", "zen_model:embedding_mlp", "--cluster",
                                   "mixed-generations", "--batch-size", "256", "--sparse",
                                   "zen", "--zero", "2", "-o", str(out)])
    assert res.exit_code == 0, res.output
    plan = Plan.from_json(out.read_text())
    assert plan.layout is not None and plan.layout.zero_stage == 2 and plan.layout.dp > 1
    assert plan.sparse_sync is None or not plan.sparse_sync.synced()
    assert refusals(plan) == []
    notes = " ".join(n for e in plan.pass_log if e.name == "zen" for n in e.notes)
    assert "ZeRO-2 reduce-scatters every gradient" in notes


def test_export_prices_the_plan_with_its_sparse_sync_and_names_it(tmp_path: Path) -> None:
    """``export`` re-predicts the plan as ``simulate`` does, Zen included (it priced every
    variant without ``sparse_sync``: 0.409 ms for a plan ``simulate`` puts at 0.979 ms), and
    names Zen as a part no engine expresses, worth the plan re-predicted dense."""
    from hetplan.cost_models.predict import simulate
    from hetplan.report.export import ENGINES, export_plan

    plan = _plan(tmp_path, "zen")
    own = simulate(plan).iteration_time_ms
    dense = simulate(plan.model_copy(update={"sparse_sync": None})).iteration_time_ms
    assert dense != own
    for engine in ENGINES:
        result = export_plan(plan, engine)
        assert result.plan_ms == own
        gap = {g.part: g for g in result.gaps}["sparse-sync"]
        assert gap.plan_does.startswith(
            "sparse sync of 1 embedding gradient(s): emb.weight zen")
        assert gap.iteration_time_ms == dense and gap.delta_ms == round(dense - own, 6)
        assert "sparse sync of 1 embedding gradient(s)" in result.text
    bare = export_plan(plan.model_copy(update={"sparse_sync": None}), "megatron")
    assert "sparse-sync" not in {g.part for g in bare.gaps} and bare.plan_ms == dense
