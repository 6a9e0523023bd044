"""The ``sparse_sync`` plan section: how each sparse gradient is synchronized (Zen, ch. 3).

Written by the ``zen`` pass (:mod:`hetplan.passes.zen`), priced by the evaluator
(:mod:`hetplan.cost_models.sparse`), executed by the runtime's sparse-sync handler
(:mod:`hetplan.runtime.handlers.sparse_sync`). A tensor listed here with a scheme other than
``dense`` leaves the gradient-sync section's path: the evaluator takes it out of its bucket
and prices its own sync unit, and the runtime's gradient path skips it.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from hetplan.ir.plan_sections import Name, _duplicates, _Section

__all__ = ["SparseSync", "SparseTensorSync", "SparseStatsRecord"]

Fraction = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]


class SparseStatsRecord(_Section):
    """The statistics a sparse gradient's scheme was chosen with (thesis Definitions 3.4–3.5).

    Attributes:
        density: ``d_G``, fraction of rows non-zero on one rank per iteration.
        density_n: ``d_G^n``, fraction non-zero after aggregating the data-parallel group.
        skew: ``s_G^n``, densest of ``n`` even row partitions over the average (>= 1).
        source: ``profiled`` (measured by ``hetplan profile --sparsity``) or ``assumed`` (the
            documented default from the table's shape and the batch: Zipf(1) token ids).
    """

    density: Fraction
    density_n: Fraction
    skew: Annotated[float, Field(ge=1, allow_inf_nan=False)] = 1.0
    source: Literal["profiled", "assumed"] = "assumed"


class SparseTensorSync(_Section):
    """One row-sparse gradient (an ``nn.Embedding`` / ``EmbeddingBag`` weight).

    Attributes:
        name: the gradient's (parameter's) name, one of the workload's gradients.
        rows / row_elems: the table's shape (a row is the unit that is zero or not).
        stats: its statistics.
        scheme: ``zen`` (Balanced Parallelism: hashed all-to-all push, pull), ``agsparse``
            (all-gather of COO) or ``dense`` (left to the gradient-sync section).
        pull: Zen's pull format, ``bitmap`` (hash bitmap + values) or ``coo``.
        hash_k: slot hash functions of Algorithm 3.2 before serial memory.
        seed: seed of the hash functions (from the plan's seed; the same on every rank).
        dense_ms / predicted_ms: predicted sync time of the dense all-reduce and of ``scheme``.
    """

    name: Name
    rows: Annotated[int, Field(ge=1)]
    row_elems: Annotated[int, Field(ge=1)]
    stats: SparseStatsRecord
    scheme: Literal["zen", "agsparse", "dense"]
    pull: Literal["bitmap", "coo"] = "bitmap"
    hash_k: Annotated[int, Field(ge=1, le=16)] = 3
    seed: Annotated[int, Field(ge=0)] = 0
    dense_ms: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    predicted_ms: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0

    @property
    def benefit(self) -> float:
        """Predicted dense time over this scheme's time (1 when equal or unknown)."""
        return self.dense_ms / self.predicted_ms if self.predicted_ms > 0 else 1.0


class SparseSync(_Section):
    """The sparse gradients of the plan and their schemes.

    Attributes:
        mode: how schemes were chosen: ``auto`` (the fastest predicted of dense, AGsparse and
            Zen), ``zen`` (Zen for every sparse gradient).
        tensors: one entry per detected sparse gradient, in backward-ready order.
    """

    mode: Literal["auto", "zen"] = "auto"
    tensors: tuple[SparseTensorSync, ...] = ()

    @model_validator(mode="after")
    def _check(self) -> SparseSync:
        if dup := _duplicates([t.name for t in self.tensors]):
            raise ValueError(f"sparse_sync lists {dup} more than once")
        return self

    def synced(self) -> dict[str, SparseTensorSync]:
        """The tensors that leave the dense gradient path (scheme other than ``dense``)."""
        return {t.name: t for t in self.tensors if t.scheme != "dense"}
