"""The one plan validator (hetplan.ir.plan_checks): one test per rule, each on a plan that is
valid except for the one thing the test breaks, read the way every command reads a plan file
(``load_plan``). Each refusal must name the file and the field path.

The plan is built by hand (no torch): 4 layers on ``cpu-2x2`` (2 nodes x 2 devices) with
dp=1 pp=2 tp=2, its pipeline actions, one TP group per stage, and one bucket per stage.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from hetplan.algorithms.pipeline_schedules import layout_actions
from hetplan.cli import app
from hetplan.errors import SpecError
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan import (
    Bucket,
    ClusterRef,
    CompressedSync,
    GradCost,
    GradientSync,
    LayerCost,
    Layout,
    ModelRef,
    NoSync,
    Plan,
    Predictions,
    RankPlacement,
    Stage,
    TensorParallel,
    TPGroup,
    TPRankRole,
    WorkloadSummary,
    load_plan,
)
from hetplan.ir.plan_checks import plan_problems
from hetplan.ir.rebalancing import PlannedEvent, Rebalancing

Edit = Callable[[dict[str, Any]], Any]


def valid_plan() -> Plan:
    spec = ClusterSpec.from_preset("cpu-2x2")
    layers = tuple(LayerCost(name=f"l{i}", fwd_flops=1000, bwd_flops=2000, param_bytes=64)
                   for i in range(4))
    grads = tuple(GradCost(name=f"l{i}.weight", size_bytes=64, layer_index=i)
                  for i in reversed(range(4)))
    layout = Layout(dp=1, pp=2, tp=2, micro_batches=4, micro_batch_size=2, global_batch_size=8)
    return Plan(
        model=ModelRef(name="toy", fingerprint="f00d", num_params=64,
                       workload=WorkloadSummary(layers=layers, grads=grads)),
        cluster=ClusterRef.from_cluster(spec),
        layout=layout,
        stages=(Stage(index=0, first_layer=0, last_layer=1, layer_names=("l0", "l1"),
                      ranks=(0, 1)),
                Stage(index=1, first_layer=2, last_layer=3, layer_names=("l2", "l3"),
                      ranks=(2, 3))),
        pipeline_actions=layout_actions(layout),
        tensor_parallel=TensorParallel(groups=(
            TPGroup(ranks=(0, 1), stage=0, roles=(TPRankRole(rank=1, role="resize",
                                                             gamma=0.2),)),
            TPGroup(ranks=(2, 3), stage=1))),
        gradient_sync=GradientSync(
            strategies={"fp32": NoSync(),
                        "topk": CompressedSync(compressor="topk", params={"ratio": 0.01})},
            buckets=(Bucket(tensors=("l3.weight", "l2.weight"), size_bytes=128, strategy="topk"),
                     Bucket(tensors=("l1.weight", "l0.weight"), size_bytes=128,
                            strategy="fp32"))),
        predictions=Predictions(iteration_time_ms=1.0, memory_per_rank_bytes=(1, 1, 1, 1)),
    )


def refused(tmp_path: Path, edit: Edit, *expected: str) -> str:
    """Write the valid plan with ``edit`` applied, load it, and return the message (which
    must hold each of ``expected`` and name the file)."""
    data = json.loads(valid_plan().to_json())
    edit(data)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(SpecError) as exc:
        load_plan(path)
    msg = str(exc.value)
    for text in expected:
        assert text in msg, f"{text!r} not in:\n{msg}"
    assert f"{path}: " in msg
    return msg


def test_the_valid_plan_is_valid(tmp_path: Path) -> None:
    plan = valid_plan()
    assert plan_problems(plan, complete=True) == []
    path = tmp_path / "plan.json"
    plan.save(path)
    assert load_plan(path) == plan
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 0, result.output


# -- what `hetplan validate` used to call valid -------------------------------------------------
def test_two_stages_sharing_ranks(tmp_path: Path) -> None:
    refused(tmp_path, lambda d: d["stages"][1].update(ranks=[0, 1]),
            "stages[1].ranks: [0, 1] (it shares ranks with stage(s) [0])",
            "each rank is in exactly one pipeline stage")


def test_a_stage_with_fewer_ranks_than_dp_x_tp(tmp_path: Path) -> None:
    refused(tmp_path, lambda d: d["stages"][0].update(ranks=[0]),
            "stages[0].ranks: 1 rank(s), but a stage runs on dp x tp = 1 x 2 = 2 ranks")


def test_global_batch_not_dp_x_micro_batch_x_micro_batches(tmp_path: Path) -> None:
    refused(tmp_path, lambda d: d["layout"].update(global_batch_size=16),
            "layout.global_batch_size: 16, but dp=1 x micro_batch_size=2 x micro_batches=4 = 8")


def test_world_size_not_the_clusters(tmp_path: Path) -> None:
    refused(tmp_path, lambda d: d["cluster"].update(world_size=8),
            "cluster.world_size: 8, but the embedded cluster spec (cluster.spec) has 4 devices")


def test_edited_cluster_spec_no_longer_matches_its_fingerprint(tmp_path: Path) -> None:
    refused(tmp_path, lambda d: d["cluster"]["spec"]["inter_node"].update(bandwidth_gbps=1),
            "cluster.fingerprint:", "was cluster.spec edited after planning?")


def test_layout_deleted(tmp_path: Path) -> None:
    refused(tmp_path, lambda d: d.pop("layout"), "layout: missing")


def test_stages_deleted(tmp_path: Path) -> None:
    refused(tmp_path, lambda d: d.pop("stages"),
            "stages: missing; the layout pipelines over pp=2 stages")


def test_bucket_names_an_unknown_tensor(tmp_path: Path) -> None:
    refused(tmp_path, lambda d: d["gradient_sync"]["buckets"][0]["tensors"].__setitem__(
        0, "l3.wieght"), "gradient_sync.buckets[0].tensors[0]: 'l3.wieght' is not a gradient",
            "did you mean 'l3.weight'?")


def test_compressor_zip_with_ratio_minus_one(tmp_path: Path) -> None:
    def edit(d: dict[str, Any]) -> None:
        d["gradient_sync"]["strategies"]["topk"].update(compressor="zip", params={"ratio": -1})

    refused(tmp_path, edit, "gradient_sync.strategies.topk: unknown compressor 'zip'")


def test_compressor_parameter_out_of_range_or_unknown(tmp_path: Path) -> None:
    refused(tmp_path, lambda d: d["gradient_sync"]["strategies"]["topk"].update(
        params={"ratio": -1}), "params.ratio: topk ratio must be in (0, 1], got -1")
    refused(tmp_path, lambda d: d["gradient_sync"]["strategies"]["topk"].update(
        params={"ratio": True}), "params.ratio: topk ratio expected a number, got True")
    refused(tmp_path, lambda d: d["gradient_sync"]["strategies"]["topk"].update(
        params={"ratoi": 0.1}), "params.ratoi: compressor 'topk' takes ratio",
            "did you mean 'ratio'?")
    refused(tmp_path, lambda d: d["gradient_sync"]["strategies"]["topk"].update(
        compressor="qsgd", params={"levels": 1000}), "qsgd levels must be in [1, 127]")


# -- the other rules ----------------------------------------------------------------------------
def test_stages_must_number_pp_x_virtual_stages(tmp_path: Path) -> None:
    def edit(d: dict[str, Any]) -> None:
        d["stages"] = [dict(d["stages"][0], last_layer=3, layer_names=[])]

    refused(tmp_path, edit, "stages: 1 stage(s), but the layout has pp=2, so 2 stage(s)")


def test_stage_ranks_follow_the_layouts_rank_mapping(tmp_path: Path) -> None:
    refused(tmp_path, lambda d: d["stages"][1].update(ranks=[2, 5]),
            "stages[1].ranks: [2, 5], but pipeline coordinate pp=1 of the layout is ranks [2, 3]")


def test_stage_layer_names_are_the_workloads(tmp_path: Path) -> None:
    refused(tmp_path, lambda d: d["stages"][0].update(layer_names=["l1", "l0"]),
            "stages[0].layer_names: ['l1', 'l0'] are not the workload's layers 0..1")


def test_stages_cover_the_workload(tmp_path: Path) -> None:
    refused(tmp_path, lambda d: d["stages"][1].update(last_layer=2, layer_names=[]),
            "stages[1].last_layer: 2, but the model has 4 layers")


def test_rank_placements_follow_the_rank_mapping_and_the_cluster(tmp_path: Path) -> None:
    def ranks(**change: int) -> Edit:
        def edit(d: dict[str, Any]) -> None:
            lay = Layout(**{k: v for k, v in d["layout"].items() if k != "ranks"})
            spec = ClusterSpec.from_preset("cpu-2x2")
            d["layout"]["ranks"] = [
                RankPlacement(rank=r, node=dev.node_index, local_rank=dev.local_rank,
                              device=dev.type, dp=c[0], pp=c[1], tp=c[2],
                              ).model_dump(mode="json") | (change if r == 3 else {})
                for r, dev, c in ((r, spec.devices()[r], lay.coords(r)) for r in range(4))]
        return edit

    data = json.loads(valid_plan().to_json())
    ranks()(data)
    assert Plan.from_json(json.dumps(data), complete=True).layout is not None  # consistent
    refused(tmp_path, ranks(node=0), "layout.ranks[3]: rank 3 is placed on node 0 local rank 1",
            "cluster.spec has it on node 1 local rank 1 (cpu)")
    refused(tmp_path, ranks(tp=0, dp=0, pp=1), "several ranks share the (dp,pp,tp) coordinates")


def test_pipeline_actions_must_match_the_layout_and_run_everything_once(tmp_path: Path) -> None:
    refused(tmp_path, lambda d: d["pipeline_actions"].update(schedule="gpipe"),
            "pipeline_actions: the lists do not match the layout: schedule is 'gpipe', "
            "the layout needs '1f1b'")
    refused(tmp_path, lambda d: d["pipeline_actions"]["ranks"].__setitem__(
        0, d["pipeline_actions"]["ranks"][0].replace("0B3", "0B2")),
            "pipeline_actions.ranks: actions ['0B2'] run more than once",
            "actions ['0B3'] never run")
    refused(tmp_path, lambda d: d["pipeline_actions"]["ranks"].__setitem__(
        1, d["pipeline_actions"]["ranks"][1] + " 2F0"),
            "pipeline_actions.ranks[1]: action '2F0' names stage 2")


def test_pipeline_actions_that_deadlock_are_refused(tmp_path: Path) -> None:
    """Every action once, but rank 1 waits for its backward before running the forward it
    needs (and rank 0 for rank 1's backward): the lists can never finish, on any machine."""
    def edit(d: dict[str, Any]) -> None:
        acts = d["pipeline_actions"]["ranks"][1].split(" ")
        assert acts[:2] == ["1F0", "1B0"]
        d["pipeline_actions"]["ranks"][1] = " ".join(["1B0", "1F0"] + acts[2:])

    msg = refused(tmp_path, edit, "pipeline_actions.ranks: pipeline schedule '1f1b' deadlocks",
                  "rank 1 at step 0 (1B0)", "rank 0 at step 2 (0B0)")
    assert "Traceback" not in msg


def test_a_backward_on_another_rank_than_its_forward_is_refused(tmp_path: Path) -> None:
    def edit(d: dict[str, Any]) -> None:
        ranks = d["pipeline_actions"]["ranks"]
        ranks[0] = ranks[0].replace("0B3", "").strip()
        ranks[1] = ranks[1] + " 0B3"

    refused(tmp_path, edit, "pipeline_actions.ranks:", "0F3 runs on rank 0 but its backward "
            "on rank 1; both must share a rank")


def test_validate_refuses_deadlocking_lists_with_exit_2(tmp_path: Path) -> None:
    data = json.loads(valid_plan().to_json())
    ranks = data["pipeline_actions"]["ranks"]
    ranks[0] = " ".join(sorted(ranks[0].split(" "), key=lambda a: "F" in a))  # B first
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 2, result.output
    assert "deadlocks" in result.output and "internal error" not in result.output


def test_the_layouts_schedule_can_be_built_for_its_sizes(tmp_path: Path) -> None:
    """What each schedule's generator needs is a rule of the layout, so `validate` refuses
    what `simulate` and the runtime would."""
    def chimera(micro_batches: int) -> Edit:
        def edit(d: dict[str, Any]) -> None:  # (Chimera runs tp=1: the TP ranks become dp)
            d["layout"].update(schedule="chimera", micro_batches=micro_batches, tp=1, dp=2,
                               global_batch_size=4 * micro_batches)
            d.pop("pipeline_actions")
            d.pop("tensor_parallel")
        return edit

    refused(tmp_path, chimera(3), "layout.micro_batches: 3, but schedule 'chimera' needs an "
            "even number")
    data = json.loads(valid_plan().to_json())
    chimera(4)(data)
    assert Plan.from_json(json.dumps(data), complete=True).layout is not None  # pp=2, M=4

    def one_stage(d: dict[str, Any]) -> None:
        d["layout"].update(schedule="chimera", pp=1, dp=2, global_batch_size=16)
        for key in ("pipeline_actions", "stages", "tensor_parallel", "gradient_sync"):
            d.pop(key)

    refused(tmp_path, one_stage, "layout.schedule: 'chimera' runs two pipeline directions "
            "over an even pp of at least 2, got pp=1")

    def interleaved(d: dict[str, Any]) -> None:
        d["layout"].update(schedule="interleaved-1f1b", virtual_stages=2, micro_batches=3,
                           global_batch_size=6)
        for key in ("pipeline_actions", "stages", "tensor_parallel", "gradient_sync"):
            d.pop(key)

    refused(tmp_path, interleaved, "layout.micro_batches: 3, but schedule 'interleaved-1f1b' "
            "needs a multiple of pp=2")


def test_chimera_composes_with_tp1_zero01_and_no_per_stage_degrees(tmp_path: Path) -> None:
    """What Chimera is priced and executed with (docs/decisions.md, "Chimera: what is
    priced"): a Chimera plan with tp > 1, ZeRO-2/3, per-stage degrees or a hierarchical
    routing was accepted and priced as if it composed."""
    def chimera(**layout: Any) -> Edit:
        def edit(d: dict[str, Any]) -> None:
            d["layout"].update(schedule="chimera", **layout)
            d.pop("pipeline_actions")
        return edit

    refused(tmp_path, chimera(), "layout.tp: 2, but schedule 'chimera' is priced and executed "
            "with tp=1 only; re-run `hetplan plan` with --tp 1, or with another --schedule")

    def zero2(d: dict[str, Any]) -> None:
        chimera(tp=1, dp=2, global_batch_size=16, zero_stage=2)(d)
        d.pop("tensor_parallel")

    refused(tmp_path, zero2, "layout.zero_stage: 2, but schedule 'chimera' composes with ZeRO "
            "0 or 1", "with --zero 0 or 1, or with another --schedule")

    def hetero(d: dict[str, Any]) -> None:
        chimera(tp=1)(d)
        d.pop("tensor_parallel")
        d["hetero"] = {"stages": [{"stage": k, "device_class": "cpu", "dp": 2, "tp": 1,
                                   "micro_batch_size": 1} for k in range(2)]}

    msg = refused(tmp_path, hetero, "hetero: per-stage degrees, but schedule 'chimera' runs "
                  "one dp x tp on every stage")
    assert "layout.tp" not in msg  # the hetero layout keeps tp=1: only the section is wrong

    def hierarchical(d: dict[str, Any]) -> None:
        zero2(d)
        d["layout"]["zero_stage"] = 1
        d["gradient_sync"]["strategies"]["fp32"] = {"kind": "none", "hierarchy": "hierarchical",
                                                    "steps": [{"level": "intra"},
                                                              {"level": "inter"}]}

    refused(tmp_path, hierarchical, "gradient_sync.strategies['fp32']: hierarchical, but "
            "schedule 'chimera' syncs each stage flat over the 2·dp ranks holding a copy")
    data = json.loads(valid_plan().to_json())
    zero2(data)
    data["layout"]["zero_stage"] = 1
    lay = Plan.from_json(json.dumps(data), complete=True).layout  # ZeRO-1, flat: valid
    assert lay is not None and lay.zero_stage == 1


def test_tp_groups_are_tp_groups_of_the_layout_inside_their_stage(tmp_path: Path) -> None:
    refused(tmp_path, lambda d: d["tensor_parallel"].update(groups=[{"ranks": [1, 2]}]),
            "tensor_parallel.groups[0].ranks: [1, 2], but the layout's TP group of rank 1 is "
            "[0, 1]")
    refused(tmp_path, lambda d: d["tensor_parallel"]["groups"][1].update(stage=0),
            "tensor_parallel.groups[1].ranks: [2, 3] are not all ranks of its stage 0")
    refused(tmp_path, lambda d: d["tensor_parallel"]["groups"][0]["roles"].append(
        {"rank": 1, "role": "normal"}), "tensor_parallel.groups[0].roles: ranks [1] have more "
            "than one role")


def test_tp_roles_prune_at_most_the_controllers_gamma_max(tmp_path: Path) -> None:
    """A role's gamma above the controller's gamma_max was accepted; `--tp-gamma-max` and the
    controller both refuse it (a rank pruning every column computes nothing)."""
    refused(tmp_path, lambda d: d["tensor_parallel"]["groups"][0]["roles"][0].update(gamma=1.0),
            "tensor_parallel.groups[0].roles[0].gamma: 1.0, above tensor_parallel.controller."
            "gamma_max 0.9")


def test_tp_linears_are_inside_layers_of_the_model(tmp_path: Path) -> None:
    """The runtime looks shard sizes up by module name: a linear of a layer the model does
    not have ran even shards."""
    def linear(name: str) -> Edit:
        def edit(d: dict[str, Any]) -> None:
            d["tensor_parallel"]["groups"][0]["linears"] = [
                {"name": name, "split": "column", "features": 8, "shard_sizes": [6, 2]}]
        return edit

    refused(tmp_path, linear("l9.fc"), "tensor_parallel.groups[0].linears[0].name: 'l9.fc' is "
            "not inside a layer of model 'toy'")
    for i, name in enumerate(("l0", "l0.mlp.fc1")):  # a layer, a linear inside one
        data = json.loads(valid_plan().to_json())
        linear(name)(data)
        path = tmp_path / f"known{i}.json"
        path.write_text(json.dumps(data), encoding="utf-8")
        load_plan(path)


def test_a_bucket_stays_in_one_stage(tmp_path: Path) -> None:
    def edit(d: dict[str, Any]) -> None:
        b = d["gradient_sync"]["buckets"]
        d["gradient_sync"]["buckets"] = [dict(b[0], tensors=b[0]["tensors"] + b[1]["tensors"])]

    refused(tmp_path, edit, "gradient_sync.buckets[0]: holds gradients of stages [0, 1]")


def test_an_inter_node_step_needs_more_than_one_node(tmp_path: Path) -> None:
    one_node = ClusterSpec.from_preset("local-cpu")

    def edit(d: dict[str, Any]) -> None:
        d["cluster"] = json.loads(ClusterRef.from_cluster(one_node).model_dump_json())
        d["gradient_sync"]["strategies"]["hier"] = {
            "kind": "none", "hierarchy": "hierarchical",
            "steps": [{"level": "intra", "routine": "reduce_scatter"},
                      {"level": "inter", "routine": "allreduce"},
                      {"level": "intra", "routine": "allgather"}]}

    refused(tmp_path, edit, "gradient_sync.strategies['hier']: has an inter-node step, but "
            "cluster 'local-cpu' has one node")


def _strategy(hierarchy: str, *steps: str) -> dict[str, Any]:
    """A strategy of ``steps`` ("routine" or "level routine") as a plan file writes it."""
    return {"kind": "none", "hierarchy": hierarchy, "steps": [
        {"level": s.split()[0], "routine": s.split()[1]} if " " in s else {"routine": s}
        for s in steps]}


@pytest.mark.parametrize(("strategy", "expected"), [
    (_strategy("flat", "allreduce", "allreduce"), "reduces the flat level twice (steps 0 and "
     "1): each rank's gradient must be summed once"),
    (_strategy("flat", "reduce"), "does not end with the whole aggregated tensor on every "
     "rank: the reduce at step 0"),
    (_strategy("flat", "reduce_scatter"), "does not end with the whole aggregated tensor on "
     "every rank: the reduce_scatter at step 0"),
    (_strategy("flat", "broadcast"), "step 0 (flat broadcast): an uncompressed broadcast must "
     "close a reduce"),
    (_strategy("flat", "allgather"), "step 0 (flat allgather): an uncompressed allgather must "
     "close a reduce_scatter"),
    (_strategy("hierarchical", "intra allreduce"), "never reduces across the inter level"),
    (_strategy("hierarchical", "intra reduce_scatter", "inter allreduce", "inter allreduce",
               "intra allgather"), "reduces the inter level twice (steps 1 and 2)"),
], ids=["twice", "reduce", "reduce_scatter", "broadcast", "allgather", "intra-only",
        "inter-twice"])
def test_a_sync_path_must_compute_the_sum_once_on_every_rank(
        tmp_path: Path, strategy: dict[str, Any], expected: str) -> None:
    """What `validate` called valid: [allreduce, allreduce] trained with dp x the gradients,
    [reduce] and the like failed only in the runtime, after the ranks had started."""
    def edit(d: dict[str, Any]) -> None:
        d["gradient_sync"]["strategies"]["fp32"] = strategy

    refused(tmp_path, edit, f"gradient_sync.strategies.fp32.steps: {expected}")


def test_validate_refuses_a_doubled_allreduce_with_exit_2(tmp_path: Path) -> None:
    data = json.loads(valid_plan().to_json())
    data["gradient_sync"]["strategies"]["fp32"] = _strategy("flat", "allreduce", "allreduce")
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 2, result.output
    assert "gradient_sync.strategies." in result.output
    assert "internal error" not in result.output


def test_rebalancing_events_assign_the_plans_layers_to_its_stages(tmp_path: Path) -> None:
    def edit(d: dict[str, Any]) -> None:
        event = PlannedEvent(iteration=10, stages=((0, 0), (1, 2), (3, 3)))
        d["rebalancing"] = json.loads(Rebalancing(events=(event,)).model_dump_json())

    refused(tmp_path, edit, "rebalancing.events[0].stages: 3 stage ranges, but the plan has 2 "
            "stages")


def test_one_memory_figure_per_rank(tmp_path: Path) -> None:
    refused(tmp_path, lambda d: d["predictions"].update(memory_per_rank_bytes=[1] * 5),
            "predictions.memory_per_rank_bytes: 5 entries for world_size 4")


# -- a complete plan (what a plan file is) ------------------------------------------------------
def test_a_plan_file_carries_its_workload(tmp_path: Path) -> None:
    refused(tmp_path, lambda d: d["model"].pop("workload"), "model.workload: missing")


def test_a_pipeline_has_a_micro_batch_per_stage(tmp_path: Path) -> None:
    def edit(d: dict[str, Any]) -> None:
        d["layout"].update(micro_batches=1, global_batch_size=2)
        d.pop("pipeline_actions")

    refused(tmp_path, edit, "layout.micro_batches: 1, but a pipeline of pp=2 stages needs at "
            "least 2 micro-batches")


def test_drafts_lack_sections_but_are_still_consistent() -> None:
    """The passes hand each other drafts (no stages before the balancing pass): rule 9 is off
    for them, every other rule is on."""
    plan = valid_plan()
    draft = plan.model_copy(update={"stages": (), "pipeline_actions": None,
                                    "tensor_parallel": None})
    again = Plan.model_validate(draft.model_dump())
    assert plan_problems(again) == []
    assert any(p.startswith("stages: missing") for p in plan_problems(again, complete=True))
    with pytest.raises(ValueError, match="global_batch_size: 16"):
        Plan.model_validate(draft.model_copy(update={"layout": draft.layout.model_copy(
            update={"global_batch_size": 16})}).model_dump())


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    def edit(d: dict[str, Any]) -> None:
        d["layout"].update(global_batch_size=16)
        d["stages"][1].update(ranks=[0, 1])
        d["gradient_sync"]["buckets"][0]["tensors"][0] = "nope"

    msg = refused(tmp_path, edit, "global_batch_size", "stages[1].ranks", "'nope'")
    assert msg.count(str(tmp_path / "plan.json")) >= 3


def test_simulate_checks_a_plan_without_its_cluster_against_the_cluster_given(
        tmp_path: Path) -> None:
    """A plan that does not embed its cluster is checked, by the same rules, against the
    ``--cluster`` it is simulated on: a peak the device type lacks is exit 2 naming the file
    and the field, not a KeyError inside the compute model."""
    data = json.loads(valid_plan().to_json())
    data["cluster"]["spec"] = None
    data["precision"] = {"devices": {"cpu": {"compute_dtype": "bf16", "loss_scaling": "none",
                                             "peak_dtype": "bf16"}},
                         "master_weights_dtype": "fp32"}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    assert load_plan(path).cluster.spec is None  # nothing to check it against on its own
    result = CliRunner().invoke(app, ["simulate", "--cluster", "cpu-2x2", str(path)])
    assert result.exit_code == 2, result.output
    out = " ".join(result.output.split())
    assert f"{path}: " in out and "internal error" not in out, out
    assert "precision.devices['cpu'].peak_dtype: 'bf16', but cluster 'cpu-2x2' (--cluster) " \
           "lists no cpu peak for it (it lists fp64, fp32)" in out, out
    result = CliRunner().invoke(app, ["explain", "--cluster", "cpu-2x2", str(path), "stage:1"])
    assert result.exit_code == 2 and f"{path}: precision.devices['cpu']" in result.output, \
        result.output
    data["precision"]["devices"]["cpu"].update(compute_dtype="fp32", peak_dtype="fp32")
    path.write_text(json.dumps(data), encoding="utf-8")
    result = CliRunner().invoke(app, ["simulate", "--cluster", "cpu-2x2", str(path)])
    assert result.exit_code == 0, result.output


# -- strict types and bounds --------------------------------------------------------------------
@pytest.mark.parametrize("field, value, expected", [
    ("dp", True, "layout.dp: expected an integer, got a boolean True"),
    ("dp", "1", "layout.dp: expected an integer, got a string '1'"),
    ("micro_batches", 10**400, "layout.micro_batches: Input should be less than or equal to"),
    ("micro_batch_size", 2.5, "layout.micro_batch_size: Input should be a valid integer"),
])
def test_layout_numbers_are_strict_and_bounded(tmp_path: Path, field: str, value: object,
                                               expected: str) -> None:
    refused(tmp_path, lambda d: d["layout"].update({field: value}), expected)


def test_a_bool_is_not_a_flag_value_elsewhere(tmp_path: Path) -> None:
    refused(tmp_path, lambda d: d["gradient_sync"]["strategies"]["topk"].update(
        error_feedback=1), "error_feedback: Input should be a valid boolean")


def test_the_precision_policy_and_peaks_are_known_and_listed(tmp_path: Path) -> None:
    refused(tmp_path, lambda d: d.update(cost_settings={"dtype": "fp33"}),
            "cost_settings.dtype: unknown precision policy 'fp33'; did you mean 'fp32'?")
    cpu = {"compute_dtype": "fp32", "loss_scaling": "none", "peak_dtype": "fp32"}
    refused(tmp_path, lambda d: d.update(precision={"devices": {"gpu": cpu}}),
            "precision.devices['gpu']: not a device type of cluster 'cpu-2x2' (its types: cpu)")
    refused(tmp_path, lambda d: d.update(precision={"devices": {"cpu": dict(
        cpu, peak_dtype="bf16")}}), "precision.devices['cpu'].peak_dtype: 'bf16', but "
            "cluster.spec lists no cpu peak for it (it lists fp64, fp32)")
    refused(tmp_path, lambda d: d.update(precision={"devices": {"cpu": dict(
        cpu, peak_dtype="fp32x")}}), "peak_dtype: unknown dtype 'fp32x'")


def test_sequence_parallel_needs_tensor_parallelism(tmp_path: Path) -> None:
    """`--sp --tp 1` is refused by `hetplan plan`; the same layout edited into a file was
    accepted, simulated and exported (Megatron's --sequence-parallel with tp 1)."""
    refused(tmp_path, lambda d: d["layout"].update(tp=1, dp=2, sequence_parallel=True),
            "layout.sequence_parallel: true, but tp=1")


def test_a_device_type_is_priced_at_its_compute_dtypes_peak(tmp_path: Path) -> None:
    """A bf16 device priced at another peak than bf16's (or fp32's, where the device lists
    no bf16 peak) was simulated at that peak: a different prediction for the same run."""
    def precision(compute: str, peak: str) -> Edit:
        def edit(d: dict[str, Any]) -> None:
            d["precision"] = {"policy": "bf16", "master_weights_dtype": "fp32", "devices": {
                "cpu": {"compute_dtype": compute, "loss_scaling": "none", "peak_dtype": peak}}}
        return edit

    refused(tmp_path, precision("bf16", "fp64"),
            "precision.devices['cpu'].peak_dtype: 'fp64', but it computes in 'bf16', which is "
            "priced at 'fp32' on cpu")
    data = json.loads(valid_plan().to_json())
    precision("bf16", "fp32")(data)  # bf16 on a CPU: priced at the fp32 peak, as planned
    path = tmp_path / "ok.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    load_plan(path)
