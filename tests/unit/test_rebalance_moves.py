"""Which parameters a re-balancing moves (runtime/rebalance.plan_param_moves): hand-derived."""

from __future__ import annotations

import pytest

from hetplan.errors import SpecError
from hetplan.runtime.rebalance import plan_param_moves


def test_moves_group_by_stage_pair_in_ascending_order() -> None:
    old = [{"a.w", "b.w", "b.b"}, {"c.w", "d.w"}, {"e.w"}]
    new = [{"a.w"}, {"b.w", "b.b", "c.w"}, {"d.w", "e.w"}]
    assert plan_param_moves(old, new) == [(0, 1, ["b.b", "b.w"]), (1, 2, ["d.w"])]


def test_backward_moves_and_repacking() -> None:
    old = [{"a"}, {"b"}, {"c"}, {"d"}]
    assert plan_param_moves(old, [{"a", "b"}, {"c", "d"}]) == [(1, 0, ["b"]), (2, 1, ["c"]),
                                                                (3, 1, ["d"])]
    assert plan_param_moves(old, old) == []


def test_bad_assignments_are_refused() -> None:
    with pytest.raises(SpecError, match="held by stages 0 and 1"):
        plan_param_moves([{"a"}, {"a"}], [{"a"}, set()])
    with pytest.raises(SpecError, match="stage 1 needs parameter 'z'"):
        plan_param_moves([{"a"}, {"b"}], [{"a"}, {"b", "z"}])
