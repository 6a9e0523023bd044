"""The ``tensor_parallel`` section: uneven shards, and the resizing controller that runs on them.

:class:`TensorParallelHandler` replaces the model's Megatron MLP pairs by uneven column/row
parallel linears with the plan's per-rank shard sizes
(:func:`~hetplan.runtime.tensor_parallel.shard_model`), splits attention by heads and the
embedding and LM head by vocabulary, and runs sequence parallelism
(:mod:`hetplan.runtime.megatron`). :class:`ResizingHandler` executes
``tensor_parallel.controller``: with a variant other than ``off`` the sharded linears become
resizable and the ZERO / migration / SEMI controller runs after every step, starting from the
group's ``roles`` (:mod:`hetplan.runtime.resizing`); with only an emulated straggler the
linears compute in full and the clock measures them.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch.distributed as dist
from torch import nn

from hetplan.errors import SpecError
from hetplan.runtime.handlers.base import Handler, RuntimeContext
from hetplan.runtime.megatron import (
    VocabParallelEmbedding,
    attention_modules,
    attention_sequence_parallel,
    is_split_attention,
    sequence_parallel,
    shard_attention,
    shard_vocab,
    sp_replicated_params,
)
from hetplan.runtime.resizing import Clock, ResizingRuntime, attach_resizing, end_iteration
from hetplan.runtime.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    _find_group,
    shard_model,
)

__all__ = ["ResizingHandler", "TensorParallelHandler"]


class TensorParallelHandler(Handler):
    """Shards the model as the plan's ``tensor_parallel`` section and layout say (``tp > 1``).

    In order: the MLP pairs (:func:`~hetplan.runtime.tensor_parallel.shard_model`, the plan's
    per-linear shard sizes); then, unless the resizing controller (or an emulated straggler)
    runs on the MLP shards (then, with a warning, nothing more), Megatron's remaining splits
    (:mod:`hetplan.runtime.megatron`): attention by whole heads (the plan's sizes for the
    output projection when it lists them), the vocabulary-parallel embedding and LM head as
    ``cost_settings.vocab_parallel`` says (:func:`_vocab_to_split`, which refuses a split it
    cannot do) — ``ctx.loss_fn`` becomes the parallel cross-entropy when it is the token
    cross-entropy — and, with ``layout.sequence_parallel``, sequence parallelism between the
    first and the last sharded layer, whose shared parameters' gradients are summed over the
    TP group after backward (before the data-parallel sync, which runs in a later handler).

    Attributes:
        sp_params: parameters whose gradients are summed over the TP group (sequence
            parallelism), empty otherwise.
        attention: attention modules split by heads.
        vocab: ``(head, embedding)`` split over the vocabulary, or None.
    """

    section = "tensor_parallel"

    def __init__(self) -> None:
        self.sp_params: list[Any] = []
        self.attention: list[str] = []
        self.vocab: tuple[str, str | None] | None = None
        self.group: Any = None
        self.unsharded: nn.Module | None = None
        self.eager_units: list[tuple[str, ...]] = []
        self.eager_required: list[str] = []
        self.sp_hooks: list[Any] = []  # sequence parallelism's hooks on pipeline stages

    def setup(self, ctx: RuntimeContext) -> None:
        layout = ctx.layout
        if layout.tp == 1:
            return
        assert ctx.groups is not None  # tp > 1 passed the world-size check: distributed
        g, r, tp = ctx.groups.tp_group, ctx.groups.tp_rank, layout.tp
        stage = _my_stage(ctx)
        self.group = g
        layers = ctx.model_ir().layers
        if layout.pp > 1:  # the stage handler traces the model as it was before sharding
            self.unsharded = copy.deepcopy(ctx.model)
        vocab = _vocab_to_split(ctx, [x.name for x in layers])
        attention = {} if _controller_on(ctx) else attention_modules(ctx.model)
        shard_model(ctx.model, layers, ctx.plan.tensor_parallel, g, r, tp, stage=stage,
                    split_elsewhere={f"{a}.{n}" for a, p in attention.items() for n in p.linears})
        if _controller_on(ctx):
            if layout.sequence_parallel and r == 0:
                warnings.warn("the plan asks for sequence parallelism with the TP resizing "
                              "controller, which resizes the MLP shards only: attention, "
                              "vocabulary and sequence stay unsplit (activations and their "
                              "memory as without sequence parallelism); re-plan with --no-sp "
                              "to match the prediction", RuntimeWarning, stacklevel=2)
            return
        planned = _planned_sizes(ctx, g, r, tp, stage)
        for name, parts in sorted(attention.items()):
            if layout.sequence_parallel and (parts.nested or parts.layer):
                if r == 0:
                    how = ("keeps its q/k/v and output projections in different modules (HF "
                           "BERT)" if parts.nested else "is a whole layer (hetplan's "
                           "MegatronBlock)")
                    warnings.warn(f"sequence parallelism: attention module {name!r} {how}, "
                                  "which the runtime splits without sequence parallelism "
                                  "only: it stays replicated on every TP rank",
                                  RuntimeWarning, stacklevel=2)
                continue
            if shard_attention(ctx.model, name, g, r, tp, planned.get(f"{name}.{parts.out}"),
                               sp=layout.sequence_parallel and layout.pp == 1):
                self.attention.append(name)
        self.vocab = vocab
        if self.vocab is not None:
            ctx.loss_fn = shard_vocab(ctx.model, self.vocab[0], self.vocab[1], g, r, tp,
                                      ctx.loss_fn)
        if layout.sequence_parallel and layout.pp == 1:
            self.sp_params = _sequence_parallel(ctx, g, r, tp, self.vocab, hooks=[])
        if layout.pp > 1:  # sequence parallelism: per stage, once its layers run sharded
            self.eager_units, self.eager_required = _eager_units(
                ctx.model, [x.name for x in layers], self.attention, self.vocab,
                layout.sequence_parallel)

    def sequence_parallel_stages(self, ctx: RuntimeContext, stages: set[int]) -> None:
        """Turn sequence parallelism on for this rank's pipeline stages ``stages`` (their
        layers run as the model's own sharded modules; the stage handler calls this after
        tracing, and again when re-balancing rebuilt the stages: the previous regions are
        undone first, the new ones come from ``ctx.plan.stages``)."""
        assert ctx.groups is not None
        self._undo_stage_sequence_parallel(ctx)
        self.sp_params = _sequence_parallel(ctx, self.group, ctx.groups.tp_rank,
                                            ctx.layout.tp, self.vocab, stages,
                                            hooks=self.sp_hooks)

    def _undo_stage_sequence_parallel(self, ctx: RuntimeContext) -> None:
        """Remove the stages' sequence-parallel hooks and modes (a region of the layers a
        stage held before re-balancing would scatter the sequence twice)."""
        if not self.sp_hooks:
            return
        for h in self.sp_hooks:
            h.remove()
        self.sp_hooks = []
        for m in ctx.model.modules():
            if isinstance(m, ColumnParallelLinear | RowParallelLinear):
                m.sp_mode = ""

    def after_backward(self, ctx: RuntimeContext) -> None:
        """Sum the sequence-parallel parameters' gradients over the TP group; with data
        parallelism below ZeRO-2 also average them over the data-parallel group here (the
        gradient-sync handler leaves them out: it flattens a bucket when backward completes
        it, before this sum, and would write the unsummed values back)."""
        average = dp_averages_sp_params(ctx)
        if average and self.sp_params:
            _quiet_grad_sync_thread(ctx)
        for p in self.sp_params:
            if p.grad is not None:
                # under ZeRO-3 the gradient is FSDP's shard (a DTensor over the DP group),
                # the same rows on every TP rank: sum the local shards
                dist.all_reduce(getattr(p.grad, "to_local", lambda: p.grad)(), group=self.group)
                if average:
                    assert ctx.groups is not None
                    dist.all_reduce(p.grad, group=ctx.groups.dp_group)
                    p.grad.div_(ctx.layout.dp)

    def close(self, ctx: RuntimeContext) -> None:
        self.sp_params, self.group, self.unsharded, self.sp_hooks = [], None, None, []


def _quiet_grad_sync_thread(ctx: RuntimeContext) -> None:
    """Wait until the gradient-sync worker thread (compressed or hierarchical paths) has
    finished what backward handed it, before this handler's blocking all-reduces on the
    data-parallel group: two threads issuing collectives on one gloo group can pair them
    differently on different ranks (``hetplan.runtime.grad_sync``'s module docstring)."""
    from hetplan.runtime.grad_sync import GradSync

    for h in ctx.handlers:  # the gradient-sync handler's path (no import of that handler)
        sync = getattr(h, "sync", None)
        if isinstance(sync, GradSync):
            sync.wait_submitted()


def dp_averages_sp_params(ctx: RuntimeContext) -> bool:
    """Whether the TP handler (not the gradient path) averages the sequence-parallel
    parameters' gradients over the data-parallel group: ``dp > 1`` below ZeRO-2 (ZeRO-2
    reduce-scatters them after this handler's sum) and without SDPipe's local gradients."""
    gs = ctx.plan.group_sync
    return (ctx.layout.dp > 1 and ctx.layout.zero_stage < 2 and ctx.groups is not None
            and not (gs is not None and gs.policy == "sdpipe"))


def _my_stage(ctx: RuntimeContext) -> int | None:
    assert ctx.groups is not None
    if ctx.layout.pp == 1:
        return None
    mine = [s.index for s in ctx.plan.stages if ctx.groups.rank in s.ranks]
    return mine[0] if len(mine) == 1 else None


def _controller_on(ctx: RuntimeContext) -> bool:
    tp = ctx.plan.tensor_parallel
    return (tp is not None and tp.controller.variant != "off") or ctx.straggler is not None


def _planned_sizes(ctx: RuntimeContext, group: Any, rank: int, tp: int,
                   stage: int | None) -> dict[str, tuple[int, ...]]:
    found = _find_group(ctx.plan.tensor_parallel, group, rank, tp, stage)
    return {s.name: tuple(s.shard_sizes) for s in found.linears} if found is not None else {}


def vocab_mode(ctx: RuntimeContext) -> str:
    """The plan's ``cost_settings.vocab_parallel`` (``unstated`` for a plan without cost
    settings, written before the plan stated it)."""
    cs = ctx.plan.cost_settings
    return cs.vocab_parallel if cs is not None else "unstated"


def _vocab_to_split(ctx: RuntimeContext, layer_names: list[str]) -> tuple[str, str | None] | None:
    """``(head, embedding)`` to split by vocabulary as the plan says (see
    :data:`~hetplan.ir.plan_sections.VocabParallel`), or None: ``whole`` never splits;
    ``split`` splits, and refuses the plan where the model has no ``V x h`` embedding pair
    or the resizing controller (or an emulated straggler) keeps the vocabulary whole;
    ``unstated`` (an older plan) splits where the model has the pair and no controller runs,
    as the runtime always did."""
    mode = vocab_mode(ctx)
    if mode == "whole":
        return None
    pair = _vocab_pair(ctx.model, layer_names)
    if mode == "unstated":
        return None if _controller_on(ctx) else pair
    fix = ("re-plan (`hetplan plan` states 'split' only where the runtime can split), or "
           "compile with vocab_parallel=False")
    if pair is None:
        raise SpecError("cost_settings.vocab_parallel: the plan asks for a vocabulary-parallel "
                        f"LM head (tp={ctx.layout.tp}), but the model's last layer is not a "
                        "linear beside a V x h token embedding, the pair the runtime splits; "
                        + fix)
    if _controller_on(ctx):
        why = ("the TP resizing controller resizes the MLP shards only"
               if ctx.straggler is None else "an emulated straggler times the MLP shards only")
        raise SpecError("cost_settings.vocab_parallel: the plan asks for a vocabulary-parallel "
                        f"LM head, but {why} and keeps the vocabulary whole; " + fix)
    return pair


def _vocab_pair(model: nn.Module, layer_names: list[str]) -> tuple[str, str | None] | None:
    """(LM head, token embedding or None): the last layer when it is a linear whose outputs
    are the rows of an ``nn.Embedding`` of the model (or, without one, any linear last
    layer with more outputs than inputs)."""
    if not layer_names:
        return None
    head = layer_names[-1].split("@")[0]
    try:
        lin = model.get_submodule(head)
    except AttributeError:
        return None
    if not isinstance(lin, nn.Linear):
        return None
    embs = [n for n, m in model.named_modules() if isinstance(m, nn.Embedding)
            and m.num_embeddings == lin.out_features and m.embedding_dim == lin.in_features]
    tied = [n for n in embs if model.get_submodule(n).weight is lin.weight]
    if tied or embs:
        return head, (tied or embs)[0]
    return None


def attention_modules_split(model: nn.Module) -> list[str]:
    """Names of the attention modules split by heads."""
    return [n for n, m in model.named_modules() if is_split_attention(m)]


def _holds_shards(model: nn.Module, layer: str) -> bool:
    if not layer:
        return False
    return any(isinstance(m, ColumnParallelLinear | RowParallelLinear | VocabParallelEmbedding)
               for m in model.get_submodule(layer).modules())


def _eager_units(model: nn.Module, layer_names: list[str], attention: list[str],
                 vocab: tuple[str, str | None] | None,
                 sp: bool) -> tuple[list[tuple[str, ...]], list[str]]:
    """What traced pipeline stages must run as the sharded modules themselves
    (:func:`~hetplan.runtime.pipeline.use_eager_layers`), and which of those must: with
    sequence parallelism every layer holding a shard (its hooks scatter and gather the
    sequence), else each attention module, each MLP pair's linears, the vocabulary's head
    and embedding (required: the loss reads the head's split logits)."""
    vocab_names = [n for n in (vocab or ()) if n]
    layers: list[tuple[str, ...]] = []
    if sp:  # whole layers first (their hooks slice the sequence), else their parts
        layers = [(n,) for n in layer_names if "@" not in n and _holds_shards(model, n)
                  and n not in vocab_names]
    pairs: dict[str, list[str]] = {}
    for name, m in model.named_modules():
        if (isinstance(m, ColumnParallelLinear | RowParallelLinear) and name not in vocab_names
                and not any(name.startswith(a + ".") for a in attention)):
            pairs.setdefault(name.rpartition(".")[0], []).append(name)
    units = [(a,) for a in attention] + [tuple(v) for _, v in sorted(pairs.items())]
    return layers + units + [(n,) for n in vocab_names], vocab_names


def _sequence_parallel(ctx: RuntimeContext, group: Any, rank: int, tp: int,
                       vocab_pair: tuple[str, str | None] | None,
                       stages: set[int] | None = None, *, hooks: list[Any]) -> list[Any]:
    """Hooks sequence parallelism on between the first and last layer holding a sharded
    linear (other than the vocabulary's), per pipeline stage of ``ctx.plan.stages``;
    switches their MLP linears to the sequence-parallel collectives; the parameters whose
    gradients must be summed. The hooks' handles are appended to ``hooks``."""
    model = ctx.model
    all_names = [x.name for x in ctx.model_ir().layers]
    names = [n for n in all_names if "@" not in n]
    vocab = {n for n in (vocab_pair or ()) if n}

    def sharded(layer: str) -> bool:
        if layer in vocab or not layer:
            return False
        return any(isinstance(m, ColumnParallelLinear | RowParallelLinear)
                   for m in model.get_submodule(layer).modules())

    # one region per pipeline stage: stages exchange the whole sequence
    per_stage = ([[n for n in all_names[s.first_layer:s.last_layer + 1] if n in names]
                  for s in sorted(ctx.plan.stages, key=lambda s: s.index)
                  if stages is None or s.index in stages]
                 if ctx.layout.pp > 1 else [names])
    attention = set(attention_modules_split(model))
    out: list[Any] = []
    for stage_names in per_stage:
        region = [n for n in stage_names if sharded(n)]
        if not region:
            continue
        first, last = stage_names.index(region[0]), stage_names.index(region[-1])
        inside = stage_names[first:last + 1]
        for lay in inside:
            for mname, m in model.get_submodule(lay).named_modules(prefix=lay):
                if mname in attention and ctx.layout.pp > 1:
                    hooks += attention_sequence_parallel(m, rank, tp, group)
            for m in model.get_submodule(lay).modules():
                if isinstance(m, ColumnParallelLinear) and not m.sp_mode:
                    m.sp_mode = "gather"
                elif isinstance(m, RowParallelLinear) and not m.sp_mode:
                    m.sp_mode = "scatter"
        hooks += sequence_parallel(model, region[0], region[-1], group, rank, tp)
        out += sp_replicated_params(model, inside)
    return out


class ResizingHandler(Handler):
    """Runs the heterogeneous-TP resizing controller after every step (``tp > 1``).

    Attributes:
        clock: times the sharded linears' matmuls (None: nothing to time).
        controller: the controller (None: variant ``off``, or no TP).
    """

    section = "tensor_parallel.controller"

    def __init__(self) -> None:
        self.clock: Clock | None = None
        self.controller: ResizingRuntime | None = None

    def setup(self, ctx: RuntimeContext) -> None:
        if ctx.layout.tp == 1:
            return
        assert ctx.groups is not None
        self.clock, self.controller = attach_resizing(
            ctx.model, ctx.plan.tensor_parallel, ctx.groups.tp_group, ctx.groups.tp_rank,
            ctx.layout.tp, ctx.straggler)

    def after_step(self, ctx: RuntimeContext) -> None:
        assert ctx.last_times is not None
        end_iteration(self.clock, self.controller, ctx.last_times.compute_s)
