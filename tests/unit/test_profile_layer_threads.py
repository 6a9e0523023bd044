"""`hetplan profile` says when it timed CPU layers in one process with several threads: a run
of several ranks per machine gives each one thread, and such a profile put gpt2_cpu's compute
at 1,521 ms per iteration against 115 ms measured by `hetplan run` (busy 2-core host)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import hetplan.profiling
from hetplan.cli import app
from hetplan.cost_models.profile_db import ProfileDB


@pytest.mark.parametrize(("threads", "processes", "noted"),
                         [(2, 1, True), (1, 1, False), (2, 4, False)])
def test_profile_notes_layers_timed_with_more_threads_than_a_rank_gets(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int, processes: int,
        noted: bool) -> None:
    monkeypatch.setattr(hetplan.profiling, "run_profile", lambda *a, **k: ProfileDB())
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    res: Any = CliRunner().invoke(app, ["profile", "mlp", "--what", "layers",
                                        "--layer-processes", str(processes),
                                        "-o", str(tmp_path / "p.json")])
    assert res.exit_code == 0, res.output
    said = " ".join(res.output.split())
    assert ("timed in this one process with 2 threads" in said) == noted
    if noted:
        assert "re-profile with --layer-processes N, its ranks per machine" in said
