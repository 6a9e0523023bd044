"""Validator rules for the per-stage sections of a plan with per-stage degrees (``hetero``).

Two sections written by passes that run per stage on a heterogeneous plan
(:mod:`hetplan.passes._hetero_sync`) are checked here against ``hetero.stages``:

- ``tensor_parallel`` (the ZERO/SEMI controller per stage): every group names its stage,
  that stage has ``tp > 1``, and the group's ranks are exactly one replica's TP group of the
  stage, ``stages[k].ranks[d*tp_k : (d+1)*tp_k]`` in that order; no shard sizes (a stage's
  TP group runs even shards at its own ``tp``).
- ``rebalancing`` (DynPipe on a dynamic model): every event assigns layers to all of the
  plan's stages (each keeps its device class, ranks and degrees, so an event cannot add
  or release one).

Rules 5 and 7 of :mod:`hetplan.ir.plan_checks` (ranks exist, ranges cover the layers and
start where the runtime can split) still apply. Each function returns one line per problem,
naming the field and the fix.
"""

from __future__ import annotations

from hetplan.ir.plan_hetero import Hetero
from hetplan.ir.plan_sections import Stage, TensorParallel
from hetplan.ir.rebalancing import Rebalancing

__all__ = ["hetero_tp_problems", "hetero_rebalancing_problems"]

_FIX = "re-run `hetplan plan --hetero ...` with the pass"


def hetero_tp_problems(hetero: Hetero, stages: tuple[Stage, ...],
                       tp: TensorParallel | None) -> list[str]:
    """Problems of ``tp`` in a plan with per-stage degrees (see the module docstring)."""
    if tp is None:
        return []
    out: list[str] = []
    for i, g in enumerate(tp.groups):
        where = f"tensor_parallel.groups[{i}]"
        if g.stage is None or g.stage >= len(hetero.stages) or g.stage >= len(stages):
            out.append(f"{where}.stage: {g.stage}; with per-stage degrees every TP group "
                       f"names its stage (0..{len(hetero.stages) - 1}); {_FIX}")
            continue
        shape, ranks = hetero.stages[g.stage], stages[g.stage].ranks
        replicas = [ranks[d * shape.tp:(d + 1) * shape.tp] for d in range(shape.dp)]
        if shape.tp == 1:
            out.append(f"{where}: stage {g.stage} runs tp=1 (hetero.stages[{g.stage}]), it "
                       f"has no TP group; {_FIX}")
        elif tuple(g.ranks) not in replicas:
            out.append(f"{where}.ranks: {list(g.ranks)} is not a TP group of stage {g.stage} "
                       f"({shape.dp}x{shape.tp}: {[list(r) for r in replicas][:4]}); {_FIX}")
        if g.linears:
            out.append(f"{where}.linears: uneven shards in a stage of one device class; a "
                       f"stage's TP group runs even shards at its tp; {_FIX}")
    return out


def hetero_rebalancing_problems(hetero: Hetero, reb: Rebalancing | None) -> list[str]:
    """Problems of ``reb`` in a plan with per-stage degrees (see the module docstring)."""
    if reb is None:
        return []
    out: list[str] = []
    n = len(hetero.stages)
    for i, ev in enumerate(reb.events):
        where = f"rebalancing.events[{i}]"
        if len(ev.stages) != n:
            out.append(f"{where}.stages: {len(ev.stages)} layer range(s), but the plan's "
                       f"{n} stages ({hetero.describe()}) each keep their devices and "
                       f"degrees; {_FIX}")
        if ev.released_stages:
            out.append(f"{where}.released_stages: {list(ev.released_stages)}; a stage of a "
                       f"plan with per-stage degrees is never released; {_FIX}")
    return out
