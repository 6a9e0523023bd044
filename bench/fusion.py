"""Bench: Cupcake tensor fusion — solver time vs thesis Table 5.1, and plan quality.

(a) Solver time on the 161-, 314- and 199-tensor workloads (ResNet-50, ResNet-101, BERT-base
of ``espresso_models.json``), DGC on 64 V100s (v100-pcie-8x8): the thesis model (compression
encode+decode on the compute stream, one allgather channel), costs from the project's cost
model. Timed: the cost tables of every group (``StageSync.ops_table``, numpy), and on them
``pareto_dp_table`` (exact for the project's table-shaped compression cost),
``dp_affine`` (exact for an affine fit of it), Algorithm 5.1 (both prunings, call budget), and
the whole ``cupcake-fusion`` pass (cost tables + DP + scoring). Ratios vs Table 5.1 (2.8 s,
6.6 s, 4.2 s; their search hardware is not stated, ours is this machine's CPU).

(b) Plan quality: predicted iteration time of Cupcake buckets vs layer-wise, one bucket per
stage, and DDP's 25 MiB buckets, for fp32 and for DGC, on the six workloads of
``espresso_models.json`` plus GPT-2 and BERT-base captured from the zoo, on v100-pcie-8x8
(PCIe, 25 Gb/s) and v100-nvlink-8x8 (NVLink, 100 Gb/s), dp = 64.

Every solver time is the least of 5 runs (the machine is shared). Run:
``python bench/fusion.py`` → ``bench/results/fusion.json`` and a table.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import numpy as np

from hetplan.algorithms.fusion import pareto_dp_table
from hetplan.algorithms.fusion_reference import SearchBudgetExceeded, alg51, dp_affine
from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.evaluate import evaluate, stage_syncs
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan import ClusterRef, ModelRef, Plan
from hetplan.ir.plan_sections import (
    Bucket,
    CompressedSync,
    GradientSync,
    Layout,
    NoSync,
    TensorSync,
    WorkloadSummary,
)
from hetplan.ir.workload import espresso_workloads
from hetplan.passes.base import PassContext
from hetplan.passes.cupcake import CupcakeFusion
from hetplan.passes.ddp_buckets import DDPBuckets

DATA = Path(__file__).resolve().parents[1] / "data" / "espresso_models.json"
OUT = Path(__file__).parent / "results" / "fusion.json"
THESIS_S = {"resnet50": 2.8, "resnet101": 6.6, "bert": 4.2}
CLUSTERS = {"pcie-25G": "v100-pcie-8x8", "nvlink-100G": "v100-nvlink-8x8"}
DP = 64
ALG51_BUDGET = 200_000


def setup(wl: WorkloadSummary, preset: str) -> tuple[PassContext, Plan]:
    spec = ClusterSpec.from_preset(preset)
    layout = Layout(dp=DP, micro_batch_size=wl.batch_size, global_batch_size=DP * wl.batch_size)
    ctx = PassContext(workload=wl, cluster=spec, costs=CostModel(spec, None), layout=layout)
    plan = Plan(model=ModelRef(name="bench", fingerprint="0" * 16, num_params=1),
                cluster=ClusterRef.from_cluster(spec, embed=False), layout=layout)
    return ctx, plan


def predict(ctx: PassContext, plan: Plan, sync: GradientSync | None) -> float:
    return evaluate(ctx.workload, ctx.layout, plan.stages, sync, ctx.costs,
                    check_memory=False).iteration_s * 1e3


def timed(fn, repeat: int = 5):  # type: ignore[no-untyped-def]
    """(result, least wall time of ``repeat`` runs): the machine is shared, and the least
    time is the one least disturbed by other jobs."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return out, best


def solver_times(name: str, wl: WorkloadSummary) -> dict[str, object]:
    ctx, plan = setup(wl, CLUSTERS["pcie-25G"])
    ss = stage_syncs(wl, ctx.layout, plan.stages, ctx.costs)[0]
    dgc = CompressedSync(compressor="dgc", params={"ratio": 0.01})
    n = len(ss.grads)
    pre = [0.0]
    for b in ss.nbytes:
        pre.append(pre[-1] + b)

    def tables() -> tuple[np.ndarray, np.ndarray]:
        # every group's (h, g) at once: compute-stream ops and channel ops of the DGC path
        ii, jj = np.triu_indices(n)
        cum = np.asarray(pre)
        res, dur = ss.ops_table(dgc, cum[jj + 1] - cum[ii], ctx.costs)
        on_gpu = np.array([r == "gpu" for r in res])
        h, g = np.full((n, n), np.inf), np.full((n, n, 1), np.inf)
        h[ii, jj] = dur[:, on_gpu].sum(axis=1)
        g[ii, jj, 0] = dur[:, ~on_gpu].sum(axis=1)
        return h, g

    (h_tab, g_tab), t_tables = timed(tables)
    table = {(i, j): (float(h_tab[i, j]), float(g_tab[i, j, 0]))
             for i in range(n) for j in range(i, n)}
    bp = list(ss.backprop_s)
    exact, t_pareto = timed(lambda: pareto_dp_table(bp, h_tab, g_tab))
    # affine fit through the single-tensor and whole-model costs
    total = pre[n]
    h1, g1 = table[0, 0]
    hn, gn = table[0, n - 1]
    x0 = ss.nbytes[0]
    bh = (hn - h1) / (total - x0) if total > x0 else 0.0
    bg = (gn - g1) / (total - x0) if total > x0 else 0.0
    ah, ag = max(h1 - bh * x0, 0.0), max(g1 - bg * x0, 0.0)
    aff, t_aff = timed(lambda: dp_affine(bp, ss.nbytes, ah, bh, ag, bg))
    try:
        a51, t_a51 = timed(repeat=1, fn=lambda: alg51(bp, lambda i, j: table[i, j][0],
                                         lambda i, j: table[i, j][1], max_calls=ALG51_BUDGET))
        alg = {"time_s": t_a51, "calls": a51.calls, "predicted_ms": a51.time_s * 1e3,
               "matches_exact": abs(a51.time_s - exact.time_s) <= 1e-9 * exact.time_s}
    except SearchBudgetExceeded:
        alg = {"time_s": None, "calls": f"> {ALG51_BUDGET}", "predicted_ms": None}
    strategies = {"dgc": dgc}
    tensors = tuple(TensorSync(name=g.name, strategy="dgc") for g in wl.grads)
    dplan = plan.model_copy(update={"gradient_sync": GradientSync(strategies=strategies,
                                                                  tensors=tensors)})
    _, t_pass = timed(lambda: CupcakeFusion().run(dplan, ctx))
    return {
        "tensors": n,
        "tables_s": t_tables, "pareto_dp_s": t_pareto,
        "tables_and_pareto_dp_s": t_tables + t_pareto, "pareto_groups": len(exact.groups),
        "pareto_predicted_ms": exact.time_s * 1e3,
        "dp_affine_s": t_aff, "dp_affine_groups": len(aff.groups),
        "alg51": alg,
        "pass_s": t_pass,
        "thesis_alg51_s": THESIS_S.get(name),
        "ratio_thesis_over_pareto": THESIS_S[name] / t_pareto if name in THESIS_S else None,
        "ratio_thesis_over_tables_and_pareto": (THESIS_S[name] / (t_tables + t_pareto)
                                                if name in THESIS_S else None),
        "ratio_thesis_over_dp_affine": THESIS_S[name] / t_aff if name in THESIS_S else None,
    }


def quality(wl: WorkloadSummary, preset: str, strategy_name: str) -> dict[str, float]:
    ctx, plan = setup(wl, preset)
    strategy = NoSync() if strategy_name == "fp32" else CompressedSync(
        compressor="dgc", params={"ratio": 0.01})
    strategies = {strategy_name: strategy}
    names = [g.name for g in wl.grads]
    size = {g.name: g.size_bytes for g in wl.grads}
    tensors = tuple(TensorSync(name=n, strategy=strategy_name) for n in names)
    layer = GradientSync(strategies=strategies, tensors=tensors)
    one = GradientSync(strategies=strategies, buckets=(Bucket(
        tensors=tuple(names), size_bytes=sum(size.values()), strategy=strategy_name),))
    ddp_buckets = DDPBuckets().run(plan, ctx).plan.gradient_sync
    assert ddp_buckets is not None
    ddp = GradientSync(strategies=strategies, buckets=tuple(
        b.model_copy(update={"strategy": strategy_name}) for b in ddp_buckets.buckets))
    cup = CupcakeFusion().run(plan.model_copy(update={"gradient_sync": ddp}), ctx)
    fused = cup.plan.gradient_sync
    out = {
        "layer_wise_ms": predict(ctx, plan, layer),
        "one_bucket_ms": predict(ctx, plan, one),
        "ddp_25MiB_ms": predict(ctx, plan, ddp),
        "cupcake_ms": predict(ctx, plan, fused),
        "cupcake_buckets": float(len(fused.buckets) if fused else 0),
        "exact": float(any("exact" in n for n in cup.notes)),
    }
    out["speedup_vs_ddp"] = out["ddp_25MiB_ms"] / out["cupcake_ms"]
    out["speedup_vs_layer_wise"] = out["layer_wise_ms"] / out["cupcake_ms"]
    return out


def zoo_workload(name: str) -> WorkloadSummary:
    from hetplan import zoo
    from hetplan.ir.capture import capture

    args, kwargs = zoo.example_inputs(name, batch=1, seq=128)
    return WorkloadSummary.from_model_ir(capture(zoo.build(name), args, kwargs, name=name))


def main() -> None:
    irs = espresso_workloads(DATA)
    wls = {k: WorkloadSummary.from_model_ir(irs[k])
           for k in ("vgg16", "resnet101", "ugatit", "bert", "gpt2", "lstm", "resnet50")}
    solver = {k: solver_times(k, wls[k]) for k in ("resnet50", "resnet101", "bert")}
    for k in ("gpt2", "bert-base"):
        wls[f"zoo:{k}"] = zoo_workload(k)
    rows = {}
    for wname, wl in wls.items():
        if wname == "resnet50":
            continue  # not one of the six selectable workloads; used for timing only
        for cname, preset in CLUSTERS.items():
            for sname in ("fp32", "dgc"):
                rows[f"{wname}|{cname}|{sname}"] = quality(wl, preset, sname)
    result = {
        "machine": {"python": platform.python_version(), "cpu": platform.processor()
                    or platform.machine(), "note": "2 cores shared with other jobs: timings "
                    "are the least of 5 runs (Algorithm 5.1: 1) and still noisy"},
        "dp": DP, "alg51_call_budget": ALG51_BUDGET,
        "solver": solver, "quality": rows,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print("solver time (DGC, 64 V100 PCIe):")
    for k, v in solver.items():
        a = v["alg51"]
        print(f"  {k:10s} N={v['tensors']:3d} tables {v['tables_s'] * 1e3:6.1f} ms  "
              f"pareto {v['pareto_dp_s'] * 1e3:7.1f} ms  "
              f"affine {v['dp_affine_s'] * 1e3:7.1f} ms  pass {v['pass_s'] * 1e3:7.1f} ms  "
              f"alg5.1 {a['time_s'] if a['time_s'] is None else round(a['time_s'], 3)} s "
              f"({a['calls']} calls)  thesis/pareto x{v['ratio_thesis_over_pareto']:.0f}")
    print(f"{'workload|cluster|sync':36s} {'layer':>9s} {'one':>9s} {'ddp25':>9s} "
          f"{'cupcake':>9s} {'vsDDP':>6s} buckets")
    for k, r in rows.items():
        print(f"{k:36s} {r['layer_wise_ms']:9.2f} {r['one_bucket_ms']:9.2f} "
              f"{r['ddp_25MiB_ms']:9.2f} {r['cupcake_ms']:9.2f} {r['speedup_vs_ddp']:6.3f} "
              f"{int(r['cupcake_buckets'])}{'' if r['exact'] else ' (surrogate)'}")


if __name__ == "__main__":
    main()
