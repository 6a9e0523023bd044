"""What a gradient-sync path computes, checked symbolically (no torch).

A plan strategy (:class:`~hetplan.ir.plan_sections.NoSync`, ``CastSync``, ``CompressedSync``)
syncs a bucket along a *path*: its ``steps`` (or a ``CompressedSync``'s ``actions``) with the
``comp`` / ``decomp`` actions :func:`path_of` derives. The section models check each step
alone (a routine that may carry the payload); this module checks the whole path: every rank
must end with the whole tensor holding the sum over all ranks, each rank's gradient counted
exactly once. ``[allreduce, allreduce]`` sums twice (gradients ``dp`` times too large: a
silently wrong model); ``[reduce]``, ``[reduce_scatter]`` or ``[broadcast]`` alone leave ranks
without the result, which the runtime used to find only after the ranks had started.

:func:`path_problems` runs the path the way :class:`hetplan.runtime.routines.PathRunner`
does (same routines, chunks, open step-1 stack, compressed segments and pieces), on ranks
whose values are *contribution vectors* (how many times each rank's gradient is in the
value) instead of numbers, on small groups: flat paths on 2 and 3 ranks, hierarchical ones on
2x3 and 3x2 ranks (nodes x ranks per node: each level once of 2 ranks and once of 3, so a
root-type chunking differs from a scatter-type one). A group of one rank is the identity in the
runtime, so a path right on these is right there too. It also refuses what the runtime would
refuse or run wrongly without noticing: a collective while the group's ranks hold different
parts of the tensor (a step 1 still open at that level), a compressed step without a
compressor, a comp of compressed pieces. Every message names the step (its index in
``steps``) and the fix.

:func:`path_of` and :func:`chunk_bounds` are the runtime's (it imports them from here).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:
    from hetplan.ir.plan_sections import CastSync, CompressedSync, NoSync

    Strategy = Union[NoSync, CastSync, CompressedSync]

__all__ = ["Step", "chunk_bounds", "path_of", "path_problems"]


@dataclass(frozen=True)
class Step:
    """One action of a path: ``kind`` comp / decomp / comm."""

    kind: str
    level: str = "flat"
    routine: str | None = None
    compressed: bool = False
    device: str | None = None


def path_of(strategy: Strategy) -> tuple[Step, ...]:
    """The actions of a plan strategy. ``CompressedSync.actions`` when given; otherwise its
    ``steps`` with a ``comp`` before every run of compressed steps and a ``decomp`` after it
    (levels as in the tree: a comp's is the next comm's, a decomp's the previous comm's)."""
    actions = getattr(strategy, "actions", ())
    if actions:
        return tuple(
            Step("comm", a.level, a.routine, a.task.endswith("_comp"))
            if a.routine is not None else Step(a.task, a.level, device=a.device)
            for a in actions
        )
    out: list[Step] = []
    comp_dev = getattr(strategy, "compress_device", "gpu")
    decomp_dev = getattr(strategy, "decompress_device", "gpu")
    prev = False
    for i, s in enumerate(strategy.steps):
        if s.compressed and not prev:
            out.append(Step("comp", s.level, device=comp_dev))
        if prev and not s.compressed:
            out.append(Step("decomp", strategy.steps[i - 1].level, device=decomp_dev))
        out.append(Step("comm", s.level, s.routine, s.compressed))
        prev = s.compressed
    if prev:
        out.append(Step("decomp", strategy.steps[-1].level, device=decomp_dev))
    return tuple(out)


def chunk_bounds(lo: int, hi: int, g: int, kind: str) -> list[tuple[int, int]]:
    """The ``g`` chunks of ``[lo, hi)``: even slices (``scatter``) or all-to-the-root (``root``)."""
    if kind == "root":
        return [(lo, hi)] + [(hi, hi)] * (g - 1)
    c = -(-(hi - lo) // g)
    return [(min(lo + i * c, hi), min(lo + (i + 1) * c, hi)) for i in range(g)]


def path_problems(strategy: Strategy) -> list[str]:
    """What is wrong with what ``strategy``'s path computes (empty: every rank ends with the
    whole tensor summed over all ranks, each rank's gradient once). One line each, without a
    field path (the caller adds its own); at most one, the first found."""
    has_compressor = getattr(strategy, "kind", "none") != "none"
    return list(_problems(path_of(strategy), has_compressor))


# -- the symbolic executor --------------------------------------------------------------------
#: Group shapes (nodes, ranks per node) a path is run on.
_SHAPES = {"flat": ((1, 2), (1, 3)), "hierarchical": ((2, 3), (3, 2))}
_STEP1 = {"reduce_scatter": "scatter", "reduce": "root", "alltoall": "scatter",
          "gather": "root"}
_COMPRESSED = ("allgather", "alltoall", "gather", "broadcast")
_UNCOMPRESSED = ("allreduce", "reduce_scatter", "allgather", "reduce", "broadcast")
_CLOSER = {"scatter": "allgather", "root": "broadcast"}
_OPENER = {"scatter": "reduce_scatter", "root": "reduce"}
_FIX = "use one allreduce, or reduce_scatter then allgather"
_HIER_FIX = ("sum once inside each node (intra) and once across nodes (inter), e.g. "
             "[intra reduce_scatter, inter allreduce, intra allgather]")

#: A contribution vector: how many times each rank's gradient is in a value, rank ``q``'s
#: count in bits ``[q * width, (q + 1) * width)`` of one int (so a sum of values is a ``+``);
#: ``width`` is 3 bits per step and 8 more, above any count a path can reach (each step at
#: most multiplies a count by the group size, at most 6 < 2**3).
Vec = int


class _Refused(Exception):
    """A path the runtime would refuse or run wrongly; the message says why and the fix."""


@dataclass
class _Seg:
    """A range of the tensor: dense values, or compressed pieces (each a list of values)."""

    lo: int
    hi: int
    dense: list[Vec] | None = None
    pieces: list[list[Vec]] = field(default_factory=list)


@dataclass
class _Rank:
    lo: int
    hi: int
    segs: list[_Seg]
    stack: list[tuple[str, str, int, int, int]] = field(default_factory=list)
    # open step 1s: level, kind, lo, hi, index of the step in ``steps``


@dataclass
class _Run:
    """One run of a path on ``nodes`` x ``per_node`` ranks (``n`` tensor elements)."""

    path: tuple[Step, ...]
    has_compressor: bool
    nodes: int
    per_node: int
    ranks: list[_Rank] = field(default_factory=list)
    reducers: dict[str, list[int]] = field(default_factory=dict)  # level -> step indices

    def __post_init__(self) -> None:
        size = self.nodes * self.per_node
        self.n = size
        self.width = 3 * len(self.path) + 8
        self.ones = sum(1 << (q * self.width) for q in range(size))
        for r in range(size):
            one = 1 << (r * self.width)
            self.ranks.append(_Rank(0, size, [_Seg(0, size, dense=[one] * size)]))

    def groups(self, level: str) -> list[list[int]]:
        """The groups of ``level``, each its ranks in group order (index 0: the root)."""
        p, n = self.per_node, self.nodes
        if level == "intra":
            return [[k * p + j for j in range(p)] for k in range(n)]
        if level == "inter":
            return [[k * p + j for k in range(n)] for j in range(p)]
        return [list(range(n * p))]

    def counts(self, v: Vec) -> list[int]:
        """The counts of contribution vector ``v``, rank by rank."""
        mask = (1 << self.width) - 1
        return [(v >> (q * self.width)) & mask for q in range(self.n)]

    def size(self, level: str) -> int:
        return len(self.groups(level)[0])

    # -- the whole path --
    def execute(self) -> None:
        comm = 0
        for i, s in enumerate(self.path):
            if s.kind == "comm":
                for g in self.groups(s.level):
                    self._comm(s, comm, [self.ranks[r] for r in g])
                comm += 1
                continue
            where = (f"the {s.kind} before step {comm}" if s.kind == "comp"
                     else f"the {s.kind} after step {comm - 1}")
            if not self.has_compressor:
                raise _Refused(f"{where}: compressed steps in a strategy of kind 'none' (no "
                               "compressor); make them uncompressed, or use kind 'cast' or "
                               "'compressed'")
            for st in self.ranks:
                if s.kind == "comp":
                    self._comp(st, self.path[i + 1:], where)
                else:
                    self._decomp(st, where)
        self._check_end()

    def _check_end(self) -> None:
        for st in self.ranks:
            if st.stack:
                level, kind, _, _, j = st.stack[0]
                opener = self._routine(j)
                leaves = ("each rank one shard of the sum" if kind == "scatter"
                          else "the sum on the group's first rank only")
                raise _Refused(
                    f"does not end with the whole aggregated tensor on every rank: the {opener} "
                    f"at step {j} ({level}) leaves {leaves}, and no {_CLOSER[kind]} at {level} "
                    f"closes it; add one after it ([{opener}, {_CLOSER[kind]}]), or {_FIX}")
            if any(seg.dense is None for seg in st.segs):
                raise _Refused("ends with compressed pieces: decompress (a decomp action) after "
                               "the last compressed step")
        bad = [(r, v) for r, st in enumerate(self.ranks) for seg in st.segs
               for v in seg.dense or () if v != self.ones]
        if not bad:
            return
        over = any(x > 1 for _, v in bad for x in self.counts(v))
        many = {lv: js for lv, js in self.reducers.items() if len(js) > 1}
        if over and many:
            level, js = sorted(many.items())[0]
            times = "twice" if len(js) == 2 else f"{len(js)} times"
            steps = ", ".join(map(str, js[:-1])) + f" and {js[-1]}"
            fix = _FIX if level == "flat" else _HIER_FIX
            raise _Refused(f"reduces the {level} level {times} (steps {steps}): each rank's "
                           f"gradient must be summed once (this sums the sum again, so "
                           f"gradients come out multiplied by the group size); {fix}")
        levels = ("flat",) if self.nodes == 1 else ("intra", "inter")
        if missing := [lv for lv in levels if not self.reducers.get(lv)]:
            who = {"flat": "ranks", "intra": "ranks of the same node",
                   "inter": "ranks on other nodes"}[missing[0]]
            raise _Refused(f"never reduces across the {missing[0]} level: the gradients of "
                           f"the {who} are missing from the result; "
                           f"{_FIX if missing[0] == 'flat' else _HIER_FIX}")
        r, v = bad[0]
        raise _Refused(f"does not compute the sum of every rank's gradient once: on "
                       f"{self.nodes * self.per_node} ranks, rank {r} ends with the gradients "
                       f"of ranks 0..{self.n - 1} counted {self.counts(v)} times; "
                       f"{_FIX if self.nodes == 1 else _HIER_FIX}")

    def _routine(self, j: int) -> str:
        return [s for s in self.path if s.kind == "comm"][j].routine or ""

    # -- comp / decomp --
    def _comp(self, st: _Rank, ahead: Sequence[Step], where: str) -> None:
        if st.hi == st.lo:
            st.segs = []
            return
        if len(st.segs) != 1 or st.segs[0].dense is None:
            raise _Refused(f"{where}: compresses compressed pieces; decompress them first "
                           "(a decomp is missing)")
        ranges = [(st.lo, st.hi)]
        for s in ahead:
            if s.kind == "decomp":
                break
            if s.kind == "comm" and s.routine in ("alltoall", "gather"):
                g = self.size(s.level)
                ranges = [c for a, b in ranges for c in chunk_bounds(a, b, g, _STEP1[s.routine])
                          if c[1] > c[0]]
        x = st.segs[0].dense
        st.segs = [_Seg(a, b, pieces=[x[a - st.lo: b - st.lo]]) for a, b in ranges]

    def _decomp(self, st: _Rank, where: str) -> None:
        if any(seg.dense is not None for seg in st.segs):
            raise _Refused(f"{where}: decompresses an uncompressed tensor (a comp is missing)")
        out = [0] * (st.hi - st.lo)
        covered = 0
        for seg in st.segs:
            for p in seg.pieces:
                for k, v in enumerate(p):
                    out[seg.lo - st.lo + k] += v
            covered += seg.hi - seg.lo
        if covered != st.hi - st.lo:
            raise _Refused(f"{where}: the compressed pieces do not cover the rank's range")
        st.segs = [_Seg(st.lo, st.hi, dense=out)] if st.hi > st.lo else []

    # -- collectives --
    def _comm(self, s: Step, j: int, members: list[_Rank]) -> None:
        r = s.routine or ""
        name = f"step {j} ({s.level} {'compressed ' if s.compressed else ''}{r})"
        allowed = _COMPRESSED if s.compressed else _UNCOMPRESSED
        if r not in allowed:
            raise _Refused(f"{name}: routine {r!r} cannot carry "
                           f"{'compressed' if s.compressed else 'uncompressed'} tensors; use "
                           f"one of {sorted(allowed)}")
        tops = {m.stack[-1] if m.stack and m.stack[-1][0] == s.level else None
                for m in members}
        top = next(iter(tops)) if len(tops) == 1 else None
        if r in ("allgather", "broadcast"):
            want = "scatter" if r == "allgather" else "root"
            if top is not None and top[1] == want:
                return self._close(s, name, members)
            if not (s.compressed and r == "allgather"):
                self._unpaired(s, name, want, top, members[0].stack)
        self._same_range(s, name, members)
        self._same_range(s, name, members)
        if s.compressed:
            if any(seg.dense is not None for m in members for seg in m.segs):
                raise _Refused(f"{name}: a compressed {r} of an uncompressed tensor (a comp is "
                               "missing)")
        else:
            for m in members:
                if m.hi > m.lo and (len(m.segs) != 1 or m.segs[0].dense is None):
                    raise _Refused(f"{name}: needs an uncompressed tensor, but the path has "
                                   "compressed pieces here (a decomp is missing)")
        self.reducers.setdefault(s.level, [])
        if not self.reducers[s.level] or self.reducers[s.level][-1] != j:
            self.reducers[s.level].append(j)
        lo, hi = members[0].lo, members[0].hi
        if r == "allreduce" or r == "allgather":  # allgather: compressed, indivisible
            if hi > lo:
                if s.compressed:
                    segs = _merge([m.segs for m in members])
                    for m in members:
                        m.segs = [_Seg(x.lo, x.hi, pieces=list(x.pieces)) for x in segs]
                else:
                    total = [sum(vs) for vs in zip(*(m.segs[0].dense or () for m in members))]
                    for m in members:
                        m.segs = [_Seg(lo, hi, dense=list(total))]
            return
        kind = _STEP1[r]
        chunks = chunk_bounds(lo, hi, len(members), kind)
        if s.compressed and hi > lo:
            out: list[list[list[_Seg]]] = []
            for m in members:
                parts: list[list[_Seg]] = [[] for _ in chunks]
                for seg in m.segs:
                    i = next((i for i, (ca, cb) in enumerate(chunks)
                              if ca <= seg.lo and seg.hi <= cb and cb > ca), None)
                    if i is None:
                        raise _Refused(f"{name}: a compressed piece straddles two of its "
                                       "chunks; decompress before it, or compress right "
                                       "before it")
                    parts[i].append(seg)
                out.append(parts)
            got = [_merge([o[i] for o in out]) for i in range(len(members))]
        elif hi > lo:
            total = [sum(vs) for vs in zip(*(m.segs[0].dense or () for m in members))]
            got = [[_Seg(a, b, dense=total[a - lo: b - lo])] if b > a else []
                   for a, b in chunks]
        else:
            got = [[] for _ in chunks]
        for i, m in enumerate(members):
            m.stack.append((s.level, kind, lo, hi, j))
            m.lo, m.hi = chunks[i]
            m.segs = got[i] if chunks[i][1] > chunks[i][0] else []

    def _unpaired(self, s: Step, name: str, want: str,
                  top: tuple[str, str, int, int, int] | None,
                  stack: list[tuple[str, str, int, int, int]]) -> None:
        """Refuse a step 2 (``want``: the kind of step 1 it closes) with no such step open
        at its level on top of ``stack``."""
        r = s.routine or ""
        what = (_OPENER[want] if not s.compressed else
                "compressed step 1 (" + ("alltoall" if want == "scatter" else "gather") + ")")
        head = (f"{name}: a{' compressed' if s.compressed else 'n uncompressed'} {r} must "
                f"close a {what} at the same level")
        if top is not None:
            opener = self._routine(top[4])
            raise _Refused(f"{head}, but the step 1 open at {s.level} is the {opener} at step "
                           f"{top[4]}, which {_an(_CLOSER[top[1]])} closes; use [{opener}, "
                           f"{_CLOSER[top[1]]}] or [{_OPENER[want]}, {r}]")
        below = next((e for e in reversed(stack) if e[0] == s.level), None)
        if below is not None and stack:
            last = stack[-1]
            raise _Refused(f"{head}; the {self._routine(below[4])} at step {below[4]} is open "
                           f"at {s.level}, but the {self._routine(last[4])} at step {last[4]} "
                           f"({last[0]}), opened after it, is not closed yet: close it first "
                           f"with {_an(_CLOSER[last[1]])} at {last[0]} (steps 2 close their "
                           "steps 1 in reverse order)")
        raise _Refused(f"{head}, and none is open: {_an(r)} only spreads what such a step "
                       f"reduced; use [{_OPENER[want]}, {r}] or one allreduce")

    def _close(self, s: Step, name: str, members: list[_Rank]) -> None:
        """Step 2 (allgather / broadcast) of the step 1 open at the top of the stack."""
        _, kind, lo, hi, _ = members[0].stack[-1]
        chunks = chunk_bounds(lo, hi, len(members), kind)
        for i, m in enumerate(members):
            if (m.lo, m.hi) != chunks[i]:
                raise _Refused(f"{name}: its ranks do not hold the chunks the open step 1 "
                               "left them")
            if not s.compressed and m.hi > m.lo and (len(m.segs) != 1
                                                     or m.segs[0].dense is None):
                raise _Refused(f"{name}: needs an uncompressed tensor, but the path has "
                               "compressed pieces here (a decomp is missing)")
            if s.compressed and any(seg.dense is not None for seg in m.segs):
                raise _Refused(f"{name}: a compressed {s.routine} of an uncompressed tensor "
                               "(a comp is missing)")
        if s.routine == "broadcast":
            root = members[0].segs
            segs = [_Seg(x.lo, x.hi, list(x.dense) if x.dense is not None else None,
                         list(x.pieces)) for x in root]
        elif s.compressed:
            segs = _merge([m.segs for m in members])
        else:
            vals = [v for m in members for seg in m.segs for v in seg.dense or ()]
            segs = [_Seg(lo, hi, dense=vals)] if hi > lo else []
        for m in members:
            m.stack.pop()
            m.lo, m.hi = lo, hi
            m.segs = [_Seg(x.lo, x.hi, list(x.dense) if x.dense is not None else None,
                           list(x.pieces)) for x in segs]

    def _same_range(self, s: Step, name: str, members: list[_Rank]) -> None:
        """A collective over a range needs every member to hold the same range."""
        if len({(m.lo, m.hi) for m in members}) == 1:
            return
        open_ = next((e for m in members for e in reversed(m.stack) if e[0] == s.level), None)
        why = ""
        if open_ is not None:
            why = (f" (the {self._routine(open_[4])} at step {open_[4]} is still open; close "
                   f"it first with {_an(_CLOSER[open_[1]])} at {s.level})")
        raise _Refused(f"{name}: runs while the ranks of its {s.level} group hold different "
                       f"parts of the tensor{why}, so it would combine unrelated values or "
                       "hang")


def _an(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _merge(groups: list[list[_Seg]]) -> list[_Seg]:
    """Union of segment lists: equal ranges concatenate their pieces; sorted by range."""
    by: dict[tuple[int, int], _Seg] = {}
    for segs in groups:
        for s in segs:
            by.setdefault((s.lo, s.hi), _Seg(s.lo, s.hi)).pieces.extend(s.pieces)
    return [by[k] for k in sorted(by)]


@lru_cache(maxsize=8192)
def _problems(path: tuple[Step, ...], has_compressor: bool) -> tuple[str, ...]:
    """:func:`path_problems` of a path (cached: plans share paths, the runtime asks per bucket)."""
    levels = {s.level for s in path if s.kind == "comm"}
    shapes = _SHAPES["flat" if levels <= {"flat"} else "hierarchical"]
    if "flat" in levels and len(levels) > 1:
        return (f"mixes 'flat' steps with {sorted(levels - {'flat'})} ones; a path is flat "
                "or hierarchical (intra and inter)",)
    for nodes, per_node in shapes:
        try:
            _Run(path, has_compressor, nodes, per_node).execute()
        except _Refused as exc:
            return (str(exc),)
    return ()
