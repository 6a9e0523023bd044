"""The price of a sparse gradient's sync (Zen, thesis ch. 3), as simulator ops.

One :class:`~hetplan.ir.plan_sparse.SparseTensorSync` becomes one sync unit of the stage's
data-parallel timeline (:func:`hetplan.cost_models.evaluate.evaluate` step 3), with the ops the
chapter describes, in order:

- ``zen``: ``hash`` (Algorithm 3.2, GPU), ``push`` (all-to-all of the COO partitions; its time
  is set by the most loaded partition: the bytes are ``imbalance`` times the balanced share,
  ``imbalance`` Theorem 3.2's ``1 + sqrt(n log n / nnz)``), ``aggregate`` (GPU), ``pull``
  (all-gather of the aggregated partitions as hash bitmap + values, or COO) and ``decode``
  (GPU);
- ``agsparse``: one all-gather of every rank's COO tensor;
- ``dense``: the fp32 all-reduce of the whole table.

Collective times come from the cost model's alpha–beta lines (:mod:`.comm`, profiled where
measured), so a sparse unit and a dense one are priced on the same link; the GPU phases are
memory passes at the device's memory bandwidth (:func:`hetplan.algorithms.zen.zen_phases`).
"""

from __future__ import annotations

import math
from typing import cast

from hetplan.algorithms.dp_types import GPU, Op
from hetplan.algorithms.zen import SparseStats, ZenLink, zen_phases
from hetplan.cost_models.comm import LinkRef
from hetplan.cost_models.costs import CostModel
from hetplan.ir.cluster import Device
from hetplan.ir.plan_sparse import SparseStatsRecord, SparseTensorSync

__all__ = ["expected_imbalance", "scheme_seconds", "sparse_ops", "stats_of"]


def stats_of(rows: int, row_elems: int, rec: SparseStatsRecord,
             value_bytes: int = 4) -> SparseStats:
    """The pure algorithm's statistics of a plan record."""
    return SparseStats(rows, row_elems, rec.density, max(rec.density, rec.density_n),
                       rec.skew, value_bytes=value_bytes)


def expected_imbalance(stats: SparseStats, n: int) -> float:
    """Theorem 3.2's push imbalance bound ``1 + sqrt(n log n / nnz)`` (constant 1)."""
    nnz = stats.density * stats.units
    if n <= 1 or nnz <= 0:
        return 1.0
    return 1.0 + math.sqrt(n * math.log(n) / nnz)


def sparse_ops(entry: SparseTensorSync, n: int, costs: CostModel, dev: Device, link: str,
               channel: str, scheme: str | None = None) -> tuple[Op, ...]:
    """The simulator ops of syncing ``entry`` with ``scheme`` (default its own) over a
    data-parallel group of ``n`` ranks on ``link``; communication runs on ``channel``."""
    stats = stats_of(entry.rows, entry.row_elems, entry.stats)
    scheme = scheme or entry.scheme
    comm, lk = costs.comm, cast(LinkRef, link)
    if n <= 1:
        return ()
    if scheme == "dense":
        return (Op(channel, comm.time_s("allreduce", stats.dense_bytes, n, lk), "allreduce"),)
    if scheme == "agsparse":
        gathered = n * stats.coo_bytes(stats.density)
        return (Op(channel, comm.time_s("allgather", gathered, n, lk), "allgather-coo"),)
    imb = expected_imbalance(stats, n)
    phases = zen_phases(stats, n, ZenLink(1.0, mem_bytes_per_s=dev.mem_bandwidth_bytes_per_s),
                        imb, entry.pull)
    push = imb * stats.coo_bytes(stats.density)
    value_n = stats.density_n * stats.units * stats.unit_elems * stats.value_bytes
    pull = stats.coo_bytes(stats.density_n) if entry.pull == "coo" else value_n + stats.units / 8
    return (
        Op(GPU, phases["hash"], "zen-hash"),
        Op(channel, comm.time_s("alltoall", push, n, lk), "zen-push"),
        Op(GPU, phases["aggregate"], "zen-aggregate"),
        Op(channel, comm.time_s("allgather", pull, n, lk), "zen-pull"),
        Op(GPU, phases["decode"], "zen-decode"),
    )


def scheme_seconds(entry: SparseTensorSync, n: int, costs: CostModel, dev: Device,
                   link: str) -> dict[str, float]:
    """The sync time of ``entry`` under each executable scheme (``dense``, ``agsparse``,
    ``zen``), as the sum of its ops (no overlap with backprop: the pass's first screen)."""
    return {s: sum(op.duration_s for op in sparse_ops(entry, n, costs, dev, link, "net", s))
            for s in ("dense", "agsparse", "zen")}
