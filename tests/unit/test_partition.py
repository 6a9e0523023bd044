"""Unit tests of the pipeline partitioner: research/dynpipe.md section 6.3 cases (derived by
hand in the digest), the device-order rule, memory errors and re-packing."""

from __future__ import annotations

import sys

import pytest

from hetplan.algorithms.partition import (
    greedy_partition,
    min_max_partition,
    partition_by_params,
    partition_by_time,
    pipeline_device_order,
    repack,
    uniform_partition,
)
from hetplan.errors import InfeasiblePlanError, SpecError

# (weights, P, optimal bottleneck) from research/dynpipe.md section 6.3
CASES = [
    ([1] * 8, 4, 2),
    ([2, 2, 2, 2, 1, 1, 1, 1], 4, 4),
    ([4] * 8 + [1] * 8, 4, 12),
    ([3, 1, 1, 1, 1, 1, 1, 3], 4, 3),
    ([5, 1, 1, 1, 1, 1, 1, 1], 4, 5),
    ([1, 1, 1, 1, 0.4, 0.4, 0.4, 0.4] + [0.1] * 8, 4, 2.0),
]


@pytest.mark.parametrize(("weights", "p", "opt"), CASES)
def test_section_6_3_optimal_bottleneck(weights, p, opt) -> None:
    part = partition_by_params(weights, p)
    assert part.bottleneck == pytest.approx(opt)
    assert all(b[0] <= b[1] for b in part.bounds)  # no empty stage, unlike the greedy


def test_section_6_3_unique_answers() -> None:
    assert min_max_partition([1] * 8, 4).bounds == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert min_max_partition([3, 1, 1, 1, 1, 1, 1, 3], 4).bounds == (
        (0, 0), (1, 3), (4, 6), (7, 7))


def test_tie_break_balances_the_other_stages() -> None:
    # [4]*8+[1]*8, P=4: optimum 12. The smallest sum of squares is 12,12,8,8 (= 416) or
    # 8,8,12,12; both beat the greedy's 12,12,12,4 (= 448).
    part = min_max_partition([4] * 8 + [1] * 8, 4)
    assert sum(x * x for x in part.loads) == 416
    assert sorted(part.loads) == [8, 8, 12, 12]


def test_heterogeneous_speeds_give_the_fast_device_more_layers() -> None:
    # 12 equal layers, device 0 twice as fast: 8 layers (time 4) vs 4 layers (time 4)
    part = partition_by_time([1.0] * 12, 2, speeds=[2.0, 1.0])
    assert part.bounds == ((0, 7), (8, 11))
    assert part.loads == (4.0, 4.0)


def test_transfer_cost_moves_the_cut_to_a_cheap_boundary() -> None:
    # cutting after layer 1 costs 5 to send; after layer 2 only 0: the cut goes after 2
    part = partition_by_time([1, 1, 1, 1], 2, send_ms=[9, 5, 0, 9])
    assert part.bounds == ((0, 2), (3, 3))
    assert part.loads == (3.0, 1.0)


def test_memory_cap_is_respected_and_binding() -> None:
    # time prefers 2|2, but stage 0 holds at most one layer
    part = min_max_partition([1, 1, 1, 1], 2, mem=[10, 10, 10, 10], mem_cap=[10, 40])
    assert part.bounds == ((0, 0), (1, 3))
    with pytest.raises(InfeasiblePlanError, match="fits the devices' memory"):
        min_max_partition([1, 1, 1, 1], 2, mem=[10, 10, 10, 10], mem_cap=[10, 20])


def test_bad_inputs_are_spec_errors() -> None:
    with pytest.raises(SpecError, match="finite and >= 0"):
        min_max_partition([1, -1], 1)
    with pytest.raises(SpecError, match="speeds needs 2 positive"):
        partition_by_time([1, 1], 2, speeds=[1, 0])
    with pytest.raises(InfeasiblePlanError, match="at least 3 layers"):
        min_max_partition([1, 1], 3)
    with pytest.raises(SpecError, match="mem_cap"):
        min_max_partition([1, 1], 1, mem=[1, 1])


def test_greedy_can_leave_a_stage_nearly_empty_exact_does_not() -> None:
    w = [5, 1, 1, 1, 1, 1, 1, 1]
    assert greedy_partition(w, 4).bottleneck == pytest.approx(5, rel=1e-6)
    assert min_max_partition(w, 4).loads == (5, 3, 2, 2)


def test_uniform_partition_is_megatron_style() -> None:
    assert uniform_partition(10, 4) == ((0, 2), (3, 5), (6, 7), (8, 9))


def test_device_order_keeps_nodes_contiguous_big_memory_first() -> None:
    # node 0: two 32 GB V100s; node 1: two 80 GB A100s (one slowed down)
    order = pipeline_device_order(nodes=[0, 0, 1, 1], memory_bytes=[32, 32, 80, 80],
                                  speeds=[1, 1, 3, 1.5])
    assert order == (2, 3, 0, 1)


def test_repack_releases_devices_when_memory_allows() -> None:
    cost = [[1.0] * 8] * 4
    mem = [[1.0] * 8] * 4
    # each device holds 4 layers: 2 devices suffice, 2 are released
    r = repack(cost, mem, [4, 4, 4, 4], target=1)
    assert r.released == (2, 3)
    assert r.partition.bounds == ((0, 3), (4, 7))
    # the target is a floor
    assert repack(cost, mem, [8, 8, 8, 8], target=3).released == (3,)
    # a slowdown cap keeps all devices
    assert repack(cost, mem, [8] * 4, target=1, max_slowdown=1.0).released == ()


def test_no_torch_import() -> None:
    assert "hetplan.algorithms.partition" in sys.modules
    import hetplan.algorithms.partition as mod

    assert "torch" not in mod.__dict__
