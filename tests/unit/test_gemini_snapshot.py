"""Gemini's flat snapshot format and the store's in-place slots: what is packed comes back
bitwise, the per-tensor views kept between rounds follow in-place updates and a changed
tensor list, and a slot written in place keeps the two-buffer and torn-write guarantees."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hetplan.runtime.checkpoint_snapshot import ALIGN, Packer, unpack
from hetplan.runtime.checkpoint_store import NodeStore


def _state() -> tuple[list[tuple[str, torch.Tensor]], torch.optim.Optimizer]:
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(3, 5, generator=g)),
          torch.nn.Parameter(torch.randn(7, generator=g)),  # 28 bytes: padding follows
          torch.nn.Parameter(torch.randn(2, 3, generator=g).to(torch.bfloat16))]
    opt = torch.optim.Adam(ps, lr=1e-3)
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    return [(f"p{i}", p) for i, p in enumerate(ps)], opt


def _pack(packer: Packer, store: NodeStore, params: list[tuple[str, torch.Tensor]],
          opt: torch.optim.Optimizer, rng: torch.Tensor, it: int) -> None:
    packed = packer.prepare(params, opt.state_dict(), rng, it)
    assert packed.nbytes % ALIGN == 0
    res = store.reserve("own", 0, it, packed.nbytes)
    assert res is not None
    packer.pack_into(packed, torch.frombuffer(res.buffer, dtype=torch.uint8,
                                              count=packed.nbytes))
    store.commit(res)


def _assert_same(state: dict, params: list[tuple[str, torch.Tensor]],
                 opt: torch.optim.Optimizer) -> None:
    assert list(state["params"]) == [n for n, _ in params]
    for n, p in params:
        got = state["params"][n]
        assert got.dtype == p.dtype and torch.equal(got, p.detach())
    want = opt.state_dict()
    assert state["optim"]["param_groups"] == want["param_groups"]
    assert state["optim"]["state"].keys() == want["state"].keys()
    for k, v in want["state"].items():
        for kk, t in v.items():
            assert torch.equal(state["optim"]["state"][k][kk], t), (k, kk)


def test_roundtrip_is_bitwise_and_views_follow_updates(tmp_path: Path) -> None:
    params, opt = _state()
    store, packer = NodeStore(tmp_path, 0), Packer()
    rng = torch.get_rng_state()
    _pack(packer, store, params, opt, rng, 1)
    state = unpack(store.read("own", 0, 1))
    _assert_same(state, params, opt)
    assert state["iteration"] == 1 and torch.equal(state["rng"], rng)
    # an optimizer step changes the tensors in place: the kept views see it
    for _, p in params:
        p.grad = torch.full_like(p, 0.5)
    opt.step()
    _pack(packer, store, params, opt, rng, 2)
    _assert_same(unpack(store.read("own", 0, 2)), params, opt)
    assert sorted(store.iterations("own", 0)) == [1, 2]
    # a replaced tensor (another object, another size) gets a new layout
    params[1] = ("p1", torch.nn.Parameter(torch.arange(11, dtype=torch.float64)))
    opt2 = torch.optim.SGD([p for _, p in params], lr=0.1)
    _pack(packer, store, params, opt2, rng, 3)
    state = unpack(store.read("own", 0, 3))
    _assert_same(state, params, opt2)
    assert sorted(store.iterations("own", 0)) == [2, 3]  # iteration 1's slot was reused


def test_not_a_snapshot_is_refused() -> None:
    with pytest.raises(ValueError, match="not a Gemini snapshot"):
        unpack(b"PK\x03\x04 a torch.save zip")


def test_reserved_slots_double_buffer_and_stamps(tmp_path: Path) -> None:
    s = NodeStore(tmp_path, 0)
    r1 = s.reserve("held", 2, 1, 8)
    assert r1 is not None
    r1.buffer[:] = b"abcdefgh"
    s.commit(r1)
    assert s.reserve("held", 2, 1, 8) is None  # complete already
    r2 = s.reserve("held", 2, 2, 8)
    assert r2 is not None and r2.slot != r1.slot
    r2.buffer[:] = b"12345678"
    s.commit(r2)
    r3 = s.reserve("held", 2, 3, 8)  # overwrites iteration 1, never 2
    assert r3 is not None and r3.slot == r1.slot and r3.buffer is r1.buffer  # same pages
    assert sorted(s.iterations("held", 2)) == [2]  # the reserved slot is incomplete
    r3.buffer[:] = b"zzzzzzzz"
    s.commit(r3)
    assert s.read("held", 2, 2) == b"12345678" and s.read("held", 2, 3) == b"zzzzzzzz"
    r4 = s.reserve("held", 2, 4, 5)  # another size: the file is resized and mapped again
    assert r4 is not None and len(r4.buffer) == 5
    r4.buffer[:] = b"vwxyz"
    s.commit(r4)
    assert s.read("held", 2, 4) == b"vwxyz"
    # a writer of iteration 5 that stamped the slot and died: the trailing stamp is 4
    data, _ = s._slot("held", 2, r4.slot)
    raw = bytearray(data.read_bytes())
    raw[:8] = (5).to_bytes(8, "little")
    data.write_bytes(bytes(raw))
    with pytest.raises(LookupError, match="corrupt"):
        s.read("held", 2, 4)
    with pytest.raises(ValueError, match="nbytes"):
        s.reserve("held", 2, 9, 0)
