"""A heterogeneous plan carrying the per-stage pass sections runs under ``hetplan run``, and
an applied re-balancing event moves layers between its stages of different degrees.

``hetplan plan --hetero on --tp-controller zero --dynamics F`` on
``tests/fixtures/clusters/cpu-hetero-3.yaml`` (gpt-test, batch 3: ``cpu@fast 1x1 |
cpu@slow 1x2``) writes a ``tensor_parallel`` section with the ZERO controller in stage 1's
TP group (ranks 1-2) and a ``rebalancing`` section whose events the trigger did not apply
(the moves do not pay on this model). ``hetplan run`` (torchrun, 3 gloo ranks) trains it and
its losses equal a single-process replay (same synthetic batches, model and optimizer as the
worker's): the controller, with no straggler, prunes nothing. What the runtime still refuses
of an applied event on per-stage degrees (the controller beside it) is named by its
preflight (``hetero_refusals``), which the last assertions show.

**Moves across the tp boundary** (:func:`test_applied_events_move_layers_across_tp`): the
searched plan (``cpu@fast 1x1 | cpu@slow 1x2``, layers 0-4 | 5-7) and the same plan with its
stages' devices swapped (``cpu@slow 1x2 | cpu@fast 1x1``) and the plan searched for batch 6
(``cpu@fast 1x1 | cpu@slow 2x1``, its dp-2 stage under ZeRO-1: both replicas of stage 1 get
their own copy of an entering layer, its Adam state is gathered from and cut into the
replicas' chunks of the sharded optimizer, and its gradients are averaged over them) get two
applied events: after
iteration 1 layer 4 (``blocks.2``) moves to the next stage (0-3 | 4-7), after iteration 3
layers 4-5 (``blocks.2``, ``blocks.3``) move to the first stage (0-5 | 6-7). So each case
of the first two moves a layer into the tp-2 stage (split as its attention and MLP shard it)
and out of it (gathered), in one order or the other. The float64 model trains ``MOVE_STEPS`` Adam steps
(whose moments and step count move with the layers); the last stage's loss per step and
every parameter at the end (gathered from the TP shards) equal a single-process reference
to ``rtol 1e-9, atol 1e-11``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from typing import Any

import pytest
import torch
from reflib import (CLUSTERS, case_results, run_each, searched_hetero, train_reference,
                    zoo_ids, zoo_model)
from torch import nn

from hetplan.ir.plan import Plan, load_plan
from hetplan.ir.plan_checks import plan_problems
from hetplan.ir.rebalancing import PlannedEvent, RebalancePolicy, Rebalancing
from hetplan.profiling._spawn import run_local_ranks
from hetplan.runtime.hetero_ranks import hetero_refusals

pytestmark = pytest.mark.dist

CLUSTER = CLUSTERS / "cpu-hetero-3.yaml"
NAME = "gpt-test"
PRUNE = {"total_iterations": 1000, "pruning": {"final_sparsity": 0.9, "start_iteration": 100,
                                               "frequency": 100, "steps": 3}}


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hetplan.cli", *args], capture_output=True,
                          text=True, timeout=300, check=False)


def test_hetplan_run_on_a_hetero_plan_with_per_stage_pass_sections(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from hetplan.cli import app
    from hetplan.runtime.executor import _default_loss, plan_optimizer
    from hetplan.runtime.worker import build_model, make_target, synthetic_batch

    dyn, path, report = tmp_path / "prune.json", tmp_path / "plan.json", tmp_path / "r.json"
    dyn.write_text(json.dumps(PRUNE))
    # in-process: planning needs no fresh interpreter (`hetplan run` below starts one)
    planned = CliRunner().invoke(app, ["plan", NAME, "--cluster", str(CLUSTER), "--batch-size",
                                       "3", "--hetero", "on", "--tp-controller", "zero",
                                       "--dynamics", str(dyn), "-o", str(path)])
    assert planned.exit_code == 0, planned.output[-3000:]
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
    with_controller = plan.model_copy(update={"rebalancing": applied})
    assert [r.split(":")[0] for r in hetero_refusals(with_controller)] == [
        "tensor_parallel.controller"]
    assert hetero_refusals(with_controller.model_copy(update={"tensor_parallel": None})) == []


# -- applied events across the tp boundary ------------------------------------------------
MOVE_STEPS, SEQ, VOCAB = 5, 32, 64
TOL = {"rtol": 1e-9, "atol": 1e-11}
#: (iteration, bounds): blocks.2 to the second stage, then blocks.2-3 to the first
EVENTS = ((1, ((0, 3), (4, 7))), (3, ((0, 5), (6, 7))))


def _data(step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11 + step)
    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _adam(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def _reference(batch: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    return train_reference(NAME, lambda step: _data(step, batch), _adam, MOVE_STEPS)


def _with_events(plan: Plan) -> Plan:
    """``plan`` with the applied events of :data:`EVENTS`, validated."""
    events = tuple(PlannedEvent(iteration=it, label=f"move {i}", stages=bounds, applied=True)
                   for i, (it, bounds) in enumerate(EVENTS))
    reb = Rebalancing(policy=RebalancePolicy(), total_iterations=MOVE_STEPS, events=events)
    data = plan.model_copy(update={"rebalancing": reb}).model_dump(mode="json")
    out = Plan.model_validate(data)
    assert plan_problems(out) == [] and hetero_refusals(out) == []
    return out


def _searched(batch: int, swap: bool) -> Plan:
    """The plan ``hetplan plan --hetero on`` searches for ``batch`` (float64 model); with
    ``swap``, its stages' devices and degrees exchanged (the tp-2 stage first). Batch 6
    keeps the LM head whole (split by vocabulary, it makes tp 2 the cheaper shape for the
    slow pair at batch 6 too; this case is the dp-2 stage)."""
    plan = searched_hetero(NAME, CLUSTER, batch, vocab_parallel=batch != 6)
    if swap:
        assert plan.hetero is not None
        a, b = plan.stages
        sa, sb = plan.hetero.stages
        plan = plan.model_copy(update={
            "stages": (a.model_copy(update={"ranks": b.ranks}),
                       b.model_copy(update={"ranks": a.ranks})),
            "hetero": plan.hetero.model_copy(update={"stages": (
                sb.model_copy(update={"stage": 0}), sa.model_copy(update={"stage": 1}))})})
    return _with_events(plan)


def _train(case: tuple[int, str]) -> dict[str, Any]:
    batch, plan_json = case
    from hetplan.runtime.executor import Runtime

    rt = Runtime(Plan.from_json(plan_json), zoo_model(NAME), example_args=zoo_ids(NAME),
                 loss_fn=_loss, optimizer=_adam)
    try:
        losses = [rt.train_step(*_data(step, batch)) for step in range(MOVE_STEPS)]
        params = {n: p.detach().clone() for n, p in rt.named_params}
        mine = {id(p) for _, p in rt.named_params}
        sharded = []
        for mname, module in rt.model.named_modules():
            if not any(id(p) in mine for p in module.parameters(recurse=False)):
                continue
            if hasattr(module, "gather_weight"):
                sharded.append(mname)
                params[f"{mname}.weight"] = module.gather_weight()
                if getattr(module, "bias", None) is not None:
                    params[f"{mname}.bias"] = module.gather_bias()
        assert rt.ctx.groups is not None
        return {"losses": losses, "params": params, "stage": rt.ctx.groups.pp_rank,
                "sharded": sharded, "rebalanced_at": list(rt.rebalanced_at),
                "skipped": len(rt.skipped_events),
                "optimizer": (type(rt.opt).__name__, getattr(rt.opt, "world", 1))}
    finally:
        rt.close()


def _rank(rank: int, world: int, cases: dict[str, tuple[int, str]]
          ) -> dict[str, dict[str, Any]]:
    torch.set_num_threads(1)
    return run_each(cases, _train)


#: label -> (batch, swap the stages' devices, the plan's shapes)
MOVE_CASES = {"tp1-tp2": (3, False, "cpu@fast 1x1 | cpu@slow 1x2"),
              "tp2-tp1": (3, True, "cpu@slow 1x2 | cpu@fast 1x1"),
              "dp1-dp2": (6, False, "cpu@fast 1x1 | cpu@slow 2x1")}


@pytest.fixture(scope="module")
def moved() -> list[dict[str, dict[str, Any]]]:
    """The plans trained one after the other in one 3-rank group."""
    cases = {}
    for label, (batch, swap, describe) in MOVE_CASES.items():
        plan = _searched(batch, swap)
        assert plan.hetero is not None and plan.hetero.describe() == describe
        assert [h.zero_stage for h in plan.hetero.stages] == [0, 1 if batch == 6 else 0]
        cases[label] = (batch, plan.to_json())
    return run_local_ranks(_rank, 3, (cases,), timeout_s=300, threads_per_process=1)


@pytest.mark.parametrize("label", sorted(MOVE_CASES))
def test_applied_events_move_layers_across_tp(moved: list[dict[str, dict[str, Any]]],
                                              label: str) -> None:
    got = case_results(moved, label)
    assert [g["rebalanced_at"] for g in got] == [[1, 3]] * 3
    assert [g["skipped"] for g in got] == [0] * 3
    if label == "dp1-dp2":  # ZeRO-1 over stage 1's two replicas, rebuilt after each move
        assert [g["optimizer"] for g in got] == [("Adam", 1)] + [("ShardedOptimizer", 2)] * 2
    batch, swap, _ = MOVE_CASES[label]
    losses, ref = _reference(batch)
    last = [g["losses"] for g in got if g["stage"] == 1]
    assert all(x != x for g in got if g["stage"] == 0 for x in g["losses"])
    assert [sum(xs) / len(xs) for xs in zip(*last)] == pytest.approx(losses, rel=1e-9)
    seen: set[str] = set()
    for g in got:
        for n, value in g["params"].items():
            if n in ref:
                torch.testing.assert_close(value, ref[n], **TOL, msg=lambda m, n=n: f"{n}: {m}")
                seen.add(n)
    assert seen == set(ref), f"unchecked: {sorted(set(ref) - seen)}"
    # after the last event the first stage holds blocks.0-3, the second none; where the
    # first stage is the tp-2 one, the blocks that moved into it run sharded
    for g in got:
        held = {".".join(n.split(".")[:2]) for n in g["params"] if n.startswith("blocks.")}
        assert held == ({f"blocks.{i}" for i in range(4)} if g["stage"] == 0 else set())
        if swap and g["stage"] == 0:
            assert {"blocks.2.attn.qkv", "blocks.3.attn.qkv", "blocks.3.fc1",
                    "blocks.3.fc2"} <= set(g["sharded"])
