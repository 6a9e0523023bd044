"""Pipeline re-balancing for dynamic models: the user's dynamics file and the plan section.

:class:`DynamicsSpec` is what ``hetplan plan --dynamics FILE`` reads (YAML or JSON): how the
model changes while it trains (gradual pruning, layer freezing, early exit) and the
re-balancing policy. :class:`Rebalancing` is the plan section the ``dynpipe`` pass writes:
the policy and every planned event with its complete stage assignment (declarative: the
runtime derives the layer moves from consecutive assignments), the moves and bytes, and the
predicted iteration time before and after.

Example dynamics file (``examples/pruning.yaml``)::

    total_iterations: 10000
    pruning: {final_sparsity: 0.9, start_iteration: 3000, frequency: 1000, steps: 4}
    rebalance: {balancer: partition, metric: time}
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hetplan.errors import SpecError
from hetplan.ir.plan_sections import Ms, NonNegFloat, NonNegInt, PosInt
from hetplan.ir.validation import check_bounds, load_structured_file, validate_model

__all__ = [
    "PruningSpec",
    "FreezeSpec",
    "EarlyExitSpec",
    "RebalancePolicy",
    "DynamicsSpec",
    "LayerMigration",
    "PlannedEvent",
    "Rebalancing",
    "stage_changes",
]

Fraction01 = Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)]


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


class PruningSpec(_Model):
    """Gradual global magnitude pruning with the Zhu–Gupta schedule (seed Eq. 2).

    Steps happen at ``start_iteration + k·frequency`` for ``k = 1..steps``; the last reaches
    ``final_sparsity``. ``kernel``: ``sparse`` runs pruned layers on the sparse kernel,
    ``best`` on whichever of sparse and dense is faster, ``sparse-from-start`` runs every
    prunable layer on the sparse kernel from iteration 0 (what the paper's code does: its
    blocks are CSR from construction). The sparse kernel equals
    dense at ``crossover_sparsity`` and takes ``sparse_floor`` of dense at 100 %.
    ``gemm_share`` is the part of a block's time in the pruned GEMMs. ``scale_skew`` tilts
    the layers' weight scales with depth (scale ``1 + skew·(depth - 0.5)``), which makes a
    global threshold prune layers unequally.
    """

    final_sparsity: Fraction01
    initial_sparsity: Fraction01 = 0.0
    start_iteration: NonNegInt = 0
    frequency: PosInt
    steps: PosInt
    kernel: Literal["sparse", "best", "sparse-from-start"] = "sparse"
    crossover_sparsity: Annotated[float, Field(gt=0, lt=1)] = 0.75
    sparse_floor: Fraction01 = 0.1
    gemm_share: Annotated[float, Field(ge=0, le=1)] = 0.9
    scale_skew: Annotated[float, Field(gt=-2, lt=2)] = 0.0

    @model_validator(mode="after")
    def _check(self) -> PruningSpec:
        if self.initial_sparsity > self.final_sparsity:
            raise ValueError(f"initial_sparsity {self.initial_sparsity} is above "
                             f"final_sparsity {self.final_sparsity}")
        return self


class FreezeSpec(_Model):
    """From ``iteration`` on, the first ``layers`` layers are frozen (no backward, no
    optimizer state)."""

    iteration: PosInt
    layers: NonNegInt


class EarlyExitSpec(_Model):
    """From ``iteration`` on, ``fraction`` of the tokens leave after layer ``after_layer``."""

    iteration: PosInt
    after_layer: NonNegInt
    fraction: Fraction01


class RebalancePolicy(_Model):
    """When and how to re-balance (see ``hetplan.algorithms.dynamics``).

    ``trigger``: ``gain`` applies a new partition only when the predicted saving until the
    next event beats the cost of moving the layers; ``every-event`` always applies it.
    """

    balancer: Literal["partition", "diffusion", "static"] = "partition"
    metric: Literal["time", "param"] = "time"
    max_iters: PosInt = 5
    trigger: Literal["gain", "every-event"] = "gain"
    repack: bool = False
    repack_slowdown: Annotated[float, Field(ge=1, allow_inf_nan=False)] = 1.0


class DynamicsSpec(_Model):
    """How the model changes while training, and the re-balancing policy."""

    total_iterations: PosInt
    pruning: PruningSpec | None = None
    freezing: tuple[FreezeSpec, ...] = ()
    early_exit: tuple[EarlyExitSpec, ...] = ()
    rebalance: RebalancePolicy = Field(default_factory=RebalancePolicy)

    @model_validator(mode="after")
    def _check(self) -> DynamicsSpec:
        last = [f.iteration for f in self.freezing] + [e.iteration for e in self.early_exit]
        if self.pruning:
            p = self.pruning
            last.append(p.start_iteration + p.steps * p.frequency)
        if last and max(last) >= self.total_iterations:
            raise ValueError(f"an event at iteration {max(last)} is not before "
                             f"total_iterations={self.total_iterations}")
        return self

    @classmethod
    def from_dict(cls, data: Any, *, where: str = "<dynamics>") -> DynamicsSpec:
        """Validate ``data``; errors name the source, the field path and a close key."""
        if not isinstance(data, dict):
            raise SpecError(f"{where}: a dynamics file holds a mapping (keys total_iterations, "
                            f"pruning, freezing, early_exit, rebalance), got "
                            f"{type(data).__name__}")
        return validate_model(cls, data, where=where, hint=_HINT)

    @classmethod
    def load(cls, path: str | Path) -> DynamicsSpec:
        """Read a YAML or JSON dynamics file.

        Raises:
            SpecError: the file is missing, unparsable or invalid (field and fix named).
        """
        data = load_structured_file(path, what="dynamics")
        return cls.from_dict(data, where=str(path))


_HINT = "compare with examples/pruning.yaml"


def stage_changes(old: Sequence[tuple[int, int]], new: Sequence[tuple[int, int]]
                  ) -> tuple[tuple[int, int, int], ...]:
    """``(layer, old stage, new stage)`` for every layer whose stage differs between the
    stage assignments ``old`` and ``new`` (``(first, last)`` ranges; a stage index is a
    pipeline position), in layer order: the layers a move between them sends. O(L)."""
    def stage_of(bounds: Sequence[tuple[int, int]]) -> list[int]:
        return [s for s, (i, j) in enumerate(bounds) for _ in range(i, j + 1)]

    a, b = stage_of(old), stage_of(new)
    return tuple((k, a[k], b[k]) for k in range(min(len(a), len(b))) if a[k] != b[k])


class LayerMigration(_Model):
    """Layer ``layer`` moves from pipeline stage ``src_stage`` to ``dst_stage`` with
    ``bytes`` (weights, sparse indices, optimizer state)."""

    layer: NonNegInt
    src_stage: NonNegInt
    dst_stage: NonNegInt
    bytes: NonNegFloat


class PlannedEvent(_Model):
    """One dynamic event and the re-balancing decided for it.

    ``stages``: the complete assignment after the event, one ``(first, last)`` layer range per
    stage (stage ``s`` stays on the ranks of pipeline coordinate ``s``); ``released_stages``:
    pipeline coordinates left without layers by re-packing. ``applied`` is false when the
    trigger policy judged the move not worth its cost (``stages`` then is the proposal).
    ``migrations``: the layers the move sends, from the stages held before it (the last
    applied event's, in iteration order); the runtime derives them from ``stages`` itself,
    and the validator refuses an applied event's list that differs
    (:mod:`hetplan.ir.plan_rebalancing_checks`).
    """

    iteration: NonNegInt
    label: str = ""
    stages: tuple[tuple[NonNegInt, NonNegInt], ...] = Field(min_length=1)
    migrations: tuple[LayerMigration, ...] = ()
    bytes_moved: NonNegFloat = 0.0
    predicted_before_ms: Ms = 0.0
    predicted_after_ms: Ms = 0.0
    overhead_ms: Ms = 0.0
    applied: bool = False
    released_stages: tuple[NonNegInt, ...] = ()

    @model_validator(mode="after")
    def _check(self) -> PlannedEvent:
        try:
            check_bounds(self.stages)
        except SpecError as e:
            raise ValueError(f"event at iteration {self.iteration}: {e}") from None
        return self


class Rebalancing(_Model):
    """The ``dynpipe`` pass's re-balancing section: the policy and the planned events.

    ``speedup_vs_static`` is the predicted whole-run throughput of the re-balanced pipeline
    over the same pipeline kept on its initial partition (overheads included).
    """

    policy: RebalancePolicy = Field(default_factory=RebalancePolicy)
    total_iterations: PosInt = 1
    events: tuple[PlannedEvent, ...] = ()
    speedup_vs_static: NonNegFloat = 1.0
    devices_used_mean: NonNegFloat = 0.0
