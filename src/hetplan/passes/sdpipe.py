"""Pass ``sdpipe``: whether the pipeline replicas synchronise in groups (SDPipe) or all
together, and SDPipe's settings.

Owns ``plan.group_sync``. It adapts the plan to the replica simulator
(:func:`hetplan.cost_models.group_sync.replica_mesh`), simulates ``iterations`` iterations of
synchronous all-reduce, SDPipe group sync and AD-PSGD gossip with the same seeded straggler
delays (the cluster spec's ``stragglers`` model), and writes the section:

- ``mode=auto``: policy ``sdpipe`` only when its simulated iterations per second beat
  all-reduce's by more than ``min-speedup`` (1.0 by default), else ``allreduce``;
- ``mode=sdpipe``: policy ``sdpipe`` whenever the layout allows it.

The layout allows it with two or more pipelines (dp ≥ 2), one TP rank per stage replica
(tp = 1), no interleaved stages and no ZeRO sharding (each replica steps its own optimizer
on its whole stage), and the sections written before this pass with no re-balancing, TP
section or sparse gradient sync (the runtime composes none of them with group sync);
otherwise the section says why it stays ``allreduce``.

P (the connectivity window, in groups) stays the user's setting, default 10 (the paper's):
the convergence bound's constants are vacuous for realistic N·P
(:func:`hetplan.algorithms.sdpipe.theorem_constants`), so P is not derived from them. T
defaults to the paper's 1/N of the slowest replica's iteration time.

Complexity: three simulations of O(M·N·K·log(M·N)) events (each SDPipe event O(P·N)).
Deterministic for a given ``ctx.seed``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from hetplan.algorithms.sdpipe import AdaptiveWindow, SchedulerConfig, communicator_count
from hetplan.cost_models.group_sync import predict_policies, replica_mesh, steady_iteration_s
from hetplan.errors import SpecError
from hetplan.ir.plan import Plan
from hetplan.ir.plan_group_sync import GroupSync, GroupSyncPrediction, StragglerModelRef
from hetplan.ir.plan_sections import Layout
from hetplan.passes.base import PassContext, PassResult

__all__ = ["SDPipe", "MAX_PREBUILT_PIPELINES"]

#: Up to this many pipelines every group is a process group built at start-up
#: (2^N - N - 1 per stage: 57 for N = 6); above it groups are built by their members on
#: first use.
MAX_PREBUILT_PIPELINES = 6


@dataclass(frozen=True)
class SDPipe:
    """SDPipe group synchronisation of pipeline replicas (see the module docstring).

    Options:
        mode: ``auto`` (only when predicted faster) or ``sdpipe`` (whenever possible).
        p: connectivity window P in committed groups (≥ 1; 1 is all-reduce).
        window_ms: the window T; None: 1/N of the slowest replica's iteration time.
        adaptive: adapt T per worker (×2 after a group of one, ×0.9 otherwise, within
            [T/100, 10·T]).
        iterations: K, simulated iterations per pipeline.
        min_speedup: in ``auto`` mode, the least simulated speedup that selects SDPipe.
        optimizer_state: ``local`` or ``adam-correction`` (SDPipe's rescaled second moment).
        final_full_average: average every stage's replicas once when training ends.
    """

    name: ClassVar[str] = "sdpipe"
    sections: ClassVar[tuple[str, ...]] = ("group_sync",)
    refines: ClassVar[bool] = True

    mode: Literal["auto", "sdpipe"] = "auto"
    p: int = 10
    window_ms: float | None = None
    adaptive: bool = False
    iterations: int = 200
    min_speedup: float = 1.0
    optimizer_state: Literal["local", "adam-correction"] = "local"
    final_full_average: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.p <= 1_000_000:
            raise SpecError(f"sdpipe{{p={self.p}}}: the connectivity window must be in "
                            "1..1000000 (1 means every group is all replicas); the paper "
                            "uses 10")
        if self.window_ms is not None and not 0 <= self.window_ms < 1e9:
            raise SpecError(f"sdpipe{{window-ms={self.window_ms}}}: must be >= 0 ms, or "
                            "none for 1/N of the iteration time")
        if not 1 <= self.iterations <= 100_000:
            raise SpecError(f"sdpipe{{iterations={self.iterations}}}: simulate 1..100000 "
                            "iterations (200 is the default)")
        if not 0 < self.min_speedup < 1e6:
            raise SpecError(f"sdpipe{{min-speedup={self.min_speedup}}}: must be > 0")

    def run(self, plan: Plan, ctx: PassContext) -> PassResult:
        lay = ctx.layout
        base = dict(requested=self.mode, num_stages=lay.pp, num_pipelines=lay.dp, p=self.p,
                    window_adapt="adaptive" if self.adaptive else "fixed",
                    optimizer_state=self.optimizer_state,
                    final_full_average=self.final_full_average, iterations=self.iterations,
                    seed=ctx.seed)
        blocker = (_blocker(lay.dp, lay.tp, lay.virtual_stages, lay.zero_stage)
                   or _chimera_blocker(lay) or _section_blocker(plan))
        if blocker:
            section = GroupSync(policy="allreduce", reason=blocker, **base)  # type: ignore[arg-type]
            return PassResult(plan.model_copy(update={"group_sync": section}), True,
                              (f"group sync off: {blocker}",))
        mesh = replica_mesh(ctx.workload, lay, plan.stages, ctx.costs)
        window_s = (self.window_ms * 1e-3 if self.window_ms is not None
                    else steady_iteration_s(mesh) / lay.dp)
        adaptive = (AdaptiveWindow(start_s=window_s, lo_s=window_s / 100, hi_s=window_s * 10)
                    if self.adaptive and window_s > 0 else None)
        config = SchedulerConfig(num_stages=lay.pp, num_pipelines=lay.dp, p=self.p,
                                 window_s=window_s, adaptive=adaptive)
        results = predict_policies(mesh, config, self.iterations, ctx.seed)
        ar, sd = results["allreduce"], results["sdpipe"]
        speedup = sd.iters_per_s / ar.iters_per_s if ar.iters_per_s > 0 else 1.0
        faster = speedup > self.min_speedup
        policy = "sdpipe" if self.mode == "sdpipe" or faster else "allreduce"
        verdict = (f"SDPipe {sd.iters_per_s:.3f} it/s vs all-reduce {ar.iters_per_s:.3f} it/s "
                   f"({speedup:.2f}x) over {self.iterations} simulated iterations")
        if self.mode == "auto":
            reason = verdict + ("; faster" if faster else
                                f"; not above the {self.min_speedup:g}x needed, kept all-reduce")
        else:
            reason = verdict + "; requested"
        prob, delay = max(((p, d) for rp, rd in zip(mesh.straggle_prob, mesh.straggle_delay_s)
                           for p, d in zip(rp, rd)), key=lambda x: x[0] * x[1])
        section = GroupSync(
            policy=policy,  # type: ignore[arg-type]
            window_ms=window_s * 1e3,
            communicator="prebuilt" if lay.dp <= MAX_PREBUILT_PIPELINES else "lazy",
            stragglers=StragglerModelRef(probability=prob, delay_ms=delay * 1e3),
            predictions=tuple(
                GroupSyncPrediction(policy=name, iters_per_s=r.iters_per_s,  # type: ignore[arg-type]
                                    mean_group_size=r.mean_group_size, lock_skips=r.lock_skips)
                for name, r in results.items()),
            speedup=speedup,
            reason=reason,
            **base,  # type: ignore[arg-type]
        )
        groups = communicator_count(lay.dp) * lay.pp
        note = (f"policy {policy}: {reason}; P={self.p}, T={window_s * 1e3:.3f} ms, "
                f"{section.communicator} communicators ({groups} group(s) of >= 2)")
        return PassResult(plan.model_copy(update={"group_sync": section}), True, (note,))


def _section_blocker(plan: Plan) -> str:
    """Why the plan's sections written before this pass rule group sync out ('' when none
    does): the runtime does not compose it with re-balancing, a TP resizing controller that
    is on or sparse gradient sync (the checks of ``runtime.composition``, which passes cannot
    import; docs/decisions/runtime-composition.md)."""
    if plan.rebalancing is not None:
        return ("the plan re-balances a dynamic model (--dynamics); group sync averages "
                "replicas of fixed stages")
    if plan.tensor_parallel is not None and plan.tensor_parallel.controller.variant != "off":
        return "the plan turns a TP resizing controller on; group sync needs tp=1"
    if plan.sparse_sync is not None and plan.sparse_sync.synced():
        return ("the plan syncs sparse gradients (--sparse); group sync averages dense "
                "replicas")
    return ""


def _chimera_blocker(lay: Layout) -> str:
    """Why a Chimera layout cannot run group sync ('' for any other schedule)."""
    if lay.schedule == "chimera" and lay.pp > 1:
        return ("schedule 'chimera': a Chimera rank holds stages of two pipeline replicas, "
                "and group sync averages each replica's stages apart")
    return ""


def _blocker(dp: int, tp: int, virtual_stages: int, zero_stage: int) -> str:
    """Why the layout cannot run group sync ('' when it can)."""
    if dp < 2:
        return "one pipeline (dp=1): no replicas to group"
    if tp > 1:
        return (f"tp={tp}: group sync averages whole stage replicas; the runtime composes it "
                "with tp=1 only")
    if virtual_stages > 1:
        return "interleaved stages: group sync needs one stage per pipeline rank"
    if zero_stage > 0:
        return (f"zero_stage={zero_stage} shards the optimizer across replicas; group sync "
                "steps each replica's optimizer locally (pin zero_stage=0)")
    return ""
