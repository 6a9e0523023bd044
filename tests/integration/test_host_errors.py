"""Errors of the machine, not of hetplan: a full disk, a read-only path, the open-file limit.

A full disk while `hetplan plan -o` wrote its plan was reported as "internal error: OSError
... This is a bug in hetplan" (exit 1), and the plan file was left truncated, the earlier
plan at that path lost. Now every file hetplan writes is written whole or not at all
(:func:`hetplan.ir.files.write_text_file`), and the CLI names the file, what the system said
and the fix (exit 2). An OSError that is no error of the machine stays an internal error.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Any

import pytest

import hetplan.ir.files as files
from hetplan.errors import SpecError
from hetplan.ir.files import write_text_file
from hetplan.ir.plan import load_plan
from test_bad_input_round7 import WORKLOAD, refused, run  # the rounds share helpers


_FDOPEN = os.fdopen


class _FullDisk:
    """A file whose writes fail as a full disk's do, after some bytes went through."""

    def __init__(self, fd: int, *args: Any, **kwargs: Any) -> None:
        self._f = _FDOPEN(fd, *args, **kwargs)

    def __enter__(self) -> _FullDisk:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()

    def write(self, text: str) -> int:
        self._f.write(text[:10])
        self._f.flush()
        raise OSError(errno.ENOSPC, "No space left on device")


@pytest.fixture
def full_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(files.os, "fdopen", _FullDisk)


def test_a_failed_write_keeps_the_earlier_file_and_leaves_no_temporary(
        tmp_path: Path, full_disk: None) -> None:
    out = tmp_path / "plan.json"
    out.write_text("the earlier plan\n")
    with pytest.raises(SpecError) as info:
        write_text_file(out, "x" * 1000, what="plan")
    msg = str(info.value)
    assert str(out) in msg and "No space left on device" in msg
    assert "free some space" in msg
    assert out.read_text() == "the earlier plan\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_a_write_replaces_the_file_whole_and_keeps_its_mode(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    out.write_text("old, longer than the new text\n")
    out.chmod(0o640)
    write_text_file(out, "new\n")
    assert out.read_text() == "new\n"
    assert out.stat().st_mode & 0o777 == 0o640
    fresh = tmp_path / "fresh.json"
    umask = os.umask(0o022)
    try:
        write_text_file(fresh, "{}\n")
    finally:
        os.umask(umask)
    # a new file gets the usual mode (0666 less the umask), not mkstemp's 0600
    assert fresh.stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh.json", "plan.json"]


def test_plan_on_a_full_disk_is_an_error_of_the_machine(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    assert run("plan", "--workload", WORKLOAD, "-c", "mixed-generations", "-b", "64",
               "--no-progress", "-o", out).exit_code == 0
    before = out.read_bytes()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(files.os, "fdopen", _FullDisk)
        result = run("plan", "--workload", WORKLOAD, "-c", "mixed-generations", "-b", "32",
                     "--no-progress", "-o", out)
    refused(result, "could not write the plan", str(out), "No space left on device",
            "free some space")
    assert out.read_bytes() == before
    load_plan(out)  # the earlier plan is whole


@pytest.mark.parametrize(("code", "fix"), [
    (errno.ENOSPC, "free some space"),
    (errno.EROFS, "choose a path you can read or write"),
    (errno.EMFILE, "ulimit -n"),
])
def test_an_error_of_the_machine_from_any_writer_names_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, fix: str) -> None:
    """The timeline's PNG is written by matplotlib, not by hetplan's writer."""
    import hetplan.report.timeline as timeline

    png = tmp_path / "t.png"

    def fail(*args: Any, **kwargs: Any) -> None:
        raise OSError(code, os.strerror(code), str(png))

    monkeypatch.setattr(timeline, "render_timeline", fail)
    plan = tmp_path / "plan.json"
    assert run("plan", "--workload", WORKLOAD, "-c", "mixed-generations", "-b", "64",
               "--no-progress", "-o", plan).exit_code == 0
    refused(run("timeline", plan, "-o", png), str(png), os.strerror(code), fix)


def test_an_oserror_that_is_no_error_of_the_machine_stays_a_bug(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hetplan.report.timeline as timeline

    def fail(*args: Any, **kwargs: Any) -> None:
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", "/nowhere/x")

    monkeypatch.setattr(timeline, "render_timeline", fail)
    plan = tmp_path / "plan.json"
    assert run("plan", "--workload", WORKLOAD, "-c", "mixed-generations", "-b", "64",
               "--no-progress", "-o", plan).exit_code == 0
    result = run("timeline", plan, "-o", tmp_path / "t.png")
    assert result.exit_code == 1, result.output
    assert "internal error" in result.output and "FileNotFoundError" in result.output


def test_a_write_through_a_symbolic_link_replaces_its_target(tmp_path: Path) -> None:
    """A plan path that is a link (latest.json -> run5.json) keeps being the link."""
    target = tmp_path / "run5.json"
    target.write_text("old\n")
    link = tmp_path / "latest.json"
    link.symlink_to(target)
    write_text_file(link, "new\n")
    assert link.is_symlink() and target.read_text() == "new\n"


def test_what_is_no_regular_file_is_written_into_not_replaced(tmp_path: Path) -> None:
    """A FIFO (or /dev/null, /dev/stdout) given as the output was replaced by a regular file
    (as root, /dev/null itself); /dev/stdout resolved to a pipe's /proc name and failed."""
    import threading

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()), daemon=True)
    reader.start()
    write_text_file(fifo, "through the pipe\n")
    reader.join(10)  # a replaced FIFO leaves the reader blocked: a daemon, so no hang
    assert got == ["through the pipe\n"]
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    write_text_file("/dev/null", "gone\n")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_hard_links_and_read_only_files_are_respected(tmp_path: Path) -> None:
    a = tmp_path / "a.json"
    a.write_text("old\n")
    b = tmp_path / "b.json"
    os.link(a, b)
    write_text_file(a, "new\n")  # in place: the other name sees it
    assert b.read_text() == "new\n" and os.stat(a).st_ino == os.stat(b).st_ino
    if os.geteuid() != 0:  # root may write any file
        ro = tmp_path / "ro.json"
        ro.write_text("keep\n")
        ro.chmod(0o444)
        with pytest.raises(SpecError, match="Permission denied"):
            write_text_file(ro, "x\n")
        assert ro.read_text() == "keep\n"


def test_a_writable_file_in_a_directory_without_room_for_a_temporary_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "plan.json"
    out.write_text("old\n")

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(files.tempfile, "mkstemp", refuse)
    write_text_file(out, "new\n")
    assert out.read_text() == "new\n"
