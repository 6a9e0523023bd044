"""Lower bounds on a layout's predicted iteration time, so the search can skip layouts that
cannot be among its finalists without running any pass on them.

:func:`iteration_lower_bound` gives, for a :class:`LayoutCandidate`, a time that
:func:`~hetplan.cost_models.evaluate.evaluate` can never predict below for any plan the
screening passes may make of it (whatever the stage partition, recomputation, ZeRO stage of
its ladder, bucketing or routing). It adds two parts, each priced with the cost model's own
functions:

1. **Compute and pipeline.** ``T``: one micro-batch's forward and backward through every
   layer, each layer at the fastest device of the cluster, its Megatron part divided by
   ``tp``, plus the TP all-reduces of its outputs (forward and backward) at the smallest
   activation dtype of the cluster. A stage of the plan takes at least its layers' share
   of ``T`` (it runs at its slowest device and adds recomputation, ZeRO's exposed
   communication and point-to-point transfers, all ``>= 0``). For GPipe and 1F1B with ``pp``
   stages and ``m`` micro-batches, stage ``k`` cannot start before micro-batch 1 crossed the
   forwards of stages ``< k``, must run all its ``m`` forwards and backwards one after the
   other, and its last backward must still cross the backwards of stages ``< k``: the
   iteration is at least ``prefix_k + m · t_k`` for every ``k``. The smallest possible
   maximum over ``k`` of that, over all ways of splitting ``T`` into ``t_0 .. t_{pp-1}``, is
   ``T / (1 - (1 - 1/m)^pp)`` (equalise the terms: ``T - prefix`` shrinks by ``1 - 1/m``
   per stage); it is ``m · T`` without a pipeline and ``T`` with one micro-batch. Stages
   hold whole layers, so :func:`partition_bound` takes the smallest maximum over the cuts
   of the layers' shares of ``T`` into contiguous stages instead (at least as large). For
   interleaved 1F1B: ``max(T, m · T / pp)`` (one micro-batch crosses every chunk in order;
   the busiest pipeline rank runs at least ``1/pp`` of all the work). Chimera: ``0`` (not
   bounded here).
2. **Optimizer step.** The memory-bound step of the slowest pipeline rank is at least the
   whole model's step bytes over ``pp`` ranks, at the smallest bytes per element of any
   device type, divided by ``dp`` if the ladder has a ZeRO stage, at the largest memory
   bandwidth of the cluster.

3. **One stage** (``pp = 1``, :func:`single_stage_s`), at each ZeRO stage the search can plan
   (those whose model state fits, as ``compile`` screens them), the least over them: ``m``
   times one micro-batch's forward and backward, which is at least ``T`` and at least the
   sum of (a) every layer's fastest forward, and backward plus the blocks' forward again
   when recomputation is certainly ``full`` (the partitioner picks it automatically —
   ``dynpipe{recompute=auto}`` alone writing ``stages`` — and
   :func:`~hetplan.cost_models.rank_memory.choose_recompute` picks ``full`` for the one
   stage, which is the stage every plan of the layout has; or ``recompute=full``),
   (b) under ZeRO-2/3, backward no shorter than the micro-batch's gradient reduce-scatter,
   and under ZeRO-3 the first all-gather of forward and of backward exposed and every
   layer at least as long as the next layer's all-gather — priced with the stage's own
   precision and data-parallel link, as
   :func:`~hetplan.cost_models.stage_times.stage_times` prices them — and (c) the TP
   all-reduces of part 1; plus part 2 at that ZeRO stage. This is what the compute-only
   bound left out of pp=1 / ZeRO-3 layouts (llama-70b on ``h100-1024``: 0.72-0.94 of the
   prediction before, 0.80-0.98 after; the 1T GPT: 0.33-0.75 before, 0.96-0.99 after).

Gradient sync is bounded by ``0`` (it may be hidden under backward). A bound is valid only
when the screening passes keep every layer's full work (:func:`bounds_apply`: no TP
resizing controller, which prunes computation). The result is multiplied by
``1 - 1e-9`` so that a different order of the same float additions never makes it exceed
the prediction. Deterministic; O(layers · device kinds) per ``(mb, tp)``, cached, and
O(60 · layers) per candidate for the partition.
"""

from __future__ import annotations

from dataclasses import replace

from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.evaluate import _step_bytes
from hetplan.cost_models.memory import capture_bytes
from hetplan.cost_models.precision import state_precision
from hetplan.cost_models.rank_memory import choose_recompute, stage_precision
from hetplan.cost_models.stage_times import group_link, nic_share, shard_bytes
from hetplan.ir.plan_sections import Stage, WorkloadSummary
from hetplan.optimizer.layout import LayoutCandidate
from hetplan.passes.base import Pass, rank_of

__all__ = ["bounds_apply", "iteration_lower_bound", "layer_compute_s", "micro_batch_compute_s",
           "partition_bound", "single_stage_s"]

#: Relative slack against float reassociation (see module docstring).
SLACK = 1e-9


def bounds_apply(passes: tuple[Pass, ...], schedule: str) -> bool:
    """Whether :func:`iteration_lower_bound` holds for plans made by ``passes``: none may
    prune computation (a TP resizing controller), and the schedule must be bounded."""
    if schedule == "chimera":
        return False
    return all(getattr(p, "controller", "off") == "off" for p in passes)


def layer_compute_s(workload: WorkloadSummary, costs: CostModel, mb: int,
                    tp: int) -> list[float]:
    """Each layer's share of ``T`` (module docstring): one micro-batch of ``mb`` samples
    forward and backward at the fastest device, with its ``tp``-way split and its TP
    all-reduces (memoised per ``(mb, tp)``)."""
    key = ("layer_compute_s", id(workload), mb, tp)
    hit: list[float] | None = costs.memo.get(key)
    if hit is not None:
        return hit
    costs.memo[("workload", id(workload))] = workload  # its id stays unique while cached
    kinds = {(d.type, d.slowdown): d for d in costs.devices}
    per_device = [costs.compute.layer_times(workload, dev, mb) for dev in kinds.values()]
    out = []
    for i, lay in enumerate(workload.layers):
        best = float("inf")
        for times in per_device:
            f, b = times[i].fwd_s, times[i].bwd_s
            div = costs.compute.tp_divisor(lay, tp)
            f, b = f / div, b / div
            best = min(best, f + b)  # recomputation would only add
        out.append(best)
    if tp > 1:
        cap = capture_bytes(workload)
        act = min(state_precision(costs.precision, t, (), cap).act_scale
                  for t in sorted({d.type for d in costs.devices}))
        scale = mb / workload.batch_size
        for i, lay in enumerate(workload.layers):
            if lay.tp_pairs:
                nbytes = lay.act_out_bytes * scale * act
                out[i] += 2 * lay.tp_pairs * costs.comm.time_s("allreduce", nbytes, tp, "intra")
    costs.memo[key] = out
    return out


def micro_batch_compute_s(workload: WorkloadSummary, costs: CostModel, mb: int,
                          tp: int) -> float:
    """``T`` of the module docstring: one micro-batch of ``mb`` samples through every layer,
    forward and backward, at the fastest device, with ``tp``-way splits and their
    all-reduces."""
    return sum(layer_compute_s(workload, costs, mb, tp))


def _pipeline_bound(t: float, pp: int, m: int, schedule: str) -> float:
    if schedule == "chimera":
        return 0.0
    if schedule == "interleaved-1f1b":
        return max(t, m * t / pp)
    return t / (1.0 - (1.0 - 1.0 / m) ** pp)


def partition_bound(times: list[float], pp: int, m: int) -> float:
    """GPipe / 1F1B: the smallest ``max_k (prefix_k + m · t_k)`` (module docstring, part 1)
    over the ways of cutting ``times`` (each layer's share of ``T``) into at most ``pp``
    contiguous stages, from below (a value no partition goes under).

    A layer is never split, so this is at least the continuous bound
    ``T / (1 - (1 - 1/m)^pp)`` and can be much more (a 2-layer stage of an 80-layer model
    on 64 stages). For a target ``X``, cutting each stage as late as ``prefix + m · t <= X``
    allows is feasible whenever any cut is (a later cut leaves every later stage a subset of
    its layers, with a prefix that grew by less than ``m`` times what the stage lost), so
    bisection on ``X`` with that greedy check finds the optimum; it returns the last
    infeasible ``X`` (or the continuous bound when that is feasible). O(60 · layers)."""
    total = sum(times)
    lo = _pipeline_bound(total, pp, m, "1f1b")
    hi = m * total
    if pp <= 1 or _fits(times, pp, m, lo):
        return lo
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if mid <= lo or mid >= hi:
            break
        if _fits(times, pp, m, mid):
            hi = mid
        else:
            lo = mid
    return lo


def _fits(times: list[float], pp: int, m: int, x: float) -> bool:
    """Whether ``times`` cut greedily (each stage as long as ``prefix + m · t <= x``) needs
    at most ``pp`` stages."""
    stages, prefix, t = 1, 0.0, 0.0
    for d in times:
        if prefix + m * (t + d) <= x:
            t += d
            continue
        if t == 0.0 and prefix + m * d > x:
            return False  # this layer alone does not fit
        stages, prefix, t = stages + 1, prefix + t, d
        if stages > pp or prefix + m * t > x:
            return False
    return True


def _optimizer_bound(workload: WorkloadSummary, costs: CostModel, cand: LayoutCandidate,
                     sharded: bool) -> float:
    cap = capture_bytes(workload)
    split = costs.memory_layers(workload)
    elems = sum(shard_bytes(split, lay.param_bytes, i, cand.tp)
                for i, lay in enumerate(split)) / cap
    per_elem = min(_step_bytes(state_precision(costs.precision, t, (t,), cap), costs.optimizer)
                   for t in sorted({d.type for d in costs.devices}))
    if sharded:
        per_elem /= cand.dp
    bw = max(d.mem_bandwidth_bytes_per_s for d in costs.devices)
    return per_elem * elems / cand.pp / bw


def iteration_lower_bound(workload: WorkloadSummary, costs: CostModel, cand: LayoutCandidate,
                          schedule: str, ladder: list[int], *,
                          recompute: str | None = None) -> float:
    """A time no plan of ``cand`` (at any ZeRO stage of ``ladder``) is predicted below, in
    seconds (see module docstring). ``recompute``: how the screening's partitioner picks
    activation recomputation (``auto``, a mode, or None when unknown), for part 3."""
    times = layer_compute_s(workload, costs, cand.micro_batch_size, cand.tp)
    if schedule in ("gpipe", "1f1b"):
        pipe = partition_bound(times, cand.pp, cand.micro_batches)
    else:
        pipe = _pipeline_bound(sum(times), cand.pp, cand.micro_batches, schedule)
    opt = _optimizer_bound(workload, costs, cand, any(z >= 1 for z in ladder) and cand.dp > 1)
    bound = pipe + opt
    if cand.pp == 1 and cand.virtual_stages == 1 and schedule != "chimera" and ladder:
        t = sum(times)
        bound = max(bound, min(
            cand.micro_batches * max(t, single_stage_s(workload, costs, cand, schedule, z,
                                                       recompute))
            + _optimizer_bound(workload, costs, cand, z >= 1 and cand.dp > 1)
            for z in ladder))
    return bound * (1.0 - SLACK)


def single_stage_s(workload: WorkloadSummary, costs: CostModel, cand: LayoutCandidate,
                   schedule: str, zero_stage: int, recompute: str | None) -> float:
    """Part 3 of the module docstring: a time one micro-batch's forward and backward through
    the single stage of ``cand`` (``pp = 1``) at ZeRO stage ``zero_stage`` cannot go under:
    the layers' fastest forward and backward (with ``tp`` and its all-reduces as in part 1),
    the blocks' forward again in backward when recomputation is certainly ``full``, and
    ZeRO-2/3's per-micro-batch gradient reduce-scatter and ZeRO-3's weight all-gathers priced
    as :func:`~hetplan.cost_models.stage_times.stage_times` prices them for this stage."""
    key = ("single_stage_s", id(workload), cand, schedule, zero_stage, recompute)
    hit: float | None = costs.memo.get(key)
    if hit is not None:
        return hit
    costs.memo[("workload", id(workload))] = workload
    c = replace(cand, zero_stage=zero_stage)
    layout = c.to_layout(c.dp * c.micro_batch_size * c.micro_batches, schedule)
    n = len(workload.layers)
    stage = Stage(index=0, first_layer=0, last_layer=n - 1,
                  layer_names=tuple(x.name for x in workload.layers),
                  ranks=tuple(rank_of(layout, d, 0, t) for d in range(c.dp)
                              for t in range(c.tp)))
    full = recompute == "full" or (recompute == "auto" and choose_recompute(
        workload, layout, (stage,), costs)[0].recompute == "full")
    kinds = {(d.type, d.slowdown): d for d in costs.devices}
    per_device = [costs.compute.layer_times(workload, dev, c.micro_batch_size)
                  for dev in kinds.values()]
    fmin, bmin = [], []
    for i, lay in enumerate(workload.layers):
        div = costs.compute.tp_divisor(lay, c.tp)
        f = min(times[i].fwd_s / div for times in per_device)
        b = min(times[i].bwd_s / div for times in per_device)
        fmin.append(f)
        bmin.append(b + (f if full and lay.kind == "block" else 0.0))
    tp_comm = sum(layer_compute_s(workload, costs, c.micro_batch_size, c.tp)) - sum(
        min((times[i].fwd_s + times[i].bwd_s) / costs.compute.tp_divisor(lay, c.tp)
            for times in per_device)
        for i, lay in enumerate(workload.layers))
    fwd, bwd = sum(fmin), sum(bmin)
    if zero_stage >= 2 and c.dp > 1:
        prec = stage_precision(workload, stage, costs)
        dp_ranks = [r for k, r in enumerate(stage.ranks) if k % c.tp == 0]
        link, _, _ = group_link(costs, dp_ranks)
        cap = prec.capture_bytes / nic_share(costs, dp_ranks)
        split = costs.memory_layers(workload)
        elems = [shard_bytes(split, split[i].param_bytes, i, c.tp) / cap for i in range(n)]
        rs = sum(costs.comm.time_s("reduce_scatter", e * prec.grad_bytes, c.dp, link)
                 for e in elems)
        if zero_stage >= 3:
            ag = [costs.comm.time_s("allgather", e * prec.weight_bytes, c.dp, link)
                  for e in elems]
            fwd = ag[0] + sum(max(f, a) for f, a in zip(fmin, ag[1:] + [0.0]))
            back = list(reversed(ag))
            bwd = back[0] + sum(max(b, a) for b, a in zip(reversed(bmin), back[1:] + [0.0]))
        bwd = max(bwd, rs)
    out = fwd + bwd + max(tp_comm, 0.0)
    costs.memo[key] = out
    return out
