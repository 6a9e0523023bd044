"""The ``group_sync`` section: SDPipe's semi-decentralized averaging of pipeline replicas,
and the emulated random straggler of local runs (under every policy).

With ``plan.group_sync.policy == "sdpipe"`` the data-parallel replicas of a stage no longer
all-reduce gradients in lock step (the gradient-sync handler keeps gradients local). Each
step, every rank:

1. runs its pipeline's micro-batches and steps its own optimizer (the runtime, unchanged);
2. (:meth:`GroupSyncHandler.after_step`) sleeps the emulated straggler delay, if any;
3. signals ready to the scheduler (:mod:`hetplan.runtime.sdpipe_service`, a thread on
   ``scheduler_rank``) and waits for its group;
4. averages its stage's parameters (and buffers, with ``averaged == "params+buffers"``) with
   the group: one flat ``all_reduce`` SUM on the group's process group, divided by its size
   (gloo has no AVG).

Process groups: ``prebuilt`` builds every group of ≥ 2 replicas of every stage at setup, in one
order on every rank (2^N - N - 1 per stage); ``lazy`` builds a group on its members' first use
(``new_group(use_local_synchronization=True)``; safe because a rank belongs to one stage and
receives that stage's groups in commit order).

Termination: :meth:`close` tells the scheduler this rank is done (it leaves the connectivity
requirement, so the others never wait for it), then, with ``final_full_average``, averages
all replicas of the stage once, so every replica ends with the same model; the scheduler rank
waits for every worker's done before stopping its thread. Every pipeline must train the same
number of steps (the final average is a collective of the whole stage).

What composes with group sync: ``stages`` / ``pipeline_actions`` (each pipeline runs its
schedule and flushes every step, as usual), fp32 ``precision``, and ``gradient_sync``'s local
part (accumulation across micro-batches), and 16-bit compute (the replicas average the
optimizer's fp32 master weights, then write their working weights from them, as a step does).
It does not compose with tensor parallelism (tp > 1), ZeRO sharding (zero_stage > 0),
interleaved stages, the TP resizing controller, re-balancing or sparse gradient sync: :func:`hetplan.runtime.composition.refusals` refuses those plans, and the
sdpipe pass never chooses group sync for the layouts among them.

Straggler emulation (tests, benchmarks), under every policy (synchronous data parallel too,
so runs compare alike): ``HETPLAN_EMULATE_DELAY="<p>,<delay_s>[,<seed>[,<ranks>]]"`` sleeps
this rank ``delay_s`` after a step with probability ``p`` (the paper's model; the
draws are :func:`hetplan.algorithms.sdpipe_sim.straggler_delays`, so the simulator predicts
the same delays), on every rank or only on ``ranks`` (``0+3``). ``HETPLAN_EMULATE_DELAY=plan``
uses the straggler model of the plan's embedded cluster spec.
"""

from __future__ import annotations

import itertools
import math
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hetplan.algorithms.sdpipe import AdaptiveWindow, SchedulerConfig
from hetplan.algorithms.sdpipe_sim import straggler_delays
from hetplan.errors import SpecError
from hetplan.ir.plan import Plan
from hetplan.ir.plan_group_sync import GroupSync
from hetplan.runtime.handlers.base import Handler, RuntimeContext
from hetplan.runtime.sdpipe_service import SchedulerClient, SchedulerService
from hetplan.runtime.sharded_optimizer import ShardedOptimizer

__all__ = ["ENV_DELAY", "GroupSyncHandler", "delay_setting", "emulated_delays"]

ENV_DELAY = "HETPLAN_EMULATE_DELAY"
#: Delays drawn per rank at setup; a run longer than this repeats them.
_DELAY_DRAWS = 1 << 16


def delay_setting(plan: Plan, world: int | None
                  ) -> tuple[float, float, int, set[int] | None] | None:
    """What :data:`ENV_DELAY` asks of a run of ``plan`` on ``world`` ranks (None: the ranks
    listed are not checked): ``(p, delay_s, seed, ranks)`` (``ranks`` None: every rank), None
    when unset; for ``plan`` each rank's ``p`` and ``delay_s`` are its straggler model's
    (``ClusterSpec.straggler_of``), given here as NaN. The launcher calls it before any rank
    starts, each rank at setup.

    Raises:
        SpecError: a malformed value, or ranks the run does not have, naming the variable and
            the expected form.
    """
    text = os.environ.get(ENV_DELAY, "").strip()
    if not text:
        return None
    if text == "plan":
        if plan.cluster.spec is None:
            raise SpecError(f"{ENV_DELAY}=plan: the plan embeds no cluster spec to read the "
                            "straggler model from; give '<p>,<delay_s>' instead")
        return math.nan, math.nan, 0, None
    parts = text.split(",")
    try:
        prob, delay = float(parts[0]), float(parts[1])
        seed = int(parts[2]) if len(parts) > 2 else 0
        ranks = {int(r) for r in parts[3].split("+")} if len(parts) > 3 else None
    except (IndexError, ValueError):
        raise SpecError(f"{ENV_DELAY}={text!r}: expected '<p>,<delay_s>[,<seed>[,<ranks>]]' "
                        "e.g. '0.1,0.3' or '0.1,0.3,7,0+3', or 'plan'") from None
    if not (0 <= prob <= 1 and 0 <= delay < math.inf) or len(parts) > 4:
        raise SpecError(f"{ENV_DELAY}={text!r}: need 0 <= p <= 1 and a finite delay_s >= 0 "
                        "(at most 4 comma-separated fields)")
    if world is not None and ranks is not None and (
            outside := sorted(r for r in ranks if not 0 <= r < world)):
        raise SpecError(f"{ENV_DELAY}={text!r}: rank(s) {outside} are not ranks of this run "
                        f"(0..{world - 1}); list ranks joined by '+', e.g. '0.1,0.3,7,0+3'")
    return prob, delay, seed, ranks


def emulated_delays(ctx: RuntimeContext, rank: int, stage: int, pipeline: int
                    ) -> list[float] | None:
    """This rank's per-step delays from :data:`ENV_DELAY` (None when unset or not this rank).

    Raises:
        SpecError: a malformed value, naming the variable and the expected form.
    """
    setting = delay_setting(ctx.plan, dist.get_world_size() if dist.is_initialized() else None)
    if setting is None:
        return None
    prob, delay, seed, ranks = setting
    if math.isnan(prob) and ctx.plan.cluster.spec is not None:  # 'plan'
        prob, delay = ctx.plan.cluster.spec.straggler_of(rank)
    if ranks is not None and rank not in ranks:
        return None
    return straggler_delays(seed, stage, pipeline, _DELAY_DRAWS, prob, delay)


class GroupSyncHandler(Handler):
    """Executes ``plan.group_sync`` (see the module docstring); a no-op unless its policy is
    ``sdpipe``.

    Attributes:
        group_sizes: the size of every group this rank averaged in, in order.
        delays_s: the emulated delay of every step (0 without emulation).
        stats: the scheduler's record (on the scheduler rank, after :meth:`close`).
    """

    section = "group_sync"

    def __init__(self) -> None:
        self.section_: GroupSync | None = None
        self.client: SchedulerClient | None = None
        self.service: SchedulerService | None = None
        self.groups: dict[tuple[int, ...], Any] = {}
        self.group_sizes: list[int] = []
        self.delays_s: list[float] = []
        self._delays: list[float] | None = None
        self._stage = self._pipeline = 0
        self._closed = False

    @property
    def active(self) -> bool:
        return self.section_ is not None

    def setup(self, ctx: RuntimeContext) -> None:
        lay = ctx.layout
        if dist.is_initialized():  # the emulated straggler delays every policy alike
            rank = dist.get_rank()
            self._pipeline, self._stage, _ = lay.coords(rank)
            self._delays = emulated_delays(ctx, rank, self._stage, self._pipeline)
        gs = ctx.plan.group_sync
        if gs is None or gs.policy != "sdpipe":
            return
        # what group sync does not compose with: hetplan.runtime.composition.refusals
        if not dist.is_initialized():
            raise SpecError("group_sync: policy 'sdpipe' needs a process group (run under "
                            "torchrun or `hetplan run`)")
        self.section_ = gs
        rank = dist.get_rank()
        window_s = gs.window_ms * 1e-3
        adaptive = (AdaptiveWindow(start_s=window_s, lo_s=window_s / 100, hi_s=window_s * 10)
                    if gs.window_adapt == "adaptive" and window_s > 0 else None)
        config = SchedulerConfig(num_stages=gs.num_stages, num_pipelines=gs.num_pipelines,
                                 p=gs.p, window_s=window_s, adaptive=adaptive)
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        addr: list[Any] = [None]
        if rank == gs.scheduler_rank:
            self.service = SchedulerService(config, host="" if host != "127.0.0.1"
                                            else host).start()
            addr = [(host, self.service.port)]
        dist.broadcast_object_list(addr, src=gs.scheduler_rank)
        self.client = SchedulerClient(addr[0][0], addr[0][1], self._stage, self._pipeline,
                                      timeout_s=ctx.timeout.total_seconds())
        if gs.communicator == "prebuilt":
            self._prebuild(ctx)

    def _ranks(self, ctx: RuntimeContext, members: tuple[int, ...], stage: int) -> list[int]:
        return [ctx.layout.rank_of(i, stage, 0) for i in members]

    def _prebuild(self, ctx: RuntimeContext) -> None:
        n, me = ctx.layout.dp, dist.get_rank()
        for stage in range(ctx.layout.pp):
            for size in range(2, n + 1):
                for members in itertools.combinations(range(n), size):
                    ranks = self._ranks(ctx, members, stage)
                    pg = dist.new_group(ranks, timeout=ctx.timeout)
                    if me in ranks:
                        self.groups[members] = pg

    def _group(self, ctx: RuntimeContext, members: tuple[int, ...]) -> Any:
        pg = self.groups.get(members)
        if pg is None:
            pg = dist.new_group(self._ranks(ctx, members, self._stage), timeout=ctx.timeout,
                                use_local_synchronization=True)
            self.groups[members] = pg
        return pg

    def _tensors(self, ctx: RuntimeContext, params: bool = True) -> list[torch.Tensor]:
        assert self.section_ is not None
        out = [p.data for _, p in ctx.named_params] if params else []
        if self.section_.averaged == "params+buffers":
            owned = {id(p) for _, p in ctx.named_params}
            for module in _stage_modules(ctx):
                for buf in module.buffers(recurse=False):
                    if buf.is_floating_point() and id(buf) not in owned:
                        out.append(buf.data)
        return out

    def _average(self, ctx: RuntimeContext, members: tuple[int, ...]) -> None:
        # With 16-bit compute the weights are the optimizer's fp32 master copy (the working
        # weights are its casts, rewritten from it at every step): average the masters, then
        # write the working weights from them, as a step does.
        opt = ctx.optimizer if isinstance(ctx.optimizer, ShardedOptimizer) else None
        master = opt.master if opt is not None else None
        tensors = self._tensors(ctx, params=master is None)
        if len(members) < 2 or (master is None and not tensors):
            return
        group = self._group(ctx, members)
        if opt is not None and master is not None:
            dist.all_reduce(master, op=dist.ReduceOp.SUM, group=group)
            master /= len(members)
            opt.write_working_weights()
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:  # one flat all-reduce per dtype, in the parameters' own precision
            by_dtype.setdefault(t.dtype, []).append(t)
        for same in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in same])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            flat /= len(members)
            offset = 0
            for t in same:
                n = t.numel()
                t.copy_(flat[offset : offset + n].view_as(t))
                offset += n

    def after_step(self, ctx: RuntimeContext) -> None:
        if ctx.released:
            return
        delay = 0.0
        if self._delays is not None:
            delay = self._delays[ctx.iteration % len(self._delays)]
            if delay > 0:
                time.sleep(delay)
        self.delays_s.append(delay)
        if self.section_ is None:
            return
        assert self.client is not None
        members = self.client.ready()
        self.group_sizes.append(len(members))
        self._average(ctx, members)

    def close(self, ctx: RuntimeContext) -> None:
        if self.section_ is None or self._closed:
            return
        self._closed = True
        assert self.client is not None
        self.client.done()
        if self.section_.final_full_average:
            self._average(ctx, tuple(range(ctx.layout.dp)))
        if self.service is not None:
            finished = self.service.join(ctx.timeout.total_seconds())
            self.service.stop()
            if self.service.error is not None:
                raise RuntimeError("the SDPipe scheduler failed") from self.service.error
            if not finished:
                raise RuntimeError("the SDPipe scheduler still had workers training when "
                                   "this rank closed (every pipeline must train the same "
                                   "number of steps)")
        self.client.close()
        self.groups.clear()


def _stage_modules(ctx: RuntimeContext) -> list[nn.Module]:
    """Modules whose parameters this rank trains (buffers of its stages are averaged too)."""
    owned = {id(p) for _, p in ctx.named_params}
    return [m for m in ctx.model.modules()
            if any(id(p) in owned for p in m.parameters(recurse=False))]
