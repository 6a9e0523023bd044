"""Rank mapping of a plan with per-stage degrees (``runtime/hetero_ranks.py``): coordinates
tp innermost, the stage layout the handlers run with, the rows each replica computes and
the overlaps a boundary sends, the world size, and the refusals (pure, no processes)."""

from __future__ import annotations

import pytest

from hetplan.errors import PlanMismatchError
from hetplan.ir.plan import Plan
from hetplan.ir.plan_hetero import Hetero, StageShape
from hetplan.ir.plan_sections import ClusterRef, Layout, ModelRef, Stage
from hetplan.runtime.composition import refusals
from hetplan.runtime.hetero_ranks import (
    hetero_coords,
    plan_world_size,
    replica_rows,
    row_overlaps,
    stage_layout,
)


def _plan(ranks: tuple[tuple[int, ...], ...] = ((0,), (1, 2, 3, 4)), *,
          sp: bool = False, world: int = 5) -> Plan:
    """Stage 0: dp 1 x tp 1; stage 1: dp 2 x tp 2; global micro-batch 4, 2 micro-batches."""
    layout = Layout(dp=1, pp=2, tp=1, micro_batches=2, micro_batch_size=4,
                    global_batch_size=8, sequence_parallel=sp)
    stages = (Stage(index=0, first_layer=0, last_layer=0, ranks=ranks[0]),
              Stage(index=1, first_layer=1, last_layer=1, ranks=ranks[1]))
    hetero = Hetero(stages=(
        StageShape(stage=0, device_class="fast", dp=1, tp=1, micro_batch_size=4),
        StageShape(stage=1, device_class="slow", dp=2, tp=2, micro_batch_size=2,
                   zero_stage=1)))
    return Plan(model=ModelRef(name="m", fingerprint="f00", num_params=1),
                cluster=ClusterRef(name="c", fingerprint="c00", world_size=world),
                layout=layout, stages=stages, hetero=hetero)


def test_coordinates_are_tp_innermost() -> None:
    plan = _plan()
    me = hetero_coords(plan, 3)
    assert (me.stage, me.dp_rank, me.tp_rank, me.dp, me.tp) == (1, 1, 0, 2, 2)
    assert me.tp_ranks == (3, 4) and me.dp_ranks == (1, 3)
    assert hetero_coords(plan, 0).tp_ranks == (0,)


def test_stage_layout_carries_the_stages_degrees() -> None:
    lay = stage_layout(_plan(), 4)
    assert (lay.dp, lay.pp, lay.tp, lay.zero_stage, lay.micro_batch_size,
            lay.micro_batches) == (2, 2, 2, 1, 2, 2)


def test_rows_and_overlaps() -> None:
    assert replica_rows(6, 2, 1) == (3, 6)
    assert row_overlaps(6, 1, 2) == [(0, 0, 0, 3), (0, 1, 3, 6)]
    assert row_overlaps(6, 2, 3) == [(0, 0, 0, 2), (0, 1, 2, 3), (1, 1, 3, 4), (1, 2, 4, 6)]
    assert row_overlaps(4, 2, 2) == [(0, 0, 0, 2), (1, 1, 2, 4)]


def test_world_size_and_idle_ranks() -> None:
    assert plan_world_size(_plan()) == 5
    idle = _plan(((0,), (2, 3, 4, 5)), world=6)
    with pytest.raises(PlanMismatchError, match=r"rank\(s\) \[1\] without a stage"):
        plan_world_size(idle)


def test_sequence_parallel_is_refused_naming_the_field() -> None:
    assert refusals(_plan()) == []
    (msg,) = refusals(_plan(sp=True))
    assert msg.startswith("layout.sequence_parallel:") and "--no-sp" in msg
