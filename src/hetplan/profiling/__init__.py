"""Measurement side of ``hetplan profile``: time layers, collectives and compressors here.

The cost models (:mod:`hetplan.cost_models`) only *read* a
:class:`~hetplan.cost_models.profile_db.ProfileDB`; this subpackage *writes* one, by running
real work on the local hardware:

* :func:`profile_layers` (:mod:`.layers`): forward/backward time per layer signature, from
  hooks on a real training step, attributed to layers the way capture attributes FLOPs;
  :func:`profile_layers_concurrent` does it on ``n`` processes at once (CPU contention).
* :func:`profile_collectives` (:mod:`.collectives`): collectives on ``world_size`` local
  processes (gloo or NCCL), with fitted α–β lines.
* :func:`profile_handovers` (:mod:`.handover`): p2p hand-overs and all-reduces with every
  process computing a burst between the messages (CPU ranks: the wait for a core that back-to-
  back collectives do not see); part of ``collectives`` on gloo.
* :func:`profile_sync_steps` (:mod:`.sync_step`): the data-parallel gradient sync timed inside
  the runtime's own training step of a zoo model (forward, backward with the bucket's hook,
  the wait, the optimizer step), and the runtime's ZeRO-3 forward and backward beside the
  plain ones; part of ``collectives`` on gloo when a zoo model is given.
* :func:`profile_tp_steps` (:mod:`.tp_step`): the runtime's tensor-parallel forward and
  backward of a zoo model, every TP group at once, beside the unsplit model's; part of
  ``collectives`` on gloo when a zoo model is given.
* :func:`profile_traced_stages` (:mod:`.stage_trace`): the model as the runtime's traced
  pipeline stages run it against the eager model, in each of ``world_size`` processes in
  turn (measured, not charged); part of ``collectives`` on gloo when a zoo model is given.
* :func:`profile_compressors` (:mod:`.compressors`): compress/decompress times on CPU and
  GPU.
* :func:`profile_sparsity` (:mod:`.sparsity`): density, overlap and skew of every embedding
  gradient over ``n`` simulated workers (``hetplan profile --sparsity``).
* :func:`profile_optimizer_steps` (:mod:`.step`): the optimizer step's cost per parameter
  tensor and per byte, on ``n`` processes at once (CPU).
* :func:`run_profile`: all of it for one model, merged into the DB file at ``output``.

Import rules: this is the one place besides ``runtime/`` that may import ``torch`` *and*
``torch.distributed`` — measuring collectives needs process groups. It is neither runtime
(it executes no plan) nor cost model (it never predicts anything); nothing in ``ir/``,
``cost_models/``, ``passes/`` or ``optimizer/`` imports it. ``torch.distributed`` is only
imported inside the functions that spawn processes (:mod:`._spawn`), so importing this package
is cheap apart from ``torch`` itself.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hetplan.cost_models.profile_db import MachineInfo, ProfileDB, SparsityRecord, merge
from hetplan.errors import SpecError
from hetplan.profiling._spawn import run_local_ranks, start_method
from hetplan.profiling.collectives import (
    DEFAULT_COLLECTIVES,
    DEFAULT_SIZES,
    CollectiveProfile,
    profile_collectives,
)
from hetplan.profiling.compressors import DEFAULT_COMPRESSOR_SIZES, profile_compressors
from hetplan.profiling.handover import profile_handovers
from hetplan.profiling.sync_step import profile_sync_steps
from hetplan.profiling.stage_trace import profile_traced_stages
from hetplan.profiling.tp_step import profile_tp_steps
from hetplan.profiling.layers import (
    alias_records,
    default_loss,
    profile_layers,
    profile_layers_concurrent,
)
from hetplan.profiling.sparsity import SparsitySpec, profile_sparsity
from hetplan.profiling.step import profile_optimizer_steps
from hetplan.runtime.launch import MIN_CPU_PROCESSES, OVERSUBSCRIBE, HostCapacity
from hetplan.runtime.link_emulation import ENV as EMULATE_ENV
from hetplan.runtime.link_emulation import emulated_link

__all__ = [
    "DEFAULT_COLLECTIVES",
    "DEFAULT_COMPRESSOR_SIZES",
    "DEFAULT_SIZES",
    "WHAT",
    "CollectiveProfile",
    "SparsitySpec",
    "default_layer_processes",
    "default_loss",
    "machine_info",
    "profile_collectives",
    "profile_compressors",
    "profile_handovers",
    "profile_sync_steps",
    "profile_tp_steps",
    "profile_traced_stages",
    "profile_layers",
    "profile_layers_concurrent",
    "profile_optimizer_steps",
    "profile_sparsity",
    "run_local_ranks",
    "run_profile",
]

log = logging.getLogger(__name__)

#: What :func:`run_profile` can measure.
WHAT: tuple[str, ...] = ("layers", "collectives", "compressors", "step")

ModelArg = str | tuple[nn.Module, Sequence[Any] | Any, Mapping[str, Any] | None]


def machine_info(device_type: str, backend: str, device_count: int) -> MachineInfo:
    """The :class:`MachineInfo` of this machine (no hostname)."""
    return MachineInfo(
        device_type=device_type,
        torch_version=torch.__version__,
        backend=backend,
        cuda_version=torch.version.cuda,
        device_count=device_count,
    )


def _planning_capture(model: Any, ir: Any, seq: int | None) -> Any:
    """The zoo model's capture as ``hetplan plan`` and ``compile`` make it (batch 1), when
    ``ir`` was captured at another batch; None otherwise (see
    :func:`~hetplan.profiling.layers.alias_records`)."""
    if not isinstance(model, str) or ir.batch_size == 1:
        return None
    from hetplan import zoo
    from hetplan.ir.capture import capture

    entry = zoo.get(model)
    args, kwargs = zoo.example_inputs(entry.name, batch=1, seq=seq, device="meta")
    return capture(zoo.build(entry.name, device="meta", seed=0), args, kwargs, name=entry.name)


def _resolve_model(
    model: ModelArg, batch_size: int, seq: int | None, device: str
) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any], str | None]:
    if isinstance(model, str):
        from hetplan import zoo

        entry = zoo.get(model)
        net = zoo.build(entry.name, device=device, seed=0)
        args, kwargs = zoo.example_inputs(entry.name, batch=batch_size, seq=seq, device=device)
        return net, tuple(args), dict(kwargs), entry.name
    if not (isinstance(model, tuple) and len(model) == 3 and isinstance(model[0], nn.Module)):
        raise TypeError(
            "run_profile(model=...) takes a zoo name or a tuple (module, example_inputs, "
            f"example_kwargs), got {type(model).__name__}"
        )
    net, inputs, keywords = model
    args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    return net, args, dict(keywords or {}), None


def _sparsity(model: ModelArg, spec: SparsitySpec, seq: int | None
              ) -> tuple[SparsityRecord, ...]:
    """:func:`profile_sparsity` of ``model`` built on CPU; the records are filed under the
    name planning captures it with (the zoo name, else the model's class name)."""
    from hetplan.ir.capture import capture

    net, args, kwargs, name = _resolve_model(model, 1, seq, "cpu")
    ir = capture(net, args, kwargs, name=name or type(net).__name__)
    return profile_sparsity(net, args, kwargs, ir=ir, workers=spec.workers,
                            batch_size=spec.batch_size, steps=spec.steps,
                            zipf_alpha=spec.zipf_alpha, script=spec.script, seed=spec.seed)


def _progress(show: bool) -> Any:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    return Progress(
        SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
        TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
        console=Console(stderr=True), disable=not show,
    )


def _check_cpu_processes(**counts: int) -> None:
    """Refuse to start more gloo processes on this host than `hetplan run` starts without
    --oversubscribe (:func:`hetplan.runtime.launch.host_problem`): on a 2-core machine -n
    1000 started a thousand processes that did not finish in minutes."""
    cpus = HostCapacity.detect().cpu_cores
    limit = max(MIN_CPU_PROCESSES, OVERSUBSCRIBE * cpus)
    for key, count in counts.items():
        option = {"world_size": "--world-size/-n", "layer_processes": "--layer-processes"}[key]
        if count > limit:
            raise SpecError(f"{option} {count}: starts {count} CPU processes on this host, "
                            f"which has {cpus} core(s): more than {limit} ({OVERSUBSCRIBE} per "
                            f"core, at least {MIN_CPU_PROCESSES}); give {option} {limit} or "
                            "less")


def _collectives(progress: Any, world_size: int, backend: str, sizes: Sequence[int],
                 collectives: Sequence[str], link_kind: str, timeout_s: float) -> list[Any]:
    """:func:`profile_collectives` under a progress line; its records (skips reported)."""
    task = progress.add_task(f"collectives on {world_size} {backend} processes", total=None)
    prof = profile_collectives(world_size, backend=backend, sizes=sizes,
                               collectives=collectives, link_kind=link_kind,
                               timeout_s=timeout_s)
    for coll, why in prof.skipped.items():
        progress.console.print(f"[yellow]skipped {coll}[/]: {why}")
        log.warning("collective %s skipped: %s", coll, why)
    progress.update(task, total=1, completed=1)
    return list(prof.records)


def default_layer_processes(world_size: int, what: Sequence[str]) -> int:
    """The processes layers are timed on when not given: on a machine without CUDA the
    ranks of a CPU run share its cores, one thread each, so ``world_size`` processes at once,
    as that many ranks would run them (timed in one process with every core, a GPT-2 block
    took 1/13 of its time in a 4-rank run); with CUDA each rank has its own device, so 1
    (this process)."""
    if "layers" not in what:
        return 1
    import torch

    return 1 if torch.cuda.is_available() else max(1, world_size)


def run_profile(
    model: ModelArg | None,
    *,
    world_size: int = 2,
    device_type: str = "cpu",
    output: str | Path | None = None,
    what: Sequence[str] = WHAT,
    batch_size: int = 1,
    seq: int | None = None,
    device: str | None = None,
    backend: str | None = None,
    link_kind: str | None = None,
    layer_processes: int | None = None,
    warmup: int = 2,
    iters: int = 5,
    collective_sizes: Sequence[int] = DEFAULT_SIZES,
    collectives: Sequence[str] = DEFAULT_COLLECTIVES,
    compressor_sizes: Sequence[int] = DEFAULT_COMPRESSOR_SIZES,
    timeout_s: float = 300.0,
    show_progress: bool = True,
    dtypes: Sequence[str] = ("fp32",),
    sparsity: SparsitySpec | None = None,
) -> ProfileDB:
    """Profile ``model`` and this machine; write (merged) to ``output``.

    Args:
        model: a zoo name (built with seed 0 on ``device``), or ``(module, example_inputs,
            example_kwargs)``; None when ``what`` has no ``layers``.
        world_size: processes for collectives and the optimizer step (and the
            ``device_count`` recorded).
        device_type: the cluster device type the records are filed under (``cpu``, or the
            GPU type of this machine, e.g. ``A100-80GB``).
        output: the DB file. If it exists it is loaded and merged
            (:func:`~hetplan.cost_models.profile_db.merge`: per key the record with more
            samples wins, the new one on a tie); None writes nothing.
        what: any of :data:`WHAT` (``collectives`` on gloo also times hand-overs under
            contention, :func:`profile_handovers`, and, for a zoo model, the data-parallel
            sync inside its training step at ``batch_size``, :func:`profile_sync_steps`,
            its tensor-parallel phases, :func:`profile_tp_steps`, and its traced pipeline
            stages, :func:`profile_traced_stages`;
            ``step``: the optimizer step on
            ``world_size`` processes at
            once, :func:`profile_optimizer_steps`; on CPU only).
        batch_size / seq: example inputs for a zoo model. Compute records are keyed by the
            layer's per-sample signature and record the micro-batch they were measured at;
            planning at another micro-batch scales the nearest measured one linearly, so
            profile at the micro-batch the plan will use (several runs with different
            ``batch_size`` merge into one DB). The sequence length is part of the signature.
        dtypes: compute dtypes to time layers in (``fp32``; ``bf16`` / ``fp16`` under
            autocast, as the runtime runs a mixed-precision plan).
        device: ``cpu`` or ``cuda``; default ``cuda`` when ``device_type`` is not ``cpu`` and
            CUDA is available.
        backend: ``gloo`` or ``nccl``; default ``nccl`` on CUDA, else ``gloo``.
        link_kind: link kind the collective records are filed under; must match the
            cluster spec's intra-node link (default ``loopback`` with gloo, ``nvlink`` with
            NCCL). With ``HETPLAN_EMULATE_BW`` set (the runtime's slow-network emulation,
            :mod:`hetplan.runtime.link_emulation`) ``collectives`` takes only the hand-overs
            and, for a zoo model, the data-parallel sync inside its step, on the emulated
            link, as a run with it pays them (its wire time is the analytic line of the
            link, by construction), filed under ``link_kind``, which must then
            name the link the emulation stands for (``ethernet`` for ``cpu-2x2-slow``'s
            inter-node link).
        layer_processes: profile layers on this many processes at once, with the threads
            each would get in training (:func:`profile_layers_concurrent`); 1 profiles in
            this process with the current thread count; None (the default):
            :func:`default_layer_processes`, as the CLI.
        warmup / iters: untimed and timed training steps for layers (collectives: calls).
        collective_sizes / collectives / compressor_sizes: what to sweep.
        timeout_s: limit for each multi-process measurement.
        show_progress: rich progress bars on stderr.
        sparsity: also measure the model's sparse (embedding) gradients on CPU
            (:func:`profile_sparsity`); None skips it. Independent of ``what``.

    Returns:
        The DB (merged with the existing file when there is one).

    Raises:
        SpecError: an unknown entry in ``what``, a count below 1 (``world_size``,
            ``layer_processes``, ``batch_size``) or an existing ``output`` that is not a
            profile DB, all refused before anything is measured.
        ValueError: ``layers`` or ``sparsity`` without a model.
        SpecError: ``HETPLAN_EMULATE_BW`` set with collectives to time and no ``link_kind``
            (or ``loopback`` / ``nvlink``) to file them under; or, without it, collectives
            timed on CPU processes filed under a ``link_kind`` other than ``loopback``.
    """
    from hetplan.runtime.cpu_sched import apply_cpu_sched, cpu_sched_policy

    cpu_sched = cpu_sched_policy()  # a bad HETPLAN_CPU_SCHED: refused before anything runs
    start_method()  # ... and a bad HETPLAN_START_METHOD
    bad = [w for w in what if w not in WHAT]
    if bad:
        from hetplan.ir.validation import did_you_mean

        parts = [p.strip() for w in bad for p in w.split(",")]
        hint = (f"; give one per --what: {' '.join(f'--what {p}' for p in parts)}"
                if len(parts) > len(bad) and all(p in WHAT for p in parts)
                else did_you_mean(bad[0], list(WHAT)))
        raise SpecError(f"--what: unknown measurement(s) {bad}{hint}; choose from {list(WHAT)}")
    if layer_processes is None:
        layer_processes = default_layer_processes(world_size, what)
    for option, count in (("--world-size/-n", world_size),
                          ("--layer-processes", layer_processes), ("--batch-size", batch_size)):
        if count < 1:
            raise SpecError(f"{option} must be at least 1, got {count}")
    # an existing output is merged into: a file that is not a profile DB fails now, not
    # after minutes of measuring
    try:
        existing = ProfileDB.load(Path(output)) if output is not None and Path(output).exists() \
            else None
    except SpecError as e:
        raise SpecError(f"{e}\n-o/--output {str(output)!r} exists, and an existing output is "
                        "merged into: delete it or choose another path") from e
    emulate = emulated_link() is not None and "collectives" in what
    if emulate:
        if link_kind in (None, "loopback", "nvlink"):
            raise SpecError(
                f"{EMULATE_ENV} is set, so hand-overs are timed on the emulated link; file "
                "them under the kind of link it stands for with link_kind (--link-kind "
                "ethernet for cpu-2x2-slow's inter-node link), not "
                f"{link_kind or 'the default'!r}, or unset {EMULATE_ENV}")
    if device is None:
        device = "cuda" if device_type != "cpu" and torch.cuda.is_available() else "cpu"
    if backend is None:
        backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "gloo":  # the layers timed in this process run as the workers do
        _check_cpu_processes(world_size=world_size, layer_processes=layer_processes)
        apply_cpu_sched(cpu_sched)
    if (not emulate and "collectives" in what and device == "cpu"
            and link_kind not in (None, "loopback")):
        raise SpecError(
            f"--link-kind {link_kind!r}: the collectives are timed between processes of this "
            "machine over loopback, and records filed under another link kind would price "
            f"every {link_kind!r} link of a cluster with loopback times; leave --link-kind out "
            f"(loopback), or set {EMULATE_ENV} to time the emulated link it stands for")
    if link_kind is None:
        link_kind = "nvlink" if backend == "nccl" else "loopback"
    compute, colls, comps = [], [], []
    sparse: tuple[SparsityRecord, ...] = ()
    steps: list[Any] = []
    hands: list[Any] = []
    with _progress(show_progress) as progress:
        if "layers" in what:
            if model is None:
                raise ValueError("profiling layers needs a model (a zoo name or a module)")
            net, args, kwargs, name = _resolve_model(model, batch_size, seq, device)
            from hetplan.ir.capture import capture

            ir = capture(net, args, kwargs, name=name)
            planning_ir = _planning_capture(model, ir, seq)
            for dtype in dtypes:
                if layer_processes > 1:
                    task = progress.add_task(
                        f"layers of {ir.name} ({dtype}) on {layer_processes} processes",
                        total=None)
                    compute += profile_layers_concurrent(
                        net, args, kwargs, processes=layer_processes, device_type=device_type,
                        device=device, warmup=warmup, iters=iters, ir=ir,
                        timeout_s=timeout_s, dtype=dtype,
                    )
                    progress.update(task, total=1, completed=1)
                else:
                    compute += profile_layers(net, args, kwargs, device_type=device_type,
                                              device=device, warmup=warmup, iters=iters,
                                              ir=ir, progress=progress, dtype=dtype)
            if planning_ir is not None:
                compute += alias_records(compute, ir, planning_ir)
        if "collectives" in what:
            if world_size < 2:
                log.warning("collectives skipped: world_size=%d (need >= 2)", world_size)
            else:
                colls = [] if emulate else _collectives(
                    progress, world_size, backend, collective_sizes, collectives, link_kind,
                    timeout_s)
                if backend == "gloo":
                    where = f" on the emulated {link_kind} link" if emulate else ""
                    task = progress.add_task(
                        f"hand-overs after compute on {world_size} processes{where}",
                        total=None)
                    hands = profile_handovers(world_size, backend=backend,
                                              link_kind=link_kind, timeout_s=timeout_s,
                                              emulate=emulate)
                    progress.update(task, total=1, completed=1)
                    if isinstance(model, str) and emulate:
                        # the data-parallel sync inside the step, on the emulated link (the
                        # other step records time loopback collectives: not filed here)
                        task = progress.add_task(
                            f"data-parallel sync inside {model}'s step on {world_size} "
                            f"processes{where}", total=None)
                        steps_with_sync, _ = profile_sync_steps(
                            model, world_size, batch_size=batch_size, seq=seq,
                            link_kind=link_kind, timeout_s=timeout_s)
                        hands += steps_with_sync
                        progress.update(task, total=1, completed=1)
                    if isinstance(model, str) and not emulate:
                        task = progress.add_task(
                            f"data-parallel sync inside {model}'s step on {world_size} "
                            "processes", total=None)
                        steps_with_sync, _ = profile_sync_steps(
                            model, world_size, batch_size=batch_size, seq=seq,
                            link_kind=link_kind, timeout_s=timeout_s, zero3=True)
                        hands += steps_with_sync
                        progress.update(task, total=1, completed=1)
                        task = progress.add_task(
                            f"tensor-parallel phases of {model} on {world_size} processes",
                            total=None)
                        tp_steps, _ = profile_tp_steps(
                            model, world_size, batch_size=batch_size, seq=seq,
                            link_kind=link_kind, timeout_s=timeout_s)
                        hands += tp_steps
                        progress.update(task, total=1, completed=1)
                        task = progress.add_task(
                            f"traced pipeline stages of {model} on {world_size} processes",
                            total=None)
                        traced, _ = profile_traced_stages(
                            model, world_size, batch_size=batch_size, seq=seq,
                            link_kind=link_kind, timeout_s=timeout_s)
                        hands += traced
                        progress.update(task, total=1, completed=1)
        if "compressors" in what:
            comps = profile_compressors(device_type=device_type, sizes=compressor_sizes,
                                        progress=progress)
        if "step" in what:
            if not device.startswith("cpu"):
                log.warning("step skipped: the optimizer step is measured on CPU ranks only")
            else:
                task = progress.add_task(f"optimizer step on {world_size} processes",
                                         total=None)
                steps = profile_optimizer_steps(world_size, device_type=device_type,
                                                timeout_s=timeout_s)
                progress.update(task, total=1, completed=1)
        if sparsity is not None:
            if model is None:
                raise ValueError("profiling sparsity needs a model (a zoo name or a module)")
            task = progress.add_task(f"sparsity on {sparsity.workers} simulated worker(s)",
                                     total=None)
            sparse = _sparsity(model, sparsity, seq)
            progress.update(task, total=1, completed=1)
    db = ProfileDB(
        machines=(machine_info(device_type, backend, world_size),),
        compute=tuple(compute),
        collectives=tuple(colls),
        compressors=tuple(comps),
        sparsity=sparse,
        optimizer_steps=tuple(steps),
        handovers=tuple(hands),
    )
    if output is not None:
        path = Path(output)
        if existing is not None:
            db = merge(db, existing)
        path.parent.mkdir(parents=True, exist_ok=True)
        db.save(path)
    return db
