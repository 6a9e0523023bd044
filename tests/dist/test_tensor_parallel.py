"""Tensor parallelism with uneven shards on gloo: forward, loss, every gradient and the
parameters after SGD steps equal a single-process float64 reference.

One process start per world size runs every case of that size (module-scoped fixtures), so the
slow part (starting processes that import torch) is paid once per world size.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from hetplan.errors import PlanMismatchError
from hetplan.ir.model import LinearInfo, TPRole
from hetplan.ir.plan_sections import TensorParallel, TPGroup, TPLinearShard
from hetplan.models import TinyGPT
from hetplan.profiling._spawn import start_method
from hetplan.runtime.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    shard_model,
    tp_pairs,
)

pytestmark = pytest.mark.dist

STEPS = 3
LR = 0.1
DIM = 6
TOL: dict[str, Any] = {"rtol": 1e-10, "atol": 1e-12}


class Conv1D(nn.Module):
    """HF GPT-2's ``Conv1D`` (weight stored [in, out]), without importing transformers."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.2)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.addmm(self.bias, x.reshape(-1, x.size(-1)), self.weight)
        return out.view(*x.shape[:-1], self.nf)


class Block(nn.Module):
    """Residual MLP block: fc1 (column) → gelu → fc2 (row), or c_fc/c_proj as Conv1D."""

    def __init__(self, dim: int, hidden: int, conv1d: bool) -> None:
        super().__init__()
        self.conv1d = conv1d
        if conv1d:
            self.c_fc, self.c_proj = Conv1D(hidden, dim), Conv1D(dim, hidden)
        else:
            self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up, down = (self.c_fc, self.c_proj) if self.conv1d else (self.fc1, self.fc2)
        return x + down(F.gelu(up(x)))


class BlockNet(nn.Module):
    """``inp`` (replicated) → blocks → ``out`` (replicated)."""

    def __init__(self, hidden: int, n_blocks: int = 2, conv1d: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(Block(DIM, hidden, conv1d) for _ in range(n_blocks))
        self.out = nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def _linears(hidden: int, n_blocks: int, conv1d: bool) -> list[LinearInfo]:
    up, down = ("c_fc", "c_proj") if conv1d else ("fc1", "fc2")
    out = [LinearInfo("inp", DIM, DIM, True)]
    for i in range(n_blocks):
        c, r = f"blocks.{i}.{up}", f"blocks.{i}.{down}"
        out += [LinearInfo(c, DIM, hidden, True, TPRole.COLUMN, r),
                LinearInfo(r, hidden, DIM, True, TPRole.ROW, c)]
    return [*out, LinearInfo("out", DIM, 3, True)]


def _section(world: int,
             shards: dict[str, tuple[Literal["column", "row"], list[int]]]) -> TensorParallel:
    lins = tuple(TPLinearShard(name=n, split=s, features=sum(z), shard_sizes=tuple(z))
                 for n, (s, z) in shards.items())
    return TensorParallel(groups=(TPGroup(ranks=tuple(range(world)), stage=0, linears=lins),))


#: name -> (world, kind, hidden, tp section or None); kind: mlp | conv1d | gpt
CASES: dict[str, tuple[int, str, int, TensorParallel | None]] = {
    "even2": (2, "mlp", 16, None),
    "uneven2": (2, "mlp", 16, _section(2, {
        "blocks.0.fc1": ("column", [3, 13]), "blocks.0.fc2": ("row", [3, 13]),
        "blocks.1.fc2": ("row", [13, 3])})),  # only the row listed: its column follows
    "conv1d2": (2, "conv1d", 16, _section(2, {"blocks.0.c_fc": ("column", [11, 5])})),
    "gpt2": (2, "gpt", 32, _section(2, {"blocks.0.fc1": ("column", [5, 27])})),
    "even4": (4, "mlp", 18, None),  # 18 on 4 ranks: [5, 5, 4, 4]
    "uneven4": (4, "mlp", 16, _section(4, {
        "blocks.0.fc1": ("column", [1, 2, 5, 8]), "blocks.1.fc1": ("column", [0, 4, 4, 8])})),
}


def _model(kind: str, hidden: int) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt":
        return TinyGPT(vocab_size=16, block_size=8, dim=8, n_layers=2, n_heads=2).double()
    return BlockNet(hidden, conv1d=kind == "conv1d").double()


def _gpt_linears() -> list[LinearInfo]:
    """What ``capture`` reports for the TinyGPT above (qkv is paired with fc2 by name order)."""
    out: list[LinearInfo] = []
    for i in range(2):
        p = f"blocks.{i}"
        out += [LinearInfo(f"{p}.attn.qkv", 8, 24, True, TPRole.COLUMN, f"{p}.fc2"),
                LinearInfo(f"{p}.attn.proj", 8, 8, True),
                LinearInfo(f"{p}.fc1", 8, 32, True, TPRole.COLUMN, f"{p}.fc2"),
                LinearInfo(f"{p}.fc2", 32, 8, True, TPRole.ROW, f"{p}.fc1")]
    return [*out, LinearInfo("head", 8, 16, False)]


def _data(kind: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    if kind == "gpt":
        ids = torch.randint(0, 16, (3, 8), generator=g)
        return ids, torch.randn(3, 8, 16, generator=g, dtype=torch.float64)
    return (torch.randn(5, DIM, generator=g, dtype=torch.float64),
            torch.randn(5, 3, generator=g, dtype=torch.float64))


def _full(model: nn.Module, grad: bool) -> dict[str, torch.Tensor]:
    """Every parameter (or gradient) at full shape; shards are gathered (collective)."""
    out: dict[str, torch.Tensor] = {}
    for mname, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            key = f"{mname}.{pname}" if mname else pname
            if isinstance(mod, ColumnParallelLinear | RowParallelLinear):
                full = mod.gather_weight(grad) if pname == "weight" else mod.gather_bias(grad)
                assert full is not None
                out[key] = full
            else:
                out[key] = (p.grad if grad else p).detach().clone()
    return out


def _train(model: nn.Module, kind: str, out: dict[str, Any]) -> None:
    """``STEPS`` steps of plain SGD. Written out: ``torch.optim.SGD`` would import
    ``torch._dynamo`` in every spawned process (seconds each on a small machine); its update
    without momentum is this same ``p.add_(p.grad, alpha=-lr)``."""
    params = list(model.parameters())
    for step in range(STEPS):
        x, y = _data(kind, step)
        pred = model(x)
        loss = F.mse_loss(pred, y)
        loss.backward()
        if step == 0:
            out.update(pred=pred.detach(), loss=float(loss.detach()), grads=_full(model, grad=True))
        with torch.no_grad():
            for p in params:
                assert p.grad is not None
                p.add_(p.grad, alpha=-LR)
                p.grad = None
    out["params"] = _full(model, grad=False)


def _worker(rank: int, world: int, store_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)  # several ranks share few cores: no OpenMP oversubscription
    store = dist.FileStore(os.path.join(store_dir, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        results: dict[str, Any] = {}
        for name, (w, kind, hidden, section) in CASES.items():
            if w != world:
                continue
            model = _model(kind, hidden)
            lins = _gpt_linears() if kind == "gpt" else _linears(hidden, 2, kind == "conv1d")
            shard_model(model, lins, section, None, rank, world, stage=0)
            res: dict[str, Any] = {"shapes": {n: tuple(p.shape)
                                              for n, p in model.named_parameters()}}
            _train(model, kind, res)
            results[name] = res
        torch.save(results, os.path.join(out_dir, f"out.{rank}"))
    finally:
        dist.destroy_process_group()


def _reference(kind: str, hidden: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    _train(_model(kind, hidden), kind, out)
    return out


def _spawn(tmp: Path, world: int) -> list[dict[str, Any]]:
    mp.start_processes(_worker, args=(world, str(tmp), str(tmp)), nprocs=world, join=True,
                       start_method=start_method())
    return [torch.load(tmp / f"out.{r}") for r in range(world)]


@pytest.fixture(scope="module")
def results2(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _spawn(tmp_path_factory.mktemp("tp2"), 2)


@pytest.fixture(scope="module")
def results4(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _spawn(tmp_path_factory.mktemp("tp4"), 4)


def _check(results: list[dict[str, Any]], case: str) -> None:
    _, kind, hidden, _ = CASES[case]
    ref = _reference(kind, hidden)
    for rank, res in enumerate(results):
        got = res[case]
        torch.testing.assert_close(got["pred"], ref["pred"], **TOL)
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-12)
        assert got["grads"].keys() == ref["grads"].keys(), rank
        for n, g in ref["grads"].items():
            torch.testing.assert_close(got["grads"][n], g, **TOL, msg=f"grad {n} rank {rank}")
        for n, p in ref["params"].items():
            torch.testing.assert_close(got["params"][n], p, **TOL, msg=f"{n} rank {rank}")


@pytest.mark.parametrize("case", ["even2", "uneven2", "conv1d2", "gpt2"])
def test_two_ranks_equal_single_process(results2: list[dict[str, Any]], case: str) -> None:
    _check(results2, case)


@pytest.mark.parametrize("case", ["even4", "uneven4"])
def test_four_ranks_equal_single_process(results4: list[dict[str, Any]], case: str) -> None:
    _check(results4, case)


def test_local_shards_have_the_planned_sizes(results2: list[dict[str, Any]],
                                             results4: list[dict[str, Any]]) -> None:
    s2 = [r["uneven2"]["shapes"] for r in results2]
    assert [s["blocks.0.fc1.weight"] for s in s2] == [(3, DIM), (13, DIM)]
    assert [s["blocks.0.fc2.weight"] for s in s2] == [(DIM, 3), (DIM, 13)]
    assert [s["blocks.1.fc1.bias"] for s in s2] == [(13,), (3,)]
    assert [s["blocks.0.fc2.bias"] for s in s2] == [(DIM,), (DIM,)]  # replicated
    assert [r["conv1d2"]["shapes"]["blocks.0.c_fc.weight"] for r in results2] == \
        [(11, DIM), (5, DIM)]  # stored in nn.Linear layout [out, in]
    gpt = [r["gpt2"]["shapes"] for r in results2]
    assert [s["blocks.0.fc1.weight"][0] for s in gpt] == [5, 27]
    assert [s["blocks.1.fc1.weight"][0] for s in gpt] == [16, 16]
    assert all(s["blocks.0.attn.qkv.weight"] == (24, 8) for s in gpt)  # attention replicated
    s4 = [r["uneven4"]["shapes"] for r in results4]
    assert [s["blocks.0.fc1.weight"][0] for s in s4] == [1, 2, 5, 8]
    assert [s["blocks.1.fc2.weight"][1] for s in s4] == [0, 4, 4, 8]
    assert [r["even4"]["shapes"]["blocks.0.fc1.weight"][0] for r in results4] == [5, 5, 4, 4]


# -- decisions, without processes ------------------------------------------------------------
def test_only_mlp_pairs_are_sharded_in_tinygpt() -> None:
    pairs, skipped = tp_pairs(_model("gpt", 32), _gpt_linears(), 2)
    assert [(p.columns, p.row, p.shard_sizes) for p in pairs] == [
        (("blocks.0.fc1",), "blocks.0.fc2", (16, 16)),
        (("blocks.1.fc1",), "blocks.1.fc2", (16, 16))]
    assert "another module" in skipped["blocks.0.attn.qkv"]
    assert skipped["head"] == "role 'either'"


def test_attention_modules_are_not_sharded() -> None:
    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.num_heads = 2
            self.c_attn, self.c_proj = nn.Linear(4, 4), nn.Linear(4, 4)

    m = nn.Module()
    m.attn = Attn()
    lins = [LinearInfo("attn.c_attn", 4, 4, True, TPRole.COLUMN, "attn.c_proj"),
            LinearInfo("attn.c_proj", 4, 4, True, TPRole.ROW, "attn.c_attn")]
    pairs, skipped = tp_pairs(m, lins, 2)
    assert pairs == [] and "attention" in skipped["attn.c_proj"]


def test_inconsistent_plan_shards_are_refused() -> None:
    sec = _section(2, {"blocks.0.fc1": ("column", [3, 13]), "blocks.0.fc2": ("row", [8, 8])})
    with pytest.raises(PlanMismatchError, match="different shard sizes"):
        tp_pairs(_model("mlp", 16), _linears(16, 2, False), 2, sec.groups[0])
    bad = _section(2, {"blocks.0.fc2": ("column", [8, 8])})
    with pytest.raises(PlanMismatchError, match="row linear"):
        tp_pairs(_model("mlp", 16), _linears(16, 2, False), 2, bad.groups[0])


def test_the_ranks_refuse_with_the_validators_field_path() -> None:
    """The ranks run the rules ``hetplan run`` checks before launch
    (:mod:`hetplan.ir.plan_tp_checks`) for plans that skipped it (``--script``): same text,
    the group's field path; a misspelt linear ran even shards before."""
    sec = _section(2, {"blocks.0.fc1": ("column", [3, 13]), "blocks.0.fc2": ("row", [8, 8])})
    with pytest.raises(PlanMismatchError, match=r"tensor_parallel\.groups\[0\]\.linears\[1\]"
                       r"\.shard_sizes: \[8, 8\], but linears\[0\]"):
        shard_model(_model("mlp", 16), _linears(16, 2, False), sec, None, 0, 2, stage=0)
    typo = _section(2, {"blocks.0.fcl": ("column", [3, 13])})
    with pytest.raises(PlanMismatchError, match=r"linears\[0\]\.name: 'blocks\.0\.fcl' is not"):
        shard_model(_model("mlp", 16), _linears(16, 2, False), typo, None, 0, 2, stage=0)


def test_tp_size_one_leaves_the_model_alone() -> None:
    model = _model("mlp", 16)
    assert shard_model(model, _linears(16, 2, False), None, None, 0, 1) is model
    assert isinstance(model.get_submodule("blocks.0.fc1"), nn.Linear)


def test_single_shard_is_the_full_linear() -> None:
    torch.manual_seed(1)
    lin, x = nn.Linear(4, 5).double(), torch.randn(2, 4, dtype=torch.float64)
    col = ColumnParallelLinear.from_linear(lin, [5], 0)
    row = RowParallelLinear.from_linear(lin, [4], 0)
    torch.testing.assert_close(col(x), lin(x))
    torch.testing.assert_close(row(x), lin(x))
    torch.testing.assert_close(col.gather_weight(), lin.weight.detach())


def test_plan_listing_an_attention_linear_warns_and_keeps_it_replicated() -> None:
    sec = _section(2, {"blocks.0.attn.qkv": ("column", [8, 16]),
                       "blocks.0.fc2": ("row", [30, 2])})
    model = _model("gpt", 32)
    with pytest.warns(RuntimeWarning, match="qkv"):
        shard_model(model, _gpt_linears(), sec, None, 1, 2, stage=0)  # no collective needed
    assert isinstance(model.get_submodule("blocks.0.attn.qkv"), nn.Linear)
    assert model.get_submodule("blocks.0.fc1").weight.shape == (2, 8)
    assert model.get_submodule("blocks.0.fc2").weight.shape == (8, 2)


def test_a_plan_group_that_does_not_fit_is_refused() -> None:
    sec = _section(4, {})
    with pytest.raises(PlanMismatchError, match="does not match this process"):
        shard_model(_model("mlp", 16), _linears(16, 2, False), sec, None, 0, 2, stage=0)
