"""Check: the Espresso pass's choices in all 36 bench cases, dumped for a diff between trees.

Runs the ``espresso`` pass with its defaults in the setup of ``bench/espresso.py`` (six
workloads x two clusters x three compressors) once per case and writes, per case, the
chosen option of every tensor (the strategy name the plan gives it) and a SHA-256 of the
whole gradient-sync section's JSON. Run it on two source trees (``PYTHONPATH=<tree>/src``)
and compare the outputs with ``--diff A B``: a speed-up that claims to change no choice must
give identical files.

Run: ``python bench/espresso_choices.py [--models a,b] --out FILE`` or
``python bench/espresso_choices.py --diff OLD.json NEW.json`` (exit status 1 on a difference).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import espresso as be  # noqa: E402  (bench/espresso.py: the cases' setup)


def dump(models: list[str], compressors: list[str]) -> dict[str, Any]:
    """Per case: the chosen strategy name of every tensor and the gradient-sync digest."""
    from hetplan.ir.plan_sections import WorkloadSummary
    from hetplan.ir.workload import espresso_workloads
    from hetplan.passes.espresso import Espresso

    wls = espresso_workloads(be.DATA, gaps="effective", include_extra=False)
    out: dict[str, Any] = {}
    for model in models:
        wl = WorkloadSummary.from_model_ir(wls[model])
        for cname, preset in be.CLUSTERS.items():
            for comp in compressors:
                ctx, plan = be._setup(wl, preset)
                got = Espresso(compressors=(comp, "fp16")).run(plan, ctx).plan.gradient_sync
                assert got is not None
                sync = got.model_dump_json().encode()
                out[f"{model}/{cname}/{comp}"] = {
                    "digest": hashlib.sha256(sync).hexdigest(),
                    "options": [t.strategy for t in got.tensors],
                }
                print(model, cname, comp, out[f"{model}/{cname}/{comp}"]["digest"][:16],
                      flush=True)
    return out


def diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The cases whose choices differ (or that one side lacks)."""
    return [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(be.TABLE_4_5_MS))
    ap.add_argument("--compressors", default=",".join(be.COMPRESSORS))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--diff", nargs=2, type=Path)
    args = ap.parse_args()
    if args.diff:
        a, b = (json.loads(p.read_text()) for p in args.diff)
        bad = diff(a, b)
        print(f"{len(set(a) | set(b))} cases, {len(bad)} differ" + (f": {bad}" if bad else ""))
        sys.exit(1 if bad else 0)
    if args.out is None:
        ap.error("--out FILE (or --diff A B)")
    res = dump(args.models.split(","), args.compressors.split(","))
    args.out.write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
