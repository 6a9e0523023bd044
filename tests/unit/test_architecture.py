"""The architecture contract: layers import only downward, the runtime knows nothing about
search, the planner imports no torch, and there are no import cycles.

The contracts live in ``pyproject.toml`` (``[tool.importlinter]``) and are checked by
import-linter over the whole ``hetplan`` package, function-local and type-only imports
included. The second test shows the check can fail: an upward import and a cycle planted in a
copy of the package are both reported.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "hetplan"


def _lint(cwd: Path, pythonpath: Path) -> subprocess.CompletedProcess[str]:
    """Run ``lint-imports`` with ``cwd``'s pyproject.toml, importing hetplan from
    ``pythonpath``."""
    code = ("import sys; from importlinter.cli import lint_imports; "
            "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True))")
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True,
                          text=True, env={"PYTHONPATH": str(pythonpath), "PATH": "/usr/bin"},
                          timeout=300)


def test_import_contracts_hold() -> None:
    out = _lint(ROOT, ROOT / "src")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "4 kept, 0 broken" in out.stdout


@pytest.fixture(scope="module")
def broken_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the package with an upward import (ir -> report) and a cycle
    (algorithms.partition <-> algorithms.fusion)."""
    root = tmp_path_factory.mktemp("broken")
    pkg = root / "src" / "hetplan"
    shutil.copytree(SRC, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    with (pkg / "ir" / "plan.py").open("a") as f:
        f.write("\nimport hetplan.report.inspect  # planted: an upward import\n")
    with (pkg / "algorithms" / "partition.py").open("a") as f:
        f.write("\nimport hetplan.algorithms.fusion  # planted: half a cycle\n")
    with (pkg / "algorithms" / "fusion.py").open("a") as f:
        f.write("\nimport hetplan.algorithms.partition  # planted: the other half\n")
    return root


def test_import_contracts_catch_upward_imports_and_cycles(broken_copy: Path) -> None:
    out = _lint(broken_copy, broken_copy / "src")
    assert out.returncode != 0
    assert "hetplan.ir is not allowed to import hetplan.report" in out.stdout, out.stdout
    assert "No cycles are allowed in hetplan.algorithms" in out.stdout, out.stdout
