"""Communication routines of Espresso's Table 4.2, flat and hierarchical, and the path executor.

A synchronization *path* (a plan strategy: :class:`~hetplan.ir.plan_sections.NoSync`,
:class:`~hetplan.ir.plan_sections.CastSync` or
:class:`~hetplan.ir.plan_sections.CompressedSync`) is a list of actions — ``comp`` /
``decomp`` on a device (a ``CastSync``'s compressed steps carry its fp16/bf16 cast, its
uncompressed ones run in that dtype), and collectives at a level (``flat``: the whole data-parallel group;
``intra``: the ranks of this node; ``inter``: the ranks with this rank's position on the other
nodes). :meth:`PathRunner.run` executes one on a flat fp32 buffer and returns the **sum** over the
data-parallel group (the caller divides by the group size).

Routines (``g`` ranks in the level's group; chunk ``i`` of a range is its ``i``-th slice of
``ceil(len / g)`` elements, the last ones shorter or empty):

=====================  ===============================================================
uncompressed
``allreduce``          sum of the range on every rank
``reduce_scatter``     rank ``i`` keeps the sum of chunk ``i`` (step 1, scatter type)
``reduce``             the group's first rank keeps the sum of the whole range, the others
                       nothing (step 1, root type)
``allgather``          step 2 of reduce_scatter: every rank gets every chunk
``broadcast``          step 2 of reduce: every rank gets the root's range
compressed
``allgather``          indivisible (no step 1 open at that level): every rank gets every
                       rank's pieces of the same range; or step 2: every rank's chunks
``alltoall``           step 1: piece ``i`` (compressed per chunk) goes to rank ``i``
``gather``             step 1: every piece goes to the first rank
``broadcast``          step 2 of gather
=====================  ===============================================================

Compressed state is a list of *segments* — a range of the buffer and the payloads whose
decompressed sum it is. ``comp`` compresses each chunk that a later step 1 will send apart
separately (looking ahead to the next ``decomp``, so nested intra/inter shuffles of compressed
pieces work); ``decomp`` decompresses every piece and sums (the thesis' "decompress and
aggregate"); a ``comp`` after a ``decomp`` re-compresses the aggregated shard with its own
error-feedback site. Randomized compressors are seeded from (iteration, site, offset) and not
from the rank, so ranks that hold the same aggregated shard compress it identically (replicas
never diverge) and random-k draws the same positions on every rank. A collective whose range is
empty on every member (e.g. the inter step of the non-root ranks after an intra ``reduce``) is
skipped.

A path that does not compute the sum (``[allreduce, allreduce]``, ``[reduce]`` alone ...) is
refused before its first collective, with :func:`hetplan.ir.sync_paths.path_problems`'
message: the check plan validation runs (so a plan file never gets here with one; a strategy
built by hand might). :func:`path_of`, :class:`Step` and :func:`chunk_bounds` live there too.

Precision: an uncompressed step of a 16-bit path (``CastSync``, or ``CompressedSync`` with a
16-bit ``uncompressed_dtype``) sends 16-bit values. A stretch of uncompressed steps is cast
to 16 bits once, before its first collective (on the gradient's device), stays 16-bit
between its collectives, and is cast back once: before the next compression (compressors
compute in fp32) or at the end of the path. This is what the cost model prices
(:func:`hetplan.cost_models.evaluate._action_ops`: one cast per direction per stretch); the
values are those of a cast around every collective, since fp16 -> fp32 -> fp16 is exact.
:attr:`PathRunner.casts` counts the casts done.

Gloo (decision in ``docs/decisions.md``): its ``all_gather`` rejects uneven sizes, so dense
chunks are padded to ``ceil(len / g)`` and compressed byte buffers to the largest one (sizes are
exchanged first; a compressed all-gather, once its step has a slot, sends the size in a header
of one padded call instead: :func:`_allgather_slotted`); ``reduce_scatter`` uses ``reduce_scatter_single`` (``reduce_scatter_tensor``
in older torch) and falls back to
``all_to_all_single`` plus a local sum where the backend lacks it; variable-size alltoall uses
``all_to_all_single`` with split sizes. Collectives run synchronously on the calling thread;
the gradient path runs them on its worker thread in the plan's bucket order. With
``HETPLAN_EMULATE_BW`` set, the ``flat`` and ``inter`` ones also hold an emulated slow link
(:mod:`hetplan.runtime.link_emulation`; benchmarks and tests).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hetplan.errors import SpecError
from hetplan.ir.plan_sections import CastSync, CompressedSync, NoSync
from hetplan.ir.sync_paths import Step, chunk_bounds, path_of, path_problems
from hetplan.runtime.compressors import Compressor, ErrorFeedback, Payload, make_compressor
from hetplan.runtime.link_emulation import EmulatedLink, occupy, throttled

__all__ = ["Level", "PathRunner", "Step", "SyncLevels", "chunk_bounds", "path_of"]

_WIRE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8,
           torch.int8, torch.float64]
_RS_NATIVE: dict[str, bool] = {}


@dataclass(frozen=True)
class Level:
    """One level's process group: ``ranks`` (global, in group order), this rank's ``index``.

    ``group`` is None for a group of one rank (every routine is then the identity).
    """

    group: Any
    ranks: tuple[int, ...]
    index: int

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def root(self) -> int:
        return self.ranks[0]

    @classmethod
    def of(cls, group: Any, ranks: Sequence[int], rank: int) -> Level:
        """The level of ``group`` (members ``ranks``) as seen by global ``rank``."""
        return cls(group if len(ranks) > 1 else None, tuple(ranks), list(ranks).index(rank))


@dataclass(frozen=True)
class SyncLevels:
    """The groups a path may use: ``flat`` always; ``intra``/``inter`` when the data-parallel
    group spans several nodes with the same number of its ranks on each (else None)."""

    flat: Level
    intra: Level | None = None
    inter: Level | None = None

    def get(self, level: str) -> Level:
        lv = getattr(self, level)
        if lv is None:
            raise SpecError(
                f"a hierarchical path needs the {level!r} groups, but this data-parallel group "
                "has no node structure (the plan's layout.ranks give no nodes, or nodes hold "
                "different numbers of its ranks); compile the plan for a cluster with equal "
                "nodes or use flat strategies"
            )
        return lv


# -- dense collectives -----------------------------------------------------------------------
def _reduce_scatter(x: torch.Tensor, lv: Level) -> torch.Tensor:
    g = lv.size
    c = -(-x.numel() // g)
    padded = torch.nn.functional.pad(x, (0, g * c - x.numel()))
    out = torch.empty(c, dtype=x.dtype, device=x.device)
    backend = str(dist.get_backend(lv.group))
    if _RS_NATIVE.get(backend, True):
        try:
            native = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            native(out, padded, group=lv.group)
            _RS_NATIVE[backend] = True
            return out
        except (RuntimeError, NotImplementedError, AttributeError):
            _RS_NATIVE[backend] = False  # local refusal: no rank has communicated yet
    recv = torch.empty_like(padded)
    dist.all_to_all_single(recv, padded, group=lv.group)
    return recv.view(g, c).sum(0)


def _allgather(chunk: torch.Tensor, lv: Level, c: int) -> torch.Tensor:
    padded = torch.nn.functional.pad(chunk, (0, c - chunk.numel()))
    parts = [torch.empty_like(padded) for _ in range(lv.size)]
    dist.all_gather(parts, padded, group=lv.group)
    return torch.cat(parts)


# -- variable-size byte collectives ----------------------------------------------------------
def _sizes(n: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([n], dtype=torch.int64, device=device)


def _allgather_bytes(buf: torch.Tensor, lv: Level,
                     link: EmulatedLink | None = None) -> list[torch.Tensor]:
    sizes = [torch.empty(1, dtype=torch.int64, device=buf.device) for _ in range(lv.size)]
    dist.all_gather(sizes, _sizes(buf.numel(), buf.device), group=lv.group)
    n = [int(s) for s in sizes]
    padded = torch.nn.functional.pad(buf, (0, max(n) - buf.numel()))
    parts = [torch.empty_like(padded) for _ in range(lv.size)]
    with occupy(link, "allgather", max(n) * lv.size, lv.size):
        dist.all_gather(parts, padded, group=lv.group)
    return [p[:k] for p, k in zip(parts, n)]


def _allgather_slotted(buf: torch.Tensor, lv: Level, link: EmulatedLink | None,
                       slots: dict[Any, int], key: Any) -> list[torch.Tensor]:
    """:func:`_allgather_bytes` in one call once the sizes are known: a compressed
    all-gather at the same path step (``key``) moves a payload of about the same size every
    iteration, so each rank sends its byte count in an 8-byte header and its payload padded
    to the step's *slot* (the largest payload seen there, the same on every rank), one
    ``all_gather``. The first call of a step (no slot yet) exchanges the sizes first, as
    :func:`_allgather_bytes` does, and sets the slot; a payload larger than the slot (every
    rank reads the same headers) is gathered again at the largest size and widens the slot.
    The result is :func:`_allgather_bytes`'s. On 4 gloo processes sharing 2 cores each call
    is a hand-over of several milliseconds (``docs/decisions/cpu-fidelity.md`` section 12),
    so the steady state saves one per step and iteration."""
    cap = slots.get(key)
    if cap is None:
        got = _allgather_bytes(buf, lv, link)
        slots[key] = max(g.numel() for g in got)
        return got
    n = buf.numel()
    head = _sizes(n, buf.device).view(torch.uint8)
    body = torch.nn.functional.pad(buf[:cap], (0, cap - min(n, cap)))
    send = torch.cat([head, body])
    parts = [torch.empty_like(send) for _ in range(lv.size)]
    with occupy(link, "allgather", send.numel() * lv.size, lv.size):
        dist.all_gather(parts, send, group=lv.group)
    sizes = [int(p[:8].clone().view(torch.int64)) for p in parts]
    if max(sizes) <= cap:
        return [p[8: 8 + k] for p, k in zip(parts, sizes)]
    slots[key] = max(sizes)  # outgrown on some rank: the payloads at their largest size
    padded = torch.nn.functional.pad(buf, (0, max(sizes) - n))
    full = [torch.empty_like(padded) for _ in range(lv.size)]
    with occupy(link, "allgather", max(sizes) * lv.size, lv.size):
        dist.all_gather(full, padded, group=lv.group)
    return [p[:k] for p, k in zip(full, sizes)]


def _alltoall_bytes(bufs: list[torch.Tensor], lv: Level,
                    link: EmulatedLink | None = None) -> list[torch.Tensor]:
    dev = bufs[0].device
    send_n = torch.tensor([b.numel() for b in bufs], dtype=torch.int64, device=dev)
    recv_n = torch.empty_like(send_n)
    dist.all_to_all_single(recv_n, send_n, group=lv.group)
    rn = [int(v) for v in recv_n]
    out = torch.empty(sum(rn), dtype=torch.uint8, device=dev)
    with occupy(link, "alltoall", sum(b.numel() for b in bufs), lv.size):
        dist.all_to_all_single(out, torch.cat(bufs), rn, [b.numel() for b in bufs],
                               group=lv.group)
    return list(out.split(rn))


def _gather_bytes(buf: torch.Tensor, lv: Level,
                  link: EmulatedLink | None = None) -> list[torch.Tensor]:
    """Every member's buffer at the root (others get an empty list); via padded gather."""
    sizes = [torch.empty(1, dtype=torch.int64, device=buf.device) for _ in range(lv.size)]
    dist.all_gather(sizes, _sizes(buf.numel(), buf.device), group=lv.group)
    n = [int(s) for s in sizes]
    padded = torch.nn.functional.pad(buf, (0, max(n) - buf.numel()))
    is_root = lv.index == 0
    parts = [torch.empty_like(padded) for _ in range(lv.size)] if is_root else None
    with occupy(link, "gather", max(n) * lv.size, lv.size):
        dist.gather(padded, parts, dst=lv.root, group=lv.group)
    return [p[:k] for p, k in zip(parts, n)] if parts is not None else []


def _broadcast_bytes(buf: torch.Tensor, lv: Level,
                     link: EmulatedLink | None = None) -> torch.Tensor:
    n = _sizes(buf.numel(), buf.device)
    dist.broadcast(n, src=lv.root, group=lv.group)
    out = buf if lv.index == 0 else torch.empty(int(n), dtype=torch.uint8, device=buf.device)
    with occupy(link, "broadcast", int(n), lv.size):
        dist.broadcast(out, src=lv.root, group=lv.group)
    return out


# -- segments and their wire format ----------------------------------------------------------
@dataclass
class _Seg:
    lo: int
    hi: int
    dense: torch.Tensor | None = None
    pieces: list[Payload] = field(default_factory=list)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def _serialize(segs: list[_Seg], device: torch.device) -> torch.Tensor:
    head: list[int] = [len(segs)]
    data: list[torch.Tensor] = []
    for s in segs:
        head += [s.lo, s.hi, len(s.pieces)]
        for p in s.pieces:
            head.append(len(p))
            for t in p:
                head += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
                data.append(_as_bytes(t).to(device))
    h = torch.tensor([len(head), *head], dtype=torch.int64).view(torch.uint8).to(device)
    return torch.cat([h, *data]) if data else h


def _deserialize(buf: torch.Tensor, device: torch.device) -> list[_Seg]:
    n = int(buf[:8].cpu().clone().view(torch.int64))
    head = buf[8: 8 * (n + 1)].cpu().clone().view(torch.int64).tolist()
    pos, off = 0, 8 * (n + 1)

    def take() -> int:
        nonlocal pos
        pos += 1
        return int(head[pos - 1])

    segs = []
    for _ in range(take()):
        s = _Seg(take(), take())
        for _ in range(take()):
            tensors = []
            for _ in range(take()):
                dtype = _DTYPES[take()]
                shape = [take() for _ in range(take())]
                nbytes = dtype.itemsize * int(torch.Size(shape).numel())
                raw = buf[off: off + nbytes]
                off += nbytes
                tensors.append(raw.clone().view(dtype).reshape(shape).to(device))
            s.pieces.append(tuple(tensors))
        segs.append(s)
    return segs


def _merge_pieces(groups: list[list[_Seg]]) -> list[_Seg]:
    """Union of segment lists: equal ranges concatenate their pieces; sorted by range."""
    by: dict[tuple[int, int], _Seg] = {}
    for segs in groups:
        for s in segs:
            by.setdefault((s.lo, s.hi), _Seg(s.lo, s.hi)).pieces.extend(s.pieces)
    return [by[k] for k in sorted(by)]


# -- the path executor -----------------------------------------------------------------------
@dataclass
class _State:
    lo: int
    hi: int
    segs: list[_Seg]
    stack: list[tuple[str, str, int, int]] = field(default_factory=list)  # level, kind, lo, hi
    dtype: torch.dtype = torch.float32  # of the gradients (a 16-bit stretch casts back to it)

    def dense(self, what: str) -> torch.Tensor | None:
        """The one dense tensor of the range (None when the range is empty)."""
        if self.hi == self.lo:
            return None
        if len(self.segs) != 1 or self.segs[0].dense is None:
            raise SpecError(f"{what} needs an uncompressed tensor; the path has a compressed "
                            "one here (a decomp is missing)")
        return self.segs[0].dense


@dataclass
class PathRunner:
    """Runs paths for one gradient-sync instance (keeps error feedback across iterations).

    Args:
        levels: the groups.
        comm_device: where collectives take their tensors (``cpu`` for gloo).

    Attributes:
        casts: dtype casts of dense values done so far (into and out of a 16-bit stretch of
            uncompressed steps; see the module docstring).
    """

    levels: SyncLevels
    comm_device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    feedback: ErrorFeedback = field(default_factory=ErrorFeedback)
    iteration: int = 0
    casts: int = 0
    _comps: dict[tuple[str, str], Compressor] = field(default_factory=dict)
    #: per (site, step) of a compressed all-gather: the largest payload seen (bytes)
    _slots: dict[Any, int] = field(default_factory=dict)

    def run(self, flat: torch.Tensor, strategy: NoSync | CastSync | CompressedSync,
            site: Any = 0) -> torch.Tensor:
        """The sum over the flat level of every rank's ``flat``, following ``strategy``.

        ``site`` keys the error-feedback memory (the bucket). The result has ``flat``'s device
        and dtype; uncompressed steps of an fp32 strategy keep ``flat``'s dtype (fp64 stays
        fp64), compressors compute in fp32. ``flat`` may be overwritten (collectives run in
        place on it when no cast or copy is needed).
        """
        steps = path_of(strategy)
        if problems := path_problems(strategy):  # as plan validation, before any collective
            raise SpecError(f"the path {[(s.kind, s.level, s.routine) for s in steps]}: "
                            f"{problems[0]}")
        comp = (self._compressor(strategy.compressor, strategy.params)
                if isinstance(strategy, CompressedSync) else
                self._compressor(strategy.dtype, {}) if isinstance(strategy, CastSync) else None)
        wire_name = (strategy.dtype if isinstance(strategy, CastSync) else
                     getattr(strategy, "uncompressed_dtype", "fp32"))
        wire = flat.dtype if wire_name == "fp32" else _WIRE[wire_name]
        ef = isinstance(strategy, CompressedSync) and strategy.error_feedback
        st = _State(0, flat.numel(), [_Seg(0, flat.numel(), dense=flat)], dtype=flat.dtype)
        for i, s in enumerate(steps):
            where = f"step {i} ({s.kind} {s.routine or s.device or ''} at {s.level})"
            if s.kind == "comp":
                if comp is None:
                    raise SpecError(f"{where}: a comp in a strategy without a compressor")
                self._comp(st, comp, steps[i + 1:], (site, i), ef, flat.device, s)
            elif s.kind == "decomp":
                self._decomp(st, comp, s, flat.device)
            elif s.compressed:
                self._comm_compressed(st, s, where, (site, i))
            else:
                self._comm_dense(st, s, wire, where)
        if st.stack or (st.lo, st.hi) != (0, flat.numel()):  # last line of defence
            raise SpecError(f"the path {[(s.kind, s.level, s.routine) for s in steps]} does "
                            "not end with the whole aggregated tensor on every rank")
        out = st.dense("the end of the path")
        if out is None:
            return flat.new_zeros(0)
        return self._cast(out, flat.dtype).to(flat.device)

    def _cast(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``x`` in ``dtype`` (on its own device), counted in :attr:`casts` when it changes."""
        if x.dtype == dtype:
            return x
        self.casts += 1
        return x.to(dtype)

    def _compressor(self, name: str, params: Mapping[str, Any]) -> Compressor:
        key = (name, repr(sorted(params.items())))
        if key not in self._comps:
            self._comps[key] = make_compressor(name, params)
        return self._comps[key]

    # -- comp / decomp --
    def _split_ahead(self, lo: int, hi: int, ahead: Sequence[Step]) -> list[tuple[int, int]]:
        """The ranges a comp must compress separately: split by every compressed step 1
        before the next decomp."""
        ranges = [(lo, hi)]
        for s in ahead:
            if s.kind == "decomp":
                break
            if s.kind == "comm" and s.routine in ("alltoall", "gather"):
                g = self.levels.get(s.level).size
                kind = "scatter" if s.routine == "alltoall" else "root"
                ranges = [c for a, b in ranges for c in chunk_bounds(a, b, g, kind) if c[1] > c[0]]
        return ranges

    def _comp(self, st: _State, comp: Compressor, ahead: Sequence[Step], site: Any, ef: bool,
              home: torch.device, s: Step) -> None:
        x = st.dense("comp")
        if x is None:
            st.segs = []
            return
        dev = torch.device("cpu") if s.device == "cpu" else home
        x = _to(self._cast(x, st.dtype), dev)  # the end of a 16-bit stretch
        segs = []
        for a, b in self._split_ahead(st.lo, st.hi, ahead):
            part = x[a - st.lo: b - st.lo]
            seed = zlib.crc32(repr((self.iteration, site, a)).encode())
            p = (self.feedback.compress(comp, (site, a, b), part, seed) if ef
                 else comp.compress(part, seed))
            segs.append(_Seg(a, b, pieces=[p]))
        st.segs = segs

    def _decomp(self, st: _State, comp: Compressor | None, s: Step,
                home: torch.device) -> None:
        if comp is None:
            raise SpecError("a decomp in a strategy without a compressor")
        dev = torch.device("cpu") if s.device == "cpu" else home
        out = torch.zeros(st.hi - st.lo, dtype=torch.float32, device=dev)
        covered = 0
        for seg in st.segs:
            if seg.dense is not None:
                raise SpecError("decomp of an uncompressed tensor (a comp is missing)")
            view = out[seg.lo - st.lo: seg.hi - st.lo]
            for p in seg.pieces:
                view += comp.decompress(tuple(_to(t, dev) for t in p), seg.hi - seg.lo)
            covered += seg.hi - seg.lo
        if covered != st.hi - st.lo:
            raise SpecError("decomp: the compressed pieces do not cover the range")
        st.segs = [_Seg(st.lo, st.hi, dense=out.to(st.dtype))] if st.hi > st.lo else []

    # -- collectives --
    def _open(self, st: _State, level: str) -> tuple[str, str, int, int] | None:
        return st.stack[-1] if st.stack and st.stack[-1][0] == level else None

    def _comm_dense(self, st: _State, s: Step, wire: torch.dtype, where: str) -> None:
        lv = self.levels.get(s.level)
        r = s.routine
        if r in ("allgather", "broadcast"):
            top = self._open(st, s.level)
            want = "scatter" if r == "allgather" else "root"
            if top is None or top[1] != want:
                raise SpecError(f"{where}: an uncompressed {r} must close a "
                                f"{'reduce_scatter' if want == 'scatter' else 'reduce'} at "
                                "the same level")
            st.stack.pop()
            _, _, lo, hi = top
            x = st.dense(where)
            if x is None:
                x = torch.zeros(0, dtype=wire, device=self.comm_device)
            if lv.group is not None and hi > lo:
                c = chunk_bounds(lo, hi, lv.size, want)
                link, item = throttled(s.level), wire.itemsize
                if r == "allgather":
                    w = c[0][1] - c[0][0]
                    with occupy(link, "allgather", w * lv.size * item, lv.size):
                        y = _allgather(_to(self._cast(x, wire), self.comm_device), lv, w)
                    x = y[: hi - lo]
                else:
                    buf = (_to(self._cast(x, wire), self.comm_device) if lv.index == 0 else
                           torch.empty(hi - lo, dtype=wire, device=self.comm_device))
                    with occupy(link, "broadcast", (hi - lo) * item, lv.size):
                        dist.broadcast(buf, src=lv.root, group=lv.group)
                    x = buf
            st.lo, st.hi = lo, hi
            st.segs = [_Seg(lo, hi, dense=x)] if hi > lo else []
            return
        x = st.dense(where)
        if r == "allreduce":
            if lv.group is not None and x is not None:
                y = _to(self._cast(x, wire), self.comm_device)
                with occupy(throttled(s.level), "allreduce", y.numel() * y.element_size(),
                            lv.size):
                    dist.all_reduce(y, group=lv.group)
                st.segs = [_Seg(st.lo, st.hi, dense=y)]
            return
        if r not in ("reduce_scatter", "reduce"):
            raise SpecError(f"{where}: routine {r!r} cannot carry uncompressed tensors")
        kind = "scatter" if r == "reduce_scatter" else "root"
        lo, hi = st.lo, st.hi
        a, b = chunk_bounds(lo, hi, lv.size, kind)[lv.index]
        st.stack.append((s.level, kind, lo, hi))
        if lv.group is not None and x is not None:
            y = _to(self._cast(x, wire), self.comm_device)
            with occupy(throttled(s.level), r, y.numel() * y.element_size(), lv.size):
                if kind == "scatter":
                    x = _reduce_scatter(y, lv)[: b - a]
                else:
                    dist.reduce(y, dst=lv.root, group=lv.group)
                    x = y
        st.lo, st.hi = a, b
        st.segs = [_Seg(a, b, dense=x[: b - a])] if b > a and x is not None else []

    def _comm_compressed(self, st: _State, s: Step, where: str, key: Any = None) -> None:
        lv = self.levels.get(s.level)
        r = s.routine
        if any(seg.dense is not None for seg in st.segs):
            raise SpecError(f"{where}: a compressed {r} of an uncompressed tensor (comp missing)")
        top = self._open(st, s.level)
        if r in ("broadcast", "allgather") and top is not None and top[1] == (
                "scatter" if r == "allgather" else "root"):
            st.stack.pop()
            _, _, lo, hi = top
            if lv.group is not None and hi > lo:
                buf = _serialize(st.segs, self.comm_device)
                link = throttled(s.level)
                got = (_allgather_slotted(buf, lv, link, self._slots, key)
                       if r == "allgather" else [_broadcast_bytes(buf, lv, link)])
                st.segs = _merge_pieces([_deserialize(b, self.comm_device) for b in got])
            st.lo, st.hi = lo, hi
            return
        if r == "allgather":  # indivisible
            if lv.group is not None and st.hi > st.lo:
                got = _allgather_slotted(_serialize(st.segs, self.comm_device), lv,
                                         throttled(s.level), self._slots, key)
                st.segs = _merge_pieces([_deserialize(b, self.comm_device) for b in got])
            return
        if r not in ("alltoall", "gather"):
            raise SpecError(f"{where}: a compressed {r} must close a compressed step 1 "
                            "(alltoall/gather) at the same level")
        kind = "scatter" if r == "alltoall" else "root"
        lo, hi = st.lo, st.hi
        chunks = chunk_bounds(lo, hi, lv.size, kind)
        st.stack.append((s.level, kind, lo, hi))
        a, b = chunks[lv.index]
        if lv.group is not None and hi > lo:
            out: list[list[_Seg]] = [[] for _ in chunks]
            for seg in st.segs:
                j = next((j for j, (ca, cb) in enumerate(chunks)
                          if ca <= seg.lo and seg.hi <= cb and cb > ca), None)
                if j is None:
                    raise SpecError(f"{where}: a compressed piece straddles two chunks")
                out[j].append(seg)
            if r == "alltoall":
                got = _alltoall_bytes([_serialize(o, self.comm_device) for o in out], lv,
                                      throttled(s.level))
            else:
                got = _gather_bytes(_serialize(out[0], self.comm_device), lv, throttled(s.level))
            st.segs = _merge_pieces([_deserialize(g, self.comm_device) for g in got])
        elif (a, b) != (lo, hi):
            st.segs = []
        st.lo, st.hi = a, b


def _to(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``x`` on ``device``; CUDA → CPU goes through pinned memory."""
    if x.device == device:
        return x
    if x.is_cuda and device.type == "cpu":
        buf = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)  # host: pinned staging
        buf.copy_(x, non_blocking=True)
        torch.cuda.current_stream(x.device).synchronize()
        return buf
    return x.to(device, non_blocking=x.is_pinned())

