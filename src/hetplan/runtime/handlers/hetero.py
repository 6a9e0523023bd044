"""A pipeline whose stages have their own data- and tensor-parallel degrees (the ``hetero``
plan section): process groups per stage, and a schedule that moves activations between
stages of different degrees itself.

torch's ``PipelineStage`` talks to one peer rank per neighbouring stage; here stage ``k``
runs ``dp_k x tp_k`` ranks and its neighbour another shape, so the executor sends and
receives with point-to-point operations on the default group (:class:`HeteroPipeline`).

**Groups** (:func:`hetero_groups`): every rank creates, in the same order, each stage's TP
group per replica and data-parallel group per TP rank (the mapping of
:mod:`hetplan.runtime.hetero_ranks`); this rank's are its ``ParallelGroups``, so tensor
parallelism, ZeRO and gradient sync run inside the stage, and gradient sync of a stage
averages over that stage's own replicas. Each stage's data-parallel group is split by node
as a homogeneous plan's is (:func:`~hetplan.runtime.groups.node_split` on the cluster's
nodes), so a hierarchical routing the planner gave a stage (Espresso per stage) runs on its
intra- and inter-node subgroups. There is no pipeline group (``pp_group`` is None;
``pp_ranks`` lists the first rank of every stage).

**Reshard at a boundary** (no sequence parallelism: a TP stage's input and output are
replicated on its TP ranks). Forward: for every pair of sender replica and receiver replica
whose micro-batch rows overlap (:func:`~hetplan.runtime.hetero_ranks.row_overlaps`), TP
rank 0 of the sender sends those rows of every output tensor to *every* TP rank of the
receiver (each needs the whole input); each chunk is preceded by a small header (dtype and
shape), so receivers need no shape inference. Backward: TP rank 0 of the receiver replica
sends the gradient of those rows to every TP rank of the sender replica. One copy, not the
sum over the receiver's TP ranks, is the gradient: the tensor-parallel layers already
all-reduce their input gradient (Megatron's ``f``), so every TP rank holds the full, equal
gradient of its input. The copy is scaled by ``dp_k / dp_{k+1}``: each replica's loss is the
mean over its own rows and gradient sync averages over replicas, so a gradient computed for
``b_{k+1}`` rows stands for ``b_k = b_{k+1} dp_{k+1} / dp_k`` rows in the sender's mean.

**Schedule**: the plan's action list of pipeline position ``k`` (gpipe or 1F1B: actions of
stage ``k`` only), executed in order on every rank of stage ``k``; receives block, sends are
asynchronous and waited for at the end of the step, so the lists that the plan's validator
proves complete cannot deadlock here. Activations travel on one group and gradients on
another (``ParallelGroups.fwd_group`` / ``bwd_group``, every rank in each): NCCL runs the
point-to-point operations between two ranks of one group in the order each rank posts them,
so in 1F1B stage ``k``'s send of the next activation, posted before its receive of a
gradient, would wait for stage ``k+1``'s receive of it, posted after its send of that
gradient: each would wait for the other. Per direction, both ranks post in the same order
(gloo's tags did the matching before; they are kept). That holds for hand-edited lists too:
rule 4 of the plan's validator refuses lists whose two ends of a transfer post in different
orders (:func:`~hetplan.ir.pipeline_order.transfer_order_problem`), which NCCL would pair
with another micro-batch's rows of the same shape.

Not executed (refused at setup, :func:`hetero_refusals`): sequence parallelism, interleaved
or Chimera schedules, parameters tied across stages, re-balancing beside the TP
resizing controller, SDPipe group sync
(:func:`~hetplan.runtime.hetero_ranks.hetero_refusals`). Re-balancing events otherwise run
(:mod:`hetplan.runtime.handlers.hetero_rebalancing`).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hetplan.errors import SpecError
from hetplan.ir.plan import Plan
from hetplan.runtime.busy_clock import BusyClock, cuda_events
from hetplan.runtime.groups import ParallelGroups, node_split
from hetplan.runtime.handlers.base import LocalStage, RuntimeContext
from hetplan.runtime.hetero_ranks import (
    HeteroCoords,
    hetero_coords,
    replica_rows,
    row_overlaps,
)

__all__ = ["HeteroPipeline", "hetero_group_members", "hetero_groups"]

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
           torch.int32, torch.bool, torch.uint8)
_HEADER = 12  # [tensors, dtype, ndim, shape (up to 9 dims)]
_FWD, _BWD = 0, 1


def hetero_group_members(plan: Plan) -> list[tuple[str, tuple[int, ...]]]:
    """Every group of a heterogeneous plan as ``(kind, global ranks)``, in the order every
    rank creates them: per stage, the TP group of each replica, the data-parallel group of
    each TP rank, then each data-parallel group's intra- and inter-node subgroups
    (:func:`~hetplan.runtime.groups.node_split` on the cluster's nodes: made only when the
    group spans at least two nodes holding the same number of its ranks, as for a
    homogeneous plan); last, the two point-to-point groups of every rank (activations
    forward, gradients backward). Pure: no process group is touched."""
    assert plan.hetero is not None
    spec = plan.cluster.spec
    node_of = spec.node_of if spec is not None else None
    out: list[tuple[str, tuple[int, ...]]] = []
    everyone = tuple(sorted({r for st in plan.stages for r in st.ranks}))
    for st, shape in zip(plan.stages, plan.hetero.stages):
        ranks, tp = tuple(st.ranks), shape.tp
        dps = [ranks[t::tp] for t in range(tp)]
        out += [("tp", ranks[d * tp:(d + 1) * tp]) for d in range(shape.dp)]
        out += [("dp", members) for members in dps]
        for members in dps:
            out += node_split(None, members, node_of)
    return [*out, ("fwd", everyone), ("bwd", everyone)]


def hetero_groups(plan: Plan, rank: int, timeout: timedelta) -> ParallelGroups:
    """This rank's groups under ``plan.hetero`` (a collective: every rank calls it and
    creates every group of :func:`hetero_group_members`, in that order); its data-parallel
    group's intra/inter-node subgroups when the group has them, so a hierarchical routing
    runs on the stage as on a homogeneous plan."""
    me = hetero_coords(plan, rank)
    mine: dict[str, Any] = {}
    ranks: dict[str, tuple[int, ...]] = {}
    for kind, members in hetero_group_members(plan):
        group = (dist.new_group(list(members), timeout=timeout)
                 if len(members) > 1 else None)
        if rank in members:
            mine[kind], ranks[kind] = group, members
    firsts = tuple(st.ranks[0] for st in plan.stages)
    return ParallelGroups(rank, me.dp_rank, me.stage, me.tp_rank, me.dp_ranks, firsts,
                          me.tp_ranks, mine.get("dp"), None, mine.get("tp"),
                          ranks.get("intra"), ranks.get("inter"), mine.get("intra"),
                          mine.get("inter"), mine.get("fwd"), mine.get("bwd"))


class HeteroPipeline:
    """Runs one step of a heterogeneous pipeline on this rank (see the module docstring).

    Args:
        ctx: the runtime context (its groups from :func:`hetero_groups`).
        stage: this rank's stage module.
        actions: this rank's stage's action list (``(kind, micro-batch)`` in order).
    """

    def __init__(self, ctx: RuntimeContext, stage: LocalStage,
                 actions: Sequence[tuple[str, int]]) -> None:
        plan = ctx.plan
        assert plan.hetero is not None and plan.layout is not None and ctx.groups is not None
        self.stage = stage
        self.actions = list(actions)
        self.me = hetero_coords(plan, ctx.groups.rank)
        self.num_stages = len(plan.stages)
        self.mb_rows = plan.layout.micro_batch_size
        self.m = plan.layout.micro_batches
        k = self.me.stage
        firsts = [st.ranks[0] for st in plan.stages]
        self.prev: HeteroCoords | None = hetero_coords(plan, firsts[k - 1]) if k > 0 else None
        self.next: HeteroCoords | None = (hetero_coords(plan, firsts[k + 1])
                                          if k + 1 < self.num_stages else None)
        self.clock = BusyClock(cuda_events(stage.submod))  # this rank's compute per step
        # headers and receive buffers live where the activations do (NCCL sends no CPU tensor)
        self.fwd, self.bwd = ctx.groups.fwd_group, ctx.groups.bwd_group
        self.device = next((p.device for p in stage.submod.parameters()), torch.device("cpu"))

    @property
    def first(self) -> bool:
        return self.prev is None

    @property
    def last(self) -> bool:
        return self.next is None

    def step(self, ctx: RuntimeContext, xs: Sequence[torch.Tensor], y: torch.Tensor) -> float:
        """Every action of this rank's list over the global batch ``(xs, y)``; the loss of
        this replica (sum over micro-batches of its mean, divided by their number) on the
        last stage, NaN elsewhere."""
        lo, hi = replica_rows(self.mb_rows, self.me.dp, self.me.dp_rank)
        saved: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        pending: list[Any] = []
        total = 0.0
        for kind, i in self.actions:
            base = i * self.mb_rows
            if kind == "F":
                if self.first:
                    ins = [x[base + lo: base + hi] for x in xs]
                else:
                    ins = self._recv_activations(i)
                with self.clock.busy():
                    out = self.stage.submod(*ins)
                    if self.last:
                        loss = ctx.loss_fn(out, y[base + lo: base + hi]) / self.m
                        saved[i] = (ins, [loss])
                if self.last:
                    total += float(loss.detach())
                if self.last:
                    continue
                outs = list(out) if isinstance(out, (tuple, list)) else [out]
                pending += self._send_activations(i, outs)
                saved[i] = (ins, outs)
            else:
                ins, outs = saved.pop(i)
                grads = None if self.last else self._recv_grads(i, outs)
                with self.clock.busy():
                    if grads is None:
                        outs[0].backward()
                    else:
                        pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad]
                        if pairs:
                            torch.autograd.backward([o for o, _ in pairs],
                                                    [g for _, g in pairs])
                if not self.first:
                    pending += self._send_grads(i, ins)
        for work in pending:
            work.wait()
        return total if self.last else float("nan")

    # -- forward: activations ----------------------------------------------------------
    def _send_activations(self, i: int, outs: list[torch.Tensor]) -> list[Any]:
        """TP rank 0 of each sender replica: the overlapping rows to every receiver TP rank."""
        nxt = self.next
        assert nxt is not None
        if self.me.tp_rank != 0:
            return []
        work: list[Any] = []
        mylo, myhi = replica_rows(self.mb_rows, self.me.dp, self.me.dp_rank)
        for s, r, lo, hi in row_overlaps(self.mb_rows, self.me.dp, nxt.dp):
            if s != self.me.dp_rank:
                continue
            for dst in nxt.stage_ranks[r * nxt.tp:(r + 1) * nxt.tp]:
                for t in outs:
                    chunk = _rows(t, mylo, myhi, lo, hi).contiguous()
                    header = _header(len(outs), chunk)
                    work.append(dist.isend(header, dst, self.fwd, tag=_tag(i, _FWD)))
                    work.append(dist.isend(chunk, dst, self.fwd, tag=_tag(i, _FWD)))
                    work.append(_Keep(header, chunk))
        return work

    def _recv_activations(self, i: int) -> list[torch.Tensor]:
        """This replica's rows of every input tensor, assembled from the sender replicas
        (floating tensors require grad)."""
        prev = self.prev
        assert prev is not None
        chunks: list[list[torch.Tensor]] = []
        for s, r, _lo, _hi in row_overlaps(self.mb_rows, prev.dp, self.me.dp):
            if r != self.me.dp_rank:
                continue
            src = prev.stage_ranks[s * prev.tp]
            got: list[torch.Tensor] = []
            n = 1
            while len(got) < n:
                header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
                dist.recv(header, src, self.fwd, tag=_tag(i, _FWD))
                n, dtype, ndim = (int(x) for x in header[:3].tolist())
                shape = header[3:3 + ndim].tolist()
                buf = torch.empty(shape, dtype=_DTYPES[dtype], device=self.device)
                dist.recv(buf, src, self.fwd, tag=_tag(i, _FWD))
                got.append(buf)
            chunks.append(got)
        ins = [torch.cat(parts) if len(parts) > 1 else parts[0] for parts in zip(*chunks)]
        return [t.requires_grad_() if t.is_floating_point() else t for t in ins]

    # -- backward: gradients -----------------------------------------------------------
    def _send_grads(self, i: int, ins: list[torch.Tensor]) -> list[Any]:
        """TP rank 0 of each receiver replica: its input gradients' overlapping rows to every
        TP rank of the sender replica, scaled by ``dp_prev / dp`` (module docstring)."""
        prev = self.prev
        assert prev is not None
        if self.me.tp_rank != 0:
            return []
        scale = prev.dp / self.me.dp
        grads = [(t.grad if t.grad is not None else torch.zeros_like(t)) * scale
                 for t in ins if t.is_floating_point()]
        mylo, myhi = replica_rows(self.mb_rows, self.me.dp, self.me.dp_rank)
        work: list[Any] = []
        for s, r, lo, hi in row_overlaps(self.mb_rows, prev.dp, self.me.dp):
            if r != self.me.dp_rank:
                continue
            for dst in prev.stage_ranks[s * prev.tp:(s + 1) * prev.tp]:
                for g in grads:
                    chunk = _rows(g, mylo, myhi, lo, hi).contiguous()
                    work.append(dist.isend(chunk, dst, self.bwd, tag=_tag(i, _BWD)))
                    work.append(_Keep(chunk))
        return work

    def _recv_grads(self, i: int, outs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The gradient of every floating output (zeros for the others), assembled from the
        receiver replicas' TP rank 0."""
        nxt = self.next
        assert nxt is not None
        grads = [torch.zeros_like(o) for o in outs]
        mylo, myhi = replica_rows(self.mb_rows, self.me.dp, self.me.dp_rank)
        for s, r, lo, hi in row_overlaps(self.mb_rows, self.me.dp, nxt.dp):
            if s != self.me.dp_rank:
                continue
            src = nxt.stage_ranks[r * nxt.tp]
            for g in grads:
                if not g.is_floating_point():
                    continue
                view = _rows(g, mylo, myhi, lo, hi)
                buf = torch.empty_like(view, memory_format=torch.contiguous_format)
                dist.recv(buf, src, self.bwd, tag=_tag(i, _BWD))
                view.copy_(buf)
        return grads


class _Keep:
    """Holds tensors of an asynchronous send alive until the step ends."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        self.tensors = tensors

    def wait(self) -> None:
        self.tensors = ()


def _tag(micro_batch: int, direction: int) -> int:
    return 2 * micro_batch + direction


def _rows(t: torch.Tensor, mylo: int, myhi: int, lo: int, hi: int) -> torch.Tensor:
    """Rows ``[lo, hi)`` of a micro-batch, of a tensor holding rows ``[mylo, myhi)``; a
    tensor without those rows in its first dimension is sent whole (only when one chunk is
    all the receiver needs)."""
    if t.dim() == 0 or t.shape[0] != myhi - mylo:
        if (lo, hi) != (mylo, myhi):
            raise SpecError(f"a boundary tensor of shape {tuple(t.shape)} has no batch "
                            f"dimension of {myhi - mylo} rows, so it cannot be split between "
                            "stages of different data-parallel degrees; re-plan with equal "
                            "dp on both sides (or --hetero off)")
        return t
    return t[lo - mylo: hi - mylo]


def _header(n: int, t: torch.Tensor) -> torch.Tensor:
    if t.dim() > _HEADER - 3 or t.dtype not in _DTYPES:
        raise SpecError(f"a boundary tensor of dtype {t.dtype} and {t.dim()} dimensions cannot "
                        "be sent between heterogeneous stages")
    return torch.tensor([n, _DTYPES.index(t.dtype), t.dim(), *t.shape,
                         *([0] * (_HEADER - 3 - t.dim()))], dtype=torch.int64, device=t.device)

