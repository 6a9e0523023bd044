"""Shared helpers that turn user-written files into validated objects with readable errors.

Every file a user types (cluster specs, workloads, plans, profiles) goes through the same
two steps:

1. :func:`load_structured_file` reads YAML or JSON into a ``dict``; syntax errors are reported
   with the file, line and column.
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
import json
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar, Union, cast

import yaml
from pydantic import BaseModel, TypeAdapter, ValidationError

from hetplan.errors import SpecError

__all__ = [
    "MAX_DEPTH",
    "MAX_ELEMENTS",
    "MAX_FILE_BYTES",
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
#: Offending input values longer than this (as ``repr``) are cut.
_MAX_VALUE_CHARS = 60

#: Files are at most this large (the largest real one, a plan for a 70B-parameter model, is a
#: few hundred KiB); a larger file is refused before it is parsed.
MAX_FILE_BYTES = 32 * 2**20
#: Files nest at most this deep (the deepest real plan or cluster spec nests 7 levels).
MAX_DEPTH = 32
#: Files hold at most this many values (lists, mappings and scalars; a YAML alias counts each
#: time it is used, so an "alias bomb" is refused instead of expanding for minutes).
MAX_ELEMENTS = 2_000_000

_DEFAULT_HINT = (
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
    close = difflib.get_close_matches(word, names, n=n, cutoff=0.6)
    if not close:
        # Case slips ("a100-80gb") score low with difflib; compare case-folded too.
        folded = {name.casefold(): name for name in names}
        close = [folded[m] for m in difflib.get_close_matches(word.casefold(), list(folded), n=n)]
    if substring and word:
        close = [name for name in names if word in name][:n] + close
    near = [repr(name) for name in dict.fromkeys(close)][:n]
    if not near:
        return ""
    if len(near) == 1:
        return f"; did you mean {near[0]}?"
    return f"; did you mean {', '.join(near[:-1])} or {near[-1]}?"


# --------------------------------------------------------------------------------------
# reading files
# --------------------------------------------------------------------------------------
class _UniqueKeyLoader(yaml.SafeLoader):
    """A SafeLoader that rejects a key written twice in one mapping (PyYAML keeps the last)."""


def _construct_unique_mapping(
    loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False
) -> dict[Any, Any]:
    seen: dict[Any, yaml.Mark] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if not isinstance(key, typing.Hashable):
            raise yaml.constructor.ConstructorError(
                None, None, f"a key must be a plain value, got {_kind_of(key)} {key!r}",
                key_node.start_mark,
            )
        if key in seen:
            first = seen[key]
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"duplicate key {key!r} (first written at line {first.line + 1})",
                key_node.start_mark,
            )
        seen[key] = key_node.start_mark
    loader.flatten_mapping(node)
    return dict(loader.construct_pairs(node, deep=deep))


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _construct_unique_mapping,
)


def _source_excerpt(text: str, line: int, column: int) -> str:
    """The 1-based ``line`` of ``text`` with a caret under ``column`` (1-based), indented."""
    lines = text.splitlines()
    if not 1 <= line <= len(lines):
        return ""
    src = lines[line - 1]
    return f"\n    {src}\n    {' ' * max(column - 1, 0)}^"


class _DuplicateKey(Exception):
    def __init__(self, key: str, keys: list[str]) -> None:
        super().__init__(key)
        self.key, self.keys = key, keys


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key, [k for k, _ in pairs])
        out[key] = value
    return out


def loads_json(text: str, *, where: str) -> Any:
    """``json.loads`` that refuses what the standard parser lets through or turns into a crash.

    Refused with a :class:`SpecError` naming ``where``: a key written twice in one object
    (``json.loads`` keeps the last silently; YAML files are refused alike), nesting deeper
    than :data:`MAX_DEPTH` or more than :data:`MAX_ELEMENTS` values (see :func:`check_shape`),
    and integers too long to convert (over 4300 digits).

    Raises:
        json.JSONDecodeError: a syntax error, for the caller to explain with its position.
        SpecError: as above.
    """
    try:
        data = json.loads(text, object_pairs_hook=_unique_object)
    except _DuplicateKey as e:
        raise SpecError(
            f"{where}: not valid: the key {e.key!r} is written twice in one object (keys "
            f"{_short_repr(e.keys)}); keep one"
        ) from None
    except RecursionError:
        raise SpecError(
            f"{where}: nested too deeply to read (more than {MAX_DEPTH} levels are never "
            "needed); is this the right file?"
        ) from None
    except json.JSONDecodeError:
        raise
    except ValueError as e:  # e.g. an integer literal longer than Python converts
        raise SpecError(f"{where}: not valid JSON: {e}") from None
    check_shape(data, where=where)
    return data


def check_shape(data: Any, *, where: str) -> None:
    """Refuse parsed data nested deeper than :data:`MAX_DEPTH` or holding more than
    :data:`MAX_ELEMENTS` values, naming the path of the first value too deep.

    O(values), stopped at :data:`MAX_ELEMENTS` (a YAML alias is visited each time it is used,
    as validation would).
    """
    containers = (dict, list, tuple)  # what json and yaml build (exact types: fast)
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(data, ())]
    count = 1
    while stack:
        value, path = stack.pop()
        if type(value) is dict:
            items: Any = value.items()
        elif type(value) in (list, tuple):
            items = enumerate(value)
        else:
            continue
        if len(path) >= MAX_DEPTH:
            raise SpecError(
                f"{where}: {_format_loc(path[:6])}...: nested more than {MAX_DEPTH} levels "
                "deep; no hetplan file nests this deeply, is this the right file?"
            )
        count += len(value)
        if count > MAX_ELEMENTS:
            raise SpecError(
                f"{where}: holds more than {MAX_ELEMENTS:,} values (YAML aliases count each "
                "time they are used); no hetplan file is this large, is this the right file?"
            )
        for key, child in items:
            if type(child) in containers:
                stack.append((child, (*path, key if isinstance(key, int) else str(key))))


def _parse_json(text: str, where: str) -> Any:
    try:
        return loads_json(text, where=where)
    except json.JSONDecodeError as e:
        raise SpecError(
            f"{where}: not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}"
            f"{_source_excerpt(text, e.lineno, e.colno)}\n"
            "hint: check for a missing comma or quote, or a trailing comma, near that position"
        ) from e


def parse_json_object(text: str, *, where: str, what: str, hint: str = "") -> dict[str, Any]:
    """Parse ``text`` as a JSON object, or raise SpecError naming ``where`` and the position.

    Args:
        text: the JSON text.
        where: the source's name in messages (a file path).
        what: what the file should be ("a workload file", "a profile DB").
        hint: appended to the message (how to get a fresh file).
    """
    if not hint:
        data = _parse_json(text, where)
    else:
        try:
            data = loads_json(text, where=where)
        except json.JSONDecodeError as e:
            raise SpecError(
                f"{where}: not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}; {hint}"
            ) from e
    if not isinstance(data, dict):
        raise SpecError(
            f"{where}: {what} is a JSON object, got a JSON {_kind_of(data)}"
            + (f"; {hint}" if hint else "")
        )
    return data


def _parse_yaml(text: str, where: str) -> Any:
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass: safe
    except RecursionError:
        raise SpecError(
            f"{where}: nested too deeply to read (more than {MAX_DEPTH} levels are never "
            "needed); is this the right file?"
        ) from None
    except ValueError as e:  # e.g. an integer literal longer than Python converts
        raise SpecError(f"{where}: not valid YAML: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        problem = getattr(e, "problem", None) or str(e)
        if mark is None:
            raise SpecError(f"{where}: not valid YAML: {problem}") from e
        line, col = mark.line + 1, mark.column + 1
        raise SpecError(
            f"{where}: not valid YAML: {problem} at line {line}, column {col}"
            f"{_source_excerpt(text, line, col)}\n"
            "hint: check the indentation (spaces, not tabs), a missing ':' after a key, "
            "and unbalanced quotes or brackets near that position"
        ) from e
    check_shape(data, where=where)
    return data


def read_text_file(path: Path, *, what: str) -> str:
    """The UTF-8 text of ``path``, refusing a directory, an unreadable file, one that is not
    UTF-8, and one over :data:`MAX_FILE_BYTES` (checked before reading it).

    Raises:
        SpecError: naming the file and what to do.
    """
    where = str(path)
    if not path.is_file():
        raise SpecError(f"{what} file {where!r} is not a regular file; pass the path of a file")
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise SpecError(
                f"{where}: the {what} file is {size / 2**20:.1f} MiB; hetplan reads files of "
                f"at most {MAX_FILE_BYTES // 2**20} MiB (real ones are far smaller): is this "
                "the right file?"
            )
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(
            f"{where}: the {what} file is not UTF-8 text ({e.reason} at byte {e.start}); "
            "save it as UTF-8 YAML or JSON"
        ) from e
    except OSError as e:
        raise SpecError(
            f"{what} file {where!r} cannot be read: {e.strerror or e}; check its permissions"
        ) from e


def load_structured_file(path: str | Path, *, what: str) -> dict[str, Any]:
    """Read a YAML or JSON file whose top level is a mapping.

    ``.yaml``/``.yml`` files are parsed as YAML (a key written twice is an error), ``.json``
    files as JSON; any other suffix is tried as JSON first, then as YAML.

    Args:
        path: the file.
        what: what the file should contain, for messages (``"cluster spec"``).

    Returns:
        The top-level mapping.

    Raises:
        SpecError: the file is missing or unreadable, its syntax is invalid (the message has
            the line and column), or its top level is not a mapping.
    """
    p = Path(path)
    where = str(p)
    if not p.exists():
        raise SpecError(
            f"{what} file {where!r} does not exist (resolved to {str(p.absolute())!r}); "
            "check the path"
        )
    text = read_text_file(p, what=what)

    suffix = p.suffix.lower()
    if suffix in (".yaml", ".yml"):
        data = _parse_yaml(text, where)
    elif suffix == ".json":
        data = _parse_json(text, where)
    else:
        try:
            data = loads_json(text, where=where)
        except json.JSONDecodeError:
            data = _parse_yaml(text, where)

    if data is None:
        raise SpecError(
            f"{where}: the {what} file is empty; write the {what} as a YAML or JSON mapping"
        )
    if not isinstance(data, dict):
        raise SpecError(
            f"{where}: the top level of a {what} file must be a mapping of keys to values, "
            f"got a {_kind_of(data)}; write it as 'key: value' lines (YAML) or an object "
            "{...} (JSON)"
        )
    return cast(dict[str, Any], data)


def _kind_of(value: Any) -> str:
    if isinstance(value, list):
        return "list"
    if isinstance(value, str):
        return "string"
    return type(value).__name__


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
_PLAIN_KEY = re.compile(r"^[A-Za-z_][\w\-]*$")


def _format_loc(loc: Sequence[str | int]) -> str:
    """``('nodes', 0, 'devices', 1, 'count')`` → ``nodes[0].devices[1].count``."""
    out = ""
    for item in loc:
        if isinstance(item, int):
            out += f"[{item}]"
        elif _PLAIN_KEY.match(item):
            out += f".{item}" if out else item
        else:
            out += f"[{item!r}]"
    return out


def _short_repr(value: Any) -> str:
    text = repr(value)
    if len(text) > _MAX_VALUE_CHARS:
        text = text[: _MAX_VALUE_CHARS - 3] + "..."
    return text


_EXTRA_TYPES = ("extra_forbidden", "unexpected_keyword_argument")
_MISSING_TYPES = ("missing", "missing_argument", "missing_keyword_only_argument")


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
        # validator may report several problems, one per line.
        return "\n".join(_line(where, loc, part) for part in msg.splitlines() if part)

    text = f"invalid key {value!r}: {msg}" if is_key else msg
    if not is_key and not isinstance(value, (dict, list, tuple)):
        text += f" (got {_short_repr(value)})"
    if kind == "literal_error" and isinstance(value, str):
        choices = re.findall(r"'([^']*)'", str(err.get("ctx", {}).get("expected", "")))
        text += did_you_mean(value, choices)
    return _line(where, loc, text)


def _line(where: str, loc: Sequence[str | int], text: str) -> str:
    path = _format_loc(loc)
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
    errors = e.errors(include_url=False)
    lines = [_format_one(err, where, model) for err in errors[:_MAX_ERROR_LINES]]
    if len(errors) > _MAX_ERROR_LINES:
        lines.append(f"{where}: ... and {len(errors) - _MAX_ERROR_LINES} more errors")
    lines.append(hint if hint is not None else _DEFAULT_HINT)
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


def check_output_path(path: str | Path, *, option: str) -> Path:
    """Refuse, before any work, an output file that could not be written.

    The directory must exist (hetplan never creates directories: a typo in ``-o
    /nonexistent/x.png`` must not create ``/nonexistent``) and be writable, and the path
    must not be a directory.

    Args:
        path: the file to be written.
        option: how the user gave it (``"-o/--output"``), for the message.

    Returns:
        ``path`` as a :class:`Path`.

    Raises:
        SpecError: naming the option, the path and the fix.
    """
    p = Path(path)
    if p.is_dir():
        raise SpecError(f"{option} {str(p)!r} is a directory; give the path of a file to write")
    parent = p.parent
    if not parent.exists():
        raise SpecError(f"{option} {str(p)!r}: the directory {str(parent)!r} does not exist; "
                        "create it first (hetplan does not create directories)")
    if not parent.is_dir():
        raise SpecError(f"{option} {str(p)!r}: {str(parent)!r} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise SpecError(f"{option} {str(p)!r} cannot be written (permission denied); choose "
                        "another path")
    return p
