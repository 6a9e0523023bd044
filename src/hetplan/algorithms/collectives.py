"""The analytic alpha–beta time of a collective, on raw numbers (pure, no torch).

``t(collective, nbytes, n) = steps(collective, n) * latency + factor(collective, n) * nbytes / B``
with the conventions of :mod:`hetplan.cost_models.comm` (which fits and looks these lines up
per cluster link, and re-exports the names here): ``factor`` is the NCCL-tests bus-bandwidth
factor, ``steps`` the latency-bound steps of the ring / pipelined-chain algorithms, ``nbytes``
the per-rank buffer (the total gathered output for gathers). It lives here, below both the
cost models and the runtime, because the runtime's link emulation
(:mod:`hetplan.runtime.link_emulation`) delays collectives by exactly this time.
"""

from __future__ import annotations

from typing import Literal, get_args

from hetplan.ir.validation import did_you_mean

__all__ = ["COLLECTIVES", "Collective", "analytic_time_s", "bus_factor", "check_collective",
           "latency_steps"]

#: The collective operations the model knows.
Collective = Literal[
    "allreduce", "reduce_scatter", "allgather", "alltoall", "broadcast", "reduce", "gather", "p2p"
]
COLLECTIVES: tuple[str, ...] = get_args(Collective)


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
