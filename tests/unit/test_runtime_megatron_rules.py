"""Single-process rules of the runtime's Megatron tensor parallelism: heads per rank, the
loss probe, attention modules found, and which traced pipeline layers can run as their own
(sharded) modules."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.pipelining import SplitPoint, pipeline

from hetplan import zoo
from hetplan.errors import SpecError
from hetplan.runtime.megatron import attention_modules, head_shards, is_token_cross_entropy
from hetplan.runtime.pipeline import use_eager_layers


def test_heads_come_from_the_plan_in_whole_heads_else_even() -> None:
    assert head_shards(4, 16, 2) == (2, 2)
    assert head_shards(5, 16, 2) == (3, 2)
    assert head_shards(4, 16, 2, (48, 16)) == (3, 1)
    with pytest.raises(ValueError, match="whole heads"):
        head_shards(4, 16, 2, (40, 24))


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
    assert found["blocks.0.attn"] == ("n_heads", "qkv", "proj", 4, 16)
    hf = attention_modules(zoo.build("tiny-gpt2", device="cpu", seed=0))
    assert hf["transformer.h.0.attn"][:3] == ("num_heads", "c_attn", "c_proj")


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
