"""The runtime executes what the planner chooses: no strategy pair it refuses
(:func:`hetplan.runtime.composition.refusals`) comes out of the layout search or a pass.

Cases from ``bench/planner_runtime_agreement.py``, each a plan the runtime refused before:
ZeRO-1 taken "for free" by the search under re-balancing or a TP resizing controller (which
move or resize whole optimizer state), the same two with ZeRO-1 pinned (the pass declines,
with a note), a hierarchical routing chosen by ``espresso`` under ZeRO-2 (the runtime's
reduce-scatter is flat), and SDPipe group sync chosen by ``sdpipe{mode=auto}`` for a plan that
re-balances.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hetplan.ir.model import ModelIR
from hetplan.ir.plan import Plan, load_plan
from hetplan.optimizer.compile import compile, model_ir
from hetplan.passes import DEFAULT_PIPELINE
from hetplan.runtime.composition import refusals

PRUNING = Path(__file__).resolve().parents[2] / "examples" / "pruning.yaml"


@pytest.fixture(scope="module")
def gpt_test() -> ModelIR:
    return model_ir("gpt-test")


@pytest.fixture(scope="module")
def tiny_gpt2() -> ModelIR:
    return model_ir("tiny-gpt2")


def _notes(plan: Plan, name: str) -> str:
    return " ".join(n for e in plan.pass_log if e.name == name for n in e.notes)


def test_search_keeps_zero_0_to_rebalance(gpt_test: ModelIR) -> None:
    # ZeRO-1 is free in time on one-slow-node's data-parallel link, but a layer moved between
    # stages takes its whole optimizer state, which ZeRO-1 shards
    plan = compile(gpt_test, "one-slow-node", batch_size=64, dynamics=PRUNING)
    assert refusals(plan) == []
    assert plan.layout is not None and plan.layout.dp > 1 and plan.layout.zero_stage == 0
    assert plan.rebalancing is not None and any(e.applied for e in plan.rebalancing.events)


def test_dynpipe_declines_rebalancing_under_zero(gpt_test: ModelIR) -> None:
    plan = compile(gpt_test, "one-slow-node", batch_size=64, dynamics=PRUNING, zero_stage=1)
    assert refusals(plan) == []
    assert plan.rebalancing is not None and not plan.rebalancing.events
    assert "not re-balanced: ZeRO-1" in _notes(plan, "dynpipe")


def test_search_keeps_zero_0_for_the_tp_controller(tiny_gpt2: ModelIR) -> None:
    plan = compile(tiny_gpt2, "mixed-generations", batch_size=64, tp=2,
                   tp_controller="migration")
    assert refusals(plan) == []
    assert plan.layout is not None and plan.layout.dp > 1 and plan.layout.zero_stage == 0
    assert plan.tensor_parallel is not None
    assert plan.tensor_parallel.controller.variant == "migration"


def test_tp_resizing_declines_the_controller_under_zero(tiny_gpt2: ModelIR) -> None:
    plan = compile(tiny_gpt2, "mixed-generations", batch_size=64, tp=2,
                   tp_controller="migration", zero_stage=1)
    assert refusals(plan) == []
    assert plan.tensor_parallel is not None
    assert plan.tensor_parallel.controller.variant == "off"
    assert "controller migration not turned on: ZeRO-1" in _notes(plan, "tp-resizing")


@pytest.mark.parametrize("zero", [2, 3])
def test_espresso_routes_flat_under_zero_2(gpt_test: ModelIR, zero: int) -> None:
    # dp=32 over 4 nodes of 8: a hierarchical routing is predicted fastest (the search chose it)
    plan = compile(gpt_test, "mixed-generations", batch_size=64, dp=32, zero_stage=zero)
    assert refusals(plan) == []
    sync = plan.gradient_sync
    assert sync is not None
    assert {s.hierarchy for s in sync.strategies.values()} == {"flat"}
    assert f"hierarchical routings not searched: ZeRO-{zero}" in _notes(plan, "espresso")


def test_sdpipe_stays_allreduce_when_the_plan_rebalances(gpt_test: ModelIR) -> None:
    # `--group-sync auto --dynamics`: SDPipe is predicted 1.5x faster on mixed-tp-node
    plan = compile(gpt_test, "mixed-tp-node", batch_size=32, dynamics=PRUNING, zero_stage=0,
                   dtype="bf16", passes=DEFAULT_PIPELINE + ",sdpipe{mode=auto}")
    assert refusals(plan) == []
    assert plan.group_sync is not None and plan.group_sync.policy == "allreduce"
    assert "re-balances a dynamic model" in plan.group_sync.reason


def test_espresso_reference_leaves_the_sync_under_zero_2(gpt_test: ModelIR) -> None:
    # the reference rule's paths are hierarchical and compressed: neither runs under ZeRO-2
    passes = "dynpipe,even-tp,ddp-buckets,espresso-reference{compressor=dgc}"
    plan = compile(gpt_test, "mixed-generations", batch_size=64, dp=32, zero_stage=2,
                   passes=passes)
    assert refusals(plan) == []
    assert "ZeRO-2 reduce-scatters gradients flat" in _notes(plan, "espresso-reference")
    at_zero_1 = compile(gpt_test, "mixed-generations", batch_size=64, dp=32, zero_stage=1,
                        passes=passes)
    assert at_zero_1.gradient_sync is not None  # at ZeRO-1 the rule applies
    assert any(s.hierarchy == "hierarchical" for s in at_zero_1.gradient_sync.strategies.values())


def test_hetero_keeps_a_tied_model_on_one_stage(tmp_path: Path) -> None:
    """GPT-2's head is tied to its embedding; the runtime does not sum tied gradients across
    stages of different degrees (it refused such a plan at setup), so the heterogeneous
    search keeps one stage for it: batch 6 on cpu-hetero-3 was `cpu@fast 1x1 | cpu@slow
    2x1` before."""
    plan = load_plan(_hetero_cli_plan(tmp_path, "cpu-hetero-3", 6))
    assert plan.hetero is not None and len(plan.stages) == 1
    assert refusals(plan) == []


def test_hetero_runner_up_of_a_tied_model_is_a_plan_it_could_have_chosen(
        tmp_path: Path) -> None:
    """The runner-up was drawn from every candidate, split ones included: on cpu-mixed-2 it
    was `cpu-fast | cpu-slow` across two stages, predicted faster than the one-stage plan,
    and `explain stage:0` said the plan's order was not the fastest, though the runtime
    refuses that runner-up."""
    from typer.testing import CliRunner

    from hetplan.cli import app

    out = _hetero_cli_plan(tmp_path, "cpu-mixed-2", 8)
    plan = load_plan(out)
    assert plan.hetero is not None and len(plan.stages) == 1
    runner_up = plan.hetero.search.runner_up
    assert runner_up is None or len(runner_up.first_layers) == 1, runner_up
    explained = CliRunner().invoke(app, ["explain", str(out), "stage:0"])
    assert explained.exit_code == 0, explained.output
    assert "not the fastest" not in explained.output, explained.output


@pytest.mark.parametrize(("cluster", "batch", "compress"), [
    ("local-cpu", 8, ()), ("cpu-2x2", 8, ()), ("cpu-2x2", 8, ("dgc", "fp16")),
    ("mixed-generations", 64, ("dgc", "fp16"))])
def test_chimera_plans_are_plans_the_runtime_runs(gpt_test: ModelIR, cluster: str, batch: int,
                                                  compress: tuple[str, ...]) -> None:
    """``--schedule chimera`` with the planner free to choose the rest: the layout, ZeRO and
    gradient paths it picks are ones the Chimera executor runs (tp 1, ZeRO <= 1, flat
    routings: on cpu-2x2 and mixed-generations a hierarchical routing is what Espresso
    would pick for a group spanning nodes)."""
    plan = compile(gpt_test, cluster, batch_size=batch, pp=2, schedule="chimera",
                   compressors=compress)
    assert plan.layout is not None and plan.layout.schedule == "chimera"
    assert refusals(plan) == []


def _hetero_cli_plan(tmp_path: Path, cluster: str, batch: int) -> Path:
    """`hetplan plan tiny-gpt2 --hetero on` on a cluster of tests/fixtures/clusters."""
    from typer.testing import CliRunner

    from hetplan.cli import app

    spec = Path(__file__).resolve().parents[1] / "fixtures" / "clusters" / f"{cluster}.yaml"
    out = tmp_path / "plan.json"
    res = CliRunner().invoke(app, ["plan", "tiny-gpt2", "-c", str(spec), "-b", str(batch),
                                   "--hetero", "on", "-o", str(out)])
    assert res.exit_code == 0, res.output
    return out
