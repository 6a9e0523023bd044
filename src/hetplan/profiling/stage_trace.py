"""The runtime's traced pipeline stages timed against the eager model they come from.

A pipeline plan (``pp > 1``) does not run the model's own modules: the runtime traces the
model with ``torch.distributed.pipelining.pipeline()`` (``torch.export`` underneath) and each
rank runs its stage's ``GraphModule`` (:func:`hetplan.runtime.pipeline.build_stages`). The
layer records (:mod:`.layers`) time the eager modules. On the CPU presets' machine the traced
stages of gpt-test take about twice as long for the same forward and backward, almost all
of it in forward (one process, one thread, micro-batch 2, medians: forward 2.87 against
0.85 ms, backward 1.60 against 1.45 ms; ``docs/decisions/cpu-fidelity.md`` section 13),
which is what ``pp`` and ``interleaved`` missed in compute (5.3 / 8.7 and 4.2 / 7.3 ms in
section 12).

:func:`profile_traced_stages` spawns ``world_size`` processes (one thread each, as training
ranks); each builds the zoo model twice, splits one copy the way the runtime does
(:func:`~hetplan.runtime.pipeline.stage_modules`) with a stage boundary before every
transformer block after the first, and runs, in ``passes`` rounds, training steps of the
eager model and of the chained stages (forward with the loss, backward), timing each phase.
**One process at a time** (the others wait): what is wanted is the ratio of the two code
paths, the contention of 4 processes on 2 cores is in the layer records it scales; timed
with all 4 computing at once the traced forward came out 6-10 times the eager one in two
profiles at load 2-4 (the run's stages, which compute while other stages wait, paid 1.6
times overall). Per rank the median step, then the mean over the ranks. Filed as
:class:`~hetplan.cost_models.profile_db.HandoverRecord` s (the runtime's phases, like the
``tp_*`` records): ``traced_forward`` / ``traced_backward``, ``group_size`` the node's processes (the
plans the ratio applies to), ``nbytes`` the model's fp32 parameters, ``micro_batch`` the one timed,
one sample: the eager phase (burst) and the traced one (seconds).

**Measured, not charged.** Scaling a pipeline stage's layer records by this ratio
over-predicted the pipelines' compute about twice in the quiet run of section 13 (``pp``
14.9 ms against 7.1 measured, ``interleaved`` 13.3 against 8.1): the layer records carry the
contention of 4 processes computing at once, and a pipeline's stages compute while other
stages wait, which in that run made up for the slower traced code. No cost model reads the
records; they stay in the profile for a model of the pipelines' contention.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hetplan.cost_models.profile_db import HandoverRecord, HandoverSample

__all__ = ["TracedStageTimes", "profile_traced_stages"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TracedStageTimes:
    """The eager model's and the traced stages' phases in seconds (per rank the median
    step, then the mean over the ranks).

    Attributes:
        processes: processes the profile ran (each timed alone, in turn).
        nbytes: the model's fp32 parameters.
        stages: stages the model was split into.
        forward_s / backward_s: the eager model's phases.
        traced_forward_s / traced_backward_s: the chained traced stages' phases.
    """

    processes: int
    nbytes: int
    stages: int
    forward_s: float
    backward_s: float
    traced_forward_s: float
    traced_backward_s: float


def _block_stages(ir: Any) -> list[Any]:
    """Stages of ``ir`` with a boundary before every transformer block after the first (the
    first stage holds what precedes the second block, the last what follows the last)."""
    from hetplan.ir.model import LayerKind
    from hetplan.ir.plan_sections import Stage

    names = [lay.name for lay in ir.layers]
    starts = [i for i, lay in enumerate(ir.layers) if lay.kind == LayerKind.BLOCK
              and "@" not in lay.name][1:]
    bounds = [0, *starts, len(names)]
    return [Stage(index=k, first_layer=a, last_layer=b - 1, layer_names=tuple(names[a:b]),
                  ranks=(0,)) for k, (a, b) in enumerate(zip(bounds, bounds[1:]))]


def _loss(out: Any, target: Any) -> Any:
    import torch

    out = getattr(out, "logits", out)
    if isinstance(out, (tuple, list)):
        out = out[0]
    return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]),
                                             target.reshape(-1))


def _worker(rank: int, world: int, model: str, batch_size: int, seq: int | None,
            rounds: int, warmup: int, passes: int) -> TracedStageTimes | None:
    """Runs in every rank: the eager and the traced phases (module docstring); None on
    every rank when the model cannot be split into traced stages."""
    import torch
    import torch.distributed as dist

    from hetplan import zoo
    from hetplan.ir.capture import capture
    from hetplan.runtime.pipeline import stage_modules

    args, kwargs = zoo.example_inputs(model, batch=batch_size, seq=seq, device="cpu")
    target = args[0]
    eager = zoo.build(model, device="cpu", seed=0)
    ir = capture(zoo.build(model, device="meta", seed=0), tuple(args), dict(kwargs),
                 name=model)
    stages = _block_stages(ir)
    ok = torch.tensor([1.0])
    mods: list[Any] = []
    if len(stages) > 1:
        try:
            split = stage_modules(zoo.build(model, device="cpu", seed=0), args, kwargs,
                                  stages, list(range(len(stages))),
                                  ir_layer_names=[lay.name for lay in ir.layers])
            mods = [split[i] for i in range(len(stages))]
        except Exception as e:  # noqa: BLE001 - a model the runtime cannot trace: no record
            log.info("traced stages of %s not timed: %s", model, e)
    if not mods or any(type(m).__name__ != "GraphModule" for m in mods):
        ok.zero_()  # manual stages run the eager modules: nothing to time
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if ok.item() == 0:
        return None

    def chained(x: Any) -> Any:
        h = x
        for m in mods:
            h = m(*h) if isinstance(h, tuple) else m(h)
        return h[0] if isinstance(h, tuple) and len(h) == 1 else h

    def step(forward: Any, params: Any, out: list[list[float]] | None) -> None:
        t0 = time.perf_counter()
        loss = _loss(forward(), target)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        for p in params:
            p.grad = None
        if out is not None:
            out[0].append(t1 - t0)
            out[1].append(t2 - t1)

    runs = {"eager": (lambda: eager(*args, **kwargs), list(eager.parameters())),
            "traced": (lambda: chained(args[0]),
                       [p for m in mods for p in m.parameters()])}
    times: dict[str, list[list[float]]] = {k: [[], []] for k in runs}
    per_pass = max(-(-rounds // passes), 1)
    for turn in range(world):  # one process at a time (module docstring)
        dist.barrier()
        if rank != turn:
            continue
        for _ in range(passes):
            for name, (forward, params) in runs.items():
                for _ in range(warmup):
                    step(forward, params, None)
                for _ in range(per_pass):
                    step(forward, params, times[name])
    dist.barrier()
    mine = torch.tensor([statistics.median(v) for k in ("eager", "traced")
                         for v in times[k]], dtype=torch.float64)
    dist.all_reduce(mine)
    m = [float(v) / world for v in mine.tolist()]
    nbytes = sum(p.numel() * 4 for p in eager.parameters() if p.requires_grad)
    return TracedStageTimes(world, nbytes, len(stages), *m)


def profile_traced_stages(
    model: str,
    world_size: int,
    *,
    batch_size: int = 1,
    seq: int | None = None,
    link_kind: str = "loopback",
    rounds: int = 30,
    warmup: int = 2,
    passes: int = 3,
    timeout_s: float = 300.0,
    threads_per_process: int | None = 1,
    max_params: int | None = None,
) -> tuple[list[HandoverRecord], TracedStageTimes | None]:
    """Time the runtime's traced pipeline stages of ``model`` against the eager model in
    each of ``world_size`` processes in turn (module docstring).

    Args:
        model: a zoo name (each process builds it with seed 0 on the CPU).
        world_size: processes (≥ 2; the node's ranks, whose plans the records apply to).
        batch_size / seq: the micro-batch each process runs (the plans' micro-batch).
        link_kind: the link kind of the node the records are filed under (``loopback``).
        rounds / warmup: timed steps per variant (split over the passes), and untimed steps
            before each pass's.
        passes: rounds over both variants in each process, so that each meets the same
            mix of the host's fast and slow spells.
        timeout_s: limit on the whole run.
        threads_per_process: torch threads per process (1: a training rank's share of the
            CPU presets' cores).
        max_params: a larger model is not timed (default
            :data:`~hetplan.profiling.sync_step.MAX_PARAMS`).

    Returns:
        A ``traced_forward`` and a ``traced_backward`` record and the phases; ``([], None)``
        when the model has fewer than two blocks, cannot be traced, or is too large.

    Raises:
        ValueError: ``world_size`` < 2, or ``rounds`` or ``passes`` < 1.
        SpecError: ``model`` is not in the zoo.
    """
    from hetplan import zoo
    from hetplan.profiling._spawn import run_local_ranks
    from hetplan.profiling.sync_step import MAX_PARAMS

    if world_size < 2:
        raise ValueError(f"traced stages are timed on world_size >= 2 processes, "
                         f"got {world_size}")
    if passes < 1 or rounds < 1:
        raise ValueError(f"rounds and passes must be >= 1, got {rounds} and {passes}")
    zoo.get(model)
    limit = MAX_PARAMS if max_params is None else max_params
    params = sum(p.numel() for p in zoo.build(model).parameters() if p.requires_grad)
    if params > limit:
        log.info("traced stages skipped: %s has %d parameters (max_params %d)",
                 model, params, limit)
        return [], None
    times: TracedStageTimes | None = run_local_ranks(
        _worker, world_size, (model, batch_size, seq, rounds, warmup, passes),
        backend="gloo", timeout_s=timeout_s, threads_per_process=threads_per_process,
    )[0]
    if times is None:
        return [], None
    records = [HandoverRecord(
        operation=op,  # type: ignore[arg-type]  # validated by the record
        backend="gloo", link_kind=link_kind, group_size=world_size, processes=world_size,
        nbytes=times.nbytes, micro_batch=batch_size,
        samples=(HandoverSample(burst_s=eager_s, seconds=traced_s),))
        for op, eager_s, traced_s in (
            ("traced_forward", times.forward_s, times.traced_forward_s),
            ("traced_backward", times.backward_s, times.traced_backward_s))]
    return records, times
