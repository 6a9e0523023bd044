"""The analytic alpha–beta time of a collective, on raw numbers (pure, no torch).

``t(collective, nbytes, n) = steps(collective, n) * latency + factor(collective, n) * nbytes / B``
with the conventions of :mod:`hetplan.cost_models.comm` (which fits and looks these lines up
per cluster link, and re-exports the names here): ``factor`` is the NCCL-tests bus-bandwidth
factor, ``steps`` the latency-bound steps of the ring / pipelined-chain algorithms, ``nbytes``
the per-rank buffer (the total gathered output for gathers). It lives here, below both the
cost models and the runtime, because the runtime's link emulation
(:mod:`hetplan.runtime.link_emulation`) delays collectives by exactly this time.

``B`` is a **bus bandwidth**: what NCCL's collectives reach on the link. A cluster spec gives
the link's line rate (``LinkSpec.bandwidth_gbps``, the datasheet's per-direction rate);
:func:`bus_bandwidth_bytes_per_s` turns it into ``B`` with the protocol efficiency of the
link's kind (:data:`PROTOCOL_EFFICIENCY`). A profile measures ``B`` and replaces both.
"""

from __future__ import annotations

from typing import Literal, get_args

from hetplan.ir.validation import did_you_mean

__all__ = ["COLLECTIVES", "Collective", "PROTOCOL_EFFICIENCY", "analytic_time_s",
           "bus_bandwidth_bytes_per_s", "bus_efficiency", "bus_factor", "check_collective", "latency_steps"]

#: The collective operations the model knows.
Collective = Literal[
    "allreduce", "reduce_scatter", "allgather", "alltoall", "broadcast", "reduce", "gather", "p2p"
]
COLLECTIVES: tuple[str, ...] = get_args(Collective)

#: The share of a link's line rate that NCCL reaches as bus bandwidth, by link kind, where
#: NCCL's developers have published it (kinds not listed: 1, the line rate):
#:
#: - ``nvlink`` 0.80: NCCL's protocol costs about 20 % of NVLink's line rate. Its developers
#:   give 370 of 450 GB/s on H100 (0.82) and about 160 GB/s intra-node on an 8-GPU A800,
#:   whose NVLink runs at 200 GB/s per direction (0.80) (NVIDIA/nccl-tests issue 212,
#:   NVIDIA/nccl issue 412).
#: - ``infiniband`` 0.96: 24 GB/s per 200 Gb/s HDR NIC (25 GB/s line rate), and 192 GB/s of
#:   all-reduce bus bandwidth on a DGX A100 with 8 of them (NVIDIA/nccl issues 412 and 1576).
#:
#: Not fitted to any prediction; ``docs/decisions/cost-model.md`` says what it changed.
PROTOCOL_EFFICIENCY: dict[str, float] = {"nvlink": 0.80, "infiniband": 0.96}


def bus_efficiency(kind: str, given: float | None = None) -> float:
    """The share of a link's line rate NCCL reaches: ``given`` (the cluster spec's
    ``bus_efficiency``) where set, else the figure of ``kind``."""
    return given if given is not None else PROTOCOL_EFFICIENCY.get(kind, 1.0)


def bus_bandwidth_bytes_per_s(kind: str, line_rate_bytes_per_s: float,
                              given: float | None = None) -> float:
    """The bus bandwidth NCCL reaches on a link of ``kind`` with this line rate."""
    return line_rate_bytes_per_s * bus_efficiency(kind, given)


def check_collective(collective: str) -> None:
    """Raise ``ValueError`` (with a did-you-mean) unless ``collective`` is one of
    :data:`COLLECTIVES`."""
    if collective not in COLLECTIVES:
        raise ValueError(
            f"unknown collective {collective!r}{did_you_mean(collective, COLLECTIVES)} "
            f"(known: {', '.join(COLLECTIVES)})"
        )


def bus_factor(collective: str, group_size: int) -> float:
    """NCCL-tests bus-bandwidth factor of ``collective`` on ``group_size`` ranks (0 for 1)."""
    check_collective(collective)
    n = group_size
    if n <= 1:
        return 0.0
    if collective == "allreduce":
        return 2.0 * (n - 1) / n
    if collective in ("broadcast", "reduce", "p2p"):
        return 1.0
    return (n - 1) / n


def latency_steps(collective: str, group_size: int) -> int:
    """Latency-bound steps of the ring/chain algorithm (0 for a group of 1)."""
    check_collective(collective)
    n = group_size
    if n <= 1:
        return 0
    if collective == "allreduce":
        return 2 * (n - 1)
    if collective == "p2p":
        return 1
    return n - 1


def analytic_time_s(
    collective: str,
    nbytes: float,
    group_size: int,
    bandwidth_bytes_per_s: float,
    latency_s: float,
) -> float:
    """The module's formula on raw numbers: ``steps * latency + factor * nbytes / bandwidth``.

    Args:
        collective: one of :data:`COLLECTIVES`.
        nbytes: buffer size in bytes, as defined in the module docstring.
        group_size: ranks taking part.
        bandwidth_bytes_per_s: bus bandwidth of the link (> 0).
        latency_s: latency of one algorithm step.

    Returns:
        Seconds; 0 for a group of 1 or 0 bytes.
    """
    if group_size <= 1 or nbytes <= 0:
        check_collective(collective)
        return 0.0
    return (
        latency_steps(collective, group_size) * latency_s
        + bus_factor(collective, group_size) * nbytes / bandwidth_bytes_per_s
    )
