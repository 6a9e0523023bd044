"""ZeRO-3 (FSDP2) composed with tensor parallelism (gloo, 4 ranks: dp 2 x tp 2) equals a
single-process reference.

FSDP2 shards each rank's parameters over its data-parallel group (the ranks with the same TP
coordinate, so every member holds a TP shard of the same shape): the TP layers' local
shards are plain tensors, so a one-dimensional mesh of the DP group suffices. gpt-test in
float64 (eval mode), 2 SGD steps; the loss of every step and every parameter (un-sharded by
FSDP, then gathered from the TP shards) equal the reference to ``rtol 1e-9, atol 1e-11``.
The four plans train one after another in one 4-rank process group (``reflib.run_each``,
docs/decisions/test-budget.md).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from reflib import case_results, cpu_cluster, run_each, train_reference, zoo_ids, zoo_model
from torch import nn

import hetplan
from hetplan.ir.plan import Plan
from hetplan.profiling._spawn import run_local_ranks

pytestmark = pytest.mark.dist

NAME, SEQ, VOCAB, BATCH, STEPS = "gpt-test", 32, 64, 4, 2  # traced stages: the zoo's seq
TOL = {"rtol": 1e-9, "atol": 1e-11}


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05)


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    return train_reference(NAME, _data, _sgd, STEPS)


def _compile(dp: int, pp: int, tp: int, mb: int, **pins: Any) -> str:
    ir = hetplan.capture(zoo_model(NAME), zoo_ids(NAME), name=NAME)
    plan = hetplan.compile(ir, cpu_cluster(4), batch_size=BATCH, dtype="fp32", zero_stage=3,
                           dp=dp, pp=pp, tp=tp, micro_batch_size=mb, **pins)
    lay = plan.layout
    assert lay is not None and (lay.dp, lay.pp, lay.tp, lay.zero_stage) == (dp, pp, tp, 3)
    assert lay.virtual_stages == pins.get("virtual_stages", 1)
    return plan.to_json()


#: label -> plan JSON; "tp*" cases are dp 2 x tp 2, "pp*" cases dp 2 x pp 2
CASES = {
    "tp": lambda: _compile(2, 1, 2, 2),
    "tp-sp": lambda: _compile(2, 1, 2, 2, sequence_parallel=True),
    "pp-1f1b": lambda: _compile(2, 2, 1, 1),
    "pp-interleaved": lambda: _compile(2, 2, 1, 1, virtual_stages=2,
                                       schedule="interleaved-1f1b"),
}


def _train(case: tuple[str, str]) -> dict[str, Any]:
    label, plan_json = case
    from torch.distributed.fsdp import FSDPModule

    from hetplan.runtime.executor import Runtime

    rt = Runtime(Plan.from_json(plan_json), zoo_model(NAME), example_args=zoo_ids(NAME),
                 loss_fn=_loss, optimizer=_sgd)
    try:
        losses = [rt.train_step(*_data(step)) for step in range(STEPS)]
        if label.startswith("pp"):  # each stage module is one FSDP unit
            sharded = all(hasattr(p, "full_tensor") for _, p in rt.named_params)
            params = {n: p.full_tensor().detach().clone() for n, p in rt.named_params}
            return {"losses": losses, "params": params, "sharded": sharded}
        fsdp = [m for m in rt.model.modules() if isinstance(m, FSDPModule)]
        sharded = all(hasattr(p, "full_tensor") for p in rt.model.parameters())  # DTensors
        # at rest: each DTensor gathered over the data-parallel pair, each TP shard then
        # over the TP pair (gather_weight takes a ZeRO-3 shard of a TP shard)
        params = {n: p.full_tensor().detach().clone() for n, p in rt.model.named_parameters()}
        for mname, module in rt.model.named_modules():
            if hasattr(module, "gather_weight"):
                params[f"{mname}.weight"] = module.gather_weight()
                if getattr(module, "bias", None) is not None:
                    params[f"{mname}.bias"] = module.gather_bias()
        return {"losses": losses, "params": params, "fsdp": len(fsdp), "sharded": sharded}
    finally:
        rt.close()


def _rank(rank: int, world: int, plans: dict[str, str]) -> dict[str, dict[str, Any]]:
    torch.set_num_threads(1)
    return run_each({k: (k, v) for k, v in plans.items()}, _train)


@pytest.fixture(scope="module")
def results() -> list[dict[str, dict[str, Any]]]:
    plans = {label: make() for label, make in CASES.items()}
    return run_local_ranks(_rank, 4, (plans,), timeout_s=300, threads_per_process=1)


@pytest.mark.parametrize("label", ["tp", "tp-sp"])
def test_zero3_x_tp2_equals_reference(results: list[dict[str, dict[str, Any]]],
                                      label: str) -> None:
    got = case_results(results, label)
    losses, ref = _reference()
    # ranks 0-1 are replica 0 (tp 0, 1), ranks 2-3 replica 1: each loss is its replica's
    # rows' mean, and the replicas' mean is the batch's
    assert got[0]["losses"] == got[1]["losses"] and got[2]["losses"] == got[3]["losses"]
    mean = [(a + b) / 2 for a, b in zip(got[0]["losses"], got[2]["losses"])]
    assert mean == pytest.approx(losses, rel=1e-9)
    for g in got:
        assert g["fsdp"] > 1  # every block and the root
        assert g["sharded"]  # every parameter at rest is FSDP's DTensor shard
        for n, want in ref.items():
            torch.testing.assert_close(g["params"][n], want, **TOL,
                                       msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("label", ["pp-1f1b", "pp-interleaved"])
def test_zero3_x_pp2_equals_reference(results: list[dict[str, dict[str, Any]]],
                                      label: str) -> None:
    """pp 2 x dp 2 (4 ranks, 2 micro-batches; 1F1B, or interleaved with 2 stages per rank):
    each stage module is one FSDP unit over its data-parallel pair."""
    got = case_results(results, label)
    losses, ref = _reference()
    last = [g["losses"] for g in got if all(x == x for x in g["losses"])]
    assert len(last) == 2  # the last stage's two replicas
    assert [(a + b) / 2 for a, b in zip(*last)] == pytest.approx(losses, rel=1e-9)
    seen: set[str] = set()
    for g in got:
        assert g["sharded"]
        for n, value in g["params"].items():
            torch.testing.assert_close(value, ref[n], **TOL, msg=lambda m, n=n: f"{n}: {m}")
            seen.add(n)
    assert seen == set(ref)
