"""The CP-SAT model of the heterogeneous search (:mod:`hetplan.algorithms.hetero_cpsat`):
equal to brute force on small clusters (random tables and the cost model's own tables,
at most 4 device groups and 12 layers) with a zero gap, deterministic, warm-started, and
honest about a restricted neighbourhood."""

from __future__ import annotations

import numpy as np
import pytest

from hetplan.algorithms.hetero_cpsat import solve_cpsat, window_arcs
from hetplan.algorithms.hetero_search import (
    HeteroProblem,
    StageOption,
    objective,
    solve_brute_force,
    solve_exact,
)
from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.hetero import build_problem, device_classes
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan_sections import WorkloadSummary


def _random_problem(rng: np.random.Generator, max_layers: int = 7,
                    layers: int | None = None) -> HeteroProblem:
    """Two device classes, 1-3 options, two recomputation modes (the second slower and
    holding twice as many micro-batches), memory that binds on long ranges."""
    L, m = int(rng.integers(2, max_layers)), int(rng.integers(1, 6))
    L = layers if layers is not None else L
    caps = (int(rng.integers(1, 5)), int(rng.integers(1, 5)))
    options = []
    for _ in range(int(rng.integers(1, 4))):
        c, dp, tp = int(rng.integers(2)), int(rng.choice([1, 2])), int(rng.choice([1, 2]))
        per = rng.uniform(0.5, 2.0, size=L)
        a, v, q = [], [], []
        for r in range(2):
            A, V, Q = (np.zeros((L + 1, L + 1)) for _ in range(3))
            for i in range(L):
                for j in range(i + 1, L + 1):
                    t = per[i:j].sum() / (dp * tp) * (1 + 0.3 * r)
                    A[i, j], V[i, j] = t + (0.1 if i else 0.0), (m - 1) * t + rng.uniform(0, 1)
                    Q[i, j] = int(6 * (1 + r) / (j - i)) - 1
            a.append(A)
            v.append(V)
            q.append(Q)
        options.append(StageOption(c, dp, tp, tuple(a), tuple(v), tuple(q)))
    return HeteroProblem(L, tuple(options), caps, m, ("none", "full"))


@pytest.mark.parametrize("seed", range(30))
def test_cpsat_equals_brute_force_on_random_tables(seed: int) -> None:
    problem = _random_problem(np.random.default_rng(seed))
    brute, sat = solve_brute_force(problem), solve_cpsat(problem)
    assert (brute is None) == (not sat.stages), (brute, sat.status)
    if brute is None:
        assert sat.status == "INFEASIBLE"
        return
    assert sat.status == "OPTIMAL" and sat.gap == 0.0 and not sat.restricted
    assert sat.objective == pytest.approx(brute.objective, rel=1e-8)
    assert objective(problem, sat.stages) == sat.objective


@pytest.mark.parametrize("seed", [109, 118, 123, 128])
def test_cpsat_equals_brute_force_on_twelve_layers(seed: int) -> None:
    """Twelve layers, 2-3 options, 3-5 micro-batches: seeds where some plan fits (at 12
    layers most random instances have a range too long for memory everywhere)."""
    problem = _random_problem(np.random.default_rng(seed), layers=12)
    brute, sat = solve_brute_force(problem), solve_cpsat(problem)
    assert brute is not None and len(problem.options) >= 2
    assert sat.status == "OPTIMAL" and sat.gap == 0.0
    assert sat.objective == pytest.approx(brute.objective, rel=1e-8)


def _node(name: str, kind: str, count: int, per_node: int) -> dict[str, object]:
    return {"name": name, "count": count, "devices": [{"type": kind, "count": per_node}],
            "cpu_cores": 16, "intra_link": {"kind": "nvlink", "bandwidth_gbps": 1200.0,
                                            "latency_us": 2.0}}


_SMALL = {  # at most 4 device groups each
    "2xA100+2xV100": [_node("a", "A100-80GB", 1, 2), _node("v", "V100-SXM2-32GB", 1, 2)],
    "A100+V100+V100": [_node("a", "A100-80GB", 1, 1), _node("v", "V100-SXM2-32GB", 2, 1)],
    "A100,2xV100,A100-40": [_node("a", "A100-80GB", 1, 1), _node("v", "V100-SXM2-32GB", 1, 2),
                            _node("b", "A100-40GB", 1, 1)],
    "A100,V100,A100-40,H100": [_node("a", "A100-80GB", 1, 1), _node("v", "V100-SXM2-32GB", 1, 1),
                               _node("b", "A100-40GB", 1, 1), _node("h", "H100-80GB", 1, 1)],
}


def _spec(cluster: str) -> ClusterSpec:
    return ClusterSpec.from_dict({"name": cluster, "nodes": _SMALL[cluster],
                                  "inter_node": {"kind": "ethernet", "bandwidth_gbps": 100.0,
                                                 "latency_us": 25.0}})


@pytest.fixture(scope="module")
def gpt_test() -> WorkloadSummary:
    from hetplan import zoo
    from hetplan.ir.capture import capture

    args, kwargs = zoo.example_inputs("gpt-test", batch=1)
    ir = capture(zoo.build("gpt-test"), args, kwargs, name="gpt-test")
    return WorkloadSummary.from_model_ir(ir)


@pytest.mark.parametrize("cluster", sorted(_SMALL))
@pytest.mark.parametrize("micro_batch,micro_batches", [(2, 4), (4, 2)])
def test_cpsat_equals_brute_force_on_mixed_clusters(gpt_test: WorkloadSummary, cluster: str,
                                                    micro_batch: int,
                                                    micro_batches: int) -> None:
    """The cost model's own tables (memory, divisibility, resharding, recomputation)."""
    costs = CostModel(_spec(cluster), dtype="mixed")
    problem, infos = build_problem(gpt_test, costs, device_classes(costs), micro_batch,
                                   micro_batches)
    assert problem.num_layers <= 12 and len(problem.capacity) <= 4 and len(infos) >= 3
    assert len(problem.capacity) == len({o.device_class for o in infos})
    brute = solve_brute_force(problem)
    assert brute is not None
    sat = solve_cpsat(problem)
    assert sat.status == "OPTIMAL" and sat.gap == 0.0
    assert sat.objective == pytest.approx(brute.objective, rel=1e-8)


def test_two_solves_give_the_same_result() -> None:
    """Deterministic (one worker, fixed seed, deterministic time limit): the same stages,
    objective, bound and status, also when the limit stops the search early."""
    problem = _random_problem(np.random.default_rng(7), max_layers=12)
    for limit in (0.001, 5.0):
        one, two = (solve_cpsat(problem, deterministic_limit=limit) for _ in range(2))
        # the work spent may differ in the last bit (summation order); the plan rounds it
        assert (one.stages, one.objective, one.bound, one.status,
                round(one.deterministic_time, 9)) == \
               (two.stages, two.objective, two.bound, two.status,
                round(two.deterministic_time, 9))


def test_warm_start_and_neighbourhood_are_reported() -> None:
    """A hint from the exact DP is accepted (its objective recorded), and a neighbourhood
    model around it says it is restricted; its solution is never worse than the hint."""
    problem = next(p for p in (_random_problem(np.random.default_rng(s), max_layers=10)
                               for s in range(100))
                   if p.num_layers >= 6 and solve_exact(p) is not None)
    exact = solve_exact(problem)
    assert exact is not None
    slots, arcs = window_arcs(problem, exact.stages, window=1)
    near = solve_cpsat(problem, hint=exact.stages, max_slots=slots, arcs=arcs)
    assert near.restricted and near.hint_objective == pytest.approx(exact.objective)
    assert near.objective <= exact.objective
    full = solve_cpsat(problem, hint=exact.stages)
    assert not full.restricted and full.objective == pytest.approx(exact.objective, rel=1e-8)


def test_infeasible_when_nothing_fits() -> None:
    problem = _random_problem(np.random.default_rng(3))
    none_fit = HeteroProblem(problem.num_layers, tuple(
        StageOption(o.device_class, o.dp, o.tp, o.a, o.v, tuple(np.full_like(x, -1.0)
                                                                for x in o.q))
        for o in problem.options), problem.capacity, problem.micro_batches, problem.modes)
    sat = solve_cpsat(none_fit)
    assert not sat.stages and sat.status == "INFEASIBLE" and sat.objective == float("inf")


def test_coarse_search_records_the_cpsat_refinement(gpt_test: WorkloadSummary) -> None:
    """On a cluster too large for the exact DP at one device (3 classes of 8: 9^3 device
    vectors), the best coarse plan is refined by CP-SAT: the record is in the plan and its
    pass log whether or not CP-SAT's plan is taken, the warm start is the coarse plan, and
    two compilations give byte-identical JSON."""
    from hetplan.cost_models.hetero import coarse_units
    from hetplan.ir.plan_sections import ClusterRef, ModelRef
    from hetplan.optimizer.hetero import compile_hetero, search_hetero

    spec = ClusterSpec.from_dict({"name": "three", "nodes": [
        _node("a", "A100-80GB", 2, 4), _node("h", "H100-80GB", 2, 4),
        _node("v", "V100-SXM2-32GB", 2, 4)], "inter_node": {
            "kind": "ethernet", "bandwidth_gbps": 100.0, "latency_us": 25.0}})
    costs = CostModel(spec, dtype="mixed")
    assert any(u > 1 for u in coarse_units(device_classes(costs)))
    assert all(c.hetero.search.cpsat is None
               for c in search_hetero(gpt_test, costs, 64, cpsat=False))
    cands = search_hetero(gpt_test, costs, 64)
    recorded = [c for c in cands if c.hetero.search.cpsat is not None]
    assert recorded and recorded[0] is cands[0]  # the plan chosen carries it
    rec = cands[0].hetero.search.cpsat
    assert rec is not None and rec.status == "OPTIMAL" and rec.gap == 0.0
    assert rec.objective_ms <= rec.hint_objective_ms
    if rec.taken:
        assert cands[0].hetero.search.method == "coarse-dp+cp-sat"
        assert set(cands[0].hetero.search.units) == {1}
    else:
        assert cands[0].hetero.search.method == "coarse-dp"
    kw = dict(model_ref=ModelRef(name="gpt-test", fingerprint="x", num_params=1),
              cluster_ref=ClusterRef.from_cluster(spec))
    one, two = (compile_hetero(gpt_test, costs, 64, **kw) for _ in range(2))  # type: ignore[arg-type]
    assert one.model_dump_json() == two.model_dump_json()
    assert any("cp-sat at one-device resolution" in n for n in one.pass_log[0].notes)
