"""``hetplan inspect / explain / diff / timeline`` on plans compiled from the model zoo.

The two zoo plans (gpt2 on ``a100-nvlink-8x8``, llama-7b on ``mixed-generations``) are
compiled once per module (about 10 s together, most of it capturing GPT-2 with
``torch.export``). Expected values come from the plan objects and the cluster presets, not
from the report code.
"""

from __future__ import annotations

import inspect
import json
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

import hetplan
from hetplan.cli import app
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan import Bucket, Plan, load_plan
from hetplan.report.inspect import SECTIONS

ZOO = {"gpt2": ("gpt2", "a100-nvlink-8x8"), "llama": ("llama-7b", "mixed-generations")}
#: llama-7b pinned to tensor parallelism: the TP views below need TP groups, and whether the
#: free search picks tp > 1 for it on this cluster moves with the cost model
PINS: dict[str, dict[str, int]] = {"llama": {"tp": 2}}


def run(*args: str | Path) -> Result:
    if "mix_stderr" in inspect.signature(CliRunner.__init__).parameters:  # click < 8.2
        runner = CliRunner(mix_stderr=False)  # type: ignore[call-arg]
    else:
        runner = CliRunner()
    return runner.invoke(app, [str(a) for a in args])


def flat(text: str) -> str:
    return " ".join(text.split())


def assert_ok(r: Result) -> str:
    assert r.exit_code == 0, f"exit {r.exit_code}\n{r.stdout}\n{r.stderr}\n{r.exception!r}"
    return flat(r.stdout)


def assert_user_error(r: Result, *needles: str) -> str:
    msg = flat(r.stderr)
    assert r.exit_code == 2, f"exit {r.exit_code}: {r.stdout}\n{msg}\n{r.exception!r}"
    assert isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.stdout + r.stderr
    assert msg.count("error:") == 1, msg
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"
    return msg


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Plan, Path]]:
    folder = tmp_path_factory.mktemp("zoo-plans")
    out = {}
    for key, (model, cluster) in ZOO.items():
        plan = hetplan.compile(model, cluster, batch_size=64, **PINS.get(key, {}))
        path = folder / f"{key}.json"
        plan.save(path)
        out[key] = (plan, path)
    return out


# --------------------------------------------------------------------------------------
# inspect
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("key", list(ZOO))
def test_inspect_zoo_plans(plans: dict[str, tuple[Plan, Path]], key: str) -> None:
    plan, path = plans[key]
    text = assert_ok(run("inspect", path))
    lay = plan.layout
    assert lay is not None and plan.predictions is not None and plan.gradient_sync is not None
    assert f"layout: dp={lay.dp} pp={lay.pp} tp={lay.tp}, schedule {lay.schedule}" in text
    devices = ClusterSpec.from_preset(ZOO[key][1]).devices()
    for st in plan.stages:
        types = Counter(devices[r].type for r in st.ranks)
        mix = " + ".join(f"{n}× {t}" for t, n in sorted(types.items()))
        assert mix in text, mix
        assert f"{st.fwd_ms:.3f}" in text and f"{st.bwd_ms:.3f}" in text
    t = plan.predictions.iteration_time_ms
    assert f"predicted iteration time: {t:.3f} ms" in text
    for b in plan.predictions.baselines:
        assert f"baseline {b.name}: {b.iteration_time_ms:.3f} ms " \
               f"({b.iteration_time_ms / t:.2f}×)" in text
    assert f"in {len(plan.gradient_sync.buckets)} bucket(s)" in text
    assert "cost provenance:" in text and "compute: analytic" in text
    assert "analytic-costs" in text  # no profile DB: the warning says so


def test_inspect_llama_shows_tp_and_memory_headroom(
    plans: dict[str, tuple[Plan, Path]],
) -> None:
    plan, path = plans["llama"]
    r = run("inspect", path, "--json")
    assert_ok(r)
    data = json.loads(r.stdout)
    assert plan.layout is not None and plan.predictions is not None
    assert data["tp"]["degree"] == plan.layout.tp
    assert sum(g["count"] for g in data["tp"]["groups"]) == plan.layout.dp * plan.layout.pp
    spec = ClusterSpec.from_preset("mixed-generations")
    mem = plan.predictions.memory_per_rank_bytes
    for row in data["memory"]["per_device_type"]:
        ranks = [r for r, d in enumerate(spec.devices()) if d.type == row["device_type"]]
        cap = next(d.memory_bytes for d in spec.devices() if d.type == row["device_type"])
        assert row["max_bytes"] == max(mem[r] for r in ranks)
        assert row["headroom_bytes"] == int(cap * 0.9) - row["max_bytes"]
    assert data["memory"]["peak"]["max_bytes"] == max(mem)


def test_inspect_json_is_sorted_and_complete(plans: dict[str, tuple[Plan, Path]]) -> None:
    plan, path = plans["gpt2"]
    r = run("inspect", path, "--json")
    assert_ok(r)
    data = json.loads(r.stdout)
    assert r.stdout == json.dumps(data, sort_keys=True, indent=2) + "\n"
    assert set(SECTIONS) | {"summary", "report_version"} == set(data)
    assert plan.model.workload is not None and plan.gradient_sync is not None
    assert sum(s["tensors"] for s in data["sync"]["strategies"]) \
        + data["sync"]["implicit_fp32_tensors"] == len(plan.model.workload.grads)
    sizes = sorted(b.size_bytes for b in plan.gradient_sync.buckets)
    assert (data["sync"]["buckets"]["min_bytes"], data["sync"]["buckets"]["max_bytes"]) == \
        (sizes[0], sizes[-1])
    assert data["summary"]["layout"] == plan.summary().layout


def test_inspect_sections(plans: dict[str, tuple[Plan, Path]]) -> None:
    _, path = plans["llama"]
    text = assert_ok(run("inspect", path, "--section", "memory"))
    assert "memory per rank" in text and "pipeline stages" not in text
    assert "predicted iteration time" not in text
    text = assert_ok(run("inspect", path, "-s", "stages", "-s", "warnings"))
    assert "pipeline stages" in text and "warnings" in text and "memory per rank" not in text
    data = json.loads(run("inspect", path, "--json", "-s", "tp").stdout)
    assert list(data) == ["tp"]


def test_inspect_help_names_every_section() -> None:
    """Was: --help listed 8 of the 11 sections --section takes."""
    text = assert_ok(run("inspect", "--help"))
    missing = [name for name in SECTIONS if name not in text]
    assert not missing, missing


def test_inspect_unknown_section(plans: dict[str, tuple[Plan, Path]]) -> None:
    _, path = plans["gpt2"]
    assert_user_error(run("inspect", path, "--section", "memroy"),
                      "'memroy' is not a section", "did you mean 'memory'")


# --------------------------------------------------------------------------------------
# explain
# --------------------------------------------------------------------------------------
def test_explain_targets_on_zoo_plans(plans: dict[str, tuple[Plan, Path]]) -> None:
    plan, path = plans["llama"]
    assert plan.gradient_sync is not None and plan.predictions is not None
    stored = plan.predictions.iteration_time_ms
    i = next(i for i, b in enumerate(plan.gradient_sync.buckets) if len(b.tensors) > 1)
    tensor = plan.gradient_sync.buckets[i].tensors[0]
    for target in (f"bucket:{i}", "stage:1", "rank:20", tensor):
        text = assert_ok(run("explain", path, target))
        assert f"predicted iteration time as planned: {stored:.3f} ms" in text
        assert "verdict:" in text
    text = assert_ok(run("explain", path, "stage:1"))
    last_of_stage0 = plan.stages[0].layer_names[-1]
    assert f"move {last_of_stage0} from stage 0 to stage 1" in text
    data = json.loads(run("explain", path, f"bucket:{i}", "--json").stdout)
    assert data["kind"] == "bucket" and data["current_ms"] == pytest.approx(stored, abs=1e-6)
    assert [a["name"] for a in data["alternatives"]][0].startswith("split into")


def test_explain_gpt2_bucket_split_matches_a_hand_edit(
    plans: dict[str, tuple[Plan, Path]],
) -> None:
    plan, path = plans["gpt2"]
    sync = plan.gradient_sync
    assert sync is not None and plan.model.workload is not None
    b = sync.buckets[2]
    size = {g.name: g.size_bytes for g in plan.model.workload.grads}
    split = [Bucket(tensors=(t,), size_bytes=size[t], strategy=b.strategy) for t in b.tensors]
    edited = plan.model_copy(update={"gradient_sync": sync.model_copy(
        update={"buckets": sync.buckets[:2] + tuple(split) + sync.buckets[3:]})})
    expected = hetplan.simulate(Plan.model_validate(edited.model_dump())).iteration_time_ms
    data = json.loads(run("explain", path, "bucket:2", "--json").stdout)
    alt = data["alternatives"][0]
    assert alt["name"] == f"split into {len(b.tensors)} per-tensor operations"
    assert alt["iteration_time_ms"] == pytest.approx(expected, abs=1e-6)


def test_explain_unknown_target_names_the_nearest(plans: dict[str, tuple[Plan, Path]]) -> None:
    _, path = plans["gpt2"]
    assert_user_error(run("explain", path, "transformer.h.3.attn.c_atn.weight"),
                      "unknown target", "transformer.h.3.attn.c_attn.weight")
    assert_user_error(run("explain", path, "rank:64"), "64 rank(s)", "rank:63")


# --------------------------------------------------------------------------------------
# diff
# --------------------------------------------------------------------------------------
def test_diff_of_two_zoo_plans(plans: dict[str, tuple[Plan, Path]]) -> None:
    (a, pa), (b, pb) = plans["gpt2"], plans["llama"]
    text = assert_ok(run("diff", pa, pb))
    assert "different models" in text
    assert a.predictions is not None and b.predictions is not None
    ta, tb = a.predictions.iteration_time_ms, b.predictions.iteration_time_ms
    assert f"iteration time: {ta:.3f} ms → {tb:.3f} ms ({tb - ta:+.3f} ms" in text
    data = json.loads(run("diff", pa, pb, "--json").stdout)
    assert data["predictions"]["iteration_time_ms"]["delta"] == pytest.approx(tb - ta, abs=1e-6)
    peak = data["predictions"]["peak_memory_bytes"]
    assert peak["delta"] == max(b.predictions.memory_per_rank_bytes) \
        - max(a.predictions.memory_per_rank_bytes)
    assert a.layout is not None and b.layout is not None
    assert (data["layout"]["tp"]["a"], data["layout"]["tp"]["b"]) == (a.layout.tp, b.layout.tp)
    assert "model" in data["changed_sections"] and not data["identical"]


def test_diff_after_a_hand_edit(tmp_path: Path) -> None:
    # one pipeline stage, so the first two buckets may be fused (the free search's gpt2 plan
    # puts one layer on each of 16 stages since the LM head is vocabulary-parallel)
    plan = hetplan.compile("gpt2", "a100-nvlink-8x8", batch_size=64, pp=1)
    path = tmp_path / "gpt2-pp1.json"
    plan.save(path)
    sync = plan.gradient_sync
    assert sync is not None
    merged = Bucket(tensors=sync.buckets[0].tensors + sync.buckets[1].tensors,
                    size_bytes=sync.buckets[0].size_bytes + sync.buckets[1].size_bytes,
                    strategy=sync.buckets[0].strategy)
    edited = Plan.model_validate(plan.model_copy(update={"gradient_sync": sync.model_copy(
        update={"buckets": (merged,) + sync.buckets[2:]})}).model_dump())
    edited = edited.model_copy(update={"predictions": hetplan.simulate(edited)})
    other = tmp_path / "edited.json"
    edited.save(other)
    text = assert_ok(run("diff", path, other))
    assert text.startswith(f"a: {path} b: {other} ")  # which plan each side of → is
    n = len(sync.buckets)
    assert f"buckets: {n} → {n - 1}" in text
    assert f"{len(merged.tensors)} tensor(s) in different buckets" in text
    assert assert_ok(run("diff", path, path)) == "the plans are identical"


# --------------------------------------------------------------------------------------
# timeline
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("suffix", [".html", ".png"])
def test_timeline(plans: dict[str, tuple[Plan, Path]], tmp_path: Path, suffix: str) -> None:
    pytest.importorskip("hetplan.report.timeline", reason="timeline renderer not installed")
    _, path = plans["llama"]
    target = tmp_path / f"llama{suffix}"
    r = run("timeline", path, "-o", target)
    assert_ok(r)
    assert target.is_file() and target.stat().st_size > 1000
    assert str(target) in r.stderr


def test_timeline_bad_suffix(plans: dict[str, tuple[Plan, Path]], tmp_path: Path) -> None:
    pytest.importorskip("hetplan.report.timeline", reason="timeline renderer not installed")
    assert_user_error(run("timeline", plans["gpt2"][1], "-o", tmp_path / "x.svg"), ".svg")


# --------------------------------------------------------------------------------------
# bad input: one message, exit 2, no traceback
# --------------------------------------------------------------------------------------
COMMANDS = {
    "inspect": lambda p, ok: ("inspect", p),
    "explain": lambda p, ok: ("explain", p, "rank:0"),
    "diff": lambda p, ok: ("diff", ok, p),
    "timeline": lambda p, ok: ("timeline", p, "-o", p.with_suffix(".html")),
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_bad_plan_files(plans: dict[str, tuple[Plan, Path]], tmp_path: Path,
                        command: str) -> None:
    ok = plans["gpt2"][1]
    text = ok.read_text()
    truncated = tmp_path / "truncated.json"
    truncated.write_text(text[: len(text) // 3])
    newer = tmp_path / "newer.json"
    newer.write_text(json.dumps({**json.loads(text), "schema_version": 7,
                                 "tool_version": "99.0.0"}))
    args = COMMANDS[command]
    assert_user_error(run(*args(tmp_path / "missing.json", ok)), "missing.json", "does not exist")
    assert_user_error(run(*args(truncated, ok)), "truncated.json", "not valid JSON")
    assert_user_error(run(*args(newer, ok)), "newer hetplan", "upgrade")


def test_plan_files_load_back(plans: dict[str, tuple[Plan, Path]]) -> None:
    for plan, path in plans.values():
        assert load_plan(path) == plan
