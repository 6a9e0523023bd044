"""The ``sdpipe`` pass and its ``group_sync`` plan section, through ``compile``."""

from __future__ import annotations

import pytest

from hetplan import compile
from hetplan.errors import SpecError
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan import Plan
from hetplan.ir.plan_group_sync import GroupSync
from hetplan.passes import get_all_passes
from hetplan.passes.sdpipe import SDPipe

PIPE = "uniform-stages,even-tp,ddp-buckets,sdpipe{{mode={mode}}}"


def _cluster(stragglers=None):
    data = ClusterSpec.from_preset("cpu-2x2").model_dump(mode="json", exclude_none=True)
    return ClusterSpec.from_dict({**data, **({"stragglers": stragglers} if stragglers else {})})


def _plan(mode="auto", stragglers=None, dp=2, pp=2):
    return compile("gpt-test", _cluster(stragglers), batch_size=8, dp=dp, pp=pp, zero_stage=0,
                   passes=PIPE.format(mode=mode))


def test_registered_under_its_name():
    assert get_all_passes()["sdpipe"] is SDPipe


def test_auto_keeps_allreduce_without_stragglers_and_picks_sdpipe_with_them():
    calm = _plan().group_sync
    assert calm.policy == "allreduce" and calm.speedup == pytest.approx(1.0)
    assert "kept all-reduce" in calm.reason
    hete = _plan(stragglers={"probability": 0.1, "delay_s": 0.3}).group_sync
    assert hete.policy == "sdpipe" and hete.speedup > 1.2
    assert [p.policy for p in hete.predictions] == ["allreduce", "sdpipe", "adpsgd"]
    assert (hete.num_stages, hete.num_pipelines, hete.p) == (2, 2, 10)
    assert hete.stragglers.probability == 0.1 and hete.stragglers.delay_ms == 300.0
    assert hete.communicator == "prebuilt"
    # the window is 1/N of the slowest replica's iteration
    assert hete.window_ms == pytest.approx(calm.window_ms)


def test_mode_sdpipe_forces_it_and_the_plan_is_deterministic():
    a, b = _plan("sdpipe"), _plan("sdpipe")
    assert a.group_sync.policy == "sdpipe"
    assert "requested" in a.group_sync.reason
    assert a.to_json() == b.to_json()
    assert Plan.from_json(a.to_json()) == a


def test_one_pipeline_stays_allreduce_with_the_reason():
    gs = _plan("sdpipe", dp=1, pp=2).group_sync
    assert gs.policy == "allreduce" and "dp=1" in gs.reason


def test_section_checks():
    with pytest.raises(ValueError, match="num_pipelines >= 2"):
        GroupSync(requested="sdpipe", policy="sdpipe", num_stages=1, num_pipelines=1)
    plan = _plan("sdpipe")
    bad = plan.group_sync.model_copy(update={"num_pipelines": 4})
    with pytest.raises(ValueError, match=r"group_sync: mesh 2 x 4 .* pp=2, dp=2"):
        Plan.model_validate({**plan.model_dump(), "group_sync": bad.model_dump()})


def test_bad_options_name_the_option():
    with pytest.raises(SpecError, match=r"sdpipe\{p=0\}"):
        SDPipe(p=0)
    with pytest.raises(SpecError, match="window-ms"):
        SDPipe(window_ms=-1.0)


def test_cli_option_appends_the_pass_and_pins_zero():
    from hetplan.cli import _with_group_sync

    assert _with_group_sync(None, "off") == (None, {})
    spec, opts = _with_group_sync("uniform-stages", "auto")
    assert spec == "uniform-stages,sdpipe{mode=auto}" and opts == {"zero_stage": 0}
    assert _with_group_sync("uniform-stages,sdpipe{mode=sdpipe p=4}", "sdpipe")[0] == \
        "uniform-stages,sdpipe{mode=sdpipe p=4}"
    with pytest.raises(SpecError, match="disagree"):
        _with_group_sync("uniform-stages,sdpipe{mode=sdpipe}", "auto")
    with pytest.raises(SpecError, match="did you mean 'auto'"):
        _with_group_sync(None, "atuo")


def test_inspect_shows_the_policy_and_its_prediction():
    from hetplan.report.inspect import build_report
    from hetplan.report.render import render_text

    plan = _plan(stragglers={"probability": 0.1, "delay_s": 0.3})
    report = build_report(plan)
    assert report["group_sync"]["policy"] == "sdpipe"
    text = render_text(report, sections=["group_sync"])
    assert "group sync: sdpipe (asked: auto) on 2 stage(s) x 2 pipeline(s)" in text
    assert "P=10 groups" in text and "+300.0 ms with probability 0.1" in text
    assert "allreduce" in text and "adpsgd" in text
    assert build_report(_plan(stragglers=None).model_copy(update={"group_sync": None})
                        )["group_sync"] is None


def test_the_runtime_refuses_what_group_sync_does_not_compose_with():
    from hetplan.runtime.composition import refusals

    plan = _plan("sdpipe")
    assert refusals(plan) == []
    gs = plan.group_sync
    lay = plan.layout
    bad = plan.model_copy(update={
        "layout": lay.model_copy(update={"zero_stage": 1}),
        "group_sync": gs.model_copy(update={"optimizer_state": "adam-correction"})})
    lines = refusals(bad)
    assert any(line.startswith("group_sync: SDPipe group sync with ZeRO-1") for line in lines)
    assert any(line.startswith("group_sync.optimizer_state: 'adam-correction'")
               for line in lines)
    off = plan.model_copy(update={"group_sync": gs.model_copy(update={"policy": "allreduce"})})
    assert refusals(off) == []
