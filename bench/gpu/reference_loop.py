"""Plain PyTorch training loops on one GPU: the reference `hetplan run` is measured against.

Trains a zoo model on the same synthetic batches as ``hetplan run`` (``synthetic_batch``),
with Adam (lr 1e-4) and bf16 autocast, three ways, on one process with NCCL:

- ``plain``: the model as is;
- ``ddp``: ``DistributedDataParallel`` (world size 1: its hooks and buckets, no traffic);
- ``fsdp2``: ``fully_shard`` on every transformer block and the root, bf16 parameters, fp32
  reduction (world size 1).

The loss is computed in fp32 (``--loss fp32``, the default): inside the autocast region, as
torch's AMP recipe computes it, where cross-entropy runs in fp32 — as hetplan's runtime
computes its loss (``precision.fp32_loss_fn``). ``--loss bf16`` computes it outside autocast
on the bf16 logits (the loop's earlier measurements: about 3 GB less memory traffic per step
for GPT-2's 50k-word vocabulary, a different job from the runtime's). ``--loss fp32,bf16``
measures both. Each timed step ends with ``torch.cuda.synchronize()``, as ``hetplan run``'s
steps end by reading the loss; 3 warm-up steps, then the median of 20.

Prints and writes (``--out``) the median iteration time and peak allocated memory of each::

    torchrun --nproc-per-node 1 bench/gpu/reference_loop.py --model gpt2 --batch 8 --out r.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist


def _time(step: Any, iters: int, warmup: int) -> tuple[float, float]:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2**20


def _variant(kind: str, name: str, batch: int, iters: int, warmup: int,
             loss_dtype: str) -> dict[str, Any]:
    from hetplan import zoo
    from hetplan.runtime.executor import _default_loss
    from hetplan.runtime.worker import make_target, synthetic_batch

    model = zoo.build(name, device="cpu", seed=0)
    ex_args, ex_kwargs = zoo.example_inputs(name, batch=1, device="cpu")
    target_of = make_target(model, ex_args, ex_kwargs)
    model = model.cuda()
    if kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif kind == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        blocks = [m for m in model.modules() if type(m).__name__.endswith("Block")]
        for b in blocks:
            fully_shard(b, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    batches = [tuple(x.cuda() for x in synthetic_batch(ex_args, batch, s)) for s in range(4)]
    state = {"i": 0}

    def step() -> None:
        xs = batches[state["i"] % len(batches)]
        state["i"] += 1
        y = target_of(xs, batch).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(*xs)
            # fp32: autocast runs cross-entropy in fp32; bf16: on the bf16 logits, outside it
            loss = _default_loss(out, y) if loss_dtype == "fp32" else None
        if loss is None:
            loss = _default_loss(out, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    ms, peak = _time(step, iters, warmup)
    return {"kind": kind, "loss_dtype": loss_dtype, "iteration_ms": ms, "peak_mib": peak}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--loss", default="fp32",
                    help="the loss's dtype: fp32 (as hetplan), bf16, or both: fp32,bf16")
    args = ap.parse_args()
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    try:
        rows = [_variant(k, args.model, args.batch, args.iters, args.warmup, loss)
                for loss in args.loss.split(",") for k in ("plain", "ddp", "fsdp2")]
    finally:
        dist.destroy_process_group()
    result = {"device": torch.cuda.get_device_name(0), "model": args.model,
              "batch": args.batch, "optimizer": "adam lr 1e-4", "autocast": "bf16",
              "warmup": args.warmup, "iters": args.iters, "variants": rows}
    for r in rows:
        print(f"{r['kind']:>6} ({r['loss_dtype']} loss): {r['iteration_ms']:.2f} ms/iteration, "
              f"peak {r['peak_mib']:.0f} MiB")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
