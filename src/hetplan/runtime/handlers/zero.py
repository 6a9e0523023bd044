"""``layout.zero_stage``: ZeRO inside each data-parallel group, and mixed precision's fp32
master weights.

- **ZeRO-1** (and **ZeRO-0 with 16-bit compute**): the runtime's
  :class:`~hetplan.runtime.sharded_optimizer.ShardedOptimizer` replaces the optimizer: fp32
  master shard, the user's optimizer over it, all-gather of the updated working weights. The
  plan's gradient path (:class:`~hetplan.runtime.handlers.grad_sync.GradSyncHandler`:
  buckets, compression, hierarchy) runs unchanged before it: ZeRO-1 composes with all of it.
- **ZeRO-2**: the same optimizer, fed by
  :class:`~hetplan.runtime.sharded_optimizer.GradReducer`, which reduce-scatters each of the
  plan's (fused) buckets as backward completes it and frees the full gradients; the gradient
  sync handler stands aside (it syncs nothing when ``zero_stage >= 2``). With a pipeline or
  sequence parallelism the gradients change after backward (the schedule's ``1 /
  micro_batches``, tied weights' and sequence-parallel sums, in earlier handlers'
  ``after_backward``), so the buckets are reduce-scattered after those instead, once per
  step: the bytes on the wire are ZeRO-2's, the full gradients live until the step's end.

With pipeline and tensor parallelism, the data-parallel group is the ranks holding the same
stage and the same TP coordinate (``ParallelGroups.dp_group``), so every replica of it holds
the same parameters (TP shards included) and cuts them into the same segments.
- **ZeRO-3**: FSDP2 (``torch.distributed.fsdp.fully_shard``) on every transformer block and
  the root, over the data-parallel group, with a ``MixedPrecisionPolicy`` from the
  ``precision`` section (fp32 shards are the master weights, 16-bit all-gathers); FSDP
  reduce-scatters per block, which is how the cost model prices ZeRO-3. With tensor
  parallelism the TP shards are sharded like any parameter (one shape per DP group); with a
  pipeline each stage module is one FSDP unit, driven by torch's schedule
  (``docs/decisions/zero3-pipeline-tp.md``).

With ``dp == 1`` there is nothing to shard: every stage runs as ZeRO-0. Combinations the
runtime does not compose are refused before any handler sets up
(:mod:`hetplan.runtime.composition`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hetplan.errors import SpecError
from hetplan.ir.model import LayerKind
from hetplan.ir.plan_sections import CastSync
from hetplan.runtime.composition import effective_zero_stage
from hetplan.runtime.handlers.base import Handler, OptimizerFactory, RuntimeContext
from hetplan.runtime.precision import DTYPES, DynamicLossScale, LossScaledOptimizer
from hetplan.runtime.sharded_optimizer import GradReducer, ShardedOptimizer, segments_of

if TYPE_CHECKING:
    from hetplan.runtime.handlers.precision import PrecisionHandler
    from hetplan.runtime.handlers.tensor_parallel import TensorParallelHandler

__all__ = ["ZeroHandler"]


class ZeroHandler(Handler):
    """Shards optimizer state, gradients or parameters inside the data-parallel group.

    Attributes:
        stage: the ZeRO stage that runs (:func:`effective_zero_stage`).
        reducer: ZeRO-2's gradient path (None otherwise).
        optimizer: the sharded optimizer the runtime built (None: the user's optimizer runs
            as is, or ZeRO-3).
    """

    section = "layout.zero_stage"

    def __init__(self) -> None:
        self.stage = 0
        self.reducer: GradReducer | None = None
        self.optimizer: ShardedOptimizer | None = None
        self._fsdp = False

    def setup(self, ctx: RuntimeContext) -> None:
        self.stage = effective_zero_stage(ctx.layout)
        precision = _precision_of(ctx)
        dtype = precision.dtype if precision is not None else "fp32"
        scaler = precision.scaler if precision is not None else None
        if self.stage == 3:
            self._fully_shard(ctx, dtype)
            if scaler is not None:  # fp16: FSDP2's fp32 shards are the master weights
                user = ctx.make_optimizer

                def scaled(params: list[nn.Parameter]) -> torch.optim.Optimizer:
                    return LossScaledOptimizer(user(params), scaler)

                ctx.make_optimizer = scaled
            return
        if self.stage == 0 and dtype == "fp32":
            return
        inner = ctx.make_optimizer

        def make(params: list[nn.Parameter]) -> torch.optim.Optimizer:
            initial = precision.take_fp32_weights() if precision is not None else {}
            return self._build(ctx, params, inner, dtype, scaler, initial)

        ctx.make_optimizer = make

    def _build(self, ctx: RuntimeContext, params: list[nn.Parameter], inner: OptimizerFactory,
               dtype: str, scaler: DynamicLossScale | None,
               initial: dict[int, torch.Tensor]) -> ShardedOptimizer:
        groups = ctx.groups
        sharded = self.stage >= 1 and groups is not None
        group = groups.dp_group if sharded and groups is not None else None
        # the group's own size and position: a Chimera plan's group holds the replicas of
        # both directions (2 dp), its rank's data replica stays ``dp_rank``
        world = len(groups.dp_ranks) if sharded and groups is not None else 1
        rank = groups.dp_ranks.index(groups.rank) if sharded and groups is not None else 0
        names = {id(p): n for n, p in ctx.named_params}
        named = [(names[id(p)], p) for p in params if p.requires_grad]
        segments = segments_of(_buckets(ctx, named), world)
        if self.reducer is not None:
            self.reducer.close()
            self.reducer = None
        if self.stage == 2:
            prec = ctx.plan.precision
            in_compute = dtype != "fp32" and (prec is None or prec.grad_reduce_dtype == "compute")
            self.reducer = GradReducer(segments, group, world,
                                       DTYPES[dtype] if in_compute else None,
                                       eager=not _changed_after_backward(ctx))
        self.optimizer = ShardedOptimizer(segments, inner, group, world, rank,
                                          reducer=self.reducer, scaler=scaler, initial=initial)
        return self.optimizer

    def _fully_shard(self, ctx: RuntimeContext, dtype: str) -> None:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        assert ctx.groups is not None  # dp > 1: distributed
        model = ctx.model
        device = next(model.parameters()).device.type
        mesh = DeviceMesh.from_group(ctx.groups.dp_group, device)
        half = DTYPES[dtype] if dtype != "fp32" else None
        prec = ctx.plan.precision
        reduce = half  # None: the parameters' own dtype
        if half is not None and prec is not None and prec.grad_reduce_dtype == "fp32":
            reduce = torch.float32
        policy = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=reduce)
        with _sequence_parallel_params_kept(ctx):
            if ctx.layout.pp > 1:
                self._fully_shard_stages(ctx, mesh, policy)
                return
            for lay in ctx.model_ir().layers:
                if lay.kind == LayerKind.BLOCK:
                    fully_shard(model.get_submodule(lay.name), mesh=mesh, mp_policy=policy)
            fully_shard(model, mesh=mesh, mp_policy=policy)
            ctx.named_params = list(model.named_parameters())
            self._fsdp = True

    def _fully_shard_stages(self, ctx: RuntimeContext, mesh: Any, policy: Any) -> None:
        """ZeRO-3 under a pipeline: each of this rank's stage modules is one FSDP unit over
        the data-parallel group (the ranks holding the same stage and TP coordinate). torch's
        pipeline schedule drives it: no gradient sync on the micro-batches' backwards, one
        reduce-scatter per stage after the last (its ``REDUCE_GRAD`` action), then the
        division by the micro-batch count. The stage's parameters are its own (traced
        stages do not share parameter objects with other stages)."""
        from torch.distributed.fsdp import fully_shard

        from hetplan.runtime.handlers.stages import StagesHandler

        keep = {n for n, _ in ctx.named_params}
        named: list[tuple[str, nn.Parameter]] = []
        for st in ctx.handler(StagesHandler).stages:
            fully_shard(st.submod, mesh=mesh, mp_policy=policy)
            named += [(n, p) for n, p in st.submod.named_parameters() if n in keep]
        ctx.named_params = named
        self._fsdp = True

    def after_backward(self, ctx: RuntimeContext) -> None:
        if self.reducer is not None:
            self.reducer.finish()

    def full_parameters(self, ctx: RuntimeContext) -> dict[str, torch.Tensor]:
        """Every parameter of this rank by name, gathered where sharded, in fp32 (the master
        weights where there are any). A collective over the data-parallel group."""
        if self.optimizer is not None:
            values = self.optimizer.full_master()
            params = [p for seg in self.optimizer.segments for p in seg.params]
            names = {id(p): n for n, p in ctx.named_params}
            return {names[id(p)]: v for p, v in zip(params, values, strict=True)}
        out = {}
        for n, p in ctx.named_params:
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[n] = full.detach().to(torch.promote_types(full.dtype, torch.float32), copy=True)
        return out

    def close(self, ctx: RuntimeContext) -> None:
        if self.reducer is not None:
            self.reducer.close()
            self.reducer = None


def _changed_after_backward(ctx: RuntimeContext) -> bool:
    """Whether earlier handlers still change this rank's gradients after backward: a
    pipeline (torch's schedule divides them by the micro-batch count when it ends; the stage
    handler sums tied weights' copies) or sequence parallelism (the TP handler sums the
    norms' gradients over the TP group). ZeRO-2 then reduce-scatters after them."""
    from hetplan.runtime.handlers.tensor_parallel import TensorParallelHandler

    if ctx.layout.pp > 1:
        return True
    tp = next((h for h in ctx.handlers if isinstance(h, TensorParallelHandler)), None)
    return tp is not None and bool(tp.sp_params)


@contextlib.contextmanager
def _sequence_parallel_params_kept(ctx: RuntimeContext) -> Iterator[None]:
    """``fully_shard`` replaces every parameter by a sharded one: the TP handler's
    sequence-parallel parameters (whose gradients it sums over the TP group after FSDP's
    reduce-scatter) are looked up again, by module and name, in the modules that were
    sharded (the model, or this rank's stage modules)."""
    from hetplan.runtime.handlers.stages import StagesHandler

    tp = _tensor_parallel_of(ctx)
    if tp is None or not tp.sp_params:
        yield
        return
    roots = ([st.submod for st in ctx.handler(StagesHandler).stages] if ctx.layout.pp > 1
             else [ctx.model])
    where = {id(p): (i, n) for i, root in enumerate(roots) for n, p in root.named_parameters()}
    if missing := [p for p in tp.sp_params if id(p) not in where]:
        raise SpecError(f"{len(missing)} sequence-parallel parameter(s) are in none of the "
                        "modules ZeRO-3 shards; re-plan without sequence parallelism")
    keys = [where[id(p)] for p in tp.sp_params]
    yield
    now = [dict(root.named_parameters()) for root in roots]
    tp.sp_params = [now[i][n] for i, n in keys]


def _tensor_parallel_of(ctx: RuntimeContext) -> TensorParallelHandler | None:
    """The runtime's tensor-parallel handler (None: it composes none)."""
    from hetplan.runtime.handlers.tensor_parallel import TensorParallelHandler

    return next((h for h in ctx.handlers if isinstance(h, TensorParallelHandler)), None)


def _precision_of(ctx: RuntimeContext) -> PrecisionHandler | None:
    """The runtime's precision handler (None: it composes none; fp32)."""
    from hetplan.runtime.handlers.precision import PrecisionHandler

    return next((h for h in ctx.handlers if isinstance(h, PrecisionHandler)), None)


def _buckets(ctx: RuntimeContext, named: Sequence[tuple[str, nn.Parameter]],
             ) -> list[tuple[list[nn.Parameter], torch.dtype | None]]:
    """This rank's parameters grouped as the plan's gradient sync groups them (buckets, then
    per-tensor strategies, then one group per parameter the plan does not mention), each
    with its wire dtype (a ``cast`` strategy's, else None)."""
    params = dict(named)
    sync = ctx.plan.gradient_sync
    out: list[tuple[list[nn.Parameter], torch.dtype | None]] = []
    covered: set[str] = set()

    def wire(strategy: Any) -> torch.dtype | None:
        return DTYPES[strategy.dtype] if isinstance(strategy, CastSync) else None

    if sync is not None:
        for b in sync.buckets:
            local = [n for n in b.tensors if n in params and n not in covered]
            if local:
                out.append(([params[n] for n in local], wire(sync.strategies[b.strategy])))
                covered.update(local)
        for t in sync.tensors:
            if t.name in params and t.name not in covered:
                out.append(([params[t.name]], wire(sync.strategies[t.strategy])))
                covered.add(t.name)
    for n, p in named:
        if n not in covered:
            out.append(([p], None))
    return out
