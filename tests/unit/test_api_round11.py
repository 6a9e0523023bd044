"""The Python API, round 11 of a new user's mistakes (`docs/decisions/
bad-input-round11.md`): each case failed before its fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import hetplan


class _RootParam(nn.Module):
    """A model whose top-level module owns a parameter beside its children (a learned
    offset added in ``forward``): the IR's layer ``""``."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.zeros(4))
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x + self.pos))


@pytest.mark.parametrize("model", [nn.Linear(4, 4), _RootParam()],
                         ids=["leaf-model", "root-parameter"])
def test_a_root_module_layer_is_planned(tmp_path: Path, model: nn.Module) -> None:
    """Was `ValidationError ... LayerCost name: String should have at least 1 character`
    (`hetplan plan --module`: an internal error): the IR names the root module's layer ``""``,
    as the runtime's split points expect, and the plan's workload summary refused it."""
    plan = hetplan.compile(model, "local-cpu", batch_size=8, example_inputs=torch.zeros(1, 4))
    assert plan.model.workload is not None
    assert "" in [lay.name for lay in plan.model.workload.layers]
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = hetplan.load_plan(path)  # the one validator, a complete plan required
    assert plan.predictions is not None
    assert hetplan.simulate(loaded).iteration_time_ms == pytest.approx(
        plan.predictions.iteration_time_ms)


def test_the_root_module_layer_is_named_for_a_reader(tmp_path: Path) -> None:
    """`inspect` and `explain` printed the root layer's name '' as nothing ('0–0 (1) ',
    'layer  (layer 0, stage 0)')."""
    from typer.testing import CliRunner

    from hetplan.cli import app

    def run(*args: object) -> Any:
        return CliRunner().invoke(app, [str(a) for a in args])

    plan = hetplan.compile(_RootParam(), "local-cpu", batch_size=8, pp=2,
                           example_inputs=torch.zeros(1, 4))
    path = tmp_path / "plan.json"
    plan.save(path)
    shown = run("inspect", path, "-s", "stages").output
    assert "0–0 (1) (the root module)" in shown, shown
    explained = run("explain", path, "pos").output
    assert "(the root module) (layer 0, stage 0)" in explained, explained
    workload = tmp_path / "w.json"
    hetplan.capture(_RootParam(), torch.zeros(1, 4)).save(workload)
    summary = run("ir", "--workload", workload).output
    assert "│ 0 │ (the root module) │ params" in summary, summary


@pytest.mark.parametrize(("call", "expected"), [
    # was TypeError: the JSON object must be str, bytes or bytearray, not dict
    (lambda: hetplan.Plan.from_json({"schema_version": 1}),  # type: ignore[arg-type]
     "Plan.from_json takes a plan's JSON text, got dict; for a dict parsed already, pass "
     "json.dumps(data)"),
    # was TypeError: expected str, bytes or os.PathLike object, not NoneType
    (lambda: hetplan.load_plan(None),  # type: ignore[arg-type]
     "expected the path of a plan file (a str or a Path), got NoneType"),
    (lambda: hetplan.ClusterSpec.load(None),  # type: ignore[arg-type]
     "expected the path of a cluster spec file (a str or a Path), got NoneType"),
    (lambda: hetplan.ModelIR.load(5),  # type: ignore[arg-type]
     "expected the path of a workload file (a str or a Path), got int"),
    # was ValueError (capture's documented error is TraceError)
    (lambda: hetplan.capture(nn.Linear(4, 4), torch.zeros(1, 4), method="jit"),
     "capture(method='jit'): use 'auto' (fx, then torch.export), 'fx' or 'export'"),
    # was a TraceError blaming Linear.forward ("the top-level forward of Linear failed")
    (lambda: __import__("hetplan.ir.capture", fromlist=["capture_dataflow"]).capture_dataflow(
        nn.Linear(4, 4), torch.zeros(1, 4), method="jit"), "capture(method='jit')"),
    # was accepted, then compile raised pydantic's ValidationError for ModelRef.name
    (lambda: hetplan.capture(nn.Linear(4, 4), torch.zeros(1, 4), name=5),  # type: ignore
     "capture(name=5): the IR's name is a string"),
], ids=["from-json-dict", "load-plan-none", "cluster-load-none", "workload-load-int",
        "capture-method", "dataflow-method",
        "capture-name-int"])
def test_an_argument_of_the_wrong_kind_is_a_hetplan_error(call: Any, expected: str) -> None:
    with pytest.raises(hetplan.HetplanError) as info:
        call()
    assert expected in str(info.value)


def test_an_option_no_union_member_takes_is_one_line() -> None:
    """Was `passes.str: Input should be a valid string (got None)` and `passes['tuple[any,
    ...]']: expected a list, got null`: pydantic's union members, one line each."""
    with pytest.raises(hetplan.SpecError) as info:
        hetplan.compile("gpt-test", "local-cpu", batch_size=8, passes=None)
    assert "compile options: passes: expected a string or a list, got null" in str(info.value)
    assert "tuple[any" not in str(info.value)


def test_a_nan_efficiency_is_called_not_finite() -> None:
    """Was `efficiency: Input should be less than or equal to 1 (got nan)`."""
    with pytest.raises(hetplan.SpecError, match="efficiency: Input should be a finite number"):
        hetplan.CompileOptions(batch_size=8, efficiency=float("nan"))


class _Gated(nn.Module):
    """A block whose forward branches on a tensor's value (capture cannot trace it)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) if x.sum() > 0 else x


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([_Gated() for _ in range(3)])
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def test_the_opaque_block_a_capture_error_suggests_is_opaque() -> None:
    """The refusal says `opaque_modules=['blocks.0']`; a block of a list of repeated blocks
    named so was silently captured as a block again, so the same error came back."""
    with pytest.raises(hetplan.TraceError, match=r"opaque_modules=\['blocks.0'\]"):
        hetplan.capture(_Stack(), torch.zeros(1, 8))
    ir = hetplan.capture(_Stack(), torch.zeros(1, 8),
                         opaque_modules=["blocks.0", "blocks.1", "blocks.2"])
    assert [lay.kind.value for lay in ir.layers][1:4] == ["opaque"] * 3


@pytest.mark.parametrize(("name", "expected"), [
    ("", "the top-level module, which cannot be opaque"),
    ("blocks", "a ModuleList, which is never called (its elements are); name the element "
               "that fails, e.g. 'blocks.0'"),
    ("blocks.0.fc", "a module inside layer 'blocks.0', which is captured as one layer: name "
                    "'blocks.0'"),
], ids=["root", "module-list", "inside-a-layer"])
def test_an_opaque_name_that_would_change_nothing_is_refused(name: str, expected: str) -> None:
    """Was: '' and a module inside a layer were silently ignored (the same IR as without
    them); a ModuleList was 'parameters never used in forward with these inputs'."""
    with pytest.raises(hetplan.TraceError) as info:
        hetplan.capture(_Stack(), torch.zeros(1, 8), opaque_modules=[name])
    assert f"opaque_modules names {name!r}: {expected}" in str(info.value)


def test_hetplan_jit_takes_the_spellings_of_a_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Was: only '0' turned the compiled kernels off; 'false', 'off' or 'no' silently left
    them on, and a value that is no switch ('fast') was read as on."""
    from hetplan.algorithms import _pipeline_kernel
    from hetplan.algorithms.dp_session import jit_enabled

    for off in ("0", "false", "OFF", "no"):
        monkeypatch.setenv("HETPLAN_JIT", off)
        assert not jit_enabled() and _pipeline_kernel.kernel() is None
    monkeypatch.setenv("HETPLAN_JIT", "fast")
    with pytest.raises(hetplan.SpecError, match="HETPLAN_JIT='fast': use HETPLAN_JIT=0"):
        hetplan.compile("gpt-test", "local-cpu", batch_size=8)


def test_simulate_of_a_plan_without_its_cluster_names_the_argument(tmp_path: Path) -> None:
    """Was 'pass --cluster FILE|PRESET', an option the Python call does not have."""
    import json

    plan = hetplan.compile("gpt-test", "local-cpu", batch_size=8)
    data = json.loads(plan.to_json())
    data["cluster"].pop("spec")
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(hetplan.SpecError, match=r"\(Python: cluster=, a ClusterSpec"):
        hetplan.simulate(path)
    assert hetplan.simulate(path, cluster="local-cpu").iteration_time_ms > 0


@pytest.mark.parametrize("name", ["0", "2"])
def test_any_block_of_a_list_at_the_root_can_be_opaque(name: str) -> None:
    """A model that is itself a list of alike blocks: only its first block became opaque;
    '2' was captured as a block again (the list kept being reused)."""
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    ir = hetplan.capture(model, torch.randn(2, 8), opaque_modules=[name])
    kinds = {layer.name: layer.kind.value for layer in ir.layers}
    assert kinds[name] == "opaque"
    assert [k for n, k in kinds.items() if n != name] == ["block"] * 3
