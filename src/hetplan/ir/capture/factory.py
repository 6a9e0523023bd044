"""A user's model factory (``--module pkg.mod:factory``): import it, call it, check its result.

The factory takes no arguments and returns ``(model, example_args)`` or ``(model,
example_args, example_kwargs)``: the module to plan and one micro-batch of inputs. Everything
that can go wrong in the user's code — importing the module raises, the factory needs
arguments, raises, or returns something else — is a :class:`~hetplan.errors.TraceError`
naming the factory (``TraceError.module``), the reason and the fix; a malformed spec or a
module that does not exist is a :class:`~hetplan.errors.SpecError`. Nothing is traced here:
the inputs' shapes are checked when :func:`~hetplan.ir.capture.capture` runs the model.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path
from typing import Any

from hetplan.errors import SpecError, TraceError

__all__ = ["load_factory"]

_RETURNS = "(model, example_args) or (model, example_args, example_kwargs)"


def load_factory(spec: str, *, option: str = "--module") -> tuple[Any, tuple, dict]:
    """Import and call the factory ``pkg.mod:factory`` (the current directory is importable).

    Args:
        spec: ``"package.module:factory"``.
        option: how the spec was given, for messages.

    Returns:
        ``(model, example_args, example_kwargs)``; a bare example input becomes a 1-tuple.

    Raises:
        SpecError: ``spec`` is not ``module:factory``, the module does not exist, or it has
            no callable of that name.
        TraceError: importing the module raised, or the factory takes arguments, raises, or
            does not return :data:`_RETURNS`.
    """
    mod_name, _, attr = spec.partition(":")
    if not mod_name or not attr:
        raise SpecError(f"{option} {spec!r}: expected 'package.module:factory'")
    module = _import(mod_name, spec, option)
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise SpecError(f"{option} {spec!r}: {mod_name} has no callable {attr!r}")
    required = _required_parameters(factory)
    if required:
        raise TraceError(
            f"{option} {spec!r}: the factory takes argument(s) {', '.join(required)}, but it "
            f"is called with none; give them defaults or wrap it in a function without "
            f"arguments that returns {_RETURNS}",
            module=spec, reason="the factory takes arguments",
        )
    try:
        result = factory()
    except SystemExit as e:  # sys.exit() or argparse in the user's code: hetplan goes on
        raise _exited(e, f"the factory {attr!r}", spec, option) from e
    except Exception as e:  # noqa: BLE001 - the user's code failed: name it, chain it
        lines = str(e).strip().splitlines()
        reason = f"{type(e).__name__}: {lines[0][:300]}" if lines else type(e).__name__
        raise TraceError(
            f"{option} {spec!r}: the factory raised {reason}; fix it so that it "
            f"returns {_RETURNS} (run it alone: python -c \"import {mod_name}; "
            f"{mod_name}.{attr}()\")",
            module=spec, reason=reason,
        ) from e
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        raise TraceError(
            f"{option} {spec!r}: the factory must return {_RETURNS}, got "
            f"{_describe(result)}",
            module=spec, reason="wrong return value",
        )
    model, args = result[0], result[1]
    kwargs = result[2] if len(result) == 3 else {}
    if not isinstance(kwargs, dict):
        raise TraceError(
            f"{option} {spec!r}: example_kwargs (the third value the factory returns) must be "
            f"a dict of keyword inputs, got {_describe(kwargs)}",
            module=spec, reason="wrong return value",
        )
    if not isinstance(args, (tuple, list)):
        args = (args,)
    return model, tuple(args), dict(kwargs)


def _import(mod_name: str, spec: str, option: str) -> Any:
    sys.path.insert(0, str(Path.cwd()))
    try:
        return importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (mod_name == e.name or mod_name.startswith(e.name + ".")):
            raise SpecError(f"{option} {spec!r}: cannot import {mod_name!r}: {e}; run from "
                            "the directory that holds it or install it") from e
        raise TraceError(f"{option} {spec!r}: importing {mod_name!r} failed: {e}",
                         module=spec, reason=str(e)) from e
    except SystemExit as e:  # a script that parses the command line when imported
        raise _exited(e, f"importing {mod_name!r}", spec, option) from e
    except Exception as e:  # noqa: BLE001 - the user's module raised while importing
        raise TraceError(
            f"{option} {spec!r}: importing {mod_name!r} raised {type(e).__name__}: {e}",
            module=spec, reason=f"{type(e).__name__}: {e}",
        ) from e
    finally:
        sys.path.pop(0)


def _exited(e: SystemExit, what: str, spec: str, option: str) -> TraceError:
    """A ``sys.exit()`` in the user's code (argparse's ``parse_args`` on hetplan's own command
    line exits 2 with "unrecognized arguments", which read as hetplan's error) as a
    TraceError naming it: hetplan, not the user's script, decides when the process ends."""
    return TraceError(
        f"{option} {spec!r}: {what} called sys.exit({e.code!r}) (a script that parses the "
        "command line, e.g. argparse's parse_args(), exits when it meets hetplan's "
        "arguments); move that code under `if __name__ == \"__main__\":` and give the factory "
        f"no work but to return {_RETURNS}",
        module=spec, reason=f"sys.exit({e.code!r})",
    )


def _required_parameters(factory: Any) -> list[str]:
    """Names of the parameters a call with no arguments would leave unbound."""
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin without a signature: just call it
        return []
    return [
        name for name, p in sig.parameters.items()
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD,
                                               p.KEYWORD_ONLY)
    ]


def _describe(value: Any) -> str:
    if isinstance(value, tuple):
        return f"a tuple of {len(value)}: ({', '.join(type(v).__name__ for v in value)})"
    return type(value).__name__
