"""What a training engine's fused transformer-block kernels keep for backward.

The memory model (:mod:`hetplan.cost_models.memory`) prices a layer's activations from the
bytes the capture saw autograd keep (``LayerCost.act_*``). That is what the runtime keeps
when it runs the captured model as it is. A plan priced with ``fusion="fused"`` describes an
engine that runs each recognisable transformer block as its fused kernels instead
(Megatron-LM, Megatron-DeepSpeed, Transformer Engine: the same setting prices their kernel
time in :mod:`hetplan.cost_models.kernels`). Those kernels keep fewer tensors than an
eagerly decomposed block: a Hugging Face GPT-2 block keeps about ``60·s·b·h`` bytes at 16
bits (its tanh-GeLU is eight element-wise kernels, each saving its input), a Llama block
``52·s·b·h`` (its RMSNorm keeps fp32 copies, its causal mask is an input of every layer),
where Megatron-LM's fused block keeps the ``34·s·b·h`` of Korthikanti et al. 2022 (Table 2).

:func:`engine_layer` rewrites a block's ``act_*`` fields to what the fused kernels keep, per
token of the captured batch, from the block's shape (:func:`~.kernels.block_shape`: ``h``,
``f``, the key/value width ``kv``, gated MLP, dropout); ``e`` bytes per element of the
capture dtype, ``d = 1`` byte per mask element where the block has dropout:

======================================  =========================================  ==========
kept tensor                             bytes per token                            where
======================================  =========================================  ==========
two norm inputs, QKV and MLP inputs     ``4·h·e``                                  replicated
two residual dropout masks              ``2·h·d``                                  replicated
queries, keys, values                   ``(h + 2·kv)·e``                           TP split
the output projection's input           ``h·e``                                    TP split
MLP: GeLU input and down-proj input     ``2·f·e`` (gated: gate + up + down ``3·f·e``) TP split
scores, materialized attention          ``scores·(e + d·(e + 1))``                 core
scores, flash attention                 ``0`` (the kernel keeps its output, counted
                                        above, and a per-head statistic, not counted)
======================================  =========================================  ==========

For a GPT block (``kv = h``, ``f = 4h``, dropout, ``e = 2``) this is Korthikanti's
``s·b·h·(34 + 5·a·s/h)``: ``10`` replicated, ``24`` split, ``5·a·s/h`` in the core (tested
against the closed form on a captured Hugging Face GPT-2). Full recomputation keeps the
block's input, ``h·e`` per token (the captured input also counts the causal mask and
position tables a decomposed model passes to every layer; an engine's fused attention takes
neither). Layer norms' per-token statistics (``8`` bytes per token each) are left out, as
the paper does. A norm outside the blocks (the final norm) keeps its input only, as the
fused norm kernel does. Other layers that are not recognisable blocks keep their captured
bytes.

**The vocabulary** (:func:`vocab_layers`, :func:`tied_head_copy`). A language model's LM
head is the last layer, a ``head`` whose forward product is ``tokens x h -> V``. With a
vocabulary-parallel head (the ``vocab_parallel`` setting under ``tp > 1``; the runtime's
:func:`~hetplan.runtime.megatron.shard_vocab`, Megatron-LM's ``VocabParallelEmbedding`` and
column-parallel output layer) the head's weight and the token embedding whose rows are the
head's outputs (``V x h``) are split over the TP ranks: their parameter bytes count as
TP-split. A head whose weight is the token embedding's (tied: the capture gives the head no
parameters of its own) holds a copy of it on a pipeline stage without that embedding, with
its own gradients and optimizer state, as Megatron-LM and the runtime's pipeline keep tied
weights across stages (their gradients are summed between the two stages).
"""

from __future__ import annotations

from hetplan.cost_models.kernels import Attention, block_shape
from hetplan.ir.plan_sections import LayerCost
from hetplan.ir.vocab import lm_vocab, splits_vocabulary, vocab_table

__all__ = ["engine_layer", "splits_vocabulary", "vocab_layers", "tied_head_copy"]


def engine_layer(lay: LayerCost, tokens: int, capture_bytes: int,
                 attention: Attention) -> LayerCost:
    """``lay`` with its ``act_*`` fields as the engine's fused block kernels keep them (see
    the module docstring); ``lay`` itself when it is not a recognisable block.

    Args:
        lay: a captured layer.
        tokens: tokens of the captured batch (the capture's first input's elements).
        capture_bytes: bytes per element of the floating dtype the layer was captured in.
        attention: ``flash`` (the core keeps no scores) or ``materialized``.
    """
    if lay.kind == "norm" and lay.act_in_bytes and not lay.tp_pairs:
        return _fused_norm(lay)
    blk = block_shape(lay, tokens)
    if blk is None:
        return lay
    e, d = float(capture_bytes), 1.0 if blk.dropout else 0.0
    h, f = float(blk.hidden), float(blk.ffn)
    kv = blk.qk - h
    repl_float, repl_mask = 4.0 * h * e, 2.0 * h * d
    split_float = (h + 2.0 * kv + h) * e + (3.0 if blk.gated else 2.0) * f * e
    if attention == "materialized":
        core_float, core_mask = blk.scores * e * (1.0 + d), blk.scores * d
    else:
        core_float = core_mask = 0.0
    saved = repl_float + repl_mask + split_float + core_float + core_mask
    return lay.model_copy(update={
        "act_in_bytes": round(h * e * tokens),
        "act_saved_bytes": round(saved * tokens),
        "act_saved_nonfloat_bytes": round((repl_mask + core_mask) * tokens),
        "act_replicated_bytes": round((repl_float + repl_mask) * tokens),
        "act_replicated_nonfloat_bytes": round(repl_mask * tokens),
        "act_attn_core_bytes": round((core_float + core_mask) * tokens),
        "act_attn_core_nonfloat_bytes": round(core_mask * tokens),
    })


def _fused_norm(lay: LayerCost) -> LayerCost:
    """A norm layer outside the blocks (the final norm, an embedding norm) as the engine's
    fused kernel keeps it: its input (the per-token statistics left out, as for the blocks),
    outside the TP regions. A decomposed norm keeps more (a Hugging Face RMSNorm its fp32
    copies: three times the 16-bit input)."""
    return lay.model_copy(update={
        "act_saved_bytes": lay.act_in_bytes,
        "act_saved_nonfloat_bytes": 0,
        "act_replicated_bytes": lay.act_in_bytes,
        "act_replicated_nonfloat_bytes": 0,
        "act_attn_core_bytes": 0,
        "act_attn_core_nonfloat_bytes": 0,
    })


def vocab_layers(layers: tuple[LayerCost, ...], capture_bytes: int) -> tuple[LayerCost, ...]:
    """``layers`` with the LM head's and the vocabulary embedding's parameters TP-split
    (a vocabulary-parallel head, see the module docstring); ``layers`` when the model has
    no LM head or no ``V x h`` embedding beside it (the runtime's ``shard_vocab`` splits
    the pair only)."""
    vocab = lm_vocab(layers)
    if vocab is None or not splits_vocabulary(layers, capture_bytes):
        return layers  # the runtime splits a head only beside its vocabulary embedding
    return tuple(
        x.model_copy(update={"tp_split_bytes": x.param_bytes})
        if x.param_bytes and (x.kind == "head" or vocab_table(x, vocab, capture_bytes))
        else x
        for x in layers)


def tied_head_copy(layers: tuple[LayerCost, ...], capture_bytes: int,
                   vocab_parallel: bool) -> tuple[int, LayerCost] | None:
    """(index of the tied embedding, the head's copy of its weight as a layer of
    parameters) when the LM head's weight is tied to a token embedding of the model; None
    otherwise. The copy is TP-split when ``vocab_parallel``."""
    vocab = lm_vocab(layers)
    if vocab is None or layers[-1].param_bytes:
        return None
    table = next((k for k, x in enumerate(layers) if vocab_table(x, vocab, capture_bytes)),
                 None)
    if table is None:
        return None
    size = layers[table].param_bytes
    return table, LayerCost(name=f"{layers[-1].name} (tied copy)", kind="head",
                            param_bytes=size, tp_split_bytes=size if vocab_parallel else 0)
