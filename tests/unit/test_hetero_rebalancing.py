"""Re-balancing a pipeline of per-stage degrees, in one process: the shard rules a move cuts
and gathers with (:mod:`hetplan.runtime.handlers.hetero_rebalancing`), and which applied
events the runtime still refuses (:func:`~hetplan.runtime.hetero_ranks.hetero_refusals`).

For every module the tensor-parallel handler builds — column and row linears (uneven
shards, a zero-width shard), the fused QKV projection of split attention, the
vocabulary-parallel embedding, and a column linear built from an HF ``Conv1D`` ([in, out]
weights) — and every TP rank: :func:`local_part` of the full tensor is exactly what the
module holds, and :func:`gather_full` of the ranks' shards (each placed in a zero buffer; the
TP group would sum them) summed over the ranks is the full tensor. A replicated parameter
(a row linear's bias, a LayerNorm) is taken whole.

Refusals: an applied event on stages ``1x1 | 2x2`` runs with the dp-2 stage at ZeRO-0 or
ZeRO-1 (what a stage's shape can hold); re-packing (fewer stages) never reaches the runtime:
the plan's validator refuses it, naming the field.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hetplan.ir.plan import Plan
from hetplan.ir.plan_hetero import Hetero, StageShape
from hetplan.ir.plan_sections import ClusterRef, Layout, ModelRef, Stage
from hetplan.ir.rebalancing import PlannedEvent, RebalancePolicy, Rebalancing
from hetplan.runtime.composition import refusals
from hetplan.runtime.handlers.hetero_rebalancing import (
    gather_full,
    local_part,
    shard_spec,
)
from hetplan.runtime.megatron import FusedColumnParallelLinear, VocabParallelEmbedding
from hetplan.runtime.tensor_parallel import ColumnParallelLinear, RowParallelLinear

SIZES = (5, 0, 3)  # uneven, one rank holding nothing


class Conv1D(nn.Module):
    """HF's ``Conv1D`` (recognised by its class name): weight [in, out]."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out))
        self.bias = nn.Parameter(torch.randn(n_out))


def _shards(kind: str) -> tuple[dict[str, torch.Tensor], list[nn.Module]]:
    """The full parameters of one module and its shard on every TP rank."""
    torch.manual_seed(0)
    if kind == "column":
        lin = nn.Linear(4, 8)
        mods = [ColumnParallelLinear.from_linear(lin, SIZES, r) for r in range(3)]
    elif kind == "row":
        lin = nn.Linear(8, 4)
        mods = [RowParallelLinear.from_linear(lin, SIZES, r) for r in range(3)]
    elif kind == "fused":
        lin = nn.Linear(4, 24)
        mods = [FusedColumnParallelLinear.from_fused(lin, SIZES, r) for r in range(3)]
    elif kind == "vocab":
        emb = nn.Embedding(8, 4)
        return ({"weight": emb.weight.detach()},
                [VocabParallelEmbedding(emb, SIZES, r, None) for r in range(3)])
    else:
        conv = Conv1D(4, 8)
        return ({"weight": conv.weight.detach(), "bias": conv.bias.detach()},
                [ColumnParallelLinear.from_linear(conv, SIZES, r) for r in range(3)])
    return {"weight": lin.weight.detach(), "bias": lin.bias.detach()}, mods


@pytest.mark.parametrize("kind", ["column", "row", "fused", "vocab", "conv1d"])
def test_local_part_and_gather_full_invert_the_tensor_parallel_split(kind: str) -> None:
    full, mods = _shards(kind)
    for attr, value in full.items():
        total = torch.zeros_like(value)
        for mod in mods:
            spec = shard_spec(mod, attr)
            conv1d = kind == "conv1d" and attr == "weight"
            local = getattr(mod, attr).detach()
            assert torch.equal(local_part(value, spec, conv1d=conv1d), local)
            part = gather_full(local, spec, None, conv1d=conv1d)
            if spec is None:  # replicated: every rank holds it whole
                assert torch.equal(part, value)
                total = value.clone()
            else:
                total += part
        assert torch.equal(total, value), (kind, attr)


def test_replicated_modules_are_taken_whole() -> None:
    norm = nn.LayerNorm(4)
    assert shard_spec(norm, "weight") is None
    row = RowParallelLinear.from_linear(nn.Linear(8, 4), SIZES, 0)
    assert shard_spec(row, "bias") is None and shard_spec(row, "weight") is not None


def _plan(zero: int, event: tuple[tuple[int, int], ...]) -> Plan:
    """Layers 0-1 | 2-3 on stages ``1x1 | 2x2`` (stage 1 at ZeRO ``zero``), one applied
    event to ``event``."""
    layout = Layout(dp=1, pp=2, tp=1, micro_batches=2, micro_batch_size=4,
                    global_batch_size=8)
    stages = (Stage(index=0, first_layer=0, last_layer=1, ranks=(0,)),
              Stage(index=1, first_layer=2, last_layer=3, ranks=(1, 2, 3, 4)))
    hetero = Hetero(stages=(
        StageShape(stage=0, device_class="fast", dp=1, tp=1, micro_batch_size=4),
        StageShape(stage=1, device_class="slow", dp=2, tp=2, micro_batch_size=2,
                   zero_stage=zero)))
    reb = Rebalancing(policy=RebalancePolicy(), total_iterations=10, events=(
        PlannedEvent(iteration=3, stages=event, applied=True),))
    return Plan(model=ModelRef(name="m", fingerprint="f00", num_params=1),
                cluster=ClusterRef(name="c", fingerprint="c00", world_size=5),
                layout=layout, stages=stages, hetero=hetero, rebalancing=reb)


def test_applied_events_run_at_zero_0_and_1_and_repacking_is_invalid() -> None:
    moves = ((0, 2), (3, 3))
    assert [refusals(_plan(z, moves)) for z in (0, 1)] == [[], []]
    with pytest.raises(ValueError, match=r"rebalancing\.events\[0\]\.stages: 1 layer range"):
        _plan(1, ((0, 3),))
