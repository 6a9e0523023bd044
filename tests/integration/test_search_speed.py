"""The fast layout search: its lower bounds never exceed a screened prediction, pruning does
not change the plan, the progress bar appears only when allowed, and ``hetplan plan``'s
strategy pins are checked before anything is planned. No timed assertions (search times are
in ``bench/plan_time.py``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hetplan import compile
from hetplan.cli import app
from hetplan.ir.model import ModelIR
from hetplan.ir.plan import load_plan
from hetplan.optimizer import compile as compile_module
from hetplan.optimizer.bounds import bounds_apply, iteration_lower_bound
from hetplan.optimizer.compile import _workload
from hetplan.optimizer.progress import Progress, search_progress

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
WORKLOAD = GOLDEN / "inspect_small.workload.json"


@pytest.fixture(scope="module")
def gpt_test() -> ModelIR:
    return _workload("gpt-test", None, None, None)


def _jobs(ir: ModelIR, cluster: str, batch: int, **kw: object) -> tuple[object, list[object]]:
    """The compile job and its candidates, built the way ``compile`` builds them."""
    seen: dict[str, object] = {}
    real = compile_module._screen

    def spy(job, candidates, infeasible, progress=None):  # type: ignore[no-untyped-def]
        seen["job"], seen["candidates"] = job, list(candidates)
        return real(job, candidates, infeasible, progress)

    compile_module._screen = spy  # type: ignore[assignment]
    try:
        compile(ir, cluster, batch_size=batch, **kw)
    finally:
        compile_module._screen = real  # type: ignore[assignment]
    return seen["job"], seen["candidates"]  # type: ignore[return-value]


@pytest.mark.parametrize("cluster,batch,kw", [
    ("mixed-generations", 64, {}),
    ("a100-nvlink-8x8", 64, {"schedule": "interleaved-1f1b"}),
    ("cpu-2x2-slow", 8, {"schedule": "gpipe"}),
])
def test_lower_bound_never_exceeds_the_screened_prediction(
        gpt_test: ModelIR, cluster: str, batch: int, kw: dict[str, object]) -> None:
    job, candidates = _jobs(gpt_test, cluster, batch, **kw)
    assert bounds_apply(job.screening, job.opts.schedule)  # type: ignore[attr-defined]
    checked = 0
    for cand in candidates:
        scored = compile_module._screen_one(job, cand, [])  # type: ignore[arg-type]
        if scored is None:
            continue
        bound = iteration_lower_bound(job.workload, job.costs, cand,  # type: ignore[attr-defined]
                                      job.opts.schedule, job.zero_ladder(cand))  # type: ignore[attr-defined]
        assert 0 < bound <= scored[0], (cand.describe(), bound, scored[0])
        checked += 1
    assert checked >= 5


def test_pruning_keeps_the_plan(gpt_test: ModelIR, monkeypatch: pytest.MonkeyPatch) -> None:
    pruned = compile(gpt_test, "mixed-generations", batch_size=64)
    note = pruned.pass_log[0].notes[0]
    count = re.search(r"(\d+) pruned by lower bounds", note)
    assert count is not None and int(count.group(1)) > 0, note
    monkeypatch.setattr(compile_module, "bounds_apply", lambda *a: False)
    full = compile(gpt_test, "mixed-generations", batch_size=64)
    assert "pruned" not in full.pass_log[0].notes[0]
    # the note's counts differ by construction: pruned layouts are not screened, so the
    # ones among them that would not fit are not counted as infeasible either
    def counts(text: str) -> tuple[str, list[int]]:
        text = re.sub(r"\d+ pruned by lower bounds, ", "", text)
        found = [int(n) for n in re.findall(r"(\d+) infeasible", text)]
        return re.sub(r"\d+ infeasible", "N infeasible", text), found

    strip, pruned_infeasible = counts(pruned.to_json())
    same, full_infeasible = counts(full.to_json())
    assert strip == same
    assert all(a <= b for a, b in zip(pruned_infeasible, full_infeasible, strict=True))


def test_bounds_do_not_apply_when_a_pass_prunes_computation(gpt_test: ModelIR) -> None:
    from hetplan.optimizer.options import CompileOptions

    opts = CompileOptions.build(batch_size=8, tp_controller="zero")
    assert not bounds_apply(opts.pipeline(), "1f1b")
    assert not bounds_apply(CompileOptions.build(batch_size=8).pipeline(), "chimera")


def test_progress_bar_only_when_allowed_and_slow() -> None:
    quiet = Progress(5, enabled=False, delay_s=0.0)
    quiet.advance(5)
    assert not quiet.shown and quiet.done == 5
    early = Progress(5, enabled=True, delay_s=3600.0)
    early.advance(1)
    assert not early.shown
    with search_progress(5, show=True, delay_s=0.0) as shown:
        shown.advance(2)
        assert shown.shown
    assert not shown.shown  # closed (transient) at the end
    with search_progress(5, show=None, delay_s=0.0) as auto:  # pytest's stderr is no TTY
        auto.advance(5)
        assert not auto.shown


def _plan_cli(*args: object) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["plan", "--workload", str(WORKLOAD), "-c", "cpu-2x2",
                                      "-b", "8", *[str(a) for a in args]])
    return result.exit_code, result.output


@pytest.mark.parametrize("args,blamed", [
    (("--zero", 4), "--zero 4"),
    (("--recompute", "partial"), "--recompute 'partial'"),
    (("--sp", "--tp", 1), "--sp needs tensor parallelism"),
    # was: a plan without ZeRO, without a word
    (("--zero", 2, "--dp", 1), "--zero 2 shards state inside data-parallel groups, but --dp 1"),
    (("--virtual-stages", 2), "--virtual-stages needs --schedule interleaved-1f1b or auto"),
    (("--virtual-stages", 1, "--schedule", "interleaved-1f1b"), "--virtual-stages 1"),
    (("--dtype", "bf32"), "--dtype 'bf32'"),
])
def test_strategy_pins_are_refused_naming_the_option(
        args: tuple[object, ...], blamed: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_compile(*a: object, **k: object) -> None:
        raise AssertionError("compile ran before the options were checked")

    monkeypatch.setattr(compile_module, "compile", no_compile)
    code, out = _plan_cli(*args)
    assert code == 2, out
    assert blamed in " ".join(out.split()), out


def test_strategy_pins_reach_the_plan(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    # --dp 4: on cpu-2x2's measured loopback (7.5 Gbit/s, 800 us per step) the search
    # prefers a 4-stage pipeline without data parallelism, where ZeRO has nothing to shard
    code, text = _plan_cli("--dp", 4, "--zero", 2, "--recompute", "full", "--dtype", "bf16",
                           "--no-progress", "-o", out)
    assert code == 0, text
    plan = load_plan(out)
    assert plan.layout is not None and plan.layout.zero_stage == 2
    assert {st.recompute for st in plan.stages} == {"full"}
    assert plan.precision is not None and plan.precision.policy == "bf16"
