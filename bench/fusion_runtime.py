"""Cupcake's buckets vs DDP's default, measured on a bandwidth-limited gloo run (issue 6).

Four gloo ranks, one per emulated node, train a small GPT (``hetplan.models.TinyGPT``, pure
PyTorch) with fp32 gradient sync over an emulated network of ``--gbps`` Gbit/s (each value a
separate run: 0.5, where the wire time is ~3x backprop, and 2, where they are alike) and
``--latency-us`` per ring step (``HETPLAN_EMULATE_BW`` / ``HETPLAN_EMULATE_LATENCY_US``,
:mod:`hetplan.runtime.link_emulation`: each collective holds a per-rank FIFO link for the
alpha-beta time of its ring algorithm; backprop keeps running meanwhile). Variants of one
plan, differing only in ``gradient_sync``:

- ``cupcake``: the compiled plan's buckets (default passes: Cupcake's fusion);
- ``ddp25``: the ``ddp-buckets`` pass (PyTorch DDP's default: first bucket 1 MiB, then 25 MiB);
- ``per-tensor``: one allreduce per gradient (no fusion);
- ``one-bucket``: every gradient in one allreduce after backward.

Calibration, so that predictions and measurements speak of the same machine: the spawn first
measures, with all four ranks busy and no emulated link, the runtime's compute time
(forward+backward) of a training step; the cluster spec gets the CPU FLOP rate that
reproduces it, and the emulated link's bandwidth and latency. Its device type says
``comm_overlaps_compute: true``: the emulated link time is a sleep that leaves the cores to
backprop (loopback gloo's own CPU use is not modelled). The variants are then planned
(rank 0) and measured side by side in the same spawn, in blocks that rotate their order every
round, and each is re-predicted by the simulator from its plan. The machine is shared: the
compute calibration drifts between runs, ratios measured in one run are what to compare.

    python bench/fusion_runtime.py [--gbps 0.5 2] [--latency-us 100] [--rounds 4] [--iters 3]

Writes ``bench/results/fusion_runtime_cpu.json``.
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
MiB = 2**20
#: TinyGPT(vocab, block, dim, layers, heads) and the batch: 77 gradients, 19.1 MiB
MODEL = (512, 64, 256, 6, 4)
SEQ, MICRO_BATCH = 32, 2


def _model() -> torch.nn.Module:
    from hetplan.models import TinyGPT

    torch.manual_seed(0)
    return TinyGPT(*MODEL)


def _inputs(batch: int, step: int) -> torch.Tensor:
    return torch.randint(0, MODEL[0], (batch, SEQ), generator=torch.Generator().manual_seed(step))


def _init(rank: int, store_dir: str, name: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(store_dir, name), WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=300))


def _calibrate(probe_json: str) -> tuple[float, float]:
    """Median compute time (forward+backward) of the runtime's training step, all ranks busy,
    no emulated link, and median time of a 4-byte allreduce; medians over the ranks."""
    from hetplan.ir.plan import Plan
    from hetplan.runtime.executor import Runtime

    rt = Runtime(Plan.from_json(probe_json), _model(), example_args=(_inputs(MICRO_BATCH, 0),))
    fb = []
    for i in range(10):
        xs = _inputs(MICRO_BATCH * WORLD, 500 + i)
        dist.barrier()
        rt.train_step((xs,), xs)
        if i >= 3 and rt.last_times is not None:
            fb.append(rt.last_times.compute_s)
    rt.close()
    tiny = torch.zeros(1)
    ar = []
    for i in range(40):
        t0 = time.perf_counter()
        dist.all_reduce(tiny)
        if i >= 5:
            ar.append(time.perf_counter() - t0)
    got: list[Any] = [None] * WORLD
    dist.all_gather_object(got, (statistics.median(fb), statistics.median(ar)))
    return statistics.median(g[0] for g in got), statistics.median(g[1] for g in got)


def _cluster(gbps: float, tflops: float, latency_us: float) -> Any:
    from hetplan.ir.cluster import ClusterSpec

    return ClusterSpec.from_dict({
        "name": "cpu-4x1-emulated",
        "description": f"4 gloo processes as 4 nodes, {gbps:g} Gbit/s emulated between them",
        "nodes": [{"name": "host", "count": WORLD, "devices": [{"type": "cpu", "count": 1}],
                   "cpu_cores": 1,
                   "intra_link": {"kind": "loopback", "bandwidth_gbps": 40.0,
                                  "latency_us": latency_us}}],
        "inter_node": {"kind": "ethernet", "bandwidth_gbps": gbps, "latency_us": latency_us},
        "device_types": {"cpu": {"memory_gib": 4.0, "peak_tflops": {"fp32": tflops},
                                 "mem_bandwidth_gb_s": 20.0, "comm_overlaps_compute": True}},
    }, where="bench/fusion_runtime.py")


def _compile(cluster: Any, passes: tuple[str, ...] | None = None) -> Any:
    import hetplan

    model = _model()
    ir = hetplan.capture(model, (_inputs(MICRO_BATCH, 0),), {})
    kw: dict[str, Any] = {"passes": passes} if passes else {}
    return hetplan.compile(ir, cluster, batch_size=MICRO_BATCH * WORLD, dp=WORLD, pp=1, tp=1,
                           micro_batch_size=MICRO_BATCH, optimizer="sgd", **kw)


def _variants(plan: Any, ddp: Any) -> dict[str, Any]:
    """The plan with each variant's gradient sync (every one a flat fp32 allreduce per bucket)."""
    from hetplan.ir.plan_sections import Bucket, GradientSync, NoSync, TensorSync

    grads = plan.model.workload.grads

    def sync(groups: list[list[Any]]) -> GradientSync:
        return GradientSync(
            strategies={"fp32": NoSync()},
            tensors=tuple(TensorSync(name=g.name, strategy="fp32") for g in grads),
            buckets=tuple(Bucket(tensors=tuple(g.name for g in grp),
                                 size_bytes=sum(g.size_bytes for g in grp), strategy="fp32")
                          for grp in groups))

    by_name = {g.name: g for g in grads}

    def groups_of(gs: Any) -> list[list[Any]]:
        return [[by_name[n] for n in b.tensors] for b in gs.buckets]

    out = {
        "cupcake": sync(groups_of(plan.gradient_sync)),
        "ddp25": sync(groups_of(ddp.gradient_sync)),
        "per-tensor": sync([]),
        "one-bucket": sync([list(grads)]),
    }
    return {k: plan.model_copy(update={"gradient_sync": v}) for k, v in out.items()}


def _plan_variants(probe_json: str, fb_s: float, ar_s: float, gbps: float,
                   latency_us: float) -> dict[str, Any]:
    """Rank 0: the calibrated cluster, the plans of every variant and their predictions."""
    import hetplan
    from hetplan.ir.plan import Plan
    from hetplan.passes import BASELINE_PASSES

    # the FLOP rate that makes the analytic compute of one micro-batch take fb_s (the probe
    # plan was compiled at 1 TFLOP/s)
    probe = Plan.from_json(probe_json)
    assert probe.predictions is not None
    tflops = probe.predictions.breakdown.compute_ms / (fb_s * 1e3)
    cluster = _cluster(gbps, tflops, latency_us)
    plan = _compile(cluster)
    ddp = _compile(cluster, BASELINE_PASSES)
    variants = _variants(plan, ddp)
    return {
        "calibration": {"forward_backward_ms": round(fb_s * 1e3, 3),
                        "loopback_tiny_allreduce_ms": round(ar_s * 1e3, 3),
                        "emulated_latency_us_per_ring_step": latency_us,
                        "cpu_fp32_tflops": round(tflops, 5)},
        "plans": {k: v.to_json() for k, v in variants.items()},
        "predicted": {k: hetplan.simulate(v).model_dump(mode="json")
                      for k, v in variants.items()},
    }


def _probe_plan(gbps: float) -> str:
    """A plan at 1 TFLOP/s with all gradients in one bucket (for the compute calibration)."""
    probe = _compile(_cluster(gbps, 1.0, 25.0))
    return _variants(probe, probe)["one-bucket"].to_json()


def _run(rank: int, store_dir: str, gbps: float, latency_us: float, rounds: int, iters: int,
         out: str) -> None:
    """Calibrate, plan (rank 0), then measure every variant with the emulated link."""
    _init(rank, store_dir, "store")
    box: list[Any] = [_probe_plan(gbps) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    probe_json = box[0]
    fb_s, ar_s = _calibrate(probe_json)
    box = [_plan_variants(probe_json, fb_s, ar_s, gbps, latency_us) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    setup = box[0]
    os.environ["HETPLAN_EMULATE_BW"] = str(gbps)
    os.environ["HETPLAN_EMULATE_LATENCY_US"] = str(latency_us)
    from hetplan.ir.plan import Plan
    from hetplan.runtime.executor import Runtime

    example = (_inputs(MICRO_BATCH, 0),)
    runtimes = {name: Runtime(Plan.from_json(pj), _model(), example_args=example)
                for name, pj in setup["plans"].items()}
    names = list(runtimes)
    times: dict[str, list[list[float]]] = {n: [] for n in names}
    for r in range(rounds + 1):  # round 0 is warm-up
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            for i in range(iters):
                xs = _inputs(MICRO_BATCH * WORLD, 1000 * r + i)
                dist.barrier()
                runtimes[name].train_step((xs,), xs)
                t = runtimes[name].last_times
                if r and t is not None:
                    times[name].append([t.iteration_s, t.compute_s, t.sync_wait_s])
    for rt in runtimes.values():
        rt.close()
    if rank == 0:
        Path(out).write_text(json.dumps({**setup, "times": times}))
    dist.barrier()
    dist.destroy_process_group()


def _setting(gbps: float, latency_us: float, rounds: int, iters: int) -> dict[str, Any]:
    """One emulated network: calibrate, plan and measure in one spawn; the result row."""
    from hetplan.ir.plan import Plan
    from hetplan.ir.plan_sections import Predictions

    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(_run, args=(tmp, gbps, latency_us, rounds, iters, out), nprocs=WORLD,
                 join=True)
        got = json.loads(Path(out).read_text())
    times = got["times"]
    variants = {k: Plan.from_json(v) for k, v in got["plans"].items()}
    predicted = {k: Predictions.model_validate(v) for k, v in got["predicted"].items()}
    med = {k: [statistics.median(x[j] for x in v) * 1e3 for j in range(3)]
           for k, v in times.items()}  # iteration, compute, exposed comm
    rows = {}
    print(f"-- {gbps:g} Gbit/s, {latency_us:g} us per ring step")
    for k, v in variants.items():
        p = predicted[k]
        it, comp, exposed = med[k]
        rows[k] = {
            "buckets": len(v.gradient_sync.buckets) or len(v.gradient_sync.tensors),
            "predicted_ms": round(p.iteration_time_ms, 3),
            "predicted_exposed_comm_ms": round(p.breakdown.exposed_comm_ms, 3),
            "measured_ms": round(it, 3),
            "measured_compute_ms": round(comp, 3),
            "measured_exposed_comm_ms": round(exposed, 3),
            "measured_over_predicted": round(it / p.iteration_time_ms, 3),
            "measured_ratio_to_ddp25": round(it / med["ddp25"][0], 3),
            "predicted_ratio_to_ddp25": round(
                p.iteration_time_ms / predicted["ddp25"].iteration_time_ms, 3),
        }
        r = rows[k]
        print(f"{k:11s} {r['buckets']:3d} buckets  predicted {r['predicted_ms']:8.1f} ms  "
              f"measured {r['measured_ms']:8.1f} ms  ratio to ddp25: predicted "
              f"{r['predicted_ratio_to_ddp25']:.3f} measured {r['measured_ratio_to_ddp25']:.3f}")
    gs = {k: v.gradient_sync for k, v in variants.items()}
    return {
        "emulated_gbps": gbps,
        "emulated_latency_us": latency_us,
        "calibration": got["calibration"],
        "iterations_each": len(times["ddp25"]),
        "variants": rows,
        # the same computation in both: how far this machine's noise moves a median
        "noise_compute_one_bucket_over_ddp25": round(med["one-bucket"][1] / med["ddp25"][1], 3),
        "cupcake_bucket_mib": [round(b.size_bytes / MiB, 3) for b in gs["cupcake"].buckets],
        "ddp25_bucket_mib": [round(b.size_bytes / MiB, 3) for b in gs["ddp25"].buckets],
        "wall_s": round(time.perf_counter() - t_start, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gbps", type=float, nargs="+", default=[0.5, 2.0])
    ap.add_argument("--latency-us", type=float, default=100.0)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args()
    settings = [_setting(g, args.latency_us, args.rounds, args.iters) for g in args.gbps]
    grads = _compile(_cluster(1.0, 1.0, 25.0)).model.workload.grads
    result = {
        "machine": machine(backend="gloo",
                           note="2 cores shared with other work while measured: absolute "
                                "times are noisy; variants were interleaved so noise hits "
                                "all alike"),
        "model": {"class": "hetplan.models.TinyGPT", "args": list(MODEL), "seq": SEQ,
                  "micro_batch_per_rank": MICRO_BATCH, "grad_tensors": len(grads),
                  "grad_mib": round(sum(g.size_bytes for g in grads) / MiB, 3)},
        "world_size": WORLD,
        "settings": settings,
    }
    path = ROOT / "bench" / "results" / "fusion_runtime_cpu.json"
    path.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(f"wrote {path.relative_to(ROOT)} in {sum(x['wall_s'] for x in settings):.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
