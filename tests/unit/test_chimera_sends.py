"""The Chimera executor releases a sent tensor once its send is done, not at the step's end
(``runtime/handlers/chimera.py``, ``_reap``): a rank sends every micro-batch's boundary
activations and input gradients of both its stages, and holding them all to the end adds
them to its peak memory. The executor's results are checked end to end by
``tests/dist/test_chimera_runtime.py``; here, what is kept of the sends in flight."""

from __future__ import annotations

import weakref

import pytest
import torch

from hetplan.runtime.handlers.chimera import _reap, _Sent


class _Work:
    """A send that is done or not (``is_completed`` never blocks, as torch's)."""

    def __init__(self, done: bool) -> None:
        self.done = done
        self.waited = False

    def is_completed(self) -> bool:
        return self.done

    def wait(self) -> None:
        self.waited = True


def test_done_sends_release_their_chunks_and_the_others_stay_in_order() -> None:
    chunks = [torch.full((4,), float(i)) for i in range(4)]
    refs = [weakref.ref(c) for c in chunks]
    works = [_Work(done) for done in (True, False, True, False)]
    pending = [_Sent(w, c) for w, c in zip(works, chunks)]
    del chunks
    kept = _reap(pending)
    del pending
    assert [float(p.chunk[0]) for p in kept] == [1.0, 3.0]
    assert [r() is None for r in refs] == [True, False, True, False]
    # the pending ones are asked, never waited for; the done ones are waited for (at once)
    assert [w.waited for w in works] == [True, False, True, False]


class _Failed(_Work):
    """A send that is done with an error, which ``wait`` raises (as torch's Work does)."""

    def wait(self) -> None:
        raise RuntimeError("connection closed by peer")


def test_a_failed_send_raises_when_reaped() -> None:
    """A done send is waited for, so its error surfaces (it was dropped unseen: only the
    sends still pending at the step's end were waited for)."""
    pending = [_Sent(_Work(False), torch.zeros(2)), _Sent(_Failed(True), torch.zeros(2))]
    with pytest.raises(RuntimeError, match="connection closed by peer"):
        _reap(pending)


def test_nothing_done_keeps_everything() -> None:
    pending = [_Sent(_Work(False), torch.zeros(2)) for _ in range(3)]
    assert _reap(pending) == pending
