"""Benchmark: does ``hetplan plan --profile`` predict what ``hetplan run`` measures on this CPU?

The whole user path, through the command line, for each plan kind on 4 gloo ranks:

1. **Profile** each model before every round (``--profile-once``: before the first only;
   ``docs/decisions/cpu-fidelity.md`` section 24): ``hetplan profile MODEL --batch-size MB
   --layer-processes 4 -n 4 --what layers --what collectives --what step`` — layers at the
   plans' micro-batch, timed on 4 processes at once (so the 4-processes-on-2-cores
   contention of training is in the times), the gloo collectives on 4 ranks, the
   hand-overs under contention (p2p and all-reduce after compute bursts on all 4
   processes, part of ``collectives`` on gloo; recorded in the result beside the
   profile), the data-parallel sync and ZeRO-3's phases
   timed inside the runtime's own step of the model (``allreduce_step``,
   ``zero3_forward``, ``zero3_backward``, also part of ``collectives``), the runtime's
   tensor-parallel forward and backward of the model with every TP group at once
   (``tp_forward`` … ``tp_sp_backward``, and the loss within them, ``tp_loss`` /
   ``tp_sp_loss``), the traced pipeline stages against the eager
   model (``traced_forward``, ``traced_backward``) and FSDP2's optimizer step
   (``zero3_step``), all part of ``collectives`` too, and the per-step
   framework costs (the optimizer step per tensor and per byte, on 4 processes at once).
   A kind run on an emulated slow link (``compressed``: ``HETPLAN_EMULATE_BW=1`` on
   ``cpu-2x2-slow``) gets a copy of its model's profile with the hand-overs timed on that
   link too, and its data-parallel sync inside the model's step there (``hetplan profile
   MODEL --what collectives --link-kind ethernet`` under the same environment: its wire time
   is the analytic line, what runs under it is measured), as its run pays them.
2. **Plan** each kind: ``hetplan plan MODEL --cluster local-cpu --profile prof.json`` pinned
   to the kind (``KINDS``: dp, pp, tp, micro-batch, ZeRO, schedule, passes).
3. **Run** it: ``hetplan run plan.json --model MODEL --steps N --report report.json`` on 4 CPU
   ranks; the report's median iteration (after warm-up) is the measurement.
4. **Report** predicted vs measured per kind, ``|pred / meas - 1|``, the median over the
   kinds that ran (target ≤ 10 %, none beyond 25 %), and every kind the planner or the
   runtime refused, with its message (not hidden); and per kind the iteration split into
   parts (``PARTS``: compute, bubble, exposed communication, optimizer step, the rest),
   predicted beside measured, with the part that misses most — what a fix has to explain.
   ``--rounds`` repeats plan + run per kind, rounds interleaved so that a shared machine's
   drifts hit every kind alike; per kind the median over rounds is reported. The machine's load average is recorded at every run.

Each kind is also planned from the same profile less its hand-over records
(``predicted_without_handovers_ms``, and the errors without them in the summary): what the
hand-over wait changes, against the same runs; less the step-level and phase records
(``predicted_without_step_records_ms``: section 11's model on the same profile); and less
only section 13's phase records (``predicted_without_phase_records_ms``: section 12's
model: tensor parallelism's phases, the traced pipeline stages, FSDP2's optimizer step),
what they change; and less only section 14's loss records
(``predicted_without_loss_records_ms``: section 13's model, the loss shared by the stages).

Nothing is tuned on the numbers reported: the profile and the cost model are used as they are.

Writes ``bench/results/fidelity_runtime_cpu.json``. Usage::

    python bench/fidelity_runtime.py                          # full: 3 rounds, 20 steps
    python bench/fidelity_runtime.py --rounds 1 --steps 5     # a quick check
    python bench/fidelity_runtime.py --kinds dp pp --out /tmp/f.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _machine import cpu_shares, cpu_times, machine, speed_probe

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "fidelity_runtime_cpu.json"
TARGET_MEDIAN = 0.10
TARGET_MAX = 0.25
RANKS = 4


@dataclass(frozen=True)
class Kind:
    """One plan kind: the model, global batch and the ``hetplan plan`` pins that make it."""

    name: str
    model: str
    batch: int
    pins: tuple[str, ...]
    cluster: str = "local-cpu"
    env: dict[str, str] = field(default_factory=dict)
    note: str = ""
    #: the kind of the link ``env`` emulates (``HETPLAN_EMULATE_BW``): the model's profile
    #: gains the hand-overs timed on that link, filed under it
    emulated_link: str = ""


#: Micro-batch of every kind (the layers are profiled at it).
MICRO_BATCH = 2
_FP32 = ("--dtype", "fp32", "--recompute", "none", "--micro-batch-size", str(MICRO_BATCH))
KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("dp", "gpt-test", 8, ("--dp", "4", "--pp", "1", "--tp", "1", "--zero", "0",
                               "--passes", "uniform-stages,ddp-buckets", *_FP32),
         note="DDP-style buckets, uncompressed"),
    Kind("zero3", "gpt-test", 8, ("--dp", "4", "--pp", "1", "--tp", "1", "--zero", "3",
                                  *_FP32), note="FSDP2 inside the data-parallel group"),
    Kind("pp", "gpt-test", 8, ("--dp", "1", "--pp", "4", "--tp", "1", "--zero", "0",
                               "--schedule", "1f1b", *_FP32), note="4 stages, 1F1B"),
    Kind("tp", "megatron-gpt-test", 4, ("--dp", "2", "--pp", "1", "--tp", "2", "--zero", "0",
                                        *_FP32), note="Megatron TP 2 x DP 2"),
    Kind("pp-tp", "megatron-gpt-test", 4, ("--dp", "1", "--pp", "2", "--tp", "2", "--zero",
                                           "0", "--schedule", "1f1b", *_FP32),
         note="PP 2 x TP 2"),
    Kind("interleaved", "gpt-test", 8, ("--dp", "2", "--pp", "2", "--tp", "1", "--zero", "0",
                                        "--schedule", "interleaved-1f1b", "--virtual-stages",
                                        "2", *_FP32), note="PP 2 x DP 2, 2 chunks per rank"),
    # Espresso on the per-tensor gradients, then Cupcake's fusion (the default pipeline's
    # DDP bucket comes first, and with the emulated link's hand-over waits Espresso, which
    # compares per-tensor compression with it, keeps that fp32 bucket: in one profile at
    # load ~8, 17.8 ms predicted against 13.8 ms for the fused compressed bucket these
    # passes reach; without the emulated link's records both pipelines give that bucket)
    Kind("compressed", "gpt-test", 8, ("--dp", "4", "--pp", "1", "--tp", "1", "--zero", "0",
                                       "--compress", "fp16,dgc", "--passes",
                                       "uniform-stages,espresso,cupcake-fusion", *_FP32),
         cluster="cpu-2x2-slow", env={"HETPLAN_EMULATE_BW": "1"}, emulated_link="ethernet",
         note="Espresso on the 1 Gbit/s emulated inter-node link (HETPLAN_EMULATE_BW=1)"),
    Kind("fused", "gpt-test", 8, ("--dp", "4", "--pp", "1", "--tp", "1", "--zero", "0",
                                  *_FP32), note="the default pipeline: Cupcake's fused buckets"),
    Kind("chimera", "gpt-test", 8, ("--dp", "2", "--pp", "2", "--tp", "1", "--zero", "0",
                                    "--schedule", "chimera", *_FP32),
         note="PP 2 x DP 2, two directions (each rank holds 2 stages, sync over 4 ranks)"),
)}


def _hetplan() -> list[str]:
    exe = Path(sys.executable).with_name("hetplan")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("hetplan")
    if found is None:
        raise SystemExit("the `hetplan` command is not on PATH; install the package first")
    return [found]


def _call(cmd: list[str], env: dict[str, str] | None, timeout_s: float) -> tuple[int, str, float]:
    """Run a command; (exit code, last lines of its output, seconds)."""
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                           env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or "") if isinstance(e.stdout, str) else ""
        return 124, out[-2000:] + f"\n(timed out after {timeout_s:.0f} s)", timeout_s
    tail = "\n".join((p.stdout + p.stderr).strip().splitlines()[-60:])
    return p.returncode, tail, time.perf_counter() - t0


def _reason(tail: str) -> str:
    """The line that says why a command refused or failed (``error:`` first)."""
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    for test in (lambda ln: ln.startswith("rank ") and "error" in ln.lower(),
                 lambda ln: ln.lower().startswith("error"),
                 lambda ln: "refus" in ln.lower()):
        for ln in lines:
            if test(ln):
                return ln[:400]
    return (lines[-1] if lines else "")[:400]


def profile(model: str, tmp: Path, args: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
    """``hetplan profile`` of ``model`` at the micro-batch, on 4 processes at once."""
    out = tmp / f"profile_{model}.json"
    cmd = [*_hetplan(), "profile", model, "-o", str(out), "-n", str(RANKS),
           "--batch-size", str(MICRO_BATCH), "--layer-processes", str(RANKS),
           "--what", "layers", "--what", "collectives", "--what", "step"]
    code, tail, secs = _call(cmd, None, args.timeout)
    info = {"command": " ".join(cmd[1:]), "exit": code, "seconds": round(secs, 1),
            "load_average": os.getloadavg()}
    if code != 0:
        info["error"] = _reason(tail)
    else:
        info["handovers_ms"] = _handovers(out)
        _write_variants(out)
    return out, info


#: The hand-over records timed inside the runtime's own step (``docs/decisions/
#: cpu-fidelity.md`` section 12); the profile less them is section 11's model.
STEP_RECORDS = ("allreduce_step", "allgather_step", "reduce_broadcast_step", "zero3_forward",
                "zero3_backward")


#: The runtime's phases timed in section 13 (tensor parallelism's, the traced pipeline
#: stages', FSDP2's optimizer step); the profile less them is section 12's model.
#: The loss timed within the TP steps (section 14: a pipeline's last stage pays it); the
#: profile less them is section 13's model.
LOSS_RECORDS = ("tp_loss", "tp_sp_loss")
PHASE_RECORDS = ("tp_forward", "tp_backward", "tp_sp_forward", "tp_sp_backward",
                 "traced_forward", "traced_backward", "zero3_step")


def _without_steps(path: Path) -> Path:
    """The same profile less its step-level records (section 11's model, same profile)."""
    return path.with_name(path.stem + "_no_step_records.json")


def _without_phases(path: Path) -> Path:
    """The same profile less its section-13 phase records (section 12's model)."""
    return path.with_name(path.stem + "_no_phase_records.json")


def emulated_profile(kind: Kind, base: Path, tmp: Path, args: argparse.Namespace
                     ) -> tuple[Path, dict[str, Any]]:
    """``base`` plus the hand-overs and the model's data-parallel sync steps timed on the
    kind's emulated link (``hetplan profile MODEL --what collectives --link-kind LINK`` under
    the kind's environment, merged into a copy of ``base``), as its run pays them."""
    out = tmp / f"{base.stem}_{kind.emulated_link}.json"
    shutil.copyfile(base, out)
    cmd = [*_hetplan(), "profile", kind.model, "-o", str(out), "-n", str(RANKS),
           "--batch-size", str(MICRO_BATCH), "--what", "collectives",
           "--link-kind", kind.emulated_link]
    code, tail, secs = _call(cmd, kind.env, args.timeout)
    info = {"command": " ".join(cmd[1:]), "env": kind.env, "exit": code,
            "seconds": round(secs, 1), "load_average": os.getloadavg()}
    if code != 0:
        info["error"] = _reason(tail)
    else:
        info["handovers_ms"] = {k: v for k, v in _handovers(out).items()
                                if k.endswith(f" {kind.emulated_link}")}
        _write_variants(out)
    return out, info


def _write_variants(path: Path) -> None:
    """Beside the profile: the same less its hand-over records (:func:`_without`), less its
    step-level and phase ones (:func:`_without_steps`: section 11's model), less its
    section-13 phase ones (:func:`_without_phases`: section 12's), and less only its loss
    ones (:func:`_without_loss`: section 13's)."""
    doc = json.loads(path.read_text())
    hands = doc.get("handovers", [])
    _without_loss(path).write_text(json.dumps(
        doc | {"handovers": [r for r in hands if r["operation"] not in LOSS_RECORDS]},
        sort_keys=True, indent=2) + "\n")
    _without_steps(path).write_text(json.dumps(
        doc | {"handovers": [r for r in hands
                             if r["operation"] not in STEP_RECORDS + PHASE_RECORDS
                             + LOSS_RECORDS]},
        sort_keys=True, indent=2) + "\n")
    _without_phases(path).write_text(json.dumps(
        doc | {"handovers": [r for r in hands
                             if r["operation"] not in PHASE_RECORDS + LOSS_RECORDS]},
        sort_keys=True, indent=2) + "\n")
    doc.pop("handovers", None)
    _without(path).write_text(json.dumps(doc, sort_keys=True, indent=2) + "\n")


def _without_loss(path: Path) -> Path:
    """The same profile less its loss records (section 13's model, same profile)."""
    return path.with_name(path.stem + "_no_loss_records.json")


def _without(path: Path) -> Path:
    """The same profile less its hand-over records (the model as it was before them)."""
    return path.with_name(path.stem + "_no_handovers.json")


def _handovers(path: Path) -> dict[str, list[list[float]]]:
    """The profile's hand-over records: ``operation n=group bytes`` -> [[burst ms, message
    ms]]."""
    doc = json.loads(path.read_text())
    return {f"{r['operation']} n={r['group_size']} {r['nbytes']} B {r['link_kind']}":
            [[round(s["burst_s"] * 1e3, 3), round(s["seconds"] * 1e3, 3)] for s in r["samples"]]
            for r in doc.get("handovers", [])}


def plan_and_run(kind: Kind, prof: Path, tmp: Path, rnd: int,
                 args: argparse.Namespace) -> dict[str, Any]:
    """Plan one kind with the profile and run it; predicted and measured (ms) or why not."""
    plan = tmp / f"plan_{kind.name}_{rnd}.json"
    report = tmp / f"report_{kind.name}_{rnd}.json"
    cmd = [*_hetplan(), "plan", kind.model, "--cluster", kind.cluster, "--batch-size",
           str(kind.batch), "--profile", str(prof), "--no-progress", *kind.pins,
           "-o", str(plan)]
    code, tail, secs = _call(cmd, None, args.timeout)
    row: dict[str, Any] = {"round": rnd, "plan_seconds": round(secs, 1)}
    if code != 0:
        return row | {"status": "plan refused", "reason": _reason(tail)}
    doc = json.loads(plan.read_text())
    pred = doc.get("predictions") or {}
    row["predicted_ms"] = pred.get("iteration_time_ms")
    row["predicted_breakdown_ms"] = pred.get("breakdown")
    row["provenance"] = {k: v.get("detail") for k, v in (doc.get("provenance") or {}).items()}
    row["plan_summary"] = _summary(doc)
    # the same plan priced without the hand-over records: what they change, same runs
    before_plan = plan.with_suffix(".before.json")
    before_cmd = [str(_without(prof)) if c == str(prof) else c for c in cmd[:-1]]
    code, _, _ = _call([*before_cmd, str(before_plan)], None, args.timeout)
    if code == 0:
        before = json.loads(before_plan.read_text())
        bp = before.get("predictions") or {}
        row["predicted_without_handovers_ms"] = bp.get("iteration_time_ms")
        row["predicted_without_handovers_breakdown_ms"] = bp.get("breakdown")
    for name, variant in (("step_records", _without_steps), ("phase_records", _without_phases),
                          ("loss_records", _without_loss)):
        if not variant(prof).exists():
            continue
        v_plan = plan.with_suffix(f".no_{name}.json")
        v_cmd = [str(variant(prof)) if c == str(prof) else c for c in cmd[:-1]]
        code, _, _ = _call([*v_cmd, str(v_plan)], None, args.timeout)
        if code == 0:
            vp = json.loads(v_plan.read_text()).get("predictions") or {}
            row[f"predicted_without_{name}_ms"] = vp.get("iteration_time_ms")
            row[f"predicted_without_{name}_breakdown_ms"] = vp.get("breakdown")
    run = [*_hetplan(), "run", str(plan), "--model", kind.model, "--steps", str(args.steps),
           "--report", str(report)]
    row["load_average_before_run"] = os.getloadavg()
    code, tail, secs = _call(run, kind.env, args.timeout)
    row["run_seconds"] = round(secs, 1)
    row["load_average_after_run"] = os.getloadavg()
    if code != 0:
        status = "refused by the runtime" if code == 2 else f"run failed (exit {code})"
        return row | {"status": status, "reason": _reason(tail)}
    rep = json.loads(report.read_text())
    meas = rep["measured"]
    row["measured_ms"] = meas["iteration_ms"]
    row["measured_breakdown_ms"] = {k: v for k, v in meas.items()
                                    if k not in ("per_iteration_ms", "busiest_rank")}
    row["measured_busiest_rank"] = meas.get("busiest_rank")
    row["measured_per_iteration_ms"] = meas.get("per_iteration_ms")
    row["measured_per_rank_ms"] = [
        {k: r.get(k) for k in ("rank", *PARTS[:-1], "iteration_ms")} for r in rep["per_rank"]]
    row["parts_ms"] = parts(row["predicted_ms"], row["predicted_breakdown_ms"] or {},
                            row["measured_breakdown_ms"])
    row["status"] = "ran"
    return row


#: The parts an iteration is split into, predicted and measured alike: compute (TP
#: collectives inside it), the pipeline bubble, exposed data-parallel communication, the
#: optimizer step, and the rest (predicted: compression; measured: the iteration less the
#: timed parts; slightly negative where the parts' medians, of different ranks, add up to
#: more). In a pipeline the run report's compute and bubble are the busiest rank's, as the
#: prediction's are, the rest rank 0's (section 24 of ``docs/decisions/cpu-fidelity.md``;
#: reports before it: rank 0's compute and the largest bubble of any rank).
PARTS = ("compute_ms", "bubble_ms", "exposed_comm_ms", "optimizer_ms", "other_ms")


def parts(pred_ms: float, pred: dict[str, float], meas: dict[str, float]
          ) -> dict[str, dict[str, float]]:
    """Predicted beside measured, per part (``PARTS``). The plan's optimizer step is its
    breakdown's ``optimizer_ms``; a plan written before the breakdown had one: the
    iteration less compute, bubble and exposed communication (what
    :func:`hetplan.cost_models.evaluate.evaluate` adds last), less any compression. The
    measured rest is the iteration less the parts the runtime timed."""
    p = {k: float(pred.get(k) or 0.0) for k in PARTS[:3]}
    p["other_ms"] = float(pred.get("compression_ms") or 0.0)
    p["optimizer_ms"] = (float(pred["optimizer_ms"]) if pred.get("optimizer_ms") is not None
                         else max(pred_ms - sum(p.values()), 0.0))
    m = {k: float(meas.get(k) or 0.0) for k in PARTS[:4]}
    m["other_ms"] = float(meas.get("iteration_ms") or 0.0) - sum(m.values())
    return {k: {"predicted": round(p[k], 3), "measured": round(m[k], 3),
                "missing": round(m[k] - p[k], 3)} for k in PARTS}


def _summary(doc: dict[str, Any]) -> dict[str, Any]:
    """What the plan decided, in a few fields (to check the kind is what it says)."""
    lay = doc.get("layout") or {}
    sync = doc.get("gradient_sync") or {}
    strategies = sync.get("strategies") or {}
    used = {b.get("strategy") for b in sync.get("buckets", [])}
    return {
        "layout": {k: lay.get(k) for k in ("dp", "pp", "tp", "micro_batch_size",
                                            "micro_batches", "schedule", "virtual_stages",
                                            "zero_stage")},
        "buckets": len(sync.get("buckets", [])),
        "strategies_used": sorted(f"{n}:{strategies.get(n, {}).get('kind')}"
                                  for n in used if n is not None),
    }


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per kind: median predicted and measured over the rounds that ran, and the error."""
    ran = [r for r in rows if r["status"] == "ran"]
    if not ran:
        return {"status": rows[-1]["status"], "reason": rows[-1].get("reason")}
    pred = statistics.median(r["predicted_ms"] for r in ran)
    meas = statistics.median(r["measured_ms"] for r in ran)
    split = {k: {side: round(statistics.median(r["parts_ms"][k][side] for r in ran), 3)
                 for side in ("predicted", "measured", "missing")} for k in PARTS}
    largest = max(PARTS, key=lambda k: abs(split[k]["missing"]))
    out = {"status": "ran", "rounds_ran": len(ran), "predicted_ms": pred, "measured_ms": meas,
           "ratio": pred / meas, "error": abs(pred / meas - 1), "parts_ms": split,
           "largest_miss": largest}
    before = [r["predicted_without_handovers_ms"] for r in ran
              if r.get("predicted_without_handovers_ms") is not None]
    if before:
        out["predicted_without_handovers_ms"] = statistics.median(before)
        out["error_without_handovers"] = abs(statistics.median(before) / meas - 1)
    for name in ("step_records", "phase_records", "loss_records"):
        vals = [r[f"predicted_without_{name}_ms"] for r in ran
                if r.get(f"predicted_without_{name}_ms") is not None]
        if vals:
            out[f"predicted_without_{name}_ms"] = statistics.median(vals)
            out[f"error_without_{name}"] = abs(statistics.median(vals) / meas - 1)
    return out


def _profile_all(kinds: list[Kind], tmp: Path, args: argparse.Namespace
                 ) -> dict[str, tuple[Path, dict[str, Any]]]:
    """Every profile the kinds are planned from, written into ``tmp``: each model's, and a
    kind's model on its emulated link."""
    profiles: dict[str, tuple[Path, dict[str, Any]]] = {}
    for model in sorted({k.model for k in kinds}):
        print(f"[profile {model}] ...", file=sys.stderr, flush=True)
        profiles[model] = profile(model, tmp, args)
    for kind in kinds:
        key = f"{kind.model}+{kind.emulated_link}"
        if kind.emulated_link and key not in profiles and profiles[kind.model][1]["exit"] == 0:
            print(f"[profile {kind.model} on the emulated {kind.emulated_link} link] ...",
                  file=sys.stderr, flush=True)
            profiles[key] = emulated_profile(kind, profiles[kind.model][0], tmp, args)
    return profiles


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per run")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per command")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--profile-once", action="store_true",
                    help="profile once before the first round (before section 24 of "
                         "docs/decisions/cpu-fidelity.md: the default profiles again before "
                         "every round, so that each round is planned from what the host "
                         "measured just before it)")
    ap.add_argument("--keep", type=Path, default=None,
                    help="keep the profiles, plans and reports in this folder")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    load_at_start, cpu_at_start = list(os.getloadavg()), cpu_times()
    probes = [{"when": "start", **speed_probe()}]
    kinds = [KINDS[k] for k in args.kinds]
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = args.keep or Path(tmp_name)
        tmp.mkdir(parents=True, exist_ok=True)
        profiles: dict[str, tuple[Path, dict[str, Any]]] = {}
        profiled: dict[str, dict[str, Any]] = {}  # "round R model" -> its profile's info
        per_kind: dict[str, list[dict[str, Any]]] = {k.name: [] for k in kinds}
        for rnd in range(args.rounds):
            if rnd == 0 or not args.profile_once:
                where = tmp if args.profile_once else tmp / f"round{rnd}"
                where.mkdir(parents=True, exist_ok=True)
                probes.append({"when": f"before the profiles of round {rnd}", **speed_probe()})
                profiles = _profile_all(kinds, where, args)
                profiled.update({m if args.profile_once else f"round {rnd} {m}": info
                                 for m, (_, info) in profiles.items()})
            probes.append({"when": f"before round {rnd}", **speed_probe()})
            for kind in kinds if rnd % 2 == 0 else kinds[::-1]:
                print(f"[round {rnd} {kind.name}] plan + run ...", file=sys.stderr, flush=True)
                path, info = profiles.get(f"{kind.model}+{kind.emulated_link}",
                                          profiles[kind.model])
                if info["exit"] != 0:
                    per_kind[kind.name].append({"round": rnd, "status": "profile failed",
                                                "reason": info.get("error")})
                    continue
                per_kind[kind.name].append(plan_and_run(kind, path, tmp, rnd, args))
    probes.append({"when": "end", **speed_probe()})
    cpu = cpu_shares(cpu_at_start, cpu_times())
    cases = []
    for kind in kinds:
        cases.append({"kind": kind.name, "model": kind.model, "cluster": kind.cluster,
                      "global_batch": kind.batch, "pins": list(kind.pins), "env": kind.env,
                      "note": kind.note, **summarize(per_kind[kind.name]),
                      "rounds": per_kind[kind.name]})
    errors = [c["error"] for c in cases if c["status"] == "ran"]
    summary = {
        "kinds": len(cases), "kinds_ran": len(errors),
        "not_run": {c["kind"]: f"{c['status']}: {c.get('reason')}" for c in cases
                    if c["status"] != "ran"},
        "median_error": statistics.median(errors) if errors else None,
        "max_error": max(errors) if errors else None,
        "target_median": TARGET_MEDIAN, "target_max": TARGET_MAX,
    }
    before = [c["error_without_handovers"] for c in cases if "error_without_handovers" in c]
    if before:
        summary["median_error_without_handovers"] = statistics.median(before)
        summary["max_error_without_handovers"] = max(before)
    for name in ("step_records", "phase_records", "loss_records"):
        vals = [c[f"error_without_{name}"] for c in cases if f"error_without_{name}" in c]
        if vals:
            summary[f"median_error_without_{name}"] = statistics.median(vals)
            summary[f"max_error_without_{name}"] = max(vals)
    summary["meets_target"] = bool(errors) and summary["median_error"] <= TARGET_MEDIAN and (
        summary["max_error"] <= TARGET_MAX) and len(errors) == len(cases)
    print(f"{'kind':<12} {'model':<18} {'predicted':>10} {'measured':>10} {'error':>7}  "
          f"{'without hand-overs':>20}  {'without step records':>20}  "
          f"{'without phase records':>21}  {'without loss records':>20}  status")
    for c in cases:
        if c["status"] == "ran":
            cols = []
            for name in ("handovers", "step_records", "phase_records", "loss_records"):
                b = c.get(f"predicted_without_{name}_ms")
                cols.append(f"{b:8.2f}ms {c[f'error_without_{name}']:>7.1%}"
                            if b is not None else "")
            print(f"{c['kind']:<12} {c['model']:<18} {c['predicted_ms']:>8.2f}ms "
                  f"{c['measured_ms']:>8.2f}ms {c['error']:>7.1%}  "
                  + "  ".join(f"{x:>20}" for x in cols) + "  ran")
        else:
            print(f"{c['kind']:<12} {c['model']:<18} {'':>10} {'':>10} {'':>7}  "
                  f"{c['status']}: {c.get('reason')}")
    print("\nper part, predicted / measured ms (the largest miss marked *):")
    print(f"{'kind':<12} " + " ".join(f"{k[:-3]:>15}" for k in PARTS))
    for c in cases:
        if c["status"] != "ran":
            continue
        cells = [f"{c['parts_ms'][k]['predicted']:6.2f}/{c['parts_ms'][k]['measured']:6.2f}"
                 + ("*" if k == c["largest_miss"] else " ") for k in PARTS]
        print(f"{c['kind']:<12} " + " ".join(f"{x:>15}" for x in cells))
    print("machine speed probes (ms; python / matmul): " + ", ".join(
        f"{p['when']} {p['python_ms']:.1f} / {p['matmul_ms']:.1f}" for p in probes)
        + (f"; CPU busy {cpu['busy']:.0%}, stolen {cpu['steal']:.1%}" if cpu else ""))
    if errors:
        print(f"median |pred/meas - 1| {summary['median_error']:.1%} (target <= "
              f"{TARGET_MEDIAN:.0%}), max {summary['max_error']:.1%} (target <= "
              f"{TARGET_MAX:.0%}); {len(errors)}/{len(cases)} kinds ran")
    result = {
        "benchmark": "fidelity_runtime_cpu",
        "machine": machine(device="cpu", backend="gloo", ranks=RANKS),
        "load_average_at_start_and_end": [load_at_start, list(os.getloadavg())],
        "speed_probes_ms": probes, "cpu_shares": cpu,
        "settings": {"rounds": args.rounds, "steps": args.steps, "micro_batch": MICRO_BATCH,
                     "kinds": args.kinds, "profile_once": args.profile_once},
        "seconds": round(time.perf_counter() - started, 1),
        "profiles": profiled,
        "summary": summary,
        "cases": cases,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {args.out}")
    return 0 if summary["meets_target"] else 1


if __name__ == "__main__":
    sys.exit(main())
