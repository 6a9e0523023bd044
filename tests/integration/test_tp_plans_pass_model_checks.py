"""Every tensor-parallel plan the planner writes for the test zoo passes the rules that need
the model (:mod:`hetplan.ir.plan_tp_checks`, run by ``hetplan run`` before launch): they must
refuse hand edits only, never what ``tp-resizing`` emits.

The zoo models the TP tests plan, and those whose attention the planner lists as a Megatron
pair (separate q/k/v projections as wide as the output projection: OPT, T5; GQA's narrower
k/v are not a pair: Llama; ViT's 2 heads give each of 2 ranks one, the even split, which the
planner does not list: it skews attention in whole heads only), on a fast and a slower CPU
process
(``tests/fixtures/clusters/cpu-mixed-2.yaml``, 2:1, and a 5:1 variant that leaves the slow
rank empty shards), tp=2; and ``gpt-test`` on the ``mixed-tp-node`` preset with dp=2 x pp=2 x
tp=4 (one TP group per stage and replica, each listing its own stage's linears). Uneven
attention heads that a plan asks for by hand pass too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import hetplan
from hetplan import zoo
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan import Plan, TPLinearShard, check_plan_matches
from hetplan.ir.plan_tp_checks import TPModel, tp_model_problems

CLUSTER = Path(__file__).resolve().parents[1] / "fixtures" / "clusters" / "cpu-mixed-2.yaml"

#: zoo model -> whether the planner lists an attention pair for it
MODELS = {"gpt-test": False, "megatron-gpt-test": False, "tied-lm": False, "tiny-gpt2": False,
          "tiny-llama": False, "tiny-vit": False, "tiny-opt": True, "tiny-t5": True}


def _clusters() -> list[ClusterSpec]:
    even = ClusterSpec.load(CLUSTER)
    data = even.model_dump(mode="json")
    data["device_types"]["cpu-slow"].update(peak_tflops={"fp32": 0.02}, mem_bandwidth_gb_s=5.0)
    return [even, ClusterSpec.from_dict(data)]


def _head_dims(name: str) -> dict[str, int]:
    """What `hetplan run` reads off zoo model ``name`` (rule 5)."""
    from hetplan.runtime.megatron import refused_head_splits

    return refused_head_splits(zoo.build(name))


def _check(plan: Plan, ir: hetplan.ModelIR) -> list[str]:
    """The listed linears of ``plan``, after checking them against ``ir`` and the zoo
    model's attention head sizes."""
    model = TPModel.of(ir.name, (x for layer in ir.layers for x in layer.linears),
                       [layer.name for layer in ir.layers], head_dims=_head_dims(ir.name))
    assert tp_model_problems(plan.tensor_parallel, model) == []
    check_plan_matches(plan, model_ir=ir)
    assert plan.tensor_parallel is not None
    return [x.name for g in plan.tensor_parallel.groups for x in g.linears]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_planned_tp_plans_pass(name: str) -> None:
    args, kwargs = zoo.example_inputs(name, batch=1)
    ir = hetplan.capture(zoo.build(name), args, kwargs, name=name)
    listed: list[str] = []
    for spec in _clusters():
        plan = hetplan.compile(ir, spec, batch_size=16, dp=1, pp=1, tp=2)
        listed += _check(plan, ir)
    assert listed, "the planner listed no linear: the rules were not exercised"
    pairs = TPModel.of(name, (x for layer in ir.layers for x in layer.linears)).pairs
    attention = {n for cols, row in pairs for n in (*cols, row)
                 if any(w in n for w in ("attn", "attention", "Attention"))}
    assert bool(attention & set(listed)) is MODELS[name]


def test_planned_pipeline_tp_plan_passes() -> None:
    args, kwargs = zoo.example_inputs("gpt-test", batch=1)
    ir = hetplan.capture(zoo.build("gpt-test"), args, kwargs, name="gpt-test")
    # what tests/unit/test_tp_resizing_pass.py plans: skewed shards win there
    plan = hetplan.compile(ir, "mixed-tp-node", batch_size=128, dp=2, pp=2, tp=4,
                           micro_batch_size=32, dtype="fp16", vocab_parallel=False)
    assert plan.tensor_parallel is not None and len(plan.tensor_parallel.groups) > 1
    assert _check(plan, ir)


def test_uneven_attention_heads_the_plan_asks_for_pass() -> None:
    """What ``tests/dist/test_runtime_megatron.py`` ("uneven-heads") adds to a planned plan and
    the runtime trains: the attention output projection by rows, 3 heads of 16 and 1."""
    args, kwargs = zoo.example_inputs("gpt-test", batch=1)
    ir = hetplan.capture(zoo.build("gpt-test"), args, kwargs, name="gpt-test")
    plan = hetplan.compile(ir, ClusterSpec.load(CLUSTER), batch_size=4, dp=1, pp=1, tp=2)
    assert plan.tensor_parallel is not None
    group = plan.tensor_parallel.groups[0]
    heads = tuple(TPLinearShard(name=f"blocks.{i}.attn.proj", split="row", features=64,
                                shard_sizes=(48, 16)) for i in range(4))
    group = group.model_copy(update={"linears": group.linears + heads})
    tp = plan.tensor_parallel.model_copy(update={"groups": (group,)})
    assert len(_check(plan.model_copy(update={"tensor_parallel": tp}), ir)) == 12
