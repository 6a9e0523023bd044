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
- where a gloo profile measured the runtime's tensor-parallel phases of the model
  (``tp_forward`` / ``tp_backward``, ``tp_sp_*`` with sequence parallelism) a TP stage's
  forward and backward are its share of those (:func:`_measured_tp`), in place of the
  layer records split ``tp`` ways and the collectives' lines: on 4 gloo processes sharing
  2 cores each TP collective waits for the processes' hand-overs. The loss measured within
  those steps (``tp_loss`` / ``tp_sp_loss``) goes to the stage holding the last layer, which
  alone computes it in a pipeline.

:func:`p2p_ms` prices the activation transfers between stages, per pipeline link, and
:func:`tied_sync_s` the all-reduce of a tied embedding's gradient between the first and the
last pipeline stage. Deterministic and free of torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from hetplan.cost_models.compute import workload_tokens
from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.engine_memory import tied_head_copy
from hetplan.cost_models.grad_accumulation import (
    accumulation_bytes,
    linear_weight_elems,
    streaming_bandwidth,
)
from hetplan.cost_models.memory import StatePrecision, capture_bytes
from hetplan.cost_models.precision import state_precision
from hetplan.cost_models.rank_memory import stage_precision
from hetplan.cost_models.tp_shares import stage_compute
from hetplan.ir.cluster import Device
from hetplan.ir.plan_sections import LayerCost, Layout, Stage, TensorParallel, WorkloadSummary

__all__ = ["rank_devices", "group_link", "shard_bytes", "stage_times", "recompute_s",
           "zero_stage_times", "p2p_ms", "tied_sync_s", "vocab_comm_s", "accumulation_s"]


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
    so GPU and analytic plans are unchanged).

    Under Chimera the up replica's stage ``k`` runs on pipeline rank ``pp-1-k`` and sends
    its boundary to rank ``pp-2-k``: link ``i`` carries stage ``i``'s boundary down and
    stage ``pp-2-i``'s up, and takes the larger (the simulator has one time per link)."""
    pp = layout.pp
    links = [0.0] * (pp if layout.virtual_stages > 1 else pp - 1)
    cap = capture_bytes(workload)
    up = layout.stage_copies == 2 and len(stages) == pp
    for k in range(len(stages) - 1):
        crossings = [(stages[k], stages[k + 1], k % pp)]
        if up:  # the up replica's copy of the same boundary, on the mirrored link
            crossings.append((stages[pp - 1 - k], stages[pp - 2 - k], pp - 2 - k))
        boundary = workload.layers[stages[k].last_layer].boundary_bytes
        for src, dst, i in crossings:
            a, b = src.ranks[0], dst.ranks[0]
            act = state_precision(costs.precision, costs.devices[a].type, (),
                                  cap).act_scale
            nbytes = boundary * scale * act / layout.tp
            link = costs.cluster.link_between(a, b)
            node = costs.devices[a].node_index
            if costs.devices[b].node_index != node:
                nbytes *= sum(1 for r in src.ranks if costs.devices[r].node_index == node)
            t = costs.comm.time_s("p2p", nbytes, 2, link)
            if burst_s is not None:
                t += costs.comm.wait_s("p2p", 2, link, (burst_s[k] + burst_s[k + 1]) / 2)
            links[i] = max(links[i], t * 1e3)
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
    them; ``selective``: the attention core's share of it, by FLOPs, which has none). With
    ZeRO-3 each layer's weights are all-gathered before its forward and its backward,
    prefetched during the previous layer's compute; with ZeRO-2 and -3 every micro-batch's
    gradients are reduce-scattered, so a backward takes at least that long. A
    vocabulary-parallel model adds its embedding's, head's and cross-entropy's TP
    collectives (:func:`vocab_comm_s`), and each layer's backward the engine's gradient
    accumulation (:func:`accumulation_s`)."""
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
    acc = accumulation_s(workload, st, layout, costs, prec)
    vocab_f, vocab_b = vocab_comm_s(workload, st, layout, costs, scale, prec)
    if (tp > 1 and costs.comm.has_handovers and uneven is None and layout.zero_stage < 2
            and st.recompute == "none" and prec.act_bytes == 4 and costs.vocab_parallel):
        measured = _measured_tp(workload, st, layout, costs, mb, list(devices.values()),
                                link, prec)
        if measured is not None:  # gloo profiles only: GPU and analytic plans skip it
            # the layers' backward rescaled to the measured one (the DP timeline's), plus
            # the engine's gradient accumulation, which the one-micro-batch phase has not
            m_f, m_b = measured
            b_sum = sum(b_layers)
            b_layers = [b * m_b / b_sum if b_sum > 0 else m_b / len(b_layers)
                        for b in b_layers]
            if acc is not None:
                b_layers = [b + a for b, a in zip(b_layers, acc)]
            return (m_f, sum(b_layers), tp_comm + (vocab_f + vocab_b) / 2, b_layers,
                    sources)
    if acc is not None:
        b_layers = [b + a for b, a in zip(b_layers, acc)]
    if vocab_b:
        b_layers = list(b_layers)
        b_layers[-1] += vocab_b
    bwd_s = sum(b_layers)
    if layout.zero_stage >= 2 and layout.dp > 1:
        fwd_s, bwd_s = _zerostage_times(workload, st, layout, costs, prec, f_layers, b_layers)
    fwd_s += vocab_f
    # TP all-reduces happen in forward and again in backward
    per_layer = list(b_layers)
    if per_layer and tp_comm:
        per_layer[-1] += tp_comm
    if per_layer and bwd_s > sum(b_layers):
        per_layer[-1] += bwd_s - sum(b_layers)
    # the vocabulary's collectives are in fwd_s / bwd_s already; the TP communication
    # reported per direction takes their mean
    return (fwd_s + tp_comm, bwd_s + tp_comm, tp_comm + (vocab_f + vocab_b) / 2, per_layer,
            sources)


def vocab_comm_s(workload: WorkloadSummary, st: Stage, layout: Layout, costs: CostModel,
                 scale: float, prec: StatePrecision) -> tuple[float, float]:
    """(forward, backward) seconds per micro-batch of a vocabulary-parallel model's TP
    collectives on ``st`` (``vocab_parallel`` under ``tp > 1``; (0, 0) otherwise), as
    Megatron-LM runs them (Shoeybi et al. 2019, section 3; ``VocabParallelEmbedding``,
    the parallel output layer, ``_VocabParallelCrossEntropy``) and the runtime's
    ``shard_vocab``:

    - the embedding sums its ranks' partial lookups: an all-reduce of its output in forward
      (with sequence parallelism a reduce-scatter into the sequence slices);
    - the head's input is copied to every rank, so backward all-reduces its gradient (with
      sequence parallelism an all-gather of the input in forward and a reduce-scatter of
      its gradient in backward);
    - the cross-entropy all-reduces three fp32 values per token in forward (the row
      maximum, the target's logit, the sum of exponentials)."""
    if layout.tp <= 1 or not costs.vocab_parallel:
        return 0.0, 0.0
    split = costs.memory_layers(workload)
    tp, sp = layout.tp, layout.sequence_parallel
    link, _, _ = group_link(costs, list(st.ranks[:tp]))
    time_s = costs.comm.time_s
    fwd = bwd = 0.0
    for i in range(st.first_layer, st.last_layer + 1):
        lay = workload.layers[i]
        if lay.kind == "head":  # split by its vocabulary, as ComputeModel.tp_divisor says
            act = lay.act_in_bytes * scale * prec.act_scale
            if sp:
                fwd += time_s("allgather", act, tp, link)
                bwd += time_s("reduce_scatter", act, tp, link)
            else:
                bwd += time_s("allreduce", act, tp, link)
            tokens = workload_tokens(workload) * scale
            fwd += 3 * time_s("allreduce", 4.0 * tokens, tp, link)
        elif split[i].tp_split_bytes and not lay.tp_split_bytes:
            out = lay.act_out_bytes * scale * prec.act_scale  # the vocabulary table
            fwd += time_s("reduce_scatter" if sp else "allreduce", out, tp, link)
    return fwd, bwd


def accumulation_s(workload: WorkloadSummary, st: Stage, layout: Layout, costs: CostModel,
                   prec: StatePrecision) -> list[float] | None:
    """Per layer of ``st``, the seconds one micro-batch's gradient accumulation adds to its
    backward under ``costs.grad_accumulation``
    (:mod:`hetplan.cost_models.grad_accumulation`), or None when it adds nothing
    (``unpriced``, or ``autograd`` with one micro-batch).

    Each layer's elements on one rank are its parameters after the TP split
    (:func:`shard_bytes`; even shards), ``1/dp`` of them under ZeRO-2/3; its linear weights
    (:func:`~hetplan.cost_models.grad_accumulation.linear_weight_elems`, split by ``tp``
    where the layer is TP-split, at most the layer's elements: a tied head holds none) move
    the linear-weight bytes, the rest the other bytes; the stage's slowest streaming
    bandwidth."""
    per_linear, per_other = accumulation_bytes(costs.grad_accumulation, prec.weight_bytes,
                                               layout.micro_batches)
    if not per_linear and not per_other:
        return None
    tp = layout.tp
    split = costs.memory_layers(workload)
    tokens = workload_tokens(workload)
    zero = layout.dp if layout.zero_stage >= 2 else 1  # the rank's shard of each gradient
    key = ("stage_times.streaming_bandwidth", st.ranks)  # per stage's ranks, not per call
    bw = costs.memo.get(key)
    if bw is None:
        bw = costs.memo[key] = min(streaming_bandwidth(d) for d in rank_devices(costs, st))
    out = []
    for i in range(st.first_layer, st.last_layer + 1):
        lay = split[i]
        elems = shard_bytes(split, lay.param_bytes, i, tp) / prec.capture_bytes
        lin = linear_weight_elems(workload.layers[i], tokens)
        lin_rank = min(lin / tp if tp > 1 and lay.tp_split_bytes else float(lin), elems)
        out.append((lin_rank * per_linear + (elems - lin_rank) * per_other) / zero / bw)
    return out


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
    split = costs.memory_layers(workload)
    elems = [shard_bytes(split, split[i].param_bytes, i, layout.tp) / cap for i in layers]
    rs = 0.0
    for n in elems:
        rs += costs.comm.time_s("reduce_scatter", n * prec.grad_bytes, layout.dp, link)
    fwd_s, bwd_s = sum(f_layers), max(sum(b_layers), rs)
    if layout.zero_stage >= 3:
        if costs.comm.has_handovers:  # gloo profiles; GPU and analytic plans skip it
            fp32_bytes = sum(shard_bytes(split, split[i].param_bytes, i, layout.tp)
                             for i in layers) / prec.capture_bytes * 4
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


def _measured_tp(workload: WorkloadSummary, st: Stage, layout: Layout, costs: CostModel,
                 mb: int, devices: Sequence[Device], link: Literal["intra", "inter"],
                 prec: StatePrecision) -> tuple[float, float] | None:
    """A tensor-parallel stage's forward and backward per micro-batch from the profile's
    ``tp_forward`` / ``tp_backward`` records (``tp_sp_*`` with sequence parallelism) where it
    holds both for the TP group (gloo profiles, :mod:`hetplan.profiling.tp_step`): the
    runtime's TP phase of the whole profiled model, its TP collectives included, timed with
    every TP group running at once, as a plan's groups do. The stage takes its share of it:
    its layers' unsplit times over the whole model's (the layer records, on the stage's
    slowest device), times the plan's micro-batch over the record's (linear, as the layer
    records scale) and the model's fp32 parameter bytes over the record's (1 for the
    profiled model). None without both records (GPU and analytic plans: the layer records
    split ``tp`` ways plus the collectives' lines).

    Where the profile also holds the ``tp_loss`` (``tp_sp_loss``) record of the same model,
    the loss is not shared out: the stage holding the model's last layer computes it (the
    runtime's pipeline runs the vocabulary-parallel cross-entropy after the last stage's
    forward, and only there), so that stage's forward is its share of the forward record
    less the loss, plus the loss (both scaled alike); every other stage's is its share of
    the forward less the loss. Without the loss record the forward is shared as a whole, as
    before (profiles taken before it: unchanged).

    ``prec`` is the stage's precision (fp32 only: the records are timed in fp32)."""
    op = "tp_sp_" if layout.sequence_parallel else "tp_"
    nbytes = sum(lay.param_bytes for lay in workload.layers) / prec.capture_bytes * 4
    fwd = costs.comm.phase_record(op + "forward", layout.tp, link, nbytes)
    bwd = costs.comm.phase_record(op + "backward", layout.tp, link, nbytes)
    if fwd is None or bwd is None or fwd.micro_batch is None or bwd.micro_batch is None:
        return None
    loss = costs.comm.phase_record(op + "loss", layout.tp, link, nbytes)
    if loss is not None and (loss.micro_batch != fwd.micro_batch or loss.nbytes != fwd.nbytes
                             or not loss.samples[0].seconds < fwd.samples[0].seconds):
        loss = None  # not the forward record's own steps: share the forward whole
    best: tuple[float, float] | None = None
    for dev in devices:
        times = costs.compute.layer_times(workload, dev, mb)
        all_f, all_b = sum(t.fwd_s for t in times), sum(t.bwd_s for t in times)
        if all_f <= 0 or all_b <= 0:
            return None
        mine = times[st.first_layer: st.last_layer + 1]
        f_share = sum(t.fwd_s for t in mine) / all_f
        b_share = sum(t.bwd_s for t in mine) / all_b
        if loss is None:
            f = fwd.samples[0].seconds * f_share * mb / fwd.micro_batch * nbytes / fwd.nbytes
        else:
            last = 1.0 if st.last_layer == len(workload.layers) - 1 else 0.0
            loss_s = loss.samples[0].seconds
            f = ((fwd.samples[0].seconds - loss_s) * f_share + loss_s * last) * (
                mb / fwd.micro_batch * nbytes / fwd.nbytes)
        b = bwd.samples[0].seconds * b_share * mb / bwd.micro_batch * nbytes / bwd.nbytes
        if best is None or f + b > best[0] + best[1]:
            best = (f, b)
    return best


def shard_bytes(layers: Sequence[LayerCost], nbytes: int, layer: int, tp: int,
                 share: float | None = None) -> float:
    """A gradient's bytes on one TP rank: the splittable part divided by tp (or times the
    rank's ``share`` with uneven shards).

    ``layers``: the layers as the cost model holds them,
    :meth:`~hetplan.cost_models.costs.CostModel.memory_layers` (with a vocabulary-parallel
    head its ``V x h`` embedding is split too: each TP rank holds, syncs and updates
    ``1/tp`` of the rows, as Megatron-LM's ``VocabParallelEmbedding`` and the runtime's
    ``shard_vocab`` do); the captured ``workload.layers`` count that table whole on every
    rank."""
    lay = layers[layer]
    if tp == 1 or not lay.param_bytes or not lay.tp_split_bytes:
        return float(nbytes)
    frac = min(lay.tp_split_bytes / lay.param_bytes, 1.0)
    return nbytes * (1 - frac + (frac / tp if share is None else frac * share))


def tied_sync_s(workload: WorkloadSummary, stages: Sequence[Stage], layout: Layout,
                costs: CostModel) -> float:
    """Seconds of the all-reduce that sums a tied embedding's gradient between the stage
    holding the token embedding and the stage holding the LM head (its copy), after the
    pipeline flush and the data-parallel sync, before the optimizer step: Megatron-LM's
    ``_allreduce_embedding_grads`` (Narayanan et al. 2021 and Megatron-DeepSpeed keep the
    head's copy of the embedding on the last stage) and the runtime's pipeline, which sums
    the two copies' gradients the same way. 0 when the head is not tied, when one stage
    holds both, or under Chimera when the two are mirror stages (``s`` and ``P-1-s``): every
    rank holding one holds the other, and the runtime sums the copies in the process.

    Each TP rank all-reduces its slice of the ``V x h`` table (``1/tp`` of it with a
    vocabulary-parallel head) in the reduce dtype with its peer on the other stage; across
    nodes every rank of the embedding's stage on the node does so at once through the node's
    shared network (as :func:`p2p_ms`)."""
    if len(stages) < 2:
        return 0.0
    cap = capture_bytes(workload)
    tied = tied_head_copy(costs.memory_layers(workload), cap, costs.vocab_parallel)
    if tied is None:
        return 0.0
    table, copy = tied
    first = next(st for st in stages if st.first_layer <= table <= st.last_layer)
    last = next(st for st in stages if st.last_layer == len(workload.layers) - 1)
    a, b = first.ranks[0], last.ranks[0]
    if first.ranks == last.ranks:
        return 0.0
    if layout.stage_copies == 2 and first.index + last.index == len(stages) - 1:
        return 0.0  # Chimera: the ranks of one stage hold its mirror too; copies sum locally
    prec = state_precision(costs.precision, costs.devices[a].type, (), cap)
    split = copy.tp_split_bytes > 0 and layout.tp > 1
    nbytes = copy.param_bytes / cap * prec.grad_bytes / (layout.tp if split else 1)
    node = costs.devices[a].node_index
    if costs.devices[b].node_index != node:
        nbytes *= sum(1 for r in first.ranks if costs.devices[r].node_index == node)
    return costs.comm.time_s("allreduce", nbytes, 2, costs.cluster.link_between(a, b))
