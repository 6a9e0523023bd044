"""A new user's mistakes, round 11 (`docs/decisions/bad-input-round11.md`): each case that
was an internal error, a silently ignored setting or an accepted value that cannot be right.

Every test here failed before its fix.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hetplan.runtime import launch as launch_mod
from test_bad_input_round7 import WORKLOAD, refused, run  # the rounds share helpers

EMULATION = ("HETPLAN_EMULATE_BW", "HETPLAN_EMULATE_LATENCY_US", "HETPLAN_EMULATE_STRAGGLER",
             "HETPLAN_EMULATE_GEMM_FLOPS", "HETPLAN_EMULATE_DELAY", "HETPLAN_CPU_SCHED",
             "HETPLAN_CHECKPOINT_DIR", "HETPLAN_STORAGE_DIR")


@pytest.fixture(scope="module")
def dp_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """mlp planned dp 4 on local-cpu (4 ranks)."""
    out = tmp_path_factory.mktemp("dp") / "plan.json"
    result = run("plan", "mlp", "-c", "local-cpu", "-b", "8", "--dp", "4", "--no-progress",
                 "-o", out)
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """No emulation variable of the caller's; starting torchrun fails the test."""
    def never(*_a: object, **_k: object) -> None:
        raise AssertionError("started torchrun despite a bad emulation variable")

    for name in EMULATION:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(launch_mod, "prestart", never)
    monkeypatch.setattr(launch_mod, "launch", never)
    monkeypatch.setattr("hetplan.runtime.link_emulation._LINK", None)


@pytest.mark.parametrize(("env", "needle"), [
    # was accepted: the latency is read only with a bandwidth, the rate only with a straggler
    ({"HETPLAN_EMULATE_LATENCY_US": "50"},
     "HETPLAN_EMULATE_LATENCY_US='50' emulates a link's latency only together with its "
     "bandwidth: set HETPLAN_EMULATE_BW too"),
    ({"HETPLAN_EMULATE_GEMM_FLOPS": "1e12"},
     "HETPLAN_EMULATE_GEMM_FLOPS='1e12' sets the device speed of an emulated straggler: set "
     "HETPLAN_EMULATE_STRAGGLER too"),
    # was accepted: no rank 99 in a run of 4, so nothing straggled
    ({"HETPLAN_EMULATE_STRAGGLER": "8@99"},
     "HETPLAN_EMULATE_STRAGGLER: rank 99 is not a rank of this run (0..3)"),
    ({"HETPLAN_EMULATE_DELAY": "0.1,0.3,7,0+99"},
     "HETPLAN_EMULATE_DELAY='0.1,0.3,7,0+99': rank(s) [99] are not ranks of this run (0..3)"),
    # was refused by every rank after torchrun started them
    ({"HETPLAN_EMULATE_DELAY": "abc"},
     "HETPLAN_EMULATE_DELAY='abc': expected '<p>,<delay_s>[,<seed>[,<ranks>]]'"),
    # was accepted: an infinite link is no emulation; an infinite latency sleeps forever
    ({"HETPLAN_EMULATE_BW": "inf"}, "HETPLAN_EMULATE_BW=inf: the emulated bandwidth must be "
     "> 0 Gbit/s and finite"),
    ({"HETPLAN_EMULATE_BW": "10", "HETPLAN_EMULATE_LATENCY_US": "inf"},
     "HETPLAN_EMULATE_LATENCY_US=inf: the emulated latency must be >= 0 microseconds and "
     "finite"),
    ({"HETPLAN_EMULATE_DELAY": "0.1,inf"}, "need 0 <= p <= 1 and a finite delay_s >= 0"),
])
def test_run_refuses_an_emulation_variable_it_would_ignore_or_cannot_use(
        dp_plan: Path, no_launch: None, monkeypatch: pytest.MonkeyPatch,
        env: dict[str, str], needle: str) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    refused(run("run", dp_plan, "--model", "mlp"), needle)


@pytest.mark.parametrize("env", [
    {"HETPLAN_EMULATE_BW": "10", "HETPLAN_EMULATE_LATENCY_US": "50"},
    {"HETPLAN_EMULATE_STRAGGLER": "8@3", "HETPLAN_EMULATE_GEMM_FLOPS": "1e12"},
    {"HETPLAN_EMULATE_DELAY": "0.1,0.3,7,0+3"},
    {"HETPLAN_EMULATE_DELAY": "plan"},
])
def test_run_takes_good_emulation_variables(dp_plan: Path, no_launch: None,
                                            monkeypatch: pytest.MonkeyPatch,
                                            env: dict[str, str]) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    result = run("run", dp_plan, "--model", "mlp", "--dry-run")
    assert result.exit_code == 0, result.output


# -- names and paths with square brackets are printed as written ----------------------------
def test_a_cluster_named_with_brackets_is_validated(tmp_path: Path) -> None:
    """Was `internal error: MarkupError: closing tag '[/]' at position 18 has nothing to
    close` (rich read the name as markup); a node named 'a100[/b]' likewise, and a cluster
    named '[red]mine' was printed as 'mine', in red."""
    base = (Path(__file__).resolve().parents[2] / "examples" / "clusters"
            / "mixed-generations.yaml").read_text()
    for name, edit in (("my[/]cluster", ("name: mixed-generations", 'name: "my[/]cluster"')),
                       ("a100[/b]", ("- name: a100", '- name: "a100[/b]"')),
                       ("[red]mine", ("name: mixed-generations", 'name: "[red]mine"'))):
        path = tmp_path / "c.yaml"
        path.write_text(base.replace(*edit, 1))
        result = run("validate", path)
        assert result.exit_code == 0, result.output
        assert name in result.output, result.output


def test_written_files_are_named_as_written(dp_plan: Path, tmp_path: Path) -> None:
    """Was 'wrote t.html' for `-o '[x]t.html'` and 'ok: plan.json is a valid plan' for
    '[old]plan.json': rich took '[x]' and '[old]' for style tags and dropped them."""
    plan = tmp_path / "[old]plan.json"
    plan.write_text(dp_plan.read_text())
    result = run("validate", plan)
    assert result.exit_code == 0, result.output
    assert "[old]plan.json is a valid plan" in " ".join(result.output.split()), result.output
    out = tmp_path / "[x]t.html"
    result = run("timeline", plan, "-o", out)
    assert result.exit_code == 0, result.output
    assert f"wrote {out}" in result.output.replace("\n", ""), result.output  # no wrapping


# -- hand-edited checkpointing sections -------------------------------------------------------
@pytest.fixture(scope="module")
def gemini_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """gpt-test planned with Gemini on cpu-2x2 (ranks 0, 1 on node 0; 2, 3 on node 1)."""
    out = tmp_path_factory.mktemp("gemini") / "plan.json"
    result = run("plan", "--workload", WORKLOAD, "-c", "cpu-2x2", "-b", "8", "--checkpoint",
                 "gemini", "--no-progress", "-o", out)
    assert result.exit_code == 0, result.output
    return out


def _edit_checkpointing(src: Path, dst: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    data = json.loads(src.read_text())
    edit(data["checkpointing"])
    dst.write_text(json.dumps(data))
    return dst


@pytest.mark.parametrize(("edit", "expected"), [
    # a rank's copy on its own node (or on itself) is lost with the node it guards; the
    # recovery odds the plan states assume it is not
    (lambda c: c["ranks"][0].update(holders=[0, 1]),
     "checkpointing.ranks[0].holders: [0, 1], on nodes [0, 0], but node 0's copies go to "
     "nodes [0, 1] (node_holders[0]): a copy on the node it guards is lost with it"),
    (lambda c: c["ranks"][0].update(holders=[0, 0]), "checkpointing.ranks[0].holders: [0, 0]"),
    (lambda c: c.update(node_holders=[[0, 0], [1, 1]]),
     "checkpointing.node_holders[0]: [0, 0], but a node's holders are the node itself first"),
    # the runtime stores the rank's own copy under this node
    (lambda c: c["ranks"][0].update(node=1),
     "checkpointing.ranks[0].node: 1, but rank 0 is on node 0 of the 2 the plan uses"),
    (lambda c: c.update(node_groups=[[0, 0]]),
     "checkpointing.node_groups: [[0, 0]], but the groups split the nodes 0..1"),
    # inspect showed Gemini's cost every 5 iterations; the runtime checkpoints every 2
    (lambda c: c["gemini"].update(every_iters=c["every_iters"] + 3),
     "checkpointing.gemini.every_iters: "),
], ids=["holder-same-node", "holder-itself", "node-holders", "node", "node-groups",
        "every-iters"])
def test_a_checkpoint_placement_that_cannot_be_right_is_refused(
        gemini_plan: Path, tmp_path: Path, edit: Callable[[dict[str, Any]], None],
        expected: str) -> None:
    """Each was accepted by every command, `run --dry-run` included."""
    path = _edit_checkpointing(gemini_plan, tmp_path / "p.json", edit)
    for command in (("validate", path), ("inspect", path),
                    ("run", path, "--model", "gpt-test", "--dry-run")):
        refused(run(*command), expected, "re-run `hetplan plan --checkpoint gemini`")


# -- inspect --section of a section the plan does not have -----------------------------------
def test_inspect_says_the_plan_has_none_of_a_section_asked_for(dp_plan: Path) -> None:
    """Was: no output at all, exit 0 (`inspect plan.json -s checkpointing` of a plan made
    without Gemini), as if the section were empty."""
    result = run("inspect", dp_plan, "-s", "checkpointing", "-s", "group_sync",
                 "-s", "rebalancing")
    assert result.exit_code == 0, result.output
    flat = " ".join(result.output.split())
    for line in ("checkpointing: none (the plan was made without `hetplan plan --checkpoint "
                 "gemini`)", "group_sync: none (", "rebalancing: none (the plan was made "
                 "without `hetplan plan --dynamics FILE`)"):
        assert line in flat, result.output


# -- a value no member of a union takes -------------------------------------------------------
def test_a_union_field_is_refused_at_the_path_the_file_writes(dp_plan: Path,
                                                              tmp_path: Path) -> None:
    """Was four lines naming pydantic's union members in the path, one per member
    (`...strategies.fp32.compressed.params.ratio['function-before[strict_float(),
    constrained-float]']: Input should be a valid number`); the file has no key
    'compressed' (it is the strategy's kind)."""
    data = json.loads(dp_plan.read_text())
    data["gradient_sync"]["strategies"]["fp32"] = {
        "kind": "compressed", "compressor": "topk", "params": {"ratio": [0.01]},
        "hierarchy": "flat", "steps": [{"compressed": True, "level": "flat",
                                        "routine": "allgather"}]}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    flat = refused(run("validate", path), "p.json: gradient_sync.strategies.fp32.params.ratio: "
                   "expected a boolean, an integer, a number or a string, got a list")
    assert "function-before" not in flat and ".compressed." not in flat, flat


# -- workload convert ------------------------------------------------------------------------
BENCHMARK = Path(__file__).resolve().parents[2] / "data" / "espresso_models.json"


def _benchmark(tmp_path: Path, models: dict[str, Any], **constants: Any) -> Path:
    vgg = json.loads(BENCHMARK.read_text())["models"]["vgg16"]
    data = {"models": {name: (vgg if m is None else m) for name, m in models.items()},
            "constants": constants}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(data))
    return path


def test_workload_convert_writes_only_into_its_directory(tmp_path: Path) -> None:
    """Was: a model named '../evil' was written to evil.json beside the output directory
    (exit 0); 'a/b' was 'could not write the workload 'wl/a/b.json': No such file'."""
    out = tmp_path / "wl"
    for name in ("../evil", "a/b"):
        refused(run("workload", "convert", _benchmark(tmp_path, {name: None}), "-o", out),
                f"bench.json: models: model name {name!r} is not a file name")
    assert not (tmp_path / "evil.json").exists()
    for name in ("..", "."):  # the advice was "e.g. ''"
        refused(run("workload", "convert", _benchmark(tmp_path, {name: None}), "-o", out),
                f"model name {name!r} is not a file name", "e.g. 'model'")


@pytest.mark.parametrize(("models", "constants", "expected"), [
    # was exit 0, 'workloads written to wl' above an empty table
    ({}, {}, "bench.json: models and extra_models_not_selectable_from_cli list no models"),
    # was an internal error (ValueError: invalid literal for int())
    ({"vgg16": None}, {"bytes_per_element": "four"},
     "bench.json: constants.bytes_per_element: expected a positive integer"),
])
def test_workload_convert_refuses_a_benchmark_file_it_cannot_use(
        tmp_path: Path, models: dict[str, Any], constants: dict[str, Any],
        expected: str) -> None:
    refused(run("workload", "convert", _benchmark(tmp_path, models, **constants), "-o",
                tmp_path / "wl"), expected)


def test_workload_convert_names_a_tensor_listed_twice(tmp_path: Path) -> None:
    """Was: 'workload 'vgg16': parameter 'classifier.6.bias' is owned by both 'classifier.6'
    and 'classifier.6'; mark one of them as an alias with tied_to' (no file, wrong fix)."""
    vgg = json.loads(BENCHMARK.read_text())["models"]["vgg16"]
    vgg["tensor_names"][1] = vgg["tensor_names"][0]
    refused(run("workload", "convert", _benchmark(tmp_path, {"vgg16": vgg}), "-o",
                tmp_path / "wl"),
            "bench.json: models.vgg16.tensor_names: ['classifier.6.bias'] listed more than once")


# -- plan options that would change nothing ---------------------------------------------------
def test_tp_gamma_max_without_a_controller_is_refused() -> None:
    """Was accepted and dropped: with the controller off nothing prunes, so the bound bounds
    nothing (as `--replicas` without `--checkpoint gemini` is refused)."""
    refused(run("plan", "--workload", WORKLOAD, "-c", "local-cpu", "-b", "8",
                "--tp-gamma-max", "0.5"),
            "--tp-gamma-max 0.5 bounds the pruning of the TP resizing controller, which is "
            "off: give --tp-controller zero, migration or semi too")
    ok = run("plan", "--workload", WORKLOAD, "-c", "local-cpu", "-b", "8", "--zero", "0",
             "--passes", "dynpipe,even-tp,ddp-buckets,tp-resizing{controller=semi}",
             "--tp-gamma-max", "0.5", "--no-progress")
    assert ok.exit_code == 0, ok.output


# -- a byte-order mark ------------------------------------------------------------------------
def test_a_json_file_saved_with_a_byte_order_mark_is_read(dp_plan: Path, tmp_path: Path) -> None:
    """Was 'not valid JSON: Unexpected UTF-8 BOM (decode using utf-8-sig)' for a plan or a
    workload saved by an editor that writes one (a YAML cluster spec with one was read)."""
    plan = tmp_path / "plan.json"
    plan.write_bytes(b"\xef\xbb\xbf" + dp_plan.read_bytes())
    workload = tmp_path / "w.json"
    workload.write_bytes(b"\xef\xbb\xbf" + Path(WORKLOAD).read_bytes())
    for command in (("validate", plan), ("inspect", plan), ("ir", "--workload", workload)):
        result = run(*command)
        assert result.exit_code == 0, result.output


# -- '-' given as an output file ---------------------------------------------------------------
@pytest.mark.parametrize("command", [
    ("plan", "--workload", WORKLOAD, "-c", "local-cpu", "-b", "8", "--no-progress", "-o", "-"),
    ("ir", "--workload", WORKLOAD, "-o", "-"),
    ("run", "{plan}", "--model", "mlp", "--dry-run", "--report", "-"),
], ids=["plan", "ir", "run-report"])
def test_dash_as_an_output_is_refused(dp_plan: Path, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch,
                                      command: tuple[str, ...]) -> None:
    """Was: a file named '-' written in the working directory (exit 0), read by a new user
    as 'write to standard output'."""
    monkeypatch.chdir(tmp_path)
    refused(run(*(str(dp_plan) if c == "{plan}" else c for c in command)),
            "'-' would write a file named '-'")
    assert not (tmp_path / "-").exists()


@pytest.mark.parametrize("name", ["HETPLAN_CHECKPOINT_DIR", "HETPLAN_STORAGE_DIR"])
def test_a_checkpoint_directory_that_is_a_file_is_refused_before_launch(
        gemini_plan: Path, tmp_path: Path, no_launch: None,
        monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Was: every rank of a Gemini run failed creating its store under a path that is a
    file, after torchrun had started them."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    monkeypatch.setenv(name, str(blocker / "ckpt"))
    refused(run("run", gemini_plan, "--model", "gpt-test"),
            f"{name}=", "is a file, not a directory")


@pytest.mark.parametrize("where", ["/proc/hetplan-ckpt", "/sys/hetplan-ckpt"])
def test_a_checkpoint_directory_no_file_can_be_made_in_is_refused_before_launch(
        gemini_plan: Path, no_launch: None, monkeypatch: pytest.MonkeyPatch,
        where: str) -> None:
    """os.access says yes to root under /proc and /sys, where no directory can be made: the
    check let them through and every rank failed after launch."""
    monkeypatch.setenv("HETPLAN_CHECKPOINT_DIR", where)
    refused(run("run", gemini_plan, "--model", "gpt-test"),
            "HETPLAN_CHECKPOINT_DIR=", "is not writable")


def test_a_plan_captured_with_opaque_modules_says_why_run_refuses_it(tmp_path: Path) -> None:
    """`hetplan run` captures the model without --opaque, so the fingerprints differ: it
    said only to re-run `hetplan plan`, which made the same plan again."""
    out = tmp_path / "op.json"
    assert run("plan", "gpt-test", "-c", "local-cpu", "-b", "8", "--opaque", "blocks.0",
               "--no-progress", "-o", out).exit_code == 0
    refused(run("run", out, "--model", "gpt-test", "--dry-run"),
            "captured with opaque modules (blocks.0)", "`hetplan run` and the runtime do not "
            "take yet", "inspected, simulated and exported, not run")
