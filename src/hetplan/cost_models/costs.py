"""The cost model: one object bundling compute, communication, compression and memory costs
for a cluster, built once per compile and shared by every pass (so passes never disagree)."""

from __future__ import annotations

from typing import Any

from hetplan.cost_models.comm import CommModel
from hetplan.cost_models.compression import CompressionModel
from hetplan.cost_models.compute import ComputeModel
from hetplan.cost_models.precision import resolve_precision
from hetplan.cost_models.profile_db import ProfileDB
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan_sections import Precision

__all__ = ["CostModel"]


class CostModel:
    """Costs on one cluster, profiled where ``db`` has measurements, analytic elsewhere.

    Args:
        cluster: the cluster.
        db: a profile DB (``hetplan profile``), or None.
        dtype: the precision policy (``mixed``: each device type in its own 16-bit dtype;
            ``fp32``, ``bf16``, ``fp16``: one dtype everywhere); see
            :mod:`hetplan.cost_models.precision`.
        efficiency: fraction of peak FLOP/s the roofline assumes.
        optimizer: optimizer whose state the memory model counts (``adam``, ``sgd`` ...).
        require_profiled: a missing profiled compute time is an error, not a fallback.
        precision: the plan's precision section (None: resolved from ``dtype``); every
            pass, the memory model and the compute model read ``self.precision``.
    """

    def __init__(
        self,
        cluster: ClusterSpec,
        db: ProfileDB | None = None,
        *,
        dtype: str = "fp32",
        efficiency: float = 0.5,
        optimizer: str = "adam",
        require_profiled: bool = False,
        precision: Precision | None = None,
    ) -> None:
        self.cluster = cluster
        self.db = db
        self.optimizer = optimizer
        self.devices = cluster.devices()
        self.precision = precision if precision is not None else resolve_precision(dtype,
                                                                                   cluster)
        self.compute = ComputeModel(
            db, efficiency=efficiency, dtype=dtype, require_profiled=require_profiled,
            precision=self.precision,
        )
        self.comm = CommModel(cluster, db)
        self.compression = CompressionModel(cluster, db)
        #: pipeline simulations by their inputs: passes that only change gradient sync
        #: re-evaluate the same schedule many times (see ``evaluate``)
        self.pipeline_cache: dict[tuple[Any, ...], Any] = {}
        #: small derived values by their inputs (a stage's state precision by its ranks'
        #: device types, ...): pure functions of this model the search asks for again and
        #: again; every entry is keyed by a tag naming the function first
        self.memo: dict[tuple[Any, ...], Any] = {}
