"""Invariants of the model IR, checked after capture and after loading a workload file.

Each violated invariant raises :class:`~hetplan.errors.SpecError` naming the layer or
tensor; ``assert`` is not used because workload files are user input.
"""

from __future__ import annotations

from hetplan.errors import SpecError
from hetplan.ir.model import ModelIR

__all__ = ["verify_model_ir"]


def verify_model_ir(ir: ModelIR, *, where: str = "") -> None:
    """Check the IR's invariants.

    - layer indices are 0..n-1 in order and names are unique;
    - every parameter is owned by exactly one layer (aliases carry ``tied_to`` naming an
      owned parameter), and the owned elements add up to ``num_params``;
    - every gradient tensor names an owned, trainable parameter of the layer it claims,
      with matching size, each at most once, and every trainable parameter has one;
    - sizes and FLOPs are non-negative.
    """
    at = f"{where}: " if where else ""
    if not ir.layers:
        raise SpecError(f"{at}the workload has no layers")
    names: set[str] = set()
    owned: dict[str, tuple[int, int]] = {}  # param name -> (layer index, numel)
    trainable: set[str] = set()
    for i, layer in enumerate(ir.layers):
        if layer.index != i:
            raise SpecError(f"{at}layer {layer.name!r} has index {layer.index}, expected {i}")
        if layer.name in names:
            raise SpecError(f"{at}layer name {layer.name!r} appears twice")
        names.add(layer.name)
        for field_name in ("fwd_flops", "bwd_flops", "act_in_bytes", "act_out_bytes", "act_saved_bytes"):
            if getattr(layer, field_name) < 0:
                raise SpecError(f"{at}layer {layer.name!r}: {field_name} is negative")
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
