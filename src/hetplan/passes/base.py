"""The pass interface.

A pass is a frozen dataclass with a kebab-case ``name``, typed options (its fields) and the
plan ``sections`` it writes. Its one method, ``run(plan, ctx)``, returns a
:class:`PassResult` with a new plan in which it has filled or changed only those sections; it
never mutates its inputs, and the pass manager (:mod:`hetplan.passes.manager`) checks after
every pass that nothing else changed. The algorithm lives in ``hetplan.algorithms`` as a pure
function; the pass adapts plan and workload to it. A pass never calls another pass: what it
needs from another pass's section comes through the pipeline (an earlier pass wrote it) or
through the cost model (e.g. :func:`~hetplan.cost_models.ddp.ddp_gradient_sync`, the
reference sync that stage partitions are priced with).

A pass whose ``refines`` is true improves a section an earlier pass already filled, at a
price: ``compile`` screens every candidate layout without it and runs it only on the best few
(``optimizer.compile.FINALISTS``), so an expensive search is paid a few times per compile,
not once per layout. ``refines`` may be a class constant or a property of the options.

Options are spelled in a pipeline spec (:mod:`hetplan.passes.spec`) as
``name{option=value other-option=a,b}``; a field whose ``metadata`` has a ``"parse"``
callable gets the option's text through it (e.g. ``dynpipe{dynamics=FILE}``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import Layout, Stage, WorkloadSummary

if TYPE_CHECKING:
    from hetplan.cost_models.costs import CostModel
    from hetplan.ir.model import ModelIR

__all__ = ["Pass", "PassContext", "PassResult", "rank_of", "stages_from_bounds"]


@dataclass(frozen=True)
class PassContext:
    """What every pass may read: the workload, the cluster, the cost model, the layout."""

    workload: WorkloadSummary
    cluster: ClusterSpec
    costs: CostModel
    layout: Layout
    seed: int = 0
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
    #: The plan fields (``Plan.model_fields``) this pass may write; the manager enforces it.
    sections: ClassVar[tuple[str, ...]]

    @property
    def refines(self) -> bool: ...

    def run(self, plan: Plan, ctx: PassContext) -> PassResult: ...


def rank_of(layout: Layout, dp: int, pp: int, tp: int) -> int:
    """Global rank of coordinates (dp, pp, tp); see :meth:`Layout.rank_of`."""
    return layout.rank_of(dp, pp, tp)


def stages_from_bounds(bounds: list[tuple[int, int]], ctx: PassContext) -> tuple[Stage, ...]:
    """Stages for inclusive layer ranges, with the ranks of each pipeline coordinate (stage
    ``s`` on coordinate ``s % pp``: interleaved chunks list ``pp * virtual_stages``)."""
    lay = ctx.layout
    names = [layer.name for layer in ctx.workload.layers]
    return tuple(
        Stage(
            index=s,
            first_layer=first,
            last_layer=last,
            layer_names=tuple(names[first : last + 1]),
            ranks=tuple(
                rank_of(lay, d, s % lay.pp, t) for d in range(lay.dp) for t in range(lay.tp)
            ),
        )
        for s, (first, last) in enumerate(bounds)
    )
