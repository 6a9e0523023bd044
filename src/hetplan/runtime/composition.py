"""Which strategies this runtime composes, as one pure check over a plan.

:func:`refusals` lists, one line each (``"field: what, why, how to fix"``), every
combination of the plan's strategies that the runtime does not execute; the runtime refuses
such a plan at setup (every rank alike, so none waits for another). The table with the
reasons is in ``docs/decisions/runtime-composition.md``.

Complexity: O(gradient-sync strategies + stages).
"""

from __future__ import annotations

from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import CompressedSync, Layout, SyncStrategy
from hetplan.runtime.hetero_ranks import hetero_refusals

__all__ = ["SUPPORTED_SCHEDULES", "effective_zero_stage", "refusals"]

_DOC = "docs/decisions/runtime-composition.md"

#: Plan schedule names the runtime executes: gpipe, 1F1B and interleaved 1F1B through torch's
#: schedule runtime, Chimera through its own executor (:mod:`hetplan.runtime.handlers.chimera`).
SUPPORTED_SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b", "chimera")


def effective_zero_stage(layout: Layout) -> int:
    """The ZeRO stage that runs: the layout's, or 0 when the group that averages a stage's
    gradients has one rank (nothing to shard): ``dp == 1``, except under Chimera, whose group
    also holds the other direction's copy (:attr:`Layout.sync_group_size`, as the memory
    model shards)."""
    return layout.zero_stage if layout.sync_group_size > 1 else 0


def refusals(plan: Plan) -> list[str]:
    """The combinations of ``plan``'s strategies this runtime refuses (empty: it runs)."""
    lay = plan.layout
    if lay is None:
        return []
    out: list[str] = []
    if lay.pp > 1 and lay.schedule not in SUPPORTED_SCHEDULES:
        out.append(f"layout.schedule: {lay.schedule!r} is not executed by the runtime, which "
                   f"runs {list(SUPPORTED_SCHEDULES)}; re-plan with --schedule 1f1b (or "
                   f"another of them) ({_DOC})")
    zero = effective_zero_stage(lay)
    sync = plan.gradient_sync
    used = set()
    if sync is not None:
        used = {b.strategy for b in sync.buckets} | {t.strategy for t in sync.tensors}
    strategies = {n: sync.strategies[n] for n in sorted(used)} if sync is not None else {}
    if lay.pp > 1 and lay.schedule == "chimera":
        out += _chimera(plan, lay, zero, strategies)
    if zero >= 1 and plan.rebalancing is not None and any(
            e.applied for e in plan.rebalancing.events):
        out.append(f"rebalancing: moving layers under ZeRO-{zero} (dp={lay.dp}); their "
                   "optimizer state is sharded across the data-parallel replicas and the "
                   "runtime moves whole per-parameter state only; re-plan with --zero 0 "
                   f"({_DOC})")
    if zero >= 1 and plan.tensor_parallel is not None and (
            plan.tensor_parallel.controller.variant != "off"):
        out.append(f"tensor_parallel.controller: the TP resizing controller "
                   f"({plan.tensor_parallel.controller.variant}) under ZeRO-{zero}; it "
                   "resizes the shards the optimizer state is cut from; re-plan with --zero 0 "
                   f"({_DOC})")
    if zero >= 2:
        for name, s in strategies.items():
            if isinstance(s, CompressedSync):
                out.append(f"gradient_sync.strategies[{name!r}]: compressed ({s.compressor}) "
                           f"under ZeRO-{zero}, which reduce-scatters gradients during backward: "
                           "compression needs the full gradient (zero_stage <= 1); re-plan "
                           f"with --zero 1 or without --compress ({_DOC})")
            elif s.hierarchy == "hierarchical":
                out.append(f"gradient_sync.strategies[{name!r}]: hierarchical under ZeRO-{zero}; "
                           "the runtime's reduce-scatter is flat over the data-parallel group; "
                           f"re-plan with --zero 1 ({_DOC})")
    if zero >= 2 and plan.sparse_sync is not None and plan.sparse_sync.synced():
        out.append(f"sparse_sync: sparse gradient schemes under ZeRO-{zero}, which "
                   "reduce-scatters every gradient during backward; the sparse schemes need "
                   f"the full gradient (zero_stage <= 1); re-plan with --zero 1 ({_DOC})")
    return out + _group_sync(plan, lay, zero) + hetero_refusals(plan)


def _chimera(plan: Plan, lay: Layout, zero: int, strategies: dict[str, SyncStrategy]
             ) -> list[str]:
    """What the Chimera executor does not compose with (its two directions run different
    stages at once, and each stage's gradients are averaged over the ranks of both
    directions: :mod:`hetplan.runtime.handlers.chimera`)."""
    fix = "re-plan with --schedule 1f1b"
    hier = sorted(n for n, s in strategies.items() if s.hierarchy != "flat")
    out = []
    for what, bad in ((f"tensor parallelism (tp={lay.tp})", lay.tp > 1),
                      (f"ZeRO-{zero} (collectives inside backward, while the two directions "
                       "run different stages)", zero >= 2),
                      ("per-stage degrees (hetero)", plan.hetero is not None),
                      (f"hierarchical gradient-sync routings {hier} (its sync group pairs "
                       "two pipeline ranks; the runtime runs flat routings on it)", bool(hier)),
                      ("sparse gradient sync", plan.sparse_sync is not None
                       and plan.sparse_sync.synced()),
                      ("SDPipe group sync", plan.group_sync is not None
                       and plan.group_sync.policy == "sdpipe"),
                      ("re-balancing events", plan.rebalancing is not None and any(
                          e.applied for e in plan.rebalancing.events))):
        if bad:
            out.append(f"layout.schedule: 'chimera' with {what} is not executed by this "
                       f"runtime; {fix} ({_DOC})")
    return out


def _group_sync(plan: Plan, lay: Layout, zero: int) -> list[str]:
    """What SDPipe group sync (``group_sync.policy == "sdpipe"``) does not compose with: it
    averages each replica's own weights after a local step (docs/decisions/sdpipe.md)."""
    gs = plan.group_sync
    if gs is None or gs.policy != "sdpipe":
        return []
    fix = "re-plan with --group-sync off, or without it"
    out = []
    for what, bad in ((f"tensor parallelism (tp={lay.tp})", lay.tp > 1),
                      (f"ZeRO-{zero} (optimizer state sharded across the replicas)", zero > 0),
                      ("interleaved stages", lay.virtual_stages > 1),
                      ("pipeline re-balancing", plan.rebalancing is not None),
                      ("the TP resizing controller", plan.tensor_parallel is not None
                       and plan.tensor_parallel.controller.variant != "off"),
                      ("sparse gradient sync", plan.sparse_sync is not None
                       and plan.sparse_sync.synced())):
        if bad:
            out.append(f"group_sync: SDPipe group sync with {what} is not executed by this "
                       f"runtime; {fix} ({_DOC}, docs/decisions/sdpipe.md)")
    if gs.optimizer_state != "local":
        out.append(f"group_sync.optimizer_state: {gs.optimizer_state!r}; the runtime keeps "
                   "optimizer state local only; re-plan with sdpipe{optimizer-state=local}")
    return out
