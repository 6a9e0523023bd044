"""Chimera plans run (gloo, CPU): two model replicas in opposite directions, from compiled
plans; after k steps every parameter and the loss of every step equal a single-process float64
reference (rtol 1e-9), as for the other schedules (``test_runtime_pp_tied.py``).

What each case would catch: ``pp2`` the two directions on two ranks (each rank holds both
stages, the tied embedding and head twice: the split's copies summed locally); ``pp4`` the
middle ranks (stages 1 and 2) and sends in both directions between the same ranks; ``dp2 x
pp2`` the sync group of both directions and both data replicas (the loss divided by the
micro-batches of one direction); ``tiny-gpt2`` the attention mask relayed through a stage in
both directions; the bf16 / ZeRO-1 case the sharded optimizer over the four-rank sync group.
Without the ``M / 2`` loss scale or with the sync over one direction only, the parameters
differ after the first step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from reflib import case_results, train_plans, zoo_model, zoo_plan, zoo_reference

from hetplan.errors import SpecError
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import Bucket, CastSync, GradientSync
from hetplan.passes.espresso import strategy_for
from hetplan.profiling._spawn import run_local_ranks
from hetplan.runtime.composition import refusals

pytestmark = pytest.mark.dist

STEPS = 2
BATCH = 8
SEQ = 16
TOL = {"rtol": 1e-9, "atol": 1e-11}

CHIMERA = {"tp": 1, "schedule": "chimera"}
#: label -> (zoo model, world size, the plan's pinned choices)
CASES: dict[str, tuple[str, int, dict[str, Any]]] = {
    "tied-lm-pp2": ("tied-lm", 2, {"dp": 1, "pp": 2, "micro_batch_size": 2, **CHIMERA}),
    "tiny-gpt2-pp2": ("tiny-gpt2", 2, {"dp": 1, "pp": 2, "micro_batch_size": 2, **CHIMERA}),
    "tied-lm-pp4": ("tied-lm", 4, {"dp": 1, "pp": 4, "micro_batch_size": 2, **CHIMERA}),
    "tied-lm-dp2xpp2": ("tied-lm", 4, {"dp": 2, "pp": 2, "micro_batch_size": 2, **CHIMERA}),
    # ZeRO-1 in fp32: the optimizer sharded over the four ranks of both directions, exactly
    "tied-lm-dp2xpp2-zero1": ("tied-lm", 4, {"dp": 2, "pp": 2, "micro_batch_size": 2,
                                             "zero_stage": 1, **CHIMERA}),
    "tied-lm-dp2xpp2-full-recompute": ("tied-lm", 4, {
        "dp": 2, "pp": 2, "micro_batch_size": 2, "recompute": "full", **CHIMERA}),
    "tied-lm-dp2xpp2-bf16-zero1": ("tied-lm", 4, {
        "dp": 2, "pp": 2, "micro_batch_size": 2, "dtype": "bf16", "zero_stage": 1, **CHIMERA}),
}
#: label -> (base case, the gradient-sync strategy of all the plan's buckets): the plan's
#: paths on the Chimera group: a bf16 wire (the fast path), top-k on the worker thread
SYNCS: dict[str, tuple[str, Any]] = {
    "tied-lm-dp2xpp2-cast-bf16": ("tied-lm-dp2xpp2", CastSync(dtype="bf16")),
    "tied-lm-dp2xpp2-topk": ("tied-lm-dp2xpp2", strategy_for(("topk", 5), ratio=0.5)),
}
EXACT = [k for k, (_, _, pins) in CASES.items() if pins.get("dtype", "fp32") == "fp32"]


def _plan(name: str, world: int, **pins: Any) -> Plan:
    return zoo_plan(name, world, BATCH, **pins)


@pytest.fixture(scope="module")
def results() -> dict[int, list[dict[str, Any]]]:
    out = {}
    for world in sorted({w for _, w, _ in CASES.values()}):
        cases = {}
        for label, (name, w, pins) in CASES.items():
            if w == world:
                plan = _plan(name, world, **pins)
                assert plan.layout is not None and plan.layout.schedule == "chimera"
                assert refusals(plan) == [], refusals(plan)
                cases[label] = (name, BATCH, SEQ, STEPS, plan.to_json())
        for label, (base, strategy) in SYNCS.items():
            name, w, pins = CASES[base]
            if w == world:
                plan = _with_sync(_plan(name, world, **pins), strategy)
                assert refusals(plan) == [], refusals(plan)
                cases[label] = (name, BATCH, SEQ, STEPS, plan.to_json())
        out[world] = run_local_ranks(train_plans, world, (cases,), timeout_s=600,
                                     threads_per_process=1)
    return out


def _with_sync(plan: Plan, strategy: Any) -> Plan:
    """``plan`` with its buckets (one per stage or more) synced by ``strategy``."""
    assert plan.gradient_sync is not None and plan.gradient_sync.buckets
    buckets = tuple(Bucket(tensors=b.tensors, size_bytes=b.size_bytes, strategy="s")
                    for b in plan.gradient_sync.buckets)
    sync = GradientSync(strategies={"s": strategy}, buckets=buckets)
    return plan.model_copy(update={"gradient_sync": sync, "predictions": None})


def _losses(got: list[dict[str, Any]]) -> list[float]:
    last = [g["losses"] for g in got if all(x == x for x in g["losses"])]
    assert last, "some rank holds the last stage and reports the loss"
    return [sum(col) / len(last) for col in zip(*last, strict=True)]


@pytest.mark.parametrize("label", EXACT)
def test_chimera_equals_reference(results: dict[int, list[dict[str, Any]]], label: str) -> None:
    name, world, _ = CASES[label]
    got = case_results(results[world], label)
    losses, ref = zoo_reference(name, BATCH, SEQ, STEPS)
    assert _losses(got) == pytest.approx(losses, rel=1e-9)
    alias = _aliases(name)
    seen: set[str] = set()
    for g in got:
        for n, value in g["params"].items():
            if n in ref:
                torch.testing.assert_close(value, ref[n], **TOL)
                seen |= alias[n]  # a tied parameter is trained once, under one of its names
    assert seen >= set(ref), f"unchecked: {sorted(set(ref) - seen)}"


def _aliases(name: str) -> dict[str, set[str]]:
    """Each parameter name of the zoo model -> every name of the same tensor."""
    by_id: dict[int, set[str]] = {}
    for n, p in zoo_model(name).named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), set()).add(n)
    return {n: names for names in by_id.values() for n in names}


def test_a_tied_weight_is_one_parameter_on_each_rank(
        results: dict[int, list[dict[str, Any]]]) -> None:
    """The split gives each stage a copy of the tied embedding / head; a Chimera rank holds
    both stages and trains one parameter under one name (with two, the plan's gradient sync
    would sync the copy it does not list with another strategy, and they would drift)."""
    tied = {n for n, names in _aliases("tied-lm").items() if len(names) > 1}
    assert len(tied) == 2
    for label in ("tied-lm-pp2", "tied-lm-dp2xpp2-topk"):
        world = CASES[label][1] if label in CASES else CASES[SYNCS[label][0]][1]
        for g in case_results(results[world], label):
            assert len(tied & set(g["params"])) == 1, sorted(tied & set(g["params"]))


def test_both_ends_of_each_replica_report_its_loss(
        results: dict[int, list[dict[str, Any]]]) -> None:
    """Pipeline ranks 0 and P-1 each hold the last stage of one direction; both report the
    replica's loss (the pair's sum), the middle ranks NaN."""
    got = case_results(results[4], "tied-lm-pp4")
    finite = [all(x == x for x in g["losses"]) for g in got]
    assert finite == [True, False, False, True]
    assert got[0]["losses"] == pytest.approx(got[3]["losses"], rel=1e-12)


def test_mixed_precision_zero1_tracks_the_reference(
        results: dict[int, list[dict[str, Any]]]) -> None:
    """bf16 compute, fp32 masters sharded over the sync group of both directions: the losses
    within bf16's precision of the reference, every parameter finite."""
    label = "tied-lm-dp2xpp2-bf16-zero1"
    got = case_results(results[4], label)
    ref_losses, _ = zoo_reference("tied-lm", BATCH, SEQ, STEPS)
    assert _losses(got) == pytest.approx(ref_losses, rel=1e-2)
    for g in got:
        assert all(bool(torch.isfinite(v).all()) for v in g["params"].values())


def test_refused_compositions_name_the_fix() -> None:
    """What the Chimera executor does not run is refused before any rank starts, naming the
    part and the fix."""
    plan = _plan("tied-lm", 4, dp=2, pp=2, micro_batch_size=2, **CHIMERA)
    assert plan.layout is not None
    bad = plan.model_copy(update={"layout": plan.layout.model_copy(update={"zero_stage": 3})})
    lines = refusals(bad)
    assert any("'chimera' with ZeRO-3" in x and "--schedule 1f1b" in x for x in lines), lines


def test_lists_of_another_shape_are_refused() -> None:
    """The Chimera executor's groups and loss scale assume Chimera's lists: every micro-batch
    down (stage s on rank s) or up (on rank P-1-s), half each way. The generated lists pass;
    1F1B's (all down) and an odd split are refused by name."""
    from hetplan.algorithms.pipeline_schedules import chimera_schedule, one_f_one_b_schedule
    from hetplan.runtime.handlers.chimera import check_chimera_shape

    for p, m in ((2, 2), (2, 6), (4, 4), (4, 8), (6, 12)):
        check_chimera_shape(chimera_schedule(p, m))
    with pytest.raises(SpecError, match="0 of 4 micro-batches go down|4 of 4 micro-batches"):
        check_chimera_shape(one_f_one_b_schedule(2, 4))


def test_transfer_order_is_checked() -> None:
    """Lists whose two ends of a transfer post in different orders are refused (NCCL would
    pair the wrong micro-batches); the generated Chimera lists pass."""
    from hetplan.algorithms.pipeline_schedules import Action, ActionKind, PipelineSchedule
    from hetplan.algorithms.pipeline_schedules import chimera_schedule
    from hetplan.runtime.handlers.chimera import check_transfer_order

    for p, m in ((2, 2), (2, 4), (4, 4), (4, 8), (6, 12)):
        check_transfer_order(chimera_schedule(p, m))
    f, b = ActionKind.F, ActionKind.B
    swapped = PipelineSchedule("gpipe", 2, 2, 2, (
        (Action(f, 0, 0), Action(f, 1, 0), Action(b, 0, 0), Action(b, 1, 0)),
        (Action(f, 1, 1), Action(f, 0, 1), Action(b, 0, 1), Action(b, 1, 1))))
    with pytest.raises(SpecError, match="rank 0 sends activations to rank 1"):
        check_transfer_order(swapped)


@pytest.mark.parametrize("label", list(SYNCS))
def test_gradient_paths_run_on_the_chimera_group(results: dict[int, list[dict[str, Any]]],
                                                 label: str) -> None:
    """The plan's gradient paths run over the sync group of both directions: a bf16 wire
    (the fast path) and top-k with error feedback (the worker thread). Every rank holding a
    parameter ends with the same value (the four copies of each stage were averaged alike),
    and the losses stay near the reference (top-k keeps half of every gradient)."""
    got = case_results(results[4], label)
    ref_losses, _ = zoo_reference("tied-lm", BATCH, SEQ, STEPS)
    assert _losses(got) == pytest.approx(ref_losses, rel=2e-2)
    held: dict[str, list[torch.Tensor]] = {}
    for g in got:
        for n, value in g["params"].items():
            held.setdefault(n, []).append(value)
    assert all(len(v) == 4 for v in held.values()), {n: len(v) for n, v in held.items()}
    for n, copies in held.items():
        for c in copies[1:]:
            torch.testing.assert_close(c, copies[0], rtol=0, atol=0, msg=n)
