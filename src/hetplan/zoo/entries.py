"""The zoo's registry: one declarative entry per model, full-size configs then tiny ones.

A table of configs, not logic: every Hugging Face entry types in its config (published sizes
for full-size models, hidden 32-64 and 2 layers for tiny ones); the custom models come from
:mod:`hetplan.models`. :data:`ZOO` maps each name to its entry.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from hetplan.zoo.builders import (
    ZooEntry,
    bert,
    feature_inputs,
    gpt2,
    hf,
    image_inputs,
    llama2,
    resnet,
    seq2seq_inputs,
    token_inputs,
)

__all__ = ["ZOO"]

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
        build=gpt2(768, 12, 12),
        example_inputs=token_inputs(50257, use_cache=True),
        default_batch=8,
        default_seq=1024,
        params_approx="124M",
        size="full",
        input_kind="tokens",
        max_seq=1024,
    )
    yield ZooEntry(
        name="gpt2-medium",
        family="gpt2",
        description="GPT-2 medium (openai-community/gpt2-medium)",
        build=gpt2(1024, 24, 16),
        example_inputs=token_inputs(50257, use_cache=True),
        default_batch=8,
        default_seq=1024,
        params_approx="355M",
        size="full",
        input_kind="tokens",
        max_seq=1024,
    )
    yield ZooEntry(
        name="gpt2-xl",
        family="gpt2",
        description="GPT-2 XL (openai-community/gpt2-xl)",
        build=gpt2(1600, 48, 25),
        example_inputs=token_inputs(50257, use_cache=True),
        default_batch=4,
        default_seq=1024,
        params_approx="1.56B",
        size="full",
        input_kind="tokens",
        max_seq=1024,
    )
    yield ZooEntry(
        name="bert-base",
        family="bert",
        description="BERT-base uncased (google-bert/bert-base-uncased), BertForMaskedLM",
        build=bert(768, 12, 12, 3072),
        example_inputs=token_inputs(30522, use_cache=False),
        default_batch=32,
        default_seq=512,
        params_approx="110M",
        size="full",
        input_kind="tokens",
        max_seq=512,
    )
    yield ZooEntry(
        name="bert-large",
        family="bert",
        description="BERT-large uncased (google-bert/bert-large-uncased), BertForMaskedLM",
        build=bert(1024, 24, 16, 4096),
        example_inputs=token_inputs(30522, use_cache=False),
        default_batch=16,
        default_seq=512,
        params_approx="335M",
        size="full",
        input_kind="tokens",
        max_seq=512,
    )
    yield ZooEntry(
        name="llama-7b",
        family="llama",
        description="Llama-2-7B (meta-llama/Llama-2-7b-hf config)",
        build=llama2(4096, 11008, 32, 32, 32),
        example_inputs=token_inputs(32000, use_cache=True),
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
        build=llama2(5120, 13824, 40, 40, 40),
        example_inputs=token_inputs(32000, use_cache=True),
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
        build=llama2(8192, 28672, 80, 64, 8),
        example_inputs=token_inputs(32000, use_cache=True),
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
        build=hf(
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
        example_inputs=token_inputs(32000, use_cache=True),
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
        build=hf(
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
        example_inputs=seq2seq_inputs(32128),
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
        build=hf(
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
        example_inputs=image_inputs(224),
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
        build=resnet([3, 4, 6, 3], [256, 512, 1024, 2048], 64, "bottleneck", 1000),
        example_inputs=image_inputs(224),
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
        build=resnet([3, 4, 23, 3], [256, 512, 1024, 2048], 64, "bottleneck", 1000),
        example_inputs=image_inputs(224),
        default_batch=32,
        default_seq=None,
        params_approx="44.5M",
        size="full",
        input_kind="image",
    )

    # ---- tiny HF configs for fast tests ----------------------------------------------------
    v = _TINY_VOCAB
    tok_cache = token_inputs(v, use_cache=True)
    tok_nocache = token_inputs(v, use_cache=False)
    yield ZooEntry(
        name="tiny-gpt2",
        family="gpt2",
        description="GPT-2 architecture, 2 layers, n_embd 64",
        build=gpt2(
            64, 2, 4, vocab_size=v, n_positions=128, bos_token_id=v - 1, eos_token_id=v - 1
        ),
        example_inputs=tok_cache,
        default_batch=2,
        default_seq=16,
        params_approx="~0.14M",
        size="tiny",
        input_kind="tokens",
        max_seq=128,
    )
    yield ZooEntry(
        name="tiny-bert",
        family="bert",
        description="BERT architecture (BertForMaskedLM), 2 layers, hidden 64",
        build=bert(64, 2, 4, 128, vocab_size=v, max_position_embeddings=128),
        example_inputs=tok_nocache,
        default_batch=2,
        default_seq=16,
        params_approx="~0.11M",
        size="tiny",
        input_kind="tokens",
        max_seq=128,
    )
    yield ZooEntry(
        name="tiny-roberta",
        family="roberta",
        description="RoBERTa architecture (RobertaForMaskedLM), 2 layers",
        build=hf(
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
        max_seq=128,  # 130 rows: positions start after the padding id 1
    )
    yield ZooEntry(
        name="tiny-llama",
        family="llama",
        description="Llama architecture, 2 layers, GQA (4 heads, 2 kv heads)",
        build=hf("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2, **_TINY_DEC),
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
        build=hf(
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
        build=hf("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=2, **_TINY_DEC),
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
        build=hf(
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
        build=hf(
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
        max_seq=128,  # OPT's table has 2 more rows (its offset)
    )
    yield ZooEntry(
        name="tiny-gptneox",
        family="gptneox",
        description="GPT-NeoX architecture, 2 layers, hidden 64",
        build=hf(
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
        build=hf(
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
        example_inputs=seq2seq_inputs(v),
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
        build=hf(
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
        example_inputs=image_inputs(32),
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
        build=resnet([1, 1], [16, 32], 16, "basic", 10),
        example_inputs=image_inputs(32),
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
        example_inputs=feature_inputs(32),
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
        example_inputs=image_inputs(32),
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
        example_inputs=token_inputs(256, use_cache=False),
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
        example_inputs=token_inputs(512, use_cache=False),
        default_batch=2,
        default_seq=16,
        params_approx="~0.17M",
        size="tiny",
        input_kind="tokens",
        max_seq=64,  # TinyGPT's block_size
    )
    yield ZooEntry(
        name="gpt-test",
        family="custom",
        description="Pure-PyTorch GPT (fx-traceable), 4 layers, dim 64, for tests",
        build=lambda: models.TinyGPT(256, 32, 64, 4, 4),
        example_inputs=token_inputs(256, use_cache=False),
        default_batch=4,
        default_seq=32,
        params_approx="~0.23M",
        size="tiny",
        input_kind="tokens",
        max_seq=32,  # TinyGPT's block_size
    )
    yield ZooEntry(
        name="megatron-gpt-test",
        family="custom",
        description="Pure-PyTorch GPT with Megatron-LM's layer (unfused attention core, "
        "dropout everywhere): the activations Korthikanti et al. 2022 count; 4 layers, dim 64",
        build=lambda: models.MegatronGPT(256, 32, 64, 4, 4),
        example_inputs=token_inputs(256, use_cache=False),
        default_batch=4,
        default_seq=32,
        params_approx="~0.23M",
        size="tiny",
        input_kind="tokens",
        max_seq=32,
    )
    yield ZooEntry(
        name="data-dependent",
        family="custom",
        description="Net with a data-dependent branch in submodule 'gate' (not traceable)",
        build=lambda: models.DataDependentNet(16, 32, 4),
        example_inputs=feature_inputs(16),
        default_batch=4,
        default_seq=None,
        params_approx="~2.8K",
        size="tiny",
        input_kind="features",
    )


ZOO: dict[str, ZooEntry] = {e.name: e for e in _entries()}
"""All zoo entries by name."""
