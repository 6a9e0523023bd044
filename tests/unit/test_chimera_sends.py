"""The Chimera executor releases a sent tensor once its send is done, not at the step's end
(``runtime/handlers/chimera.py``, ``_reap``): a rank sends every micro-batch's boundary
activations and input gradients of both its stages, and holding them all to the end adds
them to its peak memory. The executor's results are checked end to end by
``tests/dist/test_chimera_runtime.py``; here, what is kept of the sends in flight."""

from __future__ import annotations

import weakref

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
    pending = [_Sent(_Work(done), c) for done, c in zip((True, False, True, False), chunks)]
    del chunks
    kept = _reap(pending)
    del pending
    assert [float(p.chunk[0]) for p in kept] == [1.0, 3.0]
    assert [r() is None for r in refs] == [True, False, True, False]
    assert not any(p.work.waited for p in kept)  # asked, never waited for


def test_nothing_done_keeps_everything() -> None:
    pending = [_Sent(_Work(False), torch.zeros(2)) for _ in range(3)]
    assert _reap(pending) == pending
