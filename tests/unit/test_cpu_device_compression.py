"""Compression on the ``cpu`` device type (gloo runs): a fixed cost per (de)compression call,
and both (de)compression devices on the compute resource (the host CPU is the device)."""

from __future__ import annotations

import pytest

import hetplan
from hetplan.cost_models.compression import (
    CPU_DEVICE_CALL_S,
    CPU_THROUGHPUT_BITS_PER_S,
    CompressionModel,
)
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan_sections import CommStep, CompressedSync, GradientSync, TensorSync


def test_cpu_device_type_pays_a_fixed_cost_per_call() -> None:
    cpu = CompressionModel(ClusterSpec.from_preset("local-cpu")).cost("topk", "cpu")
    gpu_host = CompressionModel(ClusterSpec.from_preset("v100-pcie-8x8")).cost("topk", "cpu")
    n = 4096.0
    line = n * 8 / CPU_THROUGHPUT_BITS_PER_S
    assert cpu.compress_s(n) == pytest.approx(CPU_DEVICE_CALL_S[0] + line)
    assert cpu.decompress_s(n) == pytest.approx(CPU_DEVICE_CALL_S[1] + line)
    # a GPU machine's host CPUs keep the reference model (pure throughput, as in the thesis)
    assert gpu_host.compress_s(n) == pytest.approx(line)
    assert gpu_host.decompress_s(n) == pytest.approx(line)


def _iteration_ms(preset: str, device: str, dp: int = 4) -> float:
    """gpt-test, pure data parallelism, with every gradient on one flat top-k path (de)compressed on
    ``device``, re-predicted by the simulator."""
    plan = hetplan.compile("gpt-test", preset, batch_size=2 * dp, dp=dp, pp=1, tp=1)
    assert plan.model.workload is not None
    strategy = CompressedSync(
        steps=(CommStep(level="flat", routine="allgather", compressed=True),),
        compressor="topk", params={"ratio": 0.01}, compress_device=device,
        decompress_device=device)
    sync = GradientSync(strategies={"s": strategy},
                        tensors=tuple(TensorSync(name=g.name, strategy="s")
                                      for g in plan.model.workload.grads))
    plan = plan.model_copy(update={"gradient_sync": sync})
    return hetplan.simulate(plan).iteration_time_ms


def test_offloading_is_no_different_on_the_cpu_device_type() -> None:
    # on CPU ranks "gpu" and "cpu" (de)compression both run on the training cores
    assert _iteration_ms("local-cpu", "cpu") == _iteration_ms("local-cpu", "gpu")
    # (on GPU machines offloading to the host's CPU pool does change the prediction)
    assert (_iteration_ms("v100-pcie-8x8", "cpu", dp=64)
            != _iteration_ms("v100-pcie-8x8", "gpu", dp=64))
