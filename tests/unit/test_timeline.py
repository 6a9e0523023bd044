"""The data-parallel timeline simulator against hand-computed timelines and the thesis figures."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetplan.algorithms.dp_timeline import simulate_dp
from hetplan.algorithms.dp_types import CPU, GPU, Op, SyncUnit


def _units(ops_per_tensor: list[list[Op]]) -> list[SyncUnit]:
    return [SyncUnit(i, tuple(ops), f"T{i}") for i, ops in enumerate(ops_per_tensor)]


def test_pure_overlap() -> None:
    # ready at 1, 2, 3; each allreduce 0.5 finishes before the next tensor is ready
    tl = simulate_dp([1, 1, 1], _units([[Op("net", 0.5)]] * 3), forward_s=2, optimizer_s=0.25)
    assert tl.sync_end_s == pytest.approx(3.5)
    assert tl.exposed_comm_s == pytest.approx(0.5)
    assert tl.iteration_s == pytest.approx(2 + 3.5 + 0.25)


def test_communication_bound() -> None:
    # comm [1,3], [3,5], [5,7]: the channel is the bottleneck
    tl = simulate_dp([1, 1, 1], _units([[Op("net", 2)]] * 3))
    assert tl.iteration_s == pytest.approx(7)
    assert tl.busy_s["net"] == pytest.approx(6)


def test_gpu_compression_delays_backprop() -> None:
    # T0 ready at 1, compress 0.5 on the GPU [1,1.5] delays T1's backprop to [1.5,2.5];
    # T0 comm [1.5,2.5]; T1 comm [2.5,3.5]
    units = _units([[Op(GPU, 0.5), Op("net", 1)], [Op("net", 1)]])
    tl = simulate_dp([1, 1], units, record=True)
    assert tl.backprop_end_s == pytest.approx(2.5)
    assert tl.iteration_s == pytest.approx(3.5)
    bp1 = [e for e in tl.events if e.label == "backprop 1"][0]
    assert (bp1.start_s, bp1.end_s) == (pytest.approx(1.5), pytest.approx(2.5))


def test_decompression_waits_for_the_current_backprop_segment() -> None:
    # T0: comm [1,1.2] then decompress on GPU: runnable at 1.2 but T1's backprop [1,3] runs,
    # so decompress runs [3,3.5]
    units = _units([[Op("net", 0.2), Op(GPU, 0.5)], []])
    tl = simulate_dp([1, 2], units)
    assert tl.sync_end_s == pytest.approx(3.5)
    assert tl.iteration_s == pytest.approx(3.5)


def test_cpu_offload_runs_beside_backprop() -> None:
    # CPU compression does not touch the GPU stream: backprop ends at 2
    units = _units([[Op(CPU, 1.5), Op("net", 0.25)], [Op("net", 0.25)]])
    tl = simulate_dp([1, 1], units)
    assert tl.backprop_end_s == pytest.approx(2)
    assert tl.iteration_s == pytest.approx(2.75)  # T1 comm [2,2.25], T0 cpu [1,2.5] comm [2.5,2.75]


def test_cpu_pool_workers_run_in_parallel() -> None:
    units = _units([[Op(CPU, 2)], [Op(CPU, 2)]])
    assert simulate_dp([0, 0], units, cpu_workers=1).iteration_s == pytest.approx(4)
    assert simulate_dp([0, 0], units, cpu_workers=2).iteration_s == pytest.approx(2)


# ---- Espresso Fig. 4.2 (zen_espresso.md §F.2) --------------------------------------------
_B = [10, 10, 9]
_RAW = [14, 11, 10]
_GPU = [5, 5, 3.6]
_CPU = [7.3, 12.4, 11.2]


def _fig42(choice: str) -> float:
    ops = []
    for i, c in enumerate(choice):
        if c == "N":
            ops.append([Op("net", _RAW[i])])
        elif c == "G":
            ops.append([Op(GPU, _GPU[i]), Op("net", 3.6)])
        else:
            ops.append([Op(CPU, _CPU[i]), Op("net", 3.6)])
    return simulate_dp(_B, _units(ops)).iteration_s


@pytest.mark.parametrize(
    ("choice", "expected"),
    [("NNN", 45), ("NNG", 38.6), ("GGG", 46.2), ("CCC", 47.2), ("CNG", 36.2)],
)
def test_espresso_figure_4_2(choice: str, expected: float) -> None:
    assert _fig42(choice) == pytest.approx(expected)


def test_espresso_figure_4_2_unique_optimum_by_brute_force() -> None:
    results = {"".join(c): _fig42("".join(c)) for c in itertools.product("NGC", repeat=3)}
    ranked = sorted(results.items(), key=lambda kv: kv[1])
    assert ranked[0] == ("CNG", pytest.approx(36.2))
    assert ranked[1][1] > ranked[0][1] + 1e-9
    assert results["NCG"] == pytest.approx(39.6) and results["CCG"] == pytest.approx(39.6)


# ---- Espresso Fig. 4.9 (§F.3) --------------------------------------------------------------
@pytest.mark.parametrize(
    ("compress", "expected"), [((), 89), ((1,), 86), ((2,), 71), ((1, 2), 72)]
)
def test_espresso_figure_4_9(compress: tuple[int, ...], expected: float) -> None:
    raw = [11, 27, 27]
    ops = [
        [Op(GPU, 4), Op("net", 9)] if i in compress else [Op("net", raw[i])] for i in range(3)
    ]
    assert simulate_dp([15, 20, 20], _units(ops)).iteration_s == pytest.approx(expected)


# ---- properties --------------------------------------------------------------------------
@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.floats(0, 5), min_size=1, max_size=12),
    st.lists(st.floats(0.01, 5), min_size=12, max_size=12),
    st.floats(1.0, 4.0),
)
def test_more_bandwidth_never_increases_time(bp: list[float], comm: list[float], k: float) -> None:
    units = _units([[Op("net", c)] for c in comm[: len(bp)]])
    faster = _units([[Op("net", c / k)] for c in comm[: len(bp)]])
    assert simulate_dp(bp, faster).iteration_s <= simulate_dp(bp, units).iteration_s + 1e-9


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.floats(0, 5), min_size=2, max_size=12),
    st.lists(st.floats(0.01, 5), min_size=12, max_size=12),
    st.lists(st.floats(0, 3), min_size=12, max_size=12),
)
def test_adding_a_tensor_never_decreases_time(
    bp: list[float], comm: list[float], gpu: list[float]
) -> None:
    n = len(bp)
    ops = [[Op(GPU, gpu[i]), Op("net", comm[i])] if i % 2 else [Op("net", comm[i])]
           for i in range(n)]
    full = simulate_dp(bp, _units(ops)).iteration_s
    fewer = simulate_dp(bp[:-1], _units(ops[:-1])).iteration_s
    assert fewer <= full + 1e-9


def test_bad_unit_index() -> None:
    with pytest.raises(ValueError, match="outside 0..1"):
        simulate_dp([1, 1], [SyncUnit(2, (Op("net", 1),), "x")])
