"""A new user's mistakes, round 9 (`docs/decisions/bad-input-round9.md`, "Options and
fields"): hand-edited plans that every command took and a `hetplan run` option it dropped.

Every test here failed before its fix: a heterogeneous stage's device class that its ranks
do not have, `--script` with `--model` (the model silently dropped) or with a file that is
no Python script, and advice that sent a user with a pinned micro-batch size the wrong way.
(A TP linear listed twice in its group: `tests/unit/test_plan_checks_round9.py`.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hetplan.ir.plan import load_plan
from test_bad_input_round7 import WORKLOAD, refused, run  # the rounds share their helpers


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
