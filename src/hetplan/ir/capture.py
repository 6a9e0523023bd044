"""Model capture: ``nn.Module`` → :class:`~hetplan.ir.model.ModelIR`.

This is the only module of hetplan that imports ``torch.fx`` / ``torch.export``.

How it works (each step is a function below):

1. **Meta clone** (:func:`_meta_clone`). The model is deep-copied with every parameter and
   buffer replaced by an empty ``meta`` tensor of the same shape and dtype, so no real weight
   or activation is ever allocated: a 70B model is captured in a few hundred MiB. Tied
   parameters stay tied (the copy is keyed on tensor identity). A model already on ``meta``
   is used as it is. The caller's model is never modified.
2. **Layer units** (:func:`layer_units`). The granularity pipeline balancing needs: every
   element of a *repeated block list* (a ModuleList/Sequential whose elements share one class
   and mostly one parameter structure — transformer blocks, ResNet bottlenecks) is one layer;
   every other parameterised leaf module (embeddings, norms, heads, convolutions) is one layer;
   parameters owned directly by a container (a ViT cls token) form a ``params`` layer.
3. **Graph** (:func:`_trace_fx`, :func:`_trace_export`). ``torch.fx.symbolic_trace`` with the
   layer units as leaf modules where it works; otherwise ``torch.export`` (non-strict), whose
   aten nodes are mapped back to layers through ``nn_module_stack``. Each call of a module is
   a layer *invocation*; a module called twice (weight sharing across positions) gives a
   second layer ``name@1`` whose parameters are aliases of the first.
4. **Meta execution** (:class:`_Executor`). The captured graph is run once forward and once
   backward on meta tensors. A dispatch mode counts FLOPs per aten op with torch's own
   formulas (``torch.utils.flop_counter``), attributed to the layer running: in forward the
   graph node being interpreted, in backward the layer that created the autograd node (every
   ``grad_fn`` is tagged when it is created). Parameter post-accumulate-grad hooks record the
   **backward-ready order** of gradients — exactly the order the runtime's gradient hooks,
   Espresso and Cupcake see.
5. **Assembly and verification**: activation bytes in/out per layer from the graph's edges,
   the tensor-parallel linears of each layer, and :func:`hetplan.ir.verify.verify_model_ir`.

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

import contextlib
import copy
import dataclasses
import inspect
import io
import logging
import warnings
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import flop_registry

from hetplan.errors import TraceError
from hetplan.ir import block_reuse
from hetplan.ir.model import (
    DTYPE_BYTES,
    GradTensor,
    LayerIR,
    LayerKind,
    LinearInfo,
    ModelIR,
    ParamInfo,
    TPRole,
)
from hetplan.ir.validation import did_you_mean
from hetplan.ir.verify import verify_model_ir

__all__ = ["capture", "layer_units", "UnitInfo"]


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
        opaque_modules: qualified names of modules to treat as opaque leaves (see module doc).
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
    if method not in ("auto", "fx", "export"):
        raise ValueError(f"method must be 'auto', 'fx' or 'export', got {method!r}")
    if not isinstance(model, nn.Module):
        raise TraceError(
            f"capture() needs a torch.nn.Module, got {type(model).__name__}",
            reason="not a module",
        )
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    kwargs = dict(example_kwargs or {})
    opaque = tuple(opaque_modules)
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
    groups = sorted({u.group for u in units.values() if u.group is not None})
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


def _capture_once(
    original: nn.Module,
    meta_model: nn.Module,
    args: tuple,
    kwargs: dict,
    opaque: tuple[str, ...],
    method: str,
) -> ModelIR:
    units = layer_units(meta_model, opaque)
    graph = _build_graph(meta_model, args, kwargs, units, opaque, method)
    executor = _Executor(meta_model, graph, units)
    executor.run()
    return _assemble(original, meta_model, graph, units, executor, None, args, kwargs)


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
                        add(f"{q}.{en}", el, LayerKind.BLOCK, group=q)
            elif any(_has_params(c) for c in child.children()):
                walk(child, q)
            else:
                add(q, child, _leaf_kind(child))

    if _is_block_list(model):
        for en, el in model.named_children():
            if _has_params(el):
                add(en, el, LayerKind.BLOCK, group="")
    elif any(_has_params(c) for c in model.children()):
        walk(model, "")
    elif _has_params(model):
        add("", model, _leaf_kind(model))
    return units


# --------------------------------------------------------------------------------------
# 3. graph capture
# --------------------------------------------------------------------------------------
@dataclass
class _Graph:
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


def _build_graph(
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    units: dict[str, UnitInfo],
    opaque: tuple[str, ...],
    method: str,
) -> _Graph:
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


def _trace_fx(model: nn.Module, args: tuple, kwargs: dict, units: dict[str, UnitInfo]) -> _Graph:
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
    return _Graph(gm, "fx", node_layer, invocations, flat)


def _trace_export(
    model: nn.Module, args: tuple, kwargs: dict, units: dict[str, UnitInfo]
) -> _Graph:
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
    return _Graph(gm, "export", node_layer, invocations, flat)


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
        reason = _one_line(errors[-1][1]) if errors else "unknown"
    tried = "; ".join(f"{how}: {_one_line(e)}" for how, e in errors)
    where = f"module {culprit!r} ({_module_type(model, culprit)})" if culprit else "the model"
    msg = (
        f"cannot capture {type(model).__name__}: {where} failed: {reason}\n"
        f"  tried: {tried}\n"
        "  fix: make the control flow in that module independent of tensor values, or pass "
        f"opaque_modules=[{culprit!r}] (CLI: --opaque {culprit}) to treat it as an opaque "
        "leaf executed on CPU with zero inputs"
    )
    return TraceError(msg, module=culprit, reason=reason)


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
        failed.append(_one_line(e))
        culprit = stack[-1] if stack else ""
        return culprit, failed[0]
    finally:
        for h in handles:
            h.remove()
    return "", ""


# --------------------------------------------------------------------------------------
# 4. meta execution: FLOPs per layer, gradient-ready order, tensor sizes
# --------------------------------------------------------------------------------------
class _FlopCounter(TorchDispatchMode):
    """Counts FLOPs per aten op with torch's formulas, attributed to ``self.current``."""

    def __init__(self) -> None:
        super().__init__()
        self.current: str | None = None
        self.backward = False
        self.paused = False
        self.fwd: defaultdict[str | None, int] = defaultdict(int)
        self.bwd: defaultdict[str | None, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None and not self.paused:
            n = int(formula(*args, **kwargs, out_val=out))
            (self.bwd if self.backward else self.fwd)[self.current] += n
        return out


class _GradFnTagger(TorchFunctionMode):
    """Tags every autograd node created in forward with the layer that created it, so that
    backward FLOPs can be attributed to that layer."""

    def __init__(self, counter: _FlopCounter) -> None:
        super().__init__()
        self.counter = counter
        self.tagged: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func in _SDPA:
            out = _fused_attention(self.counter, *args, **(kwargs or {}))
        else:
            out = func(*args, **(kwargs or {}))
        layer = self.counter.current
        for t in tree_leaves(out):
            fn = getattr(t, "grad_fn", None) if isinstance(t, torch.Tensor) else None
            if fn is not None and id(fn) not in self.tagged:
                self.tagged.add(id(fn))
                fn.register_prehook(_set_current(self.counter, layer))
        return out


_SDPA = (
    torch.nn.functional.scaled_dot_product_attention,
    torch.ops.aten.scaled_dot_product_attention.default,
)


def _fused_attention(
    counter: _FlopCounter,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    **extra: Any,
) -> torch.Tensor:
    options = dict(dropout_p=dropout_p, is_causal=is_causal, scale=scale, **extra)
    return _FusedAttention.apply(q, k, v, attn_mask, options, counter)


class _FusedAttention(torch.autograd.Function):
    """Attention as a fused (flash / memory-efficient) kernel, which is what training uses on
    GPUs: it keeps q, k, v, the output and the row log-sum-exp for backward — not the
    [seq × seq] score matrix that meta execution's math path would save — and recomputes the
    scores in backward. FLOPs are counted as the math path's (recomputation is not counted:
    model FLOPs, as MFU conventions count them)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, options, counter):  # type: ignore[override]
        with torch.no_grad():
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, **options
            )
        lse = torch.empty(out.shape[:-1], dtype=torch.float32, device=out.device)
        ctx.options, ctx.counter, ctx.has_mask = options, counter, mask is not None
        ctx.save_for_backward(q, k, v, out, lse, *((mask,) if mask is not None else ()))
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        q, k, v, _out, _lse, *rest = ctx.saved_tensors
        mask = rest[0] if ctx.has_mask else None
        counter = ctx.counter
        with torch.enable_grad():
            qq, kk, vv = (x.detach().requires_grad_(x.requires_grad) for x in (q, k, v))
            counter.paused = True
            out = torch.nn.functional.scaled_dot_product_attention(
                qq, kk, vv, attn_mask=mask, **ctx.options
            )
            counter.paused = False
            wanted = [x for x in (qq, kk, vv) if x.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad_out)) if wanted else iter(())
        return (
            *(next(grads) if x.requires_grad else None for x in (qq, kk, vv)),
            None,
            None,
            None,
        )


def _set_current(counter: _FlopCounter, layer: str | None):
    def hook(_grad_outputs: Any) -> None:
        counter.current = layer

    return hook


class _OpaqueCall(torch.autograd.Function):
    """Runs an opaque module for real on CPU (zero weights and inputs) inside a meta graph."""

    @staticmethod
    def forward(ctx, module_and_state, *inputs):  # type: ignore[override]
        module, counter, on_backward = module_and_state
        ctx.shapes = [(i.shape, i.dtype) if isinstance(i, torch.Tensor) else None for i in inputs]
        ctx.on_backward = on_backward
        real_in = [
            torch.zeros(i.shape, dtype=i.dtype) if isinstance(i, torch.Tensor) else i
            for i in inputs
        ]
        with torch.no_grad():
            out = module(*real_in)
        if not isinstance(out, torch.Tensor):
            raise TraceError(
                "an opaque module must return one tensor", reason="opaque module output"
            )
        return torch.empty(out.shape, dtype=out.dtype, device="meta")

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.on_backward()
        return (None,) + tuple(
            torch.zeros(s[0], dtype=s[1], device="meta") if s and s[1].is_floating_point else None
            for s in ctx.shapes
        )


class _Executor(torch.fx.Interpreter):
    """Runs the captured graph forward and backward on meta tensors (see module docstring)."""

    def __init__(self, model: nn.Module, graph: _Graph, units: dict[str, UnitInfo]) -> None:
        super().__init__(graph.gm)
        self.graph_info = graph
        self.model = model
        self.units = units
        self.counter = _FlopCounter()
        self.values: dict[torch.fx.Node, Any] = {}
        self.grad_order: list[int] = []  # ids of parameters, in gradient-ready order
        self.saved: defaultdict[str | None, int] = defaultdict(int)  # bytes kept for backward
        self._saved_ids: set[int] = set()
        self._param_ids = {id(p) for p in graph.gm.parameters()}
        self._assign_glue()

    def _assign_glue(self) -> None:
        """Glue nodes (no layer) join the next layer in graph order, else the last layer."""
        nodes = list(self.graph_info.gm.graph.nodes)
        layer_of = self.graph_info.node_layer
        pending: list[torch.fx.Node] = []
        last = self.graph_info.invocations[-1][0] if self.graph_info.invocations else None
        self.exec_layer: dict[torch.fx.Node, str | None] = {}
        for node in nodes:
            if node.op in ("placeholder", "get_attr", "output"):
                self.exec_layer[node] = layer_of.get(node)
                continue
            if node in layer_of:
                for p in pending:
                    self.exec_layer[p] = layer_of[node]
                pending.clear()
                self.exec_layer[node] = layer_of[node]
            else:
                pending.append(node)
        for p in pending:
            self.exec_layer[p] = last

    def run_node(self, n: torch.fx.Node) -> Any:
        self.counter.current = self.exec_layer.get(n)
        out = super().run_node(n)
        self.values[n] = out
        return out

    def call_module(self, target: str, args: Any, kwargs: Any) -> Any:  # type: ignore[override]
        unit = self.units.get(target)
        if unit is None or unit.kind is not LayerKind.OPAQUE:
            return super().call_module(target, args, kwargs)
        module = self.fetch_attr(target)
        real = copy.deepcopy(module).to_empty(device="cpu")
        for t in list(real.parameters()) + list(real.buffers()):
            torch.nn.init.zeros_(t) if t.is_floating_point() else t.zero_()
        params = [p for p in module.parameters() if p.requires_grad]

        def on_backward() -> None:
            for p in reversed(params):
                self.grad_order.append(id(p))

        before = self.counter.fwd[self.counter.current]
        out = _OpaqueCall.apply((real, self.counter, on_backward), *args)
        # The opaque body ran under the dispatch mode on CPU: its forward FLOPs are counted.
        # Backward is not run for real: estimate it as 2x forward (dX and dW GEMMs).
        fwd = self.counter.fwd[self.counter.current] - before
        self.counter.bwd[self.counter.current] += 2 * fwd
        if params:
            out = out + 0 * sum(p.sum() for p in params)  # keep params in the autograd graph
        return out

    def run(self) -> None:  # type: ignore[override]
        hooks = []
        for p in self.module.parameters():
            if p.requires_grad:
                hooks.append(p.register_post_accumulate_grad_hook(self._grad_ready))
        self._opaque_param_ids = {
            id(p)
            for q, u in self.units.items()
            if u.kind is LayerKind.OPAQUE
            for p in self.model.get_submodule(q).parameters()
        }
        try:
            with (
                torch.enable_grad(),
                self.counter,
                _GradFnTagger(self.counter),
                torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack),
            ):
                out = super().run(*self.graph_info.flat_inputs)
            loss = _scalar_loss(out)
            self.counter.backward = True
            with self.counter:
                if loss is not None:
                    loss.backward()
        finally:
            for h in hooks:
                h.remove()
        for p in self.module.parameters():
            p.grad = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        """Count a tensor autograd saves for backward against the running layer, once per
        storage (views of one activation count once); parameters are not activations."""
        base = t._base if t._base is not None else t
        if id(base) in self._param_ids or id(t) in self._param_ids:
            return t
        key = t.untyped_storage()._cdata
        if key not in self._saved_ids:
            self._saved_ids.add(key)
            self.saved[self.counter.current] += t.untyped_storage().nbytes()
        return t

    def _grad_ready(self, p: torch.Tensor) -> None:
        if id(p) not in self._opaque_param_ids:
            self.grad_order.append(id(p))


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _scalar_loss(out: Any) -> torch.Tensor | None:
    parts = [
        t.float().sum()
        for t in tree_leaves(out)
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad
    ]
    if not parts:
        return None
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total


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


def _assemble(
    original: nn.Module,
    model: nn.Module,
    graph: _Graph,
    units: dict[str, UnitInfo],
    ex: _Executor,
    name: str | None,
    args: tuple,
    kwargs: dict,
) -> ModelIR:
    # canonical parameter names: the first name under which a tensor is registered
    canonical: dict[int, str] = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        canonical.setdefault(id(p), pname)
    gm_params = {id(p): pname for pname, p in graph.gm.named_parameters(remove_duplicate=False)}
    gm_to_model = {}
    for pid, pname in gm_params.items():
        try:
            gm_to_model[pid] = id(model.get_parameter(pname))
        except AttributeError:
            continue

    # parameters used by each invocation
    inv_params: dict[str, list[tuple[str, torch.Tensor]]] = {inv: [] for inv, _ in graph.invocations}
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
                linears=() if u.own_only or "@" in inv else _linears(module, unit),
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
        inv = owner.get(pid)
        if inv is None:
            continue
        dtype = _dtype_name(p.dtype)
        grads.append(
            GradTensor(
                name=canonical[pid],
                numel=p.numel(),
                size_bytes=p.numel() * DTYPE_BYTES.get(dtype, p.element_size()),
                dtype=dtype,
                layer=inv,
                layer_index=index[inv],
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


def _canon_in(canon: str, params: list[tuple[str, torch.Tensor]]) -> bool:
    return any(n == canon for n, _ in params)


def _check_dataflow_order(graph: _Graph, ex: _Executor, index: dict[str, int]) -> None:
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


def _activation_bytes(graph: _Graph, ex: _Executor) -> tuple[dict[str, int], dict[str, int]]:
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
    if type(m).__name__ == "Conv1D" and hasattr(m, "weight") and m.weight.dim() == 2:
        return int(m.weight.shape[0]), int(m.weight.shape[1])  # HF Conv1D stores [in, out]
    return None


def _linears(module: nn.Module, unit: str) -> tuple[LinearInfo, ...]:
    """The linears of one layer with Megatron roles: names first, shapes second.

    A row-parallel linear is paired with the closest column-parallel linear before it in
    module order (v_proj → o_proj, up_proj → down_proj, c_fc → c_proj).
    """
    found: list[tuple[str, int, int, bool, TPRole]] = []
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
    for q, i, o, b, role in found:
        out.append(LinearInfo(q, i, o, b, role, pairs.get(q)))
    return tuple(out)
