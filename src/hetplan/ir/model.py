"""The model IR: layers, parameters and gradient tensors of a training workload.

A :class:`ModelIR` is what every later stage of hetplan reads instead of an ``nn.Module``.
It is produced by :func:`hetplan.capture` from a PyTorch model, or loaded from a *workload
JSON* file (``ModelIR.load``), which needs no torch: benchmark workloads such as the six
models of the Espresso paper are given only as gradient sizes and backprop gaps.

All types are frozen dataclasses with tuples; pydantic validates them only when they cross a
file boundary (``ModelIR.from_json`` / ``ModelIR.to_json``), with ``extra="forbid"``.

Units are in the field names: ``*_bytes``, ``*_flops`` (one multiply-add counts as 2 FLOPs),
``*_us`` (microseconds).

:func:`verify_model_ir` checks the IR's invariants after capture and after loading a workload
file; each violation is a :class:`~hetplan.errors.SpecError` naming the layer or tensor
(``assert`` is not used: workload files are user input).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Literal

from pydantic import (
    ConfigDict,
    SerializerFunctionWrapHandler,
    TypeAdapter,
    ValidationError,
    model_serializer,
)

from hetplan.errors import SpecError
from hetplan.ir.files import write_text_file
from hetplan.ir.fields import Float, Int
from hetplan.ir.kernels import Gemm

__all__ = [
    "WORKLOAD_SCHEMA_VERSION",
    "LayerKind",
    "TPRole",
    "ParamInfo",
    "LinearInfo",
    "megatron_pairs",
    "LayerIR",
    "GradTensor",
    "ModelIR",
    "DTYPE_BYTES",
    "verify_model_ir",
]

WORKLOAD_SCHEMA_VERSION = 1

_FORBID = ConfigDict(extra="forbid")

#: Bytes per element of the dtype names the IR uses (``str(torch.float32)`` minus ``torch.``).
DTYPE_BYTES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
}


class LayerKind(str, Enum):
    """What a layer is, as far as pipeline balancing and reporting care."""

    EMBEDDING = "embedding"
    BLOCK = "block"  # one element of a repeated ModuleList/Sequential (a transformer block)
    NORM = "norm"
    HEAD = "head"  # the last parameterised layer (classifier / LM head)
    LINEAR = "linear"
    CONV = "conv"
    PARAMS = "params"  # parameters owned directly by a container module (e.g. a cls token)
    OPAQUE = "opaque"  # a module the user asked to treat as an opaque leaf
    OTHER = "other"


class TPRole(str, Enum):
    """How a tensor-parallel pass may split an ``nn.Linear``.

    ``column``: split the output features (Megatron's first linear of a pair; no communication
    in forward). ``row``: split the input features (the second linear of a pair; all-reduce of
    the output). ``either``: no pairing was recognised, the pass may choose.
    """

    COLUMN = "column"
    ROW = "row"
    EITHER = "either"


@dataclass(frozen=True, slots=True)
class ParamInfo:
    """One parameter as seen from the layer that uses it.

    Attributes:
        name: qualified parameter name (``transformer.h.0.attn.c_attn.weight``).
        shape: tensor shape.
        dtype: element type (``float32``).
        numel: number of elements.
        size_bytes: ``numel * bytes(dtype)``.
        tied_to: for an alias of a shared parameter (tied embeddings), the canonical name of
            the parameter it aliases; such an entry is counted once, in the canonical layer.
        requires_grad: False for frozen parameters (they get no gradient tensor).
    """

    name: str
    shape: tuple[Int, ...]
    dtype: str
    numel: Int
    size_bytes: Int
    tied_to: str | None = None
    requires_grad: bool = True

    __pydantic_config__ = _FORBID


@dataclass(frozen=True, slots=True)
class LinearInfo:
    """An ``nn.Linear`` (or HF ``Conv1D``) inside a layer that tensor parallelism may split.

    Attributes:
        name: qualified module name.
        in_features / out_features: the matrix shape, independent of storage layout.
        bias: whether it has a bias.
        tp_role: column / row / either (see :class:`TPRole`).
        pair: for a recognised Megatron pair, the qualified name of the other linear.
        split_unit: for a projection of an attention module, the features a tensor-parallel
            split must keep together along its split dimension (output features of a
            query/key/value projection, per part of a fused QKV one; input features of the
            output projection): ``head_dim``, or with grouped-query attention a whole group's
            ``heads // kv_heads · head_dim`` on the query and output sides
            (:func:`hetplan.ir.capture.attention.split_units`). None: no constraint known;
            left out of the JSON then, so IRs of models without attention (and workload
            files written before the field) serialise, and fingerprint, as before. Read by
            ``tp-resizing`` (whole-head shards of Megatron pairs; GQA attention is no pair,
            its k/v being narrower) and ``even-tp`` (attention with fewer heads or groups
            than ``tp``, which the runtime keeps whole).
    """

    name: str
    in_features: Int
    out_features: Int
    bias: bool
    tp_role: TPRole = TPRole.EITHER
    pair: str | None = None
    split_unit: Int | None = None

    __pydantic_config__ = _FORBID

    @model_serializer(mode="wrap")
    def _omit_no_unit(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        """Leave ``split_unit`` out while it is None (see the class)."""
        data: dict[str, object] = handler(self)
        if self.split_unit is None:
            data.pop("split_unit", None)
        return data


def megatron_pairs(
    linears: Iterable[LinearInfo],
) -> tuple[list[tuple[list[LinearInfo], LinearInfo]], dict[str, str]]:
    """The Megatron pairs among ``linears`` and why every other linear is not in one.

    A pair is a row linear and the column linears whose ``pair`` names it, all in the same
    parent module, the row naming one of them back, and every column's ``out_features``
    equal to the row's ``in_features`` (so a split of the row's input splits the columns'
    outputs alike). Both the ``tp-resizing`` pass (shard sizes) and the runtime's
    :func:`~hetplan.runtime.tensor_parallel.tp_pairs` (which also needs the modules) use it.

    Returns:
        ``[(columns, row)]`` in IR order, and ``{linear name: reason}`` for the others.
    """
    infos = {lin.name: lin for lin in linears}
    pairs: list[tuple[list[LinearInfo], LinearInfo]] = []
    skipped: dict[str, str] = {}

    def parent(name: str) -> str:
        return name.rpartition(".")[0]

    for row in infos.values():
        if row.tp_role is not TPRole.ROW:
            continue
        cols = [c for c in infos.values() if c.tp_role is TPRole.COLUMN and c.pair == row.name]
        why = ""
        if row.pair not in {c.name for c in cols}:
            why = f"row linear's partner {row.pair!r} does not name it back"
        else:
            for c in cols:
                if parent(c.name) != parent(row.name):
                    skipped[c.name] = f"paired with {row.name!r} in another module"
            cols = [c for c in cols if parent(c.name) == parent(row.name)]
            if row.pair not in {c.name for c in cols}:
                why = "its partner lives in another module"
            elif any(c.out_features != row.in_features for c in cols):
                why = "column out_features differ from the row's in_features"
        if why:
            for n in [*(c.name for c in cols), row.name]:
                skipped.setdefault(n, why)
            continue
        pairs.append((cols, row))
    paired = {lin.name for cols, row in pairs for lin in (*cols, row)}
    for name, lin in infos.items():
        if name not in paired and name not in skipped:
            skipped[name] = ("role 'either'" if lin.tp_role is TPRole.EITHER
                             else "no row partner")
    return pairs, skipped


@dataclass(frozen=True, slots=True)
class LayerIR:
    """One pipeline-balancing unit, in dataflow order.

    Attributes:
        index: position in ``ModelIR.layers``.
        name: qualified module name (for a ``params`` layer: the owning module's name).
        kind: see :class:`LayerKind`.
        module_type: class name of the module (``GPT2Block``).
        group: for a repeated block, the qualified name of its ModuleList (``transformer.h``).
        params: parameters used by this layer; aliases of tied parameters carry ``tied_to``.
        fwd_flops / bwd_flops: FLOPs of one forward / backward for the captured batch shape.
        act_in_bytes / act_out_bytes: bytes of the tensors entering / leaving the layer.
        act_saved_bytes: bytes of the activations autograd keeps from this layer's forward
            until its backward (what a pipeline stage holds per in-flight micro-batch), at
            the captured dtypes, each storage once.
        linears: the linears a tensor-parallel pass may split.
        measured_bwd_us: backprop time of this layer as measured when the workload was
            recorded (benchmark workloads only), else None.
        act_saved_nonfloat_bytes: the part of ``act_saved_bytes`` in non-floating tensors
            (dropout masks, indices): stored at the same size whatever the compute dtype.
        act_replicated_bytes: the part of ``act_saved_bytes`` saved outside the layer's
            tensor-parallel regions (layer-norm inputs, the inputs of column-parallel
            linears, dropout masks after row-parallel ones): every TP rank holds all of it
            unless sequence parallelism splits it. A region runs from the end of a Megatron
            pair's column linear to the end of its row linear. 0 when the capture could not
            tell (then every saved byte of a layer with pairs counts as split).
        act_replicated_nonfloat_bytes: its non-floating part.
        act_attn_core_bytes: how much less autograd keeps when the attention core (QK^T,
            softmax, dropout on the scores, the score-times-V product: a
            ``scaled_dot_product_attention`` call or a module of a class in
            ``ATTENTION_CORE_TYPES``) is recomputed in backward: the bytes saved inside the
            core minus those of its inputs, which recomputation keeps (selective
            recomputation, Korthikanti et al. 2022).
        act_attn_core_nonfloat_bytes: its non-floating part.
        attn_core_fwd_flops: forward FLOPs of the attention core (what selective
            recomputation runs again in backward).
        gemms: every matrix multiply of the layer's forward and backward, by shape
            (:class:`~hetplan.ir.kernels.Gemm`), at the captured batch.
        mem_fwd_bytes / mem_bwd_bytes: bytes read and written by the layer's other kernels
            (element-wise, normalisation, softmax, dropout, copies) outside the attention
            core, in forward / backward, each kernel run on its own (no fusion).
        core_mem_fwd_bytes / core_mem_bwd_bytes: the same inside the attention core: what
            an unfused attention moves through memory (scores, softmax, dropout), and a
            fused one does not.
        cut_bytes_after: bytes of every tensor a pipeline boundary right after this layer
            cuts (produced at or before it, read after it: :mod:`hetplan.ir.dataflow`). It
            equals ``act_out_bytes`` where the model is a chain; more where a residual
            shortcut, an encoder's output or a second embedding crosses the boundary. None
            (workload files, IRs written before the field): taken as ``act_out_bytes``.
            Read it through :attr:`boundary_bytes`.
        cuttable_before: False when a pipeline stage cannot start at this layer because the
            runtime cannot split the model there: the layer is never called as a module
            (its parameters are only read by glue code, like ``pos_emb.weight[:t]``), is
            called more than once, or owns only a container's parameters. The partition
            algorithms skip such boundaries and the plan validator refuses them.
    """

    index: Int
    name: str
    kind: LayerKind
    module_type: str
    params: tuple[ParamInfo, ...] = ()
    fwd_flops: Int = 0
    bwd_flops: Int = 0
    act_in_bytes: Int = 0
    act_out_bytes: Int = 0
    act_saved_bytes: Int = 0
    group: str | None = None
    linears: tuple[LinearInfo, ...] = ()
    measured_bwd_us: Float | None = None
    act_saved_nonfloat_bytes: Int = 0
    act_replicated_bytes: Int = 0
    act_replicated_nonfloat_bytes: Int = 0
    act_attn_core_bytes: Int = 0
    act_attn_core_nonfloat_bytes: Int = 0
    attn_core_fwd_flops: Int = 0
    gemms: tuple[Gemm, ...] = ()
    mem_fwd_bytes: Int = 0
    mem_bwd_bytes: Int = 0
    core_mem_fwd_bytes: Int = 0
    core_mem_bwd_bytes: Int = 0
    cut_bytes_after: Int | None = None
    cuttable_before: bool = True

    __pydantic_config__ = _FORBID

    @property
    def boundary_bytes(self) -> int:
        """Bytes a pipeline boundary right after this layer sends per micro-batch (at the
        captured batch): ``cut_bytes_after``, else ``act_out_bytes``."""
        return self.act_out_bytes if self.cut_bytes_after is None else self.cut_bytes_after

    @property
    def param_numel(self) -> int:
        """Elements of the parameters this layer owns (aliases excluded)."""
        return sum(p.numel for p in self.params if p.tied_to is None)

    @property
    def param_bytes(self) -> int:
        """Bytes of the parameters this layer owns (aliases excluded)."""
        return sum(p.size_bytes for p in self.params if p.tied_to is None)

    def tp_split_bytes(self) -> int:
        """Bytes of the owned parameters that live in tensor-parallel-splittable linears."""
        prefixes = tuple(lin.name + "." for lin in self.linears)
        return sum(
            p.size_bytes for p in self.params if p.tied_to is None and p.name.startswith(prefixes)
        ) if prefixes else 0

    def signature(self, batch_size: int = 1) -> str:
        """A key for profiled times: equal for layers that compute the same thing on the
        same shapes (all blocks of a transformer share one), independent of names and of the
        batch size.

        Activation sizes and FLOPs enter **per sample** (divided by ``batch_size``, the
        micro-batch of the capture this layer came from), so a layer profiled at micro-batch 8
        and the same layer captured for planning at micro-batch 1 share a key; the profile
        record says which micro-batch it was measured at and the compute model scales from
        there. A quantity that does not scale with the batch (e.g. a position embedding's
        ``(1, seq)`` index input) makes the key batch-specific; such a layer falls back to the
        analytic estimate when planned at another batch size.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")

        def per_sample(x: int) -> int | float:
            return x // batch_size if x % batch_size == 0 else x / batch_size

        shapes = tuple((p.shape, p.dtype) for p in self.params)
        key = repr((self.module_type, shapes, per_sample(self.act_in_bytes),
                    per_sample(self.act_out_bytes), per_sample(self.fwd_flops),
                    per_sample(self.bwd_flops), self.measured_bwd_us))
        return hashlib.sha256(key.encode()).hexdigest()[:12]


@dataclass(frozen=True, slots=True)
class GradTensor:
    """A gradient tensor, listed in backward-ready order in ``ModelIR.grad_tensors``.

    Attributes:
        name: the (canonical) parameter name.
        numel / size_bytes / dtype: as the gradient is produced (same dtype as the parameter).
        layer: name of the layer owning the parameter; ``layer_index`` its index.
        ready_gap_us: measured time since the previous gradient became ready (benchmark
            workloads only; 0 for the first), else None.
    """

    name: str
    numel: Int
    size_bytes: Int
    dtype: str
    layer: str
    layer_index: Int
    ready_gap_us: Float | None = None

    __pydantic_config__ = _FORBID


CaptureMethod = Literal["fx", "export", "workload"]


@dataclass(frozen=True, slots=True)
class ModelIR:
    """A captured model or a loaded workload.

    Attributes:
        name: model name (class name, zoo name, or the workload's name).
        layers: layers in dataflow order.
        grad_tensors: gradient tensors in backward-ready order (first ready first).
        num_params: unique parameter elements (tied parameters counted once).
        method: how it was obtained: ``fx`` (symbolic trace), ``export`` (torch.export) or
            ``workload`` (read from a file).
        input_shapes: shapes of the example inputs it was captured with (batch first).
        input_dtypes: their dtypes.
        unattributed_fwd_flops / unattributed_bwd_flops: FLOPs of operations outside every
            layer (glue code in a top-level forward: masks, reshapes, a loss).
        source: free text saying where the workload came from (benchmark file, zoo config).
    """

    name: str
    layers: tuple[LayerIR, ...]
    grad_tensors: tuple[GradTensor, ...]
    num_params: Int
    method: CaptureMethod
    input_shapes: tuple[tuple[Int, ...], ...] = ()
    input_dtypes: tuple[str, ...] = ()
    unattributed_fwd_flops: Int = 0
    unattributed_bwd_flops: Int = 0
    source: str = ""
    schema_version: Int = field(default=WORKLOAD_SCHEMA_VERSION)

    __pydantic_config__ = _FORBID

    # -- derived quantities -------------------------------------------------------------
    @property
    def param_bytes(self) -> int:
        return sum(layer.param_bytes for layer in self.layers)

    @property
    def batch_size(self) -> int:
        """The micro-batch size of the capture: the first dimension of the first input."""
        return self.input_shapes[0][0] if self.input_shapes and self.input_shapes[0] else 1

    @property
    def fwd_flops(self) -> int:
        return sum(layer.fwd_flops for layer in self.layers) + self.unattributed_fwd_flops

    @property
    def bwd_flops(self) -> int:
        return sum(layer.bwd_flops for layer in self.layers) + self.unattributed_bwd_flops

    @property
    def grad_bytes(self) -> int:
        return sum(g.size_bytes for g in self.grad_tensors)

    def layer(self, name: str) -> LayerIR:
        """The layer called ``name``; raises KeyError listing the nearest names."""
        for layer in self.layers:
            if layer.name == name:
                return layer
        from hetplan.ir.validation import did_you_mean

        near = did_you_mean(name, [lay.name for lay in self.layers], n=3)
        raise KeyError(f"no layer {name!r} in {self.name}{near} ({len(self.layers)} layers)")

    def fingerprint(self) -> str:
        """A stable hash of everything a plan depends on (structure, sizes, FLOPs).

        Two captures of the same model with the same example-input shapes give the same
        fingerprint; a changed layer, parameter, dtype or batch shape changes it.
        """
        return hashlib.sha256(self.to_json(indent=None).encode()).hexdigest()[:16]

    # -- (de)serialisation: the workload JSON -------------------------------------------
    def to_json(self, *, indent: int | None = 1) -> str:
        """Serialise to workload JSON (sorted keys: byte-identical for equal IRs)."""
        data = _ADAPTER.dump_python(self, mode="json")
        return json.dumps(data, sort_keys=True, indent=indent) + ("\n" if indent else "")

    def save(self, path: str | Path) -> None:
        write_text_file(path, self.to_json(), what="workload")

    @classmethod
    def from_json(cls, text: str, *, where: str = "<string>") -> ModelIR:
        """Parse workload JSON; a malformed file raises :class:`SpecError` naming the field."""
        from hetplan.ir.validation import parse_json_object

        data = parse_json_object(
            text, where=where, what="a workload file",
            hint="re-export it with `hetplan ir MODEL -o FILE`",
        )
        version = data.get("schema_version", WORKLOAD_SCHEMA_VERSION)
        if version != WORKLOAD_SCHEMA_VERSION:
            from hetplan.errors import PlanVersionError

            raise PlanVersionError(
                f"{where}: workload schema_version {version!r} is not supported by this "
                f"hetplan (reads version {WORKLOAD_SCHEMA_VERSION}); re-export the workload "
                "with a matching hetplan"
            )
        try:
            ir = _ADAPTER.validate_python(data)
        except ValidationError as e:
            from hetplan.ir.validation import format_validation_error

            raise SpecError(format_validation_error(e, where=where, model=ModelIR)) from e
        verify_model_ir(ir, where=where)
        return ir

    @classmethod
    def load(cls, path: str | Path) -> ModelIR:
        from hetplan.ir.files import file_path, read_text_file

        p = file_path(path, what="workload")
        if not p.exists():
            raise SpecError(f"workload file {str(p)!r} does not exist")
        return cls.from_json(read_text_file(p, what="workload"), where=str(p))


_ADAPTER: TypeAdapter[ModelIR] = TypeAdapter(ModelIR)

#: The parts of ``act_saved_bytes`` a layer may break down (see :class:`LayerIR`).
_ACT_PARTS = ("act_saved_nonfloat_bytes", "act_replicated_bytes",
              "act_replicated_nonfloat_bytes", "act_attn_core_bytes",
              "act_attn_core_nonfloat_bytes")


def _check_act_parts(layer: LayerIR, at: str) -> None:
    """Each part of a layer's saved activations fits inside the whole it is a part of."""
    within = (
        ("act_saved_nonfloat_bytes", "act_saved_bytes"),
        ("act_replicated_bytes", "act_saved_bytes"),
        ("act_attn_core_bytes", "act_saved_bytes"),
        ("act_replicated_nonfloat_bytes", "act_replicated_bytes"),
        ("act_replicated_nonfloat_bytes", "act_saved_nonfloat_bytes"),
        ("act_attn_core_nonfloat_bytes", "act_attn_core_bytes"),
        ("act_attn_core_nonfloat_bytes", "act_saved_nonfloat_bytes"),
    )
    for part, whole in within:
        if getattr(layer, part) > getattr(layer, whole):
            raise SpecError(
                f"{at}layer {layer.name!r}: {part} ({getattr(layer, part)}) exceeds {whole} "
                f"({getattr(layer, whole)}); it is a part of it"
            )
    if layer.act_replicated_bytes + layer.act_attn_core_bytes > layer.act_saved_bytes:
        raise SpecError(
            f"{at}layer {layer.name!r}: act_replicated_bytes + act_attn_core_bytes exceed "
            "act_saved_bytes (the attention core lies inside a tensor-parallel region, so the "
            "two parts are disjoint)"
        )


def verify_model_ir(ir: ModelIR, *, where: str = "") -> None:
    """Check the IR's invariants.

    - layer indices are 0..n-1 in order and names are unique;
    - every parameter is owned by exactly one layer (aliases carry ``tied_to`` naming an
      owned parameter), and the owned elements add up to ``num_params``;
    - every gradient tensor names an owned, trainable parameter of the layer it claims,
      with matching size, each at most once, and every trainable parameter has one;
    - the capture's micro-batch (the first dimension of the first input) is at least 1;
    - sizes and FLOPs are non-negative, a linear's ``split_unit`` positive and a divisor of
      the features it splits (a row linear's input, any other's output).
    """
    at = f"{where}: " if where else ""
    if not ir.layers:
        raise SpecError(f"{at}the workload has no layers")
    if ir.input_shapes and ir.input_shapes[0] and ir.input_shapes[0][0] < 1:
        raise SpecError(f"{at}the example inputs hold 0 samples (the first input's shape is "
                        f"{tuple(ir.input_shapes[0])}, its first dimension the micro-batch): "
                        "capture one micro-batch of at least 1 sample")
    names: set[str] = set()
    owned: dict[str, tuple[int, int]] = {}  # param name -> (layer index, numel)
    trainable: set[str] = set()
    for i, layer in enumerate(ir.layers):
        if layer.index != i:
            raise SpecError(f"{at}layer {layer.name!r} has index {layer.index}, expected {i}")
        if layer.name in names:
            raise SpecError(f"{at}layer name {layer.name!r} appears twice")
        names.add(layer.name)
        for field_name in ("fwd_flops", "bwd_flops", "act_in_bytes", "act_out_bytes",
                           "act_saved_bytes", *_ACT_PARTS, "attn_core_fwd_flops",
                           "mem_fwd_bytes", "mem_bwd_bytes", "core_mem_fwd_bytes",
                           "core_mem_bwd_bytes"):
            if getattr(layer, field_name) < 0:
                raise SpecError(f"{at}layer {layer.name!r}: {field_name} is negative")
        if layer.cut_bytes_after is not None and layer.cut_bytes_after < 0:
            raise SpecError(f"{at}layer {layer.name!r}: cut_bytes_after is negative")
        for lin in layer.linears:
            if lin.split_unit is not None and lin.split_unit < 1:
                raise SpecError(f"{at}linear {lin.name!r}: split_unit must be >= 1 (features "
                                f"per head), got {lin.split_unit}")
            split = lin.in_features if lin.tp_role == TPRole.ROW else lin.out_features
            if lin.split_unit is not None and split % lin.split_unit:
                raise SpecError(f"{at}linear {lin.name!r}: split_unit {lin.split_unit} does "
                                f"not divide the {split} features it splits; give the "
                                "features of one head (or key/value group), or remove it")
        _check_act_parts(layer, at)
        for p in layer.params:
            if p.tied_to is not None:
                continue
            if p.name in owned:
                other = ir.layers[owned[p.name][0]].name
                raise SpecError(
                    f"{at}parameter {p.name!r} is owned by both {other!r} and {layer.name!r}; "
                    "mark one of them as an alias with tied_to"
                )
            owned[p.name] = (i, p.numel)
            if p.requires_grad:
                trainable.add(p.name)
    for layer in ir.layers:
        for p in layer.params:
            if p.tied_to is not None and p.tied_to not in owned:
                raise SpecError(
                    f"{at}layer {layer.name!r}: {p.name!r} is tied to {p.tied_to!r}, "
                    "which no layer owns"
                )
    total = sum(numel for _, numel in owned.values())
    if total != ir.num_params:
        raise SpecError(
            f"{at}layers own {total:,} parameter elements but num_params is "
            f"{ir.num_params:,}: a parameter is missing from the layers or counted twice"
        )
    seen: set[str] = set()
    for g in ir.grad_tensors:
        if g.name in seen:
            raise SpecError(f"{at}gradient {g.name!r} is listed twice")
        seen.add(g.name)
        if g.name not in owned:
            raise SpecError(f"{at}gradient {g.name!r} belongs to no parameter of any layer")
        layer_index, numel = owned[g.name]
        if g.layer_index != layer_index or ir.layers[layer_index].name != g.layer:
            raise SpecError(
                f"{at}gradient {g.name!r} claims layer {g.layer!r} (#{g.layer_index}) but its "
                f"parameter is owned by {ir.layers[layer_index].name!r} (#{layer_index})"
            )
        if g.numel != numel:
            raise SpecError(
                f"{at}gradient {g.name!r} has {g.numel} elements, its parameter {numel}"
            )
    missing = trainable - seen
    if missing and ir.method != "workload":
        raise SpecError(
            f"{at}trainable parameters with no gradient tensor: {sorted(missing)[:5]}"
        )
