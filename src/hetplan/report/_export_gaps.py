"""What an engine's launch configuration cannot express, and the plan it runs instead.

:mod:`hetplan.report.export` asks each engine writer (:mod:`hetplan.report._export_engines`)
for the values it writes and for the parts of the plan it cannot express. A part it cannot
express is an :class:`Unexpressed`: what the plan does, what the exported configuration does
instead, and a function that turns a :class:`Variant` (the plan's layout, stages, gradient
sync, TP section and precision) into the variant without that part. The exporter prices each
part alone and all of them together with the plan's own cost model.

The detectors here are shared by the engines; each takes what its engine supports as
arguments. The helpers that build the engine's own defaults (an even stage split, DDP-style
buckets) live here too, so the writers and the pricing use the same ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

from hetplan.algorithms.pipeline_schedules import build_schedule
from hetplan.cost_models.ddp import ddp_gradient_sync, stage_of_layer
from hetplan.cost_models.evaluate import edited_lists
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sparse import SparseSync
from hetplan.ir.plan_sections import (
    Bucket,
    CastSync,
    CompressedSync,
    GradientSync,
    Layout,
    NoSync,
    PipelineActions,
    ResizingController,
    Stage,
    TensorParallel,
    TensorSync,
    WorkloadSummary,
)

#: The gradient-sync strategies of a plan.
Strategy = NoSync | CastSync | CompressedSync

__all__ = ["Variant", "Unexpressed", "PlanView", "RECOMPUTE_ORDER", "ENGINE_BUCKET_MB",
           "even_stages", "merge_virtual", "split_buckets", "engine_buckets", "common_dtype",
           "relayout", "with_recompute", "sync_gaps", "sparse_gaps", "tp_gaps",
           "rebalancing_gaps", "lists_gaps", "group_sync_gaps", "checkpointing_gaps",
           "used_strategies"]

#: Recomputation modes from least to most memory-saving; exporting one mode for stages that
#: differ uses the strongest (every stage still fits).
RECOMPUTE_ORDER = ("none", "selective", "full")
#: The bucket size the engines are told (DeepSpeed's ``reduce_bucket_size``, Megatron's
#: ``--ddp-bucket-size``), and the one their buckets are priced at: PyTorch DDP's default.
ENGINE_BUCKET_MB = 25.0


@dataclass(frozen=True)
class Variant:
    """A plan's decisions that an exported configuration may change.

    ``precision``: a precision policy forced everywhere (``fp32``, ``bf16``, ``fp16``), or
    None for the plan's own precision section. ``actions``: the plan's pipeline action lists
    (None: the lists the layout's schedule generates); a variant whose layout no longer fits
    them runs its generated lists (:func:`~hetplan.cost_models.evaluate.edited_lists`).
    ``sparse``: the plan's sparse-sync section (None: every gradient on the gradient-sync
    section's dense path).
    """

    layout: Layout
    stages: tuple[Stage, ...]
    sync: GradientSync | None
    tp: TensorParallel | None
    precision: str | None = None
    actions: PipelineActions | None = None
    sparse: SparseSync | None = None


@dataclass(frozen=True)
class Unexpressed:
    """A part of the plan an engine cannot express.

    Attributes:
        part: a short key (``uneven-stages``, ``compression`` ...).
        plan_does: what the plan does, in words.
        exported_as: what the exported configuration does instead.
        apply: the variant without this part (None: the part is not an iteration-time
            decision, e.g. re-balancing, and ``worth`` says what it was predicted to give).
        worth: for a part without ``apply``, what the plan predicted it to be worth.
    """

    part: str
    plan_does: str
    exported_as: str
    apply: Callable[[Variant], Variant] | None = None
    worth: str = ""


@dataclass(frozen=True)
class PlanView:
    """The plan's facts the engine writers need.

    Attributes:
        plan: the plan.
        workload: its workload summary.
        layout: its layout.
        stages: its stages (one stage over every layer without a pipeline).
        dtypes: compute dtype of each device type the plan's ranks use.
    """

    plan: Plan
    workload: WorkloadSummary
    layout: Layout
    stages: tuple[Stage, ...]
    dtypes: dict[str, str]

    @property
    def kinds(self) -> list[str]:
        return [x.kind for x in self.workload.layers]

    @property
    def num_blocks(self) -> int:
        return sum(1 for k in self.kinds if k == "block")

    @property
    def global_batch(self) -> int:
        lay = self.layout
        return lay.micro_batch_size * lay.micro_batches * lay.dp

    def recompute_modes(self) -> list[str]:
        return sorted({s.recompute for s in self.stages}, key=RECOMPUTE_ORDER.index)

    def variant(self) -> Variant:
        return Variant(self.layout, self.stages, self.plan.gradient_sync,
                       self.plan.tensor_parallel, actions=self.plan.pipeline_actions,
                       sparse=self.plan.sparse_sync)


def relayout(layout: Layout, **update: object) -> Layout:
    """``layout`` with fields replaced, validated again."""
    return Layout.model_validate({**layout.model_dump(), **update})


def common_dtype(dtypes: list[str] | set[str]) -> str:
    """One compute dtype every device can run: the only one, else fp32 if any device
    computes fp32, else fp16 if any does (a pre-Ampere GPU has no bf16), else bf16."""
    found = set(dtypes)
    if len(found) == 1:
        return next(iter(found))
    for d in ("fp32", "fp16"):
        if d in found:
            return d
    return "bf16"


def with_recompute(stages: tuple[Stage, ...], mode: str) -> tuple[Stage, ...]:
    """Every stage at recomputation ``mode``."""
    return tuple(s.model_copy(update={"recompute": mode}) for s in stages)


def _stage(old: Stage, index: int, first: int, last: int, names: list[str],
           recompute: str | None = None) -> Stage:
    return Stage.model_validate({
        "index": index, "first_layer": first, "last_layer": last,
        "layer_names": tuple(names[first:last + 1]) if old.layer_names else (),
        "ranks": old.ranks, "recompute": recompute or old.recompute})


def even_stages(view: PlanView, n: int | None = None) -> tuple[Stage, ...] | None:
    """The engines' default split into ``n`` stages (default ``pp * virtual_stages``): the
    transformer blocks divided evenly (the first stages take one more when they do not
    divide), layers before the first block on the first stage, layers after a block with
    it; without blocks, the layers divided evenly. Ranks and recomputation stay the plan's
    stage by stage. None when there are fewer blocks than stages."""
    stages = view.stages
    n = n if n is not None else len(stages)
    kinds = view.kinds
    names = [x.name for x in view.workload.layers]
    units = [i for i, k in enumerate(kinds) if k == "block"] or list(range(len(kinds)))
    if len(units) < n:
        return None
    base, extra = divmod(len(units), n)
    starts, at = [], 0
    for s in range(n):
        starts.append(units[at])
        at += base + (1 if s < extra else 0)
    starts[0] = 0
    ends = [starts[s + 1] - 1 for s in range(n - 1)] + [len(kinds) - 1]
    return tuple(_stage(stages[s], s, starts[s], ends[s], names) for s in range(n))


def merge_virtual(view: PlanView, stages: tuple[Stage, ...], pp: int) -> tuple[Stage, ...]:
    """Interleaved stages merged into one contiguous stage per pipeline rank: stage ``p``
    takes the layers of stages ``p*v .. p*v+v-1`` and keeps the ranks of pipeline
    coordinate ``p``, at the strongest recomputation among them."""
    v = len(stages) // pp
    names = [x.name for x in view.workload.layers]
    out = []
    for p in range(pp):
        group = stages[p * v:(p + 1) * v]
        mode = max((s.recompute for s in group), key=RECOMPUTE_ORDER.index)
        out.append(_stage(stages[p], p, group[0].first_layer, group[-1].last_layer, names,
                          recompute=mode))
    return tuple(out)


def split_buckets(workload: WorkloadSummary, stages: tuple[Stage, ...],
                  sync: GradientSync | None) -> GradientSync | None:
    """``sync`` with every bucket split where it spans two of ``stages`` (a bucket syncs
    one stage's gradients)."""
    if sync is None:
        return None
    stage_of = stage_of_layer(stages, len(workload.layers))
    grad = {g.name: g for g in workload.grads}
    out: list[Bucket] = []
    for b in sync.buckets:
        parts: dict[int, list[str]] = {}
        for t in b.tensors:
            parts.setdefault(stage_of[grad[t].layer_index], []).append(t)
        out += [Bucket(tensors=tuple(ts), strategy=b.strategy,
                       size_bytes=sum(grad[t].size_bytes for t in ts))
                for _, ts in sorted(parts.items())]
    if [b.tensors for b in out] == [b.tensors for b in sync.buckets]:
        return sync
    return _with_buckets(sync, out)


def _with_buckets(sync: GradientSync, buckets: list[Bucket]) -> GradientSync:
    in_bucket = {t: b.strategy for b in buckets for t in b.tensors}
    tensors = tuple(TensorSync(name=t.name, strategy=in_bucket.get(t.name, t.strategy))
                    for t in sync.tensors)
    return GradientSync(strategies=sync.strategies, tensors=tensors, buckets=tuple(buckets))


def engine_buckets(workload: WorkloadSummary, stages: tuple[Stage, ...],
                   sync: GradientSync) -> GradientSync:
    """The engines' size-capped buckets (:func:`ddp_gradient_sync` at
    :data:`ENGINE_BUCKET_MB`) for ``stages``, each tensor keeping the strategy it has in
    ``sync`` (a bucket is split where its tensors' strategies change)."""
    strategy_of = {t: b.strategy for b in sync.buckets for t in b.tensors}
    strategy_of.update({t.name: t.strategy for t in sync.tensors if t.name not in strategy_of})
    fallback = next(iter(sorted(sync.strategies)))
    size = {g.name: g.size_bytes for g in workload.grads}
    out: list[Bucket] = []
    for b in ddp_gradient_sync(workload, stages, bucket_cap_mb=ENGINE_BUCKET_MB).buckets:
        run: list[str] = []
        for t in b.tensors:
            if run and strategy_of.get(t, fallback) != strategy_of.get(run[0], fallback):
                out.append(Bucket(tensors=tuple(run), strategy=strategy_of.get(run[0], fallback),
                                  size_bytes=sum(size[x] for x in run)))
                run = []
            run.append(t)
        out.append(Bucket(tensors=tuple(run), strategy=strategy_of.get(run[0], fallback),
                          size_bytes=sum(size[x] for x in run)))
    return _with_buckets(sync, out)


def used_strategies(sync: GradientSync) -> dict[str, Strategy]:
    """The strategies the buckets and tensors of ``sync`` use, by key."""
    keys = {b.strategy for b in sync.buckets} | {t.strategy for t in sync.tensors}
    return {k: sync.strategies[k] for k in sorted(keys)}


def _map_strategies(sync: GradientSync, fn: Callable[[Strategy], Strategy]) -> GradientSync:
    return GradientSync(strategies={k: fn(s) for k, s in sync.strategies.items()},
                        tensors=sync.tensors, buckets=sync.buckets)


def _decompress(s: Strategy) -> Strategy:
    return NoSync() if isinstance(s, CompressedSync) else s


def _flatten(s: Strategy) -> Strategy:
    if isinstance(s, NoSync) and s.hierarchy != "flat":
        return NoSync()
    if isinstance(s, CastSync) and s.hierarchy != "flat":
        return CastSync(dtype=s.dtype)
    return s


def _uncast(s: Strategy) -> Strategy:
    return NoSync(hierarchy=s.hierarchy, steps=s.steps) if isinstance(s, CastSync) else s


def _sync_update(fn: Callable[[GradientSync], GradientSync]) -> Callable[[Variant], Variant]:
    def apply(v: Variant) -> Variant:
        return v if v.sync is None else replace(v, sync=fn(v.sync))
    return apply


def sync_gaps(view: PlanView, *, engine: str, cast: Literal["uniform", "no"] = "no",
              bucket_knob: str = "") -> list[Unexpressed]:
    """Per-tensor compression, hierarchical routing, 16-bit casts and fusion buckets: none of
    the engines takes a per-tensor sync plan. ``cast="uniform"``: the engine casts every
    gradient to one dtype for communication (DeepSpeed's ``communication_data_type``), so a
    plan whose every strategy casts to the same dtype keeps it. ``bucket_knob`` names the
    engine's bucket-size setting (empty: it has none)."""
    sync = view.plan.gradient_sync
    if sync is None or not (sync.strategies or sync.tensors or sync.buckets):
        return []  # (an empty section reads as none: every gradient one fp32 allreduce)
    used = used_strategies(sync)
    out: list[Unexpressed] = []
    compressed = sorted({s.compressor for s in used.values() if isinstance(s, CompressedSync)})
    if compressed:
        n = sum(1 for t in _tensor_strategies(sync).values()
                if isinstance(sync.strategies[t], CompressedSync))
        out.append(Unexpressed(
            "compression", f"{n} gradient tensor(s) compressed ({', '.join(compressed)})",
            f"{engine} syncs every gradient uncompressed",
            _sync_update(lambda s: _map_strategies(s, _decompress))))
    if any(getattr(s, "hierarchy", "flat") != "flat" for s in used.values()
           if not isinstance(s, CompressedSync)):
        out.append(Unexpressed(
            "hierarchical-sync", "intra-node reduce-scatter, inter-node allreduce, intra-node "
            "allgather (Espresso's hierarchical routing)",
            f"{engine}'s collectives (one flat allreduce or reduce-scatter per bucket)",
            _sync_update(lambda s: _map_strategies(s, _flatten))))
    casts = {s.dtype for s in used.values() if isinstance(s, CastSync)}
    uniform = len(casts) == 1 and all(isinstance(s, CastSync) for s in used.values())
    if casts and not (cast == "uniform" and uniform):
        out.append(Unexpressed(
            "cast-sync", f"gradients cast to {'/'.join(sorted(casts))} for communication, "
                         "tensor by tensor",
            f"{engine} communicates gradients in its reduce dtype",
            _sync_update(lambda s: _map_strategies(s, _uncast))))
    ddp = engine_buckets(view.workload, view.stages, sync)
    if [b.tensors for b in ddp.buckets] != [b.tensors for b in sync.buckets]:
        knob = (f"{bucket_knob} = {ENGINE_BUCKET_MB:g} MiB" if bucket_knob
                else "its own buckets (priced as 25 MiB size-capped buckets)")
        out.append(Unexpressed(
            "fusion-buckets", f"{len(sync.buckets)} chosen fusion bucket(s) (Cupcake)",
            f"size-capped buckets in backward order: {knob}",
            lambda v: v if v.sync is None else replace(
                v, sync=engine_buckets(view.workload, v.stages, v.sync))))
    return out


def sparse_gaps(view: PlanView, *, engine: str) -> list[Unexpressed]:
    """Sparse sync of embedding gradients (Zen's hashed all-to-all, or AGsparse's
    all-gather): none of the engines takes a per-tensor sparse scheme; each all-reduces the
    gradient dense with the others. Priced as the plan without its ``sparse_sync`` section
    (every such tensor back in its gradient-sync unit, as ``explain TENSOR``'s dense
    alternative prices it)."""
    sparse = view.plan.sparse_sync
    synced = sparse.synced() if sparse is not None else {}
    if not synced:
        return []
    schemes = ", ".join(f"{name} {t.scheme}" for name, t in synced.items())
    return [Unexpressed(
        "sparse-sync", f"sparse sync of {len(synced)} embedding gradient(s): {schemes} "
                       "(sparse_sync.tensors)",
        f"{engine} all-reduces every gradient dense, in its buckets",
        lambda v: replace(v, sparse=None))]


def _tensor_strategies(sync: GradientSync) -> dict[str, str]:
    out = {t.name: t.strategy for t in sync.tensors}
    out.update({t: b.strategy for b in sync.buckets for t in b.tensors})
    return out


def tp_gaps(view: PlanView, *, engine: str) -> list[Unexpressed]:
    """Uneven TP shards and the resizing controller: the engines split every linear evenly
    and have no controller."""
    tp = view.plan.tensor_parallel
    if tp is None:
        return []
    out: list[Unexpressed] = []
    uneven = sorted({lin.name for g in tp.groups for lin in g.linears
                     if len(set(lin.shard_sizes)) > 1})
    if uneven:
        out.append(Unexpressed(
            "uneven-tp-shards", f"{len(uneven)} linear(s) split unevenly across their TP group "
                                f"(e.g. {uneven[0]})",
            f"{engine} splits every linear evenly",
            lambda v: v if v.tp is None else replace(v, tp=v.tp.model_copy(update={
                "groups": tuple(g.model_copy(update={"linears": ()}) for g in v.tp.groups)}))))
    if tp.controller.variant != "off":
        out.append(Unexpressed(
            "resizing-controller", f"the {tp.controller.variant} resizing controller "
                                   "(ZERO-resizing / SEMI-migration) re-balances TP shards at "
                                   "run time",
            f"{engine} has no TP resizing controller",
            lambda v: v if v.tp is None else replace(v, tp=v.tp.model_copy(update={
                "controller": ResizingController(),
                "groups": tuple(g.model_copy(update={"roles": ()}) for g in v.tp.groups)}))))
    return out


def rebalancing_gaps(view: PlanView, *, engine: str) -> list[Unexpressed]:
    """Dynamic re-balancing (DynPipe): the engines keep the initial stages for the whole
    run. Its worth is a whole-run throughput, not one iteration's time."""
    rb = view.plan.rebalancing
    if rb is None or not any(e.applied for e in rb.events):
        return []
    applied = sum(1 for e in rb.events if e.applied)
    return [Unexpressed(
        "rebalancing", f"{applied} planned re-balancing event(s) over {rb.total_iterations} "
                       "iterations (DynPipe)",
        f"{engine} keeps the initial stages for the whole run",
        worth=f"predicted whole-run speedup {rb.speedup_vs_static:.3f}x over static stages")]


def group_sync_gaps(view: PlanView, *, engine: str) -> list[Unexpressed]:
    """SDPipe's group sync of pipeline replicas (``group_sync.policy == "sdpipe"``): every
    engine all-reduces gradients in lock step. Its worth is a throughput under the plan's
    straggler model (``group_sync.speedup``), not one iteration's time."""
    gs = view.plan.group_sync
    if gs is None or gs.policy != "sdpipe":
        return []
    return [Unexpressed(
        "group-sync", f"SDPipe group sync of {gs.num_pipelines} pipeline replicas: each steps "
                      "its optimizer locally and averages parameters with the replicas ready "
                      "(group_sync)",
        f"{engine} all-reduces gradients in lock step (synchronous data parallelism)",
        worth=f"lock-step all-reduce, where SDPipe was predicted {gs.speedup:.3f}x its "
              "iterations per second under the plan's straggler model")]


def checkpointing_gaps(view: PlanView, *, engine: str) -> list[Unexpressed]:
    """Gemini's in-memory checkpoints in peers' CPU memory (``checkpointing``): the engines
    checkpoint to storage with their own settings. Its worth is the time a failure wastes,
    not one iteration's time."""
    ck = view.plan.checkpointing
    if ck is None:
        return []
    return [Unexpressed(
        "checkpointing", f"Gemini in-memory checkpoints: {ck.replicas} copies of every rank's "
                         f"state in CPU memory, every {ck.every_iters} iteration(s) "
                         "(checkpointing)",
        f"{engine} checkpoints to storage with its own settings (set them yourself)",
        worth=f"a failure is predicted to waste {ck.baseline.wasted_ms:.1f} ms with "
              f"{ck.baseline.name} checkpoints, where Gemini's waste {ck.gemini.wasted_ms:.1f} ms")]


def lists_gaps(view: PlanView, *, engine: str) -> list[Unexpressed]:
    """Hand-edited pipeline action lists: every engine generates its schedule's own order
    of forwards and backwards and takes no per-rank lists. Priced as the plan run with the
    lists its layout's schedule generates. O(P * M * v)."""
    lay, acts = view.layout, view.plan.pipeline_actions
    if acts is None or edited_lists(lay, acts) is None:
        return []
    generated = build_schedule(lay.schedule, lay.pp, lay.micro_batches,
                               lay.virtual_stages).encode()
    ranks = [r for r, text in enumerate(acts.ranks) if text != generated[r]]
    return [Unexpressed(
        "edited-action-lists",
        f"edited pipeline action lists: pipeline rank(s) {ranks} run another order than the "
        f"{lay.schedule} schedule generates (pipeline_actions.ranks)",
        f"{engine} runs the order its own schedule generates (it takes no per-rank lists)",
        lambda v: replace(v, actions=None))]
