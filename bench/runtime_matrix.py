"""Compositions the planner emits, executed by the runtime against one process (gloo, CPU).

A pairwise sample of small zoo language models (``tied-lm``, ``gpt-test``, ``tiny-gpt2``,
``megatron-gpt-test``) over the dp x pp x tp layouts of 4 ranks (and some of 2), the pipeline
schedule (``1f1b``, ``gpipe``, ``interleaved-1f1b`` with 2 virtual stages; Chimera in a cover
of its own, :data:`CHIMERA_FACTORS`), the precision
policy (``fp32``, ``bf16``, ``fp16``), the ZeRO stage, activation recomputation, sequence
parallelism (TP > 1), micro-batches per replica and the model's parameter dtype (float64 as
the tests' references, or float32): every pair of two factors' values that some valid case has
appears in at least one case. Each case is compiled with its choices pinned, then trained for
``STEPS`` SGD steps on a fixed next-token batch; the cases of one world size run one after
another in one process group (``reflib``'s rank function pattern), each rank writing its
result per case, so a case that raises or hangs only costs the cases after it a new spawn.

Outcomes per case:

- ``ok``: fp32 compute: losses and every parameter within ``rtol 1e-9, atol 1e-11`` of the
  float64 reference (``rtol 1e-5`` / ``rtol 1e-4, atol 1e-5`` for a float32 model); bf16 /
  fp16: finite, losses within ``2e-2`` relative, parameters within ``atol 1e-2``;
- ``refused``: ``compile`` raised a hetplan error (its message is recorded);
  ``compile-error``: it raised anything else (an internal error);
- ``error``: a rank raised (traceback tail); ``hang``: the spawn ran past its timeout inside
  this case;
- ``nan``: a non-finite loss or parameter; ``replicas-differ``: two ranks hold different
  values under one parameter name (data-parallel replicas, TP ranks or tied copies);
- ``loss-off`` / ``params-off``: finite but off the reference.

Writes ``bench/results/runtime_matrix_cpu.json`` and prints a table.

    python bench/runtime_matrix.py [--limit N] [--only LABEL ...] [--out PATH]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import pickle
import random
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "dist"))

from _machine import machine  # noqa: E402
from reflib import cpu_cluster, lm_data, lm_loss, sgd  # noqa: E402

STEPS = 2
BATCH = 8
MODELS = ("tied-lm", "gpt-test", "tiny-gpt2", "megatron-gpt-test")
#: (world, dp, pp, tp)
LAYOUTS = ((4, 4, 1, 1), (4, 2, 2, 1), (4, 2, 1, 2), (4, 1, 2, 2), (4, 1, 4, 1), (4, 1, 1, 4),
           (2, 2, 1, 1), (2, 1, 2, 1), (2, 1, 1, 2))
NA = "-"
FACTORS: dict[str, tuple[Any, ...]] = {
    "model": MODELS,
    "layout": LAYOUTS,
    "schedule": ("1f1b", "gpipe", "interleaved-1f1b", NA),
    "dtype": ("fp32", "bf16", "fp16"),
    "zero": (0, 1, 2, 3),
    "recompute": ("none", "selective", "full"),
    "sp": (False, True, NA),
    "mb": ("few", "many"),
    "param_dtype": ("float64", "float32"),
}
EXACT_TOL = {"float64": {"rtol": 1e-9, "atol": 1e-11}, "float32": {"rtol": 1e-4, "atol": 1e-5}}
LOSS_RTOL = {"float64": 1e-9, "float32": 1e-5}
HALF_LOSS_RTOL = 2e-2
HALF_PARAM_ATOL = 1e-2


# -- the sample -------------------------------------------------------------------------------
def _valid(row: dict[str, Any]) -> bool:
    _, dp, pp, tp = row["layout"]
    if (row["schedule"] == NA) != (pp == 1):
        return False
    if (row["sp"] == NA) != (tp == 1):
        return False
    return not (dp == 1 and row["zero"] != 0)


def _pairs(row: dict[str, Any]) -> set[tuple]:
    items = [(k, v) for k, v in row.items() if v != NA]
    return {(a, b) for a, b in itertools.combinations(items, 2)}


#: Chimera's own cover (its executor composes with dp, precision, ZeRO-0/1, recomputation;
#: ``runtime/handlers/chimera.py``): the pipeline layouts of one TP rank, appended to the
#: sample so that the cases of :data:`FACTORS` keep their labels
CHIMERA_FACTORS: dict[str, tuple[Any, ...]] = {
    **FACTORS, "layout": ((4, 2, 2, 1), (4, 1, 4, 1), (2, 1, 2, 1)),
    "schedule": ("chimera",), "zero": (0, 1), "sp": (NA,)}


def pairwise_cases(seed: int = 0, factors: dict[str, tuple[Any, ...]] = FACTORS,
                   ) -> list[dict[str, Any]]:
    """A greedy pairwise cover of ``factors`` over the valid rows (``NA`` values and
    data-parallel-free ZeRO excluded)."""
    keys = list(factors)
    rows = [dict(zip(keys, vals, strict=True)) for vals in itertools.product(*factors.values())]
    rows = [r for r in rows if _valid(r)]
    random.Random(seed).shuffle(rows)
    pair_sets = [_pairs(r) for r in rows]
    uncovered = set().union(*pair_sets)
    chosen = []
    while uncovered:
        best = max(range(len(rows)), key=lambda i: len(pair_sets[i] & uncovered))
        chosen.append(rows[best])
        uncovered -= pair_sets[best]
    return chosen


def label_of(row: dict[str, Any]) -> str:
    w, dp, pp, tp = row["layout"]
    parts = [row["model"], f"w{w}:dp{dp}pp{pp}tp{tp}"]
    if pp > 1:
        parts.append("il" if row["schedule"] == "interleaved-1f1b" else row["schedule"])
    parts += [row["dtype"], f"z{row['zero']}", f"rc-{row['recompute']}"]
    if tp > 1 and row["sp"]:
        parts.append("sp")
    parts += [f"mb-{row['mb']}", "f64" if row["param_dtype"] == "float64" else "f32"]
    return "/".join(parts)


def pins_of(row: dict[str, Any]) -> dict[str, Any]:
    """The ``compile`` keywords of a case."""
    _, dp, pp, tp = row["layout"]
    rows = BATCH // dp
    micro_batches = (pp if pp > 1 else 1) * (2 if row["mb"] == "many" else 1)
    pins: dict[str, Any] = {"dp": dp, "pp": pp, "tp": tp, "dtype": row["dtype"],
                            "zero_stage": row["zero"], "recompute": row["recompute"],
                            "micro_batch_size": rows // micro_batches}
    if pp > 1:
        pins["schedule"] = row["schedule"]
        if row["schedule"] == "interleaved-1f1b":
            pins["virtual_stages"] = 2
    if tp > 1:
        pins["sequence_parallel"] = row["sp"]
    return pins


# -- models and references --------------------------------------------------------------------
def build(name: str, param_dtype: str) -> torch.nn.Module:
    from hetplan import zoo

    return zoo.build(name, device="cpu", seed=0, dtype=getattr(torch, param_dtype)).eval()


def example(name: str) -> tuple[tuple, dict]:
    from reflib import zoo_example

    return zoo_example(name)


def seq_of(name: str) -> int:
    return int(example(name)[0][0].shape[-1])


@functools.cache
def reference(name: str, param_dtype: str, skipped: tuple[bool, ...] = (False,) * STEPS,
              ) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process, ``STEPS`` SGD steps (no update in the ``skipped`` ones, as fp16's loss
    scale skips a step whose gradient overflowed): losses, final and initial parameters
    (float64)."""
    model = build(name, param_dtype)
    init = {n: p.detach().double().clone()
            for n, p in model.named_parameters(remove_duplicate=False)}
    _, kwargs = example(name)
    opt = sgd(list(model.parameters()))
    losses = []
    for step in range(STEPS):
        ids, y = lm_data(step, BATCH, seq_of(name))
        loss = lm_loss(model(ids, **kwargs), y)
        loss.backward()
        losses.append(float(loss.detach()))
        if not skipped[step]:
            opt.step()
        opt.zero_grad()
    return losses, {n: p.detach().double().clone()
                    for n, p in model.named_parameters(remove_duplicate=False)}, init


@functools.cache
def aliases(name: str) -> dict[str, frozenset[str]]:
    """Each parameter name -> every name of the same (tied) tensor."""
    model = build(name, "float32")
    by_id: dict[int, set[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), set()).add(n)
    return {n: frozenset(ns) for ns in by_id.values() for n in ns}


# -- the ranks --------------------------------------------------------------------------------
def _train(rank: int, name: str, param_dtype: str, plan_json: str) -> dict[str, Any]:
    from hetplan.ir.plan import Plan
    from hetplan.runtime.executor import Runtime
    from hetplan.runtime.handlers import ZeroHandler
    from hetplan.runtime.handlers.precision import PrecisionHandler

    args, kwargs = example(name)
    t0 = time.perf_counter()
    rt = Runtime(Plan.from_json(plan_json), build(name, param_dtype), example_args=args,
                 example_kwargs=kwargs, loss_fn=lm_loss, optimizer=sgd,
                 timeout=timedelta(seconds=90))
    seq = seq_of(name)
    scaler = rt.handler(PrecisionHandler).scaler
    losses, skipped = [], []
    for step in range(STEPS):
        before = scaler.skipped if scaler is not None else 0
        losses.append(rt.train_step(*lm_data(step, BATCH, seq)))
        skipped.append(scaler is not None and scaler.skipped > before)
    params = rt.handler(ZeroHandler).full_parameters(rt.ctx)
    mine = {id(p) for _, p in rt.named_params}
    for mname, module in rt.model.named_modules():
        if not any(id(p) in mine for p in module.parameters(recurse=False)):
            continue
        if hasattr(module, "gather_weight"):  # a tensor-parallel shard (ZeRO-3's too)
            params[f"{mname}.weight"] = module.gather_weight()
            if getattr(module, "bias", None) is not None:
                params[f"{mname}.bias"] = module.gather_bias()
    out = {"coords": rt.layout.coords(rank), "losses": losses, "skipped": skipped,
           "params": {n: v.detach().double().clone() for n, v in params.items()},
           "seconds": time.perf_counter() - t0}
    rt.close()
    return out


def run_cases(rank: int, world: int, cases: dict[str, tuple[str, str, str]],
              outdir: str) -> None:
    """Trains each case ``label -> (model, param dtype, plan JSON)`` in turn and writes this
    rank's result (or traceback) of each to ``outdir``; stops at the first that raises."""
    for i, (label, case) in enumerate(cases.items()):
        try:
            res: dict[str, Any] = _train(rank, *case)
        except Exception:
            res = {"error": traceback.format_exc()}
        Path(outdir, f"{i}.{rank}.pkl").write_bytes(pickle.dumps(res))
        if "error" in res:
            break


# -- the checks -------------------------------------------------------------------------------
def judge(row: dict[str, Any], plan_layout: Any, got: list[dict[str, Any]]) -> dict[str, Any]:
    """The outcome of one case from every rank's result."""
    name, pdt = row["model"], row["param_dtype"]
    skipped = tuple(got[0]["skipped"])
    ref_losses, ref, init = reference(name, pdt, skipped)
    half = row["dtype"] != "fp32"
    pp = row["layout"][2]
    out: dict[str, Any] = {}
    # losses: the last stage's ranks report their replica's mean; replicas hold equal rows
    by_dp: dict[int, list[list[float]]] = {}
    for g in got:
        dp, stage, _ = g["coords"]
        if stage == pp - 1:
            by_dp.setdefault(dp, []).append(g["losses"])
    flags = []
    if any(g["skipped"] != got[0]["skipped"] for g in got):
        flags.append(f"ranks skip different steps: {[g['skipped'] for g in got]}")
    if any(skipped):
        flags.append(f"fp16 overflow skipped steps {[i for i, s in enumerate(skipped) if s]} "
                     "(the reference skips them too)")
    spread = max((abs(a - b) for ls in by_dp.values() for l1 in ls for a, b in
                  zip(l1, ls[0], strict=True)), default=0.0)
    if math.isnan(spread) or spread > 0:
        flags.append(f"last-stage ranks of one replica report different losses ({spread})")
    losses = [sum(ls[0][s] for ls in by_dp.values()) / len(by_dp) for s in range(STEPS)]
    out["losses"] = losses
    out["ref_losses"] = ref_losses
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
    out["max_loss_rel_err"] = loss_err
    # parameters: every name on some rank; the same value on every rank holding it
    finite = all(math.isfinite(x) for x in losses)
    seen: dict[str, torch.Tensor] = {}
    replica_diff = 0.0
    param_err = 0.0
    update = 0.0
    tol = EXACT_TOL[pdt]
    param_off = []
    for g in got:
        for n, v in g["params"].items():
            if not torch.isfinite(v).all():
                finite = False
            if n in seen and seen[n].shape == v.shape:
                replica_diff = max(replica_diff, float((seen[n] - v).abs().max()))
            seen.setdefault(n, v)
            if n not in ref:
                continue
            if v.shape != ref[n].shape:
                param_off.append(f"{n}: shape {tuple(v.shape)} != {tuple(ref[n].shape)}")
                continue
            err = float((v - ref[n]).abs().max())
            param_err = max(param_err, err)
            update = max(update, float((ref[n] - init[n]).abs().max()))
            bad = (err > HALF_PARAM_ATOL if half else
                   not torch.allclose(v, ref[n], **tol))
            if bad and len(param_off) < 5:
                param_off.append(f"{n}: max err {err:.3g}")
    tied = aliases(name)
    missing = sorted(n for n in set(ref) - set(seen) if not tied[n] & set(seen))
    out.update(max_param_abs_err=param_err, max_update=update, replica_max_diff=replica_diff,
               missing_params=missing[:10])
    loss_tol = HALF_LOSS_RTOL if half else LOSS_RTOL[pdt]
    if not finite:
        outcome = "nan"
    elif replica_diff > 0 or len({tuple(g["skipped"]) for g in got}) > 1:
        outcome = "replicas-differ"
    elif loss_err > loss_tol:
        outcome = "loss-off"
    elif param_off or missing:
        outcome = "params-off"
    else:
        outcome = "ok"
    if param_off:
        flags.append("params off: " + "; ".join(param_off))
    if missing:
        flags.append(f"no rank reports {missing[:5]}")
    out["outcome"] = outcome
    out["notes"] = flags
    out["seconds"] = max(g.get("seconds", 0.0) for g in got)
    return out


# -- the driver -------------------------------------------------------------------------------
def compile_case(row: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """(plan JSON, {}) or (None, the refusal)."""
    import hetplan
    from hetplan.errors import HetplanError

    name = row["model"]
    args, kwargs = example(name)
    try:
        ir = hetplan.capture(build(name, row["param_dtype"]), args, kwargs, name=name)
        plan = hetplan.compile(ir, cpu_cluster(row["layout"][0]), batch_size=BATCH,
                               **pins_of(row))
    except HetplanError as e:
        return None, {"outcome": "refused", "error_type": type(e).__name__, "message": str(e)}
    except Exception as e:  # an internal error: recorded with its traceback
        return None, {"outcome": "compile-error", "error_type": type(e).__name__,
                      "message": str(e), "traceback": traceback.format_exc()[-3000:]}
    lay = plan.layout
    got = {"dp": lay.dp, "pp": lay.pp, "tp": lay.tp, "schedule": lay.schedule,
           "virtual_stages": lay.virtual_stages, "micro_batches": lay.micro_batches,
           "micro_batch_size": lay.micro_batch_size, "zero_stage": lay.zero_stage,
           "sequence_parallel": lay.sequence_parallel,
           "recompute": sorted({st.recompute for st in plan.stages})}
    return plan.to_json(), {"plan_layout": got}


def run_world(world: int, todo: list[tuple[str, dict[str, Any], str]],
              results: dict[str, dict[str, Any]], per_case_s: float) -> None:
    """Runs ``(label, row, plan JSON)`` cases on ``world`` ranks, spawning again after a case
    that fails or hangs, and fills ``results``."""
    from hetplan.profiling._spawn import run_local_ranks

    while todo:
        cases = {label: (row["model"], row["param_dtype"], pj) for label, row, pj in todo}
        print(f"spawn: {world} ranks, {len(cases)} case(s)", flush=True)
        t0 = time.perf_counter()
        crash = None
        with tempfile.TemporaryDirectory(prefix="runtime-matrix-") as outdir:
            try:
                run_local_ranks(run_cases, world, (cases, outdir),
                                timeout_s=60 + per_case_s * len(cases), threads_per_process=1)
            except TimeoutError as e:
                crash = ("hang", str(e))
            except Exception as e:
                crash = ("error", f"{type(e).__name__}: {e}"[-3000:])
            done = 0
            for i, (label, row, _) in enumerate(todo):
                files = [Path(outdir, f"{i}.{r}.pkl") for r in range(world)]
                got = [pickle.loads(f.read_bytes()) for f in files if f.exists()]
                errs = [g["error"] for g in got if "error" in g]
                entry = results[label]
                if len(got) == world and not errs:
                    entry.update(judge(row, entry.get("plan_layout"), got))
                    done = i + 1
                    continue
                if errs:
                    # the first rank's own error, not a peer's broken connection, where possible
                    own = [e for e in errs if "Connection closed by peer" not in e
                           and "PeerFailure" not in e] or errs
                    entry.update(outcome="error", message=own[0].strip().splitlines()[-1],
                                 traceback=own[0][-4000:], ranks_failed=len(errs))
                elif crash is not None:
                    entry.update(outcome=crash[0], message=crash[1])
                else:
                    entry.update(outcome="error", message="a rank wrote no result")
                done = i + 1
                break
            else:
                done = len(todo)
        print(f"  {done} case(s) in {time.perf_counter() - t0:.0f} s", flush=True)
        for label, _, _ in todo[:done]:
            print(f"  {results[label]['outcome']:>15}  {label}", flush=True)
        todo = todo[done:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=None, help="the first N cases of the sample")
    ap.add_argument("--only", nargs="*", default=None, help="labels to run")
    ap.add_argument("--per-case-s", type=float, default=120.0,
                    help="spawn timeout per case (plus 60 s)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/runtime_matrix_cpu.json")
    ap.add_argument("--merge", action="store_true",
                    help="with --only: replace those cases in --out (marked rerun)")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    rows = pairwise_cases() + pairwise_cases(factors=CHIMERA_FACTORS)
    sample_size = len(rows)
    if args.only:
        rows = [r for r in rows if label_of(r) in args.only]
    rows = rows[:args.limit]
    results: dict[str, dict[str, Any]] = {}
    by_world: dict[int, list[tuple[str, dict[str, Any], str]]] = {}
    for row in rows:
        label = label_of(row)
        pj, info = compile_case(row)
        results[label] = {"pins": {**{k: v for k, v in row.items() if k != "layout"},
                                   "world": row["layout"][0], **pins_of(row)}, **info}
        if pj is not None:
            by_world.setdefault(row["layout"][0], []).append((label, row, pj))
        else:
            print(f"  {info['outcome']:>15}  {label}: {info['message'][:200]}", flush=True)
    for world in sorted(by_world):
        run_world(world, by_world[world], results, args.per_case_s)
    counts: dict[str, int] = {}
    for r in results.values():
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    doc = {"benchmark": "runtime_matrix",
           "machine": machine(note="shared machine: 2 cores for up to 4 gloo ranks",
                              backend="gloo"),
           "setup": {"steps": STEPS, "batch": BATCH, "optimizer": "SGD lr 0.05",
                     "factors": {k: [list(v) if isinstance(v, tuple) else v for v in vals]
                                 for k, vals in FACTORS.items()},
                     "sampling": f"greedy pairwise cover: {sample_size} cases",
                     "tolerances": {"exact": EXACT_TOL, "loss_rtol": LOSS_RTOL,
                                    "half_loss_rtol": HALF_LOSS_RTOL,
                                    "half_param_atol": HALF_PARAM_ATOL}},
           "wall_seconds": round(time.perf_counter() - t_start, 1),
           "counts": counts, "cases": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.merge and args.only:
        old = json.loads(args.out.read_text())
        old["cases"].update({k: {**v, "rerun_at": doc["machine"]["commit"]}
                             for k, v in results.items()})
        old["counts"] = {}
        for r in old["cases"].values():
            old["counts"][r["outcome"]] = old["counts"].get(r["outcome"], 0) + 1
        doc = old
    elif args.only or args.limit:
        args.out = args.out.with_name(args.out.stem + "_partial.json")
    args.out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(f"\n{'outcome':>15}  {'loss err':>9} {'param err':>9} {'replica':>8}  case")
    for label, r in results.items():
        le = r.get("max_loss_rel_err")
        pe = r.get("max_param_abs_err")
        rd = r.get("replica_max_diff")
        fmt = (lambda x: f"{x:9.2e}" if isinstance(x, float) else f"{'':>9}")  # noqa: E731
        print(f"{r['outcome']:>15}  {fmt(le)} {fmt(pe)} {fmt(rd)[1:]}  {label}"
              + (f"  -- {r['message'][:120]}" if r.get("message") else ""))
    print(f"counts: {counts}; wrote {args.out} ({doc['wall_seconds']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
