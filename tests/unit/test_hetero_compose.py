"""Heterogeneous plans compose with the gradient-sync passes: Espresso and Cupcake run per
stage on each stage's own data-parallel group, the plan's sync is priced by the per-bucket DP
timeline, passes that cannot apply say why, and the validator refuses sections that disagree
with the stages."""

from __future__ import annotations

import pytest

from hetplan.algorithms.pipeline_schedules import layout_actions
from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.evaluate import evaluate
from hetplan.cost_models.hetero import (
    assign_ranks,
    device_classes,
    evaluate_hetero,
    stage_projection,
    stage_sync_section,
)
from hetplan.cost_models.memory import capture_bytes
from hetplan.cost_models.predict import simulate
from hetplan.cost_models.precision import state_precision
from hetplan.errors import SpecError
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan import Plan
from hetplan.ir.plan_hetero import Hetero, StageShape
from hetplan.ir.plan_sections import (
    Bucket,
    ClusterRef,
    CostSettings,
    GradientSync,
    Layout,
    ModelRef,
    NoSync,
    Stage,
    TensorParallel,
    TPGroup,
    WorkloadSummary,
)
from hetplan.optimizer.hetero import compile_hetero
from hetplan.passes._hetero_sync import REASONS, run_hetero_passes
from hetplan.passes.base import Pass
from hetplan.passes.cupcake import CupcakeFusion
from hetplan.passes.ddp_buckets import DDPBuckets
from hetplan.passes.dynpipe import DynPipe
from hetplan.passes.espresso import Espresso
from hetplan.passes.even_tp import EvenTP
from hetplan.passes.tp_resizing import TPResizing


def _node(name: str, kind: str, count: int, per_node: int) -> dict[str, object]:
    return {"name": name, "count": count, "devices": [{"type": kind, "count": per_node}],
            "cpu_cores": 16, "intra_link": {"kind": "nvlink", "bandwidth_gbps": 1200.0,
                                            "latency_us": 2.0}}


@pytest.fixture(scope="module")
def costs() -> CostModel:
    """Two single-GPU A100 nodes and two single-GPU V100 nodes on a slow (1 Gbit/s)
    network: every stage's data-parallel group crosses it, so compression can pay."""
    spec = ClusterSpec.from_dict({
        "name": "mixed-slow", "nodes": [_node("a", "A100-80GB", 2, 1),
                                        _node("v", "V100-SXM2-32GB", 2, 1)],
        "inter_node": {"kind": "ethernet", "bandwidth_gbps": 1.0, "latency_us": 25.0}})
    return CostModel(spec, dtype="mixed")


@pytest.fixture(scope="module")
def workload() -> WorkloadSummary:
    from hetplan import zoo
    from hetplan.ir.capture import capture

    args, kwargs = zoo.example_inputs("gpt-test", batch=1)
    ir = capture(zoo.build("gpt-test"), args, kwargs, name="gpt-test")
    return WorkloadSummary.from_model_ir(ir)  # 8 layers


def _plan(workload: WorkloadSummary, costs: CostModel, zero: int = 1) -> Plan:
    """V100 2x1 on layers 0-3, then A100 2x1 on layers 4-7, 4 micro-batches of 4, each
    stage at ZeRO ``zero``."""
    classes = device_classes(costs)
    index = {c.type: k for k, c in enumerate(classes)}
    order = [("V100-SXM2-32GB", 0, 3), ("A100-80GB", 4, 7)]
    ranks = assign_ranks(classes, [(index[t], 2, 1) for t, _, _ in order])
    names = [x.name for x in workload.layers]
    stages = tuple(Stage(index=k, first_layer=a, last_layer=b,
                         layer_names=tuple(names[a:b + 1]), ranks=r)
                   for k, ((_, a, b), r) in enumerate(zip(order, ranks)))
    hetero = Hetero(stages=tuple(
        StageShape(stage=k, device_class=classes[index[t]].name, dp=2, tp=1,
                   micro_batch_size=2, zero_stage=zero)  # type: ignore[arg-type]
        for k, (t, _, _) in enumerate(order)))
    layout = Layout(dp=1, pp=2, tp=1, micro_batches=4, micro_batch_size=4,
                    global_batch_size=16, schedule="1f1b")
    return Plan(model=ModelRef(name="gpt-test", fingerprint="test", num_params=1,
                               workload=workload),
                cluster=ClusterRef.from_cluster(costs.cluster), layout=layout, stages=stages,
                pipeline_actions=layout_actions(layout), hetero=hetero)


def _predict_s(plan: Plan, costs: CostModel) -> float:
    assert plan.layout is not None and plan.hetero is not None
    assert plan.model.workload is not None
    return evaluate_hetero(plan.model.workload, plan.layout, plan.stages, plan.hetero, costs,
                           gradient_sync=plan.gradient_sync).iteration_s


def _stage_of(plan: Plan) -> dict[str, int]:
    wl = plan.model.workload
    assert wl is not None
    layer_stage = {i: st.index for st in plan.stages
                   for i in range(st.first_layer, st.last_layer + 1)}
    return {g.name: layer_stage[g.layer_index] for g in wl.grads}


def test_sync_is_priced_by_each_stages_dp_timeline(workload: WorkloadSummary,
                                                    costs: CostModel) -> None:
    plan = run_hetero_passes(_plan(workload, costs), [DDPBuckets()], costs)
    assert plan.gradient_sync is not None and plan.hetero is not None and plan.layout
    ev = evaluate_hetero(workload, plan.layout, plan.stages, plan.hetero, costs,
                         gradient_sync=plan.gradient_sync)
    ring = evaluate_hetero(workload, plan.layout, plan.stages, plan.hetero, costs)
    assert ev.iteration_s != ring.iteration_s  # the timeline, not the closed-form ring
    for st, shape, busy in zip(plan.stages, plan.hetero.stages, ev.sync_s):
        # the same number as a homogeneous plan of the stage alone: evaluate() on its DP group
        proj = stage_projection(workload, plan.layout, st, shape)
        part = stage_sync_section(plan.gradient_sync, [g.name for g in proj.workload.grads])
        alone = evaluate(proj.workload, proj.layout, (proj.stage,), part, costs,
                         check_memory=False)
        assert busy == alone.stages[0].sync_busy_s > 0
        assert proj.layout.dp == 2 and set(proj.stage.ranks) == set(st.ranks)


@pytest.mark.parametrize("zero", [0, 1])
def test_espresso_per_stage_is_never_slower(workload: WorkloadSummary, costs: CostModel,
                                            zero: int) -> None:
    base = run_hetero_passes(_plan(workload, costs, zero), [DDPBuckets()], costs)
    esp = run_hetero_passes(_plan(workload, costs, zero),
                            [DDPBuckets(), Espresso(compressors=("dgc", "fp16"))], costs)
    assert esp.gradient_sync is not None
    assert _predict_s(esp, costs) <= _predict_s(base, costs)
    entry = next(e for e in esp.pass_log if e.name == "espresso")
    assert [n.split(":")[0] for n in entry.notes] == ["stage 0 (V100-SXM2-32GB 2x1)",
                                                      "stage 1 (A100-80GB 2x1)"]


def test_espresso_gives_each_stage_its_own_compressed_choices(workload: WorkloadSummary,
                                                              costs: CostModel) -> None:
    """Without ZeRO (whose all-gather of the updated weights a compressed sync pays on top)
    and on a 1 Gbit/s network, both stages compress and the plan is predicted faster."""
    base = run_hetero_passes(_plan(workload, costs, 0), [DDPBuckets()], costs)
    esp = run_hetero_passes(_plan(workload, costs, 0),
                            [DDPBuckets(), Espresso(compressors=("dgc", "fp16"))], costs)
    t_base, t_esp = _predict_s(base, costs), _predict_s(esp, costs)
    assert t_esp < 0.9 * t_base, (t_esp, t_base)
    stage = _stage_of(esp)
    sync = esp.gradient_sync
    assert sync is not None
    assert {t.name for t in sync.tensors} == set(stage)
    compressed = {stage[t.name] for t in sync.tensors
                  if sync.strategies[t.strategy].kind == "compressed"}
    assert compressed == {0, 1}


def test_cupcake_per_stage_is_never_slower_and_keeps_buckets_in_their_stage(
        workload: WorkloadSummary, costs: CostModel) -> None:
    base = run_hetero_passes(_plan(workload, costs), [DDPBuckets()], costs)
    fused = run_hetero_passes(_plan(workload, costs), [DDPBuckets(), CupcakeFusion()], costs)
    assert fused.gradient_sync is not None and base.gradient_sync is not None
    assert _predict_s(fused, costs) <= _predict_s(base, costs)
    stage = _stage_of(fused)
    for b in fused.gradient_sync.buckets:
        assert len({stage[t] for t in b.tensors}) == 1
    assert {stage[b.tensors[0]] for b in fused.gradient_sync.buckets} == {0, 1}
    entry = next(e for e in fused.pass_log if e.name == "cupcake-fusion")
    assert len(entry.notes) == 2 and entry.notes[1].startswith("stage 1 (A100-80GB 2x1)")


def test_passes_that_cannot_apply_say_why(workload: WorkloadSummary, costs: CostModel) -> None:
    passes = [DynPipe(), EvenTP(), DDPBuckets(), TPResizing()]
    plan = run_hetero_passes(_plan(workload, costs), passes, costs)
    log = {e.name: e for e in plan.pass_log}
    assert set(log) == {p.name for p in passes}  # none dropped silently
    for name in ("dynpipe", "even-tp"):  # dynpipe re-balances only a dynamic model
        assert not log[name].changed
        assert log[name].notes == (f"not run on a heterogeneous plan: {REASONS[name]}",)
    # tp-resizing runs per stage TP group (tests/unit/test_hetero_passes.py)
    assert log["tp-resizing"].notes == ("every stage has tp=1: no TP group to resize",)
    assert log["ddp-buckets"].changed
    assert plan.tensor_parallel is None and plan.stages == _plan(workload, costs).stages


def test_precision_is_chosen_and_priced_per_stage(workload: WorkloadSummary,
                                                  costs: CostModel) -> None:
    cap = capture_bytes(workload)
    v100 = state_precision(costs.precision, "V100-SXM2-32GB", ("V100-SXM2-32GB",), cap)
    a100 = state_precision(costs.precision, "A100-80GB", ("A100-80GB",), cap)
    assert costs.precision.devices["V100-SXM2-32GB"].compute_dtype == "fp16"  # no bf16
    assert costs.precision.devices["A100-80GB"].compute_dtype == "bf16"
    assert v100.grad_bytes == a100.grad_bytes == 2  # each stage reduces in its 16-bit dtype
    plan = run_hetero_passes(_plan(workload, costs), [DDPBuckets()], costs)
    assert plan.gradient_sync is not None and plan.layout is not None
    # the sync of a stage moves its compute dtype's bytes: forcing fp32 costs more
    fp32 = CostModel(costs.cluster, dtype="fp32")
    assert plan.hetero is not None
    t16 = evaluate_hetero(workload, plan.layout, plan.stages, plan.hetero, costs,
                          gradient_sync=plan.gradient_sync, check_memory=False).sync_s
    t32 = evaluate_hetero(workload, plan.layout, plan.stages, plan.hetero, fp32,
                          gradient_sync=plan.gradient_sync, check_memory=False).sync_s
    assert all(a < b for a, b in zip(t16, t32))


def _mixed_2x2() -> CostModel:
    spec = ClusterSpec.from_dict({
        "name": "mixed-2x2", "nodes": [_node("a", "A100-80GB", 2, 2),
                                       _node("v", "V100-SXM2-32GB", 2, 2)],
        "inter_node": {"kind": "ethernet", "bandwidth_gbps": 10.0, "latency_us": 25.0}})
    return CostModel(spec, dtype="mixed")


def _compiled(workload: WorkloadSummary, costs: CostModel, passes: tuple[Pass, ...]) -> Plan:
    # a batch at which data parallelism pays: at 64 samples the optimizer step's kernel
    # launches, which do not shrink with dp, make two dp=1 stages faster
    return compile_hetero(workload, costs, 1024, micro_batch=256,
                          model_ref=ModelRef(name="gpt-test", fingerprint="test", num_params=1,
                                             workload=workload),
                          cluster_ref=ClusterRef.from_cluster(costs.cluster),
                          cost_settings=CostSettings(dtype="mixed"), passes=passes)


def test_compile_hetero_with_passes_is_byte_identical_and_chooses_zero_per_stage(
        workload: WorkloadSummary) -> None:
    costs = _mixed_2x2()
    passes = (DDPBuckets(), Espresso(compressors=("dgc",)), CupcakeFusion(), TPResizing())
    a, b = _compiled(workload, costs, passes), _compiled(workload, costs, passes)
    assert a.to_json() == b.to_json()
    assert a.hetero is not None and a.predictions is not None
    assert any(s.dp > 1 for s in a.hetero.stages)
    assert [e.name for e in a.pass_log] == ["hetero-search", "ddp-buckets", "espresso",
                                            "cupcake-fusion", "tp-resizing", "hetero-sync"]
    sync_notes = a.pass_log[-1].notes
    assert sync_notes[0].startswith("each stage's gradient sync on its own DP group")
    # every stage with ZeRO-1 from the search was tried at ZeRO-0 for the compressed sync
    tried = [n for n in sync_notes[1:] if "ZeRO-0" in n]
    assert len(tried) == sum(s.dp > 1 for s in a.hetero.stages)
    assert sync_notes[-1].startswith("without compressors")
    assert a.predictions.iteration_time_ms == pytest.approx(_predict_s(a, costs) * 1e3,
                                                            abs=1e-6)
    # `hetplan simulate` re-predicts it from the plan alone, per-stage sync included
    again = simulate(Plan.from_json(a.to_json()), cluster=costs.cluster)
    assert again.iteration_time_ms == a.predictions.iteration_time_ms


def test_each_stages_optimizer_step_is_priced_as_evaluate_prices_its_projection(
        workload: WorkloadSummary, costs: CostModel) -> None:
    """The step of a heterogeneous plan is the slowest stage's, each priced as a
    homogeneous plan of its own (kernel launches included): it was the bytes alone, 0.000
    ms for a small model whose homogeneous plan paid 0.65 ms of launches, which made
    `--hetero auto` compare a plan without its step against one with it."""
    from hetplan.cost_models.ddp import ddp_gradient_sync

    plan = _plan(workload, costs)
    assert plan.layout is not None and plan.hetero is not None
    synced = run_hetero_passes(plan, [DDPBuckets()], costs).gradient_sync
    want = 0.0
    for st, shape in zip(plan.stages, plan.hetero.stages):
        p = stage_projection(workload, plan.layout, st, shape)
        alone = evaluate(p.workload, p.layout, (p.stage,), ddp_gradient_sync(
            p.workload, (p.stage,)), costs, check_memory=False)
        want = max(want, alone.optimizer_s)
    assert want > 1e-4  # launches: far above the bytes of gpt-test's parameters
    for sync in (None, synced):  # the search's closed form and the passes' per-stage sync
        ev = evaluate_hetero(workload, plan.layout, plan.stages, plan.hetero, costs,
                             gradient_sync=sync, check_memory=False)
        assert ev.optimizer_s == want


def test_allowing_compressors_never_predicts_slower(workload: WorkloadSummary) -> None:
    costs = _mixed_2x2()
    plain = _compiled(workload, costs, (DDPBuckets(), Espresso(), CupcakeFusion()))
    comp = _compiled(workload, costs, (DDPBuckets(), Espresso(compressors=("dgc", "fp16")),
                                       CupcakeFusion()))
    assert plain.predictions is not None and comp.predictions is not None
    assert comp.predictions.iteration_time_ms <= plain.predictions.iteration_time_ms


def test_validator_refuses_sections_that_disagree_with_the_stages(
        workload: WorkloadSummary, costs: CostModel) -> None:
    plan = _plan(workload, costs)
    stage = _stage_of(plan)
    first = [n for n, s in stage.items() if s == 0][0]
    second = [n for n, s in stage.items() if s == 1][0]
    mixed = GradientSync(strategies={"fp32": NoSync()}, buckets=(
        Bucket(tensors=(first, second), size_bytes=1, strategy="fp32"),))
    with pytest.raises(ValueError, match="stage"):
        Plan.model_validate({**plan.model_dump(), "gradient_sync": mixed.model_dump()})
    tp = TensorParallel(groups=(TPGroup(ranks=plan.stages[0].ranks, stage=0),))
    with pytest.raises(ValueError, match="tensor_parallel"):
        Plan.model_validate({**plan.model_dump(), "tensor_parallel": tp.model_dump()})
    with pytest.raises(SpecError, match="tensor_parallel"):
        Plan.from_json(plan.model_copy(update={"tensor_parallel": tp}).to_json())
