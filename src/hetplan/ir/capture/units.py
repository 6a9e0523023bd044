"""Capture step 2: which modules become layers, and their tensor-parallel linears.

Both are read from the module structure alone (no tracing): :func:`layer_units` picks the
layer granularity pipeline balancing needs (see :mod:`hetplan.ir.capture`), and
:func:`layer_linears` finds each layer's ``nn.Linear`` / HF ``Conv1D`` modules with their
Megatron column/row roles, by name first and shape second, and the head units of attention
projections (:mod:`~hetplan.ir.capture.attention`).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hetplan.ir.capture.attention import attention_parts, split_units
from hetplan.ir.model import LayerKind, LinearInfo, TPRole

__all__ = ["UnitInfo", "layer_units", "layer_linears"]


# --------------------------------------------------------------------------------------
# 2. layer units
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class UnitInfo:
    """A module chosen as one layer. ``own_only``: only the module's direct parameters."""

    name: str
    kind: LayerKind
    module_type: str
    group: str | None = None
    own_only: bool = False


_NORM_RE = re.compile(r"norm", re.IGNORECASE)


def _has_params(m: nn.Module) -> bool:
    return next(m.parameters(), None) is not None


def _signature(m: nn.Module) -> tuple:
    return tuple((n, tuple(p.shape)) for n, p in m.named_parameters())


def _is_block_list(m: nn.Module) -> bool:
    """Whether the elements of ``m`` are repeated blocks (each one layer).

    ``m`` must be a ModuleList/Sequential of ≥2 parameterised modules of one class, and
    either (a) at least two and at least half of them share one parameter structure
    (transformer layers; ResNet stages whose first bottleneck differs), or (b) ``m`` is a
    ModuleList and no element itself contains repeated blocks (T5's blocks, whose first one
    owns the relative-position bias). A Sequential of differently shaped convolutions is not.
    """
    if not isinstance(m, (nn.ModuleList, nn.Sequential)):
        return False
    kids = [c for c in m.children() if _has_params(c)]
    if len(kids) < 2 or len({type(c) for c in kids}) != 1:
        return False
    most_common = Counter(_signature(c) for c in kids).most_common(1)[0][1]
    if most_common >= 2 and 2 * most_common >= len(kids):
        return True
    return isinstance(m, nn.ModuleList) and not any(
        _is_block_list(sub) for c in kids for sub in c.modules() if sub is not c
    )


def _leaf_kind(m: nn.Module) -> LayerKind:
    cls = type(m).__name__
    if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) or cls.endswith("Embedding"):
        return LayerKind.EMBEDDING
    if _NORM_RE.search(cls):
        return LayerKind.NORM
    if isinstance(m, nn.Linear) or cls == "Conv1D":
        return LayerKind.LINEAR
    if isinstance(m, nn.modules.conv._ConvNd):
        return LayerKind.CONV
    return LayerKind.OTHER


def layer_units(model: nn.Module, opaque: Sequence[str] = ()) -> dict[str, UnitInfo]:
    """Choose the modules that become layers (see the module docstring), in module order.

    Returns a dict qualname → UnitInfo. A module reachable under two names (a shared
    submodule) is a unit once, under its first name.
    """
    units: dict[str, UnitInfo] = {}
    seen: set[int] = set()
    opaque_set = set(opaque)

    def add(q: str, m: nn.Module, kind: LayerKind, group: str | None = None) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        units[q] = UnitInfo(q, kind, type(m).__name__, group)

    def block(q: str, m: nn.Module, group: str) -> None:
        # one of a list of repeated blocks: a layer of its group, or opaque when named so
        if q in opaque_set:
            add(q, m, LayerKind.OPAQUE)
        else:
            add(q, m, LayerKind.BLOCK, group=group)

    def walk(module: nn.Module, prefix: str) -> None:
        own = list(module.named_parameters(recurse=False))
        kids = [(n, c) for n, c in module.named_children() if _has_params(c)]
        if own and kids and id(module) not in seen:
            units[prefix] = UnitInfo(prefix, LayerKind.PARAMS, type(module).__name__, None, True)
        for n, child in kids:
            q = f"{prefix}.{n}" if prefix else n
            if id(child) in seen:
                continue
            if q in opaque_set:
                add(q, child, LayerKind.OPAQUE)
            elif _is_block_list(child):
                for en, el in child.named_children():
                    if _has_params(el):
                        block(f"{q}.{en}", el, q)
            elif any(_has_params(c) for c in child.children()):
                walk(child, q)
            else:
                add(q, child, _leaf_kind(child))

    if _is_block_list(model):
        for en, el in model.named_children():
            if _has_params(el):
                block(en, el, "")
    elif any(_has_params(c) for c in model.children()):
        walk(model, "")
    elif _has_params(model):
        add("", model, _leaf_kind(model))
    return units



# --------------------------------------------------------------------------------------
# tensor-parallel candidates
# --------------------------------------------------------------------------------------
_COLUMN_RE = re.compile(
    r"(^|\.)(q_proj|k_proj|v_proj|qkv_proj|query|key|value|c_attn|qkv|wqkv|in_proj|"
    r"query_key_value|fc1|c_fc|up_proj|gate_proj|gate_up_proj|w1|w3|wi|wi_0|wi_1|fc_in|"
    r"dense_h_to_4h|intermediate\.dense|lin1|q|k|v)$",
    re.IGNORECASE,
)
_ROW_RE = re.compile(
    r"(^|\.)(o_proj|out_proj|c_proj|dense_4h_to_h|fc2|down_proj|w2|wo|fc_out|"
    r"output\.dense|attention\.output\.dense|lin2|o)$",
    re.IGNORECASE,
)


def _linear_shape(m: nn.Module) -> tuple[int, int] | None:
    if isinstance(m, nn.Linear):
        return m.in_features, m.out_features
    weight = getattr(m, "weight", None)
    if type(m).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[0]), int(weight.shape[1])  # HF Conv1D stores [in, out]
    return None


def layer_linears(module: nn.Module, unit: str) -> tuple[LinearInfo, ...]:
    """The linears of one layer with Megatron roles: names first, shapes second.

    A row-parallel linear is paired with the closest column-parallel linear before it in
    module order (v_proj → o_proj, up_proj → down_proj, c_fc → c_proj). The projections of
    an attention module (:func:`~hetplan.ir.capture.attention.attention_parts`) carry the
    unit a split must keep together (``split_unit``: whole heads, whole groups with GQA).
    """
    heads: dict[str, int] = {}  # path below ``module`` -> split unit
    for n, m in module.named_modules():
        parts = attention_parts(m)
        if parts is not None:
            for path, size in split_units(parts).items():
                heads[f"{n}.{path}" if n else path] = size
    found: list[tuple[str, int, int, bool, TPRole]] = []
    local: list[str] = []  # each found linear's path below ``module``
    for n, m in module.named_modules():
        shape = _linear_shape(m)
        if shape is None:
            continue
        q = f"{unit}.{n}" if unit and n else (n or unit)
        if _COLUMN_RE.search(n):
            role = TPRole.COLUMN
        elif _ROW_RE.search(n):
            role = TPRole.ROW
        else:
            role = TPRole.EITHER
        found.append((q, shape[0], shape[1], getattr(m, "bias", None) is not None, role))
        local.append(n)
    if not found:
        return ()
    out: list[LinearInfo] = []
    open_columns: list[str] = []
    pairs: dict[str, str] = {}
    for q, _i, _o, _b, role in found:
        if role is TPRole.COLUMN:
            open_columns.append(q)
        elif role is TPRole.ROW and open_columns:
            pairs[q] = open_columns[-1]
            for c in open_columns:
                pairs[c] = q
            open_columns = []
    for (q, i, o, b, role), n in zip(found, local, strict=True):
        out.append(LinearInfo(q, i, o, b, role, pairs.get(q), heads.get(n)))
    return tuple(out)
