"""Two re-balancing events in one run of the homogeneous pipeline, the second built on the
first (gloo, 4 ranks: pp 2 x tp 2 with sequence parallelism, gpt-test in float64, Adam).

After an applied event the runtime's plan (``ctx.plan.stages``) carries the new bounds: the
stages are rebuilt from them, and sequence parallelism (scatter the sequence at the first
sharded layer of a stage, gather it at the last) is hooked on per stage from them. The run
that moves 4|4 -> 6|2 at iteration 1 and -> 2|6 at iteration 2 ends with the losses and the
parameters (shards gathered) of the same plan that never moved (rtol 1e-9, atol 1e-11), and
every rank's ``ctx.plan.stages`` is the last event's assignment.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from reflib import cpu_cluster, lm_data, lm_loss

from hetplan.profiling._spawn import run_local_ranks

pytestmark = pytest.mark.dist

MODEL, BATCH, STEPS, WORLD = "gpt-test", 8, 4, 4
EVENTS = [(1, ((0, 5), (6, 7))), (2, ((0, 1), (2, 7)))]
TOL = {"rtol": 1e-9, "atol": 1e-11}


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return lm_data(step, BATCH, 32, vocab=256, seed=11)


def _train(plan_json: str) -> dict[str, Any]:
    from hetplan import zoo
    from hetplan.ir.plan import Plan
    from hetplan.runtime.executor import Runtime

    args, kwargs = zoo.example_inputs(MODEL, batch=1, device="cpu")
    model = zoo.build(MODEL, device="cpu", seed=0, dtype=torch.float64).eval()
    rt = Runtime(Plan.from_json(plan_json), model, example_args=args, example_kwargs=kwargs,
                 loss_fn=lm_loss, optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-2))
    losses = {}
    for step in range(STEPS):
        loss = rt.train_step(*_data(step))
        if not math.isnan(loss):
            losses[step] = loss
    mine = {id(p) for _, p in rt.named_params}
    params = {}
    for name, mod in rt.model.named_modules():
        if not any(id(p) in mine for p in mod.parameters(recurse=False)):
            continue
        if hasattr(mod, "gather_weight"):
            params[f"{name}.weight"] = mod.gather_weight()
        else:
            params.update({f"{name}.{n}": p.detach().clone()
                           for n, p in mod.named_parameters(recurse=False)})
    from hetplan.runtime.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    # how each sharded linear this rank holds runs under sequence parallelism ("": without)
    sp_modes = {name: mod.sp_mode for name, mod in rt.model.named_modules()
                if isinstance(mod, ColumnParallelLinear | RowParallelLinear)
                and any(id(p) in mine for p in mod.parameters(recurse=False))}
    out = {"losses": losses, "params": params, "rebalanced_at": list(rt.rebalanced_at),
           "stages": [(s.first_layer, s.last_layer) for s in rt.ctx.plan.stages],
           "sp_modes": sp_modes}
    rt.close()
    return out


def _worker(rank: int, world: int, plans: dict[str, str]) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {label: _train(p) for label, p in plans.items()}


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    import hetplan
    from hetplan import zoo
    from hetplan.ir.rebalancing import PlannedEvent, Rebalancing

    model = zoo.build(MODEL, device="cpu", seed=0, dtype=torch.float64)
    ir = hetplan.capture(model, *zoo.example_inputs(MODEL, batch=1, device="cpu"), name=MODEL)
    plan = hetplan.compile(ir, cpu_cluster(WORLD), batch_size=BATCH, dp=1, pp=2, tp=2,
                           micro_batch_size=2, schedule="1f1b", zero_stage=0, dtype="fp32",
                           sequence_parallel=True)
    assert plan.layout is not None and plan.layout.sequence_parallel
    assert [(s.first_layer, s.last_layer) for s in plan.stages] == [(0, 3), (4, 7)]
    reb = Rebalancing(total_iterations=100, events=tuple(
        PlannedEvent(iteration=i, stages=b, applied=True) for i, b in EVENTS))
    moved = plan.model_copy(update={"rebalancing": reb})
    return run_local_ranks(_worker, WORLD, ({"still": plan.to_json(),
                                             "moved": moved.to_json()},), timeout_s=600,
                           threads_per_process=1)


def test_two_events_train_as_the_plan_that_never_moved(runs: list[dict[str, Any]]) -> None:
    still = {k: v for r in runs for k, v in r["still"]["losses"].items()}
    moved = {k: v for r in runs for k, v in r["moved"]["losses"].items()}
    assert sorted(moved) == list(range(STEPS))
    assert [moved[k] for k in range(STEPS)] == pytest.approx(
        [still[k] for k in range(STEPS)], rel=1e-9)
    want = {n: v for r in runs for n, v in r["still"]["params"].items()}
    got = {n: v for r in runs for n, v in r["moved"]["params"].items()}
    assert sorted(got) == sorted(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], **TOL, msg=lambda m, n=n: f"{n}: {m}")


def test_the_runtime_plan_carries_the_last_assignment(runs: list[dict[str, Any]]) -> None:
    for r in runs:
        assert r["moved"]["rebalanced_at"] == [1, 2]
        assert r["moved"]["stages"] == list(EVENTS[-1][1])
        assert r["still"]["stages"] == [(0, 3), (4, 7)]


def test_sequence_parallelism_covers_the_layers_each_stage_holds_now(
        runs: list[dict[str, Any]]) -> None:
    """Every block's sharded linear on a rank runs sequence-parallel, the ones that arrived
    with the events included (the regions follow ``ctx.plan.stages``): 2|6 leaves the
    blocks on the last stage's ranks."""
    for rank, r in enumerate(runs):
        for label in ("still", "moved"):
            blocks = {n: m for n, m in r[label]["sp_modes"].items() if n.startswith("blocks.")}
            assert all(blocks.values()), (rank, label, blocks)
        held = {n.split(".")[1] for n in r["moved"]["sp_modes"] if n.startswith("blocks.")}
        assert held == (set() if rank < 2 else {"0", "1", "2", "3"})
