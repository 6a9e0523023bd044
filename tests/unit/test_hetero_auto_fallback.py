"""``--hetero auto`` keeps ``compile()``'s plan when a pass refuses the heterogeneous one
(as it does when no heterogeneous pipeline fits); ``--hetero on`` still fails with the
pass's message."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from hetplan.cli import app
from hetplan.ir.plan import load_plan

CLUSTER = Path(__file__).parents[1] / "fixtures" / "clusters" / "cpu-hetero-3.yaml"
#: DynPipe's re-packing releases stages: refused on per-stage degrees, run on compile()'s plan
REPACK = {"total_iterations": 1000, "rebalance": {"repack": True},
          "pruning": {"final_sparsity": 0.9, "start_iteration": 100, "frequency": 100,
                      "steps": 3}}


def test_hetero_auto_keeps_the_plan_a_pass_refuses_the_heterogeneous_one_of(
        tmp_path: Path) -> None:
    dyn, out = tmp_path / "repack.json", tmp_path / "plan.json"
    dyn.write_text(json.dumps(REPACK))
    args = ["plan", "gpt-test", "--cluster", str(CLUSTER), "--batch-size", "3", "--dtype",
            "fp32", "--dynamics", str(dyn), "--no-progress"]
    runner = CliRunner()
    res = runner.invoke(app, [*args, "--hetero", "auto", "-o", str(out)])
    assert res.exit_code == 0, res.output
    plan = load_plan(out)
    assert plan.hetero is None and plan.rebalancing is not None
    note = [e for e in plan.pass_log if e.name == "hetero-choice"][0].notes[0]
    assert "repack" in note and "kept compile()'s plan" in note
    res = runner.invoke(app, [*args, "--hetero", "on"])
    assert res.exit_code != 0 and "repack" in " ".join(res.output.split())
