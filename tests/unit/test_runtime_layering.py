"""The runtime imports only what the layering allows: ``hetplan.ir``, ``hetplan.errors``, the
pure ``hetplan.algorithms``, and ``hetplan.zoo`` / ``hetplan.models`` (to build a model) —
never the cost models, passes, optimizer, report or CLI; function-local imports included.
The pure schedule and collective modules it executes import no torch."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "hetplan"
RUNTIME_MAY_IMPORT = ("hetplan.ir", "hetplan.errors", "hetplan.algorithms", "hetplan.zoo",
                      "hetplan.models", "hetplan.runtime")


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, nested ones included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.level:
                raise AssertionError(f"{path}:{node.lineno}: relative import")
            if node.module == "hetplan":  # from hetplan import zoo
                out += [(node.lineno, f"hetplan.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, node.module))
    return out


def _allowed(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("path", sorted((SRC / "runtime").rglob("*.py")),
                         ids=lambda p: str(p.relative_to(SRC)))
def test_runtime_imports_only_lower_layers(path: Path) -> None:
    bad = [f"line {line}: {mod}" for line, mod in _imports(path)
           if mod.startswith("hetplan") and not _allowed(mod, RUNTIME_MAY_IMPORT)]
    assert not bad, f"{path.relative_to(SRC)} imports above the runtime's layers: {bad}"


@pytest.mark.parametrize("name", ["pipeline_schedules.py", "collectives.py"])
def test_pure_modules_the_runtime_executes_import_no_torch(name: str) -> None:
    mods = [m for _, m in _imports(SRC / "algorithms" / name)]
    assert not [m for m in mods if m.split(".")[0] in ("torch", "numpy")], mods
    assert all(_allowed(m, ("hetplan.ir", "hetplan.errors")) for m in mods
               if m.startswith("hetplan")), mods


def test_the_check_sees_a_function_local_import(tmp_path: Path) -> None:
    f = tmp_path / "x.py"
    f.write_text("def g():\n    from hetplan.cost_models.comm import analytic_time_s\n")
    assert _imports(f) == [(2, "hetplan.cost_models.comm")]
