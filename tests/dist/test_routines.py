"""Every routine of Espresso's Table 4.2, flat and hierarchical, on 4 gloo ranks as 2 nodes × 2
devices: aggregated sums against the fp32 reference (lossless paths) and against hand-derived
references or the compressors' documented bounds (lossy paths).

One spawn of 4 processes runs every case (they are cheap; the processes are not).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hetplan.algorithms.espresso_tree import all_options, devices_of, is_compressed
from hetplan.ir.plan_sections import CastSync, CommStep, CompressedSync
from hetplan.passes.espresso import strategy_for
from hetplan.profiling._spawn import run_local_ranks
from hetplan.runtime.compressors import make_compressor
from hetplan.runtime.routines import Level, PathRunner, SyncLevels

pytestmark = pytest.mark.dist

WORLD, N = 4, 1001  # 1001: chunks of every level are uneven (gloo padding exercised)


def _vec(rank: int, n: int = N) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(1000 + rank))


def _levels(rank: int) -> SyncLevels:
    """Node = rank // 2; intra {0,1},{2,3}; inter {0,2},{1,3} (every rank creates every group)."""
    groups = {}
    for members in ((0, 1), (2, 3), (0, 2), (1, 3)):
        groups[members] = dist.new_group(list(members))
    intra = (0, 1) if rank < 2 else (2, 3)
    inter = (0, 2) if rank % 2 == 0 else (1, 3)
    return SyncLevels(flat=Level.of(dist.group.WORLD, range(WORLD), rank),
                      intra=Level.of(groups[intra], intra, rank),
                      inter=Level.of(groups[inter], inter, rank))


def _cases() -> list[tuple[str, Any]]:
    """(label, strategy): every GPU-only tree option — fp32 routings as NoSync, compressed
    ones as Espresso's fp16 CastSync (every path shape, near-lossless) — and lossy compressors
    on representative paths."""
    cases: list[tuple[str, Any]] = []
    for oid, opt in enumerate(all_options()):
        if devices_of(opt) - {"gpu"}:
            continue
        key = ("fp16", oid) if is_compressed(opt) else (None, oid)
        cases.append((f"tree#{oid}", strategy_for(key)))
    flat_ag = CompressedSync(compressor="topk", steps=(CommStep(routine="allgather",
                                                              compressed=True),))
    for name in ("topk", "randomk", "dgc", "efsignsgd", "onebit", "qsgd", "powersgd"):
        cases.append((f"lossy-flat:{name}", flat_ag.model_copy(update={"compressor": name})))
    # topk on a divisible flat path (compress, alltoall, decompress+sum, re-compress,
    # allgather) and a hierarchical two-level one
    for oid, opt in enumerate(all_options()):
        labels = [(a.task, a.level, a.routine) for a in opt if a.device in (None, "gpu")]
        if devices_of(opt) != {"gpu"}:
            continue
        if labels == [("comp", "flat", None), ("comm1_comp", "flat", "alltoall"),
                      ("decomp", "flat", None), ("comp", "flat", None),
                      ("comm2_comp", "flat", "allgather"), ("decomp", "flat", None)]:
            cases.append(("topk-divisible", strategy_for(("topk", oid), ratio=0.1)))
    return cases


def _rank(rank: int, world: int) -> dict[str, Any]:
    levels = _levels(rank)
    runner = PathRunner(levels)
    out = {}
    for label, strategy in _cases():
        out[label] = runner.run(_vec(rank), strategy, site=label)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_local_ranks(_rank, WORLD, timeout_s=240, threads_per_process=1)


def _ref() -> torch.Tensor:
    return sum(_vec(r).double() for r in range(WORLD))  # type: ignore[return-value]


def test_all_ranks_agree(results: list[dict[str, Any]]) -> None:
    for label in results[0]:
        for r in range(1, WORLD):
            assert torch.equal(results[r][label], results[0][label]), (label, r)


def test_every_tree_path_shape_sums_like_allreduce(results: list[dict[str, Any]]) -> None:
    ref = _ref()
    abs_sum = sum(_vec(r).double().abs() for r in range(WORLD))
    labels = [k for k in results[0] if k.startswith("tree#")]
    assert len(labels) == 174  # the GPU-only options (§F.1)
    for label in labels:
        got = results[0][label].double()
        strategy = dict(_cases())[label]
        if isinstance(strategy, CastSync):  # fp16 roundings of partial sums along the path
            bound = 8 * 2.0**-11 * abs_sum + 1e-6
        else:  # fp32 sums, any order
            bound = 1e-5 * abs_sum + 1e-6
        assert ((got - ref).abs() <= bound).all(), (label, float((got - ref).abs().max()))


def test_lossy_flat_allgather_within_documented_error(results: list[dict[str, Any]]) -> None:
    xs = [_vec(r) for r in range(WORLD)]
    ref = _ref()
    for name in ("topk", "efsignsgd", "onebit"):  # deterministic: the exact composition
        comp = make_compressor(name)
        expected = sum(comp.roundtrip(x).double() for x in xs)
        assert torch.allclose(results[0][f"lossy-flat:{name}"].double(), expected, atol=1e-5)
    k = int(N * 0.01)
    for name in ("randomk", "dgc", "powersgd"):  # ||e_r|| <= ||x_r|| (dgc: sqrt(1 - 1/n))
        got = results[0][f"lossy-flat:{name}"].double()
        shrink = math.sqrt(1 - 1 / N) if name == "dgc" else 1.0
        assert float((got - ref).norm()) <= shrink * sum(float(x.norm()) for x in xs) + 1e-6
        assert float((got - ref).norm()) > 0  # it is lossy
    nz = (results[0]["lossy-flat:randomk"] != 0).sum()
    assert int(nz) <= WORLD * k
    got = results[0]["lossy-flat:qsgd"].double()  # |e_i| < sum_r ||x_r|| / s
    assert ((got - ref).abs() < sum(float(x.norm()) for x in xs) / 127).all()


def test_topk_divisible_path_matches_hand_derived_reference(
        results: list[dict[str, Any]]) -> None:
    """alltoall of per-chunk top-k, decompress and sum, top-k of the sum, allgather."""
    comp = make_compressor("topk", {"ratio": 0.1})
    c = math.ceil(N / WORLD)
    expected = []
    for i in range(WORLD):
        lo, hi = min(i * c, N), min((i + 1) * c, N)
        agg = sum(comp.roundtrip(_vec(r)[lo:hi]) for r in range(WORLD))
        expected.append(comp.roundtrip(agg))
    assert torch.allclose(results[0]["topk-divisible"], torch.cat(expected), atol=1e-5)
