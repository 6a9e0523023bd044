"""The NCCL path of the runtime: the same code as the gloo tests, on CUDA devices.

Skipped visibly without CUDA (CI has none); run on a GPU machine with ``pytest -m gpu``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (NCCL)"),
]


def _cluster(n: int):  # type: ignore[no-untyped-def]
    from hetplan.ir.cluster import ClusterSpec

    spec = ClusterSpec.from_preset("a100-nvlink-8x8").model_dump(mode="json")
    spec["nodes"] = [dict(spec["nodes"][0], count=1,
                          devices=[{"type": spec["nodes"][0]["devices"][0]["type"], "count": n}])]
    spec.pop("inter_node", None)
    return ClusterSpec.from_dict(spec)


def test_data_parallel_training_under_torchrun_with_nccl(tmp_path: Path) -> None:
    import hetplan

    n = torch.cuda.device_count()
    plan = hetplan.compile("gpt-test", _cluster(n), batch_size=8 * n, dp=n, pp=1, tp=1)
    plan.save(tmp_path / "plan.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc-per-node", str(n), "-m", "hetplan.runtime.worker", "--plan",
           str(tmp_path / "plan.json"), "--model", "gpt-test", "--steps", "5", "--report",
           str(tmp_path / "report.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["world_size"] == n
    assert report["measured"]["iteration_ms"] > 0
