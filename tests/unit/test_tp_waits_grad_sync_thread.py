"""The tensor-parallel handler's data-parallel average of the sequence-parallel gradients
waits for the gradient-sync worker thread first: two threads issuing collectives on one gloo
group can pair them differently on different ranks."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hetplan.runtime.grad_sync import GradSync
from hetplan.runtime.handlers import tensor_parallel as tp_mod
from hetplan.runtime.handlers.grad_sync import GradSyncHandler
from hetplan.runtime.handlers.tensor_parallel import TensorParallelHandler


def test_wait_submitted_waits_for_every_future() -> None:
    done = threading.Event()
    sync = GradSync.__new__(GradSync)  # only its buckets matter here
    with ThreadPoolExecutor(1) as pool:
        sync.buckets = [SimpleNamespace(work=pool.submit(lambda: (time.sleep(0.05),
                                                                    done.set())))]
        sync.wait_submitted()
        assert done.is_set()


def test_sp_average_waits_for_the_grad_sync_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []
    sync = GradSync.__new__(GradSync)
    sync.wait_submitted = lambda: order.append("wait")  # type: ignore[method-assign]
    gs = GradSyncHandler()
    gs.sync = sync
    tp = TensorParallelHandler.__new__(TensorParallelHandler)
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    tp.sp_params, tp.group = [p], "tp-group"
    ctx: Any = SimpleNamespace(handlers=[tp, gs], groups=SimpleNamespace(dp_group="dp-group"),
                               layout=SimpleNamespace(dp=2))
    ctx.handler = lambda kind: next(h for h in ctx.handlers if isinstance(h, kind))
    monkeypatch.setattr(tp_mod, "dp_averages_sp_params", lambda _ctx: True)
    monkeypatch.setattr(tp_mod.dist, "all_reduce",
                        lambda _t, group: order.append(f"all_reduce {group}"))
    tp.after_backward(ctx)
    assert order == ["wait", "all_reduce tp-group", "all_reduce dp-group"]
