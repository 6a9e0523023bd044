"""The ``tp-resizing`` pass and the uneven-TP cost model (cost_models/tp_shares.py).

Expectations come from the rules the pass documents, recomputed here from the compute
model's per-layer times (an input, not the code under test), or from a second compile
without the pass; never from the pass's own output.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from hetplan.algorithms.skewed_shards import proportional_shards, shard_time
from hetplan.cli import app
from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.evaluate import evaluate
from hetplan.errors import SpecError
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.model import LinearInfo, TPRole
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import (
    ResizingController,
    TensorParallel,
    TPGroup,
    TPLinearShard,
    TPRankRole,
)
from hetplan.optimizer.compile import DEFAULT_PASSES, compile
from hetplan.passes.base import PassContext
from hetplan.passes.tp_resizing import TPResizing, pair_shards
from hetplan.report.explain import explain, target_names
from hetplan.report.inspect import build_report
from hetplan.report.render import render_text

PRESET = "mixed-tp-node"
#: dp=2 pp=2, micro-batch 32: compute matters enough that skewed shards win (at dp=4 pp=1 and
#: micro-batch 4 gpt-test's sync of the largest shard across nodes costs more than the skew
#: saves, and the pass keeps even shards)
#: The LM head stays whole (vocab_parallel=False): split, it shortens the last stage so much
#: that the even shards already reach the skewed plan's time (0.8603 ms both, against
#: 0.8631 even / 0.8608 skewed with the head whole) and these tests are about the skew
ARGS = dict(batch_size=128, dp=2, pp=2, tp=4, micro_batch_size=32, dtype="fp16",
            vocab_parallel=False)
#: one stage, for the cost-model tests (their TP sections are built by hand)
FLAT = dict(batch_size=16, dp=4, pp=1, tp=4, micro_batch_size=4, dtype="fp16")

Golden = Callable[[str, str], None]  # the `golden` fixture (tests/conftest.py)


@pytest.fixture(scope="module")
def plan() -> Plan:
    return compile("gpt-test", PRESET, **ARGS)


@pytest.fixture(scope="module")
def flat() -> Plan:
    return compile("gpt-test", PRESET, **FLAT)


def _stage_blocks(plan: Plan, stage: int) -> set[str]:
    st = plan.stages[stage]
    names = [x.name for x in plan.model.workload.layers[st.first_layer:st.last_layer + 1]]
    return {f"{n}.{fc}" for n in names if n.startswith("blocks.") for fc in ("fc1", "fc2")}


@pytest.fixture(scope="module")
def spec() -> ClusterSpec:
    return ClusterSpec.from_preset(PRESET)


def _is_a100(spec: ClusterSpec, rank: int) -> bool:
    return spec.devices()[rank].type.startswith("A100")


def test_preset_mixes_generations_inside_each_tp_group(spec: ClusterSpec) -> None:
    for first in range(0, spec.world_size, 4):
        kinds = {spec.devices()[r].type for r in range(first, first + 4)}
        assert kinds == {"A100-80GB", "V100-SXM2-32GB"}


def test_plan_carries_uneven_shards_per_rank(plan: Plan, spec: ClusterSpec) -> None:
    tp = plan.tensor_parallel
    assert tp is not None and len(tp.groups) == 4
    for g in tp.groups:
        names = {lin.name for lin in g.linears}
        # every MLP pair of the blocks of the group's stage, both linears with one size list
        assert names == _stage_blocks(plan, g.stage) and names
        for lin in g.linears:
            assert sum(lin.shard_sizes) == lin.features == 256
            fast = [s for r, s in zip(g.ranks, lin.shard_sizes) if _is_a100(spec, r)]
            slow = [s for r, s in zip(g.ranks, lin.shard_sizes) if not _is_a100(spec, r)]
            assert min(fast) > max(slow), (g.ranks, lin.shard_sizes)
            assert all(s % 32 == 0 for s in lin.shard_sizes)  # 256 -> 32-column units


def test_controller_settings_default_off(plan: Plan) -> None:
    ctl = plan.tensor_parallel.controller
    assert ctl.variant == "off" and ctl.criterion == "avg"
    assert (ctl.alpha, ctl.theta_iter, ctl.replan_trigger, ctl.gamma_max) == (0.8, 1e-3, 0.1, 0.9)
    assert all(not g.roles for g in plan.tensor_parallel.groups)


def test_predicted_skewed_not_slower_than_even_and_matches_plan(plan: Plan) -> None:
    pred = plan.tensor_parallel.predicted
    assert pred is not None
    assert pred.skewed_ms < pred.even_ms
    # the pass runs last: the plan's own prediction is the skewed one
    assert plan.predictions.iteration_time_ms == pytest.approx(pred.skewed_ms)
    # even_ms is what the same layout predicts without the pass
    without = compile("gpt-test", PRESET, passes=[p for p in DEFAULT_PASSES
                                                  if p != "tp-resizing"], **ARGS)
    assert without.tensor_parallel.predicted is None
    assert without.predictions.iteration_time_ms == pytest.approx(pred.even_ms)


def test_expected_gamma_is_eq1_on_even_shards(plan: Plan, spec: ClusterSpec) -> None:
    # Eq. (1) with T_avg on the even split, T_i = rank's quarter of the TP layers' time
    costs = CostModel(spec, dtype="fp16")
    wl = plan.model.workload
    st = plan.stages[0]  # ranks 0-3 form a group of stage 0
    t = {}
    for r in range(4):
        times = costs.compute.layer_times(wl, costs.devices[r], 32)
        t[r] = sum((x.fwd_s + x.bwd_s) / 4 for k, (x, lay) in enumerate(zip(times, wl.layers))
                   if lay.tp_pairs and st.first_layer <= k <= st.last_layer)
    avg = sum(t.values()) / 4
    gam = plan.tensor_parallel.predicted.expected_gamma
    for r in range(4):
        want = (t[r] - avg) / t[r] if t[r] > 1.05 * avg else None
        assert (gam.get(str(r)) is None) if want is None else gam[str(r)] == pytest.approx(want)
    assert set(gam) == {str(r) for r in range(16) if not _is_a100(spec, r)}
    assert plan.tensor_parallel.predicted.controller_ms < plan.tensor_parallel.predicted.even_ms


def test_deterministic_bytes(plan: Plan) -> None:
    again = compile("gpt-test", PRESET, **ARGS)
    assert again.to_json() == plan.to_json()


def test_semi_variant_roles_use_min_criterion() -> None:
    p = compile("gpt-test", PRESET, tp_controller="semi", tp_gamma_max=0.5, **ARGS)
    ctl = p.tensor_parallel.controller
    assert (ctl.variant, ctl.criterion, ctl.gamma_max) == ("semi", "min", 0.5)
    for g in p.tensor_parallel.groups:
        for role in g.roles:
            assert role.role in ("normal", "resize") and role.beta == 0
            assert role.gamma <= 0.5


def test_homogeneous_cluster_keeps_even_shards() -> None:
    homogeneous = ClusterSpec.from_dict({
        "name": "a100-2x8", "nodes": [{"name": "n", "count": 2,
                                       "devices": [{"type": "A100-80GB", "count": 8}],
                                       "cpu_cores": 8, "intra_link": {"kind": "nvlink",
                                                                      "bandwidth_gbps": 2400,
                                                                      "latency_us": 2}}],
        "inter_node": {"kind": "infiniband", "bandwidth_gbps": 100, "latency_us": 3}})
    p = compile("gpt-test", homogeneous, **ARGS)
    tp = p.tensor_parallel
    assert all(not g.linears and not g.roles for g in tp.groups)
    assert tp.predicted is None  # nothing to predict: even shards, no straggler
    assert p.pass_log[-1].notes == ("4 homogeneous TP group(s): even shards",)
    without = compile("gpt-test", homogeneous, passes=[x for x in DEFAULT_PASSES
                                                       if x != "tp-resizing"], **ARGS)
    assert without.predictions.iteration_time_ms == p.predictions.iteration_time_ms


# -- cost model: uneven shards cost the slowest rank, per layer ----------------------------
def _section(sizes: tuple[int, ...], roles: tuple[TPRankRole, ...] = ()) -> TensorParallel:
    lins = tuple(TPLinearShard(name=f"blocks.{i}.{n}", split=s, features=256, shard_sizes=sizes)
                 for i in range(4) for n, s in (("fc1", "column"), ("fc2", "row")))
    groups = tuple(TPGroup(ranks=tuple(range(k, k + 4)), stage=0, linears=lins, roles=roles
                           if k == 0 else ()) for k in range(0, 16, 4))
    return TensorParallel(groups=groups)


def _stage_fwd(plan: Plan, section: TensorParallel | None) -> float:
    costs = CostModel(ClusterSpec.from_preset(PRESET), dtype="fp16")
    ev = evaluate(plan.model.workload, plan.layout, plan.stages, None, costs,
                  check_memory=False, tensor_parallel=section)
    return ev.stages[0].fwd_s - ev.stages[0].tp_comm_s


def _by_hand(plan: Plan, shares: list[float]) -> float:
    costs = CostModel(ClusterSpec.from_preset(PRESET), dtype="fp16")
    wl = plan.model.workload
    total = 0.0
    for k, lay in enumerate(wl.layers):
        total += max(costs.compute.layer_times(wl, costs.devices[r], 4)[k].fwd_s
                     * (shares[r] if lay.tp_pairs else 1.0) for r in range(4))
    return total


@pytest.mark.parametrize("sizes", [(64, 64, 64, 64), (96, 96, 32, 32), (0, 0, 128, 128),
                                   (256, 0, 0, 0)])
def test_uneven_shards_cost_slowest_rank_per_layer(flat: Plan, sizes: tuple[int, ...]) -> None:
    assert _stage_fwd(flat, _section(sizes)) == pytest.approx(
        _by_hand(flat, [s / 256 for s in sizes]))


def test_even_listed_shards_cost_like_no_section(flat: Plan) -> None:
    assert _stage_fwd(flat, _section((64, 64, 64, 64))) == pytest.approx(
        _stage_fwd(flat, None))


def test_resize_role_scales_the_rank_share(flat: Plan) -> None:
    roles = (TPRankRole(rank=2, role="resize", gamma=0.5), TPRankRole(rank=3, role="resize",
                                                                        gamma=0.5))
    got = _stage_fwd(flat, _section((64, 64, 64, 64), roles))
    # group 0 resized; the other groups (same devices) stay even and dominate
    assert got == pytest.approx(_by_hand(flat, [0.25] * 4))
    only = TensorParallel(groups=(_section((64, 64, 64, 64), roles).groups[0],))
    costs_stage = flat.stages[0].model_copy(update={"ranks": (0, 1, 2, 3)})
    costs = CostModel(ClusterSpec.from_preset(PRESET), dtype="fp16")
    layout = flat.layout.model_copy(update={"dp": 1})
    ev = evaluate(flat.model.workload, layout, (costs_stage,), None, costs, check_memory=False,
                  tensor_parallel=only)
    assert ev.stages[0].fwd_s - ev.stages[0].tp_comm_s == pytest.approx(
        _by_hand(flat, [0.25, 0.25, 0.125, 0.125]))


# -- bad input -------------------------------------------------------------------------------
def test_group_with_ranks_missing_from_the_cluster(plan: Plan) -> None:
    small = ClusterSpec.from_dict({
        "name": "eight", "nodes": [{"name": "n", "devices": [{"type": "A100-80GB",
                                                              "count": 8}],
                                    "cpu_cores": 8, "intra_link": {"kind": "nvlink",
                                                                   "bandwidth_gbps": 2400,
                                                                   "latency_us": 2}}]})
    ctx = PassContext(workload=plan.model.workload, cluster=small, costs=CostModel(small),
                      layout=plan.layout, model_ir=object())  # type: ignore[arg-type]
    with pytest.raises(SpecError, match=r"names ranks \[8, 9, 10, 11\].*world size 8"):
        TPResizing().run(plan, ctx)


@pytest.mark.parametrize("gamma", [1.0, -0.1, 1.5, float("nan")])
def test_gamma_max_outside_range(gamma: float) -> None:
    with pytest.raises(SpecError, match=r"gamma_max must be in \[0, 1\)") as info:
        TPResizing(gamma_max=gamma)
    # the reason fits the value: only a ratio of 1 or more prunes every column
    assert ("every column" in str(info.value)) == (gamma >= 1), str(info.value)
    with pytest.raises(ValidationError):
        ResizingController(gamma_max=gamma)


def test_cli_rejects_gamma_max_and_unknown_variant() -> None:
    runner = CliRunner()
    res = runner.invoke(app, ["plan", "gpt-test", "-c", PRESET, "-b", "16", "--tp", "4",
                              "--tp-gamma-max", "1"])
    assert res.exit_code != 0 and "gamma_max must be in [0, 1)" in res.output
    res = runner.invoke(app, ["plan", "gpt-test", "-c", PRESET, "-b", "16", "--tp", "4",
                              "--tp-controller", "fast"])
    assert res.exit_code != 0 and "--tp-controller" in res.output and "'fast'" in res.output


# -- hetplan inspect explains the TP section -------------------------------------------------


@pytest.fixture(scope="module")
def semi_plan() -> Plan:
    return compile("gpt-test", PRESET, tp_controller="semi", **ARGS)


def test_inspect_report_of_the_tp_section(semi_plan: Plan) -> None:
    tp = build_report(semi_plan)["tp"]
    assert tp["controller"]["variant"] == "semi" and tp["controller"]["criterion"] == "min"
    plan_tp = semi_plan.tensor_parallel
    # 2 stages x 2 data-parallel replicas: the replicas of a stage fold into one entry
    assert [(x["stage"], x["count"]) for x in tp["groups"]] == [(0, 2), (1, 2)]
    g = tp["groups"][0]
    lins = plan_tp.groups[0].linears
    assert len({x.shard_sizes for x in lins}) == 1  # one run: folded into one entry
    assert g["linears"] == [{"first": lins[0].name, "last": lins[-1].name, "count": len(lins),
                             "shard_sizes": list(lins[0].shard_sizes)}]
    assert [r["position"] for r in g["role_details"]] == [
        plan_tp.groups[0].ranks.index(r.rank) for r in plan_tp.groups[0].roles
        if r.role != "normal"]
    pred = plan_tp.predicted
    assert tp["predicted"]["skew_speedup"] == pytest.approx(pred.even_ms / pred.skewed_ms,
                                                            abs=1e-6)


def test_golden_inspect_tp_text(semi_plan: Plan, golden: Golden) -> None:
    golden("inspect_tp.txt", render_text(build_report(semi_plan), sections=["tp"], width=100))


# -- hetplan explain linear:NAME -------------------------------------------------------------
def test_explain_a_tp_linear(semi_plan: Plan) -> None:
    ex = explain(semi_plan, "linear:blocks.1.fc2")
    assert ex.kind == "linear"
    # re-evaluated with the plan's TP section: equals the plan's own prediction
    assert ex.current_ms == pytest.approx(semi_plan.predictions.iteration_time_ms, abs=1e-6)
    facts = dict(ex.facts)
    sizes = next(lin.shard_sizes for lin in semi_plan.tensor_parallel.groups[0].linears
                 if lin.name == "blocks.1.fc2")
    # blocks.1 is in stage 0: the groups of ranks 0-3 and 4-7
    assert "blocks.1.fc2" in {x.name for x in semi_plan.tensor_parallel.groups[1].linears}
    assert facts["split"].startswith("row-parallel, 256 features over 4 ranks, 2 group(s)")
    assert facts["ranks 0–3 (+1 alike)"] == (f"{sizes[0]} (A100-80GB), {sizes[1]} (A100-80GB), "
                                              f"{sizes[2]} (V100-SXM2-32GB), {sizes[3]} "
                                              "(V100-SXM2-32GB)")
    (alt,) = ex.alternatives
    assert alt.name == "even shards for 2 linear(s) of its pair"
    # the alternative is the plan with blocks.1's pair even in every group, evaluated directly
    tp = semi_plan.tensor_parallel
    even = tp.model_copy(update={"groups": tuple(g.model_copy(update={"linears": tuple(
        x for x in g.linears if not x.name.startswith("blocks.1."))}) for g in tp.groups)})
    costs = CostModel(ClusterSpec.from_preset(PRESET), dtype="fp16", grad_accumulation="autograd")
    ev = evaluate(semi_plan.model.workload, semi_plan.layout, semi_plan.stages,
                  semi_plan.gradient_sync, costs, tensor_parallel=even)
    assert alt.iteration_time_ms == pytest.approx(ev.iteration_s * 1e3, abs=1e-6)
    assert "linear:blocks.1.fc2" in target_names(semi_plan)


def test_explain_unknown_linear(semi_plan: Plan) -> None:
    with pytest.raises(SpecError, match=r"unknown target 'linear:blocks.1.fc3'.*did you mean"):
        explain(semi_plan, "linear:blocks.1.fc3")


def test_golden_explain_tp_text(semi_plan: Plan, golden: Golden) -> None:
    golden("explain_tp.txt", explain(semi_plan, "linear:blocks.0.fc1").text)


# -- memory: a rank holds its share ----------------------------------------------------------
def test_memory_follows_the_rank_share(flat: Plan) -> None:
    from hetplan.cost_models.memory import MIXED, in_flight_micro_batches, stage_memory

    costs = CostModel(ClusterSpec.from_preset(PRESET), dtype="fp16")
    wl = flat.model.workload
    ev = evaluate(wl, flat.layout, flat.stages, None, costs, check_memory=False,
                  tensor_parallel=_section((192, 64, 0, 0)))
    layers = list(wl.layers)
    flight = in_flight_micro_batches(flat.layout.schedule, 0, 1, flat.layout.micro_batches, 1)
    scale = flat.layout.micro_batch_size / wl.batch_size
    names = [lay.name for lay in layers]
    for r, share in ((0, 0.75), (1, 0.25), (2, 0.0)):
        # by hand: layers holding listed linears (blocks.N) get the share, others 1/tp
        shares = [share if any(f"blocks.{i}" == n for i in range(4)) else 0.25 for n in names]
        # fp16 everywhere: 2-byte weights, grads and activations of the fp32 capture, fp32
        # master weights; the layout's ZeRO stage over its dp ranks and sequence parallelism
        want = stage_memory(layers, tp=4, micro_batch_scale=scale, in_flight=flight,
                            shares=shares, precision=MIXED, dp=flat.layout.dp,
                            zero_stage=flat.layout.zero_stage,
                            sequence_parallel=flat.layout.sequence_parallel,
                            last=True)  # the one stage computes the loss
        assert ev.memory[r] == want
        params = sum(x.param_bytes - min(x.tp_split_bytes, x.param_bytes)
                     + min(x.tp_split_bytes, x.param_bytes) * s for x, s in zip(layers, shares))
        assert ev.memory[r].params == int(params / 2)
    assert ev.memory[0].params > ev.memory[1].params > ev.memory[2].params


def test_skew_that_overflows_the_fast_rank_is_dropped() -> None:
    """A fast CPU type with little memory: even shards (3.2 MB per rank for gpt-test at tp=2,
    from a compile without the pass) fit in its 3.6 MB usable, 3:1 skewed ones (4.6 MB) not."""
    def cluster(fast_gib: float) -> ClusterSpec:
        cpu = {"memory_gib": 4.0, "peak_tflops": {"fp32": 0.1}, "mem_bandwidth_gb_s": 20.0}
        return ClusterSpec.from_dict({
            "name": "cpu-mixed", "nodes": [{
                "name": "host", "devices": [{"type": "fast", "count": 1},
                                            {"type": "slow", "count": 1}],
                "cpu_cores": 2, "intra_link": {"kind": "loopback", "bandwidth_gbps": 40.0,
                                               "latency_us": 10.0}}],
            "device_types": {"fast": {**cpu, "memory_gib": fast_gib},
                             "slow": {**cpu, "peak_tflops": {"fp32": 0.05},
                                      "mem_bandwidth_gb_s": 10.0}}})

    kw = dict(batch_size=4, dp=1, pp=1, tp=2, micro_batch_size=4)
    roomy = compile("gpt-test", cluster(4.0), **kw)
    even = compile("gpt-test", cluster(4.0), passes=[p for p in DEFAULT_PASSES
                                                     if p != "tp-resizing"], **kw)
    need_skewed = roomy.predictions.memory_per_rank_bytes[0]
    need_even = even.predictions.memory_per_rank_bytes[0]
    assert roomy.tensor_parallel.groups[0].linears and need_skewed > need_even
    fast_bytes = (need_even + need_skewed) / 2 / 0.9  # usable 90 %: between the two
    tight = compile("gpt-test", cluster(fast_bytes / 2**30), **kw)
    assert not tight.tensor_parallel.groups[0].linears
    assert any("do not fit" in n for n in tight.pass_log[-1].notes)


def test_migration_roles_that_slow_the_plan_are_dropped(semi_plan: Plan) -> None:
    mig = compile("gpt-test", PRESET, tp_controller="migration", **ARGS)
    assert all(not g.roles for g in mig.tensor_parallel.groups)
    assert any("initial migration roles predicted slower" in n for n in mig.pass_log[-1].notes)
    assert mig.predictions.iteration_time_ms == pytest.approx(
        mig.tensor_parallel.predicted.skewed_ms)
    # the premise, by hand: the stragglers (semi's min criterion = migration's) sending their
    # whole Eq. (1) fraction to the V100s makes the iteration slower than no roles
    tp = semi_plan.tensor_parallel
    groups = []
    for g in tp.groups:
        src = {r.rank: r.gamma for r in g.roles if r.role == "resize"}
        roles = tuple(TPRankRole(rank=r, role="migrate_src", gamma=src[r], beta=1.0) if r in src
                      else TPRankRole(rank=r, role="migrate_dst") for r in g.ranks)
        groups.append(g.model_copy(update={"roles": roles}))
    costs = CostModel(ClusterSpec.from_preset(PRESET), dtype="fp16")
    ev = evaluate(semi_plan.model.workload, semi_plan.layout, semi_plan.stages,
                  mig.gradient_sync, costs,
                  tensor_parallel=tp.model_copy(update={"groups": tuple(groups)}))
    assert ev.iteration_s * 1e3 > mig.tensor_parallel.predicted.skewed_ms


def test_sync_and_optimizer_follow_the_largest_shard(flat: Plan) -> None:
    from hetplan.cost_models.optimizer_step import step_bytes, step_kernels, step_seconds
    from hetplan.cost_models.rank_memory import stage_precision

    costs = CostModel(ClusterSpec.from_preset(PRESET), dtype="fp16")
    wl = flat.model.workload

    def run(sizes: tuple[int, ...] | None):  # type: ignore[no-untyped-def]
        return evaluate(wl, flat.layout, flat.stages, flat.gradient_sync, costs,
                        check_memory=False,
                        tensor_parallel=None if sizes is None else _section(sizes))

    even, skew = run(None), run((128, 64, 32, 32))
    # optimizer step, by hand: the largest shard (1/2 of the blocks' split bytes)
    bw = min(costs.devices[r].mem_bandwidth_bytes_per_s for r in flat.stages[0].ranks)
    pbytes = 0.0
    for x in wl.layers:
        frac = min(x.tp_split_bytes / x.param_bytes, 1.0) if x.param_bytes else 0.0
        share = 0.5 if x.name.startswith("blocks.") else 0.25
        pbytes += x.param_bytes * (1 - frac + frac * share) if x.tp_split_bytes else x.param_bytes
    # the step's bytes per element (fp16 weights, fp32 master, Adam) and its launches; ZeRO-1
    # steps 1/dp of the elements on each rank
    zero = flat.layout.dp if flat.layout.zero_stage else 1
    prec = stage_precision(wl, flat.stages[0], costs)
    nbytes = step_bytes(prec, "adam", dp=zero) * pbytes / prec.capture_bytes
    kernels = step_kernels(prec, "adam", len(wl.grads), dp=zero)
    assert skew.optimizer_s == pytest.approx(step_seconds(nbytes, kernels, bw))
    assert skew.optimizer_s > even.optimizer_s
    assert skew.comm_s > even.comm_s  # the largest shard's DP group syncs more bytes


def test_simulate_reads_the_tp_section(semi_plan: Plan) -> None:
    from hetplan.cost_models.predict import simulate

    again = simulate(semi_plan)
    assert again.iteration_time_ms == pytest.approx(semi_plan.predictions.iteration_time_ms,
                                                    abs=1e-6)
    even = semi_plan.model_copy(update={"tensor_parallel": None})
    assert simulate(even).iteration_time_ms != pytest.approx(again.iteration_time_ms, abs=1e-6)


def test_migrate_src_without_dst_spreads_over_the_other_ranks(flat: Plan) -> None:
    """The runtime's reading (``plan_roles``): with no ``migrate_dst`` listed, every other rank
    receives an equal part of the migrated work, so no work is lost from the cost."""
    from hetplan.cost_models.tp_shares import rank_shares

    roles = (TPRankRole(rank=2, role="migrate_src", gamma=0.5, beta=1.0),)
    group = _section((64, 64, 64, 64), roles).groups[0]
    st = flat.stages[0]
    for row in rank_shares(flat.model.workload, group, st.first_layer, st.last_layer):
        assert sum(row) == pytest.approx(1.0)
        assert row == pytest.approx([0.25 + 0.125 / 3, 0.25 + 0.125 / 3, 0.125,
                                     0.25 + 0.125 / 3])


def test_a_rank_without_tp_work_makes_no_straggler() -> None:
    """One rank 20x slower gets an empty shard (256 / 0); its TP time of 0 must not serve as
    Eq. (1)'s reference, which made the only rank with MLP work prune (γ 0.5 under T_avg,
    γ_max under SEMI's T_min)."""
    cpu = {"memory_gib": 4.0, "peak_tflops": {"fp32": 0.1}, "mem_bandwidth_gb_s": 20.0}
    spec = ClusterSpec.from_dict({
        "name": "cpu-het", "nodes": [{
            "name": "host", "devices": [{"type": "cpu", "count": 1},
                                        {"type": "cpuslow", "count": 1}],
            "cpu_cores": 2, "intra_link": {"kind": "loopback", "bandwidth_gbps": 40.0,
                                           "latency_us": 10.0}}],
        "device_types": {"cpu": cpu, "cpuslow": {**cpu, "peak_tflops": {"fp32": 0.005}}}})
    for variant in ("zero", "semi"):
        p = compile("gpt-test", spec, batch_size=4, dp=1, pp=1, tp=2, tp_controller=variant)
        g = p.tensor_parallel.groups[0]
        assert g.linears and all(lin.shard_sizes == (256, 0) for lin in g.linears)
        assert all(r.role == "normal" and r.gamma == 0 for r in g.roles), (variant, g.roles)


# -- attention pairs in whole heads ---------------------------------------------------------
def _attention_pair(features: int, unit: int | None) -> tuple[list[LinearInfo], LinearInfo]:
    """An attention pair q/k/v -> o of ``features`` with capture's ``split_unit``."""
    cols = [LinearInfo(f"attn.{n}", features, features, False, TPRole.COLUMN, "attn.o_proj",
                       unit) for n in ("q_proj", "k_proj", "v_proj")]
    return cols, LinearInfo("attn.o_proj", features, features, False, TPRole.ROW,
                            "attn.v_proj", unit)


def test_attention_pair_shards_are_optimal_whole_heads() -> None:
    """Llama-2-7B's attention (32 heads of 128) on A100, A100, V100, V100 speeds: whole
    heads, one at least per rank, and no head split does better (brute force over heads)."""
    speeds = [2.5, 2.5, 1.0, 1.0]
    sizes = pair_shards(*_attention_pair(4096, 128), speeds)
    assert sizes is not None and sum(sizes) == 4096
    assert all(s % 128 == 0 and s >= 128 for s in sizes), sizes
    best = min(max(h * 128 / s for h, s in zip(split, speeds))
               for a in range(1, 30) for b in range(1, 31 - a) for c in range(1, 32 - a - b)
               for split in [(a, b, c, 32 - a - b - c)])
    assert shard_time(sizes, speeds) == pytest.approx(best)
    # without a unit (an MLP pair) the 64-column granularity stays
    assert pair_shards(*_attention_pair(4096, None), speeds) == proportional_shards(4096,
                                                                                    speeds)


def test_attention_pair_without_a_head_per_rank_keeps_even_shards() -> None:
    assert pair_shards(*_attention_pair(256, 128), [2.5, 2.5, 1.0, 1.0]) is None  # 2 heads
    assert pair_shards(*_attention_pair(320, 128), [2.0, 1.0]) is None  # 2.5 heads
    # a rank 20x slower still keeps one head (none would run the attention replicated)
    assert pair_shards(*_attention_pair(64, 16), [20.0, 1.0]) == (48, 16)


def _cpu_het(per_kind: int) -> ClusterSpec:
    """``per_kind`` fast and ``per_kind`` 20x slower CPU processes on one host."""
    cpu = {"memory_gib": 4.0, "peak_tflops": {"fp32": 0.1}, "mem_bandwidth_gb_s": 20.0}
    return ClusterSpec.from_dict({
        "name": "cpu-het", "nodes": [{
            "name": "host", "devices": [{"type": "cpu", "count": per_kind},
                                        {"type": "cpuslow", "count": per_kind}],
            "cpu_cores": 2, "intra_link": {"kind": "loopback", "bandwidth_gbps": 40.0,
                                           "latency_us": 10.0}}],
        "device_types": {"cpu": cpu, "cpuslow": {**cpu, "peak_tflops": {"fp32": 0.005}}}})


def test_planned_attention_keeps_whole_heads_and_one_per_rank() -> None:
    """tiny-opt (4 heads of 16) on a fast and a 20x slower rank: the MLP's slow rank gets an
    empty shard, the attention's keeps one head (3 + 1); tiny-vit (2 heads of 16) at tp=4
    cannot give every rank a head: its attention stays even (not listed), a note says so."""
    p = compile("tiny-opt", _cpu_het(1), batch_size=4, dp=1, pp=1, tp=2)
    shards = {lin.name.rpartition(".")[2]: lin.shard_sizes
              for lin in p.tensor_parallel.groups[0].linears}
    assert shards["fc2"] == (128, 0)
    assert {shards[n] for n in ("q_proj", "k_proj", "v_proj", "out_proj")} == {(48, 16)}
    vit = compile("tiny-vit", _cpu_het(2), batch_size=4, dp=1, pp=1, tp=4)
    listed = [lin.name for g in vit.tensor_parallel.groups for lin in g.linears]
    assert listed and not any(".attention." in n for n in listed), listed
    assert any("attention module(s) not skewed" in n for n in vit.pass_log[-1].notes)
