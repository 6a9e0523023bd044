"""ZERO-resizing and SEMI-migration at run time: resized linears, migration, the controller.

Executes the decisions of :mod:`hetplan.algorithms.zero_resizing` inside the uneven
column/row-parallel linears of :mod:`hetplan.runtime.tensor_parallel` (digest
``research/zero_resizing.md`` §2, §3, §6.4). The runtime knows nothing about search: each
iteration the controller gathers one small vector of measured times per rank and applies the
paper's closed-form rules.

* **Resized linear** (:class:`ResizedLinearFn`): the kept contraction columns of ``X`` and
  ``W`` are gathered (``index_select``) and three smaller GEMMs give ``Y``, ``dW[:, keep]``
  and ``dX[..., keep]``; the pruned columns' ``dW`` and ``dX`` are zeros (zero imputation);
  no output rescaling, the bias is untouched (§7.13, §7.14). Numerically it equals the 0/1
  column-mask reference.
* **Lineage**: every resizable linear keeps the pruned indices of the current iteration in
  :attr:`LayerState.step`; it is replaced only between iterations, so forward and backward
  of one iteration prune the same columns.
* **Priority** (Alg. 1): per column, the statistic δ is the column's mean ``|Δw|`` summed
  over the iterations of a statistics period (``period`` iterations; θ = period · θ_iter,
  §7.7); pruned columns keep their δ (incremental update); before the first period ends δ
  is the column's mean ``|w|`` (cold start, §7.10). α is the paper's PriDiff floor factor.
* **Lightweight migration**: a sender's migrated columns are the *tail* of its contraction
  dimension (every rank knows them without communication; pruning chooses among the rest).
  Column-parallel: ``W_s[:, c]`` is broadcast in forward, receivers' partial outputs are
  reduced to the sender; ``dY_s`` is broadcast in backward, each receiver adds its slice of
  ``dX`` into its own ``dX`` before the layer's all-reduce (reduce-merging) and its ``dW_s``
  slice is reduced to the sender. Row-parallel: ``X_s[..., c]`` and ``W_s[:, c]`` are
  broadcast (one buffer) in forward and receivers add their partial products into their own
  partial output before the forward all-reduce (merged); in backward the ``dW_s`` and
  ``dX_s`` slices go back in one reduce. Receivers of one sender are split by the paper's
  virtual renumbering. The weight update stays with the owner.
* **Measured times** (§1.2): ``T`` = the rank's busy time of the iteration (the runtime's
  compute time minus the time it waited in tensor-parallel collectives, so a fast rank does
  not inherit the straggler's time), ``M`` = time in its own prunable GEMMs (emulated
  slowdown included). Every rank gathers ``[T_raw, M_raw, L]`` (the un-balanced estimates of
  :func:`~hetplan.algorithms.zero_resizing.unbalanced_times`) each iteration and re-decides
  when some rank's ``T_raw`` moved by more than ``replan_trigger`` (either direction, so a
  recovered straggler stops pruning, §7.3) since the last decision — every rank sees the same
  gathered vector, so the trigger needs no extra agreement (§7.4).
* **Costs of Eq. (2)/(3)** (Alg. 2 line 1, "pretest"): at the first decision every rank times
  an ``index_select`` of its first layer's columns (Ω_2 per column, Ω_1 = 0) and a
  broadcast + reduce of the bytes one migrated column moves (Φ_1 per column); the maximum
  over ranks is used (identical on all). Φ_2 per column is a receiver's ``M_raw / L``.
* **Straggler emulation** (:class:`StragglerEmulator`): after each of its own GEMMs the
  straggler sleeps ``χ · t_gemm`` (extra time, χ = 0 is homogeneous, §7.27), optionally
  rotating the straggler every ``rotate_every`` iterations.
* Pruned columns get zero gradients and otherwise no special treatment by the optimizer
  (§7.16, as in the paper).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from hetplan.algorithms.zero_resizing import (
    CostCoefficients,
    RankDecision,
    n_columns,
    plan_roles,
    pridiff_ratio,
    receiver_ranges,
    renormalise_ratios,
    select_pruned,
    semi_decision,
    unbalanced_times,
    update_wvar,
    zero_decision,
)
from hetplan.errors import SpecError
from hetplan.ir.plan_sections import ResizingController, TensorParallel
from hetplan.runtime.tensor_parallel import ColumnParallelLinear, RowParallelLinear

#: repetitions of each pretest measurement (the minimum is kept)
_PRETEST_REPS = 5

__all__ = [
    "Clock",
    "LayerState",
    "LayerStep",
    "Migration",
    "ResizableColumnLinear",
    "ResizableRowLinear",
    "ResizingRuntime",
    "StragglerEmulator",
    "StragglerSpec",
    "attach_resizing",
    "end_iteration",
    "make_resizable",
    "straggler_from_env",
]


# -- the resized GEMMs -----------------------------------------------------------------------
MatMul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 2-D ``[rows, features]`` view; works for a rank with 0 features, where
    ``reshape(-1, 0)`` cannot infer the row count."""
    return t.reshape(t.shape[:-1].numel(), t.shape[-1])


def _own_forward(x2: torch.Tensor, w: torch.Tensor, keep: torch.Tensor | None,
                 mm: MatMul = torch.matmul) -> torch.Tensor:
    """``X[:, keep] · W[:, keep]ᵀ`` (all columns when ``keep`` is None); ``x2`` is 2-D."""
    if keep is None:
        return mm(x2, w.t())
    return mm(x2.index_select(1, keep), w.index_select(1, keep).t())


def _own_backward(dy: torch.Tensor, x2: torch.Tensor, w: torch.Tensor,
                  keep: torch.Tensor | None, mm: MatMul = torch.matmul
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``dX`` and ``dW`` of the kept columns, zeros at the pruned ones (zero imputation)."""
    if keep is None:
        return mm(dy, w), mm(dy.t(), x2)
    dx = x2.new_zeros(x2.shape)
    dw = w.new_zeros(w.shape)
    dx.index_copy_(1, keep, mm(dy, w.index_select(1, keep)))
    dw.index_copy_(1, keep, mm(dy.t(), x2.index_select(1, keep)))
    return dx, dw


# -- straggler emulation and clocks ----------------------------------------------------------
@dataclass
class StragglerEmulator:
    """Slows one rank's matmuls by ``chi``; optionally emulates every rank's device speed.

    Without ``flop_rate`` the straggler sleeps ``chi · t`` after each GEMM that took ``t``
    (the paper's sleep injection) and the other ranks run at the machine's speed. With
    ``flop_rate`` (FLOP/s) every GEMM of every rank lasts ``flops / flop_rate`` seconds —
    ``(1 + chi)`` times that on the straggler — by sleeping what the real GEMM did not take:
    a contention-free device model for CPU benchmarks where several ranks share few cores
    (a sleeping rank frees its core for the others, which would hide the straggler).

    Attributes:
        chi: extra time factor (0: homogeneous; the rank's matmuls take ``1 + chi`` times).
        straggler: group position of the straggler at iteration 0.
        tp_rank / tp_size: this rank's position and the group size.
        rotate_every: move the straggler to the next position every this many iterations
            (0: never), as the paper's round-robin tests do.
        flop_rate: emulated device speed in FLOP/s (None: the real machine's).
    """

    chi: float
    straggler: int
    tp_rank: int
    tp_size: int
    rotate_every: int = 0
    flop_rate: float | None = None
    iteration: int = 0
    debt: float = 0.0  # emulated seconds owed by the GEMMs since the last settle

    def current(self) -> int:
        """The straggler's group position at this iteration."""
        if self.rotate_every <= 0:
            return self.straggler % self.tp_size
        return (self.straggler + self.iteration // self.rotate_every) % self.tp_size

    def extra(self, dt: float, flops: float = 0.0) -> float:
        """The emulated extra time of a GEMM that took ``dt`` seconds for ``flops``.

        It is owed, not slept at once: :meth:`settle` sleeps the debt before the rank's next
        collective (where a slow device would make the others wait), so a layer's GEMMs
        cost one sleep and its wake-up latency, not three."""
        slow = self.chi > 0 and self.current() == self.tp_rank
        if self.flop_rate is None:
            target = (1.0 + self.chi) * dt if slow else dt
        else:
            target = flops / self.flop_rate * ((1.0 + self.chi) if slow else 1.0)
        owed = max(target - dt, 0.0)
        self.debt += owed
        return owed

    def settle(self) -> None:
        """Sleep the time owed by the GEMMs since the last call."""
        if self.debt > 0.0:
            time.sleep(self.debt)
            self.debt = 0.0

    def advance(self) -> None:
        """Count one iteration (call once per training step)."""
        self.iteration += 1


@dataclass
class Clock:
    """What one rank spent this iteration: own GEMMs, migrated GEMMs, TP collectives."""

    emulator: StragglerEmulator | None = None
    gemm_s: float = 0.0
    recv_s: float = 0.0
    comm_s: float = 0.0

    def _timed(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, float]:
        cuda = a.is_cuda
        if cuda:  # time the kernel, not its launch
            torch.cuda.synchronize(a.device)
        t0 = time.perf_counter()
        out = a @ b
        if cuda:
            torch.cuda.synchronize(a.device)
        dt = time.perf_counter() - t0
        if self.emulator is not None:
            dt += self.emulator.extra(dt, 2.0 * a.shape[0] * a.shape[1] * b.shape[1])
        return out, dt

    def gemm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a @ b`` as one of this rank's own GEMMs, timed and slowed by the emulator."""
        out, dt = self._timed(a, b)
        self.gemm_s += dt
        return out

    def received(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a @ b`` for another rank's migrated columns (timed; the emulated slowdown
        applies too: a slow device is slow for any work)."""
        out, dt = self._timed(a, b)
        self.recv_s += dt
        return out

    def settle(self) -> None:
        """Pay the emulated time owed by this rank's GEMMs (see :meth:`StragglerEmulator.
        settle`)."""
        if self.emulator is not None:
            self.emulator.settle()

    @contextmanager
    def comm(self) -> Iterator[None]:
        """Time a tensor-parallel collective (including the wait for the slowest rank),
        after paying the emulated GEMM time owed."""
        self.settle()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()  # the collective's wait, not only its launch
            self.comm_s += time.perf_counter() - t0

    def reset(self) -> None:
        self.gemm_s = self.recv_s = self.comm_s = 0.0

    def next_iteration(self) -> None:
        """End an iteration: pay what is owed, zero the counters, move a rotating straggler."""
        self.settle()
        self.reset()
        if self.emulator is not None:
            self.emulator.advance()


# -- per-layer state -------------------------------------------------------------------------
@dataclass(frozen=True)
class Migration:
    """One sender's migrated columns of a layer: the tail ``[K_s − n, K_s)`` of its
    contraction dimension, and each receiver's half-open range of positions in it."""

    src: int
    n: int
    k_src: int
    ranges: tuple[tuple[int, int, int], ...]  # (receiver, lo, hi)

    def cols(self, device: torch.device | None = None) -> torch.Tensor:
        return torch.arange(self.k_src - self.n, self.k_src, device=device)

    def mine(self, pos: int) -> tuple[int, int] | None:
        for r, lo, hi in self.ranges:
            if r == pos and hi > lo:
                return lo, hi
        return None


@dataclass(frozen=True)
class LayerStep:
    """A layer's work this iteration: own kept columns (None: all), the lineage (pruned
    columns, zero-imputed) and every migration of the group (same list on every rank)."""

    keep: torch.Tensor | None = None
    pruned: tuple[int, ...] = ()
    migrations: tuple[Migration, ...] = ()


@dataclass
class LayerState:
    """Run-time state of one resizable linear on this rank."""

    name: str
    mode: Literal["column", "row"]
    clock: Clock
    ranks: tuple[int, ...]  # global rank of every group position
    k_sizes: tuple[int, ...]  # contraction columns of every group position
    step: LayerStep = field(default_factory=LayerStep)
    rows: int = 1  # rows of the 2-D activations in the last forward
    w_var: list[float] | None = None
    acc: torch.Tensor | None = None
    prev_w: torch.Tensor | None = None


def _bcast(t: torch.Tensor, src: int, st: LayerState, group: Any) -> None:
    with st.clock.comm():
        dist.broadcast(t, src=st.ranks[src], group=group)


def _reduce(t: torch.Tensor, dst: int, st: LayerState, group: Any) -> None:
    with st.clock.comm():
        dist.reduce(t, dst=st.ranks[dst], op=dist.ReduceOp.SUM, group=group)


def _all_reduce(t: torch.Tensor, st: LayerState, group: Any) -> None:
    with st.clock.comm():
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)


class _ColumnFn(torch.autograd.Function):
    """Column-parallel linear with resizing and migration; backward all-reduces ``dX``
    (Megatron ``f``) after the receivers merged their migrated ``dX`` columns into it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, mod: ResizableColumnLinear
                ) -> torch.Tensor:
        st, step, me = mod.rz, mod.rz.step, mod.tp_rank
        x2 = _rows(x)
        st.rows = x2.shape[0]
        y = _own_forward(x2, w, step.keep, st.clock.gemm)
        sent: list[torch.Tensor] = []
        for mig in step.migrations:
            out_s = mod.shard_sizes[mig.src]
            wc = (w.index_select(1, mig.cols(w.device)) if me == mig.src
                  else w.new_empty(out_s, mig.n))
            _bcast(wc, mig.src, st, mod.group)
            sent.append(wc)
            part = y if me == mig.src else x2.new_zeros(x2.shape[0], out_s)
            rng = mig.mine(me)
            if rng is not None:
                cols = mig.cols(w.device)[rng[0]:rng[1]]
                part += st.clock.received(x2.index_select(1, cols), wc[:, rng[0]:rng[1]].t())
            _reduce(part, mig.src, st, mod.group)
        ctx.save_for_backward(x2, w, *sent)
        ctx.mod, ctx.step, ctx.x_shape = mod, step, x.shape
        return y.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x2, w, *sent = ctx.saved_tensors
        mod, step = ctx.mod, ctx.step
        st, me = mod.rz, mod.tp_rank
        dy2 = _rows(dy).contiguous()
        dx, dw = _own_backward(dy2, x2, w, step.keep, st.clock.gemm)
        for mig, wc in zip(step.migrations, sent, strict=True):
            out_s = mod.shard_sizes[mig.src]
            dys = dy2 if me == mig.src else dy2.new_empty(dy2.shape[0], out_s)
            _bcast(dys, mig.src, st, mod.group)
            buf = w.new_zeros(out_s, mig.n)
            rng = mig.mine(me)
            if rng is not None:
                lo, hi = rng
                cols = mig.cols(w.device)[lo:hi]
                dx.index_add_(1, cols, st.clock.received(dys, wc[:, lo:hi]))
                buf[:, lo:hi] = st.clock.received(dys.t(), x2.index_select(1, cols))
            _reduce(buf, mig.src, st, mod.group)
            if me == mig.src:
                dw.index_copy_(1, mig.cols(w.device), buf)
        if mod.tp_size > 1:
            _all_reduce(dx, st, mod.group)
        return dx.reshape(ctx.x_shape), dw, None


class _RowFn(torch.autograd.Function):
    """Row-parallel linear (partial products) with resizing and migration; forward
    all-reduces the partial output after the receivers merged their migrated products."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, mod: ResizableRowLinear
                ) -> torch.Tensor:
        st, step, me = mod.rz, mod.rz.step, mod.tp_rank
        x2 = _rows(x)
        rows, out = x2.shape[0], w.shape[0]
        st.rows = rows
        y = _own_forward(x2, w, step.keep, st.clock.gemm)
        sent: list[torch.Tensor] = []
        for mig in step.migrations:
            if me == mig.src:
                c = mig.cols(w.device)
                buf = torch.cat([x2.index_select(1, c).reshape(-1),
                                 w.index_select(1, c).reshape(-1)])
            else:
                buf = w.new_empty(rows * mig.n + out * mig.n)
            _bcast(buf, mig.src, st, mod.group)
            xc, wc = buf[:rows * mig.n].view(rows, mig.n), buf[rows * mig.n:].view(out, mig.n)
            sent += [xc, wc]
            rng = mig.mine(me)
            if rng is not None:
                lo, hi = rng
                y += st.clock.received(xc[:, lo:hi], wc[:, lo:hi].t())
        if mod.tp_size > 1:
            _all_reduce(y, st, mod.group)
        ctx.save_for_backward(x2, w, *sent)
        ctx.mod, ctx.step, ctx.x_shape = mod, step, x.shape
        return y.reshape(*x.shape[:-1], out)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x2, w, *sent = ctx.saved_tensors
        mod, step = ctx.mod, ctx.step
        st, me = mod.rz, mod.tp_rank
        dy2 = _rows(dy).contiguous()
        rows, out = dy2.shape
        dx, dw = _own_backward(dy2, x2, w, step.keep, st.clock.gemm)
        for i, mig in enumerate(step.migrations):
            xc, wc = sent[2 * i], sent[2 * i + 1]
            buf = w.new_zeros(out * mig.n + rows * mig.n)
            bw, bx = buf[:out * mig.n].view(out, mig.n), buf[out * mig.n:].view(rows, mig.n)
            rng = mig.mine(me)
            if rng is not None:
                lo, hi = rng
                bw[:, lo:hi] = st.clock.received(dy2.t(), xc[:, lo:hi])
                bx[:, lo:hi] = st.clock.received(dy2, wc[:, lo:hi])
            _reduce(buf, mig.src, st, mod.group)
            if me == mig.src:
                dw.index_copy_(1, mig.cols(w.device), bw)
                dx.index_copy_(1, mig.cols(w.device), bx)
        return dx.reshape(ctx.x_shape), dw, None


class ResizableColumnLinear(ColumnParallelLinear):
    """A :class:`ColumnParallelLinear` whose GEMMs follow :attr:`rz` ``.step``."""

    rz: LayerState

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _ColumnFn.apply(x, self.weight, self)
        return y + self.bias if self.bias is not None else y


class ResizableRowLinear(RowParallelLinear):
    """A :class:`RowParallelLinear` whose GEMMs follow :attr:`rz` ``.step``."""

    rz: LayerState

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _RowFn.apply(x, self.weight, self)
        return y + self.bias if self.bias is not None else y


def _group_ranks(group: Any, size: int) -> tuple[int, ...]:
    if group is None or not dist.is_initialized():
        return tuple(range(size))
    return tuple(dist.get_process_group_ranks(group))


Resizable = ResizableColumnLinear | ResizableRowLinear


def make_resizable(model: nn.Module, clock: Clock) -> list[tuple[str, Resizable]]:
    """Turn every column/row-parallel linear of ``model`` into its resizable form, in place.

    The module keeps its parameters and names (its class is switched to the resizable
    subclass, which only overrides ``forward``). Returns ``[(name, module)]`` in model order.
    """
    out: list[tuple[str, Resizable]] = []
    for name, mod in model.named_modules():
        if isinstance(mod, ColumnParallelLinear | RowParallelLinear):
            column = isinstance(mod, ColumnParallelLinear)
            mod.__class__ = ResizableColumnLinear if column else ResizableRowLinear
            k = ((mod.in_features,) * mod.tp_size if column else mod.shard_sizes)
            state = LayerState(name, "column" if column else "row", clock,
                               _group_ranks(mod.group, mod.tp_size), tuple(k))
            mod.rz = state  # type: ignore[assignment]
            assert isinstance(mod, ResizableColumnLinear | ResizableRowLinear)
            out.append((name, mod))
    return out


# -- the controller --------------------------------------------------------------------------
@dataclass
class ResizingRuntime:
    """Per-iteration controller of one TP group (ZERO, migration or SEMI).

    Args:
        layers: the resizable linears of this rank (:func:`make_resizable`).
        settings: the plan's controller settings (variant, α, θ_iter, trigger, γ_max).
        clock: the clock the layers report to.
        tp_rank / tp_size / group: this rank's position, the group size, the process group.
        period: iterations per statistics period (the paper's epoch; θ = period · θ_iter).
        smoothing: weight of the newest measurement in the running T and M (noise filter).

    The straggler tolerance, ZERO's criterion and the receivers of migrated work come from
    the settings (``straggler_eps``, ``criterion``, ``receivers``; by default 0.05, ``avg``
    and ``all``, the paper's choices).
    """

    layers: list[tuple[str, Resizable]]
    settings: ResizingController
    clock: Clock
    tp_rank: int
    tp_size: int
    group: Any = None
    period: int = 20
    smoothing: float = 0.5
    iteration: int = 0
    decisions: list[RankDecision] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)
    _t: float | None = None
    _m: float | None = None
    _basis: list[float] | None = None
    _costs: CostCoefficients | None = None

    def __post_init__(self) -> None:
        if self.settings.variant == "off":
            raise SpecError("the resizing controller needs a variant other than 'off'")
        if self.period < 1:
            raise SpecError(f"period must be >= 1 iteration, got {self.period}")
        if self.settings.imputation != "zero":
            raise SpecError(f"the runtime imputes pruned columns with zeros only (the paper's "
                            f"choice); the plan asks for {self.settings.imputation!r}: set "
                            "tensor_parallel.controller.imputation to 'zero'")

    # statistics (Alg. 1 lines 4-8) ------------------------------------------------------------
    def _track(self) -> None:
        boundary = (self.iteration + 1) % self.period == 0
        for _, mod in self.layers:
            st = mod.rz
            w = mod.weight.detach()
            rows = max(w.shape[0], 1)  # a column shard may hold 0 rows
            if st.prev_w is None:
                st.prev_w = w.clone()
                st.acc = torch.zeros(w.shape[1], dtype=torch.float64, device=w.device)
                st.w_var = (w.abs().sum(0) / rows).double().tolist()  # cold start: magnitude
                continue
            assert st.acc is not None and st.w_var is not None
            st.acc += ((w - st.prev_w).abs().sum(0) / rows).double()
            st.prev_w.copy_(w)
            if boundary:
                st.w_var = update_wvar(st.w_var, st.acc.tolist(), st.step.pruned)
                st.acc.zero_()

    # measurements -------------------------------------------------------------------------
    def _device(self) -> torch.device:
        """Where this rank's collectives run (NCCL needs CUDA tensors)."""
        return self.layers[0][1].weight.device if self.layers else torch.device("cpu")

    def _own_columns(self) -> int:
        """This rank's contraction columns over its resizable layers."""
        return sum(m.rz.k_sizes[self.tp_rank] for _, m in self.layers)

    def _own_fraction(self) -> float:
        """The fraction of its own columns this rank prunes or migrates this iteration."""
        me, total = self.tp_rank, self._own_columns()
        gone = 0
        for _, m in self.layers:
            step = m.rz.step
            gone += len(step.pruned) + sum(g.n for g in step.migrations if g.src == me)
        return min(gone / total, 0.999) if total else 0.0

    def _gather(self, busy_s: float, skipped: float) -> list[list[float]]:
        """Every rank's smoothed ``[T_raw, M_raw, columns]`` (``skipped``: this rank's
        :meth:`_own_fraction` of the iteration measured)."""
        t_raw, m_raw = unbalanced_times(busy_s, self.clock.gemm_s, skipped, self.clock.recv_s)
        a = self.smoothing
        self._t = t_raw if self._t is None else a * t_raw + (1 - a) * self._t
        self._m = m_raw if self._m is None else a * m_raw + (1 - a) * self._m
        mine = torch.tensor([self._t, self._m, float(self._own_columns())], dtype=torch.float64,
                            device=self._device())
        if self.tp_size == 1:
            return [mine.tolist()]
        bufs = [torch.empty_like(mine) for _ in range(self.tp_size)]
        dist.all_gather(bufs, mine, group=self.group)
        return [b.tolist() for b in bufs]

    def _pretest(self, rows: int) -> CostCoefficients:
        """Alg. 2 line 1: Ω_2 and Φ_1 per column, the maximum over the group."""
        _, mod = self.layers[0]
        w = mod.weight.detach()
        n = max(1, w.shape[1] // 2)
        cols = torch.arange(n, device=w.device)
        x = w.new_zeros(rows, w.shape[1])
        omega2 = math.inf
        for _ in range(_PRETEST_REPS):  # the fastest of a few: noise only adds time
            t0 = time.perf_counter()
            x.index_select(1, cols)
            w.index_select(1, cols)
            omega2 = min(omega2, (time.perf_counter() - t0) / n)
        # the probe's size must be the same on every rank (shards may be uneven): half of
        # group position 0's columns, with position 0's output rows
        n0 = max(1, mod.rz.k_sizes[0] // 2)
        out0 = mod.shard_sizes[0] if mod.rz.mode == "column" else w.shape[0]
        buf = w.new_zeros(n0 * (rows + out0))
        phi1 = 0.0
        if self.tp_size > 1:
            phi1 = math.inf
            for _ in range(_PRETEST_REPS):
                dist.barrier(group=self.group)
                t0 = time.perf_counter()
                dist.broadcast(buf, src=mod.rz.ranks[0], group=self.group)
                dist.reduce(buf, dst=mod.rz.ranks[0], group=self.group)
                phi1 = min(phi1, (time.perf_counter() - t0) / n0)
            vals = torch.tensor([omega2, phi1], dtype=torch.float64, device=w.device)
            dist.all_reduce(vals, op=dist.ReduceOp.MAX, group=self.group)
            omega2, phi1 = vals.tolist()
        return CostCoefficients(omega2=omega2 * len(self.layers), phi1=phi1 * len(self.layers))

    # decisions ----------------------------------------------------------------------------
    def _decide(self, g: list[list[float]]) -> list[RankDecision]:
        s = self.settings
        eps = s.straggler_eps
        t_raw, m_raw, cols = [v[0] for v in g], [v[1] for v in g], [int(v[2]) for v in g]
        if s.variant == "zero":
            return zero_decision(t_raw, m_raw, s.gamma_max, s.criterion, eps)
        if self._costs is None:
            self._costs = self._pretest(self.layers[0][1].rz.rows)
        # Φ_2 per column: the slowest receiver's seconds per column (all but the slowest rank)
        slowest = max(range(len(t_raw)), key=lambda r: (t_raw[r], -r))
        phi2 = max((m_raw[r] / cols[r] for r in range(len(cols)) if r != slowest and cols[r]),
                   default=0.0)
        costs = replace(self._costs, phi2=phi2)
        variant: Literal["semi", "migration"] = "migration" if s.variant == "migration" \
            else "semi"
        return semi_decision(t_raw, m_raw, cols, costs, s.gamma_max, eps, variant,
                             s.receivers)

    def _apply(self, decisions: list[RankDecision]) -> None:
        """Turn the per-rank decisions into every layer's step (same on every rank)."""
        me = self.tp_rank
        migs = [self._migrations(mod.rz, decisions) for _, mod in self.layers]
        ratios = self._ratios(decisions[me].resize, migs)
        for (_, mod), layer_migs, gk in zip(self.layers, migs, ratios, strict=True):
            st = mod.rz
            k = st.k_sizes[me]
            n_mig = sum(m.n for m in layer_migs if m.src == me)
            pruned: tuple[int, ...] = ()
            if gk > 0 and st.w_var is not None:
                eligible = st.w_var[: k - n_mig]
                pruned = select_pruned(eligible, min(n_columns(gk, k), len(eligible)))
            gone = set(pruned) | set(range(k - n_mig, k))
            keep = (torch.tensor([c for c in range(k) if c not in gone], dtype=torch.long,
                                 device=mod.weight.device)
                    if gone else None)
            st.step = LayerStep(keep, pruned, tuple(layer_migs))

    def _migrations(self, st: LayerState, decisions: list[RankDecision]) -> list[Migration]:
        """Every sender's migrated columns of one layer, with the receivers' ranges."""
        out = []
        for src, d in enumerate(decisions):
            n = n_columns(d.migrate, st.k_sizes[src])
            if d.role != "migrate_src" or n == 0:
                continue
            rng = receiver_ranges(src, d.receivers, self.tp_size, n)
            out.append(Migration(src, n, st.k_sizes[src],
                                 tuple((r, lo, hi) for r, (lo, hi) in rng.items())))
        return out

    def _ratios(self, gamma: float, migs: list[list[Migration]]) -> list[float]:
        """PriDiff's per-layer ratios of this rank, renormalised to a weighted mean of γ."""
        if gamma <= 0:
            return [0.0] * len(self.layers)
        me, s = self.tp_rank, self.settings
        theta = self.period * s.theta_iter
        ratios, weights = [], []
        for (_, mod), layer_migs in zip(self.layers, migs, strict=True):
            st = mod.rz
            n_mig = sum(m.n for m in layer_migs if m.src == me)
            eligible = (st.w_var or [])[: st.k_sizes[me] - n_mig]
            ratios.append(pridiff_ratio(eligible, theta, gamma, s.alpha, s.gamma_max)
                          if st.w_var is not None else 0.0)
            weights.append(float(mod.weight.numel()))
        return renormalise_ratios(ratios, weights, gamma, s.gamma_max)

    def start(self, roles: Sequence[RankDecision]) -> None:
        """Begin with the plan's initial decisions (one per group position), before any
        measurement; statistics start at the weights' magnitudes (cold start)."""
        if len(roles) != self.tp_size:
            raise SpecError(f"{len(roles)} initial roles for a TP group of {self.tp_size}")
        self._track()
        self.decisions = list(roles)
        self._apply(self.decisions)

    def after_step(self, busy_s: float) -> None:
        """Call once per iteration after the optimizer step (a collective over the group).

        Args:
            busy_s: this rank's compute time of the iteration, TP collectives included (the
                clock's collective time is subtracted here).
        """
        skipped = self._own_fraction()
        self.clock.settle()  # owed time counts in this iteration's busy time
        self._track()
        busy = max(busy_s - self.clock.comm_s, self.clock.gemm_s)
        g = self._gather(busy, skipped)
        t_now = [v[0] for v in g]
        trigger = self.settings.replan_trigger
        replan = (self._basis is None or (self.iteration + 1) % self.period == 0
                  or any(abs(a - b) > trigger * b for a, b in zip(t_now, self._basis,
                                                                  strict=True)))
        if replan:
            self._basis = t_now
            self.decisions = self._decide(g)
            self._apply(self.decisions)
        mine = self.decisions[self.tp_rank]  # set: the first call always re-plans
        self.history.append({"iteration": self.iteration, "t_raw": t_now, "skipped": skipped,
                             "busy_s": busy, "matmul_s": self.clock.gemm_s,
                             "received_s": self.clock.recv_s, "replan": replan,
                             "gamma": mine.resize, "migrate": mine.migrate})
        self.clock.next_iteration()
        self.iteration += 1

    def lineage(self) -> dict[str, tuple[int, ...]]:
        """``{layer name: pruned column indices}`` of the current iteration on this rank."""
        return {name: mod.rz.step.pruned for name, mod in self.layers}



@dataclass(frozen=True)
class StragglerSpec:
    """Which rank to slow in tests and benchmarks: global ``rank``, extra factor ``chi``,
    ``rotate_every`` iterations the straggler moves to the next position of its group, and
    the emulated device speed ``flop_rate`` (see :class:`StragglerEmulator`)."""

    chi: float
    rank: int
    rotate_every: int = 0
    flop_rate: float | None = None


#: ``hetplan run`` / ``Runtime``: emulate a straggler, ``CHI@RANK`` or ``CHI@RANK/ROTATE``
ENV_STRAGGLER = "HETPLAN_EMULATE_STRAGGLER"
#: with it, every rank's GEMMs last FLOPs / this rate (see :class:`StragglerEmulator`)
ENV_GEMM_FLOPS = "HETPLAN_EMULATE_GEMM_FLOPS"


def straggler_from_env(env: Mapping[str, str] | None = None) -> StragglerSpec | None:
    """The emulated straggler of ``HETPLAN_EMULATE_STRAGGLER`` (None when unset).

    ``"8@3"``: global rank 3's matmuls take 1 + 8 times as long; ``"8@3/4"``: the straggler
    moves to the next rank of its TP group every 4 iterations. ``HETPLAN_EMULATE_GEMM_FLOPS``
    (FLOP/s) also emulates every rank's device speed.

    Raises:
        SpecError: a malformed value (the message shows the expected form).
    """
    env = os.environ if env is None else env
    raw = env.get(ENV_STRAGGLER, "").strip()
    if not raw:
        if rate := env.get(ENV_GEMM_FLOPS, "").strip():
            raise SpecError(f"{ENV_GEMM_FLOPS}={rate!r} sets the device speed of an emulated "
                            f"straggler: set {ENV_STRAGGLER} too (CHI@RANK, e.g. 8@3), or "
                            f"unset {ENV_GEMM_FLOPS}")
        return None
    try:
        chi_s, _, rest = raw.partition("@")
        rank_s, _, rot_s = rest.partition("/")
        rate_s = env.get(ENV_GEMM_FLOPS, "").strip()
        spec = StragglerSpec(float(chi_s), int(rank_s), int(rot_s) if rot_s else 0,
                             float(rate_s) if rate_s else None)
    except ValueError:
        spec = None
    if spec is None or not math.isfinite(spec.chi) or spec.chi < 0 or spec.rank < 0 or (
            spec.rotate_every < 0) or (spec.flop_rate is not None and (
                not math.isfinite(spec.flop_rate) or spec.flop_rate <= 0)):
        raise SpecError(f"{ENV_STRAGGLER}={raw!r} (with {ENV_GEMM_FLOPS}="
                        f"{env.get(ENV_GEMM_FLOPS, '')!r}) is not valid: use CHI@RANK or "
                        "CHI@RANK/ROTATE with a finite CHI >= 0 (extra matmul time factor), "
                        "a global RANK, ROTATE >= 0 iterations, and a positive FLOP/s rate "
                        "(finite)")
    return spec


def attach_resizing(model: nn.Module, tp: TensorParallel | None, group: Any, tp_rank: int,
                    tp_size: int, straggler: StragglerSpec | None = None
                    ) -> tuple[Clock | None, ResizingRuntime | None]:
    """Make the sharded linears of ``model`` resizable and build the controller.

    Nothing happens (``(None, None)``) when the plan's controller is ``off`` and no straggler
    is emulated. With only an emulated straggler the linears compute in full (the baseline).

    Args:
        model: a model whose TP pairs :func:`~hetplan.runtime.tensor_parallel.shard_model`
            already replaced.
        tp: the plan's ``tensor_parallel`` section (controller settings, roles).
        group / tp_rank / tp_size: the TP process group and this rank's position.
        straggler: the emulated straggler, if any (else ``HETPLAN_EMULATE_STRAGGLER``).

    Returns:
        The clock (call ``after_step`` of the controller, or ``reset`` the clock, each
        iteration) and the controller (None when the variant is ``off``).
    """
    settings = tp.controller if tp is not None else ResizingController()
    straggler = straggler if straggler is not None else straggler_from_env()
    if settings.variant == "off" and straggler is None:
        return None, None
    ranks = _group_ranks(group, tp_size)
    emulator = None
    if straggler is not None and straggler.rank in ranks:
        emulator = StragglerEmulator(straggler.chi, ranks.index(straggler.rank), tp_rank,
                                     tp_size, straggler.rotate_every, straggler.flop_rate)
    clock = Clock(emulator)
    layers = make_resizable(model, clock)
    if settings.variant == "off" or not layers:
        return clock, None
    ctl = ResizingRuntime(layers, settings, clock, tp_rank, tp_size, group)
    mine = [g for g in (tp.groups if tp is not None else ()) if tuple(g.ranks) == ranks]
    if mine and mine[0].roles:
        ctl.start(plan_roles(mine[0]))
    return clock, ctl


def end_iteration(clock: Clock | None, controller: ResizingRuntime | None,
                  busy_s: float) -> None:
    """Per-iteration bookkeeping: the controller's step, or just the clock's reset."""
    if controller is not None:
        controller.after_step(busy_s)
    elif clock is not None:
        clock.next_iteration()
