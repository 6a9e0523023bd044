"""A run's per-action trace next to the simulator's timeline of the same plan.

``hetplan inspect PLAN --trace trace.json`` reads the trace ``hetplan run --trace`` wrote
(:mod:`hetplan.runtime.trace`) and re-evaluates the plan exactly as ``hetplan simulate`` and
``hetplan timeline`` do (:func:`hetplan.report.timeline._evaluate_plan`: its cluster, cost
settings and, with ``--profile``, the profile it was made with; with per-stage degrees,
``evaluate_hetero``, each rank compared with its own stage's timeline). Per rank it lists every
forward and backward the rank computed, predicted (start and duration on the simulated
pipeline) beside measured (start from the host's origin, duration of the stage's compute,
the wait for what the action received, the loss computed after the last stage's forward),
and where the measured time of the micro-batch phase went: compute, waits for activations
(``F``) and for gradients (``B``), the loss, and the rest (posting sends and receives,
the schedule's own work, the wait for outstanding sends at the end). The predicted forward
of the last stage includes its loss, as the profile's layer records do.

Predicted times are from the start of the simulated iteration; measured ones from the
earliest micro-batch phase of the ranks of the host (every rank of one host shares its
clock), so both show where a rank waits for another.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any

from hetplan.errors import SpecError

__all__ = ["compare_trace", "load_trace"]


def _natural(name: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key that orders numbers by value: 'launch bucket 2' before 'launch bucket 10'."""
    return tuple((0, int(part)) if part.isdigit() else (1, part)
                 for part in re.split(r"(\d+)", name) if part)


def load_trace(data: Any, path: str = "trace") -> dict[str, Any]:
    """Checks that ``data`` is a trace of ``hetplan run --trace``; returns it.

    Raises:
        SpecError: not a Chrome trace-event object of hetplan's (names the field).
    """
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise SpecError(f"{path}: not a trace-event file (no traceEvents list); write one with "
                        "`hetplan run PLAN --trace FILE`")
    other = data.get("otherData")
    meta = other.get("hetplan") if isinstance(other, dict) else None
    if not isinstance(meta, dict):
        raise SpecError(f"{path}: otherData.hetplan is missing: not a trace of `hetplan run "
                        "--trace`")
    for i, e in enumerate(data["traceEvents"]):
        if not isinstance(e, dict) or e.get("ph") not in ("X", "M"):
            raise SpecError(f"{path}: traceEvents[{i}]: expected a complete (ph 'X') or "
                            f"metadata (ph 'M') event, got {e!r:.80}")
        if e["ph"] == "X":
            _check_event(e, f"{path}: traceEvents[{i}]")
    return data


def _check_event(e: dict[str, Any], where: str) -> None:
    """A complete event as :func:`hetplan.runtime.trace.chrome_trace` writes it: what
    :func:`compare_trace` reads of it, each field named where it is missing or of a wrong
    type (an edited or foreign trace was an internal error: ``KeyError: 'pid'``)."""
    fix = "write the trace again with `hetplan run PLAN --trace FILE`"
    if not all(_number(e.get(k)) and e[k] >= 0 for k in ("ts", "dur")):
        raise SpecError(f"{where}: ts and dur must be microseconds >= 0")
    for key, kind, expected in (("pid", int, "the rank (an integer >= 0)"),
                                ("name", str, "a string"), ("cat", str, "a string"),
                                ("args", dict, "a mapping")):
        value = e.get(key)
        if not isinstance(value, kind) or isinstance(value, bool) or (
                isinstance(value, int) and value < 0):
            raise SpecError(f"{where}.{key}: expected {expected}, got {value!r:.40}; {fix}")
    if e["cat"] == "compute":
        for key in ("kind", "microbatch", "stage"):
            value = e["args"].get(key)
            if not (isinstance(value, str) if key == "kind" else
                    isinstance(value, int) and not isinstance(value, bool)):
                raise SpecError(f"{where}.args.{key}: expected "
                                f"{'a string' if key == 'kind' else 'an integer'} in a compute "
                                f"event, got {value!r:.40}; {fix}")


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def plan_digest(plan: Any) -> str:
    """The digest the runtime's ranks agree on (``hetplan.runtime.groups.plan_digest``,
    repeated here so that ``inspect`` does not import torch.distributed)."""
    return hashlib.sha256(plan.to_json().encode()).hexdigest()[:16]


def _meta_of(plan: Any) -> dict[str, Any]:
    lay = plan.layout
    return {"plan_digest": plan_digest(plan), "model": plan.model.name,
            "layout": {"dp": lay.dp, "pp": lay.pp, "tp": lay.tp} if lay is not None else {}}


def _describe(meta: Mapping[str, Any]) -> str:
    """``digest d6af34570a1a1cd6, gpt-test, dp=2 pp=2 tp=1`` (what a trace says it ran)."""
    given = meta.get("layout")
    lay: Mapping[str, Any] = given if isinstance(given, dict) else {}
    degrees = " ".join(f"{k}={lay[k]}" for k in ("dp", "pp", "tp") if k in lay)
    return ", ".join(str(x) for x in (f"digest {meta.get('plan_digest')}", meta.get("model"),
                                      degrees) if x)


def _r(x: float) -> float:
    return round(x, 3)


def compare_trace(plan: Any, trace: Mapping[str, Any], *, cluster: Any = None,
                  profile: Any = None, source: str = "the trace",
                  plan_source: str = "this plan") -> dict[str, Any]:
    """Predicted and measured, per rank and per forward/backward (see module doc).

    Args:
        plan: the plan that ran.
        trace: the trace (:func:`load_trace`).
        cluster / profile: as for ``hetplan simulate`` (the plan's own cluster by default).
        source / plan_source: the trace's and the plan's files, for messages.

    Returns:
        ``{"step", "predicted_iteration_ms", "ranks": [...]}``; each rank: ``rank``,
        ``pp_rank``, ``predicted`` (busy and idle ms of its pipeline rank, exposed sync,
        optimizer), ``measured`` (when the rank's micro-batch phase began after the host's
        earliest one, the phase split into compute, waits, loss and the rest; after-backward
        and optimizer phases, the gradient sync's pieces by name), ``actions`` (rows in
        executed order).

    Raises:
        SpecError: the trace is of another plan (its digest differs) or has no rank.
    """
    from hetplan.report.timeline import _evaluate_plan

    meta = trace["otherData"]["hetplan"]
    if meta.get("plan_digest") not in (None, plan_digest(plan)):
        raise SpecError(f"{source}: recorded for another plan ({_describe(meta)}), not "
                        f"{plan_source} ({_describe(_meta_of(plan))}): give the plan file the "
                        "run was made with")
    ev, _, _, _ = _evaluate_plan(plan, cluster, profile)
    predicted: dict[tuple[int, str, int, int], tuple[float, float]] = {}
    for e in ev.pipeline.events:
        predicted[(e.rank, e.kind.value, e.microbatch, e.stage)] = (e.start_ms, e.end_ms)
    by_rank: dict[int, list[dict[str, Any]]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            by_rank.setdefault(int(e["pid"]), []).append(e)
    if not by_rank:
        raise SpecError(f"{source}: the trace holds no events: was the traced step run?")
    rows = []
    for rank in sorted(by_rank):
        p = _pipeline_rank(plan, rank, source)
        stage_cost = ev.stages[p] if p < len(ev.stages) else None
        rows.append(_rank_rows(rank, p, by_rank[rank], predicted, ev, stage_cost))
    return {"step": meta.get("step"), "predicted_iteration_ms": _r(ev.iteration_s * 1e3),
            "ranks": rows}


def _pipeline_rank(plan: Any, rank: int, source: str) -> int:
    """``rank``'s pipeline position: its coordinate in the layout, or, with per-stage degrees,
    the stage whose ranks hold it (every rank of a stage runs the stage's action list).

    Raises:
        SpecError: a rank no stage of a plan with per-stage degrees holds.
    """
    layout = plan.layout
    if plan.hetero is None:
        return layout.coords(rank)[1] if layout is not None else 0
    for st in plan.stages:
        if rank in st.ranks:
            return int(st.index)
    raise SpecError(f"{source}: rank {rank} has events, but no stage of the plan holds it "
                    f"(stages[*].ranks: {[list(st.ranks) for st in plan.stages]}): give the "
                    "plan file the run was made with")


def _rank_rows(rank: int, p: int, events: list[dict[str, Any]],
               predicted: Mapping[tuple[int, str, int, int], tuple[float, float]],
               ev: Any, stage_cost: Any) -> dict[str, Any]:
    """One rank's comparison (see :func:`compare_trace`)."""
    ms = {id(e): (e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3) for e in events}

    def total(cat: str, kind: str | None = None) -> float:
        return sum(e["dur"] for e in events if e["cat"] == cat and (
            kind is None or e["args"].get("kind") == kind)) / 1e3

    phases = {e["name"]: e["dur"] / 1e3 for e in events if e["cat"] == "phase"}
    mb_phase = phases.get("micro-batches", 0.0)
    mb_start = next((e["ts"] / 1e3 for e in events if e["name"] == "micro-batches"), 0.0)
    waits = {k: total("wait", k) for k in ("F", "B")}
    compute, loss = total("compute"), total("loss")
    inside = [e for e in events if e["cat"] in ("wait", "loss")]
    actions = []
    for e in events:
        if e["cat"] != "compute":
            continue
        a = e["args"]
        key = (p, a["kind"], a["microbatch"], a["stage"])
        pred = predicted.get(key)
        enclosing = next((x for x in events if x["cat"] == "action"
                          and x["args"].get("kind") == a["kind"]
                          and x["args"].get("microbatch") == a["microbatch"]
                          and x["args"].get("stage") == a["stage"]), None)
        lo, hi = ms[id(enclosing)] if enclosing is not None else ms[id(e)]
        within = [x for x in inside if lo - 1e-6 <= ms[id(x)][0] and ms[id(x)][1] <= hi + 1e-6
                  and x["args"].get("microbatch") == a["microbatch"]]
        actions.append({
            "action": e["name"],
            "predicted_start_ms": _r(pred[0]) if pred else None,
            "predicted_ms": _r(pred[1] - pred[0]) if pred else None,
            "measured_start_ms": _r(ms[id(e)][0]),
            "measured_ms": _r(e["dur"] / 1e3),
            "wait_ms": _r(sum(x["dur"] for x in within if x["cat"] == "wait") / 1e3),
            "loss_ms": _r(sum(x["dur"] for x in within if x["cat"] == "loss") / 1e3),
        })
    pipe = ev.pipeline
    pred_part = {
        "pipeline_iteration_ms": _r(pipe.iteration_ms),
        "busy_ms": _r(pipe.busy_ms[p]) if p < len(pipe.busy_ms) else None,
        "idle_ms": _r(pipe.idle_ms[p]) if p < len(pipe.idle_ms) else None,
        "exposed_sync_ms": _r(stage_cost.exposed_sync_s * 1e3) if stage_cost else None,
        "optimizer_ms": _r(ev.optimizer_s * 1e3),
    }
    meas_part: dict[str, Any] = {
        "micro_batches_start_ms": _r(mb_start),
        "micro_batches_ms": _r(mb_phase),
        "compute_ms": _r(compute),
        "wait_for_activations_ms": _r(waits["F"]),
        "wait_for_gradients_ms": _r(waits["B"]),
        "loss_ms": _r(loss),
        "other_ms": _r(mb_phase - compute - waits["F"] - waits["B"] - loss),
        "after_backward_ms": {k.removeprefix("after_backward "): _r(v)
                              for k, v in phases.items() if k.startswith("after_backward")},
        "after_sync_ms": {k.removeprefix("after_sync "): _r(v)
                          for k, v in phases.items() if k.startswith("after_sync")},
        "optimizer_ms": _r(phases.get("optimizer step", 0.0)),
    }
    sync: dict[str, float] = {}
    for e in events:  # the gradient sync's launches and worker-thread steps, summed by name
        if e["cat"] == "sync":
            sync[e["name"]] = sync.get(e["name"], 0.0) + e["dur"] / 1e3
    meas_part["sync_ms"] = {k: _r(v) for k, v in sorted(sync.items(),
                                                        key=lambda kv: _natural(kv[0]))}
    return {"rank": rank, "pp_rank": p, "predicted": pred_part, "measured": meas_part,
            "actions": actions}
