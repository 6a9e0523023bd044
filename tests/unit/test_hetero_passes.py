"""DynPipe re-balancing and the ZERO/SEMI controller on heterogeneous plans (issue 25, item 3):
a dynamic model re-balanced between stages that keep their device class and degrees, the
controller per stage TP group, the validator's per-stage rules, byte-identical plans.

Every time compared here is a prediction of the project's simulator, not a measurement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetplan.algorithms.dynamics import BalancePolicy
from hetplan.algorithms.hetero_rebalance import StagePhase, replay_stages
from hetplan.algorithms.pipeline_schedules import layout_actions
from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.hetero import assign_ranks, device_classes, evaluate_hetero
from hetplan.errors import PassError, SpecError
from hetplan.ir.cluster import DEVICE_CATALOGUE, ClusterSpec
from hetplan.ir.plan import Plan
from hetplan.ir.plan_hetero import Hetero, StageShape
from hetplan.ir.plan_sections import (
    ClusterRef,
    CostSettings,
    Layout,
    ModelRef,
    Stage,
    TensorParallel,
    TPGroup,
    WorkloadSummary,
)
from hetplan.ir.rebalancing import DynamicsSpec
from hetplan.optimizer.hetero import compile_hetero
from hetplan.passes._hetero_dynpipe import phase_setup
from hetplan.passes._hetero_sync import run_hetero_passes
from hetplan.passes.ddp_buckets import DDPBuckets
from hetplan.passes.dynpipe import DynPipe
from hetplan.passes.tp_resizing import TPResizing

FIXTURES = Path(__file__).parents[1] / "fixtures" / "clusters"
EXIT = {"total_iterations": 1000,
        "early_exit": [{"iteration": 100, "after_layer": 1, "fraction": 0.75}]}
PRUNE = {"total_iterations": 1000, "pruning": {"final_sparsity": 0.9, "start_iteration": 100,
                                               "frequency": 100, "steps": 3}}


def _node(name: str, devices: list[dict[str, object]], count: int = 1) -> dict[str, object]:
    return {"name": name, "count": count, "devices": devices, "cpu_cores": 16,
            "intra_link": {"kind": "nvlink", "bandwidth_gbps": 1200.0, "latency_us": 2.0}}


@pytest.fixture(scope="module")
def workload() -> WorkloadSummary:
    from hetplan import zoo
    from hetplan.ir.capture import capture

    args, kwargs = zoo.example_inputs("gpt-test", batch=1)
    ir = capture(zoo.build("gpt-test"), args, kwargs, name="gpt-test")
    return WorkloadSummary.from_model_ir(ir)  # 8 layers


@pytest.fixture(scope="module")
def costs() -> CostModel:
    """Two single-A100 and two single-V100 nodes on 100 Gbit/s."""
    spec = ClusterSpec.from_dict({
        "name": "mixed-fast",
        "nodes": [_node("a", [{"type": "A100-80GB", "count": 1}], 2),
                  _node("v", [{"type": "V100-SXM2-32GB", "count": 1}], 2)],
        "inter_node": {"kind": "infiniband", "bandwidth_gbps": 100.0, "latency_us": 5.0}})
    return CostModel(spec, dtype="mixed")


def _plan(workload: WorkloadSummary, costs: CostModel,
          shapes: list[tuple[str, int, int, int, int]], micro_batch: int = 32,
          micro_batches: int = 8) -> Plan:
    """A plan of stages ``(device type, first layer, last layer, dp, tp)`` in order."""
    classes = device_classes(costs)
    index = {c.type: k for k, c in enumerate(classes)}
    ranks = assign_ranks(classes, [(index[t], dp, tp) for t, _, _, dp, tp in shapes])
    names = [x.name for x in workload.layers]
    stages = tuple(Stage(index=k, first_layer=a, last_layer=b,
                         layer_names=tuple(names[a:b + 1]), ranks=r)
                   for k, ((_, a, b, _, _), r) in enumerate(zip(shapes, ranks)))
    hetero = Hetero(stages=tuple(
        StageShape(stage=k, device_class=classes[index[t]].name, dp=dp, tp=tp,
                   micro_batch_size=micro_batch // dp, zero_stage=1 if dp > 1 else 0)
        for k, (t, _, _, dp, tp) in enumerate(shapes)))
    layout = Layout(dp=1, pp=len(shapes), tp=1, micro_batches=micro_batches,
                    micro_batch_size=micro_batch, global_batch_size=micro_batch * micro_batches,
                    schedule="1f1b")
    return Plan(model=ModelRef(name="gpt-test", fingerprint="test", num_params=1,
                               workload=workload),
                cluster=ClusterRef.from_cluster(costs.cluster), layout=layout, stages=stages,
                pipeline_actions=layout_actions(layout), hetero=hetero)


def _two_stage(workload: WorkloadSummary, costs: CostModel) -> Plan:
    return _plan(workload, costs, [("V100-SXM2-32GB", 0, 3, 2, 1), ("A100-80GB", 4, 7, 2, 1)])


# -- DynPipe on a heterogeneous plan ---------------------------------------------------------
def test_replay_moves_layers_where_a_hand_computation_says() -> None:
    """Six layers; stage 1's devices take twice stage 0's time on every layer. Dense: the
    best split is 4 | 2 (loads 4 and 4). From iteration 100, 75 % of the tokens leave after
    layer 1, so layers 2..5 cost a quarter: 4 | 2 loads 2.5 and 1, while 2 | 4 loads 2 and
    2, the best split (3 | 3: 2.25 and 1.5). The pipeline model here is the largest load."""
    dense = ((1.0,) * 6, (2.0,) * 6)
    exit_ = tuple(tuple(c * f for c, f in zip(row, (1, 1, .25, .25, .25, .25)))
                  for row in dense)
    phases = [StagePhase(0, "start", dense, (1.0,) * 6, (0.0,) * 6),
              StagePhase(100, "early exit", exit_, (1.0,) * 6, (0.0,) * 6)]
    tables = {0: dense, 1: exit_}

    def model(k: int, bounds: tuple[tuple[int, int], ...]) -> float:
        return max(sum(tables[k][s][i:j + 1]) for s, (i, j) in enumerate(bounds))

    run = replay_stages(phases, 200, BalancePolicy(), model, ((0, 3), (4, 5)))
    static = replay_stages(phases, 200, BalancePolicy("static"), model, ((0, 3), (4, 5)))
    (ev,) = run.events
    assert ev.applied and ev.bounds == ((0, 1), (2, 5))
    assert (ev.before_ms, ev.after_ms) == (2.5, 2.0)
    assert [m.layer for m in ev.moves] == [2, 3]
    assert (static.total_ms, run.total_ms) == (4 * 100 + 2.5 * 100, 4 * 100 + 2.0 * 100)


def test_phase_model_is_the_hetero_simulators_pipeline(workload: WorkloadSummary,
                                                       costs: CostModel) -> None:
    """Phase 0 on the plan's stages predicts what evaluate_hetero's 1F1B pipeline does."""
    plan = _two_stage(workload, costs)
    assert plan.layout is not None and plan.hetero is not None
    su = phase_setup(plan, DynamicsSpec.from_dict(EXIT), costs)
    ev = evaluate_hetero(workload, plan.layout, plan.stages, plan.hetero, costs)
    assert su.iteration_ms(0, su.initial) == pytest.approx(ev.pipeline.iteration_ms, rel=1e-9)


@pytest.mark.parametrize("dyn", [EXIT, PRUNE], ids=["early-exit", "pruning"])
def test_rebalanced_stages_beat_the_static_ones(workload: WorkloadSummary, costs: CostModel,
                                                dyn: dict[str, object]) -> None:
    plan = _two_stage(workload, costs)
    spec = DynamicsSpec.from_dict(dyn)
    out = run_hetero_passes(plan, [DynPipe(dynamics=spec)], costs)
    reb = out.rebalancing
    assert reb is not None and reb.speedup_vs_static > 1.0
    su = phase_setup(plan, spec, costs)
    cuts = [c for c in range(1, 8) if workload.layers[c].cuttable_before]
    bounds = su.initial
    for k, ph in enumerate(su.phases[1:], start=1):
        ev = next(e for e in reb.events if e.iteration == ph.start)
        if ev.applied:
            bounds = ev.stages
        static_ms, now_ms = su.iteration_ms(k, su.initial), su.iteration_ms(k, bounds)
        assert now_ms <= static_ms  # (predicted) never slower than the static stages
        # the phase's stages are the best two-stage split under the same model (brute force)
        best = min(su.iteration_ms(k, ((0, c - 1), (c, 7))) for c in cuts)
        assert now_ms == pytest.approx(best, rel=1e-12)
    first = reb.events[0]
    assert first.applied and first.predicted_after_ms < first.predicted_before_ms
    # each event keeps both stages, each on its own devices and degrees
    assert all(len(e.stages) == 2 and not e.released_stages for e in reb.events)
    entry = out.pass_log[-1]
    assert entry.name == "dynpipe" and entry.changed
    assert entry.notes[0].startswith("re-balancing between the stages V100-SXM2-32GB 2x1 | "
                                     "A100-80GB 2x1")
    assert [n.split(" (")[0] for n in entry.notes[1:3]] == [
        "phase 0 from iteration 0", "phase 1 from iteration 100" if dyn is EXIT else
        "phase 1 from iteration 200"]
    Plan.model_validate(out.model_dump())  # the validator takes it


def test_rebalancing_honours_each_stages_memory(workload: WorkloadSummary,
                                                costs: CostModel) -> None:
    plan = _two_stage(workload, costs)
    su = phase_setup(plan, DynamicsSpec.from_dict(EXIT), costs)
    reb = run_hetero_passes(plan, [DynPipe(dynamics=DynamicsSpec.from_dict(EXIT))],
                            costs).rebalancing
    assert reb is not None
    for ev in reb.events:
        for s, (i, j) in enumerate(ev.stages):
            assert sum(su.mem[s][i:j + 1]) <= su.cap[s]
    # a stage whose capacity holds only its current layers gets none: nothing moves to it
    tight = [sum(su.mem[0][0:4]), *su.cap[1:]]
    run = replay_stages(su.phases, 1000, BalancePolicy(), su.iteration_ms, su.initial,
                        send=su.send, mem=su.mem, mem_cap=tight, cuttable=su.cuttable)
    assert all(e.bounds[0][1] <= 3 for e in run.events)


def test_repack_is_refused_on_a_heterogeneous_plan(workload: WorkloadSummary,
                                                   costs: CostModel) -> None:
    dyn = DynamicsSpec.from_dict({**EXIT, "rebalance": {"repack": True}})
    with pytest.raises(PassError, match="repack"):
        run_hetero_passes(_two_stage(workload, costs), [DynPipe(dynamics=dyn)], costs)


def test_dynpipe_without_dynamics_keeps_the_searched_stages(workload: WorkloadSummary,
                                                            costs: CostModel) -> None:
    plan = _two_stage(workload, costs)
    out = run_hetero_passes(plan, [DynPipe()], costs)
    assert out.stages == plan.stages and out.rebalancing is None
    assert "not run on a heterogeneous plan" in out.pass_log[-1].notes[0]


# -- the ZERO/SEMI controller per stage TP group ---------------------------------------------
def _straggler_costs(slow: bool) -> CostModel:
    """Node ``a``: 2 A100; node ``v``: 2 V100 of which the second is 1.5x slower when
    ``slow`` (a device type of its own with ``slowdown: 1.5``)."""
    v100 = DEVICE_CATALOGUE["V100-SXM2-32GB"].model_dump()
    second = "V100-slow" if slow else "V100-SXM2-32GB"
    spec = ClusterSpec.from_dict({
        "name": "straggler-in-tp",
        "device_types": {"V100-slow": {**v100, "slowdown": 1.5}},
        "nodes": [_node("a", [{"type": "A100-80GB", "count": 2}]),
                  _node("v", [{"type": "V100-SXM2-32GB", "count": 1},
                              {"type": second, "count": 1}])],
        "inter_node": {"kind": "infiniband", "bandwidth_gbps": 100.0, "latency_us": 5.0}})
    return CostModel(spec, dtype="mixed")


def _tp_plan(workload: WorkloadSummary, costs: CostModel) -> Plan:
    """A100 1x2 on ranks 0, 1 (layers 0-3) | V100 1x2 on ranks 2, 3 (layers 4-7)."""
    plan = _plan(workload, _straggler_costs(False),
                 [("A100-80GB", 0, 3, 1, 2), ("V100-SXM2-32GB", 4, 7, 1, 2)], micro_batch=8)
    return plan.model_copy(update={"cluster": ClusterRef.from_cluster(costs.cluster)})


@pytest.mark.parametrize("variant", ["zero", "semi"])
def test_a_straggler_in_one_stages_tp_group_gets_that_stage_an_answer(
        workload: WorkloadSummary, variant: str) -> None:
    costs = _straggler_costs(True)
    plan = _tp_plan(workload, costs)
    assert [s.ranks for s in plan.stages] == [(0, 1), (2, 3)]
    out = run_hetero_passes(plan, [TPResizing(controller=variant)],  # type: ignore[arg-type]
                            costs)
    tp = out.tensor_parallel
    assert tp is not None and tp.controller.variant == variant
    by_stage = {g.stage: g for g in tp.groups}
    assert set(by_stage) == {0, 1}
    assert by_stage[0].ranks == (0, 1) and by_stage[0].roles == ()  # two equal A100s
    roles = {r.rank: r for r in by_stage[1].roles}
    assert roles[3].role == "resize" and 0 < roles[3].gamma <= 0.9
    assert roles[2].role == "normal" and roles[2].gamma == 0
    notes = out.pass_log[-1].notes
    assert notes[0].startswith("stage 0 (A100-80GB 1x2): 1 TP group(s) of identical devices")
    assert notes[1].startswith("stage 1 (V100-SXM2-32GB 1x2): straggler(s) rank 3 gamma")
    Plan.model_validate(out.model_dump())


def test_without_the_straggler_no_stage_gets_roles(workload: WorkloadSummary) -> None:
    costs = _straggler_costs(False)
    out = run_hetero_passes(_tp_plan(workload, costs), [TPResizing(controller="zero")], costs)
    assert out.tensor_parallel is not None
    assert all(g.roles == () for g in out.tensor_parallel.groups)
    assert all("no straggler" in n for n in out.pass_log[-1].notes)


def test_controller_off_writes_no_section_but_names_the_straggler(
        workload: WorkloadSummary) -> None:
    costs = _straggler_costs(True)
    out = run_hetero_passes(_tp_plan(workload, costs), [TPResizing()], costs)
    assert out.tensor_parallel is None
    assert "rank 3 gamma" in out.pass_log[-1].notes[1]
    assert "controller off" in out.pass_log[-1].notes[1]


# -- the validator ----------------------------------------------------------------------------
def test_validator_rejects_broken_per_stage_sections(workload: WorkloadSummary,
                                                     costs: CostModel) -> None:
    plan = run_hetero_passes(_two_stage(workload, costs),
                             [DynPipe(dynamics=DynamicsSpec.from_dict(EXIT))], costs)
    reb = plan.rebalancing
    assert reb is not None
    data = plan.model_dump()
    one = reb.events[0].model_copy(update={"stages": ((0, 7),), "migrations": ()})
    for bad, match in [(one, r"events\[0\].stages: 1 layer range"),
                       (reb.events[0].model_copy(update={"released_stages": (1,)}),
                        "released_stages")]:
        broken = reb.model_copy(update={"events": (bad,)})
        with pytest.raises(ValueError, match=match):
            Plan.model_validate({**data, "rebalancing": broken.model_dump()})
    stragglers = _straggler_costs(True)
    tp_plan = run_hetero_passes(_tp_plan(workload, stragglers),
                                [TPResizing(controller="zero")], stragglers)
    section = tp_plan.tensor_parallel
    assert section is not None
    tp_data = tp_plan.model_dump()
    for groups, match in [
            ((TPGroup(ranks=(1, 2), stage=1),), r"groups\[0\].ranks: \[1, 2\] is not a TP group"),
            ((TPGroup(ranks=(0, 1)),), r"groups\[0\].stage: None"),
            ((TPGroup(ranks=(2, 3), stage=0),), "is not a TP group of stage 0")]:
        broken_tp = TensorParallel(controller=section.controller, groups=groups)
        with pytest.raises(ValueError, match=match):
            Plan.model_validate({**tp_data, "tensor_parallel": broken_tp.model_dump()})
    tp1 = TensorParallel(groups=(TPGroup(ranks=plan.stages[0].ranks[:1], stage=0),))
    with pytest.raises(SpecError, match="runs tp=1"):
        Plan.from_json(plan.model_copy(update={"tensor_parallel": tp1}).to_json())


# -- the whole path: compile_hetero with the passes -------------------------------------------
def test_compiled_plan_with_dynpipe_and_controller_is_byte_identical(
        workload: WorkloadSummary) -> None:
    """The search's plan on cpu-hetero-3 (batch 3: ``cpu@fast 1x1 | cpu@slow 1x2``, the
    plan the 3-rank runtime test trains) with DynPipe on a pruned model and the ZERO
    controller: both sections per stage, byte-identical twice."""
    spec = ClusterSpec.load(FIXTURES / "cpu-hetero-3.yaml")
    costs = CostModel(spec, dtype="fp32")
    passes = (DynPipe(dynamics=DynamicsSpec.from_dict(PRUNE)), DDPBuckets(),
              TPResizing(controller="zero"))

    def compiled() -> Plan:
        return compile_hetero(workload, costs, 3,
                              model_ref=ModelRef(name="gpt-test", fingerprint="test",
                                                 num_params=1, workload=workload),
                              cluster_ref=ClusterRef.from_cluster(costs.cluster),
                              # the controller keeps the vocabulary whole (as priced)
                              cost_settings=CostSettings(dtype="fp32", vocab_parallel="whole"),
                              passes=passes)

    a, b = compiled(), compiled()
    assert a.to_json() == b.to_json()
    assert a.hetero is not None and a.hetero.describe() == "cpu@fast 1x1 | cpu@slow 1x2"
    assert [e.name for e in a.pass_log][:4] == ["hetero-search", "dynpipe", "ddp-buckets",
                                                "tp-resizing"]
    assert a.rebalancing is not None and a.rebalancing.events
    assert all(len(e.stages) == 2 for e in a.rebalancing.events)
    tp = a.tensor_parallel
    assert tp is not None and tp.controller.variant == "zero"
    assert [(g.stage, g.ranks, g.roles) for g in tp.groups] == [(1, a.stages[1].ranks, ())]


# -- the CLI ------------------------------------------------------------------------------------
def test_cli_plan_inspect_explain_show_the_per_stage_entries(tmp_path: Path) -> None:
    """`hetplan plan --hetero on --dynamics F --tp-controller zero` on cpu-hetero-3 (the
    searched ``cpu@fast 1x1 | cpu@slow 1x2``), then `inspect` and `explain stage:1`."""
    from typer.testing import CliRunner

    from hetplan.cli import app
    from hetplan.ir.plan import load_plan

    runner = CliRunner()
    dyn = tmp_path / "pruning.json"
    dyn.write_text(json.dumps(PRUNE))
    out = tmp_path / "plan.json"
    res = runner.invoke(app, ["plan", "gpt-test", "--cluster",
                              str(FIXTURES / "cpu-hetero-3.yaml"), "--batch-size", "3",
                              "--dtype", "fp32", "--hetero", "on", "--dynamics", str(dyn),
                              "--tp-controller", "zero", "-o", str(out)])
    assert res.exit_code == 0, res.output
    plan = load_plan(out)
    assert plan.hetero is not None and plan.hetero.describe() == "cpu@fast 1x1 | cpu@slow 1x2"
    assert plan.rebalancing is not None and plan.tensor_parallel is not None
    res = runner.invoke(app, ["inspect", str(out)])
    assert res.exit_code == 0, res.output
    assert "re-balancing: partition by time" in res.output
    assert "cpu@fast 1x1: 0–" in res.output and "| cpu@slow 1x2: " in res.output
    assert "resizing controller zero" in res.output
    res = runner.invoke(app, ["explain", str(out), "stage:1"])
    assert res.exit_code == 0, res.output
    assert "TP controller     zero in 1 TP group(s); no straggler expected" in res.output
    assert "re-balancing      layers " in res.output


# -- the strategy dimensions per stage (recompute, ZeRO, precision) ------------------------------
def test_recompute_and_precision_are_chosen_per_stage() -> None:
    """GPT-2 on 2 A100s and 2 V100s cut to 4 GiB each (the last stage also
    holds the loss's fp32 logits), global micro-batch 8: the searched
    plan is ``A100 2x1 | V100 2x1``; the first stage, holding two micro-batches' activations
    under 1F1B, recomputes (``full``: without it the plan does not fit) while the second
    does not; each stage computes in its device type's dtype (bf16 / fp16) and shards its
    optimizer state over its own replicas (ZeRO-1). The ZeRO stage per stage is also chosen
    against ZeRO-0 with compressors (test_hetero_compose.py::
    test_compile_hetero_with_passes_is_byte_identical_and_chooses_zero_per_stage)."""
    from hetplan import zoo
    from hetplan.errors import InfeasiblePlanError
    from hetplan.ir.capture import capture

    args, kwargs = zoo.example_inputs("gpt2", batch=1)
    wl = WorkloadSummary.from_model_ir(capture(zoo.build("gpt2"), args, kwargs, name="gpt2"))
    small = {name: {**DEVICE_CATALOGUE[base].model_dump(), "memory_gib": 4.0}
             for name, base in (("A100-4GB", "A100-80GB"), ("V100-4GB", "V100-SXM2-32GB"))}
    spec = ClusterSpec.from_dict({
        "name": "tight", "device_types": small,
        "nodes": [_node("a", [{"type": "A100-4GB", "count": 1}], 2),
                  _node("v", [{"type": "V100-4GB", "count": 1}], 2)],
        "inter_node": {"kind": "infiniband", "bandwidth_gbps": 100.0, "latency_us": 5.0}})
    costs = CostModel(spec, dtype="mixed")
    plan = compile_hetero(wl, costs, 64, micro_batch=8,
                          model_ref=ModelRef(name="gpt2", fingerprint="test", num_params=1,
                                             workload=wl),
                          cluster_ref=ClusterRef.from_cluster(costs.cluster),
                          cost_settings=CostSettings(dtype="mixed"))
    assert plan.hetero is not None and plan.layout is not None
    assert plan.hetero.describe() == "A100-4GB 2x1 | V100-4GB 2x1"
    assert [st.recompute for st in plan.stages] == ["full", "none"]
    assert [s.zero_stage for s in plan.hetero.stages] == [1, 1]
    assert plan.precision is not None
    assert [plan.precision.devices[t].compute_dtype for t in ("A100-4GB", "V100-4GB")] == [
        "bf16", "fp16"]
    # the first stage's recomputation is needed: without it the plan does not fit
    bare = tuple(st.model_copy(update={"recompute": "none"}) for st in plan.stages)
    with pytest.raises(InfeasiblePlanError):
        evaluate_hetero(wl, plan.layout, bare, plan.hetero, costs)
    # the last stage holds the loss: fp32 logits and log-softmax output, 8 bytes per logit of
    # its 4 samples (micro-batch 8 over dp 2) x 1024 tokens x 50257, one micro-batch in flight
    ev = evaluate_hetero(wl, plan.layout, plan.stages, plan.hetero, costs)
    last = ev.memory[plan.stages[-1].ranks[0]]
    assert last.activations >= 8 * 4 * 1024 * 50257
