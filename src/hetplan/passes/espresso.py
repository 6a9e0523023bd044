"""Pass ``espresso``: a gradient-compression strategy per gradient tensor (thesis ch. 4).

Owns ``plan.gradient_sync``. For each pipeline stage's data-parallel group the pass lists every
tensor's candidate options — the decision tree's paths (:mod:`hetplan.algorithms.espresso_tree`)
for each allowed compressor, the uncompressed routings (flat allreduce, reduce-scatter /
allgather, reduce / broadcast, and the hierarchical ones when the group spans several nodes with
several ranks each), and fp16/bf16 casts of those routings when allowed — and chooses one per
tensor with :func:`hetplan.algorithms.espresso.select` (Algorithms 4.1 and 4.2), scoring with
the ops and backprop segments :func:`~hetplan.cost_models.evaluate.evaluate` uses.

Output: ``strategies`` (``fp32`` is the flat fp32 allreduce; others are named
``<compressor>#<option_id>``, where ``option_id`` indexes the tree's canonical enumeration and
``fp32#<id>`` is an uncompressed routing), ``tensors`` in backward-ready order with each tensor's
``predicted_benefit_ms``, and no buckets (the fusion pass buckets tensors sharing a strategy).

Decisions (also in ``docs/decisions.md``):

- **Opt-in compression.** Compressors come from the pass option ``compressors``
  (``espresso{compressors=dgc,fp16}`` in a pipeline spec; ``compile(compressors=...)`` and
  ``hetplan plan --compress`` set it on the pipeline's espresso pass). By
  default none: lossy compression (and even an fp16/bf16 cast, which rounds gradients) changes
  what training computes, so the user must ask for it. Without compressors the pass only
  picks the best uniform fp32 routing (flat allreduce, reduce-scatter/allgather,
  reduce/broadcast, hierarchical variants) — cheap enough to run for every layout — and,
  when the incoming sync has buckets (DDP), keeps them and only changes their routing.
- **Sparsifier ratio** 0.01 (the thesis' 99 % sparsity); error feedback on.
- **Never slower than what it was given.** If the incoming ``gradient_sync`` (e.g. DDP buckets)
  is predicted faster than the chosen per-tensor strategies, it is kept, with a note.
- **Seeds.** Every uniform strategy (all tensors on one candidate option, or on its CPU-offloaded
  version) is scored too, so the result is never predicted slower than the best uniform
  compression; the note says which won.
- **No mixing of flat and hierarchical paths in one group** (§H.6, open in the thesis): the
  simulator gives flat and inter-node steps separate channels although they share the
  network, so mixing would be predicted too optimistically. The pass selects among flat
  options and among hierarchical ones (when the group spans several nodes with several ranks
  each) and keeps the faster. Algorithm 4.1's "no compression" start is the fastest uniform
  fp32 routing *of that hierarchy* (e.g. hierarchical reduce-scatter / allreduce /
  allgather), not the flat allreduce, for the same reason.
- Options are pruned to at most ``max_compressions`` compressions per tensor (default 4: no
  limit) and to the allowed ``devices`` (default GPU and CPU).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import ClassVar, Literal

from hetplan.algorithms.dp_types import Op
from hetplan.algorithms.espresso import Selection, SelectionProblem, select
from hetplan.algorithms.espresso_tree import (
    Option,
    all_options,
    offloaded,
    option_id,
    options,
)
from hetplan.cost_models.compression import COMPRESSORS, DEFAULT_SPARSITY_RATIO
from hetplan.cost_models.evaluate import StageSync, SyncScorer, evaluate, stage_syncs
from hetplan.errors import SpecError
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import (
    CastSync,
    CommStep,
    CompressedSync,
    GradientSync,
    NoSync,
    PathAction,
    SyncStrategy,
    TensorSync,
)
from hetplan.ir.validation import did_you_mean
from hetplan.passes.base import PassContext, PassResult

__all__ = ["Espresso", "strategy_for", "strategy_name", "check_compressors"]

#: A candidate: (compressor or None for fp32, option id in the tree).
Key = tuple[str | None, int]
_CASTS = ("fp16", "bf16")
_SPARSIFIERS = ("topk", "randomk", "dgc")


def check_compressors(names: tuple[str, ...]) -> tuple[str, ...]:
    """Validate compressor names; returns them sorted and de-duplicated.

    Raises:
        SpecError: an unknown name (with the known ones and a suggestion).
    """
    for n in names:
        if n not in COMPRESSORS:
            raise SpecError(
                f"unknown compressor {n!r}{did_you_mean(n, COMPRESSORS)} (known: "
                f"{', '.join(COMPRESSORS)})"
            )
    return tuple(sorted(set(names)))


def strategy_name(key: Key) -> str:
    """``fp32`` for the flat fp32 allreduce, else ``<compressor or fp32>#<option_id>``."""
    comp, oid = key
    return "fp32" if key == (None, 0) else f"{comp or 'fp32'}#{oid}"


def _steps(option: Option) -> tuple[CommStep, ...]:
    return tuple(CommStep(level=a.level, routine=a.routine,  # type: ignore[arg-type]
                          compressed=a.compressed_comm)
                 for a in option if a.routine is not None)


def strategy_for(key: Key, ratio: float = DEFAULT_SPARSITY_RATIO) -> SyncStrategy:
    """The plan strategy of a candidate ``key``."""
    comp, oid = key
    option = all_options()[oid]
    hierarchy: Literal["flat", "hierarchical"] = (
        "hierarchical" if option[0].level != "flat" else "flat")
    if comp is None:
        return NoSync(hierarchy=hierarchy, steps=_steps(option))
    if comp in _CASTS:
        return CastSync(hierarchy=hierarchy, steps=_steps(option), dtype=comp)  # type: ignore[arg-type]
    actions = tuple(PathAction(task=a.task, level=a.level, routine=a.routine,  # type: ignore[arg-type]
                               device=a.device)  # type: ignore[arg-type]
                    for a in option)
    first = next(a.device for a in option if a.task == "comp")
    last = next(a.device for a in reversed(option) if a.task == "decomp")
    params: dict[str, bool | int | float | str] = (
        {"ratio": ratio} if comp in _SPARSIFIERS else {}
    )
    return CompressedSync(hierarchy=hierarchy, steps=_steps(option), actions=actions,
                          option_id=oid, compressor=comp, params=params,
                          compress_device=first, decompress_device=last)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Espresso:
    """Per-tensor compression options chosen by Espresso's decision algorithm.

    Attributes:
        compressors: allowed compressors (none by default: compression is opt-in).
        devices: where (de)compression may run.
        max_compressions: at most this many compressions per tensor.
        ratio: fraction of elements the sparsifiers keep.
        uniform_seeds: also score every uniform strategy (see module docstring).
    """

    compressors: tuple[str, ...] = ()
    devices: tuple[str, ...] = ("gpu", "cpu")
    max_compressions: int = 4
    ratio: float = DEFAULT_SPARSITY_RATIO
    uniform_seeds: bool = True
    name: ClassVar[str] = "espresso"
    sections: ClassVar[tuple[str, ...]] = ("gradient_sync",)

    def __post_init__(self) -> None:
        check_compressors(self.compressors)

    @property
    def refines(self) -> bool:
        """A refinement (run on compile's finalists only) when compressors are allowed: the
        option search is then expensive; choosing the fp32 routing alone is cheap and can
        change which layout wins, so every layout gets it."""
        return bool(self.compressors)

    def run(self, plan: Plan, ctx: PassContext) -> PassResult:
        allowed = check_compressors(self.compressors)
        syncs = stage_syncs(ctx.workload, ctx.layout, plan.stages, ctx.costs)
        if not syncs:
            return PassResult(plan, False, ("no data-parallel gradient sync (dp = 1)",))
        if allowed and ctx.layout.zero_stage >= 2:
            # ZeRO-2/3 reduce-scatter gradients during backward; compression applies with
            # zero_stage <= 1 (docs/decisions.md, "Strategy space")
            res = dataclasses.replace(self, compressors=()).run(plan, ctx)
            note = (f"compressors {', '.join(allowed)} not used: ZeRO-{ctx.layout.zero_stage} "
                    "shards gradients during backward (compression needs zero_stage <= 1)")
            return dataclasses.replace(res, notes=(note, *res.notes))
        if not allowed and plan.gradient_sync is not None and plan.gradient_sync.buckets:
            return self._route_buckets(plan, ctx, syncs)
        strategies: dict[str, SyncStrategy] = {}
        chosen: dict[int, tuple[Key, float]] = {}
        notes = [f"compressors allowed: {', '.join(allowed) or 'none (fp32 routings only)'}"]
        for ss in syncs:
            sel, keys = self._select_stage(ss, ctx, allowed)
            for i, key, benefit in zip(ss.grads, sel.strategy, sel.benefit_s):
                chosen[i] = (key, benefit)
                strategies.setdefault(strategy_name(key), strategy_for(key, self.ratio))
            notes.append(
                f"stage {ss.stage.index}: {len(ss.grads)} tensors, {keys} candidate options, "
                f"{sum(1 for k in sel.strategy if k[0] not in (None,) + _CASTS)} compressed, "
                f"{sum(1 for k in sel.strategy if k[0] in _CASTS)} cast; predicted sync "
                f"{sel.iteration_s * 1e3:.3f} ms vs {sel.baseline_s * 1e3:.3f} ms fp32 "
                f"({sel.method}, {sel.evaluations} simulations)"
            )
        tensors = tuple(
            TensorSync(name=ctx.workload.grads[i].name, strategy=strategy_name(k),
                       predicted_benefit_ms=round(b * 1e3, 6) + 0.0)
            for i, (k, b) in sorted(chosen.items())
        )
        sync = GradientSync(strategies=dict(sorted(strategies.items())), tensors=tensors)
        if plan.gradient_sync is not None:
            mine = self._iteration_s(plan, ctx, sync)
            theirs = self._iteration_s(plan, ctx, plan.gradient_sync)
            if theirs < mine - 1e-12:
                notes.append(f"kept the incoming gradient sync: {theirs * 1e3:.3f} ms < "
                             f"{mine * 1e3:.3f} ms per-tensor")
                return PassResult(plan, False, tuple(notes))
        return PassResult(plan.model_copy(update={"gradient_sync": sync}), True, tuple(notes))

    def _route_buckets(self, plan: Plan, ctx: PassContext, syncs: list[StageSync]) -> PassResult:
        """No compressors: keep the incoming buckets and give them the fastest fp32 routing.

        Every routing is scored by a :class:`SyncScorer` of the plan: the numbers of
        ``evaluate`` bit for bit, with the stage times and the pipeline computed once, and a
        routing whose lower bound (communication alone, each channel FIFO) is not below the
        best so far is not simulated: it could not replace it. Only the chosen routing's
        section is built."""
        incoming = plan.gradient_sync
        assert incoming is not None
        hier = ["flat"]
        if any(ss.nodes > 1 and ss.per_node > 1 for ss in syncs):
            hier.append("hierarchical")
        scorer = SyncScorer(ctx.workload, ctx.layout, plan.stages, ctx.costs)
        best: tuple[float, SyncStrategy | None, str] = (
            scorer.iteration_s(incoming), None, "incoming")
        for o in options(hierarchies=hier, compress=False):
            key: Key = (None, option_id(o))
            strategy = strategy_for(key)
            # a routing whose lower bound is not below the best so far cannot win
            f = scorer.rerouted_s(incoming, strategy, below=best[0] - 1e-12)
            if f < best[0] - 1e-12:
                best = (f, strategy, strategy_name(key))
        note = (f"compressors allowed: none; buckets kept, routing {best[2]} "
                f"({best[0] * 1e3:.3f} ms predicted)")
        if best[1] is None:
            return PassResult(plan, False, (note,))
        name = best[2]
        sync = GradientSync(
            strategies={name: best[1]},
            buckets=tuple(b.model_copy(update={"strategy": name}) for b in incoming.buckets),
        )
        return PassResult(plan.model_copy(update={"gradient_sync": sync}), True, (note,))

    @staticmethod
    def _iteration_s(plan: Plan, ctx: PassContext, sync: GradientSync) -> float:
        return evaluate(ctx.workload, ctx.layout, plan.stages, sync, ctx.costs,
                        check_memory=False).iteration_s

    def _candidates(self, hier: list[str], allowed: tuple[str, ...]) -> list[Key]:
        out: list[Key] = []
        routings = options(hierarchies=hier, compress=False)
        out += [(None, option_id(o)) for o in routings]
        for c in allowed:
            if c in _CASTS:
                out += [(c, option_id(o)) for o in routings]
        lossy = options(devices=["gpu"], hierarchies=hier, compress=True,
                        max_compressions=self.max_compressions)
        for c in allowed:
            if c not in _CASTS:
                out += [(c, option_id(o)) for o in lossy]
        return out

    def _select_stage(
        self, ss: StageSync, ctx: PassContext, allowed: tuple[str, ...]
    ) -> tuple[Selection[Key], int]:
        if "gpu" not in self.devices and any(c not in _CASTS for c in allowed):
            raise SpecError("espresso needs 'gpu' in devices: CPU options are offloaded "
                            "GPU decisions (Algorithm 4.2)")
        hierarchies = [["flat"]]
        if ss.nodes > 1 and ss.per_node > 1:
            hierarchies.append(["hierarchical"])
        best: tuple[Selection[Key], int] | None = None
        for hier in hierarchies:
            sel = self._select(ss, ctx, self._candidates(hier, allowed))
            if best is None or sel[0].iteration_s < best[0].iteration_s - 1e-12:
                best = sel
        assert best is not None
        return best

    def _select(
        self, ss: StageSync, ctx: PassContext, cands: list[Key]
    ) -> tuple[Selection[Key], int]:
        cache: dict[tuple[Key, float], tuple[Op, ...]] = {}
        sizes = sorted({float(b) for b in ss.nbytes})

        def table(key: Key) -> None:
            """This option's ops at every size of the group (one vectorised evaluation)."""
            st = strategy_for(key, self.ratio)
            proto = ss.ops(st, sizes[0], ctx.costs)
            _, times = ss.ops_table(st, sizes, ctx.costs)  # bit for bit ss.ops's times
            for m, nb in enumerate(sizes):
                cache[(key, nb)] = tuple(Op(op.resource, float(times[m, c]), op.label)
                                         for c, op in enumerate(proto))

        def ops(i: int, key: Key) -> tuple[Op, ...]:
            got = cache.get((key, ss.nbytes[i]))
            if got is None:
                table(key)
                got = cache[(key, ss.nbytes[i])]
            return got

        @functools.cache
        def offload(key: Key) -> Key | None:
            if "cpu" not in self.devices or key[0] is None or key[0] in _CASTS:
                return None
            return (key[0], option_id(offloaded(all_options()[key[1]])))

        # every candidate's costs before the search (the search then only simulates)
        for k in cands:
            table(k)
            if (cpu := offload(k)) is not None:
                table(cpu)
        n = len(ss.grads)
        problem: SelectionProblem[Key] = SelectionProblem(
            backprop_s=ss.backprop_s,
            sizes=[int(b) for b in ss.nbytes],
            baseline=[(None, 0)] * n,
            gpu_options=[cands] * n,
            ops=ops,
            compressed=lambda k: k[0] is not None,
            offload=offload,
            ops_class=[float(b) for b in ss.nbytes],  # ops() depends on the size alone
        )
        # the baseline is this hierarchy's fastest uniform fp32 routing: a flat baseline under
        # hierarchical candidates would put them on other channels than the tensors left
        # uncompressed, so that every choice for one tensor looks free (and ties go by order)
        plain = [k for k in cands if k[0] is None]
        base = min(plain, key=lambda k: problem.iteration_s([k] * n))
        problem.baseline = [base] * n
        seeds = [[k] * n for k in cands] if self.uniform_seeds else []
        if self.uniform_seeds:  # every tensor offloaded the same way, too (Algorithm 4.2
            # offloads subsets of Algorithm 4.1's choice and may miss these)
            seeds += [[cpu] * n for k in cands if (cpu := offload(k)) is not None]
        if all(k[0] is None for k in cands):
            # nothing to compress: the best uniform routing (cheap enough for every layout)
            problem.gpu_options = [[]] * n
            return select(problem, seeds=seeds, exhaustive_limit=0), len(cands)
        return select(problem, seeds=seeds), len(cands)
