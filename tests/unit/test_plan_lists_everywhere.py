"""Every command that predicts a plan prices the plan's own ``pipeline_actions``
(docs/decisions/bad-input-round9.md, "Every command prices the plan's own lists").

* ``explain`` re-evaluates the plan, and every alternative (all keep the plan's layout), over
  the plan's lists, so its current time is ``simulate``'s; lists of another pipeline shape
  are never replayed (an alternative that changed the layout runs its generated lists).
* ``export`` names hand-edited lists among the parts no engine expresses, worth the plan's
  prediction with them minus the one with the generated lists.
* A plan with per-stage degrees (``hetero``) is replayed over its lists too, and rule 4
  refuses lists whose transfers the heterogeneous executor would pair with the wrong
  micro-batch; ``export`` refuses such a plan (no engine runs stages of different
  degrees).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hetplan.algorithms.pipeline_schedules import layout_actions
from hetplan.cli import app
from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.evaluate import edited_lists, evaluate
from hetplan.cost_models.hetero import assign_ranks, device_classes
from hetplan.cost_models.predict import plan_costs, simulate
from hetplan.errors import SpecError
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan import Plan
from hetplan.ir.plan_checks import plan_problems
from hetplan.ir.plan_hetero import Hetero, StageShape
from hetplan.ir.plan_sections import (
    ClusterRef,
    GradCost,
    GradientSync,
    LayerCost,
    Layout,
    ModelRef,
    NoSync,
    Stage,
    TensorSync,
    WorkloadSummary,
)
from hetplan.report.explain import explain
from hetplan.report.export import ENGINES, export_plan
from test_pipeline_action_rules import Edit, edited, make_plan


def _valid(plan: Plan, edit: Edit) -> Plan:
    """``plan`` with ``edit`` applied to its lists, through the validator (as read from a
    file)."""
    return Plan.model_validate(json.loads(edited(plan, edit).to_json()))


def reverse_last_backwards(ranks: list[str]) -> None:
    """The last stage runs its backwards in reverse (``1B3 1B2 1B1 1B0``): what the runtime
    runs (only its forwards must stay in micro-batch order), and rank 0's first backward then
    waits for the last one."""
    acts = ranks[-1].split()
    forwards = [a for a in acts if "F" in a]
    backwards = [a for a in acts if "B" in a]
    ranks[-1] = " ".join(forwards + backwards[::-1])


def serial_first(ranks: list[str]) -> None:
    """Pipeline position 0 waits for each backward before its next forward."""
    m = len(ranks[0].split()) // 2
    ranks[0] = " ".join(f"0F{i} 0B{i}" for i in range(m))


@pytest.fixture(scope="module")
def gpipe_pair() -> tuple[Plan, Plan]:
    """A pp=2 gpipe plan and the same plan with its last stage's backwards reversed."""
    plan = make_plan("gpipe", micro_batches=4)
    return plan, _valid(plan, reverse_last_backwards)


# -- explain -----------------------------------------------------------------------------
def test_explain_prices_the_plans_own_lists(gpipe_pair: tuple[Plan, Plan]) -> None:
    plan, changed = gpipe_pair
    ours = explain(changed, "stage:1")
    assert round(ours.current_ms, 6) == simulate(changed).iteration_time_ms
    assert ours.current_ms > explain(plan, "stage:1").current_ms + 100  # 843 vs 603 ms


def test_explains_alternatives_run_the_plans_lists(gpipe_pair: tuple[Plan, Plan]) -> None:
    """Moving a stage boundary keeps the stage and micro-batch numbers the lists are written
    in: the alternative is the edited plan with the boundary moved, as simulate predicts it."""
    _, changed = gpipe_pair
    alt = explain(changed, "stage:1").alternatives[0]
    assert alt.name == "move l1 from stage 0 to stage 1"
    names = ("l0",), ("l1", "l2", "l3")
    moved = tuple(st.model_copy(update={"first_layer": int(ns[0][1:]),
                                        "last_layer": int(ns[-1][1:]), "layer_names": ns})
                  for st, ns in zip(changed.stages, names))
    plan = Plan.model_validate(json.loads(changed.model_copy(
        update={"stages": moved}).to_json()))
    assert alt.iteration_time_ms == round(simulate(plan).iteration_time_ms, 6)


def test_lists_of_another_pipeline_shape_are_not_replayed(
        gpipe_pair: tuple[Plan, Plan]) -> None:
    """An alternative whose layout no longer fits the plan's lists (here 8 micro-batches, or
    1F1B) runs the lists its own schedule generates, never the plan's decoded as another
    pipeline."""
    _, changed = gpipe_pair
    workload, layout, costs = plan_costs(changed)
    acts = changed.pipeline_actions
    assert edited_lists(layout, acts) is not None
    for update in ({"micro_batches": 8, "global_batch_size": 16}, {"schedule": "1f1b"}):
        other = layout.model_copy(update=update)
        assert edited_lists(other, acts) is None
        with_lists = evaluate(workload, other, changed.stages, None, costs, actions=acts)
        generated = evaluate(workload, other, changed.stages, None, costs)
        assert with_lists.iteration_s == generated.iteration_s


# -- export ------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ENGINES)
def test_export_names_edited_lists_with_their_worth(gpipe_pair: tuple[Plan, Plan],
                                                    engine: str) -> None:
    plan, changed = gpipe_pair
    result = export_plan(changed, engine)
    assert result.plan_ms == simulate(changed).iteration_time_ms
    gap = {g.part: g for g in result.gaps}["edited-action-lists"]
    assert gap.plan_does.startswith("edited pipeline action lists: pipeline rank(s) [1]")
    assert gap.iteration_time_ms == simulate(plan).iteration_time_ms  # the generated lists
    assert gap.delta_ms == round(simulate(plan).iteration_time_ms - result.plan_ms, 6)
    assert gap.delta_ms is not None and gap.delta_ms < -100
    assert "edited pipeline action lists" in result.text
    # unedited lists: no such part, the same bytes as a plan priced over generated lists
    same = export_plan(plan, engine)
    bare = export_plan(plan.model_copy(update={"pipeline_actions": None}), engine)
    assert "edited-action-lists" not in {g.part for g in same.gaps}
    assert (same.content, same.text) == (bare.content, bare.text)


# -- per-stage degrees -------------------------------------------------------------------
def _node(name: str, kind: str) -> dict[str, object]:
    return {"name": name, "count": 2, "devices": [{"type": kind, "count": 1}],
            "cpu_cores": 16, "intra_link": {"kind": "nvlink", "bandwidth_gbps": 1200.0,
                                            "latency_us": 2.0}}


def toy_hetero_plan(param_bytes: int = 4096, gradient_sync: bool = False) -> Plan:
    """V100 dp2 on layers 0-1, then A100 dp2 on layers 2-3 (4 single-GPU nodes), 1F1B over
    4 micro-batches of 4, with its generated lists; ``param_bytes`` per layer; with
    ``gradient_sync`` every gradient synced fp32 on its stage's DP group's timeline."""
    spec = ClusterSpec.from_dict({
        "name": "mixed", "nodes": [_node("a", "A100-80GB"), _node("v", "V100-SXM2-32GB")],
        "inter_node": {"kind": "ethernet", "bandwidth_gbps": 10.0, "latency_us": 25.0}})
    classes = device_classes(CostModel(spec))
    index = {c.type: k for k, c in enumerate(classes)}
    order = [("V100-SXM2-32GB", 0), ("A100-80GB", 2)]
    ranks = assign_ranks(classes, [(index[t], 2, 1) for t, _ in order])
    stages = tuple(Stage(index=k, first_layer=a, last_layer=a + 1,
                         layer_names=(f"l{a}", f"l{a + 1}"), ranks=r)
                   for k, ((_, a), r) in enumerate(zip(order, ranks)))
    hetero = Hetero(stages=tuple(
        StageShape(stage=k, device_class=classes[index[t]].name, dp=2, tp=1,
                   micro_batch_size=2, zero_stage=0) for k, (t, _) in enumerate(order)))
    layout = Layout(dp=1, pp=2, tp=1, micro_batches=4, micro_batch_size=4,
                    global_batch_size=16, schedule="1f1b")
    layers = tuple(LayerCost(name=f"l{i}", fwd_flops=10**12, bwd_flops=2 * 10**12,
                             param_bytes=param_bytes, act_out_bytes=1 << 20,
                             act_saved_bytes=1 << 20) for i in range(4))
    grads = tuple(GradCost(name=f"l{i}.weight", size_bytes=param_bytes, layer_index=i)
                  for i in reversed(range(4)))
    sync = GradientSync(strategies={"fp32": NoSync()}, tensors=tuple(
        TensorSync(name=g.name, strategy="fp32") for g in grads)) if gradient_sync else None
    workload = WorkloadSummary(layers=layers, grads=grads, batch_size=1)
    return Plan(model=ModelRef(name="toy", fingerprint="f00d", num_params=param_bytes,
                               workload=workload),
                cluster=ClusterRef.from_cluster(spec), layout=layout, stages=stages,
                gradient_sync=sync, pipeline_actions=layout_actions(layout), hetero=hetero)


@pytest.fixture(scope="module")
def hetero_plan() -> Plan:
    return toy_hetero_plan()


def test_per_stage_degrees_replay_the_plans_own_lists(hetero_plan: Plan) -> None:
    """simulate and explain (stage:K) price the executor's lists; the first stage's ranks
    hold one micro-batch at a time when their list is serial (two in 1F1B); unedited lists
    predict what the plan without lists does."""
    base = simulate(hetero_plan)
    assert base == simulate(hetero_plan.model_copy(update={"pipeline_actions": None}))
    serial = _valid(hetero_plan, serial_first)
    slow = simulate(serial)
    assert slow.iteration_time_ms > base.iteration_time_ms * 1.2, (slow, base)
    assert round(explain(serial, "stage:0").current_ms, 6) == slow.iteration_time_ms
    first = hetero_plan.stages[0].ranks
    assert all(slow.memory_per_rank_bytes[r] < base.memory_per_rank_bytes[r] for r in first)


def test_per_stage_degrees_refuse_transfers_posted_out_of_order(hetero_plan: Plan) -> None:
    """Position 0 sends micro-batches 0..3, position 1 receives them 3..0: the lists finish,
    but NCCL would pair micro-batch 0's rows with 3's (same shapes, no error)."""
    def reverse_last(ranks: list[str]) -> None:
        ranks[0] = " ".join([f"0F{i}" for i in range(4)] + [f"0B{i}" for i in range(4)])
        ranks[1] = " ".join(f"1F{i} 1B{i}" for i in reversed(range(4)))

    found = plan_problems(edited(hetero_plan, reverse_last), complete=True)
    assert len(found) == 1 and found[0].startswith(
        "pipeline_actions.ranks[1]: rank 0 sends activations to rank 1 for (micro-batch, "
        "stage) [(0, 1), (1, 1), (2, 1), (3, 1)] but rank 1 receives them in the order "
        "[(3, 1), (2, 1), (1, 1), (0, 1)]"), found
    assert "order rank 1's receives as the sender sends, or re-run `hetplan plan`" in found[0]
    assert plan_problems(_valid(hetero_plan, serial_first), complete=True) == []


def test_export_refuses_per_stage_degrees(hetero_plan: Plan, tmp_path: Path) -> None:
    """No engine runs stages of different dp x tp: export refuses the plan, naming the file,
    the field and the fix (``timeline`` and ``inspect --trace`` draw it:
    tests/unit/test_hetero_timeline.py)."""
    path = tmp_path / "plan.json"
    hetero_plan.save(path)
    result = CliRunner().invoke(app, ["export", str(path), "--to", "megatron"])
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert f"{path}: hetero: the plan gives each stage its own devices and dp x tp" in text
    assert "`hetplan plan ... --hetero off`" in text
    with pytest.raises(SpecError, match="hetero: the plan gives each stage"):
        export_plan(hetero_plan, "megatron")
