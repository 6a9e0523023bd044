"""Unit tests of the compression cost model: wire ratios, time-model shapes, provenance."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetplan.cost_models.compression import (
    COMPRESSORS,
    GPU_THRESHOLD_BYTES,
    AffineTime,
    CompressionModel,
    PiecewiseTime,
    TableTime,
    wire_ratio,
)
from hetplan.cost_models.profile_db import CompressorRecord, CompressorSample, ProfileDB
from hetplan.errors import SpecError
from hetplan.ir.cluster import ClusterSpec

MIB = 2**20


@pytest.fixture(scope="module")
def v100() -> ClusterSpec:
    return ClusterSpec.from_preset("v100-nvlink-8x8")


# -- wire ratios ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("compressor", "kwargs", "expected"),
    [
        ("fp16", {}, 0.5),
        ("bf16", {}, 0.5),
        ("topk", {}, 0.02),  # 2 x 0.01: fp32 value + int32 index per kept element
        ("randomk", {"ratio": 0.05}, 0.1),
        ("dgc", {"ratio": 0.001}, 0.002),
        ("efsignsgd", {}, 1 / 32),
        ("onebit", {}, 1 / 32),
        ("qsgd", {}, 8 / 32),  # s = 127: sign + 7 bits
        ("qsgd", {"levels": 1}, 2 / 32),
        ("qsgd", {"levels": 15}, 5 / 32),
        ("powersgd", {"shape": (1024, 1024)}, 4 * 2048 / 1024**2),
        ("powersgd", {"shape": (64, 3, 3, 3), "rank": 4}, 4 * (64 + 27) / (64 * 27)),
        ("powersgd", {"shape": (4096,)}, 1.0),  # 1-D tensors are sent raw
        ("powersgd", {"shape": (8, 8), "rank": 8}, 1.0),  # never more than raw
        ("powersgd", {"nbytes": 4 * MIB}, 8 / 1024),  # square 1024 x 1024 approximation
    ],
)
def test_wire_ratios(compressor: str, kwargs: dict[str, object], expected: float) -> None:
    assert wire_ratio(compressor, **kwargs) == pytest.approx(expected)  # type: ignore[arg-type]


def test_wire_ratio_errors() -> None:
    with pytest.raises(ValueError, match="shape or nbytes"):
        wire_ratio("powersgd")
    with pytest.raises(SpecError, match="did you mean 'topk'"):
        wire_ratio("top-k")
    with pytest.raises(SpecError, match="ratio"):
        wire_ratio("topk", ratio=0.0)


def test_cost_carries_parameters_into_wire_ratio(v100: ClusterSpec) -> None:
    model = CompressionModel(v100)
    cost = model.cost("topk", "gpu", ratio=0.001)
    assert cost.wire_ratio() == pytest.approx(0.002)
    assert cost.wire_bytes(1e6) == pytest.approx(2e3)
    ps = model.cost("powersgd", "gpu", rank=2)
    assert ps.wire_bytes(4 * 100 * 200, shape=(100, 200)) == pytest.approx(4 * 2 * 300)


# -- time models ----------------------------------------------------------------------------
def test_piecewise_is_constant_below_threshold_then_linear() -> None:
    f = PiecewiseTime(constant_s=1e-4, threshold_bytes=4 * MIB, beta_s_per_byte=1e-10)
    assert f(1) == f(1024) == f(4 * MIB) == 1e-4
    assert f(5 * MIB) == pytest.approx(1e-4 + 1e-10 * MIB)
    assert f(0) == 0.0


def test_affine_and_table() -> None:
    assert AffineTime(1e-5, 1e-9)(1e6) == pytest.approx(1.01e-3)
    t = TableTime((100.0, 200.0, 400.0), (1.0, 2.0, 2.0))
    assert t(50) == 1.0  # below the table: first value
    assert t(150) == pytest.approx(1.5)  # interpolated
    assert t(300) == pytest.approx(2.0)
    assert t(800) == pytest.approx(2.0)  # flat last segment extended
    assert TableTime((100.0, 200.0), (1.0, 3.0))(300) == pytest.approx(5.0)
    assert TableTime((100.0,), (1.0,))(400) == pytest.approx(4.0)  # one point: proportional
    with pytest.raises(ValueError, match="increase"):
        TableTime((2.0, 1.0), (1.0, 1.0))


# -- analytic defaults ----------------------------------------------------------------------
def test_gpu_defaults_on_v100_follow_reference_constants(v100: ClusterSpec) -> None:
    cost = CompressionModel(v100).cost("dgc", "gpu")  # the only device type: V100-SXM2-32GB
    assert cost.source == "analytic" and cost.device_type == "V100-SXM2-32GB"
    # dgc: total 390 µs, decode 34 µs -> encode 356 µs, constant up to 4 MiB
    for size in (1024, MIB, GPU_THRESHOLD_BYTES):
        assert cost.compress_s(size) == pytest.approx(356e-6)
        assert cost.decompress_s(size) == pytest.approx(34e-6)
    # then proportional to size on V100 (900 GB/s = the reference)
    assert cost.compress_s(2 * GPU_THRESHOLD_BYTES) == pytest.approx(2 * 356e-6)
    assert cost.compress_s(10 * GPU_THRESHOLD_BYTES) == pytest.approx(10 * 356e-6)


def test_gpu_defaults_scale_slope_by_memory_bandwidth() -> None:
    a100 = ClusterSpec.from_preset("a100-nvlink-8x8")
    cost = CompressionModel(a100).cost("efsignsgd", "gpu")
    assert cost.compress_s(MIB) == pytest.approx(130e-6)  # constant part not scaled
    expected = 130e-6 + 130e-6 * (900 / 2039)  # one extra 4 MiB at 900/2039 of V100's slope
    assert cost.compress_s(2 * GPU_THRESHOLD_BYTES) == pytest.approx(expected)
    assert "A100-80GB" in cost.detail


def test_cpu_default_is_20_gbit_throughput(v100: ClusterSpec) -> None:
    cost = CompressionModel(v100).cost("onebit", "cpu")
    assert cost.compress_s(100e6) == pytest.approx(100e6 * 8 / 20e9)  # 40 ms
    assert cost.decompress_s(100e6) == pytest.approx(0.04)
    assert cost.compress_s(0) == 0.0 and cost.source == "analytic"


def test_mixed_cluster_default_device_type() -> None:
    model = CompressionModel(ClusterSpec.from_preset("mixed-generations"))
    ref = model.cost("topk", "gpu")
    assert ref.device_type is None and "reference V100" in ref.detail
    assert model.cost("topk", "gpu", "A100-80GB").compress_s(8 * MIB) < ref.compress_s(8 * MIB)


def test_bad_requests(v100: ClusterSpec) -> None:
    model = CompressionModel(v100)
    with pytest.raises(SpecError, match="did you mean 'powersgd'"):
        model.cost("powersdg", "gpu")
    with pytest.raises(SpecError, match="device_kind"):
        model.cost("topk", "tpu")  # type: ignore[arg-type]
    with pytest.raises(SpecError, match="unknown device type"):
        model.cost("topk", "gpu", "V100-SXM3")
    local = CompressionModel(ClusterSpec.from_preset("local-cpu"))
    assert local.cost("topk", "cpu").source == "analytic"
    # on the cpu device type, "gpu" means the device itself: its CPU cost
    on_device = local.cost("topk", "gpu")
    assert on_device.device_kind == "cpu"
    assert on_device.compress_s(1e6) == local.cost("topk", "cpu").compress_s(1e6)


# -- profiled -------------------------------------------------------------------------------
def _db() -> ProfileDB:
    rec = CompressorRecord(compressor="topk", device_kind="gpu", device_type="V100-SXM2-32GB",
                           samples=(
                               CompressorSample(nbytes=MIB, compress_s=1e-4, decompress_s=2e-5),
                               CompressorSample(nbytes=4 * MIB, compress_s=1e-4,
                                                decompress_s=2e-5),
                               CompressorSample(nbytes=16 * MIB, compress_s=4e-4,
                                                decompress_s=8e-5),
                           ))
    return ProfileDB(compressors=(rec,))


def test_profiled_table_beats_defaults(v100: ClusterSpec) -> None:
    model = CompressionModel(v100, _db())
    cost = model.cost("topk", "gpu")
    assert cost.source == "profiled" and "3 samples" in cost.detail
    assert cost.compress_s(512 * 1024) == pytest.approx(1e-4)  # constant below the table
    assert cost.compress_s(10 * MIB) == pytest.approx(2.5e-4)  # interpolated
    assert cost.decompress_s(10 * MIB) == pytest.approx(5e-5)
    assert cost.compress_s(28 * MIB) == pytest.approx(7e-4)  # extended
    assert model.cost("topk", "cpu").source == "analytic"
    assert model.cost("dgc", "gpu").source == "analytic"
    assert model.cost("topk", "gpu") is cost  # cached


@settings(max_examples=200, deadline=None)
@given(
    compressor=st.sampled_from(COMPRESSORS),
    kind=st.sampled_from(["gpu", "cpu"]),
    preset=st.sampled_from(["v100-nvlink-8x8", "a100-nvlink-8x8", "h100-1024"]),
    a=st.floats(0, 1e10),
    b=st.floats(0, 1e10),
)
def test_times_monotonic_in_bytes(
    compressor: str, kind: str, preset: str, a: float, b: float
) -> None:
    cluster = ClusterSpec.from_preset(preset)
    model = CompressionModel(cluster, _db())
    cost = model.cost(compressor, kind)  # type: ignore[arg-type]
    lo, hi = sorted((a, b))
    assert 0 <= cost.compress_s(lo) <= cost.compress_s(hi)
    assert 0 <= cost.decompress_s(lo) <= cost.decompress_s(hi)
