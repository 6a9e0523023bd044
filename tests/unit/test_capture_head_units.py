"""Capture records the head structure of attention projections (``LinearInfo.split_unit``).

Expected units come from each model's HF config (hidden size, head and key/value head
counts), not from the detector: whole heads (``head_dim`` features) for multi-head attention,
whole groups (``heads // kv_heads · head_dim``) on the query and output sides of
grouped-query attention and ``head_dim`` on its keys and values; no unit on MLP linears.
Linears without a unit leave the field out of the IR JSON, so the IR of a model without
attention serialises as it did before the field existed.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import hetplan
from hetplan import zoo
from hetplan.errors import SpecError
from hetplan.ir.capture.attention import attention_modules, attention_parts
from hetplan.ir.model import LinearInfo, ModelIR


def _units(name: str) -> tuple[nn.Module, dict[str, int | None]]:
    """Zoo model ``name`` (on meta, as the CLI captures) and its captured linears' units."""
    model = zoo.build(name)
    args, kwargs = zoo.example_inputs(name, batch=1)
    ir = hetplan.capture(model, args, kwargs, name=name)
    return model, {lin.name: lin.split_unit for lay in ir.layers for lin in lay.linears}


def _config_units(model: nn.Module) -> tuple[int, int]:
    """(query/output unit, key/value unit) from the HF config."""
    cfg = model.config  # type: ignore[union-attr]
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = cfg.hidden_size // heads
    return heads // kv * head_dim, head_dim


def test_gqa_llama_units_are_whole_groups_on_q_and_o_and_heads_on_k_v() -> None:
    model, units = _units("tiny-llama")
    q_unit, kv_unit = _config_units(model)
    assert (q_unit, kv_unit) == (32, 16)  # 4 heads of 16 in 2 key/value groups
    for i in range(model.config.num_hidden_layers):  # type: ignore[union-attr]
        at = f"model.layers.{i}"
        assert units[f"{at}.self_attn.q_proj"] == units[f"{at}.self_attn.o_proj"] == q_unit
        assert units[f"{at}.self_attn.k_proj"] == units[f"{at}.self_attn.v_proj"] == kv_unit
        for mlp in ("gate_proj", "up_proj", "down_proj"):
            assert units[f"{at}.mlp.{mlp}"] is None


@pytest.mark.parametrize(("name", "attn", "projections", "mlp"), [
    ("tiny-gpt2", "transformer.h.{i}.attn", ("c_attn", "c_proj"),
     ("transformer.h.{i}.mlp.c_fc", "transformer.h.{i}.mlp.c_proj")),
    ("tiny-bert", "bert.encoder.layer.{i}.attention",
     ("self.query", "self.key", "self.value", "output.dense"),
     ("bert.encoder.layer.{i}.intermediate.dense", "bert.encoder.layer.{i}.output.dense")),
    ("tiny-opt", "model.decoder.layers.{i}.self_attn",
     ("q_proj", "k_proj", "v_proj", "out_proj"),
     ("model.decoder.layers.{i}.fc1", "model.decoder.layers.{i}.fc2")),
], ids=["fused-qkv", "nested", "separate"])
def test_multi_head_attention_units_are_whole_heads(name: str, attn: str,
                                                    projections: tuple[str, ...],
                                                    mlp: tuple[str, ...]) -> None:
    model, units = _units(name)
    q_unit, kv_unit = _config_units(model)
    assert q_unit == kv_unit == 16  # 4 heads of 16, one key/value head each
    blocks = model.config.num_hidden_layers  # type: ignore[union-attr]
    for i in range(blocks):
        for p in projections:
            assert units[f"{attn.format(i=i)}.{p}"] == q_unit, (name, p)
        for m in mlp:
            assert units[m.format(i=i)] is None
    with_unit = {n for n, u in units.items() if u is not None}
    assert len(with_unit) == blocks * len(projections)


def test_model_without_attention_serialises_without_the_field() -> None:
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ir = hetplan.capture(mlp, torch.randn(2, 8))
    assert all(lin.split_unit is None for lay in ir.layers for lin in lay.linears)
    assert "split_unit" not in ir.to_json()
    assert ModelIR.from_json(ir.to_json()) == ir


def test_units_round_trip_through_the_workload_json() -> None:
    name = "tiny-llama"
    args, kwargs = zoo.example_inputs(name, batch=1)
    ir = hetplan.capture(zoo.build(name), args, kwargs, name=name)
    back = ModelIR.from_json(ir.to_json())
    assert back == ir and back.fingerprint() == ir.fingerprint()
    linears = [lin for lay in json.loads(ir.to_json())["layers"] for lin in lay["linears"]]
    assert {lin.get("split_unit") for lin in linears} == {None, 16, 32}


def test_a_non_positive_unit_in_a_workload_file_is_refused() -> None:
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ir = hetplan.capture(mlp, torch.randn(2, 8))
    data = json.loads(ir.to_json())
    data["layers"][0]["linears"][0]["split_unit"] = 0
    with pytest.raises(SpecError, match="split_unit must be >= 1"):
        ModelIR.from_json(json.dumps(data))
    assert LinearInfo("a", 8, 16, True).split_unit is None


def _interleaved_qkv_model(family: str) -> tuple[nn.Module, str, str]:
    """A tiny HF model whose fused QKV projection interleaves Q, K and V per head (2 heads
    of 16), its attention module's path and fused projection's name."""
    import transformers

    if family == "bloom":
        bloom = transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=2,
                                         bos_token_id=0, eos_token_id=0)
        return (transformers.BloomForCausalLM(bloom).eval(), "transformer.h.0.self_attention",
                "query_key_value")
    bigcode = transformers.GPTBigCodeConfig(vocab_size=64, n_embd=32, n_layer=1, n_head=2,
                                            multi_query=False, bos_token_id=0, eos_token_id=0)
    return transformers.GPTBigCodeForCausalLM(bigcode).eval(), "transformer.h.0.attn", "c_attn"


@pytest.mark.parametrize("family", ["bloom", "gpt_bigcode"])
def test_fused_qkv_interleaved_per_head_is_not_found_nor_given_units(family: str) -> None:
    """HF Bloom's ``query_key_value`` and GPTBigCode's (multi-head) ``c_attn`` have every
    shape GPT-2's fused projection has (a head count, ``head_dim``, ``3·heads·head_dim``
    outputs) but lay Q, K and V out per head, not as thirds: split as thirds a rank would
    get other heads' rows. Neither the runtime nor capture takes them for fused attention."""
    model, attn, fused = _interleaved_qkv_model(family)
    mod = model.get_submodule(attn)
    heads, head_dim = mod.num_heads, mod.head_dim
    assert heads * head_dim == 32
    assert mod.get_submodule(fused).weight.shape == (3 * 32, 32)  # what a shape check sees
    assert attention_parts(mod) is None
    assert attention_modules(model) == {}
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    ir = hetplan.capture(model, (ids,), {"use_cache": False}, name=family)
    units = {lin.name: lin.split_unit for lay in ir.layers for lin in lay.linears}
    assert f"{attn}.{fused}" in units
    assert set(units.values()) == {None}


def test_gpt2_fused_qkv_is_found_as_thirds() -> None:
    """HF GPT-2's ``c_attn`` (a ``Conv1D``, split into Q, K and V thirds) and the zoo's
    ``gpt-test`` ``qkv`` are fused attention."""
    gpt2 = zoo.build("tiny-gpt2", device="cpu", seed=0)
    parts = attention_parts(gpt2.get_submodule("transformer.h.0.attn"))
    assert parts is not None and parts.fused and parts.qkv == ("c_attn",)
    parts = attention_parts(zoo.build("gpt-test", device="cpu", seed=0).get_submodule(
        "blocks.0.attn"))
    assert parts is not None and parts.fused and (parts.qkv, parts.out) == (("qkv",), "proj")
