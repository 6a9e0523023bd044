"""Pass ``tp-resizing``: heterogeneous tensor parallelism (ZERO-resizing / SEMI-migration).

Refines ``plan.tensor_parallel`` (filled by ``even-tp``), per TP group
(``research/zero_resizing.md`` §6):

1. **Static skewed shards.** Every Megatron pair of the group's stage (column linears
   feeding one row linear, in the same module, ``out_features`` of the columns = the row's
   ``in_features``) gets per-rank shard sizes proportional to the ranks' speed on that
   stage (:func:`~hetplan.algorithms.skewed_shards.proportional_shards`; a pair's linears
   share one size list, as the runtime requires). A rank's speed is the inverse of the
   stage's TP-layer compute time (forward + backward) on its device in the project's
   compute model, so profiled times enter when there are any. A group whose sizes come out
   even lists no linears (the even default), so homogeneous plans do not change.
   **Attention pairs** (separate q/k/v → output projection: HF Llama-2, OPT, ViT) are cut in
   whole heads (:func:`pair_shards`): the unit is the ``split_unit`` capture records on
   their linears (``head_dim``; with grouped-query attention a whole group's query features,
   ``heads // kv_heads · head_dim``), their least common multiple where a pair's linears
   differ, and every rank gets at least one unit (a rank with no head would make the
   runtime keep that attention replicated). Where that cannot be done — fewer units than
   ranks, or features not a multiple of the unit — the pair keeps even shards (not listed;
   the runtime splits its heads evenly) and a note counts such pairs. MLP pairs (no unit)
   use :func:`~hetplan.algorithms.skewed_shards.shard_granularity`'s power-of-two columns.
2. **Controller settings** (``ResizingController``): the variant, α, θ_iter, the re-plan
   trigger, γ_max, the straggler criterion (``avg`` for ZERO, ``min`` for SEMI and
   migration, §3.3), its tolerance and the receivers.
3. **Initial roles** for the plan's own shards: the controller's rule on the predicted
   per-rank times — a rank whose time exceeds ``(1 + eps) · T_ref`` is a straggler with
   Eq. (1) γ = (T_i − T_ref) / M_i clamped to [0, γ_max], T_ref the mean or minimum. T_i =
   M_i = the rank's compute of its share of the TP layers per micro-batch: every TP layer
   ends in an all-reduce, so time a slow device loses in replicated layers (embeddings, the
   LM head) cannot be won back by pruning its TP matmuls (they would only wait longer at the
   next all-reduce); counting it, as a literal whole-iteration T_i would, over-prunes
   (a runtime controller measuring whole iterations sees more). ZERO and SEMI stragglers start
   as ``resize`` (β = 0: Eq. (2) needs the runtime's measured Ω/Φ costs, so the runtime's
   Algorithm 2 decides migration); the ``migration`` variant makes them ``migrate_src``
   (β = 1) and the other ranks ``migrate_dst``. With static skew the residual imbalance is at
   most one shard unit, so the roles it leaves are small (e.g. γ ≈ 0.05 on the V100s of
   ``mixed-tp-node``): the controller is mainly for dynamic stragglers. Roles predicted to slow
   the plan down (migration onto slower receivers: Eq. (1) sizes the migrated work by the
   sender alone) are dropped: every rank starts normal.
4. **Predicted effect** (``TensorParallel.predicted``), all with the project's simulator
   (:func:`~hetplan.cost_models.evaluate.evaluate` with the TP section): even shards; the
   plan's skewed shards; even shards with the expected γ of the controller (Eq. (1) with
   the criterion of the variant; ``avg`` when the variant is ``off``). The skewed shards are
   kept only when predicted no slower than even shards. When every group's devices are
   identical nothing is simulated and ``predicted`` stays None (even shards, no straggler):
   layout search on homogeneous clusters costs what it did before.

Decisions (also in ``docs/decisions.md``, "TP resizing pass"): the controller is **opt-in**
(``controller="off"`` by default): resizing prunes computation and changes convergence, like
lossy gradient compression, which is also opt-in; static skew is lossless and always on.
Under ZeRO >= 1 with ``dp > 1`` the controller is not turned on (a note says so): it resizes
the shards the optimizer state is cut from, which the runtime does not re-cut.
Attention pairs are skewed in whole heads (groups), not in 64-column units: the runtime
splits attention by heads and would run a split inside a head replicated, unlike the
prediction. Fused QKV modules (GPT-2's ``c_attn``, 3·width outputs) and grouped-query
attention (k/v narrower than the output projection's input) are not Megatron pairs
(:func:`~hetplan.ir.model.megatron_pairs`), so they are not listed and the runtime splits
their heads evenly. The memory model gives each rank its
share of the split parameters and activations; skewed shards that overflow a fast rank's
memory while even ones fit are dropped. Complexity O(groups · linears · ranks) plus four
simulations when a group is heterogeneous.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

from hetplan.algorithms.skewed_shards import even_shards, proportional_shards
from hetplan.algorithms.zero_resizing import zero_decision
from hetplan.cost_models.evaluate import evaluate
from hetplan.cost_models.tp_shares import rank_shares
from hetplan.errors import InfeasiblePlanError, SpecError
from hetplan.ir.fields import MAX_MS
from hetplan.ir.model import LinearInfo, megatron_pairs
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import (
    ResizingController,
    TensorParallel,
    TPGroup,
    TPLinearShard,
    TPPrediction,
    TPRankRole,
)
from hetplan.passes.base import PassContext, PassResult

__all__ = ["TPResizing", "expected_gammas", "pair_shards", "rank_speeds"]

Variant = Literal["off", "zero", "migration", "semi"]


def rank_speeds(ctx: PassContext, ranks: tuple[int, ...], first: int, last: int) -> list[float]:
    """Speed of every rank on the TP layers ``first..last``: 1 / their forward + backward
    time on its device (layers without pairs count when the stage has no TP layer)."""
    mb = ctx.layout.micro_batch_size
    layers = ctx.workload.layers[first:last + 1]
    tp_layers = [k for k, lay in enumerate(layers) if lay.tp_pairs] or list(range(len(layers)))
    out = []
    for r in ranks:
        times = ctx.costs.compute.layer_times(ctx.workload, ctx.costs.devices[r], mb)
        t = sum(times[first + k].fwd_s + times[first + k].bwd_s for k in tp_layers)
        out.append(1.0 / t if t > 0 else 1.0)
    return out


def expected_gammas(ctx: PassContext, group: TPGroup, first: int, last: int,
                    criterion: Literal["avg", "min"], eps: float,
                    gamma_max: float) -> dict[int, float]:
    """Eq. (1) per straggler of ``group`` on its current shards (see module docstring):
    ``{global rank: γ}`` for ranks with ``T_i > (1 + eps) · T_ref``."""
    mb = ctx.layout.micro_batch_size
    layers = ctx.workload.layers[first:last + 1]
    plain = group.model_copy(update={"roles": ()})
    shares = rank_shares(ctx.workload, plain, first, last)
    t_all, m_all = [], []
    for i, r in enumerate(group.ranks):
        times = ctx.costs.compute.layer_times(ctx.workload, ctx.costs.devices[r], mb)
        t = sum((times[first + k].fwd_s + times[first + k].bwd_s) * shares[k][i]
                for k, lay in enumerate(layers) if lay.tp_pairs)
        t_all.append(t)
        m_all.append(t)  # T_i = M_i: only the TP layers count (see module docstring)
    # a rank without TP work (an empty shard) is no reference: its T of 0 would make every
    # other rank a straggler under T_min and halve T_avg
    busy = [i for i, t in enumerate(t_all) if t > 0]
    if len(busy) < 2:
        return {}
    decisions = zero_decision([t_all[i] for i in busy], [m_all[i] for i in busy], gamma_max,
                              criterion, eps)
    return {group.ranks[i]: d.resize for i, d in zip(busy, decisions) if d.resize > 0}


@dataclass(frozen=True)
class TPResizing:
    """Skewed TP shards by device speed, controller settings and their predicted effect.

    Attributes:
        controller: the runtime controller variant (``off``: static shards only; opt-in
            ``zero``, ``migration``, ``semi``).
        gamma_max: upper bound on a rank's pruning ratio, in [0, 1).
        criterion: straggler criterion; None: ``min`` for ``semi``/``migration``, else ``avg``.
        straggler_eps: relative tolerance of the criterion.
        receivers: ``all`` other ranks take migrated work, or ``normal`` ones only.
        alpha / theta_iter / replan_trigger: the controller's hyper-parameters (paper: 0.8,
            1e-3, 10 %).
    """

    name: ClassVar[str] = "tp-resizing"
    sections: ClassVar[tuple[str, ...]] = ("tensor_parallel",)
    refines: ClassVar[bool] = False
    controller: Variant = "off"
    gamma_max: float = 0.9
    criterion: Literal["avg", "min"] | None = None
    straggler_eps: float = 0.05
    receivers: Literal["all", "normal"] = "all"
    alpha: float = 0.8
    theta_iter: float = 1e-3
    replan_trigger: float = 0.10

    def __post_init__(self) -> None:
        if self.controller not in ("off", "zero", "migration", "semi"):
            raise SpecError(f"tp-resizing: unknown controller {self.controller!r}; use "
                            "off, zero, migration or semi")
        if not 0 <= self.gamma_max < 1:
            why = (" (a rank pruning every column would compute nothing)"
                   if self.gamma_max >= 1 else " (a pruning ratio: the share of columns cut)")
            raise SpecError(f"tp-resizing: gamma_max must be in [0, 1), got {self.gamma_max}"
                            + why)
        if not 0 <= self.alpha <= 1:  # nan too
            raise SpecError(f"tp-resizing: alpha must be in [0, 1], got {self.alpha} "
                            "(PriDiff's decay factor; the paper's is 0.8)")
        for option, value in (("straggler_eps", self.straggler_eps),
                              ("theta_iter", self.theta_iter),
                              ("replan_trigger", self.replan_trigger)):
            if not 0 <= value <= MAX_MS:  # nan and inf too
                raise SpecError(f"tp-resizing: {option} must be a finite number >= 0, got "
                                f"{value}")

    def settings(self) -> ResizingController:
        """The controller settings this pass writes."""
        crit = self.criterion or ("min" if self.controller in ("semi", "migration") else "avg")
        return ResizingController(
            variant=self.controller, alpha=self.alpha, theta_iter=self.theta_iter,
            replan_trigger=self.replan_trigger, gamma_max=self.gamma_max, criterion=crit,
            straggler_eps=self.straggler_eps, receivers=self.receivers)

    def initial_roles(self, g: TPGroup, gammas: dict[int, float]) -> tuple[TPRankRole, ...]:
        """The controller's initial roles in group ``g`` for the stragglers' Eq. (1) γ
        ``gammas`` (``()`` when there is none); the per-stage run on a heterogeneous plan
        (:mod:`hetplan.passes._hetero_tp`) uses it as :meth:`run` does."""
        return self._roles(g, gammas, self.settings())

    def run(self, plan: Plan, ctx: PassContext) -> PassResult:
        tp = plan.tensor_parallel
        if tp is None or not tp.groups:
            return PassResult(plan, False, ("no tensor parallelism",))
        lay = ctx.layout
        if self.controller != "off" and lay.dp > 1 and lay.zero_stage >= 1:
            # the controller resizes the shards ZeRO cuts the optimizer state from, and the
            # runtime does not re-cut it (docs/decisions/runtime-composition.md)
            res = dataclasses.replace(self, controller="off").run(plan, ctx)
            note = (f"controller {self.controller} not turned on: ZeRO-{lay.zero_stage} "
                    f"shards the optimizer state across the dp={lay.dp} replicas from the TP "
                    "shards the controller resizes (the controller needs zero_stage 0)")
            return dataclasses.replace(res, notes=(note, *res.notes))
        if ctx.model_ir is None:
            return PassResult(plan, False, (("no model IR in the pass context: linears "
                                             "unknown, shards stay even"),))
        _check_groups(tp, len(ctx.costs.devices), ctx.cluster.name)
        ctl = self.settings()
        devs = ctx.costs.devices
        if all(len({(devs[r].type, devs[r].slowdown, devs[r].relative_speed)
                    for r in g.ranks}) == 1 for g in tp.groups):
            # identical devices in every group: even shards, no straggler, nothing to predict
            # (skipping the simulations keeps layout search on homogeneous clusters as fast)
            out = tp.model_copy(update={"controller": ctl})
            return PassResult(plan.model_copy(update={"tensor_parallel": out}), out != tp,
                              (f"{len(tp.groups)} homogeneous TP group(s): even shards",))
        even_heads: list[str] = []
        groups = tuple(self._group(g, plan, ctx, ctl, even_heads) for g in tp.groups)
        skewed = tp.model_copy(update={"groups": groups, "controller": ctl})
        even = TensorParallel(groups=tuple(g.model_copy(update={"linears": (), "roles": ()})
                                           for g in tp.groups), controller=ctl)
        even_ms, even_fits = self._simulate_checked(plan, ctx, even)
        any_skew = any(g.linears for g in groups)
        skewed_ms, skew_fits = (self._simulate_checked(plan, ctx, skewed) if any_skew
                                else (even_ms, even_fits))
        notes = []
        if even_heads:
            rows = sorted(set(even_heads))
            notes.append(f"{len(rows)} attention module(s) not skewed: too few whole heads "
                         f"(key/value groups) to give every rank one (e.g. {rows[0]}); they "
                         "run replicated (even-tp's note)")
        if not skew_fits and even_fits:
            notes.append("skewed shards do not fit in the faster ranks' memory; kept even "
                         "shards")
            skewed, skewed_ms = even, even_ms
        if skewed_ms > even_ms and (even_fits or not skew_fits):
            notes.append(f"skewed shards predicted slower ({skewed_ms:.3f} > {even_ms:.3f} "
                         "ms); kept even shards")
            skewed, skewed_ms = even, even_ms
        ctl_section, gammas = self._controller_effect(even, plan, ctx, ctl)
        # no expected straggler: the section is the even one (same simulation, not re-run)
        ctl_ms = self._simulate(plan, ctx, ctl_section) if gammas else even_ms
        pred = TPPrediction(even_ms=even_ms, skewed_ms=skewed_ms, controller_ms=ctl_ms,
                            expected_gamma={str(r): g for r, g in sorted(gammas.items())})
        out = skewed.model_copy(update={"predicted": pred})
        if ctl.variant != "off":
            roled = self._with_roles(out, plan, ctx, ctl)
            if roled != out:
                roled_ms = self._simulate(plan, ctx, roled)
                if roled_ms <= skewed_ms:
                    out = roled
                else:
                    notes.append(f"initial {ctl.variant} roles predicted slower ({roled_ms:.3f} "
                                 f"> {skewed_ms:.3f} ms: migrated work lands on slower "
                                 "ranks); every rank starts normal")
        uneven = sum(1 for g in out.groups if g.linears)
        notes.append(f"{uneven}/{len(out.groups)} group(s) with skewed shards; predicted "
                     f"{even_ms:.3f} ms even, {skewed_ms:.3f} ms skewed, {ctl_ms:.3f} ms even "
                     f"+ controller ({ctl.criterion})")
        return PassResult(plan.model_copy(update={"tensor_parallel": out}), True, tuple(notes))

    # -- helpers ---------------------------------------------------------------------------
    def _group(self, g: TPGroup, plan: Plan, ctx: PassContext, ctl: ResizingController,
               even_heads: list[str]) -> TPGroup:
        """``g`` with skewed shards for every pair of its stage; appends to ``even_heads``
        the row linear of each attention pair whose heads cannot be skewed."""
        first, last = _stage_layers(plan, ctx, g)
        speeds = rank_speeds(ctx, g.ranks, first, last)
        names = {lay.name for lay in ctx.model_ir.layers[first:last + 1]}  # type: ignore[union-attr]
        linears = [lin for lay in ctx.model_ir.layers  # type: ignore[union-attr]
                   if lay.name in names for lin in lay.linears]
        shards: list[TPLinearShard] = []
        for cols, row in megatron_pairs(linears)[0]:
            sizes = pair_shards(cols, row, speeds)
            if sizes is None:
                even_heads.append(row.name)
                continue
            if sizes == even_shards(row.in_features, len(sizes)):
                continue
            shards += [TPLinearShard(name=c.name, split="column", features=c.out_features,
                                     shard_sizes=sizes) for c in cols]
            shards.append(TPLinearShard(name=row.name, split="row", features=row.in_features,
                                        shard_sizes=sizes))
        return g.model_copy(update={"linears": tuple(shards), "roles": ()})

    def _with_roles(self, section: TensorParallel, plan: Plan, ctx: PassContext,
                    ctl: ResizingController) -> TensorParallel:
        """``section`` with the controller's initial roles on its own shards."""
        groups = []
        for g in section.groups:
            first, last = _stage_layers(plan, ctx, g)
            gammas = expected_gammas(ctx, g, first, last, ctl.criterion, ctl.straggler_eps,
                                     ctl.gamma_max)
            groups.append(g.model_copy(update={"roles": self._roles(g, gammas, ctl)}))
        return section.model_copy(update={"groups": tuple(groups)})

    def _roles(self, g: TPGroup, gammas: dict[int, float],
               ctl: ResizingController) -> tuple[TPRankRole, ...]:
        if not gammas:
            return ()
        if ctl.variant == "migration":
            return tuple(TPRankRole(rank=r, role="migrate_src", gamma=gammas[r], beta=1.0)
                         if r in gammas else TPRankRole(rank=r, role="migrate_dst")
                         for r in g.ranks)
        return tuple(TPRankRole(rank=r, role="resize", gamma=gammas[r]) if r in gammas
                     else TPRankRole(rank=r) for r in g.ranks)

    def _controller_effect(self, even: TensorParallel, plan: Plan, ctx: PassContext,
                           ctl: ResizingController) -> tuple[TensorParallel, dict[int, float]]:
        """Even shards with the controller's roles for every straggler's Eq. (1) γ (resizing;
        for the ``migration`` variant, migrating it to the other ranks)."""
        all_g: dict[int, float] = {}
        groups = []
        for g in even.groups:
            first, last = _stage_layers(plan, ctx, g)
            gam = expected_gammas(ctx, g, first, last, ctl.criterion, ctl.straggler_eps,
                                  ctl.gamma_max)
            all_g.update(gam)
            groups.append(g.model_copy(update={"roles": self._roles(g, gam, ctl)}))
        return even.model_copy(update={"groups": tuple(groups)}), all_g

    @staticmethod
    def _simulate_checked(plan: Plan, ctx: PassContext,
                          section: TensorParallel) -> tuple[float, bool]:
        """(iteration ms, whether every rank fits in memory) with ``section``."""
        try:
            ev = evaluate(ctx.workload, ctx.layout, plan.stages, plan.gradient_sync,
                          ctx.costs, tensor_parallel=section)
        except InfeasiblePlanError:
            return TPResizing._simulate(plan, ctx, section), False
        return ev.iteration_s * 1e3, True

    @staticmethod
    def _simulate(plan: Plan, ctx: PassContext, section: TensorParallel) -> float:
        ev = evaluate(ctx.workload, ctx.layout, plan.stages, plan.gradient_sync, ctx.costs,
                      check_memory=False, tensor_parallel=section)
        return ev.iteration_s * 1e3


def pair_shards(cols: Sequence[LinearInfo], row: LinearInfo,
                speeds: Sequence[float]) -> tuple[int, ...] | None:
    """Skewed shard sizes of one Megatron pair (see the module docstring): proportional to
    ``speeds`` in 64-column-or-smaller units, or, for an attention pair (a linear with a
    ``split_unit``), in whole heads (groups) with at least one per rank; None where an
    attention pair cannot be skewed so: fewer units than ranks (the runtime then keeps the
    attention whole on every rank, :func:`~hetplan.passes.even_tp.unsplit_attention`), or
    features not a multiple of the unit (only a hand-written workload file can say so)."""
    units = [lin.split_unit for lin in (*cols, row) if lin.split_unit is not None]
    if not units:
        return proportional_shards(row.in_features, speeds)
    unit = math.lcm(*units)
    if row.in_features % unit or row.in_features // unit < len(speeds):
        return None
    return proportional_shards(row.in_features, speeds, unit, min_units=1)


def _stage_layers(plan: Plan, ctx: PassContext, g: TPGroup) -> tuple[int, int]:
    """The layer range of the stage the group belongs to."""
    if not plan.stages:
        return 0, len(ctx.workload.layers) - 1
    for st in plan.stages:
        if (g.stage is not None and st.index == g.stage) or (
                g.stage is None and set(g.ranks) <= set(st.ranks)):
            return st.first_layer, st.last_layer
    raise SpecError(f"TP group {list(g.ranks)} (stage {g.stage}) matches no pipeline stage of "
                    f"the plan ({len(plan.stages)} stages); re-run the even-tp pass")


def _check_groups(tp: TensorParallel, world: int, cluster: str) -> None:
    """Every rank of every group must be a device of the cluster."""
    for g in tp.groups:
        missing = [r for r in g.ranks if not 0 <= r < world]
        if missing:
            raise SpecError(
                f"TP group {list(g.ranks)} names ranks {missing}, which cluster {cluster!r} "
                f"(world size {world}) does not have; plan for this cluster or fix the group")
