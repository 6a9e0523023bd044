"""The gradient path with compressed and fused buckets on 4 gloo ranks as 2 nodes × 2 devices.

- fused (one bucket) and unfused (per-tensor strategies) sync give the float64 reference mean
  gradient: equal for fp32 paths, within QSGD's documented error for a lossy hierarchical path;
- with error feedback, top-k training ends within a stated tolerance of uncompressed training.

One spawn of 4 processes runs everything.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from hetplan.algorithms.espresso_tree import (
    all_options,
    devices_of,
    is_hierarchical,
    num_compressions,
)
from hetplan.ir.plan_sections import (
    Bucket,
    CommStep,
    GradientSync,
    Layout,
    NoSync,
    RankPlacement,
    TensorSync,
)
from hetplan.models import MLP
from hetplan.passes.espresso import strategy_for
from hetplan.profiling._spawn import run_local_ranks
from hetplan.runtime.grad_sync import GradSync
from hetplan.runtime.groups import ParallelGroups

pytestmark = pytest.mark.dist

WORLD, BATCH, STEPS, LR = 4, 32, 25, 0.2
LEVELS = 127


def _layout() -> Layout:
    return Layout(dp=WORLD, micro_batch_size=BATCH // WORLD, ranks=tuple(
        RankPlacement(rank=r, node=r // 2, local_rank=r % 2, dp=r) for r in range(WORLD)))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return MLP(in_features=8, hidden=(16,), out_features=4)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(BATCH, 8, generator=g)
    w = torch.randn(8, 4, generator=g)
    return x, torch.tanh(x @ w)


def _two_level_option() -> int:
    """A GPU-only hierarchical option that compresses twice (intra and inter)."""
    for oid, opt in enumerate(all_options()):
        if is_hierarchical(opt) and devices_of(opt) == {"gpu"} and num_compressions(opt) == 2:
            return oid
    raise AssertionError("the tree has no two-compression hierarchical option")


def _sync(names: list[str], strategy: Any, fused: bool) -> GradientSync:
    if fused:
        return GradientSync(strategies={"s": strategy},
                            buckets=(Bucket(tensors=tuple(names), size_bytes=1, strategy="s"),))
    return GradientSync(strategies={"s": strategy},
                        tensors=tuple(TensorSync(name=n, strategy="s") for n in names))


def _grads(model: nn.Module, sync: GradSync, rank: int) -> list[torch.Tensor]:
    x, y = _data()
    shard = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    model.zero_grad()
    nn.functional.mse_loss(model(x[shard]), y[shard]).backward()
    sync.finish()
    return [p.grad.detach().clone() for p in model.parameters()]


def _train(strategy: Any, groups: ParallelGroups, rank: int) -> list[float]:
    model = _model()
    names = [n for n, _ in model.named_parameters()]
    sync = GradSync(list(model.named_parameters()), _sync(names, strategy, True),
                    groups.dp_group, WORLD, groups.sync_levels())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = _data()
    losses = []
    for _ in range(STEPS):
        _grads(model, sync, rank)
        opt.step()
        with torch.no_grad():
            losses.append(float(nn.functional.mse_loss(model(x), y)))
    sync.close()
    return losses


def _rank(rank: int, world: int) -> dict[str, Any]:
    groups = ParallelGroups.build(_layout(), rank)
    oid = _two_level_option()
    hier_fp32 = NoSync(hierarchy="hierarchical", steps=(
        CommStep(level="intra", routine="reduce_scatter"), CommStep(level="inter"),
        CommStep(level="intra", routine="allgather")))
    cases = {"fp32": NoSync(), "fp32-hier": hier_fp32,
             "qsgd-hier": strategy_for(("qsgd", oid)).model_copy(
                 update={"params": {"levels": LEVELS}})}
    out: dict[str, Any] = {"levels": (groups.dp_intra_ranks, groups.dp_inter_ranks)}
    for label, strategy in cases.items():
        for fused in (True, False):
            model = _model()
            names = [n for n, _ in model.named_parameters()]
            sync = GradSync(list(model.named_parameters()), _sync(names, strategy, fused),
                            groups.dp_group, WORLD, groups.sync_levels())
            out[f"{label}/{'fused' if fused else 'unfused'}"] = _grads(model, sync, rank)
            x, y = _data()
            shard = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
            model.zero_grad()
            nn.functional.mse_loss(model(x[shard]), y[shard]).backward()
            out[f"local/{rank}"] = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            sync.close()
    topk = strategy_for(("topk", oid), ratio=0.1)
    out["train/fp32"] = _train(NoSync(), groups, rank)
    out["train/topk-ef"] = _train(topk, groups, rank)
    out["train/topk-no-ef"] = _train(topk.model_copy(update={"error_feedback": False}),
                                     groups, rank)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_local_ranks(_rank, WORLD, timeout_s=300, threads_per_process=1)


def _reference() -> torch.Tensor:
    """Mean over the 4 shards of the shard-mean-loss gradient, in float64."""
    model = _model().double()
    x, y = _data()
    model(x.double())
    loss = sum(nn.functional.mse_loss(model(x[r * 8:(r + 1) * 8].double()),
                                      y[r * 8:(r + 1) * 8].double()) for r in range(WORLD))
    (loss / WORLD).backward()  # type: ignore[operator]
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _flat(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in grads]).double()


def test_node_groups_from_the_layout(results: list[dict[str, Any]]) -> None:
    assert results[0]["levels"] == ((0, 1), (0, 2))
    assert results[3]["levels"] == ((2, 3), (1, 3))


def test_fp32_fused_equals_unfused_equals_reference(results: list[dict[str, Any]]) -> None:
    ref = _reference()
    for label in ("fp32", "fp32-hier"):
        fused, unfused = _flat(results[0][f"{label}/fused"]), _flat(results[0][f"{label}/unfused"])
        assert torch.allclose(fused, ref, atol=1e-6), label
        assert torch.allclose(fused, unfused, atol=1e-7), label
        for r in range(1, WORLD):
            assert torch.equal(_flat(results[r][f"{label}/fused"]), fused)


def test_qsgd_fused_and_unfused_within_documented_error(results: list[dict[str, Any]]) -> None:
    """Two QSGD sites (each rank's intra piece, then each node's re-compressed aggregate):
    per element |error| < 2 * sum_r ||g_r|| / s on the sum, / WORLD on the mean."""
    ref = _reference()
    norms = sum(float(results[r][f"local/{r}"].norm()) for r in range(WORLD))
    bound = 2 * norms / LEVELS / WORLD * 1.01
    fused = _flat(results[0]["qsgd-hier/fused"])
    unfused = _flat(results[0]["qsgd-hier/unfused"])
    for got in (fused, unfused):
        err = (got - ref).abs()
        assert (err < bound).all() and float(err.max()) > 0
    assert float((fused - unfused).abs().max()) < 2 * bound
    for r in range(1, WORLD):
        assert torch.equal(_flat(results[r]["qsgd-hier/fused"]), fused)


def test_error_feedback_training_tracks_uncompressed(results: list[dict[str, Any]]) -> None:
    """Top-k (10 %) on a two-level hierarchical path, 25 SGD steps: with error feedback the
    final loss is within 10 % of the initial loss of uncompressed training's final loss."""
    fp32, ef, no_ef = (results[0][f"train/{k}"] for k in ("fp32", "topk-ef", "topk-no-ef"))
    assert fp32[-1] < 0.8 * fp32[0]  # the task trains
    assert abs(ef[-1] - fp32[-1]) <= 0.1 * fp32[0], (ef[-1], fp32[-1], no_ef[-1])
    # and error feedback is what keeps it there: without it top-k drifts further away
    assert abs(no_ef[-1] - fp32[-1]) > abs(ef[-1] - fp32[-1])
    for r in range(1, WORLD):
        assert results[r]["train/topk-ef"] == ef
