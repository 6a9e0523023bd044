"""Pass ``zen``: a sync scheme for every sparse (embedding) gradient (thesis ch. 3).

Owns ``plan.sparse_sync``. The sparse gradients are the captured model's untied
``nn.Embedding`` / ``EmbeddingBag`` weights (:func:`hetplan.ir.sparse_grads.sparse_gradients`);
for each one, on its stage's data-parallel group:

1. **Statistics.** ``density`` given as an option (``zen{density=0.02}``, marked profiled:
   the user measured it, e.g. with ``hetplan profile --sparsity``), else the documented
   default, marked ``assumed``: every rank looks up ``lookups_per_sample x micro-batch x
   micro-batches`` Zipf(1) ids per iteration (:func:`hetplan.algorithms.zen.zipf_stats`,
   which also gives ``d_G^n`` and the skew for the group size).
2. **Scheme.** Each executable scheme (dense all-reduce, AGsparse, Zen) is priced with the
   evaluator's own ops (:func:`hetplan.cost_models.sparse.scheme_seconds`); ``mode=auto``
   takes the fastest (ties: dense), ``mode=zen`` takes Zen for every sparse gradient.
3. **Guard.** In ``auto`` mode the whole plan is scored with ``evaluate`` with and without the
   section; if the sparse schemes are not predicted faster (they may hide less behind
   backprop than the dense unit did), every tensor is set back to ``dense``.

The pass runs after the gradient-sync passes (Espresso, Cupcake): a tensor it syncs leaves
their section's path in the evaluator and the runtime (it is taken out of its bucket), so
whatever they chose for it is not executed. Embeddings under tensor parallelism (vocab-
parallel shards) are left dense. Hash seeds come from the plan's seed. Cost: one
``stage_syncs`` and two ``evaluate`` calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from hetplan.algorithms.zen import zipf_stats
from hetplan.cost_models.evaluate import evaluate, stage_syncs
from hetplan.cost_models.sparse import scheme_seconds
from hetplan.errors import SpecError
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sparse import SparseStatsRecord, SparseSync, SparseTensorSync
from hetplan.ir.sparse_grads import sparse_gradients
from hetplan.passes.base import PassContext, PassResult

__all__ = ["Zen", "ZIPF_ALPHA"]

#: Zipf exponent of the assumed token distribution (natural-language token frequencies).
ZIPF_ALPHA = 1.0


@dataclass(frozen=True)
class Zen:
    """Choose each sparse gradient's sync scheme (see module docstring).

    Attributes:
        mode: ``auto`` (fastest predicted of dense / AGsparse / Zen) or ``zen`` (always Zen).
        density: measured per-rank density ``d_G`` of every sparse gradient (0: assume it).
        pull: Zen's pull format, ``bitmap`` (hash bitmap + values) or ``coo``.
        hash_k: slot hash functions of Algorithm 3.2.
    """

    mode: str = "auto"
    density: float = 0.0
    pull: str = "bitmap"
    hash_k: int = 3
    name: ClassVar[str] = "zen"
    sections: ClassVar[tuple[str, ...]] = ("sparse_sync",)
    refines: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "zen"):
            raise SpecError(f"zen: mode must be 'auto' or 'zen', got {self.mode!r}")
        if not 0.0 <= self.density <= 1.0:
            raise SpecError(f"zen: density must be in (0, 1] (0: assume it), got "
                            f"{self.density!r}")
        if self.pull not in ("bitmap", "coo"):
            raise SpecError(f"zen: pull must be 'bitmap' or 'coo', got {self.pull!r}")
        if not 1 <= self.hash_k <= 16:
            raise SpecError(f"zen: hash-k must be in [1, 16], got {self.hash_k!r}")

    def run(self, plan: Plan, ctx: PassContext) -> PassResult:
        if ctx.model_ir is None:
            return PassResult(plan, False, ("no captured model: sparse gradients unknown",))
        found = sparse_gradients(ctx.model_ir)
        if not found:
            return PassResult(plan, False, ("no sparse (untied embedding) gradients",))
        lay = ctx.layout
        if lay.dp <= 1:
            return PassResult(plan, False, ("no data-parallel gradient sync (dp = 1)",))
        if lay.tp > 1:
            return PassResult(plan, False, ("tensor parallelism shards the embeddings "
                                            "(vocab-parallel): left dense",))
        grad_index = {g.name: i for i, g in enumerate(ctx.workload.grads)}
        group = {i: ss for ss in stage_syncs(ctx.workload, lay, plan.stages, ctx.costs)
                 for i in ss.grads}
        tokens = lay.micro_batch_size * lay.micro_batches
        entries, notes = [], []
        for sg in found:
            ss = group.get(grad_index.get(sg.name, -1))
            if ss is None:
                continue
            stats = zipf_stats(sg.rows, sg.row_elems, max(1, round(sg.lookups_per_sample
                                                                   * tokens)), lay.dp,
                               ZIPF_ALPHA)
            source: Literal["profiled", "assumed"] = "assumed"
            if self.density > 0:
                gamma = stats.gamma
                stats = type(stats)(sg.rows, sg.row_elems, self.density,
                                    min(1.0, self.density * gamma), stats.skew)
                source = "profiled"
            rec = SparseStatsRecord(density=stats.density, density_n=stats.density_n,
                                    skew=stats.skew, source=source)
            entry = SparseTensorSync(name=sg.name, rows=sg.rows, row_elems=sg.row_elems,
                                     stats=rec, scheme="zen", pull=self.pull,  # type: ignore
                                     hash_k=self.hash_k, seed=ctx.seed)
            dev = ctx.costs.devices[ss.stage.ranks[0]]
            times = scheme_seconds(entry, lay.dp, ctx.costs, dev, ss.link)
            order = ("dense", "agsparse", "zen")
            scheme = "zen" if self.mode == "zen" else min(order, key=lambda s: (times[s],
                                                                                 order.index(s)))
            entries.append(entry.model_copy(update={
                "scheme": scheme, "dense_ms": round(times["dense"] * 1e3, 6),
                "predicted_ms": round(times[scheme] * 1e3, 6)}))
            notes.append(f"{sg.name}: {sg.rows}x{sg.row_elems}, d={stats.density:.4f} "
                         f"({source}), d^n={stats.density_n:.4f}, skew={stats.skew:.2f}: "
                         f"{scheme} {times[scheme] * 1e3:.3f} ms vs dense "
                         f"{times['dense'] * 1e3:.3f} ms")
        if not entries:
            return PassResult(plan, False, ("sparse gradients not synced by any stage",))
        section = SparseSync(mode=self.mode, tensors=tuple(entries))  # type: ignore[arg-type]
        if self.mode == "auto" and section.synced():
            mine = self._iteration_s(plan, ctx, section)
            dense = self._iteration_s(plan, ctx, None)
            if mine >= dense - 1e-12:
                section = SparseSync(mode="auto", tensors=tuple(
                    e.model_copy(update={"scheme": "dense", "predicted_ms": e.dense_ms})
                    for e in entries))
                notes.append(f"kept dense: sparse schemes predicted {mine * 1e3:.3f} ms per "
                             f"iteration vs {dense * 1e3:.3f} ms dense")
        return PassResult(plan.model_copy(update={"sparse_sync": section}), True, tuple(notes))

    @staticmethod
    def _iteration_s(plan: Plan, ctx: PassContext, section: SparseSync | None) -> float:
        return evaluate(ctx.workload, ctx.layout, plan.stages, plan.gradient_sync, ctx.costs,
                        check_memory=False, tensor_parallel=plan.tensor_parallel,
                        sparse_sync=section).iteration_s
