"""Does `hetplan run` execute what `hetplan plan` emits? A sampled sweep of planning flags.

Every case runs ``hetplan plan`` in this process (typer's runner, the model captured once and
passed as ``--workload``), loads the plan it wrote and lists
:func:`hetplan.runtime.composition.refusals` (which includes the heterogeneous pipeline's).
Each refusal line is matched to the two (or more) strategy choices it pairs, and each choice
to the flag that forces it: a refusal is ``forced`` when the user's flags pinned every half
of it, else ``planner`` (the layout search or a pass chose at least one half), which is a
planner bug.

Cases: for each (model, cluster) pair, every non-default value of one flag alone (the
planner picks the rest); the pairs of flags whose halves the runtime refuses together (both
pinned, or one pinned and the planner free to pick the other); then a seeded random sample of
2 to 4 flags together. Models are small zoo language models; clusters include the mixed-GPU
presets.

Writes ``bench/results/planner_runtime_agreement.json`` and prints a summary.

    python bench/planner_runtime_agreement.py [--random N] [--seed S] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from _machine import machine  # noqa: E402

MODELS = ("gpt-test", "tiny-gpt2", "megatron-gpt-test", "tied-lm")
#: cluster -> global batch size
CLUSTERS = {"local-cpu": 8, "cpu-2x2": 8, "mixed-tp-node": 32, "mixed-generations": 64,
            "one-slow-node": 64}
DYNAMICS = "examples/pruning.yaml"  # relative to the repository root, the working directory
#: flag -> its non-default values ("" for a bare flag such as ``--sp``)
FLAGS: dict[str, tuple[str, ...]] = {
    "--zero": ("0", "1", "2", "3"),
    "--pp": ("1",),  # pure data (and tensor) parallelism: every DP group spans the nodes
    "--dtype": ("fp32", "bf16", "fp16"),
    "--recompute": ("none", "selective", "full"),
    "--schedule": ("gpipe", "interleaved-1f1b", "auto", "chimera"),
    "--tp": ("1", "2"),
    "--compress": ("topk", "dgc,fp16", "powersgd"),
    "--dynamics": (DYNAMICS,),
    "--tp-controller": ("semi", "zero", "migration"),
    "--hetero": ("auto", "on"),
    "--group-sync": ("auto", "sdpipe"),
    "--sparse": ("auto", "zen"),
    "--checkpoint": ("gemini",),
}
#: pairs whose halves are refused together when both are present; each is planned on every
#: cluster for :data:`PAIR_MODELS` (the one-flag cases leave the other half to the planner)
PAIRS: tuple[dict[str, str], ...] = (
    {"--zero": "2", "--pp": "1"}, {"--zero": "3", "--pp": "1"},
    {"--zero": "1", "--dynamics": DYNAMICS}, {"--zero": "0", "--dynamics": DYNAMICS},
    {"--tp": "2", "--tp-controller": "semi"}, {"--tp": "2", "--tp-controller": "zero",
                                              "--zero": "1"},
    {"--sparse": "zen", "--zero": "2", "--pp": "1"},
    {"--sparse": "auto", "--zero": "2", "--pp": "1"},
    {"--compress": "dgc,fp16", "--zero": "2", "--pp": "1"},
    {"--group-sync": "auto", "--tp": "2"}, {"--group-sync": "sdpipe", "--schedule": "auto"},
    {"--hetero": "on", "--schedule": "interleaved-1f1b"}, {"--hetero": "on", "--sp": ""},
    {"--hetero": "auto", "--tp": "2"},
    # Chimera runs on its own executor, with dp, 16-bit compute, ZeRO-1 and flat paths
    {"--schedule": "chimera", "--compress": "dgc,fp16"}, {"--schedule": "chimera", "--zero": "1"},
    {"--schedule": "chimera", "--dtype": "bf16", "--recompute": "full"},
)
PAIR_MODELS = ("gpt-test", "tiny-gpt2")

#: refusal prefix -> the choices it pairs, each ``(flag, forcing values)``: the choice is the
#: user's when the flag has one of those values (``None``: any value given)
HALVES: list[tuple[str, list[tuple[str, tuple[str, ...] | None]]]] = [
    ("rebalancing: moving layers under ZeRO", [("--zero", ("1", "2", "3")),
                                               ("--dynamics", None)]),
    ("tensor_parallel.controller: the TP resizing controller (", []),  # split below
    ("sparse_sync: sparse gradient schemes under ZeRO", [("--zero", ("2", "3")),
                                                         ("--sparse", None)]),
    ("layout.sequence_parallel: sequence parallelism in a pipeline of per-stage",
     [("--sp", None), ("--hetero", ("on",))]),
    ("layout.schedule:", [("--schedule", ("interleaved-1f1b", "chimera")),
                          ("--hetero", ("on",))]),
    ("group_sync: SDPipe group sync with per-stage degrees", [("--group-sync", ("sdpipe",)),
                                                              ("--hetero", ("on",))]),
    ("group_sync.optimizer_state", [("--group-sync", ("sdpipe",))]),
]


def halves(line: str) -> list[tuple[str, tuple[str, ...] | None]]:
    """The user choices a refusal line pairs (an empty list: a choice no flag can force)."""
    if line.startswith("tensor_parallel.controller:"):
        if "under ZeRO" in line:
            return [("--tp-controller", None), ("--zero", ("1", "2", "3"))]
        return [("--tp-controller", None), ("--dynamics", None), ("--hetero", ("on",))]
    if line.startswith("layout.schedule: 'chimera' with"):  # what its executor does not run
        return [("--schedule", ("chimera",)), ("chimera composition", ())]  # planner's half
    if line.startswith("gradient_sync.strategies["):
        if "compressed (" in line:
            return [("--zero", ("2", "3")), ("--compress", None)]
        return [("--zero", ("2", "3")), ("hierarchical routing", ())]  # no flag forces it
    if line.startswith("group_sync: SDPipe group sync with ") and "per-stage" not in line:
        gs = ("--group-sync", ("sdpipe",))
        for what, half in (("tensor parallelism", ("--tp", ("2", "4", "8"))),
                           ("interleaved stages", ("--schedule", ("interleaved-1f1b",))),
                           ("pipeline re-balancing", ("--dynamics", None)),
                           ("TP resizing controller", ("--tp-controller", None)),
                           ("sparse gradient sync", ("--sparse", None)),
                           ("ZeRO", ("--zero", ("1", "2", "3")))):
            if what in line:
                return [gs, half]
    for prefix, hs in HALVES:
        if line.startswith(prefix) and hs:
            return hs
    return [("unclassified", ())]


def forced(line: str, flags: dict[str, str]) -> bool:
    """Whether the user's flags pinned every choice the refusal pairs."""
    for flag, values in halves(line):
        if flag not in flags:
            return False
        if values is not None and flags[flag] not in values:
            return False
    return True


def cases(seed: int, n_random: int) -> list[dict[str, Any]]:
    """One-flag cases for every (model, cluster), the :data:`PAIRS`, then ``n_random``
    seeded combinations."""
    out = []
    for model in MODELS:
        for cluster in CLUSTERS:
            out.append({"model": model, "cluster": cluster, "flags": {}})
            for flag, values in FLAGS.items():
                out += [{"model": model, "cluster": cluster, "flags": {flag: v}}
                        for v in values]
    out += [{"model": model, "cluster": cluster, "flags": dict(pair)}
            for model in PAIR_MODELS for cluster in CLUSTERS for pair in PAIRS]
    rng = random.Random(seed)
    names = sorted(FLAGS)
    for _ in range(n_random):
        chosen = rng.sample(names, rng.randint(2, 4))
        out.append({"model": rng.choice(MODELS), "cluster": rng.choice(sorted(CLUSTERS)),
                    "flags": {f: rng.choice(FLAGS[f]) for f in sorted(chosen)}})
    return out


def run_case(runner: Any, app: Any, case: dict[str, Any], workload: Path, tmp: Path
             ) -> dict[str, Any]:
    """Plan one case through the CLI; its outcome and every refusal with its attribution."""
    from hetplan.ir.plan import load_plan
    from hetplan.runtime.composition import refusals

    out_path = tmp / "plan.json"
    out_path.unlink(missing_ok=True)
    args = ["plan", "--workload", str(workload), "-c", case["cluster"],
            "-b", str(CLUSTERS[case["cluster"]]), "--no-progress", "-o", str(out_path)]
    for flag, value in case["flags"].items():
        args += [flag, value] if value else [flag]
    t0 = time.perf_counter()
    res = runner.invoke(app, args)
    row: dict[str, Any] = {**case, "seconds": round(time.perf_counter() - t0, 2)}
    if res.exit_code != 0 or not out_path.exists():
        tail = (res.output or "").strip().splitlines()[-3:]
        exc = res.exception
        internal = exc is not None and not isinstance(exc, SystemExit)
        row.update(outcome="internal-error" if internal else "refused-by-planner",
                   message=" ".join(tail)[-400:] or repr(exc))
        return row
    plan = load_plan(out_path)
    lines = refusals(plan)
    lay = plan.layout
    assert lay is not None
    row.update(
        outcome="runtime-refuses" if lines else "runs",
        layout={"dp": lay.dp, "pp": lay.pp, "tp": lay.tp, "zero": lay.zero_stage,
                "schedule": lay.schedule, "virtual_stages": lay.virtual_stages,
                "sp": lay.sequence_parallel, "hetero": plan.hetero is not None},
        refusals=[{"line": ln, "pairs": [h[0] for h in halves(ln)],
                   "by": "forced" if forced(ln, case["flags"]) else "planner",
                   "names_flag": bool(re.search(r"--[a-z]", ln))}
                  for ln in lines],
        warned=sum("`hetplan run` refuses this plan" in ln
                   for ln in (res.output or "").splitlines()))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--random", type=int, default=100, help="random combinations to add")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", type=int, default=None, help="run only the first N cases")
    ap.add_argument("--note", default="", help="said in the results' machine entry")
    ap.add_argument("--out", type=Path,
                    default=ROOT / "bench" / "results" / "planner_runtime_agreement.json")
    a = ap.parse_args()
    os.environ.setdefault("COLUMNS", "200")
    os.chdir(ROOT)
    from typer.testing import CliRunner

    from hetplan.cli import app
    from hetplan.optimizer.compile import model_ir

    all_cases = cases(a.seed, a.random)[: a.limit]
    rows = []
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        workloads = {}
        for m in MODELS:
            workloads[m] = tmp / f"{m}.json"
            model_ir(m).save(workloads[m])
        runner = CliRunner()
        for i, case in enumerate(all_cases):
            row = run_case(runner, app, case, workloads[case["model"]], tmp)
            rows.append(row)
            bad = [r for r in row.get("refusals", []) if r["by"] == "planner"]
            if bad or row["outcome"] == "internal-error":
                print(f"[{i}] {case['model']} {case['cluster']} {case['flags']}: "
                      f"{row['outcome']} {[r['line'][:90] for r in bad]}"
                      f"{row.get('message', '')[:200]}", flush=True)
    summary: dict[str, Any] = {"cases": len(rows), "seconds": round(
        time.perf_counter() - t_start, 1)}
    for key in ("runs", "runtime-refuses", "refused-by-planner", "internal-error"):
        summary[key] = sum(r["outcome"] == key for r in rows)
    summary["planner_chosen_refusals"] = sum(
        any(x["by"] == "planner" for x in r.get("refusals", [])) for r in rows)
    summary["forced_refusals"] = sum(
        bool(r.get("refusals")) and all(x["by"] == "forced" for x in r["refusals"])
        for r in rows)
    summary["refusals_naming_no_flag"] = sum(
        not x["names_flag"] for r in rows for x in r.get("refusals", []))
    kinds: dict[str, int] = {}
    for r in rows:
        for x in r.get("refusals", []):
            key = f"{x['by']}: {' + '.join(x['pairs'])}"
            kinds[key] = kinds.get(key, 0) + 1
    summary["refusal_kinds"] = dict(sorted(kinds.items()))
    note = " ".join(x for x in ("2 shared cores", a.note) if x)
    result = {"machine": machine(note=note), "models": list(MODELS), "clusters": CLUSTERS,
              "flags": FLAGS, "pairs": PAIRS, "pair_models": PAIR_MODELS, "seed": a.seed,
              "summary": summary, "cases": rows}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
