"""The path executor's bookkeeping on one-rank groups (no processes): every option of the
decision tree runs to the whole tensor, chunks, derived paths, and clear refusals."""

from __future__ import annotations

import pytest
import torch

from hetplan.algorithms.espresso_tree import all_options, is_compressed
from hetplan.errors import SpecError
from hetplan.ir.plan_sections import CastSync, CommStep, CompressedSync, NoSync
from hetplan.passes.espresso import strategy_for
from hetplan.runtime.routines import Level, PathRunner, Step, SyncLevels, chunk_bounds, path_of

ONE = Level(None, (0,), 0)
LEVELS = SyncLevels(ONE, ONE, ONE)


def test_chunk_bounds() -> None:
    assert chunk_bounds(0, 10, 4, "scatter") == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert chunk_bounds(0, 2, 4, "scatter") == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert chunk_bounds(5, 9, 3, "root") == [(5, 9), (9, 9), (9, 9)]


def test_every_tree_option_returns_the_whole_tensor_on_one_rank() -> None:
    x = torch.randn(37, generator=torch.Generator().manual_seed(0))
    fp16 = x.half().float()
    runner = PathRunner(LEVELS)
    for oid, opt in enumerate(all_options()):
        strategy = strategy_for(("fp16", oid) if is_compressed(opt) else (None, oid))
        got = runner.run(x, strategy, site=oid)
        assert torch.equal(got, fp16 if isinstance(strategy, CastSync) else x), oid


def test_path_derived_from_steps_when_actions_are_empty() -> None:
    s = CompressedSync(compressor="topk", hierarchy="hierarchical", compress_device="cpu",
                       steps=(CommStep(level="intra", routine="reduce_scatter"),
                              CommStep(level="inter", routine="allgather", compressed=True),
                              CommStep(level="intra", routine="allgather")))
    assert path_of(s) == (
        Step("comm", "intra", "reduce_scatter"), Step("comp", "inter", device="cpu"),
        Step("comm", "inter", "allgather", True), Step("decomp", "inter", device="gpu"),
        Step("comm", "intra", "allgather"))


def test_hierarchical_path_without_node_groups_is_refused() -> None:
    s = NoSync(hierarchy="hierarchical", steps=(CommStep(level="intra", routine="reduce"),
                                                CommStep(level="inter"),
                                                CommStep(level="intra", routine="broadcast")))
    with pytest.raises(SpecError, match="no node structure"):
        PathRunner(SyncLevels(ONE)).run(torch.ones(4), s)


def test_unpaired_step_two_is_refused() -> None:
    s = NoSync(steps=(CommStep(routine="reduce"), CommStep(routine="allgather")))
    with pytest.raises(SpecError, match="must close a reduce_scatter"):
        PathRunner(LEVELS).run(torch.ones(4), s)


def test_fp64_buffers_stay_fp64_on_uncompressed_paths() -> None:
    x = torch.randn(9, dtype=torch.float64)
    s = NoSync(steps=(CommStep(routine="reduce_scatter"), CommStep(routine="allgather")))
    got = PathRunner(LEVELS).run(x, s)
    assert got.dtype == torch.float64 and torch.equal(got, x)


def test_cpu_offloaded_compression_on_cpu_tensors() -> None:
    s = CompressedSync(compressor="efsignsgd", compress_device="cpu", decompress_device="cpu",
                       error_feedback=False)
    x = torch.randn(100)
    expected = x.abs().mean() * torch.where(x >= 0, 1.0, -1.0)
    assert torch.allclose(PathRunner(LEVELS).run(x, s), expected)
