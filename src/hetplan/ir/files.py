"""Reading the files a user types: YAML or JSON text into plain data, within limits.

Step 1 of turning a file into a validated object (step 2, validation with readable errors, is
:mod:`hetplan.ir.validation`). Every file a user types goes through here: cluster specs,
plans, workloads, profiles, dynamics files and run reports. A file is refused with a
:class:`~hetplan.errors.SpecError` naming it (and the line and column, or the path inside it)
when it is missing, not UTF-8, over :data:`MAX_FILE_BYTES`, not valid YAML/JSON, writes a key
twice (JSON's own parser keeps the last silently), nests deeper than :data:`MAX_DEPTH`, or
holds more than :data:`MAX_ELEMENTS` values: never a RecursionError, an OverflowError or a
hang. Output paths are checked here too (:func:`check_output_path`), before any work.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
import tempfile
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import yaml

from hetplan.errors import SpecError

__all__ = [
    "MAX_DEPTH",
    "MAX_ELEMENTS",
    "MAX_FILE_BYTES",
    "check_kind",
    "check_output_path",
    "check_overwrite",
    "check_shape",
    "creation_refused",
    "file_kind",
    "format_loc",
    "load_structured_file",
    "loads_json",
    "os_error_fix",
    "parse_json_object",
    "read_text_file",
    "short_repr",
    "write_text_file",
]

#: Files are at most this large (the largest real one, a plan for a 70B-parameter model, is a
#: few hundred KiB); a larger file is refused before it is parsed.
MAX_FILE_BYTES = 32 * 2**20
#: Files nest at most this deep (the deepest real plan or cluster spec nests 7 levels).
MAX_DEPTH = 32
#: Files hold at most this many values (lists, mappings and scalars; a YAML alias counts each
#: time it is used, so an "alias bomb" is refused instead of expanding for minutes).
MAX_ELEMENTS = 2_000_000
#: Offending input values longer than this (as ``repr``) are cut in messages.
_MAX_VALUE_CHARS = 60


# --------------------------------------------------------------------------------------
# reading files
# --------------------------------------------------------------------------------------
#: PyYAML's safe loader on libyaml's parser where PyYAML was built with it (its wheels are):
#: the pure-Python scanner takes seconds on a 1 MiB file (2.5 s for a 10,000-item list of
#: strings; libyaml 0.06 s). Constructing objects, and so the checks below, stays Python.
_SAFE_LOADER: type[yaml.SafeLoader] = cast(
    "type[yaml.SafeLoader]", getattr(yaml, "CSafeLoader", yaml.SafeLoader))


class _UniqueKeyLoader(_SAFE_LOADER):
    """A safe loader that rejects a key written twice in one mapping (PyYAML keeps the last).
    Merge keys (``<<: *anchor``) are read as the safe loader reads them: a key written in
    the mapping itself overrides a merged one."""


_MERGE_TAG = "tag:yaml.org,2002:merge"


def _construct_unique_mapping(
    loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False
) -> dict[Any, Any]:
    seen: dict[Any, yaml.Mark] = {}
    for key_node, _ in node.value:
        if key_node.tag == _MERGE_TAG:  # flatten_mapping below merges it
            continue
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
    if isinstance(text, str) and text.startswith("\ufeff"):
        text = text[1:]  # a byte-order mark, as read_text_file drops it
    try:
        data = json.loads(text, object_pairs_hook=_unique_object)
    except _DuplicateKey as e:
        raise SpecError(
            f"{where}: not valid: the key {e.key!r} is written twice in one object (keys "
            f"{short_repr(e.keys)}); keep one"
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
                f"{where}: {format_loc(path[:6])}...: nested more than {MAX_DEPTH} levels "
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


# -- which kind of file is it? ----------------------------------------------------------------
#: The files hetplan reads, each recognised by top-level keys only it has (the first match
#: wins): (kind, what a file of it is, its signs (any one: all of its keys present), how to
#: get one). A file of one kind passed where another is read is named for what it is,
#: instead of being refused key by key or, worse, by a schema version it does not have.
_KINDS: tuple[tuple[str, str, tuple[tuple[str, ...], ...], str], ...] = (
    ("profile DB", "a profile DB (written by `hetplan profile`)",
     (("machines",), ("compute", "collectives")), "pass a file written by `hetplan profile -o "
     "FILE`"),
    ("workload", "a workload (written by `hetplan ir MODEL -o FILE`)", (("grad_tensors",),),
     "pass a workload written by `hetplan ir MODEL -o FILE`"),
    ("plan", "a plan (written by `hetplan plan`)", (("tool_version",), ("model", "cluster")),
     "pass a plan written by `hetplan plan MODEL --cluster C --batch-size N -o FILE`"),
    ("run report", "a run report (written by `hetplan run --report`)",
     (("measured", "per_rank"),), "pass a report written by `hetplan run PLAN --report FILE`"),
    ("cluster spec", "a cluster spec", (("nodes",),),
     "pass a preset name (`hetplan presets`) or a cluster file like those in examples/clusters/"),
    ("dynamics", "a dynamics file (pruning, freezing or early exit while training)",
     (("total_iterations",),), "pass a file like examples/pruning.yaml"),
    ("trace", "a run's trace (written by `hetplan run --trace`)", (("traceEvents",),),
     "pass a trace written by `hetplan run PLAN --trace FILE`"),
)


def file_kind(data: Mapping[str, Any]) -> str | None:
    """Which kind of hetplan file ``data`` (a file's top-level mapping) is: ``"plan"``,
    ``"cluster spec"``, ``"workload"``, ``"profile DB"``, ``"run report"``, ``"dynamics"``,
    ``"trace"``, or None when no kind's keys are there."""
    for kind, _, signs, _ in _KINDS:
        if any(all(key in data for key in sign) for sign in signs):
            return kind
    return None


def check_kind(data: Mapping[str, Any], *, what: str, where: str) -> None:
    """Refuse a file of another kind than ``what`` (a kind of :func:`file_kind`, with or
    without "a " and " file"; anything else is not checked), naming what it is and how to
    get the right one."""
    expected = next((k for k in _KINDS if k[0] == _kind_name(what)), None)
    found = file_kind(data)
    if expected is None or found is None or found == expected[0]:
        return
    described = next(k[1] for k in _KINDS if k[0] == found)
    noun = f"{expected[0]} file" if expected[0] == "dynamics" else expected[0]
    article = "an" if noun[0] in "aeiou" else "a"
    raise SpecError(f"{where}: this is {described}, not {article} {noun}; {expected[3]}")


def _kind_name(what: str) -> str:
    for prefix in ("a ", "an "):
        what = what.removeprefix(prefix)
    return what.removesuffix(" file")


def check_kind_of_text(text: str, *, what: str, where: str) -> None:
    """For a file that is not valid JSON: if it is YAML of another kind (a cluster spec
    passed as a plan), refuse it as that kind (:func:`check_kind`); otherwise return and let
    the caller report the JSON error."""
    try:
        data = _parse_yaml(text, where)
    except SpecError:
        return
    if isinstance(data, dict):
        check_kind(data, what=what, where=where)


def parse_json_object(text: str, *, where: str, what: str, hint: str = "") -> dict[str, Any]:
    """Parse ``text`` as a JSON object, or raise SpecError naming ``where`` and the position.

    Args:
        text: the JSON text.
        where: the source's name in messages (a file path).
        what: what the file should be ("a workload file", "a profile DB").
        hint: appended to the message (how to get a fresh file).
    """
    try:
        data = loads_json(text, where=where)
    except json.JSONDecodeError as e:
        check_kind_of_text(text, what=what, where=where)
        if not hint:
            data = _parse_json(text, where)  # raises, with the source excerpt
        raise SpecError(
            f"{where}: not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}; {hint}"
        ) from e
    if not isinstance(data, dict):
        raise SpecError(
            f"{where}: {what} is a JSON object, got a JSON {_kind_of(data)}"
            + (f"; {hint}" if hint else "")
        )
    check_kind(data, what=what, where=where)
    return data


def _flow_depth(text: str) -> int:
    """The deepest nesting of YAML flow collections (``[`` and ``{``) in ``text``, outside
    quoted scalars and comments: one linear pass."""
    depth = deepest = 0
    quote = ""
    comment = False
    prev = "\n"
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if comment:
            comment = c != "\n"
        elif quote:
            if c == "\\" and quote == '"':
                i += 1
            elif c == quote:
                quote = ""
        elif c in "\"'":
            quote = c
        elif c == "#" and prev in " \t\n":
            comment = True
        elif c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth = max(depth - 1, 0)
        prev = c
        i += 1
    return deepest


def _parse_yaml(text: str, where: str) -> Any:
    # PyYAML takes seconds, and under load far longer, to reach its recursion limit on a
    # value nested thousands of flow collections deep: refuse it before parsing (the scan
    # costs a fraction of PyYAML's own parse; a file nested only a little too deep is
    # parsed and refused by check_shape, which names where). The depth is at most the count
    # of openers, which str.count takes at C speed: most files skip the scan.
    limit = 8 * MAX_DEPTH
    if text.count("[") + text.count("{") > limit and _flow_depth(text) > limit:
        raise SpecError(
            f"{where}: nested too deeply to read (more than {MAX_DEPTH} levels are never "
            "needed); is this the right file?")
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


def file_path(path: Any, *, what: str) -> Path:
    """``path`` (a ``str`` or ``os.PathLike``) as a :class:`Path`; anything else is refused
    with a :class:`SpecError` naming what was to be read (the Python API's loaders take
    paths: ``load_plan(None)`` was pathlib's TypeError)."""
    if isinstance(path, (str, os.PathLike)):
        return Path(path)
    raise SpecError(f"expected the path of a {what} file (a str or a Path), got "
                    f"{type(path).__name__}")


def read_text_file(path: Path, *, what: str) -> str:
    """The UTF-8 text of ``path`` (without a leading byte-order mark), refusing a directory,
    an unreadable file, one that is not UTF-8, and one over :data:`MAX_FILE_BYTES` (checked
    before reading it).

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
        # utf-8-sig: a byte-order mark (Windows editors write one) is not part of the text
        return path.read_text(encoding="utf-8-sig")
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
    p = file_path(path, what=what)
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
    elif suffix == ".json":  # an empty file is said to be empty below, not bad JSON
        data = _parse_json(text, where) if text.strip() else None
    else:
        try:
            data = loads_json(text, where=where)
        except json.JSONDecodeError:
            data = _parse_yaml(text, where)

    if data is None:  # the fix of a file hetplan writes is to write it again, not by hand
        fix = next((how for kind, _, _, how in _KINDS if kind == what),
                   f"write the {what} as a YAML or JSON mapping")
        raise SpecError(f"{where}: the {what} file is empty; {fix}")
    if not isinstance(data, dict):
        raise SpecError(
            f"{where}: the top level of the {what} file must be a mapping of keys to values, "
            f"got a {_kind_of(data)}; write it as 'key: value' lines (YAML) or an object "
            "{...} (JSON)"
        )
    check_kind(data, what=what, where=where)
    return cast(dict[str, Any], data)


def _kind_of(value: Any) -> str:
    if isinstance(value, list):
        return "list"
    if isinstance(value, str):
        return "string"
    return type(value).__name__


# --------------------------------------------------------------------------------------
# output paths
# --------------------------------------------------------------------------------------
def check_overwrite(path: str | Path, *, option: str, kind: str) -> None:
    """Refuse to overwrite a hetplan file of another kind than ``kind`` (what is about to be
    written there, a kind of :func:`file_kind`; ``""`` for a file of no hetplan kind, such
    as an engine's configuration): ``hetplan run plan.json --report plan.json`` would replace
    the plan with its run report, ``hetplan plan ... -o cluster.yaml`` the cluster spec. A
    file that is not a readable YAML or JSON mapping is someone else's to overwrite."""
    p = Path(path)
    if not p.is_file():
        return
    try:
        found = file_kind(load_structured_file(p, what="output"))
    except SpecError:
        return
    if found is None or found == kind:
        return
    described = next(k[1] for k in _KINDS if k[0] == found)
    raise SpecError(f"{option} {str(p)!r} is {described}; writing "
                    f"{'the ' + kind if kind else 'the output'} there would overwrite it: "
                    "choose another path")


def check_output_path(path: str | Path, *, option: str, kind: str | None = None) -> Path:
    """Refuse, before any work, an output file that could not be written.

    The directory must exist (hetplan never creates directories: a typo in ``-o
    /nonexistent/x.png`` must not create ``/nonexistent``) and be writable, and the path
    must not be a directory, nor, with ``kind``, a hetplan file of another kind
    (:func:`check_overwrite`).

    Args:
        path: the file to be written.
        option: how the user gave it (``"-o/--output"``), for the message.
        kind: what will be written (a kind of :func:`file_kind`, ``""`` for none), to refuse
            overwriting a file of another kind; None does not look at an existing file.

    Returns:
        ``path`` as a :class:`Path`.

    Raises:
        SpecError: naming the option, the path and the fix.
    """
    p = Path(path)
    if str(path) == "-":
        raise SpecError(f"{option} '-' would write a file named '-': hetplan does not write to "
                        f"standard output through {option}; give the path of a file (export "
                        "prints its configuration there without -o, ir with --json)")
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
    why = _write_refused(p)
    if why:
        raise SpecError(f"{option} {str(p)!r} cannot be written ({why}); choose another path")
    if kind is not None:
        check_overwrite(p, option=option, kind=kind)
    return p


def _write_refused(p: Path) -> str:
    """Why the file system refuses to write ``p`` ("": it does not), found by trying:
    ``os.access`` says yes to root whatever the file system allows (``/sys``, ``/proc``, a
    read-only mount). A regular file is opened for update (not truncated); a new one is
    probed with a temporary file created and removed in its directory."""
    try:
        if p.is_file():
            with open(p, "r+b"):
                pass
        elif not p.exists():
            return creation_refused(p.parent)
    except OSError as e:
        return e.strerror or type(e).__name__
    return ""


def creation_refused(directory: Path) -> str:
    """Why no file can be made in ``directory`` ("": one can), found by making one and
    removing it: ``os.access`` says yes to root under ``/proc``, ``/sys`` or on a read-only
    mount."""
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".hetplan-probe-")
    except OSError as e:
        return e.strerror or type(e).__name__
    os.close(fd)
    os.unlink(probe)
    return ""


def write_text_file(path: str | Path, text: str, *, what: str = "file") -> None:
    """Write ``text`` (UTF-8) to ``path`` whole or not at all, where the file system allows.

    A regular file (or a new one) is written to a temporary file beside it, which then
    replaces it (``os.replace``), so a full disk, a quota or a failed write leaves the earlier
    file as it was instead of a truncated one; the temporary file is removed on failure; the
    replaced file keeps its mode. A symbolic link is written through, as ``open`` would. The
    text is written in place, as ``open(path, "w")`` would, where replacing the file would
    change what the path is or who sees it: a path that is no regular file (``/dev/null``,
    ``/dev/stdout``, a FIFO), a file with other hard links, or a directory where no
    temporary file can be made. A file this process may not write is refused, not replaced.

    Raises:
        SpecError: the file system refused the write (no space, read-only, permission),
            naming the path, the reason and the fix.
    """
    p = Path(path)
    try:
        st: os.stat_result | None = os.stat(p)  # follows links
    except OSError:
        st = None
    try:
        if st is not None and (not stat.S_ISREG(st.st_mode) or st.st_nlink > 1):
            _write_in_place(p, text)
            return
        if st is not None and not os.access(p, os.W_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(p))
        target = Path(os.path.realpath(p)) if p.is_symlink() else p
        try:
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.",
                                       suffix=".tmp")
        except OSError:
            _write_in_place(p, text)  # e.g. a writable file in a directory that is not
            return
        try:
            with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
                f.write(text)
            if st is not None:
                os.chmod(tmp, st.st_mode & 0o7777)
            else:  # mkstemp makes it 0600; a new file gets 0666 less the umask, as open()
                umask = os.umask(0)
                os.umask(umask)
                os.chmod(tmp, 0o666 & ~umask)
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise SpecError(f"could not write the {what} {str(p)!r}: {reason}; {os_error_fix(e)}"
                        ) from None


def _write_in_place(p: Path, text: str) -> None:
    with open(p, "w", encoding="utf-8", newline="") as f:
        f.write(text)


def os_error_fix(e: OSError) -> str:
    """What to do about an error of the machine (a full disk, a read-only file system, a
    permission, the open-file limit), by its cause."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return "free some space on that file system or write elsewhere (-o PATH)"
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "choose a path you can read or write"
    if e.errno in (errno.EMFILE, errno.ENFILE):
        return "raise the open-file limit (ulimit -n) or close other programs"
    return "check the file system and try again, or write elsewhere (-o PATH)"


# --------------------------------------------------------------------------------------
# message helpers (shared with hetplan.ir.validation)
# --------------------------------------------------------------------------------------
_PLAIN_KEY = re.compile(r"^[A-Za-z_][\w\-]*$")


def format_loc(loc: Sequence[str | int]) -> str:
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


def short_repr(value: Any) -> str:
    text = repr(value)
    if len(text) > _MAX_VALUE_CHARS:
        text = text[: _MAX_VALUE_CHARS - 3] + "..."
    return text
