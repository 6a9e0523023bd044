"""Zen's sparse sync on 4 gloo ranks: Embedding(20000, 32) + MLP on Zipf-distributed tokens.

- the summed embedding gradient of Zen (hash-bitmap pull and COO pull) and of AGsparse equals
  the single-process reference (the float64 sum of the ranks' gradients) to 1e-6;
- training K SGD steps with the dense parameters on the gradient path's all-reduce and the
  embedding on Zen ends at the parameters of single-process training on the whole batch,
  to 1e-6.

One spawn of 4 processes runs everything.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from zen_model import EmbeddingMLP, zipf_tokens  # noqa: E402

from hetplan.profiling._spawn import run_local_ranks  # noqa: E402
from hetplan.runtime.grad_sync import GradSync  # noqa: E402
from hetplan.runtime.sparse_sync import (  # noqa: E402
    ZenState,
    agsparse_allreduce,
    nonzero_rows,
    zen_allreduce,
)

pytestmark = pytest.mark.dist

WORLD, BATCH, SEQ, ROWS, STEPS, LR, SEED = 4, 32, 16, 20000, 5, 0.5, 1234


def _model() -> EmbeddingMLP:
    torch.manual_seed(0)
    return EmbeddingMLP(ROWS, 32)


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = zipf_tokens(BATCH, SEQ, ROWS, seed=step)
    y = torch.randint(0, 10, (BATCH,), generator=torch.Generator().manual_seed(step))
    return x, y


def _shard(rank: int) -> slice:
    return slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)


def _local_grad(model: nn.Module, rank: int, step: int) -> None:
    x, y = _data(step)
    model.zero_grad()
    nn.functional.cross_entropy(model(x[_shard(rank)]), y[_shard(rank)]).backward()


def _rank(rank: int, world: int) -> dict[str, Any]:
    group = dist.group.WORLD
    out: dict[str, Any] = {}
    model = _model()
    _local_grad(model, rank, 0)
    g = model.emb.weight.grad.detach().clone()
    out["nnz"] = int(nonzero_rows(g).numel())
    state = ZenState(ROWS, world, SEED)
    out["zen-bitmap"] = zen_allreduce(g, state, group, rank, "bitmap")
    out["zen-coo"] = zen_allreduce(g, state, group, rank, "coo")
    out["agsparse"] = agsparse_allreduce(g, group, world)
    # training: dense parameters through the gradient path, the embedding through Zen
    model = _model()
    dense = [(n, p) for n, p in model.named_parameters() if n != "emb.weight"]
    sync = GradSync(dense, None, group, world)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        _local_grad(model, rank, step)
        sync.finish()
        emb = model.emb.weight
        emb.grad.copy_(zen_allreduce(emb.grad, state, group, rank) / world)
        opt.step()
    sync.close()
    out["trained"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_local_ranks(_rank, WORLD, timeout_s=300, threads_per_process=1)


def _reference_sum() -> torch.Tensor:
    """The float64 sum over ranks of each rank's embedding gradient."""
    total = torch.zeros(ROWS, 32, dtype=torch.float64)
    for r in range(WORLD):
        model = _model()
        _local_grad(model, r, 0)
        total += model.emb.weight.grad.double()
    return total


def test_the_gradient_is_sparse_and_overlapping(results: list[dict[str, Any]]) -> None:
    ref = _reference_sum()
    union = int(ref.ne(0).any(dim=1).sum())
    per_rank = [res["nnz"] for res in results]
    assert max(per_rank) / ROWS < 0.03  # d_G about 1 %
    assert max(per_rank) < union < sum(per_rank)  # partial overlap (1 < gamma < n)


@pytest.mark.parametrize("scheme", ["zen-bitmap", "zen-coo", "agsparse"])
def test_synced_gradient_equals_reference(results: list[dict[str, Any]], scheme: str) -> None:
    ref = _reference_sum()
    for r in range(WORLD):
        got = results[r][scheme].double()
        assert torch.allclose(got, ref, atol=1e-6, rtol=0), (scheme, r,
                                                             float((got - ref).abs().max()))
        assert torch.equal(results[r][scheme], results[0][scheme])


def test_k_training_steps_equal_single_process(results: list[dict[str, Any]]) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = _data(step)
        model.zero_grad()
        # the mean over ranks of each rank's mean loss is the whole batch's mean loss
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    moved = float((model.emb.weight.detach() - _model().emb.weight.detach()).abs().max())
    assert moved > 1e-3  # the embedding trained
    for name, p in model.named_parameters():
        for r in range(WORLD):
            got = results[r]["trained"][name]
            assert torch.allclose(got, p.detach(), atol=1e-6, rtol=0), (
                name, r, float((got - p.detach()).abs().max()))
