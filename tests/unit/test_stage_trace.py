"""The runtime's traced pipeline stages timed against the eager model
(``docs/decisions/cpu-fidelity.md`` section 13): the ``traced_*`` records, the factor a
pipeline stage's layer times take from them, where it does not apply, and the measurement."""

from __future__ import annotations

import pytest

from hetplan.cost_models.profile_db import (
    CollectiveRecord,
    CollectiveSample,
    HandoverRecord,
    HandoverSample,
    ProfileDB,
)
from hetplan.ir.cluster import ClusterSpec

MS = 1e-3
#: gpt-test's fp32 parameters (the records' ``nbytes``)
GPT_BYTES = 939_520


def _line(collective: str, group: int, alpha_s: float) -> CollectiveRecord:
    return CollectiveRecord(collective=collective,  # type: ignore[arg-type]
                            backend="gloo", link_kind="loopback", group_size=group,
                            alpha_s=alpha_s, beta_s_per_byte=1e-9,
                            samples=(CollectiveSample(nbytes=4096, seconds=alpha_s),))


def _traced(operation: str, eager_s: float, traced_s: float, group: int = 4
            ) -> HandoverRecord:
    return HandoverRecord(operation=operation,  # type: ignore[arg-type]
                          backend="gloo", link_kind="loopback", group_size=group,
                          processes=4, nbytes=GPT_BYTES, micro_batch=2,
                          samples=(HandoverSample(burst_s=eager_s, seconds=traced_s),))


LINES = (_line("p2p", 2, 0.3 * MS), _line("allreduce", 4, 4.0 * MS),
         _line("allreduce", 2, 0.3 * MS))
P2P = HandoverRecord(operation="p2p", backend="gloo", link_kind="loopback", group_size=2,
                     processes=4, nbytes=4096,
                     samples=(HandoverSample(burst_s=0.0, seconds=0.5 * MS),))
#: the traced stages: forward 3 times the eager one, backward 1.25 times
TRACED = (_traced("traced_forward", 1 * MS, 3 * MS),
          _traced("traced_backward", 2 * MS, 2.5 * MS))
BASE = ProfileDB(collectives=LINES, handovers=(P2P,))
WITH = ProfileDB(collectives=LINES, handovers=(P2P, *TRACED))
PP = dict(dp=1, pp=4, tp=1, zero_stage=0, schedule="1f1b", recompute="none")


def _plan(db: ProfileDB, model: str = "gpt-test", batch: int = 8, **pins: object
          ):  # type: ignore[no-untyped-def]
    import hetplan

    return hetplan.compile(model, ClusterSpec.from_preset("local-cpu"), batch_size=batch,
                           profile=db, micro_batch_size=2, dtype="fp32", **pins)


def _priced(db: ProfileDB, **pins: object) -> tuple[object, ...]:
    plan = _plan(db, **pins)
    assert plan.predictions is not None
    return (plan.layout, plan.stages, plan.predictions.iteration_time_ms,
            plan.predictions.breakdown)


def _stage_times(db: ProfileDB, plan) -> list[tuple[float, ...]]:  # type: ignore[no-untyped-def]
    from hetplan import zoo
    from hetplan.cost_models.costs import CostModel
    from hetplan.cost_models.stage_times import stage_times
    from hetplan.ir.capture import capture
    from hetplan.ir.plan_sections import WorkloadSummary

    args, kwargs = zoo.example_inputs("gpt-test", batch=1, device="meta")
    ir = capture(zoo.build("gpt-test", device="meta"), args, kwargs, name="gpt-test")
    workload = WorkloadSummary.from_model_ir(ir)
    costs = CostModel(ClusterSpec.from_preset("local-cpu"), db, dtype="fp32")
    return [stage_times(workload, st, plan.layout, costs, 2, 2 / workload.batch_size)[:2]
            for st in plan.stages]


def test_a_pipeline_stage_runs_at_the_traced_ratio() -> None:
    plan = _plan(WITH, **PP)
    base, traced = _stage_times(BASE, plan), _stage_times(WITH, plan)
    assert len(base) == 4
    for (bf, bb), (tf, tb) in zip(base, traced):
        assert tf == pytest.approx(3.0 * bf, rel=1e-9)
        assert tb == pytest.approx(1.25 * bb, rel=1e-9)
    with_plan, base_plan = _plan(WITH, **PP), _plan(BASE, **PP)
    assert with_plan.predictions is not None and base_plan.predictions is not None
    assert (with_plan.predictions.breakdown.compute_ms
            > base_plan.predictions.breakdown.compute_ms * 1.2)


def test_the_ratio_does_not_apply_where_the_run_is_not_traced_or_not_measured() -> None:
    # one stage: the runtime runs the eager model
    dp = dict(dp=4, pp=1, tp=1, zero_stage=0)
    assert _priced(WITH, **dp) == _priced(BASE, **dp)
    # the node's processes (4 on local-cpu) are not the records'
    two = ProfileDB(collectives=LINES, handovers=(P2P, *(_traced(r.operation, 1 * MS, 3 * MS,
                                                                 group=2) for r in TRACED)))
    assert _priced(two, **PP) == _priced(BASE, **PP)
    # only the forward measured
    assert _priced(ProfileDB(collectives=LINES, handovers=(P2P, TRACED[0])), **PP) == _priced(
        BASE, **PP)
    # a TP pipeline runs the model's own sharded modules
    pp_tp = dict(dp=1, pp=2, tp=2, zero_stage=0, schedule="1f1b", recompute="none")
    assert (_priced(WITH, model="megatron-gpt-test", batch=4, **pp_tp)
            == _priced(BASE, model="megatron-gpt-test", batch=4, **pp_tp))
    # (while the records' pipeline plan does change: the comparisons can fail)
    assert _priced(WITH, **PP) != _priced(BASE, **PP)


def test_the_charge_is_deterministic() -> None:
    assert _plan(WITH, **PP).to_json() == _plan(WITH, **PP).to_json()


@pytest.mark.dist
def test_profile_traced_stages_times_the_traced_split_beside_the_eager_model() -> None:
    from hetplan.profiling.stage_trace import profile_traced_stages

    recs, times = profile_traced_stages("gpt-test", 2, batch_size=2, rounds=3, warmup=1,
                                        passes=1, timeout_s=240)
    assert [r.operation for r in recs] == ["traced_forward", "traced_backward"]
    for r in recs:
        assert (r.group_size, r.processes, r.nbytes, r.micro_batch) == (2, 2, GPT_BYTES, 2)
        assert r.samples[0].seconds > 0.0 and r.samples[0].burst_s > 0.0
    assert times is not None and times.stages == 4  # a boundary before blocks 1, 2 and 3


def test_profile_traced_stages_rejects_bad_input() -> None:
    from hetplan.profiling.stage_trace import profile_traced_stages

    with pytest.raises(ValueError, match="world_size"):
        profile_traced_stages("gpt-test", 1)
    with pytest.raises(ValueError, match="passes"):
        profile_traced_stages("gpt-test", 2, passes=0)
    assert profile_traced_stages("gpt-test", 2, max_params=1000) == ([], None)
