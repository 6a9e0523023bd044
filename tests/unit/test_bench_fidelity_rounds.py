"""``bench/fidelity_runtime.py``: each round is planned from a profile taken just before it.

The profiling, planning and running are replaced by stand-ins that record what they were
given (the real ones take minutes); what is checked is the bench's own bookkeeping: which
profile each round's kinds are planned from, and what the results file says of them
(``docs/decisions/cpu-fidelity.md``, section 24). No duration is asserted.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.append(str(BENCH))  # after everything else: bench/ holds scripts named like modules

import fidelity_runtime as fr  # noqa: E402


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    seen: dict[str, list[Any]] = {"profile": [], "emulated": [], "plan": []}

    def profile(model: str, tmp: Path, args: Any) -> tuple[Path, dict[str, Any]]:
        seen["profile"].append((model, tmp))
        return tmp / f"profile_{model}.json", {"exit": 0, "where": str(tmp)}

    def emulated(kind: Any, base: Path, tmp: Path, args: Any) -> tuple[Path, dict[str, Any]]:
        seen["emulated"].append((kind.name, base))
        return base.with_name(base.stem + "_link.json"), {"exit": 0, "where": str(tmp)}

    def plan_and_run(kind: Any, prof: Path, tmp: Path, rnd: int, args: Any) -> dict[str, Any]:
        seen["plan"].append((kind.name, rnd, prof))
        return {"round": rnd, "status": "ran", "predicted_ms": 10.0, "measured_ms": 10.0,
                "predicted_breakdown_ms": {}, "measured_breakdown_ms": {},
                "parts_ms": fr.parts(10.0, {}, {})}

    monkeypatch.setattr(fr, "profile", profile)
    monkeypatch.setattr(fr, "emulated_profile", emulated)
    monkeypatch.setattr(fr, "plan_and_run", plan_and_run)
    monkeypatch.setattr(fr, "speed_probe", lambda: {"python_ms": 1.0, "matmul_ms": 1.0})
    return seen


def _main(tmp_path: Path, *extra: str) -> dict[str, Any]:
    out = tmp_path / "result.json"
    fr.main(["--kinds", "dp", "compressed", "--rounds", "2", "--keep", str(tmp_path / "keep"),
             "--out", str(out), *extra])
    return json.loads(out.read_text())


def test_every_round_is_planned_from_its_own_profiles(
        tmp_path: Path, calls: dict[str, list[Any]]) -> None:
    doc = _main(tmp_path)
    keep = tmp_path / "keep"
    # gpt-test profiled twice, once into each round's folder, before that round's kinds
    assert calls["profile"] == [("gpt-test", keep / "round0"), ("gpt-test", keep / "round1")]
    assert [e[0] for e in calls["emulated"]] == ["compressed", "compressed"]
    for name, rnd, prof in calls["plan"]:
        assert prof.parent == keep / f"round{rnd}", (name, rnd, prof)
    assert sorted((n, r) for n, r, _ in calls["plan"]) == [
        ("compressed", 0), ("compressed", 1), ("dp", 0), ("dp", 1)]
    # the compressed kind takes the emulated link's copy of its round's profile
    assert {p.name for n, _, p in calls["plan"] if n == "compressed"} == {
        "profile_gpt-test_link.json"}
    assert set(doc["profiles"]) == {"round 0 gpt-test", "round 1 gpt-test",
                                    "round 0 gpt-test+ethernet", "round 1 gpt-test+ethernet"}
    whens = [p["when"] for p in doc["speed_probes_ms"]]
    assert whens == ["start", "before the profiles of round 0", "before round 0",
                     "before the profiles of round 1", "before round 1", "end"]


def test_profile_once_plans_every_round_from_the_first_profiles(
        tmp_path: Path, calls: dict[str, list[Any]]) -> None:
    doc = _main(tmp_path, "--profile-once")
    keep = tmp_path / "keep"
    assert calls["profile"] == [("gpt-test", keep)]
    assert len(calls["emulated"]) == 1
    assert {prof.parent for _, _, prof in calls["plan"]} == {keep}
    assert set(doc["profiles"]) == {"gpt-test", "gpt-test+ethernet"}
