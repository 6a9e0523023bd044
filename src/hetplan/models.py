"""Small pure-PyTorch models used by the zoo, the tests and the examples.

All of them are cheap to build and run on CPU. :class:`MLP`, :class:`SkipCNN`, :class:`TiedLM`,
:class:`TinyGPT` and :class:`MegatronGPT` are ``torch.fx.symbolic_trace``-able (no
data-dependent control flow);
:class:`DataDependentNet` deliberately is not, to exercise capture error messages.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "MLP",
    "CausalSelfAttention",
    "CoreAttention",
    "DataDependentGate",
    "DataDependentNet",
    "GPTBlock",
    "MegatronBlock",
    "MegatronGPT",
    "NativeDropout",
    "ResidualBlock",
    "SkipCNN",
    "TiedBlock",
    "TiedLM",
    "TinyGPT",
]


class MLP(nn.Module):
    """A stack of ``Linear`` + ``ReLU`` layers (no activation after the last one).

    Args:
        in_features: width of the input.
        hidden: widths of the hidden layers.
        out_features: width of the output.
    """

    def __init__(
        self, in_features: int = 32, hidden: Sequence[int] = (64, 64), out_features: int = 10
    ) -> None:
        super().__init__()
        self.in_features = in_features
        widths = [in_features, *hidden, out_features]
        layers: list[nn.Module] = []
        for i in range(len(widths) - 1):
            layers.append(nn.Linear(widths[i], widths[i + 1]))
            if i < len(widths) - 2:
                layers.append(nn.ReLU())
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Maps ``x`` [batch, in_features] to logits [batch, out_features]."""
        return self.layers(x)


class ResidualBlock(nn.Module):
    """conv-BN-ReLU-conv-BN plus a skip connection (1x1 conv + BN when the shape changes).

    Args:
        in_ch: input channels.
        out_ch: output channels.
        stride: stride of the first convolution.
    """

    def __init__(self, in_ch: int, out_ch: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.shortcut: nn.Module
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False), nn.BatchNorm2d(out_ch)
            )
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Applies the block."""
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class SkipCNN(nn.Module):
    """A small ResNet-like CNN with BatchNorm and residual (skip) connections.

    Args:
        in_channels: channels of the input image.
        widths: output channels of the stages; every stage after the first halves the
            resolution.
        num_classes: width of the classifier output.
    """

    def __init__(
        self, in_channels: int = 3, widths: Sequence[int] = (16, 32, 64), num_classes: int = 10
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False),
            nn.BatchNorm2d(widths[0]),
            nn.ReLU(),
        )
        blocks = []
        prev = widths[0]
        for i, w in enumerate(widths):
            blocks.append(ResidualBlock(prev, w, stride=1 if i == 0 else 2))
            prev = w
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(prev, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Maps images [batch, C, H, W] to logits [batch, num_classes]."""
        x = self.blocks(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))


class TiedBlock(nn.Module):
    """Pre-norm residual MLP block used by :class:`TiedLM`.

    Args:
        dim: model width.
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Applies the block."""
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class TiedLM(nn.Module):
    """A tiny LM whose output projection shares its weight with the input embedding.

    ``head.weight is embed.weight``, so ``parameters()`` yields the matrix once while
    ``named_parameters(remove_duplicate=False)`` yields it under both names.

    Args:
        vocab_size: vocabulary size.
        dim: model width.
        n_layers: number of identical :class:`TiedBlock` in ``blocks`` (a ``ModuleList``).
    """

    def __init__(self, vocab_size: int = 256, dim: int = 32, n_layers: int = 2) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.embed = nn.Embedding(vocab_size, dim)
        self.blocks = nn.ModuleList(TiedBlock(dim) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Maps token ids [batch, seq] to logits [batch, seq, vocab_size]."""
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused ``qkv`` projection and ``proj`` output.

    Args:
        dim: model width.
        n_heads: number of heads (must divide ``dim``).
    """

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        if dim % n_heads:
            raise ValueError(f"dim={dim} is not divisible by n_heads={n_heads}")
        self.dim = dim
        self.n_heads = n_heads
        self.head_dim = dim // n_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Applies attention to ``x`` [batch, seq, dim]."""
        # Sizes are read one at a time (no tuple unpacking) so that fx can trace this.
        b = x.size(0)
        t = x.size(1)
        q, k, v = self.qkv(x).split(self.dim, dim=2)
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(b, t, self.dim)
        return self.proj(y)


class GPTBlock(nn.Module):
    """Pre-norm transformer block: ``ln1`` → ``attn`` → residual, ``ln2`` → ``fc1/fc2``.

    Args:
        dim: model width.
        n_heads: attention heads.
        mlp_ratio: hidden width of the MLP relative to ``dim``.
    """

    def __init__(self, dim: int, n_heads: int, mlp_ratio: int = 4) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, n_heads)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, mlp_ratio * dim)
        self.fc2 = nn.Linear(mlp_ratio * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Applies the block."""
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    """A GPT-style decoder in plain PyTorch that ``torch.fx.symbolic_trace`` can capture.

    Args:
        vocab_size: vocabulary size.
        block_size: maximum sequence length (rows of the positional embedding).
        dim: model width.
        n_layers: number of :class:`GPTBlock` in ``blocks`` (a ``ModuleList``).
        n_heads: attention heads per block.
    """

    def __init__(
        self,
        vocab_size: int = 512,
        block_size: int = 64,
        dim: int = 64,
        n_layers: int = 2,
        n_heads: int = 4,
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, dim)
        self.pos_emb = nn.Embedding(block_size, dim)
        self.blocks = nn.ModuleList(GPTBlock(dim, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Maps token ids [batch, seq ≤ block_size] to logits [batch, seq, vocab_size]."""
        t = input_ids.size(1)
        x = self.tok_emb(input_ids) + self.pos_emb.weight[:t]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class DataDependentGate(nn.Module):
    """Chooses a branch from the *values* of its input, so it cannot be traced.

    Args:
        dim: feature width.
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.pos = nn.Linear(dim, dim)
        self.neg = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Applies ``pos`` if ``x.sum() > 0`` else ``neg``."""
        if x.sum() > 0:  # data-dependent Python control flow
            return self.pos(x)
        return self.neg(x)


class DataDependentNet(nn.Module):
    """``fc_in`` → ``gate`` (a :class:`DataDependentGate`) → ``fc_out``.

    ``torch.fx.symbolic_trace`` and ``torch.export`` both fail inside the submodule named
    ``gate``; capture error messages are expected to name it.

    Args:
        in_features: input width.
        dim: hidden width.
        out_features: output width.
    """

    def __init__(self, in_features: int = 16, dim: int = 32, out_features: int = 4) -> None:
        super().__init__()
        self.in_features = in_features
        self.fc_in = nn.Linear(in_features, dim)
        self.gate = DataDependentGate(dim)
        self.fc_out = nn.Linear(dim, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Maps ``x`` [batch, in_features] to [batch, out_features]."""
        return self.fc_out(self.gate(F.relu(self.fc_in(x))))


def native_dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Dropout through ``torch.native_dropout`` on every device: autograd keeps a 1-byte mask,
    as the fused CUDA kernel does (``F.dropout`` on CPU keeps a mask in ``x``'s dtype)."""
    if not training or p == 0:
        return x
    return torch.native_dropout(x, p, True)[0]


class NativeDropout(nn.Module):
    """``nn.Dropout`` through :func:`native_dropout` (a 1-byte mask on every device).

    Args:
        p: dropout probability.
    """

    def __init__(self, p: float = 0.1) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Drops elements of ``x`` with probability ``p`` in training."""
        return native_dropout(x, self.p, self.training)


class CoreAttention(nn.Module):
    """Megatron-LM's attention core, unfused: ``dropout(softmax(QKᵀ/√d + causal)) · V``.

    What autograd keeps is what Korthikanti et al. 2022 (Table 2) count for the core: Q and
    K for ``QKᵀ``, the softmax output, the dropout mask on the scores, and the dropout output
    and V for the product with V. The causal mask is added (an addition saves nothing), as
    Megatron's fused scale-mask-softmax does. Recomputing this module in backward is
    *selective* activation recomputation.

    Args:
        head_dim: width of one head (the scale is ``1/√head_dim``).
        max_seq: the longest sequence (size of the causal mask).
        dropout: dropout probability on the attention probabilities.
    """

    def __init__(self, head_dim: int, max_seq: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.scale = head_dim ** -0.5
        self.dropout = dropout
        causal = torch.full((max_seq, max_seq), float("-inf")).triu(1)
        self.causal: torch.Tensor
        self.register_buffer("causal", causal, persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of ``q``, ``k``, ``v`` [batch, heads, seq, head_dim]; same shape out."""
        t = q.size(2)
        causal = self.causal.narrow(0, 0, t).narrow(1, 0, t)  # (narrow: fx-traceable)
        scores = torch.matmul(q, k.transpose(-2, -1)) * self.scale + causal
        probs = native_dropout(torch.softmax(scores, dim=-1), self.dropout, self.training)
        return torch.matmul(probs, v)


class MegatronBlock(nn.Module):
    """A GPT-3 / Megatron-LM transformer layer with the activations Korthikanti et al. count.

    ``ln1 → qkv (column) → core → out_proj (row) → dropout → residual``, then ``ln2 → fc1
    (column) → GeLU → fc2 (row) → dropout → residual``. Without tensor parallelism autograd
    keeps ``34·s·b·h + 5·a·s²·b`` bytes per layer in 16-bit activations with 1-byte dropout
    masks (their Table 2); the tests hold hetplan's memory model to that.

    Args:
        dim: hidden size ``h``.
        n_heads: attention heads ``a``.
        max_seq: the longest sequence.
        dropout: dropout probability (attention probabilities and both residual branches).
    """

    def __init__(self, dim: int, n_heads: int, max_seq: int, dropout: float = 0.1) -> None:
        super().__init__()
        if dim % n_heads:
            raise ValueError(f"dim={dim} is not divisible by n_heads={n_heads}")
        self.dim, self.n_heads, self.head_dim = dim, n_heads, dim // n_heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.core = CoreAttention(self.head_dim, max_seq, dropout)
        self.out_proj = nn.Linear(dim, dim)
        self.drop1 = NativeDropout(dropout)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.drop2 = NativeDropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Applies the layer to ``x`` [batch, seq, dim]."""
        b = x.size(0)
        t = x.size(1)
        q, k, v = self.qkv(self.ln1(x)).split(self.dim, dim=2)
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        ctx = self.core(q, k, v).transpose(1, 2).reshape(b, t, self.dim)
        x = x + self.drop1(self.out_proj(ctx))
        return x + self.drop2(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class MegatronGPT(nn.Module):
    """A GPT of :class:`MegatronBlock` layers (token and position embeddings with dropout,
    final LayerNorm, untied LM head), ``torch.fx.symbolic_trace``-able.

    Args:
        vocab_size: vocabulary size.
        max_seq: maximum sequence length.
        dim: hidden size.
        n_layers: transformer layers in ``blocks`` (a ``ModuleList``).
        n_heads: attention heads per layer.
        dropout: dropout probability everywhere.
    """

    def __init__(self, vocab_size: int = 256, max_seq: int = 64, dim: int = 64,
                 n_layers: int = 2, n_heads: int = 4, dropout: float = 0.1) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tok_emb = nn.Embedding(vocab_size, dim)
        self.pos_emb = nn.Embedding(max_seq, dim)
        self.drop = NativeDropout(dropout)
        self.blocks = nn.ModuleList(
            MegatronBlock(dim, n_heads, max_seq, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Maps token ids [batch, seq ≤ max_seq] to logits [batch, seq, vocab_size]."""
        t = input_ids.size(1)
        x = self.drop(self.tok_emb(input_ids) + self.pos_emb.weight[:t])
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))
