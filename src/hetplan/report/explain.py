"""``hetplan explain``: why the plan made one decision, and what the alternatives would cost.

A target names one decision of a plan:

- a gradient tensor (its name, or ``tensor:NAME``): its strategy and bucket, against being
  synced alone with an fp32 allreduce (and alone with its bucket's strategy);
- ``bucket:N`` (the N-th bucket, in launch order): against splitting it into one operation per
  tensor and against merging it with its neighbouring bucket of the same stage;
- ``stage:K`` (or ``stage:J-K``): the boundary between stage K−1 and K (stage 0: its boundary
  with stage 1), against moving it by one layer either way;
- ``rank:R``: its device, stage, memory and compute time per micro-batch, against the slowest
  device of its stage, the slowest stage and the rank with the most memory;
- ``linear:NAME``: a tensor-parallel linear the plan lists with per-rank shard sizes: its
  split, the sizes per rank and device, the ranks' controller roles, against even shards of
  its pair in every group.

Alternatives are whole plans that differ in that one decision, re-evaluated with the plan's
own cost model (:func:`hetplan.cost_models.evaluate.evaluate`, the objective of ``compile``),
so the predicted differences are what the optimizer would have seen. The current plan is
re-evaluated the same way, so differences never mix two cost models.

The pipeline runs the plan's own ``pipeline_actions`` (hand-edited lists included), in the
current plan and in every alternative, as ``simulate`` does: so ``explain`` and
``simulate`` predict an edited plan alike. Every alternative here keeps the plan's pipeline
layout (a moved stage boundary keeps the stage and micro-batch numbering the lists are
written in), so the lists always apply. An alternative that changed the layout (another
schedule, micro-batch count or number of stages) would run the lists its own layout
generates: :func:`~hetplan.cost_models.evaluate.edited_lists` never maps lists onto a
pipeline of another shape, so such an alternative cannot fail on them
(``docs/decisions/bad-input-round9.md``, "Every command prices the plan's own lists").

Example:
    >>> explain(plan, "bucket:3").alternatives[0].delta_ms  # doctest: +SKIP
    2.5
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from hetplan.cost_models.evaluate import Evaluation, evaluate
from hetplan.cost_models.predict import plan_costs, resolve_profile
from hetplan.cost_models.profile_db import ProfileDB
from hetplan.errors import InfeasiblePlanError, SpecError
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import CostSettings, GradientSync, Stage, TensorParallel
from hetplan.ir.plan_sparse import SparseSync
from hetplan.passes import get_all_passes
from hetplan.report import _explain_targets as targets
from hetplan.report._explain_targets import (
    Alternative,
    fp32_strategy,
    strategy_text,
    sync_with_buckets,
)
from hetplan.ir.validation import did_you_mean
from hetplan.report._text import fmt_delta_ms, fmt_ms

__all__ = [
    "Alternative",
    "Explanation",
    "explain",
    "target_names",
    "sync_with_buckets",
    "fp32_strategy",
    "strategy_text",
]
# Alternative and the helpers live in _explain_targets (the explainers use them); they are
# part of this module's API.

Kind = Literal["tensor", "bucket", "stage", "rank", "linear"]


@dataclass(frozen=True)
class Explanation:
    """Why a decision was made: facts, the alternatives considered, and a verdict.

    Attributes:
        target: the target as given.
        kind: ``tensor``, ``bucket``, ``stage`` or ``rank``.
        current_ms: the plan's iteration time, re-evaluated with its cost model.
        facts: (label, value) lines describing the decision.
        alternatives: the alternatives considered (may be empty, e.g. for a rank).
        verdict: one sentence comparing the plan's choice with the alternatives.
        text: the whole explanation as readable text.
    """

    target: str
    kind: Kind
    current_ms: float
    facts: tuple[tuple[str, str], ...]
    alternatives: tuple[Alternative, ...]
    verdict: str
    text: str = field(default="", compare=False)

    @property
    def best(self) -> Alternative | None:
        """The fastest alternative that fits in memory, or None."""
        fits = [a for a in self.alternatives if a.fits_memory]
        return min(fits, key=lambda a: a.iteration_time_ms, default=None)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``hetplan explain --json``."""
        data = asdict(self)
        data["facts"] = [{"label": k, "value": v} for k, v in self.facts]
        return data

    def __str__(self) -> str:
        return self.text


def explain(
    plan: Plan,
    target: str,
    *,
    cluster: ClusterSpec | str | Path | None = None,
    profile: ProfileDB | str | Path | None = None,
) -> Explanation:
    """Explain one decision of ``plan`` (see the module docstring for targets).

    Args:
        plan: a plan with a workload summary and an embedded cluster spec.
        target: a gradient name, ``bucket:N``, ``stage:K``, ``rank:R`` or ``linear:NAME``.
        cluster: the cluster, when the plan does not embed it.
        profile: the profile DB the plan was made with (analytic costs otherwise).

    Raises:
        SpecError: the target does not exist (the message names the nearest targets), or the
            plan cannot be re-evaluated (no workload summary, no cluster).
    """
    if plan.hetero is not None:  # per-stage degrees: priced by evaluate_hetero
        from hetplan.report.explain_hetero import explain_hetero

        h = explain_hetero(plan, target, cluster=cluster, profile=profile)
        alts = tuple(Alternative(n, ms, d, fits_memory=f, note=why)
                     for n, ms, d, f, why in h.alternatives)
        return Explanation(target, "stage", h.current_ms, h.facts, alts, h.verdict, h.text)
    ctx = _Context(plan, cluster, profile)
    kind, value = _resolve(plan, ctx, target)
    facts, alternatives = targets.EXPLAINERS[kind](ctx, value)
    verdict = _verdict(ctx, alternatives, kind)
    text = _text(target, ctx, facts, alternatives, verdict)
    return Explanation(target, kind, ctx.current_ms, tuple(facts), tuple(alternatives),
                       verdict, text)


# -- re-evaluation ---------------------------------------------------------------------------
class _Keep:
    """Marks "keep the plan's section" where None means "no section"."""


_KEEP = _Keep()


class _Context:
    """The plan, its cost model and its current evaluation."""

    def __init__(self, plan: Plan, cluster: Any, profile: Any) -> None:
        self.plan = plan
        self.workload, self.layout, self.costs = plan_costs(plan, cluster=cluster,
                                                            profile=profile)
        self.spec = self.costs.cluster
        settings = plan.cost_settings or CostSettings()
        self.stages = plan.stages
        self.sync = plan.gradient_sync
        recorded = settings.profile_fingerprint
        db = resolve_profile(profile)
        given = db.fingerprint() if db is not None else ""
        #: why the stored prediction may differ: the plan's profile DB missing, or another
        self.profile_note = (
            "it was predicted with a profile DB: pass --profile" if recorded and db is None
            else "" if given == recorded
            else f"it was predicted with profile DB {recorded}, not with --profile's {given}"
            if recorded
            else f"it was predicted without a profile DB, not with --profile's {given}")
        self.current, self.current_note = self.evaluate(self.stages, self.sync)
        self.current_ms = self.current.iteration_s * 1e3

    def evaluate(
        self, stages: tuple[Stage, ...], sync: GradientSync | None,
        tp: TensorParallel | None = None, sparse: SparseSync | None | _Keep = _KEEP,
    ) -> tuple[Evaluation, str]:
        """(evaluation, "" or why it does not fit in memory); ``tp``: the TP section (None:
        the plan's); ``sparse``: the sparse-sync section (default: the plan's; None: none)."""
        args = (self.workload, self.layout, stages, sync, self.costs)
        section = self.plan.tensor_parallel if tp is None else tp
        sparse_sync = self.plan.sparse_sync if isinstance(sparse, _Keep) else sparse
        # every alternative keeps the plan's layout, so the plan's own lists apply to it
        lists = self.plan.pipeline_actions
        try:
            return evaluate(*args, tensor_parallel=section, sparse_sync=sparse_sync,
                            actions=lists), ""
        except InfeasiblePlanError as e:
            return evaluate(*args, check_memory=False, tensor_parallel=section,
                            sparse_sync=sparse_sync, actions=lists), str(e)

    def alternative(
        self, name: str, *, stages: tuple[Stage, ...] | None = None,
        sync: GradientSync | None = None, note: Callable[[Evaluation], str] | None = None,
        tp: TensorParallel | None = None, sparse: SparseSync | None | _Keep = _KEEP,
    ) -> Alternative:
        """Re-evaluate the plan with ``stages``, ``sync``, the TP section ``tp`` and/or the
        sparse-sync section ``sparse`` replaced; ``note`` describes the evaluation (shown
        when it fits in memory)."""
        ev, oom = self.evaluate(self.stages if stages is None else stages,
                                self.sync if sync is None else sync, tp, sparse)
        ms = ev.iteration_s * 1e3
        return Alternative(name, round(ms, 6), round(ms - self.current_ms, 6) + 0.0,
                           fits_memory=not oom, note=oom or (note(ev) if note else ""))

    def stage_of_layer(self, stages: tuple[Stage, ...] | None = None) -> list[int]:
        out = [0] * len(self.workload.layers)
        for st in self.stages if stages is None else stages:
            for i in range(st.first_layer, st.last_layer + 1):
                out[i] = st.index
        return out

    def decided_by(self, section: str) -> list[tuple[str, str]]:
        """The facts naming every pass that changed ``section``, in the order they ran:
        ``("decided by", "pass NAME (notes)")`` for the first, ``("then", ...)`` for each
        later one (a gradient's strategy is Espresso's, its bucket Cupcake's after it);
        empty when none did."""
        registry = get_all_passes()
        lines = []
        for entry in self.plan.pass_log:
            cls = registry.get(entry.name)
            if (cls is not None and section in getattr(cls, "sections", ())
                    and entry.changed):  # a pass that kept its input did not decide it
                notes = f" ({'; '.join(entry.notes)})" if entry.notes else ""
                lines.append(f"pass {entry.name}{notes}")
        return [("then" if i else "decided by", line) for i, line in enumerate(lines)]


# -- targets -----------------------------------------------------------------------------
def target_names(plan: Plan) -> list[str]:
    """Every valid target of ``plan``: gradient names, then ``bucket:N``, ``stage:K``,
    ``rank:R``."""
    grads = [g.name for g in plan.model.workload.grads] if plan.model.workload else []
    buckets = plan.gradient_sync.buckets if plan.gradient_sync is not None else ()
    return (grads + [f"bucket:{i}" for i in range(len(buckets))]
            + [f"stage:{k}" for k in range(max(len(plan.stages), 1))]
            + [f"rank:{r}" for r in range(plan.cluster.world_size)]
            + [f"linear:{n}" for n in tp_linear_names(plan)])


def tp_linear_names(plan: Plan) -> list[str]:
    """Linears the plan's TP groups list with shard sizes, in first-listed order."""
    tp = plan.tensor_parallel
    names = [lin.name for g in tp.groups for lin in g.linears] if tp is not None else []
    return list(dict.fromkeys(names))


_PREFIXED = re.compile(r"(tensor|bucket|stage|rank|linear):(.*)")


def _resolve(plan: Plan, ctx: _Context, target: str) -> tuple[Kind, Any]:
    grads = {g.name for g in ctx.workload.grads}
    text = target.strip()
    m = _PREFIXED.fullmatch(text)
    if m is None or m.group(1) == "tensor":
        name = text if m is None else m.group(2)
        if name in grads:
            return "tensor", name
        raise SpecError(_unknown(plan, target))
    kind, arg = m.group(1), m.group(2).strip()
    if kind == "linear":
        if arg in tp_linear_names(plan):
            return "linear", arg
        if not tp_linear_names(plan):  # suggesting gradient names here misled
            tp = ctx.layout.tp
            raise SpecError(
                f"{target!r}: the plan lists no linear with shard sizes "
                f"(tensor_parallel.groups[].linears is empty: "
                + ("no tensor parallelism, tp=1" if tp == 1 else f"tp={tp}, even shards")
                + "), so there is no linear:NAME to explain; explain stage:K or rank:R instead")
        raise SpecError(_unknown(plan, target))
    counts = {
        "bucket": len(ctx.sync.buckets) if ctx.sync is not None else 0,
        "stage": max(len(ctx.stages), 1),
        "rank": ctx.layout.num_ranks,
    }
    if kind == "stage" and (pair := re.fullmatch(r"(\d+)\s*[-/]\s*(\d+)", arg)):
        a, b = int(pair.group(1)), int(pair.group(2))
        if b != a + 1:
            raise SpecError(f"{target!r}: a stage boundary joins consecutive stages, such as "
                            f"'stage:{a}-{a + 1}'")
        arg = str(b)
    if not arg.isdigit():
        raise SpecError(f"{target!r}: expected {kind}:N with an integer N")
    index = int(arg)
    if index >= counts[kind]:
        what = {"bucket": "bucket(s)", "stage": "stage(s)", "rank": "rank(s)"}[kind]
        valid = f"{kind}:0 … {kind}:{counts[kind] - 1}" if counts[kind] else "none"
        raise SpecError(f"{target!r} does not exist: the plan has {counts[kind]} {what} "
                        f"({valid})")
    return kind, index  # type: ignore[return-value]


def _unknown(plan: Plan, target: str) -> str:
    names = target_names(plan)
    hint = did_you_mean(target, names, n=3, substring=True) or "."
    return (f"unknown target {target!r}{hint} Targets are a gradient tensor name, bucket:N, "
            "stage:K, rank:R or linear:NAME of an unevenly split TP linear (`hetplan "
            "inspect` lists them)")


# -- text --------------------------------------------------------------------------------
def _verdict(ctx: _Context, alternatives: list[Alternative], kind: Kind) -> str:
    if not alternatives:
        return ("no alternative plan is evaluated for a rank; compare it with the slowest "
                "rank above" if kind == "rank" else "no alternative applies here")
    fits = [a for a in alternatives if a.fits_memory]
    if ctx.current_note:  # an edited plan that no longer fits: no choice of it is "feasible"
        return ("the plan as written does not fit in memory (note above), "
                + (f"and neither does any of the {len(alternatives)} alternative(s)"
                   if not fits else f"but '{min(fits, key=lambda a: a.iteration_time_ms).name}'"
                   " does") + ": undo the edit or re-run `hetplan plan`")
    if not fits:
        return "every alternative runs out of memory: the plan's choice is the only feasible one"
    best = min(fits, key=lambda a: a.iteration_time_ms)
    if best.delta_ms < 0:
        return (f"'{best.name}' is predicted {-best.delta_ms:.3f} ms faster: the plan's choice "
                "is not the fastest of the options considered")
    if best.delta_ms == 0:
        return f"'{best.name}' is predicted as fast: the plan's choice is tied"
    return (f"the plan's choice is the fastest of the {len(alternatives) + 1} options "
            f"considered (the next best, '{best.name}', is {best.delta_ms:.3f} ms slower)")


def _text(target: str, ctx: _Context, facts: list[tuple[str, str]],
          alternatives: list[Alternative], verdict: str) -> str:
    width = max((len(k) for k, _ in facts), default=0)
    lines = [f"explain {target}"]
    lines += [f"  {k.ljust(width)}  {v}" for k, v in facts]
    stored = ctx.plan.predictions.iteration_time_ms if ctx.plan.predictions else None
    lines.append(f"predicted iteration time as planned: {fmt_ms(ctx.current_ms)}")
    if stored is not None and abs(stored - ctx.current_ms) > 1e-6:
        why = f"; {ctx.profile_note}" if ctx.profile_note else ""
        lines.append(f"  (the plan file says {fmt_ms(stored)}{why})")
    if ctx.current_note:
        lines.append(f"  note: as planned it does not fit in memory: {ctx.current_note}")
    if alternatives:
        lines.append("alternatives, re-evaluated with the plan's cost model:")
        for a in alternatives:
            tail = "" if a.fits_memory else "  [does not fit in memory]"
            lines.append(f"  {a.name}: {fmt_ms(a.iteration_time_ms)} "
                         f"({fmt_delta_ms(a.delta_ms)}){tail}")
            if a.note:
                lines.append(f"    {a.note}")
    lines.append(f"verdict: {verdict}")
    return "\n".join(lines) + "\n"
