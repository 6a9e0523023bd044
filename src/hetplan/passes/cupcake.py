"""Pass ``cupcake-fusion``: optimal fusion of consecutive gradients into buckets (thesis ch. 5).

Owns ``plan.gradient_sync.buckets``. For every pipeline stage's data-parallel group, the
stage's gradients are taken in backward-ready order and partitioned into contiguous buckets;
each bucket is one sync unit (one compression, one communication path, one decompression) of
the strategy its tensors share. The partition minimises the stage's simulated DP timeline
(:func:`~hetplan.cost_models.evaluate.evaluate`'s ops and backprop segments, so the pass and
the simulator never disagree), solved by :func:`hetplan.algorithms.fusion.pareto_dp`.

Strategies come from the incoming section: ``gradient_sync.tensors`` (the Espresso pass, which
runs before this one), else the strategy of each tensor's incoming bucket (DDP buckets: fp32),
else the flat fp32 allreduce. Only tensors sharing a strategy are fused (a bucket has one
strategy); the tensors' strategies are kept unchanged.

Decisions (also in ``docs/decisions.md``):

- **Exact where the simulator is a tandem.** When every bucket's ops are compute-stream ops
  followed by ops on distinct FIFO channels in one order (fp32/fp16 allreduce, GPU
  compression + one collective, CPU (de)compression), the DP's recurrence *is* the
  simulator, and the result is optimal (property-tested against brute force). Otherwise (a
  decompression back on the compute stream after the collective, a channel used twice as in
  reduce-scatter + allgather, different channel orders for different strategies) the DP
  optimises a surrogate — every compute-stream op counted before the collective (the
  thesis's own model, §F-2 option (a)), all channel work as one channel — and the note
  says ``surrogate``; the result is still scored with the real simulator.
- **Never slower than what it was given.** The fused section is scored with ``evaluate``
  against the incoming one (DDP's 25 MiB buckets, or Espresso's unfused per-tensor sync) and
  the faster is kept (ties keep the incoming one), with a note.
- **Ties** between partitions: fewer buckets (the solver's tie rule, then neighbouring
  buckets are merged wherever the predicted time does not grow).
- Bucket ``size_bytes`` is the full (unsharded) fp32 gradient bytes of its tensors.

Complexity per stage: O(N²) group-cost evaluations plus the DP (about O(N² · F) for Pareto
fronts of F states); ResNet-101's 314 tensors take tens of milliseconds (``bench/fusion.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from hetplan.algorithms.dp_types import GPU, Op
from hetplan.algorithms.fusion import Fusion, pareto_dp_table
from hetplan.cost_models.evaluate import StageSync, evaluate, stage_syncs
from hetplan.errors import SpecError
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import Bucket, GradientSync, NoSync, SyncStrategy, WorkloadSummary
from hetplan.passes.base import PassContext, PassResult

__all__ = ["CupcakeFusion", "tensor_strategies", "stage_fusion", "group_cost_tables",
           "tandem_shape"]

FP32 = "fp32"


def tensor_strategies(
    workload: WorkloadSummary, sync: GradientSync | None
) -> tuple[dict[str, SyncStrategy], dict[str, str]]:
    """(strategies, tensor name → strategy key) from the incoming gradient-sync section.

    Per-tensor assignments win, then the tensor's bucket, then the flat fp32 allreduce
    (added as ``fp32`` when missing)."""
    strategies: dict[str, SyncStrategy] = dict(sync.strategies) if sync else {}
    key: dict[str, str] = {}
    if sync is not None:
        for b in sync.buckets:
            for t in b.tensors:
                key[t] = b.strategy
        for ts in sync.tensors:
            key[ts.name] = ts.strategy
    for g in workload.grads:
        if g.name not in key:
            key[g.name] = FP32
            strategies.setdefault(FP32, NoSync())
    return strategies, key


def tandem_shape(ops: tuple[Op, ...]) -> tuple[str, ...] | None:
    """The channel sequence of ``ops`` if they are compute-stream ops followed by ops on
    distinct non-compute channels (the simulator is then the tandem recurrence), else None."""
    k = 0
    while k < len(ops) and ops[k].resource == GPU:
        k += 1
    rest = tuple(op.resource for op in ops[k:])
    if GPU in rest or len(set(rest)) != len(rest):
        return None
    return rest


def stage_fusion(
    ss: StageSync, keys: list[str], strategies: dict[str, SyncStrategy], ctx: PassContext,
    *, max_group: int | None = None,
) -> tuple[Fusion, bool]:
    """Optimal buckets of one stage's gradients; returns (fusion, exact) where ``exact`` says
    the DP objective was the simulator itself (tandem ops), not the surrogate."""
    pre, chain, exact = group_cost_tables(ss, keys, strategies, ctx, max_group=max_group)
    return pareto_dp_table(ss.backprop_s, pre, chain), exact


def _runs(keys: list[str]) -> list[tuple[int, int]]:
    """Maximal ranges ``[a, b)`` of consecutive tensors with one strategy key."""
    runs, a = [], 0
    for i in range(1, len(keys) + 1):
        if i == len(keys) or keys[i] != keys[a]:
            runs.append((a, i))
            a = i
    return runs


def group_cost_tables(
    ss: StageSync, keys: list[str], strategies: dict[str, SyncStrategy], ctx: PassContext,
    *, max_group: int | None = None,
) -> tuple[np.ndarray, np.ndarray, bool]:
    """The DP's cost of every allowed bucket ``(i, j)`` of one stage: ``(pre, chain,
    exact)`` as :func:`~hetplan.algorithms.fusion.pareto_dp_table` takes them (``inf``
    where the tensors do not share a strategy or the bucket is longer than ``max_group``).

    A bucket's ops are those of :meth:`StageSync.ops` for its bytes, computed for all
    buckets of a strategy at once (:meth:`StageSync.ops_table`, bit-identical). ``exact``:
    every strategy's ops have the same tandem shape, so ``pre`` is the compute-stream ops and
    ``chain`` the channel ops in order; otherwise the surrogate (module docstring): ``pre``
    is every compute-stream op and ``chain`` one channel with all other work.
    """
    n = len(ss.grads)
    prefix = [0.0]
    for b in ss.nbytes:
        prefix.append(prefix[-1] + b)
    cum = np.asarray(prefix)
    pairs: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for a, b in _runs(keys):
        ii, jj = np.triu_indices(b - a)
        if max_group is not None:
            short = jj - ii < max_group
            ii, jj = ii[short], jj[short]
        pairs.setdefault(keys[a], []).append((ii + a, jj + a))
    tables: list[tuple[np.ndarray, np.ndarray, tuple[str, ...], np.ndarray]] = []
    for key, parts in pairs.items():
        ii = np.concatenate([p[0] for p in parts])
        jj = np.concatenate([p[1] for p in parts])
        resources, dur = ss.ops_table(strategies[key], cum[jj + 1] - cum[ii], ctx.costs)
        tables.append((ii, jj, resources, dur))
    shapes = {tandem_shape(tuple(Op(r, 0.0) for r in res)) for _, _, res, _ in tables}
    exact = len(shapes) == 1 and None not in shapes
    width = len(next(iter(shapes))) if exact else 1  # type: ignore[arg-type]
    pre = np.full((n, n), np.inf)
    chain = np.full((n, n, width), np.inf)
    for ii, jj, resources, dur in tables:
        on_gpu = [c for c, r in enumerate(resources) if r == GPU]
        others = [c for c, r in enumerate(resources) if r != GPU]
        p = np.zeros(len(ii))
        for c in on_gpu:
            p = p + dur[:, c]
        pre[ii, jj] = p
        if exact:
            chain[ii, jj] = dur[:, others] if others else np.zeros((len(ii), 0))
        else:
            q = np.zeros(len(ii))
            for c in others:
                q = q + dur[:, c]
            chain[ii, jj, 0] = q
    return pre, chain, exact


@dataclass(frozen=True)
class CupcakeFusion:
    """Optimal contiguous buckets per shared strategy (see module docstring).

    Attributes:
        max_group: longest bucket in tensors (``None``: unlimited, the exact optimum).
    """

    max_group: int | None = None
    name: ClassVar[str] = "cupcake-fusion"
    sections: ClassVar[tuple[str, ...]] = ("gradient_sync",)
    refines: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.max_group is not None and self.max_group < 1:
            raise SpecError(f"cupcake-fusion: max-group must be at least 1 (a bucket holds a "
                            f"tensor), got {self.max_group}; leave it out for unlimited buckets")

    def run(self, plan: Plan, ctx: PassContext) -> PassResult:
        workload, incoming = ctx.workload, plan.gradient_sync
        syncs = stage_syncs(workload, ctx.layout, plan.stages, ctx.costs)
        if not syncs:
            return PassResult(plan, False, ("dp=1: no gradient sync to fuse",))
        strategies, key = tensor_strategies(workload, incoming)
        buckets: list[tuple[int, Bucket]] = []
        notes: list[str] = []
        for ss in syncs:
            names = [workload.grads[i].name for i in ss.grads]
            fusion, exact = stage_fusion(ss, [key[n] for n in names], strategies, ctx,
                                         max_group=self.max_group)
            for i, j in fusion.groups:
                members = ss.grads[i : j + 1]
                buckets.append((members[-1], Bucket(
                    tensors=tuple(workload.grads[m].name for m in members),
                    size_bytes=sum(workload.grads[m].size_bytes for m in members),
                    strategy=key[names[i]],
                )))
            notes.append(f"stage {ss.stage.index}: {len(ss.grads)} tensor(s) -> "
                         f"{len(fusion.groups)} bucket(s), "
                         f"{'exact' if exact else 'surrogate'} DP")
        buckets.sort(key=lambda b: b[0])
        fused = GradientSync(
            strategies=strategies,
            tensors=incoming.tensors if incoming else (),
            buckets=tuple(b for _, b in buckets),
        )
        ours = self._iteration_s(plan, ctx, fused)
        theirs = self._iteration_s(plan, ctx, incoming)
        if theirs <= ours:
            notes.append(f"kept the incoming gradient sync ({theirs * 1e3:.3f} ms <= fused "
                         f"{ours * 1e3:.3f} ms)")
            return PassResult(plan, False, tuple(notes))
        notes.append(f"predicted {ours * 1e3:.3f} ms (incoming {theirs * 1e3:.3f} ms)")
        return PassResult(plan.model_copy(update={"gradient_sync": fused}), True, tuple(notes))

    @staticmethod
    def _iteration_s(plan: Plan, ctx: PassContext, sync: GradientSync | None) -> float:
        return evaluate(ctx.workload, ctx.layout, plan.stages, sync, ctx.costs,
                        check_memory=False).iteration_s
