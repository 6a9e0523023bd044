"""The ``hetero`` plan section: pipeline stages with their own device group and degrees.

A plan without this section means what it always meant: every stage runs ``layout.dp x
layout.tp`` ranks and rank ``(pp*dp + d)*tp + t`` is at coordinates ``(d, pp, t)``
(:meth:`~hetplan.ir.plan_sections.Layout.rank_of`).

With it, stage ``k`` (``plan.stages[k]``) runs on its own ``dp_k x tp_k`` ranks of one
device class, listed in ``plan.stages[k].ranks`` **tp innermost**: the TP group of replica
``d`` is ``ranks[d*tp_k : (d+1)*tp_k]`` and the data-parallel group of TP rank ``t`` is
``ranks[t::tp_k]`` (so gradient sync of a stage uses that stage's own groups). The layout
then describes the pipeline as a whole:

- ``layout.pp`` is the number of stages, ``layout.dp == layout.tp == 1``;
- ``layout.micro_batch_size`` is the *global* micro-batch (the samples one pipeline
  micro-batch carries through every stage) and ``layout.micro_batches`` their number; stage
  ``k``'s replicas each run ``micro_batch_size / dp_k`` samples of it;
- at a boundary between stages of different degrees the activations (forward) and their
  gradients (backward) are resharded: each receiving replica gathers its batch slice from
  the sender replicas that hold it (a tensor-parallel receiver gets the slice on every TP
  rank).

The section also records how the stages were chosen (:class:`HeteroSearch`): the search
method (exact dynamic programming, or the same over a coarser space), its objective and
bound (the gap), and the
runner-up device order with its re-predicted time, which ``hetplan explain`` shows.

Written by :mod:`hetplan.optimizer.hetero`; priced by :mod:`hetplan.cost_models.hetero`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from hetplan.ir.plan_cpsat import CpSatRecord
from hetplan.ir.plan_sections import Layout, Ms, Name, NonNegInt, PosInt, Ranks, Stage, _Section

__all__ = ["StageShape", "HeteroAlternative", "HeteroSearch", "Hetero", "hetero_problems",
           "hetero_section_problems"]


class StageShape(_Section):
    """The degrees of one pipeline stage.

    Attributes:
        stage: the stage's index in ``plan.stages``.
        device_class: the device class its ranks belong to (``"<type>"``, or
            ``"<type>@<node group>"`` where node groups of one type differ).
        dp: data-parallel replicas of the stage.
        tp: tensor-parallel degree of each replica (ranks within one node).
        micro_batch_size: samples per replica per pipeline micro-batch
            (``layout.micro_batch_size / dp``).
        zero_stage: ZeRO sharding inside the stage's data-parallel groups (0 or 1).
        reshard_in_ms: predicted time to move one micro-batch's activations into this stage
            (forward; the gradients back cost the same), 0 for the first stage.
    """

    stage: NonNegInt
    device_class: Name
    dp: Ranks = 1
    tp: Ranks = 1
    micro_batch_size: PosInt = 1
    zero_stage: Literal[0, 1] = 0
    reshard_in_ms: Ms = 0.0


class HeteroAlternative(_Section):
    """Another device order the search scored, re-predicted with the plan's cost model.

    Attributes:
        order: the device class of each stage, in pipeline order.
        degrees: ``"dp x tp"`` of each stage.
        iteration_time_ms: its predicted iteration time.
        note: why it lost (or ``""``).
        first_layers: each stage's first layer (so ``explain`` can re-predict it).
        recompute: each stage's recomputation mode.
        micro_batch_size / micro_batches: its global micro-batch and their number.
    """

    order: tuple[Name, ...]
    degrees: tuple[Name, ...] = ()
    iteration_time_ms: Ms
    note: str = ""
    first_layers: tuple[NonNegInt, ...] = ()
    recompute: tuple[Literal["none", "selective", "full"], ...] = ()
    micro_batch_size: PosInt = 1
    micro_batches: PosInt = 1


class HeteroSearch(_Section):
    """How the stages were searched.

    Attributes:
        method: ``exact-dp`` (dynamic programming over layer splits, device use and stage
            degrees; exact for the search objective) or ``coarse-dp`` (the same DP where
            every stage of a class uses a multiple of ``units`` devices, on large clusters,
            with a threshold scan that may skip windows: ``gap`` bounds the loss on the
            objective within that space), or ``coarse-dp+cp-sat`` (the coarse DP's plan
            refined by CP-SAT at one-device resolution and taken: ``bound_ms`` and ``gap``
            are then CP-SAT's, proven within its neighbourhood; see ``cpsat``).
        units: per device class (in the order of the classes' names), the device multiple
            stages use (all 1 for ``exact-dp``).
        objective_ms: the search objective of the chosen stages (a closed-form 1F1B time,
            :mod:`hetplan.algorithms.hetero_search`).
        bound_ms: the best lower bound proven on that objective (= ``objective_ms`` when
            exact).
        gap: ``(objective - bound) / objective``; 0 when proven optimal.
        states: dynamic-programming states (or CP-SAT branches) explored.
        runner_up: the best plan with another device order, re-predicted (None: no other
            order fits).
        cpsat: the CP-SAT refinement of a coarse search, taken or not (None: not run;
            :mod:`hetplan.ir.plan_cpsat`).
    """

    method: Literal["exact-dp", "coarse-dp", "coarse-dp+cp-sat"] = "exact-dp"
    units: tuple[PosInt, ...] = ()
    objective_ms: Ms = 0.0
    bound_ms: Ms = 0.0
    gap: float = Field(default=0.0, ge=0.0, le=1.0)
    states: NonNegInt = 0
    runner_up: HeteroAlternative | None = None
    cpsat: CpSatRecord | None = None


class Hetero(_Section):
    """Per-stage degrees of a heterogeneous pipeline (see the module docstring)."""

    stages: tuple[StageShape, ...] = Field(min_length=1)
    search: HeteroSearch = Field(default_factory=HeteroSearch)

    @model_validator(mode="after")
    def _check(self) -> Hetero:
        if [s.stage for s in self.stages] != list(range(len(self.stages))):
            raise ValueError(f"stages must be listed in order 0..{len(self.stages) - 1}, got "
                             f"{[s.stage for s in self.stages]}")
        return self

    @property
    def order(self) -> tuple[str, ...]:
        return tuple(s.device_class for s in self.stages)

    def describe(self) -> str:
        """``"V100 4x2 | A100 2x1"``: each stage's class and ``dp x tp``."""
        return " | ".join(f"{s.device_class} {s.dp}x{s.tp}" for s in self.stages)


def hetero_problems(hetero: Hetero | None, layout: Layout | None,
                    stages: tuple[Stage, ...], world_size: int) -> list[str]:
    """Cross-section rules of a plan with per-stage degrees (rule 3 of
    :mod:`hetplan.ir.plan_checks` in its heterogeneous form): one shape per stage; stage
    ``k`` lists ``dp_k x tp_k`` distinct ranks that exist and that no other stage lists;
    the layout is the pipeline's (``dp = tp = 1``, ``pp`` stages, one schedule chunk) and
    its micro-batch divides over every stage's replicas."""
    if hetero is None:
        return []
    out: list[str] = []
    if layout is not None:
        if (layout.dp, layout.tp, layout.virtual_stages) != (1, 1, 1):
            out.append(f"layout: a plan with per-stage degrees (hetero) keeps dp=1, tp=1 and "
                       f"virtual_stages=1 in the layout, got dp={layout.dp} tp={layout.tp} "
                       f"virtual_stages={layout.virtual_stages}; re-run `hetplan plan`")
        if layout.pp != len(hetero.stages):
            out.append(f"hetero.stages: {len(hetero.stages)} shape(s), but layout.pp is "
                       f"{layout.pp}")
        for s in hetero.stages:
            if layout.micro_batch_size != s.dp * s.micro_batch_size:
                out.append(f"hetero.stages[{s.stage}]: dp={s.dp} x micro_batch_size="
                           f"{s.micro_batch_size} is not the layout's micro-batch of "
                           f"{layout.micro_batch_size}")
    if stages and len(stages) != len(hetero.stages):
        out.append(f"hetero.stages: {len(hetero.stages)} shape(s) for {len(stages)} stage(s)")
        return out
    seen: dict[int, int] = {}
    for st, shape in zip(stages, hetero.stages):
        if len(st.ranks) != shape.dp * shape.tp or len(set(st.ranks)) != len(st.ranks):
            out.append(f"stages[{st.index}].ranks: {len(st.ranks)} rank(s) "
                       f"({len(set(st.ranks))} distinct), but hetero.stages[{st.index}] runs "
                       f"dp x tp = {shape.dp} x {shape.tp} = {shape.dp * shape.tp}")
        for r in st.ranks:
            if r >= world_size:
                out.append(f"stages[{st.index}].ranks: rank {r} does not exist in a world of "
                           f"size {world_size}")
            elif r in seen and seen[r] != st.index:
                out.append(f"stages[{st.index}].ranks: rank {r} is also in stage {seen[r]}; "
                           "each rank is in exactly one pipeline stage")
            seen.setdefault(r, st.index)
    if hetero.search.runner_up is not None:
        out += _runner_up_problems(hetero.search.runner_up, layout, stages)
    return out[:8]


def _runner_up_problems(alt: HeteroAlternative, layout: Layout | None,
                        stages: tuple[Stage, ...]) -> list[str]:
    """The recorded runner-up is one ``explain`` can rebuild and re-predict: per stage a
    ``DPxTP`` whose dp divides its micro-batch and a first layer (from 0, increasing, inside
    the model), and the plan's global batch. (Without first layers, a plan written before
    they were recorded, ``explain`` says it cannot.)"""
    where, fix = "hetero.search.runner_up", "re-run `hetplan plan --hetero`"
    n, firsts = len(alt.order), list(alt.first_layers)
    if not firsts:
        return []
    if len(alt.degrees) != n or len(firsts) != n or len(alt.recompute) not in (0, n):
        return [f"{where}: {len(alt.degrees)} degrees, {len(alt.recompute)} recompute modes "
                f"and {len(firsts)} first_layers for {n} stages (its order); {fix}"]
    out = []
    for k, d in enumerate(alt.degrees):
        dp, _, tp = d.partition("x")
        if not (dp.isdigit() and tp.isdigit() and int(dp) >= 1 and int(tp) >= 1):
            out.append(f"{where}.degrees[{k}]: {d!r} is not 'DPxTP' (e.g. '2x1'); {fix}")
        elif alt.micro_batch_size % int(dp):
            out.append(f"{where}: micro-batch {alt.micro_batch_size} does not divide over "
                       f"stage {k}'s {dp} replicas; {fix}")
    layers = stages[-1].last_layer + 1 if stages else None
    if firsts[0] != 0 or any(b <= a for a, b in zip(firsts, firsts[1:])) or (
            layers is not None and firsts[-1] >= layers):
        model = f", but the model has {layers} layers" if layers is not None else ""
        out.append(f"{where}.first_layers: {firsts}{model}: each stage's first layer, from 0 "
                   f"and increasing; {fix}")
    total = alt.micro_batch_size * alt.micro_batches
    if layout is not None and layout.global_batch_size and total != layout.global_batch_size:
        out.append(f"{where}: micro-batch {alt.micro_batch_size} x {alt.micro_batches} = "
                   f"{total} samples, but the plan's global batch is "
                   f"{layout.global_batch_size}; {fix}")
    return out


def hetero_section_problems(hetero: Hetero | None, **sections: object) -> list[str]:
    """Sections a plan with per-stage degrees cannot hold, one line each: each of them
    describes one layout-wide ``dp x tp`` that such a plan does not have (sparse sync and
    group sync: the layout's replicas; ``tensor_parallel`` and ``rebalancing`` are per
    stage there, checked by :mod:`hetplan.ir.plan_hetero_checks`). ``sections``:
    section name -> the plan's value (None: absent). The gradient-sync section is checked
    by rule 6 of :mod:`hetplan.ir.plan_checks` (a bucket stays in one stage, so it syncs on
    that stage's own data-parallel group)."""
    if hetero is None:
        return []
    why = {"tensor_parallel": "each stage's tensor parallelism is its hetero.stages[k].tp "
                              "with even shards",
           "rebalancing": "re-balancing moves layers between layout stages",
           "sparse_sync": "sparse sync runs on the layout's data-parallel group",
           "group_sync": "group sync averages the layout's pipeline replicas"}
    return [f"{name}: a plan with per-stage degrees (hetero: {hetero.describe()}) cannot hold "
            f"this section ({why.get(name, 'it assumes one layout-wide dp x tp')}); drop it "
            "or re-run `hetplan plan`"
            for name, value in sections.items() if value is not None]
