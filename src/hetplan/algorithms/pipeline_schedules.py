"""Pipeline schedules as data: per pipeline rank, the ordered actions it executes.

One generator per schedule — ``gpipe``, ``1f1b`` (PipeDream-flush, Megatron
non-interleaved), ``interleaved-1f1b`` (Megatron, ``virtual_stages`` chunks per rank) and
``chimera`` (Li & Hoefler, SC'21) — gives a :class:`PipelineSchedule`: ``actions[r]`` is rank
``r``'s ordered tuple of :class:`Action`. The same lists are

* costed by the pipeline simulator (:mod:`hetplan.cost_models.pipeline` replays them against
  stage and link times),
* written into the plan (``Plan.pipeline_actions``, one string per rank: :meth:`encode`), and
* executed by the runtime (``hetplan.runtime.handlers.stages``), which derives them with
  :func:`build_schedule` when a plan predates that section.

An action is (stage, F or B, micro-batch) and prints as ``"{stage}{kind}{microbatch}"``, e.g.
``"2F0"``, like ``torch.distributed.pipelining``'s ``_Action``; :meth:`Action.parse` reads it
back. ``stage`` indexes the micro-batch's own pipeline ``0 .. S-1``: for gpipe and 1f1b it is
the rank; interleaved rank ``r`` holds stages ``r, r+P, …``; in Chimera it is the stage in the
micro-batch's direction (so a stage index names two ranks, one per direction).

The schedule as data (:class:`Action`, :class:`PipelineSchedule`, the errors), the check
that lists can finish (:func:`check_progress`, :func:`decode_schedule`, :func:`deadlock_error`)
and what the executors assume of the lists (:func:`misplaced_stages`,
:func:`chimera_shape_problem`, :func:`transfer_order_problem`,
:func:`last_stage_order_problem`) live in :mod:`hetplan.ir.pipeline_order`, so that the plan's
one validator runs the same checks on a plan's lists as the runtime (``ir`` is the lowest
import layer: the validator may not import this module); they are re-exported here, and this
module keeps the generators.

Pure Python, no torch: the only imports are the plan's ``ir`` modules.
"""

from __future__ import annotations

from functools import lru_cache

from hetplan.ir.pipeline_order import (
    Action,
    ActionKind,
    PipelineDeadlockError,
    PipelineSchedule,
    PipelineScheduleError,
    check_progress,
    chimera_shape_problem,
    deadlock_error,
    decode_schedule,
    last_stage_order_problem,
    misplaced_stages,
    transfer_order_problem,
    transfers,
)
from hetplan.ir.plan_sections import Layout, PipelineActions

__all__ = [
    "SCHEDULES", "Action", "ActionKind", "PipelineDeadlockError", "PipelineSchedule",
    "deadlock_error",
    "PipelineScheduleError", "build_schedule", "check_progress", "check_sizes", "chimera_schedule",
    "decode_schedule", "gpipe_schedule", "interleaved_1f1b_schedule", "layout_actions",
    "one_f_one_b_schedule", "plan_schedule", "chimera_shape_problem",
    "last_stage_order_problem", "misplaced_stages", "transfer_order_problem", "transfers",
]

#: Schedule names :func:`build_schedule` generates.
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b", "chimera")

_F, _B = ActionKind.F, ActionKind.B


# --------------------------------------------------------------------------- generators


def check_sizes(num_ranks: int, num_microbatches: int) -> None:
    """Raise :class:`PipelineScheduleError` unless both sizes are at least 1."""
    if num_ranks < 1:
        raise PipelineScheduleError(f"num_ranks must be >= 1, got {num_ranks!r}")
    if num_microbatches < 1:
        raise PipelineScheduleError(f"num_microbatches must be >= 1, got {num_microbatches!r}")


def gpipe_schedule(num_ranks: int, num_microbatches: int) -> PipelineSchedule:
    """GPipe: every rank runs all forwards, then all backwards, both in micro-batch order.

    O(P * M).
    """
    check_sizes(num_ranks, num_microbatches)
    m_range = range(num_microbatches)
    actions = tuple(
        tuple([Action(_F, m, r) for m in m_range] + [Action(_B, m, r) for m in m_range])
        for r in range(num_ranks)
    )
    return PipelineSchedule("gpipe", num_ranks, num_microbatches, num_ranks, actions)


def one_f_one_b_schedule(num_ranks: int, num_microbatches: int) -> PipelineSchedule:
    """1F1B (PipeDream-flush; Megatron ``forward_backward_pipelining_without_interleaving``).

    Rank ``r`` runs ``min(P-r-1, M)`` warm-up forwards, then alternates one forward and one
    backward, then drains the remaining backwards. O(P * M).
    """
    check_sizes(num_ranks, num_microbatches)
    per_rank = []
    for r in range(num_ranks):
        warm = min(num_ranks - r - 1, num_microbatches)
        acts = [Action(_F, m, r) for m in range(warm)]
        for i in range(num_microbatches - warm):
            acts += [Action(_F, warm + i, r), Action(_B, i, r)]
        acts += [Action(_B, m, r) for m in range(num_microbatches - warm, num_microbatches)]
        per_rank.append(tuple(acts))
    return PipelineSchedule("1f1b", num_ranks, num_microbatches, num_ranks, tuple(per_rank))


def interleaved_1f1b_schedule(
    num_ranks: int, num_microbatches: int, virtual_stages: int
) -> PipelineSchedule:
    """Megatron's interleaved 1F1B with ``v = virtual_stages`` model chunks per rank.

    Rank ``r`` holds virtual stages ``r, r+P, ..., r+(v-1)P``. It walks ``M*v`` virtual
    micro-batches: the ``k``-th forward is micro-batch ``(k // (P*v)) * P + k % P`` on chunk
    ``(k % (P*v)) // P``; backwards walk the chunks in reverse. Warm-up is
    ``min(2*(P-r-1) + (v-1)*P, M*v)`` forwards (all of them when ``M == P``), then 1F1B, then
    drain, exactly as in Megatron-LM. O(P * M * v).

    Raises:
        PipelineScheduleError: ``virtual_stages < 2`` or ``M % P != 0``.
    """
    check_sizes(num_ranks, num_microbatches)
    p, v, m_total = num_ranks, virtual_stages, num_microbatches
    if v < 2:
        raise PipelineScheduleError(
            f"interleaved-1f1b needs virtual_stages >= 2, got {v!r}; use '1f1b' for one chunk"
        )
    if m_total % p != 0:
        raise PipelineScheduleError(
            f"interleaved-1f1b needs micro_batches divisible by the pipeline size: "
            f"{m_total} % {p} = {m_total % p}; use a multiple of {p} micro-batches"
        )
    total = m_total * v

    def action(kind: ActionKind, k: int, r: int) -> Action:
        chunk = (k % (p * v)) // p
        if kind is _B:
            chunk = v - 1 - chunk
        return Action(kind, (k // (p * v)) * p + k % p, chunk * p + r)

    per_rank = []
    for r in range(p):
        warm = total if m_total == p else min(2 * (p - r - 1) + (v - 1) * p, total)
        acts = [action(_F, k, r) for k in range(warm)]
        for i in range(total - warm):
            acts += [action(_F, warm + i, r), action(_B, i, r)]
        acts += [action(_B, k, r) for k in range(total - warm, total)]
        per_rank.append(tuple(acts))
    return PipelineSchedule("interleaved-1f1b", p, m_total, p * v, tuple(per_rank))


@lru_cache(maxsize=64)
def _chimera_unit(p: int, n: int) -> tuple[tuple[tuple[ActionKind, int, int], ...], ...]:
    """Per-rank order of one Chimera basic unit of ``n`` micro-batches (see chimera_schedule).

    Non-delay list scheduling at unit times F=1, B=2: repeatedly start the action with the
    earliest possible start; ties on a rank go to backward first, then the higher stage, then
    the lower micro-batch. O(n * P * (P + n)) once per (P, n), cached.
    """
    half = n // 2

    def rank_of(m: int, s: int) -> int:
        return s if m < half else p - 1 - s

    ready: list[list[tuple[int, int, int, int, int]]] = [[] for _ in range(p)]
    for m in range(n):  # (ready_time, kind 0=B 1=F, -stage, mb, stage)
        ready[rank_of(m, 0)].append((0, 1, 0, m, 0))
    free = [0] * p
    order: list[list[tuple[ActionKind, int, int]]] = [[] for _ in range(p)]
    for _ in range(2 * p * n):
        best: tuple[int, int, tuple[int, int, int, int, int]] | None = None
        for r in range(p):
            if not ready[r]:
                continue
            start = max(free[r], min(c[0] for c in ready[r]))
            pick = min((c for c in ready[r] if c[0] <= start), key=lambda c: c[1:4])
            if best is None or start < best[0]:
                best = (start, r, pick)
        assert best is not None, "chimera unit generator ran dry"
        start, r, (_, kind_bit, _, m, s) = best
        ready[r].remove(best[2])
        kind = _F if kind_bit else _B
        end = start + (1 if kind is _F else 2)
        free[r] = end
        order[r].append((kind, m, s))
        if kind is _F and s + 1 < p:
            ready[rank_of(m, s + 1)].append((end, 1, -(s + 1), m, s + 1))
        elif kind is _F:
            ready[r].append((end, 0, -s, m, s))
        elif s > 0:
            ready[rank_of(m, s - 1)].append((end, 0, -(s - 1), m, s - 1))
    return tuple(tuple(o) for o in order)


def chimera_schedule(num_ranks: int, num_microbatches: int) -> PipelineSchedule:
    """Chimera (Li & Hoefler, SC'21): two model replicas in opposite directions.

    Rank ``i`` holds stage ``i`` of the *down* pipeline and stage ``P-1-i`` of the *up*
    pipeline. Micro-batches form units of ``P`` (the last unit may be smaller); in each unit
    the first half goes down and the second half up. Decisions, since the paper gives the
    schedule only as figures:

    * A unit's per-rank order comes from non-delay list scheduling at unit times F=1, B=2
      (the paper's assumption), ties to backward first, then the stage nearer the loss, then
      the lower micro-batch. It reproduces the paper's D-2 bubbles per worker; with
      balanced stages, no transfer and ``M == P`` its makespan is ``P*T_F + (2P-2)*T_B``,
      i.e. exactly Eq. (1) of the DynPipe seed, whenever ``T_B >= 2*T_F`` (tested for
      P = 2..16). For ``T_B < 2*T_F`` this fixed order is a few ``T_F`` slower than Eq. (1).
    * Units are concatenated per rank ("direct concatenation"); forward doubling and
      backward halving are not modelled.
    * An action costs its own stage's time, whichever rank runs it (the simulator takes
      Chimera's times per stage: :mod:`hetplan.cost_models.pipeline`); the gradient
      all-reduce of each stage over the ranks holding its two replicas' copies is outside
      the schedule (:mod:`hetplan.cost_models.evaluate` prices it after the pipeline).

    O(P^2 * M) plus a cached O(P^4) unit construction.

    Raises:
        PipelineScheduleError: ``P`` or ``M`` is odd (Chimera assumes even depth and splits
            micro-batches half/half between the directions).
    """
    check_sizes(num_ranks, num_microbatches)
    p, m_total = num_ranks, num_microbatches
    if p % 2 or m_total % 2:
        raise PipelineScheduleError(
            f"chimera needs an even number of ranks and of micro-batches, got P={p}, "
            f"M={m_total}; micro-batches are split half/half between the two directions"
        )
    per_rank: list[list[Action]] = [[] for _ in range(p)]
    for base in range(0, m_total, p):
        unit = _chimera_unit(p, min(p, m_total - base))
        for r in range(p):
            per_rank[r] += [Action(k, base + m, s) for k, m, s in unit[r]]
    return PipelineSchedule("chimera", p, m_total, p, tuple(tuple(a) for a in per_rank))


def build_schedule(
    name: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1
) -> PipelineSchedule:
    """Build a named schedule (one of :data:`SCHEDULES`). O(P * M * v).

    Raises:
        PipelineScheduleError: unknown name, or ``virtual_stages != 1`` for a schedule
            without chunks, or the generator's own size requirements.
    """
    if name == "interleaved-1f1b":
        return interleaved_1f1b_schedule(num_ranks, num_microbatches, virtual_stages)
    generators = {"gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule,
                  "chimera": chimera_schedule}
    if name not in generators:
        raise PipelineScheduleError(f"unknown pipeline schedule {name!r}; expected one of "
                                    f"{', '.join(SCHEDULES)}")
    if virtual_stages != 1:
        raise PipelineScheduleError(f"schedule {name!r} has one chunk per rank, got "
                                    f"virtual_stages={virtual_stages}; use 'interleaved-1f1b'")
    return generators[name](num_ranks, num_microbatches)


# --------------------------------------------------------------------------- the plan's lists


def layout_actions(layout: Layout) -> PipelineActions | None:
    """The plan section holding the action lists of ``layout``'s schedule (None: ``pp == 1``,
    no pipeline). What :func:`hetplan.compile` writes. O(P * M * v).

    Raises:
        PipelineScheduleError: the layout's schedule cannot be generated for its sizes.
    """
    if layout.pp == 1:
        return None
    sched = build_schedule(layout.schedule, layout.pp, layout.micro_batches,
                           layout.virtual_stages)
    return PipelineActions(schedule=layout.schedule, micro_batches=sched.num_microbatches,
                           num_stages=sched.num_stages, ranks=sched.encode())


def plan_schedule(layout: Layout, actions: PipelineActions | None) -> PipelineSchedule:
    """The schedule a plan runs: its ``pipeline_actions`` section decoded and checked, or, for
    a plan written before that section existed, the lists generated for its layout.

    Raises:
        PipelineScheduleError: malformed or incomplete lists, or ungeneratable sizes.
        PipelineDeadlockError: the plan's lists can never complete.
    """
    if actions is None:
        return build_schedule(layout.schedule, layout.pp, layout.micro_batches,
                              layout.virtual_stages)
    return decode_schedule(actions.schedule, actions.micro_batches, actions.num_stages,
                           actions.ranks)
