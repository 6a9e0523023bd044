"""Formatting helpers shared by the plan reports (inspect, explain, diff).

Everything here is pure string formatting: no plan logic, no rich objects except the console
factory used to render a report to plain text at a fixed width (golden files, tests).
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from rich.console import Console

__all__ = [
    "fmt_bytes",
    "fmt_ms",
    "fmt_delta_ms",
    "fmt_pct",
    "ranges",
    "device_mix",
    "dump_json",
    "plain_text",
]


def layer_label(name: str) -> str:
    """A layer's name for a reader: the IR names the root module's layer ``""`` (a leaf
    model, or parameters the top-level module owns beside its children)."""
    return name if name else "(the root module)"


def fmt_bytes(n: float | None) -> str:
    """Bytes with a binary unit: ``3.00 GiB``, ``512 B``; ``—`` for None."""
    if n is None:
        return "—"
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_ms(ms: float | None) -> str:
    """Milliseconds with three decimals: ``12.345 ms``; ``—`` for None."""
    return "—" if ms is None else f"{ms:.3f} ms"


def fmt_delta_ms(ms: float) -> str:
    """A signed difference in milliseconds: ``+1.250 ms``, ``-0.003 ms``."""
    return f"{ms:+.3f} ms"


def fmt_pct(fraction: float | None) -> str:
    """A fraction as a percentage with one decimal: ``74.4%``; ``—`` for None."""
    return "—" if fraction is None else f"{100 * fraction:.1f}%"


def ranges(values: Iterable[int]) -> str:
    """Sorted integers folded into runs: ``0,1,2,3,8,9`` → ``0–3, 8–9``."""
    parts: list[str] = []
    run: list[int] = []
    for v in sorted(values):
        if run and v == run[-1] + 1:
            run.append(v)
            continue
        if run:
            parts.append(f"{run[0]}–{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [v]
    if run:
        parts.append(f"{run[0]}–{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(parts)


def device_mix(counts: Mapping[str, int]) -> str:
    """Device-type counts as ``8× A100-80GB + 8× V100-SXM2-32GB`` (types sorted)."""
    if not counts:
        return "—"
    return " + ".join(f"{n}× {t}" for t, n in sorted(counts.items()))


def dump_json(data: Any) -> str:
    """Deterministic JSON: sorted keys, indent 2, trailing newline."""
    return json.dumps(data, sort_keys=True, indent=2, allow_nan=False) + "\n"


def plain_text(render: Callable[[Console], None], *, width: int = 100) -> str:
    """What ``render(console)`` prints, as plain text (no colour, no markup) at ``width``."""
    buf = io.StringIO()
    console = Console(
        file=buf,
        width=width,
        color_system=None,
        force_terminal=False,
        highlight=False,
        soft_wrap=False,
        emoji=False,
    )
    render(console)
    return buf.getvalue()
