"""The compiled pipeline replay (:mod:`hetplan.algorithms._pipeline_kernel`) against the
Python loop of :mod:`hetplan.cost_models.pipeline`: the same result, bit for bit (makespan,
per-rank busy time, backward ends and every event), on each schedule kind with random
float times and per-link transfers; a deadlock reported the same way; and the search's
entry point (``simulate_named``) taking the array path only for large float schedules."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from hetplan.algorithms import _pipeline_kernel
from hetplan.cost_models import pipeline as P
from hetplan.cost_models.pipeline import (
    Action,
    ActionKind,
    PipelineDeadlockError,
    PipelineSchedule,
)

SHAPES = [("1f1b", 4, 8, 1), ("1f1b", 8, 3, 1), ("gpipe", 3, 5, 1),
          ("interleaved-1f1b", 4, 8, 2), ("interleaved-1f1b", 2, 6, 3),
          ("chimera", 4, 8, 1), ("1f1b", 32, 128, 1)]


def _times(rng: random.Random, k: int, lo: float, hi: float) -> list[float]:
    return [rng.uniform(lo, hi) for _ in range(k)]


def _compiled_or_skip() -> Callable[..., int]:
    jit = _pipeline_kernel.kernel()
    if jit is None:
        pytest.skip("numba is not installed or cannot cache here (HETPLAN_JIT=0?): the "
                    "Python loop is in use, checked by the plain-kernel tests")
    return jit


def _replay_both(name: str, p: int, m: int, v: int, seed: int,
                 run: Callable[..., Any]) -> tuple[P.PipelineSimResult, P.PipelineSimResult]:
    """The Python loop's result and ``run``'s (a kernel) on the same random times."""
    rng = random.Random(seed)
    sched, codes, rank_of, _ = P._indexed(name, p, m, v)
    flat = P._flat(codes, rank_of, sched.num_stages, p)
    per = sched.num_stages if name == "chimera" else p
    fwd, bwd = _times(rng, per, 0.5, 3.0), _times(rng, per, 1.0, 6.0)
    links = _times(rng, p, 0.0, 0.7)  # the wrap-around link last
    hop_b = rng.uniform(0.0, 0.4)
    py = P._simulate(sched, codes, rank_of, fwd, bwd, links, hop_b, None)
    table_f, _ = P._hops(links, rank_of, sched.num_stages, p, "f", back=False)
    table_b, _ = P._hops(hop_b, rank_of, sched.num_stages, p, "b", back=True)
    per_stage = name == "chimera"  # interleaved here: times per rank, split over chunks
    chunks = 1 if per_stage else sched.num_stages // p
    dur_f = [t / chunks if chunks > 1 else t for t in fwd]
    dur_b = [t / chunks if chunks > 1 else t for t in bwd]
    arr = P._replay_compiled(run, sched, flat, per_stage, dur_f, dur_b, table_f, table_b)
    return py, arr


def _same(a: P.PipelineSimResult, b: P.PipelineSimResult) -> None:
    assert a.iteration_ms == b.iteration_ms
    assert a.busy_ms == b.busy_ms and a.idle_ms == b.idle_ms
    assert a.bubble_ratio == b.bubble_ratio
    assert a.rank_bwd_end_ms == b.rank_bwd_end_ms
    assert a.stage_bwd_end_ms == b.stage_bwd_end_ms
    assert a.events == b.events
    assert a == b


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}-p{s[1]}-m{s[2]}-v{s[3]}")
@pytest.mark.parametrize("seed", [0, 1])
def test_plain_kernel_replays_as_the_python_loop(shape: tuple[str, int, int, int],
                                                 seed: int) -> None:
    # the kernel's own logic, uncompiled: runs wherever numpy does
    _same(*_replay_both(*shape, seed, _pipeline_kernel.replay))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}-p{s[1]}-m{s[2]}-v{s[3]}")
def test_simulate_dispatches_to_the_kernel_with_the_same_result(
        shape: tuple[str, int, int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    # ``_simulate`` itself hands the kernel its per-stage flag, durations and link tables
    monkeypatch.setattr(_pipeline_kernel, "_COMPILED", [_pipeline_kernel.replay])
    name, p, m, v = shape
    rng = random.Random(3)
    sched, codes, rank_of, _ = P._indexed(name, p, m, v)
    flat = P._flat(codes, rank_of, sched.num_stages, p)
    per = sched.num_stages if name == "chimera" else p
    times = [(_times(rng, per, 0.5, 3.0), _times(rng, per, 1.0, 6.0))]
    if name == "interleaved-1f1b":  # and per virtual stage
        times.append((_times(rng, sched.num_stages, 0.2, 1.0),
                      _times(rng, sched.num_stages, 0.4, 2.0)))
    for fwd, bwd in times:
        links = _times(rng, p, 0.0, 0.7)
        want = P._simulate(sched, codes, rank_of, fwd, bwd, links, 0.3, None)
        _same(want, P._simulate(sched, codes, rank_of, fwd, bwd, links, 0.3, flat))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}-p{s[1]}-m{s[2]}-v{s[3]}")
def test_compiled_kernel_replays_as_the_python_loop(shape: tuple[str, int, int, int]) -> None:
    _same(*_replay_both(*shape, 7, _compiled_or_skip()))


def test_kernels_report_a_deadlock_as_the_python_loop() -> None:
    # rank 1 runs F1 first, but rank 0 only sends F1 after B0, which needs rank 1's B0
    F, B = ActionKind.F, ActionKind.B
    acts = ((Action(F, 0, 0), Action(B, 0, 0), Action(F, 1, 0), Action(B, 1, 0)),
            (Action(F, 1, 1), Action(F, 0, 1), Action(B, 0, 1), Action(B, 1, 1)))
    sched = PipelineSchedule("hand", 2, 2, 2, acts)
    codes, rank_of = sched.index()
    flat = P._flat(codes, tuple(rank_of), 2, 2)
    with pytest.raises(PipelineDeadlockError) as python_loop:
        P._simulate(sched, codes, tuple(rank_of), [1.0, 1.0], [2.0, 2.0], 0, 0, None)
    kernels: list[Callable[..., Any]] = [_pipeline_kernel.replay]
    if (jit := _pipeline_kernel.kernel()) is not None:
        kernels.append(jit)  # without numba the plain kernel alone
    for run in kernels:
        with pytest.raises(PipelineDeadlockError) as arrays:
            P._replay_compiled(run, sched, flat, False, [1.0, 1.0], [2.0, 2.0], [0, 0, 0],
                               [0, 0, 0])
        assert str(arrays.value) == str(python_loop.value)
        assert "rank 0 at step 1 (0B0)" in str(arrays.value)


def test_simulate_named_takes_the_array_path_for_large_float_schedules(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    jit = _compiled_or_skip()

    def counting(*args: Any) -> int:
        calls.append(1)
        return jit(*args)

    monkeypatch.setattr(_pipeline_kernel, "_COMPILED", [counting])  # loaded already
    big = (24, 96)  # 2 * 96 * 24 actions, above MIN_ACTIONS
    assert 2 * big[0] * big[1] >= _pipeline_kernel.MIN_ACTIONS
    fwd, bwd = [1.5] * big[0], [3.25] * big[0]
    fast = P.simulate_named("1f1b", *big, 1, fwd, bwd, p2p_fwd_ms=0.1, p2p_bwd_ms=0.1)
    assert calls == [1]
    # exact inputs (ints) keep the Python loop and its exact arithmetic
    exact = P.simulate_named("1f1b", *big, 1, [3] * big[0], [6] * big[0])
    assert calls == [1] and isinstance(exact.iteration_ms, int)
    # a small schedule keeps the Python loop
    P.simulate_named("1f1b", 4, 8, 1, [1.5] * 4, [3.0] * 4)
    assert calls == [1]
    sched, codes, rank_of, flat = P._indexed("1f1b", *big, 1)
    assert flat is not None
    _same(fast, P._simulate(sched, codes, rank_of, fwd, bwd, 0.1, 0.1, None))


def test_the_kernel_is_loaded_once_the_python_loop_has_replayed_enough(
        monkeypatch: pytest.MonkeyPatch) -> None:
    jit = _compiled_or_skip()
    monkeypatch.setattr(_pipeline_kernel, "_COMPILED", [])
    monkeypatch.setattr(_pipeline_kernel, "_PYTHON_ACTIONS", [0])
    monkeypatch.setattr(_pipeline_kernel, "JIT_AFTER_ACTIONS", 10_000)
    assert _pipeline_kernel.kernel_for(6_000) is None  # 6,000 replayed in Python
    assert _pipeline_kernel.kernel_for(6_000) is None  # 12,000: the next one loads it
    assert _pipeline_kernel.kernel_for(6_000) is not None
    assert _pipeline_kernel._PYTHON_ACTIONS == [12_000]
    assert _pipeline_kernel.kernel_for(5_000) is not None  # loaded: used from now on
    assert _pipeline_kernel._COMPILED[0] is not None and _pipeline_kernel._COMPILED[0] is not jit


def test_warm_up_compiles_the_kernel() -> None:
    _compiled_or_skip()
    assert _pipeline_kernel.warm_up() is True


def test_a_kernel_that_fails_to_compile_leaves_the_python_loop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    numba = pytest.importorskip("numba")

    def broken_njit(**_: Any) -> Callable[[Any], Any]:
        def wrap(fn: Any) -> Any:
            def first_call(*args: Any) -> int:
                raise RuntimeError("numba: cannot compile")  # as a typing error would
            return first_call
        return wrap

    monkeypatch.setattr(numba, "njit", broken_njit)
    monkeypatch.setattr(_pipeline_kernel, "_COMPILED", [])
    assert _pipeline_kernel.kernel() is None
    assert _pipeline_kernel.warm_up() is False
    # the search's entry point then replays in Python, with the same result
    monkeypatch.setattr(_pipeline_kernel, "_PYTHON_ACTIONS", [10**9])
    res = P.simulate_named("1f1b", 24, 96, 1, [1.5] * 24, [3.25] * 24)
    sched, codes, rank_of, _ = P._indexed("1f1b", 24, 96, 1)
    _same(res, P._simulate(sched, codes, rank_of, [1.5] * 24, [3.25] * 24, 0, 0, None))


def test_hetplan_jit_0_leaves_the_python_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HETPLAN_JIT", "0")
    monkeypatch.setattr(_pipeline_kernel, "_COMPILED", [])
    assert _pipeline_kernel.kernel() is None
