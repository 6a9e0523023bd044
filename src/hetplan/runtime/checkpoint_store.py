"""Where Gemini's in-memory checkpoints live so that they outlive a rank's process.

Decision (``docs/decisions/gemini.md``): a checkpoint must survive the death of the worker
that wrote it (torchrun's elastic restart starts fresh processes), so it cannot live in the
worker's heap. Each node's "CPU memory" is a directory of plain files in shared memory
(``/dev/shm``, i.e. RAM, not disk): ``<root>/node<n>/``. A file there outlives the process and
costs no serialisation at failure time (the thesis's ``torch.save`` of 162 s), and a machine
that is lost takes its directory with it — a test wipes it to emulate that. A node's ranks
only ever read their own node's directory; copies on other nodes reach them over the network
(the handler's fetch).

Layout, per node::

    own/rank<r>/slot<0|1>.bin|.json     rank r's own snapshots (two buffers)
    held/rank<r>/slot<0|1>.bin|.json    copies of rank r's snapshots this node holds

A slot's data file is ``[stamp][padding to 64 bytes][snapshot][stamp]``, each stamp the
slot's iteration (8 bytes, little endian): the leading stamp is written when the slot is
reserved, before the snapshot, the trailing one when it is committed, after it. Its ``.json``
(iteration, snapshot size) is one fixed-size record rewritten in place (one ``pwrite``; blank
while the slot is being written). A slot is complete when its record is valid, the data file
has the size it implies, and both stamps equal the record's iteration: a slot rewritten in
part (a process killed while packing or receiving into it) has a new leading stamp and an
old trailing one, and a record that outlived its data shows another iteration. The data is
written first, the record last, and a slot being rewritten loses its record first. The newer
complete slot is never overwritten, so a failure while writing leaves the previous snapshot
intact (double buffering).

Why stamps and not a checksum (``docs/decisions/gemini.md``): a CRC-32 of the slot read every
snapshot once more (0.17 ms of CPU per 1.4 MB, and one more pass through the caches, per rank
and iteration); the stamps catch what the recovery relies on (a torn or stale slot is never
used). A snapshot damaged in place between commit and read (not a failure this store
models: its files are RAM) is not detected by them; the snapshot's own magic and iteration
are checked when it is unpacked.

The root is ``$HETPLAN_CHECKPOINT_DIR`` when set (kept after the run: the user owns it), else
``/dev/shm/hetplan-ckpt-<torchrun run id>`` (the same for every restart of one run; removed when
the run succeeds).

The checkpoint thread writes a slot in place: :meth:`NodeStore.reserve` maps the slot's data
file into the process (``mmap``; the mapping and the record's open file are kept while the
data file stays the same, so a round reuses the pages of the round before last), the snapshot
is packed or received straight into it, and :meth:`NodeStore.commit` writes the trailing
stamp and the record: no copy of the blob in the heap, three system calls per round
(``stat``, two ``pwrite``).
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import struct
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from hetplan.ir.files import creation_refused

__all__ = ["CHECKPOINT_DIR_ENV", "NodeStore", "Reserved", "default_root",
           "remove_default_root", "STORAGE_DIR_ENV", "dir_problem"]

CHECKPOINT_DIR_ENV = "HETPLAN_CHECKPOINT_DIR"
#: where the storage fallback saves (default: ``storage`` under the store's root)
STORAGE_DIR_ENV = "HETPLAN_STORAGE_DIR"
_STAMP = struct.Struct("<q")
_LEAD = 64  # the snapshot's offset in the data file (the leading stamp, padded)
_RECORD = 64  # bytes of a slot's record, blank-padded
_BLANK = b" " * _RECORD


def _record(iteration: int, nbytes: int) -> bytes:
    rec = b'{"iteration": %d, "nbytes": %d}' % (iteration, nbytes)
    return rec + _BLANK[len(rec):]


def default_root() -> tuple[Path, bool]:
    """(the store's root, whether the run owns it and removes it on success)."""
    given = os.environ.get(CHECKPOINT_DIR_ENV)
    if given:
        return Path(given), False
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "local")
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"hetplan-ckpt-{run_id}", True


def dir_problem(plan_has_checkpointing: bool, env: Mapping[str, str] | None = None
                ) -> str | None:
    """Why :data:`CHECKPOINT_DIR_ENV` or :data:`STORAGE_DIR_ENV` cannot hold a Gemini
    run's copies (None: unset, or usable), for the launcher to refuse before any rank
    starts: the path, or its nearest existing ancestor (the ranks create the rest), must be
    a directory this process can write."""
    env = os.environ if env is None else env
    for name in (CHECKPOINT_DIR_ENV, STORAGE_DIR_ENV) if plan_has_checkpointing else ():
        raw = env.get(name, "").strip()
        if not raw:
            continue
        path = Path(raw)
        existing = next((a for a in (path, *path.parents) if a.exists()), None)
        if existing is not None and not existing.is_dir():
            return (f"{name}={raw!r}: {str(existing)!r} is a file, not a directory; point it "
                    "at a directory (created if missing), or unset it")
        if existing is not None and creation_refused(existing):
            return (f"{name}={raw!r}: the directory {str(existing)!r} is not writable; point "
                    "it at a directory you can write, or unset it")
    return None


def remove_default_root() -> None:
    """Remove the run-owned store (after a successful run); a user-given root stays."""
    root, owned = default_root()
    if owned:
        shutil.rmtree(root, ignore_errors=True)


@dataclass(frozen=True)
class Reserved:
    """A slot being written: ``buffer`` is the snapshot's part of its mapped data file
    (``nbytes``); :meth:`NodeStore.commit` completes it as ``iteration``."""

    kind: str
    rank: int
    slot: int
    iteration: int
    buffer: memoryview


@dataclass(frozen=True)
class NodeStore:
    """One node's checkpoint directory (see module docstring)."""

    root: Path
    node: int
    # (kind, rank, slot) -> the data file's inode, the snapshot's size, the mapping, the
    # snapshot's view of it, the record's open file
    _maps: dict[tuple[str, int, int], tuple[int, int, mmap.mmap, memoryview, int]] = field(
        default_factory=dict, compare=False, repr=False)
    _paths: dict[tuple[str, int, int], tuple[str, str, str]] = field(
        default_factory=dict, compare=False, repr=False)
    # (kind, rank) -> {iteration: slot} as this process last reserved and committed it
    _have: dict[tuple[str, int], dict[int, int]] = field(
        default_factory=dict, compare=False, repr=False)

    @property
    def path(self) -> Path:
        return self.root / f"node{self.node}"

    def _slot(self, kind: str, rank: int, slot: int) -> tuple[Path, Path]:
        data, meta, _ = self._files(kind, rank, slot)
        return Path(data), Path(meta)

    def _files(self, kind: str, rank: int, slot: int) -> tuple[str, str, str]:
        """The slot's data, metadata and temporary metadata file names (kept: a round's
        checkpoint thread looks them up a dozen times)."""
        key = (kind, rank, slot)
        got = self._paths.get(key)
        if got is None:
            d = os.path.join(self.root, f"node{self.node}", kind, f"rank{rank}")
            got = self._paths[key] = (os.path.join(d, f"slot{slot}.bin"),
                                      os.path.join(d, f"slot{slot}.json"),
                                      os.path.join(d, f"slot{slot}.tmp"))
        return got

    def data_path(self, kind: str, rank: int, slot: int) -> str:
        """The slot's data file (the snapshot lies at :meth:`snapshot_offset` in it)."""
        return self._files(kind, rank, slot)[0]

    @staticmethod
    def snapshot_offset() -> int:
        """Where the snapshot starts in a slot's data file (after the leading stamp)."""
        return _LEAD

    def slot_of(self, kind: str, rank: int, iteration: int) -> int | None:
        """The slot that holds ``iteration`` complete, as this process last reserved and
        committed it (read from disk when it has not reserved that rank's slots)."""
        have = self._have.get((kind, rank))
        if have is None:
            have = self._have[(kind, rank)] = self.iterations(kind, rank)
        return have.get(iteration)

    def iterations(self, kind: str, rank: int) -> dict[int, int]:
        """Complete snapshots: iteration → slot."""
        out: dict[int, int] = {}
        for slot in (0, 1):
            meta = self._meta(kind, rank, slot)
            if meta is not None:
                out[int(meta["iteration"])] = slot
        return out

    def _meta(self, kind: str, rank: int, slot: int) -> dict[str, int] | None:
        """The slot's record when it is valid and the data file has the size it implies
        (the stamps are checked by :meth:`read`)."""
        data, meta, _ = self._files(kind, rank, slot)
        try:
            with open(meta, "rb") as f:
                m = json.loads(f.read())
            if os.stat(data).st_size != _LEAD + int(m["nbytes"]) + _STAMP.size:
                return None
            return {k: int(v) for k, v in m.items()}
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def write(self, kind: str, rank: int, iteration: int, blob: bytes) -> None:
        """Write ``blob`` as ``rank``'s snapshot of ``iteration`` into the slot that does not
        hold the newest complete one (:meth:`reserve` and :meth:`commit`, with the slots read
        from disk again)."""
        self._have.pop((kind, rank), None)
        res = self.reserve(kind, rank, iteration, len(blob))
        if res is None:
            return
        res.buffer[:] = blob
        self.commit(res)

    def reserve(self, kind: str, rank: int, iteration: int, nbytes: int) -> Reserved | None:
        """Make the slot that does not hold the newest complete snapshot incomplete, size its
        data file to ``nbytes`` (> 0) and map it; None when ``iteration`` is already
        complete.

        Which slot holds what is read from disk once per (kind, rank), then kept: a slot is
        only written by the one process that reserves it (a rank's own slots by the rank, a
        held rank's by its one holder on this node). The mapping is kept while the data file
        is the same file of the same size."""
        if nbytes <= 0:
            raise ValueError(f"a snapshot has at least a header; got nbytes={nbytes}")
        have = self._have.get((kind, rank))
        if have is None:
            have = self._have[(kind, rank)] = self.iterations(kind, rank)
        if iteration in have:
            return None
        newest = max(have, default=None)
        slot = 0 if newest is None else 1 - have[newest]
        for it in [i for i, s in have.items() if s == slot]:
            del have[it]
        key = (kind, rank, slot)
        cached = self._maps.get(key)
        if cached is not None:
            try:
                st = os.stat(self._files(kind, rank, slot)[0])
                if cached[1] == nbytes and (st.st_ino, st.st_size) == (
                        cached[0], _LEAD + nbytes + _STAMP.size):
                    mm, view, mfd = cached[2], cached[3], cached[4]
                    os.pwrite(mfd, _BLANK, 0)  # the slot is incomplete from here on
                    mm[:_STAMP.size] = _STAMP.pack(iteration)
                    return Reserved(kind, rank, slot, iteration, view)
            except FileNotFoundError:
                pass
            self._drop(key)
        mm, view, mfd = self._open(kind, rank, slot, nbytes)
        mm[:_STAMP.size] = _STAMP.pack(iteration)
        return Reserved(kind, rank, slot, iteration, view)

    def _open(self, kind: str, rank: int, slot: int,
              nbytes: int) -> tuple[mmap.mmap, memoryview, int]:
        """Blank the slot's record (opened and kept), size its data file for an
        ``nbytes`` snapshot and map it; kept in ``_maps``."""
        data, meta, _ = self._files(kind, rank, slot)
        os.makedirs(os.path.dirname(data), exist_ok=True)
        mfd = os.open(meta, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.pwrite(mfd, _BLANK, 0)  # the slot is incomplete from here on
        size = _LEAD + nbytes + _STAMP.size
        fd = os.open(data, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            st = os.fstat(fd)
            if st.st_size != size:
                os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        view = memoryview(mm)[_LEAD:_LEAD + nbytes]
        self._maps[(kind, rank, slot)] = (st.st_ino, nbytes, mm, view, mfd)
        return mm, view, mfd

    def _drop(self, key: tuple[str, int, int]) -> None:
        """Forget a kept mapping (its file was replaced or resized); the mapping itself goes
        with the last tensor or view that uses it."""
        os.close(self._maps.pop(key)[4])

    def commit(self, r: Reserved) -> None:
        """Complete a reserved slot: the trailing stamp after the snapshot, then the record
        (one ``pwrite`` into its kept file)."""
        _, nbytes, mm, _, mfd = self._maps[(r.kind, r.rank, r.slot)]
        mm[_LEAD + nbytes:_LEAD + nbytes + _STAMP.size] = _STAMP.pack(r.iteration)
        os.pwrite(mfd, _record(r.iteration, nbytes), 0)
        have = self._have.get((r.kind, r.rank))
        if have is not None:
            have[r.iteration] = r.slot

    def read(self, kind: str, rank: int, iteration: int) -> bytes:
        """The snapshot of ``iteration``; ``LookupError`` when absent, or torn or stale (its
        stamps are not both ``iteration``)."""
        slot = self.iterations(kind, rank).get(iteration)
        if slot is None:
            raise LookupError(f"node {self.node} holds no {kind} snapshot of rank {rank} at "
                              f"iteration {iteration}")
        data, _ = self._slot(kind, rank, slot)
        raw = data.read_bytes()
        meta = self._meta(kind, rank, slot)
        n = len(raw) - _LEAD - _STAMP.size
        if (meta is None or meta["iteration"] != iteration or n != meta["nbytes"]
                or _STAMP.unpack_from(raw, 0)[0] != iteration
                or _STAMP.unpack_from(raw, _LEAD + n)[0] != iteration):
            raise LookupError(f"node {self.node}: {kind} snapshot of rank {rank} at iteration "
                              f"{iteration} is corrupt (torn or stale: its stamps are not "
                              f"both {iteration})")
        return raw[_LEAD:_LEAD + n]

    def held_ranks(self) -> list[int]:
        """The ranks this node holds copies of."""
        d = self.path / "held"
        if not d.is_dir():
            return []
        return sorted(int(p.name[4:]) for p in d.iterdir() if p.name.startswith("rank"))
