"""The pass interface.

A pass is a frozen dataclass with a kebab-case ``name`` and typed options. Its one method,
``run(plan, ctx)``, returns a :class:`PassResult` with a new plan in which it has filled or
changed exactly one section (``section``); it never mutates its inputs. The algorithm lives in
``hetplan.algorithms`` as a pure function; the pass adapts plan and workload to it.

A pass that sets ``refines = True`` (or a ``refines(compressors) -> bool`` function) improves
a section an earlier pass already filled, at a price: ``compile`` screens every candidate
layout without it and runs it only on the best few (``optimizer.compile.FINALISTS``), so an
expensive search is paid a few times per compile, not once per layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import Layout, WorkloadSummary

if TYPE_CHECKING:
    from hetplan.cost_models.costs import CostModel
    from hetplan.ir.model import ModelIR

__all__ = ["Pass", "PassContext", "PassResult", "rank_of"]


@dataclass(frozen=True)
class PassContext:
    """What every pass may read: the workload, the cluster, the cost model, the layout."""

    workload: WorkloadSummary
    cluster: ClusterSpec
    costs: CostModel
    layout: Layout
    seed: int = 0
    #: Compressors the user allows gradient-sync passes to use (opt-in; lossy ones change
    #: convergence), e.g. ``("dgc", "fp16")``; empty: none.
    compressors: tuple[str, ...] = ()
    #: The captured model (its linears, for the tensor-parallel passes), when compile has it.
    model_ir: ModelIR | None = None


@dataclass(frozen=True)
class PassResult:
    """A pass's output: the new plan, whether it changed anything, and notes for the log."""

    plan: Plan
    changed: bool
    notes: tuple[str, ...] = field(default=())


class Pass(Protocol):
    """Structural type of a pass (see module docstring)."""

    name: ClassVar[str]
    section: ClassVar[str]

    def run(self, plan: Plan, ctx: PassContext) -> PassResult: ...


def rank_of(layout: Layout, dp: int, pp: int, tp: int) -> int:
    """Global rank of coordinates (dp, pp, tp); see :meth:`Layout.rank_of`."""
    return layout.rank_of(dp, pp, tp)
