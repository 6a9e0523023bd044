"""The ``tensor_parallel`` rules that need the model itself: what each listed linear is.

A plan's TP group lists linears by module name, each with a ``split`` (``column``: output
features, ``row``: input features), the size of that dimension (``features``) and the
per-rank ``shard_sizes``. The plan file alone cannot tell whether these describe the model's
modules (the workload names layers, not linears), so :func:`tp_model_problems` checks them
against the model's linears (:class:`~hetplan.ir.model.LinearInfo`, from capture):

1. **name**: the linear is one of the model's (or a layer of it); the runtime looks shard
   sizes up by module name, so a misspelt entry would be ignored.
2. **split**: a linear that capture found in a column/row pair (``tp_role`` with a
   ``pair``) is split its own way: a pair's column linear by ``column``, its row linear by
   ``row``.
3. **features**: the module's size along the split dimension (``out_features`` for
   ``column``, ``in_features`` for ``row``); ``shard_sizes`` sum to ``features`` (the
   section's own check), so they then divide the real dimension.
4. **pair shard sizes**: the linears of one Megatron pair
   (:func:`~hetplan.ir.model.megatron_pairs`) listed in one group have equal
   ``shard_sizes``: the column linears' outputs are the row linear's inputs, split alike.
5. **whole heads**, for attention with a fused QKV projection only (GPT-2's ``c_attn``): its
   output projection (where the caller knows these modules: ``head_dims``) is split into
   multiples of its ``head_dim``. The ranks split such a module by heads and refuse a split
   inside one (it has one key/value head per query head, so a whole head is a whole
   key/value group). Attention with separate q/k/v projections (HF Llama, Mistral, OPT,
   BERT, ViT), grouped-query attention included, is not checked: where the sizes split a
   head, or a key/value group (with GQA a rank must keep whole groups, a key/value head and
   the query heads that use it: ``runtime.megatron.group_shards``), or leave a rank no head,
   the ranks run that module replicated on every TP rank, with a warning, and train
   correctly; this check refuses no plan the ranks run. Plans written before capture
   recorded head units (``LinearInfo.split_unit``; ``tp-resizing`` now skews attention in
   whole heads) may ask for such sizes, so refusing them here would refuse what they hold.

What the planner writes satisfies all five (``tp-resizing`` lists every linear of a Megatron
pair with the pair's one size list, ``features`` from the module). ``check_plan_matches``
runs them wherever the model is known (``hetplan run`` before launching any rank,
``hetplan validate --model``), and the runtime's
:func:`~hetplan.runtime.tensor_parallel.tp_pairs` runs :func:`tp_group_problems` again for
its own group as a last line. Rule 5 needs to know which attention modules are fused and
their head sizes; the IR records head units (``split_unit``) but not which projection is a
fused one, so ``hetplan run`` and ``hetplan validate --model`` read them off the module they
capture
(``runtime.megatron.refused_head_splits``: the fused-QKV modules' output projections); a plan
checked against a bare IR skips it, and the ranks' ``shard_attention`` refuses a fused
module's split inside a head.

Each problem is one line, ``tensor_parallel.groups[i].linears[j].<field>: ...``, with the
fix. Complexity: O(linears of the model + linears listed).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from hetplan.ir.model import LinearInfo, TPRole, megatron_pairs
from hetplan.ir.plan_sections import TensorParallel, TPGroup, TPLinearShard
from hetplan.ir.validation import did_you_mean

__all__ = ["TPModel", "tp_group_problems", "tp_model_problems"]

_RERUN = "or re-run `hetplan plan`"
#: at most this many lines (a plan with every linear wrong says so this many times)
_MAX_LINES = 8


@dataclass(frozen=True)
class TPModel:
    """The model's linears as the rules need them.

    Attributes:
        name: the model's name (for messages).
        linears: every linear, by qualified name.
        pair_of: for each linear of a Megatron pair, the index of its pair in ``pairs``.
        pairs: ``(columns, row)`` of every Megatron pair.
        other_names: names a plan may list that are no linear (layers: some are one).
        head_dims: the output projection of every attention module whose split inside a
            head the ranks refuse (fused QKV: rule 5), by qualified name, with its
            ``head_dim`` (empty: rule 5 is not checked). Separate q/k/v attention, GQA
            included, is left out: the ranks run it replicated where the sizes split a head
            or a key/value group.
    """

    name: str
    linears: dict[str, LinearInfo]
    pair_of: dict[str, int]
    pairs: tuple[tuple[tuple[str, ...], str], ...]
    other_names: frozenset[str] = frozenset()
    head_dims: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, name: str, linears: Iterable[LinearInfo],
           other_names: Iterable[str] = (), head_dims: Mapping[str, int] | None = None
           ) -> TPModel:
        """Build from the model's linears (all of them: pairs are found among them)."""
        infos = {lin.name: lin for lin in linears}
        pairs = tuple((tuple(c.name for c in cols), row.name)
                      for cols, row in megatron_pairs(infos.values())[0])
        pair_of = {n: k for k, (cols, row) in enumerate(pairs) for n in (*cols, row)}
        return cls(name, infos, pair_of, pairs, frozenset(other_names) - set(infos),
                   dict(head_dims or {}))


def tp_model_problems(tp: TensorParallel | None, model: TPModel) -> list[str]:
    """Every problem of ``tp``'s listed linears against ``model`` (the module docstring's
    rules), one line each, at most :data:`_MAX_LINES` and a count of the rest."""
    if tp is None:
        return []
    out: list[str] = []
    for i, g in enumerate(tp.groups):
        out += tp_group_problems(g, model, where=f"tensor_parallel.groups[{i}]")
    if len(out) > _MAX_LINES:
        out = [*out[:_MAX_LINES], f"tensor_parallel: ... and {len(out) - _MAX_LINES} more "
               "problem(s) of this kind"]
    return out


def tp_group_problems(group: TPGroup, model: TPModel, *, where: str) -> list[str]:
    """The problems of one TP group's listed linears; ``where`` names the group's field path
    (``tensor_parallel.groups[0]``)."""
    out: list[str] = []
    sound: list[int] = []  # entries with a known linear, split and features
    for j, shard in enumerate(group.linears):
        problem = _entry_problem(shard.name, shard.split, shard.features, model)
        if problem:
            out.append(f"{where}.linears[{j}].{problem}")
        else:
            sound.append(j)
    for j in sound:
        shard = group.linears[j]
        head_dim = model.head_dims.get(shard.name)
        if head_dim and any(size % head_dim for size in shard.shard_sizes):
            out.append(f"{where}.linears[{j}].shard_sizes: {list(shard.shard_sizes)} split "
                       f"a head: {shard.name!r} is the output projection of an attention "
                       f"module of model {model.name!r} with head_dim {head_dim}, and each "
                       "rank takes whole heads; give multiples of "
                       f"{head_dim} summing to {shard.features}, {_RERUN}")
    first_of_pair: dict[int, int] = {}
    for j in sound:
        name = group.linears[j].name
        if name not in model.pair_of:
            continue
        k = first_of_pair.setdefault(model.pair_of[name], j)
        if group.linears[k].shard_sizes != group.linears[j].shard_sizes:
            out.append(_pair_sizes_problem(group.linears, j, k, model, where))
    return out


def _entry_problem(name: str, split: str, features: int, model: TPModel) -> str:
    """``"<field>: ..."`` for the first of rules 1-3 an entry breaks, else ``""``."""
    lin = model.linears.get(name)
    if lin is None:
        if name in model.other_names:
            return ""
        near = did_you_mean(name, sorted(model.linears), n=2).removeprefix("; ")
        return (f"name: {name!r} is not a linear of model {model.name!r}"
                f"{f' ({near})' if near else ''}: the runtime finds shard sizes by module "
                f"name and would ignore this entry; name the module, {_RERUN}")
    if lin.tp_role is not TPRole.EITHER and lin.pair is not None and split != lin.tp_role.value:
        role = lin.tp_role.value
        divides = "output" if role == "column" else "input"
        return (f"split: {split!r}, but model {model.name!r} has {name!r} as the {role} linear "
                f"of its pair with {lin.pair!r} (its {divides} features are split); set split "
                f"to {role!r}, {_RERUN}")
    size = lin.out_features if split == "column" else lin.in_features
    if features != size:
        dim = "out_features" if split == "column" else "in_features"
        return (f"features: {features}, but {name!r} of model {model.name!r} has {dim} {size}, "
                f"the dimension a {split} split divides; set features to {size} and "
                f"shard_sizes to sum to it, {_RERUN}")
    return ""


def _pair_sizes_problem(linears: Sequence[TPLinearShard], j: int, k: int, model: TPModel,
                        where: str) -> str:
    mine, theirs = linears[j], linears[k]
    cols, row = model.pairs[model.pair_of[theirs.name]]
    role = "row" if theirs.name == row else "column"
    return (f"{where}.linears[{j}].shard_sizes: {list(mine.shard_sizes)}, but linears[{k}] "
            f"({theirs.name!r}, the {role} linear of the same Megatron pair {list(cols)} -> "
            f"{row!r}) has {list(theirs.shard_sizes)}: different shard sizes for one pair "
            "(the column linears' outputs are the row linear's inputs, split alike); give "
            f"every linear of the pair the same shard_sizes, {_RERUN}")
