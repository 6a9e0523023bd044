"""Gemini's snapshot format: a rank's state as one flat byte buffer, packed with one torch op.

Decision (``docs/decisions/gemini.md``, "Snapshot format"): the checkpoint thread runs beside
the training thread in the same process, so every moment it holds the GIL can delay the
training thread (each torch op the training thread issues releases the GIL and must take it
back). ``torch.save`` pickles every tensor in Python and writes a zip archive: about 2 ms of
GIL-held work per MiB-sized rank state. Here instead:

* a small **header** (pickled: the iteration, the RNG state, the parameter names and where
  each tensor lies (pickled once per layout), and the optimizer state dict with its tensors
  replaced by :class:`TensorRef`);
* the **data**: every tensor's bytes, each at a 64-byte aligned offset, written by one
  ``torch.cat(..., out=)`` into the destination (a shared-memory slot mapped into the
  process: no intermediate copy), which runs with the GIL released.

Buffer layout: ``MAGIC`` (8 bytes), the header's length (8 bytes, little endian), the header,
zero padding to a multiple of 64, the data. :class:`Packer` keeps the per-tensor byte views
between rounds while the tensors stay the same (same objects, storage, shape and dtype), so a
round's GIL-held work is a check of the tensor list and one small pickle.

:func:`unpack` returns ``{"params": {name: tensor}, "optim": state dict | None, "rng":
tensor, "iteration": int}`` with tensors that own their memory (bitwise the packed ones).
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["MAGIC", "ALIGN", "TensorRef", "Packed", "Packer", "unpack"]

MAGIC = b"HPSNAP01"
ALIGN = 64
_PREFIX = len(MAGIC) + 8


@dataclass(frozen=True)
class TensorRef:
    """Stands for the ``index``-th tensor of the data region in the pickled optimizer state."""

    index: int


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _skeleton(obj: Any, out: list[torch.Tensor]) -> Any:
    """``obj`` with every tensor replaced by a :class:`TensorRef` to its place in ``out``."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
        return TensorRef(len(out) - 1)
    if isinstance(obj, dict):
        return {k: _skeleton(v, out) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_skeleton(v, out) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_skeleton(v, out) for v in obj)
    return obj


def _fill(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, TensorRef):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return {k: _fill(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_fill(v, tensors) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_fill(v, tensors) for v in obj)
    return obj


@dataclass
class Packed:
    """One snapshot ready to be copied: ``nbytes`` in all; ``head`` (prefix, header and
    padding) then ``sources`` (byte views of the tensors and zero padding, in order)."""

    nbytes: int
    head: bytes
    sources: list[torch.Tensor]


class Packer:
    """Packs a rank's state into the buffer format above (see module docstring)."""

    def __init__(self) -> None:
        self._key: list[tuple[int, int, torch.Size, torch.dtype]] = []
        self._names: list[str] = []
        self._static = b""  # the pickled names and entries of the current layout
        self._sources: list[torch.Tensor] = []
        self._entries: list[tuple[torch.dtype, tuple[int, ...], int, int]] = []
        self._data_bytes = 0
        self._zeros = torch.zeros(ALIGN, dtype=torch.uint8)  # host: snapshots are in CPU memory

    def prepare(self, params: Sequence[tuple[str, torch.Tensor]], optim: dict[str, Any] | None,
                rng: torch.Tensor, iteration: int) -> Packed:
        """The header and the tensors' byte views of this snapshot (GIL-held Python work:
        a walk over the optimizer state and one small pickle)."""
        tensors = [p for _, p in params]
        skeleton = _skeleton(optim, tensors)
        key = [(id(t), t.data_ptr(), t.shape, t.dtype) for t in tensors]
        names = [n for n, _ in params]
        if key != self._key or names != self._names:
            self._layout(tensors)
            self._key, self._names = key, names
            self._static = pickle.dumps({"names": names, "entries": self._entries}, protocol=5)
        header = pickle.dumps({"iteration": iteration, "rng": rng.numpy().tobytes(),
                               "layout": self._static, "optim": skeleton}, protocol=5)
        head_len = _align(_PREFIX + len(header))
        head = MAGIC + struct.pack("<Q", len(header)) + header
        head += bytes(head_len - len(head))
        return Packed(head_len + self._data_bytes, head, self._sources)

    def _layout(self, tensors: list[torch.Tensor]) -> None:
        sources: list[torch.Tensor] = []
        entries = []
        off = 0
        for t in tensors:
            flat = t.detach().reshape(-1)
            if not flat.is_contiguous():  # pragma: no cover - reshape(-1) is contiguous
                flat = flat.contiguous()
            view = flat.view(torch.uint8)
            n = view.numel()
            entries.append((t.dtype, tuple(t.shape), off, n))
            sources.append(view)
            pad = _align(n) - n
            if pad:
                sources.append(self._zeros[:pad])
            off += n + pad
        self._sources, self._entries, self._data_bytes = sources, entries, off

    @staticmethod
    def pack_into(packed: Packed, out: torch.Tensor) -> None:
        """Copy the snapshot into ``out`` (``packed.nbytes`` uint8 elements); the tensors'
        bytes go in one ``torch.cat``, which runs without the GIL."""
        h = len(packed.head)
        out[:h].copy_(torch.frombuffer(bytearray(packed.head), dtype=torch.uint8))
        if packed.sources:
            torch.cat(packed.sources, out=out[h:])


def unpack(buf: bytes | bytearray | memoryview) -> dict[str, Any]:
    """The state in a packed buffer (see module docstring); ``ValueError`` when ``buf`` is not
    one."""
    mv = memoryview(buf).cast("B")
    if bytes(mv[:len(MAGIC)]) != MAGIC:
        raise ValueError("not a Gemini snapshot (bad magic); was it written by another "
                         "hetplan version?")
    (hlen,) = struct.unpack("<Q", mv[len(MAGIC):_PREFIX])
    header = pickle.loads(mv[_PREFIX:_PREFIX + hlen])
    header.update(pickle.loads(header.pop("layout")))
    base = _align(_PREFIX + hlen)
    data = torch.frombuffer(bytearray(mv[base:]), dtype=torch.uint8) if len(mv) > base else (
        torch.empty(0, dtype=torch.uint8))  # host: a snapshot read back
    tensors = [data[off:off + n].view(dtype).reshape(shape).clone()
               for dtype, shape, off, n in header["entries"]]
    names = header["names"]
    rng = torch.frombuffer(bytearray(header["rng"]), dtype=torch.uint8)
    return {"params": dict(zip(names, tensors[:len(names)], strict=True)),
            "optim": _fill(header["optim"], tensors), "rng": rng,
            "iteration": int(header["iteration"])}
