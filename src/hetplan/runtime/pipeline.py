"""Pipeline-parallel stages from a plan's stage split (torch pipelining).

``torch.distributed.pipelining`` lost PiPPy's automatic split policies, so hetplan emits the
``split_spec`` itself (:func:`split_points`): a ``SplitPoint.BEGINNING`` at the module that is
the first layer of every stage after the first. :func:`build_stage` traces the model with
``pipeline()`` (``torch.export`` underneath, so HF models traced with
``example_kwargs={"use_cache": False}`` work) and builds this rank's stage. When tracing fails
(data-dependent control flow), a *manual* stage is built instead, which is possible only when
the model's forward is a plain sequence of modules: an ``nn.Sequential``, or a model that
declares ``pipeline_layers`` (an ordered sequence of its submodules with
``forward(x) == pipeline_layers[-1](...pipeline_layers[0](x))``). Stage modules share their
parameters with ``model`` and keep the model's parameter names (``blocks.2.fc1.weight``).

Glue code (operations in a parent's forward between two layer calls) lands in the stage of
the *previous* layer, because the split is placed right before the next layer module is
called; the IR attributes glue FLOPs to the next layer, so a stage's measured time may differ
from its predicted time by that glue. A boundary at a layer that is never called as a module
(only its parameters are read by glue, like ``pos_emb.weight[:t]``) or that is called more than
once cannot be split, and is refused with a :class:`~hetplan.errors.SpecError`. Parameters
tied across stages (GPT-2's ``wte``/``lm_head``) become separate copies per stage; they are
refused unless the caller sums their gradients (:func:`tied_across_stages`). A tensor a stage
makes and a stage past the next one reads is relayed through the stages in between
(:func:`_relay_skips`): torch's schedules send only between adjacent stages.

The stages run the plan's per-rank action lists through :mod:`hetplan.runtime.schedule`.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import operator
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, SplitPoint, pipeline

from hetplan.errors import SpecError, TraceError
from hetplan.ir.plan_sections import Stage

if TYPE_CHECKING:  # the common base of traced (``_PipelineStage``) and manual stages
    from torch.distributed.pipelining.stage import _PipelineStageBase

__all__ = [
    "SequentialStageModule",
    "build_stage",
    "build_stages",
    "split_points",
    "stage_indices_of_rank",
    "stage_modules",
    "stage_owning",
    "tied_across_stages",
    "use_eager_layers",
]

_MISSING = object()


# -- split points ----------------------------------------------------------------------------
def _ordered(stages: Sequence[Stage]) -> list[Stage]:
    ordered = sorted(stages, key=lambda s: s.index)
    if [s.index for s in ordered] != list(range(len(ordered))):
        raise SpecError(f"stage indices must be 0..{len(ordered) - 1}, got "
                        f"{[s.index for s in ordered]}")
    return ordered


def split_points(ir_layer_names: Sequence[str], stages: Sequence[Stage]) -> dict[str, SplitPoint]:
    """The ``split_spec`` of ``torch.distributed.pipelining.pipeline()`` for a stage split.

    Args:
        ir_layer_names: the IR's layer names in dataflow order (``ModelIR.layers``).
        stages: the plan's stages; they must cover the layers contiguously, in index order.

    Returns:
        Module qualname → ``SplitPoint.BEGINNING`` for the first layer of every stage after the
        first, in stage order (``{}`` for a single stage).

    Raises:
        SpecError: the stages do not tile the layers, a stage's ``layer_names`` disagree with
            the IR, or a boundary cannot be split (a second invocation ``name@k``, a module
            invoked several times, the root module, or a module enclosing earlier layers).
    """
    names = list(ir_layer_names)
    ordered = _ordered(stages)
    expect = 0
    for s in ordered:
        if s.first_layer != expect:
            raise SpecError(f"stage {s.index} starts at layer {s.first_layer}, expected "
                            f"{expect}: stages must cover the layers contiguously")
        if s.last_layer >= len(names):
            raise SpecError(f"stage {s.index} ends at layer {s.last_layer} but the model has "
                            f"{len(names)} layers")
        if s.layer_names and tuple(names[s.first_layer:s.last_layer + 1]) != s.layer_names:
            raise SpecError(f"stage {s.index}: layer_names {list(s.layer_names)[:3]}... do not "
                            f"match the model's layers {names[s.first_layer:s.first_layer + 3]}"
                            "...; the plan was made for another model")
        expect = s.last_layer + 1
    if ordered and expect != len(names):
        raise SpecError(f"the stages end at layer {expect - 1} but the model has {len(names)} "
                        f"layers (last: {names[-1]!r})")
    spec: dict[str, SplitPoint] = {}
    for s in ordered[1:]:
        name = names[s.first_layer]
        where = f"stage {s.index} starts at layer {s.first_layer} {name!r}"
        if "@" in name:
            raise SpecError(f"{where}, a second invocation of module {name.split('@')[0]!r}: "
                            "a pipeline split can only precede a module's first call; move the "
                            "boundary to another layer")
        if name == "":
            raise SpecError(f"{where}, the root module (parameters read by glue code in the "
                            "top-level forward): it cannot be a split point; move the boundary")
        if again := [n for n in names if n.startswith(name + "@")]:
            raise SpecError(f"{where}, but that module is invoked again as {again[0]!r}: a "
                            "split before it would also split before every later call; move "
                            "the boundary")
        if inner := [n for n in names[:s.first_layer] if n.startswith(name + ".")]:
            raise SpecError(f"{where}, a module enclosing layer {inner[0]!r} of an earlier "
                            "stage: a split before it would move that layer too")
        spec[name] = SplitPoint.BEGINNING
    return spec


def stage_indices_of_rank(stages: Sequence[Stage], rank: int) -> list[int]:
    """Indices of the stages global ``rank`` holds (several for interleaved 1F1B)."""
    return [s.index for s in _ordered(stages) if rank in s.ranks]


def stage_owning(stages: Sequence[Stage], ir_layer_names: Sequence[str],
                 param: str) -> int | None:
    """The index of the stage whose layer owns parameter ``param`` (the layer with the longest
    name that prefixes it), or None when no layer does."""
    stage_of = {n.split("@")[0]: s.index for s in _ordered(stages)
                for n in ir_layer_names[s.first_layer:s.last_layer + 1]}
    hits = [lay for lay in stage_of if lay == "" or param.startswith(lay + ".")]
    return stage_of[max(hits, key=len)] if hits else None


def tied_across_stages(model: nn.Module, stages: Sequence[Stage],
                       ir_layer_names: Sequence[str]) -> list[tuple[str, ...]]:
    """Parameters shared by layers of different stages (tied embeddings), as name tuples.

    Pipelining unties them: each stage holding a name trains its own copy, so the runtime must
    sum the gradients of the names of one tuple across the ranks holding them after
    :func:`step` and before the optimizer step, or training diverges from the unsplit model.
    """
    def owner(param: str) -> int | None:
        return stage_owning(stages, ir_layer_names, param)

    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    out = []
    for group in names.values():
        by_stage = sorted({(owner(n), n) for n in group if owner(n) is not None})
        if len({st for st, _ in by_stage}) > 1:
            out.append(tuple(n for _, n in by_stage))
    return out


# -- stages ----------------------------------------------------------------------------------
class SequentialStageModule(nn.Module):
    """A manual stage: runs modules of a sequential model in order, like ``nn.Sequential``.

    The modules are registered under their qualnames in the original model (a container per
    dotted prefix), so parameter names match ``model.named_parameters()``.

    Args:
        layers: (qualname, module) pairs in call order.
    """

    def __init__(self, layers: Sequence[tuple[str, nn.Module]]) -> None:
        super().__init__()
        self.order: list[str] = [q for q, _ in layers]
        for q, mod in layers:
            parent: nn.Module = self
            *path, leaf = q.split(".")
            for atom in path:
                if not hasattr(parent, atom):
                    parent.add_module(atom, nn.Module())
                parent = getattr(parent, atom)
            parent.add_module(leaf, mod)

    def forward(self, *args: Any) -> Any:
        """Feeds ``args`` to the first module and each output to the next one."""
        x: Any = None
        for i, q in enumerate(self.order):
            mod = self.get_submodule(q)
            x = mod(*args) if i == 0 else mod(x)
        return x


def _generated_code() -> contextlib.AbstractContextManager[Any]:
    """While ``pipeline()`` builds the stages: make the submodules that ``torch.export``
    unflattens (``InterpreterModule``) run their graph's generated Python code instead of
    walking the graph node by node in a ``torch.fx.Interpreter`` (torch's default, kept for
    debugging). The same operations in the same order, without the interpreter's per-node
    Python: on the CPU presets' machine a 4-stage pipeline step went from 24.7 to 17.2 ms
    (``docs/decisions/cpu-fidelity.md``, section 16). A torch without the switch (a private
    one: ``torch.export.unflatten._disable_interpreter``) keeps its default."""
    # the module, not ``torch.export.unflatten`` the function that shadows it as an attribute
    unflatten = importlib.import_module("torch.export.unflatten")
    switch = getattr(unflatten, "_disable_interpreter", None)
    return switch() if switch is not None else contextlib.nullcontext()


def _trace(model: nn.Module, args: tuple, kwargs: dict | None,
           spec: dict[str, SplitPoint]) -> tuple[Any, dict[str, int]]:
    """``pipeline()`` with the spec; undoes its in-place forward patching; counts the calls
    of every split module during the trace."""
    calls = dict.fromkeys(spec, 0)
    saved, hooks = [], []
    for q in spec:
        try:
            mod = model.get_submodule(q)
        except AttributeError as e:
            raise SpecError(f"stage boundary {q!r} is not a submodule of "
                            f"{type(model).__name__}; the plan was made for another model") from e
        saved.append((mod, mod.__dict__.get("forward", _MISSING),
                      mod.__dict__.get("_orig_forward", _MISSING)))
        hooks.append(mod.register_forward_pre_hook(
            lambda _m, _a, q=q: calls.__setitem__(q, calls[q] + 1)))
    try:
        with _generated_code(), warnings.catch_warnings():
            # torch's own pytree code in the split (pickling its specs) uses a check torch
            # has deprecated; printed once per rank and run, about torch, nothing to act on
            warnings.filterwarnings("ignore", category=FutureWarning,
                                    message=r".*isinstance\(treespec, LeafSpec\)")
            pipe = pipeline(model, mb_args=args, mb_kwargs=kwargs or None, split_spec=spec)
    finally:
        for h in hooks:
            h.remove()
        for mod, fwd, orig in saved:
            for attr, value in (("forward", fwd), ("_orig_forward", orig)):
                if value is _MISSING:
                    mod.__dict__.pop(attr, None)
                else:
                    mod.__dict__[attr] = value
    return pipe, calls


def _free_traced_dtypes(stage: nn.Module) -> int:
    """Let a traced stage compute in the dtype its weights have when it runs, not the one it
    was traced in; the number of nodes changed.

    The runtime traces the model in its own dtype, and the precision handler casts the
    working weights to the compute dtype after the split. ``torch.export`` bakes the traced
    dtype into the graph twice: tensor-metadata assertions (``aten._assert_tensor_metadata``),
    which compute nothing and are removed, and casts that did nothing when traced (a
    ``.to(device)`` recorded as ``aten.to`` / ``aten._to_copy`` with the input's own
    dtype), which are kept without their dtype. Before, a stage of Hugging Face's GPT-2
    refused its first bf16 or fp16 forward ("Expected Double, Got BFloat16" on ``wpe``),
    and without the assertion cast its position embeddings back to the traced dtype, which
    made the sum with the token embeddings fp32 (CPU's layer norm then refused its 16-bit
    weight). A cast to another dtype than its input's, the model's own choice, is kept. A
    submodule ``torch.export`` unflattened (``InterpreterModule``) rebuilds its generated
    code from the edited graph; a ``GraphModule`` recompiles."""
    aten = torch.ops.aten
    asserts = {getattr(aten, "_assert_tensor_metadata", None)}
    asserts = {op.default for op in asserts if op is not None}
    casts = {aten._to_copy.default, aten.to.dtype_layout}
    changed = 0
    for sub in stage.modules():
        graph = getattr(sub, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        here = 0
        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            if node.target in asserts and not node.users:
                graph.erase_node(node)
                here += 1
            elif node.target in casts and node.kwargs.get("dtype") is not None and node.args:
                traced = getattr(getattr(node.args[0], "meta", {}).get("val"), "dtype", None)
                if traced == node.kwargs["dtype"]:
                    node.kwargs = {**node.kwargs, "dtype": None}
                    here += 1
        if not here:
            continue
        changed += here
        if isinstance(sub, torch.fx.GraphModule):
            sub.recompile()
        else:
            finalize = getattr(sub, "finalize", None)
            if callable(finalize):
                finalize()
    return changed


def _relay_skips(pipe: Any) -> int:
    """Make every stage of a traced pipe receive only from the stage before it; the number of
    stage inputs that now come through a relay.

    A value a stage computes and a stage past the next one reads (Hugging Face GPT-2's
    attention mask, made by the embedding stage and read by every block), or a model input
    that the first stage and a later one read, is passed through each stage in between: the
    stage takes it as one more input and returns it (as an ``aten.alias``, so it has a
    gradient function of its own) as one more output. Torch's schedules send only between
    adjacent stages and feed the model's inputs to the first stage only, so before this every
    GPT-2 pipeline of three or more stages, and every interleaved one, was refused at its
    first step. A value read by several later stages is relayed once per stage it crosses.
    Edits the pipe's split graph and the stage modules in between (both recompiled).

    Raises:
        SpecError: a later stage reads a model input that the first stage does not read
            (torch passes the first stage exactly the model's inputs).
    """
    gm = pipe.split_gm
    graph = gm.graph
    calls = [n for n in graph.nodes if n.op == "call_module"]
    index = {n: i for i, n in enumerate(calls)}

    def producer(node: Any) -> int | None:
        """The stage that makes ``node``; -1 for a model input (the first stage's)."""
        while isinstance(node, torch.fx.Node) and node.op == "call_function" \
                and node.target is operator.getitem:
            node = node.args[0]
        if isinstance(node, torch.fx.Node) and node.op == "placeholder":
            return -1
        return index.get(node) if isinstance(node, torch.fx.Node) else None

    hops: dict[tuple[torch.fx.Node, int], torch.fx.Node] = {}  # (value, stage) -> its output
    relayed = 0
    for k, call in enumerate(calls):
        sub = gm.get_submodule(str(call.target))
        assert isinstance(sub, torch.fx.GraphModule)
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        for pos, arg in enumerate(call.args):
            s = producer(arg)
            if s is None or s >= k - 1:
                continue
            if s == -1 and arg not in calls[0].args:
                # torch feeds the model's inputs to the first stage only, as its own inputs
                raise SpecError(f"stage {k} reads the model input {arg.name!r}, which the "
                                "first stage does not: the runtime feeds inputs to the first "
                                "stage only; re-plan with a boundary after a layer that reads "
                                "it, or fewer stages")
            value = arg
            for m in range(s + 1, k):
                if (arg, m) not in hops:
                    hops[(arg, m)] = _pass_through(gm, calls[m], value, placeholders[pos].meta)
                value = hops[(arg, m)]
            call.update_arg(pos, value)
            relayed += 1
    if relayed:
        graph.lint()
        gm.recompile()
    return relayed


def _pass_through(gm: torch.fx.GraphModule, call: torch.fx.Node, value: torch.fx.Node,
                  meta: dict[str, Any]) -> torch.fx.Node:
    """Stage ``call`` takes ``value`` as its last input and returns it as its last output;
    the split graph's node for that output. ``meta``: the consumer's placeholder metadata
    (torch's stage reads ``meta["val"]`` for its buffers)."""
    sub = gm.get_submodule(str(call.target))
    assert isinstance(sub, torch.fx.GraphModule)  # what pipeline() splits into
    g = sub.graph
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    if value in call.args:  # the stage reads it too: return that input, send it once
        ph = placeholders[call.args.index(value)]
    else:
        taken = {str(n.target) for n in placeholders} | {n.name for n in g.nodes}
        name = next(f"relay_{value.name}_{i}" for i in itertools.count()
                    if f"relay_{value.name}_{i}" not in taken)
        with g.inserting_after(placeholders[-1]):
            ph = g.placeholder(name)
        ph.meta = dict(meta)
        call.args = (*call.args, value)
    out = g.output_node()
    with g.inserting_before(out):
        alias = g.call_function(torch.ops.aten.alias.default, (ph,))
    alias.meta = dict(meta)
    old = out.args[0]
    single = not isinstance(old, (tuple, list))
    outs: tuple[Any, ...] = (old,) if single else tuple(old)  # type: ignore[arg-type]
    out.args = ((*outs, alias),)
    g.lint()
    sub.recompile()
    top = gm.graph
    if single:  # its users read the one output through index 0 now
        with top.inserting_after(call):
            first = top.call_function(operator.getitem, (call, 0))
        call.replace_all_uses_with(first, delete_user_cb=lambda u: u is not first)
    after = call  # keep the getitems in index order, in the graph as in ``call.users``
    while after.next.op == "call_function" and after.next.target is operator.getitem \
            and after.next.args[0] is call:
        after = after.next
    with top.inserting_after(after):
        return top.call_function(operator.getitem, (call, len(out.args[0]) - 1))


def _check_splits(model: nn.Module, calls: dict[str, int], got: int, want: int) -> None:
    bad = {q: c for q, c in calls.items() if c != 1}
    if not bad and got == want:
        return
    what = "; ".join(
        f"{q!r} is never called as a module (its parameters are only read by glue code)"
        if c == 0 else f"{q!r} is called {c} times" for q, c in bad.items())
    raise SpecError(f"{type(model).__name__}: the plan's {want} stages cannot be cut at its "
                    f"stage boundaries ({what or 'unknown reason'}); pipelining found {got} "
                    "stages. A boundary must be a module called exactly once; move it to the "
                    "next layer")


def _declared_sequence(model: nn.Module) -> tuple[list[tuple[str, nn.Module]], str] | None:
    """The model's plain call sequence and how it was found, or None."""
    if isinstance(model, nn.Sequential):
        return list(model.named_children()), "an nn.Sequential"
    declared = getattr(model, "pipeline_layers", None)
    if declared is None:
        return None
    mods = list(declared() if callable(declared) and not isinstance(declared, nn.Module)
                else declared)
    names = {id(m): q for q, m in model.named_modules() if q}
    if missing := [type(m).__name__ for m in mods if id(m) not in names]:
        raise SpecError(f"{type(model).__name__}.pipeline_layers lists modules that are not "
                        f"submodules of the model: {missing}")
    return [(names[id(m)], m) for m in mods], "declared by pipeline_layers"


def _expand(seq: list[tuple[str, nn.Module]], cuts: Sequence[str]) -> list[tuple[str, nn.Module]]:
    """Flattens nested ``nn.Sequential`` entries that contain a cut (calling a Sequential is
    calling its children in order, so this keeps the computation)."""
    out: list[tuple[str, nn.Module]] = []
    for q, m in seq:
        if isinstance(m, nn.Sequential) and any(c.startswith(q + ".") for c in cuts):
            out += _expand([(f"{q}.{n}", c) for n, c in m.named_children()], cuts)
        else:
            out.append((q, m))
    return out


def _manual_stages(model: nn.Module, args: tuple, kwargs: dict | None, spec: Sequence[str],
                   reason: str) -> list[SequentialStageModule]:
    """Cuts a sequential model at the split points into one module per stage."""
    model_name = type(model).__name__
    found = _declared_sequence(model)
    if found is None:
        raise TraceError(
            f"cannot split {model_name} into pipeline stages: torch.distributed.pipelining could "
            f"not trace it ({reason}), and its forward is not a plain sequence of layer modules "
            "(an nn.Sequential, or a model declaring `pipeline_layers`), so no manual stage can "
            "be built. Remove the data-dependent control flow from its forward or declare "
            "`pipeline_layers`", module="", reason=reason)
    if kwargs:
        raise SpecError(f"{model_name} needs a manual pipeline split ({found[1]}), which takes "
                        f"positional inputs only, got keyword inputs {sorted(kwargs)}")
    seq = _expand(found[0], spec)
    where = {q: i for i, (q, _) in enumerate(seq)}
    if missing := [q for q in spec if q not in where]:
        raise SpecError(f"{model_name} ({found[1]}): stage boundaries {missing} are not entries "
                        f"of its call sequence {list(where)[:8]}; cannot split it manually")
    cuts = [0, *(where[q] for q in spec), len(seq)]
    if cuts != sorted(cuts):
        raise SpecError(f"{model_name}: stage boundaries {list(spec)} are out of call order")
    parts = [SequentialStageModule(seq[a:b]) for a, b in itertools.pairwise(cuts)]
    buffers = [(b, b.clone()) for b in model.buffers()]
    with torch.no_grad():  # guard: the composed parts must compute the model's forward
        state = torch.random.get_rng_state()
        want = model(*args)
        torch.random.set_rng_state(state)
        got: Any = args
        for i, part in enumerate(parts):
            got = part(*got) if i == 0 else part(got)
        torch.random.set_rng_state(state)
        for b, value in buffers:  # undo running-statistics updates of the two runs
            b.copy_(value)
    ok = isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor) and (
        want.shape == got.shape and torch.equal(want, got))
    if not ok:
        raise TraceError(f"{model_name} ({found[1]}): running its layer modules in order does "
                         "not reproduce its forward on the example inputs, so it cannot be "
                         "split manually", module="", reason=reason)
    return parts


def build_stages(
    model: nn.Module,
    example_microbatch_args: Sequence[Any] | torch.Tensor,
    example_kwargs: Mapping[str, Any] | None,
    stages: Sequence[Stage],
    stage_indices: Sequence[int],
    pp_group: dist.ProcessGroup | None,
    device: torch.device | str,
    *,
    ir_layer_names: Sequence[str] | None = None,
    allow_cross_stage_ties: bool = False,
    traced_from: nn.Module | None = None,
    eager_units: Sequence[Sequence[str]] = (),
    eager_required: Sequence[str] = (),
    kept: list[tuple[int, tuple[str, ...]]] | None = None,
) -> list[_PipelineStageBase]:
    """This rank's pipeline stages (one, or several for interleaved 1F1B), traced once.

    Args:
        model: the full model; stage modules share its parameters.
        example_microbatch_args: positional inputs of one micro-batch (for tracing).
        example_kwargs: keyword inputs used for tracing (``{"use_cache": False}`` for HF LMs);
            non-tensor values are baked into the traced stages.
        stages: the plan's stages.
        stage_indices: which stages to build.
        pp_group: the pipeline process group; its group rank ``r`` must hold stage indices
            ``≡ r (mod pp)`` (``None``: the default group).
        device: the device of this rank.
        ir_layer_names: the IR's layer names; default: the stages' ``layer_names`` joined.
        allow_cross_stage_ties: accept parameters tied across stages (the caller syncs their
            gradients, see :func:`tied_across_stages`); refused by default.
        traced_from: trace this copy of ``model`` instead (the model before tensor
            parallelism sharded it: sharded modules run collectives, which tracing cannot).
        eager_units / eager_required: the module groups whose traced modules are replaced
            by ``model``'s own (sharded) modules in the stage, and the names that must be
            (:func:`use_eager_layers`); a unit that cannot be is kept traced.
        kept: receives ``(stage index, unit)`` for every unit kept traced.

    Returns:
        One ``PipelineStage`` per entry of ``stage_indices``; ``stage.submod`` is either a
        traced ``GraphModule`` or a :class:`SequentialStageModule` (manual fallback).

    Raises:
        SpecError: the boundaries cannot be split (see :func:`split_points`), or parameters
            are tied across stages and ``allow_cross_stage_ties`` is False.
        TraceError: the model cannot be traced and is not a plain sequence of modules.
    """
    ordered = _ordered(stages)
    names = list(ir_layer_names) if ir_layer_names is not None else [
        n for s in ordered for n in s.layer_names]
    if ir_layer_names is None and any(not s.layer_names for s in ordered):
        raise SpecError("the plan's stages carry no layer_names; pass ir_layer_names")
    spec = split_points(names, ordered)
    if (ties := tied_across_stages(model, ordered, names)) and not allow_cross_stage_ties:
        raise SpecError(f"{type(model).__name__}: parameters tied across stages {ties} would be "
                        "trained as separate copies; sum their gradients across the stages "
                        "(see tied_across_stages) and pass allow_cross_stage_ties=True")
    n = len(ordered)
    if bad := [i for i in stage_indices if not 0 <= i < n]:
        raise SpecError(f"stage indices {bad} are outside the plan's {n} stages")
    device = torch.device(device)
    if n == 1:
        return [PipelineStage(model, 0, 1, device, group=pp_group)]
    parts, pipe = _split(model, example_microbatch_args, example_kwargs, ordered, names, spec,
                         stage_indices, traced_from, eager_units, eager_required, kept)
    if pipe is None:
        return [PipelineStage(parts[i], i, n, device, group=pp_group) for i in stage_indices]
    return [pipe.build_stage(i, device, group=pp_group) for i in stage_indices]


def stage_modules(
    model: nn.Module,
    example_microbatch_args: Sequence[Any] | torch.Tensor,
    example_kwargs: Mapping[str, Any] | None,
    stages: Sequence[Stage],
    stage_indices: Sequence[int],
    *,
    ir_layer_names: Sequence[str],
    traced_from: nn.Module | None = None,
    eager_units: Sequence[Sequence[str]] = (),
    eager_required: Sequence[str] = (),
    kept: list[tuple[int, tuple[str, ...]]] | None = None,
    allow_ties: bool = False,
) -> dict[int, nn.Module]:
    """The modules of stages ``stage_indices`` (index -> module), split as
    :func:`build_stages` splits them but without torch's ``PipelineStage`` around them: for
    runtimes that move activations themselves (a heterogeneous pipeline, whose neighbouring
    stages run different numbers of ranks; Chimera). Parameters tied across stages are
    refused unless ``allow_ties`` (the caller sums the copies' gradients). Arguments and
    errors as in :func:`build_stages`."""
    ordered = _ordered(stages)
    names = list(ir_layer_names)
    spec = split_points(names, ordered)
    if (ties := tied_across_stages(model, ordered, names)) and not allow_ties:
        raise SpecError(f"{type(model).__name__}: parameters tied across stages {ties}; "
                        "this pipeline does not sum tied gradients across stages of "
                        "different degrees: re-plan without per-stage degrees (--hetero off)")
    if bad := [i for i in stage_indices if not 0 <= i < len(ordered)]:
        raise SpecError(f"stage indices {bad} are outside the plan's {len(ordered)} stages")
    if len(ordered) == 1:
        return {0: model}
    parts, _ = _split(model, example_microbatch_args, example_kwargs, ordered, names, spec,
                      stage_indices, traced_from, eager_units, eager_required, kept)
    return {i: parts[i] for i in stage_indices}


def _split(model: nn.Module, example_microbatch_args: Sequence[Any] | torch.Tensor,
           example_kwargs: Mapping[str, Any] | None, ordered: Sequence[Stage],
           names: Sequence[str], spec: dict[str, SplitPoint], stage_indices: Sequence[int],
           traced_from: nn.Module | None, eager_units: Sequence[Sequence[str]],
           eager_required: Sequence[str], kept: list[tuple[int, tuple[str, ...]]] | None,
           ) -> tuple[list[nn.Module], Any]:
    """Every stage's module (traced, with the eager units of ``stage_indices`` put back; or
    manual) and the traced pipe (None for manual stages)."""
    n = len(ordered)
    args = (example_microbatch_args,) if isinstance(example_microbatch_args, torch.Tensor) \
        else tuple(example_microbatch_args)
    kwargs = dict(example_kwargs or {})
    source = traced_from if traced_from is not None else model
    try:
        pipe, calls = _trace(source, args, kwargs, spec)
    except SpecError:
        raise
    except Exception as e:  # noqa: BLE001 - any tracing failure leads to the fallback
        if eager_units:
            raise SpecError(f"{type(model).__name__} cannot be traced into pipeline stages "
                            f"({e}); pipeline with tensor parallelism needs a traced split: "
                            "re-plan with --pp 1 or --tp 1") from e
        reason = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        return list(_manual_stages(model, args, kwargs, list(spec), reason)), None
    _check_splits(source, calls, pipe.num_stages, n)
    _relay_skips(pipe)
    for i in range(n):
        _free_traced_dtypes(pipe.get_stage_module(i))
    for i in stage_indices:
        here = [r for r in eager_required
                if stage_owning(ordered, names, r + ".") == ordered[i].index]
        left = use_eager_layers(pipe.get_stage_module(i), model, eager_units, here)
        if kept is not None:
            kept += [(i, u) for u in left]
    return [pipe.get_stage_module(i) for i in range(n)], pipe


def use_eager_layers(stage_module: nn.Module, model: nn.Module,
                     units: Sequence[Sequence[str]], required: Sequence[str] = ()
                     ) -> list[tuple[str, ...]]:
    """Replace, in a traced stage, the traced modules of every *unit* the stage calls by
    ``model``'s modules of the same names (in place); the units kept traced.

    Tracing fixes every shape of a module's computation; a tensor-parallel module computes
    ``1/tp`` of its heads and features, so its stage must run the sharded module itself. A
    unit (an attention module, the linears of one MLP pair, a whole layer) is replaced
    whole or not at all: each of its modules must be called with exactly one tensor and its
    result used as one tensor (the eager calling convention of a block, a linear, an
    embedding, a single-input attention). A unit that does not qualify keeps its traced,
    unsharded copy: correct, replicated computation.

    Raises:
        SpecError: a unit with a name in ``required`` (names of this stage that must run
            sharded: the vocabulary-parallel head and embedding, whose sharding the loss
            relies on; every layer under sequence parallelism) does not qualify.
    """
    calls: dict[str, tuple[nn.Module, str, bool]] = {}
    for gm_name, gm in list(stage_module.named_modules()):
        graph = getattr(gm, "graph", None)
        if graph is None:
            continue
        for node in graph.nodes:
            if node.op != "call_module":
                continue
            full = f"{gm_name}.{node.target}" if gm_name else str(node.target)
            many_out = any(u.op == "call_function" and "getitem" in str(u.target)
                           for u in node.users)
            ok = len(node.args) == 1 and not node.kwargs and not many_out
            why = "" if ok else (f"called with {len(node.args)} input(s)"
                                 f"{' and several outputs' if many_out else ''}")
            calls[full] = (gm, why, ok)
    kept = []
    for unit in units:
        present = [n for n in unit if n in calls or n in required]
        if not present:
            continue  # another stage's
        bad = {n: calls[n][1] if n in calls else "not called as a module of its own"
               for n in unit if n not in calls or not calls[n][2]}
        if not bad:
            for n in unit:
                parent_name, _, attr = n.rpartition(".")
                parent = stage_module.get_submodule(parent_name) if parent_name else stage_module
                setattr(parent, attr, model.get_submodule(n))
            continue
        if any(n in required for n in unit):
            name, why = next(iter(bad.items()))
            raise SpecError(f"layer {name!r} is {why} in its traced pipeline stage; pipeline "
                            "with tensor parallelism runs a sharded module as itself, which "
                            "takes one tensor: re-plan with --pp 1 or --tp 1 (or without "
                            "sequence parallelism)")
        kept.append(tuple(unit))
    return kept


def build_stage(
    model: nn.Module,
    example_microbatch_args: Sequence[Any] | torch.Tensor,
    example_kwargs: Mapping[str, Any] | None,
    stages: Sequence[Stage],
    stage_index: int,
    pp_group: dist.ProcessGroup | None,
    device: torch.device | str,
    *,
    ir_layer_names: Sequence[str] | None = None,
    allow_cross_stage_ties: bool = False,
) -> _PipelineStageBase:
    """The pipeline stage ``stage_index`` of ``model`` split as the plan's ``stages`` say.

    Traces with ``pipeline(model, mb_args=..., mb_kwargs=..., split_spec=split_points(...))``
    and builds the stage with ``pipe.build_stage(stage_index, device, group=pp_group)``; falls
    back to a manual :class:`SequentialStageModule` when tracing fails (see module doc).
    Arguments, result and errors as in :func:`build_stages`.
    """
    return build_stages(model, example_microbatch_args, example_kwargs, stages, [stage_index],
                        pp_group, device, ir_layer_names=ir_layer_names,
                        allow_cross_stage_ties=allow_cross_stage_ties)[0]
