"""The optimizer step's cost model (:mod:`hetplan.cost_models.optimizer_step`): the bytes it
assumes are the bytes torch's own optimizers move, and ``evaluate`` prices a step by them
plus a launch per kernel."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.evaluate import evaluate
from hetplan.cost_models.memory import StatePrecision
from hetplan.cost_models.optimizer_step import (
    LAUNCH_S,
    UPDATE_BYTES,
    UPDATE_KERNELS,
    step_bytes,
    step_kernels,
)
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan_sections import GradCost, LayerCost, Layout, WorkloadSummary


class _Bytes(TorchDispatchMode):
    """Bytes every aten op reads and writes (each storage once per op; an in-place op
    writes its first argument) and how many ops ran."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._overloadpacket.__name__
        if name in ("item", "_local_scalar_dense"):
            return out
        self.ops += 1
        seen: dict[int, int] = {}
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                seen[t.untyped_storage().data_ptr()] = t.numel() * t.element_size()
        self.bytes += sum(seen.values())
        written = tree_leaves(args[0]) if name.endswith("_") else tree_leaves(out)
        self.bytes += sum(t.numel() * t.element_size() for t in written
                          if isinstance(t, torch.Tensor))
        return out


def _measured_bytes_per_element(make) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    params = [torch.nn.Parameter(torch.randn(20_000)) for _ in range(3)]
    opt = make(params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # the first step creates the state
    with _Bytes() as counter:
        opt.step()
    numel = sum(p.numel() for p in params)
    return counter.bytes / numel, counter.ops


@pytest.mark.parametrize("name, make", [
    ("adam", lambda ps: torch.optim.Adam(ps, lr=1e-4, foreach=True)),
    ("adamw", lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=True)),
    ("sgd-momentum", lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9, foreach=True)),
    ("sgd", lambda ps: torch.optim.SGD(ps, lr=0.01, foreach=True)),
])
def test_update_bytes_are_what_torch_moves(name: str, make) -> None:  # type: ignore[no-untyped-def]
    per_elem, ops = _measured_bytes_per_element(make)
    # the step counters (one 4-byte tensor per parameter) add a few bytes in all
    assert per_elem == pytest.approx(UPDATE_BYTES[name], rel=0.01)
    assert ops >= UPDATE_KERNELS[name]


def test_mixed_precision_step_bytes_and_kernels() -> None:
    mixed = StatePrecision(weight_bytes=2, grad_bytes=2, master_bytes=4, act_bytes=2)
    # chunk: zero 4 + grad in 2 + 4; Adam 72; cast 4 + 2; copies out 2 + 2
    assert step_bytes(mixed, "adam") == 92.0
    assert step_kernels(mixed, "adam", 148) == 7 + 2 + 2 * 148
    fp32 = StatePrecision()
    assert step_bytes(fp32, "adam") == 72.0
    assert step_kernels(fp32, "adam", 148) == 7
    # ZeRO: a rank steps 1/dp of the elements, but copies its whole working weights
    assert step_bytes(mixed, "adam", dp=4) == pytest.approx((10 + 72 + 6) / 4 + 4)
    with pytest.raises(ValueError, match="unknown optimizer"):
        step_bytes(fp32, "lamb")


def _workload(tensors_per_layer: int = 4, layers: int = 3) -> WorkloadSummary:
    lay = [LayerCost(name=f"l{i}", kind="other", fwd_flops=10**9, bwd_flops=2 * 10**9,
                     param_bytes=4 * 10**6, act_saved_bytes=10**6)
           for i in range(layers)]
    grads = [GradCost(name=f"l{i}.p{j}", size_bytes=10**6, layer_index=i)
             for i in reversed(range(layers)) for j in range(tensors_per_layer)]
    return WorkloadSummary(batch_size=1, layers=tuple(lay), grads=tuple(grads))


def test_evaluate_prices_bytes_and_launches() -> None:
    wl = _workload()
    costs = CostModel(ClusterSpec.from_preset("a100-nvlink-8x8"), dtype="mixed")
    layout = Layout(dp=1, pp=1, tp=1, micro_batch_size=1, micro_batches=1,
                    global_batch_size=1)
    ev = evaluate(wl, layout, (), None, costs, check_memory=False)
    bw = costs.devices[0].mem_bandwidth_bytes_per_s
    numel = 3 * 10**6  # 12 MB of fp32 captured parameters
    expected = 92.0 * numel / bw + (7 + 2 + 2 * 12) * LAUNCH_S
    assert ev.optimizer_s == pytest.approx(expected)
    # well above the 28 bytes per element of reading and writing the state once
    assert ev.optimizer_s > 2 * 28.0 * numel / bw


def test_the_plan_breakdown_carries_the_step_and_the_parts_make_the_iteration() -> None:
    """The step is the part of the iteration after the sync: the plan's breakdown reports it,
    and compute + bubble + exposed sync + step is the iteration of a one-stage plan."""
    from hetplan.cost_models.predict import predictions

    wl = _workload()
    costs = CostModel(ClusterSpec.from_preset("a100-nvlink-8x8"), dtype="mixed")
    layout = Layout(dp=1, pp=1, tp=1, micro_batch_size=1, micro_batches=1,
                    global_batch_size=1)
    ev = evaluate(wl, layout, (), None, costs, check_memory=False)
    b = predictions(ev, (), layout).breakdown
    # the plan stores milliseconds to the nanosecond
    assert b.optimizer_ms == pytest.approx(ev.optimizer_s * 1e3, abs=1e-6)
    assert b.optimizer_ms > 0
    assert b.compute_ms + b.bubble_ms + b.exposed_comm_ms + b.optimizer_ms == pytest.approx(
        ev.iteration_s * 1e3, abs=1e-5)
