"""The one semantic check of a plan: every rule that relates one plan section to another.

Each section's pydantic model checks what it can alone (a stage's layer range, a TP linear's
shard sum, a bucket's strategy name, a compressor's parameters). What needs two sections is
here, in :func:`plan_problems`, which :class:`~hetplan.ir.plan.Plan`'s own model validator
runs. It therefore runs wherever a plan is built or read — ``Plan(...)``, the pass manager's
``Plan.model_validate`` after every pass, ``load_plan`` in ``validate``, ``inspect``,
``simulate``, ``explain``, ``diff``, ``timeline`` and the runtime — and no path skips it.

Rules (each applies when the sections it relates are present):

1. **cluster**: ``world_size`` and ``fingerprint`` are those of the embedded spec; the
   precision section names its device types, at peaks they list.
2. **layout**: it uses at most the cluster's devices (dp·pp·tp ≤ world size; ``hetplan
   plan`` uses all of them, tests and re-packing fewer); the global batch is
   dp × micro-batch size × micro-batches; ``ranks`` placements follow
   :meth:`Layout.rank_of` (and the embedded cluster's devices); the schedule can be built
   for its sizes (Chimera: an even pp of at least 2 and an even micro-batch count;
   interleaved 1F1B: micro-batches a multiple of pp), as the simulator and runtime build it.
   Chimera composes only with ``tp = 1``, ZeRO 0 or 1, no per-stage degrees (``hetero``),
   flat gradient-sync routings, no sparse (Zen) sync, no SDPipe group sync and no planned
   re-balancing events: what is priced and executed for it (``docs/decisions.md``,
   "Chimera: what is priced").
3. **stages**: pp · virtual_stages of them; stage ``s`` runs on exactly the dp·tp ranks of
   pipeline coordinate ``s mod pp``; their layers are contiguous from 0 and cover the
   workload; ``layer_names`` are the workload's; no stage after the first starts at a layer
   whose ``cuttable_before`` is False (the runtime cannot split the model there).
4. **pipeline_actions**: the layout's schedule, micro-batches, stage and rank counts; every
   forward and backward of every stage and micro-batch exactly once, each backward on its
   forward's rank; and the lists can finish: executed rank by rank in list order they do not
   deadlock (:func:`~hetplan.ir.pipeline_order.check_progress`, the check the simulator and
   the runtime run, with its message naming each stuck rank and its next action); and what
   the runtime's executors assume (pure checks of :mod:`hetplan.ir.pipeline_order`, which
   the runtime runs too): stage ``s`` on pipeline rank ``s mod pp``; Chimera's shape (each
   micro-batch down or up, half each way) and both ends of every Chimera transfer posting in
   one order (per-stage degrees, ``hetero``, too: their executor pairs messages the same
   way); for torch's schedule runtime (not Chimera, not per-stage degrees) the last
   stage's forwards in micro-batch order (it reads micro-batch ``m``'s loss at position
   ``m`` of the losses in forward order).
5. **tensor_parallel**: each group is one TP group of the layout (tp ranks that differ only
   in their tp coordinate), inside its stage; its linears are inside layers of the workload;
   each rank has one role, pruning at most the controller's ``gamma_max``. With per-stage
   degrees (``hetero``), one replica's TP group of its stage instead
   (:mod:`hetplan.ir.plan_hetero_checks`, run with rule 3).
6. **gradient_sync**: names only gradients of the workload; a bucket stays in one stage; an
   inter-node step needs more than one node; every strategy's path leaves the sum over all
   ranks, each rank's gradient once, on every rank (:mod:`hetplan.ir.sync_paths`).
   **sparse_sync** names only gradients of the workload, each with its shape (rows x
   row_elems elements), and syncs sparsely only a token embedding's (a layer of kind
   ``embedding`` fed ids): another gradient is dense.
7. **rebalancing**: every planned event assigns the workload's layers to the plan's stages,
   none of them starting at a layer the runtime cannot split before (as in rule 3); with
   per-stage degrees, to every stage, none released (:mod:`hetplan.ir.plan_hetero_checks`).
   Replayed as the runtime runs them (applied events in iteration order, from the plan's
   stages): no two applied events at one iteration, and an applied event's migrations are
   the layers its stage ranges move (:mod:`hetplan.ir.plan_rebalancing_checks`).
8. **predictions**: at most one memory figure per rank. **cost_settings.vocab_parallel**
   ``split`` needs the pair it splits (an LM head beside its ``V x h`` token embedding,
   :mod:`hetplan.ir.vocab`) and no TP resizing controller (it keeps the vocabulary whole).
9. **complete** plans — what ``hetplan plan`` writes, required of every plan file
   (:func:`~hetplan.ir.plan.load_plan`; ``Plan.from_json(..., complete=True)``):
   a layout, the stages of a pipeline, the model's workload summary; a pipeline with at
   least one micro-batch per stage and interleaved 1F1B with at least 2 virtual stages (what
   the runtime's schedules need). Drafts, the plans passes hand to each other, lack sections
   (there are no stages before the balancing pass), so rule 9 applies only when asked for.

Every problem is one line ``"field.path: what is wrong, what was expected"``; the caller
joins them into one error, so a broken plan shows all of its problems at once.

A plan that does not embed its cluster spec is checked against the cluster it is used with
(``plan_problems(plan, cluster=spec)``: what ``simulate --cluster`` runs), so the rules that
read the spec (1, 2's placements, 6's hierarchy) hold there too; a peak the device type
lacks is then a refusal naming ``precision.devices[...]``, never a lookup failure in a cost
model. The caller checks that cluster's fingerprint itself.

Complexity: O(world size + layers + gradients + pipeline actions) (the progress check is
linear in the actions: a blocked rank sleeps until its dependency ends).

The module is somewhat over 600 lines on purpose: it is the one validator, its rules read
in the order above, each a short function over the shared helpers at the end; sections with
rules of their own live beside it (:mod:`hetplan.ir.plan_hetero_checks`,
:mod:`hetplan.ir.plan_group_sync`, :mod:`hetplan.ir.plan_rebalancing_checks`,
:mod:`hetplan.ir.plan_checkpointing`: the placement of Gemini's copies, each on another node
than the one it guards).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from typing import Protocol

from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.pipeline_order import (
    PipelineDeadlockError,
    PipelineSchedule,
    PipelineScheduleError,
    chimera_shape_problem,
    decode_schedule,
    last_stage_order_problem,
    misplaced_stages,
    transfer_order_problem,
)
from hetplan.ir.plan_sections import (
    ClusterRef,
    CostSettings,
    LayerCost,
    Precision,
    GradientSync,
    Layout,
    ModelRef,
    PipelineActions,
    Predictions,
    Stage,
    TensorParallel,
    WorkloadSummary,
)
from hetplan.ir.plan_checkpointing import Checkpointing, checkpointing_problems
from hetplan.ir.plan_group_sync import GroupSync, group_sync_problems
from hetplan.ir.plan_hetero import Hetero, hetero_problems, hetero_section_problems
from hetplan.ir.plan_hetero_checks import hetero_rebalancing_problems, hetero_tp_problems
from hetplan.ir.plan_rebalancing_checks import applied_event_problems
from hetplan.ir.model import DTYPE_BYTES
from hetplan.ir.plan_sparse import SparseSync
from hetplan.ir.rebalancing import Rebalancing
from hetplan.ir.sync_paths import path_problems
from hetplan.ir.validation import did_you_mean
from hetplan.ir.vocab import capture_dtype_bytes, splits_vocabulary

__all__ = ["plan_problems"]


class Plan(Protocol):
    """The sections of a :class:`hetplan.ir.plan.Plan` the rules read (a protocol, so that
    this module, which ``plan.py`` imports, does not import it back)."""

    @property
    def model(self) -> ModelRef: ...
    @property
    def cluster(self) -> ClusterRef: ...
    @property
    def layout(self) -> Layout | None: ...
    @property
    def stages(self) -> tuple[Stage, ...]: ...
    @property
    def pipeline_actions(self) -> PipelineActions | None: ...
    @property
    def tensor_parallel(self) -> TensorParallel | None: ...
    @property
    def gradient_sync(self) -> GradientSync | None: ...
    @property
    def rebalancing(self) -> Rebalancing | None: ...
    @property
    def predictions(self) -> Predictions | None: ...
    @property
    def precision(self) -> Precision | None: ...
    @property
    def group_sync(self) -> GroupSync | None: ...
    @property
    def checkpointing(self) -> Checkpointing | None: ...
    @property
    def sparse_sync(self) -> SparseSync | None: ...
    @property
    def hetero(self) -> Hetero | None: ...
    @property
    def cost_settings(self) -> CostSettings | None: ...

_RERUN = "re-run `hetplan plan`"
_ACTION = re.compile(r"^([0-9]+)([FB])([0-9]+)$")


def plan_problems(plan: Plan, *, complete: bool = False,
                  cluster: ClusterSpec | None = None) -> list[str]:
    """Every cross-section problem of ``plan``, one line each (empty: consistent).

    Args:
        plan: a plan whose sections each passed their own validation.
        complete: also require what a finished plan has (rule 9 of the module docstring).
        cluster: the spec the plan is used with, in place of its embedded one (None: the
            embedded ``cluster.spec``, if any). Its fingerprint is the caller's to check.
    """
    given = cluster is not None
    spec = cluster if cluster is not None else plan.cluster.spec
    label = f"cluster {spec.name!r} (--cluster)" if given and spec else "cluster.spec"
    problems = _cluster(plan, spec, label, given) + _layout(plan, spec, label)
    problems += _stages(plan) + _pipeline_actions(plan) + _tensor_parallel(plan)
    problems += _gradient_sync(plan, spec) + _sparse_sync(plan) + _rebalancing(plan)
    problems += _predictions(plan) + _vocab_parallel(plan)
    problems += group_sync_problems(plan.group_sync, plan.layout)
    problems += checkpointing_problems(plan.checkpointing, spec)
    if complete:
        problems += _completeness(plan)
    return problems


# -- 1. cluster -------------------------------------------------------------------------------
def _cluster(plan: Plan, spec: ClusterSpec | None, label: str, given: bool) -> list[str]:
    ref = plan.cluster
    if spec is None:
        return []
    out = []
    if ref.world_size != spec.world_size:
        where = label if given else "the embedded cluster spec (cluster.spec)"
        out.append(f"cluster.world_size: {ref.world_size}, but {where} has {spec.world_size} "
                   f"devices; {_RERUN}")
    precision = plan.precision
    used = sorted({g.type for node in spec.nodes for g in node.devices})
    for name, dev in sorted(precision.devices.items()) if precision is not None else ():
        if name not in used:
            out.append(f"precision.devices[{name!r}]: not a device type of cluster "
                       f"{spec.name!r} (its types: {', '.join(used)})"
                       f"{did_you_mean(name, used)}")
        elif dev.peak_dtype not in spec.device_types[name].peak_tflops:
            out.append(f"precision.devices[{name!r}].peak_dtype: {dev.peak_dtype!r}, but "
                       f"{label} lists no {name} peak for it (it lists "
                       f"{', '.join(spec.device_types[name].peak_tflops)})")
        elif want := _peak_problem(dev.compute_dtype, dev.peak_dtype,
                                   spec.device_types[name].peak_tflops):
            out.append(f"precision.devices[{name!r}].peak_dtype: {dev.peak_dtype!r}, but it "
                       f"computes in {dev.compute_dtype!r}, which is priced at {want!r} on "
                       f"{name} ({label} lists {', '.join(spec.device_types[name].peak_tflops)}"
                       f"); {_RERUN}")
    out += _device_classes(plan, spec, label)
    if not given and ref.fingerprint != spec.fingerprint():
        out.append(f"cluster.fingerprint: {ref.fingerprint!r}, but the embedded cluster spec "
                   f"has fingerprint {spec.fingerprint()!r} (was cluster.spec edited after "
                   f"planning?); {_RERUN} for the cluster you mean")
    return out


def _device_classes(plan: Plan, spec: ClusterSpec, label: str) -> list[str]:
    """A heterogeneous plan's stages name a device type their ranks have in the cluster
    (``"<type>"`` or ``"<type>@<node group>"``): the reports and the explanation print it.
    (The search gives a stage the ranks of one class; a stage whose ranks also hold another
    type, e.g. a straggler declared as a slowed type of its own, keeps its class.)"""
    if plan.hetero is None:
        return []
    devices = spec.devices()
    out = []
    for i, shape in enumerate(plan.hetero.stages):
        if shape.stage >= len(plan.stages):
            continue  # rule 3 names it
        ranks = [r for r in plan.stages[shape.stage].ranks if r < len(devices)]
        have = sorted({devices[r].type for r in ranks})
        want = shape.device_class.split("@")[0]
        if have and want not in have:
            out.append(f"hetero.stages[{i}].device_class: {shape.device_class!r}, but the "
                       f"stage's ranks {_short(ranks)} are {', '.join(have)} in {label}; "
                       f"{_RERUN}")
    runner = plan.hetero.search.runner_up
    types = {d.type for d in devices}
    for name in runner.order if runner is not None else ():
        if name.split("@")[0] not in types:
            out.append(f"hetero.search.runner_up.order: {name!r} is not a device type of "
                       f"{label} ({', '.join(sorted(types))}); {_RERUN}")
    return out


def _peak_problem(compute: str, peak: str, listed: Iterable[str]) -> str:
    """The peak a 16-bit compute dtype is priced at (its own where the device lists it, else
    fp32's: :func:`hetplan.cost_models.precision.peak_dtype`) when ``peak`` is another, or
    fp32's for fp32 compute priced at a 16-bit peak; "" when ``peak`` is right (fp32 compute
    may be priced at another listed fp32-class peak: the ``tf32`` policy)."""
    if compute in ("bf16", "fp16"):
        want = compute if compute in set(listed) else "fp32"
        return want if peak != want else ""
    return "fp32" if peak in ("bf16", "fp16", "fp8", "int8") else ""


# -- 2. layout --------------------------------------------------------------------------------
def _layout(plan: Plan, spec: ClusterSpec | None, label: str) -> list[str]:
    lay, ws = plan.layout, plan.cluster.world_size
    if lay is None:
        return []
    out = []
    if lay.num_ranks > ws:
        out.append(f"layout: dp={lay.dp} x pp={lay.pp} x tp={lay.tp} = {lay.num_ranks} ranks, "
                   f"but cluster {plan.cluster.name!r} has world_size {ws}: {_RERUN}")
    out += _schedule_sizes(lay) + _chimera_composition(plan, lay)
    if lay.sequence_parallel and lay.tp == 1 and plan.hetero is None:  # (hetero: per stage)
        out.append("layout.sequence_parallel: true, but tp=1: sequence parallelism splits the "
                   "activations of a tensor-parallel group; set it to false or re-run "
                   "`hetplan plan` with --tp 2 or more")
    batch = lay.dp * lay.micro_batch_size * lay.micro_batches
    if lay.global_batch_size is not None and lay.global_batch_size != batch:
        out.append(f"layout.global_batch_size: {lay.global_batch_size}, but dp={lay.dp} x "
                   f"micro_batch_size={lay.micro_batch_size} x micro_batches="
                   f"{lay.micro_batches} = {batch}; make them agree ({_RERUN})")
    devices = spec.devices() if spec is not None and lay.ranks and lay.num_ranks <= ws else None
    for i, r in enumerate(lay.ranks):
        want = lay.coords(r.rank)
        if (r.dp, r.pp, r.tp) != want:
            out.append(f"layout.ranks[{i}]: rank {r.rank} has coordinates (dp={r.dp}, "
                       f"pp={r.pp}, tp={r.tp}); the layout's rank mapping puts it at (dp="
                       f"{want[0]}, pp={want[1]}, tp={want[2]})")
        if devices is None:
            continue
        d = devices[r.rank]
        if (r.node, r.local_rank) != (d.node_index, d.local_rank) or r.device not in ("", d.type):
            out.append(f"layout.ranks[{i}]: rank {r.rank} is placed on node {r.node} local "
                       f"rank {r.local_rank} ({r.device or 'no device'}), but {label} has "
                       f"it on node {d.node_index} local rank {d.local_rank} ({d.type})")
    return out[:_MAX_PER_RULE]


def _schedule_sizes(lay: Layout) -> list[str]:
    """Rule 2's schedule part: the sizes the layout's schedule generator accepts."""
    m, pp = lay.micro_batches, lay.pp
    if lay.schedule == "chimera" and (pp < 2 or pp % 2):
        return [f"layout.schedule: 'chimera' runs two pipeline directions over an even pp of "
                f"at least 2, got pp={pp}; use '1f1b' (or gpipe) for this layout"]
    if lay.schedule == "chimera" and m % 2:
        return [f"layout.micro_batches: {m}, but schedule 'chimera' needs an even number (it "
                "splits micro-batches half/half between its two directions)"]
    if lay.schedule == "interleaved-1f1b" and pp > 1 and m % pp:
        return [f"layout.micro_batches: {m}, but schedule 'interleaved-1f1b' needs a multiple "
                f"of pp={pp} (Megatron's interleaving walks micro-batches in groups of pp)"]
    return []


def _chimera_composition(plan: Plan, lay: Layout) -> list[str]:
    """Rule 2's Chimera part: the sections a Chimera plan may not pair with it. Each rank
    holds a stage of each of two pipeline directions and runs them at once, and each stage's
    gradients are averaged over the ``2·dp`` ranks holding a copy."""
    if lay.schedule != "chimera" or lay.pp < 2:
        return []
    out = []
    if lay.tp > 1:
        out.append(f"layout.tp: {lay.tp}, but schedule 'chimera' is priced and executed with "
                   f"tp=1 only; {_RERUN} with --tp 1, or with another --schedule")
    if lay.zero_stage >= 2:
        out.append(f"layout.zero_stage: {lay.zero_stage}, but schedule 'chimera' composes with "
                   f"ZeRO 0 or 1 (ZeRO-{lay.zero_stage} issues collectives inside backward, "
                   "which its two directions, running different stages at once, would "
                   f"mismatch); {_RERUN} with --zero 0 or 1, or with another --schedule")
    if plan.hetero is not None:
        out.append("hetero: per-stage degrees, but schedule 'chimera' runs one dp x tp on "
                   "every stage (each rank holds two stages); drop the section, or use "
                   "schedule '1f1b' (the heterogeneous search, --hetero, plans 1F1B)")
    sync = plan.gradient_sync
    for name, strategy in sorted(sync.strategies.items()) if sync is not None else ():
        if strategy.hierarchy != "flat":
            out.append(f"gradient_sync.strategies[{name!r}]: hierarchical, but schedule "
                       "'chimera' syncs each stage flat over the 2·dp ranks holding a copy; "
                       f"use a flat routing ({_RERUN})")
    if plan.sparse_sync is not None and plan.sparse_sync.synced():
        out.append("sparse_sync: sparse gradient schemes, but schedule 'chimera' syncs every "
                   f"stage's gradients densely over its 2·dp holders; {_RERUN} without "
                   "--sparse, or with another --schedule")
    if plan.group_sync is not None and plan.group_sync.policy == "sdpipe":
        out.append("group_sync.policy: 'sdpipe', but a Chimera rank holds stages of two "
                   f"pipeline replicas; {_RERUN} without --group-sync, or with another "
                   "--schedule")
    if plan.rebalancing is not None and plan.rebalancing.events:
        out.append("rebalancing.events: planned re-balancing, but a Chimera rank holds two "
                   f"stages (one per direction), which re-balancing does not move; {_RERUN} "
                   "without --dynamics, or with another --schedule")
    return out


#: A rule reports at most this many problems (a plan with 1000 bad ranks says so 8 times).
_MAX_PER_RULE = 8


# -- 3. stages --------------------------------------------------------------------------------
def _stages(plan: Plan) -> list[str]:
    stages, lay = plan.stages, plan.layout
    out: list[str] = []
    next_first = 0
    for i, st in enumerate(stages):
        if st.index != i:
            out.append(f"stages[{i}].index: {st.index}; stages are listed in order, so "
                       f"expected {i}")
        if st.first_layer != next_first:
            out.append(f"stages[{i}].first_layer: {st.first_layer}, expected {next_first} "
                       "(stages cover consecutive layers from 0, without gaps or overlap)")
        next_first = st.last_layer + 1
    workload = plan.model.workload
    if stages and workload is not None:
        names = [x.name for x in workload.layers]
        if next_first != len(names):
            out.append(f"stages[{len(stages) - 1}].last_layer: {next_first - 1}, but the model "
                       f"has {len(names)} layers (0..{len(names) - 1}); the stages must cover "
                       "them all")
        for i, st in enumerate(stages):
            want = names[st.first_layer: st.last_layer + 1]
            if st.layer_names and list(st.layer_names) != want:
                out.append(f"stages[{i}].layer_names: {_short(st.layer_names)} are not the "
                           f"workload's layers {st.first_layer}..{st.last_layer} {_short(want)}")
        out += _uncuttable_starts([(f"stages[{i}].first_layer", st.first_layer)
                                   for i, st in enumerate(stages) if i], workload.layers)
    if plan.hetero is not None:  # per-stage degrees: rule 3's rank part in its own form
        out += hetero_problems(plan.hetero, lay, stages, plan.cluster.world_size)
        out += hetero_section_problems(plan.hetero, sparse_sync=plan.sparse_sync,
                                       group_sync=plan.group_sync)
        out += hetero_tp_problems(plan.hetero, stages, plan.tensor_parallel)
        out += hetero_rebalancing_problems(plan.hetero, plan.rebalancing)
    elif stages and lay is not None:
        out += _stage_ranks(stages, lay)
    else:
        out += _ranks_exist(plan)
    return out[:_MAX_PER_RULE]


def _uncuttable_starts(starts: list[tuple[str, int]],
                       layers: tuple[LayerCost, ...]) -> list[str]:
    """``(field path, first layer)`` of the stages after the first: those that start at a
    layer the runtime cannot split before (``cuttable_before`` False), each with the nearest
    layers the stage could start at instead."""
    out = []
    for where, k in starts:
        if k >= len(layers) or layers[k].cuttable_before:
            continue
        near = [j for j in (*range(k - 1, 0, -1), *range(k + 1, len(layers)))
                if layers[j].cuttable_before]
        near = sorted(sorted(near, key=lambda j: abs(j - k))[:2])
        fix = (" or ".join(f"{layers[j].name!r} (#{j})" for j in near) if near
               else "no other layer: use fewer stages")
        out.append(f"{where}: {k} ({layers[k].name!r}), which the runtime cannot split the "
                   "model before (the layer is never called as a module, its parameters "
                   f"only read by glue code, or is called more than once); start the stage "
                   f"at {fix}")
    return out


def _stage_ranks(stages: tuple[Stage, ...], lay: Layout) -> list[str]:
    """Rule 3's rank part: stage ``s`` holds the ranks of pipeline coordinate ``s mod pp``."""
    want_n = lay.pp * lay.virtual_stages
    if len(stages) != want_n:
        v = f" x virtual_stages={lay.virtual_stages}" if lay.virtual_stages > 1 else ""
        return [f"stages: {len(stages)} stage(s), but the layout has pp={lay.pp}{v}, so "
                f"{want_n} stage(s); {_RERUN}"]
    out = []
    group = lay.dp * lay.tp
    for i, st in enumerate(stages):
        if dup := _duplicates(st.ranks):
            out.append(f"stages[{i}].ranks: lists ranks {dup} more than once")
        p = i % lay.pp
        # rank_of(d, p, t) over every d and t: the contiguous block of pipeline coordinate p
        want = list(range(lay.rank_of(0, p, 0), lay.rank_of(0, p, 0) + group))
        got = sorted(set(st.ranks))
        if got == want and len(st.ranks) == group:
            continue
        if len(st.ranks) != group:
            out.append(f"stages[{i}].ranks: {len(st.ranks)} rank(s), but a stage runs on "
                       f"dp x tp = {lay.dp} x {lay.tp} = {group} ranks")
            continue
        others = sorted({j for j, o in enumerate(stages) if j != i and j % lay.pp != p
                         and set(o.ranks) & set(st.ranks)})
        shared = f" (it shares ranks with stage(s) {others})" if others else ""
        out.append(f"stages[{i}].ranks: {_short(st.ranks)}{shared}, but pipeline coordinate "
                   f"pp={p} of the layout is ranks {_short(want)} (rank = (pp*dp + dp_index)"
                   f"*tp + tp_index); each rank is in exactly one pipeline stage")
    return out


def _ranks_exist(plan: Plan) -> list[str]:
    """Without a layout, at least every rank a section names must exist."""
    ws = plan.cluster.world_size
    out = []
    for i, st in enumerate(plan.stages):
        if bad := sorted({r for r in st.ranks if r >= ws}):
            out.append(f"stages[{i}].ranks: ranks {_short(bad)} do not exist in a world of "
                       f"size {ws} (cluster.world_size)")
    return out


# -- 4. pipeline actions ----------------------------------------------------------------------
def _pipeline_actions(plan: Plan) -> list[str]:
    acts, lay = plan.pipeline_actions, plan.layout
    if acts is None:
        return []
    if lay is None:
        return [f"pipeline_actions: the section needs a layout to run in; {_RERUN}"]
    want = {"schedule": lay.schedule, "micro_batches": lay.micro_batches,
            "num_stages": lay.pp * lay.virtual_stages, "len(ranks)": lay.pp}
    got = {"schedule": acts.schedule, "micro_batches": acts.micro_batches,
           "num_stages": acts.num_stages, "len(ranks)": len(acts.ranks)}
    if bad := [k for k in want if want[k] != got[k]]:
        return ["pipeline_actions: the lists do not match the layout: "
                + ", ".join(f"{k} is {got[k]!r}, the layout needs {want[k]!r}" for k in bad)
                + f"; {_RERUN}"]
    seen: Counter[tuple[int, str, int]] = Counter()
    out = []
    for r, text in enumerate(acts.ranks):
        for a in text.split(" "):
            m = _ACTION.match(a)
            if m is None:
                continue  # the section's own pattern already refused it
            stage, kind, mb = int(m.group(1)), m.group(2), int(m.group(3))
            seen[(stage, kind, mb)] += 1
            if stage >= acts.num_stages or mb >= acts.micro_batches:
                out.append(f"pipeline_actions.ranks[{r}]: action {a!r} names stage {stage} and "
                           f"micro-batch {mb}, but there are {acts.num_stages} stages and "
                           f"{acts.micro_batches} micro-batches")
    expected = {(s, k, m) for s in range(acts.num_stages) for k in "FB"
                for m in range(acts.micro_batches)}
    if twice := sorted(a for a, n in seen.items() if n > 1):
        out.append(f"pipeline_actions.ranks: actions {_short([_fmt(a) for a in twice])} run "
                   "more than once")
    if missing := sorted(expected - set(seen)):
        out.append(f"pipeline_actions.ranks: actions {_short([_fmt(a) for a in missing])} "
                   f"never run; every stage runs forward (F) and backward (B) of every "
                   f"micro-batch once; {_RERUN}")
    if not out:
        sched, out = _progress(acts)
        if sched is not None:
            out += _executable(sched, lay.pp, own_executor=plan.hetero is not None)
    return out[:_MAX_PER_RULE]


def _progress(acts: PipelineActions) -> tuple[PipelineSchedule | None, list[str]]:
    """Rule 4's order part: each backward on its forward's rank, and no deadlock; the
    decoded schedule when it holds."""
    try:
        return decode_schedule(acts.schedule, acts.micro_batches, acts.num_stages,
                               acts.ranks), []
    except PipelineDeadlockError as e:
        return None, [f"pipeline_actions.ranks: {e.message.rstrip('.')}; {_RERUN} (or "
                      "restore the lists it wrote)"]
    except PipelineScheduleError as e:
        return None, [f"pipeline_actions.ranks: {e}; {_RERUN}"]


def _executable(sched: PipelineSchedule, pp: int, own_executor: bool) -> list[str]:
    """Rule 4's placement and executor part: what the runtime builds from the plan's stages
    and what its executors assume of the lists (:mod:`hetplan.ir.pipeline_order`), refused
    here rather than by the ranks after launch."""
    if sched.name == "chimera":  # the runtime's Chimera executor (layout: chimera <=> this)
        if problem := chimera_shape_problem(sched):
            return [f"pipeline_actions.ranks: {problem}; pipeline rank r holds stages r "
                    f"(down) and {pp}-1-r (up): re-run `hetplan plan --schedule chimera`"]
        if (bad := transfer_order_problem(sched)) is not None:
            return [f"pipeline_actions.ranks[{bad[0]}]: {bad[1]} (the Chimera executor's "
                    f"messages pair up in posting order); {_RERUN}, or order rank "
                    f"{bad[0]}'s receives as the sender sends"]
        return []
    out = [f"pipeline_actions.ranks[{r}]: runs stage(s) {_short(wrong)}, but the plan's "
           f"stages put stage s on pipeline rank s mod pp={pp} (stage {wrong[0]} on rank "
           f"{wrong[0] % pp}), where the runtime builds it; {_RERUN}, or keep stage s on "
           f"pipeline rank s mod pp" for r, wrong in misplaced_stages(sched).items()]
    if not out and own_executor and (bad := transfer_order_problem(sched)) is not None:
        # per-stage degrees: the heterogeneous executor posts a receive just before the
        # action that needs it, a send just after the one that makes it, on one group per
        # direction; NCCL pairs them in posting order (its tags are ignored), so another
        # order pairs one micro-batch's rows with another's (same shapes: silently)
        out.append(f"pipeline_actions.ranks[{bad[0]}]: {bad[1]} (the heterogeneous "
                   "executor's messages pair up in posting order); order rank "
                   f"{bad[0]}'s receives as the sender sends, or {_RERUN}")
    if not out and not own_executor and (late := last_stage_order_problem(sched)):
        r, order = late
        out.append(f"pipeline_actions.ranks[{r}]: the last stage ({sched.num_stages - 1}) "
                   f"runs its forwards for micro-batches {_short(order)}; torch's schedule "
                   "runtime keeps the last stage's losses in the order its forwards run and "
                   "reads micro-batch m's at position m, so they must run in micro-batch "
                   "order 0, 1, ... (its backwards may come in any order); restore that "
                   f"order or {_RERUN}")
    return out


def _fmt(action: tuple[int, str, int]) -> str:
    return f"{action[0]}{action[1]}{action[2]}"


# -- 5. tensor parallelism --------------------------------------------------------------------
def _tensor_parallel(plan: Plan) -> list[str]:
    tp, lay, ws = plan.tensor_parallel, plan.layout, plan.cluster.world_size
    if tp is None:
        return []
    out = []
    stage_ranks: dict[int, set[int]] = {}  # built once per stage, not once per group
    for i, g in enumerate(tp.groups):
        where = f"tensor_parallel.groups[{i}]"
        if bad := sorted({r for r in g.ranks if r >= ws}):
            out.append(f"{where}.ranks: ranks {_short(bad)} do not exist in a world of size "
                       f"{ws}")
            continue
        if dup := _duplicates([r.rank for r in g.roles]):
            out.append(f"{where}.roles: ranks {dup} have more than one role")
        gamma_max = tp.controller.gamma_max
        out += [f"{where}.roles[{j}].gamma: {r.gamma}, above tensor_parallel.controller."
                f"gamma_max {gamma_max} (the largest pruning ratio the controller may use); "
                f"{_RERUN}" for j, r in enumerate(g.roles) if r.gamma > gamma_max]
        if lay is not None and lay.num_ranks <= ws and plan.hetero is None:
            dp, pp, _ = lay.coords(g.ranks[0])
            want = list(range(lay.rank_of(dp, pp, 0), lay.rank_of(dp, pp, 0) + lay.tp))
            if sorted(g.ranks) != want:
                out.append(f"{where}.ranks: {_short(g.ranks)}, but the layout's TP group of "
                           f"rank {g.ranks[0]} is {_short(want)} (tp={lay.tp} ranks that differ "
                           "only in their tp coordinate)")
        if g.stage is None:
            continue
        if g.stage >= len(plan.stages) and plan.stages:
            out.append(f"{where}.stage: {g.stage}, but the plan has {len(plan.stages)} stages")
            continue
        if plan.stages and g.stage not in stage_ranks:
            stage_ranks[g.stage] = set(plan.stages[g.stage].ranks)
        if plan.stages and not set(g.ranks) <= stage_ranks[g.stage]:
            out.append(f"{where}.ranks: {_short(g.ranks)} are not all ranks of its stage "
                       f"{g.stage} {_short(plan.stages[g.stage].ranks)}")
    out += _tp_linear_names(plan)
    gammas = tp.predicted.expected_gamma if tp.predicted is not None else {}
    if bad_keys := sorted(k for k in gammas if not k.isdigit() or int(k) >= ws):
        out.append(f"tensor_parallel.predicted.expected_gamma: keys {_short(bad_keys)} are not "
                   f"ranks of a world of size {ws}")
    return out[:_MAX_PER_RULE]


def _tp_linear_names(plan: Plan) -> list[str]:
    """Each TP linear is inside a layer of the workload (its name is a layer's, a parameter
    owner's, or under a layer's): the runtime looks shard sizes up by module name, so a
    linear of a layer the model does not have would run even shards silently. (The workload
    names layers and gradients, not every linear: a misspelling inside a layer is found
    only against the model itself.)"""
    tp, workload = plan.tensor_parallel, plan.model.workload
    if tp is None or workload is None or not workload.layers:
        return []
    layers = {layer.name for layer in workload.layers}
    owners = {g.name.rsplit(".", 1)[0] for g in workload.grads}
    out = []
    for i, g in enumerate(tp.groups):
        first: dict[str, int] = {}
        for j, lin in enumerate(g.linears):
            if (k := first.setdefault(lin.name, j)) != j:
                out.append(f"tensor_parallel.groups[{i}].linears[{j}].name: {lin.name!r} is "
                           f"listed twice in the group (also linears[{k}]); each linear has "
                           f"one split and one set of shard sizes: keep one; {_RERUN}")
                continue
            parts = lin.name.split(".")
            inside = any(".".join(parts[:k]) in layers for k in range(1, len(parts) + 1))
            if not inside and lin.name not in owners:
                out.append(f"tensor_parallel.groups[{i}].linears[{j}].name: {lin.name!r} is not "
                           f"inside a layer of model {plan.model.name!r}"
                           f"{did_you_mean(lin.name, sorted(owners | layers))}; {_RERUN}")
    return out


# -- 6. gradient sync -------------------------------------------------------------------------
def _gradient_sync(plan: Plan, spec: ClusterSpec | None) -> list[str]:
    sync, workload = plan.gradient_sync, plan.model.workload
    if sync is None:
        return []
    if workload is None:
        return (_hierarchy_needs_nodes(plan, spec) + _sync_paths(sync))[:_MAX_PER_RULE]
    layer_of = {g.name: g.layer_index for g in workload.grads}
    known = list(layer_of)
    out = []
    for i, t in enumerate(sync.tensors):
        if t.name not in layer_of:
            out.append(f"gradient_sync.tensors[{i}].name: {t.name!r} is not a gradient of "
                       f"model {plan.model.name!r}{did_you_mean(t.name, known)}")
    out += _hierarchy_needs_nodes(plan, spec) + _sync_paths(sync)
    stage_of = _stage_of_layer(plan.stages, len(workload.layers))
    for i, b in enumerate(sync.buckets):
        for j, name in enumerate(b.tensors):
            if name not in layer_of:
                out.append(f"gradient_sync.buckets[{i}].tensors[{j}]: {name!r} is not a "
                           f"gradient of model {plan.model.name!r}{did_you_mean(name, known)}")
        stages = sorted({stage_of[layer_of[n]] for n in b.tensors if n in layer_of})
        if len(stages) > 1:
            out.append(f"gradient_sync.buckets[{i}]: holds gradients of stages {stages}; a "
                       "bucket stays inside one pipeline stage (each stage syncs its own)")
    return out[:_MAX_PER_RULE]


def _sparse_sync(plan: Plan) -> list[str]:
    """Each sparse-synced tensor is a gradient of the model, with the shape it has there."""
    sparse, workload = plan.sparse_sync, plan.model.workload
    if sparse is None or workload is None:
        return []
    numel = {g.name: g.size_bytes // DTYPE_BYTES[g.dtype] for g in workload.grads
             if g.dtype in DTYPE_BYTES}
    names = [g.name for g in workload.grads]
    out = []
    for i, t in enumerate(sparse.tensors):
        if t.name not in names:
            out.append(f"sparse_sync.tensors[{i}].name: {t.name!r} is not a gradient of model "
                       f"{plan.model.name!r}{did_you_mean(t.name, names)}; {_RERUN}")
        elif t.name in numel and t.rows * t.row_elems != numel[t.name]:
            out.append(f"sparse_sync.tensors[{i}]: rows x row_elems = {t.rows} x {t.row_elems} "
                       f"but gradient {t.name!r} has {numel[t.name]} elements; {_RERUN}")
        elif t.scheme != "dense" and (why := _dense_gradient(workload, t.name)):
            out.append(f"sparse_sync.tensors[{i}].name: {t.name!r} {why}, so its gradient is "
                       f"dense: every row is synced, and the prediction (at density "
                       f"{t.stats.density:g}) is wrong; list only the token embeddings "
                       f"`hetplan plan --sparse` finds, {_RERUN}")
    return out[:_MAX_PER_RULE]


def _dense_gradient(workload: WorkloadSummary, name: str) -> str:
    """Why gradient ``name`` is not row-sparse ("" where it may be): its layer is not an
    embedding, or one whose ids are made inside forward (positions: every row each step),
    the rules of :func:`~hetplan.ir.sparse_grads.sparse_gradients` the summary can check."""
    grad = next(g for g in workload.grads if g.name == name)
    if grad.layer_index >= len(workload.layers):
        return ""
    layer = workload.layers[grad.layer_index]
    if layer.kind != "embedding":
        return f"is a parameter of layer {layer.name!r} ({layer.kind}), not of an embedding"
    if layer.act_in_bytes == 0:
        return (f"is the table of embedding {layer.name!r}, which takes no ids as input (it "
                "looks up positions made inside forward)")
    return ""


def _sync_paths(sync: GradientSync) -> list[str]:
    """Each strategy's path computes the sum over all ranks, each rank's gradient once, on
    every rank (:func:`~hetplan.ir.sync_paths.path_problems`: a doubled allreduce, a reduce
    never broadcast, a hierarchical path that never crosses a level ...)."""
    return [f"gradient_sync.strategies.{name}.steps: {problem}"
            for name, st in sorted(sync.strategies.items()) for problem in path_problems(st)]


def _hierarchy_needs_nodes(plan: Plan, spec: ClusterSpec | None) -> list[str]:
    """A path with an inter-node step needs a cluster of more than one node."""
    sync = plan.gradient_sync
    if spec is None or sync is None or spec.num_nodes > 1:
        return []
    return [f"gradient_sync.strategies[{name!r}]: has an inter-node step, but cluster "
            f"{spec.name!r} has one node; use a flat path"
            for name, st in sorted(sync.strategies.items())
            if any(step.level == "inter" for step in st.steps)]


def _stage_of_layer(stages: tuple[Stage, ...], n_layers: int) -> list[int]:
    """Stage index of every layer (0 where no stage covers it: the single implied stage)."""
    out = [0] * n_layers
    for st in stages:
        for k in range(st.first_layer, min(st.last_layer + 1, n_layers)):
            out[k] = st.index
    return out


# -- 7. rebalancing ---------------------------------------------------------------------------
def _rebalancing(plan: Plan) -> list[str]:
    reb, workload = plan.rebalancing, plan.model.workload
    if reb is None or not plan.stages:
        return []
    n_stages = len(plan.stages)
    n_layers = len(workload.layers) if workload is not None else None
    out = []
    for i, ev in enumerate(reb.events):
        where = f"rebalancing.events[{i}]"
        if len(ev.stages) > n_stages:
            out.append(f"{where}.stages: {len(ev.stages)} stage ranges, but the plan has "
                       f"{n_stages} stages")
        if n_layers is not None and ev.stages[-1][1] != n_layers - 1:
            out.append(f"{where}.stages: the ranges end at layer {ev.stages[-1][1]}, but the "
                       f"model has {n_layers} layers")
        if workload is not None and ev.stages[-1][1] < len(workload.layers):
            out += _uncuttable_starts([(f"{where}.stages[{k}]", i) for k, (i, _) in
                                       enumerate(ev.stages) if k], workload.layers)
        if bad := sorted({s for s in ev.released_stages if s >= n_stages}):
            out.append(f"{where}.released_stages: {bad} are not stages of the plan "
                       f"(0..{n_stages - 1})")
        for j, m in enumerate(ev.migrations):
            if max(m.src_stage, m.dst_stage) >= n_stages or (
                    n_layers is not None and m.layer >= n_layers):
                out.append(f"{where}.migrations[{j}]: moves layer {m.layer} from stage "
                           f"{m.src_stage} to {m.dst_stage}, outside the plan's {n_stages} "
                           f"stages{'' if n_layers is None else f' and {n_layers} layers'}")
    lay = plan.layout  # the runtime executes events on a pipeline of one stage per rank
    if lay is None or (lay.pp > 1 and lay.virtual_stages == 1):
        out += applied_event_problems(reb, [(st.first_layer, st.last_layer) for st in
                                            sorted(plan.stages, key=lambda st: st.index)])
    return out[:_MAX_PER_RULE]


# -- 8. predictions ---------------------------------------------------------------------------
def _predictions(plan: Plan) -> list[str]:
    pred, ws = plan.predictions, plan.cluster.world_size
    if pred is None:
        return []
    out = []
    if len(pred.memory_per_rank_bytes) > ws:
        out.append(f"predictions.memory_per_rank_bytes: {len(pred.memory_per_rank_bytes)} "
                   f"entries for world_size {ws} (one per rank)")
    for i, b in enumerate(pred.baselines):
        if len(b.memory_per_rank_bytes) > ws:
            out.append(f"predictions.baselines[{i}].memory_per_rank_bytes: "
                       f"{len(b.memory_per_rank_bytes)} entries for world_size {ws}")
    return out


# -- 9. completeness --------------------------------------------------------------------------
def _completeness(plan: Plan) -> list[str]:
    lay = plan.layout
    out = []
    if lay is None:
        out.append("layout: missing; a plan says how the devices are split (dp, pp, tp, "
                   f"micro-batches): {_RERUN}")
    elif not plan.stages and lay.pp * lay.virtual_stages > 1:
        out.append(f"stages: missing; the layout pipelines over pp={lay.pp} stages, so the "
                   f"plan lists which layers and ranks each one has: {_RERUN}")
    if lay is not None and lay.pp > 1 and lay.micro_batches < lay.pp:
        out.append(f"layout.micro_batches: {lay.micro_batches}, but a pipeline of pp={lay.pp} "
                   f"stages needs at least {lay.pp} micro-batches (one per stage; the "
                   "runtime's schedules refuse fewer)")
    if lay is not None and lay.schedule == "interleaved-1f1b" and lay.virtual_stages < 2:
        out.append("layout.virtual_stages: interleaved-1f1b runs at least 2 model chunks per "
                   "pipeline rank, got 1; use schedule '1f1b' for one chunk")
    if plan.model.workload is None:
        out.append("model.workload: missing; a plan carries its model's workload summary "
                   f"(simulate, inspect and the runtime read it): {_RERUN}")
    return out


def _vocab_parallel(plan: Plan) -> list[str]:
    """``split`` needs the pair it splits (an LM head beside its ``V x h`` embedding) and no
    TP resizing controller (rule 8)."""
    cs, wl, tp = plan.cost_settings, plan.model.workload, plan.tensor_parallel
    if cs is None or cs.vocab_parallel != "split":
        return []
    out = []
    if wl is not None and not splits_vocabulary(wl.layers, capture_dtype_bytes(wl)):
        out.append("cost_settings.vocab_parallel: 'split', but the model's last layer is not "
                   "an LM head beside a V x h token embedding (nothing the runtime can split); "
                   f"a plan for this model says 'whole': {_RERUN}")
    if tp is not None and tp.controller.variant != "off":
        out.append(f"cost_settings.vocab_parallel: 'split' with the TP resizing controller "
                   f"({tp.controller.variant}), which resizes the MLP shards only and keeps "
                   f"the vocabulary whole; a plan with the controller says 'whole': {_RERUN}")
    return out


# -- helpers ----------------------------------------------------------------------------------
def _duplicates(items: tuple[int, ...] | list[int]) -> list[int]:
    return sorted(x for x, n in Counter(items).items() if n > 1)


def _short(items: object, limit: int = 8) -> str:
    """A list for a message, cut after ``limit`` items."""
    seq = list(items)  # type: ignore[call-overload]
    if len(seq) <= limit:
        return repr(seq)
    return "[" + ", ".join(repr(x) for x in seq[:limit]) + f", ... ({len(seq)} in all)]"
