"""Pass ``espresso-reference``: what Espresso's public reference implementation would choose.

A baseline, not an optimizer: it applies the reference simulator's per-tensor selection rule
(:func:`hetplan.algorithms.espresso_reference.reference_choice`, digest §E.9) with hetplan's
own costs and timeline, and writes the result as an ordinary ``gradient_sync``, so that a plan
chosen by the ``espresso`` pass can be compared with it by the same simulator
(``compile`` records it among the baselines when the pipeline compresses; ``bench/espresso.py``
reports the ratio).

The reference's internal options become these plan strategies (its final communication codes,
§E.8, mapped the way its ``set_final_comm`` maps them; ``k`` GPUs per node, ``N`` nodes):

==================  ==============================================================
internal option     hetplan path (decision-tree option, precision of uncompressed steps)
==================  ==============================================================
0 fp32              intra reduce-scatter, inter allreduce, intra allgather (fp32)
1 fp16              the same path cast to fp16
2 one-level         code 4 (sparsifiers; quantizers under 2^24 elements or N <= 3):
                    intra reduce-scatter (fp16), compress, inter allgather, decompress,
                    intra allgather (fp16); code 3 otherwise: intra reduce-scatter
                    (fp16), compress, inter alltoall, decompress + compress, inter
                    allgather, decompress, intra allgather (fp16)
3 two-level         code 10 (sparsifier keeping < 0.25 %): flat allgather of compressed
                    data; code 9 (sparsifiers): compress, intra alltoall, decompress +
                    compress, inter allgather, intra allgather (compressed), decompress
                    -- the reference closes the intra alltoall with a broadcast, a pair
                    the tree does not have (§H.2), so the allgather stands in; code 6
                    (quantizers): compress, intra alltoall, decompress + compress, inter
                    gather, decompress + compress, inter broadcast, intra allgather
                    (compressed), decompress
4 CPU compression   code 5: code 3's path with every (de)compression on the CPU
==================  ==============================================================

It needs a hierarchical group (several nodes, several ranks each) and ZeRO-0 or 1 (ZeRO-2/3
reduce-scatter gradients flat during backward); otherwise it leaves the incoming
``gradient_sync`` as it is, with a note.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hetplan.algorithms.dp_types import Op
from hetplan.algorithms.espresso_reference import (
    CPU_OFFLOAD,
    FP16,
    FP32,
    ONE_LEVEL,
    TWO_LEVEL,
    ReferenceThresholds,
    reference_choice,
)
from hetplan.algorithms.espresso_tree import Option, all_options, option_id
from hetplan.cost_models.compression import COMPRESSORS, DEFAULT_SPARSITY_RATIO
from hetplan.cost_models.evaluate import StageSync, stage_syncs
from hetplan.errors import SpecError
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import GradientSync, SyncStrategy, TensorSync
from hetplan.ir.validation import did_you_mean
from hetplan.passes.base import PassContext, PassResult
from hetplan.passes.espresso import Key, strategy_for, strategy_name

__all__ = ["EspressoReference", "reference_code_path"]

_SPARSIFIERS = ("randomk", "dgc", "topk")
#: Paths of the reference's final codes as (task, level or "", routine or device) triples.
_RS, _AG = ("comm1", "intra", "reduce_scatter"), ("comm2", "intra", "allgather")
_C, _D = ("comp", "", "gpu"), ("decomp", "", "gpu")
_CODES: dict[int, tuple[tuple[str, str, str], ...]] = {
    0: (_RS, ("comm", "inter", "allreduce"), _AG),
    3: (_RS, _C, ("comm1_comp", "inter", "alltoall"), _D, _C,
        ("comm2_comp", "inter", "allgather"), _D, _AG),
    4: (_RS, _C, ("comm_comp", "inter", "allgather"), _D, _AG),
    6: (_C, ("comm1_comp", "intra", "alltoall"), _D, _C, ("comm1_comp", "inter", "gather"),
        _D, _C, ("comm2_comp", "inter", "broadcast"), ("comm2_comp", "intra", "allgather"), _D),
    9: (_C, ("comm1_comp", "intra", "alltoall"), _D, _C, ("comm_comp", "inter", "allgather"),
        ("comm2_comp", "intra", "allgather"), _D),
    10: (_C, ("comm_comp", "flat", "allgather"), _D),
}


def _matches(option: Option, spec: tuple[tuple[str, str, str], ...], device: str) -> bool:
    if len(option) != len(spec):
        return False
    for a, (task, level, what) in zip(option, spec):
        if a.task != task or (level and a.level != level):
            return False
        if a.device is not None and a.device != device:
            return False
        if a.routine is not None and a.routine != what:
            return False
    return True


def reference_code_path(code: int) -> int:
    """The decision-tree ``option_id`` of the reference's final code 0, 3, 4, 5, 6, 9 or 10
    (5 is code 3 on the CPU); see the module docstring for the paths.

    Raises:
        ValueError: another code.
    """
    spec, device = (_CODES[3], "cpu") if code == 5 else (_CODES.get(code), "gpu")
    if spec is None:
        raise ValueError(f"no path for reference code {code}; known: 0, 3, 4, 5, 6, 9, 10")
    found = [o for o in all_options() if _matches(o, spec, device)]
    assert len(found) == 1, (code, len(found))  # the tree has each of these exactly once
    return option_id(found[0])


@dataclass(frozen=True)
class EspressoReference:
    """The reference implementation's per-tensor choice, as a baseline (module docstring).

    Attributes:
        compressor: the compressor the reference compresses with.
        two_level: allow two-level compression (the reference's ``--two-level``).
        cpu: allow CPU compression (its ``--cpu``).
        ratio: fraction of elements the sparsifiers keep.
    """

    compressor: str = "dgc"
    two_level: bool = True
    cpu: bool = True
    ratio: float = DEFAULT_SPARSITY_RATIO
    name: ClassVar[str] = "espresso-reference"
    sections: ClassVar[tuple[str, ...]] = ("gradient_sync",)
    refines: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.compressor not in COMPRESSORS or self.compressor in ("fp16", "bf16"):
            known = [c for c in COMPRESSORS if c not in ("fp16", "bf16")]
            raise SpecError(f"espresso-reference: unknown compressor {self.compressor!r}"
                            f"{did_you_mean(self.compressor, known)} (known: "
                            f"{', '.join(known)})")
        if not 0 < self.ratio <= 1:  # nan too
            raise SpecError(f"espresso-reference: ratio must be in (0, 1] (the fraction of "
                            f"elements a sparsifier keeps), got {self.ratio}")

    def keys(self, numel: int, nodes: int) -> dict[int, Key]:
        """The plan key of each internal option for a tensor of ``numel`` elements."""
        sparse = self.compressor in _SPARSIFIERS
        c = self.compressor
        if sparse or numel < 2**24 or nodes <= 3:
            one: Key = (c, reference_code_path(4), "fp16")
        else:
            one = (c, reference_code_path(3), "fp16")
        two = 10 if sparse and 2 * self.ratio < 0.005 else 9 if sparse else 6
        fp32 = reference_code_path(0)
        return {FP32: (None, fp32, "fp32"), FP16: (None, fp32, "fp16"), ONE_LEVEL: one,
                TWO_LEVEL: (c, reference_code_path(two), "fp32"),
                CPU_OFFLOAD: (c, reference_code_path(5), "fp16")}

    def run(self, plan: Plan, ctx: PassContext) -> PassResult:
        syncs = stage_syncs(ctx.workload, ctx.layout, plan.stages, ctx.costs)
        if not syncs:
            return PassResult(plan, False, ("no data-parallel gradient sync (dp = 1)",))
        if not all(ss.nodes > 1 and ss.per_node > 1 for ss in syncs):
            return PassResult(plan, False, (
                "espresso-reference needs hierarchical groups (several nodes with several "
                "ranks each); gradient sync left as it was",))
        if ctx.layout.stage_copies > 1:  # hetplan.ir.plan_checks, rule 2
            return PassResult(plan, False, (
                "schedule 'chimera' syncs each stage flat over the 2·dp ranks holding it and "
                "the reference's paths are hierarchical; gradient sync left as it was",))
        if (z := ctx.layout.zero_stage) >= 2:  # what the runtime composes (composition.py)
            return PassResult(plan, False, (
                f"ZeRO-{z} reduce-scatters gradients flat during backward and the reference's "
                "paths (hierarchical, compressed) need the full gradient (zero_stage <= 1); "
                "gradient sync left as it was",))
        strategies: dict[str, SyncStrategy] = {}
        tensors: dict[int, str] = {}
        notes = []
        for ss in syncs:
            chosen, f = self._stage(ss, ctx)
            for i, key in zip(ss.grads, chosen):
                tensors[i] = strategy_name(key)
                strategies.setdefault(tensors[i], strategy_for(key, self.ratio))
            counts = [sum(1 for k in chosen if k == key) for key in set(chosen)]
            notes.append(f"stage {ss.stage.index}: reference rule, {len(set(chosen))} "
                         f"strategies ({', '.join(map(str, sorted(counts, reverse=True)))} "
                         f"tensors), predicted sync {f * 1e3:.3f} ms")
        sync = GradientSync(
            strategies=dict(sorted(strategies.items())),
            tensors=tuple(TensorSync(name=ctx.workload.grads[i].name, strategy=s)
                          for i, s in sorted(tensors.items())))
        return PassResult(plan.model_copy(update={"gradient_sync": sync}), True, tuple(notes))

    def _stage(self, ss: StageSync, ctx: PassContext) -> tuple[list[Key], float]:
        numel = [int(b) // 4 for b in ss.nbytes]  # fp32 elements, as the reference counts
        keys = [self.keys(m, ss.nodes) for m in numel]
        cache: dict[tuple[Key, float], tuple[Op, ...]] = {}

        def ops(i: int, option: int) -> tuple[Op, ...]:
            key, nb = keys[i][option], float(ss.nbytes[i])
            got = cache.get((key, nb))
            if got is None:
                got = cache[(key, nb)] = ss.ops(strategy_for(key, self.ratio), nb, ctx.costs)
            return got

        r = ss.stage.ranks[0]
        nvlink = ctx.cluster.link_between(r, r).kind == "nvlink"
        opts, f = reference_choice(
            ss.backprop_s, numel, ops,
            thresholds=ReferenceThresholds.for_intra(nvlink), two_level=self.two_level,
            cpu=self.cpu)
        return [keys[i][k] for i, k in enumerate(opts)], f
