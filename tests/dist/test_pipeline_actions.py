"""The runtime executes the plan's per-rank pipeline action lists (gloo, CPU, 2 processes).

Every rank records the actions its stages executed in every step and they must equal the
plan's list for its pipeline rank — for compiled gpipe and 1f1b plans, a hand-built
interleaved-1f1b plan (two chunks per rank), and a plan whose lists differ from the generated
ones (so the runtime cannot be regenerating them). Losses and parameters still equal a
single-process float64 reference. A pipeline peer that stops answering makes the waiting
rank fail with the group's timeout instead of hanging.

The four plans train one after another in one process group; the silent peer gets its own.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from reflib import Blocks, case_results, run_each
from torch import nn

import hetplan
from hetplan import zoo
from hetplan.algorithms.pipeline_schedules import build_schedule, layout_actions
from hetplan.ir.capture import capture
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import ClusterRef, Layout, ModelRef, PipelineActions, Stage
from hetplan.profiling._spawn import run_local_ranks

pytestmark = pytest.mark.dist

STEPS, BATCH, MICRO_BATCHES, LR = 2, 8, 4, 0.1
TOL = {"rtol": 1e-9, "atol": 1e-11}


# -- models and references ----------------------------------------------------------------------
def _blocks() -> nn.Module:
    torch.manual_seed(0)
    return Blocks().double()


def _gpt() -> nn.Module:
    return zoo.build("gpt-test", device="cpu", seed=0, dtype=torch.float64)


def _lm_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    out = getattr(out, "logits", out)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


MODELS: dict[str, Any] = {
    "blocks": (_blocks, F.mse_loss, lambda g: (
        torch.randn(BATCH, 8, generator=g, dtype=torch.float64),
        torch.randn(BATCH, 3, generator=g, dtype=torch.float64))),
    "gpt": (_gpt, _lm_loss, lambda g: (
        (ids := torch.randint(0, 256, (BATCH, 32), generator=g)), torch.roll(ids, -1, dims=1))),
}


def _data(name: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return MODELS[name][2](torch.Generator().manual_seed(50 + step))


def _example(name: str) -> tuple[tuple, dict]:
    if name == "gpt":
        return zoo.example_inputs("gpt-test", batch=1, device="cpu")
    return (torch.zeros(1, 8, dtype=torch.float64),), {}


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR)


@functools.cache
def _reference(name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    build, loss_fn, _ = MODELS[name]
    model = build()
    opt = _sgd(list(model.parameters()))
    losses = []
    for step in range(STEPS):
        x, y = _data(name, step)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


# -- plans ----------------------------------------------------------------------------------------
def _cluster() -> ClusterSpec:
    spec = ClusterSpec.from_preset("local-cpu").model_dump(mode="json")
    spec["nodes"][0]["devices"] = [{"type": "cpu", "count": 2}]
    return ClusterSpec.from_dict(spec)


def _compiled(schedule: str) -> Plan:
    ir = hetplan.capture(_gpt(), *_example("gpt"), name="gpt-test")
    plan = hetplan.compile(ir, _cluster(), batch_size=BATCH, schedule=schedule, dp=1, pp=2,
                           tp=1, micro_batch_size=BATCH // MICRO_BATCHES)
    assert plan.layout is not None and plan.layout.micro_batches == MICRO_BATCHES
    return plan


def _hand(schedule: str, cuts: tuple[int, ...], virtual: int = 1,
          ranks: tuple[str, ...] | None = None) -> Plan:
    """A plan for :class:`Blocks` on 2 pipeline ranks cut before the layers ``cuts``; stage
    ``s`` on pipeline rank ``s % 2``; ``ranks``: action lists replacing the generated ones."""
    ir = capture(_blocks(), _example("blocks")[0][0])
    names = [lay.name for lay in ir.layers]
    bounds = [0, *cuts, len(names)]
    layout = Layout(pp=2, micro_batches=MICRO_BATCHES, micro_batch_size=BATCH // MICRO_BATCHES,
                    schedule=schedule, virtual_stages=virtual)
    stages = tuple(Stage(index=s, first_layer=a, last_layer=b - 1, layer_names=tuple(names[a:b]),
                         ranks=(s % 2,)) for s, (a, b) in enumerate(itertools.pairwise(bounds)))
    actions = layout_actions(layout)
    assert actions is not None
    if ranks is not None:
        actions = actions.model_copy(update={"ranks": ranks})
    return Plan(model=ModelRef.from_model_ir(ir),
                cluster=ClusterRef(name="cpu2", fingerprint="cpu2", world_size=2),
                layout=layout, stages=stages, pipeline_actions=actions)


# -- the run --------------------------------------------------------------------------------------
def _train(name: str, plan_json: str) -> dict[str, Any]:
    from hetplan.runtime.executor import Runtime
    from hetplan.runtime.handlers import StagesHandler

    args, kwargs = _example(name)
    rt = Runtime(Plan.from_json(plan_json), MODELS[name][0](), example_args=args,
                 example_kwargs=kwargs, loss_fn=MODELS[name][1], optimizer=_sgd)
    executed, losses = [], []
    for step in range(STEPS):
        losses.append(rt.train_step(*_data(name, step)))
        executed.append([str(a) for a in rt.handler(StagesHandler).executed])
    out = {"executed": executed, "losses": losses, "pp_rank": rt.ctx.groups.pp_rank,
           "params": {n: p.detach().clone() for n, p in rt.named_params}}
    rt.close()
    return out


def _worker(rank: int, world: int, runs: dict[str, tuple[str, str]]) -> dict[str, Any]:
    """Each run ``label -> (model name, plan JSON)`` in turn, in this one process group."""
    torch.set_num_threads(1)
    return run_each(runs, lambda r: _train(*r))


#: action lists for the 1f1b plan of :class:`Blocks` that differ from the generated ones: rank
#: 0 takes the backward gradients in another order than rank 1 sends them (legal)
CUSTOM = ("0F0 0F1 0F2 0F3 0B1 0B0 0B3 0B2", "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3")


def _plans() -> dict[str, tuple[str, Plan]]:
    return {"gpipe": ("gpt", _compiled("gpipe")), "1f1b": ("gpt", _compiled("1f1b")),
            "interleaved": ("blocks", _hand("interleaved-1f1b", (1, 2, 3), virtual=2)),
            "custom": ("blocks", _hand("1f1b", (2,), ranks=CUSTOM))}


@pytest.fixture(scope="module")
def runs() -> tuple[dict[str, tuple[str, Plan]], list[dict[str, Any]]]:
    """The plans by label, and every rank's results of all of them."""
    plans = _plans()
    runs = {label: (name, plan.to_json()) for label, (name, plan) in plans.items()}
    return plans, run_local_ranks(_worker, 2, (runs,), timeout_s=600)


def _compare(runs: tuple[dict[str, tuple[str, Plan]], list[dict[str, Any]]], label: str,
             ) -> Plan:
    """The run ``label`` executed its plan's lists and equals the reference; its plan."""
    name, plan = runs[0][label]
    assert plan.pipeline_actions is not None
    outs = case_results(runs[1], label)
    ref_losses, ref_params = _reference(name)
    for out in outs:
        want = plan.pipeline_actions.ranks[out["pp_rank"]].split()
        assert want, "every pipeline rank has actions"
        for step, got in enumerate(out["executed"]):
            assert got == want, f"pipeline rank {out['pp_rank']}, step {step}"
    last = [o["losses"] for o in outs if not math.isnan(o["losses"][0])]
    assert len(last) == 1  # the rank holding the last stage
    assert last[0] == pytest.approx(ref_losses, rel=TOL["rtol"])
    seen: set[str] = set()
    for out in outs:
        for n, value in out["params"].items():
            torch.testing.assert_close(value, ref_params[n], **TOL)
            seen.add(n)
    assert seen == set(ref_params), "every parameter is checked on some rank"
    return plan


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_compiled_plan_actions_are_executed(runs: Any, schedule: str) -> None:
    plan = _compare(runs, schedule)
    generated = build_schedule(schedule, 2, MICRO_BATCHES).encode()
    assert plan.pipeline_actions == PipelineActions(
        schedule=schedule, micro_batches=MICRO_BATCHES, num_stages=2, ranks=generated)


def test_interleaved_plan_actions_are_executed_with_two_chunks_per_rank(runs: Any) -> None:
    plan = _compare(runs, "interleaved")
    assert plan.pipeline_actions is not None and plan.pipeline_actions.num_stages == 4


def test_the_plans_lists_run_even_when_they_differ_from_the_generated_ones(runs: Any) -> None:
    """Rank 0 takes the backward gradients in another order than rank 1 sends them (legal,
    deadlock-free): they are matched by the receive order, not swapped."""
    plan = _compare(runs, "custom")
    assert plan.pipeline_actions is not None
    assert plan.pipeline_actions.ranks == CUSTOM
    assert plan.pipeline_actions.ranks != build_schedule("1f1b", 2, MICRO_BATCHES).encode()


# -- timeouts ---------------------------------------------------------------------------------------
def _silent_peer_worker(rank: int, world: int, plan_json: str, marker: str) -> str:
    """Rank 1 builds its stage, then never takes part in a step; rank 0's step waits for its
    backward gradient and must fail with the pipeline group's 3 s timeout."""
    torch.set_num_threads(1)
    from hetplan.runtime.executor import Runtime

    rt = Runtime(Plan.from_json(plan_json), _blocks(), example_args=_example("blocks")[0],
                 loss_fn=F.mse_loss, optimizer=_sgd, timeout=timedelta(seconds=3))
    if rank == 1:
        for _ in range(600):  # until rank 0 gave up (bounded: the run's own timeout)
            if os.path.exists(marker):
                break
            time.sleep(0.1)
        return "silent"
    try:
        rt.train_step(*_data("blocks", 0))
    except RuntimeError as e:
        return f"raised: {e}"
    finally:
        Path(marker).touch()
    return "finished"


def test_a_silent_pipeline_peer_fails_the_step_with_the_timeout(tmp_path: Path) -> None:
    plan = _hand("1f1b", (2,))
    marker = str(tmp_path / "gave-up")
    outs = run_local_ranks(_silent_peer_worker, 2, (plan.to_json(), marker), timeout_s=120)
    assert outs[1] == "silent"
    assert outs[0].startswith("raised:"), outs[0]
    assert "timed out" in outs[0].lower() or "timeout" in outs[0].lower(), outs[0]
