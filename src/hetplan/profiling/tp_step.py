"""The runtime's tensor-parallel forward and backward, timed with every TP group at once.

A layer profile (:mod:`.layers`) times each layer unsplit; the cost model divides a TP-split
layer by ``tp`` and adds each TP collective's back-to-back line. On the CPU presets' machine
(4 gloo processes on 2 cores) that misses most of what a TP step costs: every TP collective
inside forward and backward (with sequence parallelism an all-gather before each column-split
linear and a reduce-scatter after each row-split one, the vocabulary's collectives, the
parallel cross-entropy's) blocks its rank until the group's other member arrives, and with
4 processes on 2 cores that member is often waiting for a core. For megatron-gpt-test at
micro-batch 2 the split layers' records predicted 9.8 ms of compute per iteration where the
run measured 23.0 ms (``docs/decisions/cpu-fidelity.md`` section 13).

So this module measures the phases as the runtime runs them. :func:`profile_tp_steps` spawns
``world_size`` processes; each builds the zoo model twice at the profiled micro-batch: a plain
replica, and one split by the runtime's own
:class:`~hetplan.runtime.handlers.tensor_parallel.TensorParallelHandler` (Megatron pairs,
attention by heads, the vocabulary-parallel embedding and head with the parallel
cross-entropy; with and without sequence parallelism) over consecutive groups of each TP
size, every group at once (``[0, 1]`` and ``[2, 3]`` for 2 of 4). In ``passes`` rounds over
the variants, each process runs ``rounds`` training steps (forward, backward, the handler's
after-backward sum, the optimizer the runtime builds) of the plain replica and then of the
split one, timing forward and backward. Per rank the **median** step's phases (a slow spell
of the host does not move it), then the mean over the ranks.

Filed as :class:`~hetplan.cost_models.profile_db.HandoverRecord` s, operations
``tp_forward`` / ``tp_backward`` (``tp_sp_forward`` / ``tp_sp_backward`` with sequence
parallelism), ``group_size`` the TP size, ``nbytes`` the model's fp32 parameters,
``micro_batch`` the profiled micro-batch, one sample: the plain phase (burst) and the TP
phase (seconds, the whole model's, its collectives included). The loss of the same steps is
also timed on its own (from the model's output to the loss), ``tp_loss`` / ``tp_sp_loss``:
the plain cross-entropy (burst) and the runtime's vocabulary-parallel one (seconds), three
all-reduces over the TP group; it is part of the forward record too. A pipeline computes it
on its last stage only (the trace of a run shows it there, ``docs/decisions/
cpu-fidelity.md`` section 14), so the charge gives it to that stage.
:func:`hetplan.cost_models.stage_times.stage_times` charges a TP stage its share of them.
"""

from __future__ import annotations

import logging
import statistics
import time
import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hetplan.cost_models.profile_db import HandoverRecord, HandoverSample

__all__ = ["TPStepTimes", "profile_tp_steps"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TPStepTimes:
    """One TP variant's phases in seconds (per rank the median step, then the mean over the
    ranks).

    Attributes:
        group_size: ranks in each TP group.
        sequence_parallel: whether the split model ran sequence parallelism.
        nbytes: the model's fp32 parameters.
        forward_s / backward_s: the plain (unsplit) replica's phases.
        tp_forward_s / tp_backward_s: the split model's phases.
        loss_s / tp_loss_s: the plain and the split model's loss, part of the forwards.
    """

    group_size: int
    sequence_parallel: bool
    nbytes: int
    forward_s: float
    backward_s: float
    tp_forward_s: float
    tp_backward_s: float
    loss_s: float = 0.0
    tp_loss_s: float = 0.0


def _token_loss(out: Any, target: Any) -> Any:
    """The runtime's default loss on tokens (mean token cross-entropy), which the TP handler
    turns into the parallel cross-entropy."""
    import torch

    out = getattr(out, "logits", out)
    if isinstance(out, (tuple, list)):
        out = out[0]
    return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]),
                                             target.reshape(-1))


def _split(model: str, net: Any, ir: Any, group: Any, rank: int, tp: int, sp: bool
           ) -> tuple[Any, Any, Any] | None:
    """``net`` split in place by the runtime's TP handler as a ``pp=1`` plan with even shards
    and the vocabulary split asks; (handler, context, loss), or None when nothing was split."""
    from hetplan.runtime.handlers.tensor_parallel import TensorParallelHandler
    from hetplan.runtime.tensor_parallel import ColumnParallelLinear

    # what setup reads of a RuntimeContext (tensor_parallel: None gives even shards)
    ctx = types.SimpleNamespace(
        layout=types.SimpleNamespace(tp=tp, pp=1, dp=1, sequence_parallel=sp, zero_stage=0),
        groups=types.SimpleNamespace(tp_group=group, tp_rank=rank % tp, rank=rank,
                                     dp_group=None),
        plan=types.SimpleNamespace(tensor_parallel=None, stages=[], group_sync=None,
                                   cost_settings=types.SimpleNamespace(vocab_parallel="split"),
                                   model=types.SimpleNamespace(name=model)),
        model=net, loss_fn=_token_loss, straggler=None, model_ir=lambda: ir)
    handler = TensorParallelHandler()
    handler.setup(ctx)  # type: ignore[arg-type]  # the fields setup reads
    if not any(isinstance(m, ColumnParallelLinear) for m in net.modules()):
        return None
    return handler, ctx, ctx.loss_fn


def _worker(rank: int, world: int, model: str, batch_size: int, seq: int | None,
            group_sizes: Sequence[int], optimizer: str, rounds: int, warmup: int,
            passes: int) -> list[TPStepTimes]:
    """Runs in every rank: the plain and the split phases per TP variant (module
    docstring); the same list on every rank."""
    import torch
    import torch.distributed as dist

    from hetplan import zoo
    from hetplan.ir.capture import capture
    from hetplan.profiling.collectives import own_groups
    from hetplan.runtime.executor import plan_optimizer

    groups = own_groups(rank, world, [g for g in group_sizes if g != world])
    args, kwargs = zoo.example_inputs(model, batch=batch_size, seq=seq, device="cpu")
    target = args[0]
    plain = zoo.build(model, device="cpu", seed=0)
    nbytes = sum(p.numel() * 4 for p in plain.parameters() if p.requires_grad)
    ir = capture(zoo.build(model, device="meta", seed=0), tuple(args), dict(kwargs),
                 name=model)
    variants: dict[tuple[int, bool], tuple[Any, Any, Any, Any, Any]] = {}
    for g in sorted(group_sizes):
        for sp in (False, True):
            net = zoo.build(model, device="cpu", seed=0)
            split = _split(model, net, ir, groups[g] if g != world else None, rank, g, sp)
            if split is not None:
                opt = plan_optimizer(optimizer)([p for p in net.parameters()
                                                 if p.requires_grad])
                variants[(g, sp)] = (net, opt, *split)
    plain_opt = plan_optimizer(optimizer)([p for p in plain.parameters() if p.requires_grad])

    def step(net: Any, opt: Any, loss_fn: Any, after: Any, out: list[list[float]]) -> None:
        t0 = time.perf_counter()
        output = net(*args, **kwargs)
        t_out = time.perf_counter()
        loss = loss_fn(output, target)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if after is not None:
            after()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out[0].append(t1 - t0)
        out[1].append(t2 - t1)
        out[2].append(t1 - t_out)

    base: list[list[float]] = [[], [], []]
    split_t: dict[tuple[int, bool], list[list[float]]] = {k: [[], [], []] for k in variants}
    for _ in range(passes):
        for key, (net, opt, handler, ctx, loss_fn) in variants.items():
            after = (lambda h=handler, c=ctx: h.after_backward(c))
            for _ in range(warmup):
                step(net, opt, loss_fn, after, [[], [], []])
            dist.barrier()
            for _ in range(rounds):
                step(plain, plain_opt, _token_loss, None, base)
            dist.barrier()
            for _ in range(rounds):
                step(net, opt, loss_fn, after, split_t[key])
            dist.barrier()
    out = []
    for (g, sp), (f, b, lo) in sorted(split_t.items()):
        mine = torch.tensor([statistics.median(base[0]), statistics.median(base[1]),
                             statistics.median(f), statistics.median(b),
                             statistics.median(base[2]), statistics.median(lo)],
                            dtype=torch.float64)
        dist.all_reduce(mine)
        m = [float(v) / world for v in mine.tolist()]
        out.append(TPStepTimes(g, sp, nbytes, forward_s=m[0], backward_s=m[1],
                               tp_forward_s=m[2], tp_backward_s=m[3], loss_s=m[4],
                               tp_loss_s=m[5]))
    return out


def profile_tp_steps(
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
    timeout_s: float = 180.0,
    threads_per_process: int | None = 1,
    max_params: int | None = None,
) -> tuple[list[HandoverRecord], list[TPStepTimes]]:
    """Time the runtime's tensor-parallel forward and backward of ``model`` on
    ``world_size`` gloo processes, every TP group at once (module docstring).

    Args:
        model: a zoo name (each process builds it with seed 0 on the CPU).
        world_size: processes (≥ 2), all stepping at once.
        batch_size / seq: the micro-batch each process runs (the plans' micro-batch).
        link_kind: the link kind the records are filed under (``loopback`` on one host).
        group_sizes: TP sizes (default: every divisor of ``world_size`` from 2 on).
        optimizer: the optimizer the runtime builds for the plans (``adam``).
        rounds / warmup: timed steps per variant (split over the passes), and untimed steps
            before each pass's.
        passes: rounds over all variants, so that each meets the same mix of the host's
            fast and slow spells.
        timeout_s: limit on the whole run.
        threads_per_process: torch threads per process (1: a training rank's share of the
            CPU presets' cores).
        max_params: a model with more trainable parameters is not stepped (default
            :data:`~hetplan.profiling.sync_step.MAX_PARAMS`; nothing is returned).

    Returns:
        Per TP size and sequence-parallel mode the model can be split in, a forward, a
        backward and a loss record; and the phases (:class:`TPStepTimes`).

    Raises:
        ValueError: ``world_size`` < 2, ``rounds`` or ``passes`` < 1, a group size that does
            not divide ``world_size``, or an unknown optimizer.
        SpecError: ``model`` is not in the zoo.
    """
    from hetplan import zoo
    from hetplan.profiling._spawn import run_local_ranks
    from hetplan.profiling.collectives import subgroups
    from hetplan.profiling.sync_step import MAX_PARAMS
    from hetplan.runtime.executor import plan_optimizer

    if world_size < 2:
        raise ValueError(f"tensor parallelism needs world_size >= 2, got {world_size}")
    if passes < 1 or rounds < 1:
        raise ValueError(f"rounds and passes must be >= 1, got {rounds} and {passes}")
    zoo.get(model)
    plan_optimizer(optimizer)
    limit = MAX_PARAMS if max_params is None else max_params
    params = sum(p.numel() for p in zoo.build(model).parameters() if p.requires_grad)
    if params > limit:
        log.info("tensor-parallel steps skipped: %s has %d parameters (max_params %d)",
                 model, params, limit)
        return [], []
    if group_sizes is None:
        group_sizes = [g for g in range(2, world_size + 1) if world_size % g == 0]
    for g in group_sizes:
        subgroups(world_size, g)
    per_pass = max(-(-rounds // passes), 1)
    times: list[TPStepTimes] = run_local_ranks(
        _worker, world_size,
        (model, batch_size, seq, tuple(sorted(set(group_sizes))), optimizer, per_pass,
         warmup, passes),
        backend="gloo", timeout_s=timeout_s, threads_per_process=threads_per_process,
    )[0]
    records = []
    for t in times:
        op = "tp_sp_" if t.sequence_parallel else "tp_"
        for phase, burst, seconds in (("forward", t.forward_s, t.tp_forward_s),
                                      ("backward", t.backward_s, t.tp_backward_s),
                                      ("loss", t.loss_s, t.tp_loss_s)):
            records.append(HandoverRecord(
                operation=op + phase,  # type: ignore[arg-type]  # validated by the record
                backend="gloo", link_kind=link_kind, group_size=t.group_size,
                processes=world_size, nbytes=t.nbytes, micro_batch=batch_size,
                samples=(HandoverSample(burst_s=burst, seconds=seconds),)))
    return records, times
