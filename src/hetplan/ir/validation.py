"""Shared helpers that turn user-written files into validated objects with readable errors.

Every file a user types (cluster specs, workloads, plans, profiles) goes through the same
two steps:

1. :func:`load_structured_file` reads YAML or JSON into a ``dict``; syntax errors are reported
   with the file, line and column, and files too large, too deep or writing a key twice are
   refused (:mod:`hetplan.ir.files`, whose functions are re-exported here).
2. :func:`validate_model` validates the dict with pydantic; a ``ValidationError`` becomes a
   :class:`~hetplan.errors.SpecError` whose message has one line per problem, in the form
   ``"{where}: {field.path[0].name}: {what is wrong}"``, with a difflib "did you mean" for
   misspelt keys (SkyPilot's ``validate_schema`` does the same) and a closing hint line.

Both pydantic ``BaseModel`` subclasses and stdlib dataclasses validated through
``TypeAdapter`` are supported.

Example:
    >>> from pydantic import BaseModel, ConfigDict
    >>> class Group(BaseModel):
    ...     model_config = ConfigDict(extra="forbid")
    ...     type: str
    ...     count: int
    >>> validate_model(Group, {"type": "A100", "cuont": 8}, where="c.yaml")
    Traceback (most recent call last):
    ...
    hetplan.errors.SpecError: c.yaml: missing required key 'count'
    c.yaml: cuont: unknown key 'cuont'; did you mean 'count'?
    hint: ...
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import PurePath
from typing import Any, TypeVar, Union, cast

from pydantic import BaseModel, TypeAdapter, ValidationError

from hetplan.errors import SpecError
from hetplan.ir.files import (  # step 1, re-exported: every loader imports them from here
    MAX_DEPTH,
    MAX_ELEMENTS,
    MAX_FILE_BYTES,
    check_output_path,
    check_shape,
    format_loc,
    load_structured_file,
    loads_json,
    parse_json_object,
    read_text_file,
    short_repr,
)

__all__ = [
    "MAX_DEPTH",
    "MAX_ELEMENTS",
    "MAX_FILE_BYTES",
    "DEFAULT_HINT",
    "read_text_file",
    "loads_json",
    "check_shape",
    "parse_json_object",
    "load_structured_file",
    "format_validation_error",
    "validate_model",
    "did_you_mean",
    "check_bounds",
    "check_output_path",
]

T = TypeVar("T")

#: At most this many error lines are printed; the rest are counted.
_MAX_ERROR_LINES = 20
#: The closing line of a field error without a hint of its own (about a file's keys).
DEFAULT_HINT = (
    "hint: fix the fields listed above; keys are case-sensitive and unknown keys are "
    "rejected, so check their spelling"
)


# --------------------------------------------------------------------------------------
# did-you-mean
# --------------------------------------------------------------------------------------
def did_you_mean(
    word: str, choices: Sequence[str] | Mapping[str, Any], *, n: int = 1,
    substring: bool = False,
) -> str:
    """A ``"; did you mean 'x'?"`` suffix for ``word``, or ``""`` when nothing is close.

    The one place that decides which names count as close (difflib's ratio >= 0.6, then the
    same case-folded), so every "unknown name" error in hetplan suggests alike.

    Args:
        word: what the user wrote.
        choices: the valid names.
        n: suggest up to this many names (``"; did you mean 'a', 'b' or 'c'?"``), closest
            first.
        substring: also suggest names that contain ``word`` (first, in ``choices`` order):
            for long dotted names where a user types a part of one.

    Returns:
        The suffix to append to an error message (empty when no choice is similar).

    Example:
        >>> did_you_mean("cuont", ["count", "type"])
        "; did you mean 'count'?"
    """
    names = [str(c) for c in choices]
    folded = {name.casefold(): name for name in names}
    # A name that differs only in case comes first ("a100-80gb" is as close to 'H100-80GB'
    # as to 'A100-80GB' for difflib).
    same = [folded[word.casefold()]] if folded.get(word.casefold(), word) != word else []
    close = difflib.get_close_matches(word, names, n=n, cutoff=0.6)
    if not close:
        # Case slips score low with difflib; compare case-folded too.
        close = [folded[m] for m in difflib.get_close_matches(word.casefold(), list(folded), n=n)]
    close = same + close
    if substring and word:
        close = [name for name in names if word in name][:n] + close
    near = [repr(name) for name in dict.fromkeys(close)][:n]
    if not near:
        return ""
    if len(near) == 1:
        return f"; did you mean {near[0]}?"
    return f"; did you mean {', '.join(near[:-1])} or {near[-1]}?"


# --------------------------------------------------------------------------------------
# walking a model's type along an error location
# --------------------------------------------------------------------------------------
_SEQUENCE_ORIGINS = (list, tuple, set, frozenset, Sequence)
_MAPPING_ORIGINS = (dict, Mapping)


def _strip(tp: Any) -> Any:
    """Unwrap ``Annotated[X, ...]`` and ``X | None`` to ``X`` (repeatedly)."""
    while True:
        origin = typing.get_origin(tp)
        if origin is typing.Annotated:
            tp = typing.get_args(tp)[0]
            continue
        if origin in (Union, types.UnionType):
            members = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(members) == 1:
                tp = members[0]
                continue
        return tp


def _field_types(tp: Any) -> dict[str, Any] | None:
    """Field name (and alias) → annotation of a pydantic model or dataclass, else None."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        out: dict[str, Any] = {}
        for name, info in tp.model_fields.items():
            out[name] = info.annotation
            if info.alias:
                out[info.alias] = info.annotation
        return out
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        try:
            hints = typing.get_type_hints(tp)
        except Exception:  # unresolvable forward refs: the names are still usable
            hints = {}
        return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(tp) if f.init}
    return None


def _child(tp: Any, item: str | int) -> Any:
    """The type found one step below ``tp`` at loc element ``item``; None if unknown."""
    tp = _strip(tp)
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        for m in members:  # pydantic names the union member it tried in the loc
            if getattr(m, "__name__", None) == item:
                return m
        for m in members:
            found = _child(m, item)
            if found is not None:
                return found
        return None
    if isinstance(origin, type) and issubclass(origin, _MAPPING_ORIGINS) and args:
        return args[0] if item == "[key]" else args[1]
    if isinstance(origin, type) and issubclass(origin, _SEQUENCE_ORIGINS) and args:
        if not isinstance(item, int):
            return None
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            return args[item] if 0 <= item < len(args) else None
        return args[0]
    fields = _field_types(tp)
    if fields is not None and isinstance(item, str):
        return fields.get(item)
    return None


def _union_members(tp: Any) -> list[Any]:
    """The members of ``tp`` if it is a union of more than one type (None aside), else []."""
    tp = _strip(tp)
    if typing.get_origin(tp) not in (Union, types.UnionType):
        return []
    return [a for a in typing.get_args(tp) if a is not type(None)]


def _tagged_member(members: Sequence[Any], item: str) -> Any:
    """The member a discriminated union names ``item`` by (a ``Literal`` field of that
    value), else None."""
    for m in members:
        for annotation in (_field_types(_strip(m)) or {}).values():
            if typing.get_origin(annotation) is typing.Literal and \
                    typing.get_args(annotation) == (item,):
                return m
    return None


def _file_loc(model: Any, loc: Sequence[str | int]) -> tuple[tuple[str | int, ...], Any]:
    """``loc`` as the file writes it: without the union members pydantic names in it
    (``'str'``, ``"function-before[strict_float(), constrained-float]"``, a discriminator's
    tag), and the union type the last element named a member of (None: it named none, or
    one of a discriminated union, which tries that member alone)."""
    out: list[str | int] = []
    tp: Any = model
    last_union = None
    for item in loc:
        members = _union_members(tp) if tp is not None else []
        last_union = None
        if members and isinstance(item, str) and not any(
                item in (_field_types(_strip(m)) or {}) for m in members):
            tagged = _tagged_member(members, item)  # a discriminated union tries one member
            last_union = None if tagged is not None else tp
            tp = tagged or next((m for m in members if getattr(m, "__name__", None) == item),
                                None)
            continue
        out.append(item)
        tp = _child(tp, item) if tp is not None else None
    return tuple(out), last_union


def _without_union_tags(errors: list[Any], model: Any) -> list[Any]:
    """``errors`` at the locations the file writes (see :func:`_file_loc`). A value no
    member of a union takes gets one error (``expected a string or a list, got null``)
    instead of one per member; where one member got further into the value (a mapping with
    a bad field), only its errors are kept."""
    if model is None:
        return errors
    placed = [(err, *_file_loc(model, err.get("loc", ()))) for err in errors]
    deeper = {loc[:k] for _, loc, union in placed for k in range(len(loc))}
    out: list[Any] = []
    merged: set[tuple[str | int, ...]] = set()
    for err, loc, union in placed:
        if union is None:
            out.append({**err, "loc": loc})
        elif loc not in deeper and loc not in merged:
            merged.add(loc)
            kinds = [_kind_name(m) for m in _union_members(union)]
            value = err.get("input")
            shown = "" if isinstance(value, (Mapping, list, tuple)) or value is None else (
                f" {short_repr(value)}")
            out.append({"loc": loc, "type": "value_error", "input": value,
                        "msg": f"expected {_or(kinds)}, got {_json_kind(value)}{shown}"})
    return out


def _kind_name(tp: Any) -> str:
    """What a value of type ``tp`` is, in a file's words."""
    tp = _strip(tp)
    origin = typing.get_origin(tp) or tp
    names = ((bool, "a boolean"), (int, "an integer"), (float, "a number"),
             (str, "a string"), (PurePath, "a file path"))
    for cls, name in names:
        if origin is cls or (isinstance(origin, type) and issubclass(origin, cls)):
            return name
    if isinstance(origin, type) and issubclass(origin, _SEQUENCE_ORIGINS):
        return "a list"
    return "a mapping"


def _or(items: Sequence[str]) -> str:
    unique = list(dict.fromkeys(items))
    return unique[0] if len(unique) == 1 else ", ".join(unique[:-1]) + " or " + unique[-1]


def _allowed_keys(model: Any, parent_loc: Sequence[str | int]) -> list[str] | None:
    """The keys allowed by the model found at ``parent_loc`` under ``model``; None if unknown."""
    tp: Any = model
    for item in parent_loc:
        if tp is None:
            return None
        tp = _child(tp, item)
    if tp is None:
        return None
    fields = _field_types(_strip(tp))
    return sorted(fields) if fields is not None else None


# --------------------------------------------------------------------------------------
# formatting
# --------------------------------------------------------------------------------------
_EXTRA_TYPES = ("extra_forbidden", "unexpected_keyword_argument")
_MISSING_TYPES = ("missing", "missing_argument", "missing_keyword_only_argument")
#: pydantic's names for the containers a file writes as a list (YAML ``- a``, JSON ``[a]``).
_LIST_TYPES = ("tuple_type", "list_type", "set_type", "frozen_set_type")
_BOUND_TYPES = ("less_than_equal", "less_than", "greater_than_equal", "greater_than")
#: pydantic's names for what a file writes as a mapping (YAML ``key: value``, JSON ``{}``).
_MAPPING_TYPES = ("dict_type", "model_type", "model_attributes_type", "dataclass_type")
#: The unit of a field, by its name's suffix (or its parent's name): (unit, an example in
#: it, the smaller unit a value far above the field's maximum was probably written in).
_UNITS = (
    ("_gbps", ("Gbit/s", "100 Gb/s Ethernet is 100.0", "bit/s")),
    ("_gb_s", ("GB/s", "an A100's 2039 GB/s is 2039.0", "byte/s")),
    ("_gib", ("GiB", "80 GiB is 80.0", "bytes")),
    ("_us", ("microseconds", "25 us is 25.0", "nanoseconds")),
    ("peak_tflops", ("TFLOP/s", "312 TFLOP/s is 312.0", "FLOP/s")),
)


def _format_one(err: Mapping[str, Any], where: str, model: Any) -> str:
    loc: tuple[str | int, ...] = tuple(err.get("loc", ()))
    kind = str(err.get("type", ""))
    msg = str(err.get("msg", ""))
    value = err.get("input")

    if kind in _EXTRA_TYPES and loc:
        key = str(loc[-1])
        allowed = _allowed_keys(model, loc[:-1]) if model is not None else None
        text = f"unknown key {key!r}"
        if allowed:
            suggestion = did_you_mean(key, allowed)
            text += suggestion or f"; allowed keys here: {', '.join(allowed)}"
        return _line(where, loc, text)

    if kind in _MISSING_TYPES and loc:
        return _line(where, loc[:-1], f"missing required key {str(loc[-1])!r}")

    is_key = bool(loc) and loc[-1] == "[key]"
    if is_key:
        loc = loc[:-1]
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            msg = msg[len(prefix) :]
    if kind in ("value_error", "assertion_error"):
        # Our own validators write complete sentences that already quote the input; one
        # validator may report several problems, one per line. A number written with its
        # unit ('100Gbps') is told the unit the field is in.
        if isinstance(value, str) and msg.startswith(("expected a number", "expected an int")):
            msg += _unit_hint(loc, kind)
        return "\n".join(_line(where, loc, part) for part in msg.splitlines() if part)
    if kind in _MAPPING_TYPES and not is_key:
        shown = "" if value is None or isinstance(value, (list, tuple)) else f" {short_repr(value)}"
        what = "a list" if isinstance(value, (list, tuple)) else _json_kind(value)
        return _line(where, loc, f"expected a mapping ('key: value' lines), got {what}{shown}")

    if kind in _LIST_TYPES and not is_key:
        shown = "" if value is None or isinstance(value, Mapping) else f" {short_repr(value)}"
        return _line(where, loc, f"expected a list, got {_json_kind(value)}{shown}")
    if kind == "int_parsing_size" and isinstance(value, float):  # pydantic says "string"
        msg = "a number too large for an integer count (every count is at most 2**53)"
    text = f"invalid key {value!r}: {msg}" if is_key else msg
    if not is_key and not isinstance(value, (dict, list, tuple)):
        text += f" (got {short_repr(value)})"
    if kind in _BOUND_TYPES and not is_key:
        text += _unit_hint(loc, kind)
    if kind == "literal_error" and isinstance(value, str):
        choices = re.findall(r"'([^']*)'", str(err.get("ctx", {}).get("expected", "")))
        text += did_you_mean(value, choices)
    return _line(where, loc, text)


def _json_kind(value: Any) -> str:
    """What a file wrote, in the file's words (a mapping, a string ...)."""
    if isinstance(value, Mapping):
        return "a mapping"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return f"a {type(value).__name__}"


def _unit_hint(loc: Sequence[str | int], kind: str) -> str:
    """The unit of an out-of-range field named by a unit suffix: a bandwidth in bit/s or a
    memory in bytes is refused by its bound, and the message says which unit is meant."""
    names = [str(part) for part in loc[-2:] if isinstance(part, str)]
    for suffix, (unit, example, smaller) in _UNITS:
        if any(name.endswith(suffix) for name in names):
            above = kind.startswith("less_than")  # the value broke the upper bound
            return f"; the unit is {unit} ({example})" + (f", not {smaller}" if above else "")
    return ""


def _line(where: str, loc: Sequence[str | int], text: str) -> str:
    path = format_loc(loc)
    return f"{where}: {path}: {text}" if path else f"{where}: {text}"


def format_validation_error(
    e: ValidationError,
    *,
    where: str,
    model: type[BaseModel] | type | None = None,
    hint: str | None = None,
) -> str:
    """Turn a pydantic ``ValidationError`` into a readable, multi-line message.

    Each error becomes one line ``"{where}: {dotted.path[0].field}: {message}"``. An unknown
    key reads ``unknown key 'cuont'; did you mean 'count'?``, the suggestion drawn from the
    fields of the model at that path (``model`` is walked along the error's location through
    nested models, dataclasses, lists, tuples and dicts); when nothing is close the allowed
    keys are listed. Other errors carry the offending value (``!r``, truncated). The last line
    is a hint on how to fix the file.

    Args:
        e: the error pydantic raised.
        where: where the data came from (a file path, ``"<string>"``).
        model: the type that was validated, for key suggestions; None disables them.
        hint: the closing line; a generic one when None.

    Returns:
        The message (no trailing newline).
    """
    errors = _without_union_tags(e.errors(include_url=False), model)
    lines = [_format_one(err, where, model) for err in errors[:_MAX_ERROR_LINES]]
    if len(errors) > _MAX_ERROR_LINES:
        lines.append(f"{where}: ... and {len(errors) - _MAX_ERROR_LINES} more errors")
    lines.append(hint if hint is not None else DEFAULT_HINT)
    return "\n".join(lines)


def validate_model(
    model_cls: type[T], data: Mapping[str, Any], *, where: str, hint: str | None = None
) -> T:
    """Validate ``data`` as ``model_cls`` (a pydantic model or a dataclass).

    Args:
        model_cls: a ``BaseModel`` subclass, or any type pydantic's ``TypeAdapter`` accepts.
        data: the parsed file content.
        where: where ``data`` came from, for messages.
        hint: the closing line of the error message; a generic one when None.

    Returns:
        The validated instance.

    Raises:
        SpecError: one line per problem, see :func:`format_validation_error`.
    """
    try:
        if isinstance(model_cls, type) and issubclass(model_cls, BaseModel):
            return cast(T, model_cls.model_validate(data))
        return TypeAdapter(model_cls).validate_python(data)
    except ValidationError as e:
        raise SpecError(format_validation_error(e, where=where, model=model_cls, hint=hint)) from e


def check_bounds(bounds: Sequence[tuple[int, int]], n: int | None = None) -> None:
    """Raise SpecError unless ``bounds`` are non-empty contiguous ranges from layer 0 (and,
    when ``n`` is given, covering 0..n-1). The one contiguity check of solvers, the plan's
    re-balancing events and the runtime."""
    expect = 0
    for s, (i, j) in enumerate(bounds):
        if i != expect or j < i:
            raise SpecError(f"stage {s} covers layers {i}..{j}; expected a non-empty range "
                            f"starting at {expect}")
        expect = j + 1
    if n is not None and expect != n:
        raise SpecError(f"the stages end at layer {expect - 1} but there are {n} layers")
