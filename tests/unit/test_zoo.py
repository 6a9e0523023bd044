"""Tests of the built-in model zoo (hetplan.zoo) and the custom models (hetplan.models)."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest
import torch
import torch.fx

from hetplan import zoo
from hetplan.errors import SpecError
from hetplan.models import TiedLM, TinyGPT

# Published parameter counts, typed in from the sources named; never computed from our code.
PUBLISHED_PARAMS: dict[str, float] = {
    # openai/gpt-2 repo (README / download_model.py): released models 124M, 355M, 774M, 1558M.
    "gpt2": 124e6,
    "gpt2-medium": 355e6,
    "gpt2-xl": 1558e6,
    # google-bert model cards: bert-base-uncased "110M parameters"; bert-large-uncased "336M".
    "bert-base": 110e6,
    "bert-large": 336e6,
    # Llama 2 HF model cards / Hub metadata: 6,738,415,616 (7B); 13.0B; 68,976,648,192 (70B).
    "llama-7b": 6_738_415_616,
    "llama-13b": 13.016e9,
    "llama-70b": 68.98e9,
    # Mistral AI, "Mixtral of experts" (Dec 2023): "46.7B total parameters".
    "mixtral-8x7b": 46.7e9,
    # google-t5/t5-base on the HF Hub: 223M params.
    "t5-base": 223e6,
    # Dosovitskiy et al. 2021, Table 1: ViT-Base 86M.
    "vit-base": 86e6,
    # torchvision model docs: resnet50 25,557,032; resnet101 44,549,160 params.
    "resnet-50": 25_557_032,
    "resnet-101": 44_549_160,
}

FULL = sorted(PUBLISHED_PARAMS)
TINY_HF = [
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
CUSTOM = ["mlp", "skip-cnn", "tied-lm", "tiny-gpt", "gpt-test", "megatron-gpt-test",
          "data-dependent"]
FX_TRACEABLE = ["mlp", "skip-cnn", "tied-lm", "tiny-gpt", "gpt-test", "megatron-gpt-test"]


def _unique_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() dedups tied weights


def _parse_approx(text: str) -> float:
    m = re.fullmatch(r"~?([0-9.]+)([KMB])", text)
    assert m, f"unparseable params_approx {text!r}"
    return float(m.group(1)) * {"K": 1e3, "M": 1e6, "B": 1e9}[m.group(2)]


def _first_tensor(out: object) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    assert isinstance(logits, torch.Tensor), f"no logits in {type(out).__name__}"
    return logits


def test_registry_names() -> None:
    assert set(FULL + TINY_HF + CUSTOM) == set(zoo.ZOO)
    names = [e.name for e in zoo.list_models()]
    assert names == sorted(names)
    assert {e.name for e in zoo.list_models(family="custom")} == set(CUSTOM)
    assert {e.name for e in zoo.list_models(size="full")} == set(FULL)
    for name, entry in zoo.ZOO.items():
        assert entry.name == name
        assert entry.size in ("full", "tiny")
        assert entry.input_kind in ("tokens", "seq2seq", "image", "features")


def test_entry_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        zoo.get("gpt2").name = "x"  # type: ignore[misc]


def test_import_is_cheap() -> None:
    code = "import sys, hetplan.zoo; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unknown_name_suggests() -> None:
    with pytest.raises(SpecError, match=r"did you mean 'gpt2'"):
        zoo.get("gtp2")
    with pytest.raises(SpecError, match=r"did you mean .*'llama-70b'"):
        zoo.build("lama-70b")
    with pytest.raises(SpecError, match="unknown model"):
        zoo.example_inputs("no-such-model-anywhere")
    with pytest.raises(SpecError, match="see `hetplan models`"):  # the CLI user's listing
        zoo.get("tiny-gtp2")


def test_name_normalization() -> None:
    assert zoo.get("GPT2_Medium").name == "gpt2-medium"


@pytest.mark.parametrize("name", sorted(zoo.ZOO))
def test_builds_on_meta(name: str) -> None:
    model = zoo.build(name)
    params = list(model.parameters())
    assert params and all(p.device.type == "meta" for p in params)
    # params_approx stays within 10% of the real count.
    approx = _parse_approx(zoo.get(name).params_approx)
    assert _unique_params(model) == pytest.approx(approx, rel=0.1)


@pytest.mark.parametrize("name", FULL)
def test_full_size_param_counts(name: str) -> None:
    n = _unique_params(zoo.build(name))
    assert n == pytest.approx(PUBLISHED_PARAMS[name], rel=0.01), f"{name}: {n:,}"


def test_exact_known_counts() -> None:
    assert _unique_params(zoo.build("gpt2")) == 124_439_808
    assert _unique_params(zoo.build("llama-7b")) == 6_738_415_616
    assert _unique_params(zoo.build("resnet-50")) == 25_557_032


def test_tied_weights() -> None:
    gpt2 = zoo.build("gpt2")
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight
    lm = zoo.build("tied-lm")
    assert isinstance(lm, TiedLM) and lm.head.weight is lm.embed.weight
    named = dict(lm.named_parameters(remove_duplicate=False))
    assert "head.weight" in named and "embed.weight" in named


@pytest.mark.parametrize("name", TINY_HF + CUSTOM)
def test_tiny_cpu_forward(name: str) -> None:
    model = zoo.build(name, device="cpu", seed=0)
    args, kwargs = zoo.example_inputs(name, device="cpu")
    if name == "data-dependent":
        out = model(*args, **kwargs)  # eager execution is fine; only tracing fails
        assert out.shape == (zoo.get(name).default_batch, 4)
        return
    out = _first_tensor(model(*args, **kwargs))
    assert torch.isfinite(out).all()
    assert out.shape[0] == zoo.get(name).default_batch


@pytest.mark.parametrize("name", FX_TRACEABLE)
def test_fx_symbolic_trace(name: str) -> None:
    model = zoo.build(name, device="cpu", seed=0).eval()
    gm = torch.fx.symbolic_trace(model)
    args, kwargs = zoo.example_inputs(name, device="cpu")
    torch.testing.assert_close(gm(*args, **kwargs), model(*args, **kwargs))


def test_fx_fails_on_data_dependent() -> None:
    with pytest.raises(torch.fx.proxy.TraceError):
        torch.fx.symbolic_trace(zoo.build("data-dependent"))


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama", "tiny-bert", "tiny-t5", "tiny-vit"])
def test_export_on_meta(name: str) -> None:
    model = zoo.build(name)
    args, kwargs = zoo.example_inputs(name)
    ep = torch.export.export(model, args, kwargs=kwargs, strict=False)
    assert any(n.op == "call_function" for n in ep.graph.nodes)


def test_export_fails_on_data_dependent() -> None:
    args, kwargs = zoo.example_inputs("data-dependent")
    with pytest.raises(Exception, match="data-dependent"):
        torch.export.export(zoo.build("data-dependent"), args, kwargs=kwargs, strict=False)


def test_example_inputs_conventions() -> None:
    (ids,), kw = zoo.example_inputs("llama-70b", batch=2, seq=8)
    assert ids.shape == (2, 8) and ids.dtype == torch.long and ids.device.type == "meta"
    assert kw == {"use_cache": False}
    (ids,), kw = zoo.example_inputs("bert-base")
    assert ids.shape == (32, 512) and kw == {}
    (ids,), kw = zoo.example_inputs("t5-base", batch=2, seq=8)
    assert kw["decoder_input_ids"].shape == (2, 8) and kw["use_cache"] is False
    (px,), kw = zoo.example_inputs("vit-base", batch=3, seq=999, dtype=torch.bfloat16)
    assert px.shape == (3, 3, 224, 224) and px.dtype == torch.bfloat16 and kw == {}
    (ids,), _ = zoo.example_inputs("tiny-llama", batch=4, seq=32, device="cpu")
    assert 0 <= int(ids.min()) and int(ids.max()) < 512
    (ids2,), _ = zoo.example_inputs("tiny-llama", batch=4, seq=32, device="cpu")
    assert torch.equal(ids, ids2)
    with pytest.raises(SpecError, match="batch"):
        zoo.example_inputs("gpt2", batch=0)


def test_build_dtype_and_seed() -> None:
    model = zoo.build("tiny-llama", device="cpu", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert torch.get_default_dtype() == torch.float32
    state = torch.random.get_rng_state()
    a = zoo.build("tiny-gpt", device="cpu", seed=3)
    b = zoo.build("tiny-gpt", device="cpu", seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert isinstance(a, TinyGPT)
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa, pb)
    with pytest.raises(SpecError, match="floating"):
        zoo.build("mlp", dtype=torch.int64)


@pytest.mark.parametrize("name", [n for n in TINY_HF + CUSTOM
                                  if zoo.get(n).input_kind in ("tokens", "seq2seq")])
def test_max_seq_is_what_the_model_takes(name: str) -> None:
    """``max_seq`` is the longest sequence the tiny model runs on CPU (one more fails: its
    position embeddings end); an entry without one runs a long sequence."""
    model = zoo.build(name, device="cpu", seed=0)
    limit = zoo.get(name).max_seq

    def runs(seq: int) -> bool:
        entry = dataclasses.replace(zoo.get(name), max_seq=None)  # past the refusal
        args, kwargs = entry.example_inputs(1, seq, device="cpu")
        try:
            with torch.no_grad():
                model(*args, **kwargs)
        except (IndexError, RuntimeError):
            return False
        return True

    if limit is None:
        assert runs(300)
    else:
        assert runs(limit) and not runs(limit + 1)


def test_example_inputs_refuse_a_sequence_past_the_positions() -> None:
    """Was: meta inputs of any length (capture on meta does not check the indices)."""
    assert zoo.example_inputs("tiny-gpt2", batch=1, seq=128)[0][0].shape == (1, 128)
    with pytest.raises(SpecError, match=r"seq 129: tiny-gpt2 has 128 positions"):
        zoo.example_inputs("tiny-gpt2", batch=1, seq=129)
    with pytest.raises(SpecError, match="at most 1024"):
        zoo.example_inputs("gpt2", seq=2048)
