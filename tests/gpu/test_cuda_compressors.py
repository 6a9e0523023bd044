"""The runtime compressors on CUDA tensors: payloads stay on the GPU, results agree with the
CPU path, error feedback works there, and a path that offloads (de)compression to the CPU
(pinned buffers) gives the same sum. Skipped visibly without CUDA; ``pytest -m gpu``."""

from __future__ import annotations

import pytest
import torch

from hetplan.cost_models.compression import COMPRESSORS
from hetplan.ir.plan_sections import CommStep, CompressedSync
from hetplan.runtime.compressors import ErrorFeedback, make_compressor
from hetplan.runtime.routines import Level, PathRunner, SyncLevels

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

N = 1 << 16


def _x() -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", COMPRESSORS)
def test_cuda_round_trip_stays_on_the_gpu(name: str) -> None:
    comp = make_compressor(name)
    x = _x().cuda()
    payload = comp.compress(x, seed=1)
    assert all(t.is_cuda for t in payload)
    y = comp.decompress(payload, N)
    assert y.is_cuda and y.shape == (N,) and torch.isfinite(y).all()


@pytest.mark.parametrize("name", ["fp16", "bf16", "topk", "randomk", "efsignsgd", "onebit"])
def test_cuda_agrees_with_cpu(name: str) -> None:
    comp = make_compressor(name)
    x = _x()
    cpu = comp.roundtrip(x, seed=3)
    gpu = comp.roundtrip(x.cuda(), seed=3).cpu()
    assert torch.allclose(cpu, gpu, rtol=1e-5, atol=1e-6)


def test_cuda_error_feedback() -> None:
    comp, ef = make_compressor("topk"), ErrorFeedback()
    sent = torch.zeros(N, device="cuda")
    total = torch.zeros(N, device="cuda")
    for t in range(3):
        x = _x().cuda() * (t + 1)
        total += x
        sent += comp.decompress(ef.compress(comp, "s", x), N)
    assert ef.residuals["s"].is_cuda
    assert torch.allclose(sent + ef.residuals["s"], total, atol=1e-4)


def test_cpu_offloaded_path_on_cuda_gradients() -> None:
    """comp on the CPU (pinned copy), decomp on the GPU, on a one-rank group: the result is
    the compressor's round trip, back on the GPU."""
    levels = SyncLevels(Level(None, (0,), 0))
    strategy = CompressedSync(compressor="efsignsgd", compress_device="cpu",
                              decompress_device="gpu", error_feedback=False,
                              steps=(CommStep(routine="allgather", compressed=True),))
    x = _x().cuda()
    got = PathRunner(levels, torch.device("cuda")).run(x, strategy)
    assert got.is_cuda
    assert torch.allclose(got.cpu(), make_compressor("efsignsgd").roundtrip(x.cpu()), atol=1e-6)
