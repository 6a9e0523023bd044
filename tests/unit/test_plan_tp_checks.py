"""The ``tensor_parallel`` rules that need the model (:mod:`hetplan.ir.plan_tp_checks`), run by
``check_plan_matches`` (``hetplan run`` before launch, ``hetplan validate --model``).

Each case edits one field of a real plan by hand: ``gpt-test`` planned for
``tests/fixtures/clusters/cpu-mixed-2.yaml`` (a fast and a half-as-fast CPU process, tp=2),
whose only TP group lists the 4 MLP pairs ``blocks.i.fc1`` (column) -> ``blocks.i.fc2`` (row)
with shards [192, 64]. The edited file still loads (the plan-only validator cannot tell); the
model refuses it with the field path, both values and the fix. Before these rules the ranks
refused such a plan after launch, or ran it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import hetplan
from hetplan import zoo
from hetplan.errors import PlanMismatchError
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.model import ModelIR
from hetplan.ir.plan import Plan, check_plan_matches, load_plan
from hetplan.ir.plan_sections import TPGroup, TPLinearShard
from hetplan.ir.plan_tp_checks import TPModel, tp_group_problems

CLUSTER = Path(__file__).resolve().parents[1] / "fixtures" / "clusters" / "cpu-mixed-2.yaml"
G = "tensor_parallel.groups[0]"


@pytest.fixture(scope="module")
def planned() -> tuple[ModelIR, Plan]:
    args, kwargs = zoo.example_inputs("gpt-test", batch=1)
    ir = hetplan.capture(zoo.build("gpt-test"), args, kwargs, name="gpt-test")
    plan = hetplan.compile(ir, ClusterSpec.load(CLUSTER), batch_size=4, dp=1, pp=1, tp=2)
    assert plan.tensor_parallel is not None
    lins = plan.tensor_parallel.groups[0].linears
    assert [(x.name, x.split, x.features, x.shard_sizes) for x in lins[:2]] == [
        ("blocks.0.fc1", "column", 256, (192, 64)), ("blocks.0.fc2", "row", 256, (192, 64))]
    return ir, plan


def refused(tmp_path: Path, planned: tuple[ModelIR, Plan],
            edit: Callable[[list[dict[str, Any]]], None], *expected: str) -> str:
    """Apply ``edit`` to the group's linears, check that the file still loads and that the
    model refuses it with every ``expected`` text."""
    ir, plan = planned
    data = json.loads(plan.to_json())
    edit(data["tensor_parallel"]["groups"][0]["linears"])
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    edited = load_plan(path)  # what `hetplan validate p.json` reads: valid alone
    with pytest.raises(PlanMismatchError) as exc:
        check_plan_matches(edited, model_ir=ir)
    msg = str(exc.value)
    for text in expected:
        assert text in msg, f"{text!r} not in:\n{msg}"
    return msg


def test_a_pair_with_different_shard_sizes_is_refused(
        tmp_path: Path, planned: tuple[ModelIR, Plan]) -> None:
    """The ranks refused it after launch (~25 s), without a field path."""
    def edit(lins: list[dict[str, Any]]) -> None:
        lins[1]["shard_sizes"] = [128, 128]

    refused(tmp_path, planned, edit,
            f"{G}.linears[1].shard_sizes: [128, 128], but linears[0] ('blocks.0.fc1', the "
            "column linear of the same Megatron pair ['blocks.0.fc1'] -> 'blocks.0.fc2') has "
            "[192, 64]", "give every linear of the pair the same shard_sizes")


@pytest.mark.parametrize(("index", "features", "sizes", "dim"), [
    (0, 320, [256, 64], "out_features 256"),  # fc1, column: its outputs
    (3, 64, [48, 16], "in_features 256"),  # blocks.1.fc2, row: its inputs
])
def test_features_that_are_not_the_modules_are_refused(
        tmp_path: Path, planned: tuple[ModelIR, Plan], index: int, features: int,
        sizes: list[int], dim: str) -> None:
    def edit(lins: list[dict[str, Any]]) -> None:
        lins[index].update(features=features, shard_sizes=sizes)

    name = planned[1].tensor_parallel.groups[0].linears[index].name  # type: ignore[union-attr]
    msg = refused(tmp_path, planned, edit,
                  f"{G}.linears[{index}].features: {features}, but {name!r} of model "
                  f"'gpt-test' has {dim}", "set features to 256 and shard_sizes to sum to it")
    assert "shard_sizes:" not in msg  # the entry's own problem, not a pair difference too


@pytest.mark.parametrize(("index", "split", "role", "partner"), [
    (0, "row", "column", "blocks.0.fc2"),
    (1, "column", "row", "blocks.0.fc1"),
])
def test_a_pair_linear_split_the_other_way_is_refused(
        tmp_path: Path, planned: tuple[ModelIR, Plan], index: int, split: str, role: str,
        partner: str) -> None:
    """Refused by the ranks after launch before (``split: column`` on a row linear)."""
    def edit(lins: list[dict[str, Any]]) -> None:
        lins[index]["split"] = split

    name = planned[1].tensor_parallel.groups[0].linears[index].name  # type: ignore[union-attr]
    refused(tmp_path, planned, edit,
            f"{G}.linears[{index}].split: {split!r}, but model 'gpt-test' has {name!r} as the "
            f"{role} linear of its pair with {partner!r}", f"set split to {role!r}")


def test_a_misspelt_linear_is_refused_with_its_field_path(
        tmp_path: Path, planned: tuple[ModelIR, Plan]) -> None:
    def edit(lins: list[dict[str, Any]]) -> None:
        lins[2]["name"] = "blocks.1.fcl"

    refused(tmp_path, planned, edit,
            f"{G}.linears[2].name: 'blocks.1.fcl' is not a linear of model 'gpt-test' (did you "
            "mean 'blocks.1.fc", "name the module")


def test_the_fused_qkv_projection_split_by_rows_is_refused(
        tmp_path: Path, planned: tuple[ModelIR, Plan]) -> None:
    """``attn.qkv`` is a column linear (capture pairs it by name with the block's fc2); the
    runtime splits it by heads whatever the plan says."""
    def edit(lins: list[dict[str, Any]]) -> None:
        lins.append({"name": "blocks.0.attn.qkv", "split": "row", "features": 64,
                     "shard_sizes": [32, 32]})

    refused(tmp_path, planned, edit, f"{G}.linears[8].split: 'row', but model 'gpt-test' has "
            "'blocks.0.attn.qkv' as the column linear", "set split to 'column'")


def test_an_attention_split_inside_a_head_is_refused_where_head_sizes_are_known(
        planned: tuple[ModelIR, Plan]) -> None:
    """Rule 5 (whole heads): the IR records head units but not which modules are fused, so
    it is checked only where the caller read them off the module (`hetplan run`, `validate
    --model`: the CLI test)."""
    ir, plan = planned
    assert plan.tensor_parallel is not None
    group = plan.tensor_parallel.groups[0]
    proj = TPLinearShard(name="blocks.0.attn.proj", split="row", features=64,
                         shard_sizes=(40, 24))
    edited = group.model_copy(update={"linears": (*group.linears, proj)})
    linears = [lin for layer in ir.layers for lin in layer.linears]
    bare = TPModel.of("gpt-test", linears)
    assert tp_group_problems(edited, bare, where=G) == []
    heads = TPModel.of("gpt-test", linears, head_dims={"blocks.0.attn.proj": 16})
    (problem,) = tp_group_problems(edited, heads, where=G)
    assert problem.startswith(f"{G}.linears[{len(group.linears)}].shard_sizes: [40, 24] "
                              "split a head")
    whole = group.model_copy(update={"linears": (
        *group.linears, proj.model_copy(update={"shard_sizes": (48, 16)}))})
    assert tp_group_problems(whole, heads, where=G) == []


@pytest.mark.parametrize("sizes", [(48, 16), (40, 24)], ids=["splits-a-group", "splits-a-head"])
def test_gqa_attention_split_inside_a_group_passes_and_the_ranks_run_it_replicated(
        sizes: tuple[int, int]) -> None:
    """Rule 5 refuses what the ranks refuse, and only that: HF Llama's attention (separate
    q/k/v projections, 4 query heads of 16 in 2 key/value groups) asked for sizes that split
    a key/value group (3 + 1 whole heads) or a head passes the check as ``hetplan run``
    builds it; the ranks run that attention replicated, with a warning
    (``shard_attention``), instead of refusing the plan."""
    from hetplan.runtime.megatron import refused_head_splits, shard_attention

    model = zoo.build("tiny-llama", device="cpu", seed=0)
    args, kwargs = zoo.example_inputs("tiny-llama", batch=1, device="cpu")
    ir = hetplan.capture(model, args, kwargs, name="tiny-llama")
    checks = TPModel.of("tiny-llama", (lin for layer in ir.layers for lin in layer.linears),
                        [layer.name for layer in ir.layers],
                        head_dims=refused_head_splits(model))
    group = TPGroup(ranks=(0, 1), linears=tuple(
        TPLinearShard(name=f"model.layers.{i}.self_attn.o_proj", split="row", features=64,
                      shard_sizes=sizes) for i in range(2)))
    assert tp_group_problems(group, checks, where=G) == []
    with pytest.warns(RuntimeWarning, match=r"'model\.layers\.0\.self_attn'.*stays "
                                            "replicated"):
        assert not shard_attention(model, "model.layers.0.self_attn", None, 0, 2, sizes)
