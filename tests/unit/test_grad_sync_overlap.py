"""Which data-parallel groups launch a pipeline stage's buckets as the stage finishes
(``hetplan.runtime.handlers.grad_sync.overlaps_compute``): NCCL, whose collectives run beside
the compute; not gloo, which reduces on the cores the stages compute on."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from hetplan.runtime.handlers import grad_sync as handler


@pytest.mark.parametrize(("backend", "early"), [("nccl", True), ("gloo", False)])
def test_only_nccl_groups_launch_early(monkeypatch: pytest.MonkeyPatch, backend: str,
                                       early: bool) -> None:
    monkeypatch.setattr(dist, "get_backend", lambda _group: backend)
    assert handler.overlaps_compute(object()) is early
