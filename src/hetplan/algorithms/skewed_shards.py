"""Static skewed tensor-parallel shards: integer shard sizes proportional to device speed.

The "static skewed data assignment" baseline of heterogeneous tensor parallelism
(``research/zero_resizing.md`` §6.1): a TP group whose devices differ in speed gives each
rank a share of every split linear proportional to its speed, so all ranks reach each
synchronising all-reduce together. Pure: no torch.

Problem. Split ``features`` columns among ranks with speeds ``s_r`` into integer sizes that
are multiples of ``granularity`` (``features`` itself need only be a multiple where the
granularity divides it) and sum to ``features``, minimising the slowest rank's time
``max_r size_r / s_r``.

Decisions (also in ``docs/decisions.md``, "TP resizing pass"):

* **Min-max apportionment, not rounding.** Rounding ideal shares to the nearest unit can
  leave the slowest rank with an extra unit; instead units are handed out one at a time to
  the rank whose time after taking the unit is smallest (ties: lower rank). For the
  objective ``max_r units_r / s_r`` this greedy is optimal (every unit goes where it raises
  the maximum least, and the result is the same as the exact solution by exchange argument;
  the unit tests compare with brute force).
* **Granularity** (:func:`shard_granularity`), for linears with no unit of their own (MLP
  pairs): 64 columns where 64 divides ``features`` and leaves at least 2 units per rank (a
  multiple of the tensor-core tile), else the largest power of two ≤ 64 that does, else 1.
  A rank may get zero units when it is very slow (the runtime supports empty MLP shards).
  Attention pairs are not cut this way: the ``tp-resizing`` pass passes their head unit as
  ``granularity`` with ``min_units=1`` (whole heads, at least one per rank).
* Speeds must be positive and finite: a rank with no speed has no place in a TP group.

Complexity O(units · log ranks).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from hetplan.errors import SpecError

__all__ = ["even_shards", "proportional_shards", "shard_granularity", "shard_time"]

#: The largest granularity tried (columns); see the module docstring.
MAX_GRANULARITY = 64


def shard_granularity(features: int, parts: int) -> int:
    """The unit of a shard: the largest power of two ≤ 64 dividing ``features`` that leaves
    at least two units per rank, else 1.

    Args:
        features: size of the split dimension.
        parts: ranks in the group.
    """
    if features < 1 or parts < 1:
        raise SpecError(f"features and parts must be >= 1, got features={features}, "
                        f"parts={parts}")
    g = MAX_GRANULARITY
    while g > 1:
        if features % g == 0 and features // g >= 2 * parts:
            return g
        g //= 2
    return 1


def even_shards(features: int, parts: int) -> tuple[int, ...]:
    """The even split (the runtime's default): the first ``features % parts`` ranks get one
    more column."""
    if parts < 1:
        raise SpecError(f"parts must be >= 1, got {parts}")
    base, extra = divmod(features, parts)
    return tuple(base + (1 if i < extra else 0) for i in range(parts))


def _check_speeds(speeds: Sequence[float]) -> None:
    if not speeds:
        raise SpecError("a TP group needs at least one rank speed")
    bad = [i for i, s in enumerate(speeds) if not (math.isfinite(s) and s > 0)]
    if bad:
        raise SpecError(f"rank speeds must be positive and finite; ranks {bad} have "
                        f"{[speeds[i] for i in bad]}")


def proportional_shards(features: int, speeds: Sequence[float],
                        granularity: int | None = None, *,
                        min_units: int = 0) -> tuple[int, ...]:
    """Shard sizes for ``features`` columns over ranks of the given speeds (see module doc).

    Args:
        features: size of the split dimension (≥ 1).
        speeds: relative speed of every rank of the group, in group order (> 0).
        granularity: unit of a shard; None chooses :func:`shard_granularity`. When it does
            not divide ``features`` the remainder goes, as one smaller unit, to the rank whose
            time grows least.
        min_units: units every rank gets before the rest are handed out (1 for attention:
            a rank left no head would run it replicated); the greedy stays optimal under
            that lower bound.

    Returns:
        Sizes summing to ``features``, one per rank.

    Raises:
        SpecError: non-positive speeds, features or granularity; fewer units than
            ``min_units`` per rank.
    """
    _check_speeds(speeds)
    if features < 1:
        raise SpecError(f"features must be >= 1, got {features}")
    g = shard_granularity(features, len(speeds)) if granularity is None else granularity
    if g < 1:
        raise SpecError(f"granularity must be >= 1, got {g}")
    units, rest = divmod(features, g)
    if min_units < 0:
        raise SpecError(f"min_units must be >= 0, got {min_units}")
    if units < min_units * len(speeds):
        raise SpecError(f"{features} features in units of {g} give {units} unit(s), fewer "
                        f"than min_units={min_units} for each of {len(speeds)} ranks")
    sizes = [min_units * g] * len(speeds)
    # heap of (time after taking one more unit, rank)
    heap = [((sizes[r] + g) / s, r) for r, s in enumerate(speeds)]
    heapq.heapify(heap)
    for _ in range(units - min_units * len(speeds)):
        _, r = heapq.heappop(heap)
        sizes[r] += g
        heapq.heappush(heap, ((sizes[r] + g) / speeds[r], r))
    if rest:
        r = min(range(len(speeds)), key=lambda i: ((sizes[i] + rest) / speeds[i], i))
        sizes[r] += rest
    return tuple(sizes)


def shard_time(sizes: Sequence[int], speeds: Sequence[float]) -> float:
    """The slowest rank's time ``max_r sizes[r] / speeds[r]`` (columns per unit speed)."""
    _check_speeds(speeds)
    if len(sizes) != len(speeds):
        raise SpecError(f"{len(sizes)} sizes for {len(speeds)} speeds")
    return max(n / s for n, s in zip(sizes, speeds))
