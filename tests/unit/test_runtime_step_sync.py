"""A runtime step reads its loss once, after the optimizer step is queued (one process, no
process group): the micro-batches hand the runtime a device tensor, not a Python float (a
float there is a host synchronisation in the middle of the step on a GPU), the optimizer step
runs before the loss is read, and the step's times add up."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hetplan.ir.capture import capture
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import ClusterRef, Layout, ModelRef
from hetplan.models import MLP
from hetplan.runtime.executor import Runtime
from hetplan.runtime.handlers import StagesHandler

BATCH, MICRO_BATCHES = 8, 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return MLP(in_features=6, hidden=(10,), out_features=4).double()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(BATCH, 6, generator=g, dtype=torch.float64),
            torch.randn(BATCH, 4, generator=g, dtype=torch.float64))


def _runtime(events: list[str]) -> Runtime:
    ir = capture(_model(), torch.zeros(1, 6, dtype=torch.float64))
    plan = Plan(model=ModelRef.from_model_ir(ir),
                cluster=ClusterRef(name="one", fingerprint="one", world_size=1),
                layout=Layout(micro_batches=MICRO_BATCHES,
                              micro_batch_size=BATCH // MICRO_BATCHES))

    class Logged(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:  # noqa: D102
            events.append("optimizer step")
            return super().step(closure)

    return Runtime(plan, _model(), example_args=(torch.zeros(1, 6, dtype=torch.float64),),
                   optimizer=lambda ps: Logged(ps, lr=0.1))


class _Loss(torch.Tensor):
    """A loss tensor that logs when it is turned into a Python number."""

    events: list[str] = []

    def __float__(self) -> float:
        _Loss.events.append("loss read")
        return super().__float__()


def test_micro_batches_return_a_device_tensor_summed_over_micro_batches() -> None:
    rt = _runtime([])
    x, y = _data()
    loss = rt.handler(StagesHandler).run_micro_batches(rt.ctx, [x], y)
    assert isinstance(loss, torch.Tensor) and loss.dim() == 0 and not loss.requires_grad
    with torch.no_grad():
        want = sum(float(nn.functional.mse_loss(_model()(xs), ys)) for xs, ys
                   in zip(x.chunk(MICRO_BATCHES), y.chunk(MICRO_BATCHES), strict=True))
    assert abs(float(loss) - want / MICRO_BATCHES) < 1e-12


def test_the_loss_is_read_after_the_optimizer_step() -> None:
    events: list[str] = []
    rt = _runtime(events)
    _Loss.events = events
    stages = rt.handler(StagesHandler)
    run = stages.run_micro_batches

    def logged(ctx: Any, xs: Any, y: Any) -> Any:
        out = run(ctx, xs, y)
        return out.as_subclass(_Loss)

    stages.run_micro_batches = logged  # type: ignore[method-assign]
    x, y = _data()
    value = rt.train_step(x, y)
    assert events == ["optimizer step", "loss read"]
    assert isinstance(value, float) and value > 0
    t = rt.last_times
    assert t is not None
    assert abs(t.iteration_s - (t.compute_s + t.sync_wait_s + t.optimizer_s + t.bubble_s)) < 1e-9
    rt.close()
