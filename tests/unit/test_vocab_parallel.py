"""One statement of whether the LM head is vocabulary-parallel (``cost_settings.vocab_parallel``):
what ``compile`` states and prices, how older plans read, what the validator refuses, and what
the runtime's tensor-parallel handler splits or refuses (``docs/decisions/vocab-parallel.md``).
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from pydantic import ValidationError

import hetplan
from hetplan import zoo
from hetplan.cost_models.compute import vocab_split
from hetplan.cost_models.costs import CostModel
from hetplan.errors import SpecError
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import CostSettings, ResizingController, WorkloadSummary
from hetplan.runtime.handlers.tensor_parallel import _vocab_to_split


def _cluster(n: int = 2) -> ClusterSpec:
    spec = ClusterSpec.from_preset("local-cpu").model_dump(mode="json")
    spec["nodes"][0]["devices"] = [{"type": "cpu", "count": n}]
    return ClusterSpec.from_dict(spec)


def _ir(name: str) -> Any:
    model = zoo.build(name, device="cpu", seed=0)
    return hetplan.capture(model, *zoo.example_inputs(name, batch=1, device="cpu"), name=name)


@pytest.fixture(scope="module")
def gpt() -> Any:
    return _ir("gpt-test")


def _compile(ir: Any, **kw: Any) -> Plan:
    return hetplan.compile(ir, _cluster(), batch_size=4, dp=1, pp=1, tp=2, dtype="fp32", **kw)


def test_compile_states_split_by_default_and_prices_it(gpt: Any) -> None:
    split, whole = _compile(gpt), _compile(gpt, vocab_parallel=False)
    assert split.cost_settings is not None and whole.cost_settings is not None
    assert (split.cost_settings.vocab_parallel, whole.cost_settings.vocab_parallel) == (
        "split", "whole")
    assert split.predictions is not None and whole.predictions is not None
    # the head's weight, its embedding and the logits are halved on each of the 2 ranks
    assert max(split.predictions.memory_per_rank_bytes) < max(
        whole.predictions.memory_per_rank_bytes)
    # simulate prices the plan as it states it, with the same numbers compile predicted
    for plan in (split, whole):
        again = hetplan.simulate(plan)
        assert again.iteration_time_ms == pytest.approx(plan.predictions.iteration_time_ms)
        assert again.memory_per_rank_bytes == plan.predictions.memory_per_rank_bytes


def test_compile_states_whole_where_the_runtime_cannot_split(gpt: Any) -> None:
    # the TP resizing controller resizes the MLP shards and keeps the vocabulary whole
    ctl = _compile(gpt, tp_controller="zero")
    assert ctl.cost_settings is not None and ctl.cost_settings.vocab_parallel == "whole"
    # a classifier's head has no V x h embedding beside it: nothing to split
    vit = hetplan.compile(_ir("tiny-vit"), _cluster(), batch_size=4, dp=1, pp=1, tp=2)
    assert vit.cost_settings is not None and vit.cost_settings.vocab_parallel == "whole"


def test_a_head_without_its_embedding_is_never_priced_split(gpt: Any) -> None:
    wl = WorkloadSummary.from_model_ir(gpt)
    head = wl.layers[-1]
    assert head.kind == "head" and vocab_split(True, wl)
    # the same head without the V x h token embedding (the runtime would not split it)
    alone = wl.model_copy(update={"layers": tuple(
        x.model_copy(update={"param_bytes": 0, "tp_split_bytes": 0})
        if x.kind == "embedding" else x for x in wl.layers)})
    assert not vocab_split(True, alone) and not vocab_split(False, wl)
    priced = CostModel(_cluster(), vocab_parallel=vocab_split(True, alone)).compute
    assert priced.tp_divisor(head, 2) == 1


def test_older_plans_read_as_they_ran(gpt: Any) -> None:
    plan = _compile(gpt, vocab_parallel=False)
    data = json.loads(plan.to_json())
    for old, now in ((False, "unstated"), (True, "split")):
        data["cost_settings"]["vocab_parallel"] = old
        read = Plan.from_json(json.dumps(data))
        assert read.cost_settings is not None and read.cost_settings.vocab_parallel == now
    # an unstated plan was priced with the head whole: simulate keeps its numbers
    data["cost_settings"]["vocab_parallel"] = False
    old_plan = Plan.from_json(json.dumps(data))
    again = hetplan.simulate(old_plan)
    assert again.memory_per_rank_bytes == plan.predictions.memory_per_rank_bytes
    with pytest.raises(ValidationError, match="vocab_parallel"):
        CostSettings.model_validate({"vocab_parallel": "yes"})


def test_validator_refuses_split_with_the_resizing_controller(gpt: Any) -> None:
    plan = _compile(gpt)
    assert plan.tensor_parallel is not None and plan.cost_settings is not None
    tp = plan.tensor_parallel.model_copy(
        update={"controller": ResizingController(variant="zero")})
    data = json.loads(plan.model_copy(update={"tensor_parallel": tp}).to_json())
    with pytest.raises(SpecError, match=r"cost_settings.vocab_parallel: 'split' with the TP "
                                        r"resizing controller \(zero\)"):
        Plan.from_json(json.dumps(data))
    data["cost_settings"]["vocab_parallel"] = "whole"
    Plan.from_json(json.dumps(data))  # what compile writes with a controller


def test_validator_refuses_split_without_the_vocabulary_pair() -> None:
    vit = hetplan.compile(_ir("tiny-vit"), _cluster(), batch_size=4, dp=1, pp=1, tp=2)
    data = json.loads(vit.to_json())
    data["cost_settings"]["vocab_parallel"] = "split"
    with pytest.raises(SpecError, match=r"cost_settings.vocab_parallel: 'split', but the "
                                        r"model's last layer is not an LM head beside a V x h"):
        Plan.from_json(json.dumps(data))


# -- the runtime's tensor-parallel handler -------------------------------------------------
def _ctx(plan: Plan, model: torch.nn.Module, straggler: object = None) -> Any:
    return SimpleNamespace(plan=plan, model=model, layout=plan.layout, straggler=straggler)


def _names(ir: Any) -> list[str]:
    return [x.name for x in ir.layers]


def test_runtime_splits_as_the_plan_says(gpt: Any) -> None:
    model = zoo.build("gpt-test", device="cpu", seed=0)
    split = _compile(gpt)
    pair = _vocab_to_split(_ctx(split, model), _names(gpt))
    assert pair is not None and pair[0] == _names(gpt)[-1]
    whole = split.model_copy(update={"cost_settings": split.cost_settings.model_copy(
        update={"vocab_parallel": "whole"})})
    assert _vocab_to_split(_ctx(whole, model), _names(gpt)) is None
    unstated = split.model_copy(update={"cost_settings": None})
    assert _vocab_to_split(_ctx(unstated, model), _names(gpt)) == pair


def test_runtime_refuses_a_split_it_cannot_do(gpt: Any) -> None:
    model = zoo.build("gpt-test", device="cpu", seed=0)
    split = _compile(gpt)
    # the model's last layer is no longer a linear beside a V x h embedding
    with pytest.raises(SpecError, match=r"cost_settings.vocab_parallel: .* V x h token "
                                        r"embedding.*re-plan"):
        _vocab_to_split(_ctx(split, model), _names(gpt)[:-1])
    # an emulated straggler keeps the vocabulary whole
    with pytest.raises(SpecError, match="emulated straggler"):
        _vocab_to_split(_ctx(split, model, straggler=object()), _names(gpt))
