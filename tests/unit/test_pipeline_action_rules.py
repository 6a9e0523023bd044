"""Rule 4 of the plan's validator against what the runtime's executors assume of a plan's
``pipeline_actions`` lists, and the prediction of a plan over its own lists
(docs/decisions/bad-input-round9.md, "Pipeline action lists").

* Stage ``s`` lives on pipeline rank ``s mod pp`` (Chimera: rank ``r`` holds ``r`` and
  ``pp-1-r``): lists that run it elsewhere were refused by the ranks after launch.
* Chimera's executor needs Chimera's shape (half the micro-batches each way) and both ends of
  a transfer posting in one order.
* torch's schedule runtime reads micro-batch ``m``'s loss at position ``m`` of the losses in
  the order the last stage's forwards ran: those forwards must run in micro-batch order.
* Every list the planner generates passes all of it.
* ``hetplan simulate`` replays a plan's edited lists; unedited lists predict to the bit what
  the generated ones do.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import pytest
from typer.testing import CliRunner

from hetplan.algorithms.pipeline_schedules import (
    build_schedule,
    chimera_shape_problem,
    last_stage_order_problem,
    layout_actions,
    misplaced_stages,
    transfer_order_problem,
)
from hetplan.cli import app
from hetplan.cost_models.predict import simulate
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan import (
    ClusterRef,
    GradCost,
    LayerCost,
    Layout,
    ModelRef,
    Plan,
    Stage,
    WorkloadSummary,
)
from hetplan.ir.plan_checks import plan_problems

Edit = Callable[[list[str]], None]
Schedule = Literal["gpipe", "1f1b", "interleaved-1f1b", "chimera"]


def make_plan(schedule: Schedule = "1f1b", micro_batches: int = 4) -> Plan:
    """A pp=2 x dp=2 plan of a 4-layer toy on the ``cpu-2x2`` preset, with its lists."""
    spec = ClusterSpec.from_preset("cpu-2x2")
    layers = tuple(LayerCost(name=f"l{i}", fwd_flops=10**9, bwd_flops=2 * 10**9, param_bytes=4096)
                   for i in range(4))
    grads = tuple(GradCost(name=f"l{i}.weight", size_bytes=4096, layer_index=i)
                  for i in reversed(range(4)))
    layout = Layout(dp=2, pp=2, tp=1, micro_batches=micro_batches, micro_batch_size=1,
                    global_batch_size=2 * micro_batches, schedule=schedule)
    stages = tuple(Stage(index=s, first_layer=2 * s, last_layer=2 * s + 1,
                         layer_names=(f"l{2 * s}", f"l{2 * s + 1}"),
                         ranks=tuple(sorted(layout.rank_of(d, s, 0) for d in range(2))))
                   for s in range(2))
    return Plan(model=ModelRef(name="toy", fingerprint="f00d", num_params=4096,
                               workload=WorkloadSummary(layers=layers, grads=grads,
                                                        batch_size=1)),
                cluster=ClusterRef.from_cluster(spec), layout=layout, stages=stages,
                pipeline_actions=layout_actions(layout))


def edited(plan: Plan, edit: Edit) -> Plan:
    """``plan`` with ``edit`` applied to its lists, not validated (``model_copy``)."""
    assert plan.pipeline_actions is not None
    ranks = list(plan.pipeline_actions.ranks)
    edit(ranks)
    acts = plan.pipeline_actions.model_copy(update={"ranks": tuple(ranks)})
    return plan.model_copy(update={"pipeline_actions": acts})


def problems(plan: Plan) -> list[str]:
    return plan_problems(plan, complete=True)


def validate_cli(tmp_path: Path, plan: Plan) -> str:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(json.loads(plan.to_json())), encoding="utf-8")
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 2, result.output
    assert "pipeline_actions.ranks" in result.output
    assert "internal error" not in result.output
    return result.output


def swap(ranks: list[str]) -> None:
    ranks[0], ranks[1] = ranks[1], ranks[0]


def split(ranks: list[str]) -> None:
    """Micro-batch 1's stage 1 runs on rank 0 (placed after 0F1, before 0B1)."""
    ranks[0] = ranks[0].replace("0B1", "1F1 1B1 0B1")
    ranks[1] = " ".join(a for a in ranks[1].split() if a not in ("1F1", "1B1"))


def reverse_last(ranks: list[str]) -> None:
    """The last stage runs micro-batches M-1 .. 0 (as /work/hunt/pp8-rev.json); rank 0
    forwards everything first, so the lists can still finish."""
    m = len(ranks[1].split()) // 2
    ranks[0] = " ".join([f"0F{i}" for i in range(m)] + [f"0B{i}" for i in range(m)])
    ranks[1] = " ".join(f"1F{i} 1B{i}" for i in reversed(range(m)))


@pytest.mark.parametrize(("edit", "expected"), [
    (swap, "pipeline_actions.ranks[0]: runs stage(s) [1], but the plan's stages put stage s "
           "on pipeline rank s mod pp=2"),
    (split, "pipeline_actions.ranks[0]: runs stage(s) [1]"),
    (reverse_last, "pipeline_actions.ranks[1]: the last stage (1) runs its forwards for "
                   "micro-batches [3, 2, 1, 0]; torch's schedule runtime"),
])
def test_lists_the_runtime_cannot_run_are_refused(tmp_path: Path, edit: Edit,
                                                   expected: str) -> None:
    plan = edited(make_plan(), edit)
    found = problems(plan)
    assert any(expected in p for p in found), found
    assert all("re-run `hetplan plan`" in p for p in found), found
    assert expected in " ".join(validate_cli(tmp_path, plan).split())


def test_a_chimera_plan_with_1f1b_lists_is_refused(tmp_path: Path) -> None:
    plan = make_plan("chimera")
    ones = build_schedule("1f1b", 2, 4).encode()

    def edit(ranks: list[str]) -> None:
        ranks[:] = list(ones)

    found = problems(edited(plan, edit))
    assert found == ["pipeline_actions.ranks: 4 of 4 micro-batches go down; Chimera sends "
                     "half each way (each direction's loss is divided by M/2); pipeline rank "
                     "r holds stages r (down) and 2-1-r (up): re-run `hetplan plan "
                     "--schedule chimera`"], found
    assert "4 of 4 micro-batches go down" in validate_cli(tmp_path, edited(plan, edit))


def test_a_chimera_transfer_posted_out_of_order_is_refused(tmp_path: Path) -> None:
    """pp=2, M=4: micro-batches 0 and 2 go down, 1 and 3 up. Rank 0 sends the activations
    of 0 then 2, rank 1 runs stage 1 of 2 before 0: the lists finish, but the Chimera
    executor's untagged (NCCL) messages would pair micro-batch 0's activations with 2."""
    def edit(ranks: list[str]) -> None:
        ranks[0] = "0F0 0F2 1F1 1B1 1F3 1B3 0B0 0B2"
        ranks[1] = "0F1 0F3 1F2 1B2 1F0 1B0 0B1 0B3"

    plan = edited(make_plan("chimera", micro_batches=4), edit)
    found = problems(plan)
    assert len(found) == 1 and found[0].startswith(
        "pipeline_actions.ranks[1]: rank 0 sends activations to rank 1 for (micro-batch, "
        "stage) [(0, 1), (2, 1)] but rank 1 receives them in the order [(2, 1), (0, 1)]"), found
    assert "rank 0 sends activations" in validate_cli(tmp_path, plan)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b", "chimera"])
def test_every_generated_list_passes(name: str) -> None:
    for p in (2, 4, 6):
        for m in (p, 2 * p, 3 * p):
            for v in ((2, 3) if name == "interleaved-1f1b" else (1,)):
                sched = build_schedule(name, p, m, v)
                if name == "chimera":
                    assert chimera_shape_problem(sched) == ""
                    assert transfer_order_problem(sched) is None
                else:
                    assert misplaced_stages(sched) == {}
                    assert last_stage_order_problem(sched) is None
                    assert transfer_order_problem(sched) is None


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "chimera"])
def test_every_generated_plan_is_valid(name: Schedule) -> None:
    for m in (2, 4, 6):
        assert plan_problems(make_plan(name, m), complete=True) == []


def test_simulate_replays_the_plans_own_lists() -> None:
    """An order that serialises the pipeline (rank 0 waits for each backward before its next
    forward) predicts a longer iteration; the unedited lists predict what the named
    schedule does, to the bit (a prediction of the plan without its lists)."""
    plan = make_plan("1f1b", micro_batches=4)
    original = simulate(plan)
    bare = simulate(plan.model_copy(update={"pipeline_actions": None}))
    assert original == bare

    def serial(ranks: list[str]) -> None:
        ranks[0] = " ".join(f"0F{m} 0B{m}" for m in range(4))

    slow = simulate(Plan.model_validate(json.loads(edited(plan, serial).to_json())))
    assert slow.iteration_time_ms > original.iteration_time_ms * 1.2, (slow, original)


def test_memory_follows_the_plans_own_lists() -> None:
    """The activations a rank holds at its peak follow the lists it runs: rank 0 of a 1F1B
    pipeline holds 2 micro-batches (pp - stage); run as GPipe (every forward first) it holds
    all 4, run serially (each backward right after its forward) 1. The unedited lists
    predict what the named schedule does."""
    toy = make_plan("1f1b", micro_batches=4)
    assert toy.model.workload is not None
    layers = tuple(x.model_copy(update={"act_saved_bytes": 1 << 20})
                   for x in toy.model.workload.layers)  # 1 MiB saved per micro-batch
    workload = toy.model.workload.model_copy(update={"layers": layers})
    plan = toy.model_copy(update={"model": toy.model.model_copy(update={"workload": workload})})
    base = simulate(plan).memory_per_rank_bytes
    assert base == simulate(plan.model_copy(update={"pipeline_actions": None})
                            ).memory_per_rank_bytes

    def memory(order: str) -> tuple[int, ...]:
        def edit(ranks: list[str]) -> None:
            ranks[0] = order
        changed = Plan.model_validate(json.loads(edited(plan, edit).to_json()))
        return simulate(changed).memory_per_rank_bytes

    first, last = plan.stages[0].ranks, plan.stages[1].ranks
    gpipe = memory(" ".join([f"0F{m}" for m in range(4)] + [f"0B{m}" for m in range(4)]))
    serial = memory(" ".join(f"0F{m} 0B{m}" for m in range(4)))
    assert all(gpipe[r] > base[r] > serial[r] for r in first), (gpipe, base, serial)
    assert all(gpipe[r] == base[r] == serial[r] for r in last)
