"""Bench: the runtime's TP step with both TP groups stepping at once against one group alone.

``hetplan profile`` times the tensor-parallel step (``profiling/tp_step.py``) with every TP
group of the 4 CPU ranks stepping at once, as TP x DP replicas do. In a pipeline whose stages
are the TP groups (``pp-tp``), the stages take turns through the fill and the drain, so a
stage often steps while the other waits. This runs the same split model (the runtime's
``TensorParallelHandler``, tp 2, sequence parallelism on, micro-batch 2, Adam) on 4 gloo
processes (two groups stepping at once) and on 2 (one group alone), back to back, ``--reps``
times, optionally with an idle gap before every step (``--gap-ms``, as a stage waits for its
hand-over), and reports the median forward (with the loss) and backward per step, mean over
the ranks.

Run: ``python bench/tp_contention.py [--model M] [--reps N] [--steps N] [--gap-ms MS]
[--out FILE]`` (default ``bench/results/tp_contention.json``). About 10 s per run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

OUT = Path(__file__).parent / "results" / "tp_contention.json"


def worker(rank: int, world: int, model: str, gap_s: float, steps: int) -> tuple[float, float]:
    """One rank: tp 2 over consecutive ranks, ``steps`` timed steps after 2 untimed ones."""
    import torch.distributed as dist

    from hetplan import zoo
    from hetplan.ir.capture import capture
    from hetplan.profiling.collectives import own_groups
    from hetplan.profiling.tp_step import _split
    from hetplan.runtime.executor import plan_optimizer

    group = own_groups(rank, world, [2])[2] if world != 2 else None
    args, kwargs = zoo.example_inputs(model, batch=2, seq=None, device="cpu")
    target = args[0]
    ir = capture(zoo.build(model, device="meta", seed=0), tuple(args), dict(kwargs), name=model)
    net = zoo.build(model, device="cpu", seed=0)
    split = _split(model, net, ir, group, rank, 2, True)
    if split is None:
        raise SystemExit(f"{model}: nothing to split by tensor parallelism")
    handler, ctx, loss_fn = split
    opt = plan_optimizer("adam")([p for p in net.parameters() if p.requires_grad])
    fw: list[float] = []
    bw: list[float] = []
    dist.barrier()
    for k in range(steps + 2):
        if gap_s:
            time.sleep(gap_s)
        t0 = time.perf_counter()
        loss = loss_fn(net(*args, **kwargs), target)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        handler.after_backward(ctx)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if k >= 2:
            fw.append(t1 - t0)
            bw.append(t2 - t1)
    dist.barrier()
    return statistics.median(fw) * 1e3, statistics.median(bw) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="megatron-gpt-test")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--gap-ms", type=float, default=0.0)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    import tp_contention as me  # the worker must be importable by the spawned ranks

    from hetplan.profiling._spawn import run_local_ranks

    rows: list[dict[str, Any]] = []
    load = [round(x, 2) for x in os.getloadavg()]
    for rep in range(args.reps):
        for world in (4, 2):
            got = run_local_ranks(me.worker, world, (args.model, args.gap_ms / 1e3, args.steps),
                                  backend="gloo", timeout_s=300, threads_per_process=1)
            f = statistics.mean(x[0] for x in got)
            b = statistics.mean(x[1] for x in got)
            rows.append({"rep": rep, "processes": world, "groups_stepping": world // 2,
                         "forward_ms": round(f, 3), "backward_ms": round(b, 3)})
            print(f"rep {rep}: {world // 2} group(s) stepping: forward {f:6.2f} ms, "
                  f"backward {b:6.2f} ms", flush=True)
    pairs = [(a, b) for a, b in zip(rows[::2], rows[1::2], strict=True)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "what": "the runtime's TP step (tp 2, sequence parallel) with two TP groups stepping "
                "at once (4 processes) and one alone (2), back to back per rep",
        "model": args.model, "steps": args.steps, "gap_ms": args.gap_ms,
        "machine": {"cpus": os.cpu_count(), "load_average_start": load,
                    "load_average_end": [round(x, 2) for x in os.getloadavg()]},
        "runs": rows,
        "both_over_alone": {
            "forward": [round(a["forward_ms"] / b["forward_ms"], 3) for a, b in pairs],
            "backward": [round(a["backward_ms"] / b["backward_ms"], 3) for a, b in pairs]},
    }, indent=1) + "\n")


if __name__ == "__main__":
    main()
