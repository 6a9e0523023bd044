"""Measure this GPU's kernels: GEMM throughput by shape and dtype, attention, memory-bound ops.

The compute cost model prices matmuls by an efficiency curve per device type and memory-bound
operations by the bytes they move. This bench measures both on the GPU it runs on, so the
curves can be checked against (or profiled from) a real device:

- GEMM: the four matmuls of a transformer block (QKV, attention output, MLP up, MLP down) at
  several hidden sizes and token counts, forward shapes and the two backward shapes, in bf16,
  fp16 and fp32 with TF32; plus square GEMMs from 256 to 16384 (there also plain fp32).
- Attention: ``scaled_dot_product_attention`` (causal), forward and forward + backward.
- Memory-bound: layer norm, softmax, GELU, dropout and an add, as achieved GB/s counting the
  bytes read and written once.

Each timing is the median of ``--iters`` runs measured with CUDA events after ``--warmup``
runs. Writes ``bench/results/gpu_kernels_<device>.json`` (or ``--out``)::

    python bench/gpu_kernels.py [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _time_ms(fn: Callable[[], Any], warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _gemm(m: int, n: int, k: int, dtype: torch.dtype, warmup: int, iters: int) -> dict[str, Any]:
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn(k, n, device="cuda", dtype=dtype)
    ms = _time_ms(lambda: a @ b, warmup, iters)
    flops = 2.0 * m * n * k
    return {"m": m, "n": n, "k": k, "ms": ms, "tflops": flops / ms / 1e9}


def gemms(quick: bool, warmup: int, iters: int) -> list[dict[str, Any]]:
    """Transformer-block GEMMs (forward and both backward shapes) and square GEMMs."""
    hiddens = [1024, 4096, 8192] if quick else [1024, 2048, 4096, 8192, 12288]
    tokens = [2048, 8192] if quick else [2048, 8192, 16384]
    squares = [512, 2048, 8192] if quick else [256, 512, 1024, 2048, 4096, 8192, 16384]
    out: list[dict[str, Any]] = []
    for name, dtype in DTYPES.items():
        variants = [(name, False)] + ([(name + "-tf32", True)] if dtype == torch.float32 else [])
        for label, tf32 in variants:
            torch.backends.cuda.matmul.allow_tf32 = tf32
            # plain fp32 (no TF32) is slow and nobody trains in it: squares only
            for h in hiddens if label != "fp32" else []:
                for t in tokens:
                    for op, n_out, k_in in (("qkv", 3 * h, h), ("proj", h, h),
                                            ("fc1", 4 * h, h), ("fc2", h, 4 * h)):
                        # forward (t x k) @ (k x n); grad-input (t x n) @ (n x k);
                        # grad-weight (k x t) @ (t x n)
                        for phase, (m, n, k) in (("fwd", (t, n_out, k_in)),
                                                 ("bwd_input", (t, k_in, n_out)),
                                                 ("bwd_weight", (k_in, n_out, t))):
                            r = _gemm(m, n, k, dtype, warmup, iters)
                            r.update(dtype=label, kind="block", op=op, phase=phase,
                                     hidden=h, tokens=t)
                            out.append(r)
            for s in squares:
                r = _gemm(s, s, s, dtype, warmup, iters)
                r.update(dtype=label, kind="square")
                out.append(r)
            torch.cuda.empty_cache()
    torch.backends.cuda.matmul.allow_tf32 = False
    return out


def attention(quick: bool, warmup: int, iters: int) -> list[dict[str, Any]]:
    """Causal SDPA: forward and forward+backward, achieved TFLOP/s (causal flops halved)."""
    out: list[dict[str, Any]] = []
    seqs = [1024, 4096] if quick else [512, 1024, 2048, 4096, 8192]
    for dtype_name in ("bf16", "fp16"):
        dtype = DTYPES[dtype_name]
        for head_dim, heads in ((64, 16), (128, 32)):
            for s in seqs:
                batch = max(1, 16384 // s)
                q, k, v = (torch.randn(batch, heads, s, head_dim, device="cuda", dtype=dtype,
                                       requires_grad=True) for _ in range(3))
                fwd = _time_ms(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
                    q, k, v, is_causal=True), warmup, iters)

                def fwd_bwd(q=q, k=k, v=v) -> None:  # type: ignore[no-untyped-def]
                    F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

                both = _time_ms(fwd_bwd, warmup, iters)
                flops_fwd = 4.0 * batch * heads * s * s * head_dim / 2  # causal: half
                out.append({"dtype": dtype_name, "batch": batch, "heads": heads,
                            "head_dim": head_dim, "seq": s, "fwd_ms": fwd,
                            "fwd_bwd_ms": both, "fwd_tflops": flops_fwd / fwd / 1e9,
                            "fwd_bwd_tflops": 3.5 * flops_fwd / both / 1e9})
                del q, k, v
    torch.cuda.empty_cache()
    return out


def memory_bound(quick: bool, warmup: int, iters: int) -> list[dict[str, Any]]:
    """Achieved bandwidth of memory-bound ops, counting bytes read and written once."""
    out: list[dict[str, Any]] = []
    sizes = [(8192, 4096)] if quick else [(2048, 1024), (8192, 4096), (16384, 8192)]
    for dtype_name in ("bf16", "fp32"):
        dtype = DTYPES[dtype_name]
        elt = torch.tensor([], dtype=dtype).element_size()
        for rows, cols in sizes:
            x = torch.randn(rows, cols, device="cuda", dtype=dtype)
            y = torch.randn(rows, cols, device="cuda", dtype=dtype)
            ln = torch.nn.LayerNorm(cols, device="cuda", dtype=dtype)
            nbytes = rows * cols * elt
            ops: dict[str, tuple[Callable[[], Any], int]] = {
                "layernorm": (lambda: ln(x), 2),
                "softmax": (lambda: torch.softmax(x, dim=-1), 2),
                "gelu": (lambda: F.gelu(x), 2),
                "dropout": (lambda: F.dropout(x, 0.1, training=True), 2),
                "add": (lambda: x + y, 3),
            }
            for op, (fn, passes) in ops.items():
                with torch.no_grad():
                    ms = _time_ms(fn, warmup, iters)
                out.append({"op": op, "dtype": dtype_name, "rows": rows, "cols": cols,
                            "ms": ms, "bytes": nbytes * passes,
                            "gb_s": nbytes * passes / ms / 1e6})
            del x, y
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_kernels: needs a CUDA device")
    props = torch.cuda.get_device_properties(0)
    device = props.name
    result = {
        "device": device,
        "multiprocessors": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "method": f"median of {args.iters} CUDA-event timings after {args.warmup} warm-ups",
        "gemm": gemms(args.quick, args.warmup, args.iters),
        "attention": attention(args.quick, args.warmup, args.iters),
        "memory_bound": memory_bound(args.quick, args.warmup, args.iters),
    }
    slug = "".join(c if c.isalnum() else "_" for c in device).strip("_").lower()
    out = args.out or ROOT / "bench" / "results" / f"gpu_kernels_{slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    best = max(r["tflops"] for r in result["gemm"] if r["dtype"] == "bf16")
    print(f"{device}: best bf16 GEMM {best:.0f} TFLOP/s; wrote {out}")


if __name__ == "__main__":
    main()
