"""What the CPU presets' loopback link is on this machine: a gloo all-reduce sweep.

Spawns ``--world`` gloo processes (one torch thread each, as ``hetplan run`` on CPU does),
times all-reduce and ping-pong over 4 KiB … 64 MiB (``hetplan.profiling.collectives``: median
call, slowest rank), fits ``t = α + β·bytes`` to each, and converts the all-reduce line into
the link that the analytic model (``cost_models.comm``) turns back into the same line: a ring
all-reduce on ``n`` ranks costs ``2(n−1)`` latency steps and ``2(n−1)/n`` bytes per byte of
bandwidth, so

    latency_us     = α / (2(n−1))
    bandwidth_gbps = 8 · (2(n−1)/n) / β / 1e9

The presets ``local-cpu`` (4 gloo processes) and ``cpu-2x2`` (2 emulated nodes × 2) describe
4 processes on this machine; their link is the 4-rank numbers. Writes
``bench/results/cpu_link.json``.

    python bench/cpu_link.py [--world 4]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from _machine import machine

ROOT = Path(__file__).resolve().parents[1]


def link_of(alpha_s: float, beta_s_per_byte: float, n: int) -> dict[str, float]:
    """The loopback link whose analytic ``n``-rank all-reduce is ``alpha_s + beta·bytes``."""
    from hetplan.algorithms.collectives import bus_factor, latency_steps

    return {"latency_us": alpha_s / latency_steps("allreduce", n) * 1e6,
            "bandwidth_gbps": 8 * bus_factor("allreduce", n) / beta_s_per_byte / 1e9}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cpu_link.json")
    args = ap.parse_args()
    from hetplan.profiling.collectives import profile_collectives

    load = os.getloadavg()
    prof = profile_collectives(args.world, collectives=("allreduce", "p2p"), group_sizes=())
    records = {r.collective: r for r in prof.records}
    ar = records["allreduce"]
    assert ar.alpha_s is not None and ar.beta_s_per_byte is not None
    link = link_of(ar.alpha_s, ar.beta_s_per_byte, args.world)
    fits = {name: {"alpha_us": round((r.alpha_s or 0) * 1e6, 1),
                   "beta_ns_per_byte": round((r.beta_s_per_byte or 0) * 1e9, 4),
                   "group_size": r.group_size,
                   "samples_ms": [[s.nbytes, round(s.seconds * 1e3, 4)] for s in r.samples]}
            for name, r in records.items()}
    result = {"machine": machine(device="cpu", backend="gloo"),
              "load_average_before_and_after": [load, os.getloadavg()],
              "world_size": args.world, "link": {k: round(v, 2) for k, v in link.items()},
              "fits": fits}
    print(f"{args.world} gloo ranks: all-reduce α {fits['allreduce']['alpha_us']} us, "
          f"β {fits['allreduce']['beta_ns_per_byte']} ns/B -> link "
          f"{result['link']['bandwidth_gbps']} Gbit/s, {result['link']['latency_us']} us/step")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
