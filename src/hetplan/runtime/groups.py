"""Process groups for a plan's data-, pipeline- and tensor-parallel dimensions.

Every group is created with an explicit timeout (by default the job's, :func:`job_timeout`):
``new_group`` would otherwise give it torch's 30-minute default whatever the job set, and a
send, receive or collective with a dead peer would hang that long.

For hierarchical gradient sync, each data-parallel group is also split by node (``layout.ranks``
gives every rank's node): the *intra* group holds its ranks on this node, the *inter* group its
ranks with this rank's position on their node (Espresso's reference grouping). Both exist only
when the group spans nodes that each hold the same number of its ranks.

Before any group exists, the ranks agree on the plan (:func:`agree_on_plan`): each rank's
digest of the plan it loaded is gathered on the default group, and if they differ every rank
refuses with the same message, instead of crashing later inside a collective whose sizes no
longer match.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

import torch

import torch.distributed as dist

from hetplan.errors import PlanMismatchError
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import Layout
from hetplan.runtime.routines import Level, SyncLevels

__all__ = [
    "ParallelGroups",
    "agree_on_plan",
    "exit_now",
    "job_timeout",
    "plan_digest",
    "shutdown_process_groups",
]


def plan_digest(plan: Plan) -> str:
    """The first 16 hex digits of the sha256 of the plan's canonical JSON: equal exactly when
    the plans are."""
    return hashlib.sha256(plan.to_json().encode()).hexdigest()[:16]


def _describe(plan: Plan) -> str:
    lay = plan.layout
    shape = (f"dp={lay.dp} pp={lay.pp} tp={lay.tp}, global batch "
             f"{lay.dp * lay.micro_batches * lay.micro_batch_size}" if lay is not None
             else "no layout")
    return f"model {plan.model.name!r} on cluster {plan.cluster.name!r}, {shape}"


def agree_on_plan(plan: Plan) -> None:
    """Check that every rank of the default group loaded the same plan (a collective: every
    rank calls it, before any other runtime collective).

    Raises:
        PlanMismatchError: on every rank, when the ranks' plans differ; lists which ranks
            hold which plan and how to fix it.
    """
    if not dist.is_initialized():
        return
    mine = (plan_digest(plan), _describe(plan))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    holders: dict[tuple[str, str], list[int]] = {}
    for rank, entry in enumerate(everyone):
        holders.setdefault(tuple(entry), []).append(rank)
    if len(holders) == 1:
        return
    groups = "; ".join(
        f"rank(s) {', '.join(map(str, ranks))} loaded plan {digest} ({what})"
        for (digest, what), ranks in sorted(holders.items(), key=lambda kv: kv[1][0])
    )
    raise PlanMismatchError(
        f"the ranks loaded different plans: {groups}. Every rank must load the same plan "
        "file (the same bytes): copy one plan file to every node, or re-run `hetplan plan` "
        "once and use its output on every rank"
    )


def job_timeout() -> timedelta:
    """The default process group's timeout (what ``init_process_group`` was given).

    Read from the group's backend options; torch's default for the backend when it does not
    expose them (or no process group exists).
    """
    if not dist.is_initialized():
        return dist.default_pg_timeout
    group = dist.distributed_c10d._get_default_group()
    for device in (torch.device("cpu"), torch.device("cuda")):
        try:
            options = group._get_backend(device).options
        except (RuntimeError, AttributeError):
            continue
        timeout = getattr(options, "_timeout", None)
        if isinstance(timeout, timedelta):
            return timeout
    return dist.distributed_c10d._get_default_timeout(dist.get_backend(group))


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's coordinates and the groups it belongs to (rank lists are global ranks).

    Every rank creates every group, in the same order, as ``torch.distributed.new_group``
    requires; a group of one rank is ``None`` (nothing to communicate).
    """

    rank: int
    dp_rank: int
    pp_rank: int
    tp_rank: int
    dp_ranks: tuple[int, ...]
    pp_ranks: tuple[int, ...]
    tp_ranks: tuple[int, ...]
    dp_group: Any
    pp_group: Any
    tp_group: Any
    dp_intra_ranks: tuple[int, ...] | None = None
    dp_inter_ranks: tuple[int, ...] | None = None
    dp_intra_group: Any = None
    dp_inter_group: Any = None
    #: a heterogeneous pipeline's point-to-point groups, one per direction (every rank):
    #: activations go forward on one, gradients backward on the other (see
    #: :mod:`hetplan.runtime.handlers.hetero`); None otherwise
    fwd_group: Any = None
    bwd_group: Any = None

    def sync_levels(self) -> SyncLevels:
        """The levels the gradient path's routines use for this rank's data-parallel group."""
        flat = Level.of(self.dp_group, self.dp_ranks, self.rank)
        if self.dp_intra_ranks is None or self.dp_inter_ranks is None:
            return SyncLevels(flat)
        return SyncLevels(flat, Level.of(self.dp_intra_group, self.dp_intra_ranks, self.rank),
                          Level.of(self.dp_inter_group, self.dp_inter_ranks, self.rank))

    @classmethod
    def build(cls, layout: Layout, rank: int, *, backend: str | None = None,
              node_of: Callable[[int], int] | None = None,
              timeout: timedelta | None = None) -> ParallelGroups:
        """Create the groups for ``layout`` (a collective call: every rank must call it).

        ``node_of`` gives a global rank's node when ``layout.ranks`` is empty (the plan's
        ``ClusterSpec.node_of``); without either, no intra/inter groups are made. Every
        group gets ``timeout`` (default: :func:`job_timeout`).
        """
        timeout = timeout if timeout is not None else job_timeout()
        d, p, t = layout.coords(rank)
        mine: dict[str, Any] = {}
        ranks: dict[str, tuple[int, ...]] = {}

        def make(kind: str, members: tuple[int, ...]) -> None:
            group = (dist.new_group(list(members), backend=backend, timeout=timeout)
                     if len(members) > 1 else None)
            if rank in members:
                mine[kind], ranks[kind] = group, members

        for pp in range(layout.pp):
            for tp in range(layout.tp):
                make("dp", tuple(layout.rank_of(x, pp, tp) for x in range(layout.dp)))
        for dp in range(layout.dp):
            for tp in range(layout.tp):
                make("pp", tuple(layout.rank_of(dp, x, tp) for x in range(layout.pp)))
        for dp in range(layout.dp):
            for pp in range(layout.pp):
                make("tp", tuple(layout.rank_of(dp, pp, x) for x in range(layout.tp)))
        for pp in range(layout.pp):
            for tp in range(layout.tp):
                members = tuple(layout.rank_of(x, pp, tp) for x in range(layout.dp))
                for kind, sub in node_split(layout, members, node_of):
                    make(kind, sub)
        return cls(rank, d, p, t, ranks["dp"], ranks["pp"], ranks["tp"],
                   mine["dp"], mine["pp"], mine["tp"],
                   ranks.get("intra"), ranks.get("inter"), mine.get("intra"), mine.get("inter"))


def node_split(layout: Layout | None, members: tuple[int, ...],
               node_of: Callable[[int], int] | None = None) -> list[tuple[str, tuple[int, ...]]]:
    """The intra-node and inter-node subgroups of a group (empty when not hierarchical).

    Intra groups: the members on each node, in rank order. Inter groups: the j-th member of
    every node, for each j. Needs nodes (``layout.ranks``, else ``node_of``; a heterogeneous
    plan passes no layout, its ranks are the cluster's), at least two nodes, and the same
    number of members on every node.
    """
    if layout is not None and layout.ranks:
        placements = layout.ranks

        def node_of(r: int) -> int:
            return placements[r].node

    if node_of is None:
        return []
    by_node: dict[int, list[int]] = {}
    for r in members:
        by_node.setdefault(node_of(r), []).append(r)
    counts = {len(v) for v in by_node.values()}
    if len(by_node) < 2 or len(counts) != 1:
        return []
    nodes = [by_node[n] for n in sorted(by_node)]
    out = [("intra", tuple(v)) for v in nodes]
    out += [("inter", tuple(v[j] for v in nodes)) for j in range(counts.pop())]
    return out


def shutdown_process_groups(clean: bool) -> None:
    """Tear the process groups down in step: after a clean run every rank first waits for the
    others (no rank closes its connections while a peer still sends on them); after an error
    the barrier is skipped, as a peer may be dead."""
    if not dist.is_initialized():
        return
    if clean:
        try:
            dist.barrier()
        except Exception as e:  # noqa: BLE001 - a peer failed at the very end; exit anyway
            print(f"rank {dist.get_rank()}: shutdown barrier: {e}", file=sys.stderr)
    dist.destroy_process_group()


#: How long :func:`exit_now` lets multiprocessing's finalizers run before it exits anyway.
FINALIZERS_S = 2.0


def exit_now(code: int) -> NoReturn:
    """Leave the process without interpreter finalisation (after
    :func:`shutdown_process_groups`): process-group objects still referenced from module
    globals would otherwise be torn down while gloo's threads run, which aborts the process
    now and then ("terminate called without an active exception").

    First, :mod:`multiprocessing`'s finalizers of priority 0 and up run (the first of the
    two passes its exit handler makes; no child is terminated): os._exit skips them, and a
    named semaphore left registered is reported by the resource tracker when the process
    that started this one exits ("There appear to be N leaked semaphore objects").
    torch.fx's Interpreter, which capture runs, creates one: tqdm's lock shared between
    processes. They run on a thread given :data:`FINALIZERS_S` seconds: a finalizer that
    blocks (a pool that will not end) must not keep a leaving rank; the ones after it are
    then skipped."""
    import threading
    from multiprocessing import util

    run = threading.Thread(target=util._run_finalizers, args=(0,),  # type: ignore[attr-defined]
                           name="hetplan-exit-finalizers", daemon=True)
    try:
        run.start()
        run.join(FINALIZERS_S)
    except RuntimeError:  # no thread to be had: leave without them
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
