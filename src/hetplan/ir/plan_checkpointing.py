"""The ``checkpointing`` plan section: Gemini's in-memory checkpoints (thesis ch. 6).

Written by the ``gemini`` pass (:mod:`hetplan.passes.gemini`), executed by
:mod:`hetplan.runtime.handlers.checkpointing`. It says:

* **placement**: ``replicas`` (m) copies of every rank's state (parameters, optimizer state,
  RNG state, data position), one in the rank's own node's CPU memory and ``m - 1`` in other
  nodes'; the node groups of Algorithm 6.1 and each node's holders; per rank, the ranks that
  hold its copies (``holders[0]`` is the rank itself);
* **buffers**: ``buffer_bytes`` (R) reserved for checkpoint traffic, in ``sub_buffers`` (p)
  parts; one chunk is at most ``R / p`` bytes;
* **schedule**: per distinct (state size, idle spans) one :class:`ChunkSchedule` — the idle
  spans of the training's network the pass used (times from the start of the iteration) and
  the chunks Algorithm 6.2 placed in them; a chunk in span ``len(spans)`` is overflow (it
  delays the optimizer step);
* **frequency**: ``every_iters`` (CPU checkpoints) and ``storage_every_iters`` (K: the
  ``torch.distributed.checkpoint`` save to storage, the fallback when a whole group is lost);
* **predictions**: recovery probability per number of failed nodes (exact, with Eq. 6.4's
  bound beside it where it applies), and :class:`CheckpointCost` for Gemini and for the
  remote-storage baseline.

Every count is an int, every size in bytes, every time in milliseconds.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.fields import NonNegFloat, NonNegInt, PosInt
from hetplan.ir.plan_sections import Ms, Rank, Ratio

__all__ = ["Checkpointing", "ChunkSchedule", "IdleSpan", "PlannedChunk", "RankCheckpoint",
           "RecoveryOdds", "CheckpointCost", "checkpointing_problems"]

_RERUN = "re-run `hetplan plan --checkpoint gemini`"


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


class IdleSpan(_Section):
    """A stretch of the iteration in which no training traffic uses the nodes' network."""

    start_ms: Ms
    duration_ms: Ms


class PlannedChunk(_Section):
    """Bytes ``[offset, offset + size)`` of remote copy ``replica`` (0-based: it goes to
    ``holders[replica + 1]``), sent in idle span ``span``."""

    span: NonNegInt
    replica: NonNegInt
    offset: NonNegInt
    size: PosInt


class ChunkSchedule(_Section):
    """Algorithm 6.2's output for ranks of one state size over one set of idle spans."""

    id: NonNegInt
    state_bytes: NonNegInt
    spans: tuple[IdleSpan, ...] = ()
    chunks: tuple[PlannedChunk, ...] = ()
    overflow_bytes: NonNegInt = 0
    overflow_ms: Ms = 0.0

    @model_validator(mode="after")
    def _check(self) -> ChunkSchedule:
        for c in self.chunks:
            if c.span > len(self.spans):
                raise ValueError(f"schedule {self.id}: chunk in span {c.span}, but there are "
                                 f"{len(self.spans)} spans (+1 for overflow)")
            if c.offset + c.size > self.state_bytes:
                raise ValueError(f"schedule {self.id}: chunk [{c.offset}, {c.offset + c.size})"
                                 f" beyond the state's {self.state_bytes} bytes")
        return self


class RankCheckpoint(_Section):
    """One rank's checkpoint: its node, state size, holders (itself first) and schedule."""

    rank: Rank
    node: NonNegInt
    state_bytes: NonNegInt
    holders: tuple[Rank, ...] = Field(min_length=1)
    schedule: NonNegInt


class RecoveryOdds(_Section):
    """Probability that ``failed_nodes`` simultaneous node failures leave every checkpoint a
    holder: ``exact`` as a fraction ``"14/15"``, ``probability`` its value, ``eq64_bound``
    Corollary 6.1's bound where ``m`` divides the node count (else None)."""

    failed_nodes: NonNegInt
    exact: str
    probability: Ratio
    eq64_bound: Ratio | None = None


class CheckpointCost(_Section):
    """Predicted cost of one checkpointing scheme.

    ``checkpoint_ms``: time to complete one checkpoint; ``every_iters``: its interval;
    ``retrieval_ms``: time to fetch the newest complete checkpoint after a failure;
    ``slowdown``: iteration-time increase it causes (0.1 = 10 %); ``wasted_ms``: Eq. 6.1's
    expected loss per failure; ``wasted_ms_per_day``: times the cluster's failures per day
    (None when the spec gives no failure rate)."""

    name: str = Field(min_length=1)
    checkpoint_ms: Ms
    every_iters: PosInt
    retrieval_ms: Ms
    slowdown: NonNegFloat
    wasted_ms: Ms
    wasted_ms_per_day: Ms | None = None


class Checkpointing(_Section):
    """Gemini's plan: placement, buffers, idle spans, chunk schedule and predictions (see the
    module docstring)."""

    method: Literal["gemini"] = "gemini"
    replicas: PosInt
    placement: Literal["group", "ring", "mixed"]
    node_groups: tuple[tuple[NonNegInt, ...], ...]
    node_holders: tuple[tuple[NonNegInt, ...], ...]
    ranks: tuple[RankCheckpoint, ...]
    buffer_bytes: PosInt
    sub_buffers: PosInt
    mu: Ratio
    chunk_alpha_ms: Ms
    chunk_bandwidth_gbps: NonNegFloat
    schedules: tuple[ChunkSchedule, ...]
    every_iters: PosInt = 1
    storage_every_iters: PosInt
    storage_bandwidth_gbps: NonNegFloat
    storage_bandwidth_assumed: bool = False
    cpu_memory_checked: bool = False
    iteration_ms: Ms
    recovery: tuple[RecoveryOdds, ...] = ()
    gemini: CheckpointCost
    baseline: CheckpointCost

    @model_validator(mode="after")
    def _check(self) -> Checkpointing:
        if [r.rank for r in self.ranks] != list(range(len(self.ranks))):
            raise ValueError("checkpointing.ranks must list ranks 0..world-1 in order")
        ids = {s.id for s in self.schedules}
        for r in self.ranks:
            if len(r.holders) != min(self.replicas, len(self.node_holders)):
                raise ValueError(f"checkpointing.ranks[{r.rank}]: {len(r.holders)} holders, "
                                 f"expected replicas={self.replicas}")
            if r.holders[0] != r.rank:
                raise ValueError(f"checkpointing.ranks[{r.rank}]: holders[0] must be the rank "
                                 f"itself (its local copy), got {r.holders[0]}")
            if any(h >= len(self.ranks) for h in r.holders):
                raise ValueError(f"checkpointing.ranks[{r.rank}]: holder outside the world")
            if r.schedule not in ids:
                raise ValueError(f"checkpointing.ranks[{r.rank}]: unknown schedule "
                                 f"{r.schedule}")
        return self


def checkpointing_problems(section: Checkpointing | None, spec: ClusterSpec | None) -> list[str]:
    """Cross-section problems of ``checkpointing`` (the placement the runtime sends copies
    by), one line each: every node's holders are the node itself, then other nodes, each once
    (``node_holders``), and the node groups split the nodes; Gemini's predicted cost is of the
    interval the runtime checkpoints at; each rank's ``node`` is its node among those the
    plan uses (in the order of the cluster's nodes, from ``spec`` when given); each rank's
    holders sit on its node's holders, in order, so that a copy never shares the node it
    guards."""
    if section is None:
        return []
    n = len(section.node_holders)
    out = []
    for i, hs in enumerate(section.node_holders):
        if not hs or hs[0] != i or len(set(hs)) != len(hs) or max(hs) >= n:
            out.append(f"checkpointing.node_holders[{i}]: {list(hs)}, but a node's holders are "
                       f"the node itself first ({i}), then other nodes of 0..{n - 1}, each "
                       f"once; {_RERUN}")
    grouped = sorted(x for g in section.node_groups for x in g)
    if grouped != list(range(n)):
        out.append(f"checkpointing.node_groups: {[list(g) for g in section.node_groups]}, but "
                   f"the groups split the nodes 0..{n - 1}, each node in one group; {_RERUN}")
    if section.gemini.every_iters != section.every_iters:
        out.append(f"checkpointing.gemini.every_iters: {section.gemini.every_iters}, but the "
                   f"runtime checkpoints every {section.every_iters} iterations (every_iters), "
                   f"so Gemini's predicted cost is of another interval; {_RERUN}")
    if spec is not None and all(r.rank < spec.world_size for r in section.ranks):
        index = {node: i for i, node in enumerate(sorted(
            {spec.node_of(r.rank) for r in section.ranks}))}
        for r in section.ranks:
            want = index[spec.node_of(r.rank)]
            if r.node != want:
                out.append(f"checkpointing.ranks[{r.rank}].node: {r.node}, but rank {r.rank} "
                           f"is on node {want} of the {len(index)} the plan uses; {_RERUN}")
    if out:
        return out
    for r in section.ranks:
        if r.node >= n:
            out.append(f"checkpointing.ranks[{r.rank}].node: {r.node}, but node_holders lists "
                       f"nodes 0..{n - 1}; {_RERUN}")
            continue
        nodes = [section.ranks[h].node for h in r.holders]
        if nodes != list(section.node_holders[r.node][:len(nodes)]):
            out.append(f"checkpointing.ranks[{r.rank}].holders: {list(r.holders)}, on nodes "
                       f"{nodes}, but node {r.node}'s copies go to nodes "
                       f"{list(section.node_holders[r.node])} (node_holders[{r.node}]): a "
                       f"copy on the node it guards is lost with it; {_RERUN}")
    return out
