"""How long `hetplan.compile`'s full search takes on big problems, with capture timed apart.

Cases and targets (issue 18, "Search in seconds"), each the free search (nothing pinned):

- llama-70b on ``h100-1024``, global batch 1024: planning ≤ 3 s;
- the 1T-parameter GPT of Narayanan et al. 2021 (Table 1, row 10: 128 layers, hidden 25,600)
  on 3072 A100-80GB of ``bench/data/clusters/selene-dgx-a100-80gb.yaml``, global batch 3072:
  planning ≤ 15 s (the model is built on the meta device as ``bench/published.py`` builds
  it);
- ``make demo`` (gpt2 on ``mixed-generations``, batch 256): planning ≤ 1 s;
- and, without a target, llama-70b on ``a100-1024`` and gpt2 on ``v100-pcie-8x8``.

Each case runs in a fresh process: the import, then the capture (``capture_seconds``), then
``compile`` on the captured IR (``plan_seconds``, the wall time the targets bound, and
``plan_cpu_seconds``, the process's CPU time over the same span: on a shared machine the wall
time also counts the other jobs' turns, so the 1-minute load average when each case started is
recorded beside it as ``load_avg_1min``). Each row also holds a hash of the plan's JSON
(``plan_sha256``). Writes ``bench/results/plan_time.json`` with the machine record; ``--out``
another path.

``--baseline-src DIR``: before and after in one run. Each case is planned first with the
``hetplan`` package under ``DIR`` (e.g. ``src`` of an older commit, exported with ``git
archive COMMIT src | tar -x -C /tmp/base``), then with this checkout's, one fresh process
each, back to back; the row gets ``baseline`` (the same timings of the older code) and
``same_plan_as_baseline`` (the plan JSON byte-identical) and ``same_plan_but_pruned_count``
(byte-identical once the search note's "N pruned by lower bounds" is dropped: a tighter
bound prunes more layouts and changes only that count).

    python bench/plan_time.py [--quick] [--only NAME ...] [--baseline-src DIR] [--out PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _machine import machine

ROOT = Path(__file__).resolve().parents[1]
#: (name, model: a zoo name or "published:<run id>", cluster: a preset or "published",
#: global batch, target seconds or None)
CASES = [
    ("llama-70b@h100-1024", "llama-70b", "h100-1024", 1024, 3.0),
    ("gpt-1t@a100x3072", "published:narayanan2021-gpt-1t", "published", 3072, 15.0),
    ("demo", "gpt2", "mixed-generations", 256, 1.0),
    ("llama-70b@a100-1024", "llama-70b", "a100-1024", 1024, None),
    ("gpt2@v100-pcie-8x8", "gpt2", "v100-pcie-8x8", 512, None),
]
CHILD = """
import hashlib, json, re, sys, time
sys.path.insert(0, sys.argv[4])
t0 = time.perf_counter()
import hetplan
from hetplan.optimizer.compile import _workload
model, cluster, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
t1 = time.perf_counter()
if model.startswith("published:"):
    import published
    from published_data import load_runs
    run = next(r for r in load_runs().runs if r.id == model.split(":", 1)[1])
    ir, _ = published.capture_model(run)
    cluster = published.cluster_for(run)
else:
    ir = _workload(model, None, None, None)
t2 = time.perf_counter()
c2 = time.process_time()
plan = hetplan.compile(ir, cluster, batch_size=batch, progress=False)
t3 = time.perf_counter()
c3 = time.process_time()
s = plan.summary()
print(json.dumps({"import_seconds": t1 - t0, "capture_seconds": t2 - t1,
                  "plan_seconds": t3 - t2, "plan_cpu_seconds": c3 - c2, "layout": s.layout,
                  "iteration_ms": s.iteration_time_ms, "notes": plan.pass_log[0].notes,
                  "plan_sha256": hashlib.sha256(plan.to_json().encode()).hexdigest()[:16],
                  "plan_sha256_but_pruned_count": hashlib.sha256(re.sub(
                      r"\d+ pruned by lower bounds, ", "", plan.to_json()).encode()
                      ).hexdigest()[:16],
                  "world_size": plan.layout.num_ranks if plan.layout else 1}))
"""


def _run_case(model: str, cluster: str, batch: int, src: Path) -> dict | None:
    """One case in a fresh process importing ``hetplan`` from ``src``: the child's numbers
    plus ``process_seconds`` and ``load_avg_1min``; None (stderr printed) if it failed."""
    env = dict(os.environ, PYTHONPATH=str(src))
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, model, cluster, str(batch), str(ROOT / "bench")],
        capture_output=True, text=True, check=False, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode:
        print(proc.stderr[-2000:], file=sys.stderr)
        return None
    res: dict = json.loads(proc.stdout.strip().splitlines()[-1])
    res.update(process_seconds=wall, load_avg_1min=load)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="only the cases with a target")
    ap.add_argument("--only", nargs="*", help="only these case names")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "plan_time.json")
    ap.add_argument("--baseline-src", type=Path,
                    help="a directory holding an older hetplan package: each case is also "
                         "planned with it, just before, for a before/after in one run")
    args = ap.parse_args()
    cases = [c for c in CASES if (not args.quick or c[4] is not None)
             and (not args.only or c[0] in args.only)]
    rows = []
    for name, model, cluster, batch, target in cases:
        base = None
        if args.baseline_src is not None:
            base = _run_case(model, cluster, batch, args.baseline_src.resolve())
            if base is None:
                return 1
        res = _run_case(model, cluster, batch, ROOT / "src")
        if res is None:
            return 1
        res.update(case=name, model=model, cluster=cluster, batch_size=batch,
                   target_s=target,
                   meets_target=None if target is None else res["plan_seconds"] <= target)
        if base is not None:
            res["baseline"] = {k: base[k] for k in (
                "plan_seconds", "plan_cpu_seconds", "load_avg_1min", "capture_seconds",
                "layout", "iteration_ms", "plan_sha256", "notes")}
            res["baseline"]["src"] = str(args.baseline_src)
            res["same_plan_as_baseline"] = base["plan_sha256"] == res["plan_sha256"]
            res["same_plan_but_pruned_count"] = (base.get("plan_sha256_but_pruned_count")
                                                 == res["plan_sha256_but_pruned_count"])
            print(f"{name:22s} before {base['plan_seconds']:6.2f} s "
                  f"(cpu {base['plan_cpu_seconds']:6.2f} s, load {base['load_avg_1min']:4.1f})"
                  f" same plan: {res['same_plan_as_baseline']} (but the search note's "
                  f"pruned count: {res['same_plan_but_pruned_count']})")
        rows.append(res)
        load = res["load_avg_1min"]
        mark = "" if target is None else (" ok" if res["meets_target"] else
                                          f" OVER {target:g} s")
        print(f"{name:22s} plan {res['plan_seconds']:6.2f} s "
              f"(cpu {res['plan_cpu_seconds']:6.2f} s, load {load:4.1f}){mark:10s} capture "
              f"{res['capture_seconds']:5.1f} s  {res['layout']:18s} "
              f"{res['iteration_ms']:.1f} ms  ({res['notes'][0]})")
    out = {
        "machine": machine(),
        "rows": rows,
        "meets_targets": all(r["meets_target"] for r in rows if r["target_s"] is not None),
    }
    args.out.write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
