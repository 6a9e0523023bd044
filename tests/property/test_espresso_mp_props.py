"""Espresso's search on random small workloads (``hetplan.passes.espresso``).

- Monotone: allowing more (more compressions per tensor; 16-bit uncompressed steps) never
  gives a plan predicted slower. The pass widens its search in rungs, each seeded with the
  last, so this holds along the rungs: in ``max_compressions`` for any precision set, and
  for adding fp16 at one compression per tensor.
- Exactness: with a few extended-tree options per tensor (real paths, real prices) and at
  most 6 tensors, the heuristic search as the pass runs it (Algorithms 4.1 + 4.2 with the
  uniform seeds, tensors classed by size, the pass's candidate screen ``screen=3`` and
  ``seed_within=0.1``, its floor at the lower bound plus ``bound_within=0.1 %``, which can
  only stop the search within 0.1 % of the optimum; the exhaustive shortcut turned off) is
  compared with brute force over every combination. The stated bound: within 25 % of the
  optimum on every instance.
  Measured before the screen on 150 instances of this generator (seeds 0..149): 123
  exact, worst gap 23.0 %, next worst 13.8 %. With the screen, on 150 instances of the
  same kind (``random.Random(1000 + seed)`` drawing the workload): 124 exact, worst gap
  5.97 %, next 4.25 %; without it on the same instances 122 exact, worst 7.23 %. (The pass
  itself searches exhaustively when a stage has at most 4096 strategies, so on instances
  this small it is exact; the bound is the heuristic's, which it uses above that.)
  ``test_screen_within_bound_on_one_class`` puts six tensors in one class, so that the
  screen restricts three of them.
"""

from __future__ import annotations

import itertools
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from hetplan.algorithms.espresso import SelectionProblem, select
from hetplan.algorithms.espresso_tree import extended_options, options
from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.evaluate import evaluate, stage_syncs
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan import ClusterRef, ModelRef, Plan
from hetplan.ir.plan_sections import Layout, WorkloadSummary
from hetplan.ir.workload import workload_from_gradients
from hetplan.passes.base import PassContext
from hetplan.passes.espresso import Espresso, Key, _StageCosts, strategy_for

GAP_BOUND = 0.25
GAPS: list[float] = []  # every instance's gap, for reporting
_SPEC = ClusterSpec.from_preset("espresso-nvlink-8x8")
_COSTS = CostModel(_SPEC)


def _setup(numels: list[int], gaps: list[float]) -> tuple[PassContext, Plan]:
    ir = workload_from_gradients("rand", [f"t{i}" for i in range(len(numels))], numels, gaps)
    w = WorkloadSummary.from_model_ir(ir)
    layout = Layout(dp=64, micro_batch_size=w.batch_size)
    ctx = PassContext(workload=w, cluster=_SPEC, costs=_COSTS, layout=layout)
    plan = Plan(model=ModelRef(name="rand", fingerprint="0" * 16, num_params=1),
                cluster=ClusterRef.from_cluster(_SPEC, embed=False), layout=layout)
    return ctx, plan


def _time(ctx: PassContext, plan: Plan, p: Espresso) -> float:
    out = p.run(plan, ctx).plan
    return evaluate(ctx.workload, ctx.layout, out.stages, out.gradient_sync, ctx.costs,
                    check_memory=False).iteration_s


_workloads = st.integers(2, 6).flatmap(lambda n: st.tuples(
    st.lists(st.sampled_from([3_000, 60_000, 600_000, 2_400_000, 9_000_000]),
             min_size=n, max_size=n),
    st.lists(st.floats(0.0, 5_000.0), min_size=n, max_size=n)))


@settings(max_examples=12, deadline=None)
@given(_workloads, st.sampled_from(["dgc", "efsignsgd"]))
def test_more_options_never_slower(wl: tuple[list[int], list[float]], comp: str) -> None:
    ctx, plan = _setup(*wl)
    t = {m: _time(ctx, plan, Espresso(compressors=(comp, "fp16"), max_compressions=m,
                                      devices=("gpu",)))
         for m in (1, 2, 3)}
    assert t[2] <= t[1] and t[3] <= t[2], t
    fp32_only = _time(ctx, plan, Espresso(compressors=(comp,), max_compressions=1,
                                          devices=("gpu",)))
    assert t[1] <= fp32_only, (t[1], fp32_only)


def test_monotone_check_can_fail() -> None:
    """Why the seeding is needed: a greedy sweep over a wider option set ("b" only here; the
    narrower search had found "a") can end slower than the narrower choice; seeded with it,
    the wider search keeps it."""
    from hetplan.algorithms.dp_types import Op

    problem: SelectionProblem[str] = SelectionProblem(
        backprop_s=[1.0, 1.0], sizes=[1, 1], baseline=["base", "base"],
        gpu_options=[["b"], ["b"]],
        ops=lambda i, k: {"base": (Op("net", 3.0),), "a": (Op("net", 0.5),),
                          "b": (Op("net", 1.5),)}[k],
        compressed=lambda k: k != "base")
    wide = select(problem, exhaustive_limit=0)
    seeded = select(problem, exhaustive_limit=0, start=["a", "a"])
    assert seeded.iteration_s < wide.iteration_s
    assert seeded.strategy == ("a", "a")


@settings(max_examples=40, deadline=None)
@given(_workloads, st.sampled_from(["dgc", "efsignsgd", "randomk"]), st.integers(0, 10**6))
def test_search_within_bound_of_brute_force(wl: tuple[list[int], list[float]], comp: str,
                                            seed: int) -> None:
    ctx, plan = _setup(*wl)
    ss = stage_syncs(ctx.workload, ctx.layout, plan.stages, ctx.costs)[0]
    rng = random.Random(seed)
    ext = extended_options(["fp32", "fp16"],
                           base=options(devices=["gpu"], hierarchies=["hierarchical"],
                                        compress=True))
    base: Key = (None, 63, "fp32")  # hierarchical reduce-scatter / allreduce / allgather
    cands: list[Key] = [(None, 63, "fp16")] + [(comp, o, d) for o, d in rng.sample(ext, 3)]
    cache: dict[tuple[Key, float], tuple] = {}

    def ops(i: int, k: Key) -> tuple:
        nb = float(ss.nbytes[i])
        if (k, nb) not in cache:
            cache[(k, nb)] = ss.ops(strategy_for(k), nb, ctx.costs)
        return cache[(k, nb)]

    n = len(ss.grads)
    problem: SelectionProblem[Key] = SelectionProblem(
        backprop_s=ss.backprop_s, sizes=[int(b) for b in ss.nbytes], baseline=[base] * n,
        gpu_options=[cands] * n, ops=ops, compressed=lambda k: k != base,
        ops_class=[float(b) for b in ss.nbytes])
    pass_defaults = Espresso()
    # the pass's floor: its lower bound over these options (and their CPU versions)
    bound = _StageCosts(ss, ctx, pass_defaults.ratio, pass_defaults.devices).lower_bound(
        [base, *cands])
    got = select(problem, exhaustive_limit=0, seeds=[[k] * n for k in cands],
                 screen=pass_defaults.screen, seed_within=pass_defaults.seed_within,
                 floor=bound * (1.0 + pass_defaults.bound_within))
    best = min(problem.iteration_s(c) for c in itertools.product([base, *cands], repeat=n))
    gap = got.iteration_s / best - 1
    GAPS.append(gap)
    assert -1e-9 <= gap <= GAP_BOUND, (gap, got.strategy)
    if "(at the floor)" in got.method:  # stopped at the bound: within bound_within
        assert gap <= pass_defaults.bound_within + 1e-9, (gap, got.method)


@settings(max_examples=6, deadline=None)
@given(st.lists(st.floats(0.0, 5_000.0), min_size=6, max_size=6),
       st.sampled_from(["dgc", "efsignsgd"]), st.integers(0, 10**6))
def test_screen_within_bound_on_one_class(gaps: list[float], comp: str, seed: int) -> None:
    """Six tensors of one size: with ``screen=3`` the last three the sweep reaches try only
    what their class holds; the result stays within the stated bound of brute force."""
    test_search_within_bound_of_brute_force.hypothesis.inner_test(  # type: ignore[attr-defined]
        ([600_000] * 6, gaps), comp, seed)
