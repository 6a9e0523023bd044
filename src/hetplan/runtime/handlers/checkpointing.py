"""Handler of the ``checkpointing`` section: Gemini's in-memory checkpoints and recovery.

What it does, per rank (``docs/decisions/gemini.md`` has the why):

1. **Snapshot** after every ``every_iters``-th optimizer step: this rank's parameters, its
   optimizer state, the torch RNG state and the data position (the number of completed
   iterations; the worker's synthetic batches are a function of it) are serialised on a side
   thread into this node's store (:mod:`hetplan.runtime.checkpoint_store`: shared-memory
   files, two buffers, so they outlive the process).
2. **Replicas**: the same thread sends the snapshot to the rank's holders
   (``checkpointing.ranks[r].holders[1:]``) over a side gloo group, in chunks of one
   sub-buffer (``buffer_bytes / sub_buffers``), while the next iteration's forward and
   backward run; it receives the snapshots of the ranks this rank holds, writes them to its
   node's store and acknowledges each. The plan's idle-span timing is not enforced on gloo:
   chunks go as soon as the snapshot is serialised, in the plan's order (replica by replica).
3. **At most one iteration lost**: the next optimizer step waits (``after_backward``) until
   this rank's round is done, i.e. its snapshot is written locally and every holder has
   acknowledged its copy; the previous snapshot stays in the other buffer meanwhile.
4. **Storage fallback**: every ``storage_every_iters`` iterations the snapshot is also saved
   with ``torch.distributed.checkpoint`` under ``<store root>/storage/step<N>`` (or
   ``$HETPLAN_STORAGE_DIR``).
5. **Recovery** (``setup``, on every start, i.e. after each torchrun restart): the ranks
   gather which iterations each holds, own and held (:func:`newest_common`); they resume from
   the newest iteration that every rank can get — its own copy, else a holder's, fetched
   over the side group and stored again locally. When none (a whole group lost), they load
   the newest complete storage checkpoint; without one they start from iteration 0. Each
   rank prints one line saying where its state came from.

Without the section, or in a single process, the handler does nothing.
"""

from __future__ import annotations

import io
import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hetplan.ir.plan_checkpointing import Checkpointing
from hetplan.runtime.checkpoint_store import NodeStore, default_root
from hetplan.runtime.handlers.base import Handler, RuntimeContext

__all__ = ["CheckpointingHandler", "newest_common", "STORAGE_DIR_ENV"]

STORAGE_DIR_ENV = "HETPLAN_STORAGE_DIR"
_DATA, _ACK, _FETCH = 11, 12, 13


def newest_common(ck: Checkpointing, own: Sequence[Sequence[int]],
                  held: Sequence[dict[int, Sequence[int]]]) -> tuple[int, dict[int, int]] | None:
    """The newest iteration every rank can restore, and where each rank gets it.

    Args:
        ck: the plan's section (holders per rank).
        own: per rank, the iterations of its own complete snapshots (on its node).
        held: per rank ``h``, ``{r: iterations}`` of rank ``r``'s copies that ``h`` holds.

    Returns:
        ``(iteration, {rank: source rank})`` (the source is the rank itself for its own copy,
        else its first holder that has it), or None when no iteration is complete for all.
    """
    candidates = sorted({i for xs in own for i in xs}
                        | {i for h in held for xs in h.values() for i in xs}, reverse=True)
    for it in candidates:
        source: dict[int, int] = {}
        for row in ck.ranks:
            r = row.rank
            if it in own[r]:
                source[r] = r
                continue
            h = next((h for h in row.holders[1:] if it in held[h].get(r, ())), None)
            if h is None:
                break
            source[r] = h
        else:
            return it, source
    return None


def _serialize(params: list[tuple[str, torch.Tensor]], optim: dict[str, Any] | None,
               rng: torch.Tensor, completed: int) -> bytes:
    buf = io.BytesIO()
    torch.save({"params": dict(params), "optim": optim, "rng": rng, "iteration": completed},
               buf)
    return buf.getvalue()


def _as_tensor(blob: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


class CheckpointingHandler(Handler):
    """Executes ``plan.checkpointing`` (see module docstring)."""

    section = "checkpointing"

    def __init__(self) -> None:
        self.enabled = False
        self.events: list[str] = []
        self.wait_s: list[float] = []
        self.round_s: list[float] = []
        self.resumed_from: int = 0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._pending_optim: dict[str, Any] | None = None

    # -- setup and recovery ------------------------------------------------------------
    def setup(self, ctx: RuntimeContext) -> None:
        ck = ctx.plan.checkpointing
        if ck is None or not dist.is_initialized():
            return
        self.enabled = True
        self.ck = ck
        self.rank = dist.get_rank()
        row = ck.ranks[self.rank]
        self.holders = list(row.holders[1:])
        self.sources = [r.rank for r in ck.ranks if self.rank in r.holders[1:]]
        self.chunk = max(1, ck.buffer_bytes // ck.sub_buffers)
        root, _ = default_root()
        self.store = NodeStore(root, row.node)
        self.storage = Path(os.environ.get(STORAGE_DIR_ENV) or root / "storage")
        self.group = dist.new_group(backend="gloo", timeout=ctx.timeout)
        self._restore(ctx)

    def _say(self, text: str) -> None:
        self.events.append(text)
        print(f"rank {self.rank}: checkpointing: {text}", file=sys.stderr, flush=True)

    def _restore(self, ctx: RuntimeContext) -> None:
        mine = (sorted(self.store.iterations("own", self.rank)),
                {s: sorted(self.store.iterations("held", s)) for s in self.sources})
        infos: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(infos, mine, group=self.group)
        found = newest_common(self.ck, [i[0] for i in infos], [i[1] for i in infos])
        if found is not None:
            it, source = found
            blob = self._fetch(it, source)
            how = "its own copy" if source[self.rank] == self.rank else (
                f"holder rank {source[self.rank]}")
            self._load(ctx, blob)
            if it > 0:
                self._say(f"resumed at iteration {it} from {how}")
            return
        step = self._newest_storage_step()
        if step is not None:
            self._load(ctx, self._load_storage(step))
            self._say(f"no iteration is held in CPU memory by every rank; resumed at "
                      f"iteration {step} from the storage checkpoint {self.storage}")
            return
        if any(i[0] or any(i[1].values()) for i in infos):
            self._say("no complete checkpoint in CPU memory or storage; starting from "
                      "iteration 0")

    def _fetch(self, it: int, source: dict[int, int]) -> bytes:
        """This rank's snapshot of ``it``: its own, or sent by its holder (every transfer
        in rank order, so that the blocking sends and receives cannot deadlock)."""
        mine = None
        for dst in sorted(source):
            src = source[dst]
            if src == dst:
                if dst == self.rank:
                    mine = self.store.read("own", dst, it)
                continue
            if self.rank == src:
                blob = self.store.read("held", dst, it)
                dist.send(torch.tensor([len(blob)], dtype=torch.int64), dst, group=self.group,
                          tag=_FETCH)
                dist.send(_as_tensor(blob), dst, group=self.group, tag=_FETCH)
            elif self.rank == dst:
                n = torch.empty(1, dtype=torch.int64)
                dist.recv(n, src, group=self.group, tag=_FETCH)
                buf = torch.empty(int(n), dtype=torch.uint8)
                dist.recv(buf, src, group=self.group, tag=_FETCH)
                mine = buf.numpy().tobytes()
                self.store.write("own", dst, it, mine)  # held again on this node
        assert mine is not None
        return mine

    def _load(self, ctx: RuntimeContext, blob: bytes) -> None:
        state = torch.load(io.BytesIO(blob), weights_only=False)
        params = dict(ctx.named_params)
        if set(params) != set(state["params"]):
            raise RuntimeError("the checkpoint's parameters are not this rank's "
                               f"({sorted(state['params'])[:3]} vs {sorted(params)[:3]}); "
                               "was it written by another plan?")
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(state["params"][name])
        torch.set_rng_state(state["rng"])
        self._pending_optim = state["optim"]
        ctx.iteration = self.resumed_from = int(state["iteration"])

    # -- storage (torch.distributed.checkpoint) ------------------------------------------
    def _newest_storage_step(self) -> int | None:
        steps = [int(p.name[4:]) for p in self.storage.glob("step*")
                 if (p / ".metadata").is_file()] if self.storage.is_dir() else []
        found: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(found, max(steps, default=None), group=self.group)
        return None if None in found else min(found)

    def _save_storage(self, completed: int, blob: bytes) -> None:
        import torch.distributed.checkpoint as dcp

        path = self.storage / f"step{completed}"
        dcp.save({f"rank{self.rank}": _as_tensor(blob)}, checkpoint_id=path,
                 process_group=self.group)

    def _load_storage(self, step: int) -> bytes:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader

        path = self.storage / f"step{step}"
        key = f"rank{self.rank}"
        meta = FileSystemReader(path).read_metadata().state_dict_metadata[key]
        buf = torch.empty(tuple(meta.size), dtype=torch.uint8)  # type: ignore[union-attr]
        dcp.load({key: buf}, checkpoint_id=path, process_group=self.group)
        return buf.numpy().tobytes()

    # -- the step ----------------------------------------------------------------------
    def after_backward(self, ctx: RuntimeContext) -> None:
        if not self.enabled:
            return
        t0 = time.perf_counter()
        self.wait_round()
        self.wait_s.append(time.perf_counter() - t0)
        if self._pending_optim is not None and ctx.optimizer is not None:
            ctx.optimizer.load_state_dict(self._pending_optim)
            self._pending_optim = None

    def after_step(self, ctx: RuntimeContext) -> None:
        if not self.enabled:
            return
        completed = ctx.iteration + 1
        if completed % self.ck.every_iters:
            return
        self.wait_round()
        params = [(n, p.detach()) for n, p in ctx.named_params]
        optim = ctx.optimizer.state_dict() if ctx.optimizer is not None else None
        rng = torch.get_rng_state()
        blob = None
        if completed % self.ck.storage_every_iters == 0:
            blob = _serialize(params, optim, rng, completed)
            self._save_storage(completed, blob)
        self._thread = threading.Thread(
            target=self._round_guarded, args=(completed, params, optim, rng, blob),
            name=f"gemini-round-{completed}", daemon=True)
        self._thread.start()

    def wait_round(self) -> None:
        """Wait until the current round (snapshot stored, copies acknowledged) is done;
        re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"checkpoint round failed: {err}") from err

    def _round_guarded(self, *args: Any) -> None:
        try:
            self._round(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised on the main thread by _join
            self._error = e

    def _round(self, completed: int, params: list[tuple[str, torch.Tensor]],
               optim: dict[str, Any] | None, rng: torch.Tensor, blob: bytes | None) -> None:
        """Serialise, store locally, send to the holders, receive and store the held
        copies, acknowledge them, and wait for this rank's acknowledgements."""
        t0 = time.perf_counter()
        if blob is None:
            blob = _serialize(params, optim, rng, completed)
        self.store.write("own", self.rank, completed, blob)
        data = _as_tensor(blob)
        header = torch.tensor([completed, len(blob)], dtype=torch.int64)
        reqs = []
        for h in self.holders:
            reqs.append(dist.isend(header, h, group=self.group, tag=_DATA))
            for off in range(0, len(blob), self.chunk):
                reqs.append(dist.isend(data[off:off + self.chunk], h, group=self.group,
                                       tag=_DATA))
        acks = []
        for s in self.sources:
            hdr = torch.empty(2, dtype=torch.int64)
            dist.recv(hdr, s, group=self.group, tag=_DATA)
            it, n = int(hdr[0]), int(hdr[1])
            buf = torch.empty(n, dtype=torch.uint8)
            for off in range(0, n, self.chunk):
                dist.recv(buf[off:off + self.chunk], s, group=self.group, tag=_DATA)
            self.store.write("held", s, it, buf.numpy().tobytes())
            ack = torch.tensor([it], dtype=torch.int64)
            acks.append((ack, dist.isend(ack, s, group=self.group, tag=_ACK)))
        for h in self.holders:
            got = torch.empty(1, dtype=torch.int64)
            dist.recv(got, h, group=self.group, tag=_ACK)
            if int(got) != completed:
                raise RuntimeError(f"holder rank {h} acknowledged iteration {int(got)}, "
                                   f"expected {completed}")
        for r in [*reqs, *(w for _, w in acks)]:
            if r is not None:  # None only for a rank outside the group, never here
                r.wait()
        self.round_s.append(time.perf_counter() - t0)

    def close(self, ctx: RuntimeContext) -> None:
        if self._thread is not None:
            self._thread.join(timeout=ctx.timeout.total_seconds())
            self._thread = None
