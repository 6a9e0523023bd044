"""Capture failures are TraceErrors naming the module, the reason and the escape hatch.

Before, ``.item()`` or numpy in a forward, and a factory that raised, needed arguments or was
given inputs of the wrong shape, ended as a raw RuntimeError/TypeError ("internal error"),
and a failure in the top-level forward suggested ``--opaque`` with an empty name.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from hetplan.errors import SpecError, TraceError
from hetplan.ir.capture import capture
from hetplan.ir.capture.factory import load_factory


class Reads(nn.Module):
    """Calls ``.item()`` on an activation: a value capture (on meta tensors) does not have."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * x.sum().item()


class ToNumpy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return h + float(np.asarray(h.detach()).mean())


class Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if h.sum() > 0:
            h = h * 2
        return h


class Outer(nn.Module):
    """A model whose submodule ``inner`` does what ``inner_cls`` does."""

    def __init__(self, inner_cls: type[nn.Module]) -> None:
        super().__init__()
        self.inner = inner_cls()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x))


X = torch.randn(2, 4)


@pytest.mark.parametrize("inner, reason", [
    (Reads, "reads a tensor's value with .item()"),
    (ToNumpy, "converts a tensor to numpy"),
    (Branches, "control flow depends on a tensor's value"),
])
def test_a_failing_submodule_is_named_with_the_opaque_fix(inner: type[nn.Module],
                                                          reason: str) -> None:
    with pytest.raises(TraceError) as exc:
        capture(Outer(inner), X)
    e = exc.value
    assert e.module == "inner" and reason in e.reason
    msg = str(e)
    assert f"module 'inner' ({inner.__name__})" in msg and reason in msg
    assert "opaque_modules=['inner']" in msg and "--opaque inner" in msg


@pytest.mark.parametrize("model, reason", [
    (Reads(), "reads a tensor's value with .item()"),
    (ToNumpy(), "converts a tensor to numpy"),
    (Branches(), "control flow depends on a tensor's value"),
])
def test_a_failing_top_level_forward_never_suggests_an_empty_name(model: nn.Module,
                                                                 reason: str) -> None:
    with pytest.raises(TraceError) as exc:
        capture(model, X)
    msg = str(exc.value)
    assert reason in msg and f"the top-level forward of {type(model).__name__}" in msg
    assert "--opaque <its name>" in msg and "submodules now: 'fc'" in msg
    assert "--opaque \n" not in msg + "\n" and "--opaque )" not in msg
    assert "opaque_modules=['']" not in msg


def test_the_opaque_escape_hatch_gets_past_item() -> None:
    ir = capture(Outer(Reads), X, opaque_modules=["inner"])
    assert [layer.name for layer in ir.layers] == ["inner", "head"]


def test_inputs_of_the_wrong_shape_blame_the_inputs() -> None:
    with pytest.raises(TraceError) as exc:
        capture(Outer(Reads), torch.randn(2, 7))
    msg = str(exc.value)
    assert exc.value.module == "inner.fc" and "the example inputs do not fit it" in msg
    assert "check the example inputs' shapes" in msg


@pytest.mark.parametrize("args, kwargs, torch_says", [
    ((X, X), {}, "too many positional arguments"),
    ((), {}, "missing a required argument: 'x'"),
    ((X,), {"mask": X}, "unexpected keyword argument 'mask'"),
])
def test_inputs_that_do_not_fit_forwards_signature_blame_the_inputs(
        args: tuple, kwargs: dict, torch_says: str) -> None:
    # before, these were blamed on code in the top-level forward, with the advice to move
    # it into a submodule and make that opaque
    with pytest.raises(TraceError) as exc:
        capture(Outer(Reads), args, kwargs)
    msg = str(exc.value)
    assert "the example inputs do not fit it" in msg and torch_says in msg
    assert "check the example inputs' shapes" in msg and "opaque" not in msg


def test_example_kwargs_that_are_not_a_mapping_are_refused() -> None:
    # before: TypeError "cannot convert dictionary update sequence element #0 to a sequence"
    with pytest.raises(TraceError, match="example_kwargs must be a mapping of keyword names "
                                         "to inputs, got list"):
        capture(Outer(Reads), X, [X])


def test_uninitialized_lazy_modules_are_refused_by_name() -> None:
    # before: a raw RuntimeError from torch ("Can't access the shape of an uninitialized
    # parameter"), an internal error
    model = nn.Sequential(nn.Linear(4, 4), nn.LazyLinear(2))
    with pytest.raises(TraceError) as exc:
        capture(model, X)
    msg = str(exc.value)
    assert exc.value.module == "1" and "uninitialized (lazy) parameter '1.weight'" in msg
    assert "run one forward" in msg


def test_a_capture_at_micro_batch_0_is_refused() -> None:
    # before: captured with every FLOP and activation 0, and compile() of it ended in a
    # ValueError ("batch_size must be >= 1, got 0")
    with pytest.raises(SpecError, match="the example inputs hold 0 samples"):
        capture(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), torch.empty(0, 4))


# -- factories (--module pkg.mod:factory) -------------------------------------------------------
FACTORIES = """
import torch
from torch import nn

def good():
    return nn.Linear(4, 2), (torch.randn(2, 4),)

def raises():
    raise RuntimeError("weights not found")

def takes(n, *, seed):
    return good()

def wrong_shape():
    return nn.Linear(4, 2), (torch.randn(2, 7),)

def not_a_pair():
    return nn.Linear(4, 2)

not_callable = 3
"""


@pytest.fixture
def factories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
              ) -> str:
    """A module of factories in the current directory, under a name unique to the test."""
    name = f"factories_{request.node.name.replace('[', '_').replace(']', '').replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(FACTORIES), encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    return name


def test_a_good_factory(factories: str) -> None:
    model, args, kwargs = load_factory(f"{factories}:good")
    assert isinstance(model, nn.Linear) and args[0].shape == (2, 4) and kwargs == {}


def test_a_factory_that_raises(factories: str) -> None:
    with pytest.raises(TraceError) as exc:
        load_factory(f"{factories}:raises")
    assert exc.value.module == f"{factories}:raises"
    assert "the factory raised RuntimeError: weights not found" in str(exc.value)
    assert isinstance(exc.value.__cause__, RuntimeError)


def test_a_factory_that_takes_arguments(factories: str) -> None:
    with pytest.raises(TraceError, match="takes argument\\(s\\) n, seed, but it is called with"):
        load_factory(f"{factories}:takes")


def test_a_factory_whose_inputs_have_the_wrong_shape(factories: str) -> None:
    model, args, kwargs = load_factory(f"{factories}:wrong_shape")
    with pytest.raises(TraceError, match="the example inputs do not fit it"):
        capture(model, args, kwargs)


def test_a_factory_that_returns_something_else(factories: str) -> None:
    with pytest.raises(TraceError, match="must return \\(model, example_args\\)"):
        load_factory(f"{factories}:not_a_pair")


def test_spec_errors_name_the_option(factories: str) -> None:
    with pytest.raises(SpecError, match="expected 'package.module:factory'"):
        load_factory("no-colon")
    with pytest.raises(SpecError, match="cannot import 'no_such_module_here'"):
        load_factory("no_such_module_here:f")
    with pytest.raises(SpecError, match="has no callable 'not_callable'"):
        load_factory(f"{factories}:not_callable")


def test_a_module_that_raises_on_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "explodes_on_import.py").write_text("raise ValueError('bad config')\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TraceError, match="importing 'explodes_on_import' raised ValueError"):
        load_factory("explodes_on_import:f")


class Detached(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).detach())


class Argmax(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).argmax(-1)


@pytest.mark.parametrize("model, names", [(Detached(), "['body.weight', 'body.bias']"),
                                          (Argmax(), "['fc.weight', 'fc.bias']")])
def test_parameters_no_gradient_reaches_are_named_with_the_cause(model: nn.Module,
                                                                 names: str) -> None:
    # before: "trainable parameters with no gradient tensor: [...]", the IR invariant's
    # message, with neither the cause nor the fix
    with pytest.raises(TraceError) as exc:
        capture(model, X)
    msg = str(exc.value)
    assert f"no gradient reaches the trainable parameters {names}" in msg
    assert ".detach()" in msg and "requires_grad=False" in msg


def test_one_opaque_module_may_be_given_as_a_string() -> None:
    # before: the string was read as a list of one-letter names ("opaque_modules names 'i',
    # which is not a module of Outer")
    ir = capture(Outer(Reads), X, opaque_modules="inner")
    assert [layer.name for layer in ir.layers] == ["inner", "head"]
