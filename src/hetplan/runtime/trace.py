"""A per-action trace of one training step, written in Chrome's trace-event format.

``hetplan run PLAN --trace trace.json`` records, on every rank, what the runtime executed
during one chosen step (by default the last) with its start and end on the host's clock
(``time.perf_counter``: one monotonic clock shared by every process of a host):

* ``phase``: the step's phases as the runtime runs them: the micro-batches, every handler's
  after-backward work (``after_backward GradSyncHandler`` is the wait for the data-parallel
  gradient sync), every handler's work after the sync (``after_sync StagesHandler`` the
  sum of tied gradients; ``after_backward StagesHandler`` under ZeRO-2), and the
  optimizer step with ``zero_grad`` up to the step's end (the loss read);
* ``action``: with a pipeline, every action of the rank's lowered schedule, in the order it
  ran: the plan's forwards and backwards and the sends and receives torch's schedule runtime
  adds between them (``SEND_F``, ``RECV_B`` ...). An action lasts until the next one begins;
  the last one until the schedule returns (so it includes the wait for the step's
  outstanding sends);
* ``compute``: inside an action (or, without a pipeline, per micro-batch), the stage's
  forward or backward of one micro-batch and chunk;
* ``wait``: inside a forward or backward, the wait for the activation or gradient the
  action receives (posted earlier by its ``RECV`` action);
* ``loss``: on the last stage, the loss of a micro-batch (computed after the stage's
  forward, outside it);
* ``sync``: the data-parallel gradient sync's pieces (:func:`mark_grad_sync`): each bucket's
  launch from its gradient hook and, for paths run on the sync's worker thread (compressed,
  cast or hierarchical ones), every step of the path (compress, a collective, decompress) on
  that thread's own track.

Tracing is off unless asked for: without ``--trace`` nothing of this module is installed
and no action is timed beyond what the run report already measures.

The file (:func:`chrome_trace`) is a JSON object with ``traceEvents`` (complete events
``ph: "X"`` in microseconds, one process per rank named with its pipeline, data- and
tensor-parallel coordinates and host; metadata events ``ph: "M"``) that Perfetto and
``chrome://tracing`` open, and ``otherData.hetplan`` (the plan's digest, the step, the time
origin per host). Times start at the earliest micro-batch phase of the ranks of each host:
ranks of different hosts are on different clocks and are not aligned.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CATEGORIES", "MAIN_TID", "SYNC_TID", "Span", "StepTrace", "chrome_trace",
           "mark_grad_sync"]

#: Span categories, outermost first (how Perfetto nests them on a rank's track).
CATEGORIES: tuple[str, ...] = ("phase", "action", "compute", "wait", "loss", "sync")
#: Trace-event thread ids: the rank's main thread, and the gradient sync's worker thread.
MAIN_TID, SYNC_TID = 0, 1


@dataclass(frozen=True)
class Span:
    """One timed piece of the step (seconds on the host's ``perf_counter``).

    Attributes:
        name: what ran (``F1 s0``, ``RECV_B0 s1``, ``after_backward GradSyncHandler``).
        cat: one of :data:`CATEGORIES`.
        start_s / end_s: the interval.
        args: what it is, for tools (``kind``, ``microbatch``, ``stage``, ``index``).
        tid: the thread it ran on (:data:`MAIN_TID` or :data:`SYNC_TID`).
    """

    name: str
    cat: str
    start_s: float
    end_s: float
    args: Mapping[str, Any] = field(default_factory=dict)
    tid: int = MAIN_TID


class StepTrace:
    """The spans one rank records during the step being traced.

    The runtime's marks call :meth:`add` (or :meth:`span`), which records only between
    :meth:`start` and :meth:`stop`; every other step costs them one attribute read.

    Args:
        rank: the global rank.
        coords: its ``(dp, pp, tp)`` coordinates.
        host: the host's name (spans of one host share a clock).
    """

    def __init__(self, rank: int, coords: tuple[int, int, int], host: str) -> None:
        self.rank = rank
        self.coords = coords
        self.host = host
        self.recording = False
        self.step: int | None = None
        self.spans: list[Span] = []

    def start(self, step: int) -> None:
        """Record from now on, for step ``step`` (forgets an earlier recording)."""
        self.recording, self.step, self.spans = True, step, []

    def stop(self) -> None:
        """Stop recording (the spans stay)."""
        self.recording = False

    def add(self, name: str, cat: str, start_s: float, end_s: float, *, tid: int = MAIN_TID,
            **args: Any) -> None:
        """One span, when recording (``list.append``: safe from the sync's thread too)."""
        if self.recording:
            self.spans.append(Span(name, cat, start_s, end_s, args, tid))

    @contextmanager
    def span(self, name: str, cat: str, **args: Any) -> Iterator[None]:
        """Times the block as one span (when recording)."""
        if not self.recording:
            yield
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, cat, t0, time.perf_counter(), **args)

    def to_dict(self) -> dict[str, Any]:
        """This rank's recording as plain data (to gather it on rank 0)."""
        return {"rank": self.rank, "coords": list(self.coords), "host": self.host,
                "step": self.step,
                "spans": [[s.name, s.cat, s.start_s, s.end_s, dict(s.args), s.tid]
                          for s in self.spans]}


def chrome_trace(ranks: Sequence[Mapping[str, Any]], meta: Mapping[str, Any]) -> dict[str, Any]:
    """Every rank's recording (:meth:`StepTrace.to_dict`) as one Chrome trace-event object.

    Args:
        ranks: the ranks' recordings, any order.
        meta: what to keep under ``otherData.hetplan`` (plan digest, step ...).

    Returns:
        ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {"hetplan": ...}}``;
        events sorted by (rank, start, outermost first), times in microseconds from the
        earliest ``phase`` span of the rank's host (its earliest span without one).
    """
    origin: dict[str, float] = {}
    for r in ranks:
        starts = [s[2] for s in r["spans"] if s[1] == "phase"] or [s[2] for s in r["spans"]]
        if starts:
            host = str(r["host"])
            origin[host] = min(origin.get(host, starts[0]), *starts)
    depth = {c: i for i, c in enumerate(CATEGORIES)}
    events: list[dict[str, Any]] = []
    for r in sorted(ranks, key=lambda x: int(x["rank"])):
        rank, (d, p, t) = int(r["rank"]), r["coords"]
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank} (pp {p}, dp {d}, tp {t}) on {r['host']}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"sort_index": rank}})
        tids = sorted({s[5] if len(s) > 5 else MAIN_TID for s in r["spans"]} | {MAIN_TID})
        for tid in tids:
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                           "args": {"name": "gradient sync thread" if tid == SYNC_TID
                                    else "main"}})
        t0 = origin.get(str(r["host"]), 0.0)
        spans = sorted(r["spans"], key=lambda s: (s[2], depth.get(s[1], 99), -s[3]))
        for name, cat, start, end, args, *rest in spans:
            tid = rest[0] if rest else MAIN_TID
            events.append({"name": name, "cat": cat, "ph": "X", "pid": rank, "tid": tid,
                           "ts": round((start - t0) * 1e6, 3),
                           "dur": round(max(end - start, 0.0) * 1e6, 3),
                           "args": dict(args)})
    other = {**meta, "time_origin_by_host_s": dict(sorted(origin.items())),
             "clock": "time.perf_counter per host; microseconds from the host's origin"}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"hetplan": other}}


def mark_grad_sync(sync: Any, trace: StepTrace) -> None:
    """``sync`` sync spans in ``trace`` (a :class:`~hetplan.runtime.grad_sync.GradSync`;
    marked from outside: its methods are wrapped on the instance): each bucket's launch
    (``launch bucket k``, on the main thread: in the gradient hook that found it complete,
    in a pipeline when its stage's last backward ended (NCCL), or in ``finish`` for the
    rest, such as the last bucket of the fast path, which gets no hooks)
    and, for paths on the worker thread, each step of :class:`~hetplan.runtime.routines.
    PathRunner` (``comp``, ``decomp``, ``comm ROUTINE at LEVEL``) on :data:`SYNC_TID`. The
    wait for them after backward is the ``after_backward GradSyncHandler`` phase."""
    launch = sync._launch

    def timed_launch(b: Any) -> Any:
        if not trace.recording:
            return launch(b)
        t0 = time.perf_counter()
        try:
            return launch(b)
        finally:
            k = sync.buckets.index(b)
            trace.add(f"launch bucket {k}", "sync", t0, time.perf_counter(), bucket=k,
                      tensors=len(b.params))

    sync._launch = timed_launch
    runner = getattr(sync, "_runner", None)
    if runner is None:
        return
    for attr in ("_comp", "_decomp", "_comm_compressed", "_comm_dense"):
        fn = getattr(runner, attr)

        def timed(*args: Any, _fn: Any = fn, _attr: str = attr, **kwargs: Any) -> Any:
            if not trace.recording:
                return _fn(*args, **kwargs)
            step = next((a for a in args if hasattr(a, "kind") and hasattr(a, "level")), None)
            what = _attr.strip("_").replace("_", " ")
            if step is not None and getattr(step, "routine", None):
                what += f" {step.routine} at {step.level}"
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                trace.add(what, "sync", t0, time.perf_counter(), tid=SYNC_TID)

        setattr(runner, attr, timed)
