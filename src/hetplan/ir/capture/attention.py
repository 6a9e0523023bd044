"""Attention modules and their head structure, read off module attributes (no tracing).

One detector for the two places that need it: capture records, on each projection of an
attention module, the features a tensor-parallel split of it must keep together
(:attr:`~hetplan.ir.model.LinearInfo.split_unit`, :func:`split_units`), so the planner asks
for whole heads; the runtime (:mod:`hetplan.runtime.megatron`) splits the same modules by
heads. Three layouts are recognised:

* **fused**: a module with a head count (``n_heads``, ``num_heads``, ...), ``head_dim``, a
  fused QKV projection (``in → 3·heads·head_dim``: GPT-2's ``c_attn``) and an output
  projection (``heads·head_dim → out``), of a class known to lay the projection out as
  ``[Q | K | V]`` thirds (HF GPT-2, hetplan's ``gpt-test``). Fused projections interleaved
  per head (HF Bloom, GPTBigCode) are not found: their modules stay whole;
* **separate**: a module with ``head_dim`` (or ``attention_head_size``) and separate query,
  key and value projections (``q_proj``/``k_proj``/``v_proj`` or ``query``/``key``/``value``)
  beside its output projection (``o_proj``/``out_proj``): HF Llama, Mistral, Mixtral, Qwen2,
  OPT and ViT; fewer key/value heads than query heads is grouped-query attention. T5's
  attention (a relative position bias per head) is not one: it is not split;
* **nested**: HF BERT's (RoBERTa's) ``self.query/key/value`` and ``output.dense``, in two
  submodules of the attention module.

Shapes are read from the weights, so a model on ``meta`` (capture's clone) is detected as
the live one is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "AttentionParts",
    "HEAD_COUNT",
    "KV_HEAD_COUNT",
    "WIDTH",
    "attention_modules",
    "attention_parts",
    "linear_children",
    "split_units",
    "weight",
    "weight_out_in",
]

#: Head-count attributes of an attention module, in the order they are looked up.
HEAD_COUNT = ("n_heads", "num_heads", "n_head", "num_attention_heads")
#: Key/value head-count attributes (grouped-query attention).
KV_HEAD_COUNT = ("num_key_value_heads", "n_kv_heads", "num_kv_heads")
#: Width attributes (``heads · head_dim``) an attention's forward may read.
WIDTH = ("dim", "split_size", "all_head_size", "inner_dim")
#: Head-size attributes of an attention module with separate q/k/v projections.
_HEAD_DIM = ("head_dim", "attention_head_size")
#: Child names of separate query, key, value and output projections.
_Q, _K, _V, _O = ("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value"), ("o_proj",
                                                                               "out_proj")
#: Attributes of attention modules with separate projections that are not split (T5's
#: relative position bias per head).
_NOT_SPLIT = ("has_relative_attention_bias", "relative_attention_bias")
#: (module, class) of the attention modules whose fused QKV projection (child name, class
#: name) computes ``[Q | K | V]`` thirds (``split(width, dim=-1)``, then heads of each),
#: with the output projection's name where the module holds other linears of that input
#: width: HF GPT-2's and hetplan's own (the zoo's ``gpt-test``), and hetplan's
#: ``MegatronBlock`` (``megatron-gpt-test``), a whole layer whose MLP's ``fc1`` also reads
#: ``dim`` features; its forward reads the width as ``dim`` (rewritten to the local one).
_FUSED_THIRDS: dict[tuple[str, str], tuple[str, str, str | None]] = {
    ("transformers.models.gpt2.modeling_gpt2", "GPT2Attention"): ("c_attn", "Conv1D", None),
    ("hetplan.models", "CausalSelfAttention"): ("qkv", "Linear", None),
    ("hetplan.models", "MegatronBlock"): ("qkv", "Linear", "out_proj"),
}


def weight(linear: nn.Module) -> torch.Tensor:
    """The 2-D weight of an ``nn.Linear`` or HF ``Conv1D``."""
    w = getattr(linear, "weight", None)
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"expected nn.Linear or Conv1D, got {type(linear).__name__}")
    return w


def weight_out_in(linear: nn.Module) -> tuple[int, int]:
    """(out_features, in_features) whatever the storage layout."""
    w = weight(linear)
    if isinstance(linear, nn.Linear):
        return int(w.shape[0]), int(w.shape[1])
    return int(w.shape[1]), int(w.shape[0])  # HF Conv1D stores [in, out]


def linear_children(mod: nn.Module) -> list[tuple[str, nn.Module]]:
    """The direct children of ``mod`` that are ``nn.Linear`` or HF ``Conv1D``."""
    return [(n, c) for n, c in mod.named_children()
            if isinstance(getattr(c, "weight", None), torch.Tensor) and weight(c).dim() == 2
            and (isinstance(c, nn.Linear) or type(c).__name__ == "Conv1D")]


@dataclass(frozen=True)
class AttentionParts:
    """The projections and head structure of one attention module.

    Attributes:
        qkv: the fused QKV projection ``(name,)``, or the separate ``(q, k, v)`` projections,
            as paths below the module (BERT/ViT: ``("self.query", ...)``).
        out: the output projection's path below the module.
        heads: query heads.
        kv_heads: key/value heads (fewer than ``heads`` with grouped-query attention; a split
            keeps whole groups).
        head_dim: features per head.
        attr: the head-count attribute, or None where the forward reads none (HF Llama:
            ``view(..., -1, head_dim)``).
        layer: the module is a whole layer (its input is the residual stream, and it holds
            the MLP too: hetplan's ``MegatronBlock``), so sequence parallelism cannot gather
            the sequence at its input as it does for an attention module's.
    """

    qkv: tuple[str, ...]
    out: str
    heads: int
    kv_heads: int
    head_dim: int
    attr: str | None = None
    layer: bool = False

    @property
    def fused(self) -> bool:
        """Whether Q, K and V come out of one projection."""
        return len(self.qkv) == 1

    @property
    def nested(self) -> bool:
        """Whether the projections live in submodules (HF BERT's ``self`` and ``output``)."""
        return "." in self.qkv[0]

    @property
    def linears(self) -> tuple[str, ...]:
        """Every projection's path below the module."""
        return (*self.qkv, self.out)


def attention_parts(mod: nn.Module) -> AttentionParts | None:
    """The parts of attention module ``mod`` (any of the three layouts), else None."""
    return _fused_parts(mod) or _separate_parts(mod) or _nested_parts(mod)


def _fused_parts(mod: nn.Module) -> AttentionParts | None:
    """A fused QKV projection whose output is known to be ``[Q | K | V]`` thirds, each
    ``heads · head_dim`` wide (:data:`_FUSED_THIRDS`). Other fused layouts are not: HF
    Bloom's ``query_key_value`` and GPTBigCode's ``c_attn`` (multi-head) interleave Q, K and
    V per head, so a split by thirds would hand a rank other heads' rows: None, and the
    module stays replicated."""
    child = _FUSED_THIRDS.get((type(mod).__module__, type(mod).__qualname__))
    attr = next((a for a in HEAD_COUNT if isinstance(getattr(mod, a, None), int)), None)
    head_dim = getattr(mod, "head_dim", None)
    if child is None or attr is None or not isinstance(head_dim, int):
        return None
    heads: int = getattr(mod, attr)
    width = heads * head_dim
    lins = linear_children(mod)
    fused = [n for n, c in lins if weight_out_in(c)[0] == 3 * width]
    out = [n for n, c in lins if weight_out_in(c)[1] == width and n not in fused
           and child[2] in (None, n)]
    if fused != [child[0]] or type(getattr(mod, child[0])).__name__ != child[1] or len(out) != 1:
        return None
    return AttentionParts((fused[0],), out[0], heads, heads, head_dim, attr,
                          layer=child[2] is not None)


def _child(mod: nn.Module, names: Sequence[str]) -> str | None:
    found = [n for n in names if isinstance(getattr(mod, n, None), nn.Linear)]
    return found[0] if len(found) == 1 else None


def _separate_parts(mod: nn.Module) -> AttentionParts | None:
    """Separate q/k/v projections and an output projection, as children of ``mod`` (HF
    Llama, Mistral, Mixtral, OPT, ViT, ...). T5's attention (a relative position bias per
    head) is not split: None."""
    head_dim = next((getattr(mod, a) for a in _HEAD_DIM
                     if isinstance(getattr(mod, a, None), int)), None)
    if head_dim is None or head_dim <= 0 or any(hasattr(mod, a) for a in _NOT_SPLIT):
        return None
    names = [_child(mod, c) for c in (_Q, _K, _V, _O)]
    if any(n is None for n in names):
        return None
    q, k, v, o = (getattr(mod, str(n)) for n in names)
    width, kv_width = q.out_features, k.out_features
    if (v.out_features != kv_width or o.in_features != width or width % head_dim
            or kv_width % head_dim or not kv_width
            or (width // head_dim) % (kv_width // head_dim)
            or len({q.in_features, k.in_features, v.in_features}) != 1):
        return None
    heads = width // head_dim
    attr = next((a for a in HEAD_COUNT if getattr(mod, a, None) == heads), None)
    return AttentionParts((str(names[0]), str(names[1]), str(names[2])), str(names[3]),
                          heads, kv_width // head_dim, head_dim, attr)


def _nested_parts(mod: nn.Module) -> AttentionParts | None:
    """HF BERT's layout: ``self.query/key/value`` (with ``num_attention_heads`` and
    ``attention_head_size``) and the output projection ``output.dense``, in sibling modules
    of ``mod``."""
    inner, out = getattr(mod, "self", None), getattr(mod, "output", None)
    dense = getattr(out, "dense", None)
    if not isinstance(inner, nn.Module) or not isinstance(dense, nn.Linear):
        return None
    head_dim = getattr(inner, "attention_head_size", None)
    heads = getattr(inner, "num_attention_heads", None)
    if not isinstance(head_dim, int) or not isinstance(heads, int) or head_dim <= 0:
        return None
    names = [_child(inner, c) for c in (_Q, _K, _V)]
    width = heads * head_dim
    if (any(n is None for n in names) or dense.in_features != width
            or any(getattr(inner, str(n)).out_features != width for n in names)):
        return None
    return AttentionParts(tuple(f"self.{n}" for n in names), "output.dense", heads, heads,
                          head_dim, "num_attention_heads")


def attention_modules(model: nn.Module) -> dict[str, AttentionParts]:
    """Qualified name → :func:`attention_parts` of every attention module of ``model``."""
    out = {}
    for name, mod in model.named_modules():
        parts = attention_parts(mod)
        if parts is not None:
            out[name] = parts
    return out


def split_units(parts: AttentionParts) -> dict[str, int]:
    """Path below the module → the features a tensor-parallel split of that projection must
    keep together, along its split dimension (output features of q/k/v, per part of a
    fused QKV projection; input features of the output projection).

    A rank keeps whole heads, and with grouped-query attention whole groups (a key/value
    head and the ``heads // kv_heads`` query heads that use it): the query and output
    projections in units of ``heads // kv_heads · head_dim`` features, the key and value
    projections in units of ``head_dim`` (one key/value head per group). Without GQA every
    unit is ``head_dim``.
    """
    group = parts.heads // parts.kv_heads * parts.head_dim
    if parts.fused:
        return {parts.qkv[0]: parts.head_dim, parts.out: parts.head_dim}
    q, k, v = parts.qkv
    return {q: group, k: parts.head_dim, v: parts.head_dim, parts.out: group}

