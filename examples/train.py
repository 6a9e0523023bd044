"""Train your own model with a hetplan plan: the user-script form of `hetplan run`.

    hetplan plan --module examples.train:factory --cluster local-cpu -b 16 --dp 2 -o plan.json
    hetplan run plan.json --script examples/train.py --steps 20      # or, directly:
    torchrun --standalone --nproc-per-node 4 examples/train.py --plan plan.json --steps 20

A plan uses every device of its cluster: local-cpu has 4, so ``--dp 2`` gives dp=2 x pp=2 and
torchrun starts 4 processes (``hetplan run --dry-run`` prints the command it would run).

``factory()`` gives the model and one example micro-batch (what the plan was captured with);
the script owns the data and the loop, and hetplan owns the parallelism and gradient sync.

At the end the script releases the runtime (``rt.close()``: gradient hooks, threads, the
heartbeat, its process groups), waits for every rank, then destroys the process groups.
A process that reaches interpreter exit while torch.distributed still holds a thread in C++
may abort ("terminate called without an active exception"); under ``hetplan run --script``
the worker also tears down whatever the script left and exits without finalisation.
"""

from __future__ import annotations

import argparse
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(4)
        )
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def factory() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """The model (same seed on every rank) and one example micro-batch of size 1."""
    torch.manual_seed(0)
    return Regressor(), (torch.zeros(1, 32),)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", required=True)
    ap.add_argument("--steps", type=int, default=20)
    args, _ = ap.parse_known_args()

    from hetplan import load_plan
    from hetplan.runtime.executor import Runtime

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    plan = load_plan(args.plan)
    model, example = factory()
    rt = Runtime(plan, model, example_args=example,
                 optimizer=lambda params: torch.optim.Adam(params, lr=1e-3))
    layout = plan.layout
    batch = layout.dp * layout.micro_batches * layout.micro_batch_size
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(32, 1, generator=gen)
    for step in range(args.steps):
        x = torch.randn(batch, 32, generator=gen)  # the same global batch on every rank
        loss = rt.train_step(x, x @ w)
        if loss == loss and step % 5 == 0:  # NaN on pipeline ranks without the last stage
            print(f"rank {dist.get_rank()} step {step}: loss {loss:.4f}", flush=True)
    rt.close()
    dist.barrier()  # no rank tears its connections down while a peer still uses them
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
