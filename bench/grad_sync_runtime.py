"""Measured iteration time of gradient-sync variants in the runtime, side by side (gloo, CPU).

Four gloo ranks as 2 emulated nodes × 2 (``cpu-2x2``) train the same model with the same
plan except for ``gradient_sync``; blocks of iterations alternate between the variants (a
different order every round) so machine noise hits all alike:

- ``layerwise``: one fp32 allreduce per tensor (no fusion);
- ``ddp25``: DDP-style buckets of at most 25 MiB in backward-ready order (DDP's default);
- ``one-bucket``: every gradient in one fp32 bucket;
- ``compiled``: the plan's own section (default pipeline: Espresso routing + Cupcake buckets);
- ``topk-tensor`` / ``topk-fused``: top-k (1 %) on a two-level hierarchical path with error
  feedback, per tensor vs one fused bucket (fusion pays the compressor's fixed cost once).

Loopback gloo is not bandwidth-limited, so these numbers show per-operation costs (latency,
compression kernels, the worker thread), not wire savings. Writes
``bench/results/grad_sync_runtime_cpu.json``.

    python bench/grad_sync_runtime.py [--model gpt-test] [--rounds 4] [--iters 4]
"""

from __future__ import annotations

import argparse
import json
import os
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
WORLD = 4
MiB = 2**20


def _variants(plan_json: str) -> dict[str, str]:
    """Plan JSON per variant (same plan, different gradient_sync)."""
    from hetplan.algorithms.espresso_tree import (
        all_options,
        devices_of,
        is_hierarchical,
        num_compressions,
    )
    from hetplan.ir.plan import Plan
    from hetplan.ir.plan_sections import Bucket, GradientSync, NoSync, TensorSync
    from hetplan.passes.espresso import strategy_for

    plan = Plan.from_json(plan_json)
    assert plan.model.workload is not None
    grads = plan.model.workload.grads
    oid = next(i for i, o in enumerate(all_options())
               if is_hierarchical(o) and devices_of(o) == {"gpu"} and num_compressions(o) == 2)

    def sync(strategy, groups):  # type: ignore[no-untyped-def]
        return GradientSync(
            strategies={"s": strategy},
            tensors=tuple(TensorSync(name=g.name, strategy="s") for g in grads),
            buckets=tuple(Bucket(tensors=tuple(g.name for g in grp),
                                 size_bytes=sum(g.size_bytes for g in grp), strategy="s")
                          for grp in groups))

    ddp: list[list] = [[]]  # type: ignore[type-arg]
    for g in grads:
        if ddp[-1] and sum(x.size_bytes for x in ddp[-1]) + g.size_bytes > 25 * MiB:
            ddp.append([])
        ddp[-1].append(g)
    topk = strategy_for(("topk", oid))
    out = {
        "layerwise": sync(NoSync(), []),
        "ddp25": sync(NoSync(), ddp),
        "one-bucket": sync(NoSync(), [list(grads)]),
        "compiled": plan.gradient_sync,
        "topk-tensor": sync(topk, []),
        "topk-fused": sync(topk, [list(grads)]),
    }
    return {k: plan.model_copy(update={"gradient_sync": v}).to_json() for k, v in out.items()}


def _worker(rank: int, store_dir: str, variants: dict[str, str], model_name: str, rounds: int,
            iters: int, out: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(store_dir, "store"), WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=300))
    from hetplan import zoo
    from hetplan.ir.plan import Plan
    from hetplan.runtime.executor import Runtime
    from hetplan.runtime.worker import make_target, synthetic_batch

    ex_args, ex_kwargs = zoo.example_inputs(model_name, batch=1, device="cpu")
    runtimes = {}
    for name, pj in variants.items():
        plan = Plan.from_json(pj)
        runtimes[name] = Runtime(plan, zoo.build(model_name, device="cpu", seed=0),
                                 example_args=ex_args, example_kwargs=ex_kwargs)
    layout = Plan.from_json(variants["compiled"]).layout
    assert layout is not None
    batch = layout.micro_batch_size * layout.dp
    target_of = make_target(zoo.build(model_name, device="cpu", seed=0), ex_args, ex_kwargs)
    names = list(runtimes)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds + 1):  # round 0 is warm-up
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            for i in range(iters):
                xs = synthetic_batch(ex_args, batch, r * 100 + i)
                y = target_of(xs, batch)
                dist.barrier()
                t0 = time.perf_counter()
                runtimes[name].train_step(xs, y)
                if r:
                    times[name].append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def _plan_from(js: str):  # type: ignore[no-untyped-def]
    from hetplan.ir.plan import Plan

    return Plan.from_json(js)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="gpt-test")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--iters", type=int, default=4)
    args = ap.parse_args()
    import hetplan
    from hetplan.ir.cluster import ClusterSpec

    plan = hetplan.compile(args.model, ClusterSpec.from_preset("cpu-2x2"),
                           batch_size=args.batch, dp=WORLD, pp=1, tp=1,
                           micro_batch_size=args.batch // WORLD)
    variants = _variants(plan.to_json())
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        mp.spawn(_worker, args=(tmp, variants, args.model, args.rounds, args.iters, out),
                 nprocs=WORLD, join=True)
        times = json.loads(Path(out).read_text())
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    for k, v in med.items():
        print(f"{k:12s} {v:8.2f} ms   ratio to ddp25 {v / med['ddp25']:.3f}")
    gs = plan.gradient_sync
    result = {
        "machine": machine(device="cpu", backend="gloo", note="loopback: not bandwidth-limited"),
        "model": args.model, "world_size": WORLD, "cluster": "cpu-2x2",
        "global_batch": args.batch, "iterations_each": len(times["ddp25"]),
        "median_ms": med,
        "ratio_to_ddp25": {k: v / med["ddp25"] for k, v in med.items()},
        "ratio_topk_fused_over_tensor": med["topk-fused"] / med["topk-tensor"],
        "compiled_strategies": sorted(gs.strategies) if gs else [],
        "compiled_buckets": len(gs.buckets) if gs else 0,
        "grad_tensors": len(plan.model.workload.grads) if plan.model.workload else 0,
        "grad_mib": sum(g.size_bytes for g in plan.model.workload.grads) / MiB
        if plan.model.workload else 0,
        "ddp25_buckets": len(_plan_from(variants["ddp25"]).gradient_sync.buckets),
        "note": "when ddp25 has one bucket it is the same configuration as one-bucket: their "
                "difference is the measurement noise of this machine",
    }
    path = ROOT / "bench" / "results" / "grad_sync_runtime_cpu.json"
    path.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
