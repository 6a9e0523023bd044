"""The runtime's fp32 data-parallel path vs torch DistributedDataParallel, side by side.

Two gloo ranks on this machine train the same model on the same synthetic batches, alternating
blocks of iterations between ``hetplan.runtime.Runtime`` (a plan with DDP-style 25 MiB buckets)
and ``DistributedDataParallel(bucket_cap_mb=25)``, so that machine noise hits both alike. Target:
median iteration-time ratio runtime / DDP ≤ 1.10. Writes ``bench/results/runtime_overhead_cpu.json``.

    python bench/runtime_overhead.py [--model gpt-test] [--rounds 5] [--iters 5]
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
WORLD = 2


def _cluster(world: int):  # type: ignore[no-untyped-def]
    from hetplan.ir.cluster import ClusterSpec

    spec = ClusterSpec.from_preset("local-cpu").model_dump(mode="json")
    spec["name"] = f"local-cpu-{world}"
    spec["nodes"][0]["devices"] = [{"type": "cpu", "count": world}]
    return ClusterSpec.from_dict(spec)


def _worker(rank: int, store_dir: str, plan_json: str, model_name: str, rounds: int,
            iters: int, out: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(store_dir, "store"), WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=120))
    from hetplan import zoo
    from hetplan.ir.plan import Plan
    from hetplan.runtime.executor import Runtime
    from hetplan.runtime.worker import make_target, synthetic_batch

    plan = Plan.from_json(plan_json)
    assert plan.layout is not None
    batch = plan.layout.micro_batch_size * plan.layout.dp
    ex_args, ex_kwargs = zoo.example_inputs(model_name, batch=1, device="cpu")
    ours = zoo.build(model_name, device="cpu", seed=0)
    theirs = zoo.build(model_name, device="cpu", seed=0)
    rt = Runtime(plan, ours, example_args=ex_args, example_kwargs=ex_kwargs)
    ddp = torch.nn.parallel.DistributedDataParallel(theirs, bucket_cap_mb=25)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    target_of = make_target(theirs, ex_args, ex_kwargs)
    kwargs = {k: v for k, v in ex_kwargs.items() if not isinstance(v, torch.Tensor)}
    b = batch // WORLD
    times: dict[str, list[float]] = {"hetplan": [], "ddp": []}
    for r in range(rounds + 1):  # round 0 is warm-up
        for which in ("hetplan", "ddp") if r % 2 else ("ddp", "hetplan"):
            for i in range(iters):
                xs = synthetic_batch(ex_args, batch, r * 100 + i)
                y = target_of(xs, batch)
                dist.barrier()
                t0 = time.perf_counter()
                if which == "hetplan":
                    rt.train_step(xs, y)
                else:
                    local = [x[rank * b:(rank + 1) * b] for x in xs]
                    loss = rt.loss_fn(ddp(*local, **kwargs), y[rank * b:(rank + 1) * b])
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                if r:
                    times[which].append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="gpt-test")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    import hetplan

    plan = hetplan.compile(args.model, _cluster(WORLD), batch_size=args.batch, dp=WORLD, pp=1,
                           tp=1, micro_batch_size=args.batch // WORLD)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        mp.spawn(_worker, args=(tmp, plan.to_json(), args.model, args.rounds, args.iters, out),
                 nprocs=WORLD, join=True)
        times = json.loads(Path(out).read_text())
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    ratio = med["hetplan"] / med["ddp"]
    print(f"{args.model}: hetplan {med['hetplan']:.2f} ms, DDP {med['ddp']:.2f} ms, "
          f"ratio {ratio:.3f} (target ≤ 1.10)")
    result = {
        "machine": machine(device="cpu", backend="gloo"),
        "model": args.model, "world_size": WORLD, "global_batch": args.batch,
        "iterations_each": len(times["ddp"]),
        "median_ms": med, "ratio_hetplan_over_ddp": ratio, "target": 1.10,
        "meets_target": ratio <= 1.10,
        "buckets": len(plan.gradient_sync.buckets) if plan.gradient_sync else 0,
    }
    path = ROOT / "bench" / "results" / "runtime_overhead_cpu.json"
    path.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
