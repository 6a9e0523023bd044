"""The one plan validator, round 9 of a new user's mistakes (`docs/decisions/
bad-input-round9.md`): on :func:`test_plan_checks.valid_plan`, one field edited."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from test_plan_checks import refused as plan_refused


def test_a_tensor_parallel_linear_listed_twice_is_refused(tmp_path: Path) -> None:
    """Was accepted by every file command (the runtime took one of the two entries)."""
    def twice(d: dict[str, Any]) -> None:
        lin = {"name": "l0", "features": 8, "shard_sizes": [4, 4], "split": "column"}
        d["tensor_parallel"]["groups"][0]["linears"] = [lin, dict(lin, shard_sizes=[6, 2])]

    plan_refused(tmp_path, twice, "tensor_parallel.groups[0].linears[1].name: 'l0' is "
                 "listed twice in the group (also linears[0])", "keep one")
