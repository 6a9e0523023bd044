"""The built-in model zoo: named models with configs written in code and example inputs.

Every Hugging Face model is built from a config object typed in here (published sizes for the
full-size entries, tiny sizes for fast tests), never downloaded. Models are built on the
``meta`` device by default, so even ``llama-70b`` costs no memory::

    model = hetplan.zoo.build("llama-70b")                  # meta tensors only
    args, kwargs = hetplan.zoo.example_inputs("llama-70b")  # meta input_ids [1, 4096]
    ep = torch.export.export(model, args, kwargs=kwargs, strict=False)

``transformers`` is imported lazily inside the build functions; importing this module is cheap.

Input conventions (``example_inputs``):

- causal / masked LMs (``input_kind="tokens"``): ``args=(input_ids,)`` with ``input_ids`` of
  dtype ``long`` and shape [batch, seq]; ``kwargs={"use_cache": False}`` for models that accept
  it (decoders), ``{}`` otherwise (BERT, RoBERTa, the custom models).
- encoder-decoder (``"seq2seq"``, T5): ``args=(input_ids,)``,
  ``kwargs={"decoder_input_ids": ..., "use_cache": False}``, both [batch, seq].
- vision (``"image"``): ``args=(pixel_values,)`` float [batch, 3, H, W]; ``seq`` is ignored.
- ``"features"`` (MLP, DataDependentNet): ``args=(x,)`` float [batch, in_features].
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from hetplan.errors import SpecError
from hetplan.ir.validation import did_you_mean

__all__ = [
    "ZOO",
    "ExampleInputs",
    "ZooEntry",
    "build",
    "example_inputs",
    "get",
    "list_models",
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


def _token_inputs(vocab: int, *, use_cache: bool) -> Callable[..., ExampleInputs]:
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


def _seq2seq_inputs(vocab: int) -> Callable[..., ExampleInputs]:
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


def _image_inputs(image_size: int, channels: int = 3) -> Callable[..., ExampleInputs]:
    def make(
        batch: int,
        seq: int | None = None,
        *,
        device: torch.device | str = "meta",
        dtype: torch.dtype | None = None,
    ) -> ExampleInputs:
        return (_floats((batch, channels, image_size, image_size), device, dtype),), {}

    return make


def _feature_inputs(in_features: int) -> Callable[..., ExampleInputs]:
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


def _hf(config_cls: str, model_cls: str, **config: Any) -> Callable[[], nn.Module]:
    """Returns a builder that makes ``transformers.<model_cls>(<config_cls>(**config))``."""

    def make() -> nn.Module:
        import transformers

        cfg = getattr(transformers, config_cls)(**config)
        model: nn.Module = getattr(transformers, model_cls)(cfg)
        return model

    make.__qualname__ = f"build_{model_cls}"
    return make


def _gpt2(n_embd: int, n_layer: int, n_head: int, **kw: Any) -> Callable[[], nn.Module]:
    cfg: dict[str, Any] = {
        "vocab_size": 50257,
        "n_positions": 1024,
        "n_embd": n_embd,
        "n_layer": n_layer,
        "n_head": n_head,
    }
    cfg.update(kw)
    return _hf("GPT2Config", "GPT2LMHeadModel", **cfg)


def _bert(hidden: int, layers: int, heads: int, inter: int, **kw: Any) -> Callable[[], nn.Module]:
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
    return _hf("BertConfig", "BertForMaskedLM", **cfg)


def _llama2(
    hidden: int, inter: int, layers: int, heads: int, kv_heads: int
) -> Callable[[], nn.Module]:
    return _hf(
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


def _resnet(
    depths: list[int], hidden_sizes: list[int], embedding_size: int, layer_type: str, labels: int
) -> Callable[[], nn.Module]:
    # num_labels must be passed explicitly: transformers' default is 2, not 1000.
    return _hf(
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


# Tiny HF configs: hidden 32-64, 2 layers, vocab <= 1000.
_TINY_VOCAB = 512
_TINY_DEC: dict[str, Any] = {
    "vocab_size": _TINY_VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 128,
}


# --------------------------------------------------------------------------------------------
# The registry
# --------------------------------------------------------------------------------------------


def _entries() -> Iterator[ZooEntry]:
    from hetplan import models  # cheap: plain torch

    # ---- full-size, published configs ------------------------------------------------------
    yield ZooEntry(
        name="gpt2",
        family="gpt2",
        description="GPT-2 small (openai-community/gpt2), lm_head tied to wte",
        build=_gpt2(768, 12, 12),
        example_inputs=_token_inputs(50257, use_cache=True),
        default_batch=8,
        default_seq=1024,
        params_approx="124M",
        size="full",
        input_kind="tokens",
    )
    yield ZooEntry(
        name="gpt2-medium",
        family="gpt2",
        description="GPT-2 medium (openai-community/gpt2-medium)",
        build=_gpt2(1024, 24, 16),
        example_inputs=_token_inputs(50257, use_cache=True),
        default_batch=8,
        default_seq=1024,
        params_approx="355M",
        size="full",
        input_kind="tokens",
    )
    yield ZooEntry(
        name="gpt2-xl",
        family="gpt2",
        description="GPT-2 XL (openai-community/gpt2-xl)",
        build=_gpt2(1600, 48, 25),
        example_inputs=_token_inputs(50257, use_cache=True),
        default_batch=4,
        default_seq=1024,
        params_approx="1.56B",
        size="full",
        input_kind="tokens",
    )
    yield ZooEntry(
        name="bert-base",
        family="bert",
        description="BERT-base uncased (google-bert/bert-base-uncased), BertForMaskedLM",
        build=_bert(768, 12, 12, 3072),
        example_inputs=_token_inputs(30522, use_cache=False),
        default_batch=32,
        default_seq=512,
        params_approx="110M",
        size="full",
        input_kind="tokens",
    )
    yield ZooEntry(
        name="bert-large",
        family="bert",
        description="BERT-large uncased (google-bert/bert-large-uncased), BertForMaskedLM",
        build=_bert(1024, 24, 16, 4096),
        example_inputs=_token_inputs(30522, use_cache=False),
        default_batch=16,
        default_seq=512,
        params_approx="335M",
        size="full",
        input_kind="tokens",
    )
    yield ZooEntry(
        name="llama-7b",
        family="llama",
        description="Llama-2-7B (meta-llama/Llama-2-7b-hf config)",
        build=_llama2(4096, 11008, 32, 32, 32),
        example_inputs=_token_inputs(32000, use_cache=True),
        default_batch=1,
        default_seq=4096,
        params_approx="6.74B",
        size="full",
        input_kind="tokens",
    )
    yield ZooEntry(
        name="llama-13b",
        family="llama",
        description="Llama-2-13B (meta-llama/Llama-2-13b-hf config)",
        build=_llama2(5120, 13824, 40, 40, 40),
        example_inputs=_token_inputs(32000, use_cache=True),
        default_batch=1,
        default_seq=4096,
        params_approx="13.0B",
        size="full",
        input_kind="tokens",
    )
    yield ZooEntry(
        name="llama-70b",
        family="llama",
        description="Llama-2-70B (meta-llama/Llama-2-70b-hf config, GQA 8 kv heads)",
        build=_llama2(8192, 28672, 80, 64, 8),
        example_inputs=_token_inputs(32000, use_cache=True),
        default_batch=1,
        default_seq=4096,
        params_approx="69.0B",
        size="full",
        input_kind="tokens",
    )
    yield ZooEntry(
        name="mixtral-8x7b",
        family="mixtral",
        description="Mixtral-8x7B (mistralai/Mixtral-8x7B-v0.1 config), 8 experts, top-2",
        build=_hf(
            "MixtralConfig",
            "MixtralForCausalLM",
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=32768,
            rms_norm_eps=1e-5,
            rope_theta=1e6,
            sliding_window=None,
            num_local_experts=8,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
        ),
        example_inputs=_token_inputs(32000, use_cache=True),
        default_batch=1,
        default_seq=4096,
        params_approx="46.7B",
        size="full",
        input_kind="tokens",
    )
    yield ZooEntry(
        name="t5-base",
        family="t5",
        description="T5-base (google-t5/t5-base), T5ForConditionalGeneration",
        build=_hf(
            "T5Config",
            "T5ForConditionalGeneration",
            vocab_size=32128,
            d_model=768,
            d_kv=64,
            d_ff=3072,
            num_layers=12,
            num_decoder_layers=12,
            num_heads=12,
            relative_attention_num_buckets=32,
            feed_forward_proj="relu",
            tie_word_embeddings=True,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        ),
        example_inputs=_seq2seq_inputs(32128),
        default_batch=16,
        default_seq=512,
        params_approx="223M",
        size="full",
        input_kind="seq2seq",
    )
    yield ZooEntry(
        name="vit-base",
        family="vit",
        description="ViT-B/16 224 (google/vit-base-patch16-224), ViTForImageClassification, 1000 classes",
        build=_hf(
            "ViTConfig",
            "ViTForImageClassification",
            hidden_size=768,
            num_hidden_layers=12,
            num_attention_heads=12,
            intermediate_size=3072,
            image_size=224,
            patch_size=16,
            num_channels=3,
            num_labels=1000,
        ),
        example_inputs=_image_inputs(224),
        default_batch=32,
        default_seq=None,
        params_approx="86.6M",
        size="full",
        input_kind="image",
    )
    yield ZooEntry(
        name="resnet-50",
        family="resnet",
        description="ResNet-50 (microsoft/resnet-50), bottleneck [3,4,6,3]",
        build=_resnet([3, 4, 6, 3], [256, 512, 1024, 2048], 64, "bottleneck", 1000),
        example_inputs=_image_inputs(224),
        default_batch=32,
        default_seq=None,
        params_approx="25.6M",
        size="full",
        input_kind="image",
    )
    yield ZooEntry(
        name="resnet-101",
        family="resnet",
        description="ResNet-101 (microsoft/resnet-101), bottleneck [3,4,23,3]",
        build=_resnet([3, 4, 23, 3], [256, 512, 1024, 2048], 64, "bottleneck", 1000),
        example_inputs=_image_inputs(224),
        default_batch=32,
        default_seq=None,
        params_approx="44.5M",
        size="full",
        input_kind="image",
    )

    # ---- tiny HF configs for fast tests ----------------------------------------------------
    v = _TINY_VOCAB
    tok_cache = _token_inputs(v, use_cache=True)
    tok_nocache = _token_inputs(v, use_cache=False)
    yield ZooEntry(
        name="tiny-gpt2",
        family="gpt2",
        description="GPT-2 architecture, 2 layers, n_embd 64",
        build=_gpt2(
            64, 2, 4, vocab_size=v, n_positions=128, bos_token_id=v - 1, eos_token_id=v - 1
        ),
        example_inputs=tok_cache,
        default_batch=2,
        default_seq=16,
        params_approx="~0.14M",
        size="tiny",
        input_kind="tokens",
    )
    yield ZooEntry(
        name="tiny-bert",
        family="bert",
        description="BERT architecture (BertForMaskedLM), 2 layers, hidden 64",
        build=_bert(64, 2, 4, 128, vocab_size=v, max_position_embeddings=128),
        example_inputs=tok_nocache,
        default_batch=2,
        default_seq=16,
        params_approx="~0.11M",
        size="tiny",
        input_kind="tokens",
    )
    yield ZooEntry(
        name="tiny-roberta",
        family="roberta",
        description="RoBERTa architecture (RobertaForMaskedLM), 2 layers",
        build=_hf(
            "RobertaConfig",
            "RobertaForMaskedLM",
            vocab_size=v,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=130,
            type_vocab_size=1,
            pad_token_id=1,
        ),
        example_inputs=tok_nocache,
        default_batch=2,
        default_seq=16,
        params_approx="~0.11M",
        size="tiny",
        input_kind="tokens",
    )
    yield ZooEntry(
        name="tiny-llama",
        family="llama",
        description="Llama architecture, 2 layers, GQA (4 heads, 2 kv heads)",
        build=_hf("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2, **_TINY_DEC),
        example_inputs=tok_cache,
        default_batch=2,
        default_seq=16,
        params_approx="~0.14M",
        size="tiny",
        input_kind="tokens",
    )
    yield ZooEntry(
        name="tiny-mistral",
        family="mistral",
        description="Mistral architecture, 2 layers, sliding window 64",
        build=_hf(
            "MistralConfig",
            "MistralForCausalLM",
            num_key_value_heads=2,
            sliding_window=64,
            **_TINY_DEC,
        ),
        example_inputs=tok_cache,
        default_batch=2,
        default_seq=16,
        params_approx="~0.14M",
        size="tiny",
        input_kind="tokens",
    )
    yield ZooEntry(
        name="tiny-qwen2",
        family="qwen2",
        description="Qwen2 architecture (qkv bias), 2 layers",
        build=_hf("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=2, **_TINY_DEC),
        example_inputs=tok_cache,
        default_batch=2,
        default_seq=16,
        params_approx="~0.14M",
        size="tiny",
        input_kind="tokens",
    )
    yield ZooEntry(
        name="tiny-mixtral",
        family="mixtral",
        description="Mixtral architecture, 2 layers, 4 experts, top-2",
        build=_hf(
            "MixtralConfig",
            "MixtralForCausalLM",
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=None,
            **_TINY_DEC,
        ),
        example_inputs=tok_cache,
        default_batch=2,
        default_seq=16,
        params_approx="~0.29M",
        size="tiny",
        input_kind="tokens",
    )
    yield ZooEntry(
        name="tiny-opt",
        family="opt",
        description="OPT architecture, 2 layers, hidden 64",
        build=_hf(
            "OPTConfig",
            "OPTForCausalLM",
            vocab_size=v,
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=128,
            word_embed_proj_dim=64,
        ),
        example_inputs=tok_cache,
        default_batch=2,
        default_seq=16,
        params_approx="~0.11M",
        size="tiny",
        input_kind="tokens",
    )
    yield ZooEntry(
        name="tiny-gptneox",
        family="gptneox",
        description="GPT-NeoX architecture, 2 layers, hidden 64",
        build=_hf(
            "GPTNeoXConfig",
            "GPTNeoXForCausalLM",
            vocab_size=v,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=128,
        ),
        example_inputs=tok_cache,
        default_batch=2,
        default_seq=16,
        params_approx="~0.13M",
        size="tiny",
        input_kind="tokens",
    )
    yield ZooEntry(
        name="tiny-t5",
        family="t5",
        description="T5 architecture (T5ForConditionalGeneration), 2+2 layers, d_model 32",
        build=_hf(
            "T5Config",
            "T5ForConditionalGeneration",
            vocab_size=v,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            feed_forward_proj="relu",
            tie_word_embeddings=True,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        ),
        example_inputs=_seq2seq_inputs(v),
        default_batch=2,
        default_seq=16,
        params_approx="~58K",
        size="tiny",
        input_kind="seq2seq",
    )
    yield ZooEntry(
        name="tiny-vit",
        family="vit",
        description="ViT architecture, image 32, patch 8, 2 layers, hidden 32",
        build=_hf(
            "ViTConfig",
            "ViTForImageClassification",
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            image_size=32,
            patch_size=8,
            num_channels=3,
            num_labels=10,
        ),
        example_inputs=_image_inputs(32),
        default_batch=2,
        default_seq=None,
        params_approx="~24K",
        size="tiny",
        input_kind="image",
    )
    yield ZooEntry(
        name="tiny-resnet",
        family="resnet",
        description="ResNet architecture, basic blocks [1,1], image 32",
        build=_resnet([1, 1], [16, 32], 16, "basic", 10),
        example_inputs=_image_inputs(32),
        default_batch=2,
        default_seq=None,
        params_approx="~22K",
        size="tiny",
        input_kind="image",
    )

    # ---- custom pure-PyTorch models (hetplan.models) ---------------------------------------
    yield ZooEntry(
        name="mlp",
        family="custom",
        description="MLP 32 -> 64 -> 64 -> 10 (Linear + ReLU)",
        build=lambda: models.MLP(32, (64, 64), 10),
        example_inputs=_feature_inputs(32),
        default_batch=4,
        default_seq=None,
        params_approx="~6.9K",
        size="tiny",
        input_kind="features",
    )
    yield ZooEntry(
        name="skip-cnn",
        family="custom",
        description="Small ResNet-like CNN with BatchNorm and skip connections",
        build=lambda: models.SkipCNN(3, (16, 32, 64), 10),
        example_inputs=_image_inputs(32),
        default_batch=4,
        default_seq=None,
        params_approx="~78K",
        size="tiny",
        input_kind="image",
    )
    yield ZooEntry(
        name="tied-lm",
        family="custom",
        description="Tiny LM with head.weight tied to embed.weight, ModuleList blocks",
        build=lambda: models.TiedLM(256, 32, 2),
        example_inputs=_token_inputs(256, use_cache=False),
        default_batch=2,
        default_seq=16,
        params_approx="~25K",
        size="tiny",
        input_kind="tokens",
    )
    yield ZooEntry(
        name="tiny-gpt",
        family="custom",
        description="Pure-PyTorch GPT (fx-traceable), 2 layers, dim 64",
        build=lambda: models.TinyGPT(512, 64, 64, 2, 4),
        example_inputs=_token_inputs(512, use_cache=False),
        default_batch=2,
        default_seq=16,
        params_approx="~0.17M",
        size="tiny",
        input_kind="tokens",
    )
    yield ZooEntry(
        name="gpt-test",
        family="custom",
        description="Pure-PyTorch GPT (fx-traceable), 4 layers, dim 64, for tests",
        build=lambda: models.TinyGPT(256, 32, 64, 4, 4),
        example_inputs=_token_inputs(256, use_cache=False),
        default_batch=4,
        default_seq=32,
        params_approx="~0.23M",
        size="tiny",
        input_kind="tokens",
    )
    yield ZooEntry(
        name="data-dependent",
        family="custom",
        description="Net with a data-dependent branch in submodule 'gate' (not traceable)",
        build=lambda: models.DataDependentNet(16, 32, 4),
        example_inputs=_feature_inputs(16),
        default_batch=4,
        default_seq=None,
        params_approx="~2.8K",
        size="tiny",
        input_kind="features",
    )


ZOO: dict[str, ZooEntry] = {e.name: e for e in _entries()}
"""All zoo entries by name."""


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def list_models(*, family: str | None = None, size: str | None = None) -> list[ZooEntry]:
    """Lists zoo entries sorted by name.

    Args:
        family: keep only this family (e.g. ``"llama"``, ``"custom"``).
        size: keep only ``"full"`` or ``"tiny"`` entries.

    Returns:
        The matching entries, sorted by name.
    """
    return [
        e
        for _, e in sorted(ZOO.items())
        if (family is None or e.family == family) and (size is None or e.size == size)
    ]


def get(name: str) -> ZooEntry:
    """Looks up a zoo entry by name (case-insensitive; ``_`` and ``-`` are interchangeable).

    Args:
        name: the zoo name, e.g. ``"gpt2"``.

    Returns:
        The entry.

    Raises:
        SpecError: no entry has that name; the message suggests the closest names.
    """
    key = name.strip().lower().replace("_", "-")
    entry = ZOO.get(key)
    if entry is not None:
        return entry
    raise SpecError(
        f"unknown model {name!r} in the hetplan zoo{did_you_mean(key, ZOO, n=3)} "
        f"(expected one of: {', '.join(sorted(ZOO))}; see hetplan.zoo.list_models())"
    )


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype | None) -> Iterator[None]:
    if dtype is None or not dtype.is_floating_point:
        yield
        return
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build(
    name: str,
    *,
    device: torch.device | str = "meta",
    dtype: torch.dtype | None = None,
    seed: int | None = None,
) -> nn.Module:
    """Builds a zoo model.

    The model is constructed under ``with torch.device(device):`` so that on ``meta`` (the
    default) no parameter memory is allocated, whatever the model's size. The model is left in
    training mode.

    Args:
        name: the zoo name (see :func:`list_models`).
        device: where parameters are created; ``"meta"`` allocates nothing.
        dtype: floating dtype of parameters and buffers (``None``: torch's default, float32).
        seed: if given, initialize weights deterministically from this seed (the global RNG
            state is restored afterwards), so separate processes build identical models.

    Returns:
        The model.

    Raises:
        SpecError: ``name`` is not in the zoo, or ``dtype`` is not a floating dtype.
    """
    entry = get(name)
    if dtype is not None and not dtype.is_floating_point:
        raise SpecError(
            f"build({name!r}): dtype {dtype} is not a floating dtype; "
            "pass e.g. torch.float32, torch.bfloat16 or torch.float16"
        )
    rng = torch.random.fork_rng(devices=[]) if seed is not None else contextlib.nullcontext()
    with rng, _default_dtype(dtype), torch.device(device):
        if seed is not None:
            torch.manual_seed(seed)
        model = entry.build()
    if dtype is not None:
        model = model.to(dtype=dtype)
    return model


def example_inputs(
    name: str,
    batch: int | None = None,
    seq: int | None = None,
    *,
    device: torch.device | str = "meta",
    dtype: torch.dtype | None = None,
) -> ExampleInputs:
    """Makes example inputs for a zoo model: call it as ``model(*args, **kwargs)``.

    Token ids are random (fixed seed) in the model's vocabulary on real devices and
    uninitialized meta tensors on ``meta``. See the module docstring for each input kind.

    Args:
        name: the zoo name.
        batch: batch size (default: the entry's ``default_batch``).
        seq: sequence length (default: the entry's ``default_seq``); ignored by vision and
            feature models.
        device: device of the input tensors (``"meta"`` by default).
        dtype: dtype of floating inputs (pixel values, features); token ids stay ``long``.

    Returns:
        ``(args, kwargs)``.

    Raises:
        SpecError: unknown name, or a non-positive batch or sequence length.
    """
    entry = get(name)
    b = entry.default_batch if batch is None else batch
    s = entry.default_seq if seq is None else seq
    if b < 1:
        raise SpecError(f"example_inputs({name!r}): batch must be >= 1, got {b}")
    if entry.default_seq is not None and (s is None or s < 1):
        raise SpecError(f"example_inputs({name!r}): seq must be >= 1, got {s}")
    return entry.example_inputs(b, s, device=device, dtype=dtype)
