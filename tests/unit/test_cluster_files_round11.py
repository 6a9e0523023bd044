"""Cluster files, round 11 of a new user's mistakes (`docs/decisions/bad-input-round11.md`):
each case failed before its fix."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from test_input_limits import preset, refused, write


@pytest.mark.parametrize("text", ["1e3", "1.0e3", "1.0e300", "12e-3"])
def test_the_spelling_a_yaml_exponent_is_told_to_take_is_read_as_a_number(
        tmp_path: Path, text: str) -> None:
    """PyYAML reads an exponent as a number only with a point and a signed exponent. The
    refusal told ``1e3`` to write ``1.0e3`` (text too) and gave ``1.0e300`` no advice."""
    body = yaml.safe_dump(preset()).replace("latency_us: 3.0", f"latency_us: {text}", 1)
    msg = refused(write(tmp_path, "c.yaml", body), f"expected a number, got a string '{text}'")
    advice = re.search(r"write (\S+?)\)", msg)
    assert advice is not None, msg
    assert isinstance(yaml.safe_load(f"x: {advice.group(1)}")["x"], float)


def test_a_numpy_boolean_is_no_count() -> None:
    """Was accepted as 1 (``numpy.bool_`` is no ``bool``; a Python ``True`` was refused)."""
    import numpy as np

    import hetplan
    from hetplan import ClusterSpec
    from hetplan.errors import SpecError

    data = preset()
    data["nodes"][0]["devices"][0]["count"] = np.True_
    with pytest.raises(SpecError, match="count: expected an integer, got a boolean"):
        ClusterSpec.from_dict(data)
    with pytest.raises(SpecError, match="batch_size: expected an integer, got a boolean"):
        hetplan.CompileOptions(batch_size=np.True_)
    assert hetplan.CompileOptions(batch_size=np.int64(8)).batch_size == 8


def test_a_huge_number_for_a_count_is_not_called_a_string(tmp_path: Path) -> None:
    """Was 'Unable to parse input string as an integer, exceeded maximum size (got 1e+30)'
    for a count written as 1.0e+30 (a number, not a string)."""
    body = yaml.safe_dump(preset()).replace("- count: 2", "- count: 1.0e+30", 1)
    assert "- count: 1.0e+30" in body
    msg = refused(write(tmp_path, "c.yaml", body),
                  "count: a number too large for an integer count")
    assert "input string" not in msg
