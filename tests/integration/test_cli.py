"""End-to-end tests of the ``hetplan`` command line, run in-process with typer's CliRunner.

Expectations are computed independently of the code under test: parameter counts from
``nn.Module.parameters()``, world sizes from the YAML files, gradient counts from the raw
Espresso benchmark JSON, the version from the installed package metadata.
"""

from __future__ import annotations

import contextlib
import io

import importlib.metadata
import inspect
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner, Result

from hetplan import zoo
from hetplan.cli import app
from hetplan.cost_models.predict import simulate
from hetplan.errors import SpecError
from hetplan.ir.cluster import ClusterSpec, list_presets
from hetplan.ir.model import ModelIR
from hetplan.ir.plan import (
    Baseline,
    ClusterRef,
    Layout,
    ModelRef,
    Plan,
    Predictions,
    Stage,
    load_plan,
)

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "clusters"
ESPRESSO = REPO / "data" / "espresso_models.json"
ESPRESSO_SECTIONS = ("models", "extra_models_not_selectable_from_cli")


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------
def _runner() -> CliRunner:
    """A runner that keeps stderr apart from stdout (click >= 8.2 always does)."""
    if "mix_stderr" in inspect.signature(CliRunner.__init__).parameters:  # click < 8.2
        return CliRunner(mix_stderr=False)  # type: ignore[call-arg]
    return CliRunner()


def run(args: Sequence[str | Path]) -> Result:
    """Invoke ``hetplan ARGS`` in-process."""
    return _runner().invoke(app, [str(a) for a in args])


def stdout(r: Result) -> str:
    return r.stdout


def stderr(r: Result) -> str:
    try:
        return r.stderr
    except ValueError:  # stderr mixed into stdout (old click without mix_stderr=False)
        return r.output


def flat(text: str) -> str:
    """Collapse whitespace, so that rich's line wrapping does not matter."""
    return " ".join(text.split())


def assert_ok(r: Result) -> None:
    assert r.exit_code == 0, f"exit {r.exit_code}\nstdout:\n{r.stdout}\nstderr:\n{stderr(r)}"


def assert_user_error(r: Result, *needles: str) -> str:
    """Exit code 2, one clean message (no traceback) containing every needle."""
    msg = flat(stderr(r))
    assert r.exit_code == 2, f"exit {r.exit_code}: {r.stdout}\n{msg}\n{r.exception!r}"
    assert isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.stdout + stderr(r)
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"
    return msg


def table_first_column(text: str) -> list[str]:
    """The first-column cells of a rich table (continuation rows skipped)."""
    cells = []
    for line in text.splitlines():
        if line.startswith("│"):
            cell = line.split("│")[1].strip()
            if cell:
                cells.append(cell)
    return cells


def num_params(name: str) -> int:
    """Unique parameter elements of a zoo model, counted by PyTorch itself."""
    return sum(p.numel() for p in zoo.build(name).parameters())


def write_yaml(path: Path, data: Any) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def cluster_yaml() -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / "cpu-2x2.yaml").read_text())


# --------------------------------------------------------------------------------------
# fixtures
# --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_gpt_ir() -> ModelIR:
    from hetplan.ir.capture import capture

    model = zoo.build("tiny-gpt")
    args, kwargs = zoo.example_inputs("tiny-gpt")
    return capture(model, args, kwargs, name="tiny-gpt")


@pytest.fixture(scope="module")
def plan_file(tiny_gpt_ir: ModelIR, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plan for tiny-gpt on a100-nvlink-8x8: dp=4 pp=2, two stages, two baselines."""
    n = len(tiny_gpt_ir.layers)
    assert n >= 2
    plan = Plan(
        model=ModelRef.from_model_ir(tiny_gpt_ir),
        cluster=ClusterRef.from_cluster(ClusterSpec.from_preset("a100-nvlink-8x8")),
        layout=Layout(dp=4, pp=2, tp=1, micro_batches=8, schedule="1f1b"),
        stages=(
            Stage(index=0, first_layer=0, last_layer=n // 2 - 1, ranks=(0, 1, 2, 3),
                  fwd_ms=1.5, bwd_ms=3.0),
            Stage(index=1, first_layer=n // 2, last_layer=n - 1, ranks=(4, 5, 6, 7),
                  fwd_ms=1.25, bwd_ms=2.5),
        ),
        predictions=Predictions(
            iteration_time_ms=10.0,
            baselines=(
                Baseline(name="ddp", iteration_time_ms=25.0),
                Baseline(name="megatron", iteration_time_ms=15.0),
            ),
        ),
    )
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    path.write_text(plan.to_json())
    return path


# --------------------------------------------------------------------------------------
# version, models, presets
# --------------------------------------------------------------------------------------
def test_version() -> None:
    r = run(["--version"])
    assert_ok(r)
    assert importlib.metadata.version("hetplan") in r.stdout


def test_python_dash_m_hetplan_runs_the_cli() -> None:
    """Was: "No module named hetplan.__main__" (for a venv whose scripts are not on PATH)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "hetplan", "--version"], capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert importlib.metadata.version("hetplan") in proc.stdout


def test_models_lists_zoo() -> None:
    r = run(["models"])
    assert_ok(r)
    names = table_first_column(r.stdout)
    assert "gpt2" in names
    assert "llama-70b" in names


def test_models_filters_name_an_unknown_family_or_size() -> None:
    """Were an empty table, exit 0 (a family in another case, too)."""
    assert_user_error(run(["models", "--family", "lama"]), "--family 'lama'",
                      "did you mean 'llama'?", "gpt2")
    assert_user_error(run(["models", "--size", "huge"]), "--size 'huge'", "full or tiny")
    r = run(["models", "--family", "GPT2", "--size", "Tiny"])
    assert_ok(r)
    assert table_first_column(r.stdout) == ["tiny-gpt2"]


def test_presets_lists_every_preset() -> None:
    r = run(["presets"])
    assert_ok(r)
    names = table_first_column(r.stdout)
    expected = [name for name, _ in list_presets()]
    assert expected
    assert sorted(names) == sorted(expected)


# --------------------------------------------------------------------------------------
# ir
# --------------------------------------------------------------------------------------
def test_ir_tiny_gpt2_summary() -> None:
    r = run(["ir", "tiny-gpt2"])
    assert_ok(r)
    out = flat(r.stdout)
    assert f"parameters {num_params('tiny-gpt2'):,} " in out
    n_layer: int = zoo.build("tiny-gpt2").config.n_layer  # type: ignore[union-attr,assignment]
    for name in ("transformer.wte", "transformer.wpe", "transformer.h.0",
                 f"transformer.h.{n_layer - 1}", "transformer.ln_f"):
        assert name in out, name


def test_ir_json_is_a_workload() -> None:
    r = run(["ir", "tiny-gpt", "--json"])
    assert_ok(r)
    ir = ModelIR.from_json(r.stdout)
    model = zoo.build("tiny-gpt")
    assert ir.name == "tiny-gpt"
    assert ir.num_params == sum(p.numel() for p in model.parameters())
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {g.name for g in ir.grad_tensors} == trainable
    assert len(ir.grad_tensors) == len(trainable)


def test_ir_output_file_then_workload(tmp_path: Path) -> None:
    path = tmp_path / "w.json"
    first = run(["ir", "mlp", "-o", path])
    assert_ok(first)
    assert path.is_file()
    ir = ModelIR.load(path)
    assert ir.num_params == num_params("mlp")

    second = run(["ir", "--workload", path])
    assert_ok(second)
    out = flat(second.stdout)
    assert f"parameters {num_params('mlp'):,} " in out
    assert f"fingerprint {ir.fingerprint()}" in out
    assert f"fingerprint {ir.fingerprint()}" in flat(first.stdout)


def test_ir_data_dependent_names_module() -> None:
    msg = assert_user_error(run(["ir", "data-dependent"]), "'gate'")
    assert "--opaque gate" in msg


def test_ir_data_dependent_opaque() -> None:
    r = run(["ir", "data-dependent", "--opaque", "gate"])
    assert_ok(r)
    assert f"parameters {num_params('data-dependent'):,} " in flat(r.stdout)


def test_ir_misspelt_model_suggests() -> None:
    assert_user_error(run(["ir", "gtp2"]), "'gtp2'", "did you mean 'gpt2'")


def test_ir_model_and_workload_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "w.json"
    path.write_text("{}")
    assert_user_error(run(["ir", "mlp", "--workload", path]), "exactly one")


# --------------------------------------------------------------------------------------
# validate: cluster specs
# --------------------------------------------------------------------------------------
EXAMPLE_FILES = sorted(EXAMPLES.glob("*.yaml"))


def test_examples_exist() -> None:
    assert len(EXAMPLE_FILES) >= 5


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.stem)
def test_validate_example_clusters(path: Path) -> None:
    data = yaml.safe_load(path.read_text())
    world = sum(
        node.get("count", 1) * sum(g["count"] for g in node["devices"]) for node in data["nodes"]
    )
    r = run(["validate", path])
    assert_ok(r)
    out = flat(r.stdout)
    assert "valid cluster spec" in out
    assert f"{data['name']}:" in out
    assert f"{world} devices" in out


def test_validate_misspelt_key(tmp_path: Path) -> None:
    data = cluster_yaml()
    node = data["nodes"][0]
    node["cuont"] = node.pop("count")
    r = run(["validate", write_yaml(tmp_path / "c.yaml", data)])
    assert_user_error(r, "nodes[0].cuont", "did you mean 'count'")


def test_validate_negative_bandwidth(tmp_path: Path) -> None:
    data = cluster_yaml()
    data["inter_node"]["bandwidth_gbps"] = -40.0
    r = run(["validate", write_yaml(tmp_path / "c.yaml", data)])
    assert_user_error(r, "inter_node.bandwidth_gbps", "-40")


@pytest.mark.parametrize("where", ["device group", "node group"])
def test_validate_zero_devices(tmp_path: Path, where: str) -> None:
    data = cluster_yaml()
    if where == "device group":
        data["nodes"][0]["devices"][0]["count"] = 0
        needle = "nodes[0].devices"
    else:
        data["nodes"][0]["count"] = 0
        needle = "nodes[0].count"
    r = run(["validate", write_yaml(tmp_path / "c.yaml", data)])
    assert_user_error(r, needle)


def test_validate_missing_file(tmp_path: Path) -> None:
    assert_user_error(run(["validate", tmp_path / "nope.yaml"]), "nope.yaml", "does not exist")


def test_validate_invalid_yaml(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\nnodes: [\n  - {a: 1\n")
    assert_user_error(run(["validate", path]), "bad.yaml", "not valid YAML")


# --------------------------------------------------------------------------------------
# validate / inspect: plans
# --------------------------------------------------------------------------------------
def _check_plan_text(text: str) -> None:
    out = flat(text)
    assert "tiny-gpt" in out
    assert "a100-nvlink-8x8" in out
    assert "dp=4 pp=2 tp=1" in out
    assert "1f1b" in out
    assert "pipeline stages" in out
    assert "0–3" in out and "4–7" in out  # rank ranges
    assert "1.500" in out and "2.500" in out
    assert "10.000 ms" in out
    assert "baseline ddp: 25.000 ms (2.50×)" in out
    assert "baseline megatron: 15.000 ms (1.50×)" in out


def test_validate_plan(plan_file: Path) -> None:
    r = run(["validate", plan_file])
    assert_ok(r)
    assert "valid plan" in flat(r.stdout)
    _check_plan_text(r.stdout)


def test_inspect_plan(plan_file: Path) -> None:
    """The fixture's predictions are made up (10 ms; stages 1.5 + 3.0 and 1.25 + 2.5 ms):
    inspect shows what its sections predict, as simulate does, and says the stored numbers
    are stale (validate above shows the file as it is)."""
    r = run(["inspect", plan_file])
    assert_ok(r)
    out = flat(r.stdout)
    now = simulate(load_plan(plan_file)).iteration_time_ms
    assert "stored prediction 10.000 ms is stale" in out
    assert f"re-predicted {now:.3f} ms" in out
    # the headline and the baselines' speedups are the re-predicted plan's
    assert f"predicted iteration time: {now:.3f} ms" in out
    for part in ("tiny-gpt", "a100-nvlink-8x8", "dp=4 pp=2 tp=1", "1f1b", "pipeline stages",
                 "0–3", "4–7", f"baseline ddp: 25.000 ms ({25.0 / now:.2f}×)",
                 f"baseline megatron: 15.000 ms ({15.0 / now:.2f}×)"):
        assert part in out, part


def test_inspect_json(plan_file: Path, tiny_gpt_ir: ModelIR) -> None:
    r = run(["inspect", plan_file, "--json"])
    assert_ok(r)
    data = json.loads(r.stdout)["summary"]  # the headline numbers; sections beside it
    assert data["model"] == "tiny-gpt"
    assert data["cluster"] == "a100-nvlink-8x8"
    assert data["world_size"] == 64
    assert data["layout"] == "dp=4 pp=2 tp=1"
    assert data["num_stages"] == 2
    assert data["micro_batches"] == 8
    now = simulate(load_plan(plan_file)).iteration_time_ms  # re-predicted: see above
    assert data["iteration_time_ms"] == pytest.approx(now)
    assert data["best_baseline"] == "megatron"
    assert data["speedup"] == pytest.approx(15.0 / now, rel=1e-4)


@pytest.mark.parametrize("command", ["validate", "inspect"])
def test_plan_from_newer_hetplan(plan_file: Path, tmp_path: Path, command: str) -> None:
    data = json.loads(plan_file.read_text())
    data["schema_version"] = 2
    data["tool_version"] = "99.0.0"  # as a newer release writes it
    path = tmp_path / "v2.json"
    path.write_text(json.dumps(data))
    msg = assert_user_error(run([command, path]), "newer hetplan")
    assert "upgrade" in msg


@pytest.mark.parametrize("command", ["validate", "inspect"])
def test_truncated_plan(plan_file: Path, tmp_path: Path, command: str) -> None:
    text = plan_file.read_text()
    path = tmp_path / "trunc.json"
    path.write_text(text[: len(text) // 2])
    assert_user_error(run([command, path]), "trunc.json", "not valid JSON")


def test_debug_reraises(plan_file: Path, tmp_path: Path) -> None:
    text = plan_file.read_text()
    path = tmp_path / "trunc.json"
    path.write_text(text[: len(text) // 2])
    r = run(["--debug", "inspect", path])
    assert r.exit_code != 2
    assert isinstance(r.exception, SpecError), repr(r.exception)


def test_command_help_paragraphs_wrap_to_the_terminal() -> None:
    """Was: a command's help kept its docstring's line breaks, so a terminal of another
    width than the source's showed ragged lines (a break after "(captured" at any width)."""
    r = _runner().invoke(app, ["run", "--help"], env={"COLUMNS": "200"})
    assert_ok(r)
    lines = [line.strip() for line in r.stdout.splitlines()]
    assert any(line.startswith("Before any rank starts, the plan is checked against its "
                               "cluster, the model (captured here; not with --script)")
               for line in lines), r.stdout
    r = _runner().invoke(app, ["--help"], env={"COLUMNS": "200"})
    assert_ok(r)
    assert "optimizer step) and, with --sparsity, the model's" in r.stdout, r.stdout


def test_explain_help_names_every_kind_of_target() -> None:
    """Was: the TARGET help left out linear:NAME, which README and explain's errors name."""
    r = _runner().invoke(app, ["explain", "--help"], env={"COLUMNS": "200"})
    assert_ok(r)
    for kind in ("bucket:N", "stage:K", "rank:R", "linear:NAME"):
        assert kind in r.stdout, kind


def test_inspect_memory_rows_count_only_the_ranks_a_stage_uses(
        tiny_gpt_ir: ModelIR, tmp_path: Path) -> None:
    """Was: a heterogeneous plan using 1 of local-cpu's 4 ranks showed stage 0 with 4 ranks
    in the memory table (the idle ranks were filed under stage 0)."""
    workload = tmp_path / "tiny.json"
    tiny_gpt_ir.save(workload)
    out = tmp_path / "plan.json"
    assert_ok(run(["plan", "--workload", workload, "-c", "local-cpu", "-b", "8", "--hetero",
                   "on", "--no-progress", "-o", out]))
    plan = load_plan(out)
    used = {r for st in plan.stages for r in st.ranks}
    assert len(used) < plan.cluster.world_size  # the case this test is about: idle ranks
    r = run(["inspect", out, "--json", "-s", "memory"])
    assert_ok(r)
    rows = json.loads(r.stdout)["memory"]["per_stage"]
    assert sum(row["ranks"] for row in rows) == len(used), rows


@pytest.mark.parametrize("argv", [
    ("plan", "--workload", "{workload}", "-c", "local-cpu", "-b", "8", "--seq", "64"),
    ("ir", "--workload", "{workload}", "--batch", "4"),
    ("ir", "--module", "hetplan.models:nope", "--seq", "8"),
    ("profile", "--seq", "8", "--what", "step", "-o", "{tmp}/p.json"),
])
def test_zoo_input_options_without_a_zoo_model_are_refused(
        argv: tuple[str, ...], tiny_gpt_ir: ModelIR, tmp_path: Path) -> None:
    """Was: --seq / --batch with --workload or --module were ignored without a word (a plan
    "for sequence 64" was the workload's own length)."""
    workload = tmp_path / "tiny.json"
    tiny_gpt_ir.save(workload)
    r = run([a.format(workload=workload, tmp=tmp_path) for a in argv])
    assert r.exit_code == 2, stderr(r)
    flag = "--seq" if "--seq" in argv else "--batch"
    assert f"{flag} shapes a zoo model's example inputs" in flat(stderr(r))
    assert "drop it" in flat(stderr(r))


@pytest.mark.parametrize("command", [("ir",), ("plan", "-c", "local-cpu", "-b", "8")])
def test_opaque_with_a_workload_file_is_refused(command: tuple[str, ...],
                                                tiny_gpt_ir: ModelIR, tmp_path: Path) -> None:
    """Was: ignored (a workload file is already captured)."""
    workload = tmp_path / "tiny.json"
    tiny_gpt_ir.save(workload)
    r = run([*command, "--workload", workload, "--opaque", "blocks.0"])
    assert r.exit_code == 2, stderr(r)
    assert "--opaque changes how a model is captured" in flat(stderr(r))


def test_plan_says_when_a_pinned_schedule_did_not_apply(tiny_gpt_ir: ModelIR,
                                                        tmp_path: Path) -> None:
    """Was: --schedule interleaved-1f1b --virtual-stages 2 gave a dp-only plan ("schedule
    1f1b") without a word; with --pp the pins apply and nothing is said."""
    workload = tmp_path / "tiny.json"
    tiny_gpt_ir.save(workload)
    base = ["plan", "--workload", workload, "-c", "local-cpu", "-b", "8", "--dp", "4",
            "--schedule", "interleaved-1f1b", "--virtual-stages", "2"]
    r = run(base)
    assert_ok(r)
    assert ("no pipeline (pp=1), so --schedule interleaved-1f1b and --virtual-stages 2 did "
            "not apply; pin --pp") in flat(stderr(r))
    r = run([*base[:7], "--pp", "2", *base[9:]])
    assert_ok(r)
    assert "did not apply" not in flat(stderr(r))


def test_plan_says_when_dynamics_did_not_apply(tiny_gpt_ir: ModelIR, tmp_path: Path) -> None:
    """Was: --dynamics examples/pruning.yaml with a layout the search chose without a
    pipeline gave 're-balancing: ... 0 event(s)' and no word why (it moves layers between
    stages); with --pp the re-balancing applies and nothing is said."""
    workload = tmp_path / "tiny.json"
    tiny_gpt_ir.save(workload)
    dynamics = Path(__file__).resolve().parents[2] / "examples" / "pruning.yaml"
    base = ["plan", "--workload", workload, "-c", "local-cpu", "-b", "8", "--dynamics",
            dynamics]
    r = run([*base, "--dp", "4"])
    assert_ok(r)
    assert (f"no pipeline (pp=1), so --dynamics {dynamics} did not apply; pin --pp"
            in flat(stderr(r)))
    r = run([*base, "--pp", "2"])
    assert_ok(r)
    assert "did not apply" not in flat(stderr(r))


def test_plan_says_when_a_pinned_zero_stage_or_sp_did_not_apply(tiny_gpt_ir: ModelIR,
                                                                  tmp_path: Path) -> None:
    """Was: --zero 3 with a layout the search chose without data parallelism (--pp 4) gave
    "no ZeRO" without a word; --sp on a layout without tensor parallelism, the same."""
    workload = tmp_path / "tiny.json"
    tiny_gpt_ir.save(workload)
    base = ["plan", "--workload", workload, "-c", "local-cpu", "-b", "8"]
    r = run([*base, "--pp", "4", "--zero", "3", "--sp"])
    assert_ok(r)
    assert ("the layout has no data parallelism (dp=1), so --zero 3 did not apply; pin --dp"
            in flat(stderr(r)))
    assert ("the layout has no tensor parallelism (tp=1), so --sp did not apply; pin --tp"
            in flat(stderr(r)))
    r = run([*base, "--dp", "4", "--zero", "3"])
    assert_ok(r)
    assert "did not apply" not in flat(stderr(r))


# --------------------------------------------------------------------------------------
# workload convert
# --------------------------------------------------------------------------------------
def test_workload_convert(tmp_path: Path) -> None:
    if not ESPRESSO.is_file():
        pytest.skip(f"Espresso benchmark file not found at {ESPRESSO.resolve()}")
    bench = json.loads(ESPRESSO.read_text())
    expected = {
        name: m["num_tensors"] for s in ESPRESSO_SECTIONS for name, m in bench[s].items()
    }
    assert len(expected) == 9
    out_dir = tmp_path / "workloads"
    r = run(["workload", "convert", ESPRESSO, "-o", out_dir])
    assert_ok(r)
    files = sorted(out_dir.glob("*.json"))
    assert sorted(p.stem for p in files) == sorted(expected)
    for path in files:
        ir = ModelIR.load(path)
        assert len(ir.grad_tensors) == expected[path.stem], path.name


def test_workload_convert_out_dir_mistakes(tmp_path: Path) -> None:
    """-o names a directory: a missing parent is refused (never created, as other outputs'
    directories are not) and a file is refused by name, both before any work, exit 2."""
    missing = tmp_path / "nodir" / "workloads"
    r = run(["workload", "convert", ESPRESSO, "-o", missing])
    assert r.exit_code == 2, stderr(r)
    assert "nodir' does not exist" in flat(stderr(r))
    assert not (tmp_path / "nodir").exists()
    a_file = tmp_path / "plan.json"
    a_file.write_text("{}")
    r = run(["workload", "convert", ESPRESSO, "-o", a_file])
    assert r.exit_code == 2, stderr(r)
    assert "is a file, not a directory" in flat(stderr(r))
    assert "internal error" not in stderr(r)
    r = run(["workload", "convert", tmp_path / "espresso_models.json", "-o", tmp_path / "w"])
    assert r.exit_code == 2, stderr(r)
    assert "data/espresso_models.json" in flat(stderr(r))


# --------------------------------------------------------------------------------------
# plan --dynamics (DynPipe re-balancing)
# --------------------------------------------------------------------------------------
def test_plan_with_dynamics_file(tiny_gpt_ir: ModelIR, tmp_path: Path) -> None:
    workload = tmp_path / "tiny.json"
    tiny_gpt_ir.save(workload)
    example = Path(__file__).resolve().parents[2] / "examples" / "pruning.yaml"
    out = tmp_path / "plan.json"
    r = run(["plan", "--workload", workload, "-c", "local-cpu", "-b", "8", "--pp", "2",
             "--dynamics", example, "-o", out])
    assert_ok(r)
    plan = Plan.model_validate_json(out.read_text())
    assert plan.rebalancing is not None
    assert [e.iteration for e in plan.rebalancing.events] == [4000, 5000, 6000, 7000]
    # `hetplan run` executes applied events (re-packing included) and warns for the rest
    from types import SimpleNamespace

    from hetplan.runtime.rebalance import executable_events
    from hetplan.runtime.worker import _warn_skipped_events

    events = plan.rebalancing.events
    assert not any(e.applied for e in events)  # the trigger declines them for this tiny model
    assert executable_events(plan.rebalancing, 2) == ([], [])
    moved = events[0].model_copy(update={"applied": True})
    whole = ((0, plan.stages[-1].last_layer),)
    packed = events[1].model_copy(update={"applied": True, "stages": whole,
                                          "released_stages": (1,)})
    regrow = events[2].model_copy(update={"applied": True})
    forced = plan.rebalancing.model_copy(update={"events": (packed, moved, regrow)
                                                 + events[3:]})
    run_now, skipped = executable_events(forced, 2)
    assert [e.iteration for e in run_now] == [4000, 5000]  # in iteration order
    assert [e for e, _ in skipped] == [regrow]
    assert "needs 2 stages but re-packing left 1" in skipped[0][1]
    assert [e for e, _ in executable_events(forced, 1)[1]] == [moved, packed, regrow]
    assert executable_events(forced, 2, stages_per_rank=2)[0] == []  # interleaved
    for rank, expected in ((0, "event at iteration 6000 is not executed (it needs 2"), (1, "")):
        with contextlib.redirect_stderr(io.StringIO()) as err:
            _warn_skipped_events(SimpleNamespace(skipped_events=skipped), rank=rank)
        assert expected in err.getvalue() and bool(expected) == bool(err.getvalue())
    bad = write_yaml(tmp_path / "bad.yaml", {"total_iterations": 100,
                                             "pruning": {"final_sparsity": 0.9,
                                                         "frequncy": 10, "steps": 2}})
    assert_user_error(run(["plan", "--workload", workload, "-c", "local-cpu", "-b", "8",
                           "--pp", "2", "--dynamics", bad]),
                      "bad.yaml", "did you mean 'frequency'")
