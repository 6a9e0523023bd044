"""Heartbeats name the rank that stopped: three ranks beating into one store, in one
process; one stops, and the others' reading names it (and only it). Probes last 20 beats,
so a loaded machine that delays a live rank's thread does not make it a suspect."""

from __future__ import annotations

import torch.distributed as dist

from hetplan.runtime.liveness import Heartbeat, PeerFailureError


def test_the_rank_that_stops_beating_is_the_suspect() -> None:
    store = dist.HashStore()
    beats = [Heartbeat(store, rank, 3, period_s=0.05) for rank in range(3)]
    try:
        assert beats[0].stalled(probe_s=1.0) == []
        beats[1].stop()
        assert beats[0].stalled(probe_s=1.0) == [1]
        assert beats[2].stalled(probe_s=1.0) == [1]
        beats[0].period_s = 0.3  # explain() probes three beats: 0.9 s
        error = beats[0].explain(RuntimeError("[a/b/unbound_buffer.cc:78] Timed out waiting "
                                              "10000ms for recv operation to complete\nmore"))
        assert isinstance(error, PeerFailureError) and error.suspects == (1,)
        assert str(error).startswith("rank 1 stopped responding (no heartbeat for 0.9 s")
        assert str(error).endswith("failed: Timed out waiting 10000ms for recv operation to "
                                   "complete")
    finally:
        for b in beats:
            b.stop()


def test_no_suspect_while_every_rank_beats() -> None:
    store = dist.HashStore()
    beats = [Heartbeat(store, rank, 2, period_s=0.05) for rank in range(2)]
    beats[0].period_s = 0.3
    try:
        assert beats[0].explain(RuntimeError("shape mismatch")) is None
    finally:
        for b in beats:
            b.stop()


def test_a_rank_that_never_beat_is_a_suspect() -> None:
    store = dist.HashStore()
    beat = Heartbeat(store, 0, 2, period_s=0.05)
    try:
        assert beat.stalled(probe_s=0.3) == [1]
    finally:
        beat.stop()
