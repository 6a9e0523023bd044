"""Per-stage compute times of a plan, the first step of the objective
(:func:`~hetplan.cost_models.evaluate.evaluate`).

:func:`stage_times` gives one stage's forward, backward and tensor-parallel communication
time per micro-batch, at its slowest device (each device type in its own compute dtype, see
:class:`~hetplan.cost_models.compute.ComputeModel`), or with uneven TP shards at each layer's
slowest rank (:mod:`hetplan.cost_models.tp_shares`):

- a layer with Megatron pairs is split ``tp`` ways and adds one all-reduce of its output per
  pair in forward and in backward (with sequence parallelism a reduce-scatter and an
  all-gather, which cost the same), in the compute dtype;
- backward adds the stage's recomputation (:func:`recompute_s`: ``full`` runs each block's
  forward again, ``selective`` the attention core's FLOP share of it);
- ZeRO-3 all-gathers each layer's weights before its forward and its backward, prefetched
  during the previous layer's compute (the first gather is exposed); ZeRO-2 and -3
  reduce-scatter every micro-batch's gradients, so a backward takes at least that long
  (:func:`zero_stage_times`). Where a gloo profile measured the runtime's ZeRO-3 phases
  (``zero3_forward`` / ``zero3_backward`` records) those are charged instead: on gloo the
  gathers and reduce-scatters do not overlap compute or each other.

:func:`p2p_ms` prices the activation transfers between stages, per pipeline link.
Deterministic and free of torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.memory import StatePrecision, capture_bytes
from hetplan.cost_models.precision import state_precision
from hetplan.cost_models.rank_memory import stage_precision
from hetplan.cost_models.tp_shares import stage_compute
from hetplan.ir.cluster import Device
from hetplan.ir.plan_sections import LayerCost, Layout, Stage, TensorParallel, WorkloadSummary

__all__ = ["rank_devices", "group_link", "shard_bytes", "stage_times", "recompute_s",
           "zero_stage_times", "p2p_ms"]


def rank_devices(costs: CostModel, stage: Stage) -> list[Device]:
    return [costs.devices[r] for r in stage.ranks]


def group_link(costs: CostModel, ranks: list[int]) -> tuple[Literal["intra", "inter"], int, int]:
    """(link name, nodes spanned, largest members on one node) of a rank group."""
    nodes: dict[int, int] = {}
    for r in ranks:
        n = costs.devices[r].node_index
        nodes[n] = nodes.get(n, 0) + 1
    link: Literal["intra", "inter"] = "intra" if len(nodes) == 1 else "inter"
    return link, len(nodes), max(nodes.values())


def nic_share(costs: CostModel, ranks: list[int]) -> float:
    """How many groups like ``ranks`` share each node's network interfaces when they all
    communicate at once: a node's devices over the group's members on it (1 for a group
    within one node). With tensor parallelism inside a node every TP rank's data-parallel
    group crosses the node at the same time (tp=8: eight groups on eight NICs), so each gets
    ``members / devices`` of the node's inter-node bandwidth (``inter_node`` is the node's
    total)."""
    link, _, per_node = group_link(costs, ranks)
    if link != "inter":
        return 1.0
    on_node = costs.node_sizes[costs.devices[ranks[0]].node_index]
    return max(on_node / per_node, 1.0)


def p2p_ms(workload: WorkloadSummary, layout: Layout, stages: Sequence[Stage],
            costs: CostModel, scale: float,
            burst_s: Sequence[float] | None = None) -> list[float]:
    """Per pipeline link ``i -> i+1`` (and, for interleaved chunks, the wrap-around link
    ``pp-1 -> 0`` last), the activation transfer time in ms of the largest boundary crossing
    it, in the sending stage's compute dtype. Each TP rank sends its ``1/tp`` slice
    (Megatron's scatter-gather); across nodes, every rank of the sending stage on the node
    sends at once through the node's shared network (``inter_node`` is the node's total).

    ``burst_s``: per stage, the compute one micro-batch's action takes there (the mean of its
    forward and backward), the work every rank does between two blocking receives. With it,
    a crossing also pays the profiled hand-over wait after a burst of the two stages' mean
    (:meth:`~hetplan.cost_models.comm.CommModel.wait_s`: 0 s without a hand-over record,
    so GPU and analytic plans are unchanged)."""
    pp = layout.pp
    links = [0.0] * (pp if layout.virtual_stages > 1 else pp - 1)
    cap = capture_bytes(workload)
    for k in range(len(stages) - 1):
        a, b = stages[k].ranks[0], stages[k + 1].ranks[0]
        act = state_precision(costs.precision, costs.devices[a].type, (),
                              cap).act_scale
        nbytes = workload.layers[stages[k].last_layer].boundary_bytes * scale * act / layout.tp
        link = costs.cluster.link_between(a, b)
        node = costs.devices[a].node_index
        if costs.devices[b].node_index != node:
            nbytes *= sum(1 for r in stages[k].ranks if costs.devices[r].node_index == node)
        t = costs.comm.time_s("p2p", nbytes, 2, link)
        if burst_s is not None:
            t += costs.comm.wait_s("p2p", 2, link, (burst_s[k] + burst_s[k + 1]) / 2)
        links[k % pp] = max(links[k % pp], t * 1e3)
    return links


def stage_times(
    workload: WorkloadSummary,
    st: Stage,
    layout: Layout,
    costs: CostModel,
    mb: int,
    scale: float,
    tp_section: TensorParallel | None = None,
) -> tuple[float, float, float, list[float], dict[str, int]]:
    """Per-micro-batch forward, backward and TP-communication time of a stage, at the speed
    of its slowest device (or, with uneven TP shards, of each layer's slowest rank), and each
    layer's backward time (for the DP timeline).

    Backward includes the stage's recomputation (``full``: each block's forward again,
    its TP all-reduces included, as Megatron-LM's and the runtime's checkpointed blocks rerun
    them; ``selective``: the attention core's share of it, by FLOPs, which has none). With ZeRO-3 each layer's
    weights are all-gathered before its forward and its backward, prefetched during the
    previous layer's compute; with ZeRO-2 and -3 every micro-batch's gradients are
    reduce-scattered, so a backward takes at least that long."""
    devices = {(d.type, d.slowdown): d for d in rank_devices(costs, st)}
    tp = layout.tp
    if tp > 1:
        tp_ranks = list(st.ranks[:tp])
        link, _, _ = group_link(costs, tp_ranks)
    best: tuple[float, float, list[float], list[float]] | None = None
    sources: dict[str, int] = {}
    layers = workload.layers[st.first_layer : st.last_layer + 1]
    tp_comm = 0.0
    for dev in devices.values():
        times = costs.compute.layer_times(workload, dev, mb, tp=tp,
                                          sp=layout.sequence_parallel)[
            st.first_layer : st.last_layer + 1]
        per_f, per_b = [], []
        for lay, t in zip(layers, times):
            lf, lb, core = t.fwd_s, t.bwd_s, t.core_fwd_s
            if not t.per_rank:
                div = costs.compute.tp_divisor(lay, tp)
                lf, lb = lf / div, lb / div
            per_f.append(lf)
            per_b.append(lb + recompute_s(lay, lf, st.recompute, core))
            sources[t.source] = sources.get(t.source, 0) + 1
        f, b = sum(per_f), sum(per_b)
        if best is None or f + b > best[0] + best[1]:
            best = (f, b, per_f, per_b)
    assert best is not None
    fwd_s, f_layers, b_layers = best[0], best[2], best[3]
    # the cost sources stay those counted above (every device of the stage)
    uneven = stage_compute(workload, st, tp, costs, mb, tp_section)
    if uneven is not None:
        fwd_s = uneven[0]
        b_layers = [b + recompute_s(lay, f, st.recompute)
                    for b, lay, f in zip(uneven[2], layers, f_layers)]
    prec = stage_precision(workload, st, costs)
    if tp > 1:
        b_layers = list(b_layers)
        for j, lay in enumerate(layers):
            if lay.tp_pairs:
                nbytes = lay.act_out_bytes * scale * prec.act_scale
                c = lay.tp_pairs * costs.comm.time_s("allreduce", nbytes, tp, link)
                tp_comm += c
                if st.recompute == "full" and lay.kind == "block":
                    b_layers[j] += c  # the recomputed forward's all-reduces
    bwd_s = sum(b_layers)
    if layout.zero_stage >= 2 and layout.dp > 1:
        fwd_s, bwd_s = _zerostage_times(workload, st, layout, costs, prec, f_layers, b_layers)
    # TP all-reduces happen in forward and again in backward
    per_layer = list(b_layers)
    if per_layer and tp_comm:
        per_layer[-1] += tp_comm
    if per_layer and bwd_s > sum(b_layers):
        per_layer[-1] += bwd_s - sum(b_layers)
    return fwd_s + tp_comm, bwd_s + tp_comm, tp_comm, per_layer, sources


def recompute_s(lay: LayerCost, fwd_s: float, mode: str,
                core_fwd_s: float | None = None) -> float:
    """Backward's extra time to recompute ``lay`` (its forward time ``fwd_s``) under ``mode``:
    the whole forward (``full``) or the attention core's (``selective``): ``core_fwd_s``
    where the compute model priced the core apart, else the core's FLOP share of
    ``fwd_s``."""
    if mode == "full" and lay.kind == "block":
        return fwd_s
    if mode == "selective" and lay.act_attn_core_bytes and lay.fwd_flops:
        if core_fwd_s is not None:
            return min(core_fwd_s, fwd_s)
        return fwd_s * min(lay.attn_core_fwd_flops / lay.fwd_flops, 1.0)
    return 0.0


def _zerostage_times(
    workload: WorkloadSummary, st: Stage, layout: Layout, costs: CostModel,
    prec: StatePrecision, f_layers: list[float], b_layers: list[float],
) -> tuple[float, float]:
    """Per-micro-batch forward and backward time of a stage under ZeRO-2/3 (see
    :func:`_stage_times`): ZeRO-3's all-gather of layer ``i+1`` overlaps layer ``i``'s
    compute, the first one does not; ZeRO-2/3's reduce-scatter of the micro-batch's
    gradients runs beside its backward."""
    dp_ranks = [r for k, r in enumerate(st.ranks) if k % layout.tp == 0]
    link, _, _ = group_link(costs, dp_ranks)
    layers = range(st.first_layer, st.last_layer + 1)
    cap = prec.capture_bytes / nic_share(costs, dp_ranks)
    elems = [shard_bytes(workload, workload.layers[i].param_bytes, i, layout.tp) / cap
             for i in layers]
    rs = 0.0
    for n in elems:
        rs += costs.comm.time_s("reduce_scatter", n * prec.grad_bytes, layout.dp, link)
    fwd_s, bwd_s = sum(f_layers), max(sum(b_layers), rs)
    if layout.zero_stage >= 3:
        if costs.comm.has_handovers:  # gloo profiles; GPU and analytic plans skip it
            fp32_bytes = sum(shard_bytes(workload, workload.layers[i].param_bytes, i,
                                         layout.tp) for i in layers) / prec.capture_bytes * 4
            measured = _measured_zero3(costs, layout.dp, link, fp32_bytes, f_layers, b_layers)
            if measured is not None:
                return measured
        ag = [costs.comm.time_s("allgather", n * prec.weight_bytes, layout.dp, link)
              for n in elems]
        fwd_s = ag[0] + sum(max(f, a) for f, a in zip(f_layers, ag[1:] + [0.0]))
        back = list(reversed(ag))
        bwd_s = max(back[0] + sum(max(b, a) for b, a in zip(reversed(b_layers),
                                                              back[1:] + [0.0])), rs)
    return fwd_s, bwd_s


def _measured_zero3(costs: CostModel, dp: int, link: Literal["intra", "inter"],
                    param_bytes: float, f_layers: list[float], b_layers: list[float]
                    ) -> tuple[float, float] | None:
    """ZeRO-3's forward and backward from the profile's ``zero3_forward`` /
    ``zero3_backward`` records where it holds both for this group (gloo profiles,
    :mod:`hetplan.profiling.sync_step`): the plain phases plus what the runtime's ZeRO-3
    measured to add to them (its all-gathers and reduce-scatters, which take turns on gloo's
    process group and wait for the processes' hand-overs), scaled by the stage's parameter
    bytes (``param_bytes``, fp32) over the profiled model's. None without the records (GPU
    and analytic plans: the overlapped timing of :func:`_zerostage_times`)."""
    f, b = sum(f_layers), sum(b_layers)
    fwd = costs.comm.measured_s("zero3_forward", dp, link, f)
    bwd = costs.comm.measured_s("zero3_backward", dp, link, b)
    if fwd is None or bwd is None:
        return None
    return (f + fwd[0] * param_bytes / fwd[1], b + bwd[0] * param_bytes / bwd[1])


def shard_bytes(workload: WorkloadSummary, nbytes: int, layer: int, tp: int,
                 share: float | None = None) -> float:
    """A gradient's bytes on one TP rank: the splittable part divided by tp (or times the
    rank's ``share`` with uneven shards)."""
    lay = workload.layers[layer]
    if tp == 1 or not lay.param_bytes or not lay.tp_split_bytes:
        return float(nbytes)
    frac = min(lay.tp_split_bytes / lay.param_bytes, 1.0)
    return nbytes * (1 - frac + (frac / tp if share is None else frac * share))
