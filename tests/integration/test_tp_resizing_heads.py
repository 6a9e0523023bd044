"""``tp-resizing`` on a model whose head size is not 64: Llama-2-7B (32 heads of 128) on the
heterogeneous ``mixed-tp-node`` preset at tp=4, the plan ``hetplan plan llama-7b --cluster
mixed-tp-node --tp 4 --batch-size 64`` writes.

Before capture recorded head units the pass cut the attention pairs in 64-column units,
[1472, 1472, 576, 576] (11.5 and 4.5 heads), which the runtime ran replicated while the cost
model priced it split. Now every attention shard is whole heads, each rank has one, and the
runtime's :func:`~hetplan.runtime.megatron.shard_attention` splits the modules with the
plan's sizes, with no fallback. The head size comes from the HF config, not from capture.
Capturing llama-7b on meta and planning take about 25 s.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import hetplan
from hetplan import zoo
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan import Plan
from hetplan.runtime.megatron import shard_attention

MODEL, PRESET = "llama-7b", "mixed-tp-node"
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.fixture(scope="module")
def plan() -> Plan:
    return hetplan.compile(MODEL, PRESET, batch_size=64, tp=4)


def _head_dim() -> int:
    cfg = zoo.build(MODEL).config  # type: ignore[union-attr]
    return int(cfg.hidden_size // cfg.num_attention_heads)


def _attention(plan: Plan) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Attention module → (the plan's o_proj shard sizes, its TP group's ranks)."""
    assert plan.tensor_parallel is not None
    return {lin.name.rpartition(".")[0]: (lin.shard_sizes, g.ranks)
            for g in plan.tensor_parallel.groups for lin in g.linears
            if lin.name.endswith(".self_attn.o_proj")}


def test_attention_shards_are_whole_heads_skewed_to_the_fast_ranks(plan: Plan) -> None:
    head_dim = _head_dim()
    assert head_dim == 128
    devices = ClusterSpec.from_preset(PRESET).devices()
    assert plan.tensor_parallel is not None
    attention = [lin for g in plan.tensor_parallel.groups for lin in g.linears
                 if lin.name.rpartition(".")[2] in PROJ]
    assert attention, "no attention pair listed: the skew was not exercised"
    for lin in attention:
        assert sum(lin.shard_sizes) == lin.features == 4096
        assert all(s % head_dim == 0 and s > 0 for s in lin.shard_sizes), lin
    for sizes, ranks in _attention(plan).values():
        fast = [s for r, s in zip(ranks, sizes) if devices[r].type.startswith("A100")]
        slow = [s for r, s in zip(ranks, sizes) if not devices[r].type.startswith("A100")]
        assert fast and slow and min(fast) > max(slow), (ranks, sizes)


def test_the_runtime_splits_the_planned_attention_without_fallback(plan: Plan) -> None:
    """Each rank of a group splits the planned attention by heads (``shard_attention``
    returns True, no warning of a replicated module), keeping its planned rows."""
    attention = _attention(plan)
    sizes, ranks = next(iter(attention.values()))
    tp = len(ranks)
    model = zoo.build(MODEL)  # on meta: only shapes matter
    names = sorted(attention)[:tp]  # one module per TP rank, split in place
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for rank, name in enumerate(names):
            assert attention[name][0] == sizes
            assert shard_attention(model, name, None, rank, tp, sizes)
            q = model.get_submodule(f"{name}.q_proj")
            o = model.get_submodule(f"{name}.o_proj")
            assert isinstance(q.weight, torch.Tensor)
            assert tuple(q.weight.shape) == (sizes[rank], 4096)
            assert tuple(o.weight.shape) == (4096, sizes[rank])
