"""Property: bad input never crashes hetplan, never hangs, and gets one verdict everywhere.

Hypothesis mutates a valid cluster spec and a valid compiled plan across every field (a
section first, then a field in it): a key deleted, a value of the wrong JSON type, out of
range (negative, zero, 1e308, a 400-digit integer, NaN), off by one, huge (10**9, 2**50, a
100,000-character string, 10,000 list items), a key written twice, a value nested thousands
of levels deep; and whole files truncated or emptied. Each mutated file goes through every
command, in-process through typer's ``CliRunner``:

- a plan: ``validate``, ``inspect``, ``simulate`` and the run preflight's plan loading
  (:func:`hetplan.ir.plan.load_plan`, what ``hetplan run`` and its workers call); a plan
  whose embedded cluster spec was deleted is simulated as a user must, with ``--cluster``
  naming the cluster it was made for (it is then checked against that one);
- a cluster spec: ``validate`` and ``plan`` (a small workload on that cluster).

Each command must accept the file (exit 0) or refuse it (exit 2) with a message that names
the file and, for a field, its path; never exit 1 ("internal error") or show a traceback,
never run past :data:`CASE_SECONDS`, and every command gives the verdict ``validate`` gives
(no plan accepted by one command and refused by a later one). Some mutations must be
refused by every command: a key written twice, deep nesting, a boolean or a string where a
number was, a file that is not a mapping. One verdict is not validity:
``simulate`` may find that a valid plan whose workload was edited no longer fits in memory
(it costs the plan; ``validate`` has no cost model), and says which rank needs how much.
The number of generated cases is printed at the end of the run.
"""

from __future__ import annotations

import functools
import json
import math
import os
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
#: about half a second on the small workload). A hang detector, not a speed target: 20 s
#: fired on a 2-core machine under load (load average 6) while PyYAML parsed a value nested
#: 100,000 deep, which ``ir.files`` now refuses before parsing.
CASE_SECONDS = 60
PLAN_CASES = int(os.environ.get("HETPLAN_BAD_INPUT_CASES", 120))
CLUSTER_CASES = PLAN_CASES // 2

COUNTS = {"plan": 0, "cluster": 0, "commands": 0, "accepted": 0, "refused": 0,
          "out of memory": 0}
#: How `simulate` refuses a valid plan that does not fit: the rank, its need, the device's.
OUT_OF_MEMORY = re.compile(r"rank \d+ needs [\d.]+ \w+ .* but its device has [\d.]+ \w+")
Path_ = tuple[str | int, ...]


# -- the valid inputs ---------------------------------------------------------------------------
WORKLOAD = GOLDEN / "inspect_small.workload.json"
#: The preset the base plan is made for, and the base cluster spec.
BASE_CLUSTER = "mixed-tp-node"


@functools.cache
def base_plan() -> dict[str, Any]:
    """A compiled plan with every kind of section: two pipeline stages of dp=2 x tp=4 ranks,
    pipeline actions, TP groups with resizing roles, buckets, one of them compressed."""
    from hetplan.optimizer.compile import compile as compile_plan

    ir = ModelIR.load(WORKLOAD)
    plan = compile_plan(ir, BASE_CLUSTER, batch_size=64, dp=2, pp=2, tp=4,
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


@functools.cache
def base_cluster() -> dict[str, Any]:
    return json.loads(ClusterSpec.from_preset(BASE_CLUSTER).to_json())


@pytest.fixture(scope="module", autouse=True)
def _report_counts(pytestconfig: pytest.Config) -> Iterator[None]:
    """Print how many cases were generated, also when pytest captures output."""
    yield
    line = (f"bad-input property suite: {COUNTS['plan']} mutated plans and "
            f"{COUNTS['cluster']} mutated cluster specs ({COUNTS['accepted']} accepted, "
            f"{COUNTS['refused']} refused, {COUNTS['out of memory']} valid but out of memory in "
            f"simulate), {COUNTS['commands']} command runs")
    capture = pytestconfig.pluginmanager.get_plugin("capturemanager")
    if capture is None:
        print(line)
        return
    with capture.global_and_fixture_disabled():
        print("\n" + line)


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


class Nested:
    """A value nested ``depth`` lists deep, written as text (``json.dumps`` would recurse)."""

    def __init__(self, depth: int) -> None:
        self.depth = depth


WRONG_TYPES: list[Any] = ["text", True, None, [], {}, 1.5, 7]
OUT_OF_RANGE: list[Any] = [-1, 0, -0.001, 1e308, 10**400, float("nan"), float("inf"), ""]
HUGE: list[Any] = [10**9, 2**50, 2**63, "x" * 100_000]


KINDS = ["delete", "type", "range", "shift", "huge", "many", "nested", "duplicate"]


@st.composite
def mutations(draw: st.DrawFn, which: str) -> tuple[str, Path_, int]:
    """A mutation of base ``which`` ("plan", "cluster"): its kind, the path it touches, and
    which replacement value (an index); the base is built when the first case is drawn."""
    base = base_plan() if which == "plan" else base_cluster()
    whole = draw(st.sampled_from(["field"] * 12 + ["truncate", "empty", "array"]))
    if whole != "field":
        return whole, (), draw(st.integers(0, 10**6))
    # a section first, then a path in it: the workload's hundreds of gradient fields would
    # otherwise crowd out the layout's few
    section = draw(st.sampled_from(sorted(base)))
    paths = [(section,), *all_paths(base[section], (section,))]
    return draw(st.sampled_from(KINDS)), draw(st.sampled_from(paths)), draw(
        st.integers(0, 10**6))


def mutate(base: dict[str, Any], kind: str, path: Path_, choice: int) -> tuple[str, bool]:
    """The text of ``base`` mutated as (kind, path, choice) says, and whether every command
    must refuse it: a key written twice, a value nested 40 levels deep or more, a boolean or
    a string where a number was (hetplan's numbers are strict), a file that is not a mapping.
    """
    data = json.loads(json.dumps(base))
    if kind == "truncate":
        text = json.dumps(data, indent=1)
        return text[: 1 + choice % (len(text) - 1)], True
    if kind == "empty":
        return ["", "   \n", "null"][choice % 3], True
    if kind == "array":
        return "[1, 2, 3]", True
    parent, key = _get(data, path[:-1]), path[-1]
    old = parent[key]
    number = isinstance(old, (int, float)) and not isinstance(old, bool)
    if kind == "duplicate" and isinstance(parent, dict):
        return dumps(data, duplicate=path), True
    if kind in ("delete", "duplicate"):
        if isinstance(parent, dict):
            del parent[key]
        else:
            parent.pop(key)
    elif kind == "type":
        others = [v for v in WRONG_TYPES if type(v) is not type(old)]
        parent[key] = others[choice % len(others)]
        if number and isinstance(parent[key], (bool, str)):
            return dumps(data), True
    elif kind == "shift" and number:
        parent[key] = old + (1 if choice % 2 else -1)  # off by one: a rank, a layer, a count
    elif kind == "range":
        parent[key] = OUT_OF_RANGE[choice % len(OUT_OF_RANGE)]
    elif kind == "huge":
        parent[key] = HUGE[choice % len(HUGE)]
    elif kind == "many":
        item = old[0] if isinstance(old, list) and old else old
        if len(json.dumps(item)) > 200:  # keep the file small: a long list of small items
            item = 1
        parent[key] = [item] * 10_000
    elif kind == "nested":
        parent[key] = Nested([40, 100_000][choice % 2])
        return dumps(data), True
    return dumps(data), False


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
    if isinstance(data, Nested):
        return "[" * data.depth + "1" + "]" * data.depth
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
    if OUT_OF_MEMORY.search(" ".join(output.split())):
        return  # about the whole layout (see check_plan_commands), not one field
    if kind in ("delete", "type", "range", "huge", "many") and path:
        # "<file>: some.field[0].path: what is wrong" on some line, or the deleted key named
        flat = output.replace("\n", " ")
        field = re.compile(re.escape(str(file)) + r": [A-Za-z_]\w*(\.\w+|\[[^\]]+\])*[:.]")
        key = next((str(k) for k in reversed(path) if isinstance(k, str)), "")
        named = bool(key) and re.search(rf"(?<![\w.]){re.escape(key)}(?!\w)", flat) is not None
        assert field.search(flat) or named or "nested" in flat, (
            f"{command}: neither a field path nor the key {key!r} in the message\n{output}")


def _write(tmp: Path, name: str, text: str) -> Path:
    path = tmp / name
    path.write_text(text, encoding="utf-8")
    return path


# -- the properties -----------------------------------------------------------------------------
@settings(max_examples=PLAN_CASES, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                          HealthCheck.too_slow])
@given(mutation=mutations("plan"))
def test_every_command_gives_a_mutated_plan_one_clear_verdict(
        mutation: tuple[str, Path_, int], tmp_path: Path) -> None:
    kind, path, choice = mutation
    text, must_refuse = mutate(base_plan(), kind, path, choice)
    codes = check_plan_commands(text, kind, path, tmp_path)
    if must_refuse:
        assert set(codes.values()) == {2}, f"{kind} at {path} was accepted: {codes}"


def check_plan_commands(text: str, kind: str, path: Path_, tmp_path: Path) -> dict[str, int]:
    """Run every plan command on ``text``; each verdict is clear, and they agree. Returns the
    exit codes."""
    COUNTS["plan"] += 1
    file = _write(tmp_path, "plan.json", text)
    verdicts = {}
    given = ["--cluster", BASE_CLUSTER] if _without_spec(text) else []
    for name, run in (("validate", lambda: run_cli(["validate", str(file)])),
                      ("inspect", lambda: run_cli(["inspect", str(file)])),
                      ("simulate", lambda: run_cli(["simulate", *given, str(file)])),
                      ("run preflight (load_plan)", lambda: run_load_plan(file))):
        code, output = run()
        check_refusal(name, code, output, file, kind, path)
        verdicts[name] = (code, output)
    codes = {name: code for name, (code, _) in verdicts.items()}
    COUNTS["accepted" if codes["validate"] == 0 else "refused"] += 1
    if codes["validate"] == 0 and codes["simulate"] == 2 and OUT_OF_MEMORY.search(
            " ".join(verdicts["simulate"][1].split())):
        # Feasibility, not validity: a valid plan whose (edited) workload no longer fits in
        # the devices' memory. `simulate` costs it and says which rank needs how much;
        # `validate` checks the plan without a cost model.
        COUNTS["out of memory"] += 1
        codes["simulate"] = 0
    assert len(set(codes.values())) == 1, (
        f"commands disagree on a plan mutated by {kind} at {path}: {codes}\n"
        + "\n".join(f"--- {n}\n{o[-2000:]}" for n, (_, o) in verdicts.items()))
    return {name: code for name, (code, _) in verdicts.items()}


def _without_spec(text: str) -> bool:
    """Whether ``text`` is a plan object whose cluster embeds no spec (simulate then needs
    ``--cluster``)."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return False
    cluster = data.get("cluster") if isinstance(data, dict) else None
    return isinstance(cluster, dict) and cluster.get("spec") is None


def test_a_plan_without_its_cluster_spec_is_simulated_on_the_cluster_given(
        tmp_path: Path) -> None:
    """The case hypothesis found: `simulate` needs the cluster of a plan that does not embed
    it; given, every command accepts the plan."""
    data = json.loads(json.dumps(base_plan()))
    del data["cluster"]["spec"]
    codes = check_plan_commands(json.dumps(data), "delete", ("cluster", "spec"), tmp_path)
    assert set(codes.values()) == {0}, codes


def test_a_valid_plan_that_no_longer_fits_is_simulate_s_to_refuse(tmp_path: Path) -> None:
    """The one allowed difference, pinned: activations of 1 PiB in one layer."""
    data = json.loads(json.dumps(base_plan()))
    data["model"]["workload"]["layers"][3]["act_saved_bytes"] = 2**50
    codes = check_plan_commands(json.dumps(data), "huge",
                                ("model", "workload", "layers", 3, "act_saved_bytes"), tmp_path)
    assert codes == {"validate": 0, "inspect": 0, "simulate": 2,
                     "run preflight (load_plan)": 0}


@settings(max_examples=CLUSTER_CASES, suppress_health_check=[
    HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(mutation=mutations("cluster"), suffix=st.sampled_from([".yaml", ".json"]))
def test_every_command_gives_a_mutated_cluster_one_clear_verdict(
        mutation: tuple[str, Path_, int], suffix: str, tmp_path: Path) -> None:
    kind, path, choice = mutation
    text, must_refuse = mutate(base_cluster(), kind, path, choice)
    COUNTS["cluster"] += 1
    file = _write(tmp_path, f"cluster{suffix}", text)
    code, output = run_cli(["validate", str(file)])
    check_refusal("validate", code, output, file, kind, path)
    COUNTS["accepted" if code == 0 else "refused"] += 1
    assert code == 2 or not must_refuse, f"{kind} at {path} was accepted\n{output}"
    plan_code, plan_output = run_cli(["plan", "--workload", str(WORKLOAD), "-c", str(file),
                                      "-b", "16"])
    if code == 2:  # refused: refused by plan too, for the same reason, before any planning
        check_refusal("plan", plan_code, plan_output, file, kind, path)
        assert plan_code == 2, f"validate refuses the cluster, plan exits {plan_code}"
        return
    # accepted: plan either plans or says why this cluster cannot take the model (no layout
    # divides the batch, out of memory): an answer about the plan, not the file
    check_refusal("plan", plan_code, plan_output, Path(""), "", ())


def test_the_valid_inputs_are_accepted(tmp_path: Path) -> None:
    """The unmutated files pass every command (else every mutation would be 'refused')."""
    plan = _write(tmp_path, "plan.json", dumps(base_plan()))
    for args in (["validate", str(plan)], ["inspect", str(plan)], ["simulate", str(plan)]):
        assert run_cli(args)[0] == 0, args
    assert run_load_plan(plan)[0] == 0
    cluster = _write(tmp_path, "cluster.yaml", dumps(base_cluster()))
    assert run_cli(["validate", str(cluster)])[0] == 0
    code, output = run_cli(["plan", "--workload", str(WORKLOAD), "-c", str(cluster),
                            "-b", "16"])
    assert code == 0, output
