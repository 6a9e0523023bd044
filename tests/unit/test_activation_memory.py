"""Activation memory per transformer layer, from the captured graph, in each recomputation
mode: against Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models"), Table 2, and against the bytes autograd really keeps on CPU.

The paper's closed forms, per layer, in bytes, for sequence ``s``, micro-batch ``b``, hidden
``h``, heads ``a`` and tensor parallelism ``t`` (16-bit activations, 1-byte dropout masks):

=================================  ========================================
no parallelism                     ``s·b·h·(34 + 5·a·s/h)``
tensor parallel                    ``s·b·h·(10 + 24/t + 5·a·s/(h·t))``
tensor + sequence parallel         ``s·b·h/t·(34 + 5·a·s/h)``
TP + selective recomputation       ``s·b·h·(10 + 24/t)``
TP + SP + selective                ``s·b·h·34/t``
full recomputation                 ``2·s·b·h`` (``/t`` with SP)
=================================  ========================================

Their layer is :class:`hetplan.models.MegatronBlock` (unfused attention core, dropout on the
scores and after both residual branches, GeLU MLP of width ``4h``); the memory model reads
the layer the capture recorded (``LayerCost.act_*``), bf16 compute.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from hetplan import models
from hetplan.cost_models.memory import FP32, MIXED, layer_activations
from hetplan.ir.capture import capture
from hetplan.ir.plan_sections import LayerCost, WorkloadSummary

POINTS = [  # (s, b, h, a)
    (512, 2, 1024, 16),
    (2048, 1, 2048, 16),
    (1024, 4, 4096, 32),
    (2048, 1, 12288, 96),  # GPT-3 175B's layer
]


def _captured_layer(s: int, b: int, h: int, a: int) -> LayerCost:
    """The second transformer layer of a 3-layer MegatronGPT captured on meta (the first
    also holds the embedding dropout's mask, which the paper counts outside the layers)."""
    with torch.device("meta"):
        model = models.MegatronGPT(vocab_size=1024, max_seq=s, dim=h, n_layers=3, n_heads=a)
    ir = capture(model, (torch.zeros(b, s, dtype=torch.long),))
    layers = WorkloadSummary.from_model_ir(ir).layers
    assert layers[3].name == "blocks.1"
    return layers[3]


@pytest.fixture(scope="module", params=POINTS, ids=lambda p: "s{}-b{}-h{}-a{}".format(*p))
def point(request: pytest.FixtureRequest) -> tuple[tuple[int, int, int, int], LayerCost]:
    return request.param, _captured_layer(*request.param)


def korthikanti(s: int, b: int, h: int, a: int, t: int, mode: str, sp: bool) -> float:
    sbh = s * b * h
    core = 5 * a * s / h
    if mode == "full":
        return 2 * sbh / (t if sp else 1)
    if sp:
        return sbh / t * (34 + (core if mode == "none" else 0))
    return sbh * (10 + 24 / t + (core / t if mode == "none" else 0))


@pytest.mark.parametrize("t", [1, 2, 4, 8])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_layer_activations_match_korthikanti(point: tuple[tuple[int, int, int, int], LayerCost],
                                             t: int, sp: bool, mode: str) -> None:
    (s, b, h, a), layer = point
    model = layer_activations(layer, mode, tp=t, sequence_parallel=sp and t > 1,
                              precision=MIXED)
    paper = korthikanti(s, b, h, a, t, mode, sp and t > 1)
    assert model == pytest.approx(paper, rel=0.05), (model / paper, s, b, h, a, t, mode, sp)


def test_the_paper_terms_are_captured_exactly() -> None:
    # the breakdown of one layer at fp32 capture, in units of s*b*h*4 bytes: 16 floating
    # tensors of s*b*h elements outside the core (2 layer-norm inputs, QKV input, Q, K, V,
    # projection input, fc1 input, 4h GeLU input, 4h fc2 input), the core's softmax and
    # dropout outputs (2 * a*s/h), 1-byte masks: 2 residual dropouts and the scores' dropout
    s, b, h, a = 512, 2, 1024, 16
    layer = _captured_layer(s, b, h, a)
    unit = s * b * h * 4
    assert layer.act_attn_core_bytes / unit == pytest.approx(2 * a * s / h + a * s / h / 4)
    assert layer.act_attn_core_nonfloat_bytes / unit == pytest.approx(a * s / h / 4)
    assert layer.act_saved_nonfloat_bytes / unit == pytest.approx(0.5 + a * s / h / 4)
    assert layer.act_replicated_nonfloat_bytes / unit == pytest.approx(0.5)
    # outside the TP regions: 2 layer-norm inputs, QKV input, fc1 input (+ LN statistics)
    assert layer.act_replicated_bytes / unit == pytest.approx(4.5, abs=0.01)
    assert layer.act_in_bytes / unit == 1.0
    # QK^T and score x V: 2 * 2 * s^2 * h FLOPs per sample
    assert layer.attn_core_fwd_flops == 4 * b * s * s * h


# -- the bytes autograd really keeps, on CPU -----------------------------------------------------
class _Counter:
    """Unique storages autograd saves (parameters excluded) through saved-tensor hooks, plus
    the inputs non-reentrant checkpoints keep for their recomputation."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: set[int] = set()
        self.bytes = 0

    def add(self, t: torch.Tensor) -> None:
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.params or ptr in self.seen:
            return
        self.seen.add(ptr)
        self.bytes += t.untyped_storage().nbytes()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.add(t)
        return t

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
            yield


class _Checkpointed(torch.nn.Module):
    """Runs ``inner`` under non-reentrant activation checkpointing, counting its inputs."""

    def __init__(self, inner: torch.nn.Module, counter: _Counter) -> None:
        super().__init__()
        self.inner, self.counter = inner, counter

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        for x in args:
            self.counter.add(x)
        return checkpoint(self.inner, *args, use_reentrant=False)


def _measured(model: models.MegatronGPT, ids: torch.Tensor, mode: str) -> int:
    counter = _Counter(model)
    if mode == "full":
        model.blocks = torch.nn.ModuleList(_Checkpointed(blk, counter) for blk in model.blocks)
    elif mode == "selective":
        for blk in model.blocks:
            blk.core = _Checkpointed(blk.core, counter)  # type: ignore[assignment]
    with counter.hooks():
        out = model(ids)
    out.sum().backward()  # the graph was complete: backward runs
    return counter.bytes


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_model_matches_what_autograd_keeps_on_cpu(mode: str) -> None:
    torch.manual_seed(0)
    s, b, h, a, n = 64, 4, 64, 4, 4
    ids = torch.randint(0, 256, (b, s))
    ir = capture(models.MegatronGPT(256, s, h, n, a), (ids,))
    layers = WorkloadSummary.from_model_ir(ir).layers
    modelled = sum(layer_activations(x, mode, precision=FP32) for x in layers)
    measured = _measured(models.MegatronGPT(256, s, h, n, a), ids, mode)
    assert modelled == pytest.approx(measured, rel=0.10), (mode, modelled, measured)
