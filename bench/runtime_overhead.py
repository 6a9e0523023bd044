"""The runtime's overhead against torch's own data parallelism, side by side (gloo, CPU).

``--world`` gloo ranks on this machine train the same model on the same synthetic batches with
SGD, alternating blocks of iterations (the order rotates every round, so machine noise hits all
alike) between:

- ``hetplan``: ``hetplan.runtime.Runtime`` with a ZeRO-0 plan (DDP-style 25 MiB buckets);
- ``ddp``: ``DistributedDataParallel(bucket_cap_mb=25)``;
- ``hetplan-zero3``: the runtime with a ZeRO-3 plan of the same job (FSDP2 inside the
  runtime);
- ``fsdp2``: ``fully_shard`` (FSDP2) applied by hand, per transformer block and the root.

Reported: median iteration per variant and the ratios hetplan / DDP and hetplan-zero3 /
FSDP2 (target ≤ 1.05 each). Writes ``bench/results/runtime_overhead_cpu.json``.

    python bench/runtime_overhead.py [--model gpt-test] [--world 2] [--rounds 6] [--iters 5]

``--profile DIR``: rank 0 runs every variant's steps under its own ``cProfile`` profiler
(timed rounds only) and writes ``DIR/<variant>.prof`` and a text summary
``DIR/<variant>.txt`` (top functions by own time and by cumulative time, with call counts):
what the runtime's step does that the DDP and FSDP2 loops do not. The times of a profiled
sitting carry the profiler's overhead; use them for direction, not for the ratios.

``--single``: the GPU overhead job's shape on one process (no process group): bf16 autocast
and Adam, as ``bench/gpu/reference_loop.py`` trains, ``hetplan`` (the runtime with a dp=1
bf16 plan: bf16 working weights, fp32 masters) against ``plain`` (fp32 weights under
``torch.autocast``), alternating blocks. It reports each variant's median wall time and
median host CPU time (``time.process_time``) per step: on a GPU the host only queues the
work, so the CPU time is what the runtime adds on the host. Writes
``bench/results/runtime_overhead_single_cpu.json``; ``--label`` names the source tree (to
compare two trees in one sitting, run it with each tree on ``PYTHONPATH``, alternating).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _machine import machine

ROOT = Path(__file__).resolve().parents[1]
TARGET = 1.05
VARIANTS = ("hetplan", "ddp", "hetplan-zero3", "fsdp2")


def _cluster(world: int):  # type: ignore[no-untyped-def]
    from hetplan.ir.cluster import ClusterSpec

    spec = ClusterSpec.from_preset("local-cpu").model_dump(mode="json")
    spec["name"] = f"local-cpu-{world}"
    spec["nodes"][0]["devices"] = [{"type": "cpu", "count": world}]
    return ClusterSpec.from_dict(spec)


def _fsdp2(model: torch.nn.Module) -> torch.nn.Module:
    """``fully_shard`` per block (a module list's entries) and on the root, as the runtime's
    ZeRO-3 does."""
    from torch.distributed.fsdp import fully_shard

    for mod in model.modules():
        if isinstance(mod, torch.nn.ModuleList):
            for block in mod:
                fully_shard(block)
    fully_shard(model)
    return model


def _write_profiles(profiles: dict[str, cProfile.Profile], where: Path) -> None:
    """Each variant's profile (``.prof``) and its top functions as text (``.txt``)."""
    where.mkdir(parents=True, exist_ok=True)
    for name, prof in profiles.items():
        prof.dump_stats(str(where / f"{name}.prof"))
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats(40)
        (where / f"{name}.txt").write_text(text.getvalue())


def _worker(rank: int, store_dir: str, plans: dict[str, str], model_name: str, rounds: int,
            iters: int, world: int, out: str, profile: str | None = None) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(store_dir, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    from hetplan import zoo
    from hetplan.ir.plan import Plan
    from hetplan.runtime.executor import Runtime
    from hetplan.runtime.worker import make_target, synthetic_batch

    plan = Plan.from_json(plans["hetplan"])
    assert plan.layout is not None
    batch = plan.layout.micro_batch_size * plan.layout.dp
    ex_args, ex_kwargs = zoo.example_inputs(model_name, batch=1, device="cpu")
    rts = {name: Runtime(Plan.from_json(plans[name]),
                         zoo.build(model_name, device="cpu", seed=0),
                         example_args=ex_args, example_kwargs=ex_kwargs)
           for name in ("hetplan", "hetplan-zero3")}
    ddp = torch.nn.parallel.DistributedDataParallel(zoo.build(model_name, device="cpu", seed=0),
                                                    bucket_cap_mb=25)
    fsdp = _fsdp2(zoo.build(model_name, device="cpu", seed=0))
    opts = {"ddp": torch.optim.SGD(ddp.parameters(), lr=0.01),
            "fsdp2": torch.optim.SGD(fsdp.parameters(), lr=0.01)}
    torch_models = {"ddp": ddp, "fsdp2": fsdp}
    target_of = make_target(zoo.build(model_name, device="cpu", seed=0), ex_args, ex_kwargs)
    kwargs = {k: v for k, v in ex_kwargs.items() if not isinstance(v, torch.Tensor)}
    loss_fn = rts["hetplan"].loss_fn
    b = batch // world
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    profiles = {v: cProfile.Profile() for v in VARIANTS} if profile and rank == 0 else {}
    for r in range(rounds + 1):  # round 0 is warm-up
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
        for which in order:
            for i in range(iters):
                xs = synthetic_batch(ex_args, batch, r * 100 + i)
                y = target_of(xs, batch)
                dist.barrier()
                prof = profiles.get(which) if r else None
                if prof is not None:
                    prof.enable()
                t0 = time.perf_counter()
                if which in rts:
                    rts[which].train_step(xs, y)
                else:
                    local = [x[rank * b:(rank + 1) * b] for x in xs]
                    out_t = torch_models[which](*local, **kwargs)
                    loss = loss_fn(out_t, y[rank * b:(rank + 1) * b])
                    loss.backward()
                    opts[which].step()
                    opts[which].zero_grad(set_to_none=True)
                if r:
                    times[which].append(time.perf_counter() - t0)
                if prof is not None:
                    prof.disable()
    if rank == 0:
        Path(out).write_text(json.dumps(times))
        if profiles and profile:
            _write_profiles(profiles, Path(profile))
    dist.destroy_process_group()


def _single(model_name: str, batch: int, rounds: int, iters: int) -> dict[str, list[float]]:
    """``--single``: per-step (wall, CPU) seconds of ``hetplan`` and ``plain`` (see module
    docstring), in alternating blocks; round 0 is warm-up."""
    import hetplan
    from hetplan import zoo
    from hetplan.runtime.executor import Runtime, _default_loss, plan_optimizer
    from hetplan.runtime.worker import make_target, synthetic_batch

    torch.set_num_threads(1)
    plan = hetplan.compile(model_name, _cluster(1), batch_size=batch, dp=1, pp=1, tp=1,
                           micro_batch_size=batch, dtype="bf16", zero_stage=0,
                           optimizer="adam")
    ex_args, ex_kwargs = zoo.example_inputs(model_name, batch=1, device="cpu")
    rt = Runtime(plan, zoo.build(model_name, device="cpu", seed=0), example_args=ex_args,
                 example_kwargs=ex_kwargs, optimizer=plan_optimizer("adam"))
    plain = zoo.build(model_name, device="cpu", seed=0)
    opt = torch.optim.Adam(plain.parameters(), lr=1e-4)
    kwargs = {k: v for k, v in ex_kwargs.items() if not isinstance(v, torch.Tensor)}
    target_of = make_target(zoo.build(model_name, device="cpu", seed=0), ex_args, ex_kwargs)

    def plain_step(xs: tuple, y: torch.Tensor) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = plain(*xs, **kwargs)
        loss = _default_loss(out, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss.detach())  # the loss per step, as the runtime reports it

    steps = {"hetplan": rt.train_step, "plain": plain_step}
    out: dict[str, list[float]] = {f"{k}_{m}": [] for k in steps for m in ("wall", "cpu")}
    batches = [synthetic_batch(ex_args, batch, s) for s in range(4)]
    for r in range(rounds + 1):
        for which in (("hetplan", "plain") if r % 2 else ("plain", "hetplan")):
            for i in range(iters):
                xs = batches[i % len(batches)]
                y = target_of(xs, batch)
                w0, c0 = time.perf_counter(), time.process_time()
                steps[which](xs, y)
                if r:
                    out[f"{which}_wall"].append(time.perf_counter() - w0)
                    out[f"{which}_cpu"].append(time.process_time() - c0)
    rt.close()
    return out


def main_single(args: argparse.Namespace) -> int:
    """``--single`` (see module docstring)."""
    times = _single(args.model, args.batch, args.rounds, args.iters)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    for k, v in med.items():
        print(f"{args.label} {args.model} single: {k:<13} {v:8.2f} ms")
    ratios = {"hetplan_over_plain_wall": med["hetplan_wall"] / med["plain_wall"],
              "hetplan_over_plain_cpu": med["hetplan_cpu"] / med["plain_cpu"]}
    for k, v in ratios.items():
        print(f"{args.label} {k}: {v:.3f}")
    result = {"machine": machine(device="cpu", backend="none"), "label": args.label,
              "model": args.model, "global_batch": args.batch, "optimizer": "adam",
              "dtype": "bf16 autocast", "iterations_each": len(times["plain_wall"]),
              "median_ms": med, "ratios": ratios,
              "times_ms": {k: [round(x * 1e3, 3) for x in v] for k, v in times.items()}}
    out = args.out or ROOT / "bench" / "results" / "runtime_overhead_single_cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(f"wrote {out}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="gpt-test")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--world", type=int, default=2, help="gloo ranks (2-4)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--profile", type=Path, default=None,
                    help="rank 0 profiles each variant into this folder (see docstring)")
    ap.add_argument("--single", action="store_true",
                    help="one process, bf16 autocast + Adam: hetplan vs plain (CPU time)")
    ap.add_argument("--label", default="", help="names the source tree measured (to compare "
                    "two trees in one sitting: run each with its tree on PYTHONPATH)")
    args = ap.parse_args()
    if args.single:
        return main_single(args)
    default = (args.profile / "runtime_overhead_cpu.json" if args.profile  # not the record
               else ROOT / "bench" / "results" / "runtime_overhead_cpu.json")
    args.out = args.out or default
    import hetplan

    world = args.world
    plans = {name: hetplan.compile(args.model, _cluster(world), batch_size=args.batch, dp=world,
                                   pp=1, tp=1, micro_batch_size=args.batch // world,
                                   dtype="fp32", zero_stage=zero, optimizer="sgd")
             for name, zero in (("hetplan", 0), ("hetplan-zero3", 3))}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        mp.spawn(_worker, args=(tmp, {k: p.to_json() for k, p in plans.items()}, args.model,
                                args.rounds, args.iters, world, out,
                                str(args.profile) if args.profile else None),
                 nprocs=world, join=True)
        times = json.loads(Path(out).read_text())
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    ratios = {"hetplan_over_ddp": med["hetplan"] / med["ddp"],
              "hetplan_zero3_over_fsdp2": med["hetplan-zero3"] / med["fsdp2"]}
    for k, v in med.items():
        print(f"{args.label} {args.model} x{world}: {k:<14} {v:8.2f} ms")
    for k, v in ratios.items():
        print(f"{args.label} {k}: {v:.3f} (target <= {TARGET})")
    sync = plans["hetplan"].gradient_sync
    result = {
        "machine": machine(device="cpu", backend="gloo"),
        "load_average_before_and_after": [load_before, os.getloadavg()],
        "label": args.label, "hetplan_source": str(Path(hetplan.__file__).parent),
        "model": args.model, "world_size": world, "global_batch": args.batch,
        "optimizer": "sgd", "dtype": "fp32",
        "iterations_each": len(times["ddp"]),
        "median_ms": med, "ratios": ratios, "target": TARGET,
        "meets_target": all(v <= TARGET for v in ratios.values()),
        "times_ms": {k: [round(x * 1e3, 3) for x in v] for k, v in times.items()},
        "buckets": len(sync.buckets) if sync else 0,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
