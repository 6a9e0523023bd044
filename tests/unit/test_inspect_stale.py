"""``hetplan inspect`` re-checks the prediction a plan file stores: an edited plan shows what
``simulate`` predicts for it now, with a line giving the stored and the re-predicted time;
an unedited plan's report is the one it always was; a plan predicted with a profile DB is
re-checked only with that DB (docs/decisions.md, "Reports")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from hetplan.cli import app
from hetplan.cost_models.predict import simulate
from hetplan.cost_models.profile_db import ProfileDB
from hetplan.ir.model import ModelIR
from hetplan.ir.plan import Plan
from hetplan.optimizer.compile import compile as compile_plan
from hetplan.report._text import dump_json
from hetplan.report.inspect import build_report
from hetplan.report.trace_compare import plan_digest
from test_plan_lists_everywhere import toy_hetero_plan

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
runner = CliRunner()


@pytest.fixture(scope="module")
def plan() -> Plan:
    """dp=8 pp=2 tp=2 on mixed-generations, as planned (no recomputation)."""
    ir = ModelIR.load(GOLDEN / "inspect_small.workload.json")
    made = compile_plan(ir, "mixed-generations", batch_size=64, dp=8, pp=2, tp=2)
    assert all(st.recompute == "none" for st in made.stages)
    return made


def _recomputed(plan: Plan, **settings: Any) -> Plan:
    """``plan`` edited by hand: every stage recomputes fully (slower, less memory); the
    stored prediction is left as it was."""
    stages = tuple(st.model_copy(update={"recompute": "full"}) for st in plan.stages)
    update: dict[str, Any] = {"stages": stages}
    if settings:
        assert plan.cost_settings is not None
        update["cost_settings"] = plan.cost_settings.model_copy(update=settings)
    return Plan.model_validate(plan.model_copy(update=update).model_dump())


def _inspect(plan: Plan, path: Path, *args: str) -> str:
    plan.save(path)
    result = runner.invoke(app, ["inspect", str(path), *args])
    assert result.exit_code == 0, result.output
    return result.output


def test_an_edited_plan_shows_its_re_prediction(plan: Plan, tmp_path: Path) -> None:
    edited = _recomputed(plan)
    assert edited.predictions == plan.predictions  # the file still says the old numbers
    stored, now = plan.predictions.iteration_time_ms, simulate(edited)  # type: ignore[union-attr]
    assert now.iteration_time_ms > stored
    report = json.loads(_inspect(edited, tmp_path / "edited.json", "--json"))
    pred = report["predictions"]
    assert pred["iteration_time_ms"] == now.iteration_time_ms
    assert pred["breakdown"] == now.breakdown.model_dump(mode="json")
    assert pred["check"]["status"] == "stale"
    assert pred["check"]["stored_iteration_time_ms"] == stored
    assert report["memory"]["peak"]["max_bytes"] == max(now.memory_per_rank_bytes)
    assert [w["kind"] for w in report["warnings"]][0] == "stale-prediction"
    assert all(s["bwd_ms"] > st.bwd_ms for s, st in zip(report["stages"], plan.stages))
    text = " ".join(_inspect(edited, tmp_path / "edited.json").split())
    assert (f"stored prediction {stored:.3f} ms is stale: the plan was edited (or written by "
            f"another hetplan version); re-predicted {now.iteration_time_ms:.3f} ms") in text
    # the same plan unedited: the report it always was (build_report of the file)
    same = _inspect(plan, tmp_path / "plan.json", "--json")
    assert same == dump_json(build_report(Plan.from_json(plan.to_json())))
    assert "stale" not in _inspect(plan, tmp_path / "plan.json")


def test_a_run_is_compared_with_the_re_prediction(plan: Plan, tmp_path: Path) -> None:
    edited = _recomputed(plan)
    report = tmp_path / "run.json"
    report.write_text(json.dumps({"measured": {"iteration_ms": 100.0}, "world_size": 32}))
    text = _inspect(edited, tmp_path / "edited.json", "--run", str(report))
    (row,) = [line for line in text.splitlines() if line.lstrip("│ ").startswith("iteration")]
    assert f"{simulate(edited).iteration_time_ms:.3f}" in row, row
    assert f"{plan.predictions.iteration_time_ms:.3f}" not in row  # type: ignore[union-attr]


def test_a_profiled_plan_is_re_checked_with_its_profile_only(plan: Plan,
                                                             tmp_path: Path) -> None:
    db_path = tmp_path / "db.json"
    db_path.write_text(json.dumps({"schema_version": 2, "machines": []}))
    db = ProfileDB.load(db_path)
    edited = _recomputed(plan, profile_fingerprint=db.fingerprint())
    path = tmp_path / "edited.json"
    text = " ".join(_inspect(edited, path).split())
    stored = plan.predictions.iteration_time_ms  # type: ignore[union-attr]
    assert (f"stored prediction {stored:.3f} ms not re-checked: the plan was predicted with "
            f"profile DB {db.fingerprint()}, which the file does not carry; give it with "
            "--profile DB") in text
    now = simulate(edited, profile=db).iteration_time_ms
    text = " ".join(_inspect(edited, path, "--profile", str(db_path)).split())
    assert "is stale: the plan was edited" in text and f"re-predicted {now:.3f} ms" in text
    # another DB cannot re-check it: refused (bad-input round 10; it was exit 0 with a line
    # saying nothing was re-checked), naming both DBs and the fix
    wrong = _recomputed(plan, profile_fingerprint="0123456789abcdef")
    path.write_text(wrong.to_json())
    result = runner.invoke(app, ["inspect", str(path), "--profile", str(db_path)])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert (f"--profile {db_path} is profile DB {db.fingerprint()}, but {path} was predicted "
            "with profile DB 0123456789abcdef") in text and "drop --profile" in text


def test_simulate_of_a_profiled_plan_without_its_profile_says_so(plan: Plan,
                                                                  tmp_path: Path) -> None:
    """Was: `simulate` re-predicted analytically and showed the difference from the stored
    prediction as if the plan were stale, where inspect and diff say which DB to give."""
    db_path = tmp_path / "db.json"
    db_path.write_text(json.dumps({"schema_version": 2, "machines": []}))
    db = ProfileDB.load(db_path)
    assert plan.cost_settings is not None
    path = tmp_path / "plan.json"
    profiled = plan.model_copy(update={"cost_settings": plan.cost_settings.model_copy(
        update={"profile_fingerprint": db.fingerprint()})})
    profiled.save(path)
    result = runner.invoke(app, ["simulate", str(path)])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert (f"the plan was predicted with profile DB {db.fingerprint()}, which the file does "
            "not carry, so this prediction is analytic; give --profile DB") in text
    result = runner.invoke(app, ["simulate", str(path), "--profile", str(db_path)])
    assert result.exit_code == 0, result.output
    assert "note:" not in result.output
    for argv in (["export", str(path), "--to", "megatron"],
                 ["timeline", str(path), "-o", str(tmp_path / "t.html")]):
        result = runner.invoke(app, argv)  # they re-predict the plan too
        assert result.exit_code == 0, result.output
        assert "so this prediction is analytic" in " ".join(result.output.split()), argv
    plan.save(path)  # planned without a DB: nothing to say
    assert "note:" not in runner.invoke(app, ["simulate", str(path)]).output


def test_simulate_with_another_profile_than_the_plans_says_so(plan: Plan,
                                                               tmp_path: Path) -> None:
    """Was: silent, and the difference from the stored prediction read as a stale plan's."""
    db_path = tmp_path / "db.json"
    db_path.write_text(json.dumps({"schema_version": 2, "machines": []}))
    db = ProfileDB.load(db_path)
    assert plan.cost_settings is not None
    path = tmp_path / "plan.json"
    other = plan.model_copy(update={"cost_settings": plan.cost_settings.model_copy(
        update={"profile_fingerprint": "0123456789abcdef"})})
    for made, was in ((other, "with profile DB 0123456789abcdef"), (plan, "without one")):
        made.save(path)
        for argv in (["simulate", str(path)], ["export", str(path), "--to", "megatron"]):
            result = runner.invoke(app, [*argv, "--profile", str(db_path)])
            assert result.exit_code == 0, result.output
            text = " ".join(result.output.split())
            assert (f"note: this prediction uses --profile {db_path} (profile DB "
                    f"{db.fingerprint()}), but the plan was predicted {was}") in text, argv


def test_explain_with_another_profile_than_the_plans_says_so(plan: Plan,
                                                              tmp_path: Path) -> None:
    """Was: "(the plan file says X ms)" with no reason, as if the plan were stale."""
    from hetplan.cost_models.profile_db import ComputeRecord
    from hetplan.ir.plan_sections import WorkloadSummary

    ir = ModelIR.load(GOLDEN / "inspect_small.workload.json")
    sigs = sorted({lay.signature for lay in WorkloadSummary.from_model_ir(ir).layers})
    db = ProfileDB(compute=tuple(
        ComputeRecord(signature=s, device_type=d, dtype=dt, fwd_ms=5.0, bwd_ms=10.0,
                      samples=3)
        for s in sigs for d in ("A100-80GB", "V100-SXM2-32GB") for dt in ("fp32", "bf16")))
    db_path, path = tmp_path / "db.json", tmp_path / "plan.json"
    db_path.write_text(db.to_json())
    plan.save(path)  # planned without a DB
    result = runner.invoke(app, ["explain", str(path), "stage:0", "--profile", str(db_path)])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert plan.predictions is not None
    assert (f"(the plan file says {plan.predictions.iteration_time_ms:.3f} ms; it was "
            f"predicted without a profile DB, not with --profile's {db.fingerprint()})"
            ) in text


def test_a_run_of_per_stage_degrees_is_read(tmp_path: Path) -> None:
    """A run of a plan with per-stage degrees has a process per rank its stages list (4
    here), not the layout's dp x pp x tp (1 x 2 x 1): its own report was refused as another
    plan's."""
    plan, path, run = toy_hetero_plan(), tmp_path / "p.json", tmp_path / "run.json"

    def report(world: int) -> str:
        run.write_text(json.dumps({"measured": {"iteration_ms": 100.0}, "world_size": world,
                                   "plan_digest": plan_digest(plan)}))
        return str(run)

    assert "predicted vs measured" in _inspect(plan, path, "--run", report(4))
    result = runner.invoke(app, ["inspect", str(path), "--run", report(2)])
    assert result.exit_code == 2
    assert (f"{run}: world_size 2, but {path} runs on 4 ranks (V100-SXM2-32GB 2x1 | "
            "A100-80GB 2x1)") in " ".join(result.output.split())


def test_a_stale_prediction_within_a_rounding_step_is_told_apart(plan: Plan) -> None:
    """A stored time that differs from the re-prediction by less than 0.0005 ms is shown
    with the digits that tell them apart (it read "stored prediction X ms is stale: ...;
    re-predicted X ms", the same number twice)."""
    from hetplan.report.stale import check_prediction

    assert plan.predictions is not None
    now = plan.predictions.iteration_time_ms
    nudged = plan.model_copy(update={"predictions": plan.predictions.model_copy(
        update={"iteration_time_ms": now + 2e-6})})
    check = check_prediction(nudged)
    assert check.status == "stale" and check.predicted_ms == now
    assert (f"stored prediction {now + 2e-6:.6f} ms is stale" in check.note
            and f"re-predicted {now:.6f} ms" in check.note), check.note
    assert f"{now + 2e-6:.6f}" != f"{now:.6f}"


def test_diff_refuses_a_profile_neither_plan_was_predicted_with(plan: Plan,
                                                                tmp_path: Path) -> None:
    """``diff --profile DB`` where neither plan records a profile DB: the DB would re-check
    nothing (it was accepted and ignored), as ``inspect --profile`` without ``--trace``."""
    db_path = tmp_path / "db.json"
    db_path.write_text(json.dumps({"schema_version": 2, "machines": []}))
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    plan.save(a)
    _recomputed(plan).save(b)
    result = runner.invoke(app, ["diff", str(a), str(b), "--profile", str(db_path)])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert (f"--profile {db_path}: neither {a} nor {b} was predicted with a profile DB "
            "(cost_settings.profile_fingerprint is empty)") in text and "drop --profile" in text
    assert runner.invoke(app, ["diff", str(a), str(b)]).exit_code == 0


def test_out_of_memory_names_a_rank_that_does_not_fit(plan: Plan) -> None:
    """On mixed devices the rank with the most bytes may be a large one that fits: the
    out-of-memory warning names the peak of the ranks that do not (it named the plan's peak
    rank, "needs 70 GiB of 72 GiB usable (97%)", under "the plan does not fit")."""
    from hetplan.ir.cluster import ClusterSpec

    assert plan.predictions is not None and plan.cluster.spec is not None
    devices = ClusterSpec.model_validate(plan.cluster.spec).devices()
    big = next(r for r, d in enumerate(devices) if d.type == "A100-80GB")
    small = next(r for r, d in enumerate(devices) if d.type == "V100-SXM2-32GB")
    mem = [1 << 30] * len(devices)
    mem[big], mem[small] = 70 << 30, 31 << 30  # fits in 72 GiB usable; over 28.8 GiB
    edited = plan.model_copy(update={"predictions": plan.predictions.model_copy(
        update={"memory_per_rank_bytes": tuple(mem)})})
    report = build_report(edited)
    assert report["memory"]["peak"]["peak_rank"] == big
    assert report["memory"]["oom_ranks"] == [small]
    (warning,) = [w["message"] for w in report["warnings"] if w["kind"] == "out-of-memory"]
    assert f"1 rank(s) ({small}) need more than their usable memory; rank {small} needs " \
        "31.00 GiB of 28.80 GiB usable" in warning, warning


def test_a_plan_without_stages_is_inspected_and_diffed(tmp_path: Path) -> None:
    """A plan without a pipeline (pp=1) may leave its stages out (plan_checks rule 9), but
    `inspect` and `diff` re-checked its prediction against one stage per timed stage of the
    evaluation: internal error "zip() argument 2 is longer than argument 1"."""
    ir = ModelIR.load(GOLDEN / "inspect_small.workload.json")
    made = compile_plan(ir, "local-cpu", batch_size=8, dp=4)
    full, bare = tmp_path / "full.json", tmp_path / "bare.json"
    made.save(full)
    data = json.loads(full.read_text())
    data["stages"] = []
    bare.write_text(json.dumps(data))
    for argv in (["inspect", str(bare)], ["diff", str(full), str(bare)]):
        result = runner.invoke(app, argv)
        assert result.exit_code == 0, result.output


def test_simulate_words_its_breakdown_as_inspect_does(tmp_path: Path) -> None:
    """simulate left the compression time out of its breakdown (a compressed plan's parts did
    not add up to what inspect showed) and gave the bubble ratio as a fraction ('0.000')
    where inspect gives a percentage."""
    ir = ModelIR.load(GOLDEN / "inspect_small.workload.json")
    made = compile_plan(ir, "cpu-2x2-slow", batch_size=8, dp=4, compressors=("topk",))
    assert made.predictions is not None
    b = made.predictions.breakdown
    assert b.compression_ms > 0
    path = tmp_path / "plan.json"
    made.save(path)
    result = runner.invoke(app, ["simulate", str(path)])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert f"compression {b.compression_ms:.3f} ms" in text
    assert f"bubble ratio {made.predictions.bubble_ratio:.1%}" in text
