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
- interleaved 1F1B: ``virtual_stages`` ``v`` in 2..4 with ``pp · v`` at most the number of
  layers, and a micro-batch count divisible by ``pp`` (Megatron's schedule needs it); a layout
  without a pipeline runs ``v = 1``; the ``auto`` schedule searches 1F1B (``v = 1``) beside
  them, and each candidate runs the schedule its ``v`` names
  (:meth:`LayoutCandidate.schedule_for`);
- Chimera: a pipeline of an even ``pp`` with an even micro-batch count (its two directions
  split them half/half) and ``tp = 1`` (Chimera composes with neither tensor parallelism
  nor ZeRO-2/3, whose collectives inside each stage's forward and backward the two
  directions, running different stages at once, would mismatch: ``docs/decisions.md``,
  "Chimera: what is priced"; ``compile`` keeps its ZeRO ladder at 0 and 1); a layout
  without a pipeline has no schedule to run and is written with ``1f1b`` (Chimera's two
  directions need at least two stages);
- sequence parallelism whenever ``tp > 1``: it replaces each TP all-reduce by a
  reduce-scatter and an all-gather that cost the same (ring: ``2(n-1)/n`` of the bytes
  either way) and divides the activations outside the TP regions by ``tp``, so it is never
  worse in the model (a dominated choice pruned, not searched).

The ZeRO stage is not enumerated here: ``compile`` chooses it per layout (the cheapest that
fits, :func:`~hetplan.optimizer.compile.compile`).

The order of the returned list is deterministic (sorted by dp, pp, tp, micro-batch size,
micro-batches, virtual stages).
"""

from __future__ import annotations

from dataclasses import dataclass

from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan_sections import MAX_MICRO_BATCHES, Layout, WorkloadSummary

__all__ = ["LayoutCandidate", "enumerate_layouts", "divisors", "pinned_degree_problems"]


@dataclass(frozen=True, order=True)
class LayoutCandidate:
    """One layout to try: the degrees, micro-batching, interleaved chunks, sequence
    parallelism and ZeRO stage (see :class:`~hetplan.ir.plan_sections.Layout`)."""

    dp: int
    pp: int
    tp: int
    micro_batch_size: int
    micro_batches: int
    virtual_stages: int = 1
    sequence_parallel: bool = False
    zero_stage: int = 0

    def schedule_for(self, schedule: str) -> str:
        """The schedule this layout runs under the compile's ``schedule`` option: ``auto``
        is interleaved 1F1B with interleaved chunks, plain 1F1B without; Chimera and
        interleaved 1F1B without a pipeline are 1F1B (no directions to split, no chunks to
        interleave: the plan validator refuses interleaved 1F1B with one chunk)."""
        if schedule == "auto":
            return "interleaved-1f1b" if self.virtual_stages > 1 else "1f1b"
        if schedule in ("chimera", "interleaved-1f1b") and self.pp == 1:
            return "1f1b"
        return schedule

    def to_layout(self, global_batch: int, schedule: str) -> Layout:
        schedule = self.schedule_for(schedule)
        return Layout(
            dp=self.dp,
            pp=self.pp,
            tp=self.tp,
            micro_batches=self.micro_batches,
            micro_batch_size=self.micro_batch_size,
            global_batch_size=global_batch,
            schedule=schedule,  # type: ignore[arg-type]
            virtual_stages=self.virtual_stages,
            sequence_parallel=self.sequence_parallel,
            zero_stage=self.zero_stage,  # type: ignore[arg-type]
        )

    def describe(self) -> str:
        extra = "".join((f" v={self.virtual_stages}" if self.virtual_stages > 1 else "",
                         " sp" if self.sequence_parallel else "",
                         f" zero={self.zero_stage}" if self.zero_stage else ""))
        return (f"dp={self.dp} pp={self.pp} tp={self.tp} mb={self.micro_batch_size}"
                f"×{self.micro_batches}{extra}")


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
    schedule: str = "1f1b",
    virtual_stages: int | None = None,
    sequence_parallel: bool | None = None,
) -> list[LayoutCandidate]:
    """All layouts the rules allow; ``dp``/``pp``/``tp``/``micro_batch_size``/
    ``virtual_stages``/``sequence_parallel`` pin a value (``virtual_stages`` applies to
    pipelines of the interleaved schedule)."""
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
                m = per_replica // mb
                if m > MAX_MICRO_BATCHES:
                    continue
                if schedule == "chimera" and p > 1 and (p % 2 or m % 2 or t > 1):
                    continue  # two directions: micro-batches split half/half, no TP
                sp = t > 1 if sequence_parallel is None else sequence_parallel and t > 1
                for v in _chunk_counts(schedule, p, m, len(workload.layers), virtual_stages):
                    out.append(LayoutCandidate(d, p, t, mb, m, v, sp))
    return sorted(out)


def pinned_degree_problems(workload: WorkloadSummary, cluster: ClusterSpec, *,
                           dp: int | None, pp: int | None, tp: int | None,
                           max_tp: int = 8) -> list[str]:
    """Why pinned ``dp``/``pp``/``tp`` leave :func:`enumerate_layouts` nothing, whatever the
    batch: the rules above that involve only the degrees, the cluster and the model, one
    line each naming the pinned value and the values allowed (empty: the degrees can work,
    and the batch or micro-batch rules are the binding ones)."""
    world = cluster.world_size
    node_sizes = sorted({sum(g.count for g in node.devices) for node in cluster.nodes})
    out = []
    pinned = {"dp": dp, "pp": pp, "tp": tp}
    product = 1
    for value in pinned.values():
        product *= value or 1
    if world % product:
        named = " x ".join(f"{k}={v}" for k, v in pinned.items() if v is not None)
        ranks = named if named.count("=") == 1 else f"{named} = {product} ranks"
        out.append(f"{ranks} does not divide the {world} devices of cluster {cluster.name!r} "
                   f"(a plan uses every device); pin degrees whose product divides {world}")
    if tp is not None and tp > 1:
        allowed = [t for t in divisors(world)
                   if t <= max_tp and not any(size % t for size in node_sizes)]
        if tp not in allowed:
            out.append(f"tp={tp}: a tensor-parallel group stays inside one node and has at "
                       f"most {max_tp} ranks; with nodes of {node_sizes} devices, tp may be "
                       f"{', '.join(map(str, allowed))}")
        if not any(layer.tp_pairs for layer in workload.layers):
            out.append(f"tp={tp}: the model has no column/row linear pairs to split; use tp=1")
    if pp is not None and pp > len(workload.layers):
        out.append(f"pp={pp}: more pipeline stages than the model's {len(workload.layers)} "
                   f"layers; use pp <= {len(workload.layers)}")
    free = [k for k, v in pinned.items() if v is None]
    if not out and len(free) == 1 and free[0] != "dp":
        # two pinned degrees fix the third (a plan uses every device): dp=2 pp=1 on 4
        # devices means tp=2, which a model without linear pairs cannot have
        implied = {**pinned, free[0]: world // product}
        named = " x ".join(f"{k}={v}" for k, v in pinned.items() if v is not None)
        out += [f"{named} on the {world} devices of cluster {cluster.name!r} leaves "
                f"{free[0]}={world // product} (a plan uses every device), but {why}; or "
                f"pin other degrees (their product with {free[0]} is {world})"
                for why in pinned_degree_problems(workload, cluster, max_tp=max_tp,
                                                  **implied)]
    return out


def _chunk_counts(schedule: str, pp: int, micro_batches: int, layers: int,
                  pinned: int | None) -> list[int]:
    """The interleaved chunk counts ``v`` a pipeline may use (``[1]`` without one); under
    ``auto`` one chunk (1F1B) and the interleaved counts."""
    if schedule not in ("interleaved-1f1b", "auto") or pp == 1:
        return [1]
    plain = [1] if schedule == "auto" and pinned is None else []
    if micro_batches % pp:
        return plain
    options = [pinned] if pinned is not None else [2, 3, 4]
    return plain + [v for v in options if v >= 2 and pp * v <= layers]
