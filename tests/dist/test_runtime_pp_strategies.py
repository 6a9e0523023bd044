"""Precision and recomputation under a pipeline (pp 2, gloo, 2 ranks), against single-process
references.

One spawn of 2 processes trains every case for ``STEPS`` steps on a 2-layer Megatron GPT
(no dropout; its embedding and LM head are separate) split into 2 stages, 2 micro-batches
(1F1B), and returns the last stage's loss per step and every parameter of each rank (the
fp32 master weights under mixed precision). Tolerances are those of the pp=1 cases in
``test_runtime_strategies.py``:

- fp64, Adam, each recompute mode: the reference's losses and parameters to ``rtol 1e-9``,
  ``atol 1e-11`` (only the summation order differs);
- bf16 autocast with fp32 master weights, SGD with momentum: the single-process bf16 recipe
  (16-bit working weights, autocast forward, fp32 loss, fp32 master update) to ``atol 2e-3``
  on parameters and ``rtol 1e-2`` on losses — the stages hand fp32 activations to each other
  and the micro-batches' bf16 gradients are summed, which rounds differently from one
  full-batch bf16 pass; and the fp32 reference within ``atol 1e-2``.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch
from reflib import (BATCH, WORLD, assert_params, cpu_cluster, gpt_batch, gpt_example, gpt_model,
                    gpt_optimizer, gpt_reference)

import hetplan
from hetplan.ir.plan import Plan
from hetplan.models import MegatronGPT
from hetplan.profiling._spawn import run_local_ranks

pytestmark = pytest.mark.dist

STEPS = 3


def _compile(dtype: torch.dtype, policy: str, recompute: str = "none") -> str:
    plan = hetplan.compile(gpt_model(dtype), cpu_cluster(WORLD),
                           example_inputs=(gpt_example(),),
                           batch_size=BATCH, dp=1, pp=WORLD, tp=1, zero_stage=0,
                           micro_batch_size=BATCH // 2, schedule="1f1b",
                           recompute=recompute, dtype=policy, optimizer="adam")
    assert plan.layout is not None and plan.layout.micro_batches == 2
    assert {st.recompute for st in plan.stages} == {recompute}
    return plan.to_json()


def _cases() -> dict[str, tuple[str, str]]:
    """label → (model dtype, plan JSON)."""
    return {
        "bf16/pp2": ("float32", _compile(torch.float32, "bf16")),
        "fp64/pp2-full": ("float64", _compile(torch.float64, "fp32", "full")),
        "fp64/pp2-selective": ("float64", _compile(torch.float64, "fp32", "selective")),
    }


def _rank(rank: int, world: int, cases: dict[str, tuple[str, str]]) -> dict[str, Any]:
    from hetplan.runtime.executor import Runtime
    from hetplan.runtime.handlers import RecomputeHandler, ZeroHandler

    out: dict[str, Any] = {}
    for label, (dtype, plan_json) in cases.items():
        plan = Plan.from_json(plan_json)
        kind = "adam" if label.startswith("fp64") else "sgd-momentum"
        rt = Runtime(plan, gpt_model(getattr(torch, dtype)), example_args=(gpt_example(),),
                     optimizer=functools.partial(gpt_optimizer, kind))
        losses = [rt.train_step(gpt_batch(s), gpt_batch(s)) for s in range(STEPS)]
        params = rt.handler(ZeroHandler).full_parameters(rt.ctx)
        out[label] = {"losses": losses, "params": {n: v.double() for n, v in params.items()},
                      "recomputed": len(rt.handler(RecomputeHandler).wrapped)}
        rt.close()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_local_ranks(_rank, WORLD, (_cases(),), timeout_s=600, threads_per_process=1)


def _merged(results: list[dict[str, Any]], label: str) -> tuple[list[float], dict[str, Any]]:
    """The last stage's losses (the first stage's are NaN) and every rank's parameters."""
    first, last = results[0][label], results[-1][label]
    assert all(math.isnan(x) for x in first["losses"])
    params: dict[str, torch.Tensor] = {}
    for r in results:
        for n, v in r[label]["params"].items():
            assert n not in params, f"{n} trained on two stages"
            params[n] = v
    return last["losses"], params


def test_bf16_pipeline_matches_the_bf16_recipe(results: list[dict[str, Any]]) -> None:
    losses, params = _merged(results, "bf16/pp2")
    ref_losses, ref = gpt_reference(torch.float32, STEPS, torch.bfloat16)
    assert all(v.dtype == torch.float64 for v in params.values())  # fp32 masters, upcast
    assert losses == pytest.approx(ref_losses, rel=1e-2)
    assert_params(params, ref, rtol=0.0, atol=2e-3)
    _, fp32 = gpt_reference(torch.float32, STEPS)
    assert_params(params, fp32, rtol=0.0, atol=1e-2)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_in_a_pipeline_equals_the_reference(results: list[dict[str, Any]],
                                                      mode: str) -> None:
    label = f"fp64/pp2-{mode}"
    losses, params = _merged(results, label)
    assert all(r[label]["recomputed"] > 0 for r in results)  # every stage recomputes
    ref_losses, ref = gpt_reference(torch.float64, STEPS)
    assert losses == pytest.approx(ref_losses, rel=1e-9)
    assert_params(params, ref, rtol=1e-9, atol=1e-11)
