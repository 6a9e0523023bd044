"""Model capture: parameter accounting, layers, FLOPs and gradient order against torch itself.

Reference values are computed here independently of hetplan: parameter counts from
``model.parameters()``, FLOPs from ``torch.utils.flop_counter.FlopCounterMode`` on a real CPU
run, gradient-ready order from post-accumulate-grad hooks on a real CPU backward.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import hetplan
from hetplan import zoo
from hetplan.errors import TraceError
from hetplan.ir.capture import capture
from hetplan.ir.capture.units import layer_units
from hetplan.ir.model import LayerKind, ModelIR, TPRole

HF_TINY = [
    "tiny-gpt2",
    "tiny-bert",
    "tiny-roberta",
    "tiny-llama",
    "tiny-mistral",
    "tiny-qwen2",
    "tiny-mixtral",
    "tiny-opt",
    "tiny-gptneox",
    "tiny-t5",
    "tiny-vit",
    "tiny-resnet",
]
CUSTOM = ["mlp", "skip-cnn", "tied-lm", "tiny-gpt"]


def _capture_zoo(name: str, device: str = "meta") -> tuple[nn.Module, ModelIR, tuple, dict]:
    """The zoo model, its capture and example inputs; a meta capture (which no test runs or
    changes) is shared by the tests that read the same model."""
    return _captured_on_meta(name) if device == "meta" else _capture_fresh(name, device)


def _capture_fresh(name: str, device: str) -> tuple[nn.Module, ModelIR, tuple, dict]:
    model = zoo.build(name, device=device, seed=0 if device != "meta" else None)
    args, kwargs = zoo.example_inputs(name, device=device)
    return model, capture(model, args, kwargs, name=name), args, kwargs


@functools.cache
def _captured_on_meta(name: str) -> tuple[nn.Module, ModelIR, tuple, dict]:
    return _capture_fresh(name, "meta")


def _unique_numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() de-duplicates ties


@pytest.mark.parametrize("name", HF_TINY + CUSTOM)
def test_capture_counts_every_parameter_once(name: str) -> None:
    model, ir, _, _ = _capture_zoo(name)
    assert ir.num_params == _unique_numel(model)
    owned = [p for layer in ir.layers for p in layer.params if p.tied_to is None]
    assert sum(p.numel for p in owned) == _unique_numel(model)
    assert len({p.name for p in owned}) == len(owned)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {g.name for g in ir.grad_tensors} == trainable
    assert len(ir.grad_tensors) == len(trainable)
    assert ir.fwd_flops > 0 and ir.bwd_flops > ir.fwd_flops


@pytest.mark.parametrize("name", HF_TINY)
def test_hf_models_go_through_export(name: str) -> None:
    _, ir, _, _ = _capture_zoo(name)
    assert ir.method == "export"


@pytest.mark.parametrize("name", CUSTOM)
def test_custom_models_go_through_fx(name: str) -> None:
    _, ir, _, _ = _capture_zoo(name)
    assert ir.method == "fx"


@pytest.mark.parametrize(
    ("name", "group"),
    [
        ("tiny-gpt2", "transformer.h"),
        ("tiny-llama", "model.layers"),
        ("tiny-mixtral", "model.layers"),
        ("tiny-bert", "bert.encoder.layer"),
        ("tiny-t5", "encoder.block"),
        ("tiny-gpt", "blocks"),
    ],
)
def test_repeated_blocks_are_one_layer_each(name: str, group: str) -> None:
    model, ir, _, _ = _capture_zoo(name)
    expected = len(model.get_submodule(group))
    blocks = [layer for layer in ir.layers if layer.group == group]
    assert len(blocks) == expected
    assert all(layer.kind is LayerKind.BLOCK for layer in blocks)
    assert [b.name for b in blocks] == [f"{group}.{i}" for i in range(expected)]
    # blocks are contiguous in dataflow order
    idx = [b.index for b in blocks]
    assert idx == list(range(idx[0], idx[0] + expected))


def test_gpt2_layers_embeddings_blocks_norm_head() -> None:
    _, ir, _, _ = _capture_zoo("tiny-gpt2")
    kinds = [layer.kind for layer in ir.layers]
    assert kinds[:2] == [LayerKind.EMBEDDING, LayerKind.EMBEDDING]
    assert kinds[-2:] == [LayerKind.NORM, LayerKind.HEAD]
    head = ir.layers[-1]
    assert head.name == "lm_head"
    (alias,) = head.params
    assert alias.tied_to == "transformer.wte.weight"  # tied embedding, counted once


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-gpt", "skip-cnn", "tiny-llama"])
def test_flops_match_torch_flop_counter_on_a_real_run(name: str) -> None:
    model, ir, args, kwargs = _capture_zoo(name, device="cpu")
    # torch has no FLOP formula for the fused CPU attention kernel: use the math path, whose
    # bmm FLOPs are what meta execution counts.
    with sdpa_kernel(SDPBackend.MATH):
        with FlopCounterMode(display=False) as fwd_counter:
            out = model(*args, **kwargs)
        fwd = fwd_counter.get_total_flops()
        loss = _sum_float_outputs(out)
        with FlopCounterMode(display=False) as bwd_counter:
            loss.backward()
    assert ir.fwd_flops == fwd
    assert ir.bwd_flops == bwd_counter.get_total_flops()


def _sum_float_outputs(out: object) -> torch.Tensor:
    leaves = torch.utils._pytree.tree_leaves(out)
    parts = [t.float().sum() for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
    return torch.stack(parts).sum()


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-gpt", "mlp", "tied-lm", "tiny-llama"])
def test_gradient_order_is_autograds_order(name: str) -> None:
    model, ir, args, kwargs = _capture_zoo(name, device="cpu")
    names = {id(p): n for n, p in model.named_parameters()}
    order: list[str] = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda t: order.append(names[id(t)]))
    _sum_float_outputs(model(*args, **kwargs)).backward()
    assert [g.name for g in ir.grad_tensors] == order


def test_mlp_activation_bytes_by_hand() -> None:
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ir = capture(mlp, torch.randn(5, 8))
    first, second = ir.layers
    assert (first.name, second.name) == ("0", "2")
    assert first.act_in_bytes == 5 * 8 * 4
    # the ReLU is glue: it runs with the next layer, so layer 0 hands over its raw output
    assert first.act_out_bytes == 5 * 16 * 4
    assert second.act_out_bytes == 5 * 4 * 4
    # Linear: 2*B*in*out forward; backward = dX (except for the first layer) + dW
    assert first.fwd_flops == 2 * 5 * 8 * 16
    assert second.fwd_flops == 2 * 5 * 16 * 4
    assert second.bwd_flops == 2 * (2 * 5 * 16 * 4)


def test_megatron_pairs_in_a_llama_block() -> None:
    _, ir, _, _ = _capture_zoo("tiny-llama")
    block = ir.layer("model.layers.0")
    roles = {lin.name.rsplit(".", 1)[-1]: lin for lin in block.linears}
    for col in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        assert roles[col].tp_role is TPRole.COLUMN
    for row in ("o_proj", "down_proj"):
        assert roles[row].tp_role is TPRole.ROW
    assert roles["o_proj"].pair == "model.layers.0.self_attn.v_proj"
    assert roles["q_proj"].pair == "model.layers.0.self_attn.o_proj"
    assert roles["down_proj"].pair == "model.layers.0.mlp.up_proj"


def test_capture_does_not_touch_a_real_model() -> None:
    model = zoo.build("tiny-gpt", device="cpu", seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args, kwargs = zoo.example_inputs("tiny-gpt", device="cpu")
    capture(model, args, kwargs)
    for n, p in model.named_parameters():
        assert p.device.type == "cpu"
        assert torch.equal(p, before[n])
        assert p.grad is None


def test_capture_is_deterministic() -> None:
    a = _capture_fresh("tiny-gpt2", "meta")[1]
    b = _capture_fresh("tiny-gpt2", "meta")[1]
    assert a.to_json() == b.to_json()
    assert a.fingerprint() == b.fingerprint()


def test_fingerprint_changes_with_batch_shape() -> None:
    model = zoo.build("tiny-gpt")
    a = capture(model, *zoo.example_inputs("tiny-gpt", batch=2))
    b = capture(model, *zoo.example_inputs("tiny-gpt", batch=4))
    assert a.fingerprint() != b.fingerprint()


def test_data_dependent_branch_is_a_trace_error_naming_the_module() -> None:
    model = zoo.build("data-dependent")
    args, kwargs = zoo.example_inputs("data-dependent")
    with pytest.raises(TraceError) as info:
        capture(model, args, kwargs)
    assert info.value.module == "gate"
    text = str(info.value)
    assert "'gate'" in text and "DataDependentGate" in text
    assert "opaque_modules=['gate']" in text


def test_opaque_escape_hatch_captures_the_data_dependent_model() -> None:
    model = zoo.build("data-dependent")
    args, kwargs = zoo.example_inputs("data-dependent")
    ir = capture(model, args, kwargs, opaque_modules=["gate"])
    assert ir.num_params == _unique_numel(model)
    gate = ir.layer("gate")
    assert gate.kind is LayerKind.OPAQUE
    assert gate.fwd_flops > 0 and gate.bwd_flops == 2 * gate.fwd_flops
    assert [layer.name for layer in ir.layers] == ["fc_in", "gate", "fc_out"]
    assert {g.name for g in ir.grad_tensors} == {n for n, _ in model.named_parameters()}


def test_unknown_opaque_module_suggests_names() -> None:
    model = zoo.build("data-dependent")
    with pytest.raises(TraceError, match=r"did you mean 'gate'\?"):
        capture(model, *zoo.example_inputs("data-dependent"), opaque_modules=["gat"])


def test_not_a_module_and_parameterless_module() -> None:
    with pytest.raises(TraceError, match="needs a torch.nn.Module"):
        capture(lambda x: x, torch.randn(2))  # type: ignore[arg-type]
    with pytest.raises(TraceError, match="no parameters"):
        capture(nn.ReLU(), torch.randn(2))


def test_unused_parameters_are_reported() -> None:
    class Unused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Linear(4, 4)
            self.spare = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    with pytest.raises(TraceError, match="never used in forward.*spare"):
        capture(Unused(), torch.randn(2, 4))


def test_frozen_parameters_have_no_gradient() -> None:
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    mlp[0].weight.requires_grad_(False)
    ir = capture(mlp, torch.randn(5, 8))
    assert ir.num_params == _unique_numel(mlp)
    assert "0.weight" not in {g.name for g in ir.grad_tensors}
    assert not ir.layers[0].params[0].requires_grad


def test_module_called_twice_gives_a_second_invocation_layer() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(self.b(self.a(x)))

    ir = capture(Twice(), torch.randn(3, 4))
    assert [layer.name for layer in ir.layers] == ["a", "b", "a@1"]
    assert all(p.tied_to is not None for p in ir.layer("a@1").params)
    assert ir.num_params == 40


def test_layer_units_policy_on_plain_modules() -> None:
    units = layer_units(zoo.build("skip-cnn"))
    assert units, "a CNN must have layers"
    assert all(u.kind is not LayerKind.PARAMS for u in units.values())
    assert hetplan.capture is capture


def _llama(layers: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


def _t5(layers: int) -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        d_model=32, d_ff=64, num_layers=layers, num_heads=4, d_kv=8, vocab_size=128,
        decoder_start_token_id=0,
    )
    with torch.device("meta"):
        return T5ForConditionalGeneration(cfg)


@pytest.mark.parametrize(
    ("build", "inputs"),
    [
        (lambda: _llama(5), lambda: ((torch.zeros(2, 8, dtype=torch.long),), {"use_cache": False})),
        (
            lambda: _t5(4),
            lambda: (
                (torch.zeros(2, 8, dtype=torch.long),),
                {"decoder_input_ids": torch.zeros(2, 8, dtype=torch.long), "use_cache": False},
            ),
        ),
        (lambda: zoo.build("gpt-test"), lambda: zoo.example_inputs("gpt-test")),
    ],
    ids=["llama-5-layers", "t5-4-layers", "gpt-test"],
)
def test_block_reuse_equals_a_full_capture(build, inputs, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from hetplan.ir import block_reuse

    expanded = []
    original = block_reuse.expand_blocks

    def spy(ir, cuts):  # type: ignore[no-untyped-def]
        result = original(ir, cuts)
        expanded.append(result is not None)
        return result

    monkeypatch.setattr(block_reuse, "expand_blocks", spy)
    model = build()
    args, kwargs = inputs()
    full = capture(model, args, kwargs, reuse_blocks=False)
    assert expanded == []
    fast = capture(model, args, kwargs, reuse_blocks=True)
    assert expanded == [True], "the shortcut must have been taken"
    assert len(full.layers) == len(fast.layers)
    assert fast.to_json() == full.to_json()


def test_block_reuse_leaves_the_model_whole() -> None:
    model = _llama(5)
    capture(model, (torch.zeros(1, 4, dtype=torch.long),), {"use_cache": False})
    assert len(model.model.layers) == 5
