"""`hetplan profile` times CPU layers as the ranks of a run compute them: on ``--world-size``
processes at once, one thread each, unless told otherwise. By default it timed them in one
process with every thread, while a run gives each of several ranks one thread: such a
profile put gpt2_cpu's compute at 1,521 ms per iteration against 115 ms measured by
`hetplan run` (busy 2-core host). A ``--layer-processes 1`` given for a run of several ranks
gets a note."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import hetplan.profiling
from hetplan.cli import app
from hetplan.cost_models.profile_db import ProfileDB
from hetplan.profiling.layers import training_threads


def _profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *options: str,
             cuda: bool = False) -> tuple[Any, dict[str, Any]]:
    seen: dict[str, Any] = {}

    def fake(*args: Any, **kwargs: Any) -> ProfileDB:
        seen.update(kwargs)
        return ProfileDB()

    monkeypatch.setattr(hetplan.profiling, "run_profile", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    res: Any = CliRunner().invoke(app, ["profile", "mlp", *options,
                                        "-o", str(tmp_path / "p.json")])
    assert res.exit_code == 0, res.output
    return res, seen


@pytest.mark.parametrize(("options", "processes"), [
    (("--what", "layers"), 2),  # -n's default
    (("--what", "layers", "-n", "4"), 4),
    (("--what", "layers", "-n", "4", "--layer-processes", "1"), 1),
    (("--what", "layers", "-n", "1"), 1),
    ((), 2),
])
def test_layers_are_timed_on_as_many_processes_as_the_run_has(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, options: tuple[str, ...],
        processes: int) -> None:
    _, seen = _profile(tmp_path, monkeypatch, *options)
    assert seen["layer_processes"] == processes


def test_with_a_gpu_layers_are_timed_in_this_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("hetplan.cli._measures_the_device_type", lambda *a: None)
    _, seen = _profile(tmp_path, monkeypatch, "--what", "layers", "-n", "4", cuda=True)
    assert seen["layer_processes"] == 1


@pytest.mark.parametrize(("threads", "options", "noted"), [
    (2, ("--layer-processes", "1"), True),  # -n 2: a run of 2 ranks, timed in 1 process
    (2, ("--layer-processes", "1", "-n", "1"), False),  # a 1-rank run has every thread
    (1, ("--layer-processes", "1"), False),
    (2, (), False),
])
def test_profile_notes_layers_timed_with_more_threads_than_a_rank_gets(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int,
        options: tuple[str, ...], noted: bool) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    res, _ = _profile(tmp_path, monkeypatch, "--what", "layers", *options)
    said = " ".join(res.output.split())
    assert ("timed in this one process with 2 threads" in said) == noted
    if noted:
        assert "give --layer-processes 2" in said


def test_each_profiling_process_gets_the_threads_of_a_rank(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """cores // processes gave 4 profiling processes 4 threads each on a 16-core host, where
    each rank of a 4-rank run has one (torchrun's OMP_NUM_THREADS=1)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert training_threads(4) == 1
    assert training_threads(1) == 16
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert training_threads(4) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "x")
    assert training_threads(4) == 1


def test_the_api_and_the_cli_share_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """hetplan.profiling.run_profile defaulted to 1 process while the CLI followed -n."""
    import inspect

    from hetplan.profiling import default_layer_processes, run_profile

    assert inspect.signature(run_profile).parameters["layer_processes"].default is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_layer_processes(4, ("layers",)) == 4
    assert default_layer_processes(4, ("collectives",)) == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_layer_processes(4, ("layers",)) == 1
