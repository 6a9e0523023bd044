"""The compressed all-gather in one call once its step has a slot (``runtime/routines.py``,
``_allgather_slotted``; ``docs/decisions/cpu-fidelity.md`` section 12): the same result as
the two-call exchange, one ``all_gather`` per call in the steady state, two when a payload
outgrows the slot, and a DGC path run over several iterations sums as before."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from hetplan.ir.plan_sections import CommStep, CompressedSync
from hetplan.profiling._spawn import run_local_ranks
from hetplan.runtime.routines import Level, PathRunner, SyncLevels

pytestmark = pytest.mark.dist

WORLD = 2
#: bytes each rank sends per call: equal sizes, uneven ones under the slot, an outgrown one
SIZES = [(40, 40), (40, 40), (24, 37), (40, 90), (60, 10), (90, 90)]


def _payload(rank: int, call: int, n: int) -> torch.Tensor:
    return ((torch.arange(n) + 7 * rank + 13 * call) % 251).to(torch.uint8)


def _rank(rank: int, world: int) -> dict[str, Any]:
    from hetplan.runtime import routines

    calls = [0]
    real = dist.all_gather

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    routines.dist.all_gather = counted  # type: ignore[assignment]
    try:
        lv = Level.of(dist.group.WORLD, range(world), rank)
        slots: dict[Any, int] = {}
        got, per_call = [], []
        for call, sizes in enumerate(SIZES):
            before = calls[0]
            out = routines._allgather_slotted(_payload(rank, call, sizes[rank]), lv, None,
                                              slots, ("site", 0))
            per_call.append(calls[0] - before)
            got.append([t.tolist() for t in out])
    finally:
        routines.dist.all_gather = real  # type: ignore[assignment]
    # a DGC bucket (the bench's compressed kind), over several iterations, through the slots
    levels = SyncLevels(flat=Level.of(dist.group.WORLD, range(world), rank))
    runner = PathRunner(levels)
    strategy = CompressedSync(compressor="dgc", steps=(CommStep(routine="allgather",
                                                                compressed=True),))
    sums = []
    for it in range(4):
        x = torch.randn(500, generator=torch.Generator().manual_seed(100 * it + rank))
        sums.append(runner.run(x, strategy, site=0))
        runner.iteration += 1
    return {"got": got, "per_call": per_call, "slot": dict(slots), "sums": sums}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_local_ranks(_rank, WORLD, timeout_s=120)


def test_every_rank_gets_every_payload(results: list[dict[str, Any]]) -> None:
    for r in results:
        for call, sizes in enumerate(SIZES):
            assert r["got"][call] == [_payload(k, call, sizes[k]).tolist()
                                      for k in range(WORLD)]


def test_one_call_once_the_slot_is_known(results: list[dict[str, Any]]) -> None:
    # the first call learns the sizes (two calls); a payload above the slot (90 > 40, then
    # 90 > 60) costs a second call and widens the slot; every other call is one
    assert results[0]["per_call"] == [2, 1, 1, 2, 1, 1]
    assert all(r["per_call"] == results[0]["per_call"] for r in results)
    assert results[0]["slot"] == {("site", 0): 90}


def test_a_dgc_path_agrees_on_every_rank_over_iterations(
        results: list[dict[str, Any]]) -> None:
    for it in range(4):
        assert torch.equal(results[0]["sums"][it], results[1]["sums"][it])
        assert results[0]["sums"][it].abs().sum() > 0
