"""Gemini's chunks go at the plan's times, and the run report records every round.

4 gloo ranks as 4 nodes (``cpu-4-nodes``), pp=2 × dp=2, m = 2, under ``hetplan run
--report``. The plan's idle spans are predicted for a 10 Gb/s cluster (an iteration of about
3 ms, spans within its first 3.3 ms); this emulation's iterations take tens of ms, so the test
stretches the spans' offsets by ``STRETCH`` (a valid plan: the same chunks, later spans) so
that waiting for a span is visible. It checks, per rank and round:

* the chunks are sent in the plan's order (:func:`timetable`), bytes covering the snapshot;
* a chunk is never sent before its span unless the next step released it (``released``),
  and one sent ``on_time`` is at most ``TOLERANCE_MS`` after its span's start (a thread's
  wake-up on a loaded machine; a chunk behind a slow one is ``late`` and goes at once);
* every round ends (no hang) and the next step waited for it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from faultlib import start

import hetplan
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan import Plan
from hetplan.runtime.checkpoint_schedule import timetable

pytestmark = pytest.mark.dist

CLUSTER = Path(__file__).resolve().parents[1] / "fixtures" / "clusters" / "cpu-4-nodes.yaml"
STEPS, WARMUP = 6, 2  # hetplan run warms up 2 iterations
STRETCH = 40.0  # spans at 0 … 84 ms after the step's start (the step takes ~130-160 ms)
TOLERANCE_MS = 500.0


def _plan(path: Path) -> Plan:
    p = hetplan.compile("gpt-test", ClusterSpec.load(CLUSTER), batch_size=8, pp=2, dp=2,
                        zero_stage=0, passes="dynpipe,even-tp,ddp-buckets,gemini{replicas=2}")
    ck = p.checkpointing
    assert ck is not None and ck.every_iters == 1
    scheds = tuple(s.model_copy(update={"spans": tuple(
        sp.model_copy(update={"start_ms": sp.start_ms * STRETCH}) for sp in s.spans)})
        for s in ck.schedules)
    p = p.model_copy(update={"checkpointing": ck.model_copy(update={"schedules": scheds})})
    p.save(path)
    return p


def test_chunks_follow_the_schedule_and_the_report_records_them(tmp_path: Path) -> None:
    plan = _plan(tmp_path / "plan.json")
    ck = plan.checkpointing
    assert ck is not None
    report = tmp_path / "report.json"
    job = start(tmp_path, str(tmp_path / "plan.json"), "--model", "gpt-test", "--steps",
                str(STEPS), "--report", str(report), timeout_s=30,
                env={"HETPLAN_CHECKPOINT_DIR": str(tmp_path / "store")})
    try:
        assert job.proc.wait(timeout=300) == 0, job.stderr()[-4000:]
    finally:
        job.cleanup()
    ranks = json.loads(report.read_text())["per_rank"]
    hows: dict[str, int] = {}
    for r in ranks:
        rounds = r["checkpoint_rounds"]
        assert [x["iteration"] for x in rounds] == list(range(1, STEPS + WARMUP + 1))
        for x in rounds:
            want = timetable(ck, r["rank"], x["bytes"])
            got = x["chunks"]
            assert [(c["holder"], c["span"], c["offset"], c["nbytes"]) for c in got] == [
                (s.holder, s.span, s.start, s.end - s.start) for s in want]
            assert [c["planned_ms"] for c in got] == [round(s.due_ms, 3) for s in want]
            sent = [c["sent_ms"] for c in got]
            assert sent == sorted(sent)  # in the plan's order
            for c in got:
                hows[c["how"]] = hows.get(c["how"], 0) + 1
                if c["how"] == "released":
                    continue
                assert c["sent_ms"] >= c["planned_ms"] - 0.001, c
                if c["how"] == "on_time":
                    assert c["sent_ms"] - c["planned_ms"] <= TOLERANCE_MS, c
            assert x["round_ms"] >= max(sent) >= x["serialise_ms"] - 0.001
            assert x["checkpoint_cpu_ms"] > 0
        # every round but the last was waited for by the next step, which then ran
        assert all(x["wait_before_step_ms"] is not None for x in rounds[:-1])
        assert all(x["train_cpu_ms"] is not None for x in rounds[:-1])
    assert hows.get("on_time", 0) > 0, hows  # the schedule's waits happened
