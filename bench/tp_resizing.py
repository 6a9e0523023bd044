"""Heterogeneous tensor parallelism on CPU: no balancing vs static skew vs ZERO vs SEMI.

Four gloo ranks form one tensor-parallel group and train a residual MLP (``BLOCKS`` Megatron
pairs fc1 → gelu → fc2, hidden ``H``, uneven-capable column/row-parallel linears) on a fixed
teacher-regression task. Every rank emulates a device of ``FLOP_RATE`` FLOP/s (each GEMM lasts
its FLOPs / rate: the 4 ranks share 2 cores here, and real-time sleep injection alone is hidden
by the freed core, see ``StragglerEmulator``); rank 3's GEMMs take ``1 + χ`` times as long
(χ = extra time, §7 item 27 of the digest). For χ ∈ {1, 2, 4, 8}:

- ``none``: even shards, no controller (the paper's Baseline);
- ``static``: shard sizes proportional to speed (``1 / (1 + χ)`` for rank 3), the static
  skewed assignment of ``algorithms/skewed_shards.py``;
- ``zero``: even shards, ZERO-resizing (PriDiff, criterion T_avg) decided by the controller;
- ``semi``: even shards, SEMI-migration (criterion T_min, Eq. (2)/(3));
- ``migration``: even shards, migration only (MIG), for reference.

and, at χ = 8, the same with the straggler rotating to the next rank every 4 steps (the
paper's round-robin tests): static shards sized for rank 3 cannot follow it.

Per configuration: the median iteration time over the steps after ``WARMUP`` (rank 0's wall
clock; all ranks meet in the all-reduces every layer), the training loss after ``STEPS``
steps (mean of the last 4, as computed — pruned columns missing) and the held-out loss of the
trained model with every column computed, both beside the homogeneous run (χ = 0, even
shards). The paper's
figures (ViT-1B on 8 × V100, Fig. 9) are written beside them. The machine is shared (2 cores
for 4 ranks and other work): ratios are measured side by side in one run, not absolute times.

    python bench/tp_resizing.py [--steps 16] [--out bench/results/tp_resizing_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _machine import machine
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
WORLD, D, H, BLOCKS, ROWS = 4, 128, 512, 2, 256
WARMUP, LR = 5, 0.05
FLOP_RATE = 1e9  # emulated device speed, FLOP/s (see StragglerEmulator)
CHIS = (1.0, 2.0, 4.0, 8.0)
METHODS = ("none", "static", "zero", "semi", "migration")
#: the paper's round-robin straggler (Figs. 7-8): it moves to the next rank every few steps
ROTATING_CHI, ROTATE_EVERY = 8.0, 4
ROTATING_METHODS = ("none", "static", "zero", "semi")
PAPER = {
    "source": "Wang et al., Accelerating Heterogeneous Tensor Parallelism via Flexible "
              "Workload Control, Sec. V-C, Fig. 9 (ViT-1B, CIFAR-10, 8 x V100, one straggler)",
    "baseline": "iteration time grows linearly with chi",
    "zero_pri_chi8": {"speedup_vs_baseline": 3.5, "accuracy_loss_pct": 1.3},
    "zero_pridiffE_chi8": {"speedup_vs_baseline": 2.1, "accuracy_loss_pct": 0.3},
    "zero_pridiffR": "up to 4 % faster than Pri (chi = 2), comparable accuracy",
    "semi": "scales like PriDiffR with much less accuracy loss (Fig. 10, no numbers)",
}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, H), nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.out = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def _linears() -> list[Any]:
    from hetplan.ir.model import LinearInfo, TPRole

    out = []
    for i in range(BLOCKS):
        c, r = f"blocks.{i}.fc1", f"blocks.{i}.fc2"
        out += [LinearInfo(c, D, H, True, TPRole.COLUMN, r),
                LinearInfo(r, H, D, True, TPRole.ROW, c)]
    return [*out, LinearInfo("out", D, D, True)]


def _section(method: str, chi: float) -> Any:
    from hetplan.algorithms.skewed_shards import proportional_shards
    from hetplan.ir.plan_sections import (
        ResizingController,
        TensorParallel,
        TPGroup,
        TPLinearShard,
    )

    variant = method if method in ("zero", "semi", "migration") else "off"
    # noisy shared CPU: a 20 % tolerance before a rank counts as a straggler (§7 item 25)
    ctl = ResizingController(variant=variant, straggler_eps=0.2,  # type: ignore[arg-type]
                             criterion="avg" if variant == "zero" else "min")
    lins: tuple[Any, ...] = ()
    if method == "static":
        sizes = proportional_shards(H, [1.0, 1.0, 1.0, 1.0 / (1.0 + chi)], granularity=8)
        lins = tuple(TPLinearShard(name=f"blocks.{i}.fc1", split="column", features=H,
                                   shard_sizes=sizes) for i in range(BLOCKS))
    return TensorParallel(controller=ctl, groups=(TPGroup(ranks=tuple(range(WORLD)),
                                                          linears=lins),))


def _data(step: int, teacher: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(ROWS, D, generator=g)
    with torch.no_grad():
        return x, teacher(x)


def _teacher() -> nn.Module:
    torch.manual_seed(123)
    return Net()


def _run(rank: int, method: str, chi: float, steps: int, rotate: int = 0) -> dict[str, Any]:
    from hetplan.runtime.resizing import StragglerSpec, attach_resizing, end_iteration
    from hetplan.runtime.tensor_parallel import shard_model

    torch.manual_seed(0)
    model = Net()
    section = _section(method, chi)
    shard_model(model, _linears(), section, None, rank, WORLD)
    straggler = StragglerSpec(chi, 3, rotate_every=rotate, flop_rate=FLOP_RATE)
    clock, ctl = attach_resizing(model, section, None, rank, WORLD, straggler)
    teacher = _teacher()
    params = list(model.parameters())
    times, losses = [], []
    for step in range(steps):
        x, y = _data(step, teacher)
        t0 = time.perf_counter()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        with torch.no_grad():
            for p in params:
                assert p.grad is not None
                p.add_(p.grad, alpha=-LR)
                p.grad = None
        busy = time.perf_counter() - t0
        end_iteration(clock, ctl, busy)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    out: dict[str, Any] = {"times": times, "losses": losses,
                           "eval_loss": _evaluate(model, teacher)}
    if ctl is not None:
        pos = max(range(WORLD), key=lambda r: (ctl.decisions[r].resize
                                               + ctl.decisions[r].migrate, r))
        last = ctl.decisions[pos]
        out["straggler_decision"] = {"rank": pos, "role": last.role,
                                     "resize": round(last.resize, 4),
                                     "migrate": round(last.migrate, 4)}
        out["replans"] = sum(1 for h in ctl.history if h["replan"])
    return out


def _evaluate(model: nn.Module, teacher: nn.Module) -> float:
    """Loss of the trained model on a held-out batch, every column computed (no pruning)."""
    from hetplan.runtime.resizing import LayerStep, ResizableColumnLinear, ResizableRowLinear

    for mod in model.modules():
        if isinstance(mod, ResizableColumnLinear | ResizableRowLinear):
            mod.rz.step = LayerStep()
    x, y = _data(10_000, teacher)
    with torch.no_grad():
        return float(F.mse_loss(model(x), y))


def _rank(rank: int, world: int, steps: int) -> dict[str, Any]:
    del world
    res = {"homogeneous": _run(rank, "none", 0.0, steps)}
    for chi in CHIS:
        for method in METHODS:
            res[f"{method}/{chi:g}"] = _run(rank, method, chi, steps)
    for method in ROTATING_METHODS:
        res[f"{method}/{ROTATING_CHI:g}/rot{ROTATE_EVERY}"] = _run(
            rank, method, ROTATING_CHI, steps, ROTATE_EVERY)
    return res


def _summary(res: dict[str, Any], steps: int) -> dict[str, Any]:
    def med(key: str) -> float:
        return statistics.median(res[key]["times"][WARMUP:]) * 1e3

    def final(key: str) -> float:
        return statistics.fmean(res[key]["losses"][-4:])

    def held_out(key: str) -> float:
        return float(res[key]["eval_loss"])

    homo_ms, homo_loss = med("homogeneous"), final("homogeneous")
    homo_eval = held_out("homogeneous")
    rows = []
    configs = [(chi, m, f"{m}/{chi:g}", f"none/{chi:g}", 0) for chi in CHIS for m in METHODS]
    configs += [(ROTATING_CHI, m, f"{m}/{ROTATING_CHI:g}/rot{ROTATE_EVERY}",
                 f"none/{ROTATING_CHI:g}/rot{ROTATE_EVERY}", ROTATE_EVERY)
                for m in ROTATING_METHODS]
    for chi, method, key, base_key, rotate in configs:
        base = med(base_key)
        rows.append({
            "chi": chi, "method": method, "rotate_every": rotate,
            "iteration_ms": round(med(key), 2),
            "speedup_vs_none": round(base / med(key), 3),
            "slowdown_vs_homogeneous": round(med(key) / homo_ms, 3),
            "final_loss": round(final(key), 6),
            "loss_vs_homogeneous_pct": round(100 * (final(key) - homo_loss) / homo_loss, 2),
            "eval_loss": round(held_out(key), 6),
            "eval_vs_homogeneous_pct": round(100 * (held_out(key) - homo_eval) / homo_eval,
                                             2),
            "straggler_decision": res[key].get("straggler_decision"),
            "replans": res[key].get("replans"),
        })
    return {"homogeneous": {"iteration_ms": round(homo_ms, 2), "final_loss": round(homo_loss, 6),
                            "eval_loss": round(homo_eval, 6),
                            "loss_curve": [round(v, 6) for v in res["homogeneous"]["losses"]]},
            "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/tp_resizing_cpu.json")
    args = ap.parse_args(argv)
    from hetplan.profiling._spawn import run_local_ranks

    t0 = time.perf_counter()
    outs = run_local_ranks(_rank, WORLD, (args.steps,), timeout_s=900, threads_per_process=1)
    summary = _summary(outs[0], args.steps)
    doc = {
        "benchmark": "tp_resizing", "machine": machine(note="shared machine: 2 cores for 4 gloo ranks and other work; "
                                                           "compare ratios"),
        "setup": {"tp_ranks": WORLD, "straggler_rank": 3, "model": f"{BLOCKS} residual MLP "
                  f"pairs D={D} H={H}, fp32", "rows_per_step": ROWS, "steps": args.steps,
                  "warmup_steps_excluded": WARMUP, "optimizer": f"SGD lr {LR}",
                  "chi": "extra matmul time factor on rank 3 (its GEMMs last (1 + chi) x)",
                  "emulated_flop_rate": FLOP_RATE,
                  "controller_period": 20, "gamma_max": 0.9, "straggler_eps": 0.2,
                  "rotating": f"chi {ROTATING_CHI:g}, straggler moves to the next rank every "
                              f"{ROTATE_EVERY} steps (3, 0, 1, 2)"},
        "wall_seconds": round(time.perf_counter() - t0, 1),
        "paper": PAPER, **summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"homogeneous: {summary['homogeneous']['iteration_ms']} ms/it, "
          f"loss {summary['homogeneous']['final_loss']}")
    print(f"{'chi':>4} {'method':>10} {'ms/it':>8} {'speedup':>8} {'loss%':>7} {'eval%':>7}"
          "  decision")
    for r in summary["rows"]:
        rot = f"/rot{r['rotate_every']}" if r["rotate_every"] else ""
        print(f"{r['chi']:>4g} {r['method'] + rot:>10} {r['iteration_ms']:>8} "
              f"{r['speedup_vs_none']:>8} {r['loss_vs_homogeneous_pct']:>7} "
              f"{r['eval_vs_homogeneous_pct']:>7}  {r['straggler_decision']}")
    print(f"wrote {args.out} ({doc['wall_seconds']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
