"""Capture step 3: the model as an fx graph whose nodes are mapped to layer invocations.

:func:`build_graph` tries ``torch.fx.symbolic_trace`` with the layer units as leaf modules,
then ``torch.export`` (non-strict), whose aten nodes are mapped back to layers through
``nn_module_stack``. When both fail, eager meta execution locates the failing module and the
:class:`~hetplan.errors.TraceError` names it with the fix (``opaque_modules``).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import re
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn

from hetplan.errors import TraceError
from hetplan.ir.capture.units import UnitInfo

__all__ = ["Graph", "build_graph", "capture_error", "explain_failure", "module_of_node"]


# --------------------------------------------------------------------------------------
# 3. graph capture
# --------------------------------------------------------------------------------------
@dataclass
class Graph:
    """A captured fx graph plus, per node, the layer invocation it belongs to."""

    gm: torch.fx.GraphModule
    method: str
    node_layer: dict[torch.fx.Node, str]  # invocation name ("h.0", "shared@1")
    invocations: list[tuple[str, str]]  # (invocation name, unit name) in dataflow order
    flat_inputs: list[Any]


class _LeafTracer(torch.fx.Tracer):
    def __init__(self, leaves: set[str]) -> None:
        super().__init__()
        self._leaves = leaves

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return qualname in self._leaves or super().is_leaf_module(m, qualname)


def build_graph(
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    units: dict[str, UnitInfo],
    opaque: tuple[str, ...],
    method: str,
) -> Graph:
    errors: list[tuple[str, BaseException]] = []
    if method in ("auto", "fx"):
        try:
            return _trace_fx(model, args, kwargs, units)
        except Exception as e:  # noqa: BLE001 - any tracer failure means "try export"
            errors.append(("torch.fx.symbolic_trace", e))
    if opaque and method == "auto":
        method = "fx"  # opaque leaves exist only on the fx path
    if method in ("auto", "export"):
        try:
            with _quiet():
                return _trace_export(model, args, kwargs, units)
        except Exception as e:  # noqa: BLE001
            errors.append(("torch.export", e))
    raise _trace_error(model, args, kwargs, errors)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence torch's logging, warnings and graph dumps while a tracer *tries*: a failure is
    reported once, as a TraceError, rather than as pages of tracer output."""
    logger = logging.getLogger("torch")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(io.StringIO()),
        ):
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def _trace_fx(model: nn.Module, args: tuple, kwargs: dict, units: dict[str, UnitInfo]) -> Graph:
    leaves = {q for q, u in units.items() if not u.own_only and q}
    tracer = _LeafTracer(leaves)
    graph = tracer.trace(model)
    gm = torch.fx.GraphModule(model, graph)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    sig = inspect.signature(model.forward)
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    flat = []
    for ph in placeholders:
        if ph.target.startswith("*"):
            raise TraceError(
                f"{type(model).__name__}.forward takes *args/**kwargs, which symbolic tracing "
                "cannot bind",
                reason="varargs",
            )
        flat.append(bound.arguments[ph.target])
    calls: Counter[str] = Counter()

    def unit_of(node: torch.fx.Node) -> tuple[str | None, int]:
        if node.op == "call_module" and node.target in units:
            call = calls[node.target]
            calls[node.target] += 1
            return node.target, call
        return None, 0

    node_layer, invocations = _index_nodes(gm, units, unit_of)
    return Graph(gm, "fx", node_layer, invocations, flat)


def _trace_export(
    model: nn.Module, args: tuple, kwargs: dict, units: dict[str, UnitInfo]
) -> Graph:
    ep = torch.export.export(model, args, kwargs=kwargs, strict=False)
    gm = ep.module()
    bound = inspect.signature(gm.forward).bind(*args, **kwargs)
    flat = list(bound.arguments.values())

    def unit_of(node: torch.fx.Node) -> tuple[str | None, int]:
        stack = node.meta.get("nn_module_stack") or {}
        for key, (fqn, _cls) in stack.items():
            fqn = _clean_fqn(fqn)
            if fqn in units and not units[fqn].own_only:
                return fqn, _call_index(key)  # the outermost unit on the stack wins
        return None, 0

    node_layer, invocations = _index_nodes(gm, units, unit_of)
    return Graph(gm, "export", node_layer, invocations, flat)


def _index_nodes(
    gm: torch.fx.GraphModule,
    units: dict[str, UnitInfo],
    unit_of: Any,
) -> tuple[dict[torch.fx.Node, str], list[tuple[str, str]]]:
    """Map nodes to layer invocations and order the invocations by dataflow.

    ``unit_of(node)`` gives the (unit, call index) a compute node runs in. A ``get_attr`` of a
    parameter belongs to the unit owning that parameter; since export lists every get_attr
    first, a get_attr counts for ordering at the position of its first user.
    """
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    node_layer: dict[torch.fx.Node, str] = {}
    first: dict[str, int] = {}
    unit_of_inv: dict[str, str] = {}
    for node in nodes:
        if node.op == "get_attr":
            continue
        unit, call = unit_of(node)
        if unit is None:
            continue
        inv = unit if call == 0 else f"{unit}@{call}"
        node_layer[node] = inv
        unit_of_inv[inv] = unit
        first.setdefault(inv, pos[node])
    # get_attr nodes matter for order only when their unit runs no compute node of its own
    # (a cls token, a positional table indexed by glue code). Export hoists every get_attr to
    # the top and may read a tied weight under its alias's name, so such a node counts at
    # the position of its first user.
    for node in nodes:
        if node.op != "get_attr":
            continue
        unit = _owning_unit(str(node.target), units)
        if unit is None:
            continue
        node_layer[node] = unit
        if unit not in first:
            first[unit] = min((pos[u] for u in node.users), default=pos[node])
            unit_of_inv[unit] = unit
    order = sorted(first, key=lambda inv: (first[inv], inv))
    return node_layer, [(inv, unit_of_inv[inv]) for inv in order]


def _owning_unit(target: str, units: dict[str, UnitInfo]) -> str | None:
    """The unit owning parameter/buffer ``target`` (longest matching module prefix)."""
    owner = target.rpartition(".")[0]
    best = None
    for q, u in units.items():
        if u.own_only:
            if owner == q:
                return q
            continue
        if (q == "" or owner == q or owner.startswith(q + ".")) and (
            best is None or len(q) > len(best)
        ):
            best = q
    return best


def _clean_fqn(fqn: str) -> str:
    # export writes e.g. "transformer.h.0" (and sometimes "L['self'].transformer..." forms)
    fqn = re.sub(r"^L\['self'\]\.?", "", fqn)
    return fqn.replace("._modules['", ".").replace("']", "")


def _call_index(key: str) -> int:
    m = re.search(r"@(\d+)$", key)
    return int(m.group(1)) if m else 0


def _trace_error(
    model: nn.Module, args: tuple, kwargs: dict, errors: list[tuple[str, BaseException]]
) -> TraceError:
    """Find the module where eager meta execution fails and build a TraceError naming it."""
    culprit, reason = _locate_failure(model, args, kwargs)
    if not reason:
        reason = explain_failure(errors[-1][1]) if errors else "unknown"
    # Eager meta execution fails on an `if` over a tensor as on `.item()`; the tracers
    # know it was control flow.
    flow = [e for _, e in errors if explain_failure(e).startswith(_CONTROL_FLOW)]
    if flow and not reason.startswith(_CONTROL_FLOW):
        reason = explain_failure(flow[0])
    tried = "; ".join(f"{how}: {_one_line(e)}" for how, e in errors)
    return capture_error(model, culprit, reason, tried=tried)


#: Failure messages torch gives for the constructs capture cannot follow, and what they mean.
_REASONS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("item() cannot be called on meta", "Tensor.item", "call_method[target=item]"),
     "it reads a tensor's value with .item() (capture runs on meta tensors, which have "
     "shapes but no values)"),
    (("numpy", "__array__", "__array_struct__"),
     "it converts a tensor to numpy (capture runs on meta tensors, which have shapes but no "
     "values)"),
    (("data-dependent", "used as inputs to control flow", "Boolean value of Tensor",
      "GuardOnDataDependent"),
     "its control flow depends on a tensor's value (an `if` or loop on a tensor)"),
    (("shapes cannot be multiplied", "size mismatch", "must match the size",
      "Expected input", "expected input", "shape '[", "but got", "dimension",
      "must be Tensor"),
     "the example inputs do not fit it"),
)
_CONTROL_FLOW = "its control flow depends"
_BAD_INPUTS = "the example inputs do not fit"


def explain_failure(e: BaseException) -> str:
    """``e`` as a reason a person can act on: what the module did that capture cannot follow
    (``.item()``, numpy, value-dependent control flow, inputs of the wrong shape), with
    torch's own one-line message."""
    text = f"{type(e).__name__}: {e}"
    for needles, meaning in _REASONS:
        if any(n in text for n in needles):
            return f"{meaning} ({_one_line(e)})"
    return _one_line(e)


def capture_error(model: nn.Module, culprit: str, reason: str, *, tried: str = "") -> TraceError:
    """The TraceError for a failure in module ``culprit`` ("" for the top-level module).

    The fix offered always names a real module: ``opaque_modules=[culprit]`` for a
    submodule; for the top-level module (which cannot be opaque: the model would be one
    layer) moving the failing code into a submodule and making that opaque, with the
    top-level module's children listed.
    """
    name = type(model).__name__
    lines = [f"cannot capture {name}: "
             + (f"module {culprit!r} ({_module_type(model, culprit)})" if culprit
                else f"the top-level forward of {name}") + f" failed: {reason}"]
    if tried:
        lines.append(f"  tried: {tried}")
    if reason.startswith(_BAD_INPUTS):
        lines.append("  fix: check the example inputs' shapes and dtypes (a --module "
                     "factory returns (model, example_args)): one micro-batch the model's "
                     "forward accepts")
    elif culprit:
        lines.append("  fix: make that module independent of tensor values, or pass "
                     f"opaque_modules=[{culprit!r}] (CLI: --opaque {culprit}) to treat it as "
                     "an opaque leaf executed on CPU with zero inputs")
    else:
        children = ", ".join(repr(n) for n, _ in list(model.named_children())[:8]) or "none"
        lines.append(f"  fix: the failing code is in {name}.forward itself, and the top-level "
                     "module cannot be opaque (the model would be a single layer): move that "
                     "code into a submodule and mark the submodule opaque (opaque_modules="
                     "['<its name>'], CLI: --opaque <its name>); "
                     f"{name}'s submodules now: {children}")
    return TraceError("\n".join(lines), module=culprit, reason=reason)


def _module_type(model: nn.Module, q: str) -> str:
    try:
        return type(model.get_submodule(q)).__name__
    except AttributeError:
        return "?"


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    first = text[0] if text else type(e).__name__
    return f"{type(e).__name__}: {first[:300]}"


def _locate_failure(model: nn.Module, args: tuple, kwargs: dict) -> tuple[str, str]:
    names = {id(m): n for n, m in model.named_modules()}
    stack: list[str] = []
    failed: list[str] = []
    handles = []

    def pre(m: nn.Module, _inp: Any) -> None:
        stack.append(names.get(id(m), "?"))

    def post(m: nn.Module, _inp: Any, _out: Any) -> None:
        if stack:
            stack.pop()

    for m in model.modules():
        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post))
    try:
        with _quiet():
            model(*args, **kwargs)
    except Exception as e:  # noqa: BLE001
        failed.append(explain_failure(e))
        culprit = stack[-1] if stack else ""
        return culprit, failed[0]
    finally:
        for h in handles:
            h.remove()
    return "", ""


def module_of_node(node: torch.fx.Node) -> str:
    """The qualified name of the innermost module whose code made ``node`` ("" for the
    top-level forward): the module it calls, else the last entry of its ``nn_module_stack``
    (recorded by both symbolic tracing and torch.export)."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    for fqn, _cls in reversed(list(stack.values())):
        return _clean_fqn(str(fqn))
    return ""
