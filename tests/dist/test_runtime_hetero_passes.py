"""A heterogeneous plan carrying the per-stage pass sections runs under ``hetplan run``.

``hetplan plan --hetero on --tp-controller zero --dynamics F`` on
``tests/fixtures/clusters/cpu-hetero-3.yaml`` (gpt-test, batch 3: ``cpu@fast 1x1 |
cpu@slow 1x2``) writes a ``tensor_parallel`` section with the ZERO controller in stage 1's
TP group (ranks 1-2) and a ``rebalancing`` section whose events the trigger did not apply
(the moves do not pay on this model). ``hetplan run`` (torchrun, 3 gloo ranks) trains it and
its losses equal a single-process replay (same synthetic batches, model and optimizer as the
worker's): the controller, with no straggler, prunes nothing. An applied re-balancing event
on a plan with per-stage degrees is refused by the runtime's preflight
(``hetero_refusals``), which the last assertion shows.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hetplan.ir.plan import load_plan
from hetplan.runtime.hetero_ranks import hetero_refusals

pytestmark = pytest.mark.dist

CLUSTER = Path(__file__).parents[1] / "fixtures" / "clusters" / "cpu-hetero-3.yaml"
NAME = "gpt-test"
PRUNE = {"total_iterations": 1000, "pruning": {"final_sparsity": 0.9, "start_iteration": 100,
                                               "frequency": 100, "steps": 3}}


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hetplan.cli", *args], capture_output=True,
                          text=True, timeout=300, check=False)


def test_hetplan_run_on_a_hetero_plan_with_per_stage_pass_sections(tmp_path: Path) -> None:
    from hetplan.runtime.executor import _default_loss, plan_optimizer
    from hetplan.runtime.worker import build_model, make_target, synthetic_batch

    dyn, path, report = tmp_path / "prune.json", tmp_path / "plan.json", tmp_path / "r.json"
    dyn.write_text(json.dumps(PRUNE))
    proc = _cli("plan", NAME, "--cluster", str(CLUSTER), "--batch-size", "3", "--hetero", "on",
                "--tp-controller", "zero", "--dynamics", str(dyn), "-o", str(path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = load_plan(path)
    assert plan.hetero is not None and plan.hetero.describe() == "cpu@fast 1x1 | cpu@slow 1x2"
    tp, reb = plan.tensor_parallel, plan.rebalancing
    assert tp is not None and tp.controller.variant == "zero"
    assert [(g.stage, g.ranks) for g in tp.groups] == [(1, (1, 2))]
    assert reb is not None and reb.events and not any(e.applied for e in reb.events)
    proc = _cli("run", str(path), "--model", NAME, "--steps", "1", "--report", str(report))
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(report.read_text())
    assert data["world_size"] == 3

    model, args, kwargs = build_model(NAME, None, 0)
    assert plan.cost_settings is not None
    opt = plan_optimizer(plan.cost_settings.optimizer)(list(model.parameters()))
    target_of = make_target(model, args, kwargs)
    want = []
    for step in range(3):  # 2 warm-up steps and 1 timed one
        xs = synthetic_batch(args, 3, step)
        loss = _default_loss(model(*xs), target_of(xs, 3))
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(float(loss.detach()))
    assert data["loss_per_step"] == pytest.approx(want, rel=1e-4)

    applied = reb.model_copy(update={"events": (reb.events[0].model_copy(
        update={"applied": True}),)})
    refused = hetero_refusals(plan.model_copy(update={"rebalancing": applied}))
    assert refused and refused[0].startswith("rebalancing: moving layers between stages")
