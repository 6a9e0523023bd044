"""How long `hetplan.compile` takes on big problems: llama-70b on the 1024-GPU presets
(target < 60 s, stretch < 10 s), gpt2 on the testbeds. Each case runs in a fresh process
(imports and capture included, as a user sees it). Writes ``bench/results/plan_time.json``.

    python bench/plan_time.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from _machine import machine

ROOT = Path(__file__).resolve().parents[1]
CASES = [
    ("llama-70b", "h100-1024", 1024),
    ("llama-70b", "a100-1024", 1024),
    ("gpt2", "v100-pcie-8x8", 512),
    ("gpt2", "mixed-generations", 256),
]
CHILD = """
import json, sys, time
t0 = time.perf_counter()
import hetplan
plan = hetplan.compile(sys.argv[1], sys.argv[2], batch_size=int(sys.argv[3]))
s = plan.summary()
print(json.dumps({"seconds": time.perf_counter() - t0, "layout": s.layout,
                  "iteration_ms": s.iteration_time_ms, "notes": plan.pass_log[0].notes}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="only the first case")
    args = ap.parse_args()
    rows = []
    for model, cluster, batch in CASES[:1] if args.quick else CASES:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", CHILD, model, cluster, str(batch)],
                              capture_output=True, text=True, check=False)
        wall = time.perf_counter() - t0
        if proc.returncode:
            print(proc.stderr[-2000:], file=sys.stderr)
            return 1
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        res.update(model=model, cluster=cluster, batch_size=batch, process_seconds=wall)
        rows.append(res)
        print(f"{model:10s} {cluster:18s} {res['seconds']:6.1f} s  {res['layout']:18s} "
              f"{res['iteration_ms']:.1f} ms  ({res['notes'][0]})")
    big = [r for r in rows if r["model"] == "llama-70b"]
    out = {
        "machine": machine(),
        "target_s": 60, "stretch_s": 10,
        "rows": rows,
        "meets_target": all(r["seconds"] < 60 for r in big),
        "meets_stretch": all(r["seconds"] < 10 for r in big),
    }
    path = ROOT / "bench" / "results" / "plan_time.json"
    path.write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
