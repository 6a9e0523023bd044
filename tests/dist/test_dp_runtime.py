"""The runtime's data-parallel path on gloo: equal to a single-process reference; refusals;
a killed rank makes the run fail, and no rank finishes training alone. The equality cases of
one world size train one after another in one process group."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from reflib import case_results, run_each
from torch import nn

from hetplan.errors import PlanMismatchError
from hetplan.ir.capture import capture
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import (
    Bucket,
    CastSync,
    ClusterRef,
    GradientSync,
    Layout,
    ModelRef,
    NoSync,
)
from hetplan.models import MLP
from hetplan.profiling._spawn import run_local_ranks, start_method
from hetplan.runtime.executor import Runtime

pytestmark = pytest.mark.dist

STEPS = 3
BATCH = 8


def _model() -> nn.Module:
    torch.manual_seed(0)
    return MLP(in_features=6, hidden=(10, 12), out_features=4).double()


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, 6, generator=g, dtype=torch.float64)
    y = torch.randn(BATCH, 4, generator=g, dtype=torch.float64)
    return x, y


def _plan(dp: int, micro_batches: int, cast: bool = False) -> Plan:
    model = _model()
    ir = capture(model, torch.zeros(1, 6, dtype=torch.float64))
    names = [g.name for g in ir.grad_tensors]
    strategies = {"fp32": NoSync(), "half": CastSync(dtype="bf16")}
    buckets = (
        Bucket(tensors=tuple(names[:2]), size_bytes=1, strategy="half" if cast else "fp32"),
        Bucket(tensors=tuple(names[2:]), size_bytes=1, strategy="fp32"),
    )
    return Plan(
        model=ModelRef.from_model_ir(ir),
        cluster=ClusterRef(name="test", fingerprint="test", world_size=dp),
        layout=Layout(dp=dp, micro_batches=micro_batches,
                      micro_batch_size=BATCH // dp // micro_batches),
        gradient_sync=GradientSync(strategies=strategies, buckets=buckets),
    )


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    for step in range(STEPS):
        x, y = _data(step)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _worker(rank: int, world: int, store_dir: str, plan_json: str, out: str, kill: int) -> None:
    store = dist.FileStore(os.path.join(store_dir, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=10))
    try:
        plan = Plan.from_json(plan_json)
        rt = Runtime(plan, _model(), example_args=(torch.zeros(1, 6, dtype=torch.float64),))
        losses = []
        for step in range(STEPS):
            if kill >= 0 and step == 1 and rank == kill:
                os._exit(17)  # a crashed rank: no clean shutdown
            losses.append(rt.train_step(*_data(step)))
        # the replica losses average to the full-batch loss
        t = torch.tensor(losses, dtype=torch.float64)
        dist.all_reduce(t)
        params = {n: p.detach().clone() for n, p in rt.model.named_parameters()}
        torch.save({"losses": (t / world).tolist(), "params": params}, f"{out}.{rank}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run(tmp_path: Path, plan: Plan, world: int, kill: int = -1) -> None:
    mp.start_processes(_worker, args=(world, str(tmp_path), plan.to_json(),
                                      str(tmp_path / "out"), kill),
                       nprocs=world, join=True, start_method=start_method())


def _train(plan_json: str) -> dict[str, Any]:
    rt = Runtime(Plan.from_json(plan_json), _model(),
                 example_args=(torch.zeros(1, 6, dtype=torch.float64),))
    losses = [rt.train_step(*_data(step)) for step in range(STEPS)]
    # the replica losses average to the full-batch loss
    t = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(t)
    params = {n: p.detach().clone() for n, p in rt.model.named_parameters()}
    rt.close()
    return {"losses": (t / dist.get_world_size()).tolist(), "params": params}


def _cases_worker(rank: int, world: int, plans: dict[str, str]) -> dict[str, dict[str, Any]]:
    return run_each(plans, _train)


#: label -> (dp, micro-batches, a bf16 cast bucket)
CASES = {"2-1-False": (2, 1, False), "2-2-False": (2, 2, False), "4-1-False": (4, 1, False),
         "2-1-True": (2, 1, True)}


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict[str, Any]]]:
    """label -> every rank's result; one process group per world size."""
    out: dict[str, list[dict[str, Any]]] = {}
    for world in sorted({dp for dp, _, _ in CASES.values()}):
        plans = {label: _plan(dp, mb, cast).to_json()
                 for label, (dp, mb, cast) in CASES.items() if dp == world}
        got = run_local_ranks(_cases_worker, world, (plans,), timeout_s=300)
        out.update({label: case_results(got, label) for label in plans})
    return out


@pytest.mark.parametrize("label", list(CASES))
def test_data_parallel_equals_single_process(results: dict[str, list[dict[str, Any]]],
                                             label: str) -> None:
    dp, _, cast = CASES[label]
    ref_losses, ref_params = _reference()
    tol = dict(rtol=1e-2, atol=1e-3) if cast else dict(rtol=1e-10, atol=1e-12)
    assert len(results[label]) == dp
    for got in results[label]:
        assert got["losses"] == pytest.approx(ref_losses, rel=tol["rtol"])
        for name, value in ref_params.items():
            torch.testing.assert_close(got["params"][name], value, **tol)


def test_wrong_world_size_is_refused_before_any_collective() -> None:
    plan = _plan(2, 1)
    with pytest.raises(PlanMismatchError, match="needs 2 processes"):
        Runtime(plan, _model(), example_args=(torch.zeros(1, 6, dtype=torch.float64),))


def test_another_model_is_refused() -> None:
    plan = _plan(1, 1)
    other = MLP(in_features=6, hidden=(10, 13), out_features=4).double()
    with pytest.raises(PlanMismatchError, match="does not match the plan"):
        Runtime(plan, other, example_args=(torch.zeros(1, 6, dtype=torch.float64),))


def test_a_killed_rank_makes_every_rank_exit(tmp_path: Path) -> None:
    plan = _plan(2, 1)
    with pytest.raises(Exception) as info:  # noqa: PT011 - mp reports the first failure
        _run(tmp_path, plan, 2, kill=1)
    assert "17" in str(info.value) or "exit" in str(info.value).lower()
    assert not (tmp_path / "out.0").exists(), "rank 0 must not finish training alone"
