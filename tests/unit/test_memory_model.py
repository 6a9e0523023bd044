"""The memory model (cost_models/memory.py): exact model-state formulas per dtype, optimizer
and ZeRO stage, the TP division, activations per recomputation mode, ZeRO buffers, the
allocator margin, and in-flight micro-batches counted from the schedules' action lists.

Every expected number is worked out by hand in the comments.
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from hetplan.algorithms.pipeline_schedules import build_schedule
from hetplan.cost_models.memory import (
    ALLOCATOR_MARGIN,
    FP32,
    MIXED,
    StatePrecision,
    in_flight_micro_batches,
    layer_activations,
    model_state,
    peak_in_flight,
    recompute_transient,
    stage_memory,
    zero_buffers,
)
from hetplan.ir.plan_sections import LayerCost

M = 1_000_000
#: 1e6 fp32 parameters (4e6 bytes captured), no splittable linears.
PLAIN = LayerCost(name="plain", param_bytes=4 * M)
#: 1e6 fp32 parameters of which 3/4 in TP-splittable linears.
SPLIT = LayerCost(name="split", kind="block", param_bytes=4 * M, tp_split_bytes=3 * M,
                  tp_pairs=2)


# -- model state --------------------------------------------------------------------------
@pytest.mark.parametrize("optimizer, per_param", [
    ("adam", (2, 2, 12)),  # bf16 weights, bf16 grads, fp32 master 4 + two fp32 moments 8
    ("adamw", (2, 2, 12)),
    ("sgd-momentum", (2, 2, 8)),  # master 4 + one moment 4
    ("sgd", (2, 2, 4)),  # master only
])
def test_mixed_precision_state_per_parameter(optimizer: str, per_param: tuple[int, ...]) -> None:
    assert model_state([PLAIN], optimizer=optimizer, precision=MIXED) == tuple(
        float(b * M) for b in per_param)


@pytest.mark.parametrize("optimizer, per_param", [
    ("adam", (4, 4, 8)),  # fp32 weights are the master copy; two fp32 moments
    ("sgd-momentum", (4, 4, 4)),
    ("sgd", (4, 4, 0)),
])
def test_fp32_state_per_parameter(optimizer: str, per_param: tuple[int, ...]) -> None:
    assert model_state([PLAIN], optimizer=optimizer, precision=FP32) == tuple(
        float(b * M) for b in per_param)


def test_mixed_adam_is_sixteen_bytes_per_parameter() -> None:
    assert sum(model_state([PLAIN], precision=MIXED)) == 16 * M
    assert sum(model_state([PLAIN], precision=FP32)) == 16 * M


@pytest.mark.parametrize("zero, expected", [
    (0, (2 * M, 2 * M, 12 * M)),
    (1, (2 * M, 2 * M, 12 * M / 8)),  # the 12 optimizer bytes / dp
    (2, (2 * M, 2 * M / 8, 12 * M / 8)),  # + gradients / dp
    (3, (2 * M / 8, 2 * M / 8, 12 * M / 8)),  # + weights / dp
])
def test_zero_stages_divide_by_dp(zero: int, expected: tuple[float, ...]) -> None:
    assert model_state([PLAIN], dp=8, zero_stage=zero, precision=MIXED) == pytest.approx(
        expected, rel=1e-15)


def test_zero_in_fp32_divides_the_moments_only_at_stage_one() -> None:
    # fp32 Adam, dp 4, ZeRO-1: 4 + 4 + 8/4 = 10 bytes per parameter
    assert sum(model_state([PLAIN], dp=4, zero_stage=1, precision=FP32)) == 10 * M


def test_tensor_parallel_divides_the_split_part_only() -> None:
    # 0.25e6 unsplit + 0.75e6 / 4 split parameters = 437,500 per TP rank; mixed Adam 16 B
    weights, grads, state = model_state([SPLIT], tp=4, precision=MIXED)
    assert (weights, grads, state) == (2 * 437_500, 2 * 437_500, 12 * 437_500)
    # uneven shards: this rank holds 40 % of the split part
    w, _, _ = model_state([SPLIT], tp=4, precision=MIXED, shares=[0.4])
    assert w == 2 * (250_000 + 0.4 * 750_000)


def test_a_16bit_capture_counts_elements_by_its_own_size() -> None:
    # the same 1e6 parameters captured in bf16 (2e6 bytes): still 16 bytes each
    half = StatePrecision(weight_bytes=2, grad_bytes=2, master_bytes=4, act_bytes=2,
                          capture_bytes=2)
    assert sum(model_state([LayerCost(name="x", param_bytes=2 * M)], precision=half)) == 16 * M


def test_unknown_optimizer_and_zero_stage_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown optimizer 'lamb'"):
        model_state([PLAIN], optimizer="lamb")
    with pytest.raises(ValueError, match="zero_stage must be 0, 1, 2 or 3"):
        model_state([PLAIN], zero_stage=4)


def test_zero_buffers() -> None:
    big = LayerCost(name="big", param_bytes=8 * M)  # 2e6 parameters
    layers = [PLAIN, big]
    assert zero_buffers(layers, zero_stage=1, precision=MIXED) == 0
    # ZeRO-2: one reduce-scatter bucket of the largest layer's bf16 gradients
    assert zero_buffers(layers, zero_stage=2, precision=MIXED) == 2 * 2 * M
    # ZeRO-3: + two all-gather buckets of its bf16 weights (computing and prefetched)
    assert zero_buffers(layers, zero_stage=3, precision=MIXED) == 2 * 2 * M + 2 * 2 * 2 * M


# -- activations ------------------------------------------------------------------------------
#: A block that saved 100 captured bytes: 10 non-floating, 30 outside the TP regions (of which
#: 4 non-floating), 40 in the attention core (of which 5 non-floating); its input is 8 bytes.
BLOCK = LayerCost(name="b", kind="block", tp_pairs=2, act_in_bytes=8, act_saved_bytes=100,
                  act_saved_nonfloat_bytes=10, act_replicated_bytes=30,
                  act_replicated_nonfloat_bytes=4, act_attn_core_bytes=40,
                  act_attn_core_nonfloat_bytes=5, fwd_flops=100, attn_core_fwd_flops=20)


def test_activations_none_mode_scale_floating_bytes_only() -> None:
    assert layer_activations(BLOCK, "none", precision=FP32) == 100
    # bf16: 90 floating bytes halve, 10 mask bytes stay
    assert layer_activations(BLOCK, "none", precision=MIXED) == 45 + 10
    # x3 micro-batch
    assert layer_activations(BLOCK, "none", precision=MIXED, micro_batch_scale=3) == 165


def test_activations_selective_drops_the_attention_core() -> None:
    # fp32: 100 - 40; bf16: (90 - 35) / 2 + (10 - 5) = 32.5
    assert layer_activations(BLOCK, "selective", precision=FP32) == 60
    assert layer_activations(BLOCK, "selective", precision=MIXED) == 32.5


def test_activations_full_keeps_the_input() -> None:
    assert layer_activations(BLOCK, "full", precision=MIXED) == 4
    # a non-block layer is never recomputed
    head = BLOCK.model_copy(update={"kind": "head"})
    assert layer_activations(head, "full", precision=FP32) == 100


def test_activations_under_tensor_and_sequence_parallelism() -> None:
    # tp=4 without SP: the 70 bytes inside TP regions / 4 + the 30 outside
    assert layer_activations(BLOCK, "none", tp=4) == 70 / 4 + 30
    # bf16: inside = 55 - ((26 / 2) + 4) = 38 -> / 4; outside 13 + 4 = 17
    assert layer_activations(BLOCK, "none", tp=4, precision=MIXED) == 38 / 4 + 17
    # sequence parallelism splits the outside part too
    assert layer_activations(BLOCK, "none", tp=4, sequence_parallel=True) == 100 / 4
    assert layer_activations(BLOCK, "full", tp=4, sequence_parallel=True) == 8 / 4
    assert layer_activations(BLOCK, "full", tp=4) == 8
    # selective with TP: the core is inside a region: (70 - 40) / 4 + 30
    assert layer_activations(BLOCK, "selective", tp=4) == 30 / 4 + 30


def test_layers_without_pairs_are_not_split_and_old_plans_split_everything() -> None:
    norm = LayerCost(name="n", kind="norm", act_saved_bytes=100)
    assert layer_activations(norm, "none", tp=4) == 100
    # a plan written before the breakdown fields: every byte of a TP layer is split
    old = LayerCost(name="o", kind="block", tp_pairs=2, act_saved_bytes=100)
    assert layer_activations(old, "none", tp=4) == 25


def test_recompute_transient() -> None:
    assert recompute_transient(BLOCK, "none") == 0
    assert recompute_transient(BLOCK, "selective") == 40  # the core, rematerialised
    assert recompute_transient(BLOCK, "full") == 100 - 8  # the whole layer but its input


def test_stage_memory_adds_margin_on_activations_and_buffers() -> None:
    # one bf16 block, 1e6 params, ZeRO-3 over dp 2, 3 micro-batches in flight, full recompute
    block = LayerCost(name="b", kind="block", param_bytes=4 * M, act_in_bytes=8 * M,
                      act_saved_bytes=64 * M)
    mem = stage_memory([block], tp=1, micro_batch_scale=1.0, in_flight=3, precision=MIXED,
                       dp=2, zero_stage=3, recompute="full")
    assert (mem.params, mem.grads, mem.optimizer) == (M, M, 6 * M)
    # 3 inputs of 4e6 bf16 bytes + one layer rematerialised (32e6 - 4e6)
    assert mem.activations == 3 * 4 * M + 28 * M
    assert mem.buffers == 2 * M + 2 * 2 * M
    assert mem.margin == int(ALLOCATOR_MARGIN * (40 * M + 6 * M))
    assert mem.total == M + M + 6 * M + 40 * M + 6 * M + mem.margin


# -- in flight ---------------------------------------------------------------------------------
@pytest.mark.parametrize("pp, m", [(2, 4), (4, 4), (4, 16), (8, 8)])
def test_in_flight_1f1b_and_gpipe(pp: int, m: int) -> None:
    for r in range(pp):
        assert in_flight_micro_batches("1f1b", r, pp, m) == min(m, pp - r)
        assert in_flight_micro_batches("gpipe", r, pp, m) == m


def test_in_flight_closed_forms_equal_the_walk_of_the_lists() -> None:
    # 1F1B and GPipe are answered without walking the action lists: the same floats
    for name in ("1f1b", "gpipe"):
        for pp in range(2, 10):
            for m in range(1, 24):
                sched = build_schedule(name, pp, m)
                for r in range(pp):
                    walked = peak_in_flight(sched, r, [1.0] * sched.num_stages)
                    got = in_flight_micro_batches(name, r, pp, m)
                    assert (got, type(got)) == (walked, float), (name, pp, m, r)


def test_no_pipeline_holds_one_micro_batch() -> None:
    # without a pipeline the runtime accumulates gradients micro-batch after micro-batch
    assert in_flight_micro_batches("gpipe", 0, 1, 8) == 1
    assert in_flight_micro_batches("1f1b", 0, 1, 8) == 1


@pytest.mark.parametrize("pp, v", [(2, 2), (4, 2), (4, 3), (4, 4), (8, 2), (8, 4)])
def test_interleaved_first_rank_matches_narayanan(pp: int, v: int) -> None:
    # Narayanan et al. 2021 / Korthikanti et al. 2022: the first stage of interleaved 1F1B
    # holds p * (1 + (p - 1) / (p * v)) micro-batches' worth of activations
    m = 4 * pp
    got = in_flight_micro_batches("interleaved-1f1b", 0, pp, m, v)
    assert Fraction(got).limit_denominator(1000) == pp * (1 + Fraction(pp - 1, pp * v))


def test_interleaved_later_ranks_count_their_own_warmup() -> None:
    # rank r warms up 2(p - r - 1) + (v - 1) p chunks and holds one more before its first
    # backward: (v p + p - 2 r - 1) / v micro-batches' worth
    pp, v, m = 4, 3, 8
    for r in range(pp):
        want = Fraction(v * pp + pp - 2 * r - 1, v)
        got = in_flight_micro_batches("interleaved-1f1b", r, pp, m, v)
        assert Fraction(got).limit_denominator(1000) == want


def test_peak_in_flight_weighs_uneven_chunks() -> None:
    # interleaved, p=2, v=2: rank 0 holds chunks 0 and 2; chunk 2 is three times chunk 0
    sched = build_schedule("interleaved-1f1b", 2, 2, 2)
    stage_bytes = [1.0, 0.0, 3.0, 0.0]
    # rank 0 runs 0F0 0F1 2F0 2F1 before any backward: 1 + 1 + 3 + 3
    assert peak_in_flight(sched, 0, stage_bytes) == 8.0
