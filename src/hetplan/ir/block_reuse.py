"""Capture repeated blocks once: trace a shortened model, then replicate the block in the IR.

Tracing time grows with the number of blocks (``torch.export`` of llama-70b's 80 decoder
layers takes ~14 s on a laptop core, meta execution ~9 s more). Identical blocks have
identical IR apart from their names, so :func:`capture` traces the model with each long
block list cut to its *steady state* — the blocks up to the first of the final run of
identically shaped blocks, plus one more, so that the last kept block receives its input
from a block like itself — and :func:`expand_blocks` copies the last kept block's layer and
gradients for the blocks that were cut. The bytes a pipeline boundary cuts between two
copies are those after the second-to-last kept block (a block like itself follows it); the
last copy keeps the template's boundary to the layer after the list.

The result is exactly what a full capture gives (a test compares the two on models with
several blocks); whenever the shortcut does not apply cleanly (the cut changes which modules
are layers, a block is called twice, its gradients are not contiguous) capture falls back to
tracing the full model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, replace

from torch import nn

from hetplan.ir.model import GradTensor, LayerIR, ModelIR

__all__ = ["BlockCut", "plan_cuts", "truncated", "expand_blocks"]


@dataclass(frozen=True)
class BlockCut:
    """Block list ``group`` has ``total`` elements; the first ``keep`` are traced."""

    group: str
    total: int
    keep: int


def _signature(m: nn.Module) -> tuple:
    return (type(m),) + tuple((n, tuple(p.shape), p.dtype) for n, p in m.named_parameters())


def plan_cuts(model: nn.Module, groups: list[str]) -> list[BlockCut]:
    """The block lists worth cutting: those whose tail of identical blocks is ≥ 1 long."""
    cuts = []
    for group in groups:
        container = model.get_submodule(group) if group else model
        kids = list(container.children())
        if len(kids) < 3 or any(next(k.parameters(), None) is None for k in kids):
            continue
        sigs = [_signature(k) for k in kids]
        start = len(kids) - 1
        while start > 0 and sigs[start - 1] == sigs[-1]:
            start -= 1
        keep = start + 2
        if keep < len(kids):
            cuts.append(BlockCut(group, len(kids), keep))
    return cuts


@contextlib.contextmanager
def truncated(model: nn.Module, cuts: list[BlockCut]) -> Iterator[None]:
    """Temporarily shorten each cut block list of ``model`` (restored on exit)."""
    saved = []
    try:
        for cut in cuts:
            container = model.get_submodule(cut.group) if cut.group else model
            saved.append((container, container._modules))
            keys = list(container._modules)[: cut.keep]
            container._modules = {k: container._modules[k] for k in keys}
        yield
    finally:
        for container, modules in reversed(saved):
            container._modules = modules


def _rename(name: str, old: str, new: str) -> str:
    return new + name[len(old) :] if name == old or name.startswith(old + ".") else name


def _copy_layer(layer: LayerIR, old: str, new: str) -> LayerIR:
    params = tuple(
        replace(
            p,
            name=_rename(p.name, old, new),
            tied_to=_rename(p.tied_to, old, new) if p.tied_to else None,
        )
        for p in layer.params
    )
    linears = tuple(
        replace(
            lin,
            name=_rename(lin.name, old, new),
            pair=_rename(lin.pair, old, new) if lin.pair else None,
        )
        for lin in layer.linears
    )
    return replace(layer, name=new, params=params, linears=linears)


def expand_blocks(ir: ModelIR, cuts: list[BlockCut]) -> ModelIR | None:
    """Replicate the last traced block of each cut; None if the traced IR does not fit."""
    for cut in cuts:
        ir = _expand_one(ir, cut)  # type: ignore[assignment]
        if ir is None:
            return None
    return ir


def _expand_one(ir: ModelIR, cut: BlockCut) -> ModelIR | None:
    prefix = f"{cut.group}." if cut.group else ""
    names = [f"{prefix}{i}" for i in range(cut.keep)]
    by_name = {layer.name: layer for layer in ir.layers}
    if any(n not in by_name or by_name[n].group != cut.group for n in names):
        return None  # the cut changed which modules are layers
    if sum(1 for layer in ir.layers if layer.group == cut.group) != cut.keep:
        return None  # e.g. a block invoked twice ("h.1@1")
    template = by_name[names[-1]]
    if any(p.tied_to for p in template.params):
        return None
    t_index = template.index
    extra = cut.total - cut.keep
    # a boundary between two blocks cuts what the one after the block before the template
    # cuts (a block like itself follows it); the last copy's boundary is the template's
    between = by_name[names[-2]].cut_bytes_after

    # layers: copies right after the template, later layers shifted
    new_layers: list[LayerIR] = []
    for layer in ir.layers:
        if layer.index <= t_index:
            if layer.index == t_index:
                new_layers.append(replace(layer, cut_bytes_after=between))
                for k in range(extra):
                    copy = _copy_layer(template, template.name, f"{prefix}{cut.keep + k}")
                    copy = replace(copy, index=t_index + 1 + k)
                    if k < extra - 1:
                        copy = replace(copy, cut_bytes_after=between)
                    new_layers.append(copy)
            else:
                new_layers.append(layer)
        else:
            new_layers.append(replace(layer, index=layer.index + extra))

    # gradients: the template's run, repeated for blocks total-1 … keep (backward order)
    grads = list(ir.grad_tensors)
    pos = [i for i, g in enumerate(grads) if g.layer == template.name]
    if not pos or pos != list(range(pos[0], pos[0] + len(pos))):
        return None
    run = grads[pos[0] : pos[-1] + 1]
    copies: list[GradTensor] = []
    for block in range(cut.total - 1, cut.keep - 1, -1):
        name = f"{prefix}{block}"
        for g in run:
            copies.append(
                replace(
                    g,
                    name=_rename(g.name, template.name, name),
                    layer=name,
                    layer_index=t_index + 1 + block - cut.keep,
                )
            )
    shifted = [
        replace(g, layer_index=g.layer_index + extra) if g.layer_index > t_index else g
        for g in grads
    ]
    new_grads = shifted[: pos[0]] + copies + shifted[pos[0] :]
    return replace(
        ir,
        layers=tuple(new_layers),
        grad_tensors=tuple(new_grads),
        num_params=ir.num_params + extra * template.param_numel,
    )

