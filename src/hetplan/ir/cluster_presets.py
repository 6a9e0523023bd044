"""The numbers behind hetplan's built-in device types and cluster presets.

Datasheet figures for the device types and the seeds' testbeds (plus common machines) for the
presets, as plain dicts in the form a user writes a spec: :mod:`hetplan.ir.cluster` validates
them into :data:`~hetplan.ir.cluster.DEVICE_CATALOGUE` (a ``DeviceSpec`` per entry of
:data:`DEVICE_TYPES`) and :data:`~hetplan.ir.cluster.PRESETS` (a ``ClusterSpec`` per entry of
:data:`PRESET_SPECS`). Data only, apart from the schema, so that adding a machine touches this
file alone; ``examples/clusters/*.yaml`` are generated from the presets
(``python -m hetplan.ir.cluster examples/clusters``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["DEVICE_TYPES", "PRESET_SPECS"]


# Dense (no structured sparsity) peaks from NVIDIA's datasheets; fp64 is the non-tensor-core
# vector rate.
# - V100: "NVIDIA Tesla V100 GPU Accelerator" datasheet (2020): SXM2 7.8 fp64 / 15.7 fp32 /
#   125 tensor (fp16); PCIe 7 / 14 / 112; HBM2 900 GB/s for both; 16 or 32 GB.
# - A100: "NVIDIA A100 Tensor Core GPU" datasheet (SXM): 9.7 fp64, 19.5 fp32, 156 tf32,
#   312 fp16/bf16, 624 int8 TOPS; 1,555 GB/s (40GB) and 2,039 GB/s (80GB).
# - H100: "NVIDIA H100 Tensor Core GPU" datasheet (SXM5): 34 fp64, 67 fp32; the sheet lists
#   sparse tensor rates (989 tf32, 1,979 fp16/bf16, 3,958 fp8/int8), dense is half of them;
#   3.35 TB/s.
# - cpu: order-of-magnitude placeholders for one gloo process on a few cores; run
#   `hetplan profile` to replace them with measurements.
def _gpu(mem: float, bw: float, **tflops: float) -> dict[str, Any]:
    return {"memory_gib": mem, "mem_bandwidth_gb_s": bw, "peak_tflops": tflops}


_V100_SXM2 = {"fp64": 7.8, "fp32": 15.7, "fp16": 125.0}
_V100_PCIE = {"fp64": 7.0, "fp32": 14.0, "fp16": 112.0}
_A100 = {"fp64": 9.7, "fp32": 19.5, "tf32": 156.0, "fp16": 312.0, "bf16": 312.0, "int8": 624.0}
_H100 = {
    "fp64": 34.0,
    "fp32": 67.0,
    "tf32": 494.7,
    "fp16": 989.4,
    "bf16": 989.4,
    "fp8": 1978.9,
    "int8": 1978.9,
}

#: Built-in device types (``DeviceSpec`` fields by type name).
DEVICE_TYPES: dict[str, dict[str, Any]] = {
    "V100-SXM2-16GB": _gpu(16, 900, **_V100_SXM2),
    "V100-SXM2-32GB": _gpu(32, 900, **_V100_SXM2),
    "V100-PCIe-16GB": _gpu(16, 900, **_V100_PCIE),
    "V100-PCIe-32GB": _gpu(32, 900, **_V100_PCIE),
    "A100-40GB": _gpu(40, 1555, **_A100),
    "A100-80GB": _gpu(80, 2039, **_A100),
    "H100-80GB": _gpu(80, 3350, **_H100),
    "cpu": {"memory_gib": 4, "mem_bandwidth_gb_s": 20, "peak_tflops": {"fp64": 0.05, "fp32": 0.1},
            "comm_overlaps_compute": False},
}

# Links. Per-direction bandwidth per device (intra) or per node (inter); latencies are
# typical small-message figures for an alpha-beta model, to be replaced by `hetplan profile`.
# NVLink 2/3/4: 300/600/900 GB/s per GPU bidirectional (V100/A100/H100 datasheets) = 1200/
# 2400/3600 Gbit/s each way. PCIe 3.0 x16: 8 GT/s x 16 lanes x 128/130 = 126 Gbit/s.
_NVLINK2 = {"kind": "nvlink", "bandwidth_gbps": 1200.0, "latency_us": 2.0}
_NVLINK3 = {"kind": "nvlink", "bandwidth_gbps": 2400.0, "latency_us": 2.0}
_NVLINK4 = {"kind": "nvlink", "bandwidth_gbps": 3600.0, "latency_us": 2.0}
_PCIE3 = {"kind": "pcie", "bandwidth_gbps": 126.0, "latency_us": 3.0}
# Loopback: gloo between the processes of one CPU machine, measured on the 2-core machine the
# CPU presets describe with 4 processes (bench/cpu_link.py converts a measured all-reduce
# line into the link the analytic ring model turns back into it: latency = α / 2(n−1),
# bandwidth = 2(n−1)/n / β). Quiet machine (bench/results/fidelity_cpu.json, 2026-11-21, other
# processes ≤ 3 % of the CPU): 4-rank all-reduce α 4.82 ms, β 1.61 ns/B → 7.5 Gbit/s and
# 800 µs per ring step. Under load (load average 14–20, bench/results/cpu_link.json): 3.7–5.5
# Gbit/s, 790–1050 µs. Two processes on the same cores do better (α 0.39 ms, β 0.84 ns/B:
# 9.5 Gbit/s, 200 µs): 4 gloo processes on 2 cores wait for each other's time slices, which
# no per-link figure separates; the presets keep the 4-process numbers they are named for.
# (Before 2026-11-26 this said 40 Gbit/s and 10 µs, unmeasured placeholders.)
_LOOPBACK = {"kind": "loopback", "bandwidth_gbps": 7.5, "latency_us": 800.0}
# The CPU presets' machine has 2 cores (`os.cpu_count()` on it) and runs 4 gloo processes:
# every rank gets half a core when all compute at once, which `hetplan profile
# --layer-processes 4` puts into the layer times. (Before 2026-11-26 `local-cpu` said 4 cores,
# one per process, and `cpu-2x2` 2 per emulated node: twice the machine.)
_CPU_MACHINE_CORES = 2


def _eth(gbps: float) -> dict[str, Any]:
    return {"kind": "ethernet", "bandwidth_gbps": gbps, "latency_us": 25.0}


def _ib(gbps: float) -> dict[str, Any]:
    return {"kind": "infiniband", "bandwidth_gbps": gbps, "latency_us": 3.0}


def _node(
    name: str, count: int, dev: str, per_node: int, cores: int, link: dict[str, Any], **kw: Any
) -> dict[str, Any]:
    return {
        "name": name,
        "count": count,
        "devices": [{"type": dev, "count": per_node}],
        "cpu_cores": cores,
        "intra_link": link,
        **kw,
    }


def _preset(
    name: str, description: str, nodes: list[dict[str, Any]], inter: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {"name": name, "description": description, "nodes": nodes, "inter_node": inter}


#: Built-in clusters: name → the spec as a user would write it (``ClusterSpec`` fields).
PRESET_SPECS: dict[str, dict[str, Any]] = {
    "v100-pcie-8x8": _preset(
        "v100-pcie-8x8",
        "8 PCIe-only machines x 8 V100 32GB, 48 cores, 25 Gb/s Ethernet "
        "(Espresso/Cupcake PCIe testbed)",
        [_node("v100", 8, "V100-PCIe-32GB", 8, 48, _PCIE3)],
        _eth(25),
    ),
    "v100-nvlink-8x8": _preset(
        "v100-nvlink-8x8",
        "8 machines x 8 V100 SXM2 32GB on NVLink, 48 cores, 100 Gb/s TCP "
        "(Espresso/Cupcake NVLink testbed)",
        [_node("v100", 8, "V100-SXM2-32GB", 8, 48, _NVLINK2)],
        _eth(100),
    ),
    "espresso-nvlink-8x8": _preset(
        "espresso-nvlink-8x8",
        "8 machines x 8 V100 SXM2 32GB, the Espresso artifact's NVLink constants: 50 GB/s "
        "intra (0.02 us/KB), 1.25 GB/s inter (0.8 us/KB); latency per ring step 2 us intra, "
        "25 us inter (the artifact's 150 us is per call: 2 x 150 us ~ 14 x 25 us for a "
        "hierarchical allreduce over 8 nodes)",
        [_node("v100", 8, "V100-SXM2-32GB", 8, 48,
               # the artifact's 50 GB/s is a measured bus bandwidth, not a line rate
               {"kind": "nvlink", "bandwidth_gbps": 400.0, "latency_us": 2.0,
                "bus_efficiency": 1.0})],
        _eth(10),
    ),
    "espresso-pcie-8x8": _preset(
        "espresso-pcie-8x8",
        "8 PCIe-only machines x 8 V100 32GB, the Espresso artifact's PCIe constants: 2.5 GB/s "
        "intra (0.4 us/KB), 1.25 GB/s inter (0.8 us/KB); latency per ring step 3 us intra, "
        "25 us inter",
        [_node("v100", 8, "V100-PCIe-32GB", 8, 48,
               {"kind": "pcie", "bandwidth_gbps": 20.0, "latency_us": 3.0})],
        _eth(10),
    ),
    "a100-nvlink-8x8": _preset(
        "a100-nvlink-8x8",
        "8 machines x 8 A100 80GB on NVLink, 128 cores, 100 Gb/s RDMA",
        [_node("a100", 8, "A100-80GB", 8, 128, _NVLINK3)],
        _ib(100),
    ),
    "a100-1024": _preset(
        "a100-1024",
        "128 DGX A100 nodes x 8 A100 80GB (1024 GPUs), NVLink, 8 x 200 Gb/s HDR InfiniBand "
        "per node",
        [_node("a100", 128, "A100-80GB", 8, 128, _NVLINK3)],
        _ib(1600),
    ),
    "h100-1024": _preset(
        "h100-1024",
        "128 DGX H100 nodes x 8 H100 SXM 80GB (1024 GPUs), NVLink 4, 8 x 400 Gb/s NDR "
        "InfiniBand per node",
        [_node("h100", 128, "H100-80GB", 8, 112, _NVLINK4)],
        _ib(3200),
    ),
    "mixed-generations": _preset(
        "mixed-generations",
        "2 nodes x 8 A100 80GB + 2 nodes x 8 V100 SXM2 32GB, NVLink in each, 100 Gb/s "
        "Ethernet between them",
        [
            _node("a100", 2, "A100-80GB", 8, 128, _NVLINK3),
            _node("v100", 2, "V100-SXM2-32GB", 8, 48, _NVLINK2),
        ],
        _eth(100),
    ),
    "mixed-tp-node": _preset(
        "mixed-tp-node",
        "2 nodes x (2 A100 80GB + 2 V100 SXM2 32GB, repeated: 8 GPUs), NVLink 2 in each, "
        "100 Gb/s RDMA; every 4 consecutive ranks (a TP group of 4) mix both generations",
        [{"name": "mixed", "count": 2,
          "devices": [{"type": "A100-80GB", "count": 2}, {"type": "V100-SXM2-32GB", "count": 2},
                      {"type": "A100-80GB", "count": 2}, {"type": "V100-SXM2-32GB", "count": 2}],
          "cpu_cores": 96, "intra_link": _NVLINK2}],
        _ib(100),
    ),
    "one-slow-node": _preset(
        "one-slow-node",
        "4 nodes x 8 A100 80GB on NVLink, 100 Gb/s RDMA; the last node runs 2x slower "
        "(a straggler)",
        [
            _node("a100", 3, "A100-80GB", 8, 128, _NVLINK3),
            _node("a100-slow", 1, "A100-80GB", 8, 128, _NVLINK3, slowdown=2.0),
        ],
        _ib(100),
    ),
    "local-cpu": _preset(
        "local-cpu",
        "4 gloo processes sharing the 2 cores of one CPU machine",
        [_node("localhost", 1, "cpu", 4, _CPU_MACHINE_CORES, _LOOPBACK)],
    ),
    "cpu-2x2": _preset(
        "cpu-2x2",
        "2 emulated nodes x 2 gloo processes on one 2-core CPU machine (one core per emulated "
        "node; tests hierarchical collectives)",
        [_node("host", 2, "cpu", 2, _CPU_MACHINE_CORES // 2, _LOOPBACK)],
        dict(_LOOPBACK),
    ),
    "cpu-2x2-slow": _preset(
        "cpu-2x2-slow",
        "cpu-2x2 with a bandwidth-poor 1 Gb/s Ethernet link between the 2 emulated nodes "
        "(compressed-sync end-to-end runs; HETPLAN_EMULATE_BW=1 throttles a local run to it)",
        [_node("host", 2, "cpu", 2, _CPU_MACHINE_CORES // 2, _LOOPBACK)],
        _eth(1),
    ),
}
