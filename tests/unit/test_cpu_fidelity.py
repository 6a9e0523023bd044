"""The cost model on CPU ranks (gloo, ``comm_overlaps_compute: false``): what the breakdown
calls communication and compression, and the per-step framework costs a profile measures
(the causes of the CPU fidelity misses in ``docs/decisions/cpu-fidelity.md``)."""

from __future__ import annotations

import pytest

import hetplan
from hetplan.ir.cluster import ClusterSpec


def test_uncompressed_sync_on_cpu_ranks_is_communication_not_compression() -> None:
    # collectives of cpu ranks take turns with compute on the compute resource; the breakdown
    # used to report that time as compression (0.229 ms of it for a plan that compresses
    # nothing) and 0 ms of communication
    plan = hetplan.compile("tiny-gpt2", ClusterSpec.from_preset("local-cpu"), batch_size=8,
                           dp=4, pp=1, tp=1, zero_stage=0)
    assert plan.gradient_sync is not None
    kinds = {s.kind for s in plan.gradient_sync.strategies.values()}
    assert kinds == {"none"}, kinds
    b = plan.predictions.breakdown
    assert b.compression_ms == 0.0
    assert b.comm_ms > 0.0
    # nothing overlaps on cpu ranks: all of the sync is exposed
    assert b.exposed_comm_ms == pytest.approx(b.comm_ms, rel=1e-9)


def test_compressed_sync_on_cpu_ranks_still_reports_compression() -> None:
    plan = hetplan.compile("gpt-test", ClusterSpec.from_preset("cpu-2x2-slow"), batch_size=8,
                           dp=4, pp=1, tp=1, zero_stage=0, compressors=("dgc",))
    assert plan.gradient_sync is not None
    assert any(s.kind == "compressed" for s in plan.gradient_sync.strategies.values())
    b = plan.predictions.breakdown
    assert b.compression_ms > 0.0
    assert b.comm_ms > 0.0
