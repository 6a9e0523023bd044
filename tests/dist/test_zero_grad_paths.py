"""ZeRO combined with the plan's fused and compressed gradient sync, on 2 gloo ranks, against
a single-process reference — the combinations `docs/decisions/runtime-composition.md` says
compose: ZeRO-1 with any path (fused buckets, compressed), ZeRO-2 with fused buckets of
``none``/``cast`` strategies.

One spawn of 2 processes trains each case for ``STEPS`` Adam steps on a 2-layer Megatron GPT
in fp64 (no dropout: the replicas' halves of the batch see what the full batch sees). The
plan's gradients are fused into ``len(FUSED)`` buckets of consecutive tensors in backward
order (Cupcake's shape), each bucket one collective (ZeRO-2: one reduce-scatter). Checks and
tolerances:

- lossless paths (fused ``none`` buckets under ZeRO-1, ZeRO-2, ZeRO-2 with 2 micro-batches):
  every rank's losses and every parameter (gathered from the shards) equal full-batch
  training in one process to ``rtol 1e-9``, ``atol 1e-11`` (only the summation order
  differs);
- the compressed path itself (fused top-k buckets, reduce-scatter → top-k on the CPU →
  all-gather, with error feedback) under ZeRO-1, at ``ratio 1``: top-k then keeps every
  element, so the sync is exact except that the payload travels in fp32 (the compressors'
  wire format): the reference to ``rtol 1e-6``, ``atol 1e-8`` (fp32 rounding of the
  gradients, through 3 Adam steps at lr 1e-2);
- lossy paths (top-k at ``ratio 0.3`` under ZeRO-1; bf16 ``cast`` buckets under ZeRO-2):
  against ZeRO-0 over the same buckets and strategies (``atol 1e-12``: sharding changes
  nothing the path computes), and at least ``1e-6`` away from the reference somewhere (the
  lossy path really ran).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import hetplan
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.cluster_presets import PRESET_SPECS
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import Bucket, CastSync, CompressedSync, GradientSync, NoSync
from hetplan.models import MegatronGPT
from hetplan.passes.espresso import strategy_for
from hetplan.profiling._spawn import run_local_ranks

pytestmark = pytest.mark.dist

WORLD, BATCH, SEQ, VOCAB, STEPS, LR = 2, 8, 8, 64, 3, 1e-2
FUSED = 3  # buckets
TOPK_FLAT = 5  # Espresso's option: reduce-scatter, top-k on the CPU, all-gather


def _model() -> nn.Module:
    torch.manual_seed(0)
    return MegatronGPT(vocab_size=VOCAB, max_seq=SEQ, dim=16, n_layers=2, n_heads=2,
                       dropout=0.0).to(torch.float64)


def _example() -> torch.Tensor:
    return torch.zeros(1, SEQ, dtype=torch.long)


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))


def _cluster() -> ClusterSpec:
    spec = copy.deepcopy(PRESET_SPECS["local-cpu"])
    spec["name"] = "cpu-2"
    spec["nodes"][0]["devices"][0]["count"] = WORLD
    return ClusterSpec.model_validate(spec)


def _fused(plan: Plan, strategy: Any) -> GradientSync:
    """Every gradient in one of ``FUSED`` buckets of consecutive tensors (backward order)."""
    assert plan.model.workload is not None
    names = [g.name for g in plan.model.workload.grads]
    cut = [len(names) * i // FUSED for i in range(FUSED + 1)]
    buckets = tuple(Bucket(tensors=tuple(names[a:b]), size_bytes=1, strategy="s")
                    for a, b in zip(cut, cut[1:], strict=False))
    return GradientSync(strategies={"s": strategy}, buckets=buckets)


def _variant(plan: Plan, sync: GradientSync, zero: int, micro_batches: int = 1) -> str:
    data = plan.model_dump(mode="json")
    data["layout"].update(zero_stage=zero, micro_batches=micro_batches,
                          micro_batch_size=BATCH // WORLD // micro_batches)
    data["gradient_sync"] = sync.model_dump(mode="json")
    data["predictions"] = None
    data["pipeline_actions"] = None
    return Plan.model_validate(data).to_json()


def _cases() -> dict[str, str]:
    plan = hetplan.compile(_model(), _cluster(), example_inputs=(_example(),),
                           batch_size=BATCH, dp=WORLD, pp=1, tp=1, zero_stage=0,
                           recompute="none", dtype="fp32", optimizer="adam")
    none = _fused(plan, NoSync())
    exact_topk = _fused(plan, strategy_for(("topk", TOPK_FLAT), ratio=1.0))
    topk = _fused(plan, strategy_for(("topk", TOPK_FLAT), ratio=0.3))
    cast = _fused(plan, CastSync(dtype="bf16"))
    return {
        "fused-zero1": _variant(plan, none, 1),
        "fused-zero2": _variant(plan, none, 2),
        "fused-zero2-mb2": _variant(plan, none, 2, micro_batches=2),
        "fused-topk-ratio1-zero1": _variant(plan, exact_topk, 1),
        "fused-topk-zero0": _variant(plan, topk, 0),
        "fused-topk-zero1": _variant(plan, topk, 1),
        "fused-cast-zero0": _variant(plan, cast, 0),
        "fused-cast-zero2": _variant(plan, cast, 2),
    }


def _rank(rank: int, world: int, cases: dict[str, str]) -> dict[str, Any]:
    import torch.distributed as dist

    from hetplan.runtime.executor import Runtime
    from hetplan.runtime.handlers import GradSyncHandler, ZeroHandler

    out: dict[str, Any] = {}
    for label, plan_json in cases.items():
        plan = Plan.from_json(plan_json)
        rt = Runtime(plan, _model(), example_args=(_example(),),
                     optimizer=lambda ps: torch.optim.Adam(ps, lr=LR))
        sync = rt.handler(GradSyncHandler).sync
        losses = [rt.train_step(_batch(s), _batch(s)) for s in range(STEPS)]
        t = torch.tensor(losses, dtype=torch.float64)
        dist.all_reduce(t)
        params = rt.handler(ZeroHandler).full_parameters(rt.ctx)
        out[label] = {"losses": (t / world).tolist(),
                      "params": {n: v.double() for n, v in params.items()},
                      "zero": rt.handler(ZeroHandler).stage,
                      # the buckets the gradient-sync handler runs (ZeRO-2: it stands aside)
                      "sync_buckets": len(sync.buckets) if sync is not None else 0,
                      "segments": (len(rt.handler(ZeroHandler).optimizer.segments)
                                   if rt.handler(ZeroHandler).optimizer is not None else 0)}
        rt.close()
    return out


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """Full-batch training in one process, Adam in fp64."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        ids = _batch(step)
        loss = nn.functional.cross_entropy(model(ids).reshape(-1, VOCAB), ids.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().double() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_local_ranks(_rank, WORLD, (_cases(),), timeout_s=600, threads_per_process=1)


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    return _reference()


def _assert_params(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                   **tol: float) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, msg=lambda m: f"{name}: {m}", **tol)


def test_the_cases_run_the_strategies_they_name() -> None:
    cases = {k: Plan.from_json(v) for k, v in _cases().items()}
    for label, plan in cases.items():
        sync = plan.gradient_sync
        assert sync is not None and len(sync.buckets) == FUSED, label
        assert all(len(b.tensors) > 1 for b in sync.buckets), label  # fused, not per tensor
        want = (CompressedSync if "topk" in label else CastSync if "cast" in label
                else NoSync)
        assert type(sync.strategies["s"]) is want, label
        assert plan.layout is not None and f"zero{plan.layout.zero_stage}" in label


@pytest.mark.parametrize("label", ["fused-zero1", "fused-zero2", "fused-zero2-mb2"])
def test_zero_over_fused_buckets_equals_the_reference(results: list[dict[str, Any]],
                                                       reference: Any, label: str) -> None:
    ref_losses, ref_params = reference
    for r in range(WORLD):
        got = results[r][label]
        assert got["zero"] == int(label.split("zero")[1][0])
        assert got["segments"] == FUSED  # one ZeRO segment per plan bucket
        assert got["losses"] == pytest.approx(ref_losses, rel=1e-9)
        _assert_params(got["params"], ref_params, rtol=1e-9, atol=1e-11)


def test_zero1_over_the_compressed_path_equals_the_reference(results: list[dict[str, Any]],
                                                             reference: Any) -> None:
    ref_losses, ref_params = reference
    for r in range(WORLD):
        got = results[r]["fused-topk-ratio1-zero1"]
        assert got["zero"] == 1 and got["sync_buckets"] == FUSED
        assert got["losses"] == pytest.approx(ref_losses, rel=1e-6)
        _assert_params(got["params"], ref_params, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize(("sharded", "unsharded"), [("fused-topk-zero1", "fused-topk-zero0"),
                                                    ("fused-cast-zero2", "fused-cast-zero0")])
def test_zero_keeps_the_lossy_fused_path(results: list[dict[str, Any]], reference: Any,
                                         sharded: str, unsharded: str) -> None:
    _, ref_params = reference
    for r in range(WORLD):
        got, base = results[r][sharded], results[r][unsharded]
        assert got["zero"] > 0 and base["zero"] == 0
        assert got["losses"] == pytest.approx(base["losses"], rel=1e-12)
        _assert_params(got["params"], base["params"], rtol=0, atol=1e-12)
    diff = max(float((results[0][sharded]["params"][n] - v).abs().max())
               for n, v in ref_params.items())
    assert diff > 1e-6
