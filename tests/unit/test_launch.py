"""``hetplan run``'s relay of torchrun's stderr: the launcher's own traceback after a rank
failed is dropped (the ranks' errors and torchrun's summary box stay); any other traceback,
e.g. from a user's training script, is copied whole."""

from __future__ import annotations

import io

from hetplan.runtime.launch import relay_stderr

AGENT = """\
rank 1: RuntimeError: boom
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/x/torch/distributed/run.py", line 1032, in <module>
    main()
    ^^^^^^
  File "/x/torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
============================================================
hetplan.runtime.worker FAILED
------------------------------------------------------------
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 4242)
"""

USER = """\
Traceback (most recent call last):
  File "train.py", line 3, in <module>
    raise ValueError("bad batch")
ValueError: bad batch
after
"""


def _relay(text: str, keep: bool = False) -> str:
    out = io.StringIO()
    relay_stderr(io.StringIO(text), out, keep)
    return out.getvalue()


def test_the_launchers_traceback_is_dropped() -> None:
    got = _relay(AGENT)
    assert "Traceback" not in got and "ChildFailedError" not in got and "main()" not in got
    assert got.startswith("rank 1: RuntimeError: boom\n")
    assert "hetplan.runtime.worker FAILED" in got and "rank      : 1 (local_rank: 1)" in got


def test_debug_keeps_it() -> None:
    assert _relay(AGENT, keep=True) == AGENT


def test_other_tracebacks_are_copied_whole() -> None:
    assert _relay(USER) == USER
    assert _relay(USER + AGENT) == USER + _relay(AGENT)


def test_an_unfinished_traceback_is_not_lost() -> None:
    cut = 'Traceback (most recent call last):\n  File "x.py", line 1, in <module>\n'
    assert _relay(cut) == cut


def test_omp_threads_set_as_torchrun_would_without_its_warning() -> None:
    """torchrun sets OMP_NUM_THREADS=1 when it is unset and a node starts more than one
    process, and prints a five-line warning each time; the launcher sets it first."""
    from hetplan.runtime.launch import _omp_default

    cmd = ["python", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    assert _omp_default(cmd, {}) == {"OMP_NUM_THREADS": "1"}
    assert _omp_default([*cmd[:-2], "--nproc_per_node=2"], {}) == {"OMP_NUM_THREADS": "1"}
    assert _omp_default(cmd, {"OMP_NUM_THREADS": "3"}) == {}  # the user's value stays
    assert _omp_default([*cmd[:-1], "1"], {}) == {}  # one process: torchrun sets nothing
    assert _omp_default([*cmd[:-1], "gpu"], {}) == {}  # counted by torchrun itself
