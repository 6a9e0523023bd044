"""Pass ``dynpipe``: balanced pipeline stages for heterogeneous devices and dynamic models.

Owns ``plan.stages`` and, for a dynamic model, ``plan.rebalancing``. Stage ``s`` stays on the
ranks of pipeline coordinate ``s`` (the layout's rank order, which keeps a node's devices
contiguous — the device order :func:`~hetplan.algorithms.partition.pipeline_device_order`
recommends; the pass notes when the cluster's order differs from it).

1. **Costs per stage position**: every layer's forward + backward time for one micro-batch
   on the slowest device of each stage position (tensor-parallel split and all-reduces as
   in the simulator), the boundary transfer time to the next stage (forward activation and
   backward gradient over the link between the stages), and every layer's memory at that
   position (model state in the plan's precision and ZeRO stage, activations × in-flight
   micro-batches under the smallest recomputation the ``recompute`` option allows) against
   90 % of the smallest device of the stage. Interleaved 1F1B partitions into
   ``pp * virtual_stages`` chunks, chunk ``k`` on pipeline rank ``k % pp`` (its memory
   against ``1 / virtual_stages`` of the rank's). A layer's memory is priced once per class
   of layers equal but for their name (identical blocks).
2. **Candidates**: the exact min–max partition by time with transfers, by time without
   transfers, by parameter bytes, and the uniform split (Megatron's default). Whether any
   partition fits depends on the layer count and memory alone, so the tries stop at the
   first that finds none (the uniform split is still scored).
3. **Choice**: each candidate gets its stages' activation recomputation — the cheapest that
   fits, per stage (:func:`~hetplan.cost_models.rank_memory.choose_recompute`; decided here
   because whether a partition fits depends on it), or the ``recompute`` option's mode — and
   DDP-style gradient buckets, and is scored by the simulator
   (:func:`~hetplan.cost_models.evaluate.evaluate`); the fastest wins, ties to the earlier
   candidate. Candidates with the same stages are scored once (the note lists each). The uniform split is a candidate, so the result is never
   predicted slower than the ``uniform-stages`` baseline under the baseline's gradient sync.
4. **Dynamics** (``dynamics`` option): the model's phases (pruning steps, freezing, early
   exit) are replayed with :func:`~hetplan.algorithms.dynamics.run_dynamic` under the
   dynamics file's policy; every event lands in ``plan.rebalancing`` with its complete stage
   assignment, layer moves, bytes and predicted times (the schedule simulator per phase).
   Under ZeRO >= 1 with ``dp > 1`` the pass declines (no events, a note): a moved layer takes
   its whole optimizer state, which ZeRO shards across the replicas.

Complexity: O(D · L) cost lookups plus four simulator runs; the partition DP is O(P · L · w).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hetplan.algorithms.dynamics import (
    BalancePolicy,
    DynamicRun,
    LayerProfile,
    Phase,
    PruningModel,
    build_phases,
    run_dynamic,
)
from hetplan.algorithms.partition import (
    min_max_partition,
    pipeline_device_order,
    uniform_partition,
)
from hetplan.cost_models.ddp import ddp_gradient_sync
from hetplan.cost_models.evaluate import evaluate
from hetplan.cost_models.memory import (
    USABLE_FRACTION,
    capture_bytes,
    in_flight_micro_batches,
    stage_memory,
)
from hetplan.cost_models.pipeline import simulate_pipeline
from hetplan.cost_models.precision import state_precision
from hetplan.cost_models.rank_memory import RECOMPUTE_ORDER, choose_recompute
from hetplan.errors import InfeasiblePlanError, PassError, SpecError
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import GradientSync, LayerCost, Stage, WorkloadSummary
from hetplan.ir.rebalancing import DynamicsSpec, LayerMigration, PlannedEvent, Rebalancing
from hetplan.passes.base import PassContext, PassResult, rank_of, stages_from_bounds

__all__ = ["DynPipe"]

Bounds = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class _Costs:
    cost: list[list[float]]  # [stage][layer] fwd+bwd ms
    fwd: list[list[float]]
    bwd: list[list[float]]
    send: list[list[float]]  # [stage][last layer] boundary transfer ms
    mem: list[list[float]]  # [stage][layer] bytes
    cap: list[float]


def _stage_ranks(ctx: PassContext, s: int) -> tuple[int, ...]:
    lay = ctx.layout
    key = ("dynpipe.stage_ranks", lay, s % lay.pp)  # a layout's, once per search
    hit: tuple[int, ...] | None = ctx.costs.memo.get(key)
    if hit is None:
        hit = ctx.costs.memo[key] = tuple(rank_of(lay, d, s % lay.pp, t)
                                          for d in range(lay.dp) for t in range(lay.tp))
    return hit


def _layer_classes(wl: WorkloadSummary,
                   memo: dict[tuple[Any, ...], Any]) -> tuple[list[int], list[LayerCost]]:
    """Layers equal in every field but their name, which one layer's memory depends on
    alone (identical blocks): each layer's class index and one layer per class, in order of
    first appearance. Memoised per workload in ``memo`` (the cost model's)."""
    key = ("dynpipe.layer_classes", id(wl))
    hit: tuple[list[int], list[LayerCost]] | None = memo.get(key)
    if hit is not None:
        return hit
    memo[("workload", id(wl))] = wl  # keeps the id unique while cached
    index: dict[str, int] = {}
    cls: list[int] = []
    reps: list[LayerCost] = []
    for x in wl.layers:
        k = index.setdefault(repr(x.model_dump(exclude={"name"})), len(reps))
        if k == len(reps):
            reps.append(x)
        cls.append(k)
    memo[key] = (cls, reps)
    return cls, reps


def _costs(ctx: PassContext, recompute: str = "auto") -> _Costs:
    lay, wl, costs = ctx.layout, ctx.workload, ctx.costs
    mb = lay.micro_batch_size
    scale = mb / wl.batch_size
    n = len(wl.layers)
    v = lay.virtual_stages
    mode = "full" if recompute == "auto" else recompute
    fwd, bwd, send, mem, cap = [], [], [], [], []
    cls, reps = _layer_classes(wl, costs.memo)
    # each class's layer as the memory model counts it (the engine's fused blocks)
    mem_layers = costs.memory_layers(wl)
    reps = [mem_layers[cls.index(k)] for k in range(len(reps))]
    for s in range(lay.pp * v):
        ranks = _stage_ranks(ctx, s)
        types = sorted({costs.devices[r].type for r in ranks})
        prec = max((state_precision(costs.precision, t, types, capture_bytes(wl))
                    for t in types), key=lambda x: (x.act_bytes, x.weight_bytes, x.grad_bytes))
        devs = {(costs.devices[r].type, costs.devices[r].slowdown): costs.devices[r]
                for r in ranks}
        f, b = [0.0] * n, [0.0] * n
        for dev in devs.values():
            for k, (layer, t) in enumerate(zip(wl.layers, costs.compute.layer_times(wl, dev, mb))):
                div = costs.compute.tp_divisor(layer, lay.tp)
                f[k], b[k] = max(f[k], t.fwd_s * 1e3 / div), max(b[k], t.bwd_s * 1e3 / div)
        if lay.tp > 1:  # TP groups stay inside a node (layout rule)
            for k, layer in enumerate(wl.layers):
                if layer.tp_pairs:
                    ar = costs.comm.time_s("allreduce",
                                           layer.act_out_bytes * scale * prec.act_scale,
                                           lay.tp, "intra") * 1e3
                    f[k] += layer.tp_pairs * ar
                    b[k] += layer.tp_pairs * ar
        fwd.append(f)
        bwd.append(b)
        if s + 1 < lay.pp * v:
            link = costs.cluster.link_between(ranks[0], _stage_ranks(ctx, s + 1)[0])
            by_size: dict[float, float] = {}  # identical blocks send identical boundaries
            for x in wl.layers:
                if x.boundary_bytes not in by_size:
                    by_size[x.boundary_bytes] = 2e3 * costs.comm.time_s(
                        "p2p", x.boundary_bytes * scale * prec.act_scale / lay.tp, 2, link)
            send.append([by_size[x.boundary_bytes] for x in wl.layers])
        else:
            send.append([0.0] * n)
        flight = in_flight_micro_batches(lay.schedule, s % lay.pp, lay.pp, lay.micro_batches,
                                         v)
        per_class = [float(stage_memory(
            [x], tp=lay.tp, micro_batch_scale=scale, in_flight=flight,
            optimizer=costs.optimizer, precision=prec, dp=lay.dp, zero_stage=lay.zero_stage,
            sequence_parallel=lay.sequence_parallel, recompute=mode).total)
            for x in reps]
        mem.append([per_class[k] for k in cls])
        cap.append(min(costs.devices[r].memory_bytes for r in ranks) * USABLE_FRACTION / v)
    cost = [[a + b for a, b in zip(f, b)] for f, b in zip(fwd, bwd)]
    return _Costs(cost, fwd, bwd, send, mem, cap)


def _ddp_sync(ctx: PassContext, stages: tuple[Stage, ...]) -> GradientSync:
    """DDP's buckets for ``stages`` (what a candidate is priced with), memoised in the cost
    model's memo per workload and stage boundaries, all they depend on: the layouts of one
    pipeline size try the same partitions (a 1T GPT's 532 buckets, 153 times). The section
    is shared between candidates: nothing may change it in place (its ``strategies`` is a
    dict; passes copy it)."""
    wl, memo = ctx.workload, ctx.costs.memo
    key = ("dynpipe.ddp_sync", id(wl),
           tuple((st.index, st.first_layer, st.last_layer) for st in stages))
    hit: GradientSync | None = memo.get(key)
    if hit is None:
        memo[("workload", id(wl))] = wl  # keeps the id unique while cached
        hit = memo[key] = ddp_gradient_sync(wl, stages)
    return hit


def _candidates(c: _Costs, ctx: PassContext) -> list[tuple[str, Bounds]]:
    n, p = len(ctx.workload.layers), ctx.layout.pp * ctx.layout.virtual_stages
    params = [float(x.param_bytes) for x in ctx.workload.layers]
    cut = [x.cuttable_before for x in ctx.workload.layers]
    out: list[tuple[str, Bounds]] = []
    tries = (
        ("time+transfers", lambda: min_max_partition(c.cost, p, send=c.send, mem=c.mem,
                                                     mem_cap=c.cap, cuttable=cut).bounds),
        ("time", lambda: min_max_partition(c.cost, p, mem=c.mem, mem_cap=c.cap,
                                           cuttable=cut).bounds),
        ("params", lambda: min_max_partition(params, p, mem=c.mem, mem_cap=c.cap,
                                             cuttable=cut).bounds),
    )
    for name, fn in tries:
        try:
            out.append((name, fn()))
        except InfeasiblePlanError:
            # whether a partition fits depends on the layer count, the cuttable boundaries
            # and memory alone, which every try shares: if one has none, none has
            break
    out.append(("uniform", uniform_partition(n, p, cut)))
    return out


def _order_note(ctx: PassContext) -> str:
    devs = [ctx.costs.devices[_stage_ranks(ctx, s)[0]] for s in range(ctx.layout.pp)]
    speeds = [1.0 / d.slowdown if d.relative_speed is None else d.relative_speed for d in devs]
    order = pipeline_device_order([d.node_index for d in devs],
                                  [d.memory_bytes for d in devs], speeds)
    if list(order) == list(range(len(devs))):
        return ""
    return (f"device order: the recommended pipeline order of the stage devices is "
            f"{list(order)} (nodes contiguous, more memory first); stages follow rank order")


def spec_phases(dyn: DynamicsSpec, layers: Sequence[LayerProfile]) -> tuple[Phase, ...]:
    """The phases of a dynamics file over ``layers``
    (:func:`~hetplan.algorithms.dynamics.build_phases` with the file's pruning, freezing and
    early exits); shared with the heterogeneous re-balancing."""
    pm = None
    if dyn.pruning:
        pr = dyn.pruning
        pm = PruningModel(pr.final_sparsity, pr.start_iteration, pr.frequency, pr.steps,
                          pr.initial_sparsity, pr.kernel, pr.crossover_sparsity,
                          pr.sparse_floor, pr.gemm_share)
    return build_phases(layers, pruning=pm,
                        freezes=[(f.iteration, f.layers) for f in dyn.freezing],
                        exits=[(e.iteration, e.after_layer, e.fraction)
                               for e in dyn.early_exit])


@dataclass(frozen=True)
class DynPipe:
    """Exact min–max stage balancing, re-planned at the model's dynamic events.

    Attributes:
        dynamics: how the model changes while training (None: a static model); in a
            pipeline spec, the path of a dynamics file (``dynpipe{dynamics=FILE}``).
        recompute: ``auto`` (the cheapest activation recomputation that fits, per stage) or
            one mode for every stage: ``none``, ``selective``, ``full``.
    """

    dynamics: DynamicsSpec | None = field(default=None, metadata={"parse": DynamicsSpec.load})
    recompute: str = "auto"
    name: ClassVar[str] = "dynpipe"
    sections: ClassVar[tuple[str, ...]] = ("stages", "rebalancing")
    refines: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.recompute not in ("auto", *RECOMPUTE_ORDER):
            raise SpecError(f"{self.name}{{recompute={self.recompute}}}: expected auto, "
                            f"{', '.join(RECOMPUTE_ORDER)}")

    def run(self, plan: Plan, ctx: PassContext) -> PassResult:
        n, p = len(ctx.workload.layers), ctx.layout.pp * ctx.layout.virtual_stages
        if p > n:
            raise PassError(f"{self.name}: {p} pipeline stages but only {n} layers")
        if self.dynamics is not None and ctx.layout.virtual_stages > 1:
            raise PassError(f"{self.name}: re-balancing a dynamic model needs one chunk per "
                            "pipeline rank; plan it with schedule '1f1b' or 'gpipe'")
        c = _costs(ctx, self.recompute)
        best: tuple[float, str, Bounds, tuple[Stage, ...]] | None = None
        scored = []
        seen: dict[Bounds, float | None] = {}  # bounds scored: time, None if it did not fit
        for name, bounds in _candidates(c, ctx):
            if bounds in seen:  # the same stages score the same; an earlier one wins ties
                t = seen[bounds]
                if t is not None:
                    scored.append(f"{name} {t * 1e3:.4g} ms")
                continue
            seen[bounds] = None
            stages = choose_recompute(ctx.workload, ctx.layout,
                                      stages_from_bounds(list(bounds), ctx), ctx.costs,
                                      mode=self.recompute)
            sync = _ddp_sync(ctx, stages)
            try:
                ev = evaluate(ctx.workload, ctx.layout, stages, sync, ctx.costs)
            except InfeasiblePlanError:
                continue
            seen[bounds] = ev.iteration_s
            scored.append(f"{name} {ev.iteration_s * 1e3:.4g} ms")
            if best is None or ev.iteration_s < best[0]:
                best = (ev.iteration_s, name, bounds, stages)
        if best is None:  # nothing fits: the uniform split, so the simulator names the rank
            bounds = uniform_partition(n, p, [x.cuttable_before for x in ctx.workload.layers])
            stages = choose_recompute(ctx.workload, ctx.layout,
                                      stages_from_bounds(list(bounds), ctx), ctx.costs,
                                      mode=self.recompute)
            best = (math.inf, "uniform", bounds, stages)
        _, chosen, bounds, stages = best
        notes = [f"{p} stage(s), sizes {[j - i + 1 for i, j in bounds]} ({chosen}); "
                 f"candidates: {', '.join(scored) or 'none fits'}"]
        if any(st.recompute != "none" for st in stages):
            notes.append("recompute per stage: " + " ".join(st.recompute for st in stages))
        if note := _order_note(ctx):
            notes.append(note)
        update: dict[str, object] = {"stages": stages}
        lay = ctx.layout
        if self.dynamics is not None and p > 1 and lay.dp > 1 and lay.zero_stage >= 1:
            # the runtime moves a layer with its whole per-parameter optimizer state; ZeRO
            # shards that state across the replicas (docs/decisions/runtime-composition.md)
            update["rebalancing"] = Rebalancing(policy=self.dynamics.rebalance,
                                                total_iterations=self.dynamics.total_iterations)
            notes.append(f"dynamics: not re-balanced: ZeRO-{lay.zero_stage} shards the "
                         f"optimizer state across the dp={lay.dp} replicas and a moved layer "
                         "takes its whole state (re-balancing needs zero_stage 0)")
        elif self.dynamics is not None and p > 1:
            reb = _rebalancing(self.dynamics, c, ctx, bounds)
            update["rebalancing"] = reb
            applied = sum(e.applied for e in reb.events)
            notes.append(f"dynamics: {len(reb.events)} event(s), {applied} re-balanced; "
                         f"predicted speedup over static {reb.speedup_vs_static:.3f}x")
        elif self.dynamics is not None:
            update["rebalancing"] = Rebalancing(policy=self.dynamics.rebalance,
                                                total_iterations=self.dynamics.total_iterations)
        return PassResult(plan.model_copy(update=update), True, tuple(notes))


def _rebalancing(dyn: DynamicsSpec, c: _Costs, ctx: PassContext, bounds: Bounds) -> Rebalancing:
    """Replay the dynamics on stage-0's device times, with the other stages' relative speeds."""
    lay, wl = ctx.layout, ctx.workload
    ref = sum(c.cost[0]) or 1.0
    speeds = [ref / (sum(row) or ref) for row in c.cost]
    depth = [k / max(len(wl.layers) - 1, 1) for k in range(len(wl.layers))]
    skew = dyn.pruning.scale_skew if dyn.pruning else 0.0
    scale = lay.micro_batch_size / wl.batch_size
    layers = [
        LayerProfile(c.fwd[0][k], c.bwd[0][k], x.param_bytes / 4.0, prunable=x.kind == "block",
                     scale=1.0 + skew * (depth[k] - 0.5), act_bytes=x.act_saved_bytes * scale)
        for k, x in enumerate(wl.layers)
    ]
    phases = spec_phases(dyn, layers)
    pol = dyn.rebalance
    policy = BalancePolicy(pol.balancer, pol.metric, pol.max_iters, pol.trigger, pol.repack,
                           pol.repack_slowdown)
    link = ctx.costs.cluster.link_between(_stage_ranks(ctx, 0)[0], _stage_ranks(ctx, 1)[0])
    per_gb = ctx.costs.comm.time_s("p2p", 1e9, 2, link) * 1e3
    send = [sum(col) / len(c.send) for col in zip(*c.send)]

    def iteration_ms(f: Sequence[float], b: Sequence[float], k: int) -> float:
        return simulate_pipeline(f, b, lay.micro_batches, lay.schedule if k > 1 else "gpipe",
                                 virtual_stages=lay.virtual_stages if k > 1 else 1
                                 ).iteration_ms

    mem_cap = [c.cap[s] for s in range(lay.pp)]
    def replay(pol: BalancePolicy) -> DynamicRun:
        return run_dynamic(phases, lay.pp, dyn.total_iterations, pol, iteration_ms,
                           speeds=speeds, send_ms=send, link_bytes_per_ms=1e9 / per_gb,
                           mem_cap=mem_cap, initial=bounds,
                           cuttable=[x.cuttable_before for x in wl.layers])

    run = replay(policy)
    static = replay(BalancePolicy("static"))
    events = tuple(
        PlannedEvent(
            iteration=e.iteration, label=e.label, stages=e.bounds,
            migrations=tuple(LayerMigration(layer=m.layer, src_stage=m.src, dst_stage=m.dst,
                                            bytes=m.bytes) for m in e.moves),
            bytes_moved=e.bytes_moved, predicted_before_ms=e.before_ms,
            predicted_after_ms=e.after_ms, overhead_ms=e.overhead_ms, applied=e.applied,
            released_stages=e.released,
        )
        for e in run.events
    )
    return Rebalancing(policy=pol, total_iterations=dyn.total_iterations, events=events,
                       speedup_vs_static=static.total_ms / run.total_ms if run.total_ms else 1.0,
                       devices_used_mean=run.devices_used_mean)
