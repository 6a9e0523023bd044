"""``HETPLAN_EMULATE_BW`` in the runtime, on 4 gloo ranks as 2 nodes x 2: every collective that
crosses nodes (flat, inter) occupies the emulated link for its ring volume, intra-node ones do
not; the asynchronous allreduce path waits for its emulated end; results are unchanged."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hetplan.ir.plan_sections import CommStep, CompressedSync, NoSync
from hetplan.profiling._spawn import run_local_ranks
from hetplan.runtime.grad_sync import GradSync
from hetplan.runtime.link_emulation import ENV, emulated_link
from hetplan.runtime.routines import Level, PathRunner, SyncLevels

pytestmark = pytest.mark.dist

WORLD, N, GBPS = 4, 50_000, 0.4  # 200 kB of fp32 at 50 MB/s: 4 ms per 200 kB sent


def _levels(rank: int) -> SyncLevels:
    groups = {m: dist.new_group(list(m)) for m in ((0, 1), (2, 3), (0, 2), (1, 3))}
    intra = (0, 1) if rank < 2 else (2, 3)
    inter = (0, 2) if rank % 2 == 0 else (1, 3)
    return SyncLevels(flat=Level.of(dist.group.WORLD, range(WORLD), rank),
                      intra=Level.of(groups[intra], intra, rank),
                      inter=Level.of(groups[inter], inter, rank))


def _rank(rank: int, world: int) -> dict[str, Any]:
    os.environ[ENV] = str(GBPS)
    link = emulated_link()
    assert link is not None
    runner = PathRunner(_levels(rank))
    x = torch.full((N,), float(rank + 1))
    hier = NoSync(hierarchy="hierarchical", steps=(
        CommStep(level="intra", routine="reduce_scatter"),
        CommStep(level="inter", routine="allreduce"),
        CommStep(level="intra", routine="allgather")))
    topk = CompressedSync(compressor="topk", params={"ratio": 0.01}, error_feedback=False,
                          steps=(CommStep(routine="allgather", compressed=True),))
    out: dict[str, Any] = {}
    for label, strategy in (("flat", NoSync()), ("hier", hier), ("topk", topk)):
        dist.barrier()
        before, t0 = link.busy_s, time.perf_counter()
        y = runner.run(x.clone(), strategy, site=label)
        out[label] = (link.busy_s - before, time.perf_counter() - t0, float(y.sum()))
    # the asynchronous fast path: two fp32 tensors, one flat allreduce each
    model = torch.nn.Linear(100, 100)
    sync = GradSync(list(model.named_parameters()), None, dist.group.WORLD, world)
    dist.barrier()
    before, t0 = link.busy_s, time.perf_counter()
    model(torch.ones(3, 100)).sum().backward()
    sync.finish()
    out["fast"] = (link.busy_s - before, time.perf_counter() - t0,
                   float(model.bias.grad.sum()))
    sync.close()
    return out


def test_emulated_link_in_the_gradient_path() -> None:
    results = run_local_ranks(_rank, WORLD, timeout_s=120)
    per_byte = 8 / (GBPS * 1e9)
    full = 4 * N  # bytes of the fp32 buffer
    expected = {
        "flat": 2 * 3 / 4 * full * per_byte,  # ring allreduce over 4 ranks
        "hier": 2 * 1 / 2 * (full / 2) * per_byte,  # only the inter allreduce of a half
        "fast": 2 * 3 / 4 * 4 * (100 * 100 + 100) * per_byte,
    }
    for r in results:
        for label, want in expected.items():
            busy, elapsed, _ = r[label]
            assert busy == pytest.approx(want, rel=1e-9), label
            assert elapsed >= want * (1 - 1e-6), label
        # compressed flat allgather of 1 % top-k: on the link, but far less than fp32
        busy, elapsed, _ = r["topk"]
        assert 0 < busy < 0.05 * expected["flat"]
        assert elapsed >= busy * (1 - 1e-6)
        # results unchanged: sum over ranks of (rank + 1) = 10 per element
        assert r["flat"][2] == pytest.approx(10 * N) and r["hier"][2] == pytest.approx(10 * N)
        # d(sum of 3 rows)/d(bias) = 3 per element on every rank; the mean over ranks too
        assert r["fast"][2] == pytest.approx(3 * 100)
