"""``hetplan.compile``: model + cluster → the fastest feasible plan, with its baselines.

Read top to bottom (:func:`compile` is these steps in this order):

1. **Options**: :class:`~hetplan.optimizer.options.CompileOptions` validates everything asked
   for, and the pass pipeline is parsed from its spec (:mod:`hetplan.passes.spec`) before
   anything expensive runs, so a typo fails at once.
2. **Workload**: capture the model (a zoo name, an ``nn.Module`` with example inputs, a
   :class:`ModelIR` or a workload file) into the plan's :class:`WorkloadSummary`; the cost
   model for the cluster, from the profile DB where it has measurements.
3. **Screen** (:func:`_screen`): every layout :func:`enumerate_layouts` allows gets the
   *screening* passes — the pipeline without its refinements (``Pass.refines``) — which shape
   it (stages with their recomputation, TP, baseline buckets); :func:`evaluate` predicts the
   iteration; layouts that cannot fit (memory) are dropped. The ZeRO stage is chosen per
   layout (:meth:`_Job.zero_ladder`): the lowest that fits, starting at 1 with ``dp > 1``
   when the data-parallel link's reduce-scatter plus all-gather cost no more than its
   all-reduce and the pipeline does not compress gradients (a compressed sync under ZeRO-1
   all-gathers the updated weights on top), re-balance a dynamic model or turn a TP
   resizing controller on (both move whole optimizer state, which the runtime does not do
   under ZeRO); a layout that fits only with recomputation also gets the next stage up, and
   the faster of the two is kept. Under Chimera the ladder stops at ZeRO-1, sharded over
   the ``2·dp`` ranks holding each stage. Equal bytes do not make ZeRO-1 as fast (its
   all-gather follows the optimizer step), so after screening each of the :data:`FINALISTS`
   that took ZeRO-1 that way is also planned at ZeRO-0 with the screening passes, and the
   faster (ZeRO-1 on a tie) goes on to refinement (:func:`_zero0_finalists`). A
   heterogeneous plan (``hetero``) keeps its own rule (ZeRO-1 with ``dp > 1``).
4. **Refine** (:func:`_refine`): the :data:`FINALISTS` fastest layouts get the *refinement*
   list — the whole pipeline, in order, refinement passes (Cupcake; Espresso when compressors
   are allowed) included — and the fastest of those wins (ties: the smaller layout tuple). A
   refinement never makes a layout slower, so a layout outside the finalists could win only
   if refinement helped it by more than its gap to the last finalist; that is the price of
   not running the expensive searches on every layout. Without refinement passes the
   screening result is final.
5. **Assemble** (:func:`_assemble`): the same prediction for the baselines the plan must beat
   — DDP (pure data parallelism, 25 MiB fp32 buckets), the winning layout with the baseline
   passes, and the winning layout with layer-wise (unfused) fp32 sync — then predictions,
   provenance of every cost and the pass log.

:func:`hetplan.cost_models.predict.simulate` re-evaluates a plan (also one edited by hand)
from the plan file alone.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from hetplan.algorithms._jit_env import jit_switched_off
from hetplan.algorithms.pipeline_schedules import layout_actions
from hetplan.cost_models.compute import vocab_split
from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.evaluate import Evaluation, evaluate
from hetplan.cost_models.memory import USABLE_FRACTION, model_state
from hetplan.cost_models.rank_memory import stage_precision
from hetplan.cost_models.predict import (breakdown, check_profile_fits, predictions,
                                         provenance, resolve_cluster, resolve_profile)
from hetplan.cost_models.profile_db import ProfileDB
from hetplan.errors import InfeasiblePlanError, OutOfMemoryError, SpecError
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.model import ModelIR
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import (
    MAX_MICRO_BATCHES,
    Baseline,
    ClusterRef,
    CostSettings,
    Layout,
    ModelRef,
    PassLogEntry,
    Stage,
    WorkloadSummary,
)
from hetplan.optimizer.bounds import bounds_apply, iteration_lower_bound
from hetplan.optimizer.layout import (
    LayoutCandidate,
    enumerate_layouts,
    pinned_degree_problems,
)
from hetplan.optimizer.options import CompileOptions
from hetplan.optimizer.progress import Progress, search_progress
from hetplan.passes import BASELINE_PASSES, BASELINE_PIPELINE, DEFAULT_PASSES
from hetplan.passes.base import Pass, PassContext
from hetplan.passes.manager import run_passes
from hetplan.passes.spec import parse_pipeline

__all__ = ["compile", "CompileOptions", "DEFAULT_PASSES", "FINALISTS", "model_ir"]

#: Layouts that get the refinement passes after screening (see :func:`compile`).
FINALISTS = 3

@dataclass(frozen=True)
class _Job:
    """What every step of one compile shares."""

    opts: CompileOptions
    ir: ModelIR
    workload: WorkloadSummary
    spec: ClusterSpec
    db: ProfileDB | None
    costs: CostModel
    model_ref: ModelRef
    cluster_ref: ClusterRef
    pipeline: tuple[Pass, ...]
    #: the passes every layout gets (the pipeline without its refinements)
    screening: tuple[Pass, ...]
    #: the passes a finalist gets (the whole pipeline); empty: the screening is final
    refinement: tuple[Pass, ...]

    def layout(self, cand: LayoutCandidate) -> Layout:
        return cand.to_layout(self.opts.batch_size, self.opts.schedule)

    def zero_ladder(self, cand: LayoutCandidate) -> list[int]:
        """The ZeRO stages to try for ``cand``, in order (see module docstring, step 3);
        under Chimera at most 1 (ZeRO-2/3 collectives inside backward do not compose with
        its two directions; a pinned 2 or 3 is refused by the options)."""
        if cand.dp == 1:
            return [0]
        if self.opts.zero_stage is not None:
            return [self.opts.zero_stage]
        first = 1 if self.zero1_free(cand) else 0
        top = 1 if self.layout(cand).stage_copies > 1 else 3
        return [first] + [z for z in (1, 2, 3) if first < z <= top]

    def zero1_free(self, cand: LayoutCandidate) -> bool:
        """Whether the ladder of ``cand`` starts at ZeRO-1: ``dp > 1``, no pinned stage, its
        data-parallel link moves a reduce-scatter plus an all-gather in no more time than an
        all-reduce (:func:`_zero1_free`), and the pipeline does not compress gradients or
        move whole optimizer state (module docstring, step 3)."""
        if cand.dp == 1 or self.opts.zero_stage is not None:
            return False
        compressing = any(getattr(p, "compressors", ()) for p in self.pipeline)
        return (not compressing and not _moves_whole_state(self.pipeline)
                and _zero1_free(self.costs, self.layout(cand)))

    def plan_for(self, layout: Layout, passes: tuple[Pass, ...]) -> tuple[Plan, Evaluation]:
        """Run ``passes`` on an empty plan of ``layout`` and evaluate the result."""
        ctx = PassContext(workload=self.workload, cluster=self.spec, costs=self.costs,
                          layout=layout, model_ir=self.ir)
        plan = run_passes(Plan(model=self.model_ref, cluster=self.cluster_ref, layout=layout),
                          passes, ctx)
        ev = evaluate(self.workload, layout, plan.stages, plan.gradient_sync, self.costs,
                      tensor_parallel=plan.tensor_parallel, sparse_sync=plan.sparse_sync)
        return plan, ev


Scored = tuple[float, LayoutCandidate, Plan, Evaluation]


def _rebalances(pipeline: tuple[Pass, ...]) -> bool:
    """Whether ``pipeline`` re-balances a dynamic model (a ``dynpipe`` pass given dynamics),
    which needs one chunk per pipeline rank."""
    return any(p.name == "dynpipe" and getattr(p, "dynamics", None) is not None
               for p in pipeline)


def _moves_whole_state(pipeline: tuple[Pass, ...]) -> bool:
    """Whether ``pipeline`` asks for a runtime mechanism that moves or resizes whole
    per-parameter optimizer state, which the runtime does not do under ZeRO (sharded state):
    re-balancing a dynamic model, or a TP resizing controller. The passes decline them under
    ZeRO >= 1 (with a note), so the search must not take ZeRO-1 for free then."""
    return _rebalances(pipeline) or any(
        p.name == "tp-resizing" and getattr(p, "controller", "off") != "off" for p in pipeline)


def compile(  # noqa: A001 - the product's verb
    model: Any,
    cluster: ClusterSpec | str | Path,
    options: CompileOptions | None = None,
    *,
    example_inputs: Any = None,
    example_kwargs: Any = None,
    profile: ProfileDB | str | Path | None = None,
    **kwargs: Any,
) -> Plan:
    """Compile the fastest feasible plan for ``model`` on ``cluster``.

    Args:
        model: a zoo name, an ``nn.Module`` (with ``example_inputs``), a :class:`ModelIR`, or
            a workload JSON path.
        cluster: a :class:`ClusterSpec`, a preset name or a cluster file.
        options: a :class:`CompileOptions`; keyword arguments (its fields: ``batch_size``,
            ``passes``, ``schedule``, ``dp``/``pp``/``tp``, ``compressors``, ...) build or
            update it.
        example_inputs / example_kwargs: one micro-batch for an ``nn.Module``.
        profile: profile DB (or its path) with measured costs.

    Returns:
        The plan; ``plan.predictions.baselines`` holds what it beat.

    Raises:
        SpecError: an unknown or invalid option, pass or pass option (with a suggestion).
        InfeasiblePlanError: no layout fits (the message names the binding constraint).

    Example:
        >>> plan = hetplan.compile("gpt2", "a100-nvlink-8x8", batch_size=64,
        ...                        passes="dynpipe,even-tp,ddp-buckets,cupcake-fusion")  # doctest: +SKIP
    """
    with _older_objects_frozen():
        return _compile(model, cluster, options, example_inputs=example_inputs,
                        example_kwargs=example_kwargs, profile=profile, **kwargs)


@contextmanager
def _older_objects_frozen() -> Iterator[None]:
    """Keep the objects that exist when planning starts out of Python's cyclic garbage
    collections while it runs (``gc.freeze``; ``gc.unfreeze`` after, so whatever of them is
    garbage is collected later as usual). A search allocates enough to set off a full
    collection, which then walks every object of the process, torch's included: 0.23 s of
    the demo's 1.0 s on this machine, for nothing the search made. Left alone when the
    program froze objects itself (``gc.get_freeze_count() > 0``): its freeze is its own."""
    if gc.get_freeze_count() > 0:
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _compile(
    model: Any,
    cluster: ClusterSpec | str | Path,
    options: CompileOptions | None,
    *,
    example_inputs: Any,
    example_kwargs: Any,
    profile: ProfileDB | str | Path | None,
    **kwargs: Any,
) -> Plan:
    """:func:`compile`'s work."""
    jit_switched_off()  # a HETPLAN_JIT that is no switch: refused before any work
    opts = CompileOptions.build(options, **kwargs)
    spec = resolve_cluster(cluster)
    db = resolve_profile(profile)
    pipeline = opts.pipeline()
    ir = _workload(model, example_inputs, example_kwargs, opts.seq)
    screening = tuple(p for p in pipeline if not p.refines)
    workload = WorkloadSummary.from_model_ir(ir)
    check_profile_fits(db, workload, ir.name,
                       profile if isinstance(profile, (str, Path)) else "the profile DB")
    job = _Job(
        opts=opts, ir=ir, workload=workload, spec=spec, db=db,
        costs=CostModel(spec, db, dtype=opts.dtype, efficiency=opts.efficiency,
                        optimizer=opts.optimizer, require_profiled=opts.require_profiled,
                        attention=opts.attention, dp_overlap=opts.dp_overlap,
                        fusion=opts.fusion, grad_accumulation=opts.grad_accumulation,
                        vocab_parallel=_vocab_parallel(opts, pipeline, workload)),
        model_ref=ModelRef(name=ir.name, fingerprint=ir.fingerprint(),
                           num_params=ir.num_params),
        cluster_ref=ClusterRef.from_cluster(spec, embed=False),
        pipeline=pipeline, screening=screening,
        refinement=pipeline if len(screening) < len(pipeline) else (),
    )
    candidates = enumerate_layouts(job.workload, spec, opts.batch_size, dp=opts.dp,
                                   pp=opts.pp, tp=opts.tp,
                                   micro_batch_size=opts.micro_batch_size,
                                   schedule=opts.schedule, virtual_stages=opts.virtual_stages,
                                   sequence_parallel=opts.sequence_parallel)
    if opts.schedule == "auto" and opts.virtual_stages is None and _rebalances(pipeline):
        # DynPipe re-balances one chunk per pipeline rank: auto keeps to 1F1B
        candidates = [c for c in candidates if c.virtual_stages == 1]
    if not candidates and (why := pinned_degree_problems(job.workload, spec, dp=opts.dp,
                                                         pp=opts.pp, tp=opts.tp)):
        raise InfeasiblePlanError("no layout has the pinned degrees: " + "; ".join(why))
    n_layers = len(job.workload.layers)
    if not candidates and opts.pp and opts.virtual_stages and (
            opts.pp * opts.virtual_stages > n_layers):
        raise InfeasiblePlanError(
            f"no layout has the pinned degrees: pp={opts.pp} x virtual_stages="
            f"{opts.virtual_stages} makes {opts.pp * opts.virtual_stages} pipeline chunks, "
            f"but the model has {n_layers} layers and each chunk holds at least one; pin "
            f"virtual_stages <= {max(1, n_layers // opts.pp)} (or a smaller pp)")
    if not candidates:
        raise InfeasiblePlanError(
            f"no layout of {spec.world_size} devices divides the global batch of "
            f"{opts.batch_size} into at most {MAX_MICRO_BATCHES:,} micro-batches per replica "
            f"(with dp={opts.dp}, pp={opts.pp}, tp={opts.tp}, micro_batch_size="
            f"{opts.micro_batch_size} pinned"
            + (f", schedule {opts.schedule!r}: micro-batches must be a multiple of pp and "
               "pp·virtual_stages at most the layers"
               if opts.schedule in ("interleaved-1f1b", "auto")
               else "")
            + (", schedule 'chimera': a pipeline needs an even pp and an even number of "
               "micro-batches" if opts.schedule == "chimera" else "")
            + "): choose a batch size divisible by a data-parallel degree the cluster allows, "
            + _micro_batch_advice(opts)
        )
    infeasible: list[_Refusal] = []
    with search_progress(len(candidates), opts.progress) as progress:
        screened, pruned = _screen(job, candidates, infeasible, progress)
        screened = _zero0_finalists(job, screened)
        best = _refine(job, screened, infeasible)
    if best is None:
        structural = [r for r in infeasible if not r.memory]
        raise InfeasiblePlanError(
            f"none of the {len(candidates)} layouts fits in memory; for example: "
            f"{infeasible[-1].reason}" if not structural else
            f"none of the {len(candidates)} layouts can be planned; for example: "
            f"{structural[-1].reason}"
        )
    note = (f"{len(candidates)} layout(s) considered, "
            + (f"{pruned} pruned by lower bounds, " if pruned else "")
            + f"{len(infeasible)} infeasible, "
            + (f"best {min(FINALISTS, len(screened))} refined, " if job.refinement else "")
            + f"chose {best[1].describe()}")
    return _assemble(job, best, note)


def model_ir(model: Any, example_inputs: Any = None, example_kwargs: Any = None,
             seq: int | None = None) -> ModelIR:
    """The model IR :func:`compile` plans: ``model`` itself if it is one, a workload file
    loaded (a ``Path``, or a ``str`` ending in ``.json``), a zoo name or an ``nn.Module``
    captured (on the meta device, at batch 1 for a zoo name). The CLI calls it to time the
    capture apart from the planning."""
    return _workload(model, example_inputs, example_kwargs, seq)


def _workload(model: Any, example_inputs: Any, example_kwargs: Any, seq: int | None) -> ModelIR:
    if isinstance(model, ModelIR):
        return model
    if isinstance(model, Path) or (isinstance(model, str)
                                   and model.lower().endswith(".json")):
        return ModelIR.load(model)
    from hetplan.ir.capture import capture

    if isinstance(model, str):
        from hetplan import zoo

        entry = zoo.get(model)
        args, kwargs = zoo.example_inputs(entry.name, batch=1, seq=seq)
        return capture(zoo.build(entry.name), args, kwargs, name=entry.name)
    if not callable(getattr(model, "named_parameters", None)):  # not an nn.Module
        raise SpecError("model: expected a zoo name, an nn.Module (with example_inputs), a "
                        f"ModelIR or a workload file path, got {type(model).__name__}")
    if example_inputs is None:
        raise SpecError(
            "compile() of an nn.Module needs example_inputs (one micro-batch, ideally of size 1)"
        )
    return capture(model, example_inputs, example_kwargs)


def _screen(job: _Job, candidates: list[LayoutCandidate], infeasible: list[_Refusal],
            progress: Progress | None = None) -> tuple[list[Scored], int]:
    """Every candidate layout with the screening passes at its ZeRO stage, fastest first,
    and how many were pruned; the reasons of those that cannot fit at any stage are appended
    to ``infeasible``.

    Candidates are screened in the order of their lower bound
    (:func:`~hetplan.optimizer.bounds.iteration_lower_bound`, ties in layout order); once
    :data:`FINALISTS` layouts fit, a candidate whose bound exceeds the slowest of the
    fastest :data:`FINALISTS` so far cannot become a finalist, and neither can any after it:
    the rest are pruned unscreened. The finalists, and so the plan, are those of screening
    every candidate."""
    order = list(candidates)
    bounds: dict[LayoutCandidate, float] = {}
    if bounds_apply(job.screening, job.opts.schedule):
        recompute = _partitioner_recompute(job.screening)
        for cand in candidates:
            # the ZeRO stages _screen_one can plan: it skips those the model state rules out
            ladder = [z for z in job.zero_ladder(cand)
                      if not _memory_lower_bound(job.workload, replace(cand, zero_stage=z),
                                                 job.costs, job.layout(cand).stage_copies)]
            bounds[cand] = iteration_lower_bound(job.workload, job.costs, cand,
                                                 cand.schedule_for(job.opts.schedule), ladder,
                                                 recompute=recompute)
        order.sort(key=lambda c: (bounds[c], c))
    screened: list[Scored] = []
    top: list[float] = []  # the FINALISTS fastest times so far, ascending
    for k, cand in enumerate(order):
        if len(top) >= FINALISTS and bounds.get(cand, 0.0) > top[-1]:
            pruned = len(order) - k
            if progress is not None:
                progress.advance(pruned)
            screened.sort(key=lambda x: (x[0], x[1]))
            return screened, pruned
        best = _screen_one(job, cand, infeasible)
        if progress is not None:
            progress.advance(1)
        if best is not None:
            screened.append(best)
            top = sorted(top + [best[0]])[:FINALISTS]
    screened.sort(key=lambda x: (x[0], x[1]))
    return screened, 0


def _partitioner_recompute(passes: tuple[Pass, ...]) -> str | None:
    """How the screening picks activation recomputation: ``dynpipe``'s ``recompute`` option
    when it is the only screening pass that writes ``stages``, else None (unknown)."""
    owners = [p for p in passes if "stages" in getattr(p, "sections", ())]
    if len(owners) != 1 or owners[0].name != "dynpipe":
        return None
    mode = getattr(owners[0], "recompute", None)
    return mode if isinstance(mode, str) else None


@dataclass(frozen=True)
class _Refusal:
    """Why a layout was refused, and whether for memory: the search's summary says "fits
    in memory" only when every refusal is (a layout refused for the model's structure, e.g.
    too few places to cut it into the stages asked for, is not called out of memory)."""

    reason: str
    memory: bool


def _screen_one(job: _Job, cand: LayoutCandidate, infeasible: list[_Refusal]
                ) -> Scored | None:
    """``cand`` at the lowest ZeRO stage of its ladder that fits (and, if that needed
    recomputation, the next stage too: the faster wins); None if none fits."""
    best: Scored | None = None
    refusal = _Refusal("", memory=True)
    ladder = job.zero_ladder(cand)
    extra = 0
    for z in ladder:
        c = replace(cand, zero_stage=z)
        reason = _memory_lower_bound(job.workload, c, job.costs,
                                     job.layout(c).stage_copies)
        if reason:
            refusal = _Refusal(reason, memory=True)
            continue
        try:
            plan, ev = job.plan_for(job.layout(c), job.screening)
        except InfeasiblePlanError as e:
            refusal = _Refusal(str(e), memory=isinstance(e, OutOfMemoryError))
            if best is not None:
                break
            continue
        if best is None or (ev.iteration_s, c) < (best[0], best[1]):
            best = (ev.iteration_s, c, plan, ev)
        if all(st.recompute == "none" for st in plan.stages) or extra:
            break
        extra = 1  # it needed recomputation: one more ZeRO stage may avoid it
    if best is None:
        infeasible.append(refusal)
    return best


def _zero0_finalists(job: _Job, screened: list[Scored]) -> list[Scored]:
    """The screening's result with each finalist that took ZeRO-1 untried
    (:meth:`_Job.zero1_free`) also planned at ZeRO-0, the faster kept (ZeRO-1 on a tie: less
    memory for the same time); fastest first again. Equal bytes on the link do not make
    ZeRO-1 as fast: its all-gather comes after the optimizer step, where the all-reduce
    overlapped backward (tiny-gpt2 on ``local-cpu``: 6.891 ms at ZeRO-1, 6.673 at ZeRO-0).
    Only the :data:`FINALISTS` are looked at again, as only they are refined: trying ZeRO-0
    beside every layout's ZeRO-1 took up to 2.7x the search's time for the same plans."""
    out = list(screened)
    for k, (t, cand, _, _) in enumerate(screened[:FINALISTS]):
        if cand.zero_stage != 1 or not job.zero1_free(cand):
            continue
        c = replace(cand, zero_stage=0)
        if _memory_lower_bound(job.workload, c, job.costs, job.layout(c).stage_copies):
            continue
        try:
            plan, ev = job.plan_for(job.layout(c), job.screening)
        except InfeasiblePlanError:
            continue
        if ev.iteration_s < t * (1 - 1e-12):
            out[k] = (ev.iteration_s, c, plan, ev)
    out.sort(key=lambda x: (x[0], x[1]))
    return out


def _refine(job: _Job, screened: list[Scored], infeasible: list[_Refusal]
            ) -> Scored | None:
    """The fastest of the finalists after the refinement passes (the screening's fastest
    when there are none). A finalist that :func:`_zero0_finalists` moved to ZeRO-0 and that
    refinement cannot fit there is refined at the ZeRO-1 it had instead."""
    if not job.refinement:
        return screened[0] if screened else None
    best: Scored | None = None
    for _, cand, _, _ in screened[:FINALISTS]:
        tries = [cand]
        if cand.zero_stage == 0 and job.zero1_free(cand):  # ZeRO-0 in place of a free ZeRO-1
            tries.append(replace(cand, zero_stage=1))
        for c in tries:
            try:
                plan, ev = job.plan_for(job.layout(c), job.refinement)
            except InfeasiblePlanError as e:
                refusal = _Refusal(str(e), memory=isinstance(e, OutOfMemoryError))
                continue
            if best is None or (ev.iteration_s, c) < (best[0], best[1]):
                best = (ev.iteration_s, c, plan, ev)
            break
        else:  # no try fitted: the layout is infeasible (one that fell back is not)
            infeasible.append(refusal)
    return best


def _micro_batch_advice(opts: CompileOptions) -> str:
    """The micro-batch part of the advice when no layout divides the batch: a pinned size
    that leaves too few micro-batches for the schedule (Chimera's even count, interleaved's
    multiple of pp) needs a smaller one, a size past the micro-batch limit a larger one."""
    mbs = opts.micro_batch_size
    if mbs is None:
        return "or pin a micro-batch size that divides the batch per replica"
    if opts.batch_size // mbs > MAX_MICRO_BATCHES:
        return f"or a micro-batch size larger than {mbs}"
    if opts.schedule in ("chimera", "interleaved-1f1b", "auto"):
        return (f"or a micro-batch size smaller than {mbs} (more micro-batches per replica) "
                "that divides the batch per replica")
    return f"or a micro-batch size other than {mbs} that divides the batch per replica"


def _vocab_parallel(opts: CompileOptions, pipeline: tuple[Pass, ...],
                    workload: WorkloadSummary) -> bool:
    """Whether the plan's LM head is vocabulary-parallel (``cost_settings.vocab_parallel``,
    priced so by the whole search): asked for (``opts.vocab_parallel``, the default), the
    model has the head's ``V x h`` embedding (:func:`vocab_split`), and no TP resizing
    controller runs (it resizes the MLP shards and keeps the vocabulary whole at run time).
    See ``docs/decisions/vocab-parallel.md``."""
    controller = any(getattr(p, "controller", "off") != "off" for p in pipeline)
    return not controller and vocab_split(opts.vocab_parallel, workload)


def _assemble(job: _Job, best: Scored, search_note: str) -> Plan:
    """The final plan: stage times, baselines, predictions, provenance and the pass log."""
    _, cand, plan, ev = best
    opts, ir = job.opts, job.ir
    plan = plan.model_copy(update={
        "stages": _stages_with_times(plan, ev),
        "model": ModelRef(name=ir.name, fingerprint=ir.fingerprint(), num_params=ir.num_params,
                          workload=job.workload),
        "cluster": ClusterRef.from_cluster(job.spec),
        "predictions": predictions(ev, _baselines(job, cand), plan.layout),
        "provenance": provenance(ev.stages, job.costs),
        "cost_settings": CostSettings(dtype=opts.dtype, efficiency=opts.efficiency,
                                      optimizer=opts.optimizer,
                                      profile_fingerprint=_db_fingerprint(job.db),
                                      attention=opts.attention, dp_overlap=opts.dp_overlap,
                                      fusion=opts.fusion,
                                      grad_accumulation=opts.grad_accumulation,
                                      vocab_parallel="split" if job.costs.vocab_parallel
                                      else "whole"),
        "precision": job.costs.precision,
        "pass_log": (PassLogEntry(name="layout-search", changed=True, notes=(search_note,)),)
        + plan.pass_log,
        # the action lists the simulator costs and the runtime executes
        "pipeline_actions": layout_actions(plan.layout) if plan.layout else None,
    })
    return Plan.model_validate(plan.model_dump())


def _stages_with_times(plan: Plan, ev: Evaluation) -> tuple[Any, ...]:
    """The plan's stages with their predicted per-micro-batch times and peak memory."""
    return tuple(
        st.model_copy(update={
            "fwd_ms": cost.fwd_s * 1e3,
            "bwd_ms": cost.bwd_s * 1e3,
            "memory_bytes": ev.memory[st.ranks[0]].total,
        })
        for st, cost in zip(plan.stages, ev.stages)
    )


def _memory_lower_bound(workload: WorkloadSummary, cand: LayoutCandidate,
                        costs: CostModel, copies: int = 1) -> str:
    """Why ``cand`` cannot fit whatever the stage partition (the model state of the whole
    model — weights, gradients, master weights and optimizer state in the precision's dtypes,
    with the candidate's TP and ZeRO division — spread perfectly over its ``pp`` pipeline
    ranks exceeds the smallest device), or "". ``copies``: pipeline ranks holding each stage
    (``Layout.stage_copies``; Chimera's 2: each rank holds ``2/pp`` of the model, and ZeRO
    shards over ``2·dp`` ranks)."""
    whole = Stage(index=0, first_layer=0, last_layer=len(workload.layers) - 1,
                  ranks=tuple(range(len(costs.devices))))
    first_of_type: dict[str, int] = {}
    for r, dev in enumerate(costs.devices):  # the precision depends on the device type only
        first_of_type.setdefault(dev.type, r)
    prec = min((stage_precision(workload, whole, costs, r) for r in first_of_type.values()),
               key=lambda p: (p.weight_bytes + p.grad_bytes + p.master_bytes, p.act_bytes))
    w, g, o = model_state(workload.layers, tp=cand.tp, dp=cand.dp * copies,
                          zero_stage=cand.zero_stage, optimizer=costs.optimizer, precision=prec)
    need = (w + g + o) / cand.pp * copies
    cap = min(d.memory_bytes for d in costs.devices) * USABLE_FRACTION
    if need <= cap:
        return ""
    return (
        f"layout {cand.describe()}: weights, gradients, master weights and optimizer state "
        f"alone need {need / 2**30:.1f} GiB per rank even if perfectly balanced, more than "
        f"{cap / 2**30:.1f} GiB usable"
    )


def _zero1_free(costs: CostModel, layout: Layout) -> bool:
    """Whether the data-parallel link of ``layout``'s first stage moves a reduce-scatter
    plus an all-gather in no more time than an all-reduce (at 1 MiB and 1 GiB): then ZeRO-1
    costs no more bytes on the link and divides the optimizer step, so the ladder starts
    there. Not never worse: the all-gather follows the optimizer step, where the all-reduce
    overlapped backward, so the finalists are checked at ZeRO-0 too
    (:func:`_zero0_finalists`). The group is the ranks holding the first stage (under
    Chimera also pipeline rank ``pp-1``'s)."""
    ranks = [layout.rank_of(d, p, 0) for p in layout.stage_holders(0) for d in range(layout.dp)]
    n = layout.sync_group_size
    link: Literal["intra", "inter"] = (
        "intra" if len({costs.devices[r].node_index for r in ranks}) == 1 else "inter")
    for size in (2.0**20, 2.0**30):
        ar = costs.comm.time_s("allreduce", size, n, link)
        split = (costs.comm.time_s("reduce_scatter", size, n, link)
                 + costs.comm.time_s("allgather", size, n, link))
        if split > ar * (1 + 1e-9):
            return False
    return True


def _baselines(job: _Job, cand: LayoutCandidate) -> list[Baseline]:
    """DDP, the winning layout with the baseline passes, and with layer-wise fp32 sync."""
    out: list[Baseline] = []
    base = parse_pipeline(BASELINE_PIPELINE)
    if job.opts.recompute != "auto":
        base = tuple(replace(p, recompute=job.opts.recompute)  # type: ignore[type-var]
                     if p.name == "uniform-stages" else p for p in base)
    layout = job.layout(cand)

    def add(name: str, description: str, fn: Any) -> None:
        try:
            ev = fn()
        except InfeasiblePlanError:
            return
        out.append(Baseline(name=name, description=description,
                            iteration_time_ms=ev.iteration_s * 1e3, breakdown=breakdown(ev),
                            memory_per_rank_bytes=tuple(m.total for m in ev.memory)))

    # pure data parallelism with DDP buckets, at the largest micro-batch that fits
    ddp = enumerate_layouts(job.workload, job.spec, job.opts.batch_size, pp=1, tp=1)
    for c in sorted(ddp, key=lambda c: -c.micro_batch_size):
        before = len(out)
        add("ddp", f"PyTorch DDP: dp={c.dp}, 25 MiB uncompressed buckets, micro-batch "
                   f"{c.micro_batch_size}×{c.micro_batches}",
            lambda c=c: job.plan_for(job.layout(c), base)[1])
        if len(out) > before:
            break
    if tuple(p.name for p in job.pipeline) != BASELINE_PASSES:
        add("baseline-passes", f"{cand.describe()} with uniform stages, even TP, DDP buckets",
            lambda: job.plan_for(layout, base)[1])

    def layerwise() -> Evaluation:
        plan, _ = job.plan_for(layout, base)
        return evaluate(job.workload, layout, plan.stages, None, job.costs)

    add("layer-wise", f"{cand.describe()} with one uncompressed allreduce per gradient "
                      "(no fusion)",
        layerwise)
    # what the Espresso authors' reference implementation would choose, per compressor the
    # plan's Espresso pass may use, priced by the same simulator
    for comp in _espresso_compressors(job.pipeline):
        ref = parse_pipeline(f"{BASELINE_PIPELINE},espresso-reference{{compressor={comp}}}")
        add(f"espresso-reference-{comp}",
            f"{cand.describe()}: the Espresso reference implementation's threshold rule "
            f"with {comp}",
            lambda ref=ref: job.plan_for(layout, ref)[1])
    return out


def _espresso_compressors(pipeline: tuple[Any, ...]) -> list[str]:
    """The sparsifying/quantizing compressors the pipeline's Espresso pass may use (the
    reference rule picks among its options for one compressor; 16-bit casts are not one)."""
    out: list[str] = []
    for p in pipeline:
        if p.name == "espresso":
            out += [c for c in getattr(p, "compressors", ())
                    if c not in ("fp16", "bf16") and c not in out]
    return out


def _db_fingerprint(db: ProfileDB | None) -> str:
    if db is None:
        return ""
    return db.fingerprint()
