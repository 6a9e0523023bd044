"""Dynamic models for pipeline re-balancing (DynPipe / DynMo): pure functions, no torch.

A *dynamic* model changes its per-layer costs while it trains. This module describes those
changes and re-plans the pipeline at each change (``research/dynpipe.md`` §2.2, §2.4, §3–4):

* **Gradual global magnitude pruning** with the Zhu–Gupta schedule, Eq. (2) of the seed,
  implemented exactly (steps at ``t0 + kΔt`` for ``k = 1..n``, reaching ``S_f`` at ``k = n``;
  the reference code's off-by-one is not reproduced). Which layer loses how much follows
  from one *global* magnitude threshold: a layer's weights are modelled as ``N(0, σ_l²)``, so
  its sparsity at threshold ``τ`` is ``erf(τ / (σ_l √2))``, and ``τ`` is found by bisection so
  that the parameter-weighted mean sparsity equals the schedule's target. Embeddings, norms
  and heads are never pruned (as in the reference code).
* **Sparse-kernel cost** (:func:`sparse_time_factor`): the seed's Figure 2 says the sparse
  kernel beats dense cuBLAS only from 75 % sparsity on. Model: the sparse GEMM takes
  ``floor + (1 - floor) · (1 - s) / (1 - crossover)`` of the dense time — linear in the
  non-zeros, equal to dense at the crossover, ``floor`` of dense at 100 %. With the defaults
  (crossover 0.75, floor 0.1) a layer at 50 % sparsity runs 1.9× slower than dense, at 90 %
  2.2× faster. ``kernel="sparse"`` uses the sparse kernel once a layer is pruned;
  ``kernel="best"`` takes the faster of the two; ``kernel="sparse-from-start"`` runs every
  prunable layer on the sparse kernel from iteration 0, before the first pruning step too
  (at 0 % sparsity: 3.7× dense with the defaults). The last is what the paper's
  implementation runs: the reference code's pruning mode builds the blocks' four linears
  as CSR tensors when the model is constructed and multiplies them with Sputnik from then
  on (``docs/decisions.md``, "DynPipe, part 3").
* **Layer freezing** freezes a prefix of layers (PipeTransformer-style): a frozen prefix runs
  no backward at all and keeps no optimizer state.
* **Early exit**: from an iteration on, a fraction of the tokens leaves after a layer, so
  every later layer's time scales by ``1 - fraction``.

Re-planning (:func:`run_dynamic`) happens at every event with one of four balancers — the
centralized partition balancer (exact min–max, :mod:`hetplan.algorithms.partition`) or the
iterative diffusion balancer (:mod:`hetplan.algorithms.diffusion`), each by time or by
parameter count — plus the static uniform baseline. **Trigger policy** (decision): after every event
the balancer proposes a partition; it is applied only when the predicted saving until the next
event, ``(T_now - T_new) × iterations``, exceeds its cost — the balancing decision plus moving
the layers' weights and optimizer state over the pipeline links. Optionally the layers are
re-packed onto fewer devices when memory allows and the predicted iteration time does not
grow by more than the factor ``repack_slowdown``; a re-pack is applied whenever it releases
devices within that factor (the user traded that much speed for devices).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Literal

from hetplan.algorithms.diffusion import diffusion_balance
from hetplan.algorithms.partition import min_max_partition, uniform_partition
from hetplan.errors import InfeasiblePlanError, SpecError
from hetplan.ir.rebalancing import stage_changes

__all__ = [
    "balance",
    "PruneStep",
    "zhu_gupta_sparsity",
    "pruning_schedule",
    "sparse_time_factor",
    "global_magnitude_sparsity",
    "LayerMove",
    "layer_moves",
    "Phase",
    "BalancePolicy",
    "EventRecord",
    "DynamicRun",
    "run_dynamic",
    "LayerProfile",
    "PruningModel",
    "build_phases",
    "stage_peak_memory",
]

Balancer = Literal["partition", "diffusion", "static"]
Metric = Literal["time", "param"]


# -- pruning schedule and kernel cost ---------------------------------------------------------
@dataclass(frozen=True)
class PruneStep:
    """One pruning step: at ``iteration`` the model reaches ``sparsity``; ``fraction`` is the
    share of the then remaining weights removed, ``(S_k - S_{k-1}) / (1 - S_{k-1})``."""

    iteration: int
    sparsity: float
    fraction: float


def zhu_gupta_sparsity(
    t: int, *, initial: float, final: float, start: int, frequency: int, steps: int
) -> float | Fraction:
    """Eq. (2): ``S_t = S_f + (S_i - S_f)(1 - (t - t0)/(nΔt))³``, clamped to ``[t0, t0+nΔt]``.

    Exact (``Fraction``) when ``initial`` and ``final`` are Fractions or ints. O(1).
    """
    if steps < 1 or frequency < 1:
        raise SpecError(f"pruning needs steps >= 1 and frequency >= 1, got {steps}, {frequency}")
    span = steps * frequency
    progress = Fraction(min(max(t - start, 0), span), span)
    exact = isinstance(initial, (int, Fraction)) and isinstance(final, (int, Fraction))
    if not exact:
        progress = float(progress)  # type: ignore[assignment]
    return final + (initial - final) * (1 - progress) ** 3


def pruning_schedule(
    *, initial: float, final: float, start: int, frequency: int, steps: int
) -> tuple[PruneStep, ...]:
    """The ``steps`` pruning steps at ``start + k·frequency``, ``k = 1..steps``. O(n)."""
    if not (0 <= initial <= final < 1):
        raise SpecError(f"pruning needs 0 <= initial_sparsity <= final_sparsity < 1, got "
                        f"{initial} and {final}")
    out, prev = [], float(initial)
    for k in range(1, steps + 1):
        t = start + k * frequency
        s = float(zhu_gupta_sparsity(t, initial=initial, final=final, start=start,
                                     frequency=frequency, steps=steps))
        out.append(PruneStep(t, s, (s - prev) / (1 - prev)))
        prev = s
    return tuple(out)


def sparse_time_factor(sparsity: float, *, crossover: float = 0.75, floor: float = 0.1) -> float:
    """Time of a sparse GEMM relative to dense at ``sparsity`` (see module docstring). O(1)."""
    if not (0 <= sparsity <= 1) or not (0 < crossover < 1) or not (0 <= floor < 1):
        raise SpecError(f"sparse_time_factor needs sparsity in [0,1], crossover in (0,1), floor "
                        f"in [0,1); got {sparsity}, {crossover}, {floor}")
    return floor + (1 - floor) * (1 - sparsity) / (1 - crossover)


def global_magnitude_sparsity(
    params: Sequence[float], scales: Sequence[float], target: float, *, iterations: int = 200
) -> tuple[float, ...]:
    """Per-layer sparsity when one global magnitude threshold prunes ``target`` of all the
    parameters, each layer's weights ``N(0, scales[l]²)``. Layers with 0 params stay 0.

    Bisection on the threshold; O(iterations · L).
    """
    if len(params) != len(scales) or any(s <= 0 for s in scales):
        raise SpecError("global_magnitude_sparsity needs one positive scale per layer")
    total = sum(params)
    if total <= 0 or target <= 0:
        return tuple(0.0 for _ in params)

    def kept_fraction(tau: float) -> list[float]:
        return [math.erf(tau / (sc * math.sqrt(2))) for sc in scales]

    lo, hi = 0.0, 50.0 * max(scales)
    for _ in range(iterations):
        mid = (lo + hi) / 2
        frac = sum(p * s for p, s in zip(params, kept_fraction(mid))) / total
        lo, hi = (mid, hi) if frac < target else (lo, mid)
    return tuple(kept_fraction((lo + hi) / 2))


# -- layer moves ------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerMove:
    """Layer ``layer`` moves from pipeline stage ``src`` to ``dst`` carrying ``bytes``."""

    layer: int
    src: int
    dst: int
    bytes: float


def layer_moves(
    old: Sequence[tuple[int, int]], new: Sequence[tuple[int, int]], move_bytes: Sequence[float]
) -> tuple[LayerMove, ...]:
    """Every layer whose stage differs between ``old`` and ``new`` (stage index = device
    position; a stage beyond the new count has been released). O(L)."""
    return tuple(LayerMove(k, src, dst, float(move_bytes[k]))
                 for k, src, dst in stage_changes(old, new))


# -- the dynamic run --------------------------------------------------------------------------
@dataclass(frozen=True)
class Phase:
    """The model between two events, from iteration ``start`` on.

    ``fwd_ms``/``bwd_ms``: per-layer time of one micro-batch on the reference device;
    ``params``: per-layer parameter count the "param" metric balances (non-zeros);
    ``move_bytes``: bytes that move with a layer (weights, indices, optimizer state);
    ``mem_bytes``: per-layer memory excluding activations; ``act_bytes``: per-layer saved
    activations of one micro-batch; ``label``: what happened (``"prune 52.0%"``).
    """

    start: int
    fwd_ms: tuple[float, ...]
    bwd_ms: tuple[float, ...]
    params: tuple[float, ...]
    move_bytes: tuple[float, ...]
    mem_bytes: tuple[float, ...] = ()
    act_bytes: tuple[float, ...] = ()
    label: str = ""


@dataclass(frozen=True)
class BalancePolicy:
    """How and when to re-balance (see module docstring).

    Attributes:
        balancer: ``partition`` (centralized exact min–max), ``diffusion`` or ``static``.
        metric: ``time`` or ``param``.
        max_iters: diffusion iterations (seed: 5).
        trigger: ``gain`` (apply when the saving beats the cost) or ``every-event``.
        repack: also try to release devices at each event.
        repack_slowdown: re-pack only if the iteration time grows at most by this factor.
    """

    balancer: Balancer = "partition"
    metric: Metric = "time"
    max_iters: int = 5
    trigger: Literal["gain", "every-event"] = "gain"
    repack: bool = False
    repack_slowdown: float = 1.0


@dataclass(frozen=True)
class EventRecord:
    """What re-planning decided at one event."""

    iteration: int
    label: str
    bounds: tuple[tuple[int, int], ...]
    moves: tuple[LayerMove, ...]
    bytes_moved: float
    before_ms: float
    after_ms: float
    overhead_ms: float
    applied: bool
    released: tuple[int, ...] = ()


@dataclass(frozen=True)
class DynamicRun:
    """A whole training run: events and totals (``total_ms`` includes the overheads)."""

    events: tuple[EventRecord, ...]
    total_ms: float
    overhead_ms: float
    iterations: int
    final_bounds: tuple[tuple[int, int], ...]
    devices_used_mean: float = field(default=0.0)
    peak_stage_bytes: float = field(default=0.0)


#: iteration_ms(fwd per stage, bwd per stage, stage count) -> predicted iteration time
IterationModel = Callable[[Sequence[float], Sequence[float], int], float]


def stage_peak_memory(phase: Phase, bounds: Sequence[tuple[int, int]]) -> list[float]:
    """Peak bytes of every stage in ``phase``: its layers' ``mem_bytes`` plus their saved
    activations times the micro-batches stage ``s`` of ``p`` holds under 1F1B (``p - s``),
    the same model the balancers' memory caps use (:func:`_stage_mem`). ``[]`` when the
    phase has no memory data. O(stages · L)."""
    if not phase.mem_bytes:
        return []
    mem = _stage_mem(phase, len(bounds))
    return [sum(mem[s][i : j + 1]) for s, (i, j) in enumerate(bounds)]


def _stage_mem(phase: Phase, k: int) -> list[list[float]]:
    """``mem[s][l]``: bytes layer ``l`` costs on stage ``s`` of ``k`` under 1F1B (its
    ``mem_bytes`` plus its saved activations times the ``k - s`` micro-batches in flight)."""
    acts = phase.act_bytes or [0.0] * len(phase.mem_bytes)
    return [[m + a * (k - s) for m, a in zip(phase.mem_bytes, acts)] for s in range(k)]


def _stage_sums(bounds: Sequence[tuple[int, int]], per_layer: Sequence[float],
                speeds: Sequence[float]) -> list[float]:
    return [sum(per_layer[i : j + 1]) / speeds[s] for s, (i, j) in enumerate(bounds)]


def _propose(
    phase: Phase,
    bounds: tuple[tuple[int, int], ...],
    speeds: Sequence[float],
    send_ms: Sequence[float],
    policy: BalancePolicy,
    mem_cap: Sequence[float] | None,
    cuttable: Sequence[bool] | None = None,
) -> tuple[tuple[int, int], ...]:
    p = len(bounds)
    if policy.balancer == "static":
        return bounds
    total = [f + b for f, b in zip(phase.fwd_ms, phase.bwd_ms)]
    if policy.metric == "time":
        cost = [[t / speeds[s] for t in total] for s in range(p)]
        send = [list(send_ms)] * p
    else:
        cost, send = [list(phase.params)] * p, None
    mem = cap = None
    if mem_cap is not None and phase.mem_bytes:
        mem = _stage_mem(phase, p)
        cap = list(mem_cap[:p])
    return balance(policy, bounds, cost, send=send, mem=mem, mem_cap=cap, cuttable=cuttable)


def balance(policy: BalancePolicy, bounds: tuple[tuple[int, int], ...],
            cost: Sequence[Sequence[float]], *,
            send: Sequence[Sequence[float]] | None = None,
            mem: Sequence[Sequence[float]] | None = None,
            mem_cap: Sequence[float] | None = None,
            cuttable: Sequence[bool] | None = None) -> tuple[tuple[int, int], ...]:
    """The stages ``policy``'s balancer gives for per-stage layer ``cost`` (``partition``:
    the exact min-max; ``diffusion``: from ``bounds``, one layer at a time, and the exact
    partition over the allowed boundaries where it stops at a boundary the runtime cannot
    split at).

    Raises:
        InfeasiblePlanError: no partition fits the stages' memory.
    """
    p = len(bounds)
    if policy.balancer == "partition":
        return min_max_partition(cost, p, send=send, mem=mem, mem_cap=mem_cap,
                                 cuttable=cuttable).bounds
    got = diffusion_balance(bounds, cost, send=send, mem=mem, mem_cap=mem_cap,
                            max_iters=policy.max_iters)
    if cuttable is not None and not all(cuttable[i] for i, _ in got[1:]):
        return min_max_partition(cost, p, send=send, mem=mem, mem_cap=mem_cap,
                                 cuttable=cuttable).bounds
    return got


def run_dynamic(
    phases: Sequence[Phase],
    num_stages: int,
    total_iterations: int,
    policy: BalancePolicy,
    iteration_ms: IterationModel,
    *,
    speeds: Sequence[float] | None = None,
    send_ms: Sequence[float] | None = None,
    link_bytes_per_ms: float = math.inf,
    decision_ms: float = 0.0,
    mem_cap: Sequence[float] | None = None,
    initial: Sequence[tuple[int, int]] | None = None,
    cuttable: Sequence[bool] | None = None,
) -> DynamicRun:
    """Train through ``phases`` (the first starts at iteration 0) re-planning at each event.

    Args:
        phases: model states in iteration order; ``phases[0].start`` must be 0.
        num_stages: pipeline stages (devices) at the start.
        total_iterations: length of the run.
        policy: balancer, metric, trigger, re-packing.
        iteration_ms: the pipeline model (e.g. the schedule simulator).
        speeds: relative speed of each device in pipeline order (default 1).
        send_ms: per-layer boundary transfer time (for the time metric).
        link_bytes_per_ms: bandwidth layer moves use (point-to-point between stages).
        decision_ms: time the balancer's decision costs per event (measured by the caller).
        mem_cap: per-device memory capacity (layers' ``mem_bytes`` + 1F1B activation stash).
        initial: the starting partition (default: the balancer's, or uniform for static).
        cuttable: per layer, whether a stage may start there (``LayerIR.cuttable_before``;
            default everywhere): no proposal starts a stage elsewhere.

    Returns:
        The events, the total time (overheads included), the devices used on average and
        the largest stage's peak memory over the run (:func:`stage_peak_memory`; 0 without
        memory data) — the caller compares it with the devices' capacity, since the initial
        partition is taken as given.
    """
    if not phases or phases[0].start != 0:
        raise SpecError("run_dynamic needs phases starting at iteration 0")
    n = len(phases[0].fwd_ms)
    speeds = list(speeds) if speeds is not None else [1.0] * num_stages
    send = list(send_ms) if send_ms is not None else [0.0] * n
    if initial is not None:
        bounds = tuple(initial)
    elif policy.balancer == "static":
        bounds = uniform_partition(n, num_stages, cuttable)
    else:
        bounds = _propose(phases[0], uniform_partition(n, num_stages, cuttable), speeds, send,
                          policy, mem_cap, cuttable)

    def predict(ph: Phase, bd: tuple[tuple[int, int], ...]) -> float:
        return iteration_ms(_stage_sums(bd, ph.fwd_ms, speeds),
                            _stage_sums(bd, ph.bwd_ms, speeds), len(bd))

    events: list[EventRecord] = []
    total = overhead = device_iters = peak = 0.0
    for k, ph in enumerate(phases):
        end = phases[k + 1].start if k + 1 < len(phases) else total_iterations
        span = max(end - ph.start, 0)
        now = predict(ph, bounds)
        if k > 0 and policy.balancer != "static":
            new = _propose(ph, bounds, speeds, send, policy, mem_cap, cuttable)
            released: tuple[int, ...] = ()
            if policy.repack:
                new, released = _try_repack(ph, new, speeds, mem_cap, policy, predict,
                                            cuttable)
            moves = layer_moves(bounds, new, ph.move_bytes)
            moved = sum(m.bytes for m in moves)
            cost = decision_ms + (moved / link_bytes_per_ms if moved else 0.0)
            after = predict(ph, new)
            gain = (now - after) * span
            apply = bool(moves) and (policy.trigger == "every-event" or gain > cost or
                                     (bool(released) and after <= now * policy.repack_slowdown))
            events.append(EventRecord(ph.start, ph.label, new, moves, moved, now, after,
                                      cost if apply else decision_ms, apply, released))
            overhead += cost if apply else decision_ms
            if apply:
                bounds, now = new, after
        total += now * span
        device_iters += len(bounds) * span
        peak = max([peak, *stage_peak_memory(ph, bounds)])
    return DynamicRun(tuple(events), total + overhead, overhead, total_iterations, bounds,
                      device_iters / max(total_iterations, 1), peak)


def _try_repack(
    ph: Phase,
    bounds: tuple[tuple[int, int], ...],
    speeds: Sequence[float],
    mem_cap: Sequence[float] | None,
    policy: BalancePolicy,
    predict: Callable[[Phase, tuple[tuple[int, int], ...]], float],
    cuttable: Sequence[bool] | None = None,
) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]]:
    """Fewer stages if memory allows and the iteration slows by at most repack_slowdown."""
    if mem_cap is None or not ph.mem_bytes:
        return bounds, ()
    p = len(bounds)
    total = [f + b for f, b in zip(ph.fwd_ms, ph.bwd_ms)]
    base = predict(ph, bounds)
    for k in range(1, p):
        cost = [[t / speeds[s] for t in total] for s in range(k)]
        mem = _stage_mem(ph, k)
        try:
            got = min_max_partition(cost, k, mem=mem, mem_cap=list(mem_cap[:k]),
                                    cuttable=cuttable)
        except InfeasiblePlanError:
            continue
        if predict(ph, got.bounds) <= base * policy.repack_slowdown:
            return got.bounds, tuple(range(k, p))
    return bounds, ()


# -- from a description of the dynamics to phases ---------------------------------------------
@dataclass(frozen=True)
class LayerProfile:
    """A layer's dense costs: per-micro-batch times on the reference device, parameter count,
    whether pruning touches it, its weight scale (for the global threshold) and its saved
    activation bytes per micro-batch."""

    fwd_ms: float
    bwd_ms: float
    params: float
    prunable: bool = False
    scale: float = 1.0
    act_bytes: float = 0.0


@dataclass(frozen=True)
class PruningModel:
    """Gradual global magnitude pruning: the Eq. (2) schedule and the sparse-kernel curve.

    ``gemm_share`` is the part of a prunable layer's time spent in the pruned GEMMs (the rest,
    e.g. attention scores and norms, stays dense). ``kernel``: ``sparse`` (sparse kernel once
    a layer is pruned), ``best`` (the faster of sparse and dense) or ``sparse-from-start``
    (prunable layers on the sparse kernel from iteration 0, as the paper's code runs them).
    """

    final_sparsity: float
    start: int
    frequency: int
    steps: int
    initial_sparsity: float = 0.0
    kernel: Literal["sparse", "best", "sparse-from-start"] = "sparse"
    crossover: float = 0.75
    floor: float = 0.1
    gemm_share: float = 0.9


def _layer_factor(sparsity: float, pm: PruningModel) -> float:
    """Time of a prunable layer at ``sparsity`` relative to its dense time."""
    if sparsity <= 0 and pm.kernel != "sparse-from-start":
        return 1.0
    f = sparse_time_factor(sparsity, crossover=pm.crossover, floor=pm.floor)
    if pm.kernel == "best":
        f = min(f, 1.0)
    return pm.gemm_share * f + (1 - pm.gemm_share)


def build_phases(
    layers: Sequence[LayerProfile],
    *,
    pruning: PruningModel | None = None,
    freezes: Sequence[tuple[int, int]] = (),
    exits: Sequence[tuple[int, int, float]] = (),
    bytes_per_param: float = 4.0,
    index_bytes: float = 4.0,
    optimizer_factor: float = 2.0,
) -> tuple[Phase, ...]:
    """The model's phases: the dense start, then one phase per event iteration.

    Args:
        layers: dense per-layer costs, in pipeline order.
        pruning: the pruning schedule (None: no pruning).
        freezes: ``(iteration, n)``: from ``iteration`` on the first ``n`` layers are frozen.
        exits: ``(iteration, after_layer, fraction)``: from ``iteration`` on ``fraction`` of the
            tokens leave after layer ``after_layer``.
        bytes_per_param / index_bytes: a weight's bytes, and a sparse weight's column index.
        optimizer_factor: optimizer state per weight byte (Adam: 2); frozen layers keep none.

    Returns:
        Phases in iteration order; the first starts at 0. O(E · L) plus the pruning
        threshold bisection per step.
    """
    steps = pruning_schedule(initial=pruning.initial_sparsity, final=pruning.final_sparsity,
                             start=pruning.start, frequency=pruning.frequency,
                             steps=pruning.steps) if pruning else ()
    for it, nfrozen in freezes:
        if not 0 <= nfrozen <= len(layers):
            raise SpecError(f"freeze at iteration {it}: {nfrozen} layers, the model has "
                            f"{len(layers)}")
    for it, after, frac in exits:
        if not (0 <= after < len(layers) and 0 <= frac < 1):
            raise SpecError(f"early exit at iteration {it}: after_layer {after} must be in "
                            f"0..{len(layers) - 1} and fraction {frac} in [0, 1)")
    labels: dict[int, list[str]] = {}
    for st in steps:
        labels.setdefault(st.iteration, []).append(f"prune to {st.sparsity:.1%}")
    for it, nfrozen in freezes:
        labels.setdefault(it, []).append(f"freeze {nfrozen} layer(s)")
    for it, after, frac in exits:
        labels.setdefault(it, []).append(f"early exit {frac:.0%} after layer {after}")
    prunable = [lay.params if lay.prunable else 0.0 for lay in layers]
    scales = [lay.scale for lay in layers]
    out = []
    for t in [0, *sorted(k for k in labels if k > 0)]:
        target = max((st.sparsity for st in steps if st.iteration <= t), default=0.0)
        per_layer = global_magnitude_sparsity(prunable, scales, target)
        frozen = max((nf for it, nf in freezes if it <= t), default=0)
        fwd, bwd, params, moves, mems = [], [], [], [], []
        for k, lay in enumerate(layers):
            sp = per_layer[k] if lay.prunable else 0.0
            f = _layer_factor(sp, pruning) if pruning and lay.prunable else 1.0
            tokens = math.prod(1 - fr for it, after, fr in exits if it <= t and k > after)
            fwd.append(lay.fwd_ms * f * tokens)
            bwd.append(0.0 if k < frozen else lay.bwd_ms * f * tokens)
            nnz = lay.params * (1 - sp)
            weight = nnz * (bytes_per_param + (index_bytes if sp > 0 else 0.0))
            state = 0.0 if k < frozen else nnz * bytes_per_param * optimizer_factor
            grads = 0.0 if k < frozen else nnz * bytes_per_param
            params.append(nnz)
            moves.append(weight + state)
            mems.append(weight + state + grads)
        out.append(Phase(t, tuple(fwd), tuple(bwd), tuple(params), tuple(moves), tuple(mems),
                         tuple(lay.act_bytes for lay in layers),
                         "; ".join(labels.get(t, ["start"]))))
    return tuple(out)
