"""`hetplan plan --hetero`, `inspect` and `explain stage:K` on heterogeneous plans (gpt-test on
mixed-tp-node, where the searched pipeline beats compile()'s plan)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hetplan.cli import app
from hetplan.ir.plan import load_plan

runner = CliRunner()


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for mode in ("off", "auto", "on"):
        path = tmp_path_factory.mktemp("hetero") / f"{mode}.json"
        res = runner.invoke(app, ["plan", "gpt-test", "--cluster", "mixed-tp-node",
                                  "--batch-size", "64", "--hetero", mode, "-o", str(path)])
        assert res.exit_code == 0, res.output
        out[mode] = path
    return out


def test_auto_takes_the_faster_of_the_two_and_says_so(plans: dict[str, Path]) -> None:
    off, auto, on = (load_plan(plans[m]) for m in ("off", "auto", "on"))
    assert off.hetero is None and on.hetero is not None
    t = {m: p.predictions.iteration_time_ms for m, p in (("off", off), ("on", on))
         if p.predictions is not None}
    assert auto.predictions is not None
    assert auto.predictions.iteration_time_ms == min(t.values())
    assert (auto.hetero is not None) == (t["on"] < t["off"])
    choice = [e for e in auto.pass_log if e.name == "hetero-choice"]
    assert choice and "compile()'s" in choice[0].notes[0]


def test_inspect_shows_each_stages_devices_and_degrees(plans: dict[str, Path]) -> None:
    plan = load_plan(plans["on"])
    assert plan.hetero is not None
    res = runner.invoke(app, ["inspect", str(plans["on"]), "--json", "-s", "layout"])
    assert res.exit_code == 0, res.output
    lay = json.loads(res.output)["layout"]
    rows = lay["hetero"]["stages"]
    assert [(r["device_class"], r["dp"], r["tp"]) for r in rows] == [
        (s.device_class, s.dp, s.tp) for s in plan.hetero.stages]
    assert lay["ranks_used"] == sum(len(st.ranks) for st in plan.stages)
    text = runner.invoke(app, ["inspect", str(plans["on"]), "-s", "layout"]).output
    for s in plan.hetero.stages:
        assert f"{s.device_class} (ranks" in text and f"dp {s.dp} x tp {s.tp}" in text
    # the layout line read "layout: dp=1 pp=2 tp=1" (the layout's placeholders) above
    # stages of dp 2 or more
    flat = " ".join(text.split())
    assert (f"layout: pp={len(plan.hetero.stages)} with each stage's own dp x tp (below), "
            "schedule") in flat
    assert "(through the pipeline, split over each stage's replicas)" in flat
    assert "layout: dp=" not in flat


def test_inspect_strategy_line_gives_each_stages_zero_stage(tmp_path: Path) -> None:
    """The line read the layout's zero_stage, which a heterogeneous plan leaves at 0: "no
    ZeRO" under a stage listed as ZeRO-1."""
    path = tmp_path / "plan.json"
    res = runner.invoke(app, ["plan", "gpt-test", "-c", "local-cpu", "-b", "8", "--hetero",
                              "on", "-o", str(path)])
    assert res.exit_code == 0, res.output
    plan = load_plan(path)
    assert plan.hetero is not None
    zeros = [s.zero_stage for s in plan.hetero.stages]
    assert any(zeros), zeros  # the case the line got wrong
    text = runner.invoke(app, ["inspect", str(path), "-s", "layout"]).output
    line = next(x for x in text.splitlines() if x.startswith("strategy:"))
    assert "no ZeRO" not in line and "ZeRO per stage " + " ".join(map(str, zeros)) in line


def test_explain_stage_re_predicts_the_runner_up(plans: dict[str, Path]) -> None:
    plan = load_plan(plans["on"])
    assert plan.hetero is not None and plan.predictions is not None
    res = runner.invoke(app, ["explain", str(plans["on"]), "stage:0", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["current_ms"] == pytest.approx(plan.predictions.iteration_time_ms, abs=1e-6)
    runner_up = plan.hetero.search.runner_up
    if runner_up is not None:  # re-predicted, equal to what the search recorded
        (alt,) = data["alternatives"]
        assert alt["iteration_time_ms"] == pytest.approx(runner_up.iteration_time_ms, abs=1e-6)
        assert alt["delta_ms"] >= 0  # the search chose the faster order
    bad = runner.invoke(app, ["explain", str(plans["on"]), "bucket:0"])
    assert bad.exit_code != 0 and "stage:K only" in bad.output


def test_bad_hetero_value_names_the_option() -> None:
    res = runner.invoke(app, ["plan", "gpt-test", "--cluster", "mixed-tp-node",
                              "--batch-size", "64", "--hetero", "yes"])
    assert res.exit_code != 0 and "--hetero must be off, auto or on" in res.output
