"""``verify_model_ir`` refuses a ``split_unit`` that does not divide the features a linear
splits (a row linear's input, any other's output): a workload file with such a unit would
otherwise plan even shards silently."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import hetplan
from hetplan.errors import SpecError
from hetplan.ir.model import ModelIR


def _mlp_json() -> dict:  # type: ignore[type-arg]
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return json.loads(hetplan.capture(mlp, torch.randn(2, 8)).to_json())


@pytest.mark.parametrize(("unit", "ok"), [(4, True), (16, True), (5, False), (32, False)])
def test_a_unit_must_divide_the_split_features(unit: int, ok: bool) -> None:
    data = _mlp_json()
    lin = data["layers"][0]["linears"][0]
    split = lin["in_features"] if lin["tp_role"] == "row" else lin["out_features"]
    assert split == 16  # nn.Linear(8, 16), either role: its output is what a split cuts
    lin["split_unit"] = unit
    if ok:
        assert ModelIR.from_json(json.dumps(data)).layers[0].linears[0].split_unit == unit
    else:
        with pytest.raises(SpecError, match=f"split_unit {unit} does not divide the {split} "
                                            "features it splits"):
            ModelIR.from_json(json.dumps(data))
