"""The resizable column- and row-parallel linears of the runtime (one rank, so no
collectives) against the 0/1 column-mask oracle and the paper's Fig. 2 pattern worked out by
hand (digest TC-1), plus the straggler emulator."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
from torch import nn

from hetplan.runtime import resizing
from hetplan.runtime.resizing import Clock, LayerStep, StragglerEmulator, make_resizable
from hetplan.runtime.tensor_parallel import ColumnParallelLinear, RowParallelLinear

KINDS = ("column", "row")


def masked_linear(x: torch.Tensor, w: torch.Tensor, keep: Sequence[int]) -> torch.Tensor:
    """The oracle: ``(X · mask) (W · mask)ᵀ`` with a 0/1 mask of the kept columns."""
    mask = torch.zeros(w.shape[1], dtype=w.dtype)
    mask[list(keep)] = 1
    return (x * mask) @ (w * mask).t()


def resized(kind: str, w: torch.Tensor, keep: Sequence[int] | None
            ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``f(x, w)``: the runtime's resizable ``kind`` linear (one rank) with weight ``w``,
    computing only the ``keep`` contraction columns (None: all, the runtime's full path)."""
    out, k = w.shape
    full = nn.Linear(k, out, bias=False, dtype=w.dtype)
    cls = ColumnParallelLinear if kind == "column" else RowParallelLinear
    model = nn.Sequential(cls.from_linear(full, (out,) if kind == "column" else (k,), 0))
    (_, mod), = make_resizable(model, Clock())
    idx = None if keep is None else torch.tensor(list(keep), dtype=torch.long)
    pruned = () if keep is None else tuple(sorted(set(range(k)) - set(keep)))
    mod.rz.step = LayerStep(idx, pruned)
    return lambda x, weight: torch.func.functional_call(mod, {"weight": weight}, (x,))


@pytest.mark.parametrize("kind", KINDS)
def test_tc1_fig2_by_hand(kind: str) -> None:
    # N = 3, out = 2, K = 4, γ = 0.5, keep = [0, 2], pruned P = [1, 3]
    x = torch.tensor([[1., 2, 3, 4], [5, 6, 7, 8], [-1, 0, 2, 1]], requires_grad=True)
    w = torch.tensor([[1., 0, 2, 1], [0, 1, -1, 3]], requires_grad=True)
    dy = torch.tensor([[1., -1], [2, 0], [0, 1]])
    y = resized(kind, w, [0, 2])(x, w)
    # Y[0] = [1·1 + 3·2, 1·0 + 3·(-1)] = [7, -3] …
    assert torch.equal(y.detach(), torch.tensor([[7., -3], [19, -7], [3, -2]]))
    y.backward(dy)
    # dW[:, keep] = dYᵀ X[:, keep]: row 0 = 1·[1,3] + 2·[5,7] + 0 = [11, 17]
    assert torch.equal(w.grad, torch.tensor([[11., 0, 17, 0], [-2, 0, -1, 0]]))
    # dX[:, keep] = dY W[:, keep]: row 0 = 1·[1,2] − 1·[0,−1] = [1, 3]
    assert torch.equal(x.grad, torch.tensor([[1., 0, 3, 0], [2, 0, 4, 0], [0, 0, -1, 0]]))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("keep", [[0, 2, 5], [1], list(range(7)), [3, 4, 5, 6], None])
def test_equals_mask_reference(kind: str, keep: list[int] | None) -> None:
    g = torch.Generator().manual_seed(len(keep or ()))
    x = torch.randn(2, 3, 7, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 7, generator=g, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(2, 3, 5, generator=g, dtype=torch.float64)
    y = resized(kind, w, keep)(x, w)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    y_ref = masked_linear(x, w, range(7) if keep is None else keep)
    dx_ref, dw_ref = torch.autograd.grad(y_ref, (x, w), dy)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dw, dw_ref, rtol=1e-12, atol=1e-12)
    pruned = sorted(set(range(7)) - set(keep or range(7)))
    assert not dw[:, pruned].any() and not dx[..., pruned].any()  # zero imputation


@pytest.mark.parametrize("kind", KINDS)
def test_gradcheck_float64(kind: str) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 6, generator=g, dtype=torch.float64, requires_grad=True)
    # backward vs finite differences of the forward; the forward itself is pinned to the mask
    # oracle by test_equals_mask_reference, so together backward equals the oracle's too
    assert torch.autograd.gradcheck(resized(kind, w, [0, 1, 4]), (x, w))


class FakeTime:
    """Stands in for the ``time`` module of :mod:`hetplan.runtime.resizing`: every GEMM lasts
    exactly ``TICK`` (each clock read advances it) and ``sleep`` only records and advances, so
    the emulator's accounting is checked exactly, whatever the machine's load."""

    TICK = 1e-3

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def perf_counter(self) -> float:
        self.now += self.TICK
        return self.now - self.TICK

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@pytest.fixture
def fake_time(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    fake = FakeTime()
    monkeypatch.setattr(resizing, "time", fake)
    return fake


def test_emulator_sleeps_only_on_the_straggler(fake_time: FakeTime) -> None:
    tick = FakeTime.TICK
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    slow = Clock(StragglerEmulator(chi=3.0, straggler=1, tp_rank=1, tp_size=2))
    fast = Clock(StragglerEmulator(chi=3.0, straggler=1, tp_rank=0, tp_size=2))
    slow.gemm(a, b)
    assert fake_time.slept == []  # the emulated time is owed until the next collective
    slow.settle()
    assert fake_time.slept == [pytest.approx(3 * tick)] and slow.emulator.debt == 0.0
    # what it reports is what it took: its own GEMM plus the sleep
    assert slow.gemm_s == pytest.approx(tick + sum(fake_time.slept))
    fast.gemm(a, b)
    fast.settle()
    assert len(fake_time.slept) == 1 and fast.gemm_s == pytest.approx(tick)
    # the owed time is exactly χ times the GEMM's own time, and only on the straggler
    assert slow.emulator.extra(0.01) == pytest.approx(0.03)
    assert fast.emulator.extra(0.01) == 0.0 and fast.emulator.debt == 0.0


def test_emulated_device_speed(fake_time: FakeTime) -> None:
    # 2 · 64 · 32 · 16 = 65536 FLOP at 1 MFLOP/s: 65.5 ms; the straggler (χ = 1) twice that
    tick = FakeTime.TICK
    a, b = torch.randn(64, 32), torch.randn(32, 16)
    normal = Clock(StragglerEmulator(1.0, straggler=1, tp_rank=0, tp_size=2, flop_rate=1e6))
    slow = Clock(StragglerEmulator(1.0, straggler=1, tp_rank=1, tp_size=2, flop_rate=1e6))
    slow.received(a, b)
    with slow.comm():  # pays the debt before the collective, outside the comm time
        pass
    assert fake_time.slept == [pytest.approx(0.131072 - tick)]
    assert slow.comm_s == pytest.approx(tick)
    normal.gemm(a, b)
    assert normal.gemm_s == pytest.approx(0.065536)
    assert slow.recv_s == pytest.approx(0.131072) and slow.gemm_s == 0.0


def test_emulator_rotates() -> None:
    em = StragglerEmulator(chi=1.0, straggler=3, tp_rank=0, tp_size=4, rotate_every=2)
    seen = []
    for _ in range(6):
        seen.append(em.current())
        em.advance()
    assert seen == [3, 3, 0, 0, 1, 1]


def test_controller_rejects_unsupported_settings() -> None:
    from hetplan.errors import SpecError
    from hetplan.ir.plan_sections import ResizingController
    from hetplan.runtime.resizing import ResizingRuntime

    with pytest.raises(SpecError, match="imputes pruned columns with zeros only"):
        ResizingRuntime([], ResizingController(variant="zero", imputation="same"), Clock(), 0, 1)
    with pytest.raises(SpecError, match="variant other than 'off'"):
        ResizingRuntime([], ResizingController(), Clock(), 0, 1)


def test_plan_roles_to_decisions() -> None:
    from hetplan.algorithms.zero_resizing import plan_roles
    from hetplan.ir.plan_sections import TPGroup, TPRankRole

    # global ranks 4..7: rank 6 resizes 0.3; rank 7 sends γ β = 0.6 · 0.5 and prunes
    # γ (1 − β) = 0.3 towards the listed migrate_dst ranks 4 and 5 (positions 0 and 1)
    g = TPGroup(ranks=(4, 5, 6, 7), roles=(
        TPRankRole(rank=6, role="resize", gamma=0.3),
        TPRankRole(rank=7, role="migrate_src", gamma=0.6, beta=0.5),
        TPRankRole(rank=4, role="migrate_dst"), TPRankRole(rank=5, role="migrate_dst")))
    d = plan_roles(g)
    assert [x.role for x in d] == ["normal", "normal", "resize", "migrate_src"]
    assert d[2].resize == pytest.approx(0.3)
    assert (d[3].migrate, d[3].resize, d[3].receivers) == (pytest.approx(0.3),
                                                           pytest.approx(0.3), (0, 1))
    # without migrate_dst roles every other rank receives
    g2 = TPGroup(ranks=(4, 5, 6), roles=(TPRankRole(rank=5, role="migrate_src", gamma=0.4,
                                                    beta=1.0),))
    assert plan_roles(g2)[1].receivers == (0, 2) and plan_roles(g2)[1].resize == 0.0


def test_straggler_from_env() -> None:
    from hetplan.errors import SpecError
    from hetplan.runtime.resizing import StragglerSpec, straggler_from_env

    assert straggler_from_env({}) is None
    assert straggler_from_env({"HETPLAN_EMULATE_STRAGGLER": "8@3"}) == StragglerSpec(8.0, 3)
    assert straggler_from_env({"HETPLAN_EMULATE_STRAGGLER": "2.5@1/4",
                               "HETPLAN_EMULATE_GEMM_FLOPS": "1e9"}) == StragglerSpec(
        2.5, 1, 4, 1e9)
    for bad in ("8", "x@1", "8@-1", "-1@0", "8@1/z", "inf@1", "nan@1"):
        with pytest.raises(SpecError, match="CHI@RANK"):
            straggler_from_env({"HETPLAN_EMULATE_STRAGGLER": bad})
    for rate in ("0", "nan", "inf"):
        with pytest.raises(SpecError, match="positive FLOP/s"):
            straggler_from_env({"HETPLAN_EMULATE_STRAGGLER": "1@0",
                                "HETPLAN_EMULATE_GEMM_FLOPS": rate})


@pytest.mark.parametrize(("kind", "x_shape", "w_shape"),
                         [("row", (2, 3, 0), (4, 0)), ("column", (2, 3, 5), (0, 5))])
@pytest.mark.parametrize("keep_all", [True, False])
def test_a_rank_with_an_empty_shard(kind: str, x_shape: tuple[int, ...],
                                    w_shape: tuple[int, int], keep_all: bool) -> None:
    """A row shard with 0 input columns, a column shard with 0 output rows: forward and
    backward work (``reshape(-1, 0)`` could not infer the rows) and give empty / zero parts."""
    x = torch.randn(*x_shape, requires_grad=True)
    w = torch.randn(*w_shape, requires_grad=True)
    y = resized(kind, w, None if keep_all else range(w_shape[1]))(x, w)
    assert y.shape == (*x_shape[:-1], w_shape[0])
    assert torch.equal(y, torch.zeros_like(y))
    y.sum().backward()
    assert x.grad is not None and torch.equal(x.grad, torch.zeros(x_shape))
    assert w.grad is not None and w.grad.shape == w_shape
