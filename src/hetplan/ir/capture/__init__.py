"""Model capture: ``nn.Module`` → :class:`~hetplan.ir.model.ModelIR`.

This package is the only part of hetplan that imports ``torch.fx`` / ``torch.export``. The
entry point :func:`capture` and step 1 live here; the other steps are one module each:
:mod:`~hetplan.ir.capture.units` (step 2 and the tensor-parallel linears),
:mod:`~hetplan.ir.capture.trace` (step 3), :mod:`~hetplan.ir.capture.execute` (step 4) and
:mod:`~hetplan.ir.capture.assemble` (step 5).

How it works:

1. **Meta clone** (:func:`_meta_clone`). The model is deep-copied with every parameter and
   buffer replaced by an empty ``meta`` tensor of the same shape and dtype, so no real weight
   or activation is ever allocated: a 70B model is captured in a few hundred MiB. Tied
   parameters stay tied (the copy is keyed on tensor identity). A model already on ``meta``
   is used as it is. The caller's model is never modified.
2. **Layer units** (:func:`~hetplan.ir.capture.units.layer_units`). The granularity pipeline
   balancing needs: every element of a *repeated block list* (a ModuleList/Sequential whose
   elements share one class and mostly one parameter structure — transformer blocks, ResNet
   bottlenecks) is one layer; every other parameterised leaf module (embeddings, norms, heads,
   convolutions) is one layer; parameters owned directly by a container (a ViT cls token) form
   a ``params`` layer.
3. **Graph** (:func:`~hetplan.ir.capture.trace.build_graph`). ``torch.fx.symbolic_trace`` with
   the layer units as leaf modules where it works; otherwise ``torch.export`` (non-strict),
   whose aten nodes are mapped back to layers through ``nn_module_stack``. Each call of a
   module is a layer *invocation*; a module called twice (weight sharing across positions)
   gives a second layer ``name@1`` whose parameters are aliases of the first.
4. **Meta execution** (:class:`~hetplan.ir.capture.execute.Executor`). The captured graph is
   run once forward and once backward on meta tensors. A dispatch mode counts FLOPs per aten op
   with torch's own formulas (``torch.utils.flop_counter``), attributed to the layer running:
   in forward the graph node being interpreted, in backward the layer that created the autograd
   node (every ``grad_fn`` is tagged when it is created). Parameter post-accumulate-grad hooks
   record the **backward-ready order** of gradients — exactly the order the runtime's gradient
   hooks, Espresso and Cupcake see.
5. **Assembly and verification** (:func:`~hetplan.ir.capture.assemble.assemble`): activation
   bytes in/out per layer from the graph's edges, the tensor-parallel linears of each layer,
   and :func:`hetplan.ir.model.verify_model_ir`; then the pipeline-boundary fields
   (:func:`~hetplan.ir.capture.dataflow.boundary_fields`: the bytes every boundary cuts,
   which layers a stage may start at).

Glue code outside every layer (mask construction, residual adds written in a top-level
forward, a loss) is attributed to the next layer in dataflow order (or the last layer when
nothing follows), so per-layer FLOPs add up to the model's total. Decision recorded in
``docs/decisions.md``.

Escape hatch: ``opaque_modules=["encoder.router"]`` makes the named modules fx leaves that are
executed for real on CPU with zero-filled weights and inputs (only that module is
materialised), which gets past data-dependent control flow inside them; their backward FLOPs
are estimated as 2× forward. This works on the fx path (models that are otherwise
symbolically traceable).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from hetplan.errors import TraceError
from hetplan.ir import block_reuse
from hetplan.ir.capture.assemble import assemble
from hetplan.ir.capture.dataflow import boundary_fields, layer_dataflow
from hetplan.ir.capture.execute import Executor
from hetplan.ir.capture.trace import build_graph, capture_error
from hetplan.ir.capture.units import layer_units
from hetplan.ir.dataflow import LayerDataflow
from hetplan.ir.model import LayerKind, ModelIR, verify_model_ir
from hetplan.ir.validation import did_you_mean

__all__ = ["capture", "capture_dataflow"]


# --------------------------------------------------------------------------------------
# public entry point
# --------------------------------------------------------------------------------------
def capture(
    model: nn.Module,
    example_inputs: Sequence[Any] | Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    name: str | None = None,
    opaque_modules: Iterable[str] = (),
    method: str = "auto",
    reuse_blocks: bool = True,
) -> ModelIR:
    """Capture ``model`` into a :class:`ModelIR` without allocating weights or activations.

    Args:
        model: any ``nn.Module``, on any device (``meta`` included); it is not modified.
        example_inputs: positional inputs of one training micro-batch (tensors are used only
            for their shape and dtype). A single tensor may be passed bare.
        example_kwargs: keyword inputs (e.g. ``{"use_cache": False}`` for HF LMs).
        name: the IR's name (default: the model's class name).
        opaque_modules: qualified names of modules to treat as opaque leaves (see module doc;
            one name may be given as a string).
        method: ``"auto"`` (fx, then torch.export), ``"fx"`` or ``"export"``.
        reuse_blocks: trace each long list of identical blocks once and replicate it in the
            IR (:mod:`hetplan.ir.block_reuse`); the result equals a full capture. False
            traces every block.

    Returns:
        The verified IR.

    Raises:
        TraceError: the model cannot be captured; names the module and the reason.

    Example:
        >>> import torch, hetplan
        >>> mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
        ...                           torch.nn.Linear(16, 4))
        >>> ir = hetplan.capture(mlp, torch.randn(2, 8))
        >>> [layer.name for layer in ir.layers], ir.num_params
        (['0', '2'], 212)
    """
    _check_method(method)
    if name is not None and not isinstance(name, str):
        raise TraceError(f"capture(name={name!r}): the IR's name is a string (plans and "
                         f"reports show it), got {type(name).__name__}", reason="bad name")
    if not isinstance(model, nn.Module):
        raise TraceError(
            f"capture() needs a torch.nn.Module, got {type(model).__name__}",
            reason="not a module",
        )
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    kwargs = _example_kwargs(example_kwargs)
    _check_inputs_fit_forward(model, tuple(example_inputs), kwargs)
    _check_no_lazy_parameters(model)
    opaque = _opaque_names(opaque_modules)
    _check_opaque_names(model, opaque)

    meta_model = _meta_clone(model)
    args_meta = tree_map(_to_meta, tuple(example_inputs))
    kwargs_meta = tree_map(_to_meta, kwargs)
    units = layer_units(meta_model, opaque)
    if not units:
        raise TraceError(
            f"{type(model).__name__} has no parameters: there is nothing to plan",
            reason="no parameters",
        )
    _check_opaque_units(meta_model, opaque, units)
    # a list with an opaque block is traced whole (its blocks are no longer alike)
    # (a list at the root, group "", holds every module: any opaque name is in it)
    groups = sorted({u.group for u in units.values() if u.group is not None
                     and not any(u.group == "" or o.startswith(f"{u.group}.")
                                 for o in opaque)})
    cuts = block_reuse.plan_cuts(meta_model, groups) if reuse_blocks else []
    ir = None
    if cuts:
        try:
            with block_reuse.truncated(meta_model, cuts):
                short = _capture_once(model, meta_model, args_meta, kwargs_meta, opaque, method)
            ir = block_reuse.expand_blocks(short, cuts)
        except TraceError:
            ir = None  # the full capture below reports the real problem
    if ir is None:
        ir = _capture_once(model, meta_model, args_meta, kwargs_meta, opaque, method)
    if name:
        ir = dataclasses.replace(ir, name=name)
    verify_model_ir(ir, where=ir.name)
    return ir


def _check_method(method: str) -> None:
    if method not in ("auto", "fx", "export"):
        raise TraceError(f"capture(method={method!r}): use 'auto' (fx, then torch.export), "
                         "'fx' or 'export'", reason="unknown method")


def capture_dataflow(
    model: nn.Module,
    example_inputs: Sequence[Any] | Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    opaque_modules: Iterable[str] = (),
    method: str = "auto",
) -> LayerDataflow:
    """The tensors passed between the layers of ``model`` (:mod:`hetplan.ir.dataflow`):
    what each pipeline boundary must send when the model is not a chain. Same arguments as
    :func:`capture` (every block traced); its layer ``k`` is ``capture(...).layers[k]``.

    Raises:
        TraceError: the model cannot be captured, or a layer reads a later layer's tensor.
    """
    _check_method(method)
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    opaque = _opaque_names(opaque_modules)
    _check_opaque_names(model, opaque)
    meta_model = _meta_clone(model)
    args = tree_map(_to_meta, tuple(example_inputs))
    kwargs = tree_map(_to_meta, dict(example_kwargs or {}))
    units = layer_units(meta_model, opaque)
    _check_opaque_units(meta_model, opaque, units)
    graph = build_graph(meta_model, args, kwargs, units, opaque, method)
    executor = Executor(meta_model, graph, units)
    executor.run()
    flow = layer_dataflow(graph, executor)
    back = flow.backward_edges()
    if back:
        u, v, name = back[0]
        raise TraceError(f"layer order is inconsistent with dataflow: layer #{v} reads "
                         f"{name!r} produced by layer #{u}; this is a hetplan bug, please "
                         "report it with the model", reason="dataflow order")
    return flow


def _capture_once(
    original: nn.Module,
    meta_model: nn.Module,
    args: tuple,
    kwargs: dict,
    opaque: tuple[str, ...],
    method: str,
) -> ModelIR:
    units = layer_units(meta_model, opaque)
    graph = build_graph(meta_model, args, kwargs, units, opaque, method)
    executor = Executor(meta_model, graph, units)
    executor.run()
    ir = assemble(original, meta_model, graph, units, executor, None, args, kwargs)
    cut, cuttable = boundary_fields(
        graph, executor, {lay.name: lay.act_out_bytes for lay in ir.layers})
    return dataclasses.replace(ir, layers=tuple(
        dataclasses.replace(lay, cut_bytes_after=c, cuttable_before=ok)
        for lay, c, ok in zip(ir.layers, cut, cuttable, strict=True)))


def _opaque_names(opaque_modules: Iterable[str]) -> tuple[str, ...]:
    """``opaque_modules`` as a tuple of names; one name may be given as a plain string."""
    if isinstance(opaque_modules, str):
        return (opaque_modules,)
    return tuple(opaque_modules)


def _example_kwargs(example_kwargs: Any) -> dict[str, Any]:
    """``example_kwargs`` as a dict; anything but a mapping with string keys is refused."""
    if example_kwargs is None:
        return {}
    if not isinstance(example_kwargs, Mapping) or not all(
            isinstance(k, str) for k in example_kwargs):
        raise TraceError(
            "example_kwargs must be a mapping of keyword names to inputs, got "
            f"{type(example_kwargs).__name__}; pass positional inputs as example_inputs",
            reason="example_kwargs not a mapping")
    return dict(example_kwargs)


def _check_inputs_fit_forward(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    """Refuse example inputs that ``model.forward``'s signature does not take (too many or
    too few positional inputs, an unknown keyword), blaming the inputs rather than the code
    of the forward."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):  # no signature to check against: tracing will tell
        return
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        raise capture_error(model, "", f"the example inputs do not fit it (forward{sig}: "
                                       f"{e})") from None


def _check_no_lazy_parameters(model: nn.Module) -> None:
    """Refuse a model with uninitialized lazy parameters (``nn.LazyLinear`` before its
    first forward): their shapes, and so every size, are not known yet."""
    for name, p in model.named_parameters():
        if nn.parameter.is_lazy(p):
            module = name.rpartition(".")[0]
            raise TraceError(
                f"cannot capture {type(model).__name__}: module {module!r} has an "
                f"uninitialized (lazy) parameter {name!r}, whose shape is not known yet; run "
                "one forward of the model on real inputs first (that materialises lazy "
                "modules), then capture it", module=module, reason="lazy parameter")


# --------------------------------------------------------------------------------------
# 1. meta clone
# --------------------------------------------------------------------------------------
def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.empty(x.shape, dtype=x.dtype, device="meta")
    return x


def _meta_clone(model: nn.Module) -> nn.Module:
    """A structural copy of ``model`` whose tensors are all on ``meta``; ties preserved."""
    params = [p for _, p in model.named_parameters(remove_duplicate=False)]
    buffers = [b for _, b in model.named_buffers(remove_duplicate=False)]
    tensors = params + buffers
    if all(t.device.type == "meta" for t in tensors):
        return model
    memo: dict[int, Any] = {}
    for p in params:
        if id(p) not in memo:
            memo[id(p)] = nn.Parameter(_to_meta(p), requires_grad=p.requires_grad)
    for b in buffers:
        memo.setdefault(id(b), _to_meta(b))
    return copy.deepcopy(model, memo)


def _check_opaque_units(model: nn.Module, opaque: tuple[str, ...],
                        units: Mapping[str, Any]) -> None:
    """Refuse an opaque name that would change nothing: only a module captured as a layer
    of its own can run as an opaque leaf (the top-level module, a container that is never
    called, a module inside another layer, a module without parameters cannot)."""
    for q in opaque:
        mod = model.get_submodule(q)
        unit = units.get(q)
        if unit is not None and unit.kind is LayerKind.OPAQUE and not isinstance(
                mod, (nn.ModuleList, nn.ModuleDict)):
            continue
        where = f"opaque_modules names {q!r}"
        if q == "":
            why = ("the top-level module, which cannot be opaque (the model would be a single "
                   "layer); name the submodule whose forward fails")
        elif isinstance(mod, (nn.ModuleList, nn.ModuleDict)):
            first = next((n for n, _ in mod.named_children()), "0")
            why = (f"a {type(mod).__name__}, which is never called (its elements are); name "
                   f"the element that fails, e.g. '{q}.{first}'")
        elif owner := max((u for u in units if u and q.startswith(u + ".")), key=len,
                          default=""):
            why = (f"a module inside layer {owner!r}, which is captured as one layer: name "
                   f"{owner!r} to run that whole layer as an opaque leaf")
        else:
            why = ("a module without parameters, which is no layer of its own, so it cannot "
                   "be an opaque leaf; name the module with parameters that calls it")
        raise TraceError(f"{where}: {why}", module=q, reason="opaque module not a layer")


def _check_opaque_names(model: nn.Module, opaque: tuple[str, ...]) -> None:
    names = {n for n, _ in model.named_modules()}
    for q in opaque:
        if q not in names:
            children = ", ".join(repr(n) for n, _ in sorted(model.named_children()))
            near = did_you_mean(q, sorted(names), n=3) or f"; its top-level modules: {children}"
            raise TraceError(
                f"opaque_modules names {q!r}, which is not a module of "
                f"{type(model).__name__}{near}",
                module=q,
                reason="unknown module",
            )


