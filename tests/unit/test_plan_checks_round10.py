"""The one plan validator, round 10 of a new user's mistakes (`docs/decisions/
bad-input-round10.md`): on :func:`test_plan_checks.valid_plan`, one field edited."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hetplan.ir.plan import load_plan
from test_plan_checks import refused as plan_refused
from test_plan_checks import valid_plan


def _sparse(d: dict[str, Any], grad: str, *, ids: int = 32) -> None:
    """Layer l0 a token embedding (fed ``ids`` bytes of ids), ``grad`` Zen-synced as a 4 x 4
    table (the toy's parameters are 16 fp32 elements)."""
    d["model"]["workload"]["layers"][0].update(kind="embedding", act_in_bytes=ids)
    d["sparse_sync"] = {"mode": "zen", "tensors": [{
        "name": grad, "rows": 4, "row_elems": 4, "scheme": "zen",
        "stats": {"density": 0.25, "density_n": 0.5}}]}


def test_a_token_embeddings_sparse_sync_loads(tmp_path: Path) -> None:
    data = json.loads(valid_plan().to_json())
    _sparse(data, "l0.weight")
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    assert load_plan(path).sparse_sync is not None


@pytest.mark.parametrize("grad,ids,why", [
    ("l1.weight", 32, "'l1.weight' is a parameter of layer 'l1' (other), not of an embedding"),
    ("l0.weight", 0, "'l0.weight' is the table of embedding 'l0', which takes no ids"),
])
def test_sparse_sync_of_a_dense_gradient_is_refused(tmp_path: Path, grad: str, ids: int,
                                                    why: str) -> None:
    """Was accepted by every command (gpt-test's `head.weight`, the token embedding's shape,
    in place of `tok_emb.weight`), and priced at the embedding's row density though every
    row of such a gradient is non-zero each step."""
    plan_refused(tmp_path, lambda d: _sparse(d, grad, ids=ids),
                 f"sparse_sync.tensors[0].name: {why}", "so its gradient is dense",
                 "list only the token embeddings `hetplan plan --sparse` finds")
