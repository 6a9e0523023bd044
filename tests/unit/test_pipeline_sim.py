"""Tests of the pipeline-iteration simulator (hetplan.cost_models.pipeline).

Hand-computed timelines, closed forms in the balanced case, imbalance, transfers, the DynPipe
seed's Eq. (1) (worked values of research/dynpipe.md section 6.1) against the Chimera
simulation, deadlock reporting, speed, and hypothesis properties. Times are ints or
Fractions wherever exact equality is asserted.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetplan.cost_models.pipeline import (
    SCHEDULES,
    Action,
    ActionKind,
    PipelineDeadlockError,
    PipelineSchedule,
    PipelineScheduleError,
    PipelineSimResult,
    TimedEvent,
    bubble_ratio_eq1,
    bubble_ratio_gpipe_1f1b,
    bubble_ratio_interleaved,
    build_schedule,
    chimera_schedule,
    simulate_pipeline,
    simulate_schedule,
)

F, B = ActionKind.F, ActionKind.B
Fr = Fraction
Case = tuple[str, int, int, list[Fraction], list[Fraction], int]


def _timeline(result: PipelineSimResult) -> list[tuple[int, str, int, float, float]]:
    return [(e.rank, e.kind.value, e.microbatch, e.start_ms, e.end_ms) for e in result.events]


# ----------------------------------------------------------------- hand-computed timelines


def test_gpipe_p2_m2_hand_timeline() -> None:
    # t_f = 1, t_b = 2, no transfer.
    # rank 0: F0 [0,1]  F1 [1,2]
    # rank 1: F0 [1,2]  F1 [2,3]  B0 [3,5]  B1 [5,7]     (backwards after all forwards)
    # rank 0: B0 needs rank 1's B0 (5) -> [5,7]; B1 needs rank 1's B1 (7) -> [7,9]
    # makespan 9; busy 6 per rank; bubble 1 - 12/18 = 1/3 = (P-1)/(M+P-1).
    r = simulate_pipeline([1, 1], [2, 2], 2, "gpipe")
    assert _timeline(r) == [
        (0, "F", 0, 0, 1), (0, "F", 1, 1, 2), (1, "F", 0, 1, 2), (1, "F", 1, 2, 3),
        (1, "B", 0, 3, 5), (0, "B", 0, 5, 7), (1, "B", 1, 5, 7), (0, "B", 1, 7, 9),
    ]
    assert r.iteration_ms == 9
    assert r.busy_ms == (6, 6) and r.idle_ms == (3, 3)
    assert r.bubble_ratio == pytest.approx(1 / 3)


def test_1f1b_p2_m2_hand_timeline() -> None:
    # Rank 0 warms up with P-0-1 = 1 forward: F0 F1 B0 B1; rank 1 has none: F0 B0 F1 B1.
    # rank 0: F0 [0,1]  F1 [1,2]
    # rank 1: F0 [1,2]  B0 [2,4]   F1 (ready at 2, rank free at 4) [4,5]  B1 [5,7]
    # rank 0: B0 needs rank 1's B0 (4) -> [4,6]; B1 needs rank 1's B1 (7) -> [7,9]
    # makespan 9, the same as GPipe (same bubble, fewer stashed activations).
    r = simulate_pipeline([1, 1], [2, 2], 2, "1f1b")
    assert _timeline(r) == [
        (0, "F", 0, 0, 1), (0, "F", 1, 1, 2), (1, "F", 0, 1, 2), (1, "B", 0, 2, 4),
        (0, "B", 0, 4, 6), (1, "F", 1, 4, 5), (1, "B", 1, 5, 7), (0, "B", 1, 7, 9),
    ]
    assert r.iteration_ms == 9
    assert all(isinstance(e, TimedEvent) and e.stage == e.rank for e in r.events)


def test_1f1b_action_order_matches_megatron() -> None:
    s = build_schedule("1f1b", 4, 6)
    assert [str(a) for a in s.actions[1]] == [
        "1F0", "1F1", "1F2", "1B0", "1F3", "1B1", "1F4", "1B2", "1F5", "1B3", "1B4", "1B5"]
    assert [str(a) for a in s.actions[3]][:4] == ["3F0", "3B0", "3F1", "3B1"]


# ----------------------------------------------------------------- balanced closed forms


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 5, 8, 16])
def test_balanced_bubble_is_classic_closed_form(name: str, p: int, m: int) -> None:
    r = simulate_pipeline([Fr(3)] * p, [Fr(5)] * p, m, name)
    assert r.bubble_ratio == bubble_ratio_gpipe_1f1b(p, m)
    assert r.iteration_ms == (m + p - 1) * 8


@pytest.mark.parametrize(("p", "m", "v"), [(2, 4, 3), (4, 4, 2), (4, 8, 2), (4, 16, 4),
                                           (8, 16, 2), (3, 9, 3)])
def test_interleaved_cuts_bubble_by_factor_v(p: int, m: int, v: int) -> None:
    fwd, bwd = [Fr(1)] * p, [Fr(2)] * p
    inter = simulate_pipeline(fwd, bwd, m, "interleaved-1f1b", virtual_stages=v)
    plain = simulate_pipeline(fwd, bwd, m, "1f1b")
    # Bubble time per rank is exactly (P-1)(t_f+t_b)/v, against (P-1)(t_f+t_b) for 1F1B.
    assert all(i == (p - 1) * 3 / Fr(v) for i in inter.idle_ms)
    assert all(i == (p - 1) * 3 for i in plain.idle_ms)
    assert inter.bubble_ratio == bubble_ratio_interleaved(p, m, v)
    assert inter.bubble_ratio < plain.bubble_ratio
    assert len(inter.events) == 2 * m * p * v


def test_interleaved_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="divisible by the pipeline size"):
        simulate_pipeline([1] * 4, [2] * 4, 6, "interleaved-1f1b", virtual_stages=2)
    with pytest.raises(ValueError, match="virtual_stages >= 2"):
        build_schedule("interleaved-1f1b", 4, 8, virtual_stages=1)
    with pytest.raises(ValueError, match="one chunk per rank"):
        build_schedule("1f1b", 4, 8, virtual_stages=2)
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb'"):
        build_schedule("zb", 4, 8)


# ----------------------------------------------------------------- imbalance and transfers


@pytest.mark.parametrize("m", [4, 8, 16])
def test_1f1b_one_slow_stage(m: int) -> None:
    # P = 4, f = 1, b = 2; stage k = 2 is twice as slow (f' = 2, b' = 4).
    # Stage k starts at sum_{j<k} f_j = 2 and then never waits for its inputs from upstream
    # (they come every f = 1 < f' = 2), except once: after its P-k-1 = 1 warm-up forward and
    # the first steady forward it is ready for B0 at 2 + 2*f' = 6, but B0 returns only at
    # 2 + f' + (P-1-k)(f+b) = 7, a wait of (P-1-k)(b-f) = 1. From then on the rest of the
    # pipeline is faster than stage k, so it is busy for M(f'+b') = 6M in total, and the
    # last B leaves it for the upstream stages' backwards, sum_{j<k} b_j = 4. Hence
    #   makespan = 2 + 6M + 1 + 4 = 6M + 7,
    # below the naive (M-1)*max_stage + sum(stages) = 6M + 9: 1F1B hides part of the
    # bottleneck's extra backward in its warm-up. Balanced, it would be 3(M+3).
    r = simulate_pipeline([1, 1, 2, 1], [2, 2, 4, 2], m, "1f1b")
    assert r.iteration_ms == 6 * m + 7
    assert r.iteration_ms > 3 * (m + 3)
    assert r.idle_ms[2] == 1 + 2 + 4  # its wait for B0, plus head and tail
    assert r.bubble_ratio > bubble_ratio_gpipe_1f1b(4, m)


@pytest.mark.parametrize("slow", [0, 1, 2, 3])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_gpipe_one_slow_stage(slow: int, m: int) -> None:
    # Forward phase: the last forward leaves the slow stage at sum_{j<=k} f + (M-1) f', so it
    # reaches the end at sum(f) + (M-1) f'. Backward phase likewise adds sum(b) + (M-1) b':
    #   makespan = (M-1) * max_stage + sum(stages), with stage = f + b.
    fwd, bwd = [1, 1, 1, 1], [2, 2, 2, 2]
    fwd[slow], bwd[slow] = 2, 4
    r = simulate_pipeline(fwd, bwd, m, "gpipe")
    assert r.iteration_ms == (m - 1) * 6 + 15


def test_transfers_add_time_hand_computed() -> None:
    # P = 2, M = 2, 1F1B, t_f = 1, t_b = 2, 1/2 per hop in each direction:
    # rank 0: F0 [0,1]  F1 [1,2]
    # rank 1: F0 [1.5,2.5]  B0 [2.5,4.5]  F1 (arrived 2.5) [4.5,5.5]  B1 [5.5,7.5]
    # rank 0: B0 (arrives 5) [5,7]   B1 (arrives 8) [8,10]   -> makespan 10 = 9 + 2 * 1/2
    h = Fr(1, 2)
    r = simulate_pipeline([1, 1], [2, 2], 2, "1f1b", p2p_fwd_ms=[h], p2p_bwd_ms=[h])
    assert r.iteration_ms == 10
    assert r.busy_ms == (6, 6)  # transfers never occupy compute


@pytest.mark.parametrize("name", SCHEDULES)
def test_transfers_never_help(name: str) -> None:
    v = 2 if name == "interleaved-1f1b" else 1
    base = simulate_pipeline([1] * 4, [2] * 4, 8, name, virtual_stages=v)
    slow = simulate_pipeline([1] * 4, [2] * 4, 8, name, virtual_stages=v,
                             p2p_fwd_ms=Fr(1, 4), p2p_bwd_ms=Fr(1, 4))
    assert slow.iteration_ms > base.iteration_ms
    assert slow.busy_ms == base.busy_ms


def test_interleaved_needs_the_wrap_link() -> None:
    with pytest.raises(ValueError, match="wrap-around link 3->0"):
        simulate_pipeline([1] * 4, [2] * 4, 4, "interleaved-1f1b", virtual_stages=2,
                          p2p_fwd_ms=[1, 1, 1])
    r = simulate_pipeline([1] * 4, [2] * 4, 4, "interleaved-1f1b", virtual_stages=2,
                          p2p_fwd_ms=[0, 0, 0, 5])
    assert r.iteration_ms > simulate_pipeline([1] * 4, [2] * 4, 4, "interleaved-1f1b",
                                              virtual_stages=2).iteration_ms


# ----------------------------------------------------------------- Eq. (1) and Chimera

# research/dynpipe.md section 6.1: (P, T_F, T_B, T_C, bubble).
EQ1_CASES = [
    (2, 1, 2, 0, Fr(0)), (2, 1, 2, Fr(1, 10), Fr(1, 32)), (2, 1, 2, 1, Fr(1, 5)),
    (4, 1, 2, 0, Fr(1, 4)), (4, 1, 1, 0, Fr(1, 5)), (4, 1, 2, Fr(1, 10), Fr(93, 340)),
    (4, 1, 2, 1, Fr(21, 52)), (8, 1, 2, 0, Fr(1, 3)), (8, 1, 1, 0, Fr(3, 11)),
    (8, 1, 2, Fr(1, 10), Fr(533, 1528)), (8, 1, 2, 1, Fr(101, 232)),
    (16, 1, 2, 0, Fr(7, 19)), (16, 1, 1, 0, Fr(7, 23)),
    (16, 1, 2, Fr(1, 10), Fr(2445, 6448)), (16, 1, 2, 1, Fr(429, 976)),
]


@pytest.mark.parametrize(("p", "t_f", "t_b", "t_c", "expected"), EQ1_CASES)
def test_eq1_worked_values(p: int, t_f: int, t_b: int, t_c: Fraction, expected: Fraction) -> None:
    got = bubble_ratio_eq1(p, t_f, t_b, t_c)
    assert isinstance(got, Fraction) and got == expected
    assert bubble_ratio_eq1(p, float(t_f), float(t_b), float(t_c)) == pytest.approx(
        float(expected))


def test_eq1_chimera_identity_and_coefficients() -> None:
    for p in range(2, 33):
        assert bubble_ratio_eq1(p, 1, 2, 0) == Fr(p - 2) / (Fr(5 * p, 2) - 2)
    # Coefficients at P = 4 (section 6.1): numerator 26 T_C + 8 T_B; denominator
    # 40 T_C + 24 T_B + 16 T_F.
    assert bubble_ratio_eq1(4, 0, 0, 1) == Fr(26, 40)
    assert bubble_ratio_eq1(4, 0, 1, 0) == Fr(8, 24)
    with pytest.raises(ValueError, match="P >= 2"):
        bubble_ratio_eq1(1, 1, 2, 0)


@pytest.mark.parametrize("p", [2, 4, 6, 8, 10, 12, 16])
@pytest.mark.parametrize("ratio", [2, Fr(5, 2), 3, 4])
def test_chimera_simulation_agrees_with_eq1(p: int, ratio: Fraction) -> None:
    # Balanced stages, T_C = 0, B = P micro-batches: the case Eq. (1) describes.
    t_f, t_b = Fr(3), 3 * Fr(ratio)
    r = simulate_pipeline([t_f] * p, [t_b] * p, p, "chimera")
    assert r.bubble_ratio == bubble_ratio_eq1(p, t_f, t_b, 0)
    assert r.iteration_ms == p * t_f + (2 * p - 2) * t_b
    if ratio == 2:
        assert r.bubble_ratio == Fr(p - 2) / (Fr(5 * p, 2) - 2)


def test_chimera_structure() -> None:
    s = chimera_schedule(4, 8)  # two concatenated units of 4 micro-batches
    for r, acts in enumerate(s.actions):
        # rank r holds down stage r (micro-batches 0,1 and 4,5) and up stage 3-r (2,3,6,7)
        stages = {(a.microbatch, a.stage) for a in acts}
        assert stages == {(m, r if m % 4 < 2 else 3 - r) for m in range(8)}
    # D - 2 = 2 bubbles of one unit each on every worker (T_F = T_B = 1, one unit).
    r = simulate_pipeline([1] * 4, [1] * 4, 4, "chimera")
    assert r.idle_ms == (2, 2, 2, 2)
    with pytest.raises(ValueError, match="even number"):
        chimera_schedule(4, 3)
    with pytest.raises(ValueError, match="even number"):
        chimera_schedule(3, 4)


def test_chimera_charges_each_action_its_stages_time() -> None:
    """Chimera's times are per stage: rank 0 runs micro-batch 1's stage 1 (going up) at
    stage 1's time, not at its own stage 0's. P=2, M=2, stage 0: F=1 B=2, stage 1: F=3 B=5,
    no transfers. Rank 0 "0F0 1F1 1B1 0B0", rank 1 "0F1 1F0 1B0 0B1":

    * rank 0: F(0,s0) [0,1]; F(1,s1) after rank 1's F(1,s0) [0,1]: [1,4]; B(1,s1) [4,9];
      B(0,s0) after rank 1's B(0,s1) ends at 9: [9,11]
    * rank 1: F(1,s0) [0,1]; F(0,s1) [1,4]; B(0,s1) [4,9]; B(1,s0) after 9: [9,11]

    Makespan 11, each rank busy 1+3+5+2 = 11. Charging rank 0 its own stage's times for
    every action (and rank 1 stage 1's), as the simulator did, gave 16."""
    r = simulate_pipeline([1, 3], [2, 5], 2, "chimera")
    assert r.iteration_ms == 11
    assert r.busy_ms == (11, 11) and r.bubble_ratio == 0
    ends = {(e.rank, e.kind.value, e.microbatch, e.stage): (e.start_ms, e.end_ms)
            for e in r.events}
    assert ends[(0, "F", 1, 1)] == (1, 4) and ends[(0, "B", 1, 1)] == (4, 9)
    assert ends[(1, "B", 1, 0)] == (9, 11) and ends[(0, "B", 0, 0)] == (9, 11)
    assert r.stage_bwd_end_ms == (11, 9)
    with pytest.raises(PipelineScheduleError, match=r"2 entries \(one per stage\)"):
        simulate_schedule(chimera_schedule(2, 2), [1, 3, 1], [2, 5])


# ----------------------------------------------------------------- schedules as data


def _hand(actions: list[list[str]], m: int) -> PipelineSchedule:
    def parse(text: str) -> Action:
        kind = F if "F" in text else B
        stage, mb = text.split(kind.value)
        return Action(kind, int(mb), int(stage))

    acts = tuple(tuple(parse(a) for a in row) for row in actions)
    return PipelineSchedule("hand", len(actions), m, len(actions), acts)


def test_deadlock_prints_step_rank_table() -> None:
    # rank 1 runs F1 first, but rank 0 only sends F1 after B0, which needs rank 1's B0.
    sched = _hand([["0F0", "0B0", "0F1", "0B1"], ["1F1", "1F0", "1B0", "1B1"]], 2)
    with pytest.raises(PipelineDeadlockError) as info:
        simulate_schedule(sched, [1, 1], [2, 2])
    msg = str(info.value)
    assert "rank 0 at step 1 (0B0)" in msg and "rank 1 at step 0 (1F1)" in msg
    assert "[0B0]" in info.value.table and "[1F1]" in info.value.table
    assert info.value.table.count("<-- STALLED HERE") == 2
    assert isinstance(info.value, ValueError)


def test_hand_schedule_runs_and_validation_errors() -> None:
    ok = _hand([["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]], 2)
    assert simulate_schedule(ok, [1, 1], [2, 2]).iteration_ms == 9
    missing = _hand([["0F0", "0B0"], ["1F0", "1B0", "1F1", "1B1"]], 2)
    with pytest.raises(PipelineScheduleError, match="never runs 0F1"):
        simulate_schedule(missing, [1, 1], [2, 2])
    twice = _hand([["0F0", "0F0", "0B0"], ["1F0", "1B0"]], 1)
    with pytest.raises(PipelineScheduleError, match="appears twice"):
        simulate_schedule(twice, [1, 1], [2, 2])
    with pytest.raises(PipelineScheduleError, match="need 2 entries"):
        simulate_schedule(ok, [1, 1, 1], [2, 2])
    with pytest.raises(PipelineScheduleError, match="needs 1 link times"):
        simulate_schedule(ok, [1, 1], [2, 2], p2p_fwd_ms=[1, 1, 1])


# ----------------------------------------------------------------- properties


@st.composite
def _cases(draw: st.DrawFn) -> Case:
    name = draw(st.sampled_from(SCHEDULES))
    p = draw(st.integers(1, 6))
    if name == "chimera":
        p = 2 * draw(st.integers(1, 3))
    v = draw(st.integers(2, 3)) if name == "interleaved-1f1b" else 1
    step = p if name == "interleaved-1f1b" else (2 if name == "chimera" else 1)
    m = step * draw(st.integers(1, 12 // step + 1))
    # Fractions keep interleaved chunk times (t / v) exact.
    fwd = draw(st.lists(st.integers(0, 9).map(Fr), min_size=p, max_size=p))
    bwd = draw(st.lists(st.integers(0, 9).map(Fr), min_size=p, max_size=p))
    return name, v, m, fwd, bwd, step


_PROPS = settings(max_examples=120, deadline=None)


@_PROPS
@given(_cases(), st.data())
def test_prop_slower_stage_never_shortens_iteration(case: Case, data: st.DataObject) -> None:
    name, v, m, fwd, bwd, _ = case
    base = simulate_pipeline(fwd, bwd, m, name, virtual_stages=v)
    r = data.draw(st.integers(0, len(fwd) - 1))
    extra = data.draw(st.integers(1, 9))
    fwd2, bwd2 = list(fwd), list(bwd)
    (fwd2 if data.draw(st.booleans()) else bwd2)[r] += extra
    slower = simulate_pipeline(fwd2, bwd2, m, name, virtual_stages=v)
    assert slower.iteration_ms >= base.iteration_ms


@_PROPS
@given(_cases(), st.integers(0, 3))
def test_prop_makespan_covers_every_rank(case: Case, hop: int) -> None:
    name, v, m, fwd, bwd, _ = case
    r = simulate_pipeline(fwd, bwd, m, name, virtual_stages=v, p2p_fwd_ms=hop, p2p_bwd_ms=hop)
    assert r.iteration_ms >= max(r.busy_ms)
    if name == "chimera":  # times per stage: rank i runs stage i down and p-1-i up, m/2 each
        p = len(fwd)
        assert r.busy_ms == tuple(m // 2 * (fwd[i] + bwd[i] + fwd[p - 1 - i] + bwd[p - 1 - i])
                                  for i in range(p))
    else:
        assert r.busy_ms == tuple(m * (f + b) for f, b in zip(fwd, bwd))
    assert 0 <= r.bubble_ratio <= 1
    assert all(e.start_ms >= 0 and e.end_ms <= r.iteration_ms for e in r.events)


@_PROPS
@given(_cases())
def test_prop_more_microbatches_never_shorten_iteration(case: Case) -> None:
    name, v, m, fwd, bwd, step = case
    fewer = simulate_pipeline(fwd, bwd, m, name, virtual_stages=v)
    more = simulate_pipeline(fwd, bwd, m + step, name, virtual_stages=v)
    assert more.iteration_ms >= fewer.iteration_ms
