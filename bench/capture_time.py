"""Benchmark: wall time and peak memory of ``hetplan.capture`` on zoo models.

Each model is captured in a fresh Python process (so peak RSS is that model's alone): the
child builds the model on ``meta`` with ``hetplan.zoo.build``, makes example inputs
(batch 1, seq 2048 for language models; the zoo's defaults otherwise), and times
``hetplan.capture``. It reports the capture's wall time, the process's peak RSS
(``ru_maxrss``: import + build + capture) and the size of the IR.

Usage::

    python bench/capture_time.py                       # gpt2, llama-7b, llama-70b
    python bench/capture_time.py --models gpt2 llama-70b
    python bench/capture_time.py --out /tmp/capture.json

Writes ``bench/results/capture_time.json`` and prints a table. Target: llama-70b captured in
< 30 s with < 2 GiB peak RSS.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _machine import machine

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "capture_time.json"
DEFAULT_MODELS = ("gpt2", "llama-7b", "llama-70b")
LM_BATCH, LM_SEQ = 1, 2048
#: Targets per model: capture seconds and whole-process peak RSS in MiB.
TARGETS: dict[str, dict[str, float]] = {
    "llama-70b": {"max_seconds": 30.0, "max_peak_rss_mib": 2048.0},
}


def _peak_rss_mib() -> float:
    """Peak resident set size of this process in MiB (``ru_maxrss`` is KiB on Linux)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**20 if sys.platform == "darwin" else 2**10)


def child(name: str) -> dict[str, Any]:
    """Run in the fresh process: build, capture, and measure one model."""
    t0 = time.perf_counter()
    from hetplan import zoo
    from hetplan.ir.capture import capture  # what `hetplan.capture` resolves to

    t_import = time.perf_counter() - t0
    entry = zoo.get(name)
    t1 = time.perf_counter()
    model = zoo.build(entry.name)
    batch: int
    seq: int | None
    if entry.input_kind in ("tokens", "seq2seq"):
        batch, seq = LM_BATCH, LM_SEQ
        args, kwargs = zoo.example_inputs(entry.name, batch=batch, seq=seq)
    else:
        batch, seq = entry.default_batch, entry.default_seq
        args, kwargs = zoo.example_inputs(entry.name)
    t_build = time.perf_counter() - t1
    t2 = time.perf_counter()
    ir = capture(model, args, kwargs, name=entry.name)
    seconds = time.perf_counter() - t2
    return {
        "model": entry.name,
        "batch": batch,
        "seq": seq,
        "method": ir.method,
        "seconds": round(seconds, 3),
        "import_seconds": round(t_import, 3),
        "build_seconds": round(t_build, 3),
        "peak_rss_mib": round(_peak_rss_mib(), 1),
        "layers": len(ir.layers),
        "grad_tensors": len(ir.grad_tensors),
        "num_params": ir.num_params,
    }


def run_one(name: str, timeout: float) -> dict[str, Any]:
    """Capture ``name`` in a fresh interpreter; the result, or the error it hit."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--child", name],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"model": name, "error": f"timed out after {timeout:g} s"}
    wall = round(time.perf_counter() - t0, 3)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"model": name, "error": f"exit {proc.returncode}: {tail}", "process_seconds": wall}
    result: dict[str, Any] = json.loads(lines[-1])
    result["process_seconds"] = wall
    target = TARGETS.get(result["model"])
    if target is not None:
        result["target"] = target
        result["pass_seconds"] = result["seconds"] < target["max_seconds"]
        result["pass_peak_rss"] = result["peak_rss_mib"] < target["max_peak_rss_mib"]
    return result


def print_table(results: list[dict[str, Any]]) -> None:
    """A small fixed-width table of the results."""
    header = f"{'model':<12} {'capture s':>9} {'process s':>9} {'peak RSS MiB':>12} " \
             f"{'layers':>6} {'params':>16}  target"
    print(header)
    print("-" * len(header))
    for r in results:
        if "error" in r:
            print(f"{r['model']:<12} ERROR {r['error']}")
            continue
        if "target" in r:
            ok = r["pass_seconds"] and r["pass_peak_rss"]
            t = r["target"]
            verdict = (f"{'PASS' if ok else 'FAIL'} (< {t['max_seconds']:g} s, "
                       f"< {t['max_peak_rss_mib'] / 1024:g} GiB)")
        else:
            verdict = "-"
        print(
            f"{r['model']:<12} {r['seconds']:>9.2f} {r['process_seconds']:>9.2f} "
            f"{r['peak_rss_mib']:>12.0f} {r['layers']:>6} {r['num_params']:>16,}  {verdict}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS),
                        help="zoo names (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="result JSON path")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per model")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child)))
        return 0

    results = []
    for name in args.models:
        print(f"capturing {name} …", file=sys.stderr, flush=True)
        results.append(run_one(name, args.timeout))
    report = {
        "benchmark": "capture_time",
        "settings": {"lm_batch": LM_BATCH, "lm_seq": LM_SEQ, "device": "meta"},
        "machine": machine(),
        "targets": TARGETS,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    print_table(results)
    print(f"\nwrote {args.out}")
    failed = [r for r in results if "error" in r or r.get("pass_seconds") is False
              or r.get("pass_peak_rss") is False]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
