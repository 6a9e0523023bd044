"""Reports on plans: inspection, explanations, diffs and timeline renderings.

- :func:`build_report` / :func:`render_report` / :func:`render_text` — ``hetplan inspect``
  (:mod:`hetplan.report.inspect`, :mod:`hetplan.report.render`).
- :func:`explain` / :class:`Explanation` — ``hetplan explain``: why a tensor, bucket, stage
  boundary or rank looks the way it does, with re-evaluated alternatives
  (:mod:`hetplan.report.explain`).
- :func:`diff_plans` / :func:`render_diff` — ``hetplan diff`` (:mod:`hetplan.report.diff`).
- :func:`render_timeline` — ``hetplan timeline`` (:mod:`hetplan.report.timeline`).

Names are imported lazily, so ``import hetplan.report`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "SECTIONS",
    "build_report",
    "render_report",
    "render_text",
    "explain",
    "Explanation",
    "Alternative",
    "diff_plans",
    "render_diff",
    "render_timeline",
]

_WHERE = {
    "SECTIONS": "hetplan.report.inspect",
    "build_report": "hetplan.report.inspect",
    "render_report": "hetplan.report.render",
    "render_text": "hetplan.report.render",
    "explain": "hetplan.report.explain",
    "Explanation": "hetplan.report.explain",
    "Alternative": "hetplan.report.explain",
    "diff_plans": "hetplan.report.diff",
    "render_diff": "hetplan.report.diff",
    "render_timeline": "hetplan.report.timeline",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'hetplan.report' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
