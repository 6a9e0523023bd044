"""Pipelines with tied embedding / LM head and interleaved data-parallel pipelines, from
compiled plans (gloo, CPU): after k steps the loss of every step and every parameter equal a
single-process float64 reference (rtol 1e-9, atol 1e-11).

The tied weight lives on the first and on the last stage; the runtime sums the two copies'
gradients between them (Megatron's embedding group). Without that sum the copies drift apart
and the check fails (checked by removing it: the second step's loss already differs). The
models run in eval mode: dropout's random masks cannot be drawn by a split model as one
process draws them. The cases of one world size train one after another in one process group
(``reflib.train_plans``).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from reflib import case_results, train_plans, zoo_plan, zoo_reference
from typer.testing import CliRunner

from hetplan.cli import app
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import CastSync, CommStep, CompressedSync, SyncStrategy
from hetplan.profiling._spawn import run_local_ranks

pytestmark = pytest.mark.dist

STEPS = 2
BATCH = 8
SEQ = 16
TOL = {"rtol": 1e-9, "atol": 1e-11}

#: label -> (zoo model, world size, the plan's pinned choices)
CASES: dict[str, tuple[str, int, dict[str, Any]]] = {
    "tied-lm-pp2": ("tied-lm", 2, {"dp": 1, "pp": 2, "tp": 1, "micro_batch_size": 4}),
    "tiny-gpt2-pp2": ("tiny-gpt2", 2, {"dp": 1, "pp": 2, "tp": 1, "micro_batch_size": 4}),
    "tied-lm-dp2xpp2-interleaved": ("tied-lm", 4, {
        "dp": 2, "pp": 2, "tp": 1, "micro_batch_size": 2, "schedule": "interleaved-1f1b",
        "virtual_stages": 2}),
    # the same, with a stage's buckets launched as soon as its last backward ends (as on NCCL)
    "tied-lm-dp2xpp2-interleaved-early": ("tied-lm", 4, {
        "dp": 2, "pp": 2, "tp": 1, "micro_batch_size": 2, "schedule": "interleaved-1f1b",
        "virtual_stages": 2}),
    # four stages: the middle ranks hold no copy of the tied weight (but join its groups)
    "tied-lm-pp4": ("tied-lm", 4, {"dp": 1, "pp": 4, "tp": 1, "micro_batch_size": 2}),
    # ZeRO-3: the tied copies' gradients are DTensor shards, summed shard by shard
    "tied-lm-dp2xpp2-zero3": ("tied-lm", 4, {
        "dp": 2, "pp": 2, "tp": 1, "micro_batch_size": 2, "zero_stage": 3}),
    # bf16 compute with fp32 master weights and ZeRO-1 inside each data-parallel group, with
    # and without the early launch: the launch's timing must not change what is summed
    "tied-lm-dp2xpp2-interleaved-bf16-zero1": ("tied-lm", 4, {
        "dp": 2, "pp": 2, "tp": 1, "micro_batch_size": 2, "schedule": "interleaved-1f1b",
        "virtual_stages": 2, "dtype": "bf16", "zero_stage": 1}),
    "tied-lm-dp2xpp2-interleaved-bf16-zero1-early": ("tied-lm", 4, {
        "dp": 2, "pp": 2, "tp": 1, "micro_batch_size": 2, "schedule": "interleaved-1f1b",
        "virtual_stages": 2, "dtype": "bf16", "zero_stage": 1}),
    # Hugging Face GPT-2's embedding stage makes the attention mask every block reads: with
    # more than two stages (or interleaved) it is relayed through the stages in between
    "tiny-gpt2-pp4": ("tiny-gpt2", 4, {"dp": 1, "pp": 4, "tp": 1, "micro_batch_size": 2,
                                       "schedule": "gpipe"}),
    "tiny-gpt2-pp2-interleaved": ("tiny-gpt2", 2, {
        "dp": 1, "pp": 2, "tp": 1, "micro_batch_size": 2, "schedule": "interleaved-1f1b",
        "virtual_stages": 2}),
    # Hugging Face GPT-2 in bf16: its traced stage asserted the dtype it was traced in
    "tiny-gpt2-pp2-bf16": ("tiny-gpt2", 2, {"dp": 1, "pp": 2, "tp": 1, "micro_batch_size": 4,
                                            "dtype": "bf16"}),
}
#: cases whose plan syncs the tied weight's first-stage copy (the plan's ``embed.weight``
#: bucket) lossily, label -> that bucket's strategy; the last stage's copy (``head.weight``,
#: which the plan does not list) syncs in fp32. Each copy is synced, then the copies summed.
LOSSY_TIED: dict[str, SyncStrategy] = {
    "tied-lm-dp2xpp2-topk-embed": CompressedSync(
        compressor="topk", params={"ratio": 0.1}, error_feedback=True,
        steps=(CommStep(level="flat", routine="allgather", compressed=True),)),
    "tied-lm-dp2xpp2-interleaved-bf16-wire-embed-early": CastSync(dtype="bf16"),
}
CASES.update({
    "tied-lm-dp2xpp2-topk-embed": ("tied-lm", 4, {
        "dp": 2, "pp": 2, "tp": 1, "micro_batch_size": 2}),
    "tied-lm-dp2xpp2-interleaved-bf16-wire-embed-early": ("tied-lm", 4, {
        "dp": 2, "pp": 2, "tp": 1, "micro_batch_size": 2, "schedule": "interleaved-1f1b",
        "virtual_stages": 2}),
})
#: the cases held to the float64 reference at rtol 1e-9 (fp32 compute, fp32 sync)
EXACT = [k for k, (_, _, pins) in CASES.items()
         if pins.get("dtype", "fp32") == "fp32" and k not in LOSSY_TIED]


def _plan(name: str, world: int, **pins: Any) -> Plan:
    return zoo_plan(name, world, BATCH, **pins)


def _lossy_embed(plan: Plan, strategy: SyncStrategy) -> Plan:
    """``plan`` with the bucket holding ``embed.weight`` synced by ``strategy``."""
    gs = plan.gradient_sync
    assert gs is not None and any("embed.weight" in b.tensors for b in gs.buckets)
    buckets = tuple(b.model_copy(update={"strategy": "lossy"}) if "embed.weight" in b.tensors
                    else b for b in gs.buckets)
    sync = gs.model_copy(update={"strategies": {**gs.strategies, "lossy": strategy},
                                 "buckets": buckets})
    return Plan.model_validate(plan.model_copy(update={"gradient_sync": sync}).model_dump())


@pytest.fixture(scope="module")
def results() -> dict[int, list[dict[str, Any]]]:
    """world size -> every rank's results of that size's cases, run one after another in one
    process group."""
    out = {}
    for world in sorted({w for _, w, _ in CASES.values()}):
        cases = {}
        for label, (name, w, pins) in CASES.items():
            if w == world:
                plan = _plan(name, world, **pins)
                assert plan.layout is not None and plan.layout.pp == pins["pp"]
                if label in LOSSY_TIED:
                    plan = _lossy_embed(plan, LOSSY_TIED[label])
                cases[label] = (name, BATCH, SEQ, STEPS, plan.to_json())
        out[world] = run_local_ranks(_train_counting_early_launches, world, (cases,),
                                     timeout_s=600, threads_per_process=1)
    return out


def _train_counting_early_launches(rank: int, world: int, cases: dict[str, Any]
                                   ) -> dict[str, dict[str, Any]]:
    """:func:`reflib.train_plans`, case by case, counting the gradient buckets each rank
    launched while its pipeline step still ran (``GradSync.launch_final``, called when a
    stage's last backward has ended) and those holding a tied parameter. A case whose label
    ends in ``-early`` runs as on NCCL, where the runtime launches them (gloo groups do not:
    ``grad_sync.overlaps_compute``)."""
    from hetplan.runtime.grad_sync import GradSync
    from hetplan.runtime.handlers import grad_sync as handler

    launch_final, overlaps = GradSync.launch_final, handler.overlaps_compute
    out: dict[str, dict[str, Any]] = {}
    for label, case in cases.items():
        early = {"buckets": 0, "tied": 0}

        def counting(self: GradSync, final: Any, early: dict[str, int] = early) -> int:
            before = {id(b) for b in self.buckets if b.work is None}
            n = launch_final(self, final)
            for b in self.buckets:
                if id(b) in before and b.work is not None:
                    early["buckets"] += 1
                    early["tied"] += any(x in ("embed.weight", "head.weight") for x in b.names)
            return n

        GradSync.launch_final = counting  # type: ignore[method-assign]
        if label.endswith("-early"):
            handler.overlaps_compute = lambda group: True
        try:
            got = train_plans(rank, world, {label: case})
        finally:
            GradSync.launch_final = launch_final  # type: ignore[method-assign]
            handler.overlaps_compute = overlaps
        if "error" not in got[label]:
            got[label]["early launches"] = early
        out.update(got)
    return out


def _check(got: list[dict], name: str) -> None:
    losses, ref = zoo_reference(name, BATCH, SEQ, STEPS)
    # one last-stage rank per data-parallel replica reports its rows' mean loss
    last = [g["losses"] for g in got if all(x == x for x in g["losses"])]
    assert last, "some rank holds the last stage and reports the loss"
    mean = [sum(col) / len(last) for col in zip(*last, strict=True)]
    assert mean == pytest.approx(losses, rel=1e-9)
    seen: set[str] = set()
    for g in got:
        for n, value in g["params"].items():
            if n in ref:
                torch.testing.assert_close(value, ref[n], **TOL)
                seen.add(n)
    assert seen >= set(ref), f"unchecked: {sorted(set(ref) - seen)}"


@pytest.mark.parametrize("label", EXACT)
def test_tied_pipeline_equals_reference(results: dict[int, list[dict[str, Any]]],
                                        label: str) -> None:
    name, world, _ = CASES[label]
    _check(case_results(results[world], label), name)


def test_cli_plans_and_runs_tiny_gpt2_with_two_stages(tmp_path: Path) -> None:
    """``hetplan plan tiny-gpt2 --pp 2`` then ``hetplan run``: GPT-2's tied ``wte`` /
    ``lm_head`` end up on the first and the last stage, and the run trains (it was refused).
    The planner's own choice on 4 CPU ranks is dp 2 x pp 2 without ZeRO (checked: ZeRO-1's
    all-gather after the step makes it slower there; ZeRO-1 with the tied weights runs in
    ``test_runtime_parallel.py``'s dp2xpp2 case); the report's final loss is the last
    stage's, not rank 0's NaN."""
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "hetplan.cli", *args], capture_output=True,
                              text=True, timeout=600, check=False)

    plan_file, report = tmp_path / "plan.json", tmp_path / "report.json"
    # in-process: planning needs no fresh interpreter (`hetplan run` below starts one)
    planned = CliRunner().invoke(app, ["plan", "tiny-gpt2", "--pp", "2", "-b", "8",
                                       "--cluster", "local-cpu", "-o", str(plan_file)])
    assert planned.exit_code == 0, planned.output[-3000:]
    plan = Plan.from_json(plan_file.read_text())
    assert plan.layout is not None and plan.layout.pp == 2
    assert (plan.layout.dp, plan.layout.zero_stage) == (2, 0)
    assert "transformer.wte" in plan.stages[0].layer_names
    assert "lm_head" in plan.stages[-1].layer_names
    proc = cli("run", str(plan_file), "--model", "tiny-gpt2", "--steps", "2", "--report",
               str(report))
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(report.read_text())
    assert data["steps"] == 2 and data["world_size"] == plan.layout.num_ranks
    assert math.isfinite(data["final_loss"])
    assert data["final_loss"] == pytest.approx(data["loss_per_step"][-1], abs=1e-6)


def test_data_parallel_buckets_launch_as_each_stage_finishes(
        results: dict[int, list[dict[str, Any]]]) -> None:
    """Where collectives overlap compute (NCCL; forced here on gloo) each rank of the dp 2 x
    pp 2 interleaved pipeline starts syncing a stage's buckets when that stage's last
    backward has ended, inside the schedule, the tied embedding's and head's too (their
    copies are summed after the sync). The parameters still equal the reference
    (:func:`test_tied_pipeline_equals_reference`, the ``-early`` case). On gloo, where the
    sync takes the cores the stages compute on, nothing launches early."""
    early = [g["early launches"] for g in
             case_results(results[4], "tied-lm-dp2xpp2-interleaved-early")]
    assert all(e["buckets"] > 0 for e in early), early
    # the tied copies are summed after the sync, so their buckets launch early too
    assert any(e["tied"] > 0 for e in early), early
    plain = [g["early launches"] for g in case_results(results[4], "tied-lm-dp2xpp2-interleaved")]
    assert all(e["buckets"] == 0 for e in plain), plain


def test_early_launch_with_bf16_and_zero1_sums_what_the_late_launch_sums(
        results: dict[int, list[dict[str, Any]]]) -> None:
    """bf16 compute with fp32 master weights and ZeRO-1 in each data-parallel group, dp 2 x
    pp 2 interleaved with the tied head: with the buckets launched as each stage finishes
    (forced, as on NCCL) every rank launches some early, and ends with the same losses and
    parameters as the same plan launched after the schedule (the same sums of the same
    gradients; rtol 1e-6). Both track the float64 reference to bf16's precision (rel 1e-2
    on the losses, as the bf16 pipeline cases of ``test_runtime_pp_strategies.py``)."""
    label = "tied-lm-dp2xpp2-interleaved-bf16-zero1"
    late, early = case_results(results[4], label), case_results(results[4], label + "-early")
    assert all(g["early launches"]["buckets"] > 0 for g in early), early
    assert all(g["early launches"]["buckets"] == 0 for g in late), late
    for a, b in zip(late, early, strict=True):
        assert b["losses"] == pytest.approx(a["losses"], rel=1e-6, nan_ok=True)
        assert a["params"].keys() == b["params"].keys()
        for n, value in a["params"].items():
            torch.testing.assert_close(b["params"][n], value, rtol=1e-6, atol=1e-8)
    ref_losses, _ = zoo_reference("tied-lm", BATCH, SEQ, STEPS)
    last = [g["losses"] for g in early if all(x == x for x in g["losses"])]
    assert last, "some rank holds the last stage and reports the loss"
    mean = [sum(col) / len(last) for col in zip(*last, strict=True)]
    assert mean == pytest.approx(ref_losses, rel=1e-2)


@pytest.mark.parametrize("label", [k for k in CASES if k not in EXACT])
def test_mixed_precision_pipeline_tracks_the_reference(
        results: dict[int, list[dict[str, Any]]], label: str) -> None:
    """bf16 pipelines train: every loss within bf16's precision of the float64 reference
    (rel 1e-2, as the bf16 pipeline cases of ``test_runtime_pp_strategies.py``) and every
    parameter finite."""
    name, world, _ = CASES[label]
    got = case_results(results[world], label)
    ref_losses, _ = zoo_reference(name, BATCH, SEQ, STEPS)
    last = [g["losses"] for g in got if all(x == x for x in g["losses"])]
    assert last, "some rank holds the last stage and reports the loss"
    mean = [sum(col) / len(last) for col in zip(*last, strict=True)]
    assert mean == pytest.approx(ref_losses, rel=1e-2)
    for g in got:
        assert all(bool(torch.isfinite(v).all()) for v in g["params"].values())


@pytest.mark.parametrize("label", sorted(LOSSY_TIED))
def test_tied_copies_stay_equal_when_one_copy_syncs_lossily(
        results: dict[int, list[dict[str, Any]]], label: str) -> None:
    """dp 2 x pp 2 with the plan's ``embed.weight`` bucket compressed (top-k with error
    feedback) or cast to a bf16 wire, while the last stage's copy (``head.weight``) syncs in
    fp32: after the steps every copy on every rank is the same tensor bit for bit (each copy
    is synced, then the copies summed; summed before the sync they drifted apart by 1e-5 to
    1e-3). The losses track the float64 reference to the compressor's precision (rel 2e-2)."""
    name, world, _ = CASES[label]
    got = case_results(results[world], label)
    copies = [g["params"][n] for g in got for n in ("embed.weight", "head.weight")
              if n in g["params"]]
    assert len(copies) == 4, [sorted(g["params"]) for g in got]
    for c in copies[1:]:
        assert torch.equal(c, copies[0]), (c - copies[0]).abs().max()
    ref_losses, _ = zoo_reference(name, BATCH, SEQ, STEPS)
    last = [g["losses"] for g in got if all(x == x for x in g["losses"])]
    assert last, "some rank holds the last stage and reports the loss"
    mean = [sum(col) / len(last) for col in zip(*last, strict=True)]
    assert mean == pytest.approx(ref_losses, rel=2e-2)
