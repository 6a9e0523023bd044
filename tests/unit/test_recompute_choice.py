"""How ``choose_recompute`` (``cost_models/rank_memory.py``) upgrades stages: on a rank that
holds several interleaved chunks, selective recomputation on all of them before a full
forward on any, when that is enough to fit."""

from __future__ import annotations

import torch

import hetplan
from hetplan import models
from hetplan.ir.capture import capture
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.cluster import DEVICE_CATALOGUE

GiB = 2**30


def _ir():  # type: ignore[no-untyped-def]
    with torch.device("meta"):
        model = models.MegatronGPT(vocab_size=512, max_seq=512, dim=256, n_layers=8, n_heads=8)
    return capture(model, (torch.zeros(1, 512, dtype=torch.long),))


def _cluster(memory_gib: float) -> ClusterSpec:
    a100 = {**DEVICE_CATALOGUE["A100-80GB"].model_dump(), "memory_gib": memory_gib}
    return ClusterSpec.from_dict({
        "name": "tight", "device_types": {"A100-T": a100},
        "nodes": [{"name": "n0", "devices": [{"type": "A100-T", "count": 2}], "cpu_cores": 8,
                   "intra_link": {"kind": "nvlink", "bandwidth_gbps": 2400,
                                  "latency_us": 2}}]})


def _plan(ir, memory_gib: float, recompute: str):  # type: ignore[no-untyped-def]
    return hetplan.compile(ir, _cluster(memory_gib), batch_size=8, pp=2, dp=1, tp=1,
                           micro_batch_size=1, schedule="interleaved-1f1b", virtual_stages=2,
                           recompute=recompute, dtype="fp32", passes="uniform-stages")


def test_selective_on_every_chunk_before_full_on_one() -> None:
    ir = _ir()
    roomy = 1000.0
    peak = {mode: max(_plan(ir, roomy, mode).predictions.memory_per_rank_bytes)
            for mode in ("none", "selective")}
    assert peak["selective"] < peak["none"]
    # room for selective recomputation everywhere, not for none anywhere on the fullest rank
    cap_gib = (peak["selective"] + 0.1 * (peak["none"] - peak["selective"])) / 0.9 / GiB
    plan = _plan(ir, cap_gib, "auto")
    modes = [st.recompute for st in plan.stages]
    assert "full" not in modes, modes
    assert "selective" in modes


def test_no_selective_recomputation_where_the_engine_keeps_no_scores() -> None:
    # a fused attention kernel (flash) keeps no score matrices: selective recomputation
    # would drop nothing there and only rerun the attention core, so a memory-bound choice
    # goes from none straight to full
    ir = _ir()

    def plan(memory_gib: float, recompute: str):  # type: ignore[no-untyped-def]
        return hetplan.compile(ir, _cluster(memory_gib), batch_size=8, pp=2, dp=1, tp=1,
                               micro_batch_size=1, schedule="interleaved-1f1b",
                               virtual_stages=2, recompute=recompute, dtype="fp32",
                               passes="uniform-stages", attention="flash", fusion="fused")

    peak = {mode: max(plan(1000.0, mode).predictions.memory_per_rank_bytes)
            for mode in ("none", "selective", "full")}
    assert peak["selective"] == peak["none"] > peak["full"]
    cap_gib = (peak["full"] + 0.5 * (peak["none"] - peak["full"])) / 0.9 / GiB
    modes = [st.recompute for st in plan(cap_gib, "auto").stages]
    assert "selective" not in modes and "full" in modes, modes
