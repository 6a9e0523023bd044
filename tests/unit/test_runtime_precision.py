"""Mixed precision and the runtime's refusals, in one process: the fp16 loss scale skips a
step whose gradients overflow and backs off; fp16 training updates the fp32 master weights;
combinations the runtime does not compose are refused with the field and the fix."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hetplan.errors import SpecError
from hetplan.ir.capture import capture
from hetplan.ir.plan import Plan, load_plan
from hetplan.ir.plan_sections import (
    ClusterRef,
    CompressedSync,
    DevicePrecision,
    GradientSync,
    Layout,
    ModelRef,
    Precision,
    TensorSync,
)
from hetplan.models import MLP
from hetplan.runtime.composition import refusals
from hetplan.runtime.executor import Runtime
from hetplan.runtime.handlers import (
    DEFAULT_HANDLERS,
    CompositionHandler,
    PrecisionHandler,
    ZeroHandler,
)
from hetplan.runtime.precision import Autocast, DynamicLossScale


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return MLP(in_features=6, hidden=(10,), out_features=4)


def _plan(dtype: str = "fp16", **layout: int) -> Plan:
    ir = capture(_model(), torch.zeros(1, 6))
    prec = Precision(policy=dtype, master_weights_dtype="fp32", devices={"cpu": DevicePrecision(
        compute_dtype=dtype, loss_scaling="dynamic" if dtype == "fp16" else "none")})
    return Plan(model=ModelRef.from_model_ir(ir),
                cluster=ClusterRef(name="t", fingerprint="t", world_size=8),
                layout=Layout(micro_batch_size=8, **layout), precision=prec)


@pytest.mark.parametrize("io_dtype", [torch.float32, torch.float64])
def test_a_pipeline_stage_sends_in_the_dtype_it_was_traced_in(io_dtype: torch.dtype) -> None:
    """A stage under bf16 autocast computes in bf16 and returns its floating outputs in the
    dtype it was traced in (its P2P buffers'): fp32 as a rule, float64 for a float64 model
    (an fp32 output received into float64 buffers came out as NaN)."""
    stage = torch.nn.Linear(4, 4).to(torch.bfloat16)
    inner: list[torch.dtype] = []
    stage.register_forward_hook(lambda m, a, out: inner.append(out.dtype))
    cast = Autocast([stage], torch.bfloat16, io_dtype=io_dtype)
    out = stage(torch.ones(2, 4, dtype=io_dtype))
    cast.remove()
    assert inner == [torch.bfloat16]
    assert out.dtype == io_dtype
    assert stage(torch.ones(2, 4, dtype=torch.bfloat16)).dtype == torch.bfloat16  # removed


def test_loss_scale_backs_off_and_grows() -> None:
    s = DynamicLossScale(scale=8.0, growth_interval=2)
    assert not s.update(found_inf=True) and s.scale == 4.0 and s.skipped == 1
    assert s.update(found_inf=False) and s.scale == 4.0
    assert s.update(found_inf=False) and s.scale == 8.0


def test_fp16_skips_an_overflowing_step_and_trains_the_fp32_master() -> None:
    rt = Runtime(_plan(), _model(), example_args=(torch.zeros(1, 6),))
    scaler = rt.handler(PrecisionHandler).scaler
    assert scaler is not None and next(rt.model.parameters()).dtype == torch.float16
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    y = torch.randn(8, 4, generator=torch.Generator().manual_seed(2))
    before = rt.handler(ZeroHandler).full_parameters(rt.ctx)
    scaler.scale = 1e30  # every fp16 gradient overflows
    loss = rt.train_step(x, y)
    assert loss == loss and scaler.skipped == 1 and scaler.scale == 5e29
    after = rt.handler(ZeroHandler).full_parameters(rt.ctx)
    assert all(torch.equal(before[n], after[n]) for n in before)  # skipped: nothing moved
    scaler.scale = 2.0**10
    rt.train_step(x, y)
    trained = rt.handler(ZeroHandler).full_parameters(rt.ctx)
    assert scaler.skipped == 1
    assert all(v.dtype == torch.float32 for v in trained.values())
    assert any(not torch.equal(before[n], trained[n]) for n in before)
    rt.close()


def test_refusals_name_the_field_and_the_fix() -> None:
    comp = CompressedSync(compressor="topk", params={"ratio": 0.1})
    sync = GradientSync(strategies={"c": comp}, tensors=(TensorSync(name="fc_in.weight",
                                                                   strategy="c"),))
    plan = _plan("fp32", dp=2, zero_stage=2).model_copy(update={"gradient_sync": sync})
    (problem,) = refusals(plan)
    assert problem.startswith("gradient_sync.strategies['c']") and "--zero 1" in problem
    assert refusals(_plan("fp32", dp=2, zero_stage=1)) == []
    assert refusals(_plan("fp32", dp=1, zero_stage=3)) == []  # nothing to shard: ZeRO-0
    assert refusals(_plan("fp32", dp=2, pp=2, tp=2, micro_batches=2, zero_stage=2)) == []
    assert refusals(_plan("fp32", dp=2, tp=2, zero_stage=3)) == []  # FSDP2 over TP shards
    assert refusals(_plan("fp32", dp=2, pp=2, micro_batches=2, zero_stage=3)) == []  # per stage
    assert refusals(_plan("fp32", dp=2, pp=2, tp=2, micro_batches=2, zero_stage=3)) == []
    assert refusals(_plan("bf16", dp=1, pp=2, micro_batches=2)) == []  # runs per stage
    # fp16 under ZeRO-3 runs behind the loss scale (precision.LossScaledOptimizer)
    assert refusals(_plan("fp16", dp=2, zero_stage=3)) == []


def test_the_planners_chimera_plan_is_one_the_runtime_runs(tmp_path: Path) -> None:
    """``hetplan plan --schedule chimera`` emits a plan the runtime runs (its own executor,
    ``runtime/handlers/chimera.py``): no refusal, and no warning that ``hetplan run`` would
    refuse it (there was one: Chimera was simulated only)."""
    from typer.testing import CliRunner

    from hetplan.cli import app

    out = tmp_path / "plan.json"
    res = CliRunner().invoke(app, ["plan", "gpt-test", "-c", "local-cpu", "-b", "8", "--pp",
                                   "2", "--schedule", "chimera", "-o", str(out)])
    assert res.exit_code == 0, res.output
    plan = load_plan(out)
    assert plan.layout is not None and plan.layout.schedule == "chimera"
    assert refusals(plan) == []
    assert "refuses this plan" not in " ".join(res.output.split())


def test_the_first_handler_refuses_with_every_problem() -> None:
    comp = CompressedSync(compressor="topk", params={"ratio": 0.1})
    other = CompressedSync(compressor="randomk", params={"ratio": 0.1})
    sync = GradientSync(strategies={"c": comp, "d": other},
                        tensors=(TensorSync(name="fc_in.weight", strategy="c"),
                                 TensorSync(name="fc_in.bias", strategy="d")))
    plan = _plan("fp16", dp=2, pp=2, micro_batches=2, zero_stage=3).model_copy(
        update={"gradient_sync": sync})
    with pytest.raises(SpecError, match="does not execute this plan's combination") as info:
        CompositionHandler().setup(SimpleNamespace(plan=plan))  # type: ignore[arg-type]
    assert "strategies['c']" in str(info.value) and "strategies['d']" in str(info.value)
    assert DEFAULT_HANDLERS[0] is CompositionHandler
