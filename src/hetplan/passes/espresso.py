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
  allgather), not the flat allreduce, for the same reason. The hierarchy with the smaller
  lower bound (:meth:`_StageCosts.lower_bound`: ready times, shortest paths, each channel's
  least work) is searched first, and another is not searched when its bound is above that
  result: it could not be kept, so the choice is the same as searching both
  (``docs/decisions/espresso-speed.md``). Under ZeRO-2/3 only the flat options are
  candidates (a note says so): gradients are reduce-scattered flat over the data-parallel
  group during backward, and the runtime has no hierarchical reduce-scatter; so they are
  under Chimera, whose stages sync flat over the ``2·dp`` ranks holding them.
- Options are pruned to at most ``max_compressions`` compressions per tensor (default 4: no
  limit) and to the allowed ``devices`` (default GPU and CPU).
- **16-bit uncompressed steps.** With ``fp16`` (or ``bf16``) among the compressors, every
  compressed path with an uncompressed step is also a candidate with those steps in 16 bits
  (the reference implementation's "intra-node FP16" options; key ``(compressor, option_id,
  dtype)``, strategy ``<compressor>#<option_id>+fp16``).
- **Widening in rungs** (:meth:`Espresso._ladder`): (0) the uncompressed routings and casts
  with the one-compression paths in fp32 (what this pass searched before), (1) those paths
  with 16-bit uncompressed steps, (k) the paths with k = 2 .. ``max_compressions``
  compressions. Each rung starts Algorithm 4.1 from the previous rung's choice, tries only
  its new options (and again the routings and casts that choice uses), and never returns
  anything slower than that choice, so a wider search is never predicted slower than a
  narrower one along the rungs. Decisions in ``docs/decisions/espresso-mp.md`` and
  ``docs/decisions/espresso-speed.md``.
- **Candidate screen** (``screen``, default 3; an approximation for speed): in each sweep,
  the first 3 tensors of a size class try every candidate, the later ones only the options
  their class holds or has taken, and a rung also sweeps from its best uniform seed when
  that seed is within ``seed_within`` (10 %) of the first sweep's result. On the 36 bench
  cases this cut the large models' simulations 1.6-4.1x; the choices moved by -6.8 % ..
  +9.2 % against the unscreened search (geometric mean +0.18 %), every case still <= fp32,
  fp16, the best uniform compression and ``espresso-reference``.
  ``espresso{screen=0 seed_within=0}`` is Algorithm 4.1 unscreened, the search before it
  (``docs/decisions/espresso-speed.md``, "Round 6").
- **Stop at the lower bound** (``bound_within``, default 0.1 %; an approximation with a
  stated loss): a hierarchy's search stops once it holds a choice at most 0.1 % above the
  hierarchy's lower bound (the one that orders the hierarchies), since no choice of its
  rungs could be faster by more: the remaining rungs are not run, and within a rung
  (``select(floor=...)``) a best uniform seed at that floor is taken without a sweep (its
  tensors go back to the baseline where that costs nothing), a sweep stops when it gets
  there, and the sweep from the seed is not run after a first sweep that got there. On
  the 36 bench cases it fires on resnet101/NVLink (its uniform seed is 0.018 % above the
  bound), with the same choices, and the GPU selection there falls from 126-205 ms to
  18-19 ms (CPU time, under load); the other 33 cases are more than 1 % above their bounds
  and unchanged. ``bound_within=0`` turns it off (``docs/decisions/espresso-speed.md``,
  "Round 9").
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np

from hetplan.algorithms.dp_session import DPSession
from hetplan.algorithms.dp_types import CPU, GPU, Op
from hetplan.algorithms.espresso import (
    Selection,
    SelectionProblem,
    select,
    tensor_benefits,
)
from hetplan.algorithms.espresso_tables import OpsTable
from hetplan.algorithms.espresso_tree import (
    PRECISIONS,
    Option,
    all_options,
    has_uncompressed_step,
    num_compressions,
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

#: A candidate: (compressor or None for uncompressed, option id in the tree, dtype of the
#: uncompressed steps): one path of the extended tree
#: (:func:`~hetplan.algorithms.espresso_tree.extended_options`).
Key = tuple[str | None, int, str]
#: The older two-part key ``(compressor or cast or None, option id)``, fp32 uncompressed steps.
ShortKey = tuple[str | None, int]
_CASTS = ("fp16", "bf16")
_SPARSIFIERS = ("topk", "randomk", "dgc")
#: A hierarchy is not searched when its lower bound exceeds another's result by more than
#: this (seconds): far above the float rounding of the bound's sums against the simulator's.
_SKIP_EPS = 1e-9


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


def _full(key: Key | ShortKey) -> tuple[str | None, int, str]:
    """A three-part key; a two-part ``(cast, id)`` is the cast of path ``id``."""
    if len(key) == 3:
        return key
    comp, oid = key[0], key[1]
    return (None, oid, comp) if comp in _CASTS else (comp, oid, "fp32")


def strategy_name(key: Key | ShortKey) -> str:
    """``fp32`` for the flat fp32 allreduce; ``<fp32|fp16|bf16>#<option_id>`` for an
    uncompressed path; ``<compressor>#<option_id>`` for a compressed one, with ``+fp16`` /
    ``+bf16`` when its uncompressed steps are 16-bit."""
    comp, oid, dtype = _full(key)
    if comp is None:
        return "fp32" if (oid, dtype) == (0, "fp32") else f"{dtype}#{oid}"
    return f"{comp}#{oid}" + ("" if dtype == "fp32" else f"+{dtype}")


def _steps(option: Option) -> tuple[CommStep, ...]:
    return tuple(CommStep(level=a.level, routine=a.routine,  # type: ignore[arg-type]
                          compressed=a.compressed_comm)
                 for a in option if a.routine is not None)


def _hierarchical(ss: StageSync, ctx: PassContext) -> bool:
    """Whether the hierarchical routings are candidates for ``ss``'s group: it spans several
    nodes with several ranks each, ZeRO does not reduce-scatter gradients during backward
    (ZeRO-2/3 do so flat over the data-parallel group; the runtime has no hierarchical
    reduce-scatter, docs/decisions/runtime-composition.md), and the schedule is not Chimera
    (its stages sync flat over the ``2·dp`` ranks holding them, the group its executor
    builds; docs/decisions.md, "Chimera: what is priced")."""
    return (ss.nodes > 1 and ss.per_node > 1 and ctx.layout.zero_stage < 2
            and ctx.layout.stage_copies == 1)


def strategy_for(key: Key | ShortKey, ratio: float = DEFAULT_SPARSITY_RATIO) -> SyncStrategy:
    """The plan strategy of a candidate ``key`` (three-part, or the older two-part key)."""
    if len(key) == 2 and key[0] in _CASTS:  # a cast of any path's steps, as it always was
        comp, oid, dtype = None, key[1], key[0]
    else:
        comp, oid, dtype = _full(key)
    option = all_options()[oid]
    hierarchy: Literal["flat", "hierarchical"] = (
        "hierarchical" if option[0].level != "flat" else "flat")
    if comp is None and dtype == "fp32":
        return NoSync(hierarchy=hierarchy, steps=_steps(option))
    if comp is None:
        return CastSync(hierarchy=hierarchy, steps=_steps(option), dtype=dtype)  # type: ignore[arg-type]
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
                          compress_device=first, decompress_device=last,  # type: ignore[arg-type]
                          uncompressed_dtype=dtype)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Espresso:
    """Per-tensor compression options chosen by Espresso's decision algorithm.

    Attributes:
        compressors: allowed compressors (none by default: compression is opt-in).
        devices: where (de)compression may run.
        max_compressions: at most this many compressions per tensor.
        ratio: fraction of elements the sparsifiers keep.
        uniform_seeds: also score every uniform strategy (see module docstring).
        screen: the candidate screen of every sweep (``select(screen=...)``): in a size
            class, the first ``screen`` tensors a sweep reaches try every candidate, the
            others the options their class holds; 0 turns it off (Algorithm 4.1 as
            written, several times slower on the large workloads).
        seed_within: a rung also sweeps from its best uniform seed when that seed is at
            most this fraction slower than the sweep from the narrower choice
            (``select(seed_within=...)``); 0: only when it is faster.
        parallel: a rung scores its uniform seeds and sweeps from the best of them on a
            second thread while its first sweep runs (``select(parallel=True)``): the
            same choices, less wall time where two cores are free, some CPU time spent on
            seed sweeps the first sweep's result turns out not to need.
        bound_within: the search of a hierarchy stops once it holds a choice at most this
            fraction above the hierarchy's lower bound (:meth:`_StageCosts.lower_bound`
            over every candidate of every rung): no choice could be faster by more than
            that. It skips the remaining rungs, and within a rung the sweeps
            (``select(floor=...)``). 0 turns it off.
    """

    compressors: tuple[str, ...] = ()
    devices: tuple[str, ...] = ("gpu", "cpu")
    max_compressions: int = 4
    ratio: float = DEFAULT_SPARSITY_RATIO
    uniform_seeds: bool = True
    screen: int = 3
    seed_within: float = 0.1
    parallel: bool = False
    bound_within: float = 1e-3
    name: ClassVar[str] = "espresso"
    sections: ClassVar[tuple[str, ...]] = ("gradient_sync",)

    def __post_init__(self) -> None:
        allowed = check_compressors(self.compressors)
        if bad := [d for d in self.devices if d not in ("gpu", "cpu")]:
            raise SpecError(f"espresso devices: unknown {bad[0]!r}; (de)compression runs on "
                            "gpu, cpu or both")
        if "gpu" not in self.devices and any(c not in _CASTS for c in allowed):
            raise SpecError("espresso needs 'gpu' in devices: CPU options are offloaded "
                            "GPU decisions (Algorithm 4.2)")
        if not 0 < self.ratio <= 1:  # nan too
            raise SpecError(f"espresso: ratio must be in (0, 1] (the fraction of elements "
                            f"the sparsifiers keep; default {DEFAULT_SPARSITY_RATIO}), got "
                            f"{self.ratio}")
        if self.max_compressions < 0:
            raise SpecError(f"espresso max_compressions={self.max_compressions}: must be >= 0 "
                            "(0 leaves every gradient uncompressed)")
        if self.screen < 0:
            raise SpecError(f"espresso screen={self.screen}: must be >= 0 (0 turns the "
                            "candidate screen off)")
        if not self.bound_within >= 0:  # nan too
            raise SpecError(f"espresso bound_within={self.bound_within}: must be >= 0 (0 "
                            "turns the stop at the lower bound off)")
        if not self.seed_within >= 0:
            raise SpecError(f"espresso seed_within={self.seed_within}: must be >= 0 (0 sweeps "
                            "from a seed only when it is faster)")

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
        res = self._search(plan, ctx, syncs, allowed)
        if any(ss.nodes > 1 and ss.per_node > 1 and not _hierarchical(ss, ctx) for ss in syncs):
            why = (f"ZeRO-{ctx.layout.zero_stage} reduce-scatters gradients flat over the "
                   "data-parallel group" if ctx.layout.zero_stage >= 2 else
                   "schedule 'chimera' syncs each stage flat over the 2·dp ranks holding it")
            note = f"hierarchical routings not searched: {why}"
            res = dataclasses.replace(res, notes=(note, *res.notes))
        return res

    def _search(self, plan: Plan, ctx: PassContext, syncs: list[StageSync],
                allowed: tuple[str, ...]) -> PassResult:
        """The routing (no compressors, incoming buckets) or the per-tensor option search."""
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
                f"{sum(1 for k in sel.strategy if k[0] is not None)} compressed "
                f"({sum(1 for k in sel.strategy if k[0] is not None and k[2] != 'fp32')} with "
                "16-bit uncompressed steps), "
                f"{sum(1 for k in sel.strategy if k[0] is None and k[2] != 'fp32')} cast; "
                "predicted sync "
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
        if any(_hierarchical(ss, ctx) for ss in syncs):
            hier.append("hierarchical")
        scorer = SyncScorer(ctx.workload, ctx.layout, plan.stages, ctx.costs)
        best: tuple[float, SyncStrategy | None, str] = (
            scorer.iteration_s(incoming), None, "incoming")
        for o in options(hierarchies=hier, compress=False):
            key: Key = (None, option_id(o), "fp32")
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

    def _ladder(self, hier: list[str], allowed: tuple[str, ...]) -> list[list[Key]]:
        """The search's rungs, each the candidates it adds to the ones before (see the
        module docstring, "Widening in rungs"): (0) every uncompressed routing in fp32 and
        cast to each allowed 16-bit dtype, and the compressed paths with at most one
        compression, fp32 uncompressed steps; (1) the same compressed paths with 16-bit
        uncompressed steps; (k) the paths with k compressions, k = 2 .. max_compressions,
        in every allowed precision."""
        routings = options(hierarchies=hier, compress=False)
        rung0: list[Key] = [(None, option_id(o), "fp32") for o in routings]
        for c in allowed:
            if c in _CASTS:
                rung0 += [(None, option_id(o), c) for o in routings]
        lossy = [c for c in allowed if c not in _CASTS]
        narrow = [d for d in PRECISIONS[1:] if d in allowed]
        if not lossy or self.max_compressions < 1:
            return [rung0]

        def paths(k: int) -> list[Option]:
            return [o for o in options(devices=["gpu"], hierarchies=hier, compress=True,
                                       max_compressions=k) if num_compressions(o) == k]

        one = paths(1)
        rungs = [rung0 + [(c, option_id(o), "fp32") for c in lossy for o in one]]
        rungs.append([(c, option_id(o), d) for c in lossy for o in one
                      if has_uncompressed_step(o) for d in narrow])
        for k in range(2, self.max_compressions + 1):
            rungs.append([(c, option_id(o), d) for c in lossy for o in paths(k)
                          for d in ("fp32", *narrow) if d == "fp32" or has_uncompressed_step(o)])
        return [r for r in rungs if r]

    def _select_stage(
        self, ss: StageSync, ctx: PassContext, allowed: tuple[str, ...]
    ) -> tuple[Selection[Key], int]:
        if "gpu" not in self.devices and any(c not in _CASTS for c in allowed):
            raise SpecError("espresso needs 'gpu' in devices: CPU options are offloaded "
                            "GPU decisions (Algorithm 4.2)")
        hierarchies = [["flat"]]
        if _hierarchical(ss, ctx):
            hierarchies.append(["hierarchical"])
        ladders = [self._ladder(hier, allowed) for hier in hierarchies]
        costs = [_StageCosts(ss, ctx, self.ratio, self.devices) for _ in hierarchies]
        bounds = [c.lower_bound([k for rung in lad for k in rung])
                  for c, lad in zip(costs, ladders)]
        # the hierarchy with the smaller bound first; another is searched only when its
        # bound does not prove it slower than that result (it could not be kept: below)
        done: dict[int, tuple[Selection[Key], int]] = {}
        for h in sorted(range(len(hierarchies)), key=lambda h: (bounds[h], h)):
            if done and bounds[h] > min(s.iteration_s for s, _ in done.values()) + _SKIP_EPS:
                continue
            sel: Selection[Key] | None = None
            cum: list[Key] = []
            # a choice at or below the floor is within bound_within of every choice the
            # rungs could make: the search stops there (0: no floor)
            floor = bounds[h] * (1.0 + self.bound_within) if self.bound_within > 0 else 0.0
            for new in ladders[h]:
                if sel is not None and sel.iteration_s <= floor:
                    break
                # a wider rung also retries the uncompressed routings and casts the narrower
                # choice uses (the baseline is always a candidate): a tensor a new path would
                # compress for a sliver may do as well with a cast another tensor holds.
                # Retrying every routing and cast instead took 1.10x the CPU time (median
                # over the 36 bench cases) for plans at most 0.38 % faster and up to 6.6 %
                # slower (docs/decisions/espresso-speed.md, "Round 4")
                retry = [] if sel is None else _uncompressed_in(cum, sel.strategy)
                cum += new
                sel = self._select(ss, costs[h], cum, retry + new, sel, floor)
            assert sel is not None
            done[h] = (sel, len(cum))
        best: int | None = None
        for h in sorted(done):  # flat first: it is kept on a tie, as it always was
            if best is None or done[h][0].iteration_s < done[best][0].iteration_s - 1e-12:
                best = h
        assert best is not None
        # the rungs leave benefit_s out: computed for the kept selection alone, on the
        # problem of its hierarchy's last rung
        sel, keys = done[best]
        problem = costs[best].problem
        assert problem is not None
        before = problem.evaluations
        benefit = tensor_benefits(problem, sel.strategy, sel.iteration_s)
        return dataclasses.replace(sel, benefit_s=benefit, evaluations=sel.evaluations
                                   + problem.evaluations - before), keys

    def _select(
        self, ss: StageSync, costs: _StageCosts, cands: list[Key], new: list[Key],
        narrower: Selection[Key] | None, floor: float = 0.0,
    ) -> Selection[Key]:
        """One rung: ``cands`` are all its candidates, ``new`` the ones the rungs before did
        not have; ``narrower`` is the previous rung's choice (None on the first rung);
        ``floor``: ``select(floor=...)``."""
        for k in cands:  # every candidate's costs before the search (it then only simulates)
            costs.table(k)
            if (cpu := costs.offload(k)) is not None:
                costs.table(cpu)
        n = len(ss.grads)
        plain = [k for k in cands if k[0] is None and k[2] == "fp32"]
        problem: SelectionProblem[Key] = SelectionProblem(
            backprop_s=ss.backprop_s,
            sizes=[int(b) for b in ss.nbytes],
            baseline=[plain[0]] * n,
            gpu_options=[cands if narrower is None else new] * n,
            ops=costs.ops,
            # casts count as compressed, as Remove() and offloading have always seen them
            compressed=lambda k: k[0] is not None or k[2] != "fp32",
            offload=costs.offload,
            ops_class=[float(b) for b in ss.nbytes],  # ops() depends on the size alone
            ops_fields=costs.signature,
            share=costs.arrays,
            ops_table=costs.ops_table,
            table_rows=costs.rows,
        )
        costs.problem = problem
        # the baseline is this hierarchy's fastest uniform fp32 routing: a flat baseline under
        # hierarchical candidates would put them on other channels than the tensors left
        # uncompressed, so that every choice for one tensor looks free (and ties go by order)
        if costs.base is None:  # every rung has the same routings: chosen once
            costs.base = min(plain, key=lambda k: problem.iteration_s([k] * n))
        base = costs.base
        problem.baseline = [base] * n
        if narrower is not None:  # the exhaustive search (small problems) sees every rung
            full: list[Key] = [base]
            for k in cands:
                for x in (k, costs.offload(k)):
                    if x is not None and x not in full:
                        full.append(x)
            problem.all_options = [full] * n
        pool = cands if narrower is None else new
        seeds = [[k] * n for k in pool] if self.uniform_seeds else []
        if self.uniform_seeds:  # every tensor offloaded the same way, too (Algorithm 4.2
            # offloads subsets of Algorithm 4.1's choice and may miss these)
            seeds += [[cpu] * n for k in pool if (cpu := costs.offload(k)) is not None]
        if all(k[0] is None for k in cands):
            # nothing to compress: the best uniform routing (cheap enough for every layout)
            problem.gpu_options = [[]] * n
            return select(problem, seeds=seeds, exhaustive_limit=0, benefits=False)
        return select(problem, seeds=seeds, benefits=False,
                      start=None if narrower is None else narrower.strategy,
                      screen=self.screen, seed_within=self.seed_within,
                      parallel=self.parallel, floor=floor)


def _uncompressed_in(cands: list[Key], strategy: tuple[Key, ...]) -> list[Key]:
    """The uncompressed routings and casts among ``cands`` that ``strategy`` uses, in
    ``cands``' order: what a wider rung retries besides its new paths."""
    used = set(strategy)
    return [k for k in cands if k[0] is None and k in used]


class _StageCosts:
    """The ops of every candidate at every tensor size of one stage's group, computed once
    per candidate (one vectorised evaluation over the sizes) and shared by the rungs."""

    def __init__(self, ss: StageSync, ctx: PassContext, ratio: float,
                 devices: tuple[str, ...]) -> None:
        self._ss, self._ctx, self._ratio, self._devices = ss, ctx, ratio, devices
        self._sizes = sorted({float(b) for b in ss.nbytes})
        self._cache: dict[tuple[Key, float], tuple[Op, ...]] = {}
        # key -> its ops at every size (OpsTable: resources, durations, interned identities)
        self._tables: dict[Key, OpsTable] = {}
        #: each tensor's row of the tables (its size's index in the sorted sizes)
        self.rows = [self._sizes.index(float(b)) for b in ss.nbytes]
        self._done: set[Key] = set()
        # id of a cached ops tuple -> the number its (resource, duration, label) fields are
        # interned to (equal numbers exactly for equal fields); the tuples live in
        # ``_cache`` as long as this object, so their ids are not reused
        self._sigs: dict[int, int] = {}
        self._interned: dict[tuple[tuple[str, float, str], ...], int] = {}
        #: holds every cached ops tuple's arrays (registered once per candidate, for all
        #: sizes at once) for the sessions of every rung's selection
        self.arrays = DPSession(ss.backprop_s)
        #: the fastest uniform fp32 routing (Algorithm 4.1's start), the same for every rung
        self.base: Key | None = None
        #: the last rung's selection problem
        self.problem: SelectionProblem[Key] | None = None
        self.offload = functools.cache(self._offload)

    def lower_bound(self, keys: list[Key]) -> float:
        """A lower bound on the group's sync time (the selection's ``iteration_s``) under
        any choice among ``keys`` and their CPU-offloaded versions, the largest of:

        - the end of backprop;
        - per tensor, its ready time (the backprop before it: GPU work only delays it) plus
          its ops' total duration under its shortest option (its ops run one at a time);
        - per communication channel and tensor ``k``, when every choice puts work of the
          tensors ``>= k`` on it: ``k``'s ready time, plus the shortest lead before any of
          their ops there, plus the least work they can put there (the channel runs one op
          at a time), plus the shortest tail after an op there.
        """
        for k in keys:
            self.table(k)
            if (cpu := self.offload(k)) is not None:
                self.table(cpu)
        every = [*keys, *(c for k in keys if (c := self.offload(k)) is not None)]
        # per size: shortest total; per channel the least work, lead and tail over options
        inf = float("inf")
        shortest: dict[float, float] = {}
        work: dict[float, dict[str, float]] = {}
        lead: dict[float, dict[str, float]] = {}
        tail: dict[float, dict[str, float]] = {}
        channels = sorted({op.resource for k in every for op in self._cache[(k, self._sizes[0])]}
                          - {GPU, CPU})
        for nb in self._sizes:
            w = dict.fromkeys(channels, inf)
            ld = dict.fromkeys(channels, inf)
            tl = dict.fromkeys(channels, inf)
            best = inf
            for k in every:
                ops = self._cache[(k, nb)]
                total = sum(op.duration_s for op in ops)
                best = min(best, total)
                mine = dict.fromkeys(channels, 0.0)
                pre = 0.0
                for op in ops:
                    if op.resource in mine:
                        mine[op.resource] += op.duration_s
                        ld[op.resource] = min(ld[op.resource], pre)
                    pre += op.duration_s
                post = 0.0
                for op in reversed(ops):
                    if op.resource in mine:
                        tl[op.resource] = min(tl[op.resource], post)
                    post += op.duration_s
                for r in channels:
                    w[r] = min(w[r], mine[r])
            shortest[nb], work[nb], lead[nb], tail[nb] = best, w, ld, tl
        ready = [0.0] * len(self._ss.backprop_s)
        t = 0.0
        for i, bp in enumerate(self._ss.backprop_s):
            t += bp
            ready[i] = t
        bound = t
        sizes = [float(nb) for nb in self._ss.nbytes]
        for i, nb in enumerate(sizes):
            bound = max(bound, ready[i] + shortest[nb])
        for r in channels:
            acc = lo = hi = 0.0
            lo = hi = inf
            for i in range(len(sizes) - 1, -1, -1):
                nb = sizes[i]
                acc += work[nb][r]
                lo = min(lo, lead[nb][r])
                hi = min(hi, tail[nb][r])
                if acc > 0.0:  # every choice puts work of the tensors >= i on r
                    bound = max(bound, ready[i] + lo + acc + hi)
        return bound

    def signature(self, ops: tuple[Op, ...]) -> int:
        """The number ``ops``' (resource, duration, label) fields are interned to: equal
        exactly for equal fields; computed once per cached tuple."""
        got = self._sigs.get(id(ops))  # a live cached tuple's id is no other object's
        if got is None:
            fields = tuple((op.resource, op.duration_s, op.label) for op in ops)
            return self._interned.setdefault(fields, len(self._interned))
        return got

    def table(self, key: Key) -> None:
        """This option's ops at every size of the group."""
        if key in self._done:
            return
        self._done.add(key)
        ss, sizes, costs = self._ss, self._sizes, self._ctx.costs
        st = strategy_for(key, self._ratio)
        proto = ss.ops(st, sizes[0], costs)
        _, times = ss.ops_table(st, sizes, costs)  # bit for bit ss.ops's times
        steps = [(op.resource, op.label) for op in proto]
        rows = []
        sigs = []
        for nb, row in zip(sizes, times.tolist()):  # tolist: the same doubles, as floats
            ops = tuple(Op(r, t, lb) for (r, lb), t in zip(steps, row))
            self._cache[(key, nb)] = ops
            fields = tuple((r, t, lb) for (r, lb), t in zip(steps, row))
            sg = self._sigs[id(ops)] = self._interned.setdefault(fields, len(self._interned))
            sigs.append(sg)
            rows.append(ops)
        durations = np.ascontiguousarray(times, dtype=np.float64).reshape(
            len(rows), len(steps))
        self.arrays.register(rows, [r for r, _ in steps], durations)
        self._tables[key] = OpsTable(tuple(r for r, _ in steps), durations, sigs, rows)

    def ops_table(self, key: Key) -> OpsTable:
        """This option's ops at every size at once (row ``rows[i]`` is tensor ``i``'s)."""
        got = self._tables.get(key)
        if got is None:
            self.table(key)
            got = self._tables[key]
        return got

    def ops(self, i: int, key: Key) -> tuple[Op, ...]:
        got = self._cache.get((key, self._ss.nbytes[i]))
        if got is None:
            self.table(key)
            got = self._cache[(key, self._ss.nbytes[i])]
        return got

    def _offload(self, key: Key) -> Key | None:
        if "cpu" not in self._devices or key[0] is None:
            return None
        return (key[0], option_id(offloaded(all_options()[key[1]])), key[2])
