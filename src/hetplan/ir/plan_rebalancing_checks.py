"""Validator rules for the ``rebalancing`` events as the runtime runs them, in sequence.

The runtime (:class:`~hetplan.runtime.handlers.rebalancing.RebalancingHandler`) takes the
``applied`` events, sorts them by ``iteration`` (a stable sort: events of one iteration keep
their list order), and after the optimizer step of each event's iteration moves the
pipeline from the stages it holds to the event's ``stages``: the layers it sends are those
whose stage differs between the two assignments; it never reads ``migrations``. An event
that needs more stages than re-packing left is skipped, with a warning, and changes
nothing. Replaying that sequence from the plan's stages, two edits run otherwise than the
plan says, and are refused:

- **two applied events at one iteration**: both run after that iteration's step, so the
  layers move twice and no iteration trains on the first event's stages, which the plan
  (and ``inspect``) shows as applied with its predicted time;
- **migrations that disagree with the stages**: an applied event's ``migrations`` (when it
  lists any: the section is declarative, and a hand-written event may leave them out) must
  be exactly the layers the runtime moves, from the stages it holds before the event.

Accepted, because the runtime reads them the same way the plan does: events listed out of
iteration order (it sorts them; reordering an event past another changes the stages it
moves from, which the migration rule then names), events at or past
``total_iterations`` (the run's length is ``hetplan run --steps``; ``total_iterations`` is
the horizon of the predicted speedup), and anything on an event that is not applied
(nothing runs from it). The rules apply where the runtime executes events: a pipeline of
one stage per rank.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from hetplan.ir.rebalancing import Rebalancing, stage_changes

__all__ = ["applied_event_problems"]

_FIX = "re-run `hetplan plan --dynamics FILE` (the file the plan was made with)"

Bounds = Sequence[tuple[int, int]]


def applied_event_problems(reb: Rebalancing, initial: Bounds) -> list[str]:
    """Problems of ``reb``'s applied events, replayed as the runtime runs them from the
    plan's stages ``initial`` (see the module docstring); one line each."""
    order = sorted((i for i, e in enumerate(reb.events) if e.applied),
                   key=lambda i: reb.events[i].iteration)
    held, prev = tuple(initial), -1  # prev: the last event the runtime runs (-1: none yet)
    out: list[str] = []
    for i in order:
        ev, where = reb.events[i], f"rebalancing.events[{i}]"
        if len(ev.stages) > len(held):
            continue  # skipped by the runtime, with a warning: it holds the stages it had
        if prev >= 0 and reb.events[prev].iteration == ev.iteration:
            out.append(f"{where}.iteration: {ev.iteration}, the iteration of events[{prev}], "
                       f"also applied: the runtime moves the layers twice after that "
                       f"iteration's step, and no iteration trains on events[{prev}]'s "
                       f"stages {_ranges(reb.events[prev].stages)}; one applied event per "
                       f"iteration; {_FIX}")
        made = stage_changes(held, ev.stages)
        listed = [(m.layer, m.src_stage, m.dst_stage) for m in ev.migrations]
        if listed and Counter(listed) != Counter(made):
            came = ("the plan's stages" if prev < 0 else
                    f"events[{prev}]'s (iteration {reb.events[prev].iteration})")
            extra, missing = Counter(listed) - Counter(made), Counter(made) - Counter(listed)
            out.append(f"{where}.migrations: lists {_moves(extra.elements())}, leaves out "
                       f"{_moves(missing.elements())}: moving from "
                       f"{came} {_ranges(held)} to {_ranges(ev.stages)}, the runtime sends "
                       f"{_moves(made)} (applied events run in iteration order; the moves "
                       f"come from the stage ranges, never from this list); {_FIX}")
        held, prev = tuple(ev.stages), i
    return out


def _ranges(bounds: Bounds) -> str:
    return "[" + ", ".join(f"{a}-{b}" for a, b in bounds) + "]"


def _moves(moves: Iterable[tuple[int, int, int]], limit: int = 6) -> str:
    """``layer L stage s->d`` per move, layer order, cut after ``limit``; ``nothing``."""
    seq = sorted(moves)
    if not seq:
        return "nothing"
    text = ", ".join(f"layer {k} stage {s}->{d}" for k, s, d in seq[:limit])
    return text + (f", ... ({len(seq)} in all)" if len(seq) > limit else "")
