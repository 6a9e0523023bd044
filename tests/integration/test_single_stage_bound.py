"""The single-stage part of the search's lower bound (``optimizer/bounds.py``, part 3):
certain recomputation and ZeRO-2/3 communication of a ``pp = 1`` layout. It never exceeds a
screened prediction, it is tighter than the compute-only bound where memory forces full
recomputation, and pruning with it keeps the plan (all but the search note's counts of
pruned and infeasible layouts).
llama-13b on ``a100-nvlink-8x8`` at batch 512: its one-stage layouts need recomputation."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from hetplan import compile
from hetplan.ir.model import ModelIR
from hetplan.ir.plan import Plan
from hetplan.optimizer import compile as compile_module
from hetplan.optimizer.bounds import iteration_lower_bound, layer_compute_s, single_stage_s
from hetplan.optimizer.compile import _workload

CASE = ("a100-nvlink-8x8", 512)


@pytest.fixture(scope="module")
def llama13b() -> ModelIR:
    return _workload("llama-13b", None, None, None)


@pytest.fixture(scope="module")
def pruned(llama13b: ModelIR) -> dict[str, object]:
    """The plan of the search with the bounds (as it prunes by default), and the job and
    candidate layouts it screened; one search for both tests."""
    seen: dict[str, object] = {}
    real = compile_module._screen

    def spy(job, candidates, infeasible, progress=None):  # type: ignore[no-untyped-def]
        seen["job"], seen["candidates"] = job, list(candidates)
        return real(job, candidates, infeasible, progress)

    compile_module._screen = spy  # type: ignore[assignment]
    try:
        seen["plan"] = compile(llama13b, CASE[0], batch_size=CASE[1], progress=False)
    finally:
        compile_module._screen = real  # type: ignore[assignment]
    return seen


def test_single_stage_bound_is_below_every_prediction_and_bites(
        pruned: dict[str, object]) -> None:
    job, candidates = pruned["job"], pruned["candidates"]
    recompute = compile_module._partitioner_recompute(job.screening)  # type: ignore[attr-defined]
    assert recompute == "auto"
    checked = tighter = 0
    for cand in candidates:  # type: ignore[attr-defined]
        if cand.pp != 1:
            continue
        scored = compile_module._screen_one(job, cand, [])  # type: ignore[arg-type]
        if scored is None:
            continue
        ladder = [z for z in job.zero_ladder(cand)  # type: ignore[attr-defined]
                  if not compile_module._memory_lower_bound(
                      job.workload, replace(cand, zero_stage=z), job.costs)]  # type: ignore[attr-defined]
        bound = iteration_lower_bound(job.workload, job.costs, cand,  # type: ignore[attr-defined]
                                      job.opts.schedule, ladder, recompute=recompute)  # type: ignore[attr-defined]
        assert 0 < bound <= scored[0], (cand.describe(), bound, scored[0])
        t = sum(layer_compute_s(job.workload, job.costs, cand.micro_batch_size, cand.tp))  # type: ignore[attr-defined]
        # the micro-batch floor at the ZeRO stage the screening chose is above compute alone
        z = scored[1].zero_stage
        if single_stage_s(job.workload, job.costs, cand, job.opts.schedule, z,  # type: ignore[attr-defined]
                          recompute) > t * 1.05:
            tighter += 1
        checked += 1
    assert checked >= 10
    assert tighter >= 5, tighter


def test_pruning_with_the_single_stage_bound_keeps_the_plan(
        llama13b: ModelIR, pruned: dict[str, object], monkeypatch: pytest.MonkeyPatch) -> None:
    plan = pruned["plan"]
    assert isinstance(plan, Plan)
    count = re.search(r"(\d+) pruned by lower bounds", plan.pass_log[0].notes[0])
    assert count is not None and int(count.group(1)) > 0
    monkeypatch.setattr(compile_module, "bounds_apply", lambda *a: False)
    full = compile(llama13b, CASE[0], batch_size=CASE[1], progress=False)
    # the search note counts what it screened: layouts pruned unscreened are not counted
    # among the infeasible ones either
    def strip(text: str) -> str:
        text = re.sub(r"\d+ pruned by lower bounds, ", "", text)
        return re.sub(r"\d+ infeasible, ", "", text)

    assert strip(plan.to_json()) == strip(full.to_json())
