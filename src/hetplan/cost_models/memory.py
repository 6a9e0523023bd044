"""Memory per rank: weights, gradients, master weights and optimizer state, activations,
communication buffers and an allocator margin.

**Model state** per parameter element a rank holds (:func:`model_state`), in the dtypes of
:class:`StatePrecision`:

=====================  ===========  ==========  ==================  ==============
training               weights      gradients   master + optimizer   total (Adam)
=====================  ===========  ==========  ==================  ==============
mixed (bf16 / fp16)    2            2           4 + 8                16
fp32                   4            4           0 + 8                16
=====================  ===========  ==========  ==================  ==============

Optimizer moments are fp32: Adam / AdamW 8 bytes (two moments), SGD with momentum 4, plain
SGD 0. A rank holds the parameters of its stage(s), the tensor-parallel-splittable part
divided by ``tp`` (or times its share with uneven shards). ZeRO then divides inside the
group that averages the stage's gradients, ``dp`` ranks (under Chimera ``2·dp``: the ranks
holding either replica's copy, :mod:`hetplan.cost_models.rank_memory`): stage 1 the master
weights and optimizer state, stage 2 also the gradients, stage 3 also the weights.

**Activations** of one layer for one micro-batch (:func:`layer_activations`), from the bytes
the capture saw autograd keep (``LayerCost.act_*``): floating bytes scale by
``StatePrecision.act_scale`` (activations are stored in the compute dtype), non-floating ones
(dropout masks) do not; the part saved inside tensor-parallel regions is divided by ``tp``,
the part outside too with sequence parallelism. Per recomputation mode of a transformer block
(``LayerCost.kind == "block"``): ``none`` keeps what autograd saves, ``selective`` drops the
attention core (``act_attn_core_*``), ``full`` keeps the block's input only
(``act_in_bytes``). This reproduces Korthikanti et al. 2022, Table 2 (tested).

**The loss** (:func:`loss_activations`): the runtime's cross-entropy over a language
model's logits (the workload's last layer, a ``head``; ``E`` output elements per
micro-batch: its captured ``act_out_bytes`` over the capture dtype) runs in fp32, as
Megatron-LM computes it, whatever the compute dtype. From forward to backward the rank holds
the fp32 logits (the upcast copy of 16-bit logits, or the fp32 output itself: the model's
output keeps them until its backward ends) and log-softmax's saved fp32 output: ``8E``
bytes per micro-batch in flight, beside the layers' activations. In backward, the
gradients of the log-probabilities (``nll_loss``) and of the logits (log-softmax) are live
at once: ``8E`` more, one micro-batch at a time. At ``E = b·s·V`` with ``V = 50257`` this is
``16·b·s·V`` bytes — more than all of GPT-2 small's blocks keep (measured on CPU with
the storages live at the peak: ``tests/unit/test_loss_memory.py``). With a vocabulary-parallel
head (``vocab_parallel`` under ``tp > 1``: Megatron-LM's cross-entropy, and the runtime's
:func:`~hetplan.runtime.megatron.vocab_parallel_cross_entropy`) each rank's logits are its
``E/tp`` columns and the loss never gathers them: forward keeps the fp32 softmax of its
columns (``4E/tp``; the 16-bit logits are not saved), backward makes the gradient from it and
scales it (``8E/tp``).

**In flight**: a rank holds the activations of every micro-batch it ran forward and not yet
backward; :func:`peak_in_flight` walks the rank's action list of the schedule
(:mod:`hetplan.algorithms.pipeline_schedules` — the lists the runtime executes) and takes the
peak of the held bytes, stage by stage (interleaved chunks differ). Recomputation adds the
transient of one layer's backward: the activations it rematerialises.

**Buffers**: ZeRO-2 and -3 reduce-scatter each layer's full gradients out of a bucket as
large as the stage's largest layer's; ZeRO-3 all-gathers weights into two such buckets (the
layer computing and the one prefetched). ZeRO-1 works in place.

**Margin**: :data:`ALLOCATOR_MARGIN` of the activations and buffers (the caching allocator's
fragmentation; model state is allocated once and does not fragment). A rank's capacity is
:data:`USABLE_FRACTION` of its device memory (the CUDA context, library workspaces and NCCL's
buffers live outside the allocator). :func:`check_fits` raises
:class:`~hetplan.errors.InfeasiblePlanError` naming the first rank that does not fit, with
its breakdown in numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from hetplan.algorithms.pipeline_schedules import ActionKind, PipelineSchedule, build_schedule
from hetplan.errors import OutOfMemoryError
from hetplan.ir.plan_sections import LayerCost, WorkloadSummary
from hetplan.ir.vocab import capture_dtype_bytes

__all__ = [
    "ALLOCATOR_MARGIN",
    "MOMENT_BYTES",
    "USABLE_FRACTION",
    "VOCAB_PARALLEL_HELD_BYTES",
    "VOCAB_PARALLEL_TRANSIENT_BYTES",
    "FP32",
    "MIXED",
    "MemoryBreakdown",
    "StatePrecision",
    "breakdown",
    "capture_bytes",
    "check_fits",
    "in_flight_micro_batches",
    "layer_activations",
    "loss_activations",
    "model_state",
    "peak_in_flight",
    "recompute_transient",
    "schedule_of",
    "stage_memory",
    "zero_buffers",
]

#: fp32 optimizer-moment bytes per parameter element.
MOMENT_BYTES = {"adam": 8, "adamw": 8, "sgd-momentum": 4, "sgd": 0}
#: Fraction of device memory a plan may use.
USABLE_FRACTION = 0.9
#: Allocator margin: this fraction of a rank's activations and communication buffers.
ALLOCATOR_MARGIN = 0.05

GiB = float(2**30)


@dataclass(frozen=True, slots=True)
class StatePrecision:
    """Bytes per element of what one rank holds.

    Attributes:
        weight_bytes: working weights (the compute dtype).
        grad_bytes: gradients (the reduce dtype).
        master_bytes: the fp32 master copy beside 16-bit weights (0 in fp32 training).
        act_bytes: activations (the compute dtype).
        capture_bytes: the floating dtype the workload's bytes were captured in.
    """

    weight_bytes: int = 4
    grad_bytes: int = 4
    master_bytes: int = 0
    act_bytes: int = 4
    capture_bytes: int = 4

    @property
    def act_scale(self) -> float:
        """Captured floating activation bytes → bytes in the compute dtype."""
        return self.act_bytes / self.capture_bytes


#: :func:`capture_bytes` of the last few workloads, by identity (a workload is immutable;
#: the entry holds it, so its id cannot be reused while cached). The search asks for it
#: hundreds of thousands of times per compile.
_CAPTURE_BYTES: dict[int, tuple[WorkloadSummary, int]] = {}


def capture_bytes(workload: WorkloadSummary) -> int:
    """Bytes per element of the floating dtype the workload was captured in: its gradients'
    (the parameters') most common dtype; 4 (fp32) when it lists none."""
    hit = _CAPTURE_BYTES.get(id(workload))
    if hit is not None and hit[0] is workload:
        return hit[1]
    if len(_CAPTURE_BYTES) >= 8:
        _CAPTURE_BYTES.clear()
    value = capture_dtype_bytes(workload)
    _CAPTURE_BYTES[id(workload)] = (workload, value)
    return value


#: fp32 training of an fp32 capture.
FP32 = StatePrecision()
#: Mixed precision (bf16 or fp16 compute, fp32 master weights) of an fp32 capture.
MIXED = StatePrecision(weight_bytes=2, grad_bytes=2, master_bytes=4, act_bytes=2)


@dataclass(frozen=True, slots=True)
class MemoryBreakdown:
    """Bytes one rank holds (see :class:`~hetplan.ir.plan_sections.RankMemory`)."""

    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int = 0
    margin: int = 0

    @property
    def total(self) -> int:
        return (self.params + self.grads + self.optimizer + self.activations + self.buffers
                + self.margin)

    def describe(self) -> str:
        """``"params 1.20 GiB, grads …, optimizer …"`` (parts that are 0 left out)."""
        parts = (("params", self.params), ("grads", self.grads),
                 ("master weights + optimizer state", self.optimizer),
                 ("activations", self.activations), ("comm buffers", self.buffers),
                 ("allocator margin", self.margin))
        return ", ".join(f"{name} {value / GiB:.2f}" for name, value in parts if value) + " GiB"


# -- model state -----------------------------------------------------------------------------
def _rank_numel(layers: Sequence[LayerCost], tp: int, shares: Sequence[float] | None,
                capture_bytes: int) -> float:
    """Parameter elements of ``layers`` on one TP rank."""
    numel = 0.0
    for k, lay in enumerate(layers):
        split = min(lay.tp_split_bytes, lay.param_bytes)
        part = split / tp if shares is None else split * shares[k]
        numel += (lay.param_bytes - split + part) / capture_bytes
    return numel


def model_state(
    layers: Sequence[LayerCost],
    *,
    tp: int = 1,
    dp: int = 1,
    zero_stage: int = 0,
    optimizer: str = "adam",
    precision: StatePrecision = FP32,
    shares: Sequence[float] | None = None,
) -> tuple[float, float, float]:
    """(weights, gradients, master weights + optimizer state) bytes of one rank holding
    ``layers`` (see module docstring). ``shares``: this rank's fraction of each layer's split
    parameters (uneven TP shards); None: ``1 / tp``."""
    if optimizer not in MOMENT_BYTES:
        raise ValueError(
            f"unknown optimizer {optimizer!r}; expected one of {sorted(MOMENT_BYTES)}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    numel = _rank_numel(layers, tp, shares, precision.capture_bytes)
    weights = numel * precision.weight_bytes / (dp if zero_stage >= 3 else 1)
    grads = numel * precision.grad_bytes / (dp if zero_stage >= 2 else 1)
    state = numel * (precision.master_bytes + MOMENT_BYTES[optimizer])
    return weights, grads, state / (dp if zero_stage >= 1 else 1)


def zero_buffers(layers: Sequence[LayerCost], *, tp: int = 1, zero_stage: int = 0,
                 precision: StatePrecision = FP32, shares: Sequence[float] | None = None,
                 ) -> float:
    """Communication buffers of ZeRO on one rank: a reduce-scatter bucket of the largest
    layer's gradients (stages 2, 3) and two all-gather buckets of its weights (stage 3)."""
    if zero_stage < 2 or not layers:
        return 0.0
    largest = max(_rank_numel([lay], tp, None if shares is None else [shares[k]],
                              precision.capture_bytes) for k, lay in enumerate(layers))
    out = largest * precision.grad_bytes
    if zero_stage >= 3:
        out += 2 * largest * precision.weight_bytes
    return out


# -- activations -----------------------------------------------------------------------------
def layer_activations(
    lay: LayerCost,
    mode: str = "none",
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    precision: StatePrecision = FP32,
    micro_batch_scale: float = 1.0,
    share: float | None = None,
) -> float:
    """Bytes ``lay`` keeps for backward for one micro-batch under recomputation ``mode``
    (see module docstring). ``share``: this rank's fraction of the layer's TP-split part
    (uneven shards); None: ``1 / tp``."""
    if mode not in ("none", "selective", "full"):
        raise ValueError(f"unknown recompute mode {mode!r}; expected none, selective or full")
    r = precision.act_scale
    split_tp = tp > 1 and lay.tp_pairs > 0
    frac = (1.0 / tp if share is None else share) if split_tp else 1.0
    if mode == "full" and lay.kind == "block":
        kept = lay.act_in_bytes * r
        return kept * (frac if sequence_parallel else 1.0) * micro_batch_scale
    nonfloat = lay.act_saved_nonfloat_bytes
    floating = lay.act_saved_bytes - nonfloat
    if mode == "selective":
        floating -= lay.act_attn_core_bytes - lay.act_attn_core_nonfloat_bytes
        nonfloat -= lay.act_attn_core_nonfloat_bytes
    total = floating * r + nonfloat
    if not split_tp:
        return total * micro_batch_scale
    rep_nonfloat = lay.act_replicated_nonfloat_bytes
    replicated = (lay.act_replicated_bytes - rep_nonfloat) * r + rep_nonfloat
    if sequence_parallel:
        return total * frac * micro_batch_scale
    return ((total - replicated) * frac + replicated) * micro_batch_scale


#: fp32 bytes per output element the cross-entropy keeps from forward to backward (the fp32
#: logits, log-softmax's output) and adds in its backward (two gradients).
LOSS_HELD_BYTES = 8.0
LOSS_TRANSIENT_BYTES = 8.0


#: fp32 bytes per local output element a vocabulary-parallel cross-entropy keeps (its
#: softmax) and adds in its backward (the gradient and its scaled copy).
VOCAB_PARALLEL_HELD_BYTES = 4.0
VOCAB_PARALLEL_TRANSIENT_BYTES = 8.0


def loss_activations(lay: LayerCost, capture_bytes: int = 4, *,
                     micro_batch_scale: float = 1.0, vocab_tp: int = 1) -> tuple[float, float]:
    """(held, transient) bytes of the loss over ``lay``'s output for one micro-batch (see
    module docstring): ``lay`` must be the workload's last layer; (0, 0) unless it is a
    ``head`` (the runtime's cross-entropy over its logits). ``vocab_tp``: the head's
    vocabulary is split over this many TP ranks (a vocabulary-parallel cross-entropy over
    each rank's columns); 1: the logits are whole on the rank."""
    if lay.kind != "head" or not lay.act_out_bytes:
        return 0.0, 0.0
    elems = lay.act_out_bytes / capture_bytes * micro_batch_scale
    if vocab_tp > 1:
        local = elems / vocab_tp
        return VOCAB_PARALLEL_HELD_BYTES * local, VOCAB_PARALLEL_TRANSIENT_BYTES * local
    return LOSS_HELD_BYTES * elems, LOSS_TRANSIENT_BYTES * elems


def recompute_transient(
    lay: LayerCost,
    mode: str,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    precision: StatePrecision = FP32,
    micro_batch_scale: float = 1.0,
    share: float | None = None,
) -> float:
    """Bytes one layer's backward rematerialises under ``mode``: what autograd keeps without
    recomputation minus what the mode keeps (0 for ``none``). Keywords: as
    :func:`layer_activations`."""
    if mode == "none":
        return 0.0
    none = layer_activations(lay, "none", tp=tp, sequence_parallel=sequence_parallel,
                             precision=precision, micro_batch_scale=micro_batch_scale,
                             share=share)
    kept = layer_activations(lay, mode, tp=tp, sequence_parallel=sequence_parallel,
                             precision=precision, micro_batch_scale=micro_batch_scale,
                             share=share)
    return max(none - kept, 0.0)


@lru_cache(maxsize=256)
def schedule_of(name: str, pp: int, micro_batches: int, virtual_stages: int = 1
                ) -> PipelineSchedule:
    """The generated schedule (:func:`~hetplan.algorithms.pipeline_schedules.build_schedule`),
    cached: the memory model walks the same lists for every plan of a layout."""
    return build_schedule(name, pp, micro_batches, virtual_stages)


def peak_in_flight(schedule: PipelineSchedule, rank: int, stage_bytes: Sequence[float]) -> float:
    """The peak of the activation bytes ``rank`` holds while it runs its action list: a
    forward adds its stage's bytes, a backward frees them. ``stage_bytes[s]`` is one
    micro-batch's bytes of stage ``s``, the action's (virtual) stage: under Chimera a rank
    runs two stages, ``r`` going down and ``pp-1-r`` going up, and each action holds its
    own stage's bytes. A list of another length is per rank: every action of ``rank``
    holds ``stage_bytes[rank]``. O(actions of the rank)."""
    by_rank = len(stage_bytes) != schedule.num_stages
    live = peak = 0.0
    for a in schedule.actions[rank]:
        b = stage_bytes[rank if by_rank else a.stage]
        live += b if a.kind is ActionKind.F else -b
        peak = max(peak, live)
    return peak


def in_flight_micro_batches(
    schedule: str, stage: int, pp: int, micro_batches: int, virtual_stages: int = 1
) -> float:
    """Micro-batches' worth of a whole rank's activations that pipeline rank ``stage`` holds
    at its peak (its ``virtual_stages`` chunks equal), counted from the schedule's action
    lists: GPipe ``M``; 1F1B ``min(M, pp - stage)``; interleaved 1F1B on the first rank
    ``pp · (1 + (pp - 1) / (pp · v))`` (Narayanan et al. 2021) when ``M`` allows."""
    if pp == 1:  # no pipeline: micro-batch after micro-batch (gradient accumulation)
        return 1.0
    if (virtual_stages == 1 and schedule in ("1f1b", "gpipe") and 0 <= stage < pp
            and micro_batches >= 1):  # (out of range: the lists' builder says what is wrong)
        # what the walk below counts, without walking: 1F1B's rank runs min(pp - 1 - stage,
        # M) warm-up forwards and then one more before its first backward; GPipe all M
        return float(min(pp - stage, micro_batches) if schedule == "1f1b" else micro_batches)
    sched = schedule_of(schedule, pp, micro_batches, virtual_stages)
    return peak_in_flight(sched, stage, [1.0 / virtual_stages] * sched.num_stages)


# -- one rank --------------------------------------------------------------------------------
def stage_memory(
    layers: Sequence[LayerCost],
    *,
    tp: int,
    micro_batch_scale: float,
    in_flight: float,
    optimizer: str = "adam",
    buffers: int = 0,
    shares: Sequence[float] | None = None,
    precision: StatePrecision = FP32,
    dp: int = 1,
    zero_stage: int = 0,
    sequence_parallel: bool = False,
    recompute: str = "none",
    last: bool = False,
    vocab_tp: int = 1,
) -> MemoryBreakdown:
    """Peak bytes of one rank of a stage made of ``layers`` holding ``in_flight``
    micro-batches' worth of its activations (see module docstring); ``buffers``: bytes a pass
    asks for beside ZeRO's; ``last``: the stage ends the model (it computes the loss);
    ``vocab_tp``: as :func:`loss_activations`."""
    w, g, o = model_state(layers, tp=tp, dp=dp, zero_stage=zero_stage, optimizer=optimizer,
                          precision=precision, shares=shares)
    acts = transient = 0.0
    for k, lay in enumerate(layers):
        share = None if shares is None else shares[k]
        acts += layer_activations(lay, recompute, tp=tp, sequence_parallel=sequence_parallel,
                                  precision=precision, micro_batch_scale=micro_batch_scale,
                                  share=share)
        transient = max(transient, recompute_transient(
            lay, recompute, tp=tp, sequence_parallel=sequence_parallel, precision=precision,
            micro_batch_scale=micro_batch_scale, share=share))
    if last and layers:
        held, loss_transient = loss_activations(layers[-1], precision.capture_bytes,
                                                micro_batch_scale=micro_batch_scale,
                                                vocab_tp=vocab_tp)
        acts += held
        transient = max(transient, loss_transient)
    bufs = buffers + zero_buffers(layers, tp=tp, zero_stage=zero_stage, precision=precision,
                                  shares=shares)
    return breakdown(w, g, o, acts * in_flight + transient, bufs)


def breakdown(weights: float, grads: float, state: float, activations: float,
              buffers: float) -> MemoryBreakdown:
    """A :class:`MemoryBreakdown` with the allocator margin added (bytes rounded down)."""
    margin = ALLOCATOR_MARGIN * (activations + buffers)
    return MemoryBreakdown(int(weights), int(grads), int(state), int(activations),
                           int(buffers), int(margin))


def check_fits(
    per_rank: Sequence[MemoryBreakdown], capacity_bytes: Sequence[int], *, what: str = ""
) -> None:
    """Raise :class:`~hetplan.errors.OutOfMemoryError` (an ``InfeasiblePlanError``) for the
    first rank whose memory exceeds its capacity, with its breakdown."""
    for rank, (mem, cap) in enumerate(zip(per_rank, capacity_bytes)):
        usable = cap * USABLE_FRACTION
        if mem.total > usable:
            raise OutOfMemoryError(
                f"{what + ': ' if what else ''}rank {rank} needs {mem.total / GiB:.2f} GiB "
                f"({mem.describe()}) but its device has {cap / GiB:.2f} GiB "
                f"({usable / GiB:.2f} GiB usable at {USABLE_FRACTION:.0%}); use more pipeline "
                "or tensor parallelism, ZeRO sharding, activation recomputation, a smaller "
                "micro-batch, or devices with more memory"
            )
