"""Gradient-sync paths checked for what they compute (hetplan.ir.sync_paths): every path the
planner can emit passes; paths that sum twice, or leave ranks without the whole sum, are
refused with the step and the fix. The plan-level refusals (field path, ``hetplan validate``
exit 2) are in ``test_plan_checks.py``."""

from __future__ import annotations

import itertools

import pytest

from hetplan.algorithms.espresso_tree import (
    all_options,
    extended_options,
    is_compressed,
    options,
)
from hetplan.ir.plan_sections import CastSync, CommStep, CompressedSync, NoSync
from hetplan.ir.sync_paths import path_problems
from hetplan.passes.espresso import strategy_for


def flat(*routines: str) -> NoSync:
    return NoSync(steps=tuple(CommStep(routine=r) for r in routines))  # type: ignore[arg-type]


def hier(*steps: str) -> NoSync:
    """``hier("intra reduce_scatter", "inter allreduce", ...)``."""
    return NoSync(hierarchy="hierarchical", steps=tuple(
        CommStep(level=s.split()[0], routine=s.split()[1])  # type: ignore[arg-type]
        for s in steps))


def topk(*steps: tuple[str, bool]) -> CompressedSync:
    return CompressedSync(compressor="topk", params={"ratio": 0.01}, steps=tuple(
        CommStep(routine=r, compressed=c) for r, c in steps))  # type: ignore[arg-type]


def test_the_options_cover_the_whole_tree() -> None:
    """Every filter of the tree the planner asks for is a part of ``all_options``."""
    seen: set[object] = set()
    for hierarchies, compress, devices, most in itertools.product(
            (("flat",), ("hierarchical",), ("flat", "hierarchical")), (None, True, False),
            (("gpu",), ("cpu",), ("gpu", "cpu")), range(5)):
        seen.update(options(devices=devices, hierarchies=hierarchies, max_compressions=most,
                            compress=compress))
    assert seen == set(all_options())


@pytest.mark.slow
def test_every_path_the_planner_can_emit_passes() -> None:
    """The extended tree as ``strategy_for`` makes it strategies (NoSync, CastSync, and
    CompressedSync with fp32/fp16/bf16 uncompressed steps), the older fp16 cast of any path,
    and each compressed option's steps without its actions (``path_of`` derives comp and
    decomp): none is refused."""
    refused = []
    for oid, dtype in extended_options():
        compressed = is_compressed(all_options()[oid])
        strategies = [strategy_for(("topk" if compressed else None, oid, dtype))]
        if compressed and dtype == "fp32":
            strategies.append(strategy_for(("fp16", oid)))
            strategies.append(strategies[0].model_copy(update={"actions": ()}))
        refused += [(oid, dtype, type(s).__name__, p) for s in strategies
                    for p in path_problems(s)]
    assert refused == []


@pytest.mark.parametrize("strategy", [
    NoSync(), CastSync(), CastSync(dtype="bf16"), CompressedSync(compressor="topk"),
    flat("reduce_scatter", "allgather"), flat("reduce", "broadcast"),
    hier("intra reduce_scatter", "inter allreduce", "intra allgather"),
    hier("intra reduce", "inter allreduce", "intra broadcast"),
    hier("intra allreduce", "inter allreduce"), hier("inter allreduce", "intra allreduce"),
    hier("intra reduce_scatter", "inter reduce", "inter broadcast", "intra allgather"),
    topk(("alltoall", True), ("allgather", True)), topk(("gather", True), ("broadcast", True)),
    topk(("reduce_scatter", False), ("allgather", True)),
], ids=repr)
def test_right_paths_pass(strategy: NoSync | CastSync | CompressedSync) -> None:
    assert path_problems(strategy) == []


@pytest.mark.parametrize(("strategy", "expected"), [
    (flat("allreduce", "allreduce"), "reduces the flat level twice (steps 0 and 1): each "
     "rank's gradient must be summed once"),
    (flat("allreduce", "allreduce", "allreduce"), "reduces the flat level 3 times (steps 0, 1 "
     "and 2)"),
    (flat("reduce_scatter", "allgather", "allreduce"), "reduces the flat level twice"),
    (flat("reduce"), "does not end with the whole aggregated tensor on every rank: the reduce "
     "at step 0 (flat) leaves the sum on the group's first rank only, and no broadcast"),
    (flat("reduce_scatter"), "does not end with the whole aggregated tensor on every rank: the "
     "reduce_scatter at step 0 (flat) leaves each rank one shard of the sum"),
    (flat("broadcast"), "step 0 (flat broadcast): an uncompressed broadcast must close a "
     "reduce at the same level, and none is open"),
    (flat("allgather"), "step 0 (flat allgather): an uncompressed allgather must close a "
     "reduce_scatter"),
    (flat("broadcast", "allreduce"), "must close a reduce"),
    (flat("reduce", "allgather"), "the step 1 open at flat is the reduce at step 0, which a "
     "broadcast closes"),
    (flat("reduce_scatter", "allreduce", "allgather"), "step 1 (flat allreduce): runs while "
     "the ranks of its flat group hold different parts of the tensor (the reduce_scatter at "
     "step 0 is still open"),
    (hier("intra allreduce"), "never reduces across the inter level: the gradients of the "
     "ranks on other nodes are missing"),
    (hier("inter allreduce"), "never reduces across the intra level"),
    (hier("intra reduce_scatter", "inter allreduce", "inter allreduce", "intra allgather"),
     "reduces the inter level twice (steps 1 and 2)"),
    (hier("intra allreduce", "inter allreduce", "intra allreduce"),
     "reduces the intra level twice (steps 0 and 2)"),
    (hier("intra reduce", "inter allreduce", "intra allreduce"), "step 2 (intra allreduce): "
     "runs while the ranks of its intra group hold different parts"),
    (hier("intra reduce", "inter reduce", "intra broadcast", "inter broadcast"), "the reduce "
     "at step 1 (inter), opened after it, is not closed yet: close it first with a broadcast "
     "at inter"),
    (topk(("allgather", True), ("allgather", True)), "reduces the flat level twice"),
    (topk(("allgather", True), ("allreduce", False)), "reduces the flat level twice"),
    (topk(("gather", True), ("allgather", True)), "the gather at step 0 is still open"),
    (topk(("alltoall", True)), "the alltoall at step 0 (flat) leaves each rank one shard"),
    (NoSync(steps=(CommStep(routine="allgather", compressed=True),)), "compressed steps in a "
     "strategy of kind 'none' (no compressor)"),
], ids=repr)
def test_wrong_paths_are_refused_with_the_step_and_the_fix(
        strategy: NoSync | CastSync | CompressedSync, expected: str) -> None:
    problems = path_problems(strategy)
    assert len(problems) == 1 and expected in problems[0], problems
    assert "; " in problems[0]  # what is wrong; the fix
