"""The Chimera schedule (Li & Hoefler, SC'21): two model replicas run the pipeline in opposite
directions, and this runtime executes the plan's action lists for it.

**Layout.** Pipeline rank ``r`` of a data-parallel replica holds two stages: stage ``r`` of the
*down* pipeline and stage ``P-1-r`` of the *up* pipeline (``P`` is even, so the two differ and
share no layer). Micro-batches come in units of ``P``; the first half of each unit goes down
(stage ``s`` on rank ``s``), the second half up (stage ``s`` on rank ``P-1-s``). The plan's
lists say which rank runs each ``F``/``B`` of each micro-batch and stage
(:meth:`~hetplan.ir.pipeline_order.PipelineSchedule.index` gives the rank of every
``(micro-batch, stage)``); the executor takes the peers of every transfer from there, not
from a formula of its own.

**Why not torch's schedule runtime** (which runs every other schedule,
:mod:`hetplan.runtime.schedule`): its stages form one chain, ``0 -> 1 -> ... -> S-1``, through
which every micro-batch passes, with the model's inputs at stage 0 and the loss after stage
``S-1``. Chimera's up micro-batches enter at the rank holding the down pipeline's last stage
and leave at the rank holding its first: two chains over the same ranks, which torch's
stages (one index, one neighbour each way) do not describe.

**Execution** (:class:`ChimeraPipeline`): each rank runs its list in order. A forward of
stage ``s > 0`` first receives its inputs from the rank that ran ``(m, s-1)``; its outputs
are sent, asynchronously, to the rank running ``(m, s+1)``; the last stage computes the loss
instead. A backward of a stage other than the last receives the gradients of its floating
outputs from the rank that ran ``(m, s+1)``, and (for ``s > 0``) sends those of its floating
inputs back. Receives block; a send's tensor is released once the send is done (looked at
after every send, without blocking: NCCL's work reports it; gloo's (torch 2.13) reports a
send done only once it was waited for, so CPU ranks still hold every sent tensor to the
step's end), and what is still in flight is waited for at the end of the step: the plan's
validator simulates the lists to completion, so executing them in order
with blocking receives cannot deadlock, once every pair is connected. NCCL connects two
ranks of a group at their first message and blocks both hosts until both are there, which
the first sends of the two directions would turn into a deadlock: at setup every pair
exchanges one message, in one global order (:func:`warm_up`). Not run here: NCCL takes one
GPU per rank, and the lent machines have one. The receive buffers' shapes and dtypes come
from one forward of a micro-batch through every stage at setup (without gradients), so no
message carries a header. Transfers run on four point-to-point groups per replica, one per
kind (activation, gradient) and direction along the ranks (towards higher or lower ranks):
NCCL runs the operations between two ranks of one group in the order each posts them, and
within one such group and pair both sides post in the micro-batches' order (checked at
setup, with a :class:`SpecError` if a list breaks it). Gloo tags each message by
micro-batch, stage and kind as well.

**Gradients.** Every micro-batch's loss is divided by ``M / 2``, the micro-batches of its
direction: each replica of a stage then holds the mean gradient over its direction's
micro-batches, and averaging the ``2 · dp`` copies of a stage (both directions of every
data-parallel replica) gives the gradient of the mean loss over the global batch, what one
process computes. That average is the plan's gradient sync, run unchanged over the
*Chimera group* of rank ``r``: the data-parallel replicas of pipeline ranks ``r`` and
``P-1-r``, which hold the same two stages (the stage handler gives the gradient-sync and
ZeRO-1 handlers this group as ``ParallelGroups.dp_group``; ``dp_rank`` stays the rank's
data replica, whose rows it trains). A rank orders its parameters by stage index, so both
halves of the group hold the same buckets in the same order.

**Tied parameters** (an embedding tied to the LM head, on the first and the last stage): the
ranks holding stage 0 also hold stage ``P-1`` (``r = 0`` and ``r = P-1``), so both uses are in
one process. The split gives each stage a copy of its own; the stage handler points every
local copy at one parameter again, so autograd sums both uses and the plan's gradient sync
(which lists the tensor once) syncs it once, with one strategy. A parameter tied across
stages that no rank holds together is refused.

**The loss.** The ranks holding the last stage (``0`` and ``P-1``) each hold one direction's
losses; they sum them over their pair (one all-reduce of a scalar per step) and both report
the replica's loss; the other ranks report NaN.

Not composed (:mod:`hetplan.runtime.composition`): tensor parallelism, ZeRO-2/3 (collectives
inside backward, while the two directions run different stages), per-stage degrees,
hierarchical gradient-sync routings, Zen sparse sync, SDPipe group sync, re-balancing.

``hetplan run --trace`` marks, per action of the rank's list, the ``action`` span, its
``wait`` for what it receives, its ``compute`` (the last stage's forward without its loss)
and the last stage's ``loss``, as torch's schedule is marked.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from hetplan.algorithms.pipeline_schedules import Action, ActionKind, PipelineSchedule
from hetplan.errors import SpecError
from hetplan.ir.pipeline_order import (
    TRANSFER_ACT,
    TRANSFER_GRAD,
    chimera_shape_problem,
    transfer_order_problem,
    transfers,
)
from hetplan.ir.plan_sections import Layout
from hetplan.runtime.busy_clock import BusyClock, cuda_events
from hetplan.runtime.groups import ParallelGroups
from hetplan.runtime.handlers.base import RuntimeContext

if TYPE_CHECKING:
    from hetplan.runtime.trace import StepTrace

__all__ = ["Boundary", "ChimeraGroups", "ChimeraPipeline", "boundaries", "check_chimera_shape",
           "check_transfer_order", "chimera_group_members", "chimera_groups", "warm_up"]

_ACT, _GRAD = TRANSFER_ACT, TRANSFER_GRAD


def chimera_group_members(layout: Layout) -> list[tuple[str, tuple[int, ...]]]:
    """Every group a Chimera plan adds, as ``(kind, global ranks)``, in the order every rank
    creates them: per pipeline-rank pair ``{r, P-1-r}`` the sync group (its data-parallel
    replicas of both); per replica its loss pair (pipeline ranks 0 and ``P-1``) and its four
    point-to-point groups (``act+``, ``act-``, ``grad+``, ``grad-``: activations or gradients
    moving towards higher or lower ranks). Pure: no process group is touched."""
    p, dp = layout.pp, layout.dp
    out: list[tuple[str, tuple[int, ...]]] = []
    for r in range(p // 2):
        out.append(("sync", tuple(sorted(layout.rank_of(d, x, 0)
                                         for d in range(dp) for x in (r, p - 1 - r)))))
    for d in range(dp):
        chain = tuple(layout.rank_of(d, x, 0) for x in range(p))
        out.append(("loss", (chain[0], chain[-1])))
        out += [(kind, chain) for kind in ("act+", "act-", "grad+", "grad-")]
    return out


@dataclass(frozen=True)
class ChimeraGroups:
    """This rank's Chimera groups: the sync group's ranks and group, the loss pair's group,
    and the point-to-point groups by kind (``act+`` ...)."""

    sync_ranks: tuple[int, ...]
    sync: Any
    loss: Any
    p2p: dict[str, Any]

    def data_parallel(self, groups: ParallelGroups) -> ParallelGroups:
        """``groups`` with the sync group as the data-parallel group (no intra/inter split:
        the runtime composes Chimera with flat routings only); ``dp_rank`` is kept, the rank's
        data replica."""
        return replace(groups, dp_group=self.sync, dp_ranks=self.sync_ranks,
                       dp_intra_ranks=None, dp_inter_ranks=None, dp_intra_group=None,
                       dp_inter_group=None)


def chimera_groups(ctx: RuntimeContext) -> ChimeraGroups:
    """Create every group of :func:`chimera_group_members` (a collective: every rank calls it,
    in the same order) and return this rank's."""
    assert ctx.groups is not None
    me = ctx.groups.rank
    sync_ranks: tuple[int, ...] = ()
    mine: dict[str, Any] = {}
    for kind, members in chimera_group_members(ctx.layout):
        group = dist.new_group(list(members), timeout=ctx.timeout)
        if me in members:
            mine[kind] = group
            if kind == "sync":
                sync_ranks = members
    return ChimeraGroups(sync_ranks, mine["sync"], mine.get("loss"),
                         {k: mine[k] for k in ("act+", "act-", "grad+", "grad-")})


def check_transfer_order(sched: PipelineSchedule) -> None:
    """Refuse lists whose two ends of one kind of transfer between two ranks post in different
    orders (NCCL would pair the wrong messages, see the module docstring). The plan's
    validator refuses them before launch (rule 4, the same pure check:
    :func:`~hetplan.ir.pipeline_order.transfer_order_problem`).

    Raises:
        SpecError: naming the two ranks and the first micro-batches that differ.
    """
    if (bad := transfer_order_problem(sched)) is not None:
        raise SpecError(f"pipeline_actions.ranks[{bad[0]}]: {bad[1]}: re-run `hetplan plan`")


def check_chimera_shape(sched: PipelineSchedule) -> None:
    """Refuse lists that are not Chimera's shape, which the sync groups and the loss scale
    assume (:func:`~hetplan.ir.pipeline_order.chimera_shape_problem`, which the plan's
    validator runs before launch too).

    Raises:
        SpecError: naming the first micro-batch that breaks it.
    """
    if problem := chimera_shape_problem(sched):
        raise SpecError(f"pipeline_actions.ranks: {problem}; re-run "
                        "`hetplan plan --schedule chimera`")


def warm_up(sched: PipelineSchedule, groups: ChimeraGroups, chain: Sequence[int],
            pp_rank: int, device: torch.device) -> None:
    """One small blocking message on every (group, pair) the step uses, in one global order.

    NCCL connects two ranks of a group for point-to-point lazily, at their first message,
    and the connection blocks the host until both have reached it. In the step, rank 0's
    first send (down, on ``act+``) and rank ``P-1``'s (up, on ``act-``) would each wait for
    a peer still blocked in its own: a deadlock at the first step. Here every rank walks
    the same sorted list of ``(source, destination, kind)`` and takes part in its own
    entries; the earliest entry not done always has both ends at it, so the walk ends.
    On gloo the messages only cost a round trip each, once."""
    sent, _ = transfers(sched)
    one = torch.zeros(1, device=device)
    for src, dst, kind in sorted(sent):
        if pp_rank not in (src, dst):
            continue
        group = groups.p2p[("act" if kind == _ACT else "grad") + ("+" if dst > src else "-")]
        if pp_rank == src:
            dist.send(one, chain[dst], group)
        else:
            dist.recv(one, chain[src], group)


@dataclass
class Boundary:
    """What stage ``s`` hands to stage ``s+1`` for one micro-batch: shapes, dtypes."""

    shapes: list[torch.Size]
    dtypes: list[torch.dtype]


class ChimeraPipeline:
    """Runs one step of this rank's Chimera list (see the module docstring).

    Args:
        ctx: the runtime context.
        modules: this rank's stage modules by stage index (parameters shared with the model).
        schedule: the plan's schedule (every rank's list; this rank runs its pipeline rank's).
        boundaries: per stage ``s < S-1``, what it sends to ``s+1`` (from :func:`boundaries`).
        groups: this rank's Chimera groups.
    """

    def __init__(self, ctx: RuntimeContext, modules: dict[int, nn.Module],
                 schedule: PipelineSchedule, boundaries: Sequence[Boundary],
                 groups: ChimeraGroups) -> None:
        assert ctx.groups is not None
        self.modules = modules
        self.schedule = schedule
        _, self.rank_of = schedule.index()
        self.pp_rank = ctx.groups.pp_rank
        self.chain = ctx.groups.pp_ranks  # global rank of every pipeline rank of the replica
        self.actions: list[Action] = list(schedule.actions[self.pp_rank])
        self.num_stages = schedule.num_stages
        self.boundaries = list(boundaries)
        self.groups = groups
        self.mb_rows = ctx.layout.micro_batch_size
        self.per_direction = ctx.layout.micro_batches // 2
        first = next(iter(modules.values()))
        self.device = next((p.device for p in first.parameters()), torch.device("cpu"))
        self.clock = BusyClock(cuda_events(first))
        self.trace: StepTrace | None = None  # ``hetplan run --trace``: the step's marks

    def _peer(self, m: int, s: int) -> int:
        """The global rank running stage ``s`` of micro-batch ``m`` in this replica."""
        return self.chain[self.rank_of[m * self.num_stages + s]]

    def _group(self, kind: int, src_pp: int, dst_pp: int) -> Any:
        """The group of ``kind`` for a transfer from pipeline rank ``src_pp`` to ``dst_pp``."""
        up = dst_pp > src_pp
        return self.groups.p2p[("act" if kind == _ACT else "grad") + ("+" if up else "-")]

    def _tag(self, m: int, s: int, kind: int) -> int:
        return 2 * (m * self.num_stages + s) + kind

    def step(self, ctx: RuntimeContext, xs: Sequence[torch.Tensor], y: torch.Tensor) -> float:
        """Every action of this rank's list over the replica's rows ``(xs, y)``; the
        replica's loss on the ranks holding the last stage, NaN elsewhere."""
        last = self.num_stages - 1
        rows_needed = self.schedule.num_microbatches * self.mb_rows
        if any(x.shape[0] != rows_needed for x in (*xs, y)):
            raise SpecError(f"the replica's batch has {[x.shape[0] for x in (*xs, y)]} rows; "
                            f"the plan's {self.schedule.num_microbatches} micro-batches of "
                            f"{self.mb_rows} need {rows_needed}: pass the plan's global batch")
        saved: dict[tuple[int, int], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        pending: list[Any] = []
        losses: list[torch.Tensor] = []
        trace = self.trace if self.trace is not None and self.trace.recording else None
        for index, a in enumerate(self.actions):
            m, s, k = a.microbatch, a.stage, a.kind.value
            rows = slice(m * self.mb_rows, (m + 1) * self.mb_rows)
            t_action = time.perf_counter()
            if a.kind is ActionKind.F:
                ins = [x[rows] for x in xs] if s == 0 else self._recv_activations(m, s)
                t_in = time.perf_counter()
                with self.clock.busy() as host:
                    out = self.modules[s](*ins)
                    t_loss = time.perf_counter()
                    if s == last:
                        loss = ctx.loss_fn(out, y[rows]) / self.per_direction
                if s == last:
                    losses.append(loss.detach())
                    saved[(m, s)] = (ins, [loss])
                else:
                    outs = list(out) if isinstance(out, (tuple, list)) else [out]
                    self._check_boundary(outs, s)
                    pending = _reap(pending) + self._send(outs, m, s + 1, _ACT)
                    saved[(m, s)] = (ins, outs)
            else:
                ins, outs = saved.pop((m, s))
                grads = None if s == last else self._recv_grads(m, s, outs)
                t_in = time.perf_counter()
                with self.clock.busy() as host:
                    if grads is None:
                        outs[0].backward()
                    else:
                        pairs = [(o, g) for o, g in zip(outs, grads, strict=True)
                                 if o.requires_grad]
                        if pairs:
                            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                if s > 0:
                    grads_in = [t.grad if t.grad is not None else torch.zeros_like(t)
                                for t in ins if t.is_floating_point()]
                    pending = _reap(pending) + self._send(grads_in, m, s - 1, _GRAD)
            if trace is not None:  # as torch's schedule is marked (schedule.trace_schedule)
                args: dict[str, Any] = {"kind": k, "microbatch": m, "stage": s}
                trace.add(f"{k}{m} s{s}", "action", t_action, time.perf_counter(),
                          index=index, **args)
                if t_in > t_action and (s > 0 if k == "F" else s < last):
                    trace.add(f"wait {k}{m} s{s}", "wait", t_action, t_in, **args)
                end = host[1] if k == "B" or s != last else t_loss
                trace.add(f"{k}{m} s{s}", "compute", host[0], end, **args)
                if k == "F" and s == last:
                    trace.add(f"loss{m} s{s}", "loss", t_loss, host[1], microbatch=m, stage=s)
        for sent in pending:
            sent.work.wait()
        return self._loss(losses)

    def _check_boundary(self, outs: list[torch.Tensor], s: int) -> None:
        """Stage ``s``'s outputs have the shapes and dtypes its receiver's buffers were made
        for (metadata only): a mismatch would fail inside gloo, or hang or corrupt on NCCL."""
        b = self.boundaries[s]
        if [t.shape for t in outs] != b.shapes or [t.dtype for t in outs] != b.dtypes:
            raise SpecError(f"stage {s} returned {[(tuple(t.shape), t.dtype) for t in outs]}, "
                            f"its next stage expects {list(zip(map(tuple, b.shapes), b.dtypes))}"
                            " (set from the example inputs at setup): train with inputs of "
                            "the shapes the plan was made for")

    def _loss(self, losses: list[torch.Tensor]) -> float:
        """The replica's loss: the two directions' means, summed over the loss pair and
        halved (NaN on ranks without the last stage)."""
        if self.groups.loss is None:
            return float("nan")
        total = (torch.stack(losses).sum() if losses
                 else torch.zeros((), device=self.device)) / 2
        dist.all_reduce(total, group=self.groups.loss)
        return float(total)

    def _send(self, tensors: list[torch.Tensor], m: int, dst_stage: int,
              kind: int) -> list[_Sent]:
        """Send ``tensors`` to the rank running ``(m, dst_stage)`` (asynchronously)."""
        dst = self._peer(m, dst_stage)
        dst_pp = self.rank_of[m * self.num_stages + dst_stage]
        group, tag = self._group(kind, self.pp_rank, dst_pp), self._tag(m, dst_stage, kind)
        out: list[_Sent] = []
        for t in tensors:
            chunk = t.detach().contiguous()
            out.append(_Sent(dist.isend(chunk, dst, group, tag=tag), chunk))
        return out

    def _recv_activations(self, m: int, s: int) -> list[torch.Tensor]:
        """Stage ``s``'s inputs for micro-batch ``m`` (floating ones require grad)."""
        src_pp = self.rank_of[m * self.num_stages + s - 1]
        src = self.chain[src_pp]
        group, tag = self._group(_ACT, src_pp, self.pp_rank), self._tag(m, s, _ACT)
        b = self.boundaries[s - 1]
        out = []
        for shape, dtype in zip(b.shapes, b.dtypes, strict=True):
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            dist.recv(buf, src, group, tag=tag)
            out.append(buf.requires_grad_() if buf.is_floating_point() else buf)
        return out

    def _recv_grads(self, m: int, s: int, outs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The gradients of stage ``s``'s floating outputs of micro-batch ``m`` (zeros for
        the others), from the rank that ran its backward on ``s+1``."""
        src_pp = self.rank_of[m * self.num_stages + s + 1]
        src = self.chain[src_pp]
        group, tag = self._group(_GRAD, src_pp, self.pp_rank), self._tag(m, s, _GRAD)
        grads = []
        for o in outs:
            if not o.is_floating_point():
                grads.append(torch.zeros_like(o))
                continue
            g = torch.empty(o.shape, dtype=o.dtype, device=o.device)  # contiguous for recv
            dist.recv(g, src, group, tag=tag)
            grads.append(g)
        return grads


class _Sent(NamedTuple):
    """An asynchronous send and the tensor it reads, held together until the send is done
    (a chunk must outlive its send; holding it longer holds its memory for nothing)."""

    work: Any
    chunk: torch.Tensor


def _reap(pending: list[_Sent]) -> list[_Sent]:
    """The sends of ``pending`` not yet done, in order: the done ones' chunks are released
    as the step goes (a rank of a Chimera plan sends every micro-batch's activations and
    input gradients of both its stages; held until the step's end, they would add all of
    them to its peak). ``is_completed`` asks without blocking (gloo's isend answers False
    until ``wait``, so on CPU nothing is released before the step's end, as before: a
    two-process check, send then sleep past the receive, still read False); a done send is
    still waited for (it returns at once), so a send that failed raises its error here, as
    the waits at the step's end did before, instead of being dropped unseen."""
    kept = []
    for p in pending:
        if p.work.is_completed():
            p.work.wait()
        else:
            kept.append(p)
    return kept


def boundaries(modules: Sequence[nn.Module], example: Sequence[Any]) -> list[Boundary]:
    """What every stage but the last sends to the next one, for one micro-batch: one forward
    of ``example`` through all ``modules`` in order, without gradients (the receivers'
    buffers; every micro-batch has the plan's ``micro_batch_size`` rows)."""
    out: list[Boundary] = []
    ins: list[Any] = list(example)
    with torch.no_grad():
        for mod in modules[:-1]:
            got = mod(*ins)
            ins = list(got) if isinstance(got, (tuple, list)) else [got]
            if not all(isinstance(t, torch.Tensor) for t in ins):
                raise SpecError(f"a pipeline stage returned {[type(t).__name__ for t in ins]};"
                                " the Chimera runtime sends tensors only")
            out.append(Boundary([t.shape for t in ins], [t.dtype for t in ins]))
    return out
