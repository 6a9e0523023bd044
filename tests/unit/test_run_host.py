"""What ``hetplan run`` may start on this host (``runtime/launch.py: host_problem``): a plan for
GPUs needs a CUDA device per process started here; a CPU plan at most 2 processes per core (at
least 4) unless ``--oversubscribe``; ``--dry-run`` skips the check. Only preflight calls and a
CLI run whose launcher is replaced by one that fails the test: nothing is ever started."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import hetplan
from hetplan.cli import app
from hetplan.errors import SpecError
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.cluster_presets import PRESET_SPECS
from hetplan.ir.plan import Plan
from hetplan.runtime import launch as launch_mod
from hetplan.runtime.launch import HostCapacity, host_problem, preflight, torchrun_command

LAPTOP = HostCapacity(cuda_devices=0, cpu_cores=2)


def _cpu(world: int) -> ClusterSpec:
    spec = copy.deepcopy(PRESET_SPECS["local-cpu"])
    spec["nodes"][0]["devices"] = [{"type": "cpu", "count": world}]
    return ClusterSpec.model_validate(spec)


@pytest.fixture(scope="module")
def gpu_plan() -> Plan:
    """mlp on 8 nodes x 8 A100s: world size 64."""
    return hetplan.compile("mlp", "a100-nvlink-8x8", batch_size=128, dp=64, pp=1, tp=1)


def _cmd(plan: Plan, *extra: str) -> list[str]:
    return torchrun_command(plan, "plan.json", model="mlp", torchrun_args=list(extra))


def test_a_gpu_plan_needs_a_cuda_device_per_local_process(gpu_plan: Plan) -> None:
    why = host_problem(gpu_plan, _cmd(gpu_plan), LAPTOP)
    assert why is not None
    for said in ("world size 64", "'a100-nvlink-8x8'", "A100", "start 64 process(es)",
                 "0 CUDA device(s) and 2 CPU core(s)", "--dry-run",
                 "--nnodes 8 --nproc-per-node 8", "--cluster local-cpu"):
        assert said in why, said
    with pytest.raises(SpecError, match="world size 64"):
        preflight(gpu_plan, _cmd(gpu_plan), host=LAPTOP)
    # a node of the cluster: 8 CUDA devices for its 8 processes of a multi-node launch
    node = _cmd(gpu_plan, "--nnodes", "8", "--rdzv-endpoint", "h:29500", "--rdzv-id", "j")
    assert host_problem(gpu_plan, node, HostCapacity(cuda_devices=8, cpu_cores=96)) is None
    assert "start 8 process(es)" in (host_problem(gpu_plan, node, LAPTOP) or "")
    # one machine with 64 GPUs could run it whole
    assert host_problem(gpu_plan, _cmd(gpu_plan), HostCapacity(64, 2)) is None


def test_a_cpu_plan_may_oversubscribe_up_to_a_limit() -> None:
    four = hetplan.compile("mlp", _cpu(4), batch_size=8, dp=4, pp=1, tp=1)
    assert host_problem(four, _cmd(four), LAPTOP) is None  # the tests' 4 ranks on 2 cores
    assert host_problem(four, _cmd(four), HostCapacity(0, 1)) is None  # at least 4
    many = hetplan.compile("mlp", _cpu(16), batch_size=16, dp=16, pp=1, tp=1)
    why = host_problem(many, _cmd(many), LAPTOP)
    assert why is not None and "16 CPU process(es)" in why and "more than 4" in why
    assert "--oversubscribe" in why and "--dry-run" in why
    assert host_problem(many, _cmd(many), LAPTOP, oversubscribe=True) is None
    assert host_problem(many, _cmd(many), HostCapacity(0, 8)) is None


def _plan_file(plan: Plan, tmp_path: Path) -> Path:
    path = tmp_path / "plan.json"
    plan.save(path)
    return path


def _never_launch(*_a: Any, **_k: Any) -> Any:
    raise AssertionError("hetplan run started a run the host cannot hold")


def test_cli_refuses_with_exit_2_and_dry_run_still_prints(
        gpu_plan: Plan, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch_mod, "launch", _never_launch)
    monkeypatch.setattr(HostCapacity, "detect", classmethod(lambda cls: LAPTOP))
    path = _plan_file(gpu_plan, tmp_path)
    res = CliRunner().invoke(app, ["run", str(path), "--model", "mlp"])
    assert res.exit_code == 2, res.output
    assert "world size 64" in res.output and "--dry-run" in res.output
    dry = CliRunner().invoke(app, ["run", str(path), "--model", "mlp", "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert "--nproc-per-node 64" in dry.output


@pytest.mark.parametrize(("extra", "said"), [
    (["--iterations", "3"], "unknown option '--iterations'"),
    (["--reprot", "r.json"], "did you mean --report?"),
    (["--max-restarts", "x"], "invalid int value: 'x'"),
    # was: "unknown option '--steps' ...; did you mean --steps?"
    (["--", "--nnodes", "1", "--steps", "3"],
     "--steps is an option of `hetplan run`, but it follows `--`"),
])
def test_an_option_neither_takes_is_refused_before_anything_starts(
        gpu_plan: Plan, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        extra: list[str], said: str) -> None:
    # extra options go to torchrun; one its parser does not take either fails here, exit 2,
    # not in every rank's launch
    monkeypatch.setattr(launch_mod, "launch", _never_launch)
    path = _plan_file(gpu_plan, tmp_path)
    res = CliRunner().invoke(app, ["run", str(path), "--model", "mlp", "--dry-run", *extra])
    assert res.exit_code == 2, res.output
    assert said in " ".join(res.output.split())
    if extra[0] == "--iterations":
        assert "did you mean --steps?" in " ".join(res.output.split())


@pytest.mark.parametrize("extra", [["--max-restarts", "-1"], ["--max_restarts=-2"]])
def test_a_negative_max_restarts_is_refused_before_anything_starts(
        gpu_plan: Plan, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        extra: list[str]) -> None:
    # torchrun's own parser takes it; the launcher read any value but 0 as "restarts
    # allowed" and left a failed run's ranks to a torchrun that never restarts them
    monkeypatch.setattr(launch_mod, "launch", _never_launch)
    path = _plan_file(gpu_plan, tmp_path)
    res = CliRunner().invoke(app, ["run", str(path), "--model", "mlp", "--dry-run", *extra])
    assert res.exit_code == 2, res.output
    said = " ".join(res.output.split())
    value = extra[-1].rpartition("=")[2]
    assert f"--max-restarts {value}: torchrun restarts the ranks at most N times" in said
    assert "give --max-restarts 0 (a failed rank fails the run) or a positive N" in said
    with pytest.raises(SpecError, match="--max-restarts -1"):
        preflight(gpu_plan, _cmd(gpu_plan, "--max-restarts", "-1"))


def test_torchrun_options_still_pass_through(gpu_plan: Plan, tmp_path: Path) -> None:
    path = _plan_file(gpu_plan, tmp_path)
    res = CliRunner().invoke(app, ["run", str(path), "--model", "mlp", "--dry-run",
                                   "--nproc_per_node=64", "--max-restarts", "2"])
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())
    assert "--nproc_per_node=64" in out and "--max-restarts 2" in out


def test_run_without_a_model_says_which_one_the_plan_was_made_for(tmp_path: Path) -> None:
    """`hetplan run plan.json` said 'give exactly one of --model NAME or --module ...'; the
    plan names its model, so the refusal now says which option to give."""
    plan = hetplan.compile("mlp", _cpu(4), batch_size=8, dp=4, pp=1, tp=1)
    with pytest.raises(SpecError, match="the zoo model 'mlp', so give --model mlp"):
        torchrun_command(plan, "plan.json")
    path = tmp_path / "plan.json"
    plan.model_copy(update={"model": plan.model.model_copy(update={"name": "MyNet"})}).save(path)
    res = CliRunner().invoke(app, ["run", str(path), "--dry-run"])
    assert res.exit_code == 2, res.output
    assert "'MyNet', not a zoo model, so give --module" in " ".join(res.output.split())


def test_a_run_with_a_report_says_how_to_compare_it(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The run ended on 'measured ... · predicted ... · report r.json' and left the user to
    find `inspect --run`; it now prints that command with this plan and report."""
    import json

    plan = hetplan.compile("mlp", _cpu(4), batch_size=8, dp=4, pp=1, tp=1)
    path = tmp_path / "plan.json"
    plan.save(path)
    report = tmp_path / "r.json"

    class Held:
        def abandon(self) -> None:
            pass

    def launched(*_a: Any, **_k: Any) -> launch_mod.RunOutcome:  # a run that wrote its report
        report.write_text(json.dumps({"measured": {"iteration_ms": 3.0}, "steps": 5,
                                      "predicted": {"iteration_ms": 2.0}}))
        return launch_mod.RunOutcome(code=0)

    monkeypatch.setattr(launch_mod, "prestart", lambda *_a, **_k: Held())
    monkeypatch.setattr(launch_mod, "launch", launched)
    monkeypatch.setattr(HostCapacity, "detect",
                        classmethod(lambda cls: HostCapacity(cuda_devices=0, cpu_cores=4)))
    res = CliRunner().invoke(app, ["run", str(path), "--model", "mlp", "--report",
                                   str(report)])
    assert res.exit_code == 0, res.output
    said = " ".join(res.output.split())
    # whose time it is: a pipeline's progress lines are another rank's
    assert ("measured 3.00 ms/iteration (rank 0's median of 5 timed step(s)) · predicted "
            "2.00 ms") in said
    assert f"side by side, per rank: hetplan inspect {path} --run {report}" in said
