"""Precision, recomputation and ZeRO executed by the runtime on 2 gloo ranks, against
single-process references.

One spawn of 2 processes trains every case for ``STEPS`` Adam steps on a 2-layer Megatron GPT
(no dropout, so the replicas' halves of the batch see what the full batch sees) and returns
the loss per step and every parameter, gathered where ZeRO shards it (the fp32 master
weights under mixed precision). Tolerances:

- fp64 model, fp32 policy, Adam (ZeRO-1/2/3, each recompute mode, micro-batches): the
  reference's losses and parameters to ``rtol 1e-9``, ``atol 1e-11`` (only the summation
  order differs);
- a ZeRO stage against ZeRO-0 over the same gradient path (compressed top-k with error
  feedback, a bf16 ``cast`` bucket): ``atol 1e-12`` — sharding changes nothing the path
  computes;
- bf16 autocast with fp32 master weights (ZeRO-0/1/2/3), SGD with momentum: the
  single-process bf16 recipe
  (16-bit working weights, autocast forward, fp32 loss, fp32 master update) to ``atol 2e-3``
  on parameters and ``rtol 1e-2`` on losses — the replicas reduce bf16 gradients of half the
  batch each, which rounds differently from one full-batch bf16 gradient; and the fp32
  reference within ``atol 1e-2`` (bf16 trains the same model).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from reflib import (BATCH, WORLD, assert_params, cpu_cluster, gpt_batch, gpt_example, gpt_model,
                    gpt_optimizer, gpt_reference)

import hetplan
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import Bucket, CastSync, GradientSync
from hetplan.models import MegatronGPT
from hetplan.passes.espresso import strategy_for
from hetplan.profiling._spawn import run_local_ranks

pytestmark = pytest.mark.dist

STEPS = 3


def _compile(dtype: torch.dtype, policy: str) -> Plan:
    return hetplan.compile(gpt_model(dtype), cpu_cluster(WORLD),
                           example_inputs=(gpt_example(),),
                           batch_size=BATCH, dp=WORLD, pp=1, tp=1, zero_stage=0,
                           recompute="none", dtype=policy, optimizer="adam")


def _variant(plan: Plan, *, zero: int = 0, recompute: str = "none", micro_batches: int = 1,
             sync: GradientSync | None = None) -> str:
    data = plan.model_dump(mode="json")
    lay = data["layout"]
    lay.update(zero_stage=zero, micro_batches=micro_batches,
               micro_batch_size=BATCH // WORLD // micro_batches)
    for st in data["stages"]:
        st["recompute"] = recompute
    if sync is not None:
        data["gradient_sync"] = sync.model_dump(mode="json")
    data["predictions"] = None
    data["pipeline_actions"] = None
    return Plan.model_validate(data).to_json()


def _one_bucket(plan: Plan, strategy: Any) -> GradientSync:
    assert plan.model.workload is not None
    names = tuple(g.name for g in plan.model.workload.grads)
    return GradientSync(strategies={"s": strategy},
                        buckets=(Bucket(tensors=names, size_bytes=1, strategy="s"),))


def _cases() -> dict[str, tuple[str, str]]:
    """label → (model dtype, plan JSON)."""
    f64, bf16 = _compile(torch.float64, "fp32"), _compile(torch.float32, "bf16")
    fp16 = _compile(torch.float32, "fp16")
    topk = strategy_for(("topk", 5), ratio=0.5)  # reduce-scatter, top-k on CPU, all-gather
    cases = {
        "fp64/zero0": _variant(f64),
        "fp64/zero1": _variant(f64, zero=1),
        "fp64/zero2": _variant(f64, zero=2),
        "fp64/zero2-mb2": _variant(f64, zero=2, micro_batches=2),
        "fp64/zero3": _variant(f64, zero=3),
        "fp64/selective": _variant(f64, recompute="selective"),
        "fp64/full": _variant(f64, recompute="full"),
        "fp64/full-zero1": _variant(f64, recompute="full", zero=1),
        "fp64/topk-zero0": _variant(f64, sync=_one_bucket(f64, topk)),
        "fp64/topk-zero1": _variant(f64, zero=1, sync=_one_bucket(f64, topk)),
        "fp64/cast-zero0": _variant(f64, sync=_one_bucket(f64, CastSync(dtype="bf16"))),
        "fp64/cast-zero2": _variant(f64, zero=2, sync=_one_bucket(f64, CastSync(dtype="bf16"))),
        "bf16/zero0": _variant(bf16),
        "bf16/zero1": _variant(bf16, zero=1),
        "bf16/zero2": _variant(bf16, zero=2),
        "bf16/zero3": _variant(bf16, zero=3),
        "fp16/zero0": _variant(fp16),
        "fp16/zero3": _variant(fp16, zero=3),
    }
    return {k: ("float64" if k.startswith("fp64") else "float32", v) for k, v in cases.items()}


def _kind(label: str) -> str:
    return "adam" if label.startswith("fp64") else "sgd-momentum"


def _rank(rank: int, world: int, cases: dict[str, tuple[str, str]]) -> dict[str, Any]:
    import torch.distributed as dist

    from hetplan.runtime.executor import Runtime
    from hetplan.runtime.handlers import PrecisionHandler, ZeroHandler

    out: dict[str, Any] = {}
    for label, (dtype, plan_json) in cases.items():
        plan = Plan.from_json(plan_json)
        rt = Runtime(plan, gpt_model(getattr(torch, dtype)), example_args=(gpt_example(),),
                     optimizer=functools.partial(gpt_optimizer, _kind(label)))
        losses = []
        for step in range(STEPS):
            ids = gpt_batch(step)
            losses.append(rt.train_step(ids, ids))
        t = torch.tensor(losses, dtype=torch.float64)
        dist.all_reduce(t)
        params = rt.handler(ZeroHandler).full_parameters(rt.ctx)
        scaler = rt.handler(PrecisionHandler).scaler
        out[label] = {"losses": (t / world).tolist(),
                      "params": {n: v.double() for n, v in params.items()},
                      "skipped": scaler.skipped if scaler is not None else 0}
        rt.close()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_local_ranks(_rank, WORLD, (_cases(),), timeout_s=600, threads_per_process=1)


@pytest.mark.parametrize("label", ["fp64/zero0", "fp64/zero1", "fp64/zero2", "fp64/zero2-mb2",
                                   "fp64/zero3", "fp64/selective", "fp64/full",
                                   "fp64/full-zero1"])
def test_zero_and_recompute_equal_the_reference(results: list[dict[str, Any]],
                                                 label: str) -> None:
    ref_losses, ref_params = gpt_reference(torch.float64, STEPS)
    for r in range(WORLD):
        got = results[r][label]
        assert got["losses"] == pytest.approx(ref_losses, rel=1e-9)
        assert_params(got["params"], ref_params, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize(("sharded", "unsharded"), [("fp64/topk-zero1", "fp64/topk-zero0"),
                                                    ("fp64/cast-zero2", "fp64/cast-zero0")])
def test_zero_keeps_the_plans_gradient_path(results: list[dict[str, Any]], sharded: str,
                                            unsharded: str) -> None:
    ref_losses, ref_params = gpt_reference(torch.float64, STEPS)
    for r in range(WORLD):
        got, base = results[r][sharded], results[r][unsharded]
        assert got["losses"] == pytest.approx(base["losses"], rel=1e-12)
        assert_params(got["params"], base["params"], rtol=0, atol=1e-12)
    # and the path is really the lossy one the plan asked for, not a plain allreduce
    diff = max(float((results[0][sharded]["params"][n] - v).abs().max())
               for n, v in ref_params.items())
    assert diff > 1e-6


@pytest.mark.parametrize("label", ["bf16/zero0", "bf16/zero1", "bf16/zero2", "bf16/zero3"])
def test_bf16_autocast_with_fp32_master_weights(results: list[dict[str, Any]],
                                                label: str) -> None:
    ref_losses, ref_params = gpt_reference(torch.float32, STEPS, torch.bfloat16)
    _, fp32_params = gpt_reference(torch.float32, STEPS)
    for r in range(WORLD):
        got = results[r][label]
        assert got["losses"] == pytest.approx(ref_losses, rel=1e-2)
        assert_params(got["params"], {n: v for n, v in ref_params.items()},
                       rtol=0, atol=2e-3)
        assert_params(got["params"], fp32_params, rtol=0, atol=1e-2)
    # the master weights are not the bf16 working copy: some differ from their bf16 rounding
    p = results[0][label]["params"]["blocks.0.fc1.weight"]
    assert not torch.equal(p, p.to(torch.bfloat16).double())


def test_fp16_zero3_steps_behind_the_loss_scale_as_the_unsharded_run(
        results: list[dict[str, Any]]) -> None:
    """fp16 with ZeRO-3 (FSDP2's fp32 shards are the master weights; the user's optimizer
    runs behind the loss scale, unscaling each local shard): the same steps skipped for an
    overflow as fp16 without sharding, the same losses and weights to fp16's precision, and
    some step taken (the weights moved)."""
    initial = {n: p.detach().double() for n, p in gpt_model(torch.float32).named_parameters()}
    for r in range(WORLD):
        plain, sharded = results[r]["fp16/zero0"], results[r]["fp16/zero3"]
        assert sharded["skipped"] == plain["skipped"] < STEPS
        assert sharded["losses"] == pytest.approx(plain["losses"], rel=1e-2)
        assert_params(sharded["params"], plain["params"], rtol=0, atol=2e-3)
        assert any(not torch.allclose(sharded["params"][n], v) for n, v in initial.items())
