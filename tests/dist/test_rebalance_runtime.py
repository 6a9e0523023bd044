"""Runtime re-balancing on gloo: a pipeline trained k steps, re-balanced mid-run (layers,
parameters and Adam state moved point to point), continues with exactly the losses and
parameters of a run that never moved (same seeds); re-packing 4 -> 2 ranks likewise."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hetplan.errors import SpecError
from hetplan.profiling._spawn import run_local_ranks
from hetplan.runtime.rebalance import LayerStage, build_layer_stage, migrate

pytestmark = pytest.mark.dist

D, M, MB = 8, 4, 2
DT = torch.float64


def factory(k: int) -> nn.Module:
    """Layer ``k``; its initial weights depend only on ``k`` (not on where it is built)."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(1000 + k)
    layer = nn.Sequential(nn.Linear(D, D), nn.Tanh()).to(DT)
    torch.random.set_rng_state(gen_state)
    return layer


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return (torch.randn(M * MB, D, generator=g, dtype=DT),
            torch.randn(M * MB, D, generator=g, dtype=DT))


def train_step(stage: LayerStage, opt: torch.optim.Optimizer, s: int, n: int,
               step: int) -> float | None:
    """One GPipe iteration over ranks 0..n-1 (rank = stage index)."""
    x, y = batch(step)
    xs, ys = x.chunk(M), y.chunk(M)
    ins, outs = [], []
    for m in range(M):
        if s == 0:
            inp = xs[m]
        else:
            inp = torch.empty(MB, D, dtype=DT)
            dist.recv(inp, src=s - 1)
            inp.requires_grad_()
        out = stage(inp)
        if s < n - 1:
            dist.send(out.detach(), dst=s + 1)
        ins.append(inp)
        outs.append(out)
    total = 0.0
    for m in range(M):
        if s == n - 1:
            loss = F.mse_loss(outs[m], ys[m]) / M
            loss.backward()
            total += loss.item()
        else:
            g = torch.empty(MB, D, dtype=DT)
            dist.recv(g, src=s + 1)
            outs[m].backward(g)
        if s > 0:
            dist.send(ins[m].grad, dst=s - 1)
    opt.step()
    opt.zero_grad()
    return total if s == n - 1 else None


def worker(rank: int, world: int, old, new, switch: int, steps: int):
    torch.set_num_threads(1)
    stage = build_layer_stage(factory, old, rank)
    opt = torch.optim.Adam(stage.parameters(), lr=1e-2)
    bounds = old
    losses = {}
    for step in range(steps):
        if step == switch and new != old:
            stage, opt = migrate(stage, opt, bounds, new, rank, factory, list(range(len(bounds))))
            bounds = new
        if rank < len(bounds):
            loss = train_step(stage, opt, rank, len(bounds), step)
            if loss is not None:
                losses[step] = loss
    params = {k: [p.detach().clone() for p in stage.layers[str(k)].parameters()]
              for k in stage.indices}
    states = {k: [opt.state[p]["exp_avg_sq"].clone() for p in stage.layers[str(k)].parameters()]
              for k in stage.indices}
    return losses, params, states, stage.indices


def run(world: int, old, new, switch: int = 3, steps: int = 6):
    outs = run_local_ranks(worker, world, (old, new, switch, steps), timeout_s=180)
    losses, params, states, held = {}, {}, {}, []
    for lo, pa, stt, idx in outs:
        losses.update(lo)
        params.update(pa)
        states.update(stt)
        held.append(idx)
    return losses, params, states, held


def assert_same(a, b) -> None:
    la, pa, sa, _ = a
    lb, pb, sb, _ = b
    assert la == lb  # bitwise: same ops on the same values wherever they run
    assert sorted(pa) == sorted(pb)
    for k in pa:
        for x, y in zip(pa[k], pb[k]):
            assert torch.equal(x, y)
        for x, y in zip(sa[k], sb[k]):
            assert torch.equal(x, y)


def test_rebalance_mid_run_matches_a_run_that_never_moved() -> None:
    old = ((0, 1), (2, 7))
    new = ((0, 4), (5, 7))
    moved = run(2, old, new)
    still = run(2, old, old)
    assert len(moved[0]) == 6
    assert moved[3] == [[0, 1, 2, 3, 4], [5, 6, 7]]
    assert_same(moved, still)


def test_repack_4_to_2_ranks_continues_training() -> None:
    old = ((0, 1), (2, 3), (4, 5), (6, 7))
    new = ((0, 3), (4, 7))
    packed = run(4, old, new, switch=2, steps=5)
    still = run(4, old, old, switch=2, steps=5)
    assert packed[3] == [[0, 1, 2, 3], [4, 5, 6, 7], [], []]  # ranks 2, 3 released
    assert_same(packed, still)


def test_migrate_refuses_bad_assignments() -> None:
    stage = build_layer_stage(factory, ((0, 1), (2, 3)), 0)
    opt = torch.optim.Adam(stage.parameters())
    with pytest.raises(SpecError, match="expected a non-empty range"):
        migrate(stage, opt, ((0, 1), (3, 3)), ((0, 1), (2, 3)), 0, factory, [0, 1])
    with pytest.raises(SpecError, match="len"):
        migrate(stage, opt, ((0, 1), (2, 3)), ((0, 0), (1, 1), (2, 3)), 0, factory, [0, 1])
