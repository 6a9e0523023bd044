"""The runtime composes handlers (one process, no process group): every handler names a plan
section; a step calls the hooks in order; an added handler needs no change to ``Runtime``;
training through the handlers equals plain gradient accumulation."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager

import pytest
import torch
from torch import nn

from hetplan.ir.capture import capture
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import ClusterRef, Layout, ModelRef
from hetplan.models import MLP
from hetplan.runtime.executor import Runtime
from hetplan.runtime.handlers import (
    DEFAULT_HANDLERS,
    GradSyncHandler,
    Handler,
    RuntimeContext,
    StagesHandler,
)

BATCH, MICRO_BATCHES, STEPS = 8, 4, 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return MLP(in_features=6, hidden=(10,), out_features=4).double()


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return (torch.randn(BATCH, 6, generator=g, dtype=torch.float64),
            torch.randn(BATCH, 4, generator=g, dtype=torch.float64))


def _plan() -> Plan:
    ir = capture(_model(), torch.zeros(1, 6, dtype=torch.float64))
    return Plan(model=ModelRef.from_model_ir(ir),
                cluster=ClusterRef(name="one", fingerprint="one", world_size=1),
                layout=Layout(micro_batches=MICRO_BATCHES,
                              micro_batch_size=BATCH // MICRO_BATCHES))


def test_every_handler_names_plan_sections() -> None:
    for cls in DEFAULT_HANDLERS:
        for section in cls.section.split(", "):
            assert section.split(".")[0] in Plan.model_fields, (cls.__name__, section)


class Recorder(Handler):
    """A handler a new plan section would add: it sees every hook, in order."""

    section = "predictions"
    calls: list[str] = []

    def setup(self, ctx: RuntimeContext) -> None:
        self.calls.append(f"setup params={len(ctx.named_params)}")

    @contextmanager
    def _acc(self) -> Iterator[None]:
        self.calls.append("accumulate")
        yield

    def accumulating(self, ctx: RuntimeContext) -> AbstractContextManager[None]:
        return self._acc()

    def run_micro_batches(self, ctx: RuntimeContext, inputs: Sequence[torch.Tensor],
                          target: torch.Tensor) -> float | None:
        self.calls.append("run")
        return None

    def after_backward(self, ctx: RuntimeContext) -> None:
        self.calls.append("after_backward")

    def after_sync(self, ctx: RuntimeContext) -> None:
        self.calls.append("after_sync")

    def after_step(self, ctx: RuntimeContext) -> None:
        assert ctx.last_times is not None
        self.calls.append(f"after_step {ctx.iteration}")

    def close(self, ctx: RuntimeContext) -> None:
        self.calls.append("close")


def test_an_added_handler_gets_every_hook_in_order() -> None:
    Recorder.calls = []
    rt = Runtime(_plan(), _model(), example_args=(torch.zeros(1, 6, dtype=torch.float64),),
                 handlers=(*DEFAULT_HANDLERS, Recorder))
    rt.train_step(*_data(0))
    rt.close()
    # setup after the stage handler chose the parameters (MLP: 2 linears, weights and biases);
    # the stage handler runs the step, so the recorder's run_micro_batches is never asked;
    # the first 3 of 4 micro-batches accumulate
    assert Recorder.calls == ["setup params=4", "accumulate", "accumulate", "accumulate",
                              "after_backward", "after_sync", "after_step 0", "close"]


def test_a_step_without_a_handler_that_runs_it_is_refused() -> None:
    rt = Runtime(_plan(), _model(), example_args=(torch.zeros(1, 6, dtype=torch.float64),),
                 handlers=(GradSyncHandler,),
                 optimizer=lambda ps: torch.optim.SGD([nn.Parameter(torch.zeros(1))]))
    with pytest.raises(ValueError, match="include StagesHandler"):
        rt.train_step(*_data(0))


def test_training_through_the_handlers_equals_gradient_accumulation() -> None:
    rt = Runtime(_plan(), _model(), example_args=(torch.zeros(1, 6, dtype=torch.float64),),
                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = _data(step)
        loss = rt.train_step(x, y)
        ref_loss = nn.functional.mse_loss(ref(x), y)
        ref_loss.backward()
        opt.step()
        opt.zero_grad()
        assert loss == pytest.approx(ref_loss.item(), rel=1e-12)
    got = dict(rt.named_params)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(got[n], p, rtol=1e-12, atol=1e-14)
    assert rt.handler(StagesHandler).executed == ()  # no pipeline: no actions
    assert rt.last_times is not None and rt.last_times.bubble_s == 0.0
    rt.close()


def test_hetplan_run_uses_the_optimizer_the_plan_was_costed_with() -> None:
    """The memory model counts the plan's optimizer state (Adam: two moments); the runtime
    must hold the same, not a hard-wired SGD."""
    import torch

    from hetplan.runtime.executor import plan_optimizer

    p = [torch.nn.Parameter(torch.zeros(3))]
    kinds = {name: type(plan_optimizer(name)(p)) for name in ("adam", "adamw", "sgd",
                                                              "sgd-momentum")}
    assert kinds == {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW,
                     "sgd": torch.optim.SGD, "sgd-momentum": torch.optim.SGD}
    assert plan_optimizer("sgd-momentum")(p).defaults["momentum"] == 0.9
    with pytest.raises(ValueError, match="unknown optimizer"):
        plan_optimizer("lamb")


# -- ZeRO's gathers: the collective torch has not deprecated -------------------------------
def test_zero_gathers_with_the_collective_torch_does_not_deprecate(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Was: every rank of every ZeRO run printed torch's FutureWarning for
    ``all_gather_into_tensor``; the optimizer now uses ``all_gather_single`` where torch has
    it. A two-replica gather is emulated on one process (both replicas hold rank 0's
    chunk)."""
    import torch.distributed as dist

    from hetplan.runtime.sharded_optimizer import ShardedOptimizer, segments_of

    calls: list[int] = []

    def single(out: torch.Tensor, mine: torch.Tensor, group: object = None) -> None:
        calls.append(mine.numel())
        out.copy_(mine.repeat(out.numel() // mine.numel()))

    def deprecated(*args: object, **kwargs: object) -> None:
        raise AssertionError("all_gather_into_tensor: deprecated in favour of all_gather_single")

    monkeypatch.setattr(dist, "all_gather_single", single, raising=False)
    monkeypatch.setattr(dist, "all_gather_into_tensor", deprecated)
    params = [nn.Parameter(torch.arange(4.0)), nn.Parameter(torch.arange(4.0, 6.0))]
    opt = ShardedOptimizer(segments_of([(params, None)], 2),
                           lambda ps: torch.optim.SGD(ps, lr=0.1), None, 2, 0)
    opt.write_working_weights()
    assert calls == [3]
    assert params[0].detach().tolist() == [0.0, 1.0, 2.0, 0.0]  # replica 1's chunk: rank 0's
    assert len(opt._gather_flat(opt.master)) == 2 and calls == [3, 3]
