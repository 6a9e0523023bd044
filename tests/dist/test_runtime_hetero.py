"""A pipeline whose stages have their own data- and tensor-parallel degrees (the plan's
``hetero`` section) runs on gloo (3 ranks) and equals a single-process reference.

The plans come from the planner's own search (``compile()`` then ``choose_hetero(..., "on")``,
what ``hetplan plan --hetero on`` runs) on ``tests/fixtures/clusters/cpu-hetero-3.yaml``: a
node with one fast CPU device and a node with two 3x slower ones. For gpt-test (4 layers,
dim 64, sequence 32) the search picks

- global batch 3: ``cpu@fast 1x1 | cpu@slow 1x2`` (stage 0 at tp 1 on rank 0, stage 1 at
  tp 2 on ranks 1-2), 3 micro-batches of 1 row: stage 0 sends the whole activation to both
  TP ranks of stage 1, and one copy of the input gradient comes back;
- global batch 6: ``cpu@fast 1x1 | cpu@slow 2x1`` (stage 1 at dp 2): each micro-batch's
  rows are split between stage 1's replicas, whose gradients are averaged over stage 1's
  own data-parallel group;
- the batch-3 plan with its stages reversed (``cpu@slow 1x2 | cpu@fast 1x1``, built from
  the searched one and checked by the plan's validator): TP rank 0 of stage 0 sends, and
  the gradient returns to both TP ranks.

The float64 model (eval mode) trains ``STEPS`` SGD steps; the last stage's loss per step and
every parameter (gathered from the tensor-parallel shards) equal the reference to ``rtol
1e-9, atol 1e-11`` (only the summation order differs). A third test runs ``hetplan run`` on
the CLI's own plan (batch 3) for 2 steps and checks the run report's loss per step against
a single-process replay of the worker's synthetic data and optimizer (``rtol 1e-4``: the
report rounds to 6 digits, fp32).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from reflib import (CLUSTERS, case_results, run_each, searched_hetero, train_reference,
                    zoo_ids, zoo_model)
import torch.distributed as dist
from torch import nn

from hetplan.ir.plan import Plan, load_plan
from hetplan.ir.plan_checks import plan_problems
from hetplan.profiling._spawn import run_local_ranks

pytestmark = pytest.mark.dist

NAME, SEQ, VOCAB, STEPS = "gpt-test", 32, 64, 2
TOL = {"rtol": 1e-9, "atol": 1e-11}
CLUSTER = CLUSTERS / "cpu-hetero-3.yaml"


def _data(step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7 + step)
    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05)


def _reference(batch: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    return train_reference(NAME, lambda step: _data(step, batch), _sgd, STEPS)


def _plan(batch: int) -> Plan:
    """The searched heterogeneous plan for ``batch``, as ``hetplan plan --hetero on`` makes
    it (for the float64 model, whose fingerprint the runtime checks). Batch 6 keeps the LM
    head whole (``vocab_parallel=False``): split by vocabulary, the head makes tp 2 the
    cheaper shape for the slow pair at batch 6 too, and this case is the dp-2 stage."""
    plan = searched_hetero(NAME, CLUSTER, batch, vocab_parallel=batch != 6)
    assert plan_problems(plan) == []
    return plan


def _reversed(plan: Plan) -> Plan:
    """``plan`` with the stages' devices and degrees swapped (stage 0 on the tp-2 pair,
    stage 1 on the single rank), validated by the plan's one validator: the boundary the
    search did not pick, from a tensor-parallel sender to a tp-1 receiver."""
    assert plan.hetero is not None
    a, b = plan.stages
    sa, sb = plan.hetero.stages
    stages = (a.model_copy(update={"ranks": b.ranks}), b.model_copy(update={"ranks": a.ranks}))
    shapes = (sb.model_copy(update={"stage": 0}), sa.model_copy(update={"stage": 1}))
    data = plan.model_copy(update={
        "stages": stages, "hetero": plan.hetero.model_copy(update={"stages": shapes})}
    ).model_dump(mode="json")
    return Plan.model_validate(data)


def _train(case: tuple[int, str]) -> dict[str, Any]:
    batch, plan_json = case
    from hetplan.runtime.executor import Runtime

    rt = Runtime(Plan.from_json(plan_json), zoo_model(NAME), example_args=zoo_ids(NAME),
                 loss_fn=_loss, optimizer=_sgd)
    p2p: list[tuple[str, int, str]] = []  # (send or receive, peer, group) in posting order
    names = {id(rt.ctx.groups.fwd_group): "fwd", id(rt.ctx.groups.bwd_group): "bwd",
             id(None): "default"}
    isend, recv = dist.isend, dist.recv

    def logged(kind: str, real: Any) -> Any:
        def call(t: torch.Tensor, peer: int, group: Any = None, **kw: Any) -> Any:
            p2p.append((kind, peer, names.get(id(group), "other")))
            return real(t, peer, group, **kw)
        return call

    dist.isend, dist.recv = logged("S", isend), logged("R", recv)
    try:
        losses = [rt.train_step(*_data(step, batch)) for step in range(STEPS)]
        dist.isend, dist.recv = isend, recv
        params = {n: p.detach().clone() for n, p in rt.named_params}
        mine = {id(p) for _, p in rt.named_params}
        for mname, module in rt.model.named_modules():
            if not any(id(p) in mine for p in module.parameters(recurse=False)):
                continue
            if hasattr(module, "gather_weight"):
                params[f"{mname}.weight"] = module.gather_weight()
                if getattr(module, "bias", None) is not None:
                    params[f"{mname}.bias"] = module.gather_bias()
        g = rt.ctx.groups
        return {"losses": losses, "params": params, "p2p": p2p,
                "coords": (g.pp_rank, g.dp_rank, g.tp_rank, g.tp_ranks, g.dp_ranks),
                "sharded": sorted({type(m).__name__ for m in rt.model.modules()
                                   if hasattr(m, "gather_weight")})}
    finally:
        dist.isend, dist.recv = isend, recv
        rt.close()


def _rank(rank: int, world: int, cases: dict[str, tuple[int, str]]
          ) -> dict[str, dict[str, Any]]:
    torch.set_num_threads(1)
    return run_each(cases, _train)


#: label -> (batch, describe); ``batch < 0``: the searched plan of ``-batch`` with its stages
#: reversed
CASES = {"tp1-tp2": (3, "cpu@fast 1x1 | cpu@slow 1x2"),
         "dp1-dp2": (6, "cpu@fast 1x1 | cpu@slow 2x1"),
         "tp2-tp1": (-3, "cpu@slow 1x2 | cpu@fast 1x1")}


@pytest.fixture(scope="module")
def results() -> list[dict[str, dict[str, Any]]]:
    """The three plans trained one after another in one 3-rank group (``reflib.run_each``,
    docs/decisions/test-budget.md)."""
    cases = {}
    for label, (batch, describe) in CASES.items():
        plan = _plan(abs(batch)) if batch > 0 else _reversed(_plan(-batch))
        assert plan.hetero is not None and plan.hetero.describe() == describe
        cases[label] = (abs(batch), plan.to_json())
    return run_local_ranks(_rank, 3, (cases,), timeout_s=300, threads_per_process=1)


@pytest.mark.parametrize(
    ("label", "coords"),
    [
        ("tp1-tp2",
         [(0, 0, 0, (0,), (0,)), (1, 0, 0, (1, 2), (1,)), (1, 0, 1, (1, 2), (2,))]),
        ("dp1-dp2",
         [(0, 0, 0, (0,), (0,)), (1, 0, 0, (1,), (1, 2)), (1, 1, 0, (2,), (1, 2))]),
        ("tp2-tp1",
         [(1, 0, 0, (0,), (0,)), (0, 0, 0, (1, 2), (1,)), (0, 0, 1, (1, 2), (2,))]),
    ],
)
def test_hetero_stages_equal_reference(results: list[dict[str, dict[str, Any]]], label: str,
                                       coords: list[tuple]) -> None:
    batch, describe = abs(CASES[label][0]), CASES[label][1]
    got = case_results(results, label)
    assert [g["coords"] for g in got] == coords
    losses, ref = _reference(batch)
    last = [g["losses"] for g, c in zip(got, coords) if c[0] == 1]
    assert all(x != x for g, c in zip(got, coords) if c[0] == 0 for x in g["losses"])
    # each last-stage replica's loss is the mean over its rows: their mean is the batch's
    mean = [sum(xs) / len(xs) for xs in zip(*last)]
    assert mean == pytest.approx(losses, rel=1e-9)
    seen: set[str] = set()
    for g in got:
        for n, value in g["params"].items():
            if n in ref:
                torch.testing.assert_close(value, ref[n], **TOL, msg=lambda m, n=n: f"{n}: {m}")
                seen.add(n)
    assert seen == set(ref), f"unchecked: {sorted(set(ref) - seen)}"
    if describe.count("1x2"):  # the tp-2 stage's ranks ran sharded layers
        assert "FusedColumnParallelLinear" in got[1]["sharded"]


@pytest.mark.parametrize("label", list(CASES))
def test_point_to_point_posts_in_the_same_order_on_both_ends(
        results: list[dict[str, dict[str, Any]]], label: str) -> None:
    """What NCCL needs (CPU tests run gloo, whose tags match messages in any order): between
    two ranks, in one group, the operations run in the order each rank posts them, so the
    k-th operation one rank posts towards the other must be a send where the other's k-th
    is a receive. With activations and gradients on one group, 1F1B broke that: stage 0
    posts the second micro-batch's activation before the first one's gradient receive,
    stage 1 the gradient's send before that activation's receive; each waits for the
    other."""
    got = case_results(results, label)
    seqs: dict[tuple[int, int, str], list[str]] = {}
    for rank, g in enumerate(got):
        for kind, peer, group in g["p2p"]:
            seqs.setdefault((rank, peer, group), []).append(kind)
    assert seqs
    for (a, b, group), mine in seqs.items():
        theirs = ["S" if k == "R" else "R" for k in seqs.get((b, a, group), [])]
        assert mine == theirs, f"ranks {a} -> {b} on {group}: {mine} against {theirs}"
    assert {group for _, _, group in seqs} == {"fwd", "bwd"}


def test_hetplan_run_on_the_clis_hetero_plan(tmp_path: Path) -> None:
    """``hetplan plan --hetero on`` then ``hetplan run`` (torchrun, 3 ranks): the report's
    loss per step is the single-process replay's (same synthetic batches, model and
    optimizer as the worker's)."""
    import subprocess
    import sys

    from typer.testing import CliRunner

    from hetplan.cli import app
    from hetplan.runtime.executor import _default_loss, plan_optimizer
    from hetplan.runtime.worker import build_model, make_target, synthetic_batch

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "hetplan.cli", *args], capture_output=True,
                              text=True, timeout=300, check=False)

    path, report = tmp_path / "plan.json", tmp_path / "report.json"
    # in-process: planning needs no fresh interpreter (`hetplan run` below starts one)
    planned = CliRunner().invoke(app, ["plan", NAME, "--cluster", str(CLUSTER), "--batch-size",
                                       "3", "--hetero", "on", "-o", str(path)])
    assert planned.exit_code == 0, planned.output[-3000:]
    plan = load_plan(path)
    assert plan.hetero is not None and plan.hetero.describe() == "cpu@fast 1x1 | cpu@slow 1x2"
    proc = cli("run", str(path), "--model", NAME, "--steps", "1", "--report", str(report))
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(report.read_text())
    assert data["world_size"] == 3 and data["steps"] == 1

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
