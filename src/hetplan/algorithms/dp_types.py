"""What the data-parallel timeline simulator works on: ops, sync units, resources, results.

Shared by the readable reference (:mod:`hetplan.algorithms.dp_timeline`) and the search
kernels (:mod:`hetplan.algorithms._dp_kernels`, driven by
:class:`hetplan.algorithms.dp_session.DPSession`); nothing here imports either of them.

Resources (semantics in :mod:`hetplan.algorithms.dp_timeline`):

- ``"gpu"`` (:data:`GPU`): the one compute stream, shared by backprop and GPU (de)compression;
- ``"cpu"`` (:data:`CPU`): a pool of CPU compression workers;
- any other name (``"net"``, ``"intra"``, ``"inter"``): a FIFO communication channel.

The reference keys its resources by these names; the kernels by small integers (the GPU
:data:`GPU_ID`, the CPU pool :data:`CPU_ID`, channels from 2 on), which a
:class:`ResourceIds` table hands out per session.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GPU", "CPU", "GPU_ID", "CPU_ID", "MAX_RESOURCES", "EPS_BOUND", "EPS_RELEASE", "Op",
           "SyncUnit", "DPEvent", "DPTimeline", "ResourceIds"]

#: The compute stream (backprop and GPU (de)compression).
GPU = "gpu"
#: The CPU compression worker pool.
CPU = "cpu"
#: Kernel id of :data:`GPU`.
GPU_ID = 0
#: Kernel id of :data:`CPU`.
CPU_ID = 1
#: At most this many resources (GPU, CPU and channels) in one search session.
MAX_RESOURCES = 16
#: Relative slack of the lower bounds that stop a trial (rounding: the run and the bounds add
#: the same durations in other orders), at least this much in absolute terms.
EPS_BOUND = 1e-12
#: Relative slack of the release bound, which sums in another order than the run (rounding of
#: up to ~1e-13 relative for a thousand tensors).
EPS_RELEASE = 1e-9


@dataclass(frozen=True, slots=True)
class Op:
    """One step of a unit's sync path: ``duration_s`` on ``resource``."""

    resource: str
    duration_s: float
    label: str = ""


@dataclass(frozen=True, slots=True)
class SyncUnit:
    """A tensor or a bucket: ready after tensor ``last_tensor``'s backprop; then ``ops``."""

    last_tensor: int
    ops: tuple[Op, ...]
    name: str = ""


@dataclass(frozen=True, slots=True)
class DPEvent:
    """A timed interval of the simulated iteration (times from the start of backprop)."""

    resource: str
    label: str
    unit: int  # -1 for backprop segments
    start_s: float
    end_s: float


@dataclass(frozen=True, slots=True)
class DPTimeline:
    """Result of :func:`~hetplan.algorithms.dp_timeline.simulate_dp`.

    Attributes:
        iteration_s: forward + backprop/sync end + optimizer.
        backprop_end_s: when the last backprop segment ended (delayed by GPU ops).
        sync_end_s: when the last sync op ended (0 if none).
        exposed_comm_s: time after the end of backprop spent waiting for sync.
        busy_s: total busy time per resource.
        events: every interval, if ``record=True`` (else empty).
    """

    iteration_s: float
    backprop_end_s: float
    sync_end_s: float
    exposed_comm_s: float
    busy_s: dict[str, float]
    events: tuple[DPEvent, ...] = ()


class ResourceIds(dict[str, int]):
    """Resource name -> kernel id: :data:`GPU` is :data:`GPU_ID`, :data:`CPU` is
    :data:`CPU_ID`, and looking up a channel not seen yet gives it the next free id (a dict,
    so that known names cost one lookup). Sessions of one problem may share a table (the ids
    only name the channels)."""

    def __init__(self) -> None:
        super().__init__({GPU: GPU_ID, CPU: CPU_ID})

    def __missing__(self, name: str) -> int:
        if len(self) == MAX_RESOURCES:
            raise ValueError(
                f"resource {name!r} would be the {MAX_RESOURCES + 1}th of one session; "
                f"at most {MAX_RESOURCES} (GPU, CPU and channels) are supported")
        rid = self[name] = len(self)
        return rid
