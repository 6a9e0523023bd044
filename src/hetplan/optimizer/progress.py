"""The layout search's progress display: a rich progress bar on stderr for a search that
takes longer than a second.

:func:`search_progress` yields a :class:`Progress` the search advances once per candidate
layout (pruned ones count as done). The bar appears only when it is allowed — ``show=True``,
or ``show=None`` (the default) and stderr is a terminal — and only once the search has run
for :data:`DELAY_S`; it is transient (cleared when the search ends), so nothing is left in
logs, piped output or a quick search. It never touches stdout and does not change the plan.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["DELAY_S", "Progress", "search_progress"]

#: Seconds a search runs before its progress bar appears.
DELAY_S = 1.0


class Progress:
    """Counts screened layouts and draws the bar once the search is slow enough to need it.

    Args:
        total: candidate layouts of the search.
        enabled: whether a bar may be drawn at all.
        delay_s: seconds before the bar appears.
    """

    def __init__(self, total: int, enabled: bool, delay_s: float = DELAY_S) -> None:
        self.total = total
        self.done = 0
        self.enabled = enabled
        self.delay_s = delay_s
        self._start = time.perf_counter()
        self._bar: Any = None
        self._task: Any = None

    @property
    def shown(self) -> bool:
        """Whether the bar is on screen."""
        return self._bar is not None

    def advance(self, n: int = 1) -> None:
        """``n`` more layouts screened (or pruned)."""
        self.done += n
        if self._bar is None and self.enabled and (
                time.perf_counter() - self._start >= self.delay_s):
            self._open()
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done)

    def _open(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as Bar

        self._bar = Bar(TextColumn("searching layouts"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=Console(stderr=True), transient=True)
        self._bar.start()
        self._task = self._bar.add_task("search", total=self.total, completed=self.done)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


@contextmanager
def search_progress(total: int, show: bool | None = None,
                    delay_s: float = DELAY_S) -> Iterator[Progress]:
    """A :class:`Progress` for a search over ``total`` layouts (see module docstring);
    ``show``: True always allowed, False never, None only when stderr is a terminal."""
    enabled = sys.stderr.isatty() if show is None else show
    progress = Progress(total, enabled, delay_s)
    try:
        yield progress
    finally:
        progress.close()
