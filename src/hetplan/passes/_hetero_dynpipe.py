"""DynPipe's re-balancing of a dynamic model on a heterogeneous plan (``dynpipe{dynamics=}``).

The heterogeneous search (:mod:`hetplan.optimizer.hetero`) chose each stage's device class,
``dp x tp``, recomputation and layers for the dense model. When the model's per-layer cost
changes while it trains (the dynamics file: pruning, freezing, early exit), this adapter
re-balances the *layers* between those stages at every event, keeping every stage's device
class, degrees and recomputation, and writes what the homogeneous ``dynpipe`` pass writes:
the ``rebalancing`` section (policy, one :class:`~hetplan.ir.rebalancing.PlannedEvent` per
event with the complete stage assignment, moves, bytes and predicted times). Stage ``s`` of
an event runs on ``plan.stages[s].ranks`` with ``hetero.stages[s]``'s degrees, so the
section's shape needs no new field; the validator checks that every event keeps the stage
count (:mod:`hetplan.ir.plan_hetero_checks`).

1. **Costs per stage**: every layer's forward and backward ms for one micro-batch on stage
   ``s`` as the heterogeneous cost model prices it (:mod:`hetplan.cost_models.hetero`: the
   stage's device, its ``tp`` with the TP all-reduces, its replicas' ``micro_batch / dp``
   samples, its recomputation), the resharding into the next stage when ``s`` ends at a
   layer (both directions), and each layer's memory on ``s`` (model state at the stage's
   ZeRO stage and precision, activations x the micro-batches 1F1B keeps in flight there)
   against 90 % of the stage's smallest device, less the largest resharding buffer.
2. **Phases**: :func:`~hetplan.algorithms.dynamics.build_phases` on unit layer times gives
   each layer's factor per phase (sparse kernel, frozen backward, exited tokens), which
   scales every stage's row: the same dynamics model as the homogeneous replay.
3. **Replay** (:func:`~hetplan.algorithms.hetero_rebalance.replay_stages`) from the plan's
   stages with the file's balancer, metric and trigger, and once with ``static`` for the
   comparison. A phase's iteration is the 1F1B schedule simulator over the stages' sums
   with the resharding transfers (as the homogeneous replay, gradient sync and optimizer
   step are left out: they do not move with the boundaries more than the layers' bytes).

Re-packing (``rebalance.repack``) is refused: releasing a stage would leave its device
class idle, and stages here keep their devices. Complexity: O(P · L) cost lookups, then
one partition and two pipeline simulations per event.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hetplan.algorithms.dynamics import (
    BalancePolicy,
    EventRecord,
    LayerProfile,
)
from hetplan.algorithms.hetero_rebalance import Bounds, PhaseModel, StagePhase, replay_stages
from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.hetero import _layer_arrays, reshard_s
from hetplan.cost_models.memory import (
    USABLE_FRACTION,
    capture_bytes,
    in_flight_micro_batches,
    stage_memory,
)
from hetplan.cost_models.pipeline import simulate_pipeline
from hetplan.cost_models.precision import state_precision
from hetplan.errors import PassError
from hetplan.ir.plan import Plan
from hetplan.passes.dynpipe import spec_phases
from hetplan.ir.rebalancing import (
    DynamicsSpec,
    LayerMigration,
    PlannedEvent,
    Rebalancing,
    RebalancePolicy,
)

__all__ = ["PhaseSetup", "phase_setup", "hetero_rebalancing"]


def _tables(plan: Plan, costs: CostModel) -> tuple[list[list[float]], list[list[float]],
                                                   list[list[float]], list[list[float]],
                                                   list[float]]:
    """Per stage and layer: forward ms, backward ms, boundary transfer ms (stage ending at
    the layer), bytes; and each stage's memory capacity."""
    wl, lay, het = plan.model.workload, plan.layout, plan.hetero
    assert wl is not None and lay is not None and het is not None
    P, L, m = len(plan.stages), len(wl.layers), lay.micro_batches
    fwd, bwd, send, mem, cap = [], [], [], [], []
    for s, (st, shape) in enumerate(zip(plan.stages, het.stages)):
        dev = costs.devices[st.ranks[0]]
        f, b = _layer_arrays(wl, costs, dev, shape.tp, shape.micro_batch_size, "intra",
                             st.recompute)
        fwd.append([float(x) * 1e3 for x in f])
        bwd.append([float(x) * 1e3 for x in b])
        prec = state_precision(costs.precision, dev.type, (dev.type,), capture_bytes(wl))
        scale = shape.micro_batch_size / wl.batch_size
        flight = in_flight_micro_batches("1f1b", s, P, m)
        mem.append([float(stage_memory(
            [x], tp=shape.tp, micro_batch_scale=scale, in_flight=flight,
            optimizer=costs.optimizer, precision=prec, dp=shape.dp,
            zero_stage=shape.zero_stage, sequence_parallel=shape.tp > 1,
            recompute=st.recompute).total) for x in costs.memory_layers(wl)])
        buf = (max(x.boundary_bytes for x in wl.layers) * scale * prec.act_scale
               if s > 0 else 0.0)
        cap.append(min(costs.devices[r].memory_bytes for r in st.ranks) * USABLE_FRACTION
                   - buf)
        if s + 1 == P:
            send.append([0.0] * L)
            continue
        nxt, nshape = plan.stages[s + 1], het.stages[s + 1]
        per_node: dict[int, int] = {}
        for r in nxt.ranks:
            n = costs.devices[r].node_index
            per_node[n] = per_node.get(n, 0) + 1
        cross = len({costs.devices[r].node_index for r in st.ranks} | set(per_node)) > 1
        ndev = costs.devices[nxt.ranks[0]]
        send.append([2e3 * reshard_s(wl, costs, j + 1, ndev, nshape.dp, nshape.tp,
                                     lay.micro_batch_size, max(per_node.values()), cross)
                     if j + 1 < L else 0.0 for j in range(L)])
    return fwd, bwd, send, mem, cap


def _factors(plan: Plan, dyn: DynamicsSpec) -> tuple[list[tuple[float, ...]],
                                                     list[tuple[float, ...]], list[StagePhase]]:
    """Per phase, each layer's forward and backward factor, and the phases' shells (start,
    label, params, move bytes; ``cost`` filled by the caller)."""
    wl = plan.model.workload
    assert wl is not None
    n = len(wl.layers)
    skew = dyn.pruning.scale_skew if dyn.pruning else 0.0
    units = [LayerProfile(1.0, 1.0, x.param_bytes / 4.0, prunable=x.kind == "block",
                          scale=1.0 + skew * (k / max(n - 1, 1) - 0.5))
             for k, x in enumerate(wl.layers)]
    phases = spec_phases(dyn, units)
    shells = [StagePhase(ph.start, ph.label, (), ph.params, ph.move_bytes) for ph in phases]
    return [ph.fwd_ms for ph in phases], [ph.bwd_ms for ph in phases], shells


def _sizes(bounds: Bounds) -> list[int]:
    return [j - i + 1 for i, j in bounds]


@dataclass(frozen=True)
class PhaseSetup:
    """What the replay of a heterogeneous plan's dynamics runs on: the phases priced on
    every stage, the pipeline model of a phase on given stages, the stages' boundary
    transfers, memory and capacity, the initial stages, the cuttable boundaries and the
    bandwidth layer moves use (bytes per ms)."""

    phases: tuple[StagePhase, ...]
    iteration_ms: PhaseModel
    send: list[list[float]]
    mem: list[list[float]]
    cap: list[float]
    initial: Bounds
    cuttable: list[bool]
    link_bytes_per_ms: float


def phase_setup(plan: Plan, dyn: DynamicsSpec, costs: CostModel) -> PhaseSetup:
    """The :class:`PhaseSetup` of heterogeneous ``plan`` (two stages or more) under
    ``dyn`` (steps 1 and 2 of the module docstring)."""
    wl, lay = plan.model.workload, plan.layout
    assert wl is not None and lay is not None
    fwd, bwd, send, mem, cap = _tables(plan, costs)
    ff, bf, shells = _factors(plan, dyn)
    phases = tuple(StagePhase(sh.start, sh.label, tuple(
        tuple(f * a + b * c for f, a, b, c in zip(fs, ff[k], bs, bf[k]))
        for fs, bs in zip(fwd, bwd)), sh.params, sh.move_bytes)
        for k, sh in enumerate(shells))

    def iteration_ms(k: int, bounds: Bounds) -> float:
        f = [sum(fwd[s][x] * ff[k][x] for x in range(i, j + 1))
             for s, (i, j) in enumerate(bounds)]
        b = [sum(bwd[s][x] * bf[k][x] for x in range(i, j + 1))
             for s, (i, j) in enumerate(bounds)]
        links = [send[s][j] / 2 for s, (_, j) in enumerate(bounds[:-1])]
        return simulate_pipeline(f, b, lay.micro_batches, "1f1b", p2p_fwd_ms=links,
                                 p2p_bwd_ms=links).iteration_ms

    per_gb = max(costs.comm.time_s("p2p", 1e9, 2, costs.cluster.link_between(
        a.ranks[0], b.ranks[0])) for a, b in zip(plan.stages, plan.stages[1:])) * 1e3
    return PhaseSetup(phases, iteration_ms, send, mem, cap,
                      tuple((st.first_layer, st.last_layer) for st in plan.stages),
                      [x.cuttable_before for x in wl.layers], 1e9 / per_gb)


def hetero_rebalancing(plan: Plan, dyn: DynamicsSpec, costs: CostModel
                       ) -> tuple[Rebalancing, tuple[str, ...]]:
    """The ``rebalancing`` section of heterogeneous ``plan`` under ``dyn``, and the pass
    log's notes (one per phase: static vs re-balanced predicted ms).

    Raises:
        PassError: ``rebalance.repack`` is set (stages keep their devices here).
    """
    het = plan.hetero
    assert het is not None
    pol = dyn.rebalance
    if pol.repack:
        raise PassError("dynpipe: rebalance.repack on a heterogeneous plan would release a "
                        "stage and leave its device class idle; set repack: false in the "
                        "dynamics file or plan with --hetero off")
    if len(plan.stages) < 2:
        return (Rebalancing(policy=pol, total_iterations=dyn.total_iterations),
                ("one stage: nothing to re-balance",))
    su = phase_setup(plan, dyn, costs)
    run, static = [replay_stages(su.phases, dyn.total_iterations, policy, su.iteration_ms,
                                 su.initial, send=su.send, mem=su.mem, mem_cap=su.cap,
                                 cuttable=su.cuttable, link_bytes_per_ms=su.link_bytes_per_ms)
                   for policy in (_policy(pol), BalancePolicy("static"))]
    events = tuple(PlannedEvent(
        iteration=e.iteration, label=e.label, stages=e.bounds,
        migrations=tuple(LayerMigration(layer=mv.layer, src_stage=mv.src, dst_stage=mv.dst,
                                        bytes=mv.bytes) for mv in e.moves),
        bytes_moved=e.bytes_moved, predicted_before_ms=e.before_ms,
        predicted_after_ms=e.after_ms, overhead_ms=e.overhead_ms, applied=e.applied)
        for e in run.events)
    speedup = static.total_ms / run.total_ms if run.total_ms else 1.0
    reb = Rebalancing(policy=pol, total_iterations=dyn.total_iterations, events=events,
                      speedup_vs_static=speedup, devices_used_mean=float(
                          sum(s.dp * s.tp for s in het.stages)))
    return reb, _notes(su.phases, run.events, su.initial, su.iteration_ms, speedup,
                       het.describe())


def _policy(pol: RebalancePolicy) -> BalancePolicy:
    """The file's policy as the pure replay takes it (``repack`` refused before)."""
    return BalancePolicy(pol.balancer, pol.metric, pol.max_iters, pol.trigger)


def _notes(phases: Sequence[StagePhase], events: Sequence[EventRecord], initial: Bounds,
           model: PhaseModel, speedup: float, shapes: str) -> tuple[str, ...]:
    """One line per phase: its static and re-balanced predicted iteration and stages."""
    out = [f"re-balancing between the stages {shapes} (each keeps its device class and "
           f"degrees): predicted speedup over the static stages {speedup:.3f}x; each phase's "
           "times are the pipeline's alone (the plan's prediction adds the gradient sync "
           "and optimizer step, which the boundaries move little)"]
    bounds = initial
    by_start = {e.iteration: e for e in events}
    for k, ph in enumerate(phases):
        e = by_start.get(ph.start) if k else None
        if e is not None and e.applied:
            bounds = e.bounds
        static_ms, now_ms = model(k, initial), model(k, bounds)
        verdict = ("" if e is None else " (applied)" if e.applied else
                   " (no better stages)" if not e.moves else
                   f" (proposal {_sizes(e.bounds)} not applied: its gain does not pay for "
                   "the moves)")
        out.append(f"phase {k} from iteration {ph.start} ({ph.label}): static "
                   f"{static_ms:.3f} ms, re-balanced {now_ms:.3f} ms "
                   f"({static_ms / now_ms:.3f}x), stage sizes {_sizes(bounds)}{verdict}")
    return tuple(out)
