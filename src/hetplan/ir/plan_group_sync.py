"""The ``group_sync`` plan section: SDPipe's semi-decentralized synchronisation of pipeline
replicas (written by the ``sdpipe`` pass, executed by
:mod:`hetplan.runtime.handlers.group_sync`).

With ``policy == "sdpipe"`` the replicas of each pipeline stage do not all-reduce gradients in
lock step: every replica steps its optimizer locally, then averages its parameters with the
group of replicas the scheduler on rank 0 forms from ready signals (window T, connectivity
window P, a global lock against deadlock). With ``policy == "allreduce"`` the section only
records the prediction that justified keeping synchronous data parallelism.

Units are in field names; times in milliseconds as elsewhere in the plan.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, model_validator

from hetplan.ir.fields import strict_float, strict_int
from hetplan.ir.plan_sections import Layout, Ms, Name, Ranks, _Section

__all__ = ["GroupSync", "GroupSyncPrediction", "StragglerModelRef", "group_sync_problems"]

_Rate = Annotated[float, Field(ge=0, le=1e12, allow_inf_nan=False), BeforeValidator(strict_float)]
_Prob = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False), BeforeValidator(strict_float)]
_Window = Annotated[int, Field(ge=1, le=1_000_000), BeforeValidator(strict_int)]
_Count = Annotated[int, Field(ge=0, le=2**53), BeforeValidator(strict_int)]


class GroupSyncPrediction(_Section):
    """One policy's simulated throughput over ``GroupSync.iterations`` iterations.

    Attributes:
        policy: ``allreduce``, ``sdpipe`` or ``adpsgd``.
        iters_per_s: iterations per second of each pipeline.
        mean_group_size: mean number of replicas per average.
        lock_skips: SDPipe groups committed without validation (another stage held the lock).
    """

    policy: Literal["allreduce", "sdpipe", "adpsgd"]
    iters_per_s: _Rate
    mean_group_size: _Rate
    lock_skips: _Count = 0


class StragglerModelRef(_Section):
    """The straggler model the prediction was made under (copied from the cluster spec, or
    the worst rank's when only some node groups straggle): delay ``delay_ms`` with
    probability ``probability`` per device and iteration."""

    probability: _Prob = 0.0
    delay_ms: Ms = 0.0


class GroupSync(_Section):
    """How the replicas of each pipeline stage synchronise (see the module docstring).

    Attributes:
        requested: what the user asked for: ``auto`` (group sync only when predicted faster)
            or ``sdpipe`` (always).
        policy: what the plan runs: ``sdpipe`` or ``allreduce`` (synchronous data parallel).
        num_stages / num_pipelines: the M × N mesh (stages × data-parallel replicas).
        p: the connectivity window P, in committed groups of a stage (a user setting; the
            paper's default 10).
        window_ms: the window T a ready signal waits for others (default: the predicted
            iteration time / N, the paper's rule).
        window_adapt: ``fixed`` T, or ``adaptive`` (per worker: ×2 after a group smaller than
            2, ×0.9 otherwise, within [T/100, 10·T]).
        averaged: what the group averages: ``params`` or ``params+buffers``.
        optimizer_state: ``local`` (each replica keeps its own) or ``adam-correction``
            (local, with SDPipe's rescaled second moment, scale 1/N).
        communicator: ``prebuilt`` (every group of ≥ 2 replicas of a stage is a process group
            built at start-up, 2^N - N - 1 per stage) or ``lazy`` (built by its members on
            first use, then cached).
        final_full_average: average all replicas of each stage once training ends (so the
            saved model is one model).
        scheduler_rank: the rank whose thread runs the scheduler.
        stragglers: the straggler model of the prediction.
        iterations / seed: the simulated run behind ``predictions``.
        predictions: simulated throughput of each policy (allreduce first).
        speedup: SDPipe's iterations per second over all-reduce's.
        reason: one line on why ``policy`` was chosen.
    """

    requested: Literal["auto", "sdpipe"]
    policy: Literal["sdpipe", "allreduce"]
    num_stages: Ranks
    num_pipelines: Ranks
    p: _Window = 10
    window_ms: Ms = 0.0
    window_adapt: Literal["fixed", "adaptive"] = "fixed"
    averaged: Literal["params", "params+buffers"] = "params+buffers"
    optimizer_state: Literal["local", "adam-correction"] = "local"
    communicator: Literal["prebuilt", "lazy"] = "prebuilt"
    final_full_average: bool = True
    scheduler_rank: Annotated[int, Field(ge=0), BeforeValidator(strict_int)] = 0
    stragglers: StragglerModelRef = Field(default_factory=StragglerModelRef)
    iterations: _Window = 200
    seed: _Count = 0
    predictions: tuple[GroupSyncPrediction, ...] = ()
    speedup: _Rate = 1.0
    reason: Name = "not decided"

    @model_validator(mode="after")
    def _check(self) -> GroupSync:
        names = [p.policy for p in self.predictions]
        if len(set(names)) != len(names):
            raise ValueError(f"predictions name a policy twice: {names}")
        if self.policy == "sdpipe" and self.num_pipelines < 2:
            raise ValueError("policy 'sdpipe' needs num_pipelines >= 2 (replicas to group); "
                             "use policy 'allreduce' for a single pipeline")
        return self

    def prediction(self, policy: str) -> GroupSyncPrediction | None:
        """The prediction for ``policy``, or None."""
        return next((p for p in self.predictions if p.policy == policy), None)


def group_sync_problems(section: GroupSync | None, layout: Layout | None) -> list[str]:
    """Cross-section problems of ``group_sync`` against the plan's layout, one line each."""
    if section is None:
        return []
    if layout is None:
        return ["group_sync: the plan has no layout; the sdpipe pass needs one (run it after "
                "the passes that choose the layout and stages)"]
    out = []
    if (section.num_stages, section.num_pipelines) != (layout.pp, layout.dp):
        out.append(f"group_sync: mesh {section.num_stages} x {section.num_pipelines} "
                   f"(stages x pipelines), but the layout has pp={layout.pp}, dp={layout.dp}; "
                   "re-run the sdpipe pass on this layout")
    if section.scheduler_rank >= layout.num_ranks:
        out.append(f"group_sync.scheduler_rank: {section.scheduler_rank} is not a rank of the "
                   f"layout (0..{layout.num_ranks - 1})")
    return out
