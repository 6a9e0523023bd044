"""Re-balancing a running pipeline: move whole layers between stages at an iteration boundary.

The plan's ``rebalancing`` section lists complete stage assignments (``(first, last)`` layer
ranges per stage); this module executes the step from one assignment to the next:

1. Every pipeline rank calls :func:`migrate` after its optimizer step, with no micro-batch in
   flight (all schedules flush per iteration), so nothing but parameters and optimizer state
   has to move (gradients are zero at the boundary).
2. The layers whose stage changes are sent point to point, in ascending global layer order —
   every rank walks the same list, so the blocking sends and receives pair up without
   deadlock. Per layer: a metadata object (parameter names, shapes, dtypes and the optimizer
   state keys) and then the tensors: each parameter, then its optimizer state (Adam's
   ``exp_avg``, ``exp_avg_sq`` and ``step``; any tensor or number state works).
3. The receiver builds the layer with the model's own factory, fills it, and the local stage is
   rebuilt **in global layer order** (a received layer is not appended at the end, as the
   reference code does). The optimizer is rebuilt over the new parameters with the same
   hyper-parameters and the moved state, so training continues exactly as if nothing moved.
4. Re-packing is the same call with fewer stages: the ranks past the new stage count end with
   no layers and are released (they leave the pipeline; the caller decides whether they exit).

Only single-param-group optimizers are supported (the runtime builds one group per stage).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hetplan.algorithms.dynamics import layer_moves
from hetplan.algorithms.partition import check_bounds
from hetplan.errors import SpecError

__all__ = ["LayerStage", "build_layer_stage", "migrate"]

Bounds = Sequence[tuple[int, int]]


class LayerStage(nn.Module):
    """A pipeline stage made of whole layers, keyed and run by their global index."""

    def __init__(self, layers: dict[int, nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(k): layers[k] for k in sorted(layers)})

    @property
    def indices(self) -> list[int]:
        """Global indices of the layers held, ascending."""
        return sorted(int(k) for k in self.layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k in self.indices:
            x = self.layers[str(k)](x)
        return x


def build_layer_stage(factory: Callable[[int], nn.Module], bounds: Bounds,
                      stage: int) -> LayerStage:
    """Stage ``stage`` of ``bounds`` built with ``factory(global_index)`` (empty if the stage
    does not exist: a released rank)."""
    if stage >= len(bounds):
        return LayerStage({})
    first, last = bounds[stage]
    return LayerStage({k: factory(k) for k in range(first, last + 1)})


def _send_layer(module: nn.Module, opt: torch.optim.Optimizer, peer: int) -> None:
    params = list(module.named_parameters())
    meta: list[Any] = []
    for name, p in params:
        state = opt.state.get(p, {})
        meta.append((name, [(k, tuple(v.shape), v.dtype) if torch.is_tensor(v) else (k, None, v)
                            for k, v in sorted(state.items())]))
    dist.send_object_list([meta], dst=peer)  # small: names, shapes, dtypes, plain numbers
    for name, p in params:
        dist.send(p.detach().contiguous(), dst=peer)
        state = opt.state.get(p, {})
        for key in sorted(state):
            if torch.is_tensor(state[key]):
                dist.send(state[key].detach().contiguous(), dst=peer)


def _recv_layer(module: nn.Module, peer: int) -> dict[nn.Parameter, dict[str, Any]]:
    box: list[Any] = [None]
    dist.recv_object_list(box, src=peer)
    meta = box[0]
    params = dict(module.named_parameters())
    if [m[0] for m in meta] != list(params):
        raise SpecError(f"the received layer has parameters {[m[0] for m in meta]}, the "
                        f"factory built {list(params)}; both ranks must build the same layer")
    states: dict[nn.Parameter, dict[str, Any]] = {}
    for name, keys in meta:
        p = params[name]
        with torch.no_grad():
            buf = torch.empty_like(p)
            dist.recv(buf, src=peer)
            p.copy_(buf)
        state: dict[str, Any] = {}
        for key, shape, value in keys:
            if shape is None:  # a plain number travelled in the metadata
                state[key] = value
                continue
            buf = torch.empty(shape, dtype=value)
            dist.recv(buf, src=peer)
            state[key] = buf
        if state:
            states[p] = state
    return states


def migrate(
    stage: LayerStage,
    optimizer: torch.optim.Optimizer,
    old: Bounds,
    new: Bounds,
    stage_index: int,
    factory: Callable[[int], nn.Module],
    ranks: Sequence[int],
) -> tuple[LayerStage, torch.optim.Optimizer]:
    """Move layers from the ``old`` to the ``new`` stage assignment (collective over the
    pipeline ranks ``ranks``, which lists the global rank of every old stage).

    Args:
        stage: this rank's stage under ``old``.
        optimizer: its optimizer (one param group), stepped and with gradients cleared.
        old / new: complete assignments; ``len(new) <= len(old)`` (re-packing releases the
            ranks of stages ``len(new)..``).
        stage_index: this rank's pipeline coordinate.
        factory: ``factory(global_index)`` builds an uninitialised layer (weights arrive).
        ranks: ``ranks[s]`` is the global rank of stage ``s``.

    Returns:
        The rebuilt stage (layers in global order; empty on a released rank) and optimizer.

    Raises:
        SpecError: malformed assignments, more new stages than old, or an optimizer with
            several parameter groups.
    """
    for b in (old, new):
        check_bounds(b, old[-1][1] + 1)
    if len(new) > len(old) or len(ranks) != len(old):
        raise SpecError(f"migrate needs len(new) <= len(old) == len(ranks), got {len(new)}, "
                        f"{len(old)}, {len(ranks)}")
    if len(optimizer.param_groups) != 1:
        raise SpecError("migrate supports optimizers with one parameter group")
    held = {k: stage.layers[str(k)] for k in stage.indices}
    received: dict[nn.Parameter, dict[str, Any]] = {}
    for mv in layer_moves(old, new, [0.0] * (old[-1][1] + 1)):
        if mv.src == stage_index:
            _send_layer(held.pop(mv.layer), optimizer, ranks[mv.dst])
        elif mv.dst == stage_index:
            layer = factory(mv.layer)
            received.update(_recv_layer(layer, ranks[mv.src]))
            held[mv.layer] = layer
    new_stage = LayerStage(held)
    group = optimizer.param_groups[0]
    hyper = {k: v for k, v in group.items() if k != "params"}
    params = [p for p in new_stage.parameters()]
    new_opt = type(optimizer)(params if params else [torch.zeros(0, requires_grad=True)],
                              **hyper)
    for p in params:
        if p in optimizer.state:
            new_opt.state[p] = optimizer.state[p]
        elif p in received:
            new_opt.state[p] = received[p]
    return new_stage, new_opt
