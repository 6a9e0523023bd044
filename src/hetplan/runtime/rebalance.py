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

Only single-param-group optimizers are supported by :func:`migrate`.

:class:`~hetplan.runtime.executor.Runtime` drives the same protocol for any model split by
``torch.distributed.pipelining`` (whose stages share the model's parameters): it builds the
new stage first, the pipeline ranks exchange which parameter names they hold before and after
(:func:`plan_param_moves`), the moved parameters travel with their optimizer state
(:func:`exchange_params`) straight into the model's tensors, and the optimizer is rebuilt with
the carried state (:func:`carry_optimizer`); re-packing releases the ranks past the new stage
count. Which events it runs: :func:`executable_events`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hetplan.algorithms.dynamics import layer_moves
from hetplan.ir.validation import check_bounds
from hetplan.errors import SpecError
from hetplan.ir.rebalancing import PlannedEvent, Rebalancing

__all__ = [
    "LayerStage",
    "build_layer_stage",
    "carry_optimizer",
    "exchange_params",
    "migrate",
    "plan_param_moves",
]

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


def _send_params(named: Sequence[tuple[str, nn.Parameter]], opt: torch.optim.Optimizer,
                 peer: int) -> None:
    """Send parameters and their optimizer state to global rank ``peer``: one metadata
    object (names, state keys, shapes, dtypes, plain numbers), then every tensor in order."""
    meta: list[Any] = []
    for name, p in named:
        state = opt.state.get(p, {})
        meta.append((name, [(k, tuple(v.shape), v.dtype) if torch.is_tensor(v) else (k, None, v)
                            for k, v in sorted(state.items())]))
    dist.send_object_list([meta], dst=peer)  # small: names, shapes, dtypes, plain numbers
    for _, p in named:
        dist.send(p.detach().contiguous(), dst=peer)
        state = opt.state.get(p, {})
        for key in sorted(state):
            if torch.is_tensor(state[key]):
                dist.send(state[key].detach().contiguous(), dst=peer)


def _recv_params(named: Sequence[tuple[str, nn.Parameter]],
                 peer: int) -> dict[nn.Parameter, dict[str, Any]]:
    """Receive what :func:`_send_params` sent into ``named`` (copied in place); returns the
    optimizer state per parameter."""
    box: list[Any] = [None]
    dist.recv_object_list(box, src=peer)
    meta = box[0]
    params = dict(named)
    if [m[0] for m in meta] != list(params):
        raise SpecError(f"received parameters {[m[0] for m in meta]}, expected {list(params)}; "
                        "both ranks must build the same layers")
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
            buf = torch.empty(shape, dtype=value, device=p.device)
            dist.recv(buf, src=peer)
            state[key] = buf
        if state:
            states[p] = state
    return states


def plan_param_moves(old: Sequence[Collection[str]],
                     new: Sequence[Collection[str]]) -> list[tuple[int, int, list[str]]]:
    """Which parameters change stage: ``(src, dst, names)`` per pair of stages, ascending.

    Args:
        old / new: the parameter names each stage holds before and after (``new`` may be
            shorter: re-packing). Every name must be held by exactly one old stage, and every
            new name by an old one.

    Returns:
        One entry per (source, destination) pair with its names sorted, pairs in ascending
        order; every rank computes the same list, so walking it with blocking point-to-point
        calls pairs them up without deadlock.

    Raises:
        SpecError: a name held by two old stages, or a new name no old stage holds.
    """
    owner: dict[str, int] = {}
    for s, names in enumerate(old):
        for n in names:
            if n in owner:
                raise SpecError(f"parameter {n!r} is held by stages {owner[n]} and {s}; "
                                "re-balancing needs every parameter on exactly one stage")
            owner[n] = s
    moves: dict[tuple[int, int], list[str]] = {}
    for d, names in enumerate(new):
        for n in names:
            if n not in owner:
                raise SpecError(f"stage {d} needs parameter {n!r}, which no stage holds")
            if owner[n] != d:
                moves.setdefault((owner[n], d), []).append(n)
    return [(s, d, sorted(ns)) for (s, d), ns in sorted(moves.items())]


def exchange_params(
    moves: Sequence[tuple[int, int, Sequence[str]]],
    sending: Mapping[str, nn.Parameter],
    receiving: Mapping[str, nn.Parameter],
    optimizer: torch.optim.Optimizer,
    stage_index: int,
    ranks: Sequence[int],
) -> dict[nn.Parameter, dict[str, Any]]:
    """Execute ``moves`` (from :func:`plan_param_moves`; collective over the pipeline ranks).

    Args:
        sending: this rank's parameters before the move, by name (with state in ``optimizer``).
        receiving: its parameters after the move, by name (received values are copied in).
        stage_index: this rank's pipeline coordinate; ``ranks[s]``: global rank of stage ``s``.

    Returns:
        The optimizer state of every received parameter.
    """
    received: dict[nn.Parameter, dict[str, Any]] = {}
    for s, d, names in moves:
        if s == stage_index:
            _send_params([(n, sending[n]) for n in names], optimizer, ranks[d])
        elif d == stage_index:
            received.update(_recv_params([(n, receiving[n]) for n in names], ranks[s]))
    return received


def carry_optimizer(old: torch.optim.Optimizer, new: torch.optim.Optimizer,
                    received: Mapping[nn.Parameter, dict[str, Any]]) -> torch.optim.Optimizer:
    """Give ``new`` (built over the rebuilt stage's parameters) the state of ``old`` for the
    parameters that stayed and ``received`` for those that arrived, and ``old``'s
    hyper-parameters (a scheduler may have changed them) when both have as many groups."""
    if len(old.param_groups) == len(new.param_groups):
        for go, gn in zip(old.param_groups, new.param_groups):
            gn.update({k: v for k, v in go.items() if k != "params"})
    for group in new.param_groups:
        for p in group["params"]:
            if p in old.state:
                new.state[p] = old.state[p]
            elif p in received:
                new.state[p] = received[p]
    return new


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
            layer = held.pop(mv.layer)
            _send_params(list(layer.named_parameters()), optimizer, ranks[mv.dst])
        elif mv.dst == stage_index:
            layer = factory(mv.layer)
            received.update(_recv_params(list(layer.named_parameters()), ranks[mv.src]))
            held[mv.layer] = layer
    new_stage = LayerStage(held)
    hyper = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    params = list(new_stage.parameters())
    new_opt = type(optimizer)(params if params else [torch.zeros(0, requires_grad=True)],
                              **hyper)  # host: an empty stand-in, never stepped on data
    return new_stage, carry_optimizer(optimizer, new_opt, received)


def executable_events(rebalancing: Rebalancing | None, pp: int, stages_per_rank: int = 1
                      ) -> tuple[list[PlannedEvent], list[tuple[PlannedEvent, str]]]:
    """Split a plan's re-balancing events into those the runtime executes and the rest.

    Only ``applied`` events count (the others are proposals the trigger policy declined). An
    event runs when the pipeline has one stage per rank and the event needs no more stages
    than the pipeline has by then: re-packing onto fewer stages runs (the ranks past them
    are released), growing back onto released ranks does not, nor does anything in an
    interleaved pipeline or a plan without one; those are reported with the reason. Events
    are declarative (complete assignments), so skipping one does not invalidate the next: the
    runtime always moves from the stages it holds.

    Returns:
        ``(run, skipped)``: events to run in iteration order, and ``(event, reason)`` pairs.
    """
    events = sorted((e for e in (rebalancing.events if rebalancing else ()) if e.applied),
                    key=lambda e: e.iteration)
    if pp < 2:
        return [], [(e, "the plan has no pipeline (pp=1)") for e in events]
    if stages_per_rank != 1:
        why = f"an interleaved pipeline ({stages_per_rank} stages per rank) is not re-balanced"
        return [], [(e, why) for e in events]
    run: list[PlannedEvent] = []
    skipped: list[tuple[PlannedEvent, str]] = []
    stages = pp
    for e in events:
        if len(e.stages) > stages:
            skipped.append((e, (f"it needs {len(e.stages)} stages but re-packing left "
                                f"{stages}; released ranks do not rejoin")))
        else:
            run.append(e)
            stages = len(e.stages)
    return run, skipped
