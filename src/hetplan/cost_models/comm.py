"""Communication cost: an alpha–beta model per collective, group size and link.

Convention (one for analytic and profiled costs; tests check it)::

    t(collective, nbytes, n) = steps(collective, n) * alpha + factor(collective, n) * nbytes / B

* ``alpha`` is the latency of **one algorithm step** (``LinkSpec.latency_s``), ``B`` the bus
  bandwidth NCCL reaches on the link (its line rate ``LinkSpec.bandwidth_bytes_per_s`` times
  the link's ``bus_efficiency``, by default the figure of its kind,
  :data:`~hetplan.algorithms.collectives.PROTOCOL_EFFICIENCY`: NVLink 0.80, InfiniBand 0.96,
  others 1) and ``n`` the group size.
* ``factor`` is the NCCL-tests bus-bandwidth factor (``algbw = busbw / factor``):
  ``2(n-1)/n`` allreduce; ``(n-1)/n`` reduce_scatter, allgather, alltoall, gather; ``1``
  broadcast, reduce, p2p.
* ``steps`` counts the latency-bound steps of the ring / pipelined-chain algorithms NCCL uses
  (Thakur et al. 2005): ``2(n-1)`` allreduce; ``n-1`` reduce_scatter, allgather, alltoall,
  gather, broadcast, reduce; ``1`` p2p. So latency is *not* counted once per call as in the
  NCCL-tests formula ``latency + S/algbw``; for large groups this overstates small-message
  time where NCCL would switch to trees (profile to correct it).
* ``nbytes`` is the **per-rank buffer**: the input of allreduce, reduce_scatter, reduce,
  broadcast and p2p; the **total gathered output** of allgather and gather (n times one
  rank's contribution); the total each rank sends (its own block included) for alltoall.
* Group size 1, and ``nbytes == 0``, cost 0 s.

The formula on raw numbers (:func:`analytic_time_s`, :func:`bus_factor`,
:func:`latency_steps`) lives in :mod:`hetplan.algorithms.collectives`, below both this module
and the runtime's link emulation, and is re-exported here.

Profiled fits take precedence over the analytic model. A :class:`~.profile_db.CollectiveRecord`
measured at group size ``m`` on the same backend and link kind gives a line ``a + b * nbytes``
(fitted with :func:`fit_alpha_beta` unless the record carries one); it is used as is for
``n == m`` and otherwise taken from the nearest measured ``m`` and rescaled to ``n`` under the
convention above (``a * steps(n)/steps(m)``, ``b * factor(n)/factor(m)``). Every cost says its
source (``"profiled"`` or ``"analytic"``).

**Routines a profile lacks** (gloo). Where the profile holds gloo collectives on a link kind
but not the routine asked for, that routine is not priced from the link's spec beside
measured ones: on gloo the spec's loopback line made a ``reduce`` nearly free next to the
measured ``allreduce`` (5-7 ms on 4 processes sharing 2 cores), so the search chose
reduce + broadcast paths that ran slower than the all-reduce it passed over
(``docs/decisions/cpu-fidelity.md`` section 23). A ``gather`` takes the measured
``allgather`` line, any other routine (and a ``gather`` without it) the measured
``allreduce`` one, rescaled to the group as that routine: at the same ``nbytes`` an upper
bound (an all-reduce is a reduce-scatter and an all-gather, or a reduce and a broadcast,
and moves at least what an all-to-all does; an all-gather delivers what a gather does to
every rank instead of one), so where the all-reduce (for a gather, the all-gather) was
measured no path is chosen for a routine nobody measured. On gloo, 4 processes sharing 2
cores, a reduce measured 5.0-5.9 ms against the all-reduce's 5.3-7.1 ms (16 KiB-1 MiB). The
cost says which line stood in. Without the stand-in either, the analytic line applies as
before. NCCL keeps the analytic line for a routine its profile lacks: there the spec's line
is the bus-bandwidth model every GPU plan is priced with, and an all-reduce standing in for
an intra-node reduce-scatter (half its bytes) would turn the hierarchical paths of GPU plans
made from older profiles into flat ones; a test pins such a plan. Profiles from ``hetplan
profile`` measure both routines (:data:`~hetplan.profiling.collectives.
DEFAULT_COLLECTIVES`); the stand-in keeps older ones from pricing them as free.

Links are a :class:`~hetplan.ir.cluster.LinkSpec` or the names ``"intra"`` (the *slowest*
intra-node link of the cluster: the phases on all nodes run together and wait for the slowest)
and ``"inter"`` (the cluster's inter-node network).

**Hand-over wait under contention** (:meth:`CommModel.wait_s`). Where the DB has a
:class:`~.profile_db.HandoverRecord` for the backend, link kind and group size (``hetplan
profile`` takes them on gloo: every process computes a burst between the messages, as a
training step does), a blocking message costs what the record measured after a burst of the
plan's length, beyond what the line above says for the record's message size (records at
several sizes: interpolated in bytes), the wait for a core that a rank which blocked on a
message pays on a CPU with more processes than cores.
The evaluator adds it per blocking receive on the pipeline's links and once per data-parallel
sync, at its first bucket's bytes (from the ``allreduce_step`` record where the profile has
one for the group: the sync timed inside the runtime's own step, ``docs/decisions/
cpu-fidelity.md`` section 12; from the ``allgather_step`` record, at the bytes gathered,
for a sparsified bucket synced by one all-gather, section 22; from the
``reduce_broadcast_step`` record for an uncompressed bucket synced by a reduce and a
broadcast, section 23); TP's per-layer all-reduces are not charged (measured to hide most
of it: ``docs/decisions/cpu-fidelity.md`` section 11). Records on an emulated link
(``HETPLAN_EMULATE_BW``) are filed under the kind of link it stands for and apply there.
Without such a record (GPU profiles, analytic costs, another backend) it is 0 s, and plans
are priced exactly as before.

Speed: :meth:`CommModel.time_s` looks up a precomputed line per (collective, group size, link)
and does one multiply-add; nothing touches pydantic after the first call for a key.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from hetplan.algorithms.collectives import (
    COLLECTIVES,
    Collective,
    analytic_time_s,
    bus_efficiency,
    bus_factor,
    check_collective,
    latency_steps,
)
from hetplan.cost_models.profile_db import HandoverRecord, ProfileDB
from hetplan.errors import SpecError
from hetplan.ir.cluster import ClusterSpec, LinkSpec
from hetplan.ir.validation import did_you_mean

__all__ = [
    "COLLECTIVES",
    "AlphaBeta",
    "Collective",
    "CommCost",
    "CommModel",
    "CostSourceName",
    "analytic_time_s",
    "bus_factor",
    "fit_alpha_beta",
    "latency_steps",
]

#: Where a cost came from.
CostSourceName = Literal["profiled", "analytic"]
LinkRef = LinkSpec | Literal["intra", "inter"]


#: The collectives whose back-to-back lines a hand-over operation is measured against.
_LINE_OF: dict[str, tuple[str, ...]] = {
    "allreduce_step": ("allreduce",), "allgather_step": ("allgather",),
    "reduce_broadcast_step": ("reduce", "broadcast")}
#: A routine a profile lacks, priced from the first of these it measured: routines that move
#: at least its data among the same ranks, at the same ``nbytes`` (module docstring,
#: "Routines a profile lacks"). p2p has none (its records are a pipeline's hand-overs).
_STAND_IN: dict[str, tuple[str, ...]] = {
    "gather": ("allgather", "allreduce"),
    **{c: ("allreduce",) for c in ("reduce", "broadcast", "reduce_scatter", "allgather",
                                    "alltoall")},
}


@dataclass(frozen=True, slots=True)
class AlphaBeta:
    """A line ``seconds = alpha_s + beta_s_per_byte * nbytes`` and where it came from.

    Attributes:
        alpha_s: the fixed part (for a collective: all its latency steps together).
        beta_s_per_byte: seconds per byte of ``nbytes``.
        source: ``"profiled"`` (fitted from measurements) or ``"analytic"`` (from link specs).
        detail: how it was obtained, for ``hetplan inspect``.
    """

    alpha_s: float
    beta_s_per_byte: float
    source: CostSourceName = "analytic"
    detail: str = ""

    def time_s(self, nbytes: float) -> float:
        """The line at ``nbytes`` (0 s for 0 bytes)."""
        return self.alpha_s + self.beta_s_per_byte * nbytes if nbytes > 0 else 0.0


@dataclass(frozen=True, slots=True)
class CommCost:
    """A communication time with its provenance."""

    seconds: float
    source: CostSourceName
    detail: str = ""


def fit_alpha_beta(
    samples: Iterable[tuple[float, float]], *, relative: bool = True
) -> AlphaBeta:
    """Least-squares line through measured ``(nbytes, seconds)`` points, with α, β ≥ 0.

    With ``relative=True`` (default) each residual is divided by the measured time, so that
    small, latency-bound messages constrain α as much as large ones constrain β (measurement
    noise is roughly proportional to the time). If the unconstrained optimum has a negative
    coefficient, the best fit on the boundary (α = 0 or β = 0) is returned, which is the
    non-negative least-squares solution for two unknowns. When all sizes are equal the slope is
    undetermined and the line through the origin is preferred (pure bandwidth).

    Args:
        samples: ``(nbytes, seconds)`` pairs; at least one, all non-negative.
        relative: weight residuals by ``1 / seconds**2`` instead of 1.

    Returns:
        ``AlphaBeta(alpha_s, beta_s_per_byte, source="profiled")``.

    Raises:
        ValueError: no samples, or a negative or non-finite value.
    """
    pts = [(float(x), float(y)) for x, y in samples]
    if not pts:
        raise ValueError("fit_alpha_beta needs at least one (nbytes, seconds) sample")
    for x, y in pts:
        if not (0 <= x < float("inf") and 0 <= y < float("inf")):
            raise ValueError(f"samples must be finite and non-negative, got ({x!r}, {y!r})")
    tiny = max((y for _, y in pts), default=0.0) * 1e-9 or 1e-30
    ws = [1.0 / max(y, tiny) ** 2 if relative else 1.0 for _, y in pts]
    sw = sum(ws)
    sx = sum(w * x for w, (x, _) in zip(ws, pts))
    sy = sum(w * y for w, (_, y) in zip(ws, pts))
    sxx = sum(w * x * x for w, (x, _) in zip(ws, pts))
    sxy = sum(w * x * y for w, (x, y) in zip(ws, pts))

    def sse(a: float, b: float) -> float:
        return sum(w * (a + b * x - y) ** 2 for w, (x, y) in zip(ws, pts))

    candidates: list[tuple[float, float]] = []
    det = sw * sxx - sx * sx
    if det > 1e-12 * sw * sxx:
        a = (sy * sxx - sx * sxy) / det
        b = (sw * sxy - sx * sy) / det
        if a >= 0 and b >= 0:
            candidates.append((a, b))
    candidates.append((0.0, max(sxy / sxx, 0.0) if sxx > 0 else 0.0))
    candidates.append((max(sy / sw, 0.0), 0.0))
    errors = [sse(a, b) for a, b in candidates]
    best = min(range(len(candidates)), key=lambda i: (errors[i] > min(errors) * (1 + 1e-9), i))
    a, b = candidates[best]
    return AlphaBeta(a, b, "profiled", f"least-squares fit of {len(pts)} samples")


class CommModel:
    """Collective times on a cluster, profiled where the DB has them, else analytic.

    Args:
        cluster: the cluster (its links give the analytic α and β).
        db: measured collectives; None for analytic only.
        backend: the backend whose measurements apply; by default ``gloo`` when every device
            type is ``cpu``, else ``nccl``.

    Example:
        >>> from hetplan.ir.cluster import ClusterSpec
        >>> m = CommModel(ClusterSpec.from_preset("a100-nvlink-8x8"))
        >>> round(m.time_s("allreduce", 100e6, 8, "intra") * 1e6, 1)  # 14 x 2 us + 1.75 M / B
        611.3
    """

    def __init__(
        self, cluster: ClusterSpec, db: ProfileDB | None = None, *, backend: str | None = None
    ) -> None:
        self.cluster = cluster
        self.db = db
        if backend is None:
            cpu_only = all(name == "cpu" for name in _used_device_types(cluster))
            backend = "gloo" if cpu_only else "nccl"
        self.backend = backend
        intra = [node.intra_link for node in cluster.nodes]
        self._named: dict[str, LinkSpec | None] = {
            "intra": min(intra, key=lambda link: (link.bandwidth_gbps, -link.latency_us)),
            "inter": cluster.inter_node,
        }
        # (collective, link kind) -> {group size: fitted line at that size}
        self._profiled: dict[tuple[str, str], dict[int, AlphaBeta]] = {}
        for rec in db.collectives if db is not None else ():
            if rec.backend != backend:
                continue
            if rec.alpha_s is not None and rec.beta_s_per_byte is not None:
                line = AlphaBeta(rec.alpha_s, rec.beta_s_per_byte, "profiled", "fitted in DB")
            else:
                line = fit_alpha_beta((s.nbytes, s.seconds) for s in rec.samples)
            self._profiled.setdefault((rec.collective, rec.link_kind), {})[rec.group_size] = line
        self._lines: dict[tuple[str, int, LinkRef], AlphaBeta] = {}
        # (operation, link kind, group size) -> records by message size (this backend's only)
        self._handovers: dict[tuple[str, str, int], list[HandoverRecord]] = {}
        for r in db.handovers if db is not None else ():  # sorted by key: sizes ascending
            if r.backend == backend:
                self._handovers.setdefault((r.operation, r.link_kind, r.group_size),
                                           []).append(r)

    # -- the hot path ----------------------------------------------------------------------
    def time_s(self, collective: str, nbytes: float, group_size: int, link: LinkRef) -> float:
        """Seconds for one ``collective`` of ``nbytes`` on ``group_size`` ranks over ``link``.

        Args:
            collective: one of :data:`COLLECTIVES`.
            nbytes: per-rank buffer bytes (allgather/gather: total gathered; alltoall: total
                sent per rank); see the module docstring.
            group_size: ranks in the group; 1 costs 0 s.
            link: a ``LinkSpec``, ``"intra"`` or ``"inter"``.

        Raises:
            ValueError: unknown collective, group size < 1, negative ``nbytes``.
            SpecError: ``"inter"`` on a one-node cluster.
        """
        line = self._lines.get((collective, group_size, link))
        if line is None:
            line = self.alpha_beta(collective, group_size, link)
        if nbytes <= 0:
            if nbytes < 0:
                raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
            return 0.0
        return line.alpha_s + line.beta_s_per_byte * nbytes

    def alpha_beta(self, collective: str, group_size: int, link: LinkRef) -> AlphaBeta:
        """The line ``t = alpha_s + beta_s_per_byte * nbytes`` used for this key (cached)."""
        key = (collective, group_size, link)
        line = self._lines.get(key)
        if line is None:
            line = self._build_line(collective, group_size, link)
            self._lines[key] = line
        return line

    def cost(self, collective: str, nbytes: float, group_size: int, link: LinkRef) -> CommCost:
        """:meth:`time_s` with its source and how it was obtained."""
        seconds = self.time_s(collective, nbytes, group_size, link)
        line = self.alpha_beta(collective, group_size, link)
        return CommCost(seconds, line.source, line.detail)

    def sources_used(self) -> set[str]:
        """The sources (``profiled``, ``analytic`` ...) of every line this model has priced
        a collective with so far (what a plan's ``provenance`` reports)."""
        return {line.source for line in self._lines.values()}

    def unprofiled_link_kinds(self) -> list[str]:
        """The kinds of link that collectives of more than one rank were priced on from the
        cluster spec although the profile DB measured this backend on other kinds (empty
        without such records): a profile of one machine's ``loopback`` leaves a plan's
        ``ethernet`` between nodes analytic, which ``hetplan profile --link-kind`` fixes."""
        measured = {kind for _, kind in self._profiled}
        if not measured:
            return []
        return sorted({kind for (_, n, link), line in self._lines.items()
                       if n > 1 and line.source == "analytic"
                       and (kind := self.resolve_link(link).kind) not in measured})

    @property
    def has_handovers(self) -> bool:
        """Whether the profile holds hand-over records (without them every wait is 0 s)."""
        return bool(self._handovers)

    def has_handover(self, operation: str, group_size: int, link: LinkRef) -> bool:
        """Whether a hand-over record of ``operation`` exists for this backend, the kind of
        ``link`` and ``group_size`` (e.g. ``allreduce_step``: the data-parallel sync timed
        inside the runtime's step)."""
        return bool(self._handovers) and (
            (operation, self.resolve_link(link).kind, group_size) in self._handovers)

    def measured_s(self, operation: str, group_size: int, link: LinkRef,
                   burst_s: float) -> tuple[float, int] | None:
        """What a phase record (``zero3_forward`` / ``zero3_backward``: what the runtime's
        ZeRO-3 adds to a plain phase of ``burst_s``) measured, as is, with the bytes it was
        measured at (the smallest size held); None without such a record for this backend,
        link kind and group size."""
        if not self._handovers:
            return None
        recs = self._handovers.get((operation, self.resolve_link(link).kind, group_size))
        if not recs:
            return None
        return recs[0].seconds_at(burst_s), recs[0].nbytes

    def phase_record(self, operation: str, group_size: int, link: LinkRef,
                     nbytes: float) -> HandoverRecord | None:
        """The record of a measured phase (``tp_forward`` … ``tp_sp_backward``: the runtime's
        tensor-parallel phase of a whole profiled model) for this backend, the kind of
        ``link`` and ``group_size``, of the model whose fp32 parameter bytes are nearest to
        ``nbytes`` (a profile merged from several models holds one per model), the first
        such on a tie; None without one."""
        if not self._handovers:
            return None
        recs = self._handovers.get((operation, self.resolve_link(link).kind, group_size))
        if not recs:
            return None
        return min(recs, key=lambda r: abs(r.nbytes - nbytes))

    def wait_s(self, operation: str, group_size: int, link: LinkRef, burst_s: float,
               nbytes: float | None = None) -> float:
        """The measured wait of one blocking ``operation`` (``p2p`` or ``allreduce``) of
        ``nbytes`` when every rank computed ``burst_s`` before it, beyond the line's time for
        the same message (module docstring); 0 s without a hand-over record for this backend,
        link kind and group size.

        At each measured message size the wait is ``max(record(burst) - line(size), 0)``;
        between two sizes it is interpolated linearly in bytes, outside them the nearest
        size's (no extrapolation, as in bursts). ``nbytes`` None, or a record of one size
        (profiles before sizes were measured), gives the smallest size's wait.

        Args:
            operation: ``p2p`` (a pipeline stage's receive), ``allreduce`` (any collective
                of a sync phase: it waits for its slowest rank the same way) or
                ``allreduce_step`` (the data-parallel sync timed inside the runtime's step;
                ``burst_s`` is then the step without the sync; its line is the
                all-reduce's) or ``allgather_step`` (the same with a compressed bucket; its
                line is the all-gather's) or ``reduce_broadcast_step`` (the bucket synced by
                a reduce and a broadcast; its line the two lines' sum).
            group_size: ranks in the group (p2p: 2); 1 waits for nothing.
            link: a ``LinkSpec``, ``"intra"`` or ``"inter"``.
            burst_s: compute each rank does before the message, in seconds.
            nbytes: the message (per-rank buffer), or None.

        Example: records of 5 ms at 4 KiB and 12 ms at 1 MiB after the burst, against a line
        of 4 ms + 1 ns/B, wait 1 ms at 4 KiB, about 6.95 ms at 1 MiB, and halfway in
        bytes between them halfway between the two waits.
        """
        if not self._handovers or group_size < 2:
            return 0.0
        recs = self._handovers.get((operation, self.resolve_link(link).kind, group_size))
        if not recs:
            return 0.0
        lines = _LINE_OF.get(operation, (operation,))
        waits = [(r.nbytes, max(r.seconds_at(burst_s) - sum(
                      self.time_s(c, r.nbytes, group_size, link) for c in lines), 0.0))
                 for r in (recs if nbytes is not None else recs[:1])]
        if nbytes is None or nbytes <= waits[0][0]:
            return waits[0][1]
        for (lo, w_lo), (hi, w_hi) in zip(waits, waits[1:]):
            if nbytes <= hi:
                return w_lo + (nbytes - lo) / (hi - lo) * (w_hi - w_lo)
        return waits[-1][1]

    # -- hierarchical composition ----------------------------------------------------------
    def hierarchical_allreduce_cost(
        self,
        nbytes: float,
        gpus_per_node: int,
        nodes: int,
        intra: LinkRef = "intra",
        inter: LinkRef = "inter",
    ) -> CommCost:
        """Hierarchical allreduce (zen_espresso §E.4(c)), with provenance.

        Three phases in sequence: an intra-node reduce_scatter of ``nbytes`` over the
        ``gpus_per_node`` (k) GPUs; an inter-node allreduce over ``nodes`` (N) of each GPU's
        1/k shard, where the k concurrent shard allreduces share the node's NIC, so it is
        costed as one allreduce of the full ``nbytes`` over the inter link (per-NIC volume
        2(N−1)/N·M, latency steps counted once since they run together); and an intra-node
        allgather of ``nbytes``.

        Returns:
            The summed time; ``source`` is ``"profiled"`` only if every phase is.
        """
        phases = [("intra reduce_scatter", self.cost("reduce_scatter", nbytes, gpus_per_node,
                                                     intra))]
        if nodes > 1:
            phases.append(("inter allreduce", self.cost("allreduce", nbytes, nodes, inter)))
        phases.append(("intra allgather", self.cost("allgather", nbytes, gpus_per_node, intra)))
        profiled = all(cost.source == "profiled" for _, cost in phases)
        return CommCost(
            sum(cost.seconds for _, cost in phases),
            "profiled" if profiled else "analytic",
            "; ".join(f"{name}: {cost.source}" for name, cost in phases),
        )

    def hierarchical_allreduce_s(
        self,
        nbytes: float,
        gpus_per_node: int,
        nodes: int,
        intra: LinkRef = "intra",
        inter: LinkRef = "inter",
    ) -> float:
        """Seconds of :meth:`hierarchical_allreduce_cost`."""
        return self.hierarchical_allreduce_cost(nbytes, gpus_per_node, nodes, intra, inter).seconds

    # -- building lines --------------------------------------------------------------------
    def resolve_link(self, link: LinkRef) -> LinkSpec:
        """The ``LinkSpec`` a link reference names."""
        if isinstance(link, LinkSpec):
            return link
        if link not in self._named:
            raise ValueError(
                f"link must be a LinkSpec, 'intra' or 'inter', got {link!r}"
                f"{did_you_mean(str(link), list(self._named))}"
            )
        spec = self._named[link]
        if spec is None:
            raise SpecError(
                f"cluster {self.cluster.name!r} has {self.cluster.num_nodes} node and no "
                "'inter_node' link; cost inter-node collectives only on multi-node clusters"
            )
        return spec

    def _build_line(self, collective: str, group_size: int, link: LinkRef) -> AlphaBeta:
        check_collective(collective)
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be an integer >= 1, got {group_size!r}")
        spec = self.resolve_link(link)
        if group_size == 1:
            return AlphaBeta(0.0, 0.0, "analytic", "group of 1: no communication")
        steps = latency_steps(collective, group_size)
        factor = bus_factor(collective, group_size)
        fits = self._profiled.get((collective, spec.kind))
        measured = collective
        if not fits and self.backend == "gloo" and any(
                kind == spec.kind for _, kind in self._profiled):
            # the profile measured this link kind but not this routine: its stand-in's line,
            # never the spec's analytic one beside measured ones (module docstring)
            for measured in _STAND_IN.get(collective, ()):
                fits = self._profiled.get((measured, spec.kind))
                if fits:
                    break
            else:
                measured = collective
        if fits:
            m = min(fits, key=lambda size: (abs(size - group_size), -size))
            fit = fits[m]
            stand_in = "" if measured == collective else (
                f" ({measured} standing in for {collective}, which the profile lacks: "
                "re-profile to measure it)")
            if m == group_size:
                return AlphaBeta(fit.alpha_s, fit.beta_s_per_byte, "profiled",
                                 f"{self.backend} {spec.kind} n={m}: {fit.detail}{stand_in}")
            # a stand-in is rescaled as its own routine: priced as that routine at n ranks
            a = fit.alpha_s * latency_steps(measured, group_size) / latency_steps(measured, m)
            b = fit.beta_s_per_byte * bus_factor(measured, group_size) / bus_factor(measured, m)
            return AlphaBeta(a, b, "profiled",
                             f"{self.backend} {spec.kind} n={m} rescaled to n={group_size}"
                             f"{stand_in}")
        eff = bus_efficiency(spec.kind, spec.bus_efficiency)
        return AlphaBeta(
            steps * spec.latency_s,
            factor / (spec.bandwidth_bytes_per_s * eff),
            "analytic",
            f"{spec.kind} {spec.bandwidth_gbps:g} Gbit/s"
            + (f" x {eff:g} (NCCL's bus bandwidth)" if eff != 1.0 else "")
            + f", {spec.latency_us:g} us/step",
        )


def _used_device_types(cluster: ClusterSpec) -> set[str]:
    return {group.type for node in cluster.nodes for group in node.devices}
