"""When each node's inter-node network is idle during one simulated iteration.

Gemini (thesis §6.5) sends checkpoint chunks while the training's own traffic leaves the
network idle. This module reads those idle intervals off the same simulation
:func:`~hetplan.cost_models.evaluate.evaluate` makes, for every parallel layout:

* **pipeline** activations and their gradients: after every forward (backward) action of a
  stage, the point-to-point transfer to the next (previous) stage occupies both nodes' links
  for the link's ``p2p`` time, when the two stages sit on different nodes;
* **tensor parallelism** across nodes: a TP group whose ranks span nodes exchanges
  all-reduces inside every layer, so each of its forward and backward actions is counted
  busy from start to end (no idle time is assumed inside an action: conservative); a TP group
  inside one node (the usual Megatron placement) uses only the intra-node link;
* **data-parallel gradient sync**: the stage's DP timeline (recorded) placed at the start of
  its last backward; its events on the ``net``/``inter`` channels are busy when the DP group
  spans nodes. ZeRO-3's parameter all-gathers count the stage's actions busy, as TP does.
* the optimizer step uses no network.

Times are seconds from the start of the iteration; the iteration ends at
``Evaluation.iteration_s``. A node's idle spans are the complement, within ``[0, iteration)``,
of the union of its ranks' busy intervals. Spans shorter than ``min_span_s`` are dropped.

Pure and deterministic (no torch); O(events · log events).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.evaluate import Evaluation, evaluate
from hetplan.cost_models.stage_times import group_link, p2p_ms
from hetplan.ir.plan_sections import GradientSync, Layout, Stage, TensorParallel, WorkloadSummary

__all__ = ["NodeIdle", "node_idle_spans", "intersect_spans"]

_NET_CHANNELS = ("net", "inter")


@dataclass(frozen=True, slots=True)
class NodeIdle:
    """Per node, its idle ``(start_s, end_s)`` intervals; and the iteration time."""

    iteration_s: float
    idle: tuple[tuple[tuple[float, float], ...], ...]
    busy: tuple[tuple[tuple[float, float], ...], ...]
    evaluation: Evaluation


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(x for x in intervals if x[1] > x[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _complement(busy: list[tuple[float, float]], end: float,
                min_span_s: float) -> tuple[tuple[float, float], ...]:
    out = []
    t = 0.0
    for a, b in busy:
        if a - t > min_span_s:
            out.append((t, a))
        t = max(t, b)
    if end - t > min_span_s:
        out.append((t, end))
    return tuple(out)


def intersect_spans(per_node: Sequence[Sequence[tuple[float, float]]],
                    min_span_s: float = 0.0) -> tuple[tuple[float, float], ...]:
    """The intervals idle on every one of the given nodes (a placement group sends and
    receives together)."""
    if not per_node:
        return ()
    cur = list(per_node[0])
    for other in per_node[1:]:
        nxt = []
        i = j = 0
        while i < len(cur) and j < len(other):
            a, b = max(cur[i][0], other[j][0]), min(cur[i][1], other[j][1])
            if b - a > min_span_s:
                nxt.append((a, b))
            if cur[i][1] < other[j][1]:
                i += 1
            else:
                j += 1
        cur = nxt
    return tuple(cur)


def node_idle_spans(workload: WorkloadSummary, layout: Layout, stages: tuple[Stage, ...],
                    gradient_sync: GradientSync | None, costs: CostModel, *,
                    tensor_parallel: TensorParallel | None = None,
                    min_span_s: float = 0.0) -> NodeIdle:
    """Simulate the plan once (recording the DP timelines) and return every node's idle
    spans (see module docstring)."""
    ev = evaluate(workload, layout, stages, gradient_sync, costs, check_memory=False,
                  record=True, tensor_parallel=tensor_parallel)
    if not stages:
        stages = (Stage(index=0, first_layer=0, last_layer=len(workload.layers) - 1,
                        ranks=tuple(range(layout.num_ranks))),)
    node_of = [d.node_index for d in costs.devices[: layout.num_ranks]]
    num_nodes = max(node_of) + 1
    busy: list[list[tuple[float, float]]] = [[] for _ in range(num_nodes)]
    v = layout.virtual_stages
    stage_nodes = [sorted({node_of[r] for r in st.ranks}) for st in stages]

    def mark(nodes: Sequence[int], a: float, b: float) -> None:
        for n in nodes:
            busy[n].append((a, b))

    # tensor parallelism (or ZeRO-3 gathers) across nodes: whole actions busy
    crosses = []
    for st in stages:
        tp_groups = [list(st.ranks[i:i + layout.tp]) for i in range(0, len(st.ranks),
                                                                       layout.tp)]
        tp_inter = layout.tp > 1 and any(group_link(costs, g)[0] == "inter" for g in tp_groups)
        dp_ranks = [r for k, r in enumerate(st.ranks) if k % layout.tp == 0]
        zero_inter = (layout.zero_stage >= 3 and layout.dp > 1
                      and group_link(costs, dp_ranks)[0] == "inter")
        crosses.append(tp_inter or zero_inter)
    scale = layout.micro_batch_size / workload.batch_size
    p2p = p2p_ms(workload, layout, stages, costs, scale) if len(stages) > 1 else []
    last = len(stages) - 1
    for e in ev.pipeline.events:
        s = e.stage if v > 1 else e.rank
        a, b = e.start_ms * 1e-3, e.end_ms * 1e-3
        if crosses[s]:
            mark(stage_nodes[s], a, b)
        nxt = s + 1 if e.kind.value == "F" else s - 1
        if 0 <= nxt <= last and p2p:
            link_t = p2p[min(s, nxt) % len(p2p)] * 1e-3
            pair = sorted(set(stage_nodes[s]) | set(stage_nodes[nxt]))
            if len(pair) > 1 and link_t > 0:
                mark(pair, b, b + link_t)
    # data-parallel sync, from the start of each stage's last backward
    for s, (st, tl) in enumerate(zip(stages, ev.dp_timelines, strict=True)):
        if tl is None:
            continue
        dp_ranks = [r for k, r in enumerate(st.ranks) if k % layout.tp == 0]
        if group_link(costs, dp_ranks)[0] != "inter":
            continue
        bwd_ends = [x.end_ms * 1e-3 for x in ev.pipeline.events
                    if x.kind.value == "B" and (x.stage if v > 1 else x.rank) == s]
        t0 = max(bwd_ends, default=0.0) - ev.stages[s].bwd_s
        for de in tl.events:
            if de.resource in _NET_CHANNELS:
                mark(stage_nodes[s], t0 + de.start_s, t0 + de.end_s)
    merged = [_merge(b) for b in busy]
    idle = tuple(_complement(m, ev.iteration_s, min_span_s) for m in merged)
    return NodeIdle(ev.iteration_s, idle, tuple(tuple(m) for m in merged), ev)
