"""Property: bad input never crashes hetplan, never hangs, and gets one verdict everywhere.

Hypothesis mutates a valid cluster spec and a valid compiled plan across every field: a key
deleted, a value of the wrong JSON type, out of range (negative, zero, 1e308, a 400-digit
integer, NaN), huge (10**9, a 100,000-character string, 10,000 list items), a key written
twice, a value nested thousands of levels deep; and whole files truncated or emptied. Each
mutated file goes through every command, in-process through typer's ``CliRunner``:

- a plan: ``validate``, ``inspect``, ``simulate`` and the run preflight's plan loading
  (:func:`hetplan.ir.plan.load_plan`, what ``hetplan run`` and its workers call);
- a cluster spec: ``validate`` and ``plan`` (a small workload on that cluster).

Each command must accept the file (exit 0) or refuse it (exit 2) with a message that names
the file and, for a field, its path; never exit 1 ("internal error") or show a traceback,
never run past :data:`CASE_SECONDS`, and every command gives the verdict ``validate`` gives
(no plan accepted by one command and refused by a later one). The number of generated cases
is printed at the end of the run.
"""

from __future__ import annotations

import json
import math
import re
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from hetplan.cli import app
from hetplan.errors import HetplanError
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.model import ModelIR
from hetplan.ir.plan import Plan, load_plan
from hetplan.ir.plan_sections import Bucket, CompressedSync

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
#: No command may take longer than this on one mutated file (the slowest, `plan`, takes
#: about half a second on the small workload).
CASE_SECONDS = 20
PLAN_CASES = 70
CLUSTER_CASES = 40

COUNTS = {"plan": 0, "cluster": 0, "commands": 0}
Path_ = tuple[str | int, ...]


# -- the valid inputs ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def workload_file() -> Path:
    return GOLDEN / "inspect_small.workload.json"


@pytest.fixture(scope="module")
def base_plan(workload_file: Path) -> dict[str, Any]:
    """A compiled plan with every kind of section: two pipeline stages of dp=2 x tp=4 ranks,
    pipeline actions, TP groups with resizing roles, buckets, one of them compressed."""
    from hetplan.optimizer.compile import compile as compile_plan

    ir = ModelIR.load(workload_file)
    plan = compile_plan(ir, "mixed-tp-node", batch_size=64, dp=2, pp=2, tp=4,
                        tp_controller="semi")
    sync = plan.gradient_sync
    assert sync is not None and sync.buckets and plan.tensor_parallel is not None
    first = sync.buckets[0]
    sync = sync.model_copy(update={
        "strategies": {**sync.strategies,
                       "topk": CompressedSync(compressor="topk", params={"ratio": 0.01})},
        "buckets": (Bucket(tensors=first.tensors, size_bytes=first.size_bytes,
                           strategy="topk"), *sync.buckets[1:])})
    plan = Plan.model_validate(plan.model_copy(update={"gradient_sync": sync}).model_dump())
    return json.loads(plan.to_json())


@pytest.fixture(scope="module")
def base_cluster() -> dict[str, Any]:
    return json.loads(ClusterSpec.from_preset("mixed-tp-node").to_json())


@pytest.fixture(scope="module", autouse=True)
def _report_counts(pytestconfig: pytest.Config) -> Iterator[None]:
    yield
    reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    line = (f"bad-input property suite: {COUNTS['plan']} mutated plans and "
            f"{COUNTS['cluster']} mutated cluster specs, {COUNTS['commands']} command runs")
    if reporter is not None:
        reporter.write_line("")
        reporter.write_line(line)
    print(line)


# -- mutations ----------------------------------------------------------------------------------
def all_paths(data: Any, prefix: Path_ = ()) -> list[Path_]:
    """Every path to a value in ``data`` (the root excluded), containers included."""
    out: list[Path_] = []
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(
        data, list) else ()
    for key, value in items:
        path = (*prefix, key)
        out.append(path)
        out += all_paths(value, path)
    return out


def _get(data: Any, path: Path_) -> Any:
    for key in path:
        data = data[key]
    return data


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


WRONG_TYPES: list[Any] = ["text", True, None, [], {}, 1.5, 7]
OUT_OF_RANGE: list[Any] = [-1, 0, -0.001, 1e308, 10**400, float("nan"), float("inf"), ""]
HUGE: list[Any] = [10**9, 2**63, "x" * 100_000]


@st.composite
def mutations(draw: st.DrawFn, base: dict[str, Any]) -> tuple[str, str, Path_]:
    """A mutated document as text, the kind of mutation, and the path it touched."""
    data = json.loads(json.dumps(base))
    whole = draw(st.sampled_from(["field"] * 12 + ["truncate", "empty", "array"]))
    if whole == "truncate":
        text = json.dumps(data, indent=1)
        return text[: draw(st.integers(1, len(text) - 1))], whole, ()
    if whole == "empty":
        return draw(st.sampled_from(["", "   \n", "null"])), whole, ()
    if whole == "array":
        return "[1, 2, 3]", whole, ()
    path = draw(st.sampled_from(all_paths(data)))
    parent, key = _get(data, path[:-1]), path[-1]
    old = parent[key]
    kind = draw(st.sampled_from(["delete", "type", "range", "huge", "many", "nested",
                                 "duplicate"]))
    if kind == "duplicate" and isinstance(parent, dict):
        return dumps(data, duplicate=path), kind, path
    if kind == "delete" or kind == "duplicate":
        kind = "delete"
        if isinstance(parent, dict):
            del parent[key]
        else:
            parent.pop(key)
    elif kind == "type":
        parent[key] = draw(st.sampled_from([v for v in WRONG_TYPES
                                            if type(v) is not type(old)]))
    elif kind == "range":
        parent[key] = draw(st.sampled_from(OUT_OF_RANGE))
    elif kind == "huge":
        parent[key] = draw(st.sampled_from(HUGE))
    elif kind == "many":
        item = old[0] if isinstance(old, list) and old else old
        parent[key] = [item] * 10_000
    else:
        parent[key] = nested(draw(st.sampled_from([40, 100_000])))
    return dumps(data), kind, path


def dumps(data: Any, duplicate: Path_ | None = None, at: Path_ = ()) -> str:
    """JSON text of ``data``; the key at ``duplicate`` is written twice (its first copy
    holds a different value), which ``json.dumps`` cannot do."""
    if isinstance(data, dict):
        parts = []
        for key, value in data.items():
            path = (*at, key)
            if path == duplicate:
                parts.append(f"{json.dumps(key)}: {json.dumps('first copy')}")
            parts.append(f"{json.dumps(key)}: {dumps(value, duplicate, path)}")
        return "{" + ", ".join(parts) + "}"
    if isinstance(data, list):
        if len(data) > 1000:  # a huge list: the same item, written once and repeated
            item = dumps(data[0], duplicate, (*at, 0))
            return "[" + ", ".join([item] * len(data)) + "]"
        return "[" + ", ".join(dumps(v, duplicate, (*at, i)) for i, v in enumerate(data)) + "]"
    if isinstance(data, float) and not math.isfinite(data):
        return json.dumps(data)  # NaN / Infinity: what Python's json writes
    return json.dumps(data)


# -- running the commands -----------------------------------------------------------------------
class Hang(BaseException):
    """A command ran past CASE_SECONDS (a BaseException: no `except Exception` swallows it)."""


@contextmanager
def bounded(seconds: float) -> Iterator[None]:
    def alarm(signum: int, frame: Any) -> None:
        raise Hang(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


runner = CliRunner()


def run_cli(args: list[str]) -> tuple[int, str]:
    COUNTS["commands"] += 1
    with bounded(CASE_SECONDS):
        result = runner.invoke(app, args)
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        f"`hetplan {' '.join(args)}` raised {result.exception!r}")
    return result.exit_code, result.output


def run_load_plan(path: Path) -> tuple[int, str]:
    """What `hetplan run` does with a plan before any rank starts: load_plan."""
    COUNTS["commands"] += 1
    with bounded(CASE_SECONDS):
        try:
            load_plan(path)
        except HetplanError as e:
            return 2, f"error: {e}"
    return 0, ""


def check_refusal(command: str, code: int, output: str, file: Path, kind: str,
                  path: Path_) -> None:
    """A command either accepts (0) or refuses (2) with a message naming the file and,
    for a field, a field path; never an internal error."""
    assert "Traceback" not in output, f"{command}: traceback\n{output}"
    assert "internal error" not in output and code != 1, f"{command}: internal error\n{output}"
    assert code in (0, 2), f"{command}: exit {code}\n{output}"
    if code == 0:
        return
    assert str(file) in output, f"{command}: the message does not name {file}\n{output}"
    if kind in ("delete", "type", "range", "huge", "many") and path:
        # "<file>: some.field[0].path: what is wrong" on some line
        field = re.compile(re.escape(str(file)) + r": [A-Za-z_][\w]*(\.\w+|\[[^\]]+\])*[:.]")
        assert field.search(output.replace("\n", " ")) or "nested" in output, (
            f"{command}: no field path in the message\n{output}")


def _write(tmp: Path, name: str, text: str) -> Path:
    path = tmp / name
    path.write_text(text, encoding="utf-8")
    return path


# -- the properties -----------------------------------------------------------------------------
@settings(max_examples=PLAN_CASES, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                          HealthCheck.too_slow,
                                                          HealthCheck.data_too_large])
@given(data=st.data())
def test_every_command_gives_a_mutated_plan_one_clear_verdict(
        data: st.DataObject, base_plan: dict[str, Any], tmp_path: Path) -> None:
    text, kind, path = data.draw(mutations(base_plan), label="mutation")
    COUNTS["plan"] += 1
    file = _write(tmp_path, "plan.json", text)
    verdicts = {}
    for name, run in (("validate", lambda: run_cli(["validate", str(file)])),
                      ("inspect", lambda: run_cli(["inspect", str(file)])),
                      ("simulate", lambda: run_cli(["simulate", str(file)])),
                      ("run preflight (load_plan)", lambda: run_load_plan(file))):
        code, output = run()
        check_refusal(name, code, output, file, kind, path)
        verdicts[name] = (code, output)
    codes = {name: code for name, (code, _) in verdicts.items()}
    assert len(set(codes.values())) == 1, (
        f"commands disagree on a plan mutated by {kind} at {path}: {codes}\n"
        + "\n".join(f"--- {n}\n{o[-2000:]}" for n, (_, o) in verdicts.items()))


@settings(max_examples=CLUSTER_CASES, suppress_health_check=[
    HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_every_command_gives_a_mutated_cluster_one_clear_verdict(
        data: st.DataObject, base_cluster: dict[str, Any], workload_file: Path,
        tmp_path: Path) -> None:
    text, kind, path = data.draw(mutations(base_cluster), label="mutation")
    COUNTS["cluster"] += 1
    suffix = data.draw(st.sampled_from([".yaml", ".json"]), label="suffix")
    file = _write(tmp_path, f"cluster{suffix}", text)
    code, output = run_cli(["validate", str(file)])
    check_refusal("validate", code, output, file, kind, path)
    plan_code, plan_output = run_cli(["plan", "--workload", str(workload_file), "-c", str(file),
                                      "-b", "16"])
    check_refusal("plan", plan_code, plan_output, file, kind, path)
    assert plan_code == code or (code == 0 and "no layout" in plan_output), (
        f"validate exits {code} but plan exits {plan_code} on a cluster mutated by {kind} "
        f"at {path}\n--- validate\n{output[-2000:]}\n--- plan\n{plan_output[-2000:]}")


def test_the_valid_inputs_are_accepted(base_plan: dict[str, Any], base_cluster: dict[str, Any],
                                       workload_file: Path, tmp_path: Path) -> None:
    """The unmutated files pass every command (else every mutation would be 'refused')."""
    plan = _write(tmp_path, "plan.json", dumps(base_plan))
    for args in (["validate", str(plan)], ["inspect", str(plan)], ["simulate", str(plan)]):
        assert run_cli(args)[0] == 0, args
    assert run_load_plan(plan)[0] == 0
    cluster = _write(tmp_path, "cluster.yaml", dumps(base_cluster))
    assert run_cli(["validate", str(cluster)])[0] == 0
    code, output = run_cli(["plan", "--workload", str(workload_file), "-c", str(cluster),
                            "-b", "16"])
    assert code == 0, output
