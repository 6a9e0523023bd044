"""Zen's hierarchical hashing (Algorithm 3.2) and hash bitmap (Algorithm 3.3), on numpy arrays.

Pure (numpy, no torch): the runtime executes exactly these functions on the indices of each
sparse gradient, and the tests check the thesis's invariants on them (``zen_espresso.md`` §B.9,
§B.10, §F.4).

Hash functions. ``h_0`` (the partition) and ``h_1..h_k`` (the slot inside a partition) are a
seeded 64-bit mixer (the splitmix64 finalizer, a strong integer hash like the MurmurHash3
finalizer the thesis uses) taken modulo the range. Seed ``j`` of ``h_j`` is derived from the
plan's seed by :func:`hash_seeds`, so every rank builds the same functions from the plan and no
broadcast of seeds is needed (the thesis broadcasts them at start-up; a plan fixes them once).

Algorithm 3.2 on a CPU. The thesis runs one GPU thread per index; slot conflicts are settled
by whichever thread writes first. Here each round is vectorised and a conflict is settled by
the lowest position in the input (``np.unique(..., return_index=True)``), which makes the
output deterministic; the losers try the next hash function, and after ``k`` failed rounds
an index takes the next serial slot of its partition (the atomic counter, in input order).
Decisions on the thesis's open points (§H.12–H.15): slot contents are the indices themselves
(§H.14), the empty sentinel is -1 so index 0 is legal (§H.13), ``h_i`` ranges over ``[r1]``
(§H.15), ``r1`` and ``r2`` are per partition, and a serial region that fills up grows instead
of losing an index: :attr:`HashResult.overflow` counts the indices past ``r2`` so that a caller
(and the tests) see it. Cost: ``O(k |I|)`` numpy work.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = [
    "HashResult",
    "bitmap_decode",
    "bitmap_encode",
    "hash_bitmap_decode",
    "hash_bitmap_encode",
    "hash_partition",
    "hash_seeds",
    "hierarchical_hash",
    "mix64",
    "partition_of",
    "partition_sets",
    "push_imbalance",
]

IndexArray = npt.NDArray[np.int64]

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


def mix64(values: npt.ArrayLike, seed: int) -> npt.NDArray[np.uint64]:
    """The seeded splitmix64 finalizer of each value (a 64-bit hash, vectorised)."""
    x = np.asarray(values, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        x = x + np.uint64((seed * _GOLDEN + _GOLDEN) & _MASK)
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return x ^ (x >> np.uint64(31))


def hash_seeds(seed: int, k: int) -> tuple[int, ...]:
    """The seeds of ``h_0..h_k`` derived from one plan seed (``k + 1`` distinct values)."""
    base = mix64(np.arange(k + 1, dtype=np.int64), seed)
    return tuple(int(v) & 0x7FFFFFFF for v in base)


def partition_of(indices: npt.ArrayLike, n: int, seed: int) -> IndexArray:
    """``h_0``: the partition (server) of every index, the same on every rank for one seed."""
    if n < 1:
        raise ValueError(f"n must be >= 1 partitions, got {n!r}")
    h0_seed = hash_seeds(seed, 0)[0]
    return (mix64(indices, h0_seed) % np.uint64(n)).astype(np.int64)


@dataclass(frozen=True)
class HashResult:
    """The output of Algorithm 3.2.

    Attributes:
        partitions: for each partition ``p``, the indices whose ``h_0`` is ``p``, in slot order
            (parallel slots first, then serial ones), each input index exactly once.
        serial: how many indices of each partition went to serial memory (all ``k`` slots taken).
        overflow: how many of those were past the ``r2`` serial slots (the region grew).
        r1: parallel slots per partition.
        r2: serial slots per partition.
    """

    partitions: tuple[IndexArray, ...]
    serial: tuple[int, ...]
    overflow: int
    r1: int
    r2: int

    @property
    def counts(self) -> tuple[int, ...]:
        """Non-zeros per partition (the push volume to each server)."""
        return tuple(len(p) for p in self.partitions)


def hierarchical_hash(
    indices: npt.ArrayLike,
    n: int,
    seed: int,
    k: int = 3,
    r1: int | None = None,
    r2: int | None = None,
) -> HashResult:
    """Algorithm 3.2: split the non-zero ``indices`` of one gradient into ``n`` partitions.

    Args:
        indices: distinct non-negative indices of the non-zeros (any order).
        n: partitions (servers).
        seed: the plan's seed; :func:`hash_seeds` derives ``h_0..h_k`` from it.
        k: slot hash functions tried before serial memory (the thesis uses 3).
        r1: parallel slots per partition; default ``max(1, ceil(2|I|/n))`` (the thesis's
            ``2|G|d_G`` in total, spread over the partitions).
        r2: serial slots per partition; default ``max(1, r1 // 10)``.

    Returns:
        A :class:`HashResult`. Example: ``hierarchical_hash([3, 9, 4], 2, 0).counts`` sums to 3.
    """
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    if k < 1:
        raise ValueError(f"k must be >= 1 slot hash functions, got {k!r}")
    if idx.size and int(idx.min()) < 0:
        raise ValueError("indices must be non-negative")
    if idx.size != np.unique(idx).size:
        raise ValueError("indices must be distinct (one entry per non-zero row or element)")
    if r1 is None:
        r1 = max(1, -(-2 * idx.size // n))
    if r2 is None:
        r2 = max(1, r1 // 10)
    part = partition_of(idx, n, seed)
    seeds = hash_seeds(seed, k)
    slots = np.full((n, r1), -1, dtype=np.int64)
    pending = np.arange(idx.size)
    for round_ in range(1, k + 1):
        if pending.size == 0:
            break
        q = (mix64(idx[pending], seeds[round_]) % np.uint64(r1)).astype(np.int64)
        p = part[pending]
        free = slots[p, q] < 0
        cand, pq = pending[free], p[free] * r1 + q[free]
        # the first writer in input order wins a contested slot (deterministic "atomic" write)
        _, first = np.unique(pq, return_index=True)
        won = cand[first]
        slots.reshape(-1)[pq[first]] = idx[won]
        placed = np.zeros(idx.size, dtype=bool)
        placed[won] = True
        pending = pending[~placed[pending]]
    serial_lists: list[IndexArray] = []
    for j in range(n):
        serial_lists.append(idx[pending[part[pending] == j]])
    partitions = tuple(
        np.concatenate([slots[j][slots[j] >= 0], serial_lists[j]]) for j in range(n)
    )
    serial = tuple(len(s) for s in serial_lists)
    overflow = sum(max(0, s - r2) for s in serial)
    return HashResult(partitions, serial, overflow, r1, r2)


def hash_partition(indices: npt.ArrayLike, n: int, seed: int) -> list[IndexArray]:
    """Public entry point: the ``n`` index arrays of Algorithm 3.2 (defaults ``k=3``, ``r1``,
    ``r2`` as in :func:`hierarchical_hash`); array ``j`` holds the indices with ``h_0 = j``."""
    return list(hierarchical_hash(indices, n, seed).partitions)


def push_imbalance(counts: npt.ArrayLike) -> float:
    """Definition 3.6's push imbalance of one worker: ``n * max(counts) / sum(counts)``.

    ``counts`` are the non-zeros sent to each of the ``n`` partitions; 1.0 is perfectly
    balanced, ``n`` is everything in one partition. Fig. 3.6: ``(1, 4, 1)`` gives 2.
    """
    c = np.asarray(counts, dtype=np.float64).reshape(-1)
    if c.size == 0:
        raise ValueError("counts must name at least one partition")
    total = float(c.sum())
    if total <= 0:
        return 1.0
    return float(c.size * c.max() / total)


def partition_sets(size: int, n: int, seed: int) -> list[IndexArray]:
    """``𝕀_i = {idx in [0, size) | h_0(idx) = i}``, sorted: fixed for one ``h_0`` and disjoint,
    so it is computed once per plan (Algorithm 3.3's offline step)."""
    every = np.arange(size, dtype=np.int64)
    part = partition_of(every, n, seed)
    order = np.argsort(part, kind="stable")
    bounds = np.searchsorted(part[order], np.arange(n + 1))
    return [every[order[bounds[j]:bounds[j + 1]]] for j in range(n)]


def bitmap_encode(indices: npt.ArrayLike, size: int) -> npt.NDArray[np.uint32]:
    """A bitmap of ``size`` bits (packed into ``ceil(size/32)`` 32-bit words) with the bits of
    ``indices`` (0-based positions ``< size``) set; bit ``i`` is bit ``i % 32`` of word
    ``i // 32``. Its size is ``size/32`` words, as Theorem 3.3 counts it."""
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= size):
        raise ValueError(f"bitmap positions must lie in [0, {size}), got {idx.min()}..{idx.max()}")
    words = np.zeros(-(-size // 32), dtype=np.uint32)
    np.bitwise_or.at(words, idx // 32, (np.uint32(1) << (idx % 32).astype(np.uint32)))
    return words


def bitmap_decode(bits: npt.ArrayLike) -> IndexArray:
    """The sorted 0-based positions of the set bits of a bitmap from :func:`bitmap_encode`."""
    words = np.asarray(bits, dtype=np.uint32).reshape(-1)
    unpacked = np.unpackbits(words.view(np.uint8), bitorder="little")
    return np.flatnonzero(unpacked).astype(np.int64)


def hash_bitmap_encode(nonzero: npt.ArrayLike, part_set: IndexArray) -> npt.NDArray[np.uint32]:
    """Algorithm 3.3 at server ``i``: the bitmap over ``𝕀_i`` (``part_set``, sorted) of the
    aggregated non-zero global indices ``nonzero`` (all of them in ``𝕀_i``)."""
    nz = np.asarray(nonzero, dtype=np.int64).reshape(-1)
    pos = np.searchsorted(part_set, nz)
    if nz.size and (int(pos.max()) >= part_set.size or np.any(part_set[pos] != nz)):
        raise ValueError("every non-zero index must belong to the partition's index set")
    return bitmap_encode(pos, int(part_set.size))


def hash_bitmap_decode(part_set: IndexArray, bits: npt.ArrayLike) -> IndexArray:
    """Algorithm 3.3 at a worker: the global indices ``𝕀_i[bitmap_decode(bits)]``."""
    return part_set[bitmap_decode(bits)]
