"""Gradients as views of their bucket (``GradSync(grad_views=True)``), on 2 gloo ranks.

What the fast path must keep: every ``.grad`` shares the bucket's storage, at the same
address step after step; backward and the sync flatten nothing and copy nothing back (one
cast into the wire buffer and one back per cast bucket); after 3 micro-batches, over 3
iterations, the gradients are bit for bit those of the copy path and equal a
single-process reference, also when an optimizer dropped the gradients in between
(``zero_grad(set_to_none=True)`` without the sync's own ``zero_grad``). The runtime turns
views on without a pipeline and trains to the reference with 3 micro-batches.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from hetplan.ir.capture import capture
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import (
    Bucket,
    CastSync,
    ClusterRef,
    GradientSync,
    Layout,
    ModelRef,
    NoSync,
)
from hetplan.models import MLP
from hetplan.profiling._spawn import run_local_ranks
from hetplan.runtime.executor import Runtime
from hetplan.runtime.grad_sync import GradSync
from hetplan.runtime.handlers import GradSyncHandler

pytestmark = pytest.mark.dist

WORLD, MICRO, ITERS, ROWS = 2, 3, 3, 4  # rows per micro-batch and rank
LR = 0.05


def _model() -> nn.Module:
    torch.manual_seed(0)
    return MLP(in_features=6, hidden=(10, 12), out_features=4).double()


def _data(it: int, rank: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * it + 10 * rank + mb)
    return (torch.randn(ROWS, 6, generator=g, dtype=torch.float64),
            torch.randn(ROWS, 4, generator=g, dtype=torch.float64))


def _section(model: nn.Module, cast: bool) -> GradientSync:
    """Two buckets (the first hooked, the last launched by ``finish``); the first one sent
    in bf16 when ``cast``."""
    ir = capture(model, torch.zeros(1, 6, dtype=torch.float64))
    names = [g.name for g in ir.grad_tensors]
    return GradientSync(
        strategies={"fp": NoSync(), "half": CastSync(dtype="bf16")},
        buckets=(Bucket(tensors=tuple(names[:2]), size_bytes=1,
                        strategy="half" if cast else "fp"),
                 Bucket(tensors=tuple(names[2:]), size_bytes=1, strategy="fp")))


class _Ops(TorchDispatchMode):
    """Counts the aten operators run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.count: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        self.count[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def _sync_run(rank: int, cast: bool, views: bool) -> dict[str, Any]:
    """ITERS iterations of MICRO micro-batches through :class:`GradSync`; what each ended
    with. Iteration 0 ends as the runtime's step does (the optimizer's ``zero_grad``, then
    the sync's); iteration 1 only with the optimizer's, which drops the gradients."""
    model = _model()
    named = list(model.named_parameters())
    sync = GradSync(named, _section(model, cast), dist.group.WORLD, WORLD, grad_views=views)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    grads, ptrs, ops, early = [], [], [], []
    for it in range(ITERS):
        for mb in range(MICRO):
            x, y = _data(it, rank, mb)
            loss = nn.functional.mse_loss(model(x), y) / MICRO
            if mb < MICRO - 1:
                with sync.no_sync():
                    loss.backward()
                continue
            with _Ops() as counted:
                loss.backward()
                # the hooked first bucket went out during backward, the last one did not
                early.append([b.work is not None for b in sync.buckets])
                sync.finish()
            ops.append(dict(counted.count))
        grads.append({n: p.grad.clone() for n, p in named if p.grad is not None})
        ptrs.append([p.grad.untyped_storage().data_ptr() for _, p in named
                     if p.grad is not None])
        opt.step()
        opt.zero_grad(set_to_none=True)
        if it != 1:
            sync.zero_grad()
    flats = [b.flat.untyped_storage().data_ptr() for b in sync.buckets if b.flat is not None]
    shares = [[p.grad.untyped_storage().data_ptr() == b.flat.untyped_storage().data_ptr()
               for p in b.params] for b in sync.buckets if b.flat is not None]
    sync.close()
    return {"grads": grads, "ptrs": ptrs, "ops": ops, "early": early, "flats": flats,
            "shares": shares,
            "params": {n: p.detach().clone() for n, p in named}}


def _plan(model: nn.Module) -> Plan:
    ir = capture(model, torch.zeros(1, 6, dtype=torch.float64))
    return Plan(model=ModelRef.from_model_ir(ir),
                cluster=ClusterRef(name="test", fingerprint="test", world_size=WORLD),
                layout=Layout(dp=WORLD, micro_batches=MICRO, micro_batch_size=ROWS),
                gradient_sync=_section(model, cast=False))


def _runtime_run(rank: int) -> dict[str, Any]:
    """The runtime with 3 micro-batches: its losses, parameters and gradient addresses."""
    model = _model()
    rt = Runtime(_plan(model), model, example_args=(torch.zeros(1, 6, dtype=torch.float64),),
                 optimizer=lambda ps: torch.optim.SGD(ps, lr=LR))
    sync = rt.handler(GradSyncHandler).sync
    assert sync is not None
    ptrs = []
    for it in range(ITERS):
        parts = [_data(it, r, mb) for r in range(WORLD) for mb in range(MICRO)]
        # the global batch, ordered so that this rank's rows are its micro-batches
        x = torch.cat([p[0] for p in parts])
        y = torch.cat([p[1] for p in parts])
        rt.train_step(x, y)
        ptrs.append([p.grad.untyped_storage().data_ptr() for _, p in rt.named_params])
    out = {"views": sync.views, "ptrs": ptrs,
           "flats": [b.flat.untyped_storage().data_ptr() for b in sync.buckets],
           "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
    rt.close()
    return out


def _worker(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {f"sync-{cast}-{views}": _sync_run(rank, cast, views)
                           for cast in (False, True) for views in (False, True)}
    out["runtime"] = _runtime_run(rank)
    return out


def _reference() -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """One process: every rank's micro-batches, the replicas' mean; SGD."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    grads = []
    for it in range(ITERS):
        for r in range(WORLD):
            for mb in range(MICRO):
                x, y = _data(it, r, mb)
                (nn.functional.mse_loss(model(x), y) / MICRO / WORLD).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return grads, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_local_ranks(_worker, WORLD, timeout_s=300, threads_per_process=1)


@pytest.mark.parametrize("cast", [False, True])
def test_grads_share_the_bucket_storage_at_a_fixed_address(results: list[dict[str, Any]],
                                                           cast: bool) -> None:
    for got in results:
        run = got[f"sync-{cast}-True"]
        assert len(run["flats"]) == 2
        assert all(all(row) for row in run["shares"]), run["shares"]
        # the same addresses every iteration, also after the optimizer dropped them
        assert all(p == run["ptrs"][0] for p in run["ptrs"])
        copy = got[f"sync-{cast}-False"]
        assert copy["flats"] == []
        assert run["early"] == copy["early"] == [[True, False]] * ITERS


@pytest.mark.parametrize("cast", [False, True])
def test_no_flatten_and_no_copy_back(results: list[dict[str, Any]], cast: bool) -> None:
    params = len(results[0]["sync-False-True"]["params"])
    for got in results:
        for it, ops in enumerate(got[f"sync-{cast}-True"]["ops"]):
            assert ops.get("cat", 0) == 0, ops
            # a cast bucket goes into its wire buffer and back; after the optimizer dropped
            # the gradients (iteration 2), backward made new ones, copied into the bucket once
            want = (2 if cast else 0) + (params if it == 2 else 0)
            assert ops.get("copy_", 0) == want, (it, ops)
        for ops in got[f"sync-{cast}-False"]["ops"]:  # the copy path does both
            assert ops.get("cat", 0) == 2 and ops.get("copy_", 0) >= params - 1, ops


@pytest.mark.parametrize("cast", [False, True])
def test_accumulated_grads_equal_the_copy_path_and_the_reference(
        results: list[dict[str, Any]], cast: bool) -> None:
    ref_grads, ref_params = _reference()
    for got in results:
        views, copy = got[f"sync-{cast}-True"], got[f"sync-{cast}-False"]
        for it in range(ITERS):
            assert views["grads"][it].keys() == copy["grads"][it].keys() == ref_grads[it].keys()
            for n, g in views["grads"][it].items():
                assert torch.equal(g, copy["grads"][it][n]), (it, n)
                tol = 1e-2 if cast else 1e-12  # bf16 on the wire: 8 bits of mantissa
                torch.testing.assert_close(g, ref_grads[it][n], rtol=tol, atol=tol)
        for n, p in views["params"].items():
            assert torch.equal(p, copy["params"][n]), n
            if not cast:
                torch.testing.assert_close(p, ref_params[n], rtol=1e-12, atol=1e-12)


def test_the_runtime_trains_on_views_to_the_reference(results: list[dict[str, Any]]) -> None:
    _, ref_params = _reference()
    for got in results:
        run = got["runtime"]
        assert run["views"]
        assert all(p == run["ptrs"][0] for p in run["ptrs"])
        assert set(run["ptrs"][0]) == set(run["flats"])
        for n, p in run["params"].items():
            torch.testing.assert_close(p, ref_params[n], rtol=1e-12, atol=1e-12)
