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

A slot is complete when its ``.json`` (iteration, size, CRC-32) exists and matches its
``.bin``: the data is written first, the metadata last by an atomic rename, and a slot being
rewritten loses its metadata first. The newer complete slot is never overwritten, so a failure
while writing leaves the previous snapshot intact (double buffering).

The root is ``$HETPLAN_CHECKPOINT_DIR`` when set (kept after the run: the user owns it), else
``/dev/shm/hetplan-ckpt-<torchrun run id>`` (the same for every restart of one run; removed when
the run succeeds).

The checkpoint thread writes a slot in place: :meth:`NodeStore.reserve` maps the slot's data
file into the process (``mmap``; the mapping is kept while the file stays the same, so a
round reuses the pages of the round before last), the snapshot is packed or received straight
into it, and :meth:`NodeStore.commit` writes the metadata: no copy of the blob in the heap.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["CHECKPOINT_DIR_ENV", "NodeStore", "Reserved", "default_root",
           "remove_default_root"]

CHECKPOINT_DIR_ENV = "HETPLAN_CHECKPOINT_DIR"


def default_root() -> tuple[Path, bool]:
    """(the store's root, whether the run owns it and removes it on success)."""
    given = os.environ.get(CHECKPOINT_DIR_ENV)
    if given:
        return Path(given), False
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "local")
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"hetplan-ckpt-{run_id}", True


def remove_default_root() -> None:
    """Remove the run-owned store (after a successful run); a user-given root stays."""
    root, owned = default_root()
    if owned:
        shutil.rmtree(root, ignore_errors=True)


@dataclass(frozen=True)
class Reserved:
    """A slot being written: ``buffer`` maps its data file (``nbytes``); :meth:`NodeStore.commit`
    completes it as ``iteration``."""

    kind: str
    rank: int
    slot: int
    iteration: int
    buffer: mmap.mmap


@dataclass(frozen=True)
class NodeStore:
    """One node's checkpoint directory (see module docstring)."""

    root: Path
    node: int
    _maps: dict[tuple[str, int, int], tuple[int, int, mmap.mmap]] = field(
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

    def iterations(self, kind: str, rank: int) -> dict[int, int]:
        """Complete snapshots: iteration → slot."""
        out: dict[int, int] = {}
        for slot in (0, 1):
            meta = self._meta(kind, rank, slot)
            if meta is not None:
                out[int(meta["iteration"])] = slot
        return out

    def _meta(self, kind: str, rank: int, slot: int) -> dict[str, int] | None:
        data, meta, _ = self._files(kind, rank, slot)
        try:
            with open(meta, "rb") as f:
                m = json.loads(f.read())
            if os.stat(data).st_size != int(m["nbytes"]):
                return None
            return {k: int(v) for k, v in m.items()}
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def write(self, kind: str, rank: int, iteration: int, blob: bytes) -> None:
        """Write ``blob`` as ``rank``'s snapshot of ``iteration`` into the slot that does not
        hold the newest complete one."""
        have = self.iterations(kind, rank)
        if iteration in have:
            return
        self._have.pop((kind, rank), None)  # reserve reads the slots from disk again
        newest = max(have, default=None)
        slot = 0 if newest is None else 1 - have[newest]
        data, meta = self._slot(kind, rank, slot)
        data.parent.mkdir(parents=True, exist_ok=True)
        meta.unlink(missing_ok=True)  # the slot is incomplete from here on
        data.write_bytes(blob)
        tmp = meta.with_suffix(".tmp")
        tmp.write_text(json.dumps({"iteration": iteration, "nbytes": len(blob),
                                   "crc32": zlib.crc32(blob)}))
        os.replace(tmp, meta)

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
        data, meta, _ = self._files(kind, rank, slot)
        try:
            os.unlink(meta)  # the slot is incomplete from here on
        except FileNotFoundError:
            os.makedirs(os.path.dirname(data), exist_ok=True)
        cached = self._maps.get((kind, rank, slot))
        if cached is not None:
            try:
                st = os.stat(data)
                if cached[1] == nbytes and (st.st_ino, st.st_size) == (cached[0], nbytes):
                    return Reserved(kind, rank, slot, iteration, cached[2])
            except FileNotFoundError:
                pass
        fd = os.open(data, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            st = os.fstat(fd)
            if st.st_size != nbytes:
                os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes)
            self._maps[(kind, rank, slot)] = (st.st_ino, nbytes, mm)
        finally:
            os.close(fd)
        return Reserved(kind, rank, slot, iteration, mm)

    def commit(self, r: Reserved, crc32: int | None = None) -> int:
        """Complete a reserved slot: its metadata (with the data's CRC-32), by a rename;
        returns the CRC-32. ``crc32``: the CRC-32 the data must have, computed where it was
        packed (a holder's copy: it is not computed again, and a copy that differs from the
        sender's snapshot is refused when read)."""
        _, meta, tmp = self._files(r.kind, r.rank, r.slot)
        size = len(r.buffer)
        if crc32 is None:
            crc32 = zlib.crc32(r.buffer)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b'{"iteration": %d, "nbytes": %d, "crc32": %d}'
                     % (r.iteration, size, crc32))
        finally:
            os.close(fd)
        os.replace(tmp, meta)
        have = self._have.get((r.kind, r.rank))
        if have is not None:
            have[r.iteration] = r.slot
        return crc32

    def read(self, kind: str, rank: int, iteration: int) -> bytes:
        """The snapshot of ``iteration``; ``LookupError`` when absent or corrupt."""
        slot = self.iterations(kind, rank).get(iteration)
        if slot is None:
            raise LookupError(f"node {self.node} holds no {kind} snapshot of rank {rank} at "
                              f"iteration {iteration}")
        data, _ = self._slot(kind, rank, slot)
        blob = data.read_bytes()
        meta = self._meta(kind, rank, slot)
        if meta is None or zlib.crc32(blob) != meta["crc32"]:
            raise LookupError(f"node {self.node}: {kind} snapshot of rank {rank} at iteration "
                              f"{iteration} is corrupt")
        return blob

    def held_ranks(self) -> list[int]:
        """The ranks this node holds copies of."""
        d = self.path / "held"
        if not d.is_dir():
            return []
        return sorted(int(p.name[4:]) for p in d.iterdir() if p.name.startswith("rank"))
