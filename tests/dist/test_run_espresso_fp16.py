"""`hetplan run` on Espresso paths with 16-bit uncompressed steps (issue 24): 4 gloo ranks as
2 nodes x 2 (``cpu-2x2``; node 0 = ranks 0-1, node 1 = ranks 2-3), the regressor of
``examples/train.py``, its gradients synchronised as the reference implementation's "FP16
inside the node, compression across nodes" options do. The training script
(``tests/fixtures/espresso_grads_script.py``) saves every rank's synchronised gradients of
the first step; the fp32 reference is the mean of the four replicas' local gradients,
recomputed here.

Paths (tree option ids; ``a ~ b`` marks a compressed step):

* ``128``: intra reduce_scatter (fp16) · compress · inter ~allgather · decompress · intra
  allgather (fp16). Two 16-bit stretches: four casts.
* ``64``: intra reduce_scatter (fp16) · inter allreduce (fp16) · compress · intra
  ~allgather · decompress. One stretch of two steps: two casts.

Error bounds (``u = 2^-11``, fp16's unit roundoff; ``x_r`` rank ``r``'s gradient, ``y = sum_r
x_r``, ``fl`` rounding to fp16, sums of two fp16 values rounded once):

* node sum ``s_n = fl(fl(x_a) + fl(x_b))``: ``|s_n - (x_a + x_b)| <= (2u + u^2)(|x_a| +
  |x_b|)`` per element (plus ``3 * 2^-25`` absolute below fp16's normal range);
* ``topk`` is deterministic, so the test rebuilds the exact composition (fp16 rounding of
  the partial sums, top-k per shard, fp16 rounding of the aggregated shard) and compares
  within one fp16 rounding of the result (the ranks' local gradients and these may differ
  in the last fp32 bits);
* ``dgc`` keeps the top ``k'`` of each shard for some ``1 <= k' <= 2k`` (seeded sample):
  ``||e|| <= sqrt(1 - 1/m) ||s||`` per shard of ``m`` elements (``compressors.py``). With the
  final fp16 rounding of the aggregate ``z``: ``||4 g - y|| <= u ||z|| + sum_{n,shards}
  sqrt(1 - 1/m) ||s_n[shard]|| + ||sum_n (s_n - y_n)||``, and at most ``nodes * 2k``
  elements of a shard are non-zero.

The casts: the runtime casts once into and once out of each 16-bit stretch, and the cost
model prices the same casts (ops labelled ``cast``, ``cast+compress``, ``decompress+cast``).
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import hetplan
from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.evaluate import _strategy_ops
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan_sections import CompressedSync, GradientSync, NoSync, Stage, TensorSync
from hetplan.passes.espresso import strategy_for
from hetplan.runtime.compressors import make_compressor
from hetplan.runtime.routines import chunk_bounds

pytestmark = pytest.mark.dist

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "fixtures" / "espresso_grads_script.py"
WORLD, NODES, PER_NODE = 4, 2, 2
U = 2.0**-11
RATIO = 0.05

#: gradient -> (strategy name, compressor, tree option)
CHOICE = {
    "blocks.0.0.weight": ("topk128", "topk", 128),
    "blocks.1.2.weight": ("topk128", "topk", 128),
    "blocks.2.0.weight": ("topk64", "topk", 64),
    "blocks.3.0.weight": ("dgc128", "dgc", 128),
    "blocks.3.2.weight": ("dgc128", "dgc", 128),
}


def _strategy(comp: str, oid: int) -> CompressedSync:
    s = strategy_for((comp, oid, "fp16"), ratio=RATIO)
    assert isinstance(s, CompressedSync) and s.uncompressed_dtype == "fp16"
    return s


def _plan() -> hetplan.Plan:
    sys.path.insert(0, str(REPO))
    try:
        from examples.train import factory
    finally:
        sys.path.remove(str(REPO))
    model, example = factory()
    ir = hetplan.capture(model, example)
    plan = hetplan.compile(ir, ClusterSpec.from_preset("cpu-2x2"), batch_size=16, dp=WORLD,
                           pp=1, tp=1, zero_stage=0)  # the script reads whole gradients
    assert plan.model.workload is not None
    grads = [g.name for g in plan.model.workload.grads]
    assert set(CHOICE) <= set(grads)
    strategies: dict[str, Any] = {"fp32": NoSync()}
    for name, comp, oid in CHOICE.values():
        strategies[name] = _strategy(comp, oid)
    sync = GradientSync(
        strategies=strategies,
        tensors=tuple(TensorSync(name=g, strategy=CHOICE[g][0] if g in CHOICE else "fp32")
                      for g in grads))
    return plan.model_copy(update={"gradient_sync": sync})


def _local_grads() -> list[dict[str, torch.Tensor]]:
    """Each replica's fp32 gradient on its rows of the script's batch (the reference's parts)."""
    sys.path.insert(0, str(REPO))
    try:
        from examples.train import factory
    finally:
        sys.path.remove(str(REPO))
    spec = importlib.util.spec_from_file_location("espresso_grads_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    x, y = script.batch()
    b = x.shape[0] // WORLD
    out = []
    for d in range(WORLD):
        model, _ = factory()
        loss = torch.nn.functional.mse_loss(model(x[d * b:(d + 1) * b]), y[d * b:(d + 1) * b])
        loss.backward()
        out.append({n: p.grad.detach().reshape(-1).clone() for n, p in model.named_parameters()
                    if p.grad is not None})
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[hetplan.Plan, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("espresso_fp16")
    plan = _plan()
    plan.save(tmp / "plan.json")
    env = dict(os.environ, HETPLAN_GRADS_OUT=str(tmp), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "hetplan.cli", "run", str(tmp / "plan.json"), "--script",
         str(SCRIPT), "--steps", "2"],
        capture_output=True, text=True, timeout=300, check=False, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return plan, [torch.load(tmp / f"rank{r}.pt") for r in range(WORLD)]


def _fl(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).to(torch.float32)


def _node_sums(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """``s_n``: the fp16 sum of node ``n``'s two fp16 gradients (the intra reduce_scatter)."""
    return [_fl(_fl(xs[2 * n]) + _fl(xs[2 * n + 1])) for n in range(NODES)]


def test_every_rank_holds_the_same_gradients(run: tuple[hetplan.Plan, list]) -> None:
    _, res = run
    for r in range(1, WORLD):
        assert res[r]["grads"].keys() == res[0]["grads"].keys()
        for n, g in res[0]["grads"].items():
            assert torch.equal(res[r]["grads"][n], g), (n, r)


def test_fp32_tensors_are_the_mean(run: tuple[hetplan.Plan, list]) -> None:
    _, res = run
    xs = _local_grads()
    for n, g in res[0]["grads"].items():
        if n in CHOICE:
            continue
        ref = sum(x[n] for x in xs) / WORLD
        assert torch.allclose(g.reshape(-1), ref, rtol=1e-5, atol=1e-7), n


def test_topk_paths_match_the_exact_composition(run: tuple[hetplan.Plan, list]) -> None:
    """Rebuilt by hand: fp16 partial sums, top-k per shard, fp16 rounding of the aggregate."""
    _, res = run
    xs = _local_grads()
    comp = make_compressor("topk", {"ratio": RATIO})
    checked = 0
    for n, (_, name, oid) in CHOICE.items():
        if name != "topk":
            continue
        parts = [x[n] for x in xs]
        numel = parts[0].numel()
        shards = chunk_bounds(0, numel, PER_NODE, "scatter")
        s = _node_sums(parts)
        if oid == 128:  # top-k of each node's shard, summed over nodes, fp16 again
            z = torch.cat([sum(comp.roundtrip(s[k][a:b]) for k in range(NODES))
                           for a, b in shards])
            expect = _fl(z)
        else:  # 64: fp16 allreduce of the node sums, then top-k per shard
            total = _fl(s[0] + s[1])
            expect = torch.cat([comp.roundtrip(total[a:b]) for a, b in shards])
        got = res[0]["grads"][n].reshape(-1) * WORLD
        assert torch.equal(_fl(got), got)  # the last stretch (or the sum it compressed) was fp16
        assert torch.allclose(got, expect, rtol=U / 8, atol=1e-9), (
            n, float((got - expect).abs().max()))
        y = sum(parts)
        assert not torch.allclose(got, y, rtol=1e-3)  # lossy: top-k dropped most of it
        checked += 1
    assert checked == 3


def test_dgc_path_within_its_documented_error(run: tuple[hetplan.Plan, list]) -> None:
    _, res = run
    xs = _local_grads()
    k_of = lambda m: max(1, int(m * RATIO))  # noqa: E731
    checked = 0
    for n, (_, name, _oid) in CHOICE.items():
        if name != "dgc":
            continue
        parts = [x[n] for x in xs]
        y = sum(parts)
        numel = y.numel()
        got = res[0]["grads"][n].reshape(-1) * WORLD
        s = _node_sums(parts)
        shards = chunk_bounds(0, numel, PER_NODE, "scatter")
        dropped = sum(math.sqrt(1 - 1 / (b - a)) * float(s[k][a:b].norm())
                      for k in range(NODES) for a, b in shards)
        fp16_in = float(sum(s[k] - (parts[2 * k] + parts[2 * k + 1])
                            for k in range(NODES)).norm())
        bound = U * float(got.norm()) * (1 + U) + dropped + fp16_in + 1e-6
        err = float((got - y).norm())
        assert err <= bound, (n, err, bound)
        assert 0 < err  # lossy
        for a, b in shards:  # at most 2k kept per node and shard
            assert 0 < int((got[a:b] != 0).sum()) <= NODES * 2 * k_of(b - a)
        checked += 1
    assert checked == 2


def test_runtime_casts_what_the_cost_model_prices(run: tuple[hetplan.Plan, list]) -> None:
    """One cast into and one out of each 16-bit stretch, per tensor (each is its own bucket
    here), in both the runtime's count and the priced ops."""
    plan, res = run
    costs = CostModel(ClusterSpec.from_preset("cpu-2x2"))
    stage = Stage(index=0, first_layer=0, last_layer=0, ranks=tuple(range(WORLD)))
    priced = 0
    for _, comp, oid in CHOICE.values():
        ops = _strategy_ops(_strategy(comp, oid), 8192.0, costs, stage, WORLD, "inter",
                            NODES, PER_NODE)
        priced += sum(1 for o in ops if "cast" in o.label)
    assert priced == 4 + 4 + 2 + 4 + 4
    for r in range(WORLD):
        assert res[r]["casts"] == priced, r
