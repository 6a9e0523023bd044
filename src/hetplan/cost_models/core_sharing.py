"""How much of each pipeline stage's compute the other stages' compute overlaps, for a host
whose processes share fewer cores than they are (the CPU presets' machine: 4 gloo processes
on 2 cores).

A gloo profile times a tensor-parallel step two ways (:mod:`hetplan.profiling.tp_step`):
with every process of the node stepping at once (``tp_*``) and with one TP group alone
(``tp_alone_*``). A pipeline's TP stage is between the two: while the other stages wait for
a hand-over they leave the cores to it, while they compute they take their share. On this
machine the step is 1.2-2.4x slower with the other group stepping (``bench/tp_contention.py``,
``docs/decisions/cpu-fidelity.md`` sections 25-26).

:func:`stage_overlaps` reads the simulated schedule: for each stage, over the time its
forward (backward) actions run, the mean of ``(B - tp) / (N - tp)`` clamped to ``[0, 1]``,
where ``B`` is the processes of the stage's node computing at that moment (its own and every
other busy pipeline rank's) and ``N`` the plan's processes on that node. 0 means it ran
alone (the ``tp_alone_*`` record's situation), 1 with every process busy (the ``tp_*``
record's). :func:`hetplan.cost_models.evaluate.evaluate` prices the stage between the two
records by it and simulates again, to a fixed point.

Only compute is counted busy: the CPU a rank spends handing messages over is in neither
record's difference (section 18's caution), so this can under-price a stage whose
neighbours spend much of their wait working. Deterministic and free of torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from hetplan.cost_models.pipeline import ActionKind, PipelineSimResult, TimedEvent

__all__ = ["stage_overlaps"]


def stage_overlaps(pipe: PipelineSimResult, rank_procs: Sequence[Sequence[int]],
                   own: Sequence[int], total: Sequence[int], tp: int, n_stages: int
                   ) -> list[tuple[float, float]]:
    """Per stage, the (forward, backward) overlap share of the module docstring.

    Args:
        pipe: the simulated iteration (its ``events``: each action's pipeline rank, stage,
            kind and span).
        rank_procs: per pipeline rank, its processes on each node (``rank_procs[r][n]``).
        own: per stage, the node its first rank is on.
        total: per node, the plan's processes on it.
        tp: the TP size (the alone record's processes).
        n_stages: stages in the plan (the events' stage indices).

    A stage without actions of a kind gets 1 for it (as if everything computed at once).

    Example: GPipe over two micro-batches on two pipeline ranks of two processes each, on a
    node of four: each stage's forwards and backwards overlap the other stage's half the
    time.

        >>> from hetplan.cost_models.pipeline import simulate_pipeline
        >>> pipe = simulate_pipeline([5.0, 5.0], [5.0, 5.0], 2, "gpipe")
        >>> stage_overlaps(pipe, [[2], [2]], [0, 0], [4], 2, 2)
        [(0.5, 0.5), (0.5, 0.5)]
    """
    events = sorted(pipe.events, key=lambda e: (e.start_ms, e.rank))
    points = sorted({e.start_ms for e in events} | {e.end_ms for e in events})
    acc = [[0.0, 0.0, 0.0, 0.0] for _ in range(n_stages)]  # f weighted, f span, b ..., b ...
    active: list[TimedEvent] = []
    nxt = 0
    for lo, hi in zip(points, points[1:]):
        active = [e for e in active if e.end_ms > lo]
        while nxt < len(events) and events[nxt].start_ms <= lo:
            if events[nxt].end_ms > lo:
                active.append(events[nxt])
            nxt += 1
        dt = hi - lo
        if dt <= 0 or not active:
            continue
        ranks = {e.rank for e in active}
        for e in active:
            node = own[e.stage]
            busy = sum(rank_procs[r][node] for r in ranks)
            span = total[node] - tp
            w = min(max((busy - tp) / span, 0.0), 1.0) if span > 0 else 1.0
            k = 0 if e.kind == ActionKind.F else 2
            acc[e.stage][k] += w * dt
            acc[e.stage][k + 1] += dt
    return [(a[0] / a[1] if a[1] > 0 else 1.0, a[2] / a[3] if a[3] > 0 else 1.0)
            for a in acc]
