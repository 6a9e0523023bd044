"""A training script (the ``hetplan run --script`` form) whose ranks 2 and 3 load another
plan, ``HETPLAN_FAULT_OTHER_PLAN``: the same model and layout, another global batch. Without
the ranks' agreement on the plan, the first gradient all-reduce mixes two bucket layouts
("Received data size doesn't match"); with it, every rank refuses before training."""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from hetplan import load_plan, zoo
from hetplan.runtime.executor import Runtime


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", required=True)
    ap.add_argument("--steps", type=int, default=3)
    args, _ = ap.parse_known_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=10))
    rank = dist.get_rank()
    plan = load_plan(os.environ["HETPLAN_FAULT_OTHER_PLAN"] if rank >= 2 else args.plan)
    model = zoo.build("mlp", device="cpu", seed=0)
    ex_args, ex_kwargs = zoo.example_inputs("mlp", batch=1, device="cpu")
    rt = Runtime(plan, model, example_args=ex_args, example_kwargs=ex_kwargs)
    layout = plan.layout
    assert layout is not None
    batch = layout.dp * layout.micro_batches * layout.micro_batch_size
    for step in range(args.steps):
        x = torch.randn(batch, *ex_args[0].shape[1:], generator=torch.Generator().manual_seed(step))
        rt.train_step(x, torch.zeros(batch, *model(ex_args[0]).shape[1:]))
        print(f"rank {rank} step {step}", flush=True)
    rt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
