"""A new user's mistakes, round 10 (`docs/decisions/bad-input-round10.md`): each case that
gave a misleading message or a silently wrong result.

Every test here failed before its fix: a `--module` script that exits while imported (its
argparse usage read as hetplan's), an edited plan that no longer fits shown as "near-oom"
and explained as "the only feasible one", `diff` comparing stale stored predictions,
`export` claiming Gemini and SDPipe plans fully expressed, `--hetero` dropping layout pins,
and `explain linear:` suggesting gradient names on a plan without TP linears.
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest

from hetplan.ir.plan import load_plan
from test_bad_input_round7 import GOLDEN, WORKLOAD, refused, run  # the rounds share helpers

CLUSTERS = GOLDEN.parent / "fixtures" / "clusters"


def _plan(out: Path, *options: object) -> Path:
    result = run("plan", "--workload", WORKLOAD, "--no-progress", "-o", out, *options)
    assert result.exit_code == 0, result.output
    return out


def _edited(src: Path, dst: Path, **layout: Any) -> Path:
    data = json.loads(src.read_text())
    data["layout"].update(layout)
    dst.write_text(json.dumps(data))
    return dst


@pytest.fixture(scope="module")
def pp_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _plan(tmp_path_factory.mktemp("pp") / "pp.json", "-c", "local-cpu", "-b", "8",
                 "--dp", "2", "--pp", "2")


@pytest.fixture(scope="module")
def too_big(pp_plan: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The plan with micro-batches of 20000 (10.99 GiB on a 3.6 GiB usable device)."""
    return _edited(pp_plan, tmp_path_factory.mktemp("big") / "big.json",
                   micro_batch_size=20000, global_batch_size=80000)


@pytest.mark.parametrize("where", ["import", "factory"])
def test_a_module_that_exits_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      where: str) -> None:
    """Was: argparse's "usage: hetplan [-h] [--lr LR] / hetplan: error: unrecognized
    arguments" and exit 2, read as hetplan's own parser (or a bare exit 3 for sys.exit(3))."""
    body = """
        import argparse, torch
        def build():
            argparse.ArgumentParser().parse_args(["--lr", "0.1"])
            return torch.nn.Linear(4, 4), (torch.zeros(2, 4),)
        """ if where == "factory" else """
        import sys, torch
        sys.exit(3)
        def build():
            return torch.nn.Linear(4, 4), (torch.zeros(2, 4),)
        """
    (tmp_path / f"exits_{where}.py").write_text(textwrap.dedent(body))
    monkeypatch.chdir(tmp_path)
    what = "the factory 'build'" if where == "factory" else f"importing 'exits_{where}'"
    refused(run("ir", "--module", f"exits_{where}:build"),
            f"--module 'exits_{where}:build': {what} called sys.exit(",
            'move that code under `if __name__ == "__main__":`')


def test_inspect_says_an_edited_plan_does_not_fit(too_big: Path) -> None:
    """Was: "near-oom: 4 rank(s) use >= 90.0% of their usable memory; rank 0 peaks at 305.2%"
    (while `simulate` refuses the plan: it does not fit)."""
    result = run("inspect", too_big)
    assert result.exit_code == 0, result.output
    flat = " ".join(result.output.split())
    assert re.search(r"out-of-memory: the plan does not fit in memory: \d rank\(s\) \([0-3–]+\) "
                     r"need more than their usable memory; rank \d needs", flat), flat
    assert "`hetplan simulate` refuses it" in flat
    assert "near-oom" not in flat
    kinds = [w["kind"] for w in json.loads(run("inspect", too_big, "--json").output)["warnings"]]
    assert "out-of-memory" in kinds


def test_explain_of_a_plan_that_does_not_fit_says_so_in_its_verdict(too_big: Path) -> None:
    """Was: a note "as planned it does not fit in memory", then the verdict "every
    alternative runs out of memory: the plan's choice is the only feasible one"."""
    result = run("explain", too_big, "stage:0")
    assert result.exit_code == 0, result.output
    verdict = " ".join(result.output.split()).split("verdict: ")[1]
    assert verdict.startswith("the plan as written does not fit in memory (note above), and "
                              "neither does any of the 2 alternative(s)"), verdict
    assert "only feasible" not in verdict


def test_diff_compares_re_predicted_plans(pp_plan: Path, too_big: Path) -> None:
    """Was: "iteration time: 7.517 ms -> 7.517 ms (+0.000 ms)" for the plan and its copy
    with a 10,000 times larger batch (the stale stored predictions compared)."""
    result = run("diff", pp_plan, too_big)
    assert result.exit_code == 0, result.output
    flat = " ".join(result.output.split())
    now = run("simulate", too_big, "--json")
    assert now.exit_code == 2  # it no longer fits: simulate refuses it
    assert "(+0.000 ms" not in flat.split("iteration time:")[1].split(")")[0]
    assert "! b: stored prediction" in flat and "is stale" in flat
    d = json.loads(run("diff", pp_plan, too_big, "--json").output)
    it = d["predictions"]["iteration_time_ms"]
    assert it["b"] > 1000 * it["a"]
    assert d["prediction_checks"]["b"]["status"] == "stale" and "a" not in d[
        "prediction_checks"]
    assert json.loads(run("diff", pp_plan, pp_plan, "--json").output)["identical"]


@pytest.mark.parametrize("option,part", [
    (("--checkpoint", "gemini", "--replicas", "2"), "checkpointing"),
    (("--group-sync", "sdpipe"), "group-sync"),
])
def test_export_names_gemini_and_sdpipe(tmp_path: Path, option: tuple[str, ...],
                                        part: str) -> None:
    """Was: "every part of the plan is expressed in megatron" for a plan with Gemini's
    in-memory checkpoints or SDPipe's group sync, which no engine runs."""
    plan = _plan(tmp_path / "p.json", "-c", CLUSTERS / "cpu-4-nodes.yaml", "-b", "8",
                 "--dp", "2", "--pp", "2", *option)
    for engine in ("megatron", "deepspeed", "torchtitan"):
        result = run("export", plan, "--to", engine, "--json")
        assert result.exit_code == 0, result.output
        gaps = {g["part"]: g for g in json.loads(result.output)["gaps"]}
        assert part in gaps, gaps
        assert gaps[part]["worth"] and gaps[part]["iteration_time_ms"] is None
    text = " ".join(run("export", plan, "--to", "megatron").output.split())
    assert "every part of the plan is expressed" not in text


@pytest.mark.parametrize("pins,named", [
    (("--tp", "2"), "--tp 2"),
    (("--schedule", "gpipe"), "--schedule gpipe"),
    (("--zero", "2"), "--zero 2"),
    (("--recompute", "full"), "--recompute full"),
    (("--sp",), "--sp"),
    (("--pp", "2", "--micro-batch-size", "2"), "--pp 2, --micro-batch-size 2"),
])
@pytest.mark.parametrize("mode", ["on", "auto"])
def test_hetero_refuses_the_pins_its_search_drops(pins: tuple[str, ...], named: str,
                                                  mode: str) -> None:
    """Was: `--tp 2 --hetero on` on local-cpu wrote a dp 2 x tp 1 plan on 2 of the 4 ranks;
    `--schedule gpipe`, `--zero 2`, `--recompute full` vanished alike (the heterogeneous
    search takes none of them)."""
    refused(run("plan", "--workload", WORKLOAD, "-c", "local-cpu", "-b", "8", "--no-progress",
                "--hetero", mode, *pins),
            f"{named} with --hetero {mode}: the heterogeneous search chooses each stage's",
            "use --hetero off to plan with them")


def test_hetero_without_pins_still_plans(tmp_path: Path) -> None:
    out = _plan(tmp_path / "h.json", "-c", "local-cpu", "-b", "8", "--hetero", "on",
                "--schedule", "auto")
    assert load_plan(out).hetero is not None


def test_explain_linear_on_a_plan_without_tp_linears(pp_plan: Path) -> None:
    """Was: "unknown target 'linear:blocks.0.fc1'; did you mean 'blocks.0.fc1.bias', ..."
    (gradient names, for a plan that lists no linear at all)."""
    refused(run("explain", pp_plan, "linear:blocks.0.fc1"),
            "the plan lists no linear with shard sizes", "no tensor parallelism, tp=1",
            "explain stage:K or rank:R instead")
