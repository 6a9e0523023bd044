"""The profile DB: measured costs written by ``hetplan profile`` (schema version 2).

A :class:`ProfileDB` holds four kinds of records, each identified by a key:

* :class:`ComputeRecord`, key ``(signature, device_type, dtype, batch_size)``: forward and
  backward time of one layer, run in compute dtype ``dtype`` (autocast for bf16/fp16) at
  micro-batch ``batch_size``. ``signature`` is the layer's per-sample shape signature,
  :meth:`hetplan.ir.model.LayerIR.signature` (module type, parameter shapes and dtypes,
  activation sizes and FLOPs per sample), so identical blocks share one record and a layer
  profiled at one micro-batch is found when planning at another
  (:meth:`ProfileDB.compute_record` returns the nearest measured micro-batch; the compute model
  scales from it). Version 1 keyed records by batch-specific signatures without saying the
  batch or dtype; such files are refused with a hint to re-profile.
* :class:`CollectiveRecord`, key ``(collective, backend, link_kind, group_size)``: measured
  ``(nbytes, seconds)`` samples and/or a fitted line ``seconds = alpha_s + beta_s_per_byte *
  nbytes`` for that collective at that group size (see :mod:`hetplan.cost_models.comm` for what
  ``nbytes`` means per collective and how the line is rescaled to other group sizes).
* :class:`CompressorRecord`, key ``(compressor, device_kind, device_type)``: measured
  ``(nbytes, compress_s, decompress_s)`` samples; ``device_kind`` is where the compressor runs
  (``gpu`` or ``cpu``) and ``device_type`` the cluster device type of the machine (a GPU type
  such as ``A100-80GB``, or ``cpu``).

* :class:`OptimizerRecord`, key ``(optimizer, device_type, processes)``: measured time of one
  optimizer step (``step()`` then ``zero_grad()``) over ``tensors`` parameters holding
  ``nbytes`` fp32 bytes, with ``processes`` processes stepping at once on the machine, and a
  fitted line ``seconds = per_tensor_s * tensors + per_byte_s * nbytes`` (``hetplan profile
  --what step``). On a CPU the per-tensor term (the optimizer's Python and dispatch per
  parameter) dominates small models. Added like sparsity records, without a version bump: an
  absent ``optimizer_steps`` list reads as empty and an empty one is not written.
* :class:`HandoverRecord`, key ``(operation, backend, link_kind, group_size, nbytes)``: a
  p2p hand-over or a collective of ``nbytes`` timed the way training pays it on an
  oversubscribed CPU: every one of ``processes`` processes computes a burst of ``burst_s``
  between the messages; a sample is the time per message beyond the burst (``hetplan
  profile --what collectives`` on gloo; :mod:`hetplan.profiling.handover`). One record per
  message size: the cost model interpolates in bytes between them. Added like optimizer
  records, without a version bump: an absent ``handovers`` list reads as empty and an empty
  one is not written; an older profile has one size per key, read as it was. Operation
  ``allreduce_step`` (added the same way: older profiles have none) is the data-parallel sync
  timed inside the runtime's own training step of the profiled model
  (:mod:`hetplan.profiling.sync_step`): the burst is the step without the sync, a sample what
  the sync takes inside the steps with it (profiles before 2026-11-26 16:00 UTC: the slowest
  synced step less the step without); ``allgather_step`` the same with a compressed bucket
  synced by one all-gather (less the compressor's own work); ``reduce_broadcast_step`` the
  same with the bucket synced uncompressed by a reduce and a broadcast (the root-type
  routing, on the gradient path's worker thread); ``zero3_forward`` /
  ``zero3_backward`` likewise what the runtime's ZeRO-3 (FSDP2) adds to the plain forward and
  backward, and ``zero3_step`` its optimizer step over the sharded parameters.
  ``tp_forward`` / ``tp_backward`` (and ``tp_sp_*`` with sequence parallelism;
  :mod:`hetplan.profiling.tp_step`, added the same way) are the runtime's tensor-parallel forward and backward of the whole profiled
  model, TP collectives included, with every TP group running at once; they carry the
  ``micro_batch`` they were timed at (a field written only when set, so older records are
  written unchanged). ``traced_forward`` / ``traced_backward`` (:mod:`hetplan.profiling.
  stage_trace`, the same way) are the eager model's phase and the same phase run as the
  runtime's traced pipeline stages.
* :class:`SparsityRecord`, key ``(model, gradient, workers, batch_size)``: the measured
  statistics of one row-sparse (embedding) gradient when ``workers`` data-parallel workers
  each look up ``batch_size`` samples per synchronized step (``hetplan profile --sparsity``,
  :mod:`hetplan.profiling.sparsity`): per-worker density ``d_G``, aggregated density ``d_G^n``
  and skew ``s_G^n`` (thesis Definitions 3.4-3.5), the steps they are means over and the data
  they came from (a synthetic ``zipf`` token stream or the user's ``script``).
  :meth:`ProfileDB.sparsity_record` returns the record of the nearest measured batch; the zen
  pass scales it (:mod:`hetplan.passes.zen`).

plus :class:`MachineInfo` entries describing the machines measured (device type, torch
version, backend; never a hostname, so DBs can be shared).

Sparsity records were added without a version bump: an absent ``sparsity`` list reads as
empty, so every older version-2 file keeps loading with the same meaning, and
:meth:`ProfileDB.to_json` leaves the list out when it is empty, so a DB without sparsity
records is written exactly as before (and stays readable by a hetplan that predates them).

Determinism: records are kept sorted by key whatever order they were given in, and
:meth:`ProfileDB.to_json` writes sorted keys with a fixed indent, so equal DBs give
byte-identical files. A key may appear only once in a DB; :func:`merge` combines DBs from
several machines and resolves duplicates by keeping the record with **more samples** (on a tie,
the one from the earlier argument).

Lookups (:meth:`ProfileDB.compute`, :meth:`ProfileDB.collective`, :meth:`ProfileDB.compressor`)
return None when there is no record; the cost models then fall back to analytic estimates and
record that they did.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Final, Literal, TypeVar

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, field_validator,
                      model_validator)

from hetplan.errors import PlanVersionError, SpecError
from hetplan.ir.fields import Int, strict_float
from hetplan.ir.files import write_text_file
from hetplan.ir.validation import load_structured_file, parse_json_object, validate_model

__all__ = [
    "PROFILE_SCHEMA_VERSION",
    "CollectiveName",
    "CollectiveRecord",
    "CollectiveSample",
    "CompressorRecord",
    "CompressorSample",
    "ComputeRecord",
    "DeviceKind",
    "HandoverRecord",
    "HandoverSample",
    "MachineInfo",
    "ProfileDB",
    "OptimizerRecord",
    "OptimizerSample",
    "SparsityRecord",
    "merge",
]

#: The profile DB format this hetplan reads and writes.
PROFILE_SCHEMA_VERSION: Final = 2

#: Collective operations a profile can measure (the names :mod:`.comm` uses).
CollectiveName = Literal[
    "allreduce", "reduce_scatter", "allgather", "alltoall", "broadcast", "reduce", "gather", "p2p"
]
#: Compute dtypes a layer can be profiled in.
ComputeDtypeName = Literal["fp32", "bf16", "fp16"]
#: Where a compressor runs.
DeviceKind = Literal["gpu", "cpu"]

_CONFIG = ConfigDict(frozen=True, extra="forbid", validate_default=True)
#: numbers are strict (:mod:`hetplan.ir.fields`): ``true`` or ``"8"`` is not a number
_NonNeg = Annotated[float, Field(ge=0, allow_inf_nan=False), BeforeValidator(strict_float)]
_Name = Annotated[str, Field(min_length=1)]
_RERUN = "re-run `hetplan profile`"
_HINT = f"hint: profile DBs are written by `hetplan profile`; {_RERUN} rather than editing"


class MachineInfo(BaseModel):
    """A machine the DB was measured on (no hostname, so DBs can be shared).

    Attributes:
        device_type: cluster device type name (``A100-80GB``, ``cpu`` ...).
        torch_version: ``torch.__version__`` at profiling time.
        backend: the ``torch.distributed`` backend used for collectives (``nccl``, ``gloo``).
        cuda_version: ``torch.version.cuda``, or None on CPU builds.
        device_count: devices used on that machine.
    """

    model_config = _CONFIG

    device_type: _Name
    torch_version: _Name
    backend: _Name
    cuda_version: str | None = None
    device_count: Int = Field(default=1, ge=1)

    def sort_key(self) -> tuple[str, str, str, str, int]:
        """Canonical order of machine entries."""
        return (self.device_type, self.backend, self.torch_version, self.cuda_version or "",
                self.device_count)


class ComputeRecord(BaseModel):
    """Measured forward/backward time of one layer signature on one device type.

    Attributes:
        signature: the layer's per-sample shape signature (``LayerIR.signature(batch)``).
        device_type: cluster device type name.
        dtype: the compute dtype it ran in (``fp32``; ``bf16`` / ``fp16`` under autocast).
        batch_size: the micro-batch it was measured at.
        fwd_ms / bwd_ms: mean forward and backward time in milliseconds.
        samples: how many timed iterations the means are over (≥ 1).
        fwd_stdev_ms / bwd_stdev_ms: their standard deviations.
        label: optional human-readable description (``"Linear 768x3072 fp32"``); not part of
            the key.
    """

    model_config = _CONFIG

    signature: _Name
    device_type: _Name
    dtype: ComputeDtypeName = "fp32"
    batch_size: Int = Field(default=1, ge=1, le=1 << 20)
    fwd_ms: _NonNeg
    bwd_ms: _NonNeg
    samples: Int = Field(ge=1)
    fwd_stdev_ms: _NonNeg = 0.0
    bwd_stdev_ms: _NonNeg = 0.0
    label: str = ""

    @property
    def key(self) -> tuple[str, str, str, int]:
        """``(signature, device_type, dtype, batch_size)``."""
        return (self.signature, self.device_type, self.dtype, self.batch_size)

    @property
    def num_samples(self) -> int:
        """Samples behind the record (used by :func:`merge`)."""
        return self.samples


class CollectiveSample(BaseModel):
    """One timing of a collective: ``seconds`` for a buffer of ``nbytes``."""

    model_config = _CONFIG

    nbytes: Int = Field(ge=0)
    seconds: _NonNeg


class CollectiveRecord(BaseModel):
    """Measurements of one collective at one group size, backend and link kind.

    Attributes:
        collective: the operation (``allreduce`` ...).
        backend: ``nccl`` or ``gloo`` (any non-empty name is accepted).
        link_kind: the link the group spans (a :data:`hetplan.ir.cluster.LinkKind`:
            ``nvlink``, ``pcie``, ``ethernet``, ``infiniband``, ``loopback``).
        group_size: ranks in the group (≥ 2).
        samples: measured ``(nbytes, seconds)`` points.
        alpha_s / beta_s_per_byte: a fitted line ``seconds = alpha_s + beta_s_per_byte * nbytes``
            for this group size. Give both or neither; when given they are used as is,
            otherwise the cost model fits ``samples``. At least one of the two must be present.
    """

    model_config = _CONFIG

    collective: CollectiveName
    backend: _Name
    link_kind: _Name
    group_size: Int = Field(ge=2)
    samples: tuple[CollectiveSample, ...] = ()
    alpha_s: _NonNeg | None = None
    beta_s_per_byte: _NonNeg | None = None

    @model_validator(mode="after")
    def _has_data(self) -> CollectiveRecord:
        if (self.alpha_s is None) != (self.beta_s_per_byte is None):
            raise ValueError(
                "give both 'alpha_s' and 'beta_s_per_byte' or neither "
                f"(got alpha_s={self.alpha_s!r}, beta_s_per_byte={self.beta_s_per_byte!r})"
            )
        if self.alpha_s is None and not self.samples:
            raise ValueError(
                f"collective record {self.key!r} has neither samples nor a fitted "
                "alpha_s/beta_s_per_byte; add at least one"
            )
        return self

    @property
    def key(self) -> tuple[str, str, str, int]:
        """``(collective, backend, link_kind, group_size)``."""
        return (self.collective, self.backend, self.link_kind, self.group_size)

    @property
    def num_samples(self) -> int:
        """Samples behind the record (used by :func:`merge`)."""
        return len(self.samples)


class CompressorSample(BaseModel):
    """One timing of a compressor on a buffer of ``nbytes`` (raw, uncompressed bytes)."""

    model_config = _CONFIG

    nbytes: Int = Field(ge=0)
    compress_s: _NonNeg
    decompress_s: _NonNeg


_S = TypeVar("_S")


def _one_sample_per(value: tuple[_S, ...], field: str, fix: str) -> tuple[_S, ...]:
    """``value`` sorted by ``field``; two samples at one value of it are refused (``fix``
    says what to do instead)."""
    counts = Counter(getattr(x, field) for x in value)
    dup = sorted(v for v, c in counts.items() if c > 1)
    if dup:
        raise ValueError(f"more than one sample for {field} {dup}; {fix}")
    return tuple(sorted(value, key=lambda x: getattr(x, field)))


class CompressorRecord(BaseModel):
    """Measurements of one compressor on one kind of device of one machine type.

    Attributes:
        compressor: compressor name (``topk``, ``fp16`` ...; see :mod:`.compression`).
        device_kind: ``gpu`` or ``cpu`` (where (de)compression runs).
        device_type: the cluster device type of the machine measured.
        samples: at least one ``(nbytes, compress_s, decompress_s)`` point; at most one per
            ``nbytes`` (kept sorted by size).
    """

    model_config = _CONFIG

    compressor: _Name
    device_kind: DeviceKind
    device_type: _Name
    samples: tuple[CompressorSample, ...] = Field(min_length=1)

    @field_validator("samples")
    @classmethod
    def _sorted_unique(cls, value: tuple[CompressorSample, ...]) -> tuple[CompressorSample, ...]:
        return _one_sample_per(value, "nbytes", "average them into one")

    @property
    def key(self) -> tuple[str, str, str]:
        """``(compressor, device_kind, device_type)``."""
        return (self.compressor, self.device_kind, self.device_type)

    @property
    def num_samples(self) -> int:
        """Samples behind the record (used by :func:`merge`)."""
        return len(self.samples)


class SparsityRecord(BaseModel):
    """Measured statistics of one row-sparse gradient (thesis Definitions 3.4-3.5).

    Each statistic is the mean over ``steps`` measured steps; within a step, ``density`` and
    ``skew`` are means over the ``workers`` workers.

    Attributes:
        model: the captured model's name (``ModelIR.name``: the zoo name, or the class name
            of a ``--module`` factory's model).
        gradient: the gradient's (embedding weight's) parameter name.
        workers: ``n``, the data-parallel workers whose index sets were aggregated (>= 1).
        batch_size: samples one worker looks up per synchronized step (its micro-batch times
            the micro-batches accumulated before the sync).
        rows: rows of the table measured (a record whose rows differ from the planned model's
            is not used).
        density: ``d_G``, fraction of rows one worker's step touches, in (0, 1].
        density_n: ``d_G^n``, fraction touched by the union of the ``n`` workers' steps.
        skew: ``s_G^n``, densest of ``n`` even row partitions of one worker's rows over
            ``density`` (>= 1).
        steps: steps measured (>= 1).
        data: ``zipf`` (synthetic Zipf token stream) or ``script`` (the user's batches).
        zipf_alpha: the Zipf exponent of a ``zipf`` stream; None for ``script``.
    """

    model_config = _CONFIG

    model: _Name
    gradient: _Name
    workers: Int = Field(ge=1)
    batch_size: Int = Field(ge=1, le=1 << 20)
    rows: Int = Field(ge=1)
    density: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False),
                       BeforeValidator(strict_float)]
    density_n: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False),
                         BeforeValidator(strict_float)]
    skew: Annotated[float, Field(ge=1, allow_inf_nan=False), BeforeValidator(strict_float)]
    steps: Int = Field(ge=1)
    data: Literal["zipf", "script"]
    zipf_alpha: Annotated[float, Field(gt=0, allow_inf_nan=False),
                          BeforeValidator(strict_float)] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> SparsityRecord:
        if self.density_n < self.density * (1 - 1e-9):
            raise ValueError(f"density_n {self.density_n!r} is below density "
                             f"{self.density!r}; aggregating workers cannot remove rows")
        if (self.data == "zipf") != (self.zipf_alpha is not None):
            raise ValueError("give zipf_alpha exactly when data is 'zipf' "
                             f"(data={self.data!r}, zipf_alpha={self.zipf_alpha!r})")
        return self

    @property
    def key(self) -> tuple[str, str, int, int]:
        """``(model, gradient, workers, batch_size)``."""
        return (self.model, self.gradient, self.workers, self.batch_size)

    @property
    def num_samples(self) -> int:
        """Steps behind the record (used by :func:`merge`)."""
        return self.steps


class OptimizerSample(BaseModel):
    """One timing of an optimizer step over ``tensors`` parameters of ``nbytes`` fp32 bytes."""

    model_config = _CONFIG

    tensors: Int = Field(ge=1)
    nbytes: Int = Field(ge=0)
    seconds: _NonNeg


class OptimizerRecord(BaseModel):
    """Measured optimizer steps of one optimizer on one device type.

    Attributes:
        optimizer: the optimizer's name in plans (``adam``, ``adamw``, ``sgd``,
            ``sgd-momentum``: ``cost_settings.optimizer``).
        device_type: the cluster device type measured.
        processes: processes that stepped at once on the machine (the ranks of one node:
            on a CPU they share its cores).
        samples: the measured ``(tensors, nbytes, seconds)`` points (at least one).
        per_tensor_s / per_byte_s: the fitted line ``seconds = per_tensor_s * tensors +
            per_byte_s * nbytes`` (non-negative least squares on relative residuals).
    """

    model_config = _CONFIG

    optimizer: _Name
    device_type: _Name
    processes: Int = Field(ge=1)
    samples: tuple[OptimizerSample, ...] = Field(min_length=1)
    per_tensor_s: _NonNeg
    per_byte_s: _NonNeg

    @property
    def key(self) -> tuple[str, str, int]:
        """``(optimizer, device_type, processes)``."""
        return (self.optimizer, self.device_type, self.processes)

    @property
    def num_samples(self) -> int:
        """Samples behind the record (used by :func:`merge`)."""
        return len(self.samples)

    def time_s(self, tensors: float, nbytes: float) -> float:
        """The fitted step time of ``tensors`` parameters holding ``nbytes`` fp32 bytes."""
        return self.per_tensor_s * tensors + self.per_byte_s * nbytes


class HandoverSample(BaseModel):
    """One measured burst length: every process computed ``burst_s`` (wall time, all of them
    at once) between two messages, and a message then took ``seconds`` beyond the burst."""

    model_config = _CONFIG

    burst_s: _NonNeg
    seconds: _NonNeg


class HandoverRecord(BaseModel):
    """A message timed under the run's own contention (see :mod:`hetplan.profiling.handover`).

    On 4 processes sharing 2 cores a rank that blocks on a message gives its core away; when
    the message arrives it waits for a core again, behind ranks that are computing. A
    back-to-back measurement (:class:`CollectiveRecord`) has idle cores and misses that wait;
    this one has every rank compute a burst between the messages, as training does.

    Attributes:
        operation: ``p2p`` (each rank sends to the next and receives from the previous one,
            the pipeline's blocking receive), ``allreduce``, or ``allreduce_step`` (the
            data-parallel sync inside the runtime's step: the burst is the step without the
            sync, forward, backward and optimizer; the seconds what the sync takes inside
            the steps with it: the mean wait and the slowest rank's lag),
            ``allgather_step`` (the same step with a compressed sync whose one collective is
            an all-gather, less the compressor's own work; ``nbytes`` the gathered bytes),
            ``reduce_broadcast_step`` (the same step with the bucket synced uncompressed by a
            reduce to one rank and a broadcast back),
            ``zero3_forward`` / ``zero3_backward`` (the runtime's ZeRO-3 phase: the burst is
            the plain replica's phase, the seconds what ZeRO-3 adds to it; ``nbytes`` the
            model's fp32 parameters), ``zero3_step`` (the burst is the plain replica's
            optimizer step, the seconds FSDP2's step over the sharded model's DTensors, as
            is), ``tp_forward`` / ``tp_backward`` and ``tp_sp_forward`` /
            ``tp_sp_backward`` (the runtime's tensor-parallel phase of the whole profiled
            model over groups of ``group_size``, all groups at once, without / with sequence
            parallelism: the burst is the unsplit model's phase on every process, the
            seconds the TP phase itself, its collectives included; ``nbytes`` the model's
            fp32 parameters), ``tp_loss`` / ``tp_sp_loss`` (the loss of the same steps,
            part of their forward: the burst is the unsplit model's cross-entropy, the
            seconds the runtime's vocabulary-parallel cross-entropy with its three
            all-reduces over the TP group, which a pipeline runs on its last stage only),
            ``traced_forward`` / ``traced_backward`` (the whole profiled
            model's phase as the runtime's traced pipeline stages run it: the burst is the
            eager model's phase, the seconds the traced stages'; ``group_size`` and
            ``processes`` the processes computing at once).
        backend / link_kind / group_size: as in :class:`CollectiveRecord` (p2p: 2).
        processes: processes computing and communicating at once (every group of
            ``group_size`` among them talks at the same time).
        nbytes: the message (per-rank buffer) the samples were taken with; a profile may hold
            the same operation at several sizes, one record each.
        samples: one per burst length, sorted by ``burst_s``, at most one per length.
        micro_batch: the samples per rank the phase was timed at (``tp_*``, ``traced_*``; None
            for the messages, and not written then).
    """

    model_config = _CONFIG

    operation: Literal["p2p", "allreduce", "allreduce_step", "allgather_step",
                       "reduce_broadcast_step", "zero3_forward", "zero3_backward",
                       "zero3_step", "tp_forward", "tp_backward",
                       "tp_sp_forward", "tp_sp_backward", "tp_loss", "tp_sp_loss",
                       "traced_forward", "traced_backward"]
    backend: _Name
    link_kind: _Name
    group_size: Int = Field(ge=2)
    processes: Int = Field(ge=2)
    nbytes: Int = Field(ge=1)
    samples: tuple[HandoverSample, ...] = Field(min_length=1)
    micro_batch: Int | None = Field(default=None, ge=1)

    @field_validator("samples")
    @classmethod
    def _sorted_unique(cls, value: tuple[HandoverSample, ...]) -> tuple[HandoverSample, ...]:
        return _one_sample_per(value, "burst_s", "keep one per burst")

    @property
    def key(self) -> tuple[str, str, str, int, int]:
        """``(operation, backend, link_kind, group_size, nbytes)``: one record per message
        size."""
        return (self.operation, self.backend, self.link_kind, self.group_size, self.nbytes)

    @property
    def num_samples(self) -> int:
        """Samples behind the record (used by :func:`merge`)."""
        return len(self.samples)

    def seconds_at(self, burst_s: float) -> float:
        """The time of one message after a burst of ``burst_s``: linear between the measured
        bursts, the nearest measured one outside them (no extrapolation).

        Example:
            >>> r = HandoverRecord(operation="p2p", backend="gloo", link_kind="loopback",
            ...     group_size=2, processes=4, nbytes=4096,
            ...     samples=[{"burst_s": 0.0, "seconds": 0.001},
            ...              {"burst_s": 0.002, "seconds": 0.003}])
            >>> round(r.seconds_at(0.001), 6), r.seconds_at(0.01)
            (0.002, 0.003)
        """
        pts = self.samples
        if burst_s <= pts[0].burst_s:
            return pts[0].seconds
        for lo, hi in zip(pts, pts[1:]):
            if burst_s <= hi.burst_s:
                w = (burst_s - lo.burst_s) / (hi.burst_s - lo.burst_s)
                return lo.seconds + w * (hi.seconds - lo.seconds)
        return pts[-1].seconds


def _canonical(records: tuple[Any, ...], what: str) -> tuple[Any, ...]:
    counts = Counter(r.key for r in records)
    dup = sorted(k for k, c in counts.items() if c > 1)
    if dup:
        raise ValueError(
            f"{what} key {dup[0]!r} appears {counts[dup[0]]} times; each key may appear once "
            "(use hetplan.cost_models.profile_db.merge to combine DBs)"
        )
    return tuple(sorted(records, key=lambda r: r.key))


class ProfileDB(BaseModel):
    """A versioned set of measured costs; see the module docstring.

    Attributes:
        schema_version: always :data:`PROFILE_SCHEMA_VERSION`; files with another version are
            refused by :meth:`load`.
        machines: the machines measured.
        compute / collectives / compressors / sparsity / optimizer_steps / handovers: the
            records, kept sorted by key (``sparsity``, ``optimizer_steps`` and ``handovers``
            may be absent from a file: they read as empty).
    """

    model_config = _CONFIG

    schema_version: Literal[2] = PROFILE_SCHEMA_VERSION
    machines: tuple[MachineInfo, ...] = ()
    compute: tuple[ComputeRecord, ...] = ()
    collectives: tuple[CollectiveRecord, ...] = ()
    compressors: tuple[CompressorRecord, ...] = ()
    sparsity: tuple[SparsityRecord, ...] = ()
    optimizer_steps: tuple[OptimizerRecord, ...] = ()
    handovers: tuple[HandoverRecord, ...] = ()

    @field_validator("machines")
    @classmethod
    def _sort_machines(cls, value: tuple[MachineInfo, ...]) -> tuple[MachineInfo, ...]:
        unique = {m.sort_key(): m for m in value}
        return tuple(unique[k] for k in sorted(unique))

    @field_validator("compute")
    @classmethod
    def _sort_compute(cls, value: tuple[ComputeRecord, ...]) -> tuple[ComputeRecord, ...]:
        return _canonical(value, "compute")

    @field_validator("collectives")
    @classmethod
    def _sort_collectives(
        cls, value: tuple[CollectiveRecord, ...]
    ) -> tuple[CollectiveRecord, ...]:
        return _canonical(value, "collective")

    @field_validator("compressors")
    @classmethod
    def _sort_compressors(
        cls, value: tuple[CompressorRecord, ...]
    ) -> tuple[CompressorRecord, ...]:
        return _canonical(value, "compressor")

    @field_validator("sparsity")
    @classmethod
    def _sort_sparsity(cls, value: tuple[SparsityRecord, ...]) -> tuple[SparsityRecord, ...]:
        return _canonical(value, "sparsity")

    @field_validator("optimizer_steps")
    @classmethod
    def _sort_optimizer_steps(
        cls, value: tuple[OptimizerRecord, ...]
    ) -> tuple[OptimizerRecord, ...]:
        return _canonical(value, "optimizer step")

    @field_validator("handovers")
    @classmethod
    def _sort_handovers(cls, value: tuple[HandoverRecord, ...]) -> tuple[HandoverRecord, ...]:
        return _canonical(value, "hand-over")

    # -- lookups ---------------------------------------------------------------------------
    @cached_property
    def _compute_index(self) -> dict[tuple[str, str, str], tuple[ComputeRecord, ...]]:
        index: dict[tuple[str, str, str], list[ComputeRecord]] = {}
        for r in self.compute:  # sorted by key, so each list is sorted by batch size
            index.setdefault((r.signature, r.device_type, r.dtype), []).append(r)
        return {k: tuple(v) for k, v in index.items()}

    @cached_property
    def _collective_index(self) -> dict[tuple[str, str, str, int], CollectiveRecord]:
        return {r.key: r for r in self.collectives}

    @cached_property
    def _compressor_index(self) -> dict[tuple[str, str, str], CompressorRecord]:
        return {r.key: r for r in self.compressors}

    def compute_record(
        self, signature: str, device_type: str, dtype: str = "fp32", batch_size: int = 1
    ) -> ComputeRecord | None:
        """The compute record of a layer signature on a device type in ``dtype``, measured at
        the micro-batch nearest ``batch_size`` (by ratio; on a tie the larger one, whose
        kernels are closer to saturating the device), or None."""
        records = self._compute_index.get((signature, device_type, dtype))
        if not records:
            return None
        return min(records, key=lambda r: (max(r.batch_size / batch_size,
                                                batch_size / r.batch_size), -r.batch_size))

    def sparsity_record(self, model: str, gradient: str, workers: int,
                        batch_size: int) -> SparsityRecord | None:
        """The sparsity record of ``gradient`` of ``model`` on exactly ``workers`` workers,
        measured at the batch nearest ``batch_size`` (by ratio; on a tie the larger), or
        None."""
        records = [r for r in self.sparsity
                   if (r.model, r.gradient, r.workers) == (model, gradient, workers)]
        if not records:
            return None
        return min(records, key=lambda r: (max(r.batch_size / batch_size,
                                                batch_size / r.batch_size), -r.batch_size))

    def collective(
        self, collective: str, backend: str, link_kind: str, group_size: int
    ) -> CollectiveRecord | None:
        """The record of ``collective`` at exactly this backend, link kind and group size."""
        return self._collective_index.get((collective, backend, link_kind, group_size))

    def collective_records(
        self, collective: str, backend: str, link_kind: str
    ) -> tuple[CollectiveRecord, ...]:
        """All records of ``collective`` on this backend and link kind, by group size."""
        return tuple(
            r for r in self.collectives
            if (r.collective, r.backend, r.link_kind) == (collective, backend, link_kind)
        )

    def compressor(
        self, compressor: str, device_kind: str, device_type: str
    ) -> CompressorRecord | None:
        """The record of ``compressor`` on ``device_kind`` of a ``device_type`` machine."""
        return self._compressor_index.get((compressor, device_kind, device_type))

    def optimizer_step(
        self, optimizer: str, device_type: str, processes: int = 1
    ) -> OptimizerRecord | None:
        """The optimizer-step record of ``optimizer`` on ``device_type`` measured with the
        number of processes nearest ``processes`` (by ratio; on a tie the larger), or None."""
        records = [r for r in self.optimizer_steps
                   if (r.optimizer, r.device_type) == (optimizer, device_type)]
        if not records:
            return None
        return min(records, key=lambda r: (max(r.processes / processes,
                                                processes / r.processes), -r.processes))

    def handover(
        self, operation: str, backend: str, link_kind: str, group_size: int,
        nbytes: int | None = None,
    ) -> HandoverRecord | None:
        """The hand-over record of ``operation`` at exactly this backend, link kind and group
        size, and message size ``nbytes`` (None: the smallest size measured), or None."""
        return next((r for r in self.handovers  # sorted by key: the smallest size first
                     if r.key[:4] == (operation, backend, link_kind, group_size)
                     and (nbytes is None or r.nbytes == nbytes)), None)

    # -- (de)serialisation ------------------------------------------------------------------
    def to_json(self) -> str:
        """Canonical JSON: sorted keys, indent 2, trailing newline (byte-identical for equal
        DBs)."""
        data = self.model_dump(mode="json")
        # written as before they existed
        for key in ("sparsity", "optimizer_steps", "handovers"):
            if not data[key]:
                del data[key]
        for rec in data.get("handovers", ()):
            if rec["micro_batch"] is None:
                del rec["micro_batch"]
        return json.dumps(data, sort_keys=True, indent=2, allow_nan=False) + "\n"

    def fingerprint(self) -> str:
        """The DB's identity a plan records (``cost_settings.profile_fingerprint``): the
        first 16 hex digits of the SHA-256 of :meth:`to_json`."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def save(self, path: str | Path) -> None:
        """Write :meth:`to_json` to ``path`` (UTF-8)."""
        write_text_file(path, self.to_json(), what="profile DB")

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, where: str = "<profile DB>") -> ProfileDB:
        """Validate parsed profile data (version first).

        Raises:
            PlanVersionError: ``schema_version`` is not :data:`PROFILE_SCHEMA_VERSION`.
            SpecError: it is missing or not an integer, or a field is unknown, missing or out
                of range (one line per problem, naming the field path).
        """
        _check_version(data, where)
        return validate_model(cls, data, where=where, hint=_HINT)

    @classmethod
    def from_json(cls, text: str, *, where: str = "<string>") -> ProfileDB:
        """Parse profile DB JSON; errors as in :meth:`from_dict`, plus invalid JSON."""
        data = parse_json_object(
            text, where=where, what="a profile DB",
            hint=f"is this a file written by `hetplan profile`? {_RERUN} to write a fresh one",
        )
        return cls.from_dict(data, where=where)

    @classmethod
    def load(cls, path: str | Path) -> ProfileDB:
        """Read a profile DB written by :meth:`save`.

        Raises:
            SpecError: the file is missing, unreadable or not valid JSON (with line and
                column), or a field is invalid (with its path).
            PlanVersionError: the file has another schema version.
        """
        data = load_structured_file(path, what="profile DB")
        return cls.from_dict(data, where=str(path))


def _check_version(data: dict[str, Any], where: str) -> None:
    if "schema_version" not in data:
        raise SpecError(
            f"{where}: missing 'schema_version'; a profile DB starts with "
            f'"schema_version": {PROFILE_SCHEMA_VERSION}. Is this a file written by '
            "`hetplan profile`?"
        )
    version = data["schema_version"]
    if isinstance(version, bool) or not isinstance(version, int):
        raise SpecError(
            f"{where}: schema_version must be an integer (this hetplan reads "
            f"{PROFILE_SCHEMA_VERSION}), got {version!r}"
        )
    if version != PROFILE_SCHEMA_VERSION:
        raise PlanVersionError(
            f"{where}: profile DB schema_version {version}; this hetplan reads "
            f"{PROFILE_SCHEMA_VERSION}; {_RERUN}"
            + (" (version 1 keyed layer times by batch-specific signatures and recorded neither "
               "the micro-batch nor the dtype they were measured at)" if version == 1 else "")
        )


def _merge_records(groups: Iterable[tuple[Any, ...]]) -> tuple[Any, ...]:
    best: dict[Any, Any] = {}
    for records in groups:
        for r in records:
            kept = best.get(r.key)
            if kept is None or r.num_samples > kept.num_samples:
                best[r.key] = r
    return tuple(best.values())


def merge(*dbs: ProfileDB) -> ProfileDB:
    """Combine profile DBs measured on several machines or device types.

    Machine entries are united. A key present in several DBs keeps the record with the most
    samples (``samples`` for compute records, the number of sample points otherwise); on a
    tie the record from the earliest argument wins, so the result is deterministic.

    Args:
        *dbs: the DBs, in priority order for ties. No DBs gives an empty DB.

    Returns:
        A new DB (records sorted by key).
    """
    return ProfileDB(
        machines=tuple(m for db in dbs for m in db.machines),
        compute=_merge_records(db.compute for db in dbs),
        collectives=_merge_records(db.collectives for db in dbs),
        compressors=_merge_records(db.compressors for db in dbs),
        sparsity=_merge_records(db.sparsity for db in dbs),
        optimizer_steps=_merge_records(db.optimizer_steps for db in dbs),
        handovers=_merge_records(db.handovers for db in dbs),
    )
