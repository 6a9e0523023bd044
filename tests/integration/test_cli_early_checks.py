"""Options and paths are checked before anything is captured, planned or drawn, and the error
blames the option at fault; capture failures are user errors (exit 2), never "internal error".

"Before" is checked by replacing capture and compile with functions that fail the test if
they are called.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from hetplan.cli import app
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan import ClusterRef, Layout, ModelRef, Plan, WorkloadSummary

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
WORKLOAD = GOLDEN / "inspect_small.workload.json"


def run(*args: object) -> Result:
    return CliRunner().invoke(app, [str(a) for a in args])


def refused(result: Result, *expected: str) -> str:
    assert result.exit_code == 2, result.output
    assert "internal error" not in result.output and "Traceback" not in result.output
    flat = " ".join(result.output.split())
    for text in expected:
        assert text in flat, f"{text!r} not in:\n{result.output}"
    return flat


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Capturing or compiling fails the test: the command must stop before either."""
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("the command captured or planned before checking its options")

    monkeypatch.setattr("hetplan.optimizer.compile.compile", forbidden)
    monkeypatch.setattr("hetplan.ir.capture.capture", forbidden)


def test_plan_output_in_a_missing_directory_fails_before_planning(no_work: None,
                                                                  tmp_path: Path) -> None:
    out = tmp_path / "bad" / "dir" / "p.json"
    refused(run("plan", "mlp", "-c", "local-cpu", "-b", "8", "-o", out),
            f"-o/--output '{out}': the directory '{out.parent}' does not exist")
    assert not (tmp_path / "bad").exists()


def test_plan_output_that_is_a_directory_fails_before_planning(no_work: None,
                                                               tmp_path: Path) -> None:
    refused(run("plan", "mlp", "-c", "local-cpu", "-b", "8", "-o", tmp_path), "is a directory")


def test_unknown_schedule_fails_before_capture(no_work: None) -> None:
    flat = refused(run("plan", "mlp", "-c", "local-cpu", "-b", "8", "--schedule", "zigzag"),
                   "--schedule: unknown schedule 'zigzag'")
    assert "keys are case-sensitive" not in flat  # a file's hint, not an option's


def test_micro_batch_size_that_cannot_split_the_batch_is_blamed(no_work: None) -> None:
    flat = refused(run("plan", "mlp", "-c", "local-cpu", "-b", "8", "--micro-batch-size", "3"),
                   "micro_batch_size=3 does not divide batch_size=8")
    assert "dp=None" not in flat and "pinned" not in flat
    refused(run("plan", "mlp", "-c", "local-cpu", "-b", "8", "--dp", "3"),
            "dp=3 does not divide batch_size=8")
    refused(run("plan", "mlp", "-c", "local-cpu", "-b", "8", "--dp", "2",
                "--micro-batch-size", "3"),
            "micro_batch_size=3 does not divide the per-replica batch 4 (batch_size=8 / dp=2)")


def test_other_plan_options_fail_before_capture(no_work: None) -> None:
    refused(run("plan", "mlp", "-c", "local-cpu", "-b", "8", "--dtype", "fp33"),
            "--dtype 'fp33' is not a precision", "did you mean 'fp32'?")
    refused(run("plan", "mlp", "-c", "local-cpu", "-b", str(10**20)),
            "--batch-size/-b: Input should be less than or equal to 9007199254740992")
    refused(run("plan", "mlp", "-c", "local-cpu", "-b", "8", "--tp-gamma-max", "2"),
            "--tp-gamma-max:")
    refused(run("plan", "mlp", "-c", "local-cpu", "-b", "8", "--compress", "zip"),
            "--compress: unknown compressor 'zip'")
    refused(run("plan", "mlp", "-c", "local-cpu", "-b", "8", "--passes",
                "uniform-stages,ddp-buckets", "--compress", "dgc"),
            "--compress: given, but the pass pipeline has no 'espresso' pass")


@pytest.mark.parametrize(("flag", "note"), [
    ("--sparse", "schedule 'chimera': a stage's gradients are averaged over the 2·dp ranks"),
    ("--group-sync", "group sync off: schedule 'chimera'")])
def test_chimera_with_auto_passes_plans_and_the_pass_declines(flag: str, note: str) -> None:
    """``--sparse auto`` / ``--group-sync auto`` let the pass choose: under Chimera it
    declines with a note instead of the plan being refused (the forcing values are refused,
    above)."""
    got = run("plan", "gpt-test", "-c", "cpu-2x2", "-b", "8", "--pp", "2", "--schedule",
              "chimera", flag, "auto")
    assert got.exit_code == 0, got.output
    assert note in " ".join(got.output.split())


def test_chimera_with_tp_or_zero2_is_refused_before_capture(no_work: None) -> None:
    """Chimera runs tp=1 and ZeRO 0 or 1 (docs/decisions.md, "Chimera: what is priced"):
    the flag at fault and the fix, exit 2; --sparse and --group-sync name their pass."""
    plan = ("plan", "gpt-test", "-c", "local-cpu", "-b", "8", "--pp", "2", "--schedule",
            "chimera")
    refused(run(*plan, "--tp", "2"), "--tp 2 with --schedule chimera",
            "use --tp 1 or drop --tp, or another --schedule (1f1b)")
    for zero in ("2", "3"):
        refused(run(*plan, "--zero", zero), f"--zero {zero} with --schedule chimera",
                "use --zero 0 or 1 or drop --zero")
    refused(run(*plan, "--sparse", "zen"), "the 'zen' pass (--sparse) does not compose with "
            "schedule 'chimera'")
    refused(run(*plan, "--group-sync", "sdpipe"), "the 'sdpipe' pass (--group-sync) does not "
            "compose with schedule 'chimera'")

    pruning = Path(__file__).resolve().parents[2] / "examples" / "pruning.yaml"
    refused(run(*plan, "--dynamics", pruning), "--dynamics with --schedule chimera",
            "drop --dynamics")


def test_more_micro_batches_than_a_plan_may_have_is_explained() -> None:
    refused(run("plan", "--workload", WORKLOAD, "-c", "local-cpu", "-b", "1000000", "--dp",
                "4", "--micro-batch-size", "1"),
            "into at most 65,536 micro-batches per replica", "micro_batch_size=1 pinned")


def test_a_bad_cluster_fails_before_capture(no_work: None, tmp_path: Path) -> None:
    bad = tmp_path / "c.yaml"
    bad.write_text("name: x\nnodes: []\n", encoding="utf-8")
    refused(run("plan", "--workload", WORKLOAD, "-c", bad, "-b", "8"),
            f"{bad}: nodes: the list is empty")


def test_timeline_to_a_missing_directory_creates_nothing(tmp_path: Path) -> None:
    out = tmp_path / "nonexistent" / "x.png"
    refused(run("timeline", tmp_path / "no-plan.json", "-o", out),
            f"the directory '{out.parent}' does not exist")
    assert not out.parent.exists()
    refused(run("timeline", tmp_path / "no-plan.json", "-o", tmp_path / "x.svg"),
            "unknown suffix '.svg'")


def test_ir_output_checked_before_capture(no_work: None, tmp_path: Path) -> None:
    refused(run("ir", "mlp", "-o", tmp_path / "missing" / "w.json"), "does not exist")


def test_simulate_without_a_cluster_names_the_field(tmp_path: Path) -> None:
    spec = ClusterSpec.from_preset("local-cpu")
    plan = Plan(model=ModelRef(name="m", fingerprint="f", num_params=1,
                               workload=WorkloadSummary()),
                cluster=ClusterRef.from_cluster(spec, embed=False),
                layout=Layout(dp=4))
    path = tmp_path / "p.json"
    plan.save(path)
    refused(run("simulate", path), f"{path}: cluster.spec: the plan does not embed its cluster",
            "--cluster")


def test_validate_refuses_stages_that_share_ranks(tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    assert run("plan", "--workload", WORKLOAD, "-c", "mixed-generations", "-b", "64", "--dp",
               "8", "--pp", "2", "--tp", "2", "-o", good).exit_code == 0
    assert run("validate", good).exit_code == 0
    data = json.loads(good.read_text(encoding="utf-8"))
    data["stages"][1]["ranks"] = data["stages"][0]["ranks"]
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    refused(run("validate", path), f"{path}: stages[1].ranks:", "shares ranks with stage(s) [0]")


# -- capture errors through the CLI -------------------------------------------------------------
MODULES = """
import torch
from torch import nn


class Reads(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) * x.sum().item()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = Reads()
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.gate(x))


def net():
    return Net(), (torch.randn(2, 4),)


def raises():
    raise RuntimeError("checkpoint missing")


def needs(path):
    return net()
"""


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                request: pytest.FixtureRequest) -> str:
    name = f"user_{request.node.name}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(MODULES), encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    return name


def test_plan_opaque_gets_past_a_module_capture_cannot_follow(user_module: str) -> None:
    refused(run("plan", "--module", f"{user_module}:net", "-c", "local-cpu", "-b", "8"),
            "module 'gate' (Reads) failed", "reads a tensor's value with .item()",
            "--opaque gate")
    ok = run("plan", "--module", f"{user_module}:net", "-c", "local-cpu", "-b", "8",
             "--opaque", "gate")
    assert ok.exit_code == 0, ok.output


def test_plan_opaque_with_a_zoo_model() -> None:
    refused(run("plan", "data-dependent", "-c", "local-cpu", "-b", "8"), "--opaque gate")
    ok = run("plan", "data-dependent", "-c", "local-cpu", "-b", "8", "--opaque", "gate")
    assert ok.exit_code == 0, ok.output


@pytest.mark.parametrize("factory, expected", [
    ("raises", "the factory raised RuntimeError: checkpoint missing"),
    ("needs", "the factory takes argument(s) path"),
])
def test_factory_failures_are_user_errors(user_module: str, factory: str,
                                          expected: str) -> None:
    refused(run("ir", "--module", f"{user_module}:{factory}"), expected)


def test_a_malformed_run_report_names_its_field(tmp_path: Path) -> None:
    plan = tmp_path / "p.json"
    assert run("plan", "--workload", WORKLOAD, "-c", "local-cpu", "-b", "8", "-o",
               plan).exit_code == 0
    for value in ('"x"', "true", "-1"):
        report = tmp_path / "r.json"
        report.write_text('{"measured": {"iteration_ms": ' + value + "}}", encoding="utf-8")
        refused(run("inspect", plan, "--run", report),
                f"{report}: measured.iteration_ms: expected milliseconds")


def test_a_run_report_naming_no_rank_of_the_run_as_the_busiest_is_refused(
        tmp_path: Path) -> None:
    plan = tmp_path / "p.json"
    assert run("plan", "--workload", WORKLOAD, "-c", "local-cpu", "-b", "8", "-o",
               plan).exit_code == 0
    for value in ('"x"', "true", "-1", "4"):
        report = tmp_path / "r.json"
        report.write_text('{"world_size": 4, "measured": {"iteration_ms": 3.0, '
                          '"busiest_rank": ' + value + "}}", encoding="utf-8")
        refused(run("inspect", plan, "--run", report),
                f"{report}: measured.busiest_rank: expected a rank of the run (an integer "
                "in 0..3)")


def test_group_sync_with_a_pinned_zero_stage_is_refused_before_capture(no_work: None) -> None:
    refused(run("plan", "tiny-gpt2", "--cluster", "cpu-2x2", "-b", "8", "--group-sync",
                "sdpipe", "--zero", "1"), "--group-sync sdpipe", "drop --zero 1")


def test_checkpointing_and_group_sync_options_both_reach_the_pipeline(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    res = run("plan", "tiny-gpt2", "--cluster", "cpu-2x2", "-b", "8", "--checkpoint",
              "gemini", "--group-sync", "sdpipe", "-o", out)
    assert res.exit_code == 0, res.output
    plan = Plan.from_json(out.read_text())
    assert [e.name for e in plan.pass_log][-2:] == ["gemini", "sdpipe"]
    assert plan.checkpointing is not None and plan.group_sync is not None
