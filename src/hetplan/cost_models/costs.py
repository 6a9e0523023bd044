"""The cost model: one object bundling compute, communication, compression and memory costs
for a cluster, built once per compile and shared by every pass (so passes never disagree)."""

from __future__ import annotations

from collections import Counter
from typing import Any, Literal

from hetplan.cost_models.comm import CommModel
from hetplan.cost_models.compression import CompressionModel
from hetplan.cost_models.compute import ComputeModel, workload_tokens
from hetplan.cost_models.engine_memory import engine_layer, vocab_layers
from hetplan.cost_models.grad_accumulation import GRAD_ACCUMULATIONS, GradAccumulation
from hetplan.cost_models.kernels import Attention, Fusion, curve_for
from hetplan.cost_models.memory import capture_bytes
from hetplan.cost_models.precision import resolve_precision
from hetplan.cost_models.profile_db import ProfileDB
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan_sections import LayerCost, Precision, WorkloadSummary

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
        attention: the attention core fused (``flash``) or ``materialized``
            (:mod:`hetplan.cost_models.kernels`).
        fusion: the engine's memory-bound kernels run fused (``fused``) or as captured
            (``none``; :mod:`hetplan.cost_models.kernels`).
        vocab_parallel: the engine's LM head is split across TP ranks by vocabulary
            (:func:`~hetplan.cost_models.kernels.kernel_times`), and so is its
            cross-entropy (:func:`~hetplan.cost_models.memory.loss_activations`).
        dp_overlap: data-parallel sync overlaps the last backward (``backward``) or runs
            after the pipeline flush (``after-flush``); ``evaluate`` reads it.
        grad_accumulation: how the engine accumulates gradients across micro-batches
            (:mod:`hetplan.cost_models.grad_accumulation`; ``unpriced``: not priced);
            ``stage_times`` reads it.
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
        attention: Attention = "flash",
        dp_overlap: Literal["backward", "after-flush"] = "backward",
        fusion: Fusion = "none",
        vocab_parallel: bool = False,
        grad_accumulation: GradAccumulation = "unpriced",
    ) -> None:
        self.cluster = cluster
        self.db = db
        self.optimizer = optimizer
        self.devices = cluster.devices()
        #: devices per node index (NIC sharing, :func:`~.stage_times.nic_share`)
        self.node_sizes = Counter(d.node_index for d in self.devices)
        self.precision = precision if precision is not None else resolve_precision(dtype,
                                                                                   cluster)
        self.compute = ComputeModel(
            db, efficiency=efficiency, dtype=dtype, require_profiled=require_profiled,
            precision=self.precision, attention=attention, fusion=fusion,
            vocab_parallel=vocab_parallel,
            kernel_devices=all(curve_for(t) is not None for t in {d.type for d in self.devices}),
        )
        if dp_overlap not in ("backward", "after-flush"):
            raise ValueError(f"dp_overlap must be 'backward' or 'after-flush', got {dp_overlap!r}")
        self.dp_overlap = dp_overlap
        if grad_accumulation not in GRAD_ACCUMULATIONS:
            raise ValueError(f"grad_accumulation must be one of {', '.join(GRAD_ACCUMULATIONS)}"
                             f", got {grad_accumulation!r}")
        self.grad_accumulation: GradAccumulation = grad_accumulation
        self.attention: Attention = attention
        self.vocab_parallel = vocab_parallel
        self.comm = CommModel(cluster, db)
        self.compression = CompressionModel(cluster, db)
        #: pipeline simulations by their inputs: passes that only change gradient sync
        #: re-evaluate the same schedule many times (see ``evaluate``)
        self.pipeline_cache: dict[tuple[Any, ...], Any] = {}
        #: small derived values by their inputs (a stage's state precision by its ranks'
        #: device types, ...): pure functions of this model the search asks for again and
        #: again; every entry is keyed by a tag naming the function first
        self.memo: dict[tuple[Any, ...], Any] = {}

    def memory_layers(self, workload: WorkloadSummary) -> tuple[LayerCost, ...]:
        """``workload``'s layers as the memory model counts them: as captured; with
        ``fusion="fused"`` each transformer block's activations as the engine's fused kernels
        keep them (:func:`~hetplan.cost_models.engine_memory.engine_layer`); with
        ``vocab_parallel`` the LM head and its vocabulary embedding TP-split
        (:func:`~hetplan.cost_models.engine_memory.vocab_layers`). Memoised by the
        workload's identity (the entry holds the workload, so its id is not reused)."""
        if self.compute.fusion != "fused" and not self.vocab_parallel:
            return workload.layers
        key = ("memory_layers", id(workload))
        hit = self.memo.get(key)
        if hit is not None and hit[0] is workload:
            return hit[1]
        tokens, elem = workload_tokens(workload), capture_bytes(workload)
        layers = workload.layers
        if self.compute.fusion == "fused":
            layers = tuple(engine_layer(x, tokens, elem, self.attention) for x in layers)
        if self.vocab_parallel:
            layers = vocab_layers(layers, elem)
        self.memo[key] = (workload, layers)
        return layers
