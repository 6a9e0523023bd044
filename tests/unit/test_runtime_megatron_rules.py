"""Single-process rules of the runtime's Megatron tensor parallelism: heads per rank, the
loss probe, attention modules found, aliases of a replaced module's parameters, and which
traced pipeline layers can run as their own (sharded) modules."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import SplitPoint, pipeline

import hetplan
from hetplan import zoo
from hetplan.errors import SpecError
from hetplan.runtime.megatron import (
    AttentionParts,
    VocabParallelEmbedding,
    attention_modules,
    group_shards,
    head_shards,
    is_token_cross_entropy,
    shard_attention,
    shard_vocab,
)
from hetplan.runtime.pipeline import use_eager_layers
from hetplan.runtime.tensor_parallel import ColumnParallelLinear, replace_module, shard_model


def test_heads_come_from_the_plan_in_whole_heads_else_even() -> None:
    assert head_shards(4, 16, 2) == (2, 2)
    assert head_shards(5, 16, 2) == (3, 2)
    assert head_shards(4, 16, 2, (48, 16)) == (3, 1)
    with pytest.raises(ValueError, match="whole heads"):
        head_shards(4, 16, 2, (40, 24))


def test_grouped_query_heads_split_in_whole_groups() -> None:
    assert group_shards(4, 2, 16, 2) == ((2, 2), (1, 1))  # tiny-llama: 2 groups of 2
    assert group_shards(12, 3, 16, 2) == ((8, 4), (2, 1))  # uneven groups: first ranks more
    assert group_shards(4, 4, 16, 2, (48, 16)) == ((3, 1), (3, 1))  # no GQA: any whole heads
    assert group_shards(8, 4, 16, 2, (96, 32)) == ((6, 2), (3, 1))
    with pytest.raises(ValueError, match="whole groups of 2 query heads"):
        group_shards(4, 2, 16, 2, (48, 16))  # 3 + 1 heads would split a group
    with pytest.raises(ValueError, match="cannot give each of 4 ranks a whole head"):
        group_shards(4, 2, 16, 4)
    assert group_shards(4, 4, 16, 2, (64, 0)) == ((4, 0), (4, 0))  # the plan's choice


@pytest.mark.parametrize(("name", "module", "parts"), [
    ("tiny-llama", "model.layers.0.self_attn",
     AttentionParts(("q_proj", "k_proj", "v_proj"), "o_proj", 4, 2, 16)),
    ("tiny-mistral", "model.layers.1.self_attn",
     AttentionParts(("q_proj", "k_proj", "v_proj"), "o_proj", 4, 2, 16)),
    ("tiny-mixtral", "model.layers.0.self_attn",
     AttentionParts(("q_proj", "k_proj", "v_proj"), "o_proj", 4, 2, 16)),
    ("tiny-opt", "model.decoder.layers.0.self_attn",
     AttentionParts(("q_proj", "k_proj", "v_proj"), "out_proj", 4, 4, 16, "num_heads")),
    ("tiny-bert", "bert.encoder.layer.1.attention",
     AttentionParts(("self.query", "self.key", "self.value"), "output.dense", 4, 4, 16,
                    "num_attention_heads")),
    ("tiny-vit", "vit.layers.0.attention",
     AttentionParts(("q_proj", "k_proj", "v_proj"), "o_proj", 2, 2, 16,
                    "num_attention_heads")),
])
def test_separate_qkv_attention_is_found(name: str, module: str,
                                         parts: AttentionParts) -> None:
    found = attention_modules(zoo.build(name, device="cpu", seed=0))
    assert len(found) == 2 and found[module] == parts


def test_attention_not_split_yet_is_not_found() -> None:
    """T5 (a relative position bias per head) keeps its attention replicated."""
    assert attention_modules(zoo.build("tiny-t5", device="cpu", seed=0)) == {}


def test_attention_that_cannot_give_whole_groups_stays_replicated_with_a_warning() -> None:
    """tiny-llama: 4 query heads in 2 key/value groups. tp 4 leaves two ranks no group, and
    (48, 16) splits a group: the module runs whole on every rank, as before these modules
    were split (the planner records no head size, so it may ask for either), and says why."""
    model = zoo.build("tiny-llama", device="cpu", seed=0)
    name = "model.layers.0.self_attn"
    with pytest.warns(RuntimeWarning, match=r"'model\.layers\.0\.self_attn'.*each of 4 "
                                            r"ranks a whole head.*stays replicated"):
        assert not shard_attention(model, name, None, 0, 4)
    with pytest.warns(RuntimeWarning, match=r"whole groups.*stays replicated"):
        assert not shard_attention(model, name, None, 0, 2, (48, 16))
    assert isinstance(model.get_submodule(f"{name}.q_proj"), torch.nn.Linear)


def test_vit_attention_the_plan_would_split_inside_a_head_stays_replicated() -> None:
    """tiny-vit: 2 heads of 16. Sizes for its q/k/v -> o_proj pair that split a head (24 + 8
    features: what the planner asked before capture recorded head units; a plan of that time
    or a hand edit) run the module whole, with a warning; whole heads (16 + 16) split it."""
    model = zoo.build("tiny-vit", device="cpu", seed=0)
    name = "vit.layers.0.attention"
    with pytest.warns(RuntimeWarning, match=r"'vit\.layers\.0\.attention'.*multiples of "
                                            r"head_dim=16.*stays replicated"):
        assert not shard_attention(model, name, None, 0, 2, (24, 8))
    assert isinstance(model.get_submodule(f"{name}.q_proj"), torch.nn.Linear)
    assert shard_attention(model, name, None, 1, 2, (16, 16))
    assert model.get_submodule(f"{name}.q_proj").weight.shape == (16, 32)
    assert model.get_submodule(f"{name}.o_proj").weight.shape == (32, 16)


def _ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _logits_squared(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean() + 0 * y.sum()  # not the token cross-entropy: logits gathered


@pytest.mark.parametrize(("loss", "decoder"), [
    (_ce, "cls.predictions.decoder"), (_logits_squared, "cls.predictions.decoder.head")])
def test_bert_head_bias_alias_follows_the_vocab_parallel_head(
        loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], decoder: str) -> None:
    """HF ties BERT's ``cls.predictions.bias`` to its decoder's bias. Once the decoder is
    vocabulary-parallel (rank 1 of 2 here) the alias is the rank's shard too: it trains, and
    a state dict saved from the split model carries it, not the full bias left behind."""
    model = zoo.build("tiny-bert", device="cpu", seed=0)
    assert model.cls.predictions.bias is model.cls.predictions.decoder.bias  # HF's tie
    full = model.cls.predictions.bias.detach().clone()
    shard_vocab(model, "cls.predictions.decoder", "bert.embeddings.word_embeddings", None, 1,
                2, loss)
    split = model.get_submodule(decoder)
    assert isinstance(split, ColumnParallelLinear)
    assert model.cls.predictions.bias is split.bias
    state = model.state_dict()
    assert torch.equal(state["cls.predictions.bias"], full[split.start:])
    assert torch.equal(state["cls.predictions.bias"], state[f"{decoder}.bias"])


def test_fused_attention_that_cannot_give_whole_heads_is_refused_by_name() -> None:
    model = zoo.build("gpt-test", device="cpu", seed=0)
    with pytest.raises(SpecError, match=r"'blocks\.0\.attn'.*tp=2.*re-plan"):
        shard_attention(model, "blocks.0.attn", None, 0, 2, (40, 24))


def test_attention_a_plan_leaves_a_rank_no_head_stays_replicated_with_a_warning() -> None:
    """The planner gives a much slower rank no feature of OPT's q/k/v -> out_proj pair."""
    model = zoo.build("tiny-opt", device="cpu", seed=0)
    name = "model.decoder.layers.0.self_attn"
    with pytest.warns(RuntimeWarning, match=r"rank no head.*stays replicated"):
        assert not shard_attention(model, name, None, 0, 2, (64, 0))
    assert isinstance(model.get_submodule(f"{name}.q_proj"), torch.nn.Linear)


def test_the_loss_probe_accepts_cross_entropy_only() -> None:
    def ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    def summed(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="sum")

    def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out, y)

    assert is_token_cross_entropy(ce)
    assert not is_token_cross_entropy(summed)
    assert not is_token_cross_entropy(mse)  # raises on integer targets: not it


def test_attention_modules_of_gpt_test_and_hf_gpt2() -> None:
    found = attention_modules(zoo.build("gpt-test", device="cpu", seed=0))
    assert sorted(found) == [f"blocks.{i}.attn" for i in range(4)]
    assert found["blocks.0.attn"] == AttentionParts(("qkv",), "proj", 4, 4, 16, "n_heads")
    hf = attention_modules(zoo.build("tiny-gpt2", device="cpu", seed=0))
    parts = hf["transformer.h.0.attn"]
    assert (parts.attr, parts.qkv, parts.out) == ("num_heads", ("c_attn",), "c_proj")


def test_traced_single_input_layers_run_as_their_own_modules() -> None:
    model = zoo.build("gpt-test", device="cpu", seed=0)
    ids = torch.randint(0, 256, (2, 32))
    pipe = pipeline(model, mb_args=(ids,), split_spec={"blocks.2": SplitPoint.BEGINNING})
    stage = pipe.get_stage_module(1)
    assert use_eager_layers(stage, model, [("blocks.2",), ("head",), ("blocks.0",)]) == []
    assert stage.get_submodule("blocks.2") is model.blocks[2]
    assert stage.get_submodule("head") is model.head
    x = torch.randn(2, 32, 64)  # dim 64
    torch.testing.assert_close(stage(x), model.head(model.ln_f(model.blocks[3](model.blocks[2](x)))))


def test_hf_blocks_called_with_several_inputs_stay_traced_or_are_refused_by_name() -> None:
    model = zoo.build("tiny-gpt2", device="cpu", seed=0)
    args, _ = zoo.example_inputs("tiny-gpt2", batch=2, device="cpu")
    pipe = pipeline(model, mb_args=args, mb_kwargs={"use_cache": False},
                    split_spec={"transformer.h.1": SplitPoint.BEGINNING})
    stage = pipe.get_stage_module(0)
    mlp = ("transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj")
    kept = use_eager_layers(stage, model, [("transformer.h.0.attn",), mlp,
                                           ("transformer.wte",)])
    assert kept == [("transformer.h.0.attn",)]  # several inputs: runs replicated
    assert stage.get_submodule(mlp[0]) is model.transformer.h[0].mlp.c_fc
    assert stage.get_submodule("transformer.wte") is model.transformer.wte
    with pytest.raises(SpecError, match=r"'transformer\.h\.0'.*--pp 1 or --tp 1"):
        use_eager_layers(stage, model, [("transformer.h.0",)], required=["transformer.h.0"])


def test_vocab_parallel_embedding_keeps_the_padding_row_without_gradient() -> None:
    """HF OPT's token embedding has ``padding_idx=1``: its row gets no gradient."""
    emb = torch.nn.Embedding(8, 4, padding_idx=1)
    split = VocabParallelEmbedding(emb, [8], 0, None)
    split(torch.tensor([[1, 2, 1, 5]])).sum().backward()
    assert split.weight.grad is not None
    assert split.weight.grad[1].abs().sum() == 0 and split.weight.grad[2].abs().sum() > 0


def test_t5_lookups_of_the_split_vocabulary_are_all_vocab_parallel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """HF T5's ``shared``, ``encoder.embed_tokens`` and ``decoder.embed_tokens`` are three
    ``nn.Embedding`` modules on one weight (tied to ``lm_head`` too). Split over 2 ranks,
    all three are the same vocabulary-parallel embedding: the encoder looks up id 511 (past
    rank 0's rows) and, summed over the ranks (the all-reduce, faked here without a process
    group), every lookup is the full table's."""
    monkeypatch.setattr("hetplan.runtime.megatron.reduce_from_tp", lambda y, _group: y)
    full = zoo.build("tiny-t5", device="cpu", seed=0)
    ids = torch.tensor([[511, 3, 300, 7]])
    partial: dict[str, torch.Tensor] = {}
    for rank in (0, 1):
        model = zoo.build("tiny-t5", device="cpu", seed=0)
        shard_vocab(model, "lm_head", "shared", None, rank, 2, _ce)
        emb = model.get_submodule("shared")
        assert isinstance(emb, VocabParallelEmbedding)
        assert model.encoder.embed_tokens is emb and model.decoder.embed_tokens is emb
        assert model.lm_head.weight is emb.weight  # the tie stays
        model.encoder(input_ids=ids)  # an IndexError when the stacks kept nn.Embedding
        for stack in ("encoder", "decoder"):
            y = model.get_submodule(f"{stack}.embed_tokens")(ids)
            partial[stack] = partial[stack] + y if stack in partial else y
    for y in partial.values():
        torch.testing.assert_close(y, full.shared(ids), rtol=0, atol=0)


class _TiedLinears(nn.Module):
    """``y.weight`` is ``x.weight``: two linears on one matrix."""

    def __init__(self) -> None:
        super().__init__()
        self.x, self.y = nn.Linear(4, 16), nn.Linear(4, 16)
        self.y.weight = self.x.weight

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return self.x(a) + self.y(a)


@pytest.mark.parametrize("order", [("x", "y"), ("y", "x")])
def test_modules_sharing_a_parameter_are_replaced_in_any_order(
        order: tuple[str, str]) -> None:
    """Each linear of a tied pair, both being replaced, is sliced from the full matrix: the
    first replacement does not hand its shard to the other (named ``pending``)."""
    model = _TiedLinears()
    want = model.x.weight.detach()[8:].clone()
    for name in order:
        replace_module(model, name, ColumnParallelLinear.from_linear(
            model.get_submodule(name), [8, 8], 1), pending={"x", "y"})
    for name in "xy":
        split = model.get_submodule(name)
        assert isinstance(split, ColumnParallelLinear)
        assert torch.equal(split.weight.detach(), want)


def test_a_linear_left_computing_with_a_replaced_parameter_is_refused_by_name() -> None:
    """Re-pointing ``y.weight`` to ``x``'s shard would make ``y`` compute on 8 of its 16
    rows: refused, naming the alias and its holder, and the model is left as it was."""
    model = _TiedLinears()
    x = model.x
    with pytest.raises(SpecError, match=r"'y\.weight' is x\.weight.*'y' \(Linear\)"):
        replace_module(model, "x", ColumnParallelLinear.from_linear(x, [8, 8], 1))
    assert model.x is x and model.y.weight is x.weight


class _MLPBlock(nn.Module):
    """``x + fc2(relu(fc1(x)))``: one Megatron pair."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


def test_shard_model_splits_mlp_pairs_whose_linears_share_a_weight() -> None:
    """Two MLP pairs whose column linears share a weight: both are split from the full
    matrix, whichever is replaced first."""
    model = nn.Sequential(_MLPBlock(), _MLPBlock())
    model[1].fc1.weight = model[0].fc1.weight
    full = model[0].fc1.weight.detach().clone()
    ir = hetplan.capture(model, torch.randn(2, 4))
    shard_model(model, ir.layers, None, None, 1, 2)
    for block in model:
        assert isinstance(block.fc1, ColumnParallelLinear)
        assert torch.equal(block.fc1.weight.detach(), full[8:])
