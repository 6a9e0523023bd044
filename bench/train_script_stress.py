"""``examples/train.py`` through ``hetplan run --script``, many runs in a row: every run must
exit 0, every rank must train to the end, no rank may abort at exit ("terminate called
without an active exception"), and no process of the run may be left behind.

One plan is compiled (``--module examples.train:factory``, ``--dp RANKS``), then the script
runs ``--runs`` times on ``RANKS`` gloo ranks. Each run's processes carry a marker in their
environment; after the run the process table (``/proc``) is searched for it. With
``--direct`` the same number of runs go through ``torchrun examples/train.py`` as well (the
form without the launcher, which relies on the script's own teardown alone).

    python bench/train_script_stress.py [--runs 20] [--ranks 4] [--steps 6] [--direct]

Writes ``bench/results/train_script_stress.json``; the exit code is 1 unless every run
passed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from _machine import machine

ROOT = Path(__file__).resolve().parents[1]
MARK = "HETPLAN_STRESS_RUN"


def _left_behind(mark: str) -> list[int]:
    """Live processes whose environment carries ``MARK=mark``."""
    needle = f"{MARK}={mark}".encode()
    left = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in env and state != "Z":
            left.append(int(entry))
    return left


def _one_run(cmd: list[str], ranks: int, steps: int) -> dict[str, Any]:
    mark = uuid.uuid4().hex
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=dict(os.environ, **{MARK: mark}), check=False)
    seconds = time.perf_counter() - t0
    output = proc.stdout + proc.stderr
    last = (steps - 1) // 5 * 5  # the script prints every 5th step
    # ranks write unbuffered (torchrun runs python -u): two ranks' lines may share one line
    finished = len(set(re.findall(rf"rank (\d+) step {last}: loss", output)))
    left = _left_behind(mark)
    for pid in left:  # never leave them running, whatever the result
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    run = {
        "exit_code": proc.returncode,
        "seconds": round(seconds, 2),
        "ranks_finished": finished,
        "aborted": "terminate called" in output,
        "left_behind": len(left),
    }
    run["passed"] = (proc.returncode == 0 and finished == ranks and not run["aborted"]
                     and not left)
    if not run["passed"]:
        run["output_tail"] = output[-2000:]
    return run


def _series(name: str, cmd: list[str], runs: int, ranks: int, steps: int) -> dict[str, Any]:
    results = []
    for i in range(runs):
        run = _one_run(cmd, ranks, steps)
        results.append(run)
        print(f"{name} run {i + 1:2d}/{runs}: exit {run['exit_code']}, {run['seconds']:6.2f} s, "
              f"{run['ranks_finished']}/{ranks} ranks finished, aborted={run['aborted']}, "
              f"left behind={run['left_behind']}", flush=True)
    passed = sum(r["passed"] for r in results)
    return {"command": " ".join(cmd), "passed": passed, "runs": runs,
            "aborted_runs": sum(r["aborted"] for r in results), "results": results}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--direct", action="store_true",
                    help="also run torchrun examples/train.py directly")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" /
                    "train_script_stress.json")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hetplan-stress-"))
    plan = work / "plan.json"
    subprocess.run([sys.executable, "-m", "hetplan.cli", "plan", "--module",
                    "examples.train:factory", "--cluster", "local-cpu", "-b",
                    str(2 * args.ranks), "--dp", str(args.ranks), "-o", str(plan)],
                   check=True, capture_output=True, cwd=ROOT)
    script = str(ROOT / "examples" / "train.py")
    series = {"hetplan_run_script": _series(
        "hetplan run --script",
        [sys.executable, "-m", "hetplan.cli", "run", str(plan), "--script", script,
         "--steps", str(args.steps)], args.runs, args.ranks, args.steps)}
    if args.direct:
        series["torchrun_direct"] = _series(
            "torchrun train.py",
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
             "--nproc-per-node", str(args.ranks), script, "--plan", str(plan), "--steps",
             str(args.steps)], args.runs, args.ranks, args.steps)
    result = {
        "benchmark": "train_script_stress",
        "machine": machine(backend="gloo", ranks=args.ranks,
                           note="2 cores shared with other jobs while it ran"),
        "steps": args.steps,
        "series": series,
        "pass": all(s["passed"] == s["runs"] for s in series.values()),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    for name, s in series.items():
        print(f"{name}: {s['passed']}/{s['runs']} passed, {s['aborted_runs']} aborted")
    print(f"wrote {args.out}")
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
