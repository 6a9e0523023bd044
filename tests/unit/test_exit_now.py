"""How a rank leaves (:func:`hetplan.runtime.groups.exit_now`): multiprocessing's
finalizers run first (a named semaphore left registered is reported as leaked by the
resource tracker), and a finalizer that blocks does not keep the rank from leaving."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _leave(body: str) -> subprocess.CompletedProcess[str]:
    code = textwrap.dedent(body) + "\nfrom hetplan.runtime.groups import exit_now\nexit_now(3)\n"
    # the timeout only guards against a hang; nothing here asserts a duration
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)


def test_a_semaphore_made_before_exit_now_is_released() -> None:
    got = _leave("""
        import multiprocessing
        lock = multiprocessing.get_context("spawn").RLock()
        """)
    assert got.returncode == 3, got.stderr
    assert "leaked semaphore" not in got.stderr, got.stderr


def test_a_finalizer_that_blocks_does_not_keep_the_process() -> None:
    got = _leave("""
        import threading
        from multiprocessing import util

        class Stuck:
            pass

        stuck = Stuck()
        util.Finalize(stuck, threading.Event().wait, exitpriority=10)
        """)
    assert got.returncode == 3, got.stderr
