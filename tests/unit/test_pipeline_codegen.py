"""The traced pipeline stages run their graphs' generated code, not ``torch.fx.Interpreter``
(``hetplan.runtime.pipeline._generated_code``): every unflattened submodule is switched, the
switch is undone after tracing, and the split model still computes what the model does."""

from __future__ import annotations

import importlib

import torch
from torch.distributed.pipelining import SplitPoint
from torch.export.unflatten import InterpreterModule

from hetplan import zoo
from hetplan.runtime.pipeline import _trace


def test_stage_submodules_run_generated_code_and_compute_the_same() -> None:
    model = zoo.build("gpt-test", device="cpu", seed=0)
    args, kwargs = zoo.example_inputs("gpt-test", batch=2, device="cpu")
    pipe, _ = _trace(model, args, kwargs, {"blocks.2": SplitPoint.BEGINNING})
    subs = [m for i in range(2) for m in pipe.get_stage_module(i).modules()
            if isinstance(m, InterpreterModule)]
    assert subs, "the trace unflattened no submodule: nothing to check"
    assert all(m._run_with_interpreter is False for m in subs)
    # torch's own default is back for everything built after the trace
    assert importlib.import_module("torch.export.unflatten").RUN_WITH_INTERPRETER is True
    with torch.no_grad():
        mid = pipe.get_stage_module(0)(*args, **kwargs)
        out = pipe.get_stage_module(1)(*(mid if isinstance(mid, tuple) else (mid,)))
        want = model(*args, **kwargs)
    got = out[0] if isinstance(out, tuple) else out
    torch.testing.assert_close(got, want if isinstance(want, torch.Tensor) else want[0])


def test_the_trace_prints_no_warning_of_torch_internals() -> None:
    """torch's split pickles its pytree specs through a check torch itself deprecated: every
    rank of every pipeline run printed the same FutureWarning (``isinstance(treespec,
    LeafSpec)``), once per rank in `hetplan run`, about nothing a user can change."""
    import warnings

    model = zoo.build("gpt-test", device="cpu", seed=0)
    args, kwargs = zoo.example_inputs("gpt-test", batch=2, device="cpu")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _trace(model, args, kwargs, {"blocks.2": SplitPoint.BEGINNING})
    assert not [w for w in seen if "LeafSpec" in str(w.message)], [str(w.message) for w in seen]
