"""Runtime with pipeline and tensor parallelism from compiled plans (gloo, CPU): after k steps
every parameter equals a single-process float64 reference."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import hetplan
from hetplan import zoo
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan import Plan
from hetplan.profiling._spawn import start_method

pytestmark = pytest.mark.dist

MODEL = "gpt-test"
STEPS = 2
BATCH = 8


def _cluster(world: int) -> ClusterSpec:
    spec = ClusterSpec.from_preset("local-cpu").model_dump(mode="json")
    spec["nodes"][0]["devices"] = [{"type": "cpu", "count": world}]
    return ClusterSpec.from_dict(spec)


def _model() -> nn.Module:
    return zoo.build(MODEL, device="cpu", seed=0, dtype=torch.float64)


def _example() -> tuple[tuple, dict]:
    return zoo.example_inputs(MODEL, batch=1, device="cpu")


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7 + step)
    ids = torch.randint(0, 256, (BATCH, 32), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = getattr(out, "logits", out)
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05)


def _reference() -> dict[str, torch.Tensor]:
    model = _model()
    opt = _sgd(list(model.parameters()))
    for step in range(STEPS):
        ids, y = _data(step)
        _loss(model(ids), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _worker(rank: int, world: int, store_dir: str, plan_json: str, out: str) -> None:
    torch.set_num_threads(1)
    from hetplan.runtime.executor import Runtime

    store = dist.FileStore(os.path.join(store_dir, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        args, kwargs = _example()
        rt = Runtime(Plan.from_json(plan_json), _model(), example_args=args,
                     example_kwargs=kwargs, loss_fn=_loss, optimizer=_sgd)
        for step in range(STEPS):
            rt.train_step(*_data(step))
        params = {n: p.detach().clone() for n, p in rt.named_params}
        if rt.layout.tp > 1:
            for name, module in rt.model.named_modules():
                if hasattr(module, "gather_weight"):
                    params[f"{name}.weight"] = module.gather_weight()
                    if getattr(module, "bias", None) is not None:
                        params[f"{name}.bias"] = module.gather_bias()
        torch.save(params, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("world", "pins", "schedule"),
    [
        (2, {"dp": 1, "pp": 2, "tp": 1}, "1f1b"),
        (2, {"dp": 1, "pp": 2, "tp": 1}, "gpipe"),
        (2, {"dp": 1, "pp": 1, "tp": 2}, "1f1b"),
        pytest.param(4, {"dp": 2, "pp": 2, "tp": 1, "zero_stage": 1}, "1f1b",
                     marks=pytest.mark.slow),
        pytest.param(4, {"dp": 2, "pp": 2, "tp": 1, "zero_stage": 2}, "1f1b",
                     marks=pytest.mark.slow),
        pytest.param(4, {"dp": 2, "pp": 1, "tp": 2, "zero_stage": 1}, "1f1b",
                     marks=pytest.mark.slow),
        pytest.param(4, {"dp": 2, "pp": 1, "tp": 2, "zero_stage": 2}, "1f1b",
                     marks=pytest.mark.slow),
    ],
    ids=["pp2-1f1b", "pp2-gpipe", "tp2", "dp2xpp2", "dp2xpp2-zero2", "dp2xtp2-zero1",
         "dp2xtp2-zero2"],
)
def test_parallel_plan_equals_reference(tmp_path: Path, world: int, pins: dict, schedule: str) -> None:
    """dp2 x pp2 at ZeRO-1: the tied embedding and LM head summed over the stages before
    the optimizer shards them; ZeRO-2 under a pipeline and ZeRO-1/2 with tensor parallelism
    (sequence parallelism on). The ZeRO stage is pinned (the search keeps ZeRO-0 where ZeRO-1's
    all-gather after the step makes it slower, as here on this cluster)."""
    ir = hetplan.capture(_model(), *_example(), name=MODEL)
    plan = hetplan.compile(ir, _cluster(world), batch_size=BATCH, schedule=schedule,
                           micro_batch_size=BATCH // pins["dp"] // 2, **pins)
    assert plan.layout is not None and plan.layout.micro_batches == 2
    assert plan.layout.zero_stage == pins.get("zero_stage", 0)
    mp.start_processes(_worker, args=(world, str(tmp_path), plan.to_json(),
                                      str(tmp_path / "out")),
                       nprocs=world, join=True, start_method=start_method())
    ref = _reference()
    seen: set[str] = set()
    for rank in range(world):
        got = torch.load(tmp_path / f"out.{rank}")
        for name, value in got.items():
            torch.testing.assert_close(value, ref[name], rtol=1e-9, atol=1e-11)
            seen.add(name)
    assert seen == set(ref), "every parameter is checked on some rank"
