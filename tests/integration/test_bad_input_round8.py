"""A new user's mistakes, round 8 (`docs/decisions/bad-input-round8.md`): the run trace
(`hetplan run --trace`, `inspect --trace/--profile`), run reports beside a plan
(`inspect --run`), `hetplan profile`'s options and profiles given to `--profile`.

Every test here failed before its fix: an internal error for an edited trace or report, a
run that wrote its trace over the plan, an option silently ignored, a report or a profile
of another plan or model accepted as this one's.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hetplan.cost_models.profile_db import ProfileDB
from hetplan.errors import SpecError
from hetplan.ir.plan import load_plan
from hetplan.report.trace_compare import load_trace, plan_digest
from test_bad_input_round7 import WORKLOAD, refused, run  # the rounds share their helpers


def _write(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data))
    return path


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two plans of one workload on local-cpu: pp=2 (4 ranks) and pp=1 (4 ranks)."""
    d = tmp_path_factory.mktemp("plans")
    out = {}
    for name, pp in (("pp2", "2"), ("pp1", "1")):
        out[name] = d / f"{name}.json"
        result = run("plan", "--workload", WORKLOAD, "-c", "local-cpu", "-b", "8", "--pp", pp,
                     "--no-progress", "-o", out[name])
        assert result.exit_code == 0, result.output
    return out


def _report(plan: Path) -> dict[str, Any]:
    """A run report as `hetplan run --report` writes it (runtime/worker.py)."""
    p = load_plan(plan)
    rank = {"rank": 0, "compute_ms": 1.0, "bubble_ms": 0.5, "exposed_comm_ms": 0.2,
            "optimizer_ms": 0.1, "cpu_ms": 2.0, "losses": [5.0, 4.9]}
    return {"plan_digest": plan_digest(p), "world_size": 4, "steps": 2, "final_loss": 4.9,
            "measured": {"iteration_ms": 3.0, "compute_ms": 1.0, "bubble_ms": 0.5,
                         "exposed_comm_ms": 0.2, "optimizer_ms": 0.1,
                         "per_iteration_ms": [3.0, 3.0]},
            "per_rank": [dict(rank, rank=r) for r in range(4)], "loss_per_step": [5.0, 4.9],
            "rebalanced_at": [], "rebalance_ms": [], "cpu_sched": "normal",
            "predicted": {"iteration_ms": 2.0}}


def _trace(plan: Path) -> dict[str, Any]:
    """A trace as `hetplan run --trace` writes it (runtime/trace.chrome_trace), one rank."""
    p = load_plan(plan)
    ev = {"ph": "X", "pid": 0, "tid": 0, "name": "F0 s0", "cat": "compute", "ts": 10.0,
          "dur": 5.0, "args": {"kind": "F", "microbatch": 0, "stage": 0}}
    return {"traceEvents": [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0,
                             "args": {"name": "rank 0"}}, ev],
            "otherData": {"hetplan": {"plan_digest": plan_digest(p), "model": p.model.name,
                                      "step": 4, "world_size": 4,
                                      "layout": {"dp": 2, "pp": 2, "tp": 1}}}}


# -- inspect --run: an edited report, a report of another plan -----------------------------
def test_the_report_fixture_is_read(plans: dict[str, Path], tmp_path: Path) -> None:
    result = run("inspect", plans["pp2"], "--run", _write(tmp_path / "r.json",
                                                          _report(plans["pp2"])))
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(("edit", "expected"), [
    # was: internal error: TypeError (a rank's time formatted with :.3f)
    (lambda r: r["per_rank"][0].update(compute_ms=None),
     "per_rank[0].compute_ms: expected milliseconds, got null"),
    (lambda r: r["per_rank"][0].update(compute_ms="12"),
     "per_rank[0].compute_ms: expected a number >= 0, got '12'"),
    (lambda r: r.update(loss_per_step=["a"]), "loss_per_step: expected a list of numbers"),
    # were: accepted
    (lambda r: r["per_rank"][0].update(rank=99),
     "per_rank[0].rank: expected a rank in 0..3 (world_size 4), got 99"),
    (lambda r: r.update(per_rank={"0": {}}), "per_rank: expected a list"),
    (lambda r: r.update(cpu_sched="idle"), "cpu_sched: expected one of normal, batch"),
    # was: accepted, the table titled "(-5 iterations, 4 ranks)"
    (lambda r: r.update(steps=-5), "steps: expected the number of timed iterations (an "
                                   "integer >= 1), got -5"),
    (lambda r: r.update(steps="2"), "steps: expected the number of timed iterations"),
])
def test_an_edited_run_report_is_refused_by_field(plans: dict[str, Path], tmp_path: Path,
                                                   edit: Any, expected: str) -> None:
    report = _report(plans["pp2"])
    edit(report)
    path = _write(tmp_path / "r.json", report)
    refused(run("inspect", plans["pp2"], "--run", path), f"{path}: {expected}",
            "write the report with `hetplan run PLAN --report FILE`")


def test_a_run_report_of_another_plan_is_refused(plans: dict[str, Path],
                                                 tmp_path: Path) -> None:
    """Both plans run on 4 ranks: only the digest the report now carries tells them apart."""
    path = _write(tmp_path / "r.json", _report(plans["pp2"]))
    refused(run("inspect", plans["pp1"], "--run", path),
            f"{path}: the run report is of another plan", f"not {plans['pp1']}")


def test_timeline_checks_its_run_report_as_inspect_does(plans: dict[str, Path],
                                                        tmp_path: Path) -> None:
    """`timeline --run-report` drew another plan's measured time beside this plan's
    prediction (exit 0), and an edited report's error named neither the file nor the field."""
    out = tmp_path / "t.html"
    path = _write(tmp_path / "r.json", _report(plans["pp2"]))
    refused(run("timeline", plans["pp1"], "-o", out, "--run-report", path),
            f"{path}: the run report is of another plan", f"not {plans['pp1']}")
    report = _report(plans["pp2"])
    report["measured"]["iteration_ms"] = "fast"
    path = _write(tmp_path / "edited.json", report)
    refused(run("timeline", plans["pp2"], "-o", out, "--run-report", path),
            f"{path}: measured.iteration_ms: expected milliseconds")
    assert not out.exists()
    result = run("timeline", plans["pp2"], "-o", out, "--run-report",
                 _write(tmp_path / "ok.json", _report(plans["pp2"])))
    assert result.exit_code == 0 and out.exists(), result.output


def test_an_older_report_of_another_world_size_is_refused(plans: dict[str, Path],
                                                          tmp_path: Path) -> None:
    report = _report(plans["pp2"])
    del report["plan_digest"]  # written before reports carried it
    report.update(world_size=8, per_rank=[])
    path = _write(tmp_path / "r.json", report)
    refused(run("inspect", plans["pp2"], "--run", path),
            f"{path}: world_size 8, but {plans['pp2']} runs on 4 ranks (dp=2 pp=2 tp=1)")


def test_the_worker_writes_the_plan_digest_into_its_report(plans: dict[str, Path],
                                                           tmp_path: Path) -> None:
    from hetplan.runtime.worker import _write_report

    plan = load_plan(plans["pp2"])
    step = SimpleNamespace(iteration_s=0.003, compute_s=0.001, sync_wait_s=0.0,
                           optimizer_s=0.0)
    ranks = [{"rank": 0, "compute_ms": 1.0, "bubble_ms": 0.0, "losses": [1.0]}]
    out = tmp_path / "r.json"
    _write_report(str(out), plan, [step], 1.0, ranks,
                  SimpleNamespace(rebalanced_at=[], rebalance_s=[]))
    assert json.loads(out.read_text())["plan_digest"] == plan_digest(plan)


def test_the_report_of_a_pipeline_takes_compute_and_bubble_from_its_busiest_rank(
        plans: dict[str, Path], tmp_path: Path) -> None:
    from hetplan.runtime.worker import _write_report

    plan = load_plan(plans["pp2"])
    step = SimpleNamespace(iteration_s=0.009, compute_s=0.002, sync_wait_s=0.0,
                           optimizer_s=0.001)
    # ranks 1 and 2 tie on compute: the lower one is named; rank 3 waits longest
    ranks = [{"rank": 0, "compute_ms": 2.0, "bubble_ms": 6.0, "losses": []},
             {"rank": 1, "compute_ms": 5.0, "bubble_ms": 3.0, "losses": [1.0]},
             {"rank": 2, "compute_ms": 5.0, "bubble_ms": 2.5, "losses": []},
             {"rank": 3, "compute_ms": 1.0, "bubble_ms": 7.0, "losses": [1.0]}]
    out = tmp_path / "r.json"
    _write_report(str(out), plan, [step], 1.0, ranks,
                  SimpleNamespace(rebalanced_at=[], rebalance_s=[]))
    measured = json.loads(out.read_text())["measured"]
    assert (measured["busiest_rank"], measured["compute_ms"], measured["bubble_ms"]) == (
        1, 5.0, 3.0)
    assert measured["iteration_ms"] == 9.0 and measured["optimizer_ms"] == 1.0  # rank 0's


# -- inspect --trace: an edited trace, another plan's, a trace where another kind is read --
@pytest.mark.parametrize(("edit", "field"), [
    (lambda e: e.pop("pid"), "traceEvents[1].pid: expected the rank"),  # was: KeyError: 'pid'
    (lambda e: e.pop("args"), "traceEvents[1].args: expected a mapping"),  # KeyError: 'args'
    (lambda e: e.pop("cat"), "traceEvents[1].cat: expected a string"),  # KeyError: 'cat'
    (lambda e: e.update(pid="rank0"), "traceEvents[1].pid"),  # ValueError: invalid literal
    (lambda e: e["args"].pop("microbatch"), "traceEvents[1].args.microbatch"),  # KeyError
])
def test_an_edited_trace_is_refused_by_field(plans: dict[str, Path], tmp_path: Path,
                                             edit: Any, field: str) -> None:
    trace = _trace(plans["pp2"])
    edit(trace["traceEvents"][1])
    with pytest.raises(SpecError, match="write the trace again"):
        load_trace(copy.deepcopy(trace), "t.json")
    path = _write(tmp_path / "t.json", trace)
    refused(run("inspect", plans["pp2"], "--trace", path), f"{path}: {field}")


@pytest.mark.parametrize("other", ["x", -1, True])
def test_a_trace_whose_other_data_is_not_a_mapping_is_refused(plans: dict[str, Path],
                                                               tmp_path: Path,
                                                               other: object) -> None:
    """Was: internal error (AttributeError: 'str' object has no attribute 'get')."""
    trace = _trace(plans["pp2"])
    trace["otherData"] = other
    path = _write(tmp_path / "t.json", trace)
    for argv in (("validate", path), ("inspect", plans["pp2"], "--trace", path)):
        refused(run(*argv), f"{path}: otherData.hetplan is missing")


def test_a_trace_of_another_plan_names_both_files(plans: dict[str, Path],
                                                  tmp_path: Path) -> None:
    path = _write(tmp_path / "t.json", _trace(plans["pp2"]))
    refused(run("inspect", plans["pp1"], "--trace", path),  # was: no file named
            f"{path}: recorded for another plan", "dp=2 pp=2 tp=1", f"not {plans['pp1']}")


def test_a_trace_is_named_where_another_kind_is_read(plans: dict[str, Path],
                                                     tmp_path: Path) -> None:
    path = _write(tmp_path / "t.json", _trace(plans["pp2"]))
    kind = "this is a run's trace (written by `hetplan run --trace`)"
    # was: 'not a run report (no measured.iteration_ms)'
    refused(run("inspect", plans["pp2"], "--run", path), kind, "not a run report")
    # was: "missing 'schema_version'; a hetplan plan starts with ..."
    refused(run("simulate", path), kind, "not a plan")
    # was: judged as a cluster spec ('missing required key nodes')
    result = run("validate", path)
    assert result.exit_code == 0 and "valid trace" in result.output, result.output


def test_inspect_profile_without_a_trace_is_refused(plans: dict[str, Path],
                                                    tmp_path: Path) -> None:
    db = _write(tmp_path / "db.json", {"schema_version": 2, "machines": []})
    refused(run("inspect", plans["pp2"], "--profile", db),  # was: ignored
            "--profile re-predicts the plan beside a run's --trace; give --trace FILE too")


# -- hetplan run --trace ------------------------------------------------------------------
def test_run_trace_onto_the_plan_is_refused(plans: dict[str, Path], tmp_path: Path) -> None:
    """A real run wrote its trace over the plan it ran (exit 0)."""
    plan = tmp_path / "p.json"
    plan.write_text(plans["pp2"].read_text())
    refused(run("run", plan, "--model", "gpt-test", "--trace", plan, "--dry-run"),
            f"--trace '{plan}' is a plan (written by `hetplan plan`); writing the trace there "
            "would overwrite it")


def test_run_trace_and_report_on_one_path_is_refused(plans: dict[str, Path],
                                                     tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    refused(run("run", plans["pp2"], "--model", "gpt-test", "--trace", out, "--report", out,
                "--dry-run"), "--trace and --report are both")


def test_trace_step_without_trace_is_refused(plans: dict[str, Path]) -> None:
    refused(run("run", plans["pp2"], "--model", "gpt-test", "--trace-step", "3", "--dry-run"),
            "--trace-step 3 chooses the step --trace records; give --trace FILE too")


# -- hetplan profile options -------------------------------------------------------------
def test_profile_what_as_a_comma_list_says_how_to_give_several(tmp_path: Path) -> None:
    refused(run("profile", "--what", "collectives,step", "-o", tmp_path / "db.json"),
            "give one per --what: --what collectives --what step")
    refused(run("profile", "--what", "collective", "-o", tmp_path / "db.json"),
            "did you mean 'collectives'?")


def test_profile_collectives_on_one_process_is_refused(tmp_path: Path) -> None:
    """Was: exit 0 with an empty profile DB ('collectives skipped: world_size=1')."""
    out = tmp_path / "db.json"
    refused(run("profile", "--what", "collectives", "-n", "1", "-o", out),
            "--what collectives times collectives between processes", "give -n 2 or more")
    assert not out.exists()


def test_profile_collectives_filed_under_another_link_on_cpu_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Was: exit 0, loopback times filed as NVLink records (priced every NVLink link of a
    cluster planned with the profile)."""
    monkeypatch.delenv("HETPLAN_EMULATE_BW", raising=False)
    out = tmp_path / "db.json"
    refused(run("profile", "--what", "collectives", "-n", "2", "--link-kind", "nvlink",
                "-o", out), "--link-kind 'nvlink'", "over loopback", "HETPLAN_EMULATE_BW")
    assert not out.exists()


def test_profile_output_that_cannot_be_merged_into_says_so(tmp_path: Path) -> None:
    out = tmp_path / "db.json"
    out.write_text("")
    refused(run("profile", "--what", "step", "-o", out),
            "an existing output is merged into: delete it or choose another path")


# -- a profile of another model ----------------------------------------------------------
def _foreign_profile(tmp_path: Path) -> Path:
    rec = {"signature": "0123456789ab", "device_type": "cpu", "dtype": "fp32",
           "batch_size": 1, "fwd_ms": 1.0, "bwd_ms": 2.0, "samples": 5, "label": "Linear other.fc"}
    return _write(tmp_path / "other.json", {"schema_version": 2, "machines": [],
                                            "compute": [rec], "collectives": []})


def test_a_profile_of_another_model_is_refused(plans: dict[str, Path],
                                               tmp_path: Path) -> None:
    """Was: accepted, every layer priced by the analytic estimates (plan, simulate, export,
    inspect --trace)."""
    db = _foreign_profile(tmp_path)
    expected = (f"{db}: none of its 1 layer record(s) (Linear other.fc) is a layer of model",
                "profiled on another model or at another --seq")
    refused(run("plan", "--workload", WORKLOAD, "-c", "local-cpu", "-b", "8", "--no-progress",
                "--profile", db, "-o", tmp_path / "p.json"), *expected)
    refused(run("simulate", plans["pp2"], "--profile", db), *expected)
    refused(run("export", plans["pp2"], "--to", "megatron", "--profile", db), *expected)


def test_a_profile_without_layer_records_or_with_one_of_the_model_passes(
        plans: dict[str, Path]) -> None:
    from hetplan.cost_models.predict import check_profile_fits

    plan = load_plan(plans["pp2"])
    workload = plan.model.workload
    assert workload is not None
    check_profile_fits(ProfileDB(), workload, "m")  # collectives only: analytic compute
    sig = workload.layers[0].signature
    db = ProfileDB.from_dict({"schema_version": 2, "compute": [
        {"signature": sig, "device_type": "cpu", "dtype": "fp32", "batch_size": 1,
         "fwd_ms": 1.0, "bwd_ms": 1.0, "samples": 5},
        {"signature": "0123456789ab", "device_type": "cpu", "dtype": "fp32", "batch_size": 1,
         "fwd_ms": 1.0, "bwd_ms": 1.0, "samples": 5}]}, where="db")
    check_profile_fits(db, workload, "m")
