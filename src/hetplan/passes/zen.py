"""Pass ``zen``: a sync scheme for every sparse (embedding) gradient (thesis ch. 3).

Owns ``plan.sparse_sync``. The sparse gradients are the captured model's untied
``nn.Embedding`` / ``EmbeddingBag`` weights (:func:`hetplan.ir.sparse_grads.sparse_gradients`);
for each one, on its stage's data-parallel group:

1. **Statistics**, the first that applies, each rank looking up the ids of ``b =
   micro-batch x micro-batches`` samples per iteration:

   a. ``density`` given as an option (``zen{density=0.02}``, marked ``profiled``: the user
      measured it); ``d_G^n`` and the skew from the assumed default's ``gamma`` and skew.
   b. A :class:`~hetplan.cost_models.profile_db.SparsityRecord` of the profile DB (``hetplan
      profile --sparsity``) for this model, this gradient and ``n`` = the stage's data-
      parallel degree, with the table's row count, measured at the batch nearest ``b``
      (marked ``profiled``). Measured at another batch ``b'``, each statistic is scaled by the
      analytic Zipf model's ratio between the two batches (``zipf_stats`` at ``b`` over at
      ``b'``, with the record's Zipf exponent), and the pass note says so.
   c. The documented default, marked ``assumed``: Zipf(1) ids,
      ``lookups_per_sample x b`` of them per rank
      (:func:`hetplan.algorithms.zen.zipf_stats`, which also gives ``d_G^n`` and the skew
      for the group size).
2. **Scheme.** Each executable scheme (dense all-reduce, AGsparse, Zen) is priced with the
   evaluator's own ops (:func:`hetplan.cost_models.sparse.scheme_seconds`); ``mode=auto``
   takes the fastest (ties: dense), ``mode=zen`` takes Zen for every sparse gradient.
3. **Guard.** In ``auto`` mode the whole plan is scored with ``evaluate`` with and without the
   section; if the sparse schemes are not predicted faster (they may hide less behind
   backprop than the dense unit did), every tensor is set back to ``dense``.

The pass runs after the gradient-sync passes (Espresso, Cupcake): a tensor it syncs leaves
their section's path in the evaluator and the runtime (it is taken out of its bucket), so
whatever they chose for it is not executed. Embeddings under tensor parallelism (vocab-
parallel shards) are left dense, and so is every sparse gradient under ZeRO-2/3 (they are
reduce-scattered during backward; the schemes need the full gradient). Hash seeds come from
the plan's seed. Cost: one
``stage_syncs`` and two ``evaluate`` calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from hetplan.algorithms.zen import SparseStats, zipf_stats
from hetplan.cost_models.evaluate import evaluate, stage_syncs
from hetplan.cost_models.sparse import scheme_seconds
from hetplan.errors import SpecError
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sparse import SparseStatsRecord, SparseSync, SparseTensorSync
from hetplan.ir.sparse_grads import SparseGrad, sparse_gradients
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
        if lay.schedule == "chimera" and lay.pp > 1:  # what the runtime composes
            return PassResult(plan, False, (
                "schedule 'chimera': a stage's gradients are averaged over the 2·dp ranks "
                "holding a copy, which the sparse schemes do not model: left dense",))
        if lay.dp > 1 and lay.zero_stage >= 2:  # what the runtime composes (composition.py)
            return PassResult(plan, False, (
                f"ZeRO-{lay.zero_stage} reduce-scatters every gradient during backward and "
                "the sparse schemes need the full gradient (zero_stage <= 1): left dense",))
        grad_index = {g.name: i for i, g in enumerate(ctx.workload.grads)}
        group = {i: ss for ss in stage_syncs(ctx.workload, lay, plan.stages, ctx.costs)
                 for i in ss.grads}
        samples = lay.micro_batch_size * lay.micro_batches
        entries: list[SparseTensorSync] = []
        notes: list[str] = []
        for sg in found:
            ss = group.get(grad_index.get(sg.name, -1))
            if ss is None:
                continue
            stats = zipf_stats(sg.rows, sg.row_elems, max(1, round(sg.lookups_per_sample
                                                                   * samples)), lay.dp,
                               ZIPF_ALPHA)
            source: Literal["profiled", "assumed"] = "assumed"
            measured = None if self.density > 0 else _profiled(sg, samples, ctx, notes)
            if self.density > 0:
                gamma = stats.gamma
                stats = type(stats)(sg.rows, sg.row_elems, self.density,
                                    min(1.0, self.density * gamma), stats.skew)
                source = "profiled"
            elif measured is not None:
                stats, source = measured, "profiled"
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


def _profiled(sg: SparseGrad, samples: int, ctx: PassContext,
              notes: list[str]) -> SparseStats | None:
    """``sg``'s statistics from the profile DB's sparsity record at ``n = dp``, scaled to
    ``samples`` per rank (module docstring, step 1b), or None; appends what it did to
    ``notes``."""
    db, ir, n = ctx.costs.db, ctx.model_ir, ctx.layout.dp
    if db is None or ir is None:
        return None
    rec = db.sparsity_record(ir.name, sg.name, n, samples)
    if rec is None:
        have = sorted({r.workers for r in db.sparsity
                       if (r.model, r.gradient) == (ir.name, sg.name)})
        if have:
            notes.append(f"{sg.name}: profiled on n={have} workers, not n={n}: assumed "
                         f"(re-profile with --workers {n})")
        return None
    if rec.rows != sg.rows:
        notes.append(f"{sg.name}: the sparsity record has {rec.rows} rows, the model "
                     f"{sg.rows}: assumed (re-profile the model)")
        return None
    d, dn, skew = rec.density, rec.density_n, rec.skew
    if rec.batch_size != samples:
        alpha = rec.zipf_alpha if rec.zipf_alpha is not None else ZIPF_ALPHA
        at = zipf_stats(sg.rows, sg.row_elems,
                        max(1, round(sg.lookups_per_sample * rec.batch_size)), n, alpha)
        to = zipf_stats(sg.rows, sg.row_elems,
                        max(1, round(sg.lookups_per_sample * samples)), n, alpha)
        rd, rdn, rs = to.density / at.density, to.density_n / at.density_n, to.skew / at.skew
        d = min(1.0, d * rd)
        dn = min(1.0, max(d, dn * rdn))
        skew = max(1.0, skew * rs)
        notes.append(f"{sg.name}: profiled at batch {rec.batch_size} per rank ({rec.data} "
                     f"data, {rec.steps} steps), scaled to batch {samples} by the Zipf"
                     f"({alpha:g}) model's ratios: d x{rd:.3f}, d^n x{rdn:.3f}, skew x{rs:.3f}")
    return SparseStats(sg.rows, sg.row_elems, d, dn, skew)
