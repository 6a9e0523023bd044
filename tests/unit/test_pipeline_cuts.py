"""Pipeline boundaries the planner emits: priced by every tensor that crosses them
(``LayerIR.cut_bytes_after``) and never placed before a layer the runtime cannot split at
(``LayerIR.cuttable_before``).

The model is the runtime tests' Megatron-style GPT (``tests/dist/reflib.py``): its forward
adds ``pos_emb.weight[:t]`` to ``tok_emb(ids)`` in glue code, so ``pos_emb`` is never called
as a module (torch pipelining cannot split before it) and the boundary after it sends the
summed embedding, which the previous layer's ``act_out_bytes`` (0 for ``pos_emb``) misses.
"""

from __future__ import annotations

import copy

import pytest
import torch

import hetplan
from hetplan.algorithms.partition import min_max_partition, uniform_partition
from hetplan.errors import InfeasiblePlanError
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.cluster_presets import PRESET_SPECS
from hetplan.ir.model import ModelIR
from hetplan.ir.plan import Plan
from hetplan.models import MegatronGPT

SEQ = 8


def _gpt() -> MegatronGPT:
    torch.manual_seed(0)
    return MegatronGPT(vocab_size=32, max_seq=SEQ, dim=16, n_layers=2, n_heads=2,
                       dropout=0.0).double()


def _cpu(world: int) -> ClusterSpec:
    spec = copy.deepcopy(PRESET_SPECS["local-cpu"])
    spec["name"] = f"cpu-{world}"
    spec["nodes"][0]["devices"] = [{"type": "cpu", "count": world}]
    return ClusterSpec.model_validate(spec)


@pytest.fixture(scope="module")
def ir() -> ModelIR:
    return hetplan.capture(_gpt(), (torch.zeros(1, SEQ, dtype=torch.long),))


@pytest.fixture(scope="module")
def plans() -> dict[int, Plan]:
    out = {}
    for pp, mb in ((2, 4), (4, 2)):
        out[pp] = hetplan.compile(
            _gpt(), _cpu(pp), example_inputs=(torch.zeros(1, SEQ, dtype=torch.long),),
            batch_size=8, dp=1, pp=pp, tp=1, zero_stage=0, micro_batch_size=mb,
            schedule="1f1b", recompute="full", dtype="fp32", optimizer="adam")
    return out


def test_the_boundary_after_pos_emb_is_priced_with_the_summed_embeddings(ir: ModelIR) -> None:
    names = [x.name for x in ir.layers]
    assert names == ["tok_emb", "pos_emb", "blocks.0", "blocks.1", "ln_f", "head"]
    tok, pos, b0 = ir.layers[0], ir.layers[1], ir.layers[2]
    hidden = 1 * SEQ * 16 * 8  # batch x seq x dim, float64
    assert tok.act_out_bytes == hidden
    assert pos.act_out_bytes == 0  # the old price: pos_emb's weight is read by glue only
    # the boundary after pos_emb sends the token embedding plus the position rows (summed in
    # glue before blocks.0): a (batch, seq, dim) tensor, as between two blocks
    assert pos.cut_bytes_after == pos.boundary_bytes == hidden
    assert b0.cut_bytes_after == b0.act_out_bytes == hidden
    # chain boundaries keep act_out_bytes
    for lay in ir.layers[2:]:
        assert lay.cut_bytes_after == lay.act_out_bytes, lay.name


def test_the_capture_marks_pos_emb_non_cuttable(ir: ModelIR) -> None:
    assert [x.cuttable_before for x in ir.layers] == [True, False, True, True, True, True]


def test_the_plan_workload_carries_the_boundary_fields(plans: dict[int, Plan]) -> None:
    wl = plans[2].model.workload
    assert wl is not None
    assert [x.cuttable_before for x in wl.layers] == [True, False, True, True, True, True]
    assert wl.layers[1].boundary_bytes == wl.layers[0].act_out_bytes > 0


@pytest.mark.parametrize("pp", [2, 4])
def test_the_planner_never_starts_a_stage_at_pos_emb(plans: dict[int, Plan], pp: int) -> None:
    plan = plans[pp]
    assert len(plan.stages) == pp
    starts = [st.first_layer for st in plan.stages]
    assert 1 not in starts
    if pp == 2:  # stage 0 holds a block, so full recomputation has something to recompute
        assert plan.stages[0].last_layer >= 2


@pytest.mark.parametrize("p", [2, 4])
def test_partition_skips_a_non_cuttable_boundary(p: int) -> None:
    # the cheapest split starts a stage at layer 1; layer 1 cannot start a stage
    cost = [9.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    cut = [True, False, True, True, True, True, True, True]
    free = min_max_partition(cost, p)
    assert 1 in free.cuts
    got = min_max_partition(cost, p, cuttable=cut)
    assert 1 not in got.cuts and len(got.bounds) == p
    assert got.bounds[0][0] == 0 and got.bounds[-1][1] == len(cost) - 1
    # the uniform split moves off it too
    uni = uniform_partition(len(cost), p, [True, True, False, True, False, True, False, True])
    assert all(i in (0, 1, 3, 5, 7) for i, _ in uni) and len(uni) == p


def test_partition_refuses_more_stages_than_cuttable_boundaries() -> None:
    with pytest.raises(InfeasiblePlanError, match="can be cut"):
        min_max_partition([1.0] * 4, 3, cuttable=[True, False, True, False])


def test_the_validator_refuses_a_stage_starting_at_pos_emb(plans: dict[int, Plan]) -> None:
    plan = plans[2]
    data = plan.model_dump(mode="json")
    wl = data["model"]["workload"]["layers"]
    st0, st1 = data["stages"]
    st0["last_layer"], st1["first_layer"] = 0, 1
    st0["layer_names"] = [wl[0]["name"]]
    st1["layer_names"] = [x["name"] for x in wl[1:]]
    with pytest.raises(ValueError, match=r"stages\[1\]\.first_layer: 1 \('pos_emb'\).*"
                                         r"never called as a module.*'blocks\.0' \(#2\)"):
        Plan.model_validate(data)


def test_the_validator_refuses_a_rebalancing_event_starting_at_pos_emb(
        plans: dict[int, Plan]) -> None:
    from hetplan.ir.rebalancing import PlannedEvent, Rebalancing

    plan = plans[2]
    good = Rebalancing(total_iterations=10, events=(
        PlannedEvent(iteration=1, stages=((0, 3), (4, 5)), applied=True),))
    Plan.model_validate(plan.model_copy(update={"rebalancing": good}).model_dump())
    bad = Rebalancing(total_iterations=10, events=(
        PlannedEvent(iteration=1, stages=((0, 0), (1, 5)), applied=True),))
    with pytest.raises(ValueError, match=r"rebalancing\.events\[0\]\.stages\[1\]: 1 "
                                         r"\('pos_emb'\)"):
        Plan.model_validate(plan.model_copy(update={"rebalancing": bad}).model_dump())


def test_repack_skips_a_non_cuttable_boundary() -> None:
    from hetplan.algorithms.partition import repack

    cost = [[9.0, 1.0, 1.0, 1.0]] * 2
    mem = [[1.0] * 4] * 2
    free = repack(cost, mem, [10.0, 10.0], target=2)
    assert free.partition.cuts == (1,)
    got = repack(cost, mem, [10.0, 10.0], target=2, cuttable=[True, False, True, True])
    assert got.partition.cuts == (2,)
