"""Gemini's per-node store (two buffers, completeness) and the choice of the iteration
every rank resumes from."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetplan.ir.plan_checkpointing import (
    CheckpointCost,
    Checkpointing,
    ChunkSchedule,
    RankCheckpoint,
)
from hetplan.runtime.checkpoint_store import NodeStore
from hetplan.runtime.handlers.checkpointing import newest_common


def test_two_buffers_keep_the_newest_complete(tmp_path: Path) -> None:
    s = NodeStore(tmp_path, 0)
    s.write("own", 3, 1, b"one")
    s.write("own", 3, 2, b"two")
    s.write("own", 3, 3, b"three")  # overwrites iteration 1, never 2
    assert sorted(s.iterations("own", 3)) == [2, 3]
    assert s.read("own", 3, 2) == b"two"
    # a slot being rewritten is incomplete: its metadata goes first
    _, meta = s._slot("own", 3, s.iterations("own", 3)[2])
    meta.unlink()
    assert sorted(s.iterations("own", 3)) == [3]
    with pytest.raises(LookupError, match="iteration 2"):
        s.read("own", 3, 2)


def test_torn_or_stale_data_is_refused(tmp_path: Path) -> None:
    s = NodeStore(tmp_path, 1)
    s.write("held", 0, 5, b"abcd")
    assert s.read("held", 0, 5) == b"abcd"
    data, _ = s._slot("held", 0, 0)
    good = data.read_bytes()
    # torn: a writer of iteration 7 stamped the start and died before the end
    data.write_bytes((7).to_bytes(8, "little") + good[8:])
    with pytest.raises(LookupError, match="corrupt"):
        s.read("held", 0, 5)
    # stale: the record outlived its data (the slot holds iteration 3's stamps)
    data.write_bytes((3).to_bytes(8, "little") + good[8:-8] + (3).to_bytes(8, "little"))
    with pytest.raises(LookupError, match="corrupt"):
        s.read("held", 0, 5)
    # the data file cut short: not a complete slot at all
    data.write_bytes(b"abcd")
    assert s.iterations("held", 0) == {}
    assert s.held_ranks() == [0]


def _section() -> Checkpointing:
    cost = CheckpointCost(name="x", checkpoint_ms=1, every_iters=1, retrieval_ms=1,
                          slowdown=0, wasted_ms=1)
    holders = [(0, 1), (1, 0), (2, 3), (3, 2)]
    return Checkpointing(
        replicas=2, placement="group", node_groups=((0, 1), (2, 3)),
        node_holders=tuple(holders),
        ranks=tuple(RankCheckpoint(rank=r, node=r, state_bytes=4, holders=h, schedule=0)
                    for r, h in enumerate(holders)),
        buffer_bytes=8, sub_buffers=2, mu=0.5, chunk_alpha_ms=0, chunk_bandwidth_gbps=1,
        schedules=(ChunkSchedule(id=0, state_bytes=4),), storage_every_iters=10,
        storage_bandwidth_gbps=1, iteration_ms=1, gemini=cost, baseline=cost)


def test_newest_common() -> None:
    ck = _section()
    own = [[4, 5], [], [4, 5], [5, 6]]  # rank 1's node was wiped; rank 3 ran ahead
    held = [{1: [4, 5]}, {0: []}, {3: [4]}, {2: [4, 5]}]
    assert newest_common(ck, own, held) == (5, {0: 0, 1: 0, 2: 2, 3: 3})
    # the whole group {0, 1} lost: nothing is held by everyone
    assert newest_common(ck, [[], [], [5], [5]], [{}, {}, {3: [5]}, {2: [5]}]) is None


def _reserve_commit(s: NodeStore, it: int, blob: bytes) -> None:
    res = s.reserve("own", 0, it, len(blob))
    assert res is not None
    res.buffer[:] = blob
    s.commit(res)


def test_reserved_slots_alternate_and_reuse_their_mapping(tmp_path: Path) -> None:
    s = NodeStore(tmp_path, 0)
    for it in range(1, 6):
        _reserve_commit(s, it, bytes([it]) * 64)
        assert sorted(s.iterations("own", 0)) == [it - 1, it][(it == 1):]
    assert s.read("own", 0, 5) == bytes([5]) * 64 and s.read("own", 0, 4) == bytes([4]) * 64
    assert s.reserve("own", 0, 5, 64) is None  # already complete
    maps = dict(s._maps)
    _reserve_commit(s, 6, b"x" * 64)
    assert s._maps == maps  # the same files, the same sizes: mapped once


def test_reserve_after_the_node_was_wiped(tmp_path: Path) -> None:
    import shutil

    s = NodeStore(tmp_path, 0)
    _reserve_commit(s, 1, b"a" * 64)
    _reserve_commit(s, 2, b"b" * 64)
    shutil.rmtree(s.path)  # the machine's memory is lost under a live process
    _reserve_commit(s, 3, b"c" * 128)
    assert s.read("own", 0, 3) == b"c" * 128
    # a slot reserved but never committed (its writer died) is not complete, and the
    # previous snapshot in the other slot stays readable
    assert s.reserve("own", 0, 4, 128) is not None
    assert sorted(s.iterations("own", 0)) == [3]
    assert s.read("own", 0, 3) == b"c" * 128
