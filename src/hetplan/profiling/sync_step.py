"""The data-parallel sync timed inside the training step the runtime runs.

:mod:`.handover` times an all-reduce after a burst of small matmuls. On the CPU presets'
machine (4 gloo processes on 2 cores) that pattern misses part of what a data-parallel step
pays for its gradient sync: with the runtime's own step around it (forward, backward with the
gradient hooks that launch the bucket's asynchronous all-reduce, the wait, the optimizer
step) the sync of gpt-test's 0.94 MB of gradients costs about 4 ms more than after matmul
bursts of the same length (``docs/decisions/cpu-fidelity.md`` section 12). So this module
measures the step itself.

:func:`profile_sync_steps` spawns ``world_size`` processes, each with its own replica of a
zoo model at the profiled micro-batch, and the runtime's gradient path over it
(:class:`~hetplan.runtime.grad_sync.GradSync` with one fp32 bucket of every gradient, the
bucket a data-parallel plan of a small model has: its hook launches the asynchronous
all-reduce when the last gradient is ready, ``finish`` waits and writes the average back) and
the optimizer the runtime builds (:func:`~hetplan.runtime.executor.plan_optimizer`). For the
whole world and for every group of each smaller size at once (as a ``dp=2`` plan's groups
sync together), in ``passes`` rounds over the groups:

1. **the step without the sync** (hooks held back, as during gradient accumulation):
   ``rounds`` steps, the mean step ``c`` (every process computing, as in training);
2. **the step with it**: ``rounds`` steps, the mean step ``r``.

The sample is ``(c, w + r_max - r)``: ``c`` the step without the sync (mean over the ranks),
and what the sync takes inside the steps with it: the mean wait ``w`` in ``finish`` plus how
much later than the mean step ``r`` the slowest rank's ``r_max`` ended (the step ends for a
data-parallel group when its last member's does). Not ``r_max - c``, which the records
before 2026-11-26 16:00 UTC hold: with every process computing and none waiting, the step
without the sync runs under more contention than the compute inside the steps with it
(gpt-test: 9.8 ms against the layer records' 3.8 ms of forward and backward and 2.1 ms of
Adam, in section 12's quiet profile), so ``r_max - c`` under-counted the sync by that
difference; the run's exposed communication is its wait in ``finish``
(``docs/decisions/cpu-fidelity.md`` section 13). It is filed as a
:class:`~hetplan.cost_models.profile_db.HandoverRecord` with operation ``allreduce_step``, the
group size, and the bucket's bytes; the cost model charges it, less
the back-to-back all-reduce line at those bytes, once per data-parallel sync in place of the
``allreduce`` record (:func:`hetplan.cost_models.evaluate._sync_wait_s`). Also returned, not
stored: how much the compute phase (forward and backward) and the wait after it take in the
steps with the sync, per rank (:class:`SyncStepTimes`).

**A compressed bucket** (``allgather_step``): the same steps with the bucket compressed
(:data:`COMPRESSOR`: DGC at 1 %, one flat all-gather of the payloads, on the gradient path's
worker thread as the runtime runs a compressed strategy). Its sample is the burst above and
what that sync takes inside the steps with it, measured the same way, less the compressor's
own work (compressing a gradient of the model with error feedback and decompressing every
member's payload, timed on every rank at once after the steps), which the cost model prices
per compressor; ``nbytes`` the gathered payloads of that gradient. What is left is what the
sync waits for beyond that work: the members that reach the all-gather late, the cores, and
the worker thread's hand-offs. On the CPU presets' machine that wait is not the all-reduce's: the
compressed step of gpt-test on the emulated 1 Gbit/s link waited about 35 ms where the
burst records (all-reduces after matmuls) gave 9 (``docs/decisions/cpu-fidelity.md``
section 22). The cost model charges it for a sync whose first unit is sparsified and
all-gathered (:func:`hetplan.cost_models.evaluate._sync_wait_s`). Under
``HETPLAN_EMULATE_BW`` both variants run on the emulated link (a profile with
``--link-kind``), as a plan's sync there does.

**A reduce and a broadcast** (``reduce_broadcast_step``): the same steps with the bucket
synced uncompressed by a reduce to one rank and a broadcast back (:data:`ROOTED`,
Espresso's root-type routing), which the runtime runs on the gradient path's worker thread
instead of launching an asynchronous all-reduce from the hooks; its sample is the burst
above and what that sync takes inside the steps with it, measured the same way; ``nbytes``
the bucket. Priced from the lines alone, that routing looked cheaper than the all-reduce
on the CPU presets' machine, and its runs were up to 15 % slower
(``docs/decisions/cpu-fidelity.md`` section 23).

**ZeRO-3** (``zero3=True``): the same replica is then sharded the way the runtime's ZeRO-3
does it (FSDP2's ``fully_shard`` on every transformer block of the captured model and on the
root, over the group; :class:`~hetplan.runtime.handlers.zero.ZeroHandler`), and its forward
and backward (FSDP2's per-block all-gathers, and its reduce-scatters, which the root's
backward waits for) are timed beside the plain replica's. Two records per group size,
``zero3_forward`` and ``zero3_backward``: the plain phase (burst) and what ZeRO-3 adds to
it, means over the ranks, ``nbytes`` the model's fp32 parameters; and ``zero3_step``: the
plain replica's optimizer step (burst) and the sharded one's (seconds: FSDP2's parameters
are DTensors, and each rank's step over its shards goes through DTensor's dispatch, several
times the plain step on a small model). On gloo the gathers and
reduce-scatters of one process group run one after the other, each waiting for the 4
processes' hand-overs, so what they add is neither the overlap nor the line the analytic
ZeRO-3 timing assumes (:func:`hetplan.cost_models.stage_times.zero_stage_times` charges the
records where a profile holds them).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hetplan.cost_models.profile_db import HandoverRecord, HandoverSample

__all__ = ["MAX_PARAMS", "SyncStepTimes", "Zero3Times", "profile_sync_steps", "summary_ms"]

log = logging.getLogger(__name__)

#: Largest model (trainable parameters) :func:`profile_sync_steps` steps: every process holds
#: a replica with its gradients and optimizer state (tiny-gpt2 and the test GPTs are far
#: below; GPT-2 small, 124 M, is above).
MAX_PARAMS = 20_000_000


@dataclass(frozen=True)
class SyncStepTimes:
    """One group size's step, in seconds (means over rounds and passes).

    Attributes:
        group_size: ranks in each data-parallel group.
        nbytes: the bucket (every gradient of the model, fp32).
        step_s: the step without the sync, mean over the ranks (the record's burst).
        added_s: what the sync takes inside the steps with it (the record's seconds): the
            mean wait (``wait_s``) plus how much later the slowest rank's step ended than
            the mean one (``slowest_step_with_sync_s - step_with_sync_s``).
        compute_s / compute_with_sync_s: forward and backward without and with the sync
            (hooks launching the bucket's all-reduce), mean over the ranks.
        wait_s: ``finish`` (the wait for the all-reduce and the write-back), mean over the
            ranks.
        step_with_sync_s / slowest_step_with_sync_s: the step with the sync, mean over the
            ranks and the slowest rank's.
        compressed_added_s: the same as ``added_s`` with the bucket compressed
            (:data:`COMPRESSOR`, one all-gather), less ``compression_s`` (never below 0):
            ``compressed_wait_s + compressed_slowest_step_with_sync_s -
            compressed_step_with_sync_s - compression_s``.
        compression_s: the compressor's own work per step, timed on every rank at once
            outside the step, on a gradient of the model, as the runtime's path does it:
            compressing the bucket with error feedback and decompressing one payload per
            member of the group.
        compressed_nbytes: the all-gather's bytes: this rank's payload of that gradient
            (values and indices) times the group size.
        compressed_wait_s / compressed_step_with_sync_s /
        compressed_slowest_step_with_sync_s: ``wait_s``, ``step_with_sync_s`` and
            ``slowest_step_with_sync_s`` of the steps with the compressed sync.
        rooted_added_s: the same as ``added_s`` with the bucket synced uncompressed by a
            reduce and a broadcast (:data:`ROOTED`): ``rooted_wait_s +
            rooted_slowest_step_with_sync_s - rooted_step_with_sync_s``.
        rooted_wait_s / rooted_step_with_sync_s / rooted_slowest_step_with_sync_s:
            ``wait_s``, ``step_with_sync_s`` and ``slowest_step_with_sync_s`` of those steps.
    """

    group_size: int
    nbytes: int
    step_s: float
    added_s: float
    compute_s: float
    compute_with_sync_s: float
    wait_s: float
    step_with_sync_s: float = 0.0
    slowest_step_with_sync_s: float = 0.0
    compressed_added_s: float = 0.0
    compression_s: float = 0.0
    compressed_nbytes: int = 0
    compressed_wait_s: float = 0.0
    compressed_step_with_sync_s: float = 0.0
    compressed_slowest_step_with_sync_s: float = 0.0
    rooted_added_s: float = 0.0
    rooted_wait_s: float = 0.0
    rooted_step_with_sync_s: float = 0.0
    rooted_slowest_step_with_sync_s: float = 0.0


#: The routines of the ``reduce_broadcast_step`` record: the bucket reduced to one rank and
#: broadcast back, uncompressed (Espresso's root-type routing, ``fp32#6``), which the runtime
#: runs on the gradient path's worker thread.
ROOTED = ("reduce", "broadcast")


#: The compressed bucket of the ``allgather_step`` record: the whole gradient under DGC at 1 %
#: synced by one flat all-gather of the payloads (:class:`CompressedSync`'s default path), the
#: strategy Espresso and Cupcake give a small model's bucket on a slow link.
COMPRESSOR = ("dgc", {"ratio": 0.01})


def _loss(out: Any, args: Sequence[Any]) -> Any:
    """The runtime's default loss: token cross-entropy when the input is tokens and the
    output holds one logit row per token, else the mean square of the output."""
    import torch

    out = getattr(out, "logits", out)
    if isinstance(out, (tuple, list)):
        out = out[0]
    tokens = args[0] if args else None
    if (isinstance(tokens, torch.Tensor) and not tokens.dtype.is_floating_point
            and out.dim() == tokens.dim() + 1 and out.shape[:-1] == tokens.shape):
        return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]),
                                                 tokens.reshape(-1))
    return out.float().pow(2).mean()


@dataclass(frozen=True)
class Zero3Times:
    """One group size's ZeRO-3 forward and backward beside the plain replica's, in seconds
    (means over the ranks, rounds and passes).

    Attributes:
        group_size: ranks in each data-parallel group.
        nbytes: the model's fp32 parameters.
        forward_s / backward_s: the plain replica's phases (no sync).
        zero3_forward_s / zero3_backward_s: the same phases under FSDP2 over the group.
        step_s / zero3_step_s: the optimizer step (``step()`` and ``zero_grad()``) of the
            plain replica and of the sharded one (FSDP2's parameters are DTensors: each
            rank steps its shards through DTensor's dispatch).
    """

    group_size: int
    nbytes: int
    forward_s: float
    backward_s: float
    zero3_forward_s: float
    zero3_backward_s: float
    step_s: float = 0.0
    zero3_step_s: float = 0.0


def _zero3(rank: int, world: int, model: str, args: Sequence[Any], kwargs: dict[str, Any],
           groups: dict[int, Any], optimizer: str, rounds: int, warmup: int,
           passes: int) -> list[Zero3Times]:
    """Runs in every rank: forward and backward of a plain replica and of one sharded as the
    runtime's ZeRO-3 does, per group size."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from hetplan import zoo
    from hetplan.ir.capture import capture
    from hetplan.ir.model import LayerKind
    from hetplan.runtime.executor import plan_optimizer

    def phases(net: Any, opt: Any) -> tuple[float, float, float]:
        f = b = s = 0.0
        for _ in range(rounds):
            t0 = time.perf_counter()
            loss = _loss(net(*args, **kwargs), args)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t3 = time.perf_counter()
            f, b, s = f + t1 - t0, b + t2 - t1, s + t3 - t2
        return f / rounds, b / rounds, s / rounds

    plain = zoo.build(model, device="cpu", seed=0)
    blocks = [lay.name for lay in capture(plain, tuple(args), kwargs, name=model).layers
              if lay.kind == LayerKind.BLOCK]
    nbytes = sum(p.numel() * 4 for p in plain.parameters() if p.requires_grad)
    plain_opt = plan_optimizer(optimizer)([p for p in plain.parameters() if p.requires_grad])
    sharded = {}
    for g, pg in sorted(groups.items()):
        net = zoo.build(model, device="cpu", seed=0)
        world_pg: Any = dist.group.WORLD
        mesh = DeviceMesh.from_group(pg if pg is not None else world_pg, "cpu")
        for name in blocks:
            fully_shard(net.get_submodule(name), mesh=mesh)
        fully_shard(net, mesh=mesh)
        sharded[g] = (net, plan_optimizer(optimizer)(list(net.parameters())))
    acc: dict[int, list[float]] = {g: [0.0] * 6 for g in sharded}
    for _ in range(passes):
        for g, (net, opt) in sharded.items():
            for _ in range(warmup):
                phases(net, opt)
            dist.barrier()
            f0, b0, s0 = phases(plain, plain_opt)
            dist.barrier()
            f1, b1, s1 = phases(net, opt)
            means = torch.tensor([f0, b0, f1, b1, s0, s1], dtype=torch.float64)
            dist.all_reduce(means)
            for i, v in enumerate(means.tolist()):
                acc[g][i] += float(v) / world / passes
            dist.barrier()
    return [Zero3Times(g, nbytes, *a) for g, a in sorted(acc.items())]


def _worker(rank: int, world: int, model: str, batch_size: int, seq: int | None,
            group_sizes: Sequence[int], optimizer: str, rounds: int, warmup: int,
            passes: int, zero3: bool = False
            ) -> tuple[list[SyncStepTimes], list[Zero3Times]]:
    """Runs in every rank: one :class:`SyncStepTimes` per group size, the slowest rank's
    added time (the same list on every rank), and with ``zero3`` one :class:`Zero3Times`
    per group size."""
    import torch
    import torch.distributed as dist

    from hetplan import zoo
    from hetplan.ir.plan_sections import (
        Bucket,
        CommStep,
        CompressedSync,
        GradientSync,
        NoSync,
    )
    from hetplan.profiling.collectives import own_groups
    from hetplan.runtime.compressors import ErrorFeedback, make_compressor, payload_bytes
    from hetplan.runtime.executor import plan_optimizer
    from hetplan.runtime.grad_sync import GradSync

    groups = own_groups(rank, world, group_sizes)
    net = zoo.build(model, device="cpu", seed=0)
    args, kwargs = zoo.example_inputs(model, batch=batch_size, seq=seq, device="cpu")
    named = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
    nbytes = sum(p.numel() * 4 for _, p in named)
    name, params = COMPRESSOR

    def section(strategy: NoSync | CompressedSync) -> GradientSync:
        return GradientSync(strategies={"s": strategy}, buckets=(
            Bucket(tensors=tuple(n for n, _ in named), size_bytes=nbytes, strategy="s"),))

    opt = plan_optimizer(optimizer)([p for _, p in named])
    plain = section(NoSync())
    packed = section(CompressedSync(compressor=name, params=dict(params),
                                    compress_device="cpu", decompress_device="cpu"))
    pg = {g: groups[g] if g != world else dist.group.WORLD for g in sorted(groups)}
    syncs = {g: GradSync(named, plain, pg[g], g) for g in sorted(groups)}
    compressed = {g: GradSync(named, packed, pg[g], g) for g in sorted(groups)}
    pair = section(NoSync(steps=tuple(
        CommStep(routine=r) for r in ROOTED)))  # type: ignore[arg-type]
    rooted = {g: GradSync(named, pair, pg[g], g) for g in sorted(groups)}
    every = (*syncs.values(), *compressed.values(), *rooted.values())
    for gs in every:  # hooks of all stay registered:
        gs.sync_enabled = False  # hold all back but the one timed (a one-bucket sync has
        # none: its bucket is launched by finish)

    def step(gs: GradSync, sync: bool, parts: list[float]) -> None:
        t0 = time.perf_counter()
        gs.sync_enabled = sync
        loss = _loss(net(*args, **kwargs), args)
        loss.backward()
        t1 = time.perf_counter()
        if sync:
            gs.finish()
        gs.sync_enabled = False
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        parts[0] += t1 - t0
        parts[1] += t2 - t1

    def mean_step(gs: GradSync, sync: bool) -> tuple[float, float, float]:
        parts = [0.0, 0.0]
        t0 = time.perf_counter()
        for _ in range(rounds):
            step(gs, sync, parts)
        return ((time.perf_counter() - t0) / rounds, parts[0] / rounds, parts[1] / rounds)

    # the compressor's work as the runtime's path does it on a real gradient: with error
    # feedback (residual added, the payload decompressed once more for the new residual),
    # a seed per iteration, and one payload per member decompressed
    comp = make_compressor(name, params)
    _loss(net(*args, **kwargs), args).backward()  # hooks held back: no sync
    grad = torch.cat([p.grad.reshape(-1).float() for _, p in named
                      if p.grad is not None])
    opt.zero_grad(set_to_none=True)
    feedback = ErrorFeedback()
    payload = feedback.compress(comp, "bucket", grad, 0)
    packed_bytes = payload_bytes(payload)

    def compression_s(g: int) -> float:
        """The compressor's work per step on a group of ``g``: compress the bucket (with
        error feedback), decompress every member's payload."""
        t0 = time.perf_counter()
        for i in range(rounds):
            out = feedback.compress(comp, "bucket", grad, i + 1)
            for _ in range(g):
                comp.decompress(out, grad.numel())
        return (time.perf_counter() - t0) / rounds

    # per group size: [step without, step with (slowest), compute without, compute with,
    # wait, step with (mean), compressed: step with (mean), wait, slowest; compression;
    # reduce and broadcast: step with (mean), wait, slowest]
    acc: dict[int, list[float]] = {g: [0.0] * 13 for g in syncs}
    for _ in range(passes):
        for g, gs in syncs.items():
            for _ in range(warmup):
                step(gs, True, [0.0, 0.0])
            dist.barrier()
            c, c_fb, _ = mean_step(gs, False)
            dist.barrier()
            r, r_fb, r_wait = mean_step(gs, True)
            for _ in range(warmup):
                step(compressed[g], True, [0.0, 0.0])
            dist.barrier()
            q, _, q_wait = mean_step(compressed[g], True)
            dist.barrier()
            work = compression_s(g)
            for _ in range(warmup):
                step(rooted[g], True, [0.0, 0.0])
            dist.barrier()
            o, _, o_wait = mean_step(rooted[g], True)
            dist.barrier()
            means = torch.tensor([c, c_fb, r_fb, r_wait, r, q, q_wait, work, o, o_wait],
                                 dtype=torch.float64)
            dist.all_reduce(means)
            slowest = torch.tensor([r, q, o], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            m = [float(x) / world / passes for x in means]
            for i, v in zip((0, 2, 3, 4, 5, 6, 7, 9, 10, 11), m):
                acc[g][i] += v
            for i, v in zip((1, 8, 12), slowest.tolist()):
                acc[g][i] += float(v) / passes
            dist.barrier()
    for gs in every:
        gs.close()
    # the sync's own time inside the steps with it: the mean wait, and how much later than
    # the mean step the slowest rank's ended (the compressed one less the compressor's work)
    dp = [SyncStepTimes(group_size=g, nbytes=nbytes, step_s=a[0],
                        added_s=max(a[4] + a[1] - a[5], 0.0), compute_s=a[2],
                        compute_with_sync_s=a[3], wait_s=a[4], step_with_sync_s=a[5],
                        slowest_step_with_sync_s=a[1],
                        compressed_added_s=max(a[7] + a[8] - a[6] - a[9], 0.0),
                        compression_s=a[9], compressed_nbytes=packed_bytes * g,
                        compressed_wait_s=a[7], compressed_step_with_sync_s=a[6],
                        compressed_slowest_step_with_sync_s=a[8],
                        rooted_added_s=max(a[11] + a[12] - a[10], 0.0), rooted_wait_s=a[11],
                        rooted_step_with_sync_s=a[10], rooted_slowest_step_with_sync_s=a[12])
          for g, a in sorted(acc.items())]
    z3 = (_zero3(rank, world, model, args, kwargs, groups, optimizer, rounds, warmup, passes)
          if zero3 else [])
    return dp, z3


def profile_sync_steps(
    model: str,
    world_size: int,
    *,
    batch_size: int = 1,
    seq: int | None = None,
    link_kind: str = "loopback",
    group_sizes: Sequence[int] | None = None,
    optimizer: str = "adam",
    rounds: int = 30,
    warmup: int = 2,
    passes: int = 3,
    timeout_s: float = 120.0,
    threads_per_process: int | None = 1,
    zero3: bool = False,
    max_params: int = MAX_PARAMS,
) -> tuple[list[HandoverRecord], list[SyncStepTimes]]:
    """Time the data-parallel gradient sync inside the runtime's step of ``model`` on
    ``world_size`` gloo processes (module docstring).

    Args:
        model: a zoo name (each process builds it with seed 0 on the CPU).
        world_size: processes (≥ 2), all stepping at once.
        batch_size / seq: each replica's micro-batch (the plans' micro-batch) and sequence.
        link_kind: the link kind the records are filed under (``loopback`` on one host).
        group_sizes: smaller data-parallel groups, every group of a size at once (default:
            every divisor of ``world_size`` from 2 below it, as :mod:`.handover`).
        optimizer: the optimizer the runtime builds for the plans (``adam``).
        rounds / warmup: timed steps per group size and variant (split over the passes),
            and untimed steps with the sync before each pass's.
        passes: rounds over all group sizes, so that each meets the same mix of the host's
            fast and slow spells.
        timeout_s: limit on the whole run.
        threads_per_process: torch threads per process (1: a training rank's share of the
            CPU presets' cores).
        zero3: also time the replica sharded as the runtime's ZeRO-3 does (module
            docstring).
        max_params: a model with more trainable parameters is not stepped (nothing is
            returned, and a log line says so): every process holds a whole replica with its
            optimizer state, which on a CPU is meant for the small models CPU plans run.

    Returns:
        One ``allreduce_step``, one ``allgather_step`` and one ``reduce_broadcast_step``
        :class:`HandoverRecord` per group size (one sample: the step without the sync, and
        what the sync takes inside the steps with it; the compressed one less the
        compressor's work), with ``zero3`` also a
        ``zero3_forward``, a ``zero3_backward`` and a ``zero3_step`` one per group size;
        and the step's parts (:class:`SyncStepTimes`) per group size.

    Raises:
        ValueError: ``world_size`` < 2, ``rounds`` or ``passes`` < 1, a group size that does
            not divide ``world_size``, or an unknown optimizer.
        SpecError: ``model`` is not in the zoo.
    """
    from hetplan import zoo
    from hetplan.profiling._spawn import run_local_ranks
    from hetplan.profiling.collectives import subgroups
    from hetplan.runtime.executor import plan_optimizer

    if world_size < 2:
        raise ValueError(f"the data-parallel sync needs world_size >= 2, got {world_size}")
    if passes < 1 or rounds < 1:
        raise ValueError(f"rounds and passes must be >= 1, got {rounds} and {passes}")
    zoo.get(model)
    plan_optimizer(optimizer)
    params = sum(p.numel() for p in zoo.build(model).parameters() if p.requires_grad)
    if params > max_params:
        log.info("data-parallel sync steps skipped: %s has %d parameters (max_params %d)",
                 model, params, max_params)
        return [], []
    if group_sizes is None:
        group_sizes = [g for g in range(2, world_size) if world_size % g == 0]
    for g in group_sizes:
        subgroups(world_size, g)
    per_pass = max(-(-rounds // passes), 1)
    results = run_local_ranks(
        _worker, world_size,
        (model, batch_size, seq, tuple(sorted(set(group_sizes) - {world_size})), optimizer,
         per_pass, warmup, passes, zero3),
        backend="gloo", timeout_s=timeout_s, threads_per_process=threads_per_process,
    )
    times: list[SyncStepTimes] = results[0][0]
    z3: list[Zero3Times] = results[0][1]

    def record(operation: str, group: int, nbytes: int, burst: float, seconds: float
               ) -> HandoverRecord:
        return HandoverRecord(operation=operation,  # type: ignore[arg-type]
                              backend="gloo", link_kind=link_kind, group_size=group,
                              processes=world_size, nbytes=nbytes,
                              samples=(HandoverSample(burst_s=burst,
                                                      seconds=max(seconds, 0.0)),))

    records = [record("allreduce_step", t.group_size, t.nbytes, t.step_s, t.added_s)
               for t in times]
    records += [record("allgather_step", t.group_size, t.compressed_nbytes, t.step_s,
                       t.compressed_added_s) for t in times]
    records += [record("reduce_broadcast_step", t.group_size, t.nbytes, t.step_s,
                       t.rooted_added_s) for t in times]
    for z in z3:
        records += [record("zero3_forward", z.group_size, z.nbytes, z.forward_s,
                           z.zero3_forward_s - z.forward_s),
                    record("zero3_backward", z.group_size, z.nbytes, z.backward_s,
                           z.zero3_backward_s - z.backward_s),
                    record("zero3_step", z.group_size, z.nbytes, z.step_s, z.zero3_step_s)]
    return records, times


def summary_ms(times: Sequence[SyncStepTimes]) -> list[dict[str, float]]:
    """``times`` in milliseconds, for reports (rounded to µs)."""
    return [{"group_size": t.group_size, "nbytes": t.nbytes,
             **{k: round(getattr(t, k) * 1e3, 3) for k in
                ("step_s", "added_s", "compute_s", "compute_with_sync_s", "wait_s",
                 "step_with_sync_s", "slowest_step_with_sync_s", "compressed_added_s",
                 "compression_s", "compressed_wait_s", "compressed_step_with_sync_s",
                 "compressed_slowest_step_with_sync_s", "rooted_added_s", "rooted_wait_s",
                 "rooted_step_with_sync_s", "rooted_slowest_step_with_sync_s")},
             "compressed_nbytes": t.compressed_nbytes}
            for t in times]
