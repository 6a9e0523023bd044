"""Zen (thesis ch. 3): the cost of every sparse-sync scheme and the choice between them.

Pure (numpy, no torch). A sparse gradient is ``units`` rows of ``unit_elems`` elements each
(an embedding table's rows; ``unit_elems = 1`` is the thesis's element-wise COO); a fraction
``density`` of its units is non-zero on one worker, ``density_n`` after aggregating ``n``
workers (Definition 3.4: ``gamma = density_n / density``), and the densest of ``n`` even
partitions holds ``skew`` times the average (Definition 3.5). From these and a link (bus
bandwidth, per-step latency) :func:`scheme_times` prices the schemes of §B.5 (digest
``zen_espresso.md``):

- ``dense``: ring all-reduce of the dense tensor, ``2(n-1)/n * M / B``;
- ``agsparse``: all-gather of every worker's COO tensor, ``(n-1) * coo(d) / B`` (grows with n);
- ``sparse_ps``: push and pull to ``n`` servers on even partitions, both ``skew`` times the
  balanced volume: ``(n-1)/n * s * (coo(d) + coo(d_n)) / B``;
- ``ps_broadcast``: Sparse PS push, pull by broadcast in ``b`` rounds: ``+ b * coo(d_n) / B``;
- ``zen``: Balanced Parallelism through Algorithms 3.2 / 3.3: hash, all-to-all push set by the
  most loaded partition (``imbalance`` from the hashing, ~1), aggregation, pull as a hash
  bitmap or COO, whichever is smaller, and decode. With ``imbalance = 1``, COO pull and no
  compute it is the thesis's ``2(n-1)(d_G + d_G^n) M / n / B``.

``coo(d) = d * units * (unit_elems * value_bytes + index_bytes)``: a COO tensor sends one index
per non-zero unit, so the thesis's "COO doubles the size" is the ``unit_elems = 1`` case.
Latency: ``n - 1`` steps for every point-to-point or ring phase (``2(n - 1)`` for all-reduce).

:func:`choose_scheme` picks the fastest of the schemes the runtime executes
(``dense``, ``agsparse``, ``zen``); the parameter-server schemes are priced for comparison
only (Fig. 3.7's table, the Lemma 3.4 tests). Ties go to ``dense`` (nothing changes).

Hashing, the hash bitmap and :func:`push_imbalance` live in :mod:`.zen_hashing` and are
re-exported here, the stable public entry points.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from hetplan.algorithms.zen_hashing import (
    HashResult,
    bitmap_decode,
    bitmap_encode,
    hash_bitmap_decode,
    hash_bitmap_encode,
    hash_partition,
    hierarchical_hash,
    partition_sets,
    push_imbalance,
)

__all__ = [
    "EXECUTABLE_SCHEMES",
    "PullFormat",
    "SCHEMES",
    "HashResult",
    "Scheme",
    "SchemeChoice",
    "SparseStats",
    "ZenLink",
    "bitmap_decode",
    "bitmap_encode",
    "choose_scheme",
    "hash_bitmap_decode",
    "hash_bitmap_encode",
    "hash_partition",
    "hierarchical_hash",
    "hierarchy_incremental_volume",
    "partition_sets",
    "ps_broadcast_over_bp",
    "push_imbalance",
    "ring_incremental_first_step",
    "scheme_times",
    "skew_of",
    "zen_phases",
    "zipf_stats",
]

Scheme = Literal["dense", "agsparse", "sparse_ps", "ps_broadcast", "zen"]
SCHEMES: tuple[Scheme, ...] = ("dense", "agsparse", "sparse_ps", "ps_broadcast", "zen")
#: The schemes the runtime can execute, in tie-break order.
EXECUTABLE_SCHEMES: tuple[Scheme, ...] = ("dense", "agsparse", "zen")


@dataclass(frozen=True)
class SparseStats:
    """The statistics of one sparse gradient that the scheme costs depend on (§B.2).

    Attributes:
        units: rows of the gradient (elements when ``unit_elems`` is 1).
        unit_elems: elements per row (the embedding dimension).
        density: ``d_G``, fraction of units non-zero on one worker, in (0, 1].
        density_n: ``d_G^n``, fraction non-zero after aggregating ``n`` workers,
            ``density <= density_n <= min(1, n * density)``.
        skew: ``s_G^n >= 1``, densest of ``n`` even partitions over the average.
        value_bytes: bytes per element on the wire (4 for fp32).
        index_bytes: bytes per COO index (4 for int32 as in the thesis).
    """

    units: int
    unit_elems: int
    density: float
    density_n: float
    skew: float = 1.0
    value_bytes: int = 4
    index_bytes: int = 4

    def __post_init__(self) -> None:
        if self.units < 1 or self.unit_elems < 1:
            raise ValueError(f"units and unit_elems must be >= 1, got {self.units}, "
                             f"{self.unit_elems}")
        if not 0.0 < self.density <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {self.density!r}")
        if not self.density - 1e-12 <= self.density_n <= 1.0 + 1e-12:
            raise ValueError(f"density_n must be in [density, 1], got {self.density_n!r} "
                             f"(density {self.density!r})")
        if self.skew < 1.0 - 1e-12:
            raise ValueError(f"skew must be >= 1, got {self.skew!r}")

    @property
    def dense_bytes(self) -> float:
        """``M`` in bytes: the dense gradient."""
        return float(self.units * self.unit_elems * self.value_bytes)

    def coo_bytes(self, density: float) -> float:
        """Bytes of a COO tensor with ``density`` of the units non-zero."""
        return density * self.units * (self.unit_elems * self.value_bytes + self.index_bytes)

    @property
    def gamma(self) -> float:
        """Densification ratio ``gamma_G^n = d_G^n / d_G`` (Definition 3.4)."""
        return self.density_n / self.density


@dataclass(frozen=True)
class ZenLink:
    """The link and device rates that price a scheme.

    Attributes:
        bandwidth_bytes_per_s: per-rank bandwidth ``B``.
        latency_s: one step's latency.
        mem_bytes_per_s: device memory bandwidth that prices hashing, aggregation and decode
            (0 leaves compute out, the thesis's communication-only model).
        broadcast_rounds: ``b`` of PS-with-broadcast; 0 means ``ceil(log2 n)`` (binomial tree).
    """

    bandwidth_bytes_per_s: float
    latency_s: float = 0.0
    mem_bytes_per_s: float = 0.0
    broadcast_rounds: float = 0.0

    def rounds(self, n: int) -> float:
        """``b`` for ``n`` ranks."""
        return self.broadcast_rounds or float(max(1, math.ceil(math.log2(max(n, 2)))))


PullFormat = Literal["auto", "coo", "bitmap"]


def zen_phases(stats: SparseStats, n: int, link: ZenLink, imbalance: float = 1.0,
               pull: PullFormat = "auto") -> dict[str, float]:
    """Zen's time per phase in seconds, in execution order (§B.9–B.10, issue 21 item 4).

    ``hash`` (Algorithm 3.2 over the local non-zeros: ``k + 1`` hash reads and one write per
    index and a gather of its values), ``push`` (all-to-all of COO partitions, the most loaded
    one ``imbalance`` times the average), ``aggregate`` (scatter-add of the ``n`` received
    partitions), ``pull`` (all-gather of the aggregated partitions, each as a hash bitmap over
    ``𝕀_i`` plus values or as COO: ``pull``, ``"auto"`` takes the smaller) and ``decode`` (bitmap → indices and a
    write of the values). Compute phases are memory passes at ``link.mem_bytes_per_s``.
    """
    b, lat = link.bandwidth_bytes_per_s, link.latency_s
    frac = (n - 1) / n
    push_bytes = frac * imbalance * stats.coo_bytes(stats.density)
    value_n = stats.density_n * stats.units * stats.unit_elems * stats.value_bytes
    bitmap = value_n + stats.units / 8.0
    coo_n = stats.coo_bytes(stats.density_n)
    pull_bytes = frac * {"auto": min(coo_n, bitmap), "coo": coo_n, "bitmap": bitmap}[pull]
    phases = {"hash": 0.0, "push": 0.0, "aggregate": 0.0, "pull": 0.0, "decode": 0.0}
    if n > 1:
        phases["push"] = (n - 1) * lat + push_bytes / b
        phases["pull"] = (n - 1) * lat + pull_bytes / b
    if link.mem_bytes_per_s > 0 and n > 1:
        mem = link.mem_bytes_per_s
        nnz = stats.density * stats.units
        phases["hash"] = (nnz * 6 * 8 + stats.coo_bytes(stats.density) * 2) / mem
        phases["aggregate"] = 2 * imbalance * stats.coo_bytes(stats.density) / mem
        phases["decode"] = (stats.units / 8.0 + 2 * value_n) / mem
    return phases


def scheme_times(stats: SparseStats, n: int, link: ZenLink, imbalance: float = 1.0,
                 pull: PullFormat = "auto") -> dict[Scheme, float]:
    """The sync time in seconds of every scheme in :data:`SCHEMES` for one gradient on ``n``
    ranks (formulas in the module docstring). ``imbalance`` is Zen's push imbalance, ``pull``
    its pull format (:func:`zen_phases`)."""
    if n < 1:
        raise ValueError(f"n must be >= 1 ranks, got {n!r}")
    if n == 1:
        return {s: 0.0 for s in SCHEMES}
    b, lat = link.bandwidth_bytes_per_s, link.latency_s
    if b <= 0:
        raise ValueError(f"bandwidth must be > 0 bytes/s, got {b!r}")
    frac = (n - 1) / n
    coo_d, coo_dn = stats.coo_bytes(stats.density), stats.coo_bytes(stats.density_n)
    s = stats.skew
    push_ps = (n - 1) * lat + frac * s * coo_d / b
    return {
        "dense": 2 * (n - 1) * lat + 2 * frac * stats.dense_bytes / b,
        "agsparse": (n - 1) * lat + (n - 1) * coo_d / b,
        "sparse_ps": push_ps + (n - 1) * lat + frac * s * coo_dn / b,
        "ps_broadcast": push_ps + link.rounds(n) * (lat + coo_dn / b),
        "zen": sum(zen_phases(stats, n, link, imbalance, pull).values()),
    }


@dataclass(frozen=True)
class SchemeChoice:
    """The chosen scheme of one gradient and the times it was chosen from (seconds)."""

    scheme: Scheme
    times: dict[Scheme, float]

    @property
    def benefit(self) -> float:
        """Dense time over the chosen scheme's time (1.0 when dense is chosen)."""
        t = self.times[self.scheme]
        return self.times["dense"] / t if t > 0 else 1.0


def choose_scheme(stats: SparseStats, n: int, link: ZenLink, imbalance: float = 1.0,
                  allowed: Sequence[Scheme] = EXECUTABLE_SCHEMES) -> SchemeChoice:
    """The fastest of ``allowed`` schemes (first in ``allowed`` order on a tie), with all the
    times of :func:`scheme_times`. Example: a 1 %-dense 100k×32 table on 16 ranks picks zen."""
    if not allowed:
        raise ValueError("allowed must name at least one scheme")
    times = scheme_times(stats, n, link, imbalance)
    best = min(allowed, key=lambda sch: (times[sch], allowed.index(sch)))
    return SchemeChoice(best, times)


def ps_broadcast_over_bp(skew: float, gamma: float, n: int, rounds: float) -> float:
    """Lemma 3.4's ratio of PS-with-broadcast to BP time:
    ``s/(1+gamma) + n/(n-1) * b*gamma/(1+gamma)`` (element-wise COO, no latency)."""
    return skew / (1 + gamma) + n / (n - 1) * rounds * gamma / (1 + gamma)


def ring_incremental_first_step(densities: Sequence[float], elements: float, n: int,
                                bandwidth: float) -> float:
    """Lemma 3.5: first step of Ring + Incremental aggregation, ``2 sum_{i<n} d^i M / n / B``
    (``densities[i-1]`` is stage ``i``'s density ``d_G^i``, ``n - 1`` of them)."""
    if len(densities) != n - 1:
        raise ValueError(f"need n - 1 = {n - 1} stage densities, got {len(densities)}")
    return 2 * float(sum(densities)) * elements / n / bandwidth


def hierarchy_incremental_volume(densities_pow2: Sequence[float], elements: float,
                                 n: int) -> float:
    """Lemma 3.5: total traffic of Hierarchy + Incremental aggregation,
    ``V = sum_{i=1}^{log n} d^{2^{i-1}} / 2^{i-1} * M n`` (``densities_pow2[i-1] = d^{2^{i-1}}``;
    ``n`` a power of two)."""
    levels = int(round(math.log2(n)))
    if 2 ** levels != n or len(densities_pow2) != levels:
        raise ValueError(f"n must be a power of two with log2(n) = {levels} densities")
    return sum(d / 2 ** i * elements * n for i, d in enumerate(densities_pow2))


def skew_of(indices: np.ndarray, units: int, n: int) -> float:
    """Definition 3.5 on an index set: the densest of ``n`` even partitions of ``[0, units)``
    over the average density (1 for an empty set). Partition ``j`` is
    ``[floor(j units / n), floor((j+1) units / n))``, as in :func:`zipf_stats`."""
    if indices.size == 0:
        return 1.0
    bounds = np.arange(n + 1, dtype=np.int64) * units // n
    part = np.searchsorted(bounds, indices, side="right") - 1
    counts = np.bincount(np.clip(part, 0, n - 1), minlength=n)
    sizes = np.diff(bounds)
    return float((counts / np.maximum(sizes, 1)).max() / (indices.size / units))


def zipf_stats(units: int, unit_elems: int, tokens_per_worker: int, n: int,
               alpha: float = 1.0) -> SparseStats:
    """Expected statistics of an embedding gradient when every worker looks up
    ``tokens_per_worker`` i.i.d. Zipf(``alpha``) rows of a ``units``-row table (row ``r`` has
    probability ``∝ 1/(r+1)^alpha``, frequent rows first, as tokenizers number them).

    ``d = mean_r 1 - (1-p_r)^T``, ``d_n`` the same with ``nT`` draws, and the skew the
    expected densest of ``n`` even partitions over ``d`` (the first one, which holds the
    frequent rows). Analytic, no sampling: deterministic.
    """
    p = 1.0 / np.arange(1, units + 1, dtype=np.float64) ** alpha
    p /= p.sum()
    hit1 = -np.expm1(tokens_per_worker * np.log1p(-p))
    hitn = -np.expm1(n * tokens_per_worker * np.log1p(-p))
    d = float(hit1.mean())
    bounds = np.floor(np.linspace(0, units, n + 1)).astype(np.int64)
    part = [float(hit1[bounds[j]:bounds[j + 1]].mean())
            for j in range(n) if bounds[j + 1] > bounds[j]]
    skew = max(part) / d if d > 0 else 1.0
    return SparseStats(units, unit_elems, d, max(d, float(hitn.mean())), max(1.0, skew))

