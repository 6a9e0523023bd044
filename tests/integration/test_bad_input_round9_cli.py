"""A new user's mistakes, round 9 (`docs/decisions/bad-input-round9.md`, "Options and
fields"): hand-edited plans that every command took and a `hetplan run` option it dropped.

Every test here failed before its fix: a heterogeneous stage's device class that its ranks
do not have, `--script` with `--model` (the model silently dropped) or with a file that is
no Python script, and advice that sent a user with a pinned micro-batch size the wrong way.
(A TP linear listed twice in its group: `tests/unit/test_plan_checks_round9.py`.) And a
tensor-parallel pair rule that needs the model (`docs/decisions/bad-input-round9.md`,
"Tensor-parallel rules that need the model"): `hetplan run` refused the plan only from its
ranks, after launching them; each rule: `tests/unit/test_plan_tp_checks.py`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hetplan.ir.plan import load_plan
from test_bad_input_round7 import GOLDEN, WORKLOAD, refused, run  # the rounds share helpers

CPU_MIXED_2 = GOLDEN.parent / "fixtures" / "clusters" / "cpu-mixed-2.yaml"


def _edited(src: Path, dst: Path, edit: Any) -> Path:
    data = json.loads(src.read_text())
    edit(data)
    dst.write_text(json.dumps(data))
    return dst


@pytest.fixture(scope="module")
def hetero_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`--hetero on` on mixed-generations: stage 0 on the A100 class."""
    out = tmp_path_factory.mktemp("het") / "het.json"
    result = run("plan", "--workload", WORKLOAD, "-c", "mixed-generations", "-b", "64",
                 "--hetero", "on", "--no-progress", "-o", out)
    assert result.exit_code == 0, result.output
    plan = load_plan(out)
    assert plan.hetero is not None and plan.hetero.stages[0].device_class == "A100-80GB"
    return out


@pytest.mark.parametrize("device_class", ["H100", "V100-SXM2-32GB"])
def test_a_stage_device_class_its_ranks_do_not_have_is_refused(
        tmp_path: Path, hetero_plan: Path, device_class: str) -> None:
    """Was accepted by every command; `inspect` then printed "2x H100" above a table of
    A100s (an existing type of the cluster was accepted too, its prediction unchanged)."""
    def edit(d: dict[str, Any]) -> None:
        d["hetero"]["stages"][0]["device_class"] = device_class

    bad = _edited(hetero_plan, tmp_path / "p.json", edit)
    for cmd in ("validate", "inspect", "simulate"):
        refused(run(cmd, bad), f"hetero.stages[0].device_class: {device_class!r}, but the "
                "stage's ranks", "are A100-80GB", "re-run `hetplan plan`")
    assert run("validate", hetero_plan).exit_code == 0


@pytest.fixture(scope="module")
def runner_up_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`--hetero on` on cpu-mixed-2: two stages, and a runner-up of the other order."""
    out = tmp_path_factory.mktemp("het") / "het.json"
    result = run("plan", "--workload", WORKLOAD, "-c", CPU_MIXED_2, "-b", "8", "--hetero",
                 "on", "--no-progress", "-o", out)
    assert result.exit_code == 0, result.output
    plan = load_plan(out)
    assert plan.hetero is not None and plan.hetero.search.runner_up is not None
    assert len(plan.hetero.search.runner_up.first_layers) == 2
    return out


@pytest.mark.parametrize(("edit", "expected"), [
    # was: internal error (ValidationError for Stage) in `explain stage:0`
    ({"first_layers": [0, 99]}, "first_layers: [0, 99], but the model has 8 layers"),
    ({"first_layers": [3, 0]}, "first_layers: [3, 0]"),
    # were: re-predicted with the stages zip() kept, or at another global batch
    ({"degrees": ["1x1"]}, "1 degrees, 2 recompute modes and 2 first_layers for 2 stages"),
    ({"degrees": ["1x1", "two"]}, "degrees[1]: 'two' is not 'DPxTP'"),
    ({"micro_batch_size": 3}, "micro-batch 3 x 8 = 24 samples, but the plan's global batch "
                              "is 8"),
    # was: refused by `explain` alone, without the file's name
    ({"order": ["H100", "cpu-fast"]}, "order: 'H100' is not a device type of cluster.spec"),
])
def test_an_edited_runner_up_is_refused(tmp_path: Path, runner_up_plan: Path,
                                        edit: dict[str, Any], expected: str) -> None:
    bad = _edited(runner_up_plan, tmp_path / "p.json",
                  lambda d: d["hetero"]["search"]["runner_up"].update(edit))
    for cmd in (("validate", bad), ("explain", bad, "stage:0")):
        refused(run(*cmd), f"{bad}: hetero.search.runner_up", expected)
    assert run("explain", runner_up_plan, "stage:0").exit_code == 0


@pytest.fixture(scope="module")
def dp_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dp") / "dp.json"
    result = run("plan", "--workload", WORKLOAD, "-c", "local-cpu", "-b", "8", "--dp", "4",
                 "--no-progress", "-o", out)
    assert result.exit_code == 0, result.output
    return out


def test_run_script_with_model_is_refused(tmp_path: Path, dp_plan: Path) -> None:
    """Was: `--model` dropped from the torchrun command without a word (`--dry-run` exit 0)."""
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    refused(run("run", dp_plan, "--script", script, "--model", "tiny-gpt2", "--dry-run"),
            "--model names the model of the synthetic-data run", "drop --model")
    refused(run("run", dp_plan, "--script", script, "--module", "a.b:c", "--dry-run"),
            "drop --module")


def test_run_script_that_is_not_python_is_refused(tmp_path: Path, dp_plan: Path) -> None:
    """Was accepted (every rank would then fail to run a YAML file as Python)."""
    notes = tmp_path / "cluster.yaml"
    notes.write_text("name: x\n")
    refused(run("run", dp_plan, "--script", notes, "--dry-run"),
            f"--script: {str(notes)!r} is not a Python file (.py)")


def test_chimera_with_too_few_micro_batches_advises_a_smaller_micro_batch() -> None:
    """Was: '... or a larger micro-batch size', where dp=2 leaves 1 micro-batch of 4 and
    Chimera needs an even count: a larger one makes it worse."""
    flat = refused(run("plan", "--workload", WORKLOAD, "-c", "local-cpu", "-b", "8", "--pp",
                       "2", "--schedule", "chimera", "--micro-batch-size", "4",
                       "--no-progress"),
                   "an even number of micro-batches", "a micro-batch size smaller than 4")
    assert "larger micro-batch" not in flat


def _tp2_plan_that_never_launches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """gpt-test planned at tp 2 on the 2:1 CPU cluster (its TP group lists the MLP pairs
    with shards [192, 64]); torchrun patched to fail the test if `run` ever starts it."""
    import hetplan.runtime.launch as launch_module

    def no_launch(*args: object, **kwargs: object) -> None:
        raise AssertionError("torchrun was started for a plan the model refuses")

    monkeypatch.setattr(launch_module, "launch", no_launch)
    good = tmp_path / "good.json"
    result = run("plan", "gpt-test", "-c", CPU_MIXED_2, "-b", "4", "--dp", "1", "--pp", "1",
                 "--tp", "2", "--no-progress", "-o", good)
    assert result.exit_code == 0, result.output
    return good


def test_run_refuses_a_tp_pair_with_different_shard_sizes_before_any_rank_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Was: torchrun started 2 ranks, each refused the plan after capturing the model (~25 s
    on 2 cores) with no field path. Now the launcher refuses it (exit 2) and starts nothing;
    `validate` says it did not check the model, and with --model refuses alike."""
    good = _tp2_plan_that_never_launches(tmp_path, monkeypatch)

    def edit(d: dict[str, Any]) -> None:
        row = d["tensor_parallel"]["groups"][0]["linears"][1]
        assert (row["name"], row["shard_sizes"]) == ("blocks.0.fc2", [192, 64])
        row["shard_sizes"] = [128, 128]

    bad = _edited(good, tmp_path / "p.json", edit)
    expected = ("p.json: tensor_parallel.groups[0].linears[1].shard_sizes: [128, 128], but "
                "linears[0] ('blocks.0.fc1', the column linear of the same Megatron pair",
                "has [192, 64]", "give every linear of the pair the same shard_sizes")
    refused(run("run", bad, "--model", "gpt-test", "--steps", "1"), *expected)
    alone = run("validate", bad)
    assert alone.exit_code == 0, alone.output
    assert "not checked against its model" in " ".join(alone.output.split())
    refused(run("validate", bad, "--model", "gpt-test"), *expected)


def test_run_refuses_an_attention_split_inside_a_head_before_any_rank_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An attention output projection listed with shards that are no multiples of its
    head_dim (gpt-test: 4 heads of 16): the ranks refused it after launch (`head_shards`);
    `run` and `validate --model` read the head sizes off the module and refuse it first."""
    good = _tp2_plan_that_never_launches(tmp_path, monkeypatch)

    def edit(sizes: list[int]) -> Any:
        def apply(d: dict[str, Any]) -> None:
            d["tensor_parallel"]["groups"][0]["linears"].append(
                {"name": "blocks.0.attn.proj", "split": "row", "features": 64,
                 "shard_sizes": sizes})
        return apply

    bad = _edited(good, tmp_path / "p.json", edit([40, 24]))
    n = len(load_plan(bad).tensor_parallel.groups[0].linears) - 1  # type: ignore[union-attr]
    expected = (f"p.json: tensor_parallel.groups[0].linears[{n}].shard_sizes: [40, 24] split "
                "a head: 'blocks.0.attn.proj' is the output projection of an attention module",
                "head_dim 16", "give multiples of 16 summing to 64")
    refused(run("run", bad, "--model", "gpt-test", "--steps", "1"), *expected)
    refused(run("validate", bad, "--model", "gpt-test"), *expected)
    whole = _edited(good, tmp_path / "whole.json", edit([48, 16]))  # 3 heads and 1
    ok = run("validate", whole, "--model", "gpt-test")
    assert ok.exit_code == 0, ok.output


@pytest.mark.parametrize("field", ["skewed_ms", "controller_ms"])
def test_inspect_of_a_tp_prediction_edited_to_zero_ms(tmp_path: Path, field: str) -> None:
    """Was: internal error (TypeError formatting the speedup over 0 ms, which is None)."""
    good = tmp_path / "good.json"
    result = run("plan", "gpt-test", "-c", CPU_MIXED_2, "-b", "4", "--dp", "1", "--pp", "1",
                 "--tp", "2", "--no-progress", "-o", good)
    assert result.exit_code == 0, result.output
    bad = _edited(good, tmp_path / "p.json",
                  lambda d: d["tensor_parallel"]["predicted"].update({field: 0}))
    result = run("inspect", bad, "-s", "tp")
    assert result.exit_code == 0, result.output
    assert "0.000 ms (—)" in result.output or "0.000 ms (—," in result.output, result.output


@pytest.mark.parametrize("engine", ["megatron", "deepspeed", "torchtitan"])
def test_export_of_an_empty_gradient_sync_section(tmp_path: Path, dp_plan: Path,
                                                  engine: str) -> None:
    """An empty section (no strategies, tensors or buckets: every gradient one fp32
    allreduce, as `inspect` and `simulate` read it) was an internal error (StopIteration)
    in `export`; it is exported as a plan without the section is."""
    empty = _edited(dp_plan, tmp_path / "empty.json", lambda d: d.update(gradient_sync={}))
    none = _edited(dp_plan, tmp_path / "none.json", lambda d: d.update(gradient_sync=None))
    results = [run("export", p, "--to", engine, "--json") for p in (empty, none)]
    assert [r.exit_code for r in results] == [0, 0], results[0].output
    a, b = (json.loads(r.output) for r in results)
    assert (a["exported_ms"], a.get("gaps")) == (b["exported_ms"], b.get("gaps"))
