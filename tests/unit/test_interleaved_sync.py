"""Interleaved stages: the chunks a rank holds sync through the same links.

A rank of an interleaved layout holds ``virtual_stages`` chunks; each chunk's data-parallel
group is the same ranks, on the same NICs. After the pipeline flush (Megatron-LM before its
overlapped reduce) the rank all-reduces its chunks one after another, so with one flat
bucket per chunk the rank's sync takes the sum of what each chunk's sync takes alone (each
chunk's own timeline, which the evaluation records beside the rank's)."""

from __future__ import annotations

import pytest

from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.evaluate import SyncScorer, evaluate
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import (
    Bucket,
    ClusterRef,
    GradCost,
    GradientSync,
    LayerCost,
    Layout,
    ModelRef,
    NoSync,
    WorkloadSummary,
)
from hetplan.passes.base import PassContext
from hetplan.passes.manager import run_passes
from hetplan.passes.spec import parse_pipeline

MB = 10**6


def _workload(grad_mb: int, layers: int = 4) -> WorkloadSummary:
    lay = [LayerCost(name=f"l{i}", kind="other", fwd_flops=10**11, bwd_flops=2 * 10**11,
                     param_bytes=grad_mb * MB, act_saved_bytes=MB)
           for i in range(layers)]
    grads = [GradCost(name=f"l{i}.w", size_bytes=grad_mb * MB, layer_index=i)
             for i in reversed(range(layers))]
    return WorkloadSummary(batch_size=4, layers=tuple(lay), grads=tuple(grads))


def _setup(overlap: str, grad_mb: int = 50) -> tuple[WorkloadSummary, Layout, Plan, CostModel]:
    wl = _workload(grad_mb)
    spec = ClusterSpec.from_preset("a100-nvlink-8x8")
    costs = CostModel(spec, dtype="fp32", dp_overlap=overlap)  # type: ignore[arg-type]
    # dp=32 over 8 nodes: each stage's data-parallel group crosses the nodes' NICs
    layout = Layout(dp=32, pp=2, micro_batches=4, micro_batch_size=1,
                    schedule="interleaved-1f1b", virtual_stages=2)
    ctx = PassContext(workload=wl, cluster=spec, costs=costs, layout=layout)
    plan = Plan(model=ModelRef(name="four", fingerprint="f", num_params=1),
                cluster=ClusterRef.from_cluster(spec), layout=layout)
    plan = run_passes(plan, parse_pipeline("uniform-stages,even-tp"), ctx)
    assert len(plan.stages) == 4 and all(st.first_layer == st.last_layer for st in plan.stages)
    return wl, layout, plan, costs


def _sync(layers: list[int], grad_mb: int = 50) -> GradientSync:
    return GradientSync(strategies={"fp32": NoSync()}, buckets=tuple(
        Bucket(tensors=(f"l{i}.w",), size_bytes=grad_mb * MB, strategy="fp32")
        for i in layers))


def test_after_the_flush_a_ranks_chunks_sync_one_after_another() -> None:
    wl, layout, plan, costs = _setup("after-flush")
    both = evaluate(wl, layout, plan.stages, _sync([0, 1, 2, 3]), costs, check_memory=False,
                    record=True)
    ends = both.pipeline.stage_bwd_end_ms
    for rank in range(layout.pp):
        a, b = rank, rank + layout.pp  # stage s holds layer s; the rank holds stages a, b
        assert plan.stages[a].ranks == plan.stages[b].ranks
        alone = [both.dp_timelines[s].iteration_s for s in (a, b)]  # type: ignore[union-attr]
        assert min(alone) > 0.005  # 50 MB over the NICs: milliseconds
        last = max((a, b), key=lambda s: ends[s])
        # the rank's sync: both buckets after its last backward, one after the other
        assert both.stages[last].exposed_sync_s == pytest.approx(sum(alone))
    # the iteration: the latest rank's backward end + its two syncs + the step
    want = max(ends[s] * 1e-3 + both.stages[s].exposed_sync_s for s in range(4))
    assert both.iteration_s == pytest.approx(want + both.optimizer_s)
    assert both.exposed_comm_s == pytest.approx(max(
        both.stages[s].exposed_sync_s for s in range(4)))


def test_overlapped_sync_waits_for_the_ranks_other_chunk() -> None:
    """Overlapped with backward, a chunk's sync can start only when the link has finished
    the rank's earlier chunk: with 400 MB a chunk, the earlier chunk's sync still holds the
    link when the later one's gradient is ready, so the rank finishes later than either
    chunk alone, and no later than both syncs back to back after its last backward."""
    wl, layout, plan, costs = _setup("backward", grad_mb=400)
    both = evaluate(wl, layout, plan.stages, _sync([0, 1, 2, 3], 400), costs,
                    check_memory=False, record=True)
    ends = [e * 1e-3 for e in both.pipeline.stage_bwd_end_ms]
    for rank in range(layout.pp):
        a, b = rank, rank + layout.pp
        first, last = sorted((a, b), key=lambda s: ends[s])
        tl = {s: both.dp_timelines[s] for s in (a, b)}
        busy = {s: tl[s].busy_s["net"] for s in (a, b)}  # type: ignore[union-attr]
        alone = {s: ends[s] + tl[s].iteration_s - both.stages[s].bwd_s  # type: ignore[union-attr]
                 for s in (a, b)}
        assert alone[first] > ends[last]  # the first still syncs when the last is ready
        finish = ends[last] + both.stages[last].exposed_sync_s
        assert finish > max(alone.values()) + 0.1 * busy[last]
        assert finish <= ends[last] + busy[a] + busy[b] + 1e-12


@pytest.mark.parametrize("overlap", ["after-flush", "backward"])
def test_scorer_equals_evaluate_on_interleaved_stages(overlap: str) -> None:
    wl, layout, plan, costs = _setup(overlap)
    scorer = SyncScorer(wl, layout, plan.stages, costs)
    for layers in ([0, 1, 2, 3], [0, 2], [1], [3, 1]):
        want = evaluate(wl, layout, plan.stages, _sync(layers), costs,
                        check_memory=False).iteration_s
        assert scorer.iteration_s(_sync(layers)) == want
