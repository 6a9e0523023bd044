"""Espresso's decision tree of compression options (thesis §4.5, ``research/zen_espresso.md`` §D).

A *compression option* is one Start→End path of the tree: the ordered action tasks that
synchronize one gradient tensor. The tree has four dimensions — compress or not, GPU or CPU
for every (de)compression, the communication scheme (flat or hierarchical; divisible or
indivisible; the routine of each step, Table 4.2/4.3) and where (de)compression sits along the
path — and three pruning rules (valid connections, step-matched routines, paired routines).

Action tasks (Table 4.3): ``comp``/``decomp`` on ``gpu`` or ``cpu``; ``comm`` (allreduce),
``comm1`` (reduce_scatter | reduce), ``comm2`` (allgather | broadcast) for uncompressed
tensors; ``comm_comp`` (allgather), ``comm1_comp`` (alltoall | gather), ``comm2_comp``
(allgather | broadcast) for compressed ones. Levels: ``flat``, ``intra``, ``inter``.

Decisions (inferred; the thesis omits the valid connections, §H.1–§H.2; also in
``docs/decisions.md``):

- The valid connections are Fig. 4.8 as transcribed in §D.3. Every comp/decomp is a 2-way
  device choice; every divisible scheme picks its routine pair at its first step; the pair of
  the first intra-machine step also fixes the routine of the last intra-machine step.
- Pairs are scatter-type {reduce_scatter, alltoall} → allgather and root-type {reduce,
  gather} → broadcast; cross-type pairs are illegal.
- Hierarchical communication always starts with a divisible intra-machine step.

Under these rules the full tree has |C| = 4341 options (63 flat, 4278 hierarchical), 174 of
them GPU-only (9 without compression). :func:`all_options` enumerates them in a canonical
order; an option's index there is its ``option_id``. :func:`options` filters by constraints
(allowed devices, hierarchies, maximum compressions per tensor).

**Precision of the uncompressed steps** (an extension: the reference implementation's
"intra-node FP16" options, digest §E.8–§E.9). A path's uncompressed communication steps may
carry the gradients in ``fp32``, ``fp16`` or ``bf16``; compressed steps carry what the
compressor makes of the fp32 values either way. The precision is one choice per path, for all
its uncompressed steps (the plan's ``uncompressed_dtype``). The thesis' tree is the fp32
sub-tree; a path with at least one uncompressed step gets two more variants, so the extended
tree has 4341 + 2 x 2097 = **8535** options (:func:`extended_options`), 174 + 2 x 129 = 432 of
them GPU-only. Choosing the precision step by step instead would need a dtype per step in the
plan; it is not searched (``docs/decisions/espresso-mp.md``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

__all__ = [
    "Action",
    "Option",
    "TASKS",
    "all_options",
    "options",
    "option_id",
    "num_compressions",
    "is_compressed",
    "is_hierarchical",
    "devices_of",
    "offloaded",
    "PRECISIONS",
    "has_uncompressed_step",
    "extended_options",
]

Task = Literal["comp", "decomp", "comm", "comm1", "comm2", "comm_comp", "comm1_comp",
               "comm2_comp"]
Level = Literal["flat", "intra", "inter"]
#: Table 4.3: each action task and its search space (routines, or devices).
TASKS: dict[str, tuple[str, ...]] = {
    "comp": ("gpu", "cpu"),
    "decomp": ("gpu", "cpu"),
    "comm": ("allreduce",),
    "comm1": ("reduce_scatter", "reduce"),
    "comm2": ("allgather", "broadcast"),
    "comm_comp": ("allgather",),
    "comm1_comp": ("alltoall", "gather"),
    "comm2_comp": ("allgather", "broadcast"),
}
_DEVICES = ("gpu", "cpu")
#: Precisions of a path's uncompressed steps (fp32 first: the thesis' tree).
PRECISIONS = ("fp32", "fp16", "bf16")
#: Routine pairs of divisible schemes: (uncompressed step 1, compressed step 1, step 2).
_PAIRS = {"scatter": ("reduce_scatter", "alltoall", "allgather"),
          "root": ("reduce", "gather", "broadcast")}


@dataclass(frozen=True, slots=True)
class Action:
    """One action task of a path: a comm task with its ``routine``, or a (de)compression with
    its ``device``. ``level`` is the hierarchy level of the comm (for comp: of the next comm;
    for decomp: of the previous one)."""

    task: Task
    level: Level
    routine: str | None = None
    device: str | None = None

    @property
    def compressed_comm(self) -> bool:
        """Whether this is a communication of a compressed payload."""
        return self.task.endswith("_comp")

    def __str__(self) -> str:
        what = self.routine if self.routine is not None else self.device
        return f"{self.task}({what}@{self.level})"


Option = tuple[Action, ...]
_Paths = list[Option]


def _seq(*parts: _Paths) -> _Paths:
    """Every concatenation of one path from each part, in order."""
    out: _Paths = [()]
    for part in parts:
        out = [a + b for a in out for b in part]
    return out


def _one(task: Task, level: Level, routine: str) -> _Paths:
    return [(Action(task, level, routine=routine),)]


def _dev(task: Task, level: Level) -> _Paths:
    return [(Action(task, level, device=d),) for d in _DEVICES]


def _last_intra(pair: str) -> _Paths:
    """T1: the second intra step (or the second flat step), input uncompressed."""
    routine = _PAIRS[pair][2]
    return _seq(_one("comm2", "intra", routine)) + _seq(
        _dev("comp", "intra"), _one("comm2_comp", "intra", routine), _dev("decomp", "intra"))


def _last_intra_compressed(pair: str) -> _Paths:
    """T2: the second intra step, input compressed."""
    routine = _PAIRS[pair][2]
    return _seq(_one("comm2_comp", "intra", routine), _dev("decomp", "intra")) + _seq(
        _dev("decomp", "intra"), _last_intra(pair))


def _second_inter(pair: str, inter_pair: str) -> _Paths:
    """T5: the second inter step then the second intra step, input uncompressed."""
    routine = _PAIRS[inter_pair][2]
    return _seq(_one("comm2", "inter", routine), _last_intra(pair)) + _seq(
        _dev("comp", "inter"), _one("comm2_comp", "inter", routine),
        _last_intra_compressed(pair))


def _inter(pair: str) -> _Paths:
    """T3: the inter-machine phase then the second intra step, input uncompressed."""
    out = _seq(_one("comm", "inter", "allreduce"), _last_intra(pair))
    for q, (rs, _, _) in _PAIRS.items():
        out += _seq(_one("comm1", "inter", rs), _second_inter(pair, q))
    return out


def _inter_compressed(pair: str) -> _Paths:
    """T4: the inter-machine phase then the second intra step, input compressed."""
    out = _seq(_one("comm_comp", "inter", "allgather"), _last_intra_compressed(pair))
    for q, (_, a2a, ag) in _PAIRS.items():
        first = _one("comm1_comp", "inter", a2a)
        out += _seq(first, _one("comm2_comp", "inter", ag), _last_intra_compressed(pair))
        out += _seq(first, _dev("decomp", "inter"), _second_inter(pair, q))
    return out


def _flat() -> _Paths:
    out = _seq(_one("comm", "flat", "allreduce"))
    for p, (rs, _, _) in _PAIRS.items():
        out += _seq(_one("comm1", "flat", rs), _relevel(_last_intra(p), "flat"))
    out += _seq(_dev("comp", "flat"), _one("comm_comp", "flat", "allgather"),
                _dev("decomp", "flat"))
    for p, (_, a2a, _) in _PAIRS.items():
        out += _seq(_dev("comp", "flat"), _one("comm1_comp", "flat", a2a),
                    _relevel(_last_intra_compressed(p), "flat"))
    return out


def _relevel(paths: _Paths, level: Level) -> _Paths:
    return [tuple(Action(a.task, level, a.routine, a.device) for a in p) for p in paths]


def _hierarchical() -> _Paths:
    out: _Paths = []
    for p, (rs, a2a, _) in _PAIRS.items():
        step1 = _one("comm1", "intra", rs)
        out += _seq(step1, _inter(p))
        out += _seq(step1, _dev("comp", "inter"), _inter_compressed(p))
        step1c = _seq(_dev("comp", "intra"), _one("comm1_comp", "intra", a2a))
        out += _seq(step1c, _dev("decomp", "intra"), _inter(p))
        out += _seq(step1c, _dev("decomp", "intra"), _dev("comp", "inter"),
                    _inter_compressed(p))
        out += _seq(step1c, _inter_compressed(p))
    return out


@lru_cache(maxsize=1)
def all_options() -> tuple[Option, ...]:
    """Every option of the tree in canonical order (flat first); index = ``option_id``."""
    return tuple(_flat() + _hierarchical())


@lru_cache(maxsize=1)
def _ids() -> dict[Option, int]:
    return {o: i for i, o in enumerate(all_options())}


def option_id(option: Option) -> int:
    """The canonical index of ``option`` in :func:`all_options`.

    Raises:
        KeyError: ``option`` is not a path of the tree.
    """
    return _ids()[option]


def num_compressions(option: Option) -> int:
    """How many compression operations the path performs."""
    return sum(1 for a in option if a.task == "comp")


def is_compressed(option: Option) -> bool:
    """Whether the path compresses at all."""
    return any(a.task == "comp" for a in option)


def is_hierarchical(option: Option) -> bool:
    """Whether the path uses hierarchical (intra, inter) communication."""
    return option[0].level != "flat"


def devices_of(option: Option) -> frozenset[str]:
    """The devices the path's (de)compressions run on."""
    return frozenset(a.device for a in option if a.device is not None)


def offloaded(option: Option) -> Option:
    """The same path with every compression and decompression on the CPU (Algorithm 4.2)."""
    return tuple(Action(a.task, a.level, a.routine, "cpu") if a.device else a for a in option)


def options(
    *,
    devices: Iterable[str] = _DEVICES,
    hierarchies: Iterable[str] = ("flat", "hierarchical"),
    max_compressions: int = 4,
    compress: bool | None = None,
) -> tuple[Option, ...]:
    """The options that satisfy the constraints, in canonical order.

    Args:
        devices: devices (de)compression may use (``gpu``, ``cpu``).
        hierarchies: ``flat`` and/or ``hierarchical``.
        max_compressions: at most this many compressions per tensor (accuracy guard).
        compress: True: only compressing paths; False: only uncompressed ones; None: both.

    Raises:
        ValueError: an unknown device or hierarchy, or a negative ``max_compressions``.
    """
    devs = frozenset(devices)
    hiers = frozenset(hierarchies)
    if bad := sorted(devs - set(_DEVICES)):
        raise ValueError(f"unknown devices {bad}; use 'gpu' and/or 'cpu'")
    if bad := sorted(hiers - {"flat", "hierarchical"}):
        raise ValueError(f"unknown hierarchies {bad}; use 'flat' and/or 'hierarchical'")
    if max_compressions < 0:
        raise ValueError(f"max_compressions must be >= 0, got {max_compressions}")
    return _options(devs, hiers, max_compressions, compress)


@lru_cache(maxsize=256)
def _options(devs: frozenset[str], hiers: frozenset[str], max_compressions: int,
             compress: bool | None) -> tuple[Option, ...]:
    """:func:`options` after validation (cached: the pass asks for the same sets often)."""
    out = []
    for o in all_options():
        n = num_compressions(o)
        if n > max_compressions or (compress is not None and (n > 0) != compress):
            continue
        if not devices_of(o) <= devs:
            continue
        if ("hierarchical" if is_hierarchical(o) else "flat") not in hiers:
            continue
        out.append(o)
    return tuple(out)


def has_uncompressed_step(option: Option) -> bool:
    """Whether the path has an uncompressed communication step (so a precision to choose)."""
    return any(a.routine is not None and not a.compressed_comm for a in option)


def extended_options(precisions: Iterable[str] = PRECISIONS,
                     base: Iterable[Option] | None = None) -> tuple[tuple[int, str], ...]:
    """The extended tree: ``(option_id, precision)`` for every path of ``base`` (default: the
    whole tree) and every precision of its uncompressed steps (only ``fp32`` for a path without
    one), path by path in canonical order, precisions in :data:`PRECISIONS` order.

    Raises:
        ValueError: an unknown precision.
    """
    precs = [p for p in PRECISIONS if p in set(precisions)]
    if bad := sorted(set(precisions) - set(PRECISIONS)):
        raise ValueError(f"unknown precisions {bad}; use {', '.join(PRECISIONS)}")
    out: list[tuple[int, str]] = []
    for o in all_options() if base is None else base:
        oid = option_id(o)
        out += [(oid, p) for p in precs if p == "fp32" or has_uncompressed_step(o)]
    return tuple(out)
