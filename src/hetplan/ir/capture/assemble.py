"""Capture step 5: the :class:`~hetplan.ir.model.ModelIR` from the graph and its meta run.

:func:`assemble` names each layer's parameters (canonical names; aliases of tied weights),
takes FLOPs and saved bytes (with their breakdown: non-floating, replicated under tensor
parallelism, attention core) from the :class:`~hetplan.ir.capture.execute.Executor`,
activation bytes in/out from the graph's edges between layers, the gradient tensors in
backward-ready order and the layers' tensor-parallel linears; it refuses parameters the
inputs never use (they would get no gradient).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from hetplan.errors import TraceError
from hetplan.ir.capture.execute import Executor
from hetplan.ir.capture.trace import Graph
from hetplan.ir.capture.units import UnitInfo, layer_linears
from hetplan.ir.kernels import Gemm
from hetplan.ir.model import DTYPE_BYTES, GradTensor, LayerIR, LayerKind, ModelIR, ParamInfo

__all__ = ["assemble"]


# --------------------------------------------------------------------------------------
# 5. assembly
# --------------------------------------------------------------------------------------
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tensor_bytes(value: Any) -> int:
    total = 0
    for t in tree_leaves(value):
        if isinstance(t, torch.Tensor):
            total += t.numel() * DTYPE_BYTES.get(_dtype_name(t.dtype), t.element_size())
    return total


def _param_info(name: str, p: torch.Tensor, tied_to: str | None) -> ParamInfo:
    dtype = _dtype_name(p.dtype)
    return ParamInfo(
        name=name,
        shape=tuple(int(s) for s in p.shape),
        dtype=dtype,
        numel=p.numel(),
        size_bytes=p.numel() * DTYPE_BYTES.get(dtype, p.element_size()),
        tied_to=tied_to,
        requires_grad=p.requires_grad,
    )


def assemble(
    original: nn.Module,
    model: nn.Module,
    graph: Graph,
    units: dict[str, UnitInfo],
    ex: Executor,
    name: str | None,
    args: tuple,
    kwargs: dict,
) -> ModelIR:
    # canonical parameter names: the first name under which a tensor is registered
    canonical: dict[int, str] = {}
    for pname, param in model.named_parameters(remove_duplicate=False):
        canonical.setdefault(id(param), pname)
    gm_params = {id(p): pname for pname, p in graph.gm.named_parameters(remove_duplicate=False)}
    gm_to_model = {}
    for pid, pname in gm_params.items():
        try:
            gm_to_model[pid] = id(model.get_parameter(pname))
        except AttributeError:
            continue

    # parameters used by each invocation
    inv_params: dict[str, list[tuple[str, torch.Tensor]]] = {
        inv: [] for inv, _ in graph.invocations}
    for inv, unit in graph.invocations:
        u = units[unit]
        module = model.get_submodule(unit) if unit else model
        prefix = f"{unit}." if unit else ""
        inv_params[inv] = [
            (prefix + n, p) for n, p in module.named_parameters(recurse=not u.own_only,
                                                                remove_duplicate=False)
        ]

    # ownership: a tensor is owned by the first invocation (dataflow order) that uses it
    owner: dict[int, str] = {}
    for inv, _ in graph.invocations:
        for _, p in inv_params[inv]:
            owner.setdefault(id(p), inv)
    index = {inv: i for i, (inv, _) in enumerate(graph.invocations)}
    _check_dataflow_order(graph, ex, index)
    act_in, act_out = _activation_bytes(graph, ex)
    parts = ex.activation_parts()

    layers: list[LayerIR] = []
    for inv, unit in graph.invocations:
        u = units[unit]
        seen_here: set[int] = set()
        params = []
        for pname, p in inv_params[inv]:
            if id(p) in seen_here:
                continue
            seen_here.add(id(p))
            canon = canonical[id(p)]
            is_owner = owner[id(p)] == inv and canon == pname
            tied = None if is_owner else canon
            if owner[id(p)] == inv and canon != pname and not _canon_in(canon, inv_params[inv]):
                tied = None  # owning layer reaches the tensor only under an alias name
                pname = canon
            params.append(_param_info(pname, p, tied))
        module = model.get_submodule(unit) if unit else model
        layers.append(
            LayerIR(
                index=index[inv],
                name=inv,
                kind=u.kind,
                module_type=u.module_type,
                group=u.group,
                params=tuple(params),
                fwd_flops=ex.counter.fwd.get(inv, 0),
                bwd_flops=ex.counter.bwd.get(inv, 0),
                act_in_bytes=act_in.get(inv, 0),
                act_out_bytes=act_out.get(inv, 0),
                act_saved_bytes=ex.saved.get(inv, 0),
                linears=() if u.own_only or "@" in inv else layer_linears(module, unit),
                attn_core_fwd_flops=ex.counter.core_fwd.get(inv, 0),
                **_act_parts(parts.get(inv, {})),
                **_kernels(ex.counter, inv),
            )
        )
    layers = _mark_head(layers)

    # gradient tensors in backward-ready order
    grads: list[GradTensor] = []
    done: set[int] = set()
    by_id = {id(p): p for p in model.parameters()}
    for gid in ex.grad_order:
        pid = gm_to_model.get(gid, gid)
        if pid in done or pid not in by_id:
            continue
        done.add(pid)
        p = by_id[pid]
        grad_layer = owner.get(pid)
        if grad_layer is None:
            continue
        dtype = _dtype_name(p.dtype)
        grads.append(
            GradTensor(
                name=canonical[pid],
                numel=p.numel(),
                size_bytes=p.numel() * DTYPE_BYTES.get(dtype, p.element_size()),
                dtype=dtype,
                layer=grad_layer,
                layer_index=index[grad_layer],
            )
        )
    unused = [canonical[id(p)] for p in model.parameters() if id(p) not in owner]
    if unused:
        raise TraceError(
            f"{type(original).__name__}: parameters never used in forward with these inputs: "
            f"{unused[:5]}{' …' if len(unused) > 5 else ''}; they would get no gradient. "
            "Capture with inputs that exercise them, or freeze them (requires_grad=False) "
            "and remove them from the model",
            reason="unused parameters",
        )
    no_grad = [canonical[id(p)] for p in model.parameters() if p.requires_grad
               and id(p) not in done]
    if no_grad:
        raise TraceError(
            f"{type(original).__name__}: no gradient reaches the trainable parameters "
            f"{no_grad[:5]}{' …' if len(no_grad) > 5 else ''}: the forward's outputs do not "
            "depend on them differentiably (a .detach(), an argmax or comparison, or no "
            "floating-point output). Capture a forward whose output back-propagates to them, "
            "or freeze them (requires_grad=False)",
            reason="no gradient",
        )
    return ModelIR(
        name=name or type(original).__name__,
        layers=tuple(layers),
        grad_tensors=tuple(grads),
        num_params=sum(p.numel() for p in model.parameters()),
        method=graph.method,  # type: ignore[arg-type]
        input_shapes=tuple(
            tuple(int(s) for s in t.shape) for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        ),
        input_dtypes=tuple(
            _dtype_name(t.dtype) for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        ),
    )


def _act_parts(part: dict[str, int]) -> dict[str, Any]:
    """The ``act_*`` breakdown fields of a layer from the executor's per-layer parts."""
    return {
        "act_saved_nonfloat_bytes": part.get("saved_nonfloat", 0),
        "act_replicated_bytes": part.get("replicated", 0),
        "act_replicated_nonfloat_bytes": part.get("replicated_nonfloat", 0),
        "act_attn_core_bytes": part.get("core", 0),
        "act_attn_core_nonfloat_bytes": part.get("core_nonfloat", 0),
    }


def _canon_in(canon: str, params: list[tuple[str, torch.Tensor]]) -> bool:
    return any(n == canon for n, _ in params)


def _check_dataflow_order(graph: Graph, ex: Executor, index: dict[str, int]) -> None:
    """Verify that no layer consumes a tensor produced by a later layer."""
    for node in graph.gm.graph.nodes:
        src = ex.exec_layer.get(node)
        if src is None or node.op == "get_attr":
            continue
        for user in node.users:
            dst = ex.exec_layer.get(user)
            if dst is not None and index[dst] < index[src]:
                raise TraceError(
                    f"layer order is inconsistent with dataflow: {dst!r} (#{index[dst]}) "
                    f"consumes {node.name!r} produced by {src!r} (#{index[src]}); this is a "
                    "hetplan bug, please report it with the model",
                    module=src,
                    reason="dataflow order",
                )


def _activation_bytes(graph: Graph, ex: Executor) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes entering / leaving each invocation, from the graph edges between layers."""
    layer_of = ex.exec_layer
    act_in: defaultdict[str, int] = defaultdict(int)
    act_out: defaultdict[str, int] = defaultdict(int)
    for node in graph.gm.graph.nodes:
        if node.op in ("get_attr", "output"):
            continue
        src = layer_of.get(node)
        size = _tensor_bytes(ex.values.get(node))
        if size == 0:
            continue
        consumers = {layer_of.get(u) for u in node.users if u.op != "output"}
        if any(u.op == "output" for u in node.users) and src is not None:
            act_out[src] += size
        for dst in consumers:
            if dst is None or dst == src:
                continue
            act_in[dst] += size
        if src is not None and any(c != src for c in consumers if c is not None):
            act_out[src] += size
    return dict(act_in), dict(act_out)


def _mark_head(layers: list[LayerIR]) -> list[LayerIR]:
    """The last layer, if it is a linear (an LM head or classifier), is the head."""
    if layers and layers[-1].kind is LayerKind.LINEAR:
        from dataclasses import replace

        layers[-1] = replace(layers[-1], kind=LayerKind.HEAD)
    return layers


def _kernels(counter: Any, inv: str) -> dict[str, Any]:
    """A layer's matrix multiplies by shape and the bytes its other kernels move (see
    :class:`~hetplan.ir.model.LayerIR`), in a deterministic order."""
    gemms = tuple(
        Gemm(phase=phase, core=core, batch=b, m=m, n=n, k=k, count=count)
        for (phase, core, b, m, n, k), count in sorted(counter.gemms.get(inv, {}).items())
    )
    mem = counter.mem_bytes.get(inv, {})
    return {
        "gemms": gemms,
        "mem_fwd_bytes": mem.get(("fwd", False), 0),
        "mem_bwd_bytes": mem.get(("bwd", False), 0),
        "core_mem_fwd_bytes": mem.get(("fwd", True), 0),
        "core_mem_bwd_bytes": mem.get(("bwd", True), 0),
    }
