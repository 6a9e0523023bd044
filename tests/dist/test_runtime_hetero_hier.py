"""A heterogeneous stage whose data-parallel group spans nodes runs a hierarchical gradient
sync (5 gloo ranks) and equals a single-process reference.

Cluster ``tests/fixtures/clusters/cpu-hetero-5.yaml``: a fast node with one CPU device (rank
0) and two slow nodes with two devices each (ranks 1-2, 3-4). The plan, built through the
plan API from the pieces ``compile_hetero`` assembles (the search itself prefers three
stages here), is ``cpu@fast 1x1 | cpu@slow 4x1``: stage 1's data-parallel group is ranks
1-4 on 2 nodes x 2 ranks, so the runtime splits it into intra-node groups (1, 2), (3, 4)
and inter-node groups (1, 3), (2, 4), as it does for a homogeneous plan; stage 1 runs
ZeRO-1, as the planner's stages with ``dp > 1`` do. gpt-test in float64 (eval mode), 2 SGD
steps, global batch 8 (2 micro-batches of 4 rows; 1 row per stage-1 replica).

One spawn runs three gradient-sync sections on the same plan, each a fresh ``Runtime``:

- ``hier``: every stage-1 tensor on Espresso's fp32 hierarchical routing (intra
  reduce-scatter, inter allreduce, intra allgather). The last stage's loss per step and
  every parameter equal the reference to ``rtol 1e-9, atol 1e-11`` (only the summation
  order differs).
- ``topk1``: as ``hier``, with stage 1's last block in one bucket on a two-level compressed
  hierarchical path (top-k, ratio 1: lossless, but the payload is the compressor's fp32
  values and indices through both levels). Every parameter equals the reference to fp32
  rounding (``rtol 1e-5, atol 1e-7``); the bucket's parameters are not bitwise those of
  ``hier`` (the compressed fp32 path ran).
- ``topk``: the same bucket at ratio 0.25 with error feedback (lossy). The four stage-1
  replicas hold bitwise-equal parameters after the steps, which differ from ``hier``'s.

Each check fails if a level's groups are wrong: a sum over the intra group alone, or an
inter group pairing ranks of one node, gives each replica half the batch's gradient.
Measured: the module (plan assembly, one spawn, three runs) took 47 s under pytest on this
shared 2-core machine.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import hetplan
from hetplan import zoo
from hetplan.algorithms.espresso_tree import (
    all_options,
    devices_of,
    is_hierarchical,
    num_compressions,
)
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan import Plan
from hetplan.ir.plan_checks import plan_problems
from hetplan.ir.plan_sections import Bucket, CommStep, GradientSync, NoSync, TensorSync
from hetplan.profiling._spawn import start_method

pytestmark = pytest.mark.dist

NAME, SEQ, VOCAB, STEPS, WORLD = "gpt-test", 32, 64, 2, 5
MB, M = 4, 2  # micro-batch rows, micro-batches: global batch 8
BATCH = MB * M
SPLIT = 3  # stage 0: the first SPLIT layers of the captured model
EXACT = {"rtol": 1e-9, "atol": 1e-11}
FP32 = {"rtol": 1e-5, "atol": 1e-7}
CLUSTER = Path(__file__).parents[1] / "fixtures" / "clusters" / "cpu-hetero-5.yaml"
HIER = NoSync(hierarchy="hierarchical", steps=(
    CommStep(level="intra", routine="reduce_scatter"), CommStep(level="inter"),
    CommStep(level="intra", routine="allgather")))
BUCKET_PREFIX = "blocks.3."


def _model() -> nn.Module:
    return zoo.build(NAME, device="cpu", seed=0, dtype=torch.float64).eval()


def _example() -> tuple[torch.Tensor, ...]:
    return tuple(zoo.example_inputs(NAME, batch=1, device="cpu")[0])


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05)


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model()
    opt = _sgd(list(model.parameters()))
    losses = []
    for step in range(STEPS):
        ids, y = _data(step)
        loss = _loss(model(ids), y)
        loss.backward()
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _two_level_option() -> int:
    """A hierarchical option of Espresso's tree that compresses at both levels."""
    for oid, opt in enumerate(all_options()):
        if is_hierarchical(opt) and devices_of(opt) == {"gpu"} and num_compressions(opt) == 2:
            return oid
    raise AssertionError("the tree has no two-compression hierarchical option")


def _plan() -> Plan:
    """``cpu@fast 1x1 | cpu@slow 4x1``, assembled as ``compile_hetero`` assembles a plan
    (same layout, stages, section and action lists), without a gradient-sync section."""
    from hetplan.algorithms.pipeline_schedules import layout_actions
    from hetplan.ir.plan_hetero import Hetero, StageShape
    from hetplan.ir.plan_sections import Layout, Stage
    from hetplan.optimizer.hetero import choose_hetero

    spec = ClusterSpec.load(CLUSTER)
    assert [spec.node_of(r) for r in range(WORLD)] == [0, 1, 1, 2, 2]
    ir = hetplan.capture(_model(), _example(), name=NAME)
    searched = choose_hetero(hetplan.compile(ir, spec, batch_size=20, dtype="fp32"),
                             spec, None, 20, "on")
    workload = searched.model.workload
    assert workload is not None and searched.hetero is not None
    names = [x.name for x in workload.layers]
    layout = Layout(dp=1, pp=2, tp=1, micro_batches=M, micro_batch_size=MB,
                    global_batch_size=BATCH, schedule="1f1b")
    stages = (Stage(index=0, first_layer=0, last_layer=SPLIT - 1,
                    layer_names=tuple(names[:SPLIT]), ranks=(0,)),
              Stage(index=1, first_layer=SPLIT, last_layer=len(names) - 1,
                    layer_names=tuple(names[SPLIT:]), ranks=(1, 2, 3, 4)))
    hetero = Hetero(stages=(
        StageShape(stage=0, device_class="cpu@fast", dp=1, tp=1, micro_batch_size=MB,
                   zero_stage=0),
        StageShape(stage=1, device_class="cpu@slow", dp=4, tp=1, micro_batch_size=MB // 4,
                   zero_stage=1)), search=searched.hetero.search)
    return Plan(model=searched.model, cluster=searched.cluster, layout=layout, stages=stages,
                pipeline_actions=layout_actions(layout), hetero=hetero,
                cost_settings=searched.cost_settings, precision=searched.precision)


def _stage1_grads(plan: Plan) -> list[str]:
    workload = plan.model.workload
    assert workload is not None
    return [g.name for g in workload.grads if g.layer_index >= SPLIT]


def _with_sync(plan: Plan, bucket: Any = None) -> Plan:
    """``plan`` with every stage-1 tensor on ``HIER``; with ``bucket`` (a strategy), the
    tensors of ``BUCKET_PREFIX`` fused into one bucket on it."""
    names = _stage1_grads(plan)
    fused = [n for n in names if n.startswith(BUCKET_PREFIX)] if bucket is not None else []
    strategies: dict[str, Any] = {"hier": HIER}
    buckets: tuple[Bucket, ...] = ()
    if fused:
        strategies["comp"] = bucket
        buckets = (Bucket(tensors=tuple(fused), size_bytes=1, strategy="comp"),)
    sync = GradientSync(strategies=strategies, buckets=buckets, tensors=tuple(
        TensorSync(name=n, strategy="hier") for n in names if n not in fused))
    out = Plan.model_validate(plan.model_copy(update={"gradient_sync": sync}).model_dump())
    assert plan_problems(out) == [], plan_problems(out)
    return out


def _plans() -> dict[str, Plan]:
    from hetplan.passes.espresso import strategy_for

    plan, oid = _plan(), _two_level_option()
    return {"hier": _with_sync(plan),
            "topk1": _with_sync(plan, strategy_for(("topk", oid), ratio=1.0)),
            "topk": _with_sync(plan, strategy_for(("topk", oid), ratio=0.25))}


def _worker(rank: int, world: int, store_dir: str, plans: dict[str, str], out: str) -> None:
    torch.set_num_threads(1)
    from hetplan.runtime.executor import Runtime

    store = dist.FileStore(os.path.join(store_dir, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    result: dict[str, Any] = {}
    try:
        for label, plan_json in plans.items():
            rt = Runtime(Plan.from_json(plan_json), _model(), example_args=_example(),
                         loss_fn=_loss, optimizer=_sgd)
            g = rt.ctx.groups
            assert g is not None
            result[label] = {
                "losses": [rt.train_step(*_data(step)) for step in range(STEPS)],
                "params": {n: p.detach().clone() for n, p in rt.named_params},
                "levels": (g.dp_ranks, g.dp_intra_ranks, g.dp_inter_ranks)}
            rt.close()
        torch.save(result, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("hetero-hier")
    plans = {k: p.to_json() for k, p in _plans().items()}
    mp.start_processes(_worker, args=(WORLD, str(tmp), plans, str(tmp / "out")),
                       nprocs=WORLD, join=True, start_method=start_method())
    return [torch.load(tmp / f"out.{r}") for r in range(WORLD)]


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    return _reference()


def _last_stage_loss(results: list[dict[str, Any]], label: str) -> list[float]:
    """Mean over stage 1's replicas of each one's loss (the mean over its rows)."""
    per_rank = [results[r][label]["losses"] for r in range(1, WORLD)]
    assert all(x != x for x in results[0][label]["losses"])  # stage 0 reports no loss
    return [sum(xs) / len(xs) for xs in zip(*per_rank)]


def _check_params(results: list[dict[str, Any]], label: str,
                  ref: dict[str, torch.Tensor], tol: dict[str, float]) -> None:
    seen: set[str] = set()
    for r in range(WORLD):
        for n, value in results[r][label]["params"].items():
            torch.testing.assert_close(value, ref[n], **tol, msg=lambda m, n=n: f"{n}: {m}")
            seen.add(n)
    assert seen == set(ref), f"unchecked: {sorted(set(ref) - seen)}"


def test_stage_dp_group_split_by_node(results: list[dict[str, Any]]) -> None:
    levels = [results[r]["hier"]["levels"] for r in range(WORLD)]
    assert levels == [((0,), None, None),
                      ((1, 2, 3, 4), (1, 2), (1, 3)), ((1, 2, 3, 4), (1, 2), (2, 4)),
                      ((1, 2, 3, 4), (3, 4), (1, 3)), ((1, 2, 3, 4), (3, 4), (2, 4))]


def test_hierarchical_fp32_equals_reference(
        results: list[dict[str, Any]],
        reference: tuple[list[float], dict[str, torch.Tensor]]) -> None:
    losses, ref = reference
    assert _last_stage_loss(results, "hier") == pytest.approx(losses, rel=1e-9)
    _check_params(results, "hier", ref, EXACT)


def test_lossless_compressed_bucket_equals_reference_to_fp32(
        results: list[dict[str, Any]],
        reference: tuple[list[float], dict[str, torch.Tensor]]) -> None:
    losses, ref = reference
    assert _last_stage_loss(results, "topk1") == pytest.approx(losses, rel=1e-6)
    _check_params(results, "topk1", ref, FP32)
    bucket = [n for n in results[1]["topk1"]["params"] if n.startswith(BUCKET_PREFIX)]
    assert bucket
    assert any(not torch.equal(results[1]["topk1"]["params"][n], results[1]["hier"]["params"][n])
               for n in bucket)


def test_lossy_compressed_bucket_keeps_replicas_equal(results: list[dict[str, Any]]) -> None:
    first = results[1]["topk"]["params"]
    for r in range(2, WORLD):
        got = results[r]["topk"]["params"]
        assert sorted(got) == sorted(first)
        for n, value in got.items():
            assert torch.equal(value, first[n]), f"rank {r}: {n} differs from rank 1"
    bucket = [n for n in first if n.startswith(BUCKET_PREFIX)]
    assert any(not torch.equal(first[n], results[1]["hier"]["params"][n]) for n in bucket)
