"""The README's Python example runs as written (so the documentation stays true)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


@pytest.mark.parametrize("index", range(len(_python_blocks())))
def test_readme_python_example_runs(index: int, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.chdir(tmp_path)
    code = _python_blocks()[index]
    exec(compile(code, f"README.md block {index}", "exec"), {"__name__": "__readme__"})


def test_readme_names_the_two_quick_start_commands() -> None:
    text = README.read_text()
    assert "make demo" in text and "make test" in text
    ci = (README.parent / ".ci" / "run").read_text()
    assert "make test" in ci
