"""The selection rule of Espresso's public reference implementation (digest §E.9), as a baseline.

The authors' simulator (``simulator_espresso.py``) does not run the thesis' Algorithm 4.1; it
chooses among five options per tensor by thresholds on the tensor's element count and keeps a
choice only when its own timeline says it helps. This module re-implements that rule over
hetplan's timeline (:class:`~hetplan.algorithms.dp_session.DPSession`), so a plan can show
what the reference would have chosen, priced by the same simulator as everything else.

Options (the reference's internal codes): 0 fp32, 1 fp16, 2 one-level compression (fp16
inside the node, compressed across nodes), 3 two-level compression (compressed inside and
across nodes), 4 one-level with CPU (de)compression. The caller says what each costs per
tensor (``ops(i, option)``); the rule only decides.

The rule, step by step (:func:`reference_choice`):

1. Everything fp32. Tensors whose communication ends before the last bubble of that timeline
   (the start of its last busy period) are set aside: they keep fp32.
2. Every other tensor with more than ``fp16_above`` elements goes fp16. Tensors communicated
   before the last bubble of this timeline are set aside too.
3. Size groups, largest first, each latest-ready first: a tensor not set aside tries one
   option chosen by its size (3 above ``two_level_above`` when two-level is allowed, 2 above
   ``one_level_above``, otherwise nothing) and keeps it if the iteration gets shorter.
4. With CPU compression allowed, the compressed tensors under ``offload_below`` elements,
   grouped by size (each group earliest-ready first), try every count of offloaded tensors
   per group (the first ones of the group go to option 4); the best vector is kept. Above
   ``offload_limit`` vectors the groups are searched one at a time (coordinate descent),
   which the reference never does (it always enumerates; it is far slower than this).

Thresholds (elements, "strictly greater"): fp16 above 2^17; one-level above 2^20 (PCIe) or
2^19 (NVLink); two-level above 2^23 (PCIe) or 2^22 (NVLink); offload below 2^25.

Differences from the reference, all deliberate: hetplan's timeline replaces the reference's
single-channel one (so "keeps it if the iteration gets shorter" asks hetplan's simulator);
the reference re-times only the suffix after its last bubble, which gives the same order of
choices; its ready gaps are used as the workload gives them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hetplan.algorithms.dp_session import DPSession
from hetplan.algorithms.dp_types import Op

__all__ = ["ReferenceThresholds", "reference_choice", "FP32", "FP16", "ONE_LEVEL",
           "TWO_LEVEL", "CPU_OFFLOAD"]

FP32, FP16, ONE_LEVEL, TWO_LEVEL, CPU_OFFLOAD = 0, 1, 2, 3, 4
_EPS = 1e-9


@dataclass(frozen=True)
class ReferenceThresholds:
    """The reference's element-count thresholds (strictly greater / strictly less)."""

    fp16_above: int = 2**17
    one_level_above: int = 2**19
    two_level_above: int = 2**22
    offload_below: int = 2**25

    @classmethod
    def for_intra(cls, nvlink: bool) -> ReferenceThresholds:
        """NVLink machines compress from 2^19 / 2^22 elements, PCIe ones from 2^20 / 2^23."""
        return cls() if nvlink else cls(one_level_above=2**20, two_level_above=2**23)


def reference_choice(
    backprop_s: Sequence[float],
    numel: Sequence[int],
    ops: Callable[[int, int], tuple[Op, ...]],
    *,
    thresholds: ReferenceThresholds = ReferenceThresholds(),
    two_level: bool = True,
    cpu: bool = True,
    forward_s: float = 0.0,
    optimizer_s: float = 0.0,
    cpu_workers: int = 1,
    offload_limit: int = 1 << 15,
) -> tuple[list[int], float]:
    """The reference implementation's choice (see the module docstring).

    Args:
        backprop_s / numel: per tensor in ready order: backprop time before it is ready, and
            its element count.
        ops: the simulator ops of tensor ``i`` under option ``0..4``.
        thresholds / two_level / cpu: the reference's settings (``--two-level``, ``--cpu``).
        forward_s / optimizer_s / cpu_workers: passed to the simulator.
        offload_limit: exhaustive offloading up to this many vectors.

    Returns:
        (one option 0..4 per tensor, its predicted iteration time).
    """
    n = len(backprop_s)
    if len(numel) != n:
        raise ValueError(f"{n} backprop times but {len(numel)} element counts")
    opts = [FP32] * n
    sess = DPSession(backprop_s, forward_s=forward_s, optimizer_s=optimizer_s,
                     cpu_workers=cpu_workers)
    sess.rebase([ops(i, FP32) for i in range(n)])
    aside = set(sess.before_bubbles(_EPS))
    # 2. fp16 above the threshold, after the last bubble of the fp32 timeline
    for i in range(n):
        if i not in aside and numel[i] > thresholds.fp16_above:
            opts[i] = FP16
    best = sess.rebase([ops(i, k) for i, k in enumerate(opts)])
    aside |= sess.before_bubbles(_EPS)
    # 3. one threshold-chosen option per tensor, size groups largest first, latest-ready first
    for i in sorted(range(n), key=lambda j: (-numel[j], -j)):
        if i in aside:
            continue
        if two_level and numel[i] > thresholds.two_level_above:
            k = TWO_LEVEL
        elif numel[i] > thresholds.one_level_above:
            k = ONE_LEVEL
        else:
            continue
        f = sess.trial({i: ops(i, k)}, bound=best - _EPS)
        if f < best - _EPS:
            opts[i] = k
            best = sess.rebase([*sess.base_ops[:i], ops(i, k), *sess.base_ops[i + 1:]])
    if not cpu:
        return opts, best
    # 4. offloading: size groups of compressed tensors, earliest-ready first in each
    groups: dict[int, list[int]] = {}
    for i, k in enumerate(opts):
        if k >= ONE_LEVEL and numel[i] < thresholds.offload_below:
            groups.setdefault(numel[i], []).append(i)
    if not groups:
        return opts, best
    glist = list(groups.values())
    total = 1
    for g in glist:
        total *= len(g) + 1
    offl = {i: ops(i, CPU_OFFLOAD) for g in glist for i in g}
    counts, f = sess.best_offload(glist, offl, best, _EPS, exhaustive=total <= offload_limit)
    for g, u in zip(glist, counts):
        for i in g[:u]:
            opts[i] = CPU_OFFLOAD
    return opts, min(f, best)
