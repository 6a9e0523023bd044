"""Gemini: where in-memory checkpoint replicas live, how likely they survive, how their
traffic fits the network's idle time, and how much time a failure wastes.

Thesis chapter 6 (``research/cupcake_gemini.md`` Part B). Pure: no torch, exact arithmetic
with :class:`fractions.Fraction` where the thesis states exact values.

1. **Placement** (Algorithm 6.1, Theorem 6.1). :func:`placement_groups` returns the
   algorithm's group list and strategy label; :func:`place` returns, for every node, the
   ``m`` nodes that hold its checkpoint (itself first, then its ``m - 1`` remote holders).
   Node ids are **0-based** (the thesis counts from 1).

   * ``group`` (``m`` divides ``n``): nodes ``[j*m, (j+1)*m)`` form a group; every member
     holds every member's checkpoint.
   * ``ring``: node ``i`` is held by ``i, i+1, …, i+m-1`` (mod ``n``). The thesis's "the
     consecutive m − 1 machines in the ring from its left hand" leaves the direction open;
     the successors are chosen, which changes no probability (the failure sets are the same
     windows of ``m`` consecutive nodes).
   * ``mixed``: the first ``⌊n/m⌋ - 1`` groups as ``group``, the last ``m + q`` nodes
     (``q = n mod m``) as a ring among themselves. Equals ``group`` when ``m`` divides ``n``.
   ``n < m`` is rejected (Algorithm 6.1 indexes an empty group list there).

2. **Recovery probability** for ``k`` nodes failing at once, the failed set uniformly random
   among the ``C(n, k)`` sets (the thesis's implicit assumption). Recovery from CPU memory
   fails iff some node loses all ``m`` holders. :func:`recovery_probability` is exact:

   * by enumeration of the failed sets (:func:`recovery_probability_enumerated`) when there
     are at most :data:`ENUMERATION_LIMIT` of them;
   * otherwise by counting the good sets: the groups' part is the coefficient of ``x^j`` in
     ``((1+x)^m - x^m)^G`` (no group wholly failed) and the ring's part counts cyclic 0/1
     strings with ``j`` ones and no cyclic run of ``m`` ones (a small DP). For pure group
     placement this equals the inclusion-exclusion closed form
     :func:`group_recovery_closed_form`; for mixed placement at ``k = m`` it equals
     :func:`mixed_recovery_closed_form` (``1 - (m+q+p-1)/C(n,m)``). Property tests hold all
     of them against the enumeration.

   :func:`eq64_bound` is Corollary 6.1's Eq. 6.4 (``m | n`` only): exact for
   ``m <= k < 2m``, a strict lower bound for ``k >= 2m`` unless both are 0 (e.g.
   ``(8, 2, 4)``: 8/35 exact against 1/7). :func:`theorem61_upper_bound` is the best any
   placement can do at ``k = m``.

3. **Traffic partition** (Algorithm 6.2, fixed): :func:`partition_checkpoint` cuts the
   ``remote_copies`` copies of a ``ckpt_bytes`` checkpoint into chunks of at most one
   sub-buffer ``R/p`` and places them into idle spans, charging ``chunk_time(s) = α + s/bw``
   against each span's budget ``μ·t``. Decisions on the digest's defects (§B4.3):

   * G1: the budget is charged ``chunk_time(size)`` (the listing charges
     ``f(remain_size)``);
   * G2: a span whose remaining budget cannot carry one byte past ``α`` is left (the listing
     loops forever when ``0 < budget <= α``);
   * G3: exactly ``m - 1`` remote copies are partitioned (the listing's ``cpkt_id < m - 1``
     partitions ``m``); the local copy is a device→host copy, not network traffic;
   * G4: the infinite span is **appended** after the real ones (the prose overwrites the last
     one, losing its capacity); chunks placed there are *overflow*: they delay the step;
   * G5: every chunk carries its span, replica, byte offset and size;
   * G6: names ``bw``/``chunk_time``/``interval`` avoid the thesis's clashing ``B``, ``f``.
   ``unit`` (optional) rounds chunk sizes down to a multiple of it (bytes: whole elements);
   ``None`` keeps real-valued sizes, as in the digest's worked example.

4. **Wasted time** (Eq. 6.1): :func:`expected_wasted_time` ``= t_ckpt + interval/2 +
   t_rtvl``; :func:`checkpoint_every` is the frequency rule when the traffic does not fit
   (the thesis says only "reduce the frequency").

Complexity: placement O(n·m); enumeration O(C(n,k)·n); counting O(G·k² + r·m²·k) with
``G`` groups and a ring of ``r`` nodes; partition O(chunks + spans).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from itertools import combinations
from typing import Literal

from hetplan.errors import SpecError

__all__ = [
    "Placement",
    "Chunk",
    "ENUMERATION_LIMIT",
    "placement_groups",
    "place",
    "recovery_probability",
    "recovery_probability_enumerated",
    "group_recovery_closed_form",
    "mixed_recovery_closed_form",
    "eq64_bound",
    "theorem61_upper_bound",
    "chunk_time",
    "partition_checkpoint",
    "expected_wasted_time",
    "checkpoint_every",
]

Placement = Literal["group", "ring", "mixed"]

#: Failed sets up to which :func:`recovery_probability` enumerates instead of counting.
ENUMERATION_LIMIT = 200_000


def _check_nm(n: int, m: int) -> None:
    if m < 1:
        raise SpecError(f"replicas m must be >= 1, got m={m}")
    if n < m:
        raise SpecError(f"Gemini needs at least as many nodes as replicas: n={n} < m={m}; "
                        f"lower --replicas to at most {n}")


def placement_groups(n: int, m: int) -> tuple[tuple[tuple[int, ...], ...], str]:
    """Algorithm 6.1: the group list and the strategy label ("group" or "mixed").

    Args:
        n: nodes (machines), ``n >= m``.
        m: replicas per checkpoint, the local one included.

    Returns:
        ``(groups, strategy)``; 0-based node ids; the remainder ``n mod m`` joins the last
        group, which is then placed as a ring.

    Example:
        >>> placement_groups(5, 2)
        (((0, 1), (2, 3, 4)), 'mixed')
    """
    _check_nm(n, m)
    g = n // m
    groups = [list(range(m * i, m * i + m)) for i in range(g)]
    strategy = "group"
    if n % m:
        strategy = "mixed"
        groups[-1].extend(range(g * m, n))
    return tuple(tuple(x) for x in groups), strategy


def _ring_holders(members: Sequence[int], m: int) -> list[tuple[int, ...]]:
    r = len(members)
    return [tuple(members[(i + j) % r] for j in range(m)) for i in range(r)]


def place(n: int, m: int, placement: Placement = "mixed") -> tuple[tuple[int, ...], ...]:
    """Each node's holders: ``holders[i]`` lists the ``m`` nodes keeping node ``i``'s
    checkpoint, ``i`` itself first, then its remote holders in sending order.

    Args:
        n: nodes, ``n >= m``.
        m: replicas, the local copy included.
        placement: "mixed" (Algorithm 6.1; "group" when ``m`` divides ``n``), "group"
            (requires ``m | n``) or "ring".

    Example:
        >>> place(4, 2)
        ((0, 1), (1, 0), (2, 3), (3, 2))
    """
    _check_nm(n, m)
    if placement == "ring":
        return tuple(_ring_holders(range(n), m))
    if placement == "group" and n % m:
        raise SpecError(f"group placement needs m to divide n: n={n}, m={m}; use "
                        f"placement='mixed' (Algorithm 6.1) or change --replicas")
    if placement not in ("group", "mixed"):
        raise SpecError(f"placement must be 'group', 'ring' or 'mixed', got {placement!r}")
    groups, strategy = placement_groups(n, m)
    holders: list[tuple[int, ...]] = [()] * n
    for gi, members in enumerate(groups):
        if strategy == "mixed" and gi == len(groups) - 1:
            for node, hs in zip(members, _ring_holders(members, m), strict=True):
                holders[node] = hs
            continue
        for node in members:
            holders[node] = (node, *(x for x in members if x != node))
    return tuple(holders)


def _check_k(n: int, k: int) -> None:
    if not 0 <= k <= n:
        raise SpecError(f"failed nodes k must be in [0, n={n}], got k={k}")


def recovery_probability_enumerated(holders: Sequence[Sequence[int]], k: int) -> Fraction:
    """Reference: the share of the ``C(n, k)`` failed sets that leave every node at least
    one holder, by enumerating them. ``holders`` as returned by :func:`place`."""
    n = len(holders)
    _check_k(n, k)
    masks = sorted({sum(1 << h for h in hs) for hs in holders})
    good = 0
    total = 0
    for failed in combinations(range(n), k):
        fm = sum(1 << x for x in failed)
        total += 1
        if not any(hm & fm == hm for hm in masks):
            good += 1
    return Fraction(good, total)


def _groups_good(groups: int, m: int, k: int) -> list[int]:
    """``out[j]``: ways to fail ``j <= k`` nodes among ``groups`` groups of ``m`` with no
    group wholly failed (coefficients of ``((1+x)^m - x^m)^groups``)."""
    one = [math.comb(m, j) for j in range(m + 1)]
    one[m] -= 1
    out = [1] + [0] * k
    for _ in range(groups):
        nxt = [0] * (k + 1)
        for a, ca in enumerate(out):
            if ca:
                for b in range(min(m, k - a) + 1):
                    nxt[a + b] += ca * one[b]
        out = nxt
    return out


def _ring_good(r: int, m: int, k: int) -> list[int]:
    """``out[j]``: labelled cyclic 0/1 strings of length ``r`` with ``j <= k`` ones and no
    cyclic run of ``m`` ones (no window of ``m`` consecutive ring nodes wholly failed)."""
    out = [0] * (k + 1)
    if r == 0:
        out[0] = 1
        return out
    # State: (leading run of ones, whether a zero was seen, current trailing run, ones).
    states: dict[tuple[int, bool, int, int], int] = {(0, False, 0, 0): 1}
    for _ in range(r):
        nxt: dict[tuple[int, bool, int, int], int] = {}
        for (lead, zero, run, ones), c in states.items():
            # place a 0
            key = (lead, True, 0, ones)
            nxt[key] = nxt.get(key, 0) + c
            # place a 1
            if ones + 1 > k:
                continue
            if zero:
                if run + 1 < m:
                    key = (lead, True, run + 1, ones + 1)
                    nxt[key] = nxt.get(key, 0) + c
            elif lead + 1 < m:
                key = (lead + 1, False, 0, ones + 1)
                nxt[key] = nxt.get(key, 0) + c
        states = nxt
    for (lead, zero, run, ones), c in states.items():
        if zero and lead + run < m:
            out[ones] += c
    # The all-ones string has no zero; it is good only when r < m (cannot happen for a
    # placement ring, where r >= m, but keep the count exact).
    if r <= k and r < m:
        out[r] += 1
    return out


def _structure(n: int, m: int, placement: Placement) -> tuple[int, int]:
    """(number of size-m groups, ring length) of a placement."""
    if placement == "ring":
        return 0, n
    if placement == "group" or n % m == 0:
        if n % m:
            raise SpecError(f"group placement needs m to divide n: n={n}, m={m}")
        return n // m, 0
    g = n // m
    return g - 1, n - m * (g - 1)


def recovery_probability(n: int, m: int, k: int,
                         placement: Placement = "group") -> Fraction:
    """Exact probability that ``k`` simultaneous node failures leave every checkpoint a
    holder, so training recovers from CPU memory.

    Args:
        n: nodes; m: replicas (local included); k: failed nodes, a uniformly random set.
        placement: "group" (``m | n``), "ring" or "mixed" (Algorithm 6.1).

    Returns:
        A :class:`~fractions.Fraction`; 1 for ``k < m``.

    Example:
        >>> recovery_probability(16, 2, 2)
        Fraction(14, 15)
    """
    _check_nm(n, m)
    _check_k(n, k)
    if placement not in ("group", "ring", "mixed"):
        raise SpecError(f"placement must be 'group', 'ring' or 'mixed', got {placement!r}")
    groups, ring = _structure(n, m, placement)
    if k < m:
        return Fraction(1)
    total = math.comb(n, k)
    if total <= ENUMERATION_LIMIT:
        return recovery_probability_enumerated(place(n, m, placement), k)
    gg = _groups_good(groups, m, k)
    rg = _ring_good(ring, m, k)
    good = sum(rg[j] * gg[k - j] for j in range(k + 1))
    return Fraction(good, total)


def group_recovery_closed_form(n: int, m: int, k: int) -> Fraction:
    """Inclusion-exclusion over the ``n/m`` groups (digest §B3.4, DERIVED):
    ``Σ_j (-1)^j C(n/m, j) C(n - jm, k - jm) / C(n, k)``. Requires ``m | n``."""
    _check_nm(n, m)
    _check_k(n, k)
    if n % m:
        raise SpecError(f"the group closed form needs m to divide n: n={n}, m={m}")
    g = n // m
    bad_free = sum((-1) ** j * math.comb(g, j) * math.comb(n - j * m, k - j * m)
                   for j in range(k // m + 1))
    return Fraction(bad_free, math.comb(n, k))


def mixed_recovery_closed_form(n: int, m: int) -> Fraction:
    """Mixed placement at ``k = m`` (Theorem 6.1's proof): ``1 - (m+q+p-1)/C(n, m)`` with
    ``n = p·m + q``, ``1 <= q < m``; for ``q = 0`` the group value ``1 - (n/m)/C(n, m)``."""
    _check_nm(n, m)
    p, q = divmod(n, m)
    unique_sets = p if q == 0 else m + q + p - 1
    return 1 - Fraction(unique_sets, math.comb(n, m))


def theorem61_upper_bound(n: int, m: int) -> Fraction:
    """The best recovery probability any placement reaches at ``k = m``:
    ``1 - ⌈n/m⌉/C(n, m)`` (Theorem 6.1's proof)."""
    _check_nm(n, m)
    return 1 - Fraction(-(-n // m), math.comb(n, m))


def eq64_bound(n: int, m: int, k: int) -> Fraction:
    """Corollary 6.1, Eq. 6.4: ``max(0, 1 - n·C(n-m, k-m)/(m·C(n, k)))`` for ``m | n``
    (1 when ``k < m``). Exact for ``m <= k < 2m``; a lower bound for ``k >= 2m``."""
    _check_nm(n, m)
    _check_k(n, k)
    if n % m:
        raise SpecError(f"Eq. 6.4 holds only when m divides n: n={n}, m={m}")
    if k < m:
        return Fraction(1)
    value = 1 - Fraction(n * math.comb(n - m, k - m), m * math.comb(n, k))
    return max(Fraction(0), value)


@dataclass(frozen=True, slots=True)
class Chunk:
    """One checkpoint chunk: sent in idle span ``span`` (index ``len(spans)`` is the
    appended overflow span), for remote copy ``replica`` (0-based), bytes
    ``[offset, offset + size)`` of the checkpoint."""

    span: int
    replica: int
    offset: float
    size: float


def chunk_time(size: float, alpha_s: float, bw: float) -> float:
    """Time to send one chunk: ``alpha_s + size / bw``."""
    return alpha_s + size / bw


def partition_checkpoint(spans: Sequence[float], *, ckpt_bytes: float, remote_copies: int,
                         buffer_bytes: float, sub_buffers: int, alpha_s: float, bw: float,
                         mu: float, unit: float | None = None) -> tuple[Chunk, ...]:
    """Algorithm 6.2 with the fixes in the module docstring.

    Args:
        spans: idle span lengths (s) in the order they occur in an iteration.
        ckpt_bytes: ``C``, one checkpoint's size.
        remote_copies: ``m - 1``.
        buffer_bytes: ``R``, the reserved buffer; split into ``sub_buffers`` (``p``) parts.
        alpha_s, bw: the chunk cost model ``alpha_s + size / bw``.
        mu: ``μ`` in (0, 1], the share of each profiled span trusted to be idle.
        unit: chunk sizes are rounded down to a multiple of it (None: no rounding).

    Returns:
        The chunks, in sending order. Chunks with ``span == len(spans)`` are overflow.

    Example (the digest's G9):
        >>> [(c.span, c.size) for c in partition_checkpoint([12, 6, 3], ckpt_bytes=10,
        ...     remote_copies=1, buffer_bytes=16, sub_buffers=4, alpha_s=1, bw=1, mu=0.5)]
        [(0, 4.0), (1, 2.0), (2, 0.5), (3, 3.5)]
    """
    if remote_copies < 0:
        raise SpecError(f"remote_copies must be >= 0, got {remote_copies}")
    if not 0 < mu <= 1:
        raise SpecError(f"mu must be in (0, 1], got {mu}")
    if sub_buffers < 1 or buffer_bytes <= 0:
        raise SpecError(f"buffer_bytes and sub_buffers must be positive, got "
                        f"{buffer_bytes} and {sub_buffers}")
    if bw <= 0 or alpha_s < 0 or ckpt_bytes < 0:
        raise SpecError(f"need bw > 0, alpha_s >= 0, ckpt_bytes >= 0; got bw={bw}, "
                        f"alpha_s={alpha_s}, ckpt_bytes={ckpt_bytes}")
    if any(t < 0 or not math.isfinite(t) for t in spans):
        raise SpecError(f"idle spans must be finite and >= 0, got {list(spans)}")
    part = buffer_bytes / sub_buffers
    if unit is not None:
        part = math.floor(part / unit) * unit
        if part <= 0:
            raise SpecError(f"sub-buffer {buffer_bytes / sub_buffers} bytes is smaller than "
                            f"the unit {unit}")
    chunks: list[Chunk] = []
    if remote_copies == 0 or ckpt_bytes == 0:
        return ()
    replica = 0
    remain = float(ckpt_bytes)
    all_spans = [*spans, math.inf]
    for si, t in enumerate(all_spans):
        budget = mu * t
        while budget > 0:
            if budget >= chunk_time(part, alpha_s, bw):
                size = part
            else:
                size = max(0.0, (budget - alpha_s) * bw)
                if unit is not None:
                    size = math.floor(size / unit) * unit
            size = min(size, remain)
            if size <= 0:
                break
            chunks.append(Chunk(si, replica, ckpt_bytes - remain, float(size)))
            remain -= size
            if budget != math.inf:
                budget -= chunk_time(size, alpha_s, bw)
            if remain == 0:
                if replica + 1 < remote_copies:
                    replica += 1
                    remain = float(ckpt_bytes)
                else:
                    return tuple(chunks)
    raise AssertionError("the infinite span always takes the rest")  # pragma: no cover


def expected_wasted_time(t_ckpt_s: float, interval_s: float, t_rtvl_s: float) -> float:
    """Eq. 6.1: expected time lost to one failure, failures uniform between checkpoints:
    ``t_ckpt + interval/2 + t_rtvl`` (``interval = 1/f``, at least ``max(t_ckpt,
    T_iter)`` by Eq. 6.2).

    Example:
        >>> expected_wasted_time(42, 42, 42)  # MT-NLG to 20 Gb/s storage, minutes
        105.0
    """
    if min(t_ckpt_s, interval_s, t_rtvl_s) < 0:
        raise SpecError(f"times must be >= 0, got t_ckpt={t_ckpt_s}, interval={interval_s}, "
                        f"t_rtvl={t_rtvl_s}")
    return float(t_ckpt_s + interval_s / 2 + t_rtvl_s)


def checkpoint_every(iteration_s: float, overflow_s: float, max_slowdown: float) -> int:
    """Checkpoint interval in iterations when ``overflow_s`` of checkpoint traffic does not
    fit the idle spans and delays the step it runs in: the smallest ``K >= 1`` with
    ``overflow_s / (K · iteration_s) <= max_slowdown`` (the overflow amortised over ``K``
    iterations). Every iteration when nothing overflows."""
    if iteration_s <= 0 or overflow_s < 0 or max_slowdown <= 0:
        raise SpecError(f"need iteration_s > 0, overflow_s >= 0, max_slowdown > 0; got "
                        f"{iteration_s}, {overflow_s}, {max_slowdown}")
    if overflow_s == 0:
        return 1
    return max(1, math.ceil(overflow_s / (max_slowdown * iteration_s) - 1e-12))
