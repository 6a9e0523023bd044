"""The process ``hetplan run`` starts under torchrun: train a zoo or user model with a plan,
or run the user's training script.

    python -m torch.distributed.run --nproc-per-node N -m hetplan.runtime.worker \\
        --plan plan.json --model gpt-test --steps 10 --report report.json
    python -m torch.distributed.run --nproc-per-node N -m hetplan.runtime.worker \\
        --script train.py --plan plan.json --steps 10

Each rank builds the model with the same seed, builds :class:`Runtime`, trains on synthetic
data (the same global batch on every rank; each replica takes its rows), rank 0 prints a
progress line per step (step, loss, iteration time), and rank 0 writes the run report:
per-iteration measured times (after warm-up), their medians, the loss per step, every rank's
medians (the process's CPU time per step among them) and its peak memory beside the plan's
predictions. The memory meter slows every operator, so it measures the last warm-up step
(untimed; the optimizer's state exists from the first step on); with fewer than two warm-up
steps it measures one extra step after the timed ones. With ``--script`` the script runs as
``__main__`` with the remaining arguments instead (:func:`run_script`).

Reliability (:mod:`hetplan.runtime.proctree`, :mod:`hetplan.runtime.liveness`):

- The process group has a timeout (``--timeout``); a collective with a frozen or dead peer
  fails within it, and the rank exits 1 naming the peer whose heartbeat stopped.
- SIGINT, SIGTERM or SIGHUP end a rank at once with one line (no traceback) and exit code
  128 + the signal's number, even inside a collective; the rank dies with torchrun
  (parent-death signal) and exits when the launcher is gone.
- Exit codes: 0 trained; 1 the run failed (a peer, a collective, the user's script);
  2 the plan was refused (mismatched model, world size, or ranks that loaded different
  plans); 128 + N stopped by signal N. Each rank records its code for the launcher.
- Every exit releases the runtime and the process groups (a barrier first after success),
  then leaves without interpreter finalisation (:func:`~hetplan.runtime.groups.exit_now`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import runpy
import statistics
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from hetplan.errors import SpecError

__all__ = ["main", "run_script", "synthetic_batch", "build_model", "make_target"]


def build_model(name: str | None, module: str | None, seed: int) -> tuple[Any, tuple, dict]:
    """(model, example_args, example_kwargs) of a zoo name or a ``pkg.mod:factory``."""
    if module:
        import importlib

        mod_name, _, attr = module.partition(":")
        sys.path.insert(0, os.getcwd())
        torch.manual_seed(seed)
        result = getattr(importlib.import_module(mod_name), attr)()
        model, args = result[0], result[1]
        kwargs = result[2] if len(result) > 2 else {}
        return model, tuple(args) if isinstance(args, (tuple, list)) else (args,), kwargs
    from hetplan import zoo

    assert name is not None
    model = zoo.build(name, device="cpu", seed=seed)
    return model, *zoo.example_inputs(name, batch=1, device="cpu")


def synthetic_batch(example_args: tuple, batch: int, step: int) -> tuple:
    """A global batch shaped like the example inputs, and a target, the same on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    xs = []
    for a in example_args:
        shape = (batch, *a.shape[1:])
        if a.dtype in (torch.long, torch.int64, torch.int32):
            xs.append(torch.randint(0, max(int(a.max()) + 1, 2), shape,
                                    generator=g))  # host: the caller moves the batch
        else:
            xs.append(torch.randn(shape, generator=g, dtype=a.dtype))  # host: as above
    return tuple(xs)


def make_target(model: Any, example_args: tuple, example_kwargs: dict) -> Any:
    """A function ``(inputs, batch) -> target``: the token ids themselves for language models
    (cross-entropy), zeros shaped like the output otherwise (MSE)."""
    with torch.no_grad():
        out = model(*example_args, **example_kwargs)
    out = getattr(out, "logits", out)
    if isinstance(out, (tuple, list)):
        out = out[0]
    if example_args and example_args[0].dtype == torch.long and out.dim() == 3:
        return lambda xs, batch: xs[0]
    shape = tuple(out.shape[1:])
    return lambda xs, batch: torch.zeros((batch, *shape), dtype=out.dtype, device=out.device)


def main(argv: list[str] | None = None) -> NoReturn:
    """The rank's entry point (see module docstring); never returns."""
    from hetplan.runtime import proctree

    argv = sys.argv[1:] if argv is None else argv
    proctree.stop_on_signals()
    proctree.set_parent_death_signal()  # die with torchrun
    code = _cpu_sched()  # before any thread of the rank's own starts
    try:
        if code == 0:
            proctree.watch_launcher()
            code = run_script(argv[1:]) if argv[:1] == ["--script"] else _run_worker(argv)
    except Exception as e:  # noqa: BLE001 - e.g. the rendezvous timed out: one line, code 1
        _print_error(f"{type(e).__name__}: {e}")
        code = 1
    from hetplan.runtime.groups import exit_now, shutdown_process_groups

    proctree.defer_stop(5.0)  # the teardown below, not a signal, ends this rank
    shutdown_process_groups(clean=code == 0)
    proctree.record_exit(code)
    exit_now(code)


def _cpu_sched() -> int:
    """A CPU rank's scheduling policy (:mod:`.cpu_sched`): 0, or 2 with one line printed for
    a bad or refused ``HETPLAN_CPU_SCHED``."""
    if torch.cuda.is_available():
        return 0
    from hetplan.runtime.cpu_sched import apply_cpu_sched

    try:
        apply_cpu_sched()
    except SpecError as e:
        _print_error(f"error: {e}")
        return 2
    return 0


def run_script(argv: list[str]) -> int:
    """Run the training script ``argv[0]`` as ``__main__`` with ``argv[1:]`` as its
    arguments (as ``python train.py ...`` would); its exit code. Hetplan's errors print as
    one line (2), a failed peer as one line (1), anything else with its traceback (1)."""
    from hetplan.errors import HetplanError
    from hetplan.runtime.liveness import PeerFailureError

    script = argv[0] if argv else ""
    if not os.path.isfile(script):
        _print_error(f"error: training script {script!r} does not exist")
        return 2
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return int(e.code or 0)
        print(e.code, file=sys.stderr)
        return 1
    except HetplanError as e:
        _print_error(f"error: {e}")
        return 2
    except PeerFailureError as e:
        _print_error(str(e))
        return 1
    except Exception:  # noqa: BLE001 - the user's own error: their traceback says where
        traceback.print_exc()
        return 1
    return 0


def _rank() -> str:
    return os.environ.get("RANK", "?")


def _print_error(message: str) -> None:
    """One line for this rank (``HETPLAN_DEBUG``: with the traceback being handled)."""
    from hetplan.runtime.proctree import DEBUG_ENV, say

    if os.environ.get(DEBUG_ENV) and sys.exc_info()[0] is not None:
        traceback.print_exc()
    say(f"rank {_rank()}: {message}")


def _run_worker(argv: list[str]) -> int:
    """Train on synthetic data (the ``--model`` / ``--module`` form); the exit code."""
    ap = argparse.ArgumentParser(prog="hetplan.runtime.worker")
    ap.add_argument("--plan", required=True)
    ap.add_argument("--model")
    ap.add_argument("--module")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--report")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace", help="write the per-action trace of one step here")
    ap.add_argument("--trace-step", type=int, default=0,
                    help="the step to trace, 1-based as the progress line counts (0: last)")
    args = ap.parse_args(argv)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=args.timeout)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restart == "0":
        dist.init_process_group(backend, timeout=timeout)
    else:  # torchrun --max-restarts: the job's store still holds the failed attempt's keys
        from torch.distributed.rendezvous import rendezvous

        store, rank, world = next(rendezvous("env://", timeout=timeout))
        dist.init_process_group(backend, store=dist.PrefixStore(f"/attempt{restart}", store),
                                rank=rank, world_size=world, timeout=timeout)
    return _train(args, device)


def _train(args: argparse.Namespace, device: torch.device) -> int:
    """Build the runtime, train, write the report; the process's exit code."""
    from hetplan.errors import HetplanError
    from hetplan.ir.plan import load_plan
    from hetplan.runtime.executor import Runtime, plan_optimizer
    from hetplan.runtime.liveness import PeerFailureError

    rank = dist.get_rank()
    rt = None
    try:
        plan = load_plan(args.plan)
        model, ex_args, ex_kwargs = build_model(args.model, args.module, args.seed)
        model = model.to(device)
        settings = plan.cost_settings
        rt = Runtime(plan, model, example_args=ex_args, example_kwargs=ex_kwargs,
                     optimizer=plan_optimizer(settings.optimizer if settings else "sgd"))
        _warn_skipped_events(rt, rank)
        layout = plan.layout
        assert layout is not None
        batch = layout.micro_batch_size * layout.micro_batches * layout.dp
        target_of = make_target(model, tuple(a.to(device) for a in ex_args), ex_kwargs)
        times, losses = [], []
        loss = float("nan")
        total = args.warmup + args.steps
        trace = rt.start_trace() if args.trace else None
        traced_step = (args.trace_step or total) - 1
        # peak memory on the last warm-up step: the run trains the steps it was asked for
        meter_at = args.warmup - 1 if args.report and args.warmup >= 2 else None
        peak, peak_step = None, 0
        # the rank that prints the progress line: rank 0, or in a pipeline the first rank
        # that computes the loss (a rank of the last stage), agreed on after the first step
        printer = 0
        # a restart resumes where the restored checkpoint left off (0 without one)
        first = rt.ctx.iteration
        for step in range(first, total):
            xs = tuple(x.to(device) for x in synthetic_batch(ex_args, batch, step))
            if trace is not None and step == traced_step:
                trace.start(step + 1)
            with _meter(rt) if step == meter_at else contextlib.nullcontext() as metered:
                loss = rt.train_step(xs, target_of(xs, batch).to(device))
            if step == meter_at:
                peak, peak_step = metered, step + 1
            if trace is not None:
                trace.stop()
            losses.append(loss)
            if step >= args.warmup and rt.last_times is not None:
                times.append(rt.last_times)
            if step == first and layout.pp > 1:
                printer = _loss_rank(loss)
            if step == first and rank == printer and (note := _loss_note(rank, plan.loss_replicas())):
                print(note, flush=True)
            if rank == printer and rt.last_times is not None:
                # "nan" where the loss is another rank's read as a diverged run
                shown = (f"{loss:.4f}" if layout.pp == 1 or loss == loss
                         else "(on the last stage)")
                print(f"step {step + 1}/{total}  loss {shown}  "
                      f"iteration {rt.last_times.iteration_s * 1e3:.2f} ms", flush=True)
            if step == args.warmup - 1 and rank == printer:  # after the last warm-up step's
                print(f"rank {rank}: warm-up done; timing {args.steps} step(s)", flush=True)
        if trace is not None:
            _write_trace(args.trace, plan, trace, rank)
        if args.report:
            rounds = None
            if plan.checkpointing is not None:  # this attempt's checkpoint rounds, taken
                from hetplan.runtime.handlers import CheckpointingHandler  # before an

                rounds = rt.handler(CheckpointingHandler).report()  # extra metered step
            if peak is None:  # no warm-up step to meter, or a restart began after it
                peak = _measure_peak(rt, ex_args, batch, total, target_of, device)
                peak_step = total + 1
            summary = _rank_summary(rank, times, losses, peak, plan)
            summary["peak_memory_step"] = peak_step  # 1-based, as the progress line counts
            if rounds is not None:
                summary["checkpoint_rounds"] = rounds
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, summary)
            if rank == 0:
                _write_report(args.report, plan, times, loss, ranks, rt)
    except HetplanError as e:
        _print_error(f"error: {e}")
        return 2
    except PeerFailureError as e:  # a frozen or dead peer, named
        _print_error(str(e))
        return 1
    except Exception as e:  # a collective error / timeout without a suspect, or a bug
        _print_error(f"{type(e).__name__}: {e}")
        return 1
    finally:
        if rt is not None:
            rt.close()
    if plan.checkpointing is not None:  # the run succeeded: drop its in-memory checkpoints
        from hetplan.runtime.checkpoint_store import remove_default_root

        dist.barrier()
        if rank == 0:
            remove_default_root()
    return 0


def _write_trace(path: str, plan: Any, trace: Any, rank: int) -> None:
    """Every rank's recording gathered on rank 0, written there as one Chrome trace
    (:func:`~hetplan.runtime.trace.chrome_trace`)."""
    from hetplan.runtime.groups import plan_digest
    from hetplan.runtime.trace import chrome_trace

    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, trace.to_dict())
    if rank == 0:
        layout = plan.layout
        meta = {"plan_digest": plan_digest(plan),
                "model": plan.model.name, "step": trace.step, "world_size": len(ranks),
                "layout": {"dp": layout.dp, "pp": layout.pp, "tp": layout.tp,
                           "schedule": layout.schedule, "micro_batches": layout.micro_batches,
                           "virtual_stages": layout.virtual_stages}}
        Path(path).write_text(json.dumps(chrome_trace(ranks, meta), indent=1) + "\n")


def _warn_skipped_events(rt: Any, rank: int) -> None:
    """Say so when the plan has re-balancing events the runtime does not execute (growing
    back onto released ranks, interleaved pipelines, plans without a pipeline); the others
    run at their iteration."""
    skipped = rt.skipped_events
    if skipped and rank == 0:
        for event, why in skipped[:5]:
            print(f"warning: the plan's re-balancing event at iteration {event.iteration} is "
                  f"not executed ({why}); training keeps the stages it has", file=sys.stderr)
        if len(skipped) > 5:
            print(f"warning: ... and {len(skipped) - 5} more such event(s)", file=sys.stderr)


def _med_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3 if xs else 0.0


def _measure_peak(rt: Any, ex_args: tuple, batch: int, step: int, target_of: Any,
                  device: torch.device) -> Any:
    """One more step, untimed, under the memory meter (it slows every operator): this rank's
    peak of live tensor bytes (:mod:`hetplan.runtime.memory_meter`)."""
    xs = tuple(x.to(device) for x in synthetic_batch(ex_args, batch, step))
    with _meter(rt) as peak:
        rt.train_step(xs, target_of(xs, batch).to(device))
    return peak


def _meter(rt: Any) -> Any:
    """The memory meter over this rank's model, optimizer (and the sharded optimizer's master
    shard) and pipeline stages: a context manager yielding the step's peak."""
    from hetplan.runtime.memory_meter import peak_memory

    opt = rt.opt
    return peak_memory(rt.model, opt, [getattr(opt, "master", None)], rt.stage_modules)


def _loss_note(rank: int, dp: int) -> str | None:
    """What the progress line's loss is when the data-parallel replicas each compute one
    (``None`` with one replica): the printing rank's own, where the run report holds their
    mean, so that the last line's loss and the report's ``final_loss`` may differ."""
    if dp <= 1:
        return None
    return (f"rank {rank}: the loss below is its data-parallel replica's (1 of {dp}); the "
            "run report's loss_per_step and final_loss are the mean over the replicas")


def _loss_rank(loss: float) -> int:
    """The lowest rank whose ``loss`` of this step is a number (0 when none is): in a
    pipeline only the last stage's ranks compute the loss, the others hold NaN. Every rank
    calls it at the same step (one gather of a flag, under the group's timeout)."""
    flags: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(flags, loss == loss)
    return next((r for r, has in enumerate(flags) if has), 0)


def _rank_summary(rank: int, times: list[Any], losses: list[float] | None = None,
                  peak: Any = None, plan: Any = None) -> dict[str, Any]:
    """This rank's median times (ms), losses, and measured peak memory beside the plan's
    prediction for it, for the run report's ``per_rank`` list."""
    out: dict[str, Any] = {
        "rank": rank,
        "iteration_ms": _med_ms([t.iteration_s for t in times]),
        "compute_ms": _med_ms([t.compute_s for t in times]),
        "bubble_ms": _med_ms([t.bubble_s for t in times]),
        "exposed_comm_ms": _med_ms([t.sync_wait_s for t in times]),
        "optimizer_ms": _med_ms([t.optimizer_s for t in times]),
        "cpu_ms": _med_ms([t.cpu_s for t in times]),
        "losses": list(losses or []),
    }
    if peak is None:
        out["peak_memory_note"] = "not measured"
    else:
        out["peak_memory_bytes"] = peak.peak_bytes
        out["peak_memory_by_kind"] = dict(sorted(peak.at_peak.items()))
        pred = plan.predictions if plan is not None else None
        if pred is not None and rank < len(pred.memory_breakdown):
            m = pred.memory_breakdown[rank]
            out["predicted_memory_bytes"] = m.total - m.margin
            out["predicted_memory_by_kind"] = {
                "params": m.params, "grads": m.grads, "optimizer": m.optimizer,
                "activations": m.activations, "buffers": m.buffers}
    return out


def _loss_per_step(ranks: list[Any]) -> list[float]:
    """Each step's loss, the mean over the ranks that computed one (a pipeline's other ranks
    report NaN): the data-parallel replicas' mean is the global batch's loss."""
    n = max((len(r.get("losses", [])) for r in ranks), default=0)
    out = []
    for i in range(n):
        vals = [r["losses"][i] for r in ranks if i < len(r.get("losses", []))
                and r["losses"][i] == r["losses"][i]]
        out.append(round(sum(vals) / len(vals), 6) if vals else float("nan"))
    return out


def _final_loss(ranks: list[Any], fallback: float) -> float:
    """The last step's loss: the mean over the ranks that computed one (the last pipeline
    stage of each data-parallel replica; rank 0 reports NaN when it holds another stage);
    ``fallback`` (rank 0's) when no rank recorded losses."""
    last = [r["losses"][-1] for r in ranks if r.get("losses")]
    vals = [x for x in last if x == x]
    return sum(vals) / len(vals) if vals else fallback


def _write_report(path: str, plan: Any, times: list[Any], loss: float,
                  ranks: list[Any], rt: Any) -> None:
    """Rank 0's times as ``measured``, every rank's medians as ``per_rank``, the
    operating-system policy rank 0 ran under (``cpu_sched``: :mod:`.cpu_sched`), and the
    digest of the plan that ran (``plan_digest``: ``inspect --run`` checks it).

    In a pipeline (``pp > 1``) the measured compute and bubble are the busiest rank's (the
    largest compute median over every stage it holds, its own bubble beside it, the lowest
    such rank on a tie; ``busiest_rank``), as the prediction's breakdown is the busiest
    pipeline rank's (``compute`` the largest per-rank compute, ``bubble`` the pipeline's
    span less it). Rank 0's stages are not those the prediction describes in a plan with
    unequal stages, and the largest bubble is mostly a less busy rank's
    (``docs/decisions/cpu-fidelity.md`` section 24). Without a pipeline: rank 0's compute,
    the largest bubble (about 0 on every rank), ``busiest_rank`` null."""
    from hetplan.runtime.cpu_sched import current_cpu_sched
    from hetplan.runtime.groups import plan_digest

    pred = plan.predictions
    compute_ms = _med_ms([t.compute_s for t in times])
    bubble_ms = max(r["bubble_ms"] for r in ranks)  # without a pipeline: about 0 everywhere
    busiest = None
    if plan.layout is not None and plan.layout.pp > 1 and ranks:
        top = max(ranks, key=lambda r: (r["compute_ms"], -r["rank"]))
        busiest, compute_ms, bubble_ms = top["rank"], top["compute_ms"], top["bubble_ms"]
    report = {
        "plan_digest": plan_digest(plan),
        "world_size": len(ranks),
        "steps": len(times),
        "final_loss": _final_loss(ranks, loss),
        "measured": {
            "iteration_ms": _med_ms([t.iteration_s for t in times]),
            "compute_ms": compute_ms,
            "bubble_ms": bubble_ms,
            "busiest_rank": busiest,
            "exposed_comm_ms": _med_ms([t.sync_wait_s for t in times]),
            "optimizer_ms": _med_ms([t.optimizer_s for t in times]),
            "per_iteration_ms": [round(t.iteration_s * 1e3, 4) for t in times],
        },
        "per_rank": ranks,
        "loss_per_step": _loss_per_step(ranks),
        "rebalanced_at": list(rt.rebalanced_at),
        "rebalance_ms": [round(x * 1e3, 3) for x in rt.rebalance_s],
        "cpu_sched": current_cpu_sched(),
        "predicted": {
            "iteration_ms": pred.iteration_time_ms if pred else None,
            "compute_ms": pred.breakdown.compute_ms if pred else None,
            "bubble_ms": pred.breakdown.bubble_ms if pred else None,
            "exposed_comm_ms": pred.breakdown.exposed_comm_ms if pred else None,
            "optimizer_ms": pred.breakdown.optimizer_ms if pred else None,
        },
    }
    Path(path).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
