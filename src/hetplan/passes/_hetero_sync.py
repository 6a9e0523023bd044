"""The pass pipeline on a heterogeneous plan: sync passes, DynPipe and TP resizing per stage.

A plan with a ``hetero`` section (:mod:`hetplan.ir.plan_hetero`) gives every pipeline stage
its own device class and ``dp x tp``, so the passes, written for one layout-wide ``dp x tp``,
cannot run on it as a whole. This adapter decides, for each pass of the pipeline:

- **Gradient-sync passes** (every pass whose only section is ``gradient_sync``: DDP buckets,
  Espresso, Cupcake) run once per stage with ``dp > 1``, unchanged, on the stage's
  :func:`~hetplan.cost_models.hetero.stage_projection` (the stage as a homogeneous plan of
  its own: its layers and gradients, its ``dp x tp``, ZeRO stage and micro-batch, its real
  ranks, so its own data-parallel group and links). Each stage's tensors get their own
  choices; the sections are merged into the plan's one ``gradient_sync`` (tensors are
  distinct parameters, so per-tensor entries and buckets already say which stage, hence
  which group, syncs them). Strategies of equal name and content are shared; a name two
  stages use for different strategies is suffixed ``@s<stage>`` in the later stage.
- **DynPipe with a dynamics file** re-balances the layers between the plan's stages at the
  model's events, every stage keeping its device class and degrees
  (:mod:`hetplan.passes._hetero_dynpipe`): the ``rebalancing`` section, one note per phase.
  Without dynamics it is not run: the search already balanced the dense model exactly.
- **TP resizing** runs the ZERO/SEMI controller's rule in the TP groups of every stage with
  ``tp > 1``, on the stage's projection (:mod:`hetplan.passes._hetero_tp`): the
  ``tensor_parallel`` section with each group's stage named, one note per stage.
- **Every other pass** is not run, and the pass log says why (:data:`REASONS`): it writes a
  section whose meaning assumes one layout-wide ``dp x tp`` (stages, even shards, sparse
  sync, checkpoints, group sync).

The per-stage runs go through :func:`~hetplan.passes.manager.run_passes` (section checks,
validation, errors naming the pass), and the log gets one entry per pass with one note per
stage. Deterministic: stages in order, strategy names renamed by a fixed rule.
"""

from __future__ import annotations

from collections.abc import Sequence

from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.hetero import stage_projection
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import Bucket, GradientSync, PassLogEntry, SyncStrategy, TensorSync
from hetplan.passes._hetero_dynpipe import hetero_rebalancing
from hetplan.passes._hetero_tp import hetero_tp_controller
from hetplan.passes.base import Pass, PassContext
from hetplan.passes.dynpipe import DynPipe
from hetplan.passes.manager import run_passes
from hetplan.passes.tp_resizing import TPResizing

__all__ = ["REASONS", "per_stage", "run_hetero_passes", "merge_syncs"]

_STAGES = ("the heterogeneous search chose each stage's layers, device class and degrees "
           "(hetero.stages); a stage pass would redraw stages on layout ranks")

#: Why each pass that is not a gradient-sync pass does not run on a heterogeneous plan.
REASONS: dict[str, str] = {
    "dynpipe": _STAGES + ("; without a dynamics file there is nothing to re-balance "
                          "(dynpipe{dynamics=FILE} re-balances a dynamic model between them)"),
    "uniform-stages": _STAGES,
    "even-tp": ("each stage's TP group is one device class, so its shards are even at the "
                "stage's own tp (hetero.stages[k].tp); the tensor_parallel section holds one "
                "layout-wide degree"),
    "zen": "sparse sync is planned over the layout's data-parallel group, not per stage yet",
    "gemini": "checkpoint placement is planned over the layout's ranks, not per stage yet",
    "sdpipe": ("group sync averages the layout's pipeline replicas; the stages of a "
               "heterogeneous plan have replica counts of their own"),
}


def per_stage(p: Pass) -> bool:
    """Whether ``p`` runs per stage on a heterogeneous plan: it writes only
    ``gradient_sync``."""
    return tuple(p.sections) == ("gradient_sync",)


def run_hetero_passes(plan: Plan, passes: Sequence[Pass], costs: CostModel) -> Plan:
    """``plan`` (with a ``hetero`` section) after ``passes`` (see the module docstring):
    its ``gradient_sync`` from the per-stage runs, its ``rebalancing`` (DynPipe with
    dynamics) and ``tensor_parallel`` (TP resizing) sections, its pass log with one entry
    per pass.

    Raises:
        PassError / HetplanError: a pass failed on a stage (naming the pass; the stage is in
            the message of the manager's error through the pass log context).
    """
    het, lay, workload = plan.hetero, plan.layout, plan.model.workload
    if het is None or lay is None or workload is None:
        raise ValueError("run_hetero_passes needs a plan with hetero, layout and workload")
    runs = [p for p in passes if per_stage(p)]
    subs: dict[int, tuple[Plan, PassContext]] = {}
    for st, shape in zip(plan.stages, het.stages):
        if shape.dp == 1:
            continue
        proj = stage_projection(workload, lay, st, shape)
        ctx = PassContext(workload=proj.workload, cluster=costs.cluster, costs=costs,
                          layout=proj.layout)
        sub = Plan(model=plan.model.model_copy(update={"workload": proj.workload}),
                   cluster=plan.cluster, stages=(proj.stage,))
        subs[st.index] = (sub, ctx)
    log = list(plan.pass_log)
    update: dict[str, object] = {}
    for p in passes:
        if isinstance(p, DynPipe) and p.dynamics is not None:
            reb, rnotes = hetero_rebalancing(plan, p.dynamics, costs)
            update["rebalancing"] = reb
            log.append(PassLogEntry(name=p.name, changed=bool(reb.events), notes=rnotes))
            continue
        if isinstance(p, TPResizing):
            section, tnotes = hetero_tp_controller(plan, p, costs)
            update["tensor_parallel"] = section
            log.append(PassLogEntry(name=p.name, changed=section is not None, notes=tnotes))
            continue
        if not per_stage(p):
            reason = REASONS.get(p.name, f"it writes {list(p.sections)}, sections a "
                                 "heterogeneous plan does not take per stage yet")
            log.append(PassLogEntry(name=p.name, changed=False,
                                    notes=(f"not run on a heterogeneous plan: {reason}",)))
            continue
        notes, changed = [], False
        for k, (sub, ctx) in sorted(subs.items()):
            sub = run_passes(sub.model_copy(update={"pass_log": ()}), [p], ctx)
            subs[k] = (sub, ctx)
            entry = sub.pass_log[-1]
            changed |= entry.changed
            shape = het.stages[k]
            # the projection's one stage is its stage 0: the note's own "stage 0: " says
            # nothing the prefix does not
            text = "; ".join(n.replace("stage 0: ", "") for n in entry.notes) or (
                "changed" if entry.changed else "no change")
            notes.append(f"stage {k} ({shape.device_class} {shape.dp}x{shape.tp}): {text}")
        if not subs:
            notes.append("every stage has dp=1: no gradient sync to plan")
        log.append(PassLogEntry(name=p.name, changed=changed, notes=tuple(notes)))
    sync = merge_syncs([(k, sub.gradient_sync) for k, (sub, _) in sorted(subs.items())])
    if not runs:
        sync = plan.gradient_sync
    return plan.model_copy(update={**update, "gradient_sync": sync, "pass_log": tuple(log)})


def merge_syncs(parts: Sequence[tuple[int, GradientSync | None]]) -> GradientSync | None:
    """One gradient-sync section from each stage's (stage index, section), in stage order;
    a strategy name an earlier stage uses for another strategy gets ``@s<stage>``."""
    strategies: dict[str, SyncStrategy] = {}
    tensors: list[TensorSync] = []
    buckets: list[Bucket] = []
    seen = False
    for k, sync in parts:
        if sync is None:
            continue
        seen = True
        rename: dict[str, str] = {}
        for name in sorted(sync.strategies):
            strategy = sync.strategies[name]
            new = name if strategies.get(name, strategy) == strategy else f"{name}@s{k}"
            strategies[new] = strategy
            rename[name] = new
        tensors += [t.model_copy(update={"strategy": rename[t.strategy]}) for t in sync.tensors]
        buckets += [b.model_copy(update={"strategy": rename[b.strategy]}) for b in sync.buckets]
    if not seen:
        return None
    return GradientSync(strategies=strategies, tensors=tuple(tensors), buckets=tuple(buckets))
