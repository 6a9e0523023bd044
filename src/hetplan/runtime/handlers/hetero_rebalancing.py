"""Re-balancing a pipeline of per-stage degrees (the ``hetero`` section): move whole layers
between stages whose data- and tensor-parallel degrees differ.

:class:`~hetplan.runtime.handlers.rebalancing.RebalancingHandler` calls
:func:`rebalance_hetero` after the optimizer step of an applied event's iteration, on every
rank (every rank of a heterogeneous plan holds one stage; no micro-batch is in flight and
gradients are cleared, so only parameters and optimizer state move). The steps:

1. **Rebuild first.** This rank's stage module is built for the event's bounds
   (:meth:`~hetplan.runtime.handlers.stages.StagesHandler.rebuild_hetero`: same stage index,
   ranks and degrees; its parameters are the model's, sharded where the stage runs tensor
   parallel — a tp>1 rank sharded *every* layer of its model at setup, so a layer entering
   its stage already has its sharded modules, holding stale values).
2. **Agree on the moves.** Every rank contributes the names of the parameters its stage
   owns before and after (``all_gather_object`` over the world); the first rank of each stage
   speaks for it and :func:`~hetplan.runtime.rebalance.plan_param_moves` (the homogeneous
   mechanism) lists ``(source stage, destination stage, names)`` in one order every rank
   walks, so the blocking point-to-point calls pair up.
3. **Full tensors travel.** First every rank takes its optimizer's state as whole
   parameters (:func:`_whole_state`): a plain optimizer's per-parameter state as it is; the
   runtime's sharded optimizer (ZeRO-1/2 over the stage's replicas, or 16-bit working
   weights with fp32 masters) gathers its master values and state chunks from the replicas
   (:meth:`~hetplan.runtime.sharded_optimizer.ShardedOptimizer.full_state`). Per move, the
   ranks of the source stage's replica 0 rebuild each parameter's *full* tensor (its master
   value where there is one) in the unsharded model's layout — and every optimizer-state
   tensor of the parameter's shape (Adam's moments, a momentum buffer) the same way — by
   writing their shard at its place in a zero buffer and summing over their TP group
   (:func:`gather_full`; a replicated parameter, or a scalar state such as Adam's ``step``,
   is taken as it is). Its TP rank 0 sends a metadata object (names, full shapes, dtypes,
   plain-number state) and the tensors to **every** rank of the destination stage: each
   data-parallel replica gets a copy, and each TP rank cuts the rows or columns its own
   module holds (:func:`local_part`) — the split the stage's tensor-parallel handler made
   (column / fused-QKV / row linears, vocabulary-parallel embedding; anything else is
   replicated and copied whole).
4. **Continue.** The other handlers rebuild over the new parameters
   (``ctx.params_changed()``: gradient sync over the stage's own replicas, precision,
   recomputation), ``ctx.plan`` carries the new bounds, and the optimizer is rebuilt with the
   kept state and the received state (:func:`~hetplan.runtime.rebalance.carry_optimizer`;
   a sharded optimizer, whose flat layout changed with the stage's parameters, loads every
   parameter's whole master and state into its new chunks:
   :meth:`~hetplan.runtime.sharded_optimizer.ShardedOptimizer.load_full_state`), so
   training continues exactly as the unsplit model would.

Every collective runs on the runtime's groups (the stage's TP group, created with the
runtime's timeout) or the default group (the job's timeout), so a peer that dies during the
move fails the others instead of hanging them. Sending full tensors costs ``tp`` times the
bytes of sending shards to matching shards, and is what makes any pair of degrees work.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hetplan.errors import SpecError
from hetplan.ir.plan_sections import Stage
from hetplan.runtime.handlers.base import RuntimeContext
from hetplan.runtime.handlers.stages import StagesHandler
from hetplan.runtime.hetero_ranks import HeteroCoords, hetero_coords
from hetplan.runtime.megatron import FusedColumnParallelLinear, VocabParallelEmbedding
from hetplan.runtime.rebalance import carry_optimizer, plan_param_moves
from hetplan.runtime.sharded_optimizer import ShardedOptimizer
from hetplan.runtime.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from hetplan.runtime.tp_comm import all_reduce_sum

__all__ = ["ShardSpec", "gather_full", "local_part", "rebalance_hetero", "shard_spec"]

#: How one rank holds a parameter of a tensor-parallel module: ``(dim, full length, ranges)``
#: — the rows (``dim`` 0) or columns (``dim`` 1) ``[lo, hi)`` of the full tensor in the
#: module's ``[out, in]`` layout it keeps, in order; None: replicated (held whole).
ShardSpec = tuple[int, int, tuple[tuple[int, int], ...]] | None


def shard_spec(module: nn.Module, attr: str) -> ShardSpec:
    """Which part of the full parameter ``module.<attr>`` this rank holds (see
    :data:`ShardSpec`), for the modules the tensor-parallel handler builds."""
    if isinstance(module, FusedColumnParallelLinear):
        part = module.out_features // module.parts
        return (0, module.out_features, tuple((p * part + module.start, p * part + module.end)
                                              for p in range(module.parts)))
    if isinstance(module, ColumnParallelLinear):
        return 0, module.out_features, ((module.start, module.end),)
    if isinstance(module, RowParallelLinear):
        if attr == "bias":
            return None
        return 1, module.in_features, ((module.start, module.end),)
    if isinstance(module, VocabParallelEmbedding):
        return 0, module.num_embeddings, ((module.start, module.end),)
    return None


def _conv1d_weight(module: nn.Module, attr: str) -> bool:
    """A sharded HF ``Conv1D`` weight: ``[out, in]`` here, ``[in, out]`` in the model."""
    return attr == "weight" and bool(getattr(module, "conv1d", False))


def gather_full(local: torch.Tensor, spec: ShardSpec, group: Any, *,
                conv1d: bool = False) -> torch.Tensor:
    """The full tensor of a shard held as ``spec`` says, in the unsharded model's layout (a
    collective over the TP group ``group`` when sharded: every rank writes its part into a
    zero buffer and the buffers are summed, so uneven parts work on gloo)."""
    if spec is None:
        return local.detach().clone()
    dim, full_len, ranges = spec
    shape = list(local.shape)
    shape[dim] = full_len
    full = torch.zeros(shape, dtype=local.dtype, device=local.device)
    at = 0
    for lo, hi in ranges:
        full.narrow(dim, lo, hi - lo).copy_(local.detach().narrow(dim, at, hi - lo))
        at += hi - lo
    if group is not None:
        all_reduce_sum(full, group)
    return full.t() if conv1d else full


def local_part(full: torch.Tensor, spec: ShardSpec, *, conv1d: bool = False) -> torch.Tensor:
    """This rank's part of ``full`` (the unsharded model's layout) as ``spec`` says."""
    if spec is None:
        return full
    dim, _, ranges = spec
    src = full.t() if conv1d else full
    return torch.cat([src.narrow(dim, lo, hi - lo) for lo, hi in ranges], dim=dim)


def _holders(module: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Qualified parameter name -> (the module that holds it, attribute)."""
    out: dict[str, tuple[nn.Module, str]] = {}
    for mname, m in module.named_modules():
        for attr, p in m.named_parameters(recurse=False):
            if p is not None:
                out.setdefault(f"{mname}.{attr}" if mname else attr, (m, attr))
    return out


def _owned_names(params: Mapping[str, nn.Parameter], stages: Sequence[Stage],
                 layer_names: Sequence[str]) -> list[str]:
    """The parameters a layer of ``stages`` owns (those of no layer stay on every stage)."""
    from hetplan.runtime.pipeline import stage_owning

    return sorted(n for n in params if stage_owning(stages, layer_names, n) is not None)


def rebalance_hetero(ctx: RuntimeContext, bounds: Sequence[tuple[int, int]]) -> None:
    """Move this rank's heterogeneous pipeline to the stage assignment ``bounds`` (as many
    stages as the plan's; collective over the world; see the module docstring).

    Raises:
        SpecError: ``bounds`` has another stage count than the plan (re-packing), or a stage
            needs a parameter no stage holds.
    """
    plan, groups = ctx.plan, ctx.groups
    assert groups is not None and ctx.optimizer is not None and plan.hetero is not None
    if len(bounds) != len(plan.stages):
        raise SpecError(f"rebalancing: an event with {len(bounds)} stages on a pipeline of "
                        f"{len(plan.stages)} stages of per-stage degrees; re-packing is not "
                        "executed here: re-plan with rebalance.repack false")
    stages_h = ctx.handler(StagesHandler)
    names = [x.name for x in ctx.model_ir().layers]
    old_stages = sorted(plan.stages, key=lambda s: s.index)
    new_stages = [s.model_copy(update={"first_layer": a, "last_layer": b, "fwd_ms": 0.0,
                                       "bwd_ms": 0.0, "memory_bytes": None,
                                       "layer_names": tuple(names[a:b + 1])})
                  for s, (a, b) in zip(old_stages, bounds)]
    old_opt = ctx.optimizer
    whole = _whole_state(ctx, old_opt)  # collective over the stage's replicas under ZeRO
    sending, send_holders = dict(ctx.named_params), _holders(stages_h.stages[0].submod)
    stages_h.rebuild_hetero(ctx, new_stages)
    receiving, recv_holders = dict(ctx.named_params), _holders(stages_h.stages[0].submod)
    me = hetero_coords(plan, groups.rank)
    mine = (me.stage, _owned_names(sending, old_stages, names),
            _owned_names(receiving, new_stages, names))
    held: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(held, mine)
    speaker = {s.index: s.ranks[0] for s in old_stages}
    moves = plan_param_moves([held[speaker[s.index]][1] for s in old_stages],
                             [held[speaker[s.index]][2] for s in old_stages])
    received: dict[nn.Parameter, tuple[torch.Tensor | None, dict[str, Any]]] = {}
    for src, dst, moved in moves:
        to = hetero_coords(plan, speaker[dst])
        if me.stage == src and me.dp_rank == 0:
            _send(moved, sending, send_holders, whole, me, to, groups.tp_group)
        elif me.stage == dst:
            received.update(_recv(moved, receiving, recv_holders, speaker[src]))
    ctx.plan = plan.model_copy(update={"stages": tuple(new_stages)})
    ctx.params_changed()
    new_opt = ctx.make_optimizer([p for _, p in ctx.named_params])
    if isinstance(new_opt, ShardedOptimizer):  # a new flat layout: every value is loaded
        carry_optimizer(old_opt, new_opt, {})  # the hyper-parameters
        new_opt.load_full_state({**whole, **received})
        ctx.optimizer = new_opt
    else:
        ctx.optimizer = carry_optimizer(old_opt, new_opt,
                                        {p: state for p, (_, state) in received.items()})


def _whole_state(ctx: RuntimeContext, opt: torch.optim.Optimizer
                 ) -> Mapping[nn.Parameter, tuple[torch.Tensor | None, dict[str, Any]]]:
    """Per parameter of this rank: its master value (None: the parameter is its own) and
    its optimizer state, as whole tensors of the parameter's shape; under ZeRO-1/2 or 16-bit
    master weights (:class:`~hetplan.runtime.sharded_optimizer.ShardedOptimizer`) gathered
    from the replicas' chunks, a collective over the stage's data-parallel group."""
    if isinstance(opt, ShardedOptimizer):
        return opt.full_state()
    return {p: (None, dict(opt.state.get(p, {}))) for _, p in ctx.named_params}


def _send(moved: Sequence[str], params: Mapping[str, nn.Parameter],
          holders: Mapping[str, tuple[nn.Module, str]],
          whole: Mapping[nn.Parameter, tuple[torch.Tensor | None, dict[str, Any]]],
          me: HeteroCoords, to: HeteroCoords, tp_group: Any) -> None:
    """On replica 0 of the source stage: gather every moved parameter and its
    optimizer state to full tensors (collectives over this replica's TP group
    ``tp_group``), then TP rank 0 sends them to every rank of the destination stage (``to``:
    its coordinates)."""
    group = tp_group if me.tp > 1 else None
    meta: list[Any] = []
    tensors: list[torch.Tensor] = []
    for name in moved:
        p = params[name]
        module, attr = holders[name]
        spec = shard_spec(module, attr)
        conv1d = _conv1d_weight(module, attr)
        master, state = whole.get(p, (None, {}))
        value = master if master is not None else p  # the master is the full-precision value
        full = gather_full(value, spec, group, conv1d=conv1d)
        keys: list[Any] = []
        tensors.append(full)
        for key in sorted(state):
            v = state[key]
            if not torch.is_tensor(v):
                keys.append((key, None, v, False))
                continue
            sharded = tuple(v.shape) == tuple(p.shape) and spec is not None
            t = gather_full(v, spec if sharded else None, group, conv1d=conv1d and sharded)
            keys.append((key, tuple(t.shape), t.dtype, tuple(v.shape) == tuple(p.shape)))
            tensors.append(t)
        meta.append((name, tuple(full.shape), full.dtype, keys))
    if me.tp_rank != 0:
        return
    for dst in to.stage_ranks:
        dist.send_object_list([meta], dst=dst)  # small: names, shapes, dtypes, numbers
        for t in tensors:
            dist.send(t.contiguous(), dst=dst)


def _recv(moved: Sequence[str], params: Mapping[str, nn.Parameter],
          holders: Mapping[str, tuple[nn.Module, str]],
          src: int) -> dict[nn.Parameter, tuple[torch.Tensor, dict[str, Any]]]:
    """On every rank of the destination stage: receive what :func:`_send` sent from global
    rank ``src`` and copy this rank's part into its parameters; per parameter, that part in
    full precision (the master value) and its optimizer state."""
    box: list[Any] = [None]
    dist.recv_object_list(box, src=src)
    meta = box[0]
    if [m[0] for m in meta] != list(moved):
        raise SpecError(f"rebalancing: received parameters {[m[0] for m in meta]}, expected "
                        f"{list(moved)}; every stage must build the same layers")
    states: dict[nn.Parameter, tuple[torch.Tensor, dict[str, Any]]] = {}
    for name, shape, dtype, keys in meta:
        p = params[name]
        module, attr = holders[name]
        spec, conv1d = shard_spec(module, attr), _conv1d_weight(module, attr)
        full = torch.empty(shape, dtype=dtype, device=p.device)
        dist.recv(full, src=src)
        part = local_part(full, spec, conv1d=conv1d)
        if part.shape != p.shape:
            raise SpecError(f"rebalancing: {name}: this rank's part has shape "
                            f"{tuple(part.shape)}, its module holds {tuple(p.shape)}")
        with torch.no_grad():
            p.copy_(part)
        state: dict[str, Any] = {}
        for key, sshape, value, sharded in keys:
            if sshape is None:  # a plain number travelled in the metadata
                state[key] = value
                continue
            buf = torch.empty(sshape, dtype=value, device=p.device)
            dist.recv(buf, src=src)
            state[key] = (local_part(buf, spec, conv1d=conv1d) if sharded
                          else buf).clone()
        states[p] = (part.clone(), state)
    return states
