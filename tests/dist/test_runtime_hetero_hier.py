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

Without the per-stage subgroups stage 1's ranks refuse the first case at setup (the
grad-sync path's ``SpecError``: no 'intra' group) and the module fails: rank 0, which syncs
nothing, waits on the pipeline until the spawn's limit (``TIMEOUT_S``; checked). With the
intra group passed as the inter level too, the ranks fail in the path. A sum over the intra group alone would give each replica half the
batch's gradient, which the reference comparison rejects. The cases share one process group
(``reflib.run_each``, docs/decisions/test-budget.md); the reference is ``reflib``'s.
Measured: the module took 38 s under pytest on this shared 2-core machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from reflib import (
    case_results,
    lm_data,
    lm_loss,
    run_each,
    sgd,
    zoo_example,
    zoo_model,
    zoo_reference,
)

import hetplan
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
from hetplan.profiling._spawn import run_local_ranks

pytestmark = pytest.mark.dist

NAME, SEQ, STEPS, WORLD = "gpt-test", 32, 2, 5
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
TIMEOUT_S = 180  # process-group timeout and wall limit: 4-5x the measured run


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
    ir = hetplan.capture(zoo_model(NAME), zoo_example(NAME)[0], name=NAME)
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
                   zero_stage=1)))  # no search record: the search ran at another batch
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


def _train(plan_json: str) -> dict[str, Any]:
    from hetplan.runtime.executor import Runtime

    rt = Runtime(Plan.from_json(plan_json), zoo_model(NAME), example_args=zoo_example(NAME)[0],
                 loss_fn=lm_loss, optimizer=sgd)
    g = rt.ctx.groups
    assert g is not None
    out = {"losses": [rt.train_step(*lm_data(step, BATCH, SEQ)) for step in range(STEPS)],
           "params": {n: p.detach().clone() for n, p in rt.named_params},
           "levels": (g.dp_ranks, g.dp_intra_ranks, g.dp_inter_ranks)}
    rt.close()
    return out


def _rank(rank: int, world: int, plans: dict[str, str]) -> dict[str, dict[str, Any]]:
    return run_each(plans, _train)


@pytest.fixture(scope="module")
def results() -> list[dict[str, dict[str, Any]]]:
    """Every rank's ``label -> result`` (one spawn runs all cases)."""
    plans = {k: p.to_json() for k, p in _plans().items()}
    return run_local_ranks(_rank, WORLD, (plans,), timeout_s=TIMEOUT_S,
                           threads_per_process=1)


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    return zoo_reference(NAME, BATCH, SEQ, STEPS)


def _last_stage_loss(ranks: list[dict[str, Any]]) -> list[float]:
    """Mean over stage 1's replicas of each one's loss (the mean over its rows)."""
    assert all(x != x for x in ranks[0]["losses"])  # stage 0 reports no loss
    return [sum(xs) / len(xs) for xs in zip(*(r["losses"] for r in ranks[1:]))]


def _check_params(ranks: list[dict[str, Any]], ref: dict[str, torch.Tensor],
                  tol: dict[str, float]) -> None:
    seen: set[str] = set()
    for r in ranks:
        for n, value in r["params"].items():
            torch.testing.assert_close(value, ref[n], **tol, msg=lambda m, n=n: f"{n}: {m}")
            seen.add(n)
    assert seen == set(ref), f"unchecked: {sorted(set(ref) - seen)}"


def test_stage_dp_group_split_by_node(results: list[dict[str, dict[str, Any]]]) -> None:
    levels = [r["levels"] for r in case_results(results, "hier")]
    assert levels == [((0,), None, None),
                      ((1, 2, 3, 4), (1, 2), (1, 3)), ((1, 2, 3, 4), (1, 2), (2, 4)),
                      ((1, 2, 3, 4), (3, 4), (1, 3)), ((1, 2, 3, 4), (3, 4), (2, 4))]


def test_hierarchical_fp32_equals_reference(
        results: list[dict[str, dict[str, Any]]],
        reference: tuple[list[float], dict[str, torch.Tensor]]) -> None:
    losses, ref = reference
    ranks = case_results(results, "hier")
    assert _last_stage_loss(ranks) == pytest.approx(losses, rel=1e-9)
    _check_params(ranks, ref, EXACT)


def test_lossless_compressed_bucket_equals_reference_to_fp32(
        results: list[dict[str, dict[str, Any]]],
        reference: tuple[list[float], dict[str, torch.Tensor]]) -> None:
    losses, ref = reference
    ranks = case_results(results, "topk1")
    assert _last_stage_loss(ranks) == pytest.approx(losses, rel=1e-6)
    _check_params(ranks, ref, FP32)
    got, hier = ranks[1]["params"], case_results(results, "hier")[1]["params"]
    bucket = [n for n in got if n.startswith(BUCKET_PREFIX)]
    assert bucket and any(not torch.equal(got[n], hier[n]) for n in bucket)


def test_lossy_compressed_bucket_keeps_replicas_equal(
        results: list[dict[str, dict[str, Any]]]) -> None:
    ranks = case_results(results, "topk")
    first = ranks[1]["params"]
    for r in range(2, WORLD):
        got = ranks[r]["params"]
        assert sorted(got) == sorted(first)
        for n, value in got.items():
            assert torch.equal(value, first[n]), f"rank {r}: {n} differs from rank 1"
    hier = case_results(results, "hier")[1]["params"]
    bucket = [n for n in first if n.startswith(BUCKET_PREFIX)]
    assert any(not torch.equal(first[n], hier[n]) for n in bucket)
