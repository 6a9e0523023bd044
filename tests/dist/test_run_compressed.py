"""`hetplan run` on a plan with compressed buckets: 4 gloo ranks as 2 nodes × 2 (``cpu-2x2``),
large gradients on a two-level hierarchical top-k path (half of them fused into one bucket),
small ones fp32; the node groups come from the plan's cluster spec."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import hetplan
from hetplan.algorithms.espresso_tree import (
    all_options,
    devices_of,
    is_hierarchical,
    num_compressions,
)
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan_sections import Bucket, CompressedSync, GradientSync, NoSync, TensorSync
from hetplan.passes.espresso import strategy_for
from hetplan.runtime.cpu_sched import cpu_sched_policy, current_cpu_sched

pytestmark = pytest.mark.dist


def _compressed_plan() -> hetplan.Plan:
    plan = hetplan.compile("gpt-test", ClusterSpec.from_preset("cpu-2x2"), batch_size=8, dp=4,
                           pp=1, tp=1)
    oid = next(i for i, o in enumerate(all_options())
               if is_hierarchical(o) and devices_of(o) == {"gpu"} and num_compressions(o) == 2)
    assert plan.model.workload is not None
    grads = plan.model.workload.grads
    big = [g for g in grads if g.size_bytes >= 4096]
    fused = big[: len(big) // 2]
    sync = GradientSync(
        strategies={"fp32": NoSync(), "topk": strategy_for(("topk", oid), ratio=0.05)},
        tensors=tuple(TensorSync(name=g.name, strategy="topk" if g in big else "fp32")
                      for g in grads),
        buckets=(Bucket(tensors=tuple(g.name for g in fused),
                        size_bytes=sum(g.size_bytes for g in fused), strategy="topk"),),
    )
    return plan.model_copy(update={"gradient_sync": sync})


def test_run_a_plan_with_compressed_hierarchical_buckets(tmp_path: Path) -> None:
    plan = _compressed_plan()
    assert plan.gradient_sync is not None
    assert isinstance(plan.gradient_sync.strategies["topk"], CompressedSync)
    plan.save(tmp_path / "plan.json")
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "hetplan.cli", "run", str(tmp_path / "plan.json"), "--model",
         "gpt-test", "--steps", "3", "--report", str(report)],
        capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(report.read_text())
    assert data["world_size"] == 4 and data["steps"] == 3
    assert math.isfinite(data["final_loss"])
    # the report says how the operating system scheduled the ranks (hetplan.runtime.cpu_sched):
    # batch if asked, else as they were started (the policy of this test's process)
    want = "batch" if cpu_sched_policy() == "batch" else current_cpu_sched()
    assert data["cpu_sched"] == (want if hasattr(os, "SCHED_BATCH") else "unsupported")
