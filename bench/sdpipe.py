"""SDPipe group sync against synchronous all-reduce under the paper's straggler model: measured
on gloo (2 stages x 2 pipelines on one CPU machine) beside the simulator's predictions, and a
simulated table in the shape of the paper's Fig. 4.

Measured (4 gloo ranks, ``cpu-2x2`` with ``stragglers: {probability: 0.1, delay_s: 0.3}``, the
paper's hete-B ResNet setting): the same model and layout (dp=2, pp=2) planned twice, once with
``sdpipe{mode=sdpipe}`` (group sync) and once without (gradient all-reduce). Each round trains
K iterations with each plan, the order alternating, every rank delayed by
``HETPLAN_EMULATE_DELAY`` with the round's seed (the same delays for both plans). A
calibration run without delays measures the synchronous iteration time (its 20th percentile
sets SDPipe's window T, 1/N of it, the paper's rule: the machine is shared, and its least
loaded steps are what the model costs) and calibrates the simulator. Iterations per second =
K / (last rank's end − common start).

Predicted, beside each measurement: the simulator (``hetplan.algorithms.sdpipe_sim``, flush
schedule, the measured stage compute and averaging times, the same delays), and the plan's own
prediction (the ``sdpipe`` pass: analytic CPU costs, PipeDream 1F1B).

Fig. 4 shape (simulated only): M x N in {4x2, 4x4, 4x8, 2x8} x {homogeneous, hete-A, hete-B}
for all-reduce, AD-PSGD and SDPipe (P = 10, T = iteration / N), samples per second with 64
samples per pipeline and mini-batch. The stage times are an assumption, not a measurement:
BERT-base in 4 (or 2) equal stages on A100s, 30 ms forward and 60 ms backward per 64-sample
mini-batch for a quarter of the model, parameters averaged over 10 Gb/s Ethernet (the paper's
testbed), delays +0.2 s / +0.6 s with p = 0.1 (the paper's BERT settings).

    python bench/sdpipe.py [--iters 40] [--rounds 2] [--model gpt-test] [--batch 8]

Writes ``bench/results/sdpipe_cpu.json``; exit code 1 when SDPipe's measured speedup is below
1.3x.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _machine import machine

ROOT = Path(__file__).resolve().parents[1]
WORLD = 4
PROB, DELAY_S = 0.1, 0.3
BASE = "uniform-stages,even-tp,ddp-buckets"
TARGET = 1.3


def _cluster():  # type: ignore[no-untyped-def]
    from hetplan.ir.cluster import ClusterSpec

    data = ClusterSpec.from_preset("cpu-2x2").model_dump(mode="json", exclude_none=True)
    return ClusterSpec.from_dict({**data, "stragglers": {"probability": PROB,
                                                          "delay_s": DELAY_S}})


def _plans(model: str, batch: int) -> dict[str, str]:
    import hetplan
    from hetplan import zoo

    args, kwargs = zoo.example_inputs(model, batch=1, device="cpu")
    ir = hetplan.capture(zoo.build(model, device="cpu", seed=0), args, kwargs, name=model)
    out = {}
    for name, extra in (("allreduce", ""), ("sdpipe", ",sdpipe{mode=sdpipe}")):
        plan = hetplan.compile(ir, _cluster(), batch_size=batch, dp=2, pp=2, tp=1, zero_stage=0,
                               micro_batch_size=batch // 4, passes=BASE + extra)
        out[name] = plan.to_json()
    return out


def _worker(rank: int, store_dir: str, plans: dict[str, str], model: str, iters: int,
            rounds: int, out: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(store_dir, "store"), WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=600))
    from hetplan import zoo
    from hetplan.ir.plan import Plan
    from hetplan.runtime.executor import Runtime
    from hetplan.runtime.handlers.group_sync import ENV_DELAY, GroupSyncHandler
    from hetplan.runtime.worker import make_target, synthetic_batch

    args, kwargs = zoo.example_inputs(model, batch=1, device="cpu")
    layout = Plan.from_json(plans["allreduce"]).layout
    assert layout is not None
    batch = layout.micro_batch_size * layout.micro_batches * layout.dp
    target_of = make_target(zoo.build(model, device="cpu", seed=0), args, kwargs)

    def run(plan_json: str, steps: int, delay: str) -> dict[str, Any]:
        os.environ[ENV_DELAY] = delay
        rt = Runtime(Plan.from_json(plan_json), zoo.build(model, device="cpu", seed=0),
                     example_args=args, example_kwargs=kwargs)
        data = [synthetic_batch(args, batch, 1000 + i) for i in range(steps)]
        targets = [target_of(x, batch) for x in data]
        dist.barrier()
        t0 = time.perf_counter()
        times = []
        for x, y in zip(data, targets):
            rt.train_step(x, y)
            assert rt.last_times is not None
            times.append(rt.last_times)
        t1 = time.perf_counter()
        handler = rt.handler(GroupSyncHandler)
        sizes = list(handler.group_sizes)
        rt.close()
        spans = [None] * WORLD
        dist.all_gather_object(spans, (t0, t1))
        start = max(s[0] for s in spans)  # every rank passed the barrier by then
        return {"iters_per_s": steps / (max(s[1] for s in spans) - start),
                "group_sizes": sizes,
                "compute_s": statistics.median(t.compute_s for t in times),
                "sync_wait_s": statistics.median(t.sync_wait_s for t in times),
                "optimizer_s": statistics.median(t.optimizer_s for t in times),
                "iteration_s": statistics.median(t.iteration_s for t in times),
                # the machine is shared: its least loaded steps say what the model costs
                "iteration_q20_s": statistics.quantiles([t.iteration_s for t in times],
                                                        n=5)[0]}

    result: dict[str, Any] = {"calibration": run(plans["allreduce"], max(iters // 2, 8), "")}
    measured: list[Any] = [None] * WORLD  # every rank must load the same plan: agree on T
    dist.all_gather_object(measured, result["calibration"]["iteration_q20_s"])
    window_ms = round(statistics.median(measured) * 1e3 / layout.dp, 3)
    plans = dict(plans)
    sd = Plan.from_json(plans["sdpipe"])
    assert sd.group_sync is not None
    plans["sdpipe"] = sd.model_copy(update={"group_sync": sd.group_sync.model_copy(
        update={"window_ms": window_ms})}).to_json()
    result["window_ms"] = window_ms
    result["rounds"] = []
    for r in range(rounds):
        order = ["allreduce", "sdpipe"] if r % 2 == 0 else ["sdpipe", "allreduce"]
        delay = f"{PROB},{DELAY_S},{r}"
        result["rounds"].append({name: run(plans[name], iters, delay) for name in order})
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def _predict(per_rank: list[dict[str, Any]], layout: Any, iters: int, seed: int,
             window_ms: float) -> dict[str, float]:
    """The simulator's iterations per second for both policies, calibrated on the measured
    synchronous run without delays (stage compute and averaging times per rank)."""
    from hetplan.algorithms.sdpipe import SchedulerConfig
    from hetplan.algorithms.sdpipe_sim import ReplicaMesh, simulate

    m, n = layout.pp, layout.dp
    fwd = [[0.0] * n for _ in range(m)]
    bwd = [[0.0] * n for _ in range(m)]
    avg = 0.0
    for rank, res in enumerate(per_rank):
        dp, pp, _ = layout.coords(rank)
        cal = res["calibration"]
        # the shared machine's load inflates the medians: scale them to the quiet steps
        quiet = cal["iteration_q20_s"] / cal["iteration_s"]
        fwd[pp][dp] = quiet * cal["compute_s"] / 3
        bwd[pp][dp] = quiet * (2 * cal["compute_s"] / 3 + cal["optimizer_s"])
        avg = max(avg, quiet * cal["sync_wait_s"])
    # the flush schedule serialises the stages; what the measured iteration has beyond it
    # (pipeline overlap of micro-batches is negative, activation transfers positive) is
    # spread over the stage boundaries
    serial = max(sum(fwd[j][i] + bwd[j][i] for j in range(m)) for i in range(n)) + avg
    measured = statistics.median(r["calibration"]["iteration_q20_s"] for r in per_rank)
    p2p = (measured - serial) / (2 * (m - 1))
    if p2p < 0:  # micro-batches overlap: scale the compute down instead
        scale = (measured - avg) / (serial - avg)
        fwd = [[f * scale for f in row] for row in fwd]
        bwd = [[b * scale for b in row] for row in bwd]
        p2p = 0.0
    grid = lambda v: tuple((v,) * n for _ in range(m))  # noqa: E731
    mesh = ReplicaMesh(fwd_s=tuple(map(tuple, fwd)), bwd_s=tuple(map(tuple, bwd)),
                       p2p_s=(p2p,) * (m - 1),
                       avg_s=tuple((0.0, 0.0) + (avg,) * (n - 1) for _ in range(m)),
                       straggle_prob=grid(PROB), straggle_delay_s=grid(DELAY_S))
    config = SchedulerConfig(num_stages=m, num_pipelines=n, p=10, window_s=window_ms * 1e-3)
    return {pol: simulate(mesh, pol, iters, seed=seed, scheduler=config,
                          schedule="flush").makespan_iters_per_s
            for pol in ("allreduce", "sdpipe")}


def fig4_table(iterations: int = 200, seed: int = 0) -> list[dict[str, Any]]:
    """The simulated Fig. 4-shaped table (see the module docstring for the assumptions)."""
    from hetplan.algorithms.collectives import analytic_time_s
    from hetplan.algorithms.sdpipe import SchedulerConfig
    from hetplan.algorithms.sdpipe_sim import ReplicaMesh, simulate

    samples = 64
    stage_bytes_full = 110e6 * 4  # BERT-base fp32
    rows = []
    for m, n in ((4, 2), (4, 4), (4, 8), (2, 8)):
        per_stage = 4 / m  # a stage holds 4/m quarters of the model
        f, b = 0.030 * per_stage, 0.060 * per_stage
        nbytes = stage_bytes_full / m
        avg = tuple((0.0, 0.0) + tuple(
            analytic_time_s("allreduce", nbytes, s, latency_s=50e-6,
                            bandwidth_bytes_per_s=10e9 / 8) for s in range(2, n + 1))
            for _ in range(m))
        for setting, delay in (("homogeneous", 0.0), ("hete-A", 0.2), ("hete-B", 0.6)):
            grid = lambda v: tuple((v,) * n for _ in range(m))  # noqa: E731
            mesh = ReplicaMesh(fwd_s=grid(f), bwd_s=grid(b), p2p_s=(0.002,) * (m - 1),
                               avg_s=avg, straggle_prob=grid(0.1 if delay else 0.0),
                               straggle_delay_s=grid(delay))
            config = SchedulerConfig(num_stages=m, num_pipelines=n, p=10,
                                     window_s=(f + b) / n)
            row: dict[str, Any] = {"mesh": f"{m}x{n}", "setting": setting}
            for pol in ("allreduce", "adpsgd", "sdpipe"):
                res = simulate(mesh, pol, iterations, seed=seed, scheduler=config)
                row[pol] = round(res.iters_per_s * n * samples, 1)
            row["sdpipe_vs_allreduce"] = round(row["sdpipe"] / row["allreduce"], 3)
            row["sdpipe_vs_adpsgd"] = round(row["sdpipe"] / row["adpsgd"], 3)
            rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt-test")
    ap.add_argument("--batch", type=int, default=8, help="global batch (4 micro-batches)")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "sdpipe_cpu.json")
    args = ap.parse_args()

    from hetplan.ir.plan import Plan
    from hetplan.profiling._spawn import start_method

    plans = _plans(args.model, args.batch)
    layout = Plan.from_json(plans["allreduce"]).layout
    section = Plan.from_json(plans["sdpipe"]).group_sync
    assert layout is not None and section is not None
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.start_processes(_worker, args=(tmp, plans, args.model, args.iters, args.rounds, out),
                           nprocs=WORLD, join=True, start_method=start_method())
        per_rank = json.loads(Path(out).read_text())
    rounds = []
    for r in range(args.rounds):
        measured = {pol: per_rank[0]["rounds"][r][pol]["iters_per_s"]
                    for pol in ("allreduce", "sdpipe")}
        predicted = _predict(per_rank, layout, args.iters, r, per_rank[0]["window_ms"])
        sizes = [s for res in per_rank for s in res["rounds"][r]["sdpipe"]["group_sizes"]]
        rounds.append({
            "seed": r, "measured_iters_per_s": measured, "predicted_iters_per_s": predicted,
            "measured_speedup": measured["sdpipe"] / measured["allreduce"],
            "predicted_speedup": predicted["sdpipe"] / predicted["allreduce"],
            "sdpipe_mean_group_size": statistics.fmean(sizes),
        })
    speedup = statistics.fmean(r["measured_speedup"] for r in rounds)
    plan_pred = {p.policy: p.iters_per_s for p in section.predictions}
    result = {
        "machine": machine(backend="gloo", load_average_at_end=os.getloadavg(),
                           note="shared machine: see the load average"),
        "config": {"model": args.model, "batch": args.batch, "iters": args.iters,
                   "rounds": args.rounds, "mesh": "2 stages x 2 pipelines",
                   "stragglers": {"probability": PROB, "delay_s": DELAY_S},
                   "window_ms": per_rank[0]["window_ms"], "p": section.p},
        "calibration_iteration_s": statistics.median(
            r["calibration"]["iteration_s"] for r in per_rank),
        "calibration_iteration_q20_s": statistics.median(
            r["calibration"]["iteration_q20_s"] for r in per_rank),
        "rounds": rounds,
        "mean_measured_speedup": speedup,
        "plan_prediction_iters_per_s (analytic CPU costs, 1F1B)": plan_pred,
        "target_speedup": TARGET,
        "fig4_simulated_samples_per_s": fig4_table(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(f"calibration: synchronous iteration {result['calibration_iteration_s'] * 1e3:.1f} ms"
          f" (median; 20th percentile {result['calibration_iteration_q20_s'] * 1e3:.1f} ms), "
          f"T = {per_rank[0]['window_ms']:.1f} ms")
    print(f"{'round':>5} {'policy':>10} {'measured it/s':>14} {'predicted it/s':>15}")
    for r in rounds:
        for pol in ("allreduce", "sdpipe"):
            print(f"{r['seed']:>5} {pol:>10} {r['measured_iters_per_s'][pol]:14.3f} "
                  f"{r['predicted_iters_per_s'][pol]:15.3f}")
        print(f"{'':>5} {'speedup':>10} {r['measured_speedup']:14.2f} "
              f"{r['predicted_speedup']:15.2f}   mean group {r['sdpipe_mean_group_size']:.2f}")
    print("\nsimulated Fig. 4 shape (samples/s):")
    print(f"{'mesh':>5} {'setting':>12} {'allreduce':>10} {'adpsgd':>10} {'sdpipe':>10} "
          f"{'vs AR':>6} {'vs AD':>6}")
    for row in result["fig4_simulated_samples_per_s"]:
        print(f"{row['mesh']:>5} {row['setting']:>12} {row['allreduce']:10.1f} "
              f"{row['adpsgd']:10.1f} {row['sdpipe']:10.1f} {row['sdpipe_vs_allreduce']:6.2f} "
              f"{row['sdpipe_vs_adpsgd']:6.2f}")
    print(f"\nmean measured speedup {speedup:.2f}x (target >= {TARGET}x); wrote {args.out}")
    return 0 if speedup >= TARGET else 1


if __name__ == "__main__":
    raise SystemExit(main())
