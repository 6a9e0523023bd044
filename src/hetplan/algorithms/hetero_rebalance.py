"""Re-balancing a dynamic model between pipeline stages that each have their own costs.

:func:`~hetplan.algorithms.dynamics.run_dynamic` replays a dynamic model (pruning, freezing,
early exit) on stages that differ by one scalar speed each: every layer costs ``t / speed_s``
on stage ``s``. The stages of a heterogeneous plan differ by more than a speed: each has its
own device class, data- and tensor-parallel degrees and recomputation, so the ratio between
two stages' times depends on the layer (tensor parallelism divides only the layers with
Megatron pairs and adds their all-reduces; a stage's replicas each run ``micro_batch / dp``
samples). This module replays the same phases with a full ``cost[stage][layer]`` table per
phase and a caller's pipeline model, with the same balancers, trigger rule and records as
``run_dynamic`` (:class:`~hetplan.algorithms.dynamics.EventRecord`,
:class:`~hetplan.algorithms.dynamics.DynamicRun`), so the plan section and its report do not
change. Stages are never released: a stage keeps its device class and degrees, and a
re-pack would leave a class's devices idle (the caller refuses ``repack``).

At each event the replay takes the fastest, under the caller's pipeline model, of the
balancer's proposal (with and without the boundary transfers), the initial stages and the
current ones: the balancer's min-max objective is not the pipeline's time (:func:`_best`),
so a phase is never predicted slower than it would be on its stages before the event or on
the initial ones, but where moving back does not pay for the moved bytes. Pure: numbers in,
numbers out; deterministic (ties as in
:func:`~hetplan.algorithms.partition.min_max_partition`, then in candidate order).
Complexity per event: two partitions, O(P · L · w), plus five calls of the pipeline model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hetplan.algorithms.dynamics import (
    BalancePolicy,
    DynamicRun,
    EventRecord,
    balance,
    layer_moves,
)
from hetplan.errors import SpecError

__all__ = ["Bounds", "PhaseModel", "StagePhase", "replay_stages", "propose_stages"]

Bounds = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class StagePhase:
    """The model between two events, priced on every stage.

    Attributes:
        start: the first iteration of the phase.
        label: what happened (``"prune to 52.0%"``; ``"start"`` for the first phase).
        cost: ``cost[s][l]``: forward + backward ms of layer ``l`` for one micro-batch on
            stage ``s`` (its own devices and degrees).
        params: per-layer parameter count the ``param`` metric balances (non-zeros).
        move_bytes: bytes that move with a layer when it changes stage.
    """

    start: int
    label: str
    cost: tuple[tuple[float, ...], ...]
    params: tuple[float, ...]
    move_bytes: tuple[float, ...]


#: iteration_ms(phase index, bounds) -> the predicted iteration time of that phase
PhaseModel = Callable[[int, Bounds], float]


def propose_stages(phase: StagePhase, bounds: Bounds, policy: BalancePolicy, *,
                   send: Sequence[Sequence[float]] | None = None,
                   mem: Sequence[Sequence[float]] | None = None,
                   mem_cap: Sequence[float] | None = None,
                   cuttable: Sequence[bool] | None = None) -> Bounds:
    """The balancer's stages for ``phase`` (``bounds``: the current ones, which ``static``
    keeps and ``diffusion`` starts from).

    Raises:
        InfeasiblePlanError: no partition fits the stages' memory.
    """
    p = len(bounds)
    if policy.balancer == "static":
        return bounds
    if policy.metric == "time":
        cost: Sequence[Sequence[float]] = phase.cost
        snd = send
    else:
        cost, snd = [list(phase.params)] * p, None
    return balance(policy, bounds, cost, send=snd, mem=mem, mem_cap=mem_cap,
                   cuttable=cuttable)


def replay_stages(phases: Sequence[StagePhase], total_iterations: int, policy: BalancePolicy,
                  iteration_ms: PhaseModel, initial: Bounds, *,
                  send: Sequence[Sequence[float]] | None = None,
                  mem: Sequence[Sequence[float]] | None = None,
                  mem_cap: Sequence[float] | None = None,
                  cuttable: Sequence[bool] | None = None,
                  link_bytes_per_ms: float = float("inf")) -> DynamicRun:
    """Train through ``phases`` from the stages ``initial``, re-planning at each event.

    Args:
        phases: in iteration order; ``phases[0].start`` must be 0.
        total_iterations: length of the run.
        policy: balancer, metric and trigger (``repack`` is not read: stages stay).
        iteration_ms: the pipeline model of a phase on given stages.
        initial: the starting stages (one ``(first, last)`` layer range per stage).
        send: ``send[s][j]``: boundary transfer ms when stage ``s`` ends at layer ``j``.
        mem / mem_cap: ``mem[s][l]`` bytes layer ``l`` costs on stage ``s``, and each
            stage's capacity: no proposal overflows a stage.
        cuttable: per layer, whether a stage may start there.
        link_bytes_per_ms: bandwidth layer moves use.

    Returns:
        The events (one per phase after the first), the total time with the moves'
        overheads, and the final stages. ``devices_used_mean`` is the stage count.
    """
    if not phases or phases[0].start != 0:
        raise SpecError("replay_stages needs phases starting at iteration 0")
    bounds = tuple(initial)
    events: list[EventRecord] = []
    total = overhead = 0.0
    for k, ph in enumerate(phases):
        end = phases[k + 1].start if k + 1 < len(phases) else total_iterations
        span = max(end - ph.start, 0)
        now = iteration_ms(k, bounds)
        if k > 0 and policy.balancer != "static":
            new = _best(k, bounds, initial, iteration_ms, propose_stages(
                ph, bounds, policy, send=send, mem=mem, mem_cap=mem_cap, cuttable=cuttable),
                propose_stages(ph, bounds, policy, mem=mem, mem_cap=mem_cap,
                               cuttable=cuttable) if send is not None else None)
            moves = layer_moves(bounds, new, ph.move_bytes)
            moved = sum(m.bytes for m in moves)
            cost = moved / link_bytes_per_ms if moved else 0.0
            after = iteration_ms(k, new)
            apply = bool(moves) and (policy.trigger == "every-event"
                                     or (now - after) * span > cost)
            events.append(EventRecord(ph.start, ph.label, new, moves, moved, now, after,
                                      cost if apply else 0.0, apply))
            if apply:
                overhead += cost
                bounds, now = new, after
        total += now * span
    return DynamicRun(tuple(events), total + overhead, overhead, total_iterations, bounds,
                      float(len(bounds)))


def _best(k: int, current: Bounds, initial: Sequence[tuple[int, int]], model: PhaseModel,
          proposal: Bounds, plain: Bounds | None) -> Bounds:
    """The fastest under ``model`` of the balancer's proposal, its proposal without the
    boundary transfers, the initial stages and the current ones (ties: in that order).

    The balancer minimises the largest stage's load; the pipeline also pays every stage's
    fill and drain, and moving a layer onto a stage of slower devices adds to that sum, so
    the min-max proposal can predict slower than stages it did not consider."""
    cands = [proposal, *([plain] if plain is not None else []), tuple(initial), current]
    times = [model(k, b) for b in cands]
    return cands[times.index(min(times))]
