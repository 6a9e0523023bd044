"""Bench: the Espresso pass's selection time, one commit vs an earlier one, side by side.

Runs the ``espresso`` pass (the setup of ``bench/espresso.py``: effective gaps, dp = 64,
``--max-compressions 1`` unless told, the compressor and fp16 allowed, GPU and CPU) in a fresh process per
case and per source tree, alternating the two trees so that both see the same load on a
shared machine (both trees are ``git archive``s, so uncommitted work in the checkout does
not enter); keeps the least of ``--repeat`` runs of each for the whole pass's wall time and
for its GPU selection (Algorithm 4.1 with the uniform seeds, both hierarchies: what
``bench/espresso.py`` sets beside Table 4.5), and a digest of the chosen gradient-sync
section, which must be identical (same choices, only faster). Each process loads (or
compiles) the numba kernels before the timed pass.

Run: ``python bench/espresso_vs_previous.py [--commit REV] [--now REV] [--cases m/c/comp,...]
[--max-compressions N]`` (default 1; 4 is the pass's default, the whole tree)
→
``bench/results/espresso_vs_previous.json``.

``--by-model`` instead runs every case of a model (both clusters, the three compressors)
in one process per tree, ``--repeat`` times each in that process, the two trees
alternating per model for ``--rounds`` rounds; per case it keeps the least wall time and
the least CPU time (``time.process_time``) of the GPU selection over all runs, beside the
thesis' Table 4.5 (CPU time is the comparison on a shared machine: wall time also holds
what other processes took). The pass runs with its defaults (``--max-compressions`` left
out) unless told. Each process loads the numba kernels from its tree's on-disk cache (its
own ``NUMBA_CACHE_DIR``; compiled on the tree's first process) before any timed pass, so
compile and load time are in no number. Writes ``bench/results/espresso_vs_previous_by_model.json``
unless ``--out`` says otherwise. ``--now-options JSON`` gives the pass further options on
the ``now`` tree alone (e.g. ``'{"parallel": true}'``). ``--keep DIR`` extracts the trees and their caches into
``DIR`` and reuses them: a first run there compiles the kernels, so that a timed run in a
short quiet period does not (the trees must be the same commits).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(__file__).parent / "results" / "espresso_vs_previous.json"
#: The comparison of record: one simulator in algorithms/ (issue 17; docs/decisions.md, "One
#: data-parallel simulator") at its last code commit against the head before it. Earlier
#: rounds: 05c170c (the release bound) against 0421d5c.
NOW = "6b57a95"
PREVIOUS = "41a21ba"
CASES = ("lstm/nvlink/dgc,vgg16/nvlink/dgc,gpt2/nvlink/dgc,ugatit/nvlink/dgc,bert/pcie/randomk,"
         "resnet101/nvlink/dgc")

_CHILD = """
import hashlib, json, sys, time
sys.path.insert(0, {bench!r})
import espresso as be
from hetplan.ir.plan_sections import WorkloadSummary
from hetplan.ir.workload import espresso_workloads
from hetplan.passes.espresso import Espresso
try:  # the simulator's place in the tree under test
    from hetplan.algorithms.dp_session import warm_up
except ImportError:  # trees before it moved to algorithms/ (issue 17)
    from hetplan.cost_models.timeline import warm_up
warm_up()  # load (or compile) the kernels outside the timed pass
model, cl, comp = sys.argv[1:4]  # then max_compressions
wls = espresso_workloads(be.DATA, gaps="effective", include_extra=False)
wl = WorkloadSummary.from_model_ir(wls[model])
ctx, plan = be._setup(wl, be.CLUSTERS[cl])
with be._Recorder() as rec:  # keeps every Selection the pass makes
    t = time.perf_counter()
    # the compressors as the pass's option: every tree under comparison takes it there
    out = Espresso(compressors=(comp, "fp16"), devices=("gpu", "cpu"),
                   max_compressions=int(sys.argv[4])).run(plan, ctx)
    s = time.perf_counter() - t
sync = out.plan.gradient_sync.model_dump_json().encode()
print(json.dumps({{"s": s, "gpu_s": sum(x.gpu_s for x in rec.selections),
                  "digest": hashlib.sha256(sync).hexdigest()[:16]}}))
"""

_CHILD_MODEL = """
import hashlib, json, sys, time
sys.path.insert(0, {bench!r})
import espresso as be
from hetplan.ir.plan_sections import WorkloadSummary
from hetplan.ir.workload import espresso_workloads
from hetplan.passes.espresso import Espresso
from hetplan.algorithms.dp_session import warm_up
warm_up()  # load (or compile) the kernels outside the timed passes
model, repeat, max_comp = sys.argv[1], int(sys.argv[2]), sys.argv[3]
kw = {{}} if max_comp == "default" else {{"max_compressions": int(max_comp)}}
kw.update(json.loads(sys.argv[4]) if len(sys.argv) > 4 else {{}})  # this tree's options
wl = WorkloadSummary.from_model_ir(
    espresso_workloads(be.DATA, gaps="effective", include_extra=False)[model])
out = {{}}
for cl in be.CLUSTERS:
    for comp in be.COMPRESSORS:
        row = {{"gpu_s": float("inf"), "gpu_process_s": float("inf"), "s": float("inf")}}
        for _ in range(repeat):
            ctx, plan = be._setup(wl, be.CLUSTERS[cl])
            with be._Recorder() as rec:
                t = time.perf_counter()
                res = Espresso(compressors=(comp, "fp16"), **kw).run(plan, ctx)
                s = time.perf_counter() - t
            row["s"] = min(row["s"], s)
            row["gpu_s"] = min(row["gpu_s"], sum(x.gpu_s for x in rec.selections))
            row["gpu_process_s"] = min(row["gpu_process_s"],
                                       sum(x.gpu_process_s for x in rec.selections))
            sync = res.plan.gradient_sync.model_dump_json().encode()
            row["digest"] = hashlib.sha256(sync).hexdigest()[:16]
        out[f"{{model}}/{{cl}}/{{comp}}"] = row
print(json.dumps(out))
"""


def _run(src: Path, case: str, max_comp: int) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(src), NUMBA_CACHE_DIR=str(src.parent / "numba"))
    code = _CHILD.format(bench=str(ROOT / "bench"))
    r = subprocess.run([sys.executable, "-c", code, *case.split("/"), str(max_comp)], env=env,
                       capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def _run_model(src: Path, model: str, repeat: int, max_comp: str,
               options: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(src), NUMBA_CACHE_DIR=str(src.parent / "numba"))
    code = _CHILD_MODEL.format(bench=str(ROOT / "bench"))
    r = subprocess.run([sys.executable, "-c", code, model, str(repeat), max_comp,
                        json.dumps(options)], env=env, capture_output=True, text=True,
                       check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def by_model(trees: dict[str, Path], models: list[str], repeat: int, rounds: int,
             max_comp: str, now_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Per case: each tree's least wall and CPU time of the GPU selection and its digest;
    ``now_options`` are further options of the pass on the ``now`` tree."""
    import espresso as be  # bench/espresso.py: Table 4.5

    rows: dict[str, Any] = {}
    for model in models:
        for _ in range(rounds):
            for tag, src in trees.items():
                extra = (now_options or {}) if tag == "now" else {}
                for case, got in _run_model(src, model, repeat, max_comp, extra).items():
                    row = rows.setdefault(case, {})
                    for key in ("s", "gpu_s", "gpu_process_s"):
                        row[f"{tag}_{key}"] = min(row.get(f"{tag}_{key}", float("inf")),
                                                  got[key])
                    row[f"{tag}_digest"] = got["digest"]
        table = be.TABLE_4_5_MS[model]
        for case in [c for c in rows if c.startswith(model + "/")]:
            row = rows[case]
            row["same_choice"] = row["previous_digest"] == row["now_digest"]
            row["gpu_process_speedup"] = row["previous_gpu_process_s"] / row["now_gpu_process_s"]
            for tag in trees:
                row[f"{tag}_process_vs_table_4_5"] = round(
                    row[f"{tag}_gpu_process_s"] * 1e3 / table, 3)
            print(f"{case:26s} GPU selection CPU time: previous "
                  f"{row['previous_gpu_process_s'] * 1e3:7.1f} ms  now "
                  f"{row['now_gpu_process_s'] * 1e3:7.1f} ms  x{row['gpu_process_speedup']:.2f}"
                  f" | wall: previous {row['previous_gpu_s'] * 1e3:7.1f} ms  now "
                  f"{row['now_gpu_s'] * 1e3:7.1f} ms | Table 4.5 {table} ms: "
                  f"{row['now_process_vs_table_4_5']:.2f}x | same choice: "
                  f"{row['same_choice']}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--commit", default=PREVIOUS)
    ap.add_argument("--now", default=NOW)
    ap.add_argument("--cases", default=CASES)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--max-compressions", type=int, default=None,
                    help="the pass's max_compressions (default: 1 per case, the pass's own "
                         "default with --by-model; 4 is the whole tree)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--by-model", default=None,
                    help="models (comma-separated): every case of each in one process per tree")
    ap.add_argument("--rounds", type=int, default=2, help="with --by-model: alternations")
    ap.add_argument("--now-options", type=json.loads, default=None,
                    help='with --by-model: further options of the pass on the --now tree, as '
                         'JSON (e.g. \'{"parallel": true}\')')
    ap.add_argument("--keep", type=Path, default=None,
                    help="extract the trees (and their numba caches) here instead of a "
                         "temporary folder, so that a run before the timed one compiles the "
                         "kernels (git archive keeps the files' times, so the caches stay valid)")
    args = ap.parse_args()
    rows: dict[str, Any] = {}
    load0 = round(os.getloadavg()[0], 2)
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = str(args.keep) if args.keep is not None else tmp_dir
        trees = {}
        for tag, rev in (("previous", args.commit), ("now", args.now)):
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "src"],
                                     capture_output=True, check=True).stdout
            if (Path(tmp) / tag / "src").exists():  # a kept tree: replaced, its cache kept
                shutil.rmtree(Path(tmp) / tag / "src")
            (Path(tmp) / tag).mkdir(parents=True, exist_ok=True)
            subprocess.run(["tar", "-x", "-C", str(Path(tmp) / tag)], input=archive, check=True)
            trees[tag] = Path(tmp) / tag / "src"
        now_rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.now],
                                 capture_output=True, text=True, check=True).stdout.strip()
        if args.by_model:
            max_comp = "default" if args.max_compressions is None else str(args.max_compressions)
            load = [round(x, 2) for x in os.getloadavg()]
            got = by_model(trees, args.by_model.split(","), args.repeat, args.rounds, max_comp,
                           args.now_options)
            out = args.out or OUT.with_name("espresso_vs_previous_by_model.json")
            out.write_text(json.dumps({
                "what": "CPU and wall time of the espresso pass's GPU selection (every sweep "
                        "and seed), --now vs --commit, every case of bench/espresso.py, the "
                        "pass's defaults unless max_compressions says otherwise",
                "commit": args.commit, "now": now_rev, "repeat": args.repeat,
                "rounds": args.rounds, "max_compressions": max_comp,
                "now_options": args.now_options or {},
                "numba": "kernels loaded from each tree's on-disk cache before the timed "
                         "passes (compiled on the tree's first process): not in the times",
                "machine": {"note": "2 CPU cores shared with other jobs; the two trees "
                                    "alternate per model",
                            "load_average_start": load,
                            "load_average_end": [round(x, 2) for x in os.getloadavg()]},
                "cases": got}, indent=1, sort_keys=True) + "\n")
            return
        if args.max_compressions is None:
            args.max_compressions = 1
        for case in args.cases.split(","):
            row: dict[str, Any] = {}
            for _ in range(args.repeat):
                for tag, src in trees.items():
                    got = _run(src, case, args.max_compressions)
                    for key in ("s", "gpu_s"):
                        row[f"{tag}_{key}"] = min(row.get(f"{tag}_{key}", float("inf")),
                                                  got[key])
                    row[f"{tag}_digest"] = got["digest"]
            row["speedup"] = row["previous_s"] / row["now_s"]
            row["gpu_selection_speedup"] = row["previous_gpu_s"] / row["now_gpu_s"]
            row["same_choice"] = row["previous_digest"] == row["now_digest"]
            rows[case] = row
            print(f"{case:22s} pass: previous {row['previous_s']:7.3f} s  now {row['now_s']:7.3f}"
                  f" s  x{row['speedup']:.2f} | GPU selection: previous "
                  f"{row['previous_gpu_s'] * 1e3:7.1f} ms  now {row['now_gpu_s'] * 1e3:7.1f} ms  "
                  f"x{row['gpu_selection_speedup']:.2f} | same choice: {row['same_choice']}",
                  flush=True)
    result = {
        "what": "espresso pass wall time (whole pass, kernels loaded before it) and its GPU "
                "selection time, --now vs --commit, same setup as bench/espresso.py with "
                f"--max-compressions {args.max_compressions}",
        "max_compressions": args.max_compressions,
        "commit": args.commit, "now": now_rev, "repeat": args.repeat,
        "machine": {"note": "2 CPU cores shared with other jobs: absolute times depend on "
                            "their load; the two trees alternate, so the ratio is the "
                            "comparable number",
                    "load_average_1min_start_end": [load0, round(os.getloadavg()[0], 2)]},
        "cases": rows,
    }
    out = args.out or OUT
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
