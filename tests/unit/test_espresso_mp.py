"""Espresso with 16-bit uncompressed steps: hand-computed pricing, the extended tree's count,
and the reference baseline's paths."""

from __future__ import annotations

import pytest

from hetplan.algorithms.dp_types import GPU
from hetplan.algorithms.espresso_tree import all_options, extended_options, options
from hetplan.cost_models.compression import GPU_THRESHOLD_BYTES
from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.evaluate import _strategy_ops
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan_sections import Stage
from hetplan.passes.espresso import strategy_for, strategy_name
from hetplan.passes.espresso_reference import reference_code_path

MIB = 2**20


@pytest.fixture(scope="module")
def costs() -> CostModel:
    return CostModel(ClusterSpec.from_preset("espresso-nvlink-8x8"))


def _ops(costs: CostModel, key: tuple[str | None, int, str], nbytes: float) -> list:
    st = Stage(index=0, first_layer=0, last_layer=0, ranks=tuple(range(64)))
    return list(_strategy_ops(strategy_for(key), nbytes, costs, st, 64, "inter", 8, 8))


def _bytes(costs: CostModel, op, group: int, link: str) -> float:
    """The bytes a comm op moved, from its alpha-beta line."""
    line = costs.comm.alpha_beta(op.label, group, link)
    return (op.duration_s - line.alpha_s) / line.beta_s_per_byte


def test_extended_tree_count() -> None:
    assert len(all_options()) == 4341
    assert len(extended_options(["fp32"])) == 4341  # the thesis' tree is the fp32 sub-tree
    assert len(extended_options()) == 4341 + 2 * 2097 == 8535
    assert len(extended_options(base=options(devices=["gpu"]))) == 174 + 2 * 129


def test_fp16_steps_halve_only_uncompressed_bytes(costs: CostModel) -> None:
    """Reference code 4 with DGC (wire ratio 0.02) on a 4 MiB fp32 tensor, 8 nodes x 8 GPUs:
    intra reduce-scatter of 2 MiB (fp16; 4 MiB in fp32), compress the 512 KiB fp32 shard,
    inter allgather of 0.02 x 512 KiB per GPU x 8 GPUs x 8 nodes = 0.02 x 4 MiB x 8 (the
    same in both precisions), decompress the 8 pieces (4 MiB), intra allgather of 2 MiB
    (4 MiB in fp32); casts: 4 MiB in, 512 KiB back before compressing, 512 KiB in after
    decompressing, 4 MiB out, each over the V100's 900 GB/s."""
    oid = reference_code_path(4)
    nb = 4.0 * MIB
    half = _ops(costs, ("dgc", oid, "fp16"), nb)
    full = _ops(costs, ("dgc", oid, "fp32"), nb)
    assert [o.label for o in full] == ["reduce_scatter", "compress", "allgather",
                                       "decompress", "allgather"]
    assert [o.label for o in half] == ["cast", "reduce_scatter", "cast+compress", "allgather",
                                       "decompress+cast", "allgather", "cast"]
    bw = costs.devices[0].mem_bandwidth_bytes_per_s
    assert half[0].duration_s == pytest.approx(nb / bw)
    assert half[-1].duration_s == pytest.approx(nb / bw)
    assert _bytes(costs, half[1], 8, "intra") == pytest.approx(2 * MIB)
    assert _bytes(costs, full[0], 8, "intra") == pytest.approx(4 * MIB)
    assert _bytes(costs, half[5], 8, "intra") == pytest.approx(2 * MIB)
    assert _bytes(costs, full[4], 8, "intra") == pytest.approx(4 * MIB)
    # compressed bytes come from the compressor on the fp32 values: unchanged by the cast
    assert _bytes(costs, half[3], 8, "inter") == pytest.approx(0.02 * 4 * MIB * 8)
    assert half[3].duration_s == full[2].duration_s
    # (de)compression times are the fp32 ones plus the fused cast of the shard
    assert half[2].duration_s == pytest.approx(full[1].duration_s + nb / 8 / bw)
    assert half[4].duration_s == pytest.approx(full[3].duration_s + nb / 8 / bw)
    assert nb / 8 <= GPU_THRESHOLD_BYTES  # (compression time constant at this size)


def test_fp16_cpu_compression_casts_on_gpu(costs: CostModel) -> None:
    """Code 5 (code 3 on the CPU): casts next to CPU (de)compression are GPU ops of their own."""
    half = _ops(costs, ("dgc", reference_code_path(5), "fp16"), 4.0 * MIB)
    labels = [o.label for o in half]
    assert labels[:3] == ["cast", "reduce_scatter", "cast"]
    assert half[2].resource == GPU and half[3].resource != GPU  # the compression is the CPU's
    assert labels[-2:] == ["allgather", "cast"]


def test_paths_without_uncompressed_steps_have_no_precision(costs: CostModel) -> None:
    oid = reference_code_path(10)  # flat allgather of compressed data
    assert [o.label for o in _ops(costs, ("dgc", oid, "fp16"), 4.0 * MIB)] == [
        o.label for o in _ops(costs, ("dgc", oid, "fp32"), 4.0 * MIB)]
    assert (oid, "fp16") not in extended_options()


def test_names() -> None:
    assert strategy_name((None, 0, "fp32")) == "fp32"
    assert strategy_name((None, 63, "fp16")) == strategy_name(("fp16", 63)) == "fp16#63"
    assert strategy_name(("dgc", 128, "fp16")) == "dgc#128+fp16"
    assert strategy_for(("dgc", 128, "bf16")).uncompressed_dtype == "bf16"  # type: ignore[union-attr]
    assert strategy_for(("fp16", 63)) == strategy_for((None, 63, "fp16"))
