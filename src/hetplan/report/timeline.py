"""Draw a plan's simulated iteration as a timeline (PNG via matplotlib, HTML via plotly).

The plan is re-evaluated exactly as :func:`hetplan.simulate` does (its workload summary,
embedded cluster and cost settings) with ``record=True``, and the recorded events become bars.
A plan with per-stage degrees (``hetero``) is evaluated by
:func:`~hetplan.cost_models.hetero.evaluate_hetero`, as ``simulate`` does: each stage with its
own times, resharding links and DP group; its rows name each stage's ranks and degrees.

* one row per pipeline stage: forward and backward of every micro-batch (labelled with the
  micro-batch number; gaps are pipeline bubbles), then the optimizer step; every rank of the
  stage runs these (the model prices the ranks of a stage alike);
* under each stage, the data-parallel sync of its **last micro-batch's backward**: the GPU
  stream (backprop and GPU (de)compression / casts), the CPU lane (CPU compression) and one
  lane per communication channel (``net`` = flat, ``intra``-node, ``inter``-node). The DP
  timeline is relative to that backward; it is shifted to ``last backward end - backward
  time`` (the start of the last backward for non-interleaved schedules), which is where
  :func:`~hetplan.cost_models.evaluate.evaluate` puts it;
* a ``predicted`` bar of the whole iteration and, with a run report, a ``measured`` one.

:func:`timeline_segments` computes the bars without plotting; :func:`render_timeline` draws
them. Plotting libraries are imported only when drawing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hetplan.errors import SpecError
from hetplan.ir.validation import check_output_path
from hetplan.report._text import ranges

__all__ = ["SUFFIXES", "Segment", "check_output", "render_timeline", "timeline_segments"]

#: File suffixes :func:`render_timeline` writes (PNG via matplotlib, HTML via plotly).
SUFFIXES: tuple[str, ...] = (".png", ".html", ".htm")

_CHANNELS = {"gpu": "GPU stream", "cpu": "CPU", "net": "network (flat)",
             "intra": "intra-node", "inter": "inter-node"}
#: kind -> (legend name, colour), in legend order.
_STYLE: dict[str, tuple[str, str]] = {
    "F": ("forward", "#4C72B0"),
    "B": ("backward", "#DD8452"),
    "backprop": ("backprop (last micro-batch)", "#F3BE96"),
    "cast": ("cast fp16/bf16", "#937860"),
    "compress": ("compress", "#8172B3"),
    "decompress": ("decompress", "#DA8BC3"),
    "allreduce": ("allreduce", "#55A868"),
    "reduce_scatter": ("reduce-scatter", "#8EBA42"),
    "allgather": ("allgather", "#2A9D8F"),
    "reduce": ("reduce", "#64B5CD"),
    "broadcast": ("broadcast", "#C44E52"),
    "alltoall": ("all-to-all", "#CCB974"),
    "gather": ("gather", "#B07AA1"),
    "sync-wait": ("waiting for gradient sync", "#E4E4E4"),
    "optimizer": ("optimizer step", "#8C8C8C"),
    "predicted": ("predicted iteration", "#3A3A3A"),
    "measured": ("measured iteration", "#C0392B"),
}
_OTHER = ("other", "#BBBBBB")


@dataclass(frozen=True)
class Segment:
    """One drawn bar of the timeline (times in ms from the start of the iteration).

    Attributes:
        lane: the row it is drawn on (``"stage 0"``, ``"stage 0 · GPU stream"``,
            ``"stage 0 · inter-node"``, ``"predicted"``, ``"measured"``).
        kind: what it is: ``F``/``B`` (pipeline), ``backprop``, ``compress``, ``decompress``,
            ``cast``, a collective (``allreduce``, ``allgather`` ...), ``optimizer``,
            ``predicted`` or ``measured``.
        start_ms / end_ms: the interval.
        label: text drawn on the bar when it fits ("" for none).
        stage: the pipeline stage (-1 for the whole-iteration bars).
        microbatch: the micro-batch of a forward/backward, else None.
        detail: a longer description (hover text in HTML).
    """

    lane: str
    kind: str
    start_ms: float
    end_ms: float
    label: str = ""
    stage: int = -1
    microbatch: int | None = None
    detail: str = ""

    @property
    def duration_ms(self) -> float:
        """Length of the bar."""
        return self.end_ms - self.start_ms


@dataclass(frozen=True)
class _Timeline:
    segments: list[Segment]
    lanes: list[str]
    title: str
    subtitle: str
    iteration_ms: float


def check_output(path: str | Path, *, option: str = "path") -> str:
    """Refuse, before anything is simulated, a timeline file that cannot be written: an
    unknown suffix, or a directory that does not exist (it is never created) or is not
    writable. Returns the suffix (lower case).

    Raises:
        SpecError: naming ``option`` and the path.
    """
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in SUFFIXES:
        raise SpecError(
            f"{option} {str(p)!r}: cannot draw a timeline to it: unknown suffix "
            f"{p.suffix!r}; use {' or '.join(SUFFIXES)} (PNG image or self-contained "
            "interactive HTML)"
        )
    check_output_path(p, option=option)
    return suffix


def render_timeline(
    plan: Any,
    path: str | Path,
    *,
    cluster: Any = None,
    profile: Any = None,
    run_report: Mapping[str, Any] | None = None,
) -> Path:
    """Draw the simulated iteration of ``plan`` to ``path`` (``.png`` or ``.html``).

    Args:
        plan: a :class:`~hetplan.ir.plan.Plan` with a workload summary.
        path: output file; the suffix picks the format (``.png``: 1600 px wide image;
            ``.html``/``.htm``: interactive plotly page with the JS inlined, works offline).
        cluster: the cluster (spec, preset name or file) if the plan does not embed it.
        profile: a profile DB (or its path) with measured costs, as for ``simulate``.
        run_report: measured times of a run (``{"iteration_ms": ..., "compute_ms": ...}``,
            or the runtime's report with a ``"measured"`` section): adds a measured bar.

    Returns:
        The path written.

    Raises:
        SpecError: unknown suffix, a directory that does not exist (it is not created) or
            is not writable, a plan that cannot be simulated, a bad run report, or a missing
            plotting library.
        PlanMismatchError: ``cluster`` is not the cluster the plan was made for.
    """
    out = Path(path)
    suffix = check_output(out)
    tl = _build(plan, cluster, profile, run_report)
    if suffix == ".png":
        _draw_png(tl, out)
    else:
        _draw_html(tl, out)
    return out


def timeline_segments(
    plan: Any,
    *,
    cluster: Any = None,
    profile: Any = None,
    run_report: Mapping[str, Any] | None = None,
) -> list[Segment]:
    """The bars :func:`render_timeline` draws, lane by lane in drawing order (no plotting).

    Tiny adjacent DP ops of one kind (under 1/1000 of the iteration) are merged into one bar
    and consecutive backprop segments into one; pipeline forward/backward bars never are.
    Arguments as for :func:`render_timeline`.
    """
    return _build(plan, cluster, profile, run_report).segments


# --------------------------------------------------------------------------- evaluation
def _evaluate_plan(plan: Any, cluster: Any, profile: Any) -> tuple[Any, Any, Any, str]:
    """(Evaluation with recorded events, workload, stages, cluster name), with the cost
    settings and the model :func:`hetplan.simulate` uses (memory is not checked: the timeline
    draws time only). A plan with per-stage degrees gets
    :func:`~hetplan.cost_models.hetero.evaluate_hetero`'s evaluation, which has the same
    fields the timeline reads (its iteration time is ``simulate``'s, to the bit)."""
    from hetplan.cost_models.evaluate import evaluate
    from hetplan.cost_models.hetero import evaluate_hetero
    from hetplan.ir.plan_sections import Stage
    from hetplan.cost_models.predict import plan_costs

    workload, layout, costs = plan_costs(plan, cluster=cluster, profile=profile)
    spec = costs.cluster
    if plan.hetero is not None:
        hev = evaluate_hetero(workload, layout, plan.stages, plan.hetero, costs,
                              check_memory=False, gradient_sync=plan.gradient_sync,
                              actions=plan.pipeline_actions, record=True)
        return hev, workload, plan.stages, spec.name
    ev = evaluate(workload, layout, plan.stages, plan.gradient_sync, costs,
                  check_memory=False, record=True, tensor_parallel=plan.tensor_parallel,
                  sparse_sync=plan.sparse_sync, actions=plan.pipeline_actions)
    stages = plan.stages or (
        Stage(index=0, first_layer=0, last_layer=len(workload.layers) - 1,
              ranks=tuple(range(layout.num_ranks))),
    )
    return ev, workload, stages, spec.name


def _unit_details(plan: Any, workload: Any, stages: Any) -> list[list[str]]:
    """Per stage, a description of each sync unit, in the order the DP timeline numbers them."""
    from hetplan.cost_models.evaluate import _units_by_stage

    stage_of = [0] * len(workload.layers)
    for st in stages:
        for i in range(st.first_layer, st.last_layer + 1):
            stage_of[i] = st.index
    out = []
    for units in _units_by_stage(workload, plan.gradient_sync, stage_of, len(stages)):
        rows = []
        for idx, strategy in units:
            names = [workload.grads[i].name for i in idx]
            mib = sum(workload.grads[i].size_bytes for i in idx) / 2**20
            span = names[0] if len(names) == 1 else f"{names[0]} … {names[-1]}"
            rows.append(f"{len(names)} tensor(s), {mib:.2f} MiB, {_strategy(strategy)}: {span}")
        out.append(rows)
    return out


def _strategy(s: Any) -> str:
    path = "+".join(f"{st.level}:{st.routine}" for st in s.steps)
    if s.kind == "cast":
        return f"{s.dtype} ({path})"
    if s.kind == "compressed":
        params = ",".join(f"{k}={v}" for k, v in sorted(s.params.items()))
        return f"{s.compressor}[{params}] on {s.compress_device} ({path})"
    return f"fp32 ({path})"


# --------------------------------------------------------------------------- segments
def _build(plan: Any, cluster: Any, profile: Any, run_report: Any) -> _Timeline:
    measured = _measured(run_report)
    ev, workload, stages, cluster_name = _evaluate_plan(plan, cluster, profile)
    layout = plan.layout
    details = _unit_details(plan, workload, stages)
    iteration_ms = ev.iteration_s * 1e3
    interleaved = layout is not None and layout.virtual_stages > 1
    n = len(stages)
    names = _stage_lanes(plan, n)
    rows: list[list[Segment]] = [[] for _ in range(n)]
    last_end = [0.0] * n
    for e in sorted(ev.pipeline.events, key=lambda e: (e.rank, e.start_ms)):
        kind = e.kind.value
        mb = f"{e.microbatch}" + (f".{e.stage // n}" if interleaved else "")
        what = "forward" if kind == "F" else "backward"
        rows[e.rank].append(Segment(
            names[e.rank], kind, e.start_ms, e.end_ms, mb, e.rank, e.microbatch,
            f"stage {e.rank} {what}, micro-batch {mb}: {e.start_ms:.2f}–{e.end_ms:.2f} ms "
            f"({e.end_ms - e.start_ms:.2f} ms)"))
        if kind == "B":
            last_end[e.rank] = max(last_end[e.rank], e.end_ms)
    finish = []
    dp_lanes: list[list[Segment]] = []
    channels = _channels(plan)
    for s, (cost, tl) in enumerate(zip(ev.stages, ev.dp_timelines)):
        offset = last_end[s] - cost.bwd_s * 1e3
        finish.append(last_end[s] + max(cost.exposed_sync_s, 0.0) * 1e3)
        dp_lanes.append(_dp_segments(s, tl, offset, details[s], channels)
                        if tl is not None else [])
    span = max(iteration_ms, measured[0] if measured else 0.0) or 1.0
    segments: list[Segment] = []
    lanes: list[str] = []
    opt_start = max(finish, default=0.0)
    for s in range(n):
        if finish[s] - last_end[s] > 1e-9 * span:
            rows[s].append(Segment(
                names[s], "sync-wait", last_end[s], finish[s], "sync wait", s, None,
                f"stage {s} waits {finish[s] - last_end[s]:.2f} ms after its last backward "
                "for its gradient sync (exposed communication / compression)"))
        if ev.optimizer_s > 0:
            rows[s].append(Segment(names[s], "optimizer", opt_start, iteration_ms, "opt", s,
                                   None, f"optimizer step: {ev.optimizer_s * 1e3:.2f} ms"))
        lanes.append(names[s])
        segments += rows[s]
        merged = _merge(dp_lanes[s], span / 1000)
        order = {f"stage {s} · {c}": i for i, c in enumerate(channels.values())}
        for lane in sorted({x.lane for x in merged}, key=lambda x: (order.get(x, 99), x)):
            lanes.append(lane)
            segments += [x for x in merged if x.lane == lane]
    lanes.append("predicted")
    segments.append(Segment("predicted", "predicted", 0.0, iteration_ms,
                            f"predicted {iteration_ms:.1f} ms", -1, None,
                            _breakdown_text(ev)))
    if measured:
        total, parts = measured
        extra = ", ".join(f"{k.removesuffix('_ms').replace('_', ' ')} {v:.1f} ms"
                          for k, v in parts.items())
        lanes.append("measured")
        segments.append(Segment("measured", "measured", 0.0, total,
                                f"measured {total:.1f} ms", -1, None,
                                f"measured {total:.2f} ms/iteration" +
                                (f" ({extra})" if extra else "")))
    lay = f"dp={plan.cluster.world_size} (no layout)"
    if layout is not None and plan.hetero is not None:
        m, size = layout.micro_batches, layout.micro_batch_size
        lay = (f"per-stage degrees {plan.hetero.describe()}, {layout.schedule}, {m} "
               f"micro-batch{'es' if m > 1 else ''} of {size} sample{'s' if size > 1 else ''}")
    elif layout is not None:
        m, size = layout.micro_batches, layout.micro_batch_size
        lay = (f"dp={layout.dp} pp={layout.pp} tp={layout.tp}, {layout.schedule}, {m} "
               f"micro-batch{'es' if m > 1 else ''} of {size} sample{'s' if size > 1 else ''}")
    subtitle = (f"predicted {iteration_ms:.1f} ms/iteration · bubble {ev.bubble_ratio:.0%} · "
                f"exposed comm {ev.exposed_comm_s * 1e3:.1f} ms")
    if measured:
        subtitle += f" · measured {measured[0]:.1f} ms"
    return _Timeline(segments, lanes, f"{plan.model.name} on {cluster_name} — {lay}",
                     subtitle + " · DP lanes: sync of each stage's last backward",
                     iteration_ms)


def _stage_lanes(plan: Any, n: int) -> list[str]:
    """Each pipeline stage's row: ``stage K``; with per-stage degrees also its ranks, device
    class and dp x tp (``stage 1: ranks 1–4, cpu@slow 2x2``)."""
    if plan.hetero is None:
        return [f"stage {s}" for s in range(n)]
    return [f"stage {st.index}: ranks {ranges(st.ranks)}, {shape.device_class} "
            f"{shape.dp}x{shape.tp}" for st, shape in zip(plan.stages, plan.hetero.stages)]


def _channels(plan: Any) -> dict[str, str]:
    """The DP lanes' names: the device's own stream is "GPU stream" unless every device of
    the plan's cluster is a CPU (a type named ``cpu...``, as ``hetplan run`` tells them),
    where it is the "device stream" (a CPU plan's timeline showed a GPU it does not have)."""
    spec = plan.cluster.spec
    types = {d.type for d in spec.devices()} if spec is not None else set()
    if types and all(t.lower().startswith("cpu") for t in types):
        return {**_CHANNELS, "gpu": "device stream"}
    return _CHANNELS


def _dp_segments(stage: int, tl: Any, offset: float, units: list[str],
                 channels: dict[str, str] = _CHANNELS) -> list[Segment]:
    out = []
    for e in sorted(tl.events, key=lambda e: (e.resource, e.start_s)):
        lane = f"stage {stage} · {channels.get(e.resource, e.resource)}"
        start, end = offset + e.start_s * 1e3, offset + e.end_s * 1e3
        if e.unit < 0:
            out.append(Segment(lane, "backprop", start, end, "backprop", stage, None,
                               f"backprop of the last micro-batch ({e.label})"))
            continue
        kind = e.label or "op"
        what = units[e.unit] if 0 <= e.unit < len(units) else ""
        out.append(Segment(lane, kind, start, end, f"u{e.unit}", stage, None,
                           f"{kind} of sync unit u{e.unit} on {channels.get(e.resource, '')}"
                           f" ({(end - start):.3f} ms): {what}"))
    return out


def _merge(segments: list[Segment], tiny_ms: float) -> list[Segment]:
    """Merge touching segments of one kind on one lane: all backprop segments, and runs of
    ops shorter than ``tiny_ms`` (too thin to see or label one by one)."""
    out: list[Segment] = []
    count = 1
    last_dur = 0.0
    for seg in segments:
        prev = out[-1] if out else None
        touching = (prev is not None and prev.lane == seg.lane and prev.kind == seg.kind
                    and abs(seg.start_ms - prev.end_ms) <= 1e-9 * max(1.0, seg.end_ms))
        if touching and prev is not None and (
            seg.kind == "backprop" or (seg.duration_ms < tiny_ms and last_dur < tiny_ms)
        ):
            count += 1
            if seg.kind == "backprop":
                out[-1] = replace(prev, end_ms=seg.end_ms)
            else:
                first = prev.label.split("–")[0]
                label = f"{first}–{seg.label}"
                out[-1] = replace(prev, end_ms=seg.end_ms, label=label,
                                  detail=f"{count} {seg.kind} ops merged: units {label}")
        else:
            out.append(seg)
            count = 1
        last_dur = seg.duration_ms
    return [
        replace(x, detail=f"backprop of the last micro-batch: {x.duration_ms:.2f} ms")
        if x.kind == "backprop" else x
        for x in out
    ]


def _breakdown_text(ev: Any) -> str:
    return (f"predicted {ev.iteration_s * 1e3:.2f} ms/iteration: compute "
            f"{ev.compute_s * 1e3:.1f} ms, comm {ev.comm_s * 1e3:.1f} ms (exposed "
            f"{ev.exposed_comm_s * 1e3:.1f}), bubble {ev.bubble_s * 1e3:.1f} ms, compression "
            f"{ev.compression_s * 1e3:.1f} ms, optimizer {ev.optimizer_s * 1e3:.1f} ms")


def _measured(report: Any) -> tuple[float, dict[str, float]] | None:
    """(measured iteration ms, other ``*_ms`` numbers) of a run report, or None."""
    if report is None:
        return None
    if not isinstance(report, Mapping):
        raise SpecError(f"run_report must be a mapping of measured times, got {type(report)}")
    inner = report.get("measured")
    data: Mapping[str, Any] = inner if isinstance(inner, Mapping) else report
    total = data.get("iteration_ms")
    if isinstance(total, bool) or not isinstance(total, (int, float)) or not total > 0:
        raise SpecError(
            f"run_report needs a positive number 'iteration_ms' (measured milliseconds per "
            f"iteration), got {total!r}"
        )
    parts = {k: float(v) for k, v in data.items()
             if k.endswith("_ms") and k != "iteration_ms" and isinstance(v, (int, float))
             and not isinstance(v, bool)}
    return float(total), parts


# --------------------------------------------------------------------------- drawing
def _text_colour(hex_colour: str) -> str:
    r, g, b = (int(hex_colour[i : i + 2], 16) for i in (1, 3, 5))
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 150 else "white"


def _bar_height(lane: str) -> float:
    if lane in ("predicted", "measured"):
        return 0.5
    return 0.8 if "·" not in lane else 0.6


def _draw_png(tl: _Timeline, path: Path) -> None:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.collections import PolyCollection
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise SpecError(f"drawing a PNG needs matplotlib (pip install matplotlib): {e}") from e
    n = len(tl.lanes)
    width, height, dpi = 16.0, max(9.0, 2.6 + 0.42 * n), 100
    fig = Figure(figsize=(width, height), dpi=dpi)
    FigureCanvasAgg(fig)
    # room for the longest row name (a stage with per-stage degrees names its ranks)
    left, right = max(0.155, min(0.4, (0.08 * max(map(len, tl.lanes)) + 0.3) / width)), 0.985
    kinds = list(dict.fromkeys(s.kind for s in tl.segments))
    handles = [Patch(color=_STYLE.get(k, _OTHER)[1], label=_STYLE.get(k, _OTHER)[0])
               for k in _STYLE if k in kinds]
    ncol = len(handles) if len(handles) <= 7 else -(-len(handles) // 2)
    legend_rows = -(-len(handles) // ncol)
    fig.subplots_adjust(left=left, right=right, top=1 - 1.15 / height,
                        bottom=(0.95 + 0.28 * legend_rows) / height)
    ax = fig.add_subplot(1, 1, 1)
    ypos = {lane: n - 1 - i for i, lane in enumerate(tl.lanes)}
    xmax = max(s.end_ms for s in tl.segments) * 1.015
    px_per_ms = (right - left) * width * dpi / xmax
    # One collection of rectangles per kind, not one patch per bar: a plan of 65,536
    # micro-batches has as many bars per stage, and matplotlib spends about 0.7 ms on each
    # patch it adds and draws (45 s), against one draw call for a collection.
    for kind in kinds:  # bars at least 2 px wide; white edges only where they do not hide it
        segs = [s for s in tl.segments if s.kind == kind]
        colour = _STYLE.get(kind, _OTHER)[1]
        boxes = []
        for s in segs:
            x0, x1 = s.start_ms, s.start_ms + max(s.duration_ms, 2 / px_per_ms)
            y, h = ypos[s.lane], _bar_height(s.lane) / 2
            boxes.append(((x0, y - h), (x0, y + h), (x1, y + h), (x1, y - h)))
        ax.add_collection(PolyCollection(
            boxes, facecolors=colour, edgecolors="white", closed=True,
            linewidths=[0.6 if s.duration_ms * px_per_ms > 5 else 0 for s in segs]))
    char_px = 8.5 * 0.62 * dpi / 72
    for s in tl.segments:
        if s.label and s.duration_ms * px_per_ms >= len(s.label) * char_px + 6:
            colour = _STYLE.get(s.kind, _OTHER)[1]
            ax.text((s.start_ms + s.end_ms) / 2, ypos[s.lane], s.label, ha="center",
                    va="center", fontsize=8.5, color=_text_colour(colour), clip_on=True)
    for i, lane in enumerate(tl.lanes):  # separate the stage groups
        if i and "·" not in lane:
            ax.axhline(n - i - 0.5, color="#999999", linewidth=0.8)
    ax.axvline(tl.iteration_ms, color="#3A3A3A", linestyle="--", linewidth=1)
    ax.set_yticks(range(n))
    ax.set_yticklabels(list(reversed(tl.lanes)), fontsize=10)
    ax.set_ylim(-0.6, n - 0.4)
    ax.set_xlim(0, xmax)
    ax.set_xlabel("time (ms)", fontsize=11)
    ax.grid(axis="x", color="#DDDDDD", linewidth=0.6)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.text(0.5, 1 - 0.3 / height, tl.title, ha="center", va="top", fontsize=14,
             weight="bold")
    fig.text(0.5, 1 - 0.68 / height, tl.subtitle, ha="center", va="top", fontsize=11,
             color="#444444")
    fig.legend(handles=handles, loc="lower center", ncol=ncol, frameon=False,
               fontsize=10, bbox_to_anchor=(0.5, 0.05 / height))
    fig.savefig(path, format="png")


def _draw_html(tl: _Timeline, path: Path) -> None:
    try:
        import plotly.graph_objects as go
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise SpecError(f"drawing HTML needs plotly (pip install plotly): {e}") from e
    fig = go.Figure()
    kinds = list(dict.fromkeys(s.kind for s in tl.segments))
    for kind in [k for k in _STYLE if k in kinds] + [k for k in kinds if k not in _STYLE]:
        segs = [s for s in tl.segments if s.kind == kind]
        name, colour = _STYLE.get(kind, (kind, _OTHER[1]))
        fig.add_trace(go.Bar(
            orientation="h", name=name, y=[s.lane for s in segs],
            x=[s.duration_ms for s in segs], base=[s.start_ms for s in segs],
            width=[_bar_height(s.lane) for s in segs], text=[s.label for s in segs],
            textposition="inside", insidetextanchor="middle",
            textfont={"color": _text_colour(colour)},
            hovertext=[f"{s.detail}<br>{s.start_ms:.3f}–{s.end_ms:.3f} ms" for s in segs],
            hovertemplate="%{hovertext}<extra></extra>",
            marker={"color": colour, "line": {"color": "white", "width": 0.5}},
        ))
    fig.add_vline(x=tl.iteration_ms, line_dash="dash", line_color="#3A3A3A")
    fig.update_layout(
        title={"text": f"{tl.title}<br><sub>{tl.subtitle}</sub>", "x": 0.5},
        barmode="overlay", template="plotly_white", height=max(600, 160 + 38 * len(tl.lanes)),
        xaxis={"title": "time (ms)", "rangemode": "tozero"},
        yaxis={"categoryorder": "array", "categoryarray": list(reversed(tl.lanes))},
        uniformtext={"minsize": 9, "mode": "hide"},
        legend={"orientation": "h", "y": -0.12, "x": 0.5, "xanchor": "center"},
        margin={"l": 200, "r": 30, "t": 90, "b": 90},
    )
    fig.write_html(str(path), include_plotlyjs=True, full_html=True)
