"""The per-action trace of a step (``hetplan run --trace``) on gloo, 2 processes.

Every rank traces its second step of a 1F1B plan, an interleaved plan (two chunks per rank)
and a data-parallel plan whose gradient sync runs a compressed path on the sync's worker
thread. The trace must hold every action of the rank's lowered schedule, in the order it
ran, with each compute span of the plan's list inside its action and every duration >= 0;
its Chrome trace-event export must be valid JSON that ``hetplan inspect --trace`` reads;
the step that was not traced leaves no span, and a runtime never asked to trace installs
no marks.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from reflib import Blocks, case_results, run_each
from torch import nn

from hetplan.algorithms.pipeline_schedules import layout_actions
from hetplan.ir.capture import capture
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import (
    Bucket,
    ClusterRef,
    CommStep,
    CompressedSync,
    GradientSync,
    Layout,
    ModelRef,
    Stage,
)
from hetplan.profiling._spawn import run_local_ranks

pytestmark = pytest.mark.dist

BATCH, MICRO_BATCHES = 8, 4


def _blocks() -> nn.Module:
    torch.manual_seed(0)
    return Blocks()


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + step)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 3, generator=g)


def _plan(schedule: str, cuts: tuple[int, ...], virtual: int = 1, pp: int = 2,
          sync: GradientSync | None = None) -> Plan:
    ir = capture(_blocks(), torch.zeros(1, 8))
    names = [lay.name for lay in ir.layers]
    bounds = [0, *cuts, len(names)]
    layout = Layout(pp=pp, dp=2 // pp, micro_batches=MICRO_BATCHES,
                    micro_batch_size=BATCH // MICRO_BATCHES // (2 // pp), schedule=schedule,
                    virtual_stages=virtual)
    stages = tuple(Stage(index=s, first_layer=a, last_layer=b - 1, layer_names=tuple(names[a:b]),
                         ranks=(s % pp,) if pp > 1 else (0, 1))
                   for s, (a, b) in enumerate(itertools.pairwise(bounds)))
    return Plan(model=ModelRef.from_model_ir(ir),
                cluster=ClusterRef(name="cpu2", fingerprint="cpu2", world_size=2),
                layout=layout, stages=stages, pipeline_actions=layout_actions(layout),
                gradient_sync=sync)


def _compressed_sync() -> GradientSync:
    params = list(_blocks().named_parameters())[::-1]
    names = [n for n, _ in params]
    dgc = CompressedSync(compressor="topk", params={"ratio": 0.5}, error_feedback=True,
                         compress_device="cpu", decompress_device="cpu",
                         steps=(CommStep(routine="allgather", compressed=True),))
    return GradientSync(strategies={"topk": dgc},
                        buckets=(Bucket(tensors=tuple(names), strategy="topk",
                                         size_bytes=sum(p.numel() * 4 for _, p in params)),))


def _train(plan_json: str) -> dict[str, Any]:
    from hetplan.runtime.executor import Runtime
    from hetplan.runtime.handlers import StagesHandler
    from hetplan.runtime.trace import chrome_trace

    def sgd(ps: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(ps, lr=0.1)

    plan = Plan.from_json(plan_json)
    untraced = Runtime(plan, _blocks(), example_args=(torch.zeros(1, 8),), loss_fn=F.mse_loss,
                       optimizer=sgd)
    untraced.train_step(*_data(0))
    sched = untraced.handler(StagesHandler).schedule
    plain_map = sched is None or type(sched._comp_type_to_function_map) is dict
    untraced.close()
    rt = Runtime(plan, _blocks(), example_args=(torch.zeros(1, 8),), loss_fn=F.mse_loss,
                 optimizer=sgd)
    trace = rt.start_trace()
    rt.train_step(*_data(0))
    after_untraced_step = len(trace.spans)
    trace.start(2)
    rt.train_step(*_data(1))
    trace.stop()
    monitor = rt.handler(StagesHandler).monitor
    busy = monitor.busy_s if monitor is not None else None
    rt.train_step(*_data(2))  # not recorded either
    handler = rt.handler(StagesHandler)
    lowered = ([str(a) for a in handler.schedule.pipeline_order_with_comms[
        handler.schedule.rank]] if handler.schedule is not None else [])
    out = {"recording": trace.to_dict(), "spans_after": len(trace.spans),
           "after_untraced_step": after_untraced_step, "plain_map": plain_map,
           "lowered": lowered, "pp_rank": rt.ctx.groups.pp_rank, "busy_s": busy}
    gathered: list[Any] = [None, None]
    torch.distributed.all_gather_object(gathered, trace.to_dict())
    out["chrome"] = json.dumps(chrome_trace(gathered, {"step": 2, "plan_digest": None}))
    rt.close()
    return out


def _worker(rank: int, world: int, runs: dict[str, str]) -> dict[str, Any]:
    torch.set_num_threads(1)
    return run_each(runs, _train)


PLANS = {
    "1f1b": lambda: _plan("1f1b", (2,)),
    "interleaved": lambda: _plan("interleaved-1f1b", (1, 2, 3), virtual=2),
    "dp-compressed": lambda: _plan("1f1b", (), pp=1, sync=_compressed_sync()),
    "chimera": lambda: _plan("chimera", (2,)),
}


@pytest.fixture(scope="module")
def runs() -> tuple[dict[str, Plan], dict[str, list[dict[str, Any]]]]:
    plans = {k: make() for k, make in PLANS.items()}
    outs = run_local_ranks(_worker, 2, ({k: p.to_json() for k, p in plans.items()},),
                           timeout_s=600)
    return plans, {k: case_results(outs, k) for k in plans}


def _spans(out: dict[str, Any], cat: str) -> list[list[Any]]:
    return [s for s in out["recording"]["spans"] if s[1] == cat]


@pytest.mark.parametrize("label", ["1f1b", "interleaved"])
def test_every_action_of_the_plan_is_traced_in_order(runs: Any, label: str) -> None:
    plans, outs = runs
    plan = plans[label]
    assert plan.pipeline_actions is not None
    for out in outs[label]:
        want = plan.pipeline_actions.ranks[out["pp_rank"]].split()
        computed = [f"{s[4]['stage']}{s[4]['kind']}{s[4]['microbatch']}"
                    for s in _spans(out, "compute")]
        assert computed == want, f"pipeline rank {out['pp_rank']}"
        actions = _spans(out, "action")
        assert [s[4]["index"] for s in actions] == list(range(len(out["lowered"])))
        assert [f"{s[4]['stage']}{s[4]['kind']}{s[4]['microbatch']}" for s in actions
                if s[4]["kind"] in ("F", "B")] == want
        starts = [s[2] for s in actions]
        assert starts == sorted(starts), "actions in the order they ran"
        for s in out["recording"]["spans"]:
            assert s[3] >= s[2], s
        for c in _spans(out, "compute"):  # inside the action that ran it
            a = next(x for x in actions if x[4]["kind"] == c[4]["kind"]
                     and x[4]["microbatch"] == c[4]["microbatch"]
                     and x[4]["stage"] == c[4]["stage"])
            assert a[2] <= c[2] and c[3] <= a[3]
        non_first = [a for a in want if a[1] == "F" and a[0] != "0"]
        assert len([s for s in _spans(out, "wait") if s[4]["kind"] == "F"]) == len(non_first)


def test_every_action_of_a_chimera_list_is_traced_in_order(runs: Any) -> None:
    """Chimera runs on the runtime's own executor: one ``action`` span per action of the
    rank's list (no sends or receives of their own: each action's ``wait`` is inside it),
    its compute inside it, a wait for every forward that receives (the down stage 1 and the
    up stage 1, one per micro-batch on each rank), and a loss for every micro-batch whose
    last stage the rank runs (both ranks do, one direction each)."""
    plans, outs = runs
    plan = plans["chimera"]
    assert plan.pipeline_actions is not None
    for out in outs["chimera"]:
        want = plan.pipeline_actions.ranks[out["pp_rank"]].split()
        actions = _spans(out, "action")
        assert [f"{s[4]['stage']}{s[4]['kind']}{s[4]['microbatch']}" for s in actions] == want
        assert [s[4]["index"] for s in actions] == list(range(len(want)))
        assert [s[2] for s in actions] == sorted(s[2] for s in actions)
        computed = [f"{s[4]['stage']}{s[4]['kind']}{s[4]['microbatch']}"
                    for s in _spans(out, "compute")]
        assert computed == want
        for c in _spans(out, "compute") + _spans(out, "wait"):
            a = next(x for x in actions if x[4]["kind"] == c[4]["kind"]
                     and x[4]["microbatch"] == c[4]["microbatch"]
                     and x[4]["stage"] == c[4]["stage"])
            assert a[2] <= c[2] <= c[3] <= a[3]
        waits_f = [s for s in _spans(out, "wait") if s[4]["kind"] == "F"]
        assert len(waits_f) == len([a for a in want if a[1] == "F" and a[0] == "1"])
        assert len(_spans(out, "loss")) == MICRO_BATCHES // 2


def test_the_last_stage_traces_its_losses(runs: Any) -> None:
    _, outs = runs
    last = next(o for o in outs["1f1b"] if o["pp_rank"] == 1)
    assert sorted(s[4]["microbatch"] for s in _spans(last, "loss")) == list(range(MICRO_BATCHES))
    # the run report's compute counts the loss (it is not waiting): busy = compute + loss
    spent = sum(s[3] - s[2] for s in _spans(last, "compute") + _spans(last, "loss"))
    assert last["busy_s"] == pytest.approx(spent, rel=0.05, abs=2e-4)
    assert last["busy_s"] > sum(s[3] - s[2] for s in _spans(last, "compute"))


def test_a_data_parallel_step_traces_its_micro_batches_and_sync_path(runs: Any) -> None:
    _, outs = runs
    for out in outs["dp-compressed"]:
        computed = [(s[4]["kind"], s[4]["microbatch"]) for s in _spans(out, "compute")]
        assert computed == [(k, m) for m in range(MICRO_BATCHES) for k in "FB"], computed
        sync = _spans(out, "sync")
        names = [s[0] for s in sync]
        assert "launch bucket 0" in names
        assert "comp" in names and "decomp" in names, names
        assert all(s[5] == 1 for s in sync if s[0] != "launch bucket 0")
        phases = [s[0] for s in sorted(_spans(out, "phase"), key=lambda s: s[2])]
        assert phases[0] == "micro-batches" and phases[-1] == "optimizer step"
        assert "after_backward GradSyncHandler" in phases


@pytest.mark.parametrize("label", list(PLANS))
def test_only_the_chosen_step_is_recorded_and_no_marks_without_tracing(runs: Any,
                                                                        label: str) -> None:
    _, outs = runs
    for out in outs[label]:
        assert out["after_untraced_step"] == 0
        assert out["spans_after"] == len(out["recording"]["spans"]) > 0
        assert out["recording"]["step"] == 2
        assert out["plain_map"], "a runtime that never traced has torch's own action map"


@pytest.mark.parametrize("label", list(PLANS))
def test_the_export_is_valid_trace_event_json(runs: Any, label: str) -> None:
    from hetplan.report.trace_compare import load_trace

    _, outs = runs
    doc = json.loads(outs[label][0]["chrome"])
    load_trace(doc)
    complete = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in complete} == {0, 1}
    for e in complete:
        assert set(e) >= {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"}
        assert e["ts"] >= 0 and e["dur"] >= 0
    names = {(e["pid"], e["args"]["name"]) for e in doc["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert {p for p, _ in names} == {0, 1}
