"""Parallel layouts to consider: (dp, pp, tp, micro-batch size) over the whole cluster.

Rules (each prunes layouts that cannot be right, not ones that merely look slow):

- every device is used: ``dp · pp · tp = world size``;
- ``tp`` divides the devices of every node (a TP group never crosses nodes: its all-reduces
  run once per layer) and is ≤ ``max_tp``; ``tp > 1`` only if the model has Megatron pairs;
- ``pp`` ≤ the number of layers;
- the global batch splits evenly over replicas: ``global_batch % dp == 0``; the micro-batch
  size divides the per-replica batch; candidates are its powers of two and itself;
- a pipeline has at least as many micro-batches as stages (fewer leaves stages idle for the
  whole iteration, and torch's 1F1B schedules refuse it);
- at most ``MAX_MICRO_BATCHES`` (65,536) micro-batches, the most a plan may have.

The order of the returned list is deterministic (sorted by dp, pp, tp, micro-batch size).
"""

from __future__ import annotations

from dataclasses import dataclass

from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan_sections import MAX_MICRO_BATCHES, Layout, WorkloadSummary

__all__ = ["LayoutCandidate", "enumerate_layouts", "divisors"]


@dataclass(frozen=True, order=True)
class LayoutCandidate:
    dp: int
    pp: int
    tp: int
    micro_batch_size: int
    micro_batches: int

    def to_layout(self, global_batch: int, schedule: str, virtual_stages: int = 1) -> Layout:
        return Layout(
            dp=self.dp,
            pp=self.pp,
            tp=self.tp,
            micro_batches=self.micro_batches,
            micro_batch_size=self.micro_batch_size,
            global_batch_size=global_batch,
            schedule=schedule,  # type: ignore[arg-type]
            virtual_stages=virtual_stages,
        )

    def describe(self) -> str:
        return (f"dp={self.dp} pp={self.pp} tp={self.tp} mb={self.micro_batch_size}"
                f"×{self.micro_batches}")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _micro_batch_sizes(per_replica: int) -> list[int]:
    sizes = {per_replica}
    p = 1
    while p < per_replica:
        if per_replica % p == 0:
            sizes.add(p)
        p *= 2
    return sorted(sizes)


def enumerate_layouts(
    workload: WorkloadSummary,
    cluster: ClusterSpec,
    global_batch: int,
    *,
    max_tp: int = 8,
    dp: int | None = None,
    pp: int | None = None,
    tp: int | None = None,
    micro_batch_size: int | None = None,
) -> list[LayoutCandidate]:
    """All layouts the rules allow; ``dp``/``pp``/``tp``/``micro_batch_size`` pin a value."""
    world = cluster.world_size
    node_sizes = [sum(g.count for g in node.devices) for node in cluster.nodes]
    has_pairs = any(layer.tp_pairs for layer in workload.layers)
    out = []
    for t in divisors(world):
        if t > max_tp or any(size % t for size in node_sizes) or (t > 1 and not has_pairs):
            continue
        if tp is not None and t != tp:
            continue
        for p in divisors(world // t):
            if p > len(workload.layers) or (pp is not None and p != pp):
                continue
            d = world // (t * p)
            if (dp is not None and d != dp) or global_batch % d:
                continue
            per_replica = global_batch // d
            for mb in _micro_batch_sizes(per_replica):
                if micro_batch_size is not None and mb != micro_batch_size:
                    continue
                if p > 1 and per_replica // mb < p:
                    continue  # a pipeline needs at least one micro-batch per stage
                if per_replica // mb > MAX_MICRO_BATCHES:
                    continue
                out.append(LayoutCandidate(d, p, t, mb, per_replica // mb))
    return sorted(out)
