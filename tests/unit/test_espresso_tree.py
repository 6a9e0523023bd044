"""Espresso's decision tree (thesis §4.5) against the counts of ``zen_espresso.md`` §F.1.

The expected numbers come from the thesis (|C| = 4341, §4.7.1) and the digest's independent
enumeration script (§D.3), not from this code.
"""

from __future__ import annotations

from collections import Counter

import pytest

from hetplan.algorithms.espresso_tree import (
    TASKS,
    all_options,
    devices_of,
    is_compressed,
    is_hierarchical,
    num_compressions,
    offloaded,
    option_id,
    options,
)


def test_total_count_is_4341() -> None:
    opts = all_options()
    assert len(opts) == 4341
    assert len(set(opts)) == 4341
    assert sum(1 for o in opts if not is_hierarchical(o)) == 63
    assert sum(1 for o in opts if is_hierarchical(o)) == 4278


def test_gpu_only_options_are_174_with_9_uncompressed() -> None:
    gpu = options(devices=["gpu"])
    assert len(gpu) == 174
    assert sum(1 for o in gpu if not is_compressed(o)) == 9
    assert len(options(devices=["gpu"], compress=True)) == 165


def test_counts_by_number_of_compressions() -> None:
    counts = Counter(num_compressions(o) for o in all_options())
    assert dict(counts) == {0: 9, 1: 236, 2: 1152, 3: 1920, 4: 1024}


def test_topology_pruned_gpu_candidates() -> None:
    assert len(options(devices=["gpu"], hierarchies=["flat"])) == 12
    assert len(options(devices=["gpu"], hierarchies=["hierarchical"])) == 162


def test_max_compressions_constraint() -> None:
    for m in range(5):
        got = options(max_compressions=m)
        assert all(num_compressions(o) <= m for o in got)
        assert len(got) == sum(v for k, v in {0: 9, 1: 236, 2: 1152, 3: 1920, 4: 1024}.items()
                               if k <= m)


def test_routines_are_in_their_task_search_space() -> None:
    for o in all_options():
        for a in o:
            if a.task in ("comp", "decomp"):
                assert a.device in TASKS[a.task] and a.routine is None
            else:
                assert a.routine in TASKS[a.task] and a.device is None


def test_pruning_rules() -> None:
    for o in all_options():
        comms = [a for a in o if a.routine is not None]
        # a second step (also one right after a compression) closes an open first step
        for k, (a, b) in enumerate(zip(o, o[1:])):
            if a.task == "comp" and b.task in ("comm2", "comm2_comp"):
                assert any(c.task.startswith("comm1") and c.level == b.level for c in o[:k])
        # hierarchical paths start with a divisible intra step
        if is_hierarchical(o):
            assert comms[0].level == "intra" and comms[0].task in ("comm1", "comm1_comp")
        # a second step pairs with the open first step of its level
        open_: dict[str, str] = {}
        for a in comms:
            if a.task in ("comm1", "comm1_comp"):
                open_[a.level] = a.routine or ""
            elif a.task in ("comm2", "comm2_comp"):
                first = open_.pop(a.level)
                scatter = first in ("reduce_scatter", "alltoall")
                assert a.routine == ("allgather" if scatter else "broadcast")
        assert not open_, f"unfinished divisible scheme in {[str(a) for a in o]}"
        # compressed comms only between a comp and the decomp that ends the compression
        compressed = False
        for a in o:
            if a.task == "comp":
                assert not compressed
                compressed = True
            elif a.task == "decomp":
                assert compressed
                compressed = False
            elif a.routine is not None:
                assert a.compressed_comm == compressed
        assert not compressed


def test_option_ids_and_offload() -> None:
    opts = all_options()
    assert [option_id(o) for o in opts[:5]] == [0, 1, 2, 3, 4]
    for o in options(devices=["gpu"], compress=True):
        cpu = offloaded(o)
        assert devices_of(cpu) == {"cpu"} and option_id(cpu) != option_id(o)


def test_bad_constraints() -> None:
    with pytest.raises(ValueError, match="unknown devices"):
        options(devices=["tpu"])
    with pytest.raises(ValueError, match="unknown hierarchies"):
        options(hierarchies=["ring"])
