"""A new user's mistakes, round 7 (`docs/decisions/bad-input-round7.md`): each case that
gave an internal error, a misleading message or a plan file the other commands refuse.

Every test here failed before its fix: a plan that `hetplan plan` wrote and `validate`
refused, an "internal error" for an option typed wrong, a refusal that blamed the batch
size for a pinned degree the cluster cannot have, or minutes of measuring before an output
file that can never be written was refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from hetplan.cli import app
from hetplan.ir.plan import Plan, load_plan

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
WORKLOAD = GOLDEN / "inspect_small.workload.json"


def run(*args: object) -> Result:
    return CliRunner().invoke(app, [str(a) for a in args])


def refused(result: Result, *expected: str) -> str:
    """The command refused with exit code 2, no traceback, and every expected text."""
    assert result.exit_code == 2, result.output
    assert "internal error" not in result.output and "Traceback" not in result.output
    flat = " ".join(result.output.split())
    for text in expected:
        assert text in flat, f"{text!r} not in:\n{result.output}"
    return flat


def _plan(tmp_path: Path, *options: object) -> Result:
    return run("plan", "--workload", WORKLOAD, "--no-progress", *options)


# -- hetplan plan writes only what every other command reads -------------------------------
def test_interleaved_schedule_without_a_pipeline_writes_a_plan_that_loads(
        tmp_path: Path) -> None:
    """`--schedule interleaved-1f1b` on local-cpu: the search picks pp=1, which has no chunks
    to interleave. The plan was written as interleaved 1F1B with one chunk, which `validate`,
    `inspect`, `simulate` and `run` all refuse; it is now written as 1F1B (as Chimera is)."""
    out = tmp_path / "p.json"
    result = _plan(tmp_path, "-c", "local-cpu", "-b", "8", "--schedule", "interleaved-1f1b",
                   "--pp", "1", "-o", out)
    assert result.exit_code == 0, result.output
    plan = load_plan(out)  # the one validator, a complete plan required
    assert plan.layout is not None and plan.layout.pp == 1
    assert plan.layout.schedule == "1f1b"
    assert run("validate", out).exit_code == 0


def test_virtual_stages_with_no_pipeline_is_refused(tmp_path: Path) -> None:
    refused(_plan(tmp_path, "-c", "local-cpu", "-b", "8", "--schedule", "interleaved-1f1b",
                  "--virtual-stages", "2", "--pp", "1"),
            "--virtual-stages 2", "--pp 1 is pinned", "pin --pp 2 or more")


def test_a_compiled_plan_the_validator_refuses_is_never_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the planner gets wrong, `hetplan plan` does not leave a file that every
    later command refuses: it checks the plan as `load_plan` will, before writing."""
    import hetplan.optimizer.compile as compile_module

    real = compile_module.compile

    def broken(*args: object, **kwargs: object) -> Plan:
        plan = real(*args, **kwargs)  # type: ignore[arg-type]
        assert plan.layout is not None
        layout = plan.layout.model_copy(update={"schedule": "interleaved-1f1b"})
        return plan.model_copy(update={"layout": layout})  # not validated: a planner bug

    monkeypatch.setattr(compile_module, "compile", broken)
    out = tmp_path / "p.json"
    result = _plan(tmp_path, "-c", "local-cpu", "-b", "8", "--pp", "1", "-o", out)
    assert result.exit_code == 1, result.output
    assert "fails the plan validator" in result.output
    assert "layout.virtual_stages" in result.output
    assert not out.exists()


def test_a_plan_the_runtime_refuses_is_flagged_when_it_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan `hetplan run` would refuse (its preflight, ``runtime.composition.refusals``) is
    written unchanged and says so at once, naming the part and the fix, instead of at
    `hetplan run`. The planner's own choices no longer pair strategies the runtime refuses
    (`--schedule chimera` was the last, and runs now:
    tests/integration/test_planner_runtime_agreement.py and tests/dist/test_chimera_runtime.py),
    so the refusal is injected here; the check itself is what is tested."""
    import hetplan.runtime.composition as composition

    monkeypatch.setattr(composition, "refusals",
                        lambda plan: ["layout.schedule: refused; re-plan with --schedule 1f1b"])
    out = tmp_path / "p.json"
    result = _plan(tmp_path, "-c", "local-cpu", "-b", "8", "--pp", "2", "-o", out)
    assert result.exit_code == 0, result.output
    flat = " ".join(result.output.split())
    assert "warning: `hetplan run` refuses this plan: layout.schedule" in flat
    assert "re-plan with --schedule 1f1b" in flat
    assert load_plan(out).layout.pp == 2  # type: ignore[union-attr]


# -- a pinned degree the cluster or the model cannot have is named --------------------------
def test_pinned_tp_that_does_not_fit_the_nodes_is_named() -> None:
    """Was: 'no layout ... divides the global batch ...: choose a batch size divisible by a
    data-parallel degree', which sent the user to the wrong option."""
    flat = refused(_plan(Path(), "-c", "a100-nvlink-8x8", "-b", "64", "--tp", "3"),
                   "tp=3 does not divide the 64 devices", "tp may be 1, 2, 4, 8")
    assert "batch size" not in flat


def test_pinned_pp_beyond_the_layers_is_named() -> None:
    refused(_plan(Path(), "-c", "mixed-generations", "-b", "64", "--pp", "16"),
            "pp=16: more pipeline stages than the model's 8 layers; use pp <= 8")


def test_pinned_degrees_whose_product_exceeds_the_cluster() -> None:
    refused(_plan(Path(), "-c", "mixed-generations", "-b", "64", "--pp", "8", "--dp", "8"),
            "dp=8 x pp=8 = 64 ranks does not divide the 32 devices")


# -- hetplan profile refuses before it measures ------------------------------------------
@pytest.fixture
def no_measuring(monkeypatch: pytest.MonkeyPatch) -> None:
    """Measuring anything fails the test: the command must refuse first."""
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("profile measured before checking its options")

    for name in ("profile_compressors", "profile_layers", "profile_collectives",
                 "profile_optimizer_steps", "run_local_ranks"):
        monkeypatch.setattr(f"hetplan.profiling.{name}", forbidden, raising=False)


def test_profile_unknown_measurement_is_a_user_error(no_measuring: None,
                                                     tmp_path: Path) -> None:
    """Was: 'internal error: ValueError: unknown measurement(s) ['gpus']'."""
    refused(run("profile", "--what", "gpus", "-o", tmp_path / "db.json"),
            "--what: unknown measurement(s) ['gpus']", "choose from")


@pytest.mark.parametrize("option", ["-n", "--layer-processes", "--batch-size"])
def test_profile_counts_below_one_are_refused_first(no_measuring: None, tmp_path: Path,
                                                    option: str) -> None:
    """Was (-n 0): 18 s of layer and compressor measurements, then 'internal error:
    ValueError: processes must be >= 1, got 0'."""
    refused(run("profile", "--what", "compressors", option, "0", "-o", tmp_path / "db.json"),
            "must be at least 1, got 0")


@pytest.mark.parametrize(("option", "what"), [("-n", "collectives"),
                                              ("--layer-processes", "compressors")])
def test_profile_more_processes_than_the_host_takes_are_refused_first(
        no_measuring: None, tmp_path: Path, option: str, what: str) -> None:
    """Was (-n 1000 on 2 cores): a thousand gloo processes started, the load average past
    150, and no end in two minutes; `hetplan run` refuses such a count without
    --oversubscribe."""
    refused(run("profile", "--what", what, option, "1000", "-o", tmp_path / "db.json"),
            f"{option} 1000: starts 1000 CPU processes on this host", "give", "or less")


def test_profile_output_that_is_not_a_profile_db_is_refused_first(no_measuring: None,
                                                                  tmp_path: Path) -> None:
    """The output is merged into when it exists; a file that is not a profile DB was refused
    only after every measurement had run."""
    out = tmp_path / "plan.json"
    out.write_text(json.dumps({"a": 1}))
    refused(run("profile", "--what", "compressors", "-o", out),
            str(out), "missing 'schema_version'")
    assert json.loads(out.read_text()) == {"a": 1}


# -- a file of another kind is named for what it is ------------------------------------------
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CLUSTER_YAML = EXAMPLES / "clusters" / "cpu-2x2.yaml"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One file of each kind: a plan, a profile DB, a workload, a cluster spec (YAML)."""
    d = tmp_path_factory.mktemp("kinds")
    plan = d / "p.json"
    result = run("plan", "--workload", WORKLOAD, "-c", "local-cpu", "-b", "8", "--no-progress",
                 "-o", plan)
    assert result.exit_code == 0, result.output
    profile = d / "db.json"
    profile.write_text(json.dumps({"schema_version": 2, "machines": []}))
    return {"plan": plan, "profile DB": profile, "workload": WORKLOAD, "cluster": CLUSTER_YAML}


@pytest.mark.parametrize(("command", "given", "expected"), [
    # was: 'written by a newer hetplan (schema_version 2) ...; upgrade hetplan'
    (("inspect", "{f}"), "profile DB", "this is a profile DB (written by `hetplan profile`), "
     "not a plan"),
    # was: 'not valid JSON: Expecting value at line 1, column 1; re-run `hetplan plan`'
    (("simulate", "{f}"), "cluster", "this is a cluster spec, not a plan"),
    (("inspect", "{f}"), "workload", "this is a workload (written by `hetplan ir MODEL -o "
     "FILE`), not a plan"),
    # was: 'profile DB schema_version 1; ... re-run `hetplan profile` (version 1 keyed ...)'
    (("plan", "--workload", str(WORKLOAD), "-c", "local-cpu", "-b", "8", "--profile", "{f}"),
     "plan", "this is a plan (written by `hetplan plan`), not a profile DB"),
    # was: eight 'missing required key' and 'unknown key' lines
    (("plan", "--workload", "{f}", "-c", "local-cpu", "-b", "8"), "plan",
     "this is a plan (written by `hetplan plan`), not a workload"),
    (("plan", "--workload", str(WORKLOAD), "-c", "{f}", "-b", "8"), "plan",
     "this is a plan (written by `hetplan plan`), not a cluster spec; pass a preset name"),
    (("plan", "--workload", str(WORKLOAD), "-c", "local-cpu", "-b", "8", "--dynamics", "{f}"),
     "profile DB", "not a dynamics file; pass a file like examples/pruning.yaml"),
])
def test_a_file_of_another_kind_is_named(files: dict[str, Path], command: tuple[str, ...],
                                         given: str, expected: str) -> None:
    path = files[given]
    flat = refused(run(*(part.format(f=path) for part in command)), str(path), expected)
    assert "missing required key" not in flat and "schema_version" not in flat


@pytest.mark.parametrize(("path", "said"), [
    ("profile DB", "is a valid profile DB"),
    (EXAMPLES / "pruning.yaml", "is a valid dynamics file"),
])
def test_validate_reads_every_kind_of_file(files: dict[str, Path], path: str | Path,
                                           said: str) -> None:
    """`validate` took a profile DB or a dynamics file for a cluster spec and refused it."""
    path = files.get(str(path), Path(path))
    result = run("validate", path)
    assert result.exit_code == 0, result.output
    assert said in result.output


# -- options of ir and profile, and a model given as a path -------------------------------
@pytest.mark.parametrize("argv", [("ir", "tiny-gpt2", "--batch", "0"),
                                  ("ir", "tiny-gpt2", "--seq", "-4"),
                                  ("profile", "tiny-gpt2", "--seq", "0")])
def test_count_options_below_one_are_refused_by_their_flag(
        argv: tuple[str, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    """Was (ir --batch 0): "example_inputs('tiny-gpt2'): batch must be >= 1, got 0", after
    importing the model, naming no option."""
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("the command built the model before checking its options")

    monkeypatch.setattr("hetplan.cli.load_model_ir", forbidden)
    monkeypatch.setattr("hetplan.profiling.run_profile", forbidden)
    flag = argv[2]
    refused(run(*argv), f"{flag} must be at least 1, got {argv[3]}")


def test_a_model_given_as_a_path_is_pointed_to_module_and_workload() -> None:
    refused(run("plan", "./mymodel.py", "-c", "local-cpu", "-b", "8"),
            "unknown model './mymodel.py' in the hetplan zoo",
            "--module pkg.mod:factory", "--workload FILE")


# -- an output path that holds a file of another kind ---------------------------------------
def test_run_report_onto_the_plan_is_refused(files: dict[str, Path], tmp_path: Path) -> None:
    """Was: accepted; the run's report replaced the plan it was trained with."""
    plan = tmp_path / "p.json"
    plan.write_bytes(files["plan"].read_bytes())
    refused(run("run", plan, "--model", "gpt-test", "--report", plan, "--dry-run"),
            f"--report '{plan}' is a plan (written by `hetplan plan`); writing the run report "
            "there would overwrite it")
    assert plan.read_bytes() == files["plan"].read_bytes()


def test_outputs_onto_a_file_of_another_kind_are_refused(files: dict[str, Path],
                                                         tmp_path: Path) -> None:
    cluster = tmp_path / "c.yaml"
    cluster.write_bytes(CLUSTER_YAML.read_bytes())
    refused(_plan(tmp_path, "-c", "local-cpu", "-b", "8", "-o", cluster),
            f"-o/--output '{cluster}' is a cluster spec; writing the plan there would "
            "overwrite it")
    assert cluster.read_bytes() == CLUSTER_YAML.read_bytes()
    plan = tmp_path / "p.json"
    plan.write_bytes(files["plan"].read_bytes())
    refused(run("export", files["plan"], "--to", "megatron", "-o", plan),
            f"-o/--output '{plan}' is a plan")
    # a plan over a plan, an engine config over a file of no hetplan kind: as before
    assert _plan(tmp_path, "-c", "local-cpu", "-b", "8", "-o", plan).exit_code == 0
    other = tmp_path / "args.txt"
    other.write_text("--old\n")
    assert run("export", plan, "--to", "megatron", "-o", other).exit_code == 0


def test_profile_a_gpu_type_on_a_machine_without_one_is_refused(
        no_measuring: None, tmp_path: Path) -> None:
    """Was: CPU times filed as the A100-80GB's, which `plan --profile` then priced A100s at."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: its GPU type is measured on it")
    refused(run("profile", "--what", "compressors", "--device-type", "A100-80GB", "-o",
                tmp_path / "db.json"),
            "--device-type 'A100-80GB' is a GPU type, but this machine has no CUDA device")


def test_a_pass_option_out_of_range_names_the_option() -> None:
    """Was: "pass 'cupcake-fusion' failed after passes [...]: ValueError: ops_table needs a
    non-empty 1-D list of sizes, got shape (0,)" once the search had run."""
    refused(_plan(Path(), "-c", "mixed-generations", "-b", "64", "--pp", "2", "--passes",
                  "dynpipe,even-tp,ddp-buckets,cupcake-fusion{max-group=-1}"),
            "--passes: pass 'cupcake-fusion'", "max-group must be at least 1", "got -1")


def test_a_pipeline_that_does_not_start_with_its_stages_pass_gets_a_runnable_example(
        ) -> None:
    """Was: "e.g. 'dynpipe,ddp-buckets,even-tp,dynpipe'" (the stages pass twice)."""
    refused(_plan(Path(), "-c", "mixed-generations", "-b", "64", "--passes",
                  "ddp-buckets,even-tp,dynpipe"),
            "start it with a pass that writes them", "e.g. 'dynpipe,ddp-buckets,even-tp'")


def test_a_cluster_path_that_does_not_exist_is_called_a_missing_file() -> None:
    """Was: "unknown cluster preset './mycluster' (available: ...)"."""
    refused(_plan(Path(), "-c", "./no/such/cluster", "-b", "8"),
            "cluster spec file './no/such/cluster' does not exist (resolved to",
            "check the path, or name a preset")


def test_a_training_script_that_is_a_directory_is_called_one(files: dict[str, Path],
                                                             tmp_path: Path) -> None:
    """Was: "training script '...' does not exist" for a directory that does."""
    refused(run("run", files["plan"], "--script", tmp_path, "--dry-run"),
            f"--script: training script '{tmp_path}' is a directory")


def test_a_tp_linear_the_model_does_not_have_is_refused_before_the_run(tmp_path: Path) -> None:
    """A linear misspelt inside a real layer passes the plan validator (the workload names
    layers, not linears); the runtime looked its shard sizes up by module name and ran even
    shards. `hetplan run` checks the plan against the model before any rank starts."""
    from hetplan.optimizer.compile import compile as compile_plan

    plan = compile_plan("gpt-test", "mixed-tp-node", batch_size=64, pp=2, tp=4, zero_stage=0,
                        tp_controller="semi")
    data = json.loads(plan.to_json())
    data["tensor_parallel"]["groups"][0]["linears"] = [  # 'fcl' for 'fc1'
        {"name": "blocks.0.fcl", "split": "column", "features": 256,
         "shard_sizes": [96, 96, 32, 32]}]
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    assert run("validate", path).exit_code == 0  # inside layer blocks.0: the file is valid
    refused(run("run", path, "--model", "gpt-test", "--dry-run"),
            "tensor_parallel.groups[0].linears[0].name: 'blocks.0.fcl' is not a linear of "
            "model 'gpt-test' (did you mean 'blocks.0.fc")


def test_a_plan_whose_workload_was_edited_is_refused_before_the_run(tmp_path: Path) -> None:
    """Every command read the edited numbers as the model's (a gradient of 0 bytes was priced
    as such) and `run` trained the real model; the file alone cannot tell, the model can."""
    from hetplan.optimizer.compile import compile as compile_plan

    plan = compile_plan("gpt-test", "local-cpu", batch_size=8)
    path = tmp_path / "p.json"
    plan.save(path)
    assert run("run", path, "--model", "gpt-test", "--dry-run").exit_code == 0
    data = json.loads(path.read_text())
    data["model"]["workload"]["grads"][0]["size_bytes"] = 0
    path.write_text(json.dumps(data))
    assert run("validate", path).exit_code == 0
    name = data["model"]["workload"]["grads"][0]["name"]
    refused(run("run", path, "--model", "gpt-test", "--dry-run"),
            f"model.workload.grads[0] (name / size_bytes / layer_index): ('{name}', 0,",
            "the plan was edited after planning")


def test_hetero_on_a_one_node_mixed_cluster_plans(tmp_path: Path) -> None:
    """Was: "cluster 'one-node-mixed' has 1 node and no 'inter_node' link; cost inter-node
    collectives only on multi-node clusters" (exit 2): the per-stage search priced every
    stage boundary as crossing nodes, which one node does not have."""
    cluster = tmp_path / "one-node-mixed.yaml"
    cluster.write_text(
        "name: one-node-mixed\n"
        "nodes:\n"
        "- name: box\n"
        "  count: 1\n"
        "  devices:\n"
        "  - {type: A100-80GB, count: 2}\n"
        "  - {type: V100-SXM2-32GB, count: 2}\n"
        "  cpu_cores: 64\n"
        "  intra_link: {kind: pcie, bandwidth_gbps: 256.0, latency_us: 5.0}\n")
    out = tmp_path / "p.json"
    result = _plan(tmp_path, "-c", cluster, "-b", "16", "--hetero", "on", "-o", out)
    assert result.exit_code == 0, result.output
    assert load_plan(out).hetero is not None
