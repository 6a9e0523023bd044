"""The sections of a :class:`hetplan.ir.plan.Plan` (schema version 1).

Each optimization pass owns one section. All models are frozen pydantic models with
``extra="forbid"``; ordered things are JSON arrays (tuples), things keyed by a name are JSON
objects (dicts, written with sorted keys). Units are in the field names (``*_ms``, ``*_bytes``).

Floats that are times (``*_ms``) are rounded to 1e-6 ms and fractions to 1e-9 when a model is
built, so an in-memory plan equals the plan read back from its JSON, and tiny floating-point
noise from summation order does not change the bytes written.

Changing anything here changes the plan format: bump ``SCHEMA_VERSION`` in ``plan.py`` and
regenerate ``tests/golden/plan.schema.json`` (``python -m hetplan.ir.plan --write-schema ...``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, Annotated, Literal, Union, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    StrictBool,
    field_validator,
    model_serializer,
    model_validator,
)

from hetplan.ir.cluster import DTYPE_ALIASES, MAX_WORLD_SIZE, ClusterSpec, Dtype
from hetplan.ir.compressors import compressor_problems
from hetplan.ir.kernels import Gemm
from hetplan.ir.fields import (
    MAX_MS,
    FiniteFloat,
    NonNegFloat,
    NonNegInt,
    PosInt,
    strict_float,
    strict_int,
)
from hetplan.ir.validation import did_you_mean

if TYPE_CHECKING:
    from hetplan.ir.model import ModelIR

__all__ = [
    "MAX_MICRO_BATCHES",
    "LayerCost",
    "GradCost",
    "WorkloadSummary",
    "ModelRef",
    "ClusterRef",
    "CostSettings",
    "Precision",
    "DevicePrecision",
    "RankPlacement",
    "Layout",
    "Stage",
    "PipelineActions",
    "TPLinearShard",
    "TPRankRole",
    "TPGroup",
    "ResizingController",
    "TPPrediction",
    "TensorParallel",
    "CommStep",
    "PathAction",
    "NoSync",
    "CastSync",
    "CompressedSync",
    "SyncStrategy",
    "TensorSync",
    "Bucket",
    "GradientSync",
    "TimeBreakdown",
    "Baseline",
    "Predictions",
    "RankMemory",
    "CostSource",
    "PassLogEntry",
]


def _round_ms(v: float) -> float:
    return round(v, 6) + 0.0  # + 0.0 turns -0.0 into 0.0


def _round_ratio(v: float) -> float:
    return round(v, 9) + 0.0


Name = Annotated[str, Field(min_length=1)]
#: A time in milliseconds, rounded to 1e-6 ms.
Ms = Annotated[float, Field(ge=0, le=MAX_MS, allow_inf_nan=False), BeforeValidator(strict_float),
               AfterValidator(_round_ms)]
#: A fraction in [0, 1], rounded to 1e-9.
Ratio = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False), BeforeValidator(strict_float),
                  AfterValidator(_round_ratio)]
#: A rank, or a count of ranks (at most the largest cluster a spec may describe).
Rank = Annotated[int, Field(ge=0, lt=MAX_WORLD_SIZE), BeforeValidator(strict_int)]
Ranks = Annotated[int, Field(ge=1, le=MAX_WORLD_SIZE), BeforeValidator(strict_int)]
#: Most micro-batches per iteration a plan may have: a pipeline's simulation and its action
#: lists are O(micro-batches x stages).
MAX_MICRO_BATCHES = 2**16
MicroBatches = Annotated[int, Field(ge=1, le=MAX_MICRO_BATCHES), BeforeValidator(strict_int)]
Device = Literal["gpu", "cpu"]


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


def _duplicates(items: Iterable[str | int]) -> list[str | int]:
    """The items that occur more than once, sorted."""
    seq = list(items)
    if len(set(seq)) == len(seq):  # the common case, without counting
        return []
    counts = Counter(seq)
    return sorted(x for x, n in counts.items() if n > 1)


# -- model and cluster references ------------------------------------------------------------
class LayerCost(_Section):
    """Per-layer numbers the simulator needs, copied from the model IR.

    ``signature`` keys profiled times (identical blocks share one); ``tp_pairs`` counts the
    Megatron column/row pairs (one all-reduce each in forward and backward under TP);
    ``tp_split_bytes`` is the parameter bytes in splittable linears. The ``act_*`` parts of
    ``act_saved_bytes`` and ``attn_core_fwd_flops`` are :class:`~hetplan.ir.model.LayerIR`'s
    (non-floating bytes, bytes outside tensor-parallel regions, the attention core that
    selective recomputation drops); plans written before they existed read them as 0, which
    the memory model takes as before: every byte floating, split under TP, no core.
    ``gemms`` and the ``*mem_*_bytes`` are the layer's kernels (:mod:`hetplan.ir.kernels`),
    which the compute model prices shape by shape; empty in plans written before them (the
    compute model then prices the layer's FLOPs at the roofline).
    ``cut_bytes_after`` / ``cuttable_before`` are the IR's pipeline-boundary fields (the
    bytes a boundary after the layer cuts; whether a stage may start at it); read the bytes
    through :attr:`boundary_bytes` (``act_out_bytes`` in plans written before them).
    ``name`` is the module's qualified name, as in the IR: ``""`` is the root module (a leaf
    model, or the parameters a model's top-level module owns beside its children).
    """

    name: str
    kind: Name = "other"
    signature: str = ""
    fwd_flops: NonNegInt = 0
    bwd_flops: NonNegInt = 0
    param_bytes: NonNegInt = 0
    act_in_bytes: NonNegInt = 0
    act_out_bytes: NonNegInt = 0
    act_saved_bytes: NonNegInt = 0
    tp_pairs: NonNegInt = 0
    tp_split_bytes: NonNegInt = 0
    measured_bwd_us: NonNegFloat | None = None
    act_saved_nonfloat_bytes: NonNegInt = 0
    act_replicated_bytes: NonNegInt = 0
    act_replicated_nonfloat_bytes: NonNegInt = 0
    act_attn_core_bytes: NonNegInt = 0
    act_attn_core_nonfloat_bytes: NonNegInt = 0
    attn_core_fwd_flops: NonNegInt = 0
    gemms: tuple[Gemm, ...] = ()
    mem_fwd_bytes: NonNegInt = 0
    mem_bwd_bytes: NonNegInt = 0
    core_mem_fwd_bytes: NonNegInt = 0
    core_mem_bwd_bytes: NonNegInt = 0
    cut_bytes_after: NonNegInt | None = None
    cuttable_before: bool = True

    @property
    def boundary_bytes(self) -> int:
        """Bytes a pipeline boundary right after this layer sends per micro-batch, at the
        captured batch (``cut_bytes_after``, else ``act_out_bytes``)."""
        return self.act_out_bytes if self.cut_bytes_after is None else self.cut_bytes_after


class GradCost(_Section):
    """One gradient tensor, in backward-ready order."""

    name: Name
    size_bytes: NonNegInt
    layer_index: NonNegInt
    dtype: Name = "float32"
    ready_gap_us: NonNegFloat | None = None


class WorkloadSummary(_Section):
    """Enough of the model to re-simulate a plan without re-capturing the model.

    Attributes:
        batch_size: the micro-batch size the numbers were captured with (costs scale
            linearly with the micro-batch size).
        input_shapes / input_dtypes: the example inputs of the capture (the runtime rebuilds
            them to verify the model's fingerprint).
        layers: per-layer FLOPs and bytes, in dataflow order.
        grads: gradient tensors in backward-ready order; ``layer_index`` indexes ``layers``.
        unattributed_fwd_flops / unattributed_bwd_flops: FLOPs outside every layer.
    """

    batch_size: PosInt = 1
    input_shapes: tuple[tuple[NonNegInt, ...], ...] = ()
    input_dtypes: tuple[Name, ...] = ()
    layers: tuple[LayerCost, ...] = ()
    grads: tuple[GradCost, ...] = ()
    unattributed_fwd_flops: NonNegInt = 0
    unattributed_bwd_flops: NonNegInt = 0

    @model_validator(mode="after")
    def _check(self) -> WorkloadSummary:
        for what, names in (("layer", [x.name for x in self.layers]),
                            ("gradient", [g.name for g in self.grads])):
            if dup := _duplicates(names):
                raise ValueError(f"duplicate {what} names {dup}; names must be unique")
        for g in self.grads:
            if g.layer_index >= len(self.layers):
                raise ValueError(
                    f"gradient {g.name!r} has layer_index {g.layer_index}, but there are only "
                    f"{len(self.layers)} layers"
                )
        return self

    @classmethod
    def from_model_ir(cls, ir: ModelIR) -> WorkloadSummary:
        """Copy the per-layer and per-gradient numbers out of a :class:`ModelIR`."""
        return cls(
            batch_size=ir.batch_size,
            input_shapes=ir.input_shapes,
            input_dtypes=ir.input_dtypes,
            layers=tuple(
                LayerCost(
                    name=lay.name,
                    kind=lay.kind.value,
                    signature=lay.signature(ir.batch_size),
                    fwd_flops=lay.fwd_flops,
                    bwd_flops=lay.bwd_flops,
                    param_bytes=lay.param_bytes,
                    act_in_bytes=lay.act_in_bytes,
                    act_out_bytes=lay.act_out_bytes,
                    act_saved_bytes=lay.act_saved_bytes,
                    tp_pairs=sum(1 for x in lay.linears if x.tp_role.value == "row" and x.pair),
                    tp_split_bytes=lay.tp_split_bytes(),
                    measured_bwd_us=lay.measured_bwd_us,
                    act_saved_nonfloat_bytes=lay.act_saved_nonfloat_bytes,
                    act_replicated_bytes=lay.act_replicated_bytes,
                    act_replicated_nonfloat_bytes=lay.act_replicated_nonfloat_bytes,
                    act_attn_core_bytes=lay.act_attn_core_bytes,
                    act_attn_core_nonfloat_bytes=lay.act_attn_core_nonfloat_bytes,
                    attn_core_fwd_flops=lay.attn_core_fwd_flops,
                    gemms=lay.gemms,
                    mem_fwd_bytes=lay.mem_fwd_bytes,
                    mem_bwd_bytes=lay.mem_bwd_bytes,
                    core_mem_fwd_bytes=lay.core_mem_fwd_bytes,
                    core_mem_bwd_bytes=lay.core_mem_bwd_bytes,
                    cut_bytes_after=lay.cut_bytes_after,
                    cuttable_before=lay.cuttable_before,
                )
                for lay in ir.layers
            ),
            grads=tuple(
                GradCost(name=g.name, size_bytes=g.size_bytes, layer_index=g.layer_index,
                         dtype=g.dtype, ready_gap_us=g.ready_gap_us)
                for g in ir.grad_tensors
            ),
            unattributed_fwd_flops=ir.unattributed_fwd_flops,
            unattributed_bwd_flops=ir.unattributed_bwd_flops,
        )


class ModelRef(_Section):
    """Which model the plan is for; ``fingerprint`` is ``ModelIR.fingerprint()``."""

    name: Name
    fingerprint: Name
    num_params: NonNegInt
    workload: WorkloadSummary | None = None

    @classmethod
    def from_model_ir(cls, ir: ModelIR, *, workload: bool = True) -> ModelRef:
        """Reference ``ir`` by name and fingerprint, embedding its workload numbers."""
        summary = WorkloadSummary.from_model_ir(ir) if workload else None
        return cls(name=ir.name, fingerprint=ir.fingerprint(), num_params=ir.num_params,
                   workload=summary)


class ClusterRef(_Section):
    """Which cluster the plan is for; ``fingerprint`` is ``ClusterSpec.fingerprint()``.

    ``spec`` embeds the cluster itself so that ``hetplan simulate`` can re-evaluate the plan
    from the plan file alone.
    """

    name: Name
    fingerprint: Name
    world_size: Ranks
    spec: ClusterSpec | None = None

    @classmethod
    def from_cluster(cls, spec: ClusterSpec, *, embed: bool = True) -> ClusterRef:
        """Reference ``spec`` by name, fingerprint and world size (embedding it by default)."""
        return cls(name=spec.name, fingerprint=spec.fingerprint(), world_size=spec.world_size,
                   spec=spec if embed else None)


#: Whether the LM head is vocabulary-parallel under tensor parallelism (``tp > 1``):
#: ``split``: the head and the ``V x h`` token embedding whose rows are its outputs are split
#: over the TP ranks by vocabulary, with the parallel cross-entropy (Megatron-LM); the
#: planner writes it only for a model that has that pair and no TP resizing controller, and
#: the runtime refuses a plan asking for it where it cannot split. ``whole``: every TP rank
#: holds and runs the whole head and embedding. ``unstated``: a plan written before the plan
#: said (it stored ``false``): priced whole, and run as hetplan always ran such plans, split
#: beside a ``V x h`` embedding unless the resizing controller runs.
VocabParallel = Literal["split", "whole", "unstated"]


def _legacy_vocab_parallel(v: object) -> object:
    """Plans written before :data:`VocabParallel` stored a bool: ``true`` was priced split
    (and the runtime split beside the embedding): ``split``; ``false`` was priced whole while
    the runtime split where it could: ``unstated``."""
    if v is True:
        return "split"
    if v is False:
        return "unstated"
    return v


class CostSettings(_Section):
    """The cost-model settings a plan was predicted with (``simulate`` reuses them).

    ``dtype`` is the precision policy asked for: ``mixed`` (each device type at its own
    16-bit dtype, see :class:`Precision`) or one dtype forced everywhere (``fp32``, ``bf16``,
    ``fp16``); plans written before mixed precision existed say ``fp32`` (the default), which
    still means fp32 everywhere. ``profile_fingerprint`` identifies the profile DB used
    (empty: analytic costs only). ``attention``: the attention core runs fused (``flash``)
    or writes its scores to memory (``materialized``); ``dp_overlap``: data-parallel
    gradient sync overlaps the last micro-batch's backward (``backward``) or starts after
    the pipeline flush (``after-flush``); ``fusion``: the engine's memory-bound kernels
    run as captured (``none``) or as its fused transformer-block kernels (``fused``: their
    time and the activations they keep); ``vocab_parallel``: whether the LM head is
    vocabulary-parallel, the one statement the planner prices and the runtime executes
    (:data:`VocabParallel`); ``grad_accumulation``: how the engine adds each micro-batch's
    gradients to the iteration's (``unpriced``: not priced, what a plan without the field
    means; ``autograd``, ``compile``'s default, ``hook16``, ``hook32``, ``fused``:
    :mod:`hetplan.cost_models.grad_accumulation`), written to JSON only when it is not
    ``unpriced``, so that plans written before it existed stay byte-identical; see
    ``docs/decisions/cost-model.md``, ``docs/decisions/vocab-parallel.md`` and
    ``docs/decisions/published-round6.md``.
    """

    dtype: Name = "fp32"
    efficiency: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False),
                          BeforeValidator(strict_float)] = 0.5
    optimizer: Literal["adam", "adamw", "sgd-momentum", "sgd"] = "adam"
    profile_fingerprint: str = ""
    attention: Literal["flash", "materialized"] = "flash"
    dp_overlap: Literal["backward", "after-flush"] = "backward"
    fusion: Literal["none", "fused"] = "none"
    vocab_parallel: Annotated[VocabParallel, BeforeValidator(_legacy_vocab_parallel)] = "split"
    grad_accumulation: Literal["unpriced", "autograd", "hook16", "hook32", "fused"] = "unpriced"

    @model_serializer(mode="wrap")
    def _omit_unpriced(self, handler: SerializerFunctionWrapHandler,
                       info: SerializationInfo) -> dict[str, object]:
        """Leave ``grad_accumulation`` out while it is ``unpriced`` (see the class)."""
        data: dict[str, object] = handler(self)
        if self.grad_accumulation == "unpriced":
            data.pop("grad_accumulation", None)
        return data

    @property
    def vocab_split(self) -> bool:
        """Whether the predictions price the LM head split by vocabulary (``split``); a plan
        that does not state it (``unstated``) was priced with the head whole."""
        return self.vocab_parallel == "split"

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, v: str) -> str:
        known = ["mixed", *get_args(Dtype), *DTYPE_ALIASES]
        if v not in known:
            raise ValueError(f"unknown precision policy {v[:40]!r}{did_you_mean(v[:40], known)}"
                             f" (known: mixed, {', '.join(get_args(Dtype))})")
        return v


# -- precision -------------------------------------------------------------------------------
ComputeDtype = Literal["fp32", "bf16", "fp16"]


class DevicePrecision(_Section):
    """How one device type computes.

    Attributes:
        compute_dtype: the dtype of its weights, activations and matmuls.
        loss_scaling: ``dynamic`` for fp16 (its range needs a loss scale that backs off on
            overflow), else ``none``.
        peak_dtype: the peak its compute time was priced at: the compute dtype where the
            device type lists a peak for it, else ``fp32`` (a dtype without tensor-core
            support runs at most at the fp32 rate, e.g. bf16 forced on a V100 or a CPU).
    """

    compute_dtype: ComputeDtype = "fp32"
    loss_scaling: Literal["none", "dynamic"] = "none"
    peak_dtype: Name = "fp32"

    @field_validator("peak_dtype")
    @classmethod
    def _known_peak(cls, v: str) -> str:
        known = get_args(Dtype)
        if v not in known:
            raise ValueError(f"unknown dtype {v[:40]!r}{did_you_mean(v[:40], known)} (known: "
                             f"{', '.join(known)})")
        return v

    @model_validator(mode="after")
    def _check(self) -> DevicePrecision:
        want = "dynamic" if self.compute_dtype == "fp16" else "none"
        if self.loss_scaling != want:
            raise ValueError(f"compute_dtype {self.compute_dtype!r} needs loss_scaling "
                             f"{want!r}, got {self.loss_scaling!r}")
        return self


class Precision(_Section):
    """Mixed precision per device type (the ``precision`` plan section).

    Attributes:
        policy: what was asked for: ``mixed`` (bf16 where the device type lists a bf16 peak —
            A100, H100 and newer —, else fp16 with dynamic loss scaling where it lists fp16 —
            V100 and other pre-Ampere GPUs —, else fp32, e.g. CPUs) or one dtype forced.
        devices: per device type of the cluster, how it computes.
        master_weights_dtype: ``fp32`` master weights beside 16-bit working weights; None
            when every device computes in fp32 (the weights are the master copy).
        optimizer_state_dtype: the optimizer's moments.
        grad_reduce_dtype: what gradients are kept and reduced in: ``compute`` (the DP
            group's compute dtype, or fp32 where its ranks compute in different dtypes) or
            ``fp32``.

    A plan without this section (written before it existed) computes in
    ``CostSettings.dtype`` everywhere, as it was predicted.
    """

    policy: Literal["mixed", "fp32", "bf16", "fp16"] = "fp32"
    devices: dict[Name, DevicePrecision] = Field(default_factory=dict)
    master_weights_dtype: Literal["fp32"] | None = None
    optimizer_state_dtype: Literal["fp32"] = "fp32"
    grad_reduce_dtype: Literal["compute", "fp32"] = "compute"

    @model_validator(mode="after")
    def _check(self) -> Precision:
        half = any(d.compute_dtype != "fp32" for d in self.devices.values())
        if half and self.master_weights_dtype is None:
            raise ValueError("16-bit compute needs master_weights_dtype 'fp32' (the optimizer "
                             "updates fp32 master weights, not the 16-bit copy)")
        if self.policy != "mixed" and self.policy != "fp32":
            bad = sorted(t for t, d in self.devices.items() if d.compute_dtype != self.policy)
            if bad:
                raise ValueError(f"policy {self.policy!r} forces that dtype everywhere, but "
                                 f"device types {bad} compute in another")
        return self

    def compute_dtype(self, device_type: str) -> str:
        """The compute dtype of ``device_type`` (fp32 for a type the section does not list)."""
        d = self.devices.get(device_type)
        return d.compute_dtype if d is not None else "fp32"


# -- layout and pipeline stages --------------------------------------------------------------
class RankPlacement(_Section):
    """Where one global rank sits: its device and its (dp, pp, tp) coordinates."""

    rank: Rank
    node: Rank = 0
    local_rank: Rank = 0
    device: str = ""
    dp: Rank = 0
    pp: Rank = 0
    tp: Rank = 0


class Layout(_Section):
    """The parallel layout: dp × pp × tp, micro-batching, pipeline schedule, rank mapping.

    ``virtual_stages`` is the number of model chunks per pipeline rank (interleaved 1F1B only;
    the plan then lists ``pp * virtual_stages`` stages, stage ``k`` on the ranks of pipeline
    coordinate ``k % pp``). ``ranks`` is empty or lists every rank ``0 .. dp*pp*tp-1`` in
    order. ``sequence_parallel`` (Megatron's, with ``tp > 1``): the layer norms and dropouts
    outside the tensor-parallel regions run on a ``1/tp`` slice of the sequence, their TP
    all-reduces become a reduce-scatter and an all-gather. ``zero_stage``: sharding inside
    each data-parallel group (ZeRO): 1 the fp32 master weights and optimizer state (the
    distributed optimizer), 2 also the gradients, 3 also the parameters (FSDP), which are
    all-gathered per layer in forward and backward. The defaults (off, 0) are what plans
    written before these fields meant.
    """

    dp: Ranks = 1
    pp: Ranks = 1
    tp: Ranks = 1
    micro_batches: MicroBatches = 1
    micro_batch_size: PosInt = 1
    global_batch_size: PosInt | None = None
    schedule: Literal["gpipe", "1f1b", "interleaved-1f1b", "chimera"] = "1f1b"
    virtual_stages: Ranks = 1
    ranks: tuple[RankPlacement, ...] = ()
    sequence_parallel: bool = False
    zero_stage: Literal[0, 1, 2, 3] = 0

    @property
    def num_ranks(self) -> int:
        return self.dp * self.pp * self.tp

    def rank_of(self, dp: int, pp: int, tp: int) -> int:
        """Global rank of coordinates (dp, pp, tp): tp innermost (inside a node), then dp,
        then pp outermost (stages span nodes: activations are the cheapest traffic to send
        far). The runtime and the passes share this one mapping."""
        return (pp * self.dp + dp) * self.tp + tp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp, pp, tp) of a global rank; the inverse of :meth:`rank_of`."""
        tp = rank % self.tp
        dp = (rank // self.tp) % self.dp
        pp = rank // (self.tp * self.dp)
        return dp, pp, tp

    @property
    def stage_copies(self) -> int:
        """How many pipeline coordinates hold each stage: 2 under Chimera (pipeline rank
        ``r`` holds stage ``r`` of its *down* model replica and stage ``pp-1-r`` of its *up*
        one), else 1."""
        return 2 if self.schedule == "chimera" and self.pp > 1 else 1

    @property
    def sync_group_size(self) -> int:
        """The ranks a stage's gradients are averaged over: its ``dp`` replicas, times
        :attr:`stage_copies` (Chimera: the dp replicas of pipeline ranks ``s`` and
        ``pp-1-s``, one group for both stages either rank holds)."""
        return self.dp * self.stage_copies

    def stage_holders(self, stage: int) -> tuple[int, ...]:
        """The pipeline coordinates holding (virtual) stage ``stage``: ``stage mod pp``, and
        under Chimera also its mirror ``pp-1-stage``."""
        p = stage % self.pp
        return (p, self.pp - 1 - p) if self.stage_copies == 2 else (p,)

    @model_validator(mode="after")
    def _check(self) -> Layout:
        if self.virtual_stages > 1 and self.schedule != "interleaved-1f1b":
            raise ValueError(
                f"virtual_stages={self.virtual_stages} needs schedule 'interleaved-1f1b', "
                f"got {self.schedule!r}"
            )
        if not self.ranks:
            return self
        if [r.rank for r in self.ranks] != list(range(self.num_ranks)):
            raise ValueError(
                f"ranks must list ranks 0..{self.num_ranks - 1} (dp*pp*tp) in order, got "
                f"{[r.rank for r in self.ranks]}"
            )
        for r in self.ranks:
            if r.dp >= self.dp or r.pp >= self.pp or r.tp >= self.tp:
                raise ValueError(
                    f"rank {r.rank} has coordinates (dp={r.dp}, pp={r.pp}, tp={r.tp}) outside "
                    f"the layout dp={self.dp} pp={self.pp} tp={self.tp}"
                )
        if dup := _duplicates([f"({r.dp},{r.pp},{r.tp})" for r in self.ranks]):
            raise ValueError(f"several ranks share the (dp,pp,tp) coordinates {dup}")
        return self


Recompute = Literal["none", "selective", "full"]


class Stage(_Section):
    """One pipeline stage: layers ``first_layer..last_layer`` (inclusive) on ``ranks``.

    ``recompute``: activation recomputation of the stage's transformer blocks: ``none``
    (autograd keeps what it saves), ``selective`` (the attention core is recomputed in
    backward; Korthikanti et al. 2022), ``full`` (each block keeps only its input and runs
    its forward again in backward). The pass that writes the stages chooses it with the
    partition, since whether a partition fits depends on it.
    """

    index: NonNegInt
    first_layer: NonNegInt
    last_layer: NonNegInt
    layer_names: tuple[str, ...] = ()
    ranks: tuple[Rank, ...] = Field(min_length=1)
    fwd_ms: Ms = 0.0
    bwd_ms: Ms = 0.0
    memory_bytes: NonNegInt | None = None
    recompute: Recompute = "none"

    @model_validator(mode="after")
    def _check(self) -> Stage:
        if self.first_layer > self.last_layer:
            raise ValueError(
                f"stage {self.index}: first_layer {self.first_layer} > last_layer "
                f"{self.last_layer}"
            )
        n = self.last_layer - self.first_layer + 1
        if self.layer_names and len(self.layer_names) != n:
            raise ValueError(
                f"stage {self.index}: {len(self.layer_names)} layer_names for {n} layers"
            )
        return self


#: One rank's pipeline actions: ``"{stage}{F|B}{microbatch}"`` separated by single spaces.
_ACTIONS_PATTERN = r"^[0-9]+[FB][0-9]+( [0-9]+[FB][0-9]+)*$"


class PipelineActions(_Section):
    """The per-rank pipeline action lists the simulator costs and the runtime executes.

    ``ranks[r]`` is pipeline rank ``r``'s actions in execution order, each
    ``"{stage}{F|B}{microbatch}"`` as ``torch.distributed.pipelining`` prints its ``_Action``
    (``"0F0 0F1 0B0 1F0 ..."``); ``num_stages`` is the stages a micro-batch passes
    (``pp * virtual_stages``). The lists are generated by
    :mod:`hetplan.algorithms.pipeline_schedules` for the layout's schedule, which also
    decodes them and checks that they are complete and cannot deadlock. Plans without this
    section (written before it existed; it is optional, so ``schema_version`` stays 1) run
    the lists that module generates for their layout.
    """

    schedule: Literal["gpipe", "1f1b", "interleaved-1f1b", "chimera"]
    micro_batches: MicroBatches
    num_stages: Ranks
    ranks: tuple[Annotated[str, Field(pattern=_ACTIONS_PATTERN)], ...] = Field(min_length=1)


# -- tensor parallelism ----------------------------------------------------------------------
class TPLinearShard(_Section):
    """How one linear is split across the ranks of a TP group (uneven shards allowed).

    ``features`` is the size of the split dimension (out_features for ``column``, in_features
    for ``row``); ``shard_sizes[i]`` is the share of the i-th rank of the group.
    """

    name: Name
    split: Literal["column", "row"]
    features: PosInt
    shard_sizes: tuple[NonNegInt, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _check(self) -> TPLinearShard:
        if sum(self.shard_sizes) != self.features:
            raise ValueError(
                f"linear {self.name!r}: shard_sizes {list(self.shard_sizes)} sum to "
                f"{sum(self.shard_sizes)}, expected features={self.features}"
            )
        return self


class TPRankRole(_Section):
    """A rank's initial role for the resizing controller (ZERO-resizing / SEMI-migration).

    ``gamma`` is the fraction of its columns a ``resize`` rank prunes each iteration; ``beta``
    the fraction a ``migrate_src`` rank sends to the other ranks of its group.
    """

    rank: Rank
    role: Literal["normal", "resize", "migrate_src", "migrate_dst"] = "normal"
    gamma: Ratio = 0.0
    beta: Ratio = 0.0


class TPGroup(_Section):
    """One tensor-parallel group: its ranks, per-linear shard sizes and rank roles."""

    ranks: tuple[Rank, ...] = Field(min_length=1)
    stage: Rank | None = None
    linears: tuple[TPLinearShard, ...] = ()
    roles: tuple[TPRankRole, ...] = ()

    @model_validator(mode="after")
    def _check(self) -> TPGroup:
        if dup := _duplicates(list(self.ranks)):
            raise ValueError(f"TP group lists ranks {dup} more than once")
        for lin in self.linears:
            if len(lin.shard_sizes) != len(self.ranks):
                raise ValueError(
                    f"linear {lin.name!r} has {len(lin.shard_sizes)} shard_sizes for a TP "
                    f"group of {len(self.ranks)} ranks {list(self.ranks)}"
                )
        if bad := sorted({r.rank for r in self.roles} - set(self.ranks)):
            raise ValueError(f"roles name ranks {bad} outside the group {list(self.ranks)}")
        return self


class ResizingController(_Section):
    """Settings of the runtime resizing controller (``research/zero_resizing.md`` §2.9, §6).

    Attributes:
        variant: ``off`` (static shards only), ``zero`` (resizing), ``migration``, ``semi``.
        alpha: PriDiff's decay factor: a layer prunes at least ``alpha · γ`` (paper: 0.8).
        theta_iter: per-iteration micro-threshold θ_iter (paper: 1e-3; θ = n_iter · θ_iter).
        replan_trigger: relative increase of a rank's iteration time that triggers a re-plan.
        gamma_max: upper bound on any rank's pruning ratio γ (< 1: a rank keeps a column).
        imputation: what pruned columns' gradients get (paper: zero).
        criterion: who is a straggler: ``avg`` (T_i > T_avg, ZERO) or ``min`` (T_i > T_min,
            SEMI).
        straggler_eps: relative tolerance of the criterion (T_i > (1 + eps) · T_ref); not in
            the paper (§7 item 25: T_min makes every rank but the fastest a straggler).
        receivers: ranks that take migrated work: ``all`` others (Eq. (3) literal) or
            ``normal`` ones only (§7 item 23).
    """

    variant: Literal["off", "zero", "migration", "semi"] = "off"
    alpha: Ratio = 0.8
    theta_iter: NonNegFloat = 1e-3
    replan_trigger: NonNegFloat = 0.10
    gamma_max: Ratio = 0.9
    imputation: Literal["zero", "same", "average"] = "zero"
    criterion: Literal["avg", "min"] = "avg"
    straggler_eps: NonNegFloat = 0.05
    receivers: Literal["all", "normal"] = "all"

    @model_validator(mode="after")
    def _check(self) -> ResizingController:
        if self.gamma_max >= 1:
            raise ValueError(f"gamma_max must be in [0, 1), got {self.gamma_max}: a rank that "
                             "pruned every column would compute nothing")
        return self


class TPPrediction(_Section):
    """The predicted effect of the TP-resizing decisions (simulated iteration times).

    Attributes:
        even_ms: iteration with even shards and no controller.
        skewed_ms: with the plan's static per-rank shard sizes.
        controller_ms: even shards with the controller's expected pruning ratios (Eq. (1)
            from the predicted per-rank times) — what resizing alone would reach.
        expected_gamma: that expected γ per global rank (ranks not listed: 0).
    """

    even_ms: Ms
    skewed_ms: Ms
    controller_ms: Ms
    expected_gamma: dict[str, Ratio] = Field(default_factory=dict)


class TensorParallel(_Section):
    """The tensor-parallel section: controller settings and one entry per TP group."""

    controller: ResizingController = Field(default_factory=ResizingController)
    groups: tuple[TPGroup, ...] = ()
    predicted: TPPrediction | None = None

    @model_validator(mode="after")
    def _check(self) -> TensorParallel:
        if dup := _duplicates([r for g in self.groups for r in g.ranks]):
            raise ValueError(f"ranks {dup} belong to more than one TP group")
        return self


# -- gradient synchronization ----------------------------------------------------------------
Routine = Literal["allreduce", "reduce_scatter", "allgather", "reduce", "broadcast", "alltoall",
                  "gather"]
#: Routines that can carry compressed payloads (Espresso Table 4.2: no reduction on them).
_COMPRESSED_ROUTINES = frozenset({"allgather", "alltoall", "gather", "broadcast"})
_UNCOMPRESSED_ROUTINES = frozenset({"allreduce", "reduce_scatter", "allgather", "reduce",
                                    "broadcast"})


class CommStep(_Section):
    """One collective of a synchronization path, at one level of the hierarchy."""

    level: Literal["flat", "intra", "inter"] = "flat"
    routine: Routine = "allreduce"
    compressed: StrictBool = False

    @model_validator(mode="after")
    def _check(self) -> CommStep:
        allowed = _COMPRESSED_ROUTINES if self.compressed else _UNCOMPRESSED_ROUTINES
        if self.routine not in allowed:
            what = "compressed" if self.compressed else "uncompressed"
            raise ValueError(
                f"routine {self.routine!r} cannot carry {what} tensors; use one of "
                f"{sorted(allowed)}"
            )
        return self


#: Espresso's action tasks (Table 4.3) and the routines each may use.
_TASK_ROUTINES: dict[str, frozenset[str]] = {
    "comm": frozenset({"allreduce"}),
    "comm1": frozenset({"reduce_scatter", "reduce"}),
    "comm2": frozenset({"allgather", "broadcast"}),
    "comm_comp": frozenset({"allgather"}),
    "comm1_comp": frozenset({"alltoall", "gather"}),
    "comm2_comp": frozenset({"allgather", "broadcast"}),
}


class PathAction(_Section):
    """One action task of an Espresso compression option (a path of the decision tree).

    ``comp``/``decomp`` carry a ``device``; the comm tasks carry a ``routine`` from their
    Table 4.3 search space. A ``decomp`` after a compressed comm decompresses every received
    piece and sums them; a later ``comp`` re-compresses the (aggregated) shard; ``comm1_comp``
    followed directly by ``comm2_comp`` forwards the un-aggregated pieces.
    """

    task: Literal["comp", "decomp", "comm", "comm1", "comm2", "comm_comp", "comm1_comp",
                  "comm2_comp"]
    level: Literal["flat", "intra", "inter"] = "flat"
    routine: Routine | None = None
    device: Device | None = None

    @model_validator(mode="after")
    def _check(self) -> PathAction:
        if self.task in ("comp", "decomp"):
            if self.device is None or self.routine is not None:
                raise ValueError(f"action {self.task!r} needs a device and no routine")
            return self
        allowed = _TASK_ROUTINES[self.task]
        if self.device is not None or self.routine not in allowed:
            raise ValueError(
                f"action {self.task!r} needs a routine in {sorted(allowed)} and no device, "
                f"got routine={self.routine!r} device={self.device!r}"
            )
        return self


class _PathSync(_Section):
    hierarchy: Literal["flat", "hierarchical"] = "flat"
    steps: tuple[CommStep, ...] = Field(default=(CommStep(),), min_length=1)

    @model_validator(mode="after")
    def _check_levels(self) -> _PathSync:
        levels = {s.level for s in self.steps}
        if self.hierarchy == "flat" and levels != {"flat"}:
            raise ValueError(f"a flat path has only 'flat' steps, got levels {sorted(levels)}")
        if self.hierarchy == "hierarchical" and "flat" in levels:
            raise ValueError("a hierarchical path has only 'intra' and 'inter' steps")
        return self


class NoSync(_PathSync):
    """Uncompressed fp32 synchronization (by default one flat allreduce)."""

    kind: Literal["none"] = "none"


class CastSync(_PathSync):
    """Cast to fp16/bf16, synchronize uncompressed, cast back."""

    kind: Literal["cast"] = "cast"
    dtype: Literal["fp16", "bf16"] = "fp16"


class CompressedSync(_PathSync):
    """An Espresso compression option: compressor, where (de)compression runs, the path.

    Attributes:
        compressor: compressor name (``topk``, ``randomk``, ``powersgd``, ``qsgd`` ...).
        params: its parameters (``{"ratio": 0.01}``).
        compress_device / decompress_device: where compression / decompression run.
        uncompressed_dtype: dtype of the uncompressed steps (Espresso's "intra FP16"
            options use fp16).
        error_feedback: keep a residual of what compression dropped, added next iteration.
        steps: collectives in execution order; a step with ``compressed=True`` carries the
            compressed payload (compression happens before the first such step, decompression
            after the last).
    """

    kind: Literal["compressed"] = "compressed"
    compressor: Name
    params: dict[Name, Union[bool, int, FiniteFloat, str]] = Field(default_factory=dict)
    compress_device: Device = "gpu"
    decompress_device: Device = "gpu"
    uncompressed_dtype: Literal["fp32", "fp16", "bf16"] = "fp32"
    error_feedback: StrictBool = True
    steps: tuple[CommStep, ...] = Field(
        default=(CommStep(routine="allgather", compressed=True),), min_length=1
    )
    actions: tuple[PathAction, ...] = ()
    option_id: NonNegInt | None = None

    @model_validator(mode="after")
    def _check_compressed(self) -> CompressedSync:
        if problems := compressor_problems(self.compressor, self.params):
            raise ValueError("\n".join(problems))
        if not any(s.compressed for s in self.steps):
            raise ValueError("a compressed path needs at least one step with compressed=true")
        if self.actions:
            comms = tuple(
                CommStep(level=a.level, routine=a.routine, compressed=a.task.endswith("_comp"))
                for a in self.actions if a.routine is not None
            )
            if comms != self.steps:
                raise ValueError(
                    "steps must list the comm actions of `actions` in order (level, routine, "
                    "compressed = task ends with '_comp')"
                )
            first = next((a.device for a in self.actions if a.task == "comp"), None)
            last = next((a.device for a in reversed(self.actions) if a.task == "decomp"), None)
            if first is None or last is None:
                raise ValueError("actions compress ('comp') and decompress ('decomp') at least "
                                 "once each")
            if (first, last) != (self.compress_device, self.decompress_device):
                raise ValueError(
                    "compress_device / decompress_device must be the devices of the first "
                    "comp and the last decomp action"
                )
        return self


SyncStrategy = Annotated[Union[NoSync, CastSync, CompressedSync], Field(discriminator="kind")]


class TensorSync(_Section):
    """Which strategy (a key of ``GradientSync.strategies``) a gradient tensor uses.

    ``predicted_benefit_ms`` (Espresso): how much longer the iteration is predicted to take if
    this tensor alone went back to the uncompressed fp32 strategy; None when not computed.
    """

    name: Name
    strategy: Name
    predicted_benefit_ms: FiniteFloat | None = None


class Bucket(_Section):
    """Consecutive gradients fused into one (compression +) communication operation."""

    tensors: tuple[Name, ...] = Field(min_length=1)
    size_bytes: NonNegInt
    strategy: Name


class GradientSync(_Section):
    """Per-tensor synchronization strategies (Espresso) and fusion buckets (Cupcake).

    Attributes:
        strategies: named strategies, referenced by ``tensors`` and ``buckets``.
        tensors: the strategy of each gradient tensor, in backward-ready order.
        buckets: buckets in the order they are launched; each uses one strategy.
    """

    strategies: dict[Name, SyncStrategy] = Field(default_factory=dict)
    tensors: tuple[TensorSync, ...] = ()
    buckets: tuple[Bucket, ...] = ()

    @model_validator(mode="after")
    def _check(self) -> GradientSync:
        if dup := _duplicates([t.name for t in self.tensors]):
            raise ValueError(f"tensors lists {dup} more than once")
        if dup := _duplicates([t for b in self.buckets for t in b.tensors]):
            raise ValueError(f"tensors {dup} are in more than one bucket")
        refs = [(f"tensor {t.name!r}", t.strategy) for t in self.tensors]
        refs += [(f"bucket {i}", b.strategy) for i, b in enumerate(self.buckets)]
        for who, ref in refs:
            if ref not in self.strategies:
                raise ValueError(
                    f"{who} uses strategy {ref!r}, which is not one of the strategies "
                    f"{sorted(self.strategies)}"
                )
        per_tensor = {t.name: t.strategy for t in self.tensors}
        for i, b in enumerate(self.buckets):
            for t in b.tensors:
                if t in per_tensor and per_tensor[t] != b.strategy:
                    raise ValueError(
                        f"tensor {t!r} uses strategy {per_tensor[t]!r} but its bucket {i} "
                        f"uses {b.strategy!r}"
                    )
        return self


# -- predictions, provenance, pass log -------------------------------------------------------
class TimeBreakdown(_Section):
    """Where an iteration's time goes, on the pipeline rank that finishes last.

    Attributes:
        compute_ms: forward and backward (recomputation, TP collectives and ZeRO-3 gathers
            on the critical path included).
        comm_ms: all gradient-sync and pipeline-transfer time, hidden or not.
        exposed_comm_ms: the gradient sync not hidden behind backward.
        bubble_ms: pipeline idle time.
        compression_ms: GPU (de)compression of the gradient sync.
        optimizer_ms: the optimizer step after the sync, with the tied embedding's gradient
            sum before it (0 in plans written before the field existed).

    ``compute + bubble`` is the pipeline's span, and the iteration is at most that plus
    ``exposed_comm + optimizer`` (equal when the stage whose sync is exposed longest is also
    the last to finish); ``comm_ms`` and ``compression_ms`` overlap the other parts.
    """

    compute_ms: Ms = 0.0
    comm_ms: Ms = 0.0
    exposed_comm_ms: Ms = 0.0
    bubble_ms: Ms = 0.0
    compression_ms: Ms = 0.0
    optimizer_ms: Ms = 0.0


class Baseline(_Section):
    """The predicted cost of a baseline strategy the plan was compared with."""

    name: Name
    description: str = ""
    iteration_time_ms: Ms
    breakdown: TimeBreakdown | None = None
    memory_per_rank_bytes: tuple[NonNegInt, ...] = ()


class RankMemory(_Section):
    """The predicted peak memory of one rank, by what holds it (bytes; ``total`` their sum).

    Attributes:
        params: working weights (compute dtype), after TP/PP and ZeRO-3 sharding.
        grads: gradients (the reduce dtype), after ZeRO-2 sharding.
        optimizer: fp32 master weights and optimizer state, after ZeRO-1 sharding.
        activations: activations kept for backward at the schedule's peak of in-flight
            micro-batches, under the stage's recomputation, plus the recomputation's transient.
        buffers: communication buffers: ZeRO all-gather and reduce-scatter buckets, buffers
            passes ask for.
        margin: the allocator margin (``cost_models.memory.ALLOCATOR_MARGIN`` of the
            activations and buffers: fragmentation of the caching allocator).
    """

    params: NonNegInt = 0
    grads: NonNegInt = 0
    optimizer: NonNegInt = 0
    activations: NonNegInt = 0
    buffers: NonNegInt = 0
    margin: NonNegInt = 0

    @property
    def total(self) -> int:
        return (self.params + self.grads + self.optimizer + self.activations + self.buffers
                + self.margin)


class Predictions(_Section):
    """What the simulator predicts for the plan, and for the baselines it beat.

    ``memory_per_rank_bytes[r]`` is the peak memory of global rank ``r``; ``memory_breakdown``
    (empty in plans written before it existed) says what holds it, rank by rank. ``bubble_ratio`` is
    the simulated bubble of the plan's (possibly unbalanced) stages; ``bubble_ratio_balanced``
    the simulated bubble of the same schedule with every stage at the mean stage time (the
    inherent part; the difference is the imbalance); ``bubble_ratio_eq1`` the DynPipe seed's
    Eq. (1) (Chimera, B = P) at the mean stage times with ``T_C = 0``. Both are None without
    a pipeline.
    """

    iteration_time_ms: Ms
    breakdown: TimeBreakdown = Field(default_factory=TimeBreakdown)
    memory_per_rank_bytes: tuple[NonNegInt, ...] = ()
    bubble_ratio: Ratio = 0.0
    bubble_ratio_balanced: Ratio | None = None
    bubble_ratio_eq1: Ratio | None = None
    baselines: tuple[Baseline, ...] = ()
    memory_breakdown: tuple[RankMemory, ...] = ()

    @model_validator(mode="after")
    def _check(self) -> Predictions:
        if dup := _duplicates([b.name for b in self.baselines]):
            raise ValueError(f"baseline names {dup} appear more than once")
        if self.memory_breakdown:
            totals = tuple(m.total for m in self.memory_breakdown)
            if totals != self.memory_per_rank_bytes:
                raise ValueError("memory_breakdown must add up to memory_per_rank_bytes, "
                                 "rank by rank")
        return self


class CostSource(_Section):
    """Where one kind of cost came from: a profile DB or an analytic model."""

    source: Literal["profiled", "analytic"]
    detail: str = ""


class PassLogEntry(_Section):
    """One pass run: whether it changed the plan, and notes on what it decided.

    ``duration_ms`` is wall-clock time; it is left ``None`` unless timings were asked for,
    because recording it makes the plan bytes differ from run to run.
    """

    name: Name
    changed: StrictBool
    duration_ms: Ms | None = None
    notes: tuple[str, ...] = ()
