"""The cost model: one object bundling compute, communication, compression and memory costs
for a cluster, built once per compile and shared by every pass (so passes never disagree)."""

from __future__ import annotations

from typing import Any

from hetplan.cost_models.comm import CommModel
from hetplan.cost_models.compression import CompressionModel
from hetplan.cost_models.compute import ComputeModel
from hetplan.cost_models.profile_db import ProfileDB
from hetplan.ir.cluster import ClusterSpec

__all__ = ["CostModel"]


class CostModel:
    """Costs on one cluster, profiled where ``db`` has measurements, analytic elsewhere.

    Args:
        cluster: the cluster.
        db: a profile DB (``hetplan profile``), or None.
        dtype: compute dtype for roofline estimates (``fp32``, ``bf16`` ...).
        efficiency: fraction of peak FLOP/s the roofline assumes.
        optimizer: optimizer whose state the memory model counts (``adam``, ``sgd`` ...).
        require_profiled: a missing profiled compute time is an error, not a fallback.
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
    ) -> None:
        self.cluster = cluster
        self.db = db
        self.optimizer = optimizer
        self.devices = cluster.devices()
        self.compute = ComputeModel(
            db, efficiency=efficiency, dtype=dtype, require_profiled=require_profiled
        )
        self.comm = CommModel(cluster, db)
        self.compression = CompressionModel(cluster, db)
        #: pipeline simulations by their inputs: passes that only change gradient sync
        #: re-evaluate the same schedule many times (see ``evaluate``)
        self.pipeline_cache: dict[tuple[Any, ...], Any] = {}
