"""The heterogeneous search cuts only where the runtime can split the model
(``HeteroProblem.cuttable``, from ``LayerIR.cuttable_before``): the exact DP, CP-SAT, brute
force and the local search never start a stage at a forbidden layer, and the DP still equals
brute force over the allowed cuts, also where the forbidden boundary is the cheapest cut."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hetplan.algorithms.hetero_cpsat import solve_cpsat
from hetplan.algorithms.hetero_search import (
    HeteroProblem,
    StageChoice,
    StageOption,
    improve_locally,
    objective,
    solve_brute_force,
    solve_exact,
)
from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.hetero import build_problem, device_classes
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan_checks import plan_problems
from hetplan.ir.plan_sections import ClusterRef, CostSettings, ModelRef, WorkloadSummary
from hetplan.optimizer.hetero import compile_hetero, search_hetero

INF = float("inf")


def _starts(stages: tuple[StageChoice, ...]) -> set[int]:
    return {s.first for s in stages[1:]}


def _random_problem(rng: np.random.Generator, cheap_cut: int | None = None) -> HeteroProblem:
    """Random tables (as in ``test_hetero_search``); ``cheap_cut``: the resharding into a
    stage costs 1 s except at that layer, where it is free (the cheapest cut)."""
    L, m = int(rng.integers(3, 7)), int(rng.integers(2, 6))
    caps = (int(rng.integers(1, 4)), int(rng.integers(1, 4)))
    options = []
    for _ in range(int(rng.integers(1, 4))):
        c, dp = int(rng.integers(2)), int(rng.choice([1, 2]))
        per = rng.uniform(0.5, 2.0, size=L)
        a, v, q = [], [], []
        for r in range(2):
            A, V, Q = (np.zeros((L + 1, L + 1)) for _ in range(3))
            for i in range(L):
                for j in range(i + 1, L + 1):
                    t = per[i:j].sum() / dp * (1 + 0.3 * r)
                    send = 0.0 if i == 0 or i == cheap_cut else (1.0 if cheap_cut else 0.1)
                    A[i, j], V[i, j] = t + send, (m - 1) * t + rng.uniform(0, 1)
                    Q[i, j] = int(6 * (1 + r) / (j - i)) - 1
            a.append(A)
            v.append(V)
            q.append(Q)
        options.append(StageOption(c, dp, 1, tuple(a), tuple(v), tuple(q)))
    return HeteroProblem(L, tuple(options), caps, m, ("none", "full"))


def _forbid(problem: HeteroProblem, layers: set[int]) -> HeteroProblem:
    return dataclasses.replace(problem, cuttable=tuple(
        k not in layers for k in range(problem.num_layers)))


@pytest.mark.parametrize("seed", range(30))
def test_exact_and_cpsat_equal_brute_force_over_allowed_cuts(seed: int) -> None:
    """The layer the unconstrained optimum cuts at is forbidden: every solver moves off it
    and the DP and CP-SAT reach brute force's optimum over the remaining cuts."""
    rng = np.random.default_rng(seed)
    free = _random_problem(rng, cheap_cut=int(rng.integers(1, 3)))
    ref = solve_brute_force(free)
    # forbid the optimum's first cut (layer 1 where the optimum is one stage or none)
    banned = min(_starts(ref.stages)) if ref is not None and len(ref.stages) > 1 else 1
    problem = _forbid(free, {banned})
    if ref is not None and len(ref.stages) > 1:
        assert objective(problem, ref.stages) == INF  # the free optimum is now refused
    brute, exact = solve_brute_force(problem), solve_exact(problem)
    assert (brute is None) == (exact is None)
    if brute is None or exact is None:
        return
    assert banned not in _starts(brute.stages) | _starts(exact.stages)
    assert exact.objective == pytest.approx(brute.objective, rel=1e-12)
    assert ref is not None and exact.objective >= ref.objective
    assert all(banned not in _starts(st) for _, st in exact.front)
    cp = solve_cpsat(problem)
    assert cp.status == "OPTIMAL" and banned not in _starts(cp.stages)
    assert cp.objective == pytest.approx(brute.objective, rel=1e-6)


def test_most_seeds_forbid_the_optimums_cut() -> None:
    """The construction above does forbid a cut the free optimum makes, mostly the cheap
    one (16 of the 30 seeds have a multi-stage optimum, 11 of them cut at the cheap
    boundary), so the parametrised test exercises the constraint, not a cut nobody wanted."""
    multi = cheap_hit = 0
    for seed in range(30):
        rng = np.random.default_rng(seed)
        cheap = int(rng.integers(1, 3))
        ref = solve_brute_force(_random_problem(rng, cheap_cut=cheap))
        if ref is not None and len(ref.stages) > 1:
            multi += 1
            cheap_hit += cheap in _starts(ref.stages)
    assert multi >= 15 and cheap_hit >= 10


def test_local_search_never_moves_a_boundary_onto_a_forbidden_layer() -> None:
    """Boundary moves of one or two layers would reach layer 2; with it forbidden the
    climb judges no plan that starts a stage there, and still improves elsewhere."""
    L = 6
    one = np.zeros((L + 1, L + 1))
    for i in range(L):
        for j in range(i + 1, L + 1):
            one[i, j] = j - i
    opt = StageOption(0, 1, 1, (one,), (one,), (one + 10,))
    problem = HeteroProblem(L, (opt,), (2,), 4, cuttable=(True, True, False, True, True, True))
    judged: list[tuple[StageChoice, ...]] = []

    def judge(st: tuple[StageChoice, ...]) -> float:
        judged.append(st)
        return abs(st[0].end - 2.2)  # prefers a cut at 2, the forbidden layer

    start = (StageChoice(0, 0, 0, 4), StageChoice(0, 0, 4, 6))
    found, _, _ = improve_locally(problem, start, judge)
    assert found[0].end == 3  # the nearest allowed cut
    assert len(judged) > 1 and all(2 not in _starts(st) for st in judged)
    free = dataclasses.replace(problem, cuttable=())
    assert improve_locally(free, start, judge)[0][0].end == 2  # the constraint decided it


def test_cuttable_length_is_checked() -> None:
    with pytest.raises(ValueError, match="cuttable needs one value per layer"):
        HeteroProblem(3, (), (1,), 2, cuttable=(True,))


def _node(name: str, kind: str, count: int, per_node: int) -> dict[str, object]:
    return {"name": name, "count": count, "devices": [{"type": kind, "count": per_node}],
            "cpu_cores": 16, "intra_link": {"kind": "nvlink", "bandwidth_gbps": 1200.0,
                                            "latency_us": 2.0}}


def _costs() -> CostModel:
    spec = ClusterSpec.from_dict({
        "name": "mixed-2x2", "nodes": [_node("a", "A100-80GB", 2, 2),
                                       _node("v", "V100-SXM2-32GB", 2, 2)],
        "inter_node": {"kind": "ethernet", "bandwidth_gbps": 10.0, "latency_us": 25.0}})
    return CostModel(spec, dtype="mixed")


def _small_costs() -> CostModel:
    spec = ClusterSpec.from_dict({
        "name": "A100+V100+V100", "nodes": [_node("a", "A100-80GB", 1, 1),
                                            _node("v", "V100-SXM2-32GB", 2, 1)],
        "inter_node": {"kind": "ethernet", "bandwidth_gbps": 100.0, "latency_us": 25.0}})
    return CostModel(spec, dtype="mixed")


@pytest.fixture(scope="module")
def gpt_test() -> WorkloadSummary:
    from hetplan import zoo
    from hetplan.ir.capture import capture

    args, kwargs = zoo.example_inputs("gpt-test", batch=1)
    ir = capture(zoo.build("gpt-test"), args, kwargs, name="gpt-test")
    return WorkloadSummary.from_model_ir(ir)  # 8 layers; pos_emb (layer 1) not cuttable


def _with_cuts(workload: WorkloadSummary, cuttable: list[bool]) -> WorkloadSummary:
    """``workload`` with the given cuts and 1000 times the FLOPs (compute-bound, so the
    optimum pipelines: at gpt-test's own size one stage wins and there is no cut to
    forbid)."""
    return workload.model_copy(update={"layers": tuple(
        x.model_copy(update={"cuttable_before": c, "fwd_flops": x.fwd_flops * 1000,
                             "bwd_flops": x.bwd_flops * 1000})
        for x, c in zip(workload.layers, cuttable, strict=True))})


def test_cost_model_problem_carries_the_workloads_cuts(gpt_test: WorkloadSummary) -> None:
    costs = _small_costs()
    problem, _ = build_problem(gpt_test, costs, device_classes(costs), 2, 4)
    assert problem.cuttable == tuple(x.cuttable_before for x in gpt_test.layers)
    assert problem.cuttable[1] is False  # pos_emb only feeds glue code


def test_cost_model_tables_forbidden_optimum_cut(gpt_test: WorkloadSummary) -> None:
    """On the cost model's own tables (3 GPUs, 8 layers): forbid the cut the optimum makes
    when every boundary is allowed; the DP then equals brute force over the allowed cuts."""
    costs = _small_costs()
    free_wl = _with_cuts(gpt_test, [True] * len(gpt_test.layers))
    free, _ = build_problem(free_wl, costs, device_classes(costs), 2, 4)
    ref = solve_exact(free)
    assert ref is not None and len(ref.stages) > 1
    banned = set(_starts(ref.stages))
    wl = _with_cuts(gpt_test, [k not in banned for k in range(len(gpt_test.layers))])
    problem, _ = build_problem(wl, costs, device_classes(costs), 2, 4)
    brute, exact = solve_brute_force(problem), solve_exact(problem)
    assert brute is not None and exact is not None
    assert not banned & (_starts(exact.stages) | _starts(brute.stages))
    assert exact.objective == pytest.approx(brute.objective, rel=1e-12)
    assert exact.objective > ref.objective


def test_compiled_hetero_plan_never_starts_a_stage_at_a_forbidden_layer(
        gpt_test: WorkloadSummary) -> None:
    """End to end (DP, restricted seeds, local search, simulator): with the stage starts
    of the unconstrained plan forbidden, the compiled plan cuts elsewhere and the
    validator accepts it."""
    costs = _costs()
    free_wl = _with_cuts(gpt_test, [True] * len(gpt_test.layers))
    free = search_hetero(free_wl, costs, 64, micro_batch=16)
    best = next(c for c in free if c.evaluation is not None)
    banned = {s.first_layer for s in best.stages[1:]}
    assert banned and 1 not in banned
    banned.add(1)  # pos_emb, as captured
    wl = _with_cuts(gpt_test, [k not in banned for k in range(len(gpt_test.layers))])
    cands = search_hetero(wl, costs, 64, micro_batch=16)
    assert cands and all(not banned & {s.first_layer for s in c.stages[1:]} for c in cands)
    plan = compile_hetero(wl, costs, 64, micro_batch=16,
                          model_ref=ModelRef(name="gpt-test", fingerprint="test",
                                             num_params=1, workload=wl),
                          cluster_ref=ClusterRef.from_cluster(costs.cluster),
                          cost_settings=CostSettings(dtype="mixed"))
    assert plan.stages and not banned & {s.first_layer for s in plan.stages[1:]}
    assert plan_problems(plan) == []
