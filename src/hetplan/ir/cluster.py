"""The cluster spec: the machines a plan is compiled for.

A :class:`ClusterSpec` lists groups of identical nodes (``count`` lets 128 identical nodes be
one entry), the devices in each node by type name, the intra-node link, the inter-node
network, and a catalogue of device types (``device_types``). A node refers to a device type by
name; a name not defined in the file is taken from the built-in :data:`DEVICE_CATALOGUE`
(``V100-SXM2-32GB``, ``A100-80GB``, ``H100-80GB``, ``cpu`` ...), and the loaded spec then
contains that entry, so a saved spec is self-contained and its fingerprint covers the numbers.

A minimal file::

    name: two-a100-nodes
    nodes:
    - name: a100
      count: 2
      devices: [{type: A100-80GB, count: 8}]
      cpu_cores: 128
      intra_link: {kind: nvlink, bandwidth_gbps: 2400, latency_us: 2}
    inter_node: {kind: infiniband, bandwidth_gbps: 100, latency_us: 3}

Units are in the field names. Link bandwidths are in **Gbit/s** (``bandwidth_gbps``), per
direction: for the intra-node link it is what one device can send while receiving as much
(NVLink 3: 600 GB/s bidirectional = 300 GB/s = 2400 Gbit/s each way); for ``inter_node`` it is
what one node can send through all its NICs together. Both are line rates (the datasheet's);
the analytic cost model prices collectives at the bus bandwidth NCCL reaches on them
(``hetplan.algorithms.collectives.PROTOCOL_EFFICIENCY``), a profile at what it measured.
Device memory bandwidth is in
**GB/s** (bytes; ``mem_bandwidth_gb_s``). Peak compute is dense (no sparsity) TFLOP/s.

Heterogeneity and stragglers: ``slowdown`` (≥ 1) on a device type or on a node group divides
the device's effective speed (peak FLOP/s and memory bandwidth); the two multiply.
``relative_speed`` records a measured speed, passed through to the cost model as is.
``stragglers`` (optional) adds random per-iteration delays (:mod:`hetplan.ir.stragglers`).

Presets for the seeds' testbeds and common machines are in :data:`PRESETS` (their numbers, and
the device types', in :mod:`hetplan.ir.cluster_presets`); each is also written to
``examples/clusters/<name>.yaml`` (regenerate with ``python -m hetplan.ir.cluster
examples/clusters``; a test checks they agree).
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    ValidationInfo,
    field_validator,
    model_validator,
)

from hetplan.errors import SpecError
from hetplan.ir.cluster_presets import DEVICE_TYPES, PRESET_SPECS
from hetplan.ir.fields import strict_float, strict_int
from hetplan.ir.stragglers import StragglerSpec
from hetplan.ir.files import write_text_file
from hetplan.ir.validation import did_you_mean, load_structured_file, validate_model

__all__ = [
    "Dtype",
    "LinkKind",
    "DTYPE_ALIASES",
    "DeviceSpec",
    "LinkSpec",
    "DeviceGroup",
    "NodeSpec",
    "ClusterSpec",
    "Device",
    "DEVICE_CATALOGUE",
    "PRESETS",
    "list_presets",
    "DEFAULT_STORAGE_BANDWIDTH_GBPS",
]

_CONFIG = ConfigDict(frozen=True, extra="forbid", validate_default=True)

#: Compute dtypes a device lists peak throughput for (``tf32``: fp32 matmuls on tensor cores).
Dtype = Literal["fp64", "fp32", "tf32", "fp16", "bf16", "fp8", "int8"]
_DTYPE_ORDER: tuple[str, ...] = ("fp64", "fp32", "tf32", "fp16", "bf16", "fp8", "int8")

#: torch dtype names (as the model IR writes them) → the spec's dtype keys.
DTYPE_ALIASES: dict[str, str] = {
    "float64": "fp64",
    "float32": "fp32",
    "float16": "fp16",
    "bfloat16": "bf16",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
    "int8": "int8",
}

LinkKind = Literal["nvlink", "pcie", "ethernet", "infiniband", "loopback"]

#: The largest cluster a spec may describe (every device is a rank; plans and the simulator
#: are O(world size)). Far above today's largest training jobs; raise it here if needed.
MAX_WORLD_SIZE = 65_536
#: At most this many devices in one node, node groups in a spec, and nodes in one group.
MAX_DEVICES_PER_NODE = 1_024
MAX_NODE_GROUPS = 4_096
MAX_NODES = MAX_WORLD_SIZE
#: Remote-storage bandwidth assumed when a spec gives none: the thesis's FSx (20 Gbit/s).
DEFAULT_STORAGE_BANDWIDTH_GBPS = 20.0

_Name = Annotated[str, Field(min_length=1, max_length=200)]


_Float = BeforeValidator(strict_float)
_Int = BeforeValidator(strict_int)
#: Device memory in GiB: 1 MiB .. 1 PiB.
_MemoryGiB = Annotated[float, Field(ge=2**-10, le=2**20, allow_inf_nan=False), _Float]
#: Peak TFLOP/s: 1 MFLOP/s .. 1 EFLOP/s.
_TFlops = Annotated[float, Field(ge=1e-6, le=1e6, allow_inf_nan=False), _Float]
#: Memory bandwidth in GB/s, link bandwidth in Gbit/s: 1 MB/s (Mbit/s) .. 1 PB/s (Pbit/s).
_Bandwidth = Annotated[float, Field(ge=1e-3, le=1e6, allow_inf_nan=False), _Float]
#: Link latency in microseconds: up to 1 s.
_LatencyUs = Annotated[float, Field(ge=0, le=1e6, allow_inf_nan=False), _Float]
#: A straggler factor (>= 1: that many times slower), up to 10,000.
_Slowdown = Annotated[float, Field(ge=1.0, le=1e4, allow_inf_nan=False), _Float]
_Speed = Annotated[float, Field(gt=0, le=1e6, allow_inf_nan=False), _Float]
_Rate = Annotated[float, Field(ge=0, le=1e6, allow_inf_nan=False), _Float]
#: Devices of one type in a node (0 is refused with its own message, see NodeSpec).
_DeviceCount = Annotated[int, Field(ge=0, le=MAX_DEVICES_PER_NODE), _Int]
_NodeCount = Annotated[int, Field(ge=1, le=MAX_NODES), _Int]
_Cores = Annotated[int, Field(ge=1, le=1 << 20), _Int]

_CLUSTER_HINT = (
    "hint: compare with a complete cluster file in examples/clusters/ (or start from a "
    "preset: ClusterSpec.from_preset(name).to_yaml())"
)


# --------------------------------------------------------------------------------------
# the schema
# --------------------------------------------------------------------------------------
class DeviceSpec(BaseModel):
    """One device type of the catalogue (a GPU model, or ``cpu`` for a gloo process).

    Attributes:
        memory_gib: device memory in GiB.
        peak_tflops: dense peak TFLOP/s (TOP/s for int8) per compute dtype; ``fp32`` is
            required, the others are listed where the device supports them.
        mem_bandwidth_gb_s: memory bandwidth in GB/s (bytes).
        slowdown: straggler factor ≥ 1 for every device of this type: effective speed is
            peak / slowdown.
        relative_speed: a measured speed of this type relative to a reference device of the
            user's choosing (e.g. throughput on the model at hand), or None.
        comm_overlaps_compute: whether gradient communication runs beside compute (True for
            GPUs: collectives run on their own stream and copy engines) or takes turns with it
            (False for ``cpu``: gloo reduces and copies on the same cores the training
            threads keep busy, so the timeline puts communication on the compute resource).
    """

    model_config = _CONFIG

    memory_gib: _MemoryGiB
    peak_tflops: dict[Dtype, _TFlops]
    mem_bandwidth_gb_s: _Bandwidth
    slowdown: _Slowdown = 1.0
    relative_speed: _Speed | None = None
    comm_overlaps_compute: StrictBool = True

    @field_validator("peak_tflops")
    @classmethod
    def _fp32_listed(cls, value: dict[str, float]) -> dict[str, float]:
        if "fp32" not in value:
            raise ValueError(
                f"peak_tflops must list 'fp32' (the roofline fallback), got keys "
                f"{sorted(value)}; add e.g. 'fp32: 19.5'"
            )
        # Canonical order, so written files do not depend on how the user ordered keys.
        return {k: value[k] for k in _DTYPE_ORDER if k in value}


class LinkSpec(BaseModel):
    """A link: the intra-node interconnect of a node group, or the inter-node network.

    Attributes:
        kind: ``nvlink``, ``pcie``, ``ethernet``, ``infiniband`` or ``loopback`` (processes on
            one host).
        bandwidth_gbps: Gbit/s per direction (see the module docstring for what it counts).
        latency_us: one-way latency of a small message, in microseconds.
        bus_efficiency: the share of ``bandwidth_gbps`` that NCCL's collectives reach (their
            bus bandwidth). Unset: the published figure of the link's kind
            (``hetplan.algorithms.collectives.PROTOCOL_EFFICIENCY``: NVLink 0.80, InfiniBand
            0.96, others 1). ``1`` when ``bandwidth_gbps`` is already a measured bus
            bandwidth rather than a line rate.
    """

    model_config = _CONFIG

    kind: LinkKind
    bandwidth_gbps: _Bandwidth
    latency_us: _LatencyUs
    bus_efficiency: Annotated[float | None, Field(default=None, gt=0, le=1,
                                                  allow_inf_nan=False)] = None

    @property
    def bandwidth_bytes_per_s(self) -> float:
        """Bandwidth in bytes per second."""
        return self.bandwidth_gbps * 1e9 / 8

    @property
    def latency_s(self) -> float:
        """Latency in seconds."""
        return self.latency_us * 1e-6


class DeviceGroup(BaseModel):
    """``count`` devices of catalogue type ``type`` in one node."""

    model_config = _CONFIG

    type: _Name
    count: _DeviceCount


class NodeSpec(BaseModel):
    """A group of ``count`` identical nodes.

    Attributes:
        name: group name, unique in the cluster. With ``count > 1`` the nodes are named
            ``{name}-0``, ``{name}-1`` ...
        count: how many nodes have this shape.
        devices: device groups of one node, in local-rank order. A single mapping
            ``{type: ..., count: ...}`` is accepted for a one-type node.
        cpu_cores: CPU cores per node (for CPU-side compression and data loading).
        intra_link: the interconnect between the devices of one node.
        slowdown: straggler factor ≥ 1 for every device of these nodes.
        failure_rate_per_hour: expected failures per node-hour, or None when unknown.
        cpu_memory_gib: host (CPU) memory of one node in GiB, 1 MiB .. 1 PiB, or None when
            unknown. The Gemini checkpoint pass checks that its in-memory replicas fit in it;
            when None, that check is skipped and the plan says so.
    """

    model_config = _CONFIG

    name: _Name
    count: _NodeCount = 1
    devices: tuple[DeviceGroup, ...] = Field(max_length=MAX_DEVICES_PER_NODE)
    cpu_cores: _Cores
    intra_link: LinkSpec
    slowdown: _Slowdown = 1.0
    failure_rate_per_hour: _Rate | None = None
    cpu_memory_gib: _MemoryGiB | None = None

    @field_validator("devices", mode="before")
    @classmethod
    def _one_group_shorthand(cls, value: Any) -> Any:
        return [value] if isinstance(value, Mapping) else value

    @field_validator("devices")
    @classmethod
    def _has_devices(
        cls, value: tuple[DeviceGroup, ...], info: ValidationInfo
    ) -> tuple[DeviceGroup, ...]:
        node = info.data.get("name", "?")
        if not value:
            raise ValueError(
                f"node {node!r} has no devices; list them as "
                "'devices: [{type: A100-80GB, count: 8}]'"
            )
        for i, group in enumerate(value):
            if group.count < 1:
                raise ValueError(
                    f"node {node!r}: devices[{i}] ({group.type!r}) has count {group.count}; "
                    "every device group needs count >= 1 (remove the group instead)"
                )
        return value

    @property
    def devices_per_node(self) -> int:
        """Devices in one node of this group."""
        return sum(g.count for g in self.devices)

    def node_names(self) -> tuple[str, ...]:
        """Names of the nodes of this group: ``name`` alone, or ``name-0`` ... ``name-{n-1}``."""
        if self.count == 1:
            return (self.name,)
        return tuple(f"{self.name}-{i}" for i in range(self.count))


@dataclass(frozen=True, slots=True)
class Device:
    """One device (one rank) of a cluster, with slowdowns applied; see ``ClusterSpec.devices``.

    Attributes:
        rank: global rank (nodes in spec order, devices in local order).
        node: name of its node (``a100-3``); ``node_index`` its index among all nodes.
        group: name of its node group (the ``NodeSpec``).
        local_rank: index within its node.
        type: device type name (a ``device_types`` key).
        memory_bytes: device memory.
        peak_flops: ``(dtype, FLOP/s)`` pairs, effective: peak / slowdown.
        mem_bandwidth_bytes_per_s: effective memory bandwidth: datasheet / slowdown.
        slowdown: combined straggler factor (device type x node group).
        relative_speed: the measured relative speed of the type divided by ``slowdown``, or
            None when the spec has no measurement.
        comm_overlaps_compute: see :class:`DeviceSpec`.
    """

    rank: int
    node: str
    node_index: int
    group: str
    local_rank: int
    type: str
    memory_bytes: int
    peak_flops: tuple[tuple[str, float], ...]
    mem_bandwidth_bytes_per_s: float
    slowdown: float
    relative_speed: float | None
    comm_overlaps_compute: bool = True

    def flops(self, dtype: str) -> float:
        """Effective peak FLOP/s for ``dtype`` (``"bf16"`` or a torch name ``"bfloat16"``).

        Raises:
            KeyError: the device type lists no throughput for that dtype.
        """
        key = DTYPE_ALIASES.get(dtype, dtype)
        for name, value in self.peak_flops:
            if name == key:
                return value
        listed = [name for name, _ in self.peak_flops]
        raise KeyError(f"device type {self.type!r} lists no peak for {dtype!r}; has {listed}")


class ClusterSpec(BaseModel):
    """A cluster: node groups, their devices and links, and the inter-node network.

    Attributes:
        name: cluster name (not part of the fingerprint).
        description: free text (not part of the fingerprint).
        nodes: node groups, in rank order.
        inter_node: the network between nodes; required when there is more than one node.
        device_types: the device catalogue, by type name; types the nodes use but the file
            does not define are filled in from :data:`DEVICE_CATALOGUE` when loading.
        storage_bandwidth_gbps: aggregate bandwidth (Gbit/s) of the remote persistent storage
            that checkpoints are written to, or None when unknown; the Gemini pass then
            assumes :data:`DEFAULT_STORAGE_BANDWIDTH_GBPS` (the thesis's 20 Gb/s FSx) and
            records the assumption in the plan.
        stragglers: random per-iteration delays of devices (:class:`StragglerSpec`), or None.

    Example:
        >>> spec = ClusterSpec.from_preset("mixed-generations")
        >>> spec.world_size, spec.num_nodes, spec.is_heterogeneous
        (32, 4, True)
        >>> spec.link_between(0, 9).kind
        'ethernet'
    """

    model_config = _CONFIG

    name: _Name
    description: str = Field(default="", max_length=10_000)
    nodes: tuple[NodeSpec, ...] = Field(max_length=MAX_NODE_GROUPS)
    inter_node: LinkSpec | None = None
    device_types: dict[_Name, DeviceSpec] = Field(default_factory=dict,
                                                  max_length=MAX_NODE_GROUPS)
    storage_bandwidth_gbps: _Bandwidth | None = None
    stragglers: StragglerSpec | None = None

    # -- validation ---------------------------------------------------------------------
    @model_validator(mode="before")
    @classmethod
    def _fill_builtin_types(cls, data: Any) -> Any:
        """Add the built-in catalogue entry of every referenced type the file leaves out."""
        if not isinstance(data, Mapping) or not isinstance(data.get("nodes"), list | tuple):
            return data
        defined = data.get("device_types", {})
        if not isinstance(defined, Mapping):
            return data
        added: dict[str, Any] = dict(defined)
        for node in data["nodes"]:
            groups = node.get("devices") if isinstance(node, Mapping) else None
            groups = [groups] if isinstance(groups, Mapping) else groups
            for group in groups if isinstance(groups, list | tuple) else ():
                name = group.get("type") if isinstance(group, Mapping) else None
                if isinstance(name, str) and name not in added and name in DEVICE_CATALOGUE:
                    added[name] = DEVICE_CATALOGUE[name]
        if len(added) == len(defined):
            return data
        return {**data, "device_types": added}

    @model_validator(mode="after")
    def _consistent(self) -> ClusterSpec:
        problems: list[str] = []
        if not self.nodes:
            problems.append("nodes: the list is empty; list at least one node group")
        for i, node in enumerate(self.nodes):
            if node.devices_per_node > MAX_DEVICES_PER_NODE:
                problems.append(
                    f"nodes[{i}].devices: node {node.name!r} has {node.devices_per_node} "
                    f"devices; at most {MAX_DEVICES_PER_NODE} per node"
                )
        if self.num_nodes > MAX_NODES or self.world_size > MAX_WORLD_SIZE:
            counts = " + ".join(f"{n.count} x {n.devices_per_node}" for n in self.nodes[:4])
            more = " + ..." if len(self.nodes) > 4 else ""
            problems.append(
                f"nodes: {self.num_nodes:,} nodes with {self.world_size:,} devices in all "
                f"({counts}{more} per node group); hetplan plans for at most "
                f"{MAX_WORLD_SIZE:,} devices and {MAX_NODES:,} nodes: check the 'count' of "
                "each node group and device group"
            )
            raise ValueError("\n".join(problems))  # what follows is O(nodes): stop here
        group_counts = Counter(node.name for node in self.nodes)
        for name in sorted(g for g, n in group_counts.items() if n > 1):
            problems.append(f"nodes: two node groups are named {name!r}; rename one")
        clashes = sorted(n for n, k in Counter(self.node_names()).items() if k > 1)
        if clashes and len(group_counts) == len(self.nodes):
            problems.append(
                f"nodes: node names {clashes} occur twice (a group with count > 1 names its nodes "
                "'<name>-<i>'); rename the clashing group"
            )
        known = sorted(set(self.device_types) | set(DEVICE_CATALOGUE))
        for i, node in enumerate(self.nodes):
            for j, group in enumerate(node.devices):
                if group.type not in self.device_types:
                    problems.append(
                        f"nodes[{i}].devices[{j}].type: unknown device type {group.type!r} "
                        f"in node {node.name!r} (define it under device_types or use a "
                        f"built-in type: {', '.join(DEVICE_CATALOGUE)})"
                        + did_you_mean(group.type, known)
                    )
        group_names = [node.name for node in self.nodes]
        for name in self.stragglers.nodes if self.stragglers is not None else ():
            if name not in group_names:
                problems.append(
                    f"stragglers.nodes: unknown node group {name!r} (node groups: "
                    f"{', '.join(group_names)}){did_you_mean(name, group_names)}"
                )
        if self.num_nodes > 1 and self.inter_node is None:
            problems.append(
                f"inter_node: missing; the cluster has {self.num_nodes} nodes, so it needs the "
                "network between them; add e.g. "
                "'inter_node: {kind: ethernet, bandwidth_gbps: 100, latency_us: 10}'"
            )
        if problems:
            raise ValueError("\n".join(problems))  # one line each in the SpecError
        return self

    # -- shape ----------------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        """Number of nodes (summing the groups' counts)."""
        return sum(node.count for node in self.nodes)

    @property
    def world_size(self) -> int:
        """Number of devices (ranks)."""
        return sum(node.count * node.devices_per_node for node in self.nodes)

    @property
    def devices_per_node(self) -> int | None:
        """Devices per node when every node has the same number, else None."""
        sizes = {node.devices_per_node for node in self.nodes}
        return sizes.pop() if len(sizes) == 1 else None

    def straggler_of(self, rank: int) -> tuple[float, float]:
        """``(probability, delay_s)`` of the random per-iteration delay of ``rank``'s device
        (``(0.0, 0.0)`` when it does not straggle)."""
        spec = self.stragglers
        if spec is None or (spec.nodes and self._device(rank).group not in spec.nodes):
            return 0.0, 0.0
        return spec.probability, spec.delay_s

    @property
    def is_heterogeneous(self) -> bool:
        """True when devices differ in type, slowdown or measured speed."""
        kinds = {(d.type, d.slowdown, d.relative_speed) for d in self.devices()}
        return len(kinds) > 1

    def devices(self) -> tuple[Device, ...]:
        """Every device in rank order: nodes in spec order, devices in local order.

        Computed once per spec (O(world_size)) and cached.
        """
        return self._device_table

    def node_names(self) -> tuple[str, ...]:
        """Names of all nodes, in rank order."""
        return tuple(n for node in self.nodes for n in node.node_names())

    def node_of(self, rank: int) -> int:
        """Index of the node holding ``rank``."""
        return self._device(rank).node_index

    def ranks_of_node(self, node_index: int) -> tuple[int, ...]:
        """The ranks of node ``node_index``, in local order."""
        if not 0 <= node_index < self.num_nodes:
            raise IndexError(f"node index {node_index} out of range (0..{self.num_nodes - 1})")
        return tuple(d.rank for d in self.devices() if d.node_index == node_index)

    def link_between(self, rank_a: int, rank_b: int) -> LinkSpec:
        """The link data crosses between two ranks.

        Returns:
            The intra-node link of their node group when both are on one node (also for
            ``rank_a == rank_b``), else the inter-node network.
        """
        a, b = self._device(rank_a), self._device(rank_b)
        if a.node_index == b.node_index:
            return self._group(a.group).intra_link
        assert self.inter_node is not None  # validated: > 1 node implies inter_node
        return self.inter_node

    @cached_property
    def _device_table(self) -> tuple[Device, ...]:
        out: list[Device] = []
        node_index = 0
        for node in self.nodes:
            template: list[tuple[str, DeviceSpec, float]] = []
            for group in node.devices:
                spec = self.device_types[group.type]
                template += [(group.type, spec, spec.slowdown * node.slowdown)] * group.count
            for node_name in node.node_names():
                for local_rank, (type_name, spec, slowdown) in enumerate(template):
                    out.append(
                        _make_device(
                            len(out),
                            node_name,
                            node_index,
                            node.name,
                            local_rank,
                            type_name,
                            spec,
                            slowdown,
                        )
                    )
                node_index += 1
        return tuple(out)

    def _device(self, rank: int) -> Device:
        table = self.devices()
        if not 0 <= rank < len(table):
            raise IndexError(f"rank {rank} out of range for world size {len(table)}")
        return table[rank]

    def _group(self, name: str) -> NodeSpec:
        return next(node for node in self.nodes if node.name == name)

    # -- identity and (de)serialisation ----------------------------------------------------
    def fingerprint(self) -> str:
        """First 16 hex digits of the sha256 of the canonical JSON (sorted keys).

        ``name`` and ``description`` are left out: renaming a cluster does not invalidate
        its plans; any change to a device, node, link or count does.
        """
        data = self.model_dump(mode="json", exclude={"name", "description"})
        # Fields added after the first release count only when set, so the fingerprints
        # (and the plans that carry them) of specs that leave them out stay the same.
        if data.get("storage_bandwidth_gbps") is None:
            data.pop("storage_bandwidth_gbps", None)
        for node in data.get("nodes", ()):
            if node.get("cpu_memory_gib") is None:
                node.pop("cpu_memory_gib", None)
        if data.get("stragglers") is None:  # specs written before the field keep their hash
            data.pop("stragglers", None)
        links = [node.get("intra_link") for node in data.get("nodes", ())]
        for link in [*links, data.get("inter_node")]:
            if isinstance(link, dict) and link.get("bus_efficiency") is None:
                link.pop("bus_efficiency", None)
        text = json.dumps(data, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def to_yaml(self) -> str:
        """Canonical YAML: fields in schema order, None fields left out."""
        data = self.model_dump(mode="json", exclude_none=True)
        return str(yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=100))

    def to_json(self, *, indent: int | None = 2) -> str:
        """Canonical JSON: sorted keys, None fields left out."""
        data = self.model_dump(mode="json", exclude_none=True)
        return json.dumps(data, sort_keys=True, indent=indent) + "\n"

    def save(self, path: str | Path) -> None:
        """Write as JSON when ``path`` ends in ``.json``, else as YAML."""
        p = Path(path)
        text = self.to_json() if p.suffix.lower() == ".json" else self.to_yaml()
        write_text_file(p, text, what="cluster spec")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "<cluster spec>") -> ClusterSpec:
        """Validate a parsed spec; errors raise :class:`SpecError` naming the field path."""
        return validate_model(cls, data, where=where, hint=_CLUSTER_HINT)

    @classmethod
    def load(cls, path: str | Path) -> ClusterSpec:
        """Read a cluster spec from a YAML or JSON file.

        Raises:
            SpecError: the file is missing or malformed, or the spec is invalid; the message
                names the file and field path and suggests the right key for a misspelt one.
        """
        data = load_structured_file(path, what="cluster spec")
        return cls.from_dict(data, where=str(path))

    @classmethod
    def from_preset(cls, name: str) -> ClusterSpec:
        """The built-in cluster called ``name`` (see :func:`list_presets`).

        Raises:
            SpecError: no preset has that name (with the nearest name and the list).
        """
        if not isinstance(name, str):
            raise SpecError(f"cluster preset: expected a preset name (a string), got "
                            f"{type(name).__name__} {name!r}; one of {', '.join(PRESETS)}")
        factory = PRESETS.get(name)
        if factory is None and any(sep in name for sep in "/\\"):
            # a path, not a preset name: the file is missing (resolve_cluster reads files)
            raise SpecError(
                f"cluster spec file {name!r} does not exist (resolved to "
                f"{str(Path(name).absolute())!r}); check the path, or name a preset "
                f"({', '.join(PRESETS)})"
            )
        if factory is None:
            raise SpecError(
                f"unknown cluster preset {name!r} (available: {', '.join(PRESETS)}; or pass "
                f"a YAML or JSON cluster file){did_you_mean(name, PRESETS)}"
            )
        return factory()


def _make_device(
    rank: int,
    node: str,
    node_index: int,
    group: str,
    local_rank: int,
    type_name: str,
    spec: DeviceSpec,
    slowdown: float,
) -> Device:
    flops = tuple((dt, tf * 1e12 / slowdown) for dt, tf in spec.peak_tflops.items())
    speed = None if spec.relative_speed is None else spec.relative_speed / slowdown
    return Device(
        rank=rank,
        node=node,
        node_index=node_index,
        group=group,
        local_rank=local_rank,
        type=type_name,
        memory_bytes=int(spec.memory_gib * 2**30),
        peak_flops=flops,
        mem_bandwidth_bytes_per_s=spec.mem_bandwidth_gb_s * 1e9 / slowdown,
        slowdown=slowdown,
        relative_speed=speed,
        comm_overlaps_compute=spec.comm_overlaps_compute,
    )


# --------------------------------------------------------------------------------------
# built-in device types and presets (their numbers: hetplan.ir.cluster_presets)
# --------------------------------------------------------------------------------------
#: Built-in device types; a spec may use these names without defining them.
DEVICE_CATALOGUE: dict[str, DeviceSpec] = {
    name: DeviceSpec(**spec) for name, spec in DEVICE_TYPES.items()
}


def _preset(name: str) -> Callable[[], ClusterSpec]:
    data = PRESET_SPECS[name]

    def factory() -> ClusterSpec:
        return ClusterSpec.from_dict(data, where=f"preset {name!r}")

    return factory


#: Built-in clusters: name → a function building the spec.
PRESETS: dict[str, Callable[[], ClusterSpec]] = {name: _preset(name) for name in PRESET_SPECS}


def list_presets() -> list[tuple[str, str]]:
    """``(name, description)`` of every preset, in definition order."""
    return [(name, factory().description) for name, factory in PRESETS.items()]


def _write_examples(directory: str | Path) -> list[Path]:
    """Write every preset as ``<directory>/<name>.yaml``; returns the paths written."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, factory in PRESETS.items():
        path = out / f"{name}.yaml"
        write_text_file(path, factory().to_yaml(), what="cluster spec")
        written.append(path)
    return written


if __name__ == "__main__":  # python -m hetplan.ir.cluster examples/clusters
    for written_path in _write_examples(sys.argv[1] if len(sys.argv) > 1 else "."):
        print(written_path)
