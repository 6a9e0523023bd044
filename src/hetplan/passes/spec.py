"""The pass pipeline as data: a spec string parsed into pass instances, and back.

Grammar (xDSL's pass-pipeline syntax)::

    pipeline := pass ("," pass)*
    pass     := NAME ["{" option (" " option)* "}"]
    option   := KEY "=" VALUE

- ``NAME`` is a registered pass name (:func:`hetplan.passes.get_all_passes`).
- ``KEY`` is a field of the pass's dataclass, kebab-case or snake_case
  (``max-compressions`` and ``max_compressions`` name the same option).
- ``VALUE`` is converted to the field's type with pydantic: numbers, ``true``/``false``,
  ``none`` for an optional field, and comma-separated items for a tuple
  (``espresso{compressors=dgc,fp16}``: the comma inside braces belongs to the value). A field
  whose ``metadata["parse"]`` is set gets the text through that callable instead
  (``dynpipe{dynamics=examples/pruning.yaml}``).

Example::

    >>> [p.name for p in parse_pipeline("dynpipe,espresso{compressors=dgc,fp16},cupcake-fusion")]
    ['dynpipe', 'espresso', 'cupcake-fusion']
    >>> format_pipeline(parse_pipeline("tp-resizing{controller=semi gamma-max=0.5}"))
    'tp-resizing{controller=semi gamma-max=0.5}'

Every mistake is a :class:`~hetplan.errors.SpecError` that names where the spec came from
(``--passes``), the pass, the option and the fix, with a did-you-mean for misspelt names.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Sequence
from typing import Any

from pydantic import TypeAdapter, ValidationError

from hetplan.errors import HetplanError, SpecError
from hetplan.ir.validation import did_you_mean
from hetplan.passes.base import Pass

__all__ = ["parse_pipeline", "format_pipeline", "resolve_pipeline", "pass_options",
           "describe_passes"]


def _registry() -> dict[str, type]:
    from hetplan.passes import get_all_passes

    return get_all_passes()


def _split_top(text: str, where: str) -> list[str]:
    """Split ``text`` at the commas outside braces; braces must balance and not nest."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "{":
            depth += 1
            if depth > 1:
                raise SpecError(f"{where}: nested '{{' at character {i + 1} of {text!r}; "
                                "options are written name{key=value other=value}")
        elif ch == "}":
            depth -= 1
            if depth < 0:
                raise SpecError(f"{where}: unmatched '}}' at character {i + 1} of {text!r}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise SpecError(f"{where}: unclosed '{{' in {text!r}; close each option list with '}}'")
    parts.append(text[start:])
    return parts


def pass_options(cls: type) -> dict[str, dataclasses.Field[Any]]:
    """The options of pass class ``cls``: its dataclass fields by snake_case name."""
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


def _convert(cls: type, f: dataclasses.Field[Any], text: str, where: str) -> Any:
    parse = f.metadata.get("parse")
    if parse is not None:
        try:
            return parse(text)
        except HetplanError as e:
            raise SpecError(f"{where}: option {_kebab(f.name)}={text!r}: {e}") from e
    hint = typing.get_type_hints(cls)[f.name]
    value: Any = text
    if text.lower() == "none":
        value = None
    elif typing.get_origin(_non_none(hint)) is tuple:
        value = tuple(x for x in text.split(",") if x) if text else ()
    try:
        return TypeAdapter(hint).validate_python(value)
    except ValidationError as e:
        reason = e.errors()[0]["msg"]
        raise SpecError(f"{where}: option {_kebab(f.name)}={text!r} is not valid: {reason} "
                        f"(expected {_type_name(hint)})") from None


def _non_none(hint: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return hint


def _type_name(hint: Any) -> str:
    """A short readable name of an option's type: ``int``, ``a|b``, ``str,...``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return "|".join(map(str, args))
    if origin in (typing.Union, types.UnionType):
        inner = [_type_name(a) for a in args if a is not type(None)]
        return " or ".join(inner) + (" or none" if type(None) in args else "")
    if origin is tuple:
        return f"{_type_name(args[0])},..." if args else "tuple"
    return getattr(hint, "__name__", repr(hint))


def _kebab(name: str) -> str:
    return name.replace("_", "-")


def _parse_one(text: str, where: str) -> Pass:
    text = text.strip()
    if not text:
        raise SpecError(f"{where}: an empty pass name (two commas in a row, or a trailing "
                        "comma?); write names separated by single commas")
    name, _, rest = text.partition("{")
    name = name.strip()
    registry = _registry()
    if name not in registry:
        raise SpecError(f"{where}: unknown pass {name!r}{did_you_mean(name, registry)} "
                        f"(known: {', '.join(sorted(registry))})")
    cls = registry[name]
    here = f"{where}: pass {name!r}"
    if rest and not rest.endswith("}"):
        raise SpecError(f"{here}: text after '}}' in {text!r}")
    options = pass_options(cls)
    kwargs: dict[str, Any] = {}
    for item in rest[:-1].split() if rest else ():
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise SpecError(f"{here}: option {item!r} is not key=value "
                            f"(options: {', '.join(map(_kebab, options)) or 'none'})")
        field_name = key.replace("-", "_")
        if field_name not in options:
            known = [_kebab(o) for o in options]
            raise SpecError(f"{here}: unknown option {key!r}{did_you_mean(_kebab(key), known)} "
                            f"(options: {', '.join(known) or 'none'})")
        if field_name in kwargs:
            raise SpecError(f"{here}: option {key!r} given twice")
        kwargs[field_name] = _convert(cls, options[field_name], value, here)
    try:
        return typing.cast(Pass, cls(**kwargs))
    except HetplanError as e:
        raise SpecError(f"{here}: {e}") from e


def parse_pipeline(spec: str, *, where: str = "passes") -> tuple[Pass, ...]:
    """Parse a pipeline spec (see module docstring) into pass instances, in order.

    Raises:
        SpecError: an unknown pass or option (with a suggestion), a value of the wrong
            type, or malformed braces; the message starts with ``where``.
    """
    if not spec.strip():
        raise SpecError(f"{where}: the pass pipeline is empty; name at least one pass "
                        f"(known: {', '.join(sorted(_registry()))})")
    return tuple(_parse_one(part, where) for part in _split_top(spec, where))


def _format_value(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def format_pipeline(passes: Sequence[Pass]) -> str:
    """The spec of ``passes``: names, with the options that differ from their defaults.

    Options read through a ``parse`` callable (e.g. a dynamics file) have no text form and
    are written as ``key=<set>``; such a spec documents the pipeline but does not re-parse.
    """
    out = []
    for p in passes:
        items = []
        for f in dataclasses.fields(typing.cast(Any, p)):
            if not f.init:
                continue
            value = getattr(p, f.name)
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
            if value == default:
                continue
            text = "<set>" if "parse" in f.metadata else _format_value(value)
            items.append(f"{_kebab(f.name)}={text}")
        out.append(p.name + ("{" + " ".join(items) + "}" if items else ""))
    return ",".join(out)


def resolve_pipeline(passes: str | Sequence[str | Pass], *, where: str = "passes"
                     ) -> tuple[Pass, ...]:
    """Pass instances from a spec string, or a sequence of names / spec items / instances."""
    if isinstance(passes, str):
        return parse_pipeline(passes, where=where)
    out: list[Pass] = []
    for item in passes:
        if isinstance(item, str):
            out.extend(parse_pipeline(item, where=where))
        elif dataclasses.is_dataclass(item) and hasattr(item, "run"):
            out.append(item)
        else:
            raise SpecError(f"{where}: {item!r} is neither a pass name nor a pass instance")
    if not out:
        raise SpecError(f"{where}: the pass pipeline is empty")
    return tuple(out)


def describe_passes() -> list[tuple[str, str, list[tuple[str, str, str]]]]:
    """Every registered pass: (name, first docstring line, [(option, type, default)])."""
    rows = []
    for name, cls in sorted(_registry().items()):
        hints = typing.get_type_hints(cls)
        opts = []
        for f in pass_options(cls).values():
            default = f.default if f.default is not dataclasses.MISSING else None
            kind = "file" if "parse" in f.metadata else _type_name(hints[f.name])
            opts.append((_kebab(f.name), kind, _format_value(default)))
        doc = (cls.__doc__ or "").strip().splitlines()
        # a first line may end "(see module docstring)": name that module for the reader
        first = re.sub(r"\((?:see )?(?:the )?module docstring\)",
                       f"(see the docstring of {cls.__module__})", doc[0]) if doc else ""
        rows.append((name, first, opts))
    return rows
