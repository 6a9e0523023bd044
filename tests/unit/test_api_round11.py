"""The Python API, round 11 of a new user's mistakes (`docs/decisions/
bad-input-round11.md`): each case failed before its fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import hetplan


class _RootParam(nn.Module):
    """A model whose top-level module owns a parameter beside its children (a learned
    offset added in ``forward``): the IR's layer ``""``."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.zeros(4))
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x + self.pos))


@pytest.mark.parametrize("model", [nn.Linear(4, 4), _RootParam()],
                         ids=["leaf-model", "root-parameter"])
def test_a_root_module_layer_is_planned(tmp_path: Path, model: nn.Module) -> None:
    """Was `ValidationError ... LayerCost name: String should have at least 1 character`
    (`hetplan plan --module`: an internal error): the IR names the root module's layer ``""``,
    as the runtime's split points expect, and the plan's workload summary refused it."""
    plan = hetplan.compile(model, "local-cpu", batch_size=8, example_inputs=torch.zeros(1, 4))
    assert plan.model.workload is not None
    assert "" in [lay.name for lay in plan.model.workload.layers]
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = hetplan.load_plan(path)  # the one validator, a complete plan required
    assert plan.predictions is not None
    assert hetplan.simulate(loaded).iteration_time_ms == pytest.approx(
        plan.predictions.iteration_time_ms)
