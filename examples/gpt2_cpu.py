"""A reduced GPT-2 for end-to-end runs on CPU processes (``hetplan plan/run --module``).

GPT-2's architecture and tokenizer size (Hugging Face ``GPT2LMHeadModel``, vocabulary 50257,
``lm_head`` tied to ``wte``) at 2 layers of width 128 and 64 positions: full GPT-2 small
(124M parameters, 1024 positions) takes minutes per step on two shared CPU cores, this one a
fraction of a second, and it keeps what matters to gradient compression: one very large
gradient (``wte``, 25.7 MB), mid-sized matrices (attention and MLP weights, 64-256 KB) and
many tiny ones (biases and LayerNorms, 0.5-2 KB).

    hetplan plan --module examples.gpt2_cpu:factory -c cpu-2x2-slow -b 8 --dp 4 \\
        --compress topk -o gpt2-topk.json
    hetplan run gpt2-topk.json --module examples.gpt2_cpu:factory --steps 5
"""

from __future__ import annotations

from typing import Any

import torch

#: (vocabulary, width, layers, heads, positions) of the reduced model.
CONFIG = (50257, 128, 2, 4, 64)
SEQ = 32


def factory() -> tuple[torch.nn.Module, tuple[torch.Tensor], dict[str, Any]]:
    """The model (seeded by the caller) and one example micro-batch of 1 x ``SEQ`` tokens."""
    import transformers

    vocab, width, layers, heads, positions = CONFIG
    cfg = transformers.GPT2Config(vocab_size=vocab, n_embd=width, n_layer=layers,
                                  n_head=heads, n_positions=positions, use_cache=False)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, vocab, (1, SEQ), generator=torch.Generator().manual_seed(0))
    return model, (ids,), {}
