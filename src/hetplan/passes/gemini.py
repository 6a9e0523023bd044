"""Pass ``gemini``: in-memory checkpoints in peers' CPU memory (thesis ch. 6).

Owns ``plan.checkpointing`` (:mod:`hetplan.ir.plan_checkpointing`). It runs last, on the
finished plan (``refines``: only the finalists of layout search pay for it), and changes
nothing the simulator prices: checkpoint traffic is placed in the network's idle time, and
whatever does not fit is reported as a slowdown and amortised by checkpointing less often.

1. **Placement** over the plan's nodes: :func:`hetplan.algorithms.gemini.place` (Algorithm
   6.1). Rank ``r`` (``l``-th rank of its node) is held by the ``l``-th rank of each holder
   node (``l`` modulo that node's ranks when nodes differ in size), so the copies of a
   pipeline stage or a tensor-parallel shard land on other nodes, where no peer holds them.
2. **State size** per rank: parameters plus master weights and optimizer state, from the
   memory model (the evaluation the simulator makes).
3. **Idle spans**: :func:`hetplan.cost_models.idle_spans.node_idle_spans` simulates the plan
   and returns each node's idle intervals on the inter-node network; a rank uses the spans
   idle on its node and on all its holders' nodes.
4. **Schedule**: :func:`hetplan.algorithms.gemini.partition_checkpoint` (Algorithm 6.2,
   fixed) per distinct (state size, spans), with ``chunk_time(s) = α + s / bw``: ``α`` the
   inter-node latency, ``bw`` the node's inter-node bandwidth shared by its ranks (they send
   at once).
5. **Frequency**: every iteration when the schedule fits; otherwise every ``K`` iterations
   with the overflow amortised to at most ``max_slowdown``
   (:func:`~hetplan.algorithms.gemini.checkpoint_every`). The storage fallback
   (``torch.distributed.checkpoint``) every ``storage_every_iters``: ``storage_interval_s``
   (default 3 h, the thesis's) in iterations, never more often than storage can absorb.
6. **Predictions** against the remote-storage baseline (HighFreq: all ranks' states to
   storage at ``storage_bandwidth_gbps``, every ``⌈t_ckpt / T_iter⌉`` iterations, retrieved
   from storage): checkpoint time, interval, retrieval time, slowdown and Eq. 6.1's wasted
   time, per failure and per day (the nodes' ``failure_rate_per_hour``). Recovery
   probability for ``k = 1 .. min(n, 2m)`` failed nodes, exact, with Eq. 6.4 beside it.
7. **CPU memory**: each node keeps two buffers (complete and in progress) of its own ranks'
   states and of the states it holds; with ``cpu_memory_gib`` in the spec this must fit
   (:class:`~hetplan.errors.InfeasiblePlanError` otherwise).

Complexity: one simulation, O(n · m) placement, O(chunks) partition per distinct schedule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from hetplan.algorithms import gemini as alg
from hetplan.cost_models.idle_spans import intersect_spans, node_idle_spans
from hetplan.errors import InfeasiblePlanError, SpecError
from hetplan.ir.cluster import DEFAULT_STORAGE_BANDWIDTH_GBPS, ClusterSpec, NodeSpec
from hetplan.ir.plan import Plan
from hetplan.ir.plan_checkpointing import (
    CheckpointCost,
    Checkpointing,
    ChunkSchedule,
    IdleSpan,
    PlannedChunk,
    RankCheckpoint,
    RecoveryOdds,
)
from hetplan.passes.base import PassContext, PassResult

__all__ = ["Gemini"]

Spans = tuple[tuple[float, float], ...]
MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class Gemini:
    """Plan Gemini checkpoints (see module docstring).

    Options:
        replicas: m, copies of every rank's state, its own node's included (>= 1).
        placement: ``mixed`` (Algorithm 6.1), ``group`` or ``ring``.
        buffer_mb: R, the device buffer reserved for checkpoint traffic (MiB; thesis 128).
        sub_buffers: p, its parts (thesis 4); a chunk is at most R / p.
        mu: the share of each simulated idle span trusted to be idle, in (0, 1].
        max_slowdown: the slowdown (0.03 = 3 %) above which checkpoints are taken less often.
        storage_interval_s: seconds between fallback saves to storage (thesis: 3 h).
    """

    name: ClassVar[str] = "gemini"
    sections: ClassVar[tuple[str, ...]] = ("checkpointing",)
    refines: ClassVar[bool] = True

    replicas: int = 2
    placement: str = "mixed"
    buffer_mb: float = 128.0
    sub_buffers: int = 4
    mu: float = 0.8
    max_slowdown: float = 0.03
    storage_interval_s: float = 10800.0

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise SpecError(f"gemini{{replicas={self.replicas}}}: replicas must be >= 1 "
                            "(2 keeps one copy on another node)")
        if self.placement not in ("mixed", "group", "ring"):
            raise SpecError(f"gemini{{placement={self.placement}}}: use mixed, group or ring")
        if not 0 < self.buffer_mb <= 1 << 20 or not 1 <= self.sub_buffers <= 1024:
            raise SpecError(f"gemini: buffer-mb must be in (0, 1048576] and sub-buffers in "
                            f"[1, 1024], got {self.buffer_mb} and {self.sub_buffers}")
        if not 0 < self.mu <= 1:
            raise SpecError(f"gemini{{mu={self.mu}}}: mu must be in (0, 1]")
        if not 0 < self.max_slowdown <= 10 or not 0 < self.storage_interval_s <= 1e9:
            raise SpecError("gemini: max-slowdown must be in (0, 10] and storage-interval-s "
                            "in (0, 1e9]")

    def run(self, plan: Plan, ctx: PassContext) -> PassResult:
        costs, lay, cluster = ctx.costs, ctx.layout, ctx.cluster
        world = lay.num_ranks
        node_of = [costs.devices[r].node_index for r in range(world)]
        nodes = sorted(set(node_of))
        index = {n: i for i, n in enumerate(nodes)}  # plan node ids are 0..n-1
        n = len(nodes)
        if self.replicas > n:
            raise SpecError(f"gemini{{replicas={self.replicas}}}: the plan spans {n} node(s); "
                            f"at most {n} replicas can sit on distinct nodes; lower --replicas")
        placement = self.placement
        if placement == "group" and n % self.replicas:
            raise SpecError(f"gemini{{placement=group}}: {self.replicas} replicas do not "
                            f"divide {n} nodes; use placement=mixed")
        holders_n = alg.place(n, self.replicas, placement)  # type: ignore[arg-type]
        groups, strategy = alg.placement_groups(n, self.replicas)
        ranks_on: list[list[int]] = [[] for _ in range(n)]
        for r in range(world):
            ranks_on[index[node_of[r]]].append(r)

        idle = node_idle_spans(ctx.workload, lay, plan.stages, plan.gradient_sync, costs,
                               tensor_parallel=plan.tensor_parallel)
        ev = idle.evaluation
        iteration_s = ev.iteration_s
        state = [m.params + m.optimizer for m in ev.memory]

        link = cluster.inter_node
        alpha_s = link.latency_us * 1e-6 if link is not None else 0.0
        node_bw = link.bandwidth_gbps * 1e9 / 8 if link is not None else math.inf
        buffer_bytes = int(self.buffer_mb * MiB)

        per_rank = []
        for r in range(world):
            ni = index[node_of[r]]
            local = ranks_on[ni].index(r)
            holders = tuple(ranks_on[h][local % len(ranks_on[h])] for h in holders_n[ni])
            bw = node_bw / len(ranks_on[ni])
            spans = intersect_spans([idle.idle[nodes[h]] for h in holders_n[ni]])
            per_rank.append((ni, holders, bw, spans))
        every = 1
        schedules, overflow, done_s, rows = self._schedules(per_rank, state, alpha_s,
                                                            buffer_bytes, iteration_s, 1)
        worst_overflow = max(overflow.values(), default=0.0)
        if iteration_s > 0 and worst_overflow > self.max_slowdown * iteration_s:
            every = self._spread(per_rank, state, alpha_s, buffer_bytes, iteration_s)
            if every > 1:
                schedules, overflow, done_s, rows = self._schedules(
                    per_rank, state, alpha_s, buffer_bytes, iteration_s, every)
            else:  # no idle time to spread into: amortise the overflow instead
                every = alg.checkpoint_every(iteration_s, worst_overflow, self.max_slowdown)
            worst_overflow = max(overflow.values(), default=0.0)
        rank_rows = rows
        cpu_checked = self._check_cpu_memory(cluster, nodes, ranks_on, rank_rows, index,
                                             node_of)
        t_ckpt = max(done_s.values(), default=0.0)
        # retrieval after a node is replaced: the largest state fetched from a holder
        peer_bw = min((node_bw / len(ranks_on[i]) for i in range(n)), default=math.inf)
        t_rtvl = max((alg.chunk_time(s, alpha_s, peer_bw) for s in state), default=0.0)
        failures_per_day = _failures_per_day(cluster, nodes)

        storage_gbps = cluster.storage_bandwidth_gbps
        assumed = storage_gbps is None
        storage_gbps = DEFAULT_STORAGE_BANDWIDTH_GBPS if storage_gbps is None else storage_gbps
        t_store = sum(state) / (storage_gbps * 1e9 / 8)
        every_store = max(1, math.ceil(t_store / iteration_s - 1e-12)) if iteration_s else 1
        storage_every = max(every_store,
                            math.ceil(self.storage_interval_s / max(iteration_s, 1e-12)))

        gemini = _cost("gemini", t_ckpt, every, iteration_s, t_rtvl,
                       worst_overflow / (every * iteration_s) if iteration_s else 0.0,
                       failures_per_day)
        baseline = _cost("remote-storage", t_store, every_store, iteration_s, t_store, 0.0,
                         failures_per_day)
        recovery = []
        for k in range(1, min(n, 2 * self.replicas) + 1):
            p = alg.recovery_probability(n, self.replicas, k, placement)  # type: ignore[arg-type]
            bound = (float(alg.eq64_bound(n, self.replicas, k))
                     if n % self.replicas == 0 else None)
            recovery.append(RecoveryOdds(failed_nodes=k, exact=f"{p.numerator}/{p.denominator}",
                                         probability=float(p), eq64_bound=bound))
        section = Checkpointing(
            replicas=self.replicas,
            placement=placement if placement != "mixed" else strategy,  # type: ignore[arg-type]
            node_groups=groups, node_holders=holders_n, ranks=tuple(rank_rows),
            buffer_bytes=buffer_bytes, sub_buffers=self.sub_buffers, mu=self.mu,
            chunk_alpha_ms=alpha_s * 1e3,
            chunk_bandwidth_gbps=(peer_bw * 8 / 1e9) if math.isfinite(peer_bw) else 0.0,
            schedules=tuple(schedules), every_iters=every,
            storage_every_iters=storage_every, storage_bandwidth_gbps=storage_gbps,
            storage_bandwidth_assumed=assumed, cpu_memory_checked=cpu_checked,
            iteration_ms=iteration_s * 1e3, recovery=tuple(recovery), gemini=gemini,
            baseline=baseline)
        new = plan.model_copy(update={"checkpointing": section})
        notes = (f"m={self.replicas} {section.placement} over {n} nodes; "
                 f"checkpoint {t_ckpt * 1e3:.1f} ms every {every} iteration(s) vs storage "
                 f"{t_store * 1e3:.1f} ms every {every_store}",)
        return PassResult(new, True, notes)

    def _schedules(self, per_rank: list[tuple[int, tuple[int, ...], float, Spans]],
                   state: list[int], alpha_s: float, buffer_bytes: int, iteration_s: float,
                   every: int) -> tuple[list[ChunkSchedule], dict[int, float],
                                        dict[int, float], list[RankCheckpoint]]:
        """One schedule per distinct (state size, spans) over ``every`` iterations' spans;
        each schedule's overflow time and finish time; the rank rows."""
        found: dict[tuple[int, Spans, float], ChunkSchedule] = {}
        overflow: dict[int, float] = {}
        done: dict[int, float] = {}
        rows = []
        for r, (ni, holders, bw, spans) in enumerate(per_rank):
            key = (state[r], spans, bw)
            if key not in found:
                sid = len(found)
                over_k = _repeat(spans, every, iteration_s)
                sch = found[key] = self._schedule(sid, state[r], over_k, alpha_s, bw,
                                                  buffer_bytes)
                overflow[sid] = sch.overflow_ms * 1e-3
                done[sid] = _finish_s(sch, over_k, alpha_s, bw, every * iteration_s)
            rows.append(RankCheckpoint(rank=r, node=ni, state_bytes=state[r], holders=holders,
                                       schedule=found[key].id))
        return list(found.values()), overflow, done, rows

    def _spread(self, per_rank: list[tuple[int, tuple[int, ...], float, Spans]],
                state: list[int], alpha_s: float, buffer_bytes: int,
                iteration_s: float) -> int:
        """The fewest iterations whose idle spans carry every rank's checkpoint without
        overflow (1 when some rank has no idle time at all: nothing to spread into)."""
        need = 1
        for r, (_, _, bw, spans) in enumerate(per_rank):
            idle_s = self.mu * sum(b - a for a, b in spans)
            if idle_s <= 0 or not math.isfinite(bw):
                return 1
            chunks = math.ceil(state[r] / (buffer_bytes / self.sub_buffers))
            send_s = (self.replicas - 1) * (state[r] / bw + chunks * alpha_s)
            need = max(need, math.ceil(send_s / idle_s))
        for k in range(need, need + 64):  # chunk edges waste a little of each span
            if all(self._schedule(0, state[r], _repeat(sp, k, iteration_s), alpha_s, bw,
                                  buffer_bytes).overflow_bytes == 0
                   for r, (_, _, bw, sp) in enumerate(per_rank)):
                return k
        return need + 64

    def _schedule(self, sid: int, state_bytes: int, spans: tuple[tuple[float, float], ...],
                  alpha_s: float, bw: float, buffer_bytes: int) -> ChunkSchedule:
        durations = [b - a for a, b in spans]
        chunks = alg.partition_checkpoint(
            durations, ckpt_bytes=state_bytes, remote_copies=self.replicas - 1,
            buffer_bytes=buffer_bytes, sub_buffers=self.sub_buffers, alpha_s=alpha_s,
            bw=bw if math.isfinite(bw) else 1e30, mu=self.mu, unit=1)
        planned = tuple(PlannedChunk(span=c.span, replica=c.replica, offset=int(c.offset),
                                     size=int(c.size)) for c in chunks)
        over = [c for c in planned if c.span == len(spans)]
        return ChunkSchedule(
            id=sid, state_bytes=state_bytes,
            spans=tuple(IdleSpan(start_ms=a * 1e3, duration_ms=(b - a) * 1e3)
                        for a, b in spans),
            chunks=planned, overflow_bytes=sum(c.size for c in over),
            overflow_ms=sum(alg.chunk_time(c.size, alpha_s, bw) for c in over) * 1e3
            if math.isfinite(bw) else 0.0)

    def _check_cpu_memory(self, cluster: ClusterSpec, nodes: list[int], ranks_on: list[list[int]],
                          rows: list[RankCheckpoint], index: dict[int, int],
                          node_of: list[int]) -> bool:
        """Two buffers of every state a node keeps must fit its CPU memory, when known."""
        kept = [0] * len(nodes)
        for row in rows:
            for h in row.holders:
                kept[index[node_of[h]]] += 2 * row.state_bytes
        limits = [_node_specs(cluster)[nd].cpu_memory_gib for nd in nodes]
        if any(x is None for x in limits):
            return False
        for i, (need, cap) in enumerate(zip(kept, limits, strict=True)):
            assert cap is not None
            if need > cap * GiB:
                raise InfeasiblePlanError(
                    f"gemini: node {cluster.node_names()[nodes[i]]!r} must keep "
                    f"{need / GiB:.2f} GiB of checkpoints (2 buffers x {self.replicas} "
                    f"replicas of {len(ranks_on[i])} rank(s)' states) but has "
                    f"cpu_memory_gib={cap}; lower --replicas or use nodes with more memory")
        return True


def _repeat(spans: Spans, every: int, iteration_s: float) -> Spans:
    """``spans`` of ``every`` consecutive iterations, times from the first one's start."""
    return tuple((a + i * iteration_s, b + i * iteration_s) for i in range(every)
                 for a, b in spans)


def _finish_s(sch: ChunkSchedule, spans: tuple[tuple[float, float], ...], alpha_s: float,
              bw: float, iteration_s: float) -> float:
    """When the last chunk of a schedule ends, from the start of the iteration (overflow
    chunks run after the iteration's end, before the next step)."""
    if not math.isfinite(bw) or not sch.chunks:
        return 0.0
    used: dict[int, float] = {}
    end = 0.0
    for c in sch.chunks:
        start = spans[c.span][0] if c.span < len(spans) else iteration_s
        used[c.span] = used.get(c.span, 0.0) + alg.chunk_time(c.size, alpha_s, bw)
        end = max(end, start + used[c.span])
    return end


def _node_specs(cluster: ClusterSpec) -> list[NodeSpec]:
    """The node group of every node, by node index."""
    return [g for g in cluster.nodes for _ in range(g.count)]


def _failures_per_day(cluster: ClusterSpec, nodes: list[int]) -> float | None:
    rates = [_node_specs(cluster)[nd].failure_rate_per_hour for nd in nodes]
    if any(r is None for r in rates):
        return None
    return sum(r for r in rates if r is not None) * 24


def _cost(name: str, t_ckpt: float, every: int, iteration_s: float, t_rtvl: float,
          slowdown: float, failures_per_day: float | None) -> CheckpointCost:
    interval = max(every * iteration_s, t_ckpt)  # Eq. 6.2
    wasted = alg.expected_wasted_time(t_ckpt, interval, t_rtvl)
    return CheckpointCost(
        name=name, checkpoint_ms=t_ckpt * 1e3, every_iters=every, retrieval_ms=t_rtvl * 1e3,
        slowdown=slowdown, wasted_ms=wasted * 1e3,
        wasted_ms_per_day=None if failures_per_day is None
        else wasted * failures_per_day * 1e3)
