"""Gradient accumulation across micro-batches (``cost_settings.grad_accumulation``), by hand:
the bytes per element of each engine, the elements a rank accumulates (TP split, ZeRO-2
shard, linear weights under the fused GEMM), the seconds on the stage's backward, and that
the default leaves plans as they were."""

from __future__ import annotations

import functools

import pytest

import hetplan
from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.grad_accumulation import (
    accumulation_bytes,
    linear_weight_elems,
    streaming_bandwidth,
)
from hetplan.cost_models.predict import resolve_cluster, simulate
from hetplan.cost_models.rank_memory import stage_precision
from hetplan.cost_models.stage_times import accumulation_s, stage_times
from hetplan.ir.kernels import Gemm
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import CostSettings, LayerCost, Layout, Stage, WorkloadSummary

TOKENS = 8
#: the block's linear weights (16 x 64 and 64 x 16) and 80 other elements (biases, norms)
LIN, OTHER, EMB = 16 * 64 + 64 * 16, 80, 1000


def _workload() -> WorkloadSummary:
    """An embedding-like layer (1000 elements, no product) and a block with two linears and
    an attention-core product, captured in fp32 at 8 tokens."""
    gemms = (Gemm(phase="fwd", batch=1, m=TOKENS, k=16, n=64),
             Gemm(phase="fwd", batch=1, m=TOKENS, k=64, n=16),
             Gemm(phase="fwd", core=True, batch=2, m=TOKENS, k=8, n=TOKENS),
             Gemm(phase="bwd", batch=1, m=16, k=TOKENS, n=64))
    emb = LayerCost(name="emb", param_bytes=4 * EMB, act_out_bytes=4 * TOKENS * 16)
    blk = LayerCost(name="blk", kind="block", param_bytes=4 * (LIN + OTHER),
                    tp_split_bytes=4 * LIN, tp_pairs=1, fwd_flops=2 * TOKENS * LIN,
                    bwd_flops=4 * TOKENS * LIN, act_in_bytes=4 * TOKENS * 16,
                    act_out_bytes=4 * TOKENS * 16, gemms=gemms)
    return WorkloadSummary(batch_size=1, input_shapes=((1, TOKENS),), layers=(emb, blk))


def _costs(mode: str) -> CostModel:
    return CostModel(resolve_cluster("a100-nvlink-8x8"), dtype="bf16",
                     grad_accumulation=mode)  # type: ignore[arg-type]


def _acc(mode: str, *, m: int = 4, tp: int = 1, dp: int = 1,
         zero: int = 0) -> list[float] | None:
    wl = _workload()
    costs = _costs(mode)
    layout = Layout(dp=dp, tp=tp, micro_batches=m, zero_stage=zero)  # type: ignore[arg-type]
    st = Stage(index=0, first_layer=0, last_layer=1, ranks=tuple(range(dp * tp)))
    return accumulation_s(wl, st, layout, costs, stage_precision(wl, st, costs))


def _bw() -> float:
    bw = streaming_bandwidth(resolve_cluster("a100-nvlink-8x8").devices()[0])
    assert bw == pytest.approx(2039e9 * 0.88, rel=1e-3)  # A100 80GB datasheet x stream
    return bw


def test_bytes_per_element_by_engine() -> None:
    # autograd: 3 x the 16-bit gradient for micro-batches 2..m, averaged over m
    assert accumulation_bytes("autograd", 2, 4) == (4.5, 4.5)
    assert accumulation_bytes("autograd", 2, 1) == (0.0, 0.0)
    # Megatron's hook every micro-batch: read the 16-bit gradient, read-modify-write the buffer
    assert accumulation_bytes("hook16", 2, 4) == (6.0, 6.0)
    assert accumulation_bytes("hook32", 2, 4) == (10.0, 10.0)
    # the fused weight-gradient GEMM: nothing for linear weights, the fp32 hook for the rest
    assert accumulation_bytes("fused", 2, 4) == (0.0, 10.0)
    assert accumulation_bytes("unpriced", 2, 4) == (0.0, 0.0)
    with pytest.raises(ValueError, match="grad_accumulation"):
        accumulation_bytes("hook", 2, 4)


def test_linear_weights_are_the_forward_products_over_tokens() -> None:
    blk = _workload().layers[1]
    assert linear_weight_elems(blk, TOKENS) == LIN  # not the core product, not backward's
    assert linear_weight_elems(_workload().layers[0], TOKENS) == 0


@pytest.mark.parametrize(("mode", "per_emb", "per_blk"), [
    ("autograd", 4.5 * EMB, 4.5 * (LIN + OTHER)),
    ("hook16", 6.0 * EMB, 6.0 * (LIN + OTHER)),
    ("hook32", 10.0 * EMB, 10.0 * (LIN + OTHER)),
    ("fused", 10.0 * EMB, 10.0 * OTHER),
])
def test_seconds_per_layer_by_hand(mode: str, per_emb: float, per_blk: float) -> None:
    bw = _bw()
    assert _acc(mode) == pytest.approx([per_emb / bw, per_blk / bw])


def test_nothing_to_price() -> None:
    assert _acc("unpriced") is None
    assert _acc("autograd", m=1) is None  # one micro-batch: its gradient is .grad
    assert _acc("hook16", m=1) is not None  # the hook runs on every micro-batch


def test_tensor_parallel_rank_accumulates_its_shard() -> None:
    bw = _bw()
    # tp 2: the linears' 2048 elements split, the 80 others whole; fused prices the others
    assert _acc("hook16", tp=2) == pytest.approx(
        [6.0 * EMB / bw, 6.0 * (LIN / 2 + OTHER) / bw])
    assert _acc("fused", tp=2) == pytest.approx([10.0 * EMB / bw, 10.0 * OTHER / bw])


def test_zero_stages() -> None:
    full = _acc("hook32", dp=4)
    assert full is not None
    # ZeRO-1 accumulates the whole gradient; ZeRO-2/3 their 1/dp shard of each reduced one
    assert _acc("hook32", dp=4, zero=1) == pytest.approx(full)
    assert _acc("hook32", dp=4, zero=2) == pytest.approx([t / 4 for t in full])
    assert _acc("hook32", dp=4, zero=3) == pytest.approx([t / 4 for t in full])


def test_stage_backward_grows_by_the_term() -> None:
    wl = _workload()
    layout = Layout(micro_batches=4)
    st = Stage(index=0, first_layer=0, last_layer=1, ranks=(0,))
    base = stage_times(wl, st, layout, _costs("unpriced"), 1, 1.0)
    acc = _acc("hook16")
    assert acc is not None
    priced = stage_times(wl, st, layout, _costs("hook16"), 1, 1.0)
    assert priced[0] == pytest.approx(base[0])  # forward unchanged
    assert priced[1] - base[1] == pytest.approx(sum(acc))
    assert [p - b for p, b in zip(priced[3], base[3])] == pytest.approx(acc)


@functools.cache
def _plan(**kw: object) -> Plan:
    """GPT-2 planned with ``kw``; each setting compiled once for the tests that read it."""
    return hetplan.compile("gpt2", "a100-nvlink-8x8", batch_size=256, dp=16, pp=4, tp=1,
                           micro_batch_size=4, dtype="bf16", passes="uniform-stages",
                           **kw)


def test_unpriced_leaves_plans_byte_identical() -> None:
    unpriced = _plan(grad_accumulation="unpriced")
    assert unpriced.cost_settings is not None
    assert unpriced.cost_settings.grad_accumulation == "unpriced"
    text = unpriced.to_json()
    assert "grad_accumulation" not in text  # plans as written before the setting existed
    assert Plan.from_json(text).to_json() == text
    assert Plan.from_json(text).cost_settings.grad_accumulation == "unpriced"  # type: ignore[union-attr]


def test_default_is_the_runtimes_own_accumulation() -> None:
    # the hetplan runtime accumulates with autograd (docs/decisions/grad-accumulation-default.md)
    default, unpriced = _plan(), _plan(grad_accumulation="unpriced")
    assert default.cost_settings is not None and default.predictions is not None
    assert default.cost_settings.grad_accumulation == "autograd"
    assert _plan(grad_accumulation="autograd").to_json() == default.to_json()
    assert unpriced.predictions is not None
    assert default.predictions.iteration_time_ms > unpriced.predictions.iteration_time_ms
    again = Plan.from_json(default.to_json())
    assert '"grad_accumulation": "autograd"' in default.to_json()
    assert simulate(again).iteration_time_ms == pytest.approx(
        default.predictions.iteration_time_ms)


def test_cost_settings_refuse_an_unknown_engine() -> None:
    with pytest.raises(ValueError, match="grad_accumulation"):
        CostSettings(grad_accumulation="hook")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="grad_accumulation"):
        _costs("hook")
