"""Refuse, before any handler sets up, a plan whose strategies this runtime does not compose
(:func:`~hetplan.runtime.composition.refusals`; every rank refuses alike)."""

from __future__ import annotations

from hetplan.errors import SpecError
from hetplan.runtime.composition import refusals
from hetplan.runtime.handlers.base import Handler, RuntimeContext

__all__ = ["CompositionHandler"]


class CompositionHandler(Handler):
    """Raises :class:`~hetplan.errors.SpecError` listing every refused combination."""

    section = "layout, precision, stages, gradient_sync"

    def setup(self, ctx: RuntimeContext) -> None:
        if problems := refusals(ctx.plan):
            raise SpecError("the runtime does not execute this plan's combination of "
                            "strategies:\n  " + "\n  ".join(problems))
