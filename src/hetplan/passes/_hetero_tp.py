"""The ZERO/SEMI resizing controller inside each stage's TP group of a heterogeneous plan.

The ``tp-resizing`` pass (:mod:`hetplan.passes.tp_resizing`) refines a ``tensor_parallel``
section whose groups all run the layout's one ``tp``. In a heterogeneous plan each stage has
its own ``tp_k``; its TP group of replica ``d`` is ``stages[k].ranks[d*tp_k:(d+1)*tp_k]``
(:mod:`hetplan.ir.plan_hetero`). This adapter runs the controller's rule per stage with
``tp_k > 1``, on the stage's :func:`~hetplan.cost_models.hetero.stage_projection` (the stage
as a homogeneous ``dp_k x tp_k`` plan of its own, on its real ranks and devices):

1. **Expected stragglers**: :func:`~hetplan.passes.tp_resizing.expected_gammas` on every
   TP group of the stage, with the pass's criterion, tolerance and ``gamma_max`` — Eq. (1)
   on each rank's time for its share of the stage's TP layers on its own device (the
   cluster's per-device slowdown and measured speed, as the homogeneous pass reads them).
2. **Roles**: with a controller variant other than ``off``, each straggler's initial role
   (:meth:`~hetplan.passes.tp_resizing.TPResizing.initial_roles`), the others ``normal``.
3. **Predicted effect** per stage: the projection simulated
   (:func:`~hetplan.cost_models.evaluate.evaluate`) with even shards and with the
   controller's roles; the pass log gives both per stage. The roles are kept only where
   they are predicted no slower, as the homogeneous pass keeps them.

The per-stage results merge into one ``tensor_parallel`` section: every group names its
stage (``TPGroup.stage``), ranks are the stage's real ranks. The section is written only
with a controller variant other than ``off`` (the runtime then runs the controller in every
stage's TP group, for the stragglers that appear while training); with ``off`` the plan's
even shards at each stage's ``tp`` are what a missing section already means, and the log
still names any expected straggler. Static skewed shards are not planned: the stages of a
searched plan draw their TP groups from one device class, and the adapter has no captured
model (the linears) to size them. Deterministic; O(stages x groups x layers) lookups plus
two simulations per stage with a straggler.
"""

from __future__ import annotations

from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.evaluate import evaluate
from hetplan.cost_models.hetero import StageProjection, stage_projection
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import TensorParallel, TPGroup
from hetplan.passes.base import PassContext
from hetplan.passes.tp_resizing import TPResizing, expected_gammas

__all__ = ["hetero_tp_controller"]


def _stage_ms(proj: StageProjection, costs: CostModel, section: TensorParallel | None
              ) -> float:
    """The stage alone (its projection) simulated with ``section``, in ms."""
    ev = evaluate(proj.workload, proj.layout, (proj.stage,), None, costs, check_memory=False,
                  tensor_parallel=section)
    return ev.iteration_s * 1e3


def hetero_tp_controller(plan: Plan, p: TPResizing, costs: CostModel
                         ) -> tuple[TensorParallel | None, tuple[str, ...]]:
    """The ``tensor_parallel`` section of heterogeneous ``plan`` under ``p``'s controller
    (None: nothing to write, see the module docstring) and one note per stage."""
    wl, lay, het = plan.model.workload, plan.layout, plan.hetero
    assert wl is not None and lay is not None and het is not None
    ctl = p.settings()
    groups: list[TPGroup] = []
    notes: list[str] = []
    for st, shape in zip(plan.stages, het.stages):
        if shape.tp == 1:
            continue
        proj = stage_projection(wl, lay, st, shape)
        ctx = PassContext(workload=proj.workload, cluster=costs.cluster, costs=costs,
                          layout=proj.layout)
        last = len(proj.workload.layers) - 1
        mine: list[TPGroup] = []
        gammas: dict[int, float] = {}
        for d in range(shape.dp):
            g = TPGroup(ranks=st.ranks[d * shape.tp:(d + 1) * shape.tp], stage=0)
            gam = expected_gammas(ctx, g, 0, last, ctl.criterion, ctl.straggler_eps,
                                  ctl.gamma_max)
            gammas.update(gam)
            roles = p.initial_roles(g, gam) if ctl.variant != "off" else ()
            mine.append(g.model_copy(update={"roles": roles}))
        head = f"stage {st.index} ({shape.device_class} {shape.dp}x{shape.tp})"
        if not gammas:
            notes.append(f"{head}: {len(mine)} TP group(s) of identical devices, no "
                         f"straggler: even shards"
                         + ("" if ctl.variant == "off" else
                            f"; the {ctl.variant} controller runs in them"))
            groups += [g.model_copy(update={"stage": st.index}) for g in mine]
            continue
        even_ms = _stage_ms(proj, costs, None)
        ctl_ms = _stage_ms(proj, costs, TensorParallel(controller=ctl, groups=tuple(
            g.model_copy(update={"roles": p.initial_roles(g, gammas)}) for g in mine)))
        said = ", ".join(f"rank {r} gamma {g:.3f}" for r, g in sorted(gammas.items()))
        if ctl.variant == "off":
            verdict = "controller off: even shards (set tp-resizing{controller=...})"
        elif ctl_ms <= even_ms:
            verdict = f"{ctl.variant} roles kept"
        else:
            verdict = f"{ctl.variant} roles predicted slower: every rank starts normal"
            mine = [g.model_copy(update={"roles": ()}) for g in mine]
        notes.append(f"{head}: straggler(s) {said} ({ctl.criterion}); stage alone "
                     f"{even_ms:.3f} ms even, {ctl_ms:.3f} ms with the controller's gamma; "
                     f"{verdict}")
        groups += [g.model_copy(update={"stage": st.index}) for g in mine]
    if not groups:
        return None, ("every stage has tp=1: no TP group to resize",)
    if ctl.variant == "off":
        return None, tuple(notes)
    return TensorParallel(controller=ctl, groups=tuple(groups)), tuple(notes)
