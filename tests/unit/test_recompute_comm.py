"""Full recomputation reruns a block's forward with its tensor-parallel all-reduces
(``cost_models/stage_times.py``): the backward of a ``full`` stage is the ``none`` stage's
plus each block's forward and its all-reduces once more; ``selective`` adds no
communication."""

from __future__ import annotations

import pytest
import torch

import hetplan
from hetplan import models
from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.predict import resolve_cluster
from hetplan.cost_models.stage_times import stage_times
from hetplan.ir.capture import capture


@pytest.fixture(scope="module")
def plan_and_costs():  # type: ignore[no-untyped-def]
    with torch.device("meta"):
        model = models.MegatronGPT(vocab_size=512, max_seq=128, dim=256, n_layers=4,
                                   n_heads=4)
    ir = capture(model, (torch.zeros(2, 128, dtype=torch.long),))
    plan = hetplan.compile(ir, "a100-nvlink-8x8", batch_size=64, dp=32, pp=1, tp=2,
                           dtype="bf16", recompute="none", passes="uniform-stages")
    costs = CostModel(resolve_cluster("a100-nvlink-8x8"), dtype="bf16")
    return plan, costs


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputation_adds_its_forward_and_only_full_adds_all_reduces(plan_and_costs,  # type: ignore[no-untyped-def]
                                                                       mode: str) -> None:
    plan, costs = plan_and_costs
    wl, lay = plan.model.workload, plan.layout
    st = plan.stages[0]
    mb = lay.micro_batch_size
    scale = mb / wl.batch_size
    f0, b0, comm, _, _ = stage_times(wl, st, lay, costs, mb, scale)
    f1, b1, comm1, _, _ = stage_times(wl, st.model_copy(update={"recompute": mode}), lay,
                                      costs, mb, scale)
    assert (f1, comm1) == (f0, comm)
    blocks = [x for x in wl.layers if x.kind == "block"]
    assert comm > 0 and blocks
    times = costs.compute.layer_times(wl, costs.devices[0], mb, tp=2,
                                      sp=lay.sequence_parallel)
    pairs = {x.name: x.tp_pairs for x in wl.layers}
    per_block_comm = comm / sum(x.tp_pairs for x in wl.layers)  # equal activations
    if mode == "full":
        expected = sum(t.fwd_s + pairs[x.name] * per_block_comm
                       for x, t in zip(wl.layers, times) if x.kind == "block")
    else:
        expected = sum(t.core_fwd_s for x, t in zip(wl.layers, times) if x.kind == "block")
    assert b1 - b0 == pytest.approx(expected, rel=1e-9)
