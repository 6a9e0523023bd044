"""Tensor parallelism with uneven per-rank shards (Megatron column/row pairs).

hetplan manages its own shards instead of using DTensor: DTensor only supports
``torch.chunk``-style unevenness and silently returns wrong data otherwise, and gloo's
``all_gather`` rejects uneven sizes. Every collective here is an ``all_reduce`` (of partial
products, of input gradients, or of zero-padded buffers when gathering a full tensor), so any
shard sizes work on every backend, including a rank holding zero features.

A Megatron pair is a *column* linear (output features split: each rank holds rows
``[start:end]`` of ``W`` and that slice of the bias; no communication in forward, the input
gradient is all-reduced in backward) followed by a *row* linear (input features split: the
input arrives as this rank's slice of the column layer's output; the partial products are
all-reduced in forward and the bias, replicated, is added once after the reduce). Between
them only element-wise operations may run (an activation, dropout, ``act(gate) * up``).

Scope of :func:`shard_model`: only *MLP-style* pairs are sharded here. A pair group is a row
linear ``R`` and every column linear ``C`` whose ``pair`` is ``R``; it is sharded when
``R.pair`` is one of those columns, all of them live in the same parent module, every
column's ``out_features`` equals ``R.in_features``, and the parent module is not an
attention module (it has none of the head-count attributes in :data:`HEAD_ATTRS`). Attention
(whole heads per rank, the fused QKV projection split per part, the module's head count
rewritten), the vocabulary-parallel embedding and LM head, and sequence parallelism are
:mod:`hetplan.runtime.megatron`'s; :func:`tp_pairs` reports the linears it leaves to others
as skipped, with the reason. A plan's listed linears must pass
:mod:`hetplan.ir.plan_tp_checks` (name, split, features, one size list per pair), which
``hetplan run`` checks before launch and :func:`tp_pairs` again. The parameter names of a
sharded linear do not change (``blocks.0.fc1.weight``); their shapes become the local
shard's. The collectives live in :mod:`hetplan.runtime.tp_comm`.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hetplan.algorithms.skewed_shards import even_shards
from hetplan.errors import PlanMismatchError, SpecError
from hetplan.ir.model import LayerIR, LinearInfo, megatron_pairs
from hetplan.ir.plan_sections import TensorParallel, TPGroup
from hetplan.ir.plan_tp_checks import TPModel, tp_group_problems
from hetplan.runtime.tp_comm import (
    copy_to_tp,
    gather_shards,
    reduce_from_tp,
    sp_column_input,
    sp_row_output,
)

__all__ = [
    "HEAD_ATTRS",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TPPair",
    "copy_to_tp",
    "gather_shards",
    "reduce_from_tp",
    "replace_module",
    "shard_model",
    "tp_pairs",
    "unsharded",
]

log = logging.getLogger(__name__)

#: Attributes that mark a module as multi-head attention (its pairs are not sharded).
HEAD_ATTRS = ("n_heads", "num_heads", "n_head", "num_attention_heads", "num_key_value_heads",
              "head_dim")


def _source_weight(linear: nn.Module) -> tuple[torch.Tensor, bool, bool]:
    """The weight of an ``nn.Linear`` or HF ``Conv1D`` in [out, in] layout, whether the
    module is a ``Conv1D``, and whether the weight requires grad."""
    weight = getattr(linear, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise TypeError(f"expected nn.Linear or Conv1D, got {type(linear).__name__}")
    if isinstance(linear, nn.Linear):
        return weight.detach(), False, weight.requires_grad
    if type(linear).__name__ == "Conv1D":
        return weight.detach().t(), True, weight.requires_grad  # Conv1D stores [in, out]
    raise TypeError(f"expected nn.Linear or Conv1D, got {type(linear).__name__}")


_P = TypeVar("_P", bound="_ParallelLinear")


def unsharded(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """This rank's whole tensor-parallel shard: ``t`` gathered over the data-parallel group
    when ZeRO-3 (FSDP2) shards it further (a DTensor: a collective over that group); zeros
    like ``like`` when ``t`` is None (a gradient not computed yet)."""
    t = torch.zeros_like(like) if t is None else t
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


class _ParallelLinear(nn.Module):
    """Shared state of the column and row linears; ``weight`` is [local_out, local_in]."""

    split_dim: int  # dimension of ``weight`` ([out, in]) that is split
    #: sequence parallelism (:mod:`hetplan.runtime.megatron`): ``""`` off; a column linear
    #: ``"gather"`` (all-gathers the sequence of its input) or ``"gathered"`` (its input was
    #: gathered by its attention module); a row linear ``"scatter"`` (reduce-scatters its
    #: output along the sequence instead of all-reducing it)
    sp_mode: str = ""

    def __init__(self, in_features: int, out_features: int, shard_sizes: Sequence[int],
                 rank: int, group: Any = None, *, bias: bool = True,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 conv1d: bool = False) -> None:
        super().__init__()
        sizes = [int(s) for s in shard_sizes]
        full = (out_features, in_features)[self.split_dim]
        if sum(sizes) != full or any(s < 0 for s in sizes):
            raise ValueError(f"shard_sizes {sizes} must be non-negative and sum to {full}")
        if not 0 <= rank < len(sizes):
            raise ValueError(f"rank {rank} outside a group of {len(sizes)}")
        self.in_features, self.out_features = in_features, out_features
        self.shard_sizes, self.tp_rank, self.tp_size = tuple(sizes), rank, len(sizes)
        self.group, self.conv1d = group, conv1d
        self.start = sum(sizes[:rank])
        self.end = self.start + sizes[rank]
        shape = [out_features, in_features]
        shape[self.split_dim] = sizes[rank]
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
        bias_len = sizes[rank] if self.split_dim == 0 else out_features
        self.bias: nn.Parameter | None
        if bias:
            self.bias = nn.Parameter(torch.empty(bias_len, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls: type[_P], linear: nn.Module,  # noqa: PYI019 - Self needs 3.11
                    shard_sizes: Sequence[int], rank: int, group: Any = None) -> _P:
        """Build this rank's shard by slicing a full ``nn.Linear`` or HF ``Conv1D``.

        Args:
            linear: the full module (left untouched).
            shard_sizes: share of every rank of the group along the split dimension.
            rank: this rank's index in the TP group.
            group: the TP process group (``None``: the default group).
        """
        w, conv1d, w_grad = _source_weight(linear)
        b = getattr(linear, "bias", None)
        b = b if isinstance(b, torch.Tensor) else None
        mod = cls(w.shape[1], w.shape[0], shard_sizes, rank, group, bias=b is not None,
                  dtype=w.dtype, device=w.device, conv1d=conv1d)
        size = mod.end - mod.start
        with torch.no_grad():
            mod.weight.copy_(w.narrow(mod.split_dim, mod.start, size))
            mod.weight.requires_grad_(w_grad)
            if b is not None and mod.bias is not None:
                mod.bias.copy_(b.detach().narrow(0, mod.start, size) if mod.split_dim == 0
                               else b.detach())
                mod.bias.requires_grad_(b.requires_grad)
        return mod

    def gather_weight(self, grad: bool = False, source_layout: bool = True) -> torch.Tensor:
        """The full weight (or its gradient) on every rank; a collective call.

        Args:
            grad: gather ``weight.grad`` instead of the weight (zeros if it is None).
            source_layout: return [in, out] when built from a ``Conv1D`` (else [out, in]).
        """
        local = unsharded(self.weight.grad if grad else self.weight, self.weight)
        full = gather_shards(local, self.shard_sizes, self.tp_rank, self.split_dim, self.group)
        return full.t() if (self.conv1d and source_layout) else full

    def gather_bias(self, grad: bool = False) -> torch.Tensor | None:
        """The full bias (or its gradient) on every rank, None without a bias; collective."""
        if self.bias is None:
            return None
        local = unsharded(self.bias.grad if grad else self.bias, self.bias)
        if self.split_dim == 1:
            return local.detach().clone()  # replicated
        return gather_shards(local, self.shard_sizes, self.tp_rank, 0, self.group)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"shard_sizes={list(self.shard_sizes)}, rank={self.tp_rank}, "
                f"bias={self.bias is not None}")


class ColumnParallelLinear(_ParallelLinear):
    """Output features split across the TP group; the output is this rank's slice.

    ``weight`` is rows ``[start:end]`` of the full [out, in] weight, ``bias`` the same slice.
    Forward needs no communication; backward all-reduces the input gradient (Megatron ``f``).
    """

    split_dim = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Maps ``x`` [..., in_features] to [..., shard_sizes[rank]]."""
        if self.sp_mode == "gather":
            x = sp_column_input(x, self.tp_rank, self.tp_size, self.group)
        elif self.tp_size > 1 and self.sp_mode != "gathered":
            x = copy_to_tp(x, self.group)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(_ParallelLinear):
    """Input features split across the TP group; the output is full and replicated.

    ``weight`` is columns ``[start:end]`` of the full [out, in] weight; the bias is whole.
    Forward all-reduces the partial products, then adds the bias once (Megatron ``g``).
    """

    split_dim = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Maps this rank's input slice [..., shard_sizes[rank]] to [..., out_features]."""
        y = F.linear(x, self.weight)
        if self.sp_mode == "scatter":
            y = sp_row_output(y, self.tp_rank, self.tp_size, self.group)
        elif self.tp_size > 1:
            y = reduce_from_tp(y, self.group)
        return y + self.bias if self.bias is not None else y


@dataclass(frozen=True)
class TPPair:
    """One shardable group: column linears feeding one row linear, with the shard sizes."""

    columns: tuple[str, ...]
    row: str
    shard_sizes: tuple[int, ...]


def _flat_linears(items: Iterable[LinearInfo | LayerIR]) -> list[LinearInfo]:
    out: list[LinearInfo] = []
    for it in items:
        out.extend(it.linears if isinstance(it, LayerIR) else (it,))
    return out


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _module(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def tp_pairs(model: nn.Module, linears: Iterable[LinearInfo | LayerIR], tp_size: int,
             tp_group: TPGroup | None = None, tp_rank: int | None = None, *,
             where: str = "tensor_parallel.groups[?]") -> tuple[list[TPPair], dict[str, str]]:
    """Decide which linears :func:`shard_model` splits, and how.

    Args:
        model: the full model (its modules are looked up by qualified name).
        linears: the IR's linears (or layers, whose ``linears`` are used).
        tp_size: ranks in the TP group.
        tp_group: the plan's group (its ``linears`` override the even split per linear).
        tp_rank: unused; kept for symmetry with :func:`shard_model`.
        where: the group's field path in the plan, for messages.

    Returns:
        The pair groups to shard, and ``{linear name: reason}`` for linears left replicated.

    Raises:
        PlanMismatchError: the group's linears break a rule of
            :mod:`hetplan.ir.plan_tp_checks` (``hetplan run`` checks them before launch; a
            plan run with ``--script`` or built by hand meets them here first), or its
            shard sizes do not fit ``tp_size`` ranks.
    """
    del tp_rank
    items = list(linears)
    flat = _flat_linears(items)
    if tp_group is not None:
        rules = TPModel.of(type(model).__name__, flat,
                           other_names=[x.name for x in items if isinstance(x, LayerIR)])
        if problems := tp_group_problems(tp_group, rules, where=where):
            raise PlanMismatchError("\n".join(problems))
    listed = {s.name: s for s in tp_group.linears} if tp_group is not None else {}
    candidates, skipped = megatron_pairs(flat)
    pairs: list[TPPair] = []
    for cols, row in candidates:
        names = [c.name for c in cols]
        why = ""
        if any(_module(model, n) is None for n in [*names, row.name]):
            why = "not every linear of the pair is in this model (another stage?)"
        parent = _module(model, _parent(row.name))
        if not why and parent is not None and any(hasattr(parent, a) for a in HEAD_ATTRS):
            why = "attention pair (split by heads by hetplan.runtime.megatron, or replicated)"
        if why:
            for n in [*names, row.name]:
                skipped.setdefault(n, why)
            continue
        # the rules above leave one size list per pair (or none: even shards)
        given = [tuple(listed[n].shard_sizes) for n in [*names, row.name] if n in listed]
        sizes = given[0] if given else even_shards(row.in_features, tp_size)
        if len(sizes) != tp_size or sum(sizes) != row.in_features:
            raise PlanMismatchError(f"TP plan shard sizes {list(sizes)} for {row.name!r} do not "
                                    f"fit {row.in_features} features on {tp_size} ranks")
        pairs.append(TPPair(tuple(names), row.name, tuple(sizes)))
    return pairs, skipped


def _find_group(tp: TensorParallel | None, group: Any, tp_rank: int, tp_size: int,
                stage: int | None) -> TPGroup | None:
    if tp is None or not tp.groups:
        return None
    me = dist.get_rank() if dist.is_initialized() else tp_rank
    found = [g for g in tp.groups if me in g.ranks
             and (stage is None or g.stage is None or g.stage == stage)]
    if not found:
        raise PlanMismatchError(f"rank {me} (stage {stage}) is in no TP group of the plan "
                                f"{[list(g.ranks) for g in tp.groups]}")
    g = found[0]
    if len(g.ranks) != tp_size or g.ranks[tp_rank] != me:
        raise PlanMismatchError(f"the plan's TP group {list(g.ranks)} does not match this "
                                f"process: tp_rank={tp_rank} of tp_size={tp_size}, rank {me}")
    if group is not None and dist.is_initialized():
        members = tuple(dist.get_process_group_ranks(group))
        if members != tuple(g.ranks):
            raise PlanMismatchError(f"the TP process group has ranks {list(members)}, the "
                                    f"plan's group {list(g.ranks)}")
    return g


def _computes_with(mod: nn.Module) -> bool:
    """Whether ``mod``'s forward uses its parameters as whole matrices (a linear, an HF
    ``Conv1D``, an embedding, a parallel linear): handed a shard, it would compute wrong."""
    return (isinstance(mod, nn.Linear | nn.Embedding | _ParallelLinear)
            or type(mod).__name__ == "Conv1D")


def _under(path: str, names: Collection[str]) -> bool:
    return any(path == n or path.startswith(f"{n}.") for n in names)


def replace_module(model: nn.Module, name: str, new: nn.Module, *,
                   params_of: nn.Module | None = None, pending: Collection[str] = ()) -> None:
    """Put ``new`` in place of module ``name`` of ``model``, and re-point the replaced
    module's aliases: every other module of ``model`` whose parameter attribute held one of
    the replaced module's parameters (HF ties BERT's ``cls.predictions.bias`` to its
    decoder's bias) now holds the parameter of the same name in ``params_of`` (default
    ``new``; a wrapper such as :class:`~hetplan.runtime.megatron.GatherLogits` names its
    shard's parameters ``head.*``). Left alone, such an alias would keep the full tensor
    that no longer trains, and a state dict (or any code reading it) would carry the stale
    value. A parameter ``params_of`` has no counterpart for keeps its aliases as they are.

    Only plain parameter attributes are re-pointed: a module whose forward uses the
    parameter as a whole matrix (``nn.Linear``, ``nn.Embedding``, HF ``Conv1D``: T5's
    ``encoder.embed_tokens`` shares ``shared``'s weight) would compute wrong on a shard, so
    it must be replaced too: the caller names it in ``pending`` (modules it replaces next,
    left alone here, in any order), else this raises. O(modules of ``model``).

    Raises:
        SpecError: a module outside ``pending`` computes with one of the replaced
            parameters (the alias and its holder are named); ``model`` is left unchanged.
    """
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, attr)
    now = dict((params_of or new).named_parameters())
    own = {id(p): n for n, p in old.named_parameters() if n in now and now[n] is not p}
    holders: list[tuple[nn.Module, str, nn.Parameter]] = []
    skip = {*pending, name}
    for path, mod in model.named_modules(remove_duplicate=False):
        for pname, p in mod.named_parameters(recurse=False):
            if id(p) not in own or _under(path, skip):
                continue
            if _computes_with(mod):
                alias = f"{path}.{pname}" if path else pname
                raise SpecError(
                    f"tensor parallelism: {alias!r} is {name}.{own[id(p)]}, which a "
                    f"{type(new).__name__} replaces with its local shard, but its holder "
                    f"{path!r} ({type(mod).__name__}) computes with the whole tensor: it "
                    "would run on the shard (such a tie is not split)")
            holders.append((mod, pname, now[own[id(p)]]))
    setattr(parent, attr, new)
    for mod, pname, shard in holders:
        setattr(mod, pname, shard)


def shard_model(model: nn.Module, ir_layers_linears: Iterable[LinearInfo | LayerIR],
                tp_section_or_none: TensorParallel | None, group: Any, tp_rank: int,
                tp_size: int, stage: int | None = None, *,
                split_elsewhere: Collection[str] = ()) -> nn.Module:
    """Replace, in place, every shardable Megatron pair by column/row parallel linears.

    Which pairs are shardable is decided by :func:`tp_pairs` (MLP-style pairs only; see the
    module docstring); the others stay replicated and are logged. Shard sizes come from the
    plan's TP group of this rank when it lists the linear, else an even split (the first
    ranks get the remainder), which is also what an empty ``linears`` list means.

    Args:
        model: the model whose names match the IR's (modified in place and returned).
        ir_layers_linears: the IR's linears, or its layers (their ``linears`` are used).
        tp_section_or_none: the plan's ``tensor_parallel`` section, or None (even shards).
        group: the TP process group (``None``: the default group).
        tp_rank: this rank's index in the TP group.
        tp_size: ranks in the TP group; 1 returns the model unchanged.
        stage: this rank's pipeline stage (selects the plan's TP group).
        split_elsewhere: linears the caller splits itself (attention split by heads,
            :mod:`hetplan.runtime.megatron`): left alone here without a warning.

    Raises:
        PlanMismatchError: the plan's TP group does not match this process, or its linears
            break a rule of :mod:`hetplan.ir.plan_tp_checks` (see :func:`tp_pairs`).
    """
    if tp_size <= 1:
        return model
    tp_group = _find_group(tp_section_or_none, group, tp_rank, tp_size, stage)
    where = (f"tensor_parallel.groups[{tp_section_or_none.groups.index(tp_group)}]"
             if tp_section_or_none is not None and tp_group is not None else "tensor_parallel")
    pairs, skipped = tp_pairs(model, ir_layers_linears, tp_size, tp_group, where=where)
    listed_skipped = sorted(n for n in skipped if n not in split_elsewhere
                            and tp_group is not None and n in {s.name for s in tp_group.linears})
    if listed_skipped:
        warnings.warn(f"TP plan lists {listed_skipped} but they stay replicated: "
                      f"{ {n: skipped[n] for n in listed_skipped} }", RuntimeWarning,
                      stacklevel=2)
    for name, why in sorted(skipped.items()):
        log.debug("tensor parallel: %s stays replicated (%s)", name, why)
    pending = {n for pair in pairs for n in (*pair.columns, pair.row)}  # ties among them
    for pair in pairs:
        for name in pair.columns:
            replace_module(model, name, ColumnParallelLinear.from_linear(
                model.get_submodule(name), pair.shard_sizes, tp_rank, group), pending=pending)
        replace_module(model, pair.row, RowParallelLinear.from_linear(
            model.get_submodule(pair.row), pair.shard_sizes, tp_rank, group), pending=pending)
    log.info("tensor parallel: %d pair(s) sharded over %d ranks, %d linear(s) replicated",
             len(pairs), tp_size, len(skipped))
    return model
