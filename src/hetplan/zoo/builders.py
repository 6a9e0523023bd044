"""What a zoo entry is, and the parts entries are made of.

:class:`ZooEntry` describes one named model; the example-input factories make inputs of each
kind (see :mod:`hetplan.zoo` for the conventions); the Hugging Face builders construct a
``transformers`` model from a config typed in here (``transformers`` is imported when a
model is built, not when this module is imported).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

__all__ = [
    "ExampleInputs",
    "InputKind",
    "ZooEntry",
    "token_inputs",
    "seq2seq_inputs",
    "image_inputs",
    "feature_inputs",
    "hf",
    "gpt2",
    "bert",
    "llama2",
    "resnet",
]

ExampleInputs = tuple[tuple[Any, ...], dict[str, Any]]
"""``(args, kwargs)`` to call a model with: ``model(*args, **kwargs)``."""

InputKind = Literal["tokens", "seq2seq", "image", "features"]

_INPUT_SEED = 1234


@dataclass(frozen=True)
class ZooEntry:
    """One named model of the zoo.

    Attributes:
        name: the zoo name (lower case, dashes), e.g. ``"llama-7b"``.
        family: model family (``"gpt2"``, ``"llama"``, ``"custom"`` …).
        description: one line: what it is and where the config comes from.
        build: constructs the model on the current default device (use :func:`build`, which
            sets the device, dtype and seed).
        example_inputs: ``(batch, seq, *, device="meta", dtype=None) -> (args, kwargs)``;
            ``seq`` is ignored by vision and feature models.
        default_batch: batch size used when :func:`example_inputs` gets none.
        default_seq: sequence length used when :func:`example_inputs` gets none; ``None`` for
            models without a sequence axis.
        params_approx: human-readable parameter count (unique parameters), e.g. ``"6.74B"``.
        size: ``"full"`` for published full-size configs, ``"tiny"`` for test-sized models.
        input_kind: which input convention :func:`example_inputs` follows (see module doc).
        max_seq: the longest sequence the model takes: the rows of its learned position
            embeddings (a longer one indexes past them, which capture on ``meta`` does not
            check); ``None`` without such a table (rotary or relative positions, none) or
            without a sequence axis.
    """

    name: str
    family: str
    description: str
    build: Callable[[], nn.Module] = field(repr=False, compare=False)
    example_inputs: Callable[..., ExampleInputs] = field(repr=False, compare=False)
    default_batch: int
    default_seq: int | None
    params_approx: str
    size: Literal["full", "tiny"]
    input_kind: InputKind
    max_seq: int | None = None


# --------------------------------------------------------------------------------------------
# Example-input factories
# --------------------------------------------------------------------------------------------


def _gen() -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(_INPUT_SEED)
    return g


def _ids(batch: int, seq: int, vocab: int, device: torch.device | str) -> torch.Tensor:
    if torch.device(device).type == "meta":
        return torch.empty(batch, seq, dtype=torch.long, device="meta")
    return torch.randint(0, vocab, (batch, seq), generator=_gen(), dtype=torch.long).to(device)


def _floats(
    shape: tuple[int, ...], device: torch.device | str, dtype: torch.dtype | None
) -> torch.Tensor:
    dtype = dtype or torch.float32
    if torch.device(device).type == "meta":
        return torch.empty(shape, dtype=dtype, device="meta")
    return torch.randn(shape, generator=_gen()).to(device=device, dtype=dtype)


def token_inputs(vocab: int, *, use_cache: bool) -> Callable[..., ExampleInputs]:
    def make(
        batch: int,
        seq: int,
        *,
        device: torch.device | str = "meta",
        dtype: torch.dtype | None = None,
    ) -> ExampleInputs:
        kwargs: dict[str, Any] = {"use_cache": False} if use_cache else {}
        return (_ids(batch, seq, vocab, device),), kwargs

    return make


def seq2seq_inputs(vocab: int) -> Callable[..., ExampleInputs]:
    def make(
        batch: int,
        seq: int,
        *,
        device: torch.device | str = "meta",
        dtype: torch.dtype | None = None,
    ) -> ExampleInputs:
        ids = _ids(batch, seq, vocab, device)
        dec = _ids(batch, seq, vocab, device)
        return (ids,), {"decoder_input_ids": dec, "use_cache": False}

    return make


def image_inputs(image_size: int, channels: int = 3) -> Callable[..., ExampleInputs]:
    def make(
        batch: int,
        seq: int | None = None,
        *,
        device: torch.device | str = "meta",
        dtype: torch.dtype | None = None,
    ) -> ExampleInputs:
        return (_floats((batch, channels, image_size, image_size), device, dtype),), {}

    return make


def feature_inputs(in_features: int) -> Callable[..., ExampleInputs]:
    def make(
        batch: int,
        seq: int | None = None,
        *,
        device: torch.device | str = "meta",
        dtype: torch.dtype | None = None,
    ) -> ExampleInputs:
        return (_floats((batch, in_features), device, dtype),), {}

    return make


# --------------------------------------------------------------------------------------------
# Hugging Face builders (transformers imported lazily)
# --------------------------------------------------------------------------------------------


def hf(config_cls: str, model_cls: str, **config: Any) -> Callable[[], nn.Module]:
    """Returns a builder that makes ``transformers.<model_cls>(<config_cls>(**config))``."""

    def make() -> nn.Module:
        import transformers

        cfg = getattr(transformers, config_cls)(**config)
        model: nn.Module = getattr(transformers, model_cls)(cfg)
        return model

    make.__qualname__ = f"build_{model_cls}"
    return make


def gpt2(n_embd: int, n_layer: int, n_head: int, **kw: Any) -> Callable[[], nn.Module]:
    cfg: dict[str, Any] = {
        "vocab_size": 50257,
        "n_positions": 1024,
        "n_embd": n_embd,
        "n_layer": n_layer,
        "n_head": n_head,
    }
    cfg.update(kw)
    return hf("GPT2Config", "GPT2LMHeadModel", **cfg)


def bert(hidden: int, layers: int, heads: int, inter: int, **kw: Any) -> Callable[[], nn.Module]:
    cfg: dict[str, Any] = {
        "vocab_size": 30522,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "intermediate_size": inter,
        "max_position_embeddings": 512,
        "type_vocab_size": 2,
    }
    cfg.update(kw)
    return hf("BertConfig", "BertForMaskedLM", **cfg)


def llama2(
    hidden: int, inter: int, layers: int, heads: int, kv_heads: int
) -> Callable[[], nn.Module]:
    return hf(
        "LlamaConfig",
        "LlamaForCausalLM",
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )


def resnet(
    depths: list[int], hidden_sizes: list[int], embedding_size: int, layer_type: str, labels: int
) -> Callable[[], nn.Module]:
    # num_labels must be passed explicitly: transformers' default is 2, not 1000.
    return hf(
        "ResNetConfig",
        "ResNetForImageClassification",
        num_channels=3,
        embedding_size=embedding_size,
        hidden_sizes=hidden_sizes,
        depths=depths,
        layer_type=layer_type,
        hidden_act="relu",
        downsample_in_first_stage=False,
        num_labels=labels,
    )
