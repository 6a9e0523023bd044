"""Process groups for a plan's data-, pipeline- and tensor-parallel dimensions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from hetplan.ir.plan_sections import Layout

__all__ = ["ParallelGroups"]


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

    @classmethod
    def build(cls, layout: Layout, rank: int, *, backend: str | None = None) -> ParallelGroups:
        """Create the groups for ``layout`` (a collective call: every rank must call it)."""
        d, p, t = layout.coords(rank)
        mine: dict[str, Any] = {}
        ranks: dict[str, tuple[int, ...]] = {}

        def make(kind: str, members: tuple[int, ...]) -> None:
            group = dist.new_group(list(members), backend=backend) if len(members) > 1 else None
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
        return cls(rank, d, p, t, ranks["dp"], ranks["pp"], ranks["tp"],
                   mine["dp"], mine["pp"], mine["tp"])
