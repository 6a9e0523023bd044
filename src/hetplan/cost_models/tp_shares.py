"""Compute time of a pipeline stage under uneven tensor-parallel shards and resizing roles.

:func:`~hetplan.cost_models.evaluate.evaluate` splits a layer with Megatron pairs evenly
``tp`` ways. When the plan's ``tensor_parallel`` section gives per-rank shard sizes (the
``tp-resizing`` pass) or controller roles with a pruning ratio, this module replaces that:

* **A rank's share of a layer** is the feature-weighted mean of its shard fractions over the
  group's listed linears inside the layer (a linear belongs to the layer whose name is a
  dotted prefix of the linear's name); layers without listed linears are split evenly. The
  whole layer time scales with the share, as in the even model (which divides the whole
  layer by ``tp``).
* **Roles** (the controller's expected effect, ``research/zero_resizing.md`` §2.3, §3.4):
  a ``resize`` or ``migrate_src`` rank computes ``1 − γ`` of its share (a ``migrate_src``
  rank sends ``γ·β`` of it and prunes ``γ·(1−β)``); the migrated work is spread evenly over
  the group's ``migrate_dst`` ranks, or every other rank when none is listed — the runtime's
  reading, :func:`~hetplan.algorithms.zero_resizing.plan_roles`. Migration's
  broadcast/reduce traffic is not modelled.
* **Gradient sync and optimizer step** use the largest rank share of each layer: the DP group
  of the largest shard syncs the most bytes and its optimizer step updates the most (the
  simulator follows one DP group per stage).
* **Synchronisation.** Every TP layer ends in an all-reduce, so each layer's forward (and
  backward) time is the *slowest rank's* time for its own share, and the stage time is the
  sum over layers of those maxima (not the maximum over ranks of their sums). A layer
  without pairs runs replicated: the slowest device's time.

Deterministic and free of torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from hetplan.algorithms.zero_resizing import plan_roles
from hetplan.cost_models.costs import CostModel
from hetplan.ir.plan_sections import Stage, TensorParallel, TPGroup, WorkloadSummary

__all__ = ["stage_compute", "rank_shares", "rank_layer_shares", "max_layer_shares",
           "layer_of_linear"]


def layer_of_linear(layer_names: Sequence[str], linear: str) -> int | None:
    """Index of the layer owning ``linear`` (the longest layer name that is a dotted prefix
    of it), or None."""
    best, best_len = None, -1
    for i, name in enumerate(layer_names):
        if (linear.startswith(name + ".") or linear == name) and len(name) > best_len:
            best, best_len = i, len(name)
    return best


def _uneven(group: TPGroup) -> bool:
    return bool(group.linears) or any(r.gamma > 0 for r in group.roles)


def rank_shares(workload: WorkloadSummary, group: TPGroup, first: int, last: int
                ) -> list[list[float]]:
    """``shares[k][i]``: the fraction of TP layer ``first + k`` that the group's ``i``-th rank
    computes, with the roles' pruning and migration applied (see module docstring)."""
    names = [lay.name for lay in workload.layers]
    n = len(group.ranks)
    feats = [[0.0] * n for _ in range(first, last + 1)]
    total = [0.0] * (last - first + 1)
    for lin in group.linears:
        k = layer_of_linear(names, lin.name)
        if k is None or not first <= k <= last:
            continue
        for i, size in enumerate(lin.shard_sizes):
            feats[k - first][i] += size
        total[k - first] += lin.features
    decisions = plan_roles(group)  # the runtime's reading of the roles
    out = []
    for k in range(last - first + 1):
        base = [f / total[k] for f in feats[k]] if total[k] else [1.0 / n] * n
        eff = [b * (1.0 - d.resize - d.migrate) for b, d in zip(base, decisions)]
        for i, d in enumerate(decisions):
            for j in d.receivers:
                eff[j] += base[i] * d.migrate / len(d.receivers)
        out.append(eff)
    return out


def _stage_groups(st: Stage, section: TensorParallel | None) -> list[TPGroup]:
    """The section's TP groups inside stage ``st``."""
    if section is None:
        return []
    in_stage = set(st.ranks)
    # the stage test first: it is cheap and rejects most groups of a deep pipeline
    return [g for g in section.groups if (g.stage is None or g.stage == st.index)
            and set(g.ranks) <= in_stage]


def rank_layer_shares(workload: WorkloadSummary, st: Stage, tp: int,
                      section: TensorParallel | None) -> dict[int, list[float]]:
    """``{rank: share of each layer of the stage}`` for the ranks of groups with listed
    shard sizes (memory: a rank holds its share of the split parameters and activations;
    roles do not change what a rank holds). Layers without pairs get ``1 / tp`` (unused)."""
    if tp <= 1:
        return {}
    out: dict[int, list[float]] = {}
    first, last = st.first_layer, st.last_layer
    for g in _stage_groups(st, section):
        if not g.linears:
            continue
        shares = rank_shares(workload, g.model_copy(update={"roles": ()}), first, last)
        for i, r in enumerate(g.ranks):
            out[r] = [shares[k][i] for k in range(last - first + 1)]
    return out


def max_layer_shares(workload: WorkloadSummary, st: Stage, tp: int,
                     section: TensorParallel | None) -> list[float] | None:
    """The largest rank share of each layer of the stage (the DP group of the largest shard
    syncs the most gradient bytes, and its optimizer step updates the most), or None when
    the stage's shards are even."""
    per_rank = rank_layer_shares(workload, st, tp, section)
    if not per_rank:
        return None
    return [max(v[k] for v in per_rank.values()) for k in range(st.last_layer - st.first_layer
                                                                 + 1)]


def stage_compute(
    workload: WorkloadSummary,
    st: Stage,
    tp: int,
    costs: CostModel,
    mb: int,
    section: TensorParallel | None,
) -> tuple[float, float, list[float]] | None:
    """Per-micro-batch forward and backward compute time of a stage and each layer's
    backward time, under the section's uneven shards and roles; None when the stage's TP
    groups are all even without roles (the caller's even model then applies unchanged).

    Args:
        workload: the workload.
        st: the stage.
        tp: the TP degree of the layout.
        costs: the cost model (devices and per-layer times).
        mb: the micro-batch size.
        section: the plan's tensor-parallel section (or None).
    """
    if tp <= 1 or section is None:
        return None
    groups = _stage_groups(st, section)
    if not any(_uneven(g) for g in groups):
        return None
    covered = {r for g in groups for r in g.ranks}
    rest = [r for r in st.ranks if r not in covered]
    groups += [TPGroup(ranks=tuple(rest[i:i + tp])) for i in range(0, len(rest), tp)]
    first, last = st.first_layer, st.last_layer
    layers = workload.layers[first:last + 1]
    times = {r: costs.compute.layer_times(workload, costs.devices[r], mb)[first:last + 1]
             for r in st.ranks}
    fwd = [0.0] * len(layers)
    bwd = [0.0] * len(layers)
    for g in groups:
        shares = rank_shares(workload, g, first, last)
        for k, lay in enumerate(layers):
            for i, r in enumerate(g.ranks):
                s = shares[k][i] if lay.tp_pairs else 1.0
                fwd[k] = max(fwd[k], times[r][k].fwd_s * s)
                bwd[k] = max(bwd[k], times[r][k].bwd_s * s)
    return sum(fwd), sum(bwd), bwd
