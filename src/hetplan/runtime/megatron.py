"""Megatron tensor parallelism beyond MLP pairs: attention by heads, the vocabulary-parallel
embedding and LM head with a parallel cross-entropy, and sequence parallelism.

:func:`~hetplan.runtime.tensor_parallel.shard_model` splits MLP pairs; this module splits the
rest of a transformer, in place, on the same uneven-shard linears
(:class:`~hetplan.runtime.tensor_parallel.ColumnParallelLinear` / ``RowParallelLinear``):

* **Attention** (:func:`shard_attention`, the modules :func:`attention_modules` finds: the
  detector in :mod:`hetplan.ir.capture.attention`, which capture also runs to record each
  projection's head unit for the planner): either a module with a head count
  (``n_heads``, ``num_heads``, ...), ``head_dim``, a fused QKV projection
  (``in → 3·heads·head_dim``, of a class known to lay it out as ``[Q | K | V]`` thirds: HF
  GPT-2's ``c_attn``, the zoo's ``gpt-test``; Bloom's and GPTBigCode's, interleaved per
  head, are not split) and an output projection (``heads·head_dim → out``); or a module
  with ``head_dim`` and separate query, key and value projections (``q_proj``/``k_proj``/
  ``v_proj`` or ``query``/``key``/``value``) beside its output projection
  (``o_proj``/``out_proj``): HF Llama, Mistral, Mixtral, Qwen2, OPT and ViT; or HF BERT's
  (RoBERTa's) layout, ``self.query/key/value`` and ``output.dense`` in two submodules
  (split without sequence parallelism only: with it the TP handler keeps it replicated,
  with a warning). Each rank keeps whole heads: the Q, K and V rows of its heads (one
  :class:`FusedColumnParallelLinear`, or three column-parallel linears) and the matching input
  columns of the output projection (a row-parallel linear). With grouped-query attention
  (fewer key/value heads than query heads) a rank keeps whole groups, a key/value head and
  the query heads that use it, so ``num_key_value_groups`` stays as it is
  (:func:`group_shards`). The module's head-count and width attributes are rewritten to the
  local ones (forwards that ``view(..., -1, head_dim)`` read none), so its own forward
  computes its heads only. The heads per rank come from the plan (the output projection's
  ``shard_sizes`` in features, a multiple of ``head_dim``, of a group's query features with
  GQA), else an even split (the first ranks get the remainder). Where that cannot give every
  rank whole heads (groups) — a split inside one, or a rank left none — a fused QKV module is
  refused (``SpecError`` naming the module: only a hand edit asks for it), and separate
  q/k/v projections stay replicated, with a warning (:func:`_keep_replicated`: plans written
  before capture recorded head units, or edited by hand, may ask for such sizes, and they
  ran replicated before these modules were split; ``tp-resizing`` now gives attention pairs
  whole heads, or leaves them even). Not split, so replicated on every TP rank, with
  the runtime's warning where the plan lists them: T5's attention (a relative position bias
  per head).
* **Vocabulary** (:func:`shard_vocab`): the token embedding whose rows are the LM head's
  outputs is split by rows (:class:`VocabParallelEmbedding`: a rank looks up the ids in its
  range, the partial embeddings are summed), the head by output features; a tied
  embedding/head stays tied (one local parameter), every lookup of the table is the same
  vocabulary-parallel embedding (HF T5's ``encoder.embed_tokens`` and
  ``decoder.embed_tokens`` share ``shared``'s weight), and any other alias of a replaced
  module's parameter holds the local shard (HF BERT's ``cls.predictions.bias`` is its
  decoder's bias: :func:`~hetplan.runtime.tensor_parallel.replace_module`, which every split
  here uses, refuses to hand a shard to a linear or embedding left whole). The head's local
  logits go to :func:`vocab_parallel_cross_entropy` (never gathered) when the runtime's loss
  is the token cross-entropy — checked on a probe (:func:`is_token_cross_entropy`); with any
  other loss the logits are gathered first (:class:`GatherLogits`) and the given loss runs
  on them.
* **Sequence parallelism** (:func:`sequence_parallel`): between the first and the last
  sharded block the residual stream holds this rank's slice of the sequence (dim 1,
  batch-first), so layer norms, dropouts and residual adds run on ``1/tp`` of the tokens. A
  column linear (MLP) or an attention module all-gathers the sequence at its input; a row
  linear reduce-scatters its output instead of all-reducing it. The parameters the slices
  share (norms, row biases) get partial gradients, summed over the TP group after backward
  (:func:`sp_replicated_params`). Uneven sequence slices work (the first ranks get the
  remainder): the collectives are :mod:`~hetplan.runtime.tp_comm`'s, all of them
  ``all_reduce`` of zero-padded buffers; a reduce-scatter is an all-reduce and a slice.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hetplan.algorithms.skewed_shards import even_shards
from hetplan.errors import SpecError
from hetplan.ir.capture.attention import (
    HEAD_COUNT,
    KV_HEAD_COUNT,
    WIDTH,
    AttentionParts,
    attention_modules,
    attention_parts,
    weight,
    weight_out_in,
)
from hetplan.runtime.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    replace_module,
    unsharded,
)
from hetplan.runtime.tp_comm import (
    SeqState,
    all_reduce_sum,
    gather_seq,
    gather_shards,
    reduce_from_tp,
    scatter_seq,
)

__all__ = [
    "AttentionParts",
    "FusedColumnParallelLinear",
    "GatherLogits",
    "VocabParallelEmbedding",
    "VocabParallelLoss",
    "attention_modules",
    "refused_head_splits",
    "attention_sequence_parallel",
    "group_shards",
    "head_shards",
    "is_split_attention",
    "is_token_cross_entropy",
    "sequence_parallel",
    "shard_attention",
    "shard_vocab",
    "sp_replicated_params",
    "vocab_parallel_cross_entropy",
]

# -- attention -----------------------------------------------------------------------------
class FusedColumnParallelLinear(ColumnParallelLinear):
    """A column-parallel fused projection of ``parts`` equal parts (Q, K, V): this rank keeps
    rows ``[start:end]`` of *every* part, so its heads get their own queries, keys and
    values. ``shard_sizes`` are per part; ``weight`` is ``[parts · local, in]``."""

    def __init__(self, in_features: int, out_features: int, shard_sizes: Sequence[int],
                 rank: int, group: Any = None, *, parts: int = 3, bias: bool = True,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 conv1d: bool = False) -> None:
        nn.Module.__init__(self)
        sizes = [int(s) for s in shard_sizes]
        if sum(sizes) * parts != out_features:
            raise ValueError(f"shard_sizes {sizes} per part × {parts} parts must sum to "
                             f"{out_features}")
        self.in_features, self.out_features, self.parts = in_features, out_features, parts
        self.shard_sizes, self.tp_rank, self.tp_size = tuple(sizes), rank, len(sizes)
        self.group, self.conv1d = group, conv1d
        self.start = sum(sizes[:rank])
        self.end = self.start + sizes[rank]
        local = parts * sizes[rank]
        self.weight = nn.Parameter(torch.empty(local, in_features, dtype=dtype, device=device))
        self.bias: nn.Parameter | None
        if bias:
            self.bias = nn.Parameter(torch.empty(local, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_fused(cls, linear: nn.Module, shard_sizes: Sequence[int], rank: int,
                   group: Any = None, parts: int = 3) -> FusedColumnParallelLinear:
        """This rank's rows of every part of a full ``nn.Linear`` or HF ``Conv1D``."""
        w = weight(linear).detach()
        conv1d = not isinstance(linear, nn.Linear)
        w = w.t() if conv1d else w
        b = getattr(linear, "bias", None)
        mod = cls(w.shape[1], w.shape[0], shard_sizes, rank, group, parts=parts,
                  bias=isinstance(b, torch.Tensor), dtype=w.dtype, device=w.device,
                  conv1d=conv1d)
        part = w.shape[0] // parts
        rows = torch.cat([torch.arange(p * part + mod.start, p * part + mod.end, device=w.device)
                          for p in range(parts)])
        with torch.no_grad():
            mod.weight.copy_(w[rows])
            mod.weight.requires_grad_(weight(linear).requires_grad)
            if mod.bias is not None and isinstance(b, torch.Tensor):
                mod.bias.copy_(b.detach()[rows])
                mod.bias.requires_grad_(b.requires_grad)
        return mod

    def _gather_parts(self, local: torch.Tensor) -> torch.Tensor:
        n = self.end - self.start
        return torch.cat([gather_shards(local.narrow(0, p * n, n), self.shard_sizes,
                                        self.tp_rank, 0, self.group)
                          for p in range(self.parts)])

    def gather_weight(self, grad: bool = False, source_layout: bool = True) -> torch.Tensor:
        full = self._gather_parts(unsharded(self.weight.grad if grad else self.weight,
                                            self.weight))
        return full.t() if (self.conv1d and source_layout) else full

    def gather_bias(self, grad: bool = False) -> torch.Tensor | None:
        if self.bias is None:
            return None
        return self._gather_parts(unsharded(self.bias.grad if grad else self.bias, self.bias))


def head_shards(heads: int, head_dim: int, tp: int,
                planned: Sequence[int] | None = None) -> tuple[int, ...]:
    """Heads per rank: the plan's feature shard sizes divided by ``head_dim`` (each must be a
    multiple of it), else an even split of the heads."""
    if planned is None:
        return tuple(even_shards(heads, tp))
    if len(planned) != tp or sum(planned) != heads * head_dim or any(
            s % head_dim for s in planned):
        raise ValueError(f"attention shard sizes {list(planned)} must be {tp} multiples of "
                         f"head_dim={head_dim} summing to {heads * head_dim} (whole heads)")
    return tuple(s // head_dim for s in planned)


def refused_head_splits(model: nn.Module) -> dict[str, int]:
    """The output projection (qualified name) of every attention module whose split inside a
    head the ranks refuse, with its ``head_dim``: the fused-QKV modules
    (:func:`shard_attention`), whose whole heads are whole key/value groups (one key/value
    head per query head). Separate q/k/v projections are left out, grouped-query attention
    included: sizes that split a head, or a key/value group (:func:`group_shards`), or
    leave a rank none, run that module replicated, with a warning, so the check must not
    refuse them. What ``hetplan run`` and ``validate --model`` hand the plan's model checks
    (:mod:`hetplan.ir.plan_tp_checks`, rule 5) before any rank starts."""
    return {f"{name}.{parts.out}": parts.head_dim
            for name, parts in attention_modules(model).items() if parts.fused}


def group_shards(heads: int, kv_heads: int, head_dim: int, tp: int,
                 planned: Sequence[int] | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(query heads, key/value heads) per rank for attention with ``kv_heads`` key/value
    heads (grouped-query attention when fewer than ``heads``): each rank keeps whole groups,
    a key/value head and the ``heads // kv_heads`` query heads that use it (at least one in
    an even split; the plan may leave a rank none). ``planned``: the plan's feature shard
    sizes of the output projection (multiples of a group's ``heads // kv_heads · head_dim``
    query features), else an even split of the groups (the first ranks get the remainder).

    Raises:
        ValueError: ``planned`` splits a group, or an even split leaves a rank no group.
    """
    per_group = heads // kv_heads
    if planned is None:
        groups = tuple(even_shards(kv_heads, tp))
    else:
        q = head_shards(heads, head_dim, tp, planned)
        if any(h % per_group for h in q):
            raise ValueError(f"attention shard sizes {list(planned)} must be multiples of "
                             f"{per_group * head_dim} features (whole groups of {per_group} "
                             f"query heads sharing a key/value head, head_dim={head_dim})")
        groups = tuple(h // per_group for h in q)
    if planned is None and min(groups) < 1:
        raise ValueError(f"attention with {kv_heads} key/value heads ({heads} query heads) "
                         f"cannot give each of {tp} ranks a whole head (group): split "
                         f"{list(groups)}")
    return tuple(g * per_group for g in groups), groups


def _local_attrs(mod: nn.Module, parts: AttentionParts, heads: int, kv_heads: int) -> None:
    """Rewrite the head-count and width attributes the forward may read to the local ones."""
    width = parts.heads * parts.head_dim
    for a in WIDTH:
        if getattr(mod, a, None) == width:
            setattr(mod, a, heads * parts.head_dim)
    for a in HEAD_COUNT:
        if getattr(mod, a, None) == parts.heads:
            setattr(mod, a, heads)
    for a in KV_HEAD_COUNT:
        if getattr(mod, a, None) == parts.kv_heads:
            setattr(mod, a, kv_heads)


def _keep_replicated(name: str, rank: int, why: str) -> None:
    """Warn (once, on TP rank 0) that attention module ``name`` with separate q/k/v
    projections stays replicated on every TP rank, and why. A plan from before capture
    recorded head units (``LinearInfo.split_unit``), or one edited by hand, may split a head
    or leave a rank none; the plan then runs as it did before these modules were split,
    attention whole on every rank, and the warning says the prediction (which divides the
    attention by tp) will be short of it."""
    if rank == 0:
        warnings.warn(f"tensor parallelism: attention module {name!r} cannot be split by whole "
                      f"heads: {why}; it stays replicated on every TP rank (the prediction "
                      "divides it by tp: expect the run slower; re-plan with a tp, or shard "
                      "sizes of its output projection, in whole heads to split it)",
                      RuntimeWarning, stacklevel=3)


def shard_attention(model: nn.Module, name: str, group: Any, rank: int, tp: int,
                    planned: Sequence[int] | None = None, *, sp: bool = False) -> bool:
    """Split attention module ``name`` of ``model`` by heads, in place (see module doc).
    Whether it was split: separate q/k/v projections that ``tp`` or the planned sizes cannot
    give every rank whole heads (groups) of, or that leave a rank none, stay replicated,
    with a warning (:func:`_keep_replicated`).

    Args:
        planned: the plan's shard sizes (features) for the output projection, or None.
        sp: sequence parallelism: gather the sequence at the module's input and
            reduce-scatter the output projection.

    Raises:
        ValueError: ``name`` is no attention module this module splits.
        SpecError: a fused QKV projection's ``planned`` sizes or ``tp`` cannot give every
            rank whole heads.
    """
    mod = model.get_submodule(name)
    parts = attention_parts(mod)
    if parts is None:
        raise ValueError(f"{name!r} is not an attention module with a fused QKV projection "
                         "or separate q/k/v projections")
    try:
        if parts.fused:
            per_rank = head_shards(parts.heads, parts.head_dim, tp, planned)
            kv = per_rank
        else:
            per_rank, kv = group_shards(parts.heads, parts.kv_heads, parts.head_dim, tp,
                                        planned)
    except ValueError as e:
        if not parts.fused:  # as before this split existed: older plans may ask for it
            _keep_replicated(name, rank, str(e))
            return False
        raise SpecError(f"tensor parallelism: attention module {name!r} cannot be split by "
                        f"heads over tp={tp}: {e}; re-plan with a tp (or shard sizes of "
                        f"{name}.{parts.out}) that gives every rank whole heads") from e
    if not parts.fused and 0 in per_rank:
        _keep_replicated(name, rank, f"the plan gives a rank no head (shard sizes "
                                     f"{list(planned or ())} of {name}.{parts.out})")
        return False
    feats = [h * parts.head_dim for h in per_rank]
    prefix = f"{name}." if name else ""  # the projections' paths in ``model``
    pending = {prefix + p for p in parts.linears}
    if parts.fused:
        fused = prefix + parts.qkv[0]
        replace_module(model, fused, FusedColumnParallelLinear.from_fused(
            model.get_submodule(fused), feats, rank, group), pending=pending)
    else:
        kv_feats = [h * parts.head_dim for h in kv]
        for path, sizes in zip(parts.qkv, (feats, kv_feats, kv_feats), strict=True):
            replace_module(model, prefix + path, ColumnParallelLinear.from_linear(
                mod.get_submodule(path), sizes, rank, group), pending=pending)
    replace_module(model, prefix + parts.out, RowParallelLinear.from_linear(
        mod.get_submodule(parts.out), feats, rank, group), pending=pending)
    holder = parts.qkv[0].rpartition(".")[0]  # the module whose forward reads the heads
    _local_attrs(mod.get_submodule(holder) if holder else mod, parts, per_rank[rank], kv[rank])
    setattr(mod, "hetplan_heads", per_rank[rank])  # marks the split module
    if sp:
        attention_sequence_parallel(mod, rank, tp, group)
    return True


def is_split_attention(mod: nn.Module) -> bool:
    """Whether :func:`shard_attention` split ``mod``."""
    return isinstance(getattr(mod, "hetplan_heads", None), int)


def attention_sequence_parallel(mod: nn.Module, rank: int, tp: int, group: Any) -> list[Any]:
    """Sequence parallelism for an attention module :func:`shard_attention` split: gather
    the sequence at the input of the module holding the q/k/v projections (BERT's
    ``attention.self``: its output projection adds the residual, which stays a slice),
    reduce-scatter its output projection. Returns the hook's handle (``.remove()`` undoes
    it, with the linears' ``sp_mode`` reset)."""
    holder = next((m for m in mod.modules()
                   if any(isinstance(c, ColumnParallelLinear) for c in m.children())), mod)
    for child in mod.modules():
        if isinstance(child, ColumnParallelLinear):
            child.sp_mode = "gathered"
        elif isinstance(child, RowParallelLinear):
            child.sp_mode = "scatter"
    return [holder.register_forward_pre_hook(_gather_input_hook(rank, tp, group),
                                             with_kwargs=True)]


# -- sequence parallelism ------------------------------------------------------------------
def _first_arg(args: tuple, kwargs: dict) -> tuple[torch.Tensor | None, str | None]:
    if args and isinstance(args[0], torch.Tensor):
        return args[0], None
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return kwargs["hidden_states"], "hidden_states"
    return None, None


def _replace_first(args: tuple, kwargs: dict, key: str | None,
                   x: torch.Tensor) -> tuple[tuple, dict]:
    if key is None:
        return (x, *args[1:]), kwargs
    return args, {**kwargs, key: x}


def _gather_input_hook(rank: int, tp: int, group: Any) -> Callable[..., Any]:
    def hook(_m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        x, key = _first_arg(args, kwargs)
        if x is None:
            return None
        full = gather_seq(x, rank, tp, SeqState.total, group, True)
        return _replace_first(args, kwargs, key, full)
    return hook


def sequence_parallel(model: nn.Module, first: str, last: str, group: Any, rank: int,
                      tp: int) -> list[Any]:
    """Scatter the residual stream along the sequence at the input of layer ``first`` and
    gather it at the output of layer ``last`` (in place, by forward hooks); the MLP column
    linears between them gather their input, the row linears reduce-scatter their output.
    Returns the two hooks' handles (re-balancing removes them before it moves the region)."""
    def scatter(_m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        x, key = _first_arg(args, kwargs)
        if x is None:
            return None
        SeqState.total = x.size(1)
        return _replace_first(args, kwargs, key, scatter_seq(x, rank, tp, group))

    def gather(_m: nn.Module, _args: Any, output: Any) -> Any:
        def full(t: torch.Tensor) -> torch.Tensor:
            return gather_seq(t, rank, tp, SeqState.total, group, False)
        if isinstance(output, torch.Tensor):
            return full(output)
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            return (full(output[0]), *output[1:])
        raise TypeError(f"sequence parallelism: layer {last!r} returns "
                        f"{type(output).__name__}, expected a tensor or a tuple starting "
                        "with one")

    return [model.get_submodule(first).register_forward_pre_hook(scatter, with_kwargs=True),
            model.get_submodule(last).register_forward_hook(gather)]


def sp_replicated_params(model: nn.Module, layers: Sequence[str]) -> list[nn.Parameter]:
    """Parameters of ``layers`` that every TP rank holds whole (norms, row biases): with
    sequence parallelism each rank's gradient covers its tokens only, so they are summed."""
    out: dict[int, nn.Parameter] = {}
    for lay in layers:
        for mod in model.get_submodule(lay).modules():
            sharded = isinstance(mod, ColumnParallelLinear | RowParallelLinear)
            for pname, p in mod.named_parameters(recurse=False):
                if sharded and not (pname == "bias" and isinstance(mod, RowParallelLinear)):
                    continue
                out[id(p)] = p
    return list(out.values())


# -- vocabulary ----------------------------------------------------------------------------
class VocabParallelEmbedding(nn.Module):
    """An ``nn.Embedding`` split by rows (uneven allowed): this rank holds rows
    ``[start:end]``, looks up the ids in that range (zeros elsewhere) and the partial
    embeddings are summed over the group (Megatron's ``g``). The padding row
    (``padding_idx``, HF OPT's) gets no gradient, as in the full embedding."""

    def __init__(self, emb: nn.Embedding, shard_sizes: Sequence[int], rank: int,
                 group: Any) -> None:
        super().__init__()
        sizes = [int(s) for s in shard_sizes]
        if sum(sizes) != emb.num_embeddings:
            raise ValueError(f"vocab shard sizes {sizes} must sum to {emb.num_embeddings}")
        self.shard_sizes, self.tp_rank, self.group = tuple(sizes), rank, group
        self.start = sum(sizes[:rank])
        self.end = self.start + sizes[rank]
        self.num_embeddings, self.embedding_dim = emb.num_embeddings, emb.embedding_dim
        pad = emb.padding_idx
        #: the embedding's ``padding_idx`` (its row gets no gradient) when this rank holds it
        self.padding_idx = (pad - self.start if pad is not None and self.start <= pad < self.end
                            else None)
        self.weight = nn.Parameter(emb.weight.detach()[self.start:self.end].clone(),
                                   requires_grad=emb.weight.requires_grad)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Maps token ids to embeddings [..., embedding_dim] (replicated)."""
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        y = F.embedding(local, self.weight, self.padding_idx).masked_fill(
            outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(y, self.group) if len(self.shard_sizes) > 1 else y

    def gather_weight(self, grad: bool = False, source_layout: bool = True) -> torch.Tensor:
        """The full table on every rank (a collective call)."""
        local = unsharded(self.weight.grad if grad else self.weight, self.weight)
        return gather_shards(local, self.shard_sizes, self.tp_rank, 0, self.group)


class _ParallelCE(torch.autograd.Function):
    """Per-token cross-entropy of logits split over the vocabulary (Megatron's
    ``vocab_parallel_cross_entropy``): max, target logit and sum of exponentials are reduced
    over the group; the gradient is ``softmax - onehot`` on this rank's columns."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, start: int,
                group: Any) -> torch.Tensor:
        x = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        m = x.max(dim=-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        x = x - m.unsqueeze(-1)
        n = x.size(-1)
        inside = (target >= start) & (target < start + n)
        idx = (target - start).masked_fill(~inside, 0)
        picked = x.gather(-1, idx.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
        all_reduce_sum(picked, group)
        e = x.exp()
        s = all_reduce_sum(e.sum(-1), group)
        softmax = e / s.unsqueeze(-1)
        ctx.save_for_backward(softmax, idx, inside)
        return torch.log(s) - picked

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, idx, inside = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, idx.unsqueeze(-1), -inside.to(g.dtype).unsqueeze(-1))
        return g * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, target: torch.Tensor,
                                 start: int, group: Any) -> torch.Tensor:
    """The mean token cross-entropy of logits whose vocabulary columns ``[start, start +
    local_logits.size(-1))`` live on this rank (a collective over ``group``)."""
    flat = local_logits.reshape(-1, local_logits.size(-1))
    return _ParallelCE.apply(flat, target.reshape(-1), start, group).mean()


class VocabParallelLoss:
    """The runtime's loss when the LM head is vocabulary-parallel: unwraps HF outputs
    (``.logits``, tuples) like the default loss, then :func:`vocab_parallel_cross_entropy`."""

    def __init__(self, start: int, group: Any) -> None:
        self.start, self.group = start, group

    def __call__(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        out = getattr(output, "logits", output)
        if isinstance(out, (tuple, list)):
            out = out[0]
        return vocab_parallel_cross_entropy(out, target, self.start, self.group)


def is_token_cross_entropy(loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]) -> bool:
    """Whether ``loss_fn(logits, ids)`` is the mean token cross-entropy, on a fixed probe
    (float64 logits [2, 3, 5], ids [2, 3]); any error means no."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 5, generator=g, dtype=torch.float64)  # host: a local probe
    ids = torch.randint(0, 5, (2, 3), generator=g)  # host: a local probe
    try:
        got = loss_fn(logits, ids)
    except Exception:  # noqa: BLE001 - a loss that cannot take logits is not this one
        return False
    want = F.cross_entropy(logits.reshape(-1, 5), ids.reshape(-1))
    return (isinstance(got, torch.Tensor) and got.dim() == 0
            and bool(torch.allclose(got.double(), want, rtol=1e-9, atol=1e-12)))


class GatherLogits(nn.Module):
    """Wraps a vocabulary-parallel head so that it returns the full logits (a loss other than
    the token cross-entropy needs them); backward keeps this rank's columns."""

    def __init__(self, head: ColumnParallelLinear) -> None:
        super().__init__()
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The head's full output [..., vocab]."""
        return _GatherCols.apply(self.head(x), self.head.shard_sizes, self.head.tp_rank,
                                 self.head.group)


class _GatherCols(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sizes: Sequence[int], rank: int,
                group: Any) -> torch.Tensor:
        ctx.sizes, ctx.rank = sizes, rank
        return gather_shards(x.contiguous(), sizes, rank, x.dim() - 1, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        start = sum(ctx.sizes[:ctx.rank])
        return grad.narrow(-1, start, ctx.sizes[ctx.rank]).contiguous(), None, None, None


def shard_vocab(model: nn.Module, head: str, embedding: str | None, group: Any, rank: int,
                tp: int, loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
                ) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """Split LM head ``head`` (by output features) and, when given, token embedding
    ``embedding`` (by rows) evenly over the vocabulary, in place; a tied pair stays tied, and
    any other attribute aliasing the head's (embedding's) parameters holds the local shard
    after it (HF BERT's ``cls.predictions.bias``). Every ``nn.Embedding`` of ``model`` on the
    embedding's weight (HF T5's ``encoder.embed_tokens`` and ``decoder.embed_tokens`` beside
    ``shared``) becomes the same :class:`VocabParallelEmbedding`. Returns the loss to train
    with (see module doc).

    Raises:
        SpecError: another module computes with the head's or the embedding's whole
            parameter (a linear tied to it, say): it would run on the local shard.
    """
    lin = model.get_submodule(head)
    vocab = weight_out_in(lin)[0]
    sizes = tuple(even_shards(vocab, tp))
    emb_mod = model.get_submodule(embedding) if embedding is not None else None
    if emb_mod is not None and not isinstance(emb_mod, nn.Embedding):
        raise TypeError(f"{embedding!r} is a {type(emb_mod).__name__}, not an nn.Embedding")
    tied = emb_mod is not None and emb_mod.weight is weight(lin)
    new_head = ColumnParallelLinear.from_linear(lin, sizes, rank, group)
    # every lookup of the table (T5: ``shared``, ``encoder.embed_tokens`` and
    # ``decoder.embed_tokens``, three modules on one weight) becomes vocabulary-parallel
    lookups = [] if emb_mod is None else [
        n for n, m in model.named_modules(remove_duplicate=False)
        if isinstance(m, nn.Embedding) and m.weight is emb_mod.weight]
    pending = {head, *lookups}
    if emb_mod is not None:
        emb = VocabParallelEmbedding(emb_mod, sizes, rank, group)
        for path in lookups:
            replace_module(model, path, emb, pending=pending)
        if tied:
            new_head.weight = emb.weight
    if is_token_cross_entropy(loss_fn):
        replace_module(model, head, new_head, pending=pending)
        return VocabParallelLoss(new_head.start, group)
    replace_module(model, head, GatherLogits(new_head), params_of=new_head, pending=pending)
    return loss_fn
