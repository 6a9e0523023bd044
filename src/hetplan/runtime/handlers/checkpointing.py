"""Handler of the ``checkpointing`` section: Gemini's in-memory checkpoints and recovery.

What it does, per rank (``docs/decisions/gemini.md`` has the why):

1. **Snapshot** after every ``every_iters``-th optimizer step: this rank's parameters, its
   optimizer state, the torch RNG state and the data position (the number of completed
   iterations; the worker's synthetic batches are a function of it) are packed by the
   training thread, right after the step, into one flat buffer
   (:mod:`hetplan.runtime.checkpoint_snapshot`: a small pickled header, then every tensor's
   bytes copied by one ``torch.cat``) straight into this node's store
   (:mod:`hetplan.runtime.checkpoint_store`: shared-memory files mapped into the process, two
   buffers, so they outlive the process). Packing costs about 0.2 ms of CPU per 1.4 MB; a
   thread that did it beside the training thread cost more (its wake-up and the GIL handed
   back and forth; ``docs/decisions/gemini.md``, "Round 3").
2. **Replicas**: a side process per rank (:mod:`hetplan.runtime.checkpoint_agent`, so that
   none of the network work shares this process's GIL) sends the snapshot from the own slot
   to the rank's holders (``checkpointing.ranks[r].holders[1:]``), one TCP stream per holder
   (:mod:`hetplan.runtime.checkpoint_link`), each chunk of the plan's schedule at its idle
   span's offset from the step's start (the end of the optimizer step that completed the
   snapshot's iteration; :mod:`hetplan.runtime.checkpoint_schedule` maps the planned chunks
   onto the serialised blob); a chunk whose span has passed goes at once, together with the
   following chunks to the same holder that are due too (one send). One receiver thread of
   the side process per rank this rank holds reads that rank's snapshots straight into the
   mapped slot of its node's store (one ``recv_into`` per round, never copied again),
   completes them and acknowledges each. Every round is recorded (chunks sent, bytes, when,
   how; the wait before the step; CPU time of the training thread, and of the packing and
   the side process's sender) for the run report
   (:meth:`CheckpointingHandler.report`).
3. **At most one interval lost**: the snapshot is packed before the next step changes the
   parameters in place; the step that takes the next snapshot waits (``after_backward``)
   for the whole round, i.e. its snapshot is written locally and every
   holder has acknowledged its copy, and releases at once the chunks whose spans are still
   ahead (the schedule never delays a step beyond that bound). The previous snapshot stays in
   the other buffer meanwhile.
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

import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hetplan.ir.plan_checkpointing import Checkpointing
from hetplan.runtime.checkpoint_agent import Agent
from hetplan.runtime.checkpoint_link import connect_links, local_address
from hetplan.runtime.checkpoint_schedule import ChunkEvent, PlannedSend, RoundRecord, timetable
from hetplan.runtime.checkpoint_snapshot import Packed, Packer, unpack
from hetplan.runtime.checkpoint_store import STORAGE_DIR_ENV, NodeStore, default_root
from hetplan.runtime.handlers.base import Handler, RuntimeContext

__all__ = ["CheckpointingHandler", "newest_common", "STORAGE_DIR_ENV"]

_FETCH = 13


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


def _as_tensor(blob: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


def _mapped(buffer: Any, nbytes: int) -> torch.Tensor:
    return torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes)


class CheckpointingHandler(Handler):
    """Executes ``plan.checkpointing`` (see module docstring)."""

    section = "checkpointing"

    def __init__(self) -> None:
        self.enabled = False
        self.events: list[str] = []
        self.wait_s: list[float] = []
        self.round_s: list[float] = []
        self.resumed_from: int = 0
        self._inflight: RoundRecord | None = None  # a round whose end is not collected
        self.packer = Packer()
        self._timetables: dict[tuple[int, int], list[PlannedSend]] = {}
        self._error: BaseException | None = None
        self._pending_optim: dict[str, Any] | None = None
        self.rounds: list[RoundRecord] = []
        self._anchor: float | None = None
        self._anchor_cpu = 0.0
        self.agent: Agent | None = None  # the side process that sends and receives
        self._failed = False  # a round's error was raised

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
        root, _ = default_root()
        self.store = NodeStore(root, row.node)
        self.storage = Path(os.environ.get(STORAGE_DIR_ENV) or root / "storage")
        self.group = dist.new_group(backend="gloo", timeout=ctx.timeout)
        self._restore(ctx)
        self._connect(ctx)

    def _connect(self, ctx: RuntimeContext) -> None:
        """The streams to the holders and from the ranks held, handed to the side process."""
        world = dist.get_world_size()

        def gather(obj: Any) -> list[Any]:
            got: list[Any] = [None] * world
            dist.all_gather_object(got, obj, group=self.group)
            return got

        host = local_address(os.environ.get("MASTER_ADDR", "127.0.0.1"))
        out, inc = connect_links(self.rank, self.holders, self.sources, host, gather,
                                 ctx.timeout)
        self.agent = Agent.start(self.rank, self.store.root, self.store.node, out, inc,
                                 ctx.timeout)

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
            self._load(ctx, blob, it)
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
                          tag=_FETCH)  # host: self.group is a gloo group
                dist.send(_as_tensor(blob), dst, group=self.group, tag=_FETCH)
            elif self.rank == dst:
                n = torch.empty(1, dtype=torch.int64)  # host: the gloo group's
                dist.recv(n, src, group=self.group, tag=_FETCH)
                buf = torch.empty(int(n), dtype=torch.uint8)  # host: the gloo group's
                dist.recv(buf, src, group=self.group, tag=_FETCH)
                mine = buf.numpy().tobytes()
                self.store.write("own", dst, it, mine)  # held again on this node
        assert mine is not None
        return mine

    def _load(self, ctx: RuntimeContext, blob: bytes, expect: int | None = None) -> None:
        state = unpack(blob)
        if expect is not None and int(state["iteration"]) != expect:
            raise RuntimeError(f"rank {self.rank}: the snapshot of iteration {expect} holds "
                               f"iteration {state['iteration']}; the store is inconsistent")
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

    def _save_storage(self, completed: int, blob: torch.Tensor) -> None:
        import torch.distributed.checkpoint as dcp

        path = self.storage / f"step{completed}"
        dcp.save({f"rank{self.rank}": blob}, checkpoint_id=path,
                 process_group=self.group)

    def _load_storage(self, step: int) -> bytes:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader

        path = self.storage / f"step{step}"
        key = f"rank{self.rank}"
        meta = FileSystemReader(path).read_metadata().state_dict_metadata[key]
        size = tuple(meta.size)  # type: ignore[union-attr]
        buf = torch.empty(size, dtype=torch.uint8)  # host: read from disk over the gloo group
        dcp.load({key: buf}, checkpoint_id=path, process_group=self.group)
        return buf.numpy().tobytes()

    # -- the step ----------------------------------------------------------------------
    def after_backward(self, ctx: RuntimeContext) -> None:
        """Before the step that takes the next snapshot: wait for the whole round of the
        previous one (its copies acknowledged), releasing the chunks whose span is still
        ahead (at most one checkpoint interval lost)."""
        if not self.enabled:
            return
        t0 = time.perf_counter()
        if (ctx.iteration + 1) % self.ck.every_iters == 0:
            self.wait_round()
        else:
            self._raise_error()
        waited = time.perf_counter() - t0
        self.wait_s.append(waited)
        if self.rounds and self.rounds[-1].wait_before_step_ms is None:
            self.rounds[-1].wait_before_step_ms = waited * 1e3
        if self._pending_optim is not None and ctx.optimizer is not None:
            ctx.optimizer.load_state_dict(self._pending_optim)
            self._pending_optim = None

    def after_step(self, ctx: RuntimeContext) -> None:
        """After every ``every_iters``-th step: pack the snapshot into the own slot (here,
        on the training thread: see the module docstring) and hand the round to the side
        process; every ``storage_every_iters``-th, save it to storage too."""
        if not self.enabled:
            return
        now, cpu = time.perf_counter(), time.thread_time()
        last = self.rounds[-1] if self.rounds else None
        if last is not None and last.train_cpu_ms is None and self._anchor is not None:
            last.train_cpu_ms = (cpu - self._anchor_cpu) * 1e3
            if ctx.last_times is not None:
                last.step_start_ms = (now - ctx.last_times.iteration_s - self._anchor) * 1e3
        completed = ctx.iteration + 1
        if completed % self.ck.every_iters:
            return
        self.wait_round()
        self._anchor, self._anchor_cpu = time.perf_counter(), time.thread_time()
        optim = ctx.optimizer.state_dict() if ctx.optimizer is not None else None
        packed = self.packer.prepare(list(ctx.named_params), optim, torch.get_rng_state(),
                                     completed)
        data = self._pack_own(packed, completed)
        record = RoundRecord(iteration=completed, bytes=data.numel(),
                             serialise_ms=(time.perf_counter() - self._anchor) * 1e3)
        self.rounds.append(record)
        slot = self.store.slot_of("own", self.rank, completed)
        if slot is None:
            raise RuntimeError(f"rank {self.rank}: the own snapshot of iteration {completed} "
                               "is not in the store after packing")
        assert self.agent is not None
        plan = self._timetable(self.rank, record.bytes)
        self.agent.round(completed, record.bytes, slot, self._anchor,
                         [(c.holder, c.span, c.start, c.end, c.due_ms) for c in plan])
        self._inflight = record
        record.checkpoint_cpu_ms = (time.thread_time() - self._anchor_cpu) * 1e3
        if completed % self.ck.storage_every_iters == 0:
            self._save_storage(completed, data)

    def wait_round(self) -> None:
        """Wait until the current round (snapshot stored, copies acknowledged) is done,
        sending at once the chunks whose span is still ahead; re-raise its error (or one
        the side process reported since)."""
        rec, self._inflight = self._inflight, None
        if rec is not None and self.agent is not None:
            if self._error is None:
                try:
                    _, _, chunks, round_ms, cpu_ms = self.agent.wait(rec.iteration)
                except (OSError, RuntimeError) as e:
                    self._error = e
                else:
                    rec.chunks.extend(ChunkEvent(*c) for c in chunks)
                    rec.round_ms = round_ms
                    rec.checkpoint_cpu_ms += cpu_ms
                    self.round_s.append(round_ms / 1e3)
        self._raise_error()

    def _raise_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            self._failed = True
            raise RuntimeError(f"checkpoint round failed: {err}") from err

    def report(self) -> list[dict[str, Any]]:
        """The rounds of this attempt, for the run report (:class:`RoundRecord`); waits for
        the current round first."""
        if self.enabled:
            self.wait_round()
        return [r.to_json() for r in self.rounds]

    def _timetable(self, rank: int, nbytes: int) -> list[PlannedSend]:
        """:func:`timetable`, kept per (rank, size): the size repeats every round."""
        key = (rank, nbytes)
        if key not in self._timetables:
            self._timetables[key] = timetable(self.ck, rank, nbytes)
        return self._timetables[key]

    def _pack_own(self, packed: Packed, completed: int) -> torch.Tensor:
        """Pack the snapshot straight into this rank's own slot and complete it; the packed
        bytes (the mapped slot, or a heap buffer when the slot already holds
        ``completed``)."""
        res = self.store.reserve("own", self.rank, completed, packed.nbytes)
        out = (_mapped(res.buffer, packed.nbytes) if res is not None
               else torch.empty(packed.nbytes, dtype=torch.uint8))  # host: the CPU store
        self.packer.pack_into(packed, out)
        if res is not None:
            self.store.commit(res)
        return out

    def close(self, ctx: RuntimeContext) -> None:
        """Finish: the last round, then the side process ends the streams to the holders
        (end-of-file at a header boundary) and waits until each rank held has ended its
        stream (its last round acknowledged), at most the runtime's timeout, and exits.
        After a failed round it does not wait for the ranks held (the run is failing)."""
        clean = self._error is None and not self._failed
        if self.agent is not None:
            self.agent.close(clean)
            self.agent = None
