"""Capture step 4: run the captured graph forward and backward on meta tensors.

:class:`Executor` interprets the graph once forward and once backward. A dispatch mode counts
FLOPs per aten op with torch's own formulas, attributed to the layer running (in backward,
the layer that created the autograd node); parameter post-accumulate-grad hooks record the
backward-ready order of gradients; saved-tensor hooks count the activation bytes kept for
backward. Attention runs as a fused kernel would (no ``[seq x seq]`` scores saved), dropout as
the fused GPU kernel (a 1-byte mask), and opaque modules run for real on CPU with zero-filled
weights and inputs.

Every saved storage is recorded once (:class:`SavedRecord`) with what the memory model needs
to price recomputation, dtypes and tensor parallelism (:class:`~hetplan.ir.model.LayerIR`'s
``act_*`` fields):

* whether it is floating (dropout masks and indices keep their size under mixed precision);
* whether it was saved inside a tensor-parallel region — from the end of a column linear to
  the end of the row linear it pairs with (the pairs ``LayerCost.tp_pairs`` counts) — or
  outside, where every TP rank holds it unless sequence parallelism splits it;
* whether it was saved inside an attention core (a ``scaled_dot_product_attention`` call, or a
  module whose class is in :data:`ATTENTION_CORE_TYPES`); each core call also records the
  storages of its inputs, which selective recomputation keeps instead.

On the fx path a layer runs as one module call, so regions and cores are followed with
forward hooks on the linears and core modules; on the export path every aten node names its
module stack (``nn_module_stack``), which gives the same transitions node by node.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from hetplan.errors import TraceError
from hetplan.ir.capture.trace import (
    Graph,
    _clean_fqn,
    capture_error,
    explain_failure,
    module_of_node,
)
from hetplan.ir.capture.units import UnitInfo, layer_linears
from hetplan.ir.model import LayerKind, TPRole

__all__ = ["ATTENTION_CORE_TYPES", "Executor", "SavedRecord"]

#: Module classes that are an attention core (QK^T, softmax, dropout, times V): Megatron-LM's
#: names and hetplan's own (:class:`hetplan.models.CoreAttention`).
ATTENTION_CORE_TYPES = frozenset({"CoreAttention", "DotProductAttention"})


@dataclass(frozen=True, slots=True)
class SavedRecord:
    """One storage autograd keeps for backward, counted against ``layer``.

    Attributes:
        layer: the layer invocation running when it was first saved.
        nbytes: the storage's bytes.
        floating: a floating-point tensor (False: masks, indices).
        split: saved inside a tensor-parallel region or an attention core.
        core: index into ``Executor.cores`` of the attention core that saved it, or None.
    """

    layer: str | None
    nbytes: int
    floating: bool
    split: bool
    core: int | None


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
        #: forward FLOPs run inside an attention core, per layer
        self.core_fwd: defaultdict[str | None, int] = defaultdict(int)
        self.in_core = False
        #: per layer: (phase, core, batch, m, n, k) -> how many matrix multiplies
        self.gemms: defaultdict[str | None, defaultdict[tuple[str, bool, int, int, int, int],
                                                        int]] = defaultdict(
            lambda: defaultdict(int))
        #: per layer and (phase, core): bytes read and written by the other kernels
        self.mem_bytes: defaultdict[str | None, defaultdict[tuple[str, bool], int]] = (
            defaultdict(lambda: defaultdict(int)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused:
            return out
        phase = "bwd" if self.backward else "fwd"
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            n = int(formula(*args, **kwargs, out_val=out))
            (self.bwd if self.backward else self.fwd)[self.current] += n
            if self.in_core and not self.backward:
                self.core_fwd[self.current] += n
            shape = _gemm_shape(func, args)
            if shape is not None:
                self.gemms[self.current][(phase, self.in_core) + shape] += 1
        elif not _moves_no_data(func):
            moved = sum(_tensor_bytes(t) for t in tree_leaves((args, kwargs, out))
                        if isinstance(t, torch.Tensor))
            self.mem_bytes[self.current][(phase, self.in_core)] += moved
        return out


#: aten ops that move no data (views, metadata, allocation without initialisation)
_NO_DATA = frozenset({
    "detach", "alias", "empty", "empty_like", "empty_strided", "new_empty", "lift_fresh",
    "_unsafe_view", "scalar_tensor", "t", "zeros_like", "ones_like", "new_ones", "new_zeros",
    "arange", "full", "zeros", "ones", "bernoulli_",
})


def _moves_no_data(func: Any) -> bool:
    """Whether ``func`` is a view or an op that reads and writes no tensor data worth
    pricing (its output is written once at most by an initialiser)."""
    if getattr(func, "is_view", False):
        return True
    return func._overloadpacket.__name__ in _NO_DATA


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _gemm_shape(func: Any, args: tuple[Any, ...]) -> tuple[int, int, int, int] | None:
    """(batch, m, n, k) of a matrix multiply op, or None for any other op with a FLOP
    formula (convolutions, fused attention)."""
    name = func._overloadpacket.__name__
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if name in ("mm", "addmm") and len(tensors) >= 2:
        a, b = tensors[-2], tensors[-1]
        if a.dim() == 2 and b.dim() == 2:
            return 1, int(a.shape[0]), int(b.shape[1]), int(a.shape[1])
    if name in ("bmm", "baddbmm") and len(tensors) >= 2:
        a, b = tensors[-2], tensors[-1]
        if a.dim() == 3 and b.dim() == 3:
            return int(a.shape[0]), int(a.shape[1]), int(b.shape[2]), int(a.shape[2])
    return None


class _GradFnTagger(TorchFunctionMode):
    """Tags every autograd node created in forward with the layer that created it, so that
    backward FLOPs can be attributed to that layer. It also marks scaled-dot-product attention
    calls as attention cores for the executor's saved-bytes accounting."""

    def __init__(self, counter: _FlopCounter, executor: Executor | None = None) -> None:
        super().__init__()
        self.counter = counter
        self.executor = executor
        self.tagged: set[int] = set()
        #: the tagged autograd nodes themselves, kept alive for the capture: ``id`` of a
        #: freed node can be reused by a new one, which would then go untagged and have its
        #: backward kernels attributed to whichever layer ran last (the capture, and the model
        #: fingerprint with it, then differed between processes)
        self._tagged_nodes: list[Any] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _SDPA:
            ex = self.executor
            inputs = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
            started = ex.enter_core(inputs) if ex is not None else False
            try:
                out = _fused_attention(self.counter, *args, **(kwargs or {}))
            finally:
                if started and ex is not None:
                    ex.leave_core()
        elif func in _DROPOUT:
            out = _fused_dropout(*args, **(kwargs or {}))
        else:
            out = func(*args, **(kwargs or {}))
        layer = self.counter.current
        for t in tree_leaves(out):
            fn = getattr(t, "grad_fn", None) if isinstance(t, torch.Tensor) else None
            if fn is not None and id(fn) not in self.tagged:
                self.tagged.add(id(fn))
                self._tagged_nodes.append(fn)
                fn.register_prehook(_set_current(self.counter, layer))
        return out


_SDPA = (
    torch.nn.functional.scaled_dot_product_attention,
    torch.ops.aten.scaled_dot_product_attention.default,
)


_DROPOUT = (torch.nn.functional.dropout, torch.ops.aten.dropout.default)


def _fused_dropout(input: torch.Tensor, p: float = 0.5, training: bool = True,
                   inplace: bool = False, **_: Any) -> torch.Tensor:
    """Dropout as the fused kernel GPUs run (``native_dropout``: autograd keeps a 1-byte
    mask), not the CPU composite (a mask in the input's dtype); the output is never in-place
    (meta tensors hold no values to overwrite)."""
    if not training or p == 0:
        return input
    return torch.native_dropout(input, p, True)[0]


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
    def forward(ctx, q, k, v, mask, options, counter):
        with torch.no_grad():
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, **options
            )
        lse = torch.empty(out.shape[:-1], dtype=torch.float32, device=out.device)
        ctx.options, ctx.counter, ctx.has_mask = options, counter, mask is not None
        ctx.save_for_backward(q, k, v, out, lse, *((mask,) if mask is not None else ()))
        return out

    @staticmethod
    def backward(ctx, grad_out):
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
            was_core, counter.in_core = counter.in_core, True
            try:
                grads = (iter(torch.autograd.grad(out, wanted, grad_out)) if wanted
                         else iter(()))
            finally:
                counter.in_core = was_core
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
    def forward(ctx, module_and_state, *inputs):
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
    def backward(ctx, grad):
        ctx.on_backward()
        return (None,) + tuple(
            torch.zeros(s[0], dtype=s[1], device="meta") if s and s[1].is_floating_point else None
            for s in ctx.shapes
        )


class Executor(torch.fx.Interpreter):
    """Runs the captured graph forward and backward on meta tensors (see module docstring)."""

    def __init__(self, model: nn.Module, graph: Graph, units: dict[str, UnitInfo]) -> None:
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
        self.node: torch.fx.Node | None = None  # the node being run (to blame a failure)
        #: every storage saved for backward, by storage key (see SavedRecord)
        self.saved_records: dict[int, SavedRecord] = {}
        #: attention-core calls: (layer, their input tensors), in call order
        self.cores: list[tuple[str | None, list[torch.Tensor]]] = []
        self._core_depth = 0
        self._core: int | None = None
        self._split = False  # inside a tensor-parallel region
        self._linear: str | None = None  # the pair linear running (export path)
        self._layer: str | None = None
        self._pair_role = self._pair_linears()
        self._export_info: dict[torch.fx.Node, tuple[str | None, bool]] = (
            self._node_info() if graph.method == "export" else {})
        self._assign_glue()

    # -- tensor-parallel regions and attention cores -------------------------------------
    def _pair_linears(self) -> dict[str, str]:
        """``{linear qualname: "column" | "row"}`` for the column/row pairs of every layer:
        a row linear with a partner and the column linears naming it (the pairs
        ``LayerCost.tp_pairs`` counts; a fused QKV projection pairs with the attention output
        even where its width differs)."""
        roles: dict[str, str] = {}
        for q, u in self.units.items():
            if u.own_only or u.kind is LayerKind.OPAQUE:
                continue
            module = self.model.get_submodule(q) if q else self.model
            linears = layer_linears(module, q)
            rows = {x.name for x in linears if x.tp_role is TPRole.ROW and x.pair}
            for x in linears:
                if x.name in rows:
                    roles[x.name] = "row"
                elif x.tp_role is TPRole.COLUMN and x.pair in rows:
                    roles[x.name] = "column"
        return roles

    def _node_info(self) -> dict[torch.fx.Node, tuple[str | None, bool]]:
        """Export path: per node, the innermost pair linear on its module stack (or None) and
        whether an attention-core module is on it."""
        info: dict[torch.fx.Node, tuple[str | None, bool]] = {}
        for node in self.graph_info.gm.graph.nodes:
            stack = node.meta.get("nn_module_stack") or {}
            linear, core = None, False
            for fqn, cls in stack.values():
                name = _clean_fqn(fqn)
                if name in self._pair_role:
                    linear = name
                cls_name = cls if isinstance(cls, str) else getattr(cls, "__name__", "")
                core = core or cls_name.rsplit(".", 1)[-1] in ATTENTION_CORE_TYPES
            info[node] = (linear, core)
        return info

    def _enter_linear(self, name: str) -> None:
        self._linear = name

    def _leave_linear(self, name: str) -> None:
        """A column linear's end opens its pair's region, the row linear's end closes it."""
        self._split = self._pair_role.get(name) == "column" or (
            self._split and self._pair_role.get(name) != "row")
        self._linear = None

    def enter_core(self, inputs: list[torch.Tensor]) -> bool:
        """Start an attention core whose tensor inputs are ``inputs`` (nested calls join the
        outer core). Returns True: the caller must :meth:`leave_core`."""
        self._core_depth += 1
        if self._core_depth == 1:
            self.cores.append((self.counter.current, list(inputs)))
            self._core = len(self.cores) - 1
            self.counter.in_core = True
        return True

    def leave_core(self) -> None:
        self._core_depth -= 1
        if self._core_depth == 0:
            self._core = None
            self.counter.in_core = False

    def _hooks(self) -> list[Any]:
        """fx path: forward hooks on the pair linears and the attention-core modules."""
        handles = []
        for name in self._pair_role:
            m = self.model.get_submodule(name)
            handles.append(m.register_forward_pre_hook(
                lambda _m, _a, name=name: self._enter_linear(name)))
            handles.append(m.register_forward_hook(
                lambda _m, _a, _o, name=name: self._leave_linear(name)))
        for m in self.model.modules():
            if type(m).__name__ in ATTENTION_CORE_TYPES:
                handles.append(m.register_forward_pre_hook(
                    lambda _m, args: self.enter_core(
                        [a for a in tree_leaves(args) if isinstance(a, torch.Tensor)]) and None))
                handles.append(m.register_forward_hook(lambda *_: self.leave_core()))
        return handles

    def _export_transitions(self, n: torch.fx.Node) -> None:
        """Export path: follow regions and cores from the node's module stack."""
        if n.op not in ("call_function", "call_method"):
            return
        linear, core = self._export_info.get(n, (None, False))
        if linear != self._linear:
            if self._linear is not None:
                self._leave_linear(self._linear)
            if linear is not None:
                self._enter_linear(linear)
        if core and self._core is None:
            self.enter_core([])
        elif not core and self._core is not None and self._core_depth == 1:
            self.leave_core()
        if core and self._core is not None:
            inputs = self.cores[self._core][1]
            for a in n.all_input_nodes:
                v = self.values.get(a)
                if isinstance(v, torch.Tensor) and not self._export_info.get(a, (None, False))[1]:
                    inputs.append(v)

    def activation_parts(self) -> dict[str | None, dict[str, int]]:
        """Per layer: ``saved``, ``saved_nonfloat``, ``replicated``, ``replicated_nonfloat``,
        ``core``, ``core_nonfloat`` bytes (the ``act_*`` fields of
        :class:`~hetplan.ir.model.LayerIR`).

        ``core`` is what selective recomputation saves: the bytes saved inside the layer's
        attention cores minus the storages of their inputs that nothing outside a core keeps
        (recomputation keeps those instead), at least 0.
        """
        out: defaultdict[str | None, defaultdict[str, int]] = defaultdict(
            lambda: defaultdict(int))
        kept: set[int] = set()
        for key, rec in self.saved_records.items():
            o = out[rec.layer]
            o["saved"] += rec.nbytes
            o["saved_nonfloat"] += 0 if rec.floating else rec.nbytes
            if not rec.split:
                o["replicated"] += rec.nbytes
                o["replicated_nonfloat"] += 0 if rec.floating else rec.nbytes
            if rec.core is None:
                kept.add(key)
            else:
                o["core"] += rec.nbytes
                o["core_nonfloat"] += 0 if rec.floating else rec.nbytes
        for layer, inputs in self.cores:
            for t in inputs:
                key = t.untyped_storage()._cdata
                if key in kept or (t._base is not None and id(t._base) in self._param_ids):
                    continue
                if id(t) in self._param_ids:
                    continue
                kept.add(key)
                nbytes = t.untyped_storage().nbytes()
                out[layer]["core"] -= nbytes
                out[layer]["core_nonfloat"] -= 0 if t.is_floating_point() else nbytes
        for o in out.values():
            o["core"] = min(max(o["core"], 0), o["saved"] - o["replicated"])
            o["core_nonfloat"] = min(max(o["core_nonfloat"], 0), o["core"],
                                     o["saved_nonfloat"])
        return {k: dict(v) for k, v in out.items()}

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
        self.node = n
        self.counter.current = self.exec_layer.get(n)
        if self.counter.current != self._layer:  # regions and cores end with their layer
            self._layer, self._split, self._linear = self.counter.current, False, None
            while self._core is not None:
                self.leave_core()
        if self._export_info:
            self._export_transitions(n)
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
            anchor = sum(p.sum() for p in params)
            if not out.requires_grad:
                # No input needs a gradient (the module reads the model's inputs), so the
                # opaque call's backward never runs: its parameters are ready when the
                # gradient reaches them through this term instead.
                anchor.register_hook(lambda grad: on_backward())
            out = out + 0 * anchor  # keep params in the autograd graph
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
        hooks += self._hooks() if not self._export_info else []
        try:
            with (
                torch.enable_grad(),
                self.counter,
                _GradFnTagger(self.counter, self),
                torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack),
            ):
                out = super().run(*self.graph_info.flat_inputs)
            loss = _scalar_loss(out)
            self.counter.backward = True
            self.node = None
            with self.counter:
                if loss is not None:
                    loss.backward()
        except TraceError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's module failed: say which
            raise self._failure(e) from e
        finally:
            for h in hooks:
                h.remove()
        for p in self.module.parameters():
            p.grad = None

    def _failure(self, e: Exception) -> TraceError:
        """A TraceError naming the module whose code was running when ``e`` was raised (in
        backward: the layer whose autograd node ran)."""
        if self.node is not None:
            culprit = module_of_node(self.node)
            where = f"at fx node %{self.node.name}: {self.node.op} {self.node.target}"
        else:
            culprit = (self.counter.current or "").split("@")[0]
            where = "in backward"
        reason = explain_failure(e)
        return capture_error(self.model, culprit, f"{reason} [{where}]")

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        """Count a tensor autograd saves for backward against the running layer, once per
        storage (views of one activation count once); parameters are not activations."""
        base = t._base if t._base is not None else t
        if id(base) in self._param_ids or id(t) in self._param_ids:
            return t
        key = t.untyped_storage()._cdata
        if key not in self._saved_ids:
            self._saved_ids.add(key)
            nbytes = t.untyped_storage().nbytes()
            self.saved[self.counter.current] += nbytes
            self.saved_records[key] = SavedRecord(
                self.counter.current, nbytes, t.is_floating_point(),
                self._split or self._core is not None, self._core)
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
