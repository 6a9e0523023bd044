"""hetplan against published large-model training runs: predicted vs measured iteration time.

For every run of ``bench/data/published_runs.json`` (see :mod:`published_data` and
``bench/README.md``):

1. **Model**: the run's architecture and shape as a Hugging Face model (GPT-2 classes for
   Megatron GPT, BLOOM, Llama) built on the ``meta`` device in the run's 16-bit dtype and
   captured once at batch 1 and the run's sequence length (repeated blocks are traced once,
   ``ir/block_reuse.py``); runs of the same shape share the capture.
2. **Cluster**: the run's cluster file (``bench/data/clusters``, one node and the network)
   scaled to the run's GPU count.
3. **Pinned**: ``hetplan.compile`` with everything of the published layout that the planner
   can express (dp, pp, tp, the schedule, and where published the micro-batch size, the
   precision, interleaved virtual stages, recomputation, sequence parallelism and ZeRO /
   FSDP sharding; :data:`DIMENSIONS`). A dimension the source does not publish is left to
   the planner's search; one it cannot express (context parallelism) is listed per run. When the published layout does not
   fit the planner's memory model, the :class:`InfeasiblePlanError` message is recorded and
   the same layout is compiled again on the same cluster with unbounded device memory, so
   that its predicted time can still be compared with the measured one (marked
   ``memory_ignored``).
4. **Free search**: the same compile without pins (the engine settings kept, the schedule
   ``auto``: 1F1B and interleaved 1F1B searched side by side): the layout it picks, its predicted time,
   whether anything fits.
5. **Summary**: median and worst |predicted / measured - 1| of the pinned predictions, how
   many published layouts fit, how many free-search plans are predicted at least as fast as
   the published layout.

Writes ``bench/results/published.json`` (``--quick``: ``published_quick.json``) with the
machine record and prints a table. A full run takes about 15 minutes on a 2-core machine.

    python bench/published.py [--quick] [--only ID ...] [--no-free] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _machine import machine
from published_data import (
    CLUSTER_DIR,
    ModelConfig,
    PublishedRuns,
    Run,
    load_runs,
    measured_iteration,
    param_count,
)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"

#: One run per source and size class: what ``--quick`` runs.
QUICK = (
    "narayanan2021-gpt-1.7b",
    "narayanan2021-gpt-145.6b",
    "korthikanti2022-gpt-22b-sp-selective",
    "bloom2022-176b",
    "llama3-405b-8k-gpus",
)

#: Device memory of the "unbounded" copy of a cluster (GiB): large enough for any layout.
UNBOUNDED_GIB = 1.0e6


# --------------------------------------------------------------------------------------------
# Strategy dimensions: what the planner can express of a published layout
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Dimension:
    """One strategy dimension of a published layout.

    Attributes:
        name: the dimension, as reported.
        field: the :class:`published_data.Layout` attribute holding the published value.
        default: the value today's planner assumes implicitly (a published value equal to it
            needs no option).
        option: the ``compile`` option that expresses the dimension, or None while the
            planner cannot; setting it here makes the bench pin the published value.
        to_option: published value → option value.
        candidates: option names a planner version might use for it; if ``CompileOptions``
            has one while ``option`` is None, the run reports it as available but not wired.
        what: one line for the report.
    """

    name: str
    field: str
    default: Any
    option: str | None
    candidates: tuple[str, ...]
    what: str
    to_option: Callable[[Any], Any] = lambda v: v


_ZERO = {"none": 0, "zero-1": 1, "zero-2": 2, "zero-3": 3, "fsdp": 3}

#: Where a source's sharding is not the name's usual stage. Llama 3's FSDP "shards optimizer
#: states and gradients, but for model shards we do not reshard after forward computation to
#: avoid an extra all-gather communication during backward passes" (Llama 3 Team 2024,
#: section 3.3.2): parameters stay whole through forward and backward, gradients and
#: optimizer state are sharded, which is the planner's ZeRO-2.
ZERO_BY_SOURCE: dict[str, dict[str, int]] = {"llama3_2024": {"fsdp": 2}}

DIMENSIONS: tuple[Dimension, ...] = (
    Dimension("micro_batch_size", "micro_batch_size", None, "micro_batch_size",
              ("micro_batch_size",), "micro-batch size"),
    Dimension("compute_dtype", "precision", "fp32", "dtype", ("dtype",),
              "compute dtype (fp16 / bf16 tensor cores) with fp32 master weights and "
              "optimizer state (the planner's mixed precision)"),
    Dimension("virtual_stages", "virtual_stages", 1, "virtual_stages",
              ("virtual_stages", "interleave", "num_virtual_stages"),
              "interleaved virtual pipeline stages"),
    Dimension("recompute", "recompute", "none", "recompute",
              ("recompute", "activation_recompute", "recomputation"),
              "activation recomputation (selective or full)"),
    Dimension("sequence_parallel", "sequence_parallel", False, "sequence_parallel",
              ("sequence_parallel", "sp"), "sequence parallelism alongside TP"),
    Dimension("dp_sharding", "dp_sharding", "none", "zero_stage",
              ("zero", "zero_stage", "dp_sharding", "fsdp", "sharding"),
              "ZeRO / FSDP sharding across data-parallel ranks",
              to_option=lambda v: _ZERO[v]),
    Dimension("context_parallel", "cp", 1, None, ("cp", "context_parallel"),
              "context parallelism"),
)


#: The training software's kernels and sync order, per source (cost-model settings, not
#: layout): Megatron-LM of 2021-22 (Narayanan et al. 2021, Korthikanti et al. 2022) and
#: Megatron-DeepSpeed for BLOOM wrote the attention scores to memory (fused scale-mask-
#: softmax, no fused attention kernel: the 5·a·s² activation term Korthikanti et al. count is
#: those scores) and all-reduced gradients after the pipeline flush (Narayanan et al. 2021,
#: section 2.2: "at the end of every batch ... gradients are all-reduced"); Llama 3 trained
#: with fused attention and FSDP, whose reduce-scatters overlap backward. All of them ran
#: fused memory-bound kernels (``fusion="fused"``): Megatron-LM's fused bias+GeLU,
#: bias+dropout+add, scale-mask-softmax and Apex layer norm (Narayanan et al. 2021,
#: section 4.2 "Operator fusion"; Megatron-DeepSpeed keeps them); Llama 3 fused RMSNorm,
#: SwiGLU and rotary kernels beside flash attention. All of them split the LM head across
#: the TP ranks by vocabulary (``vocab_parallel``: Megatron-LM's parallel output layer and
#: vocab-parallel cross-entropy, Shoeybi et al. 2019, section 3; Llama 3 "4D parallelism"
#: with Megatron-style TP).
_MEGATRON: dict[str, Any] = {"attention": "materialized", "dp_overlap": "after-flush",
                             "fusion": "fused", "vocab_parallel": True}
SOFTWARE: dict[str, dict[str, Any]] = {
    "narayanan2021": _MEGATRON,
    "korthikanti2022": _MEGATRON,
    "bloom2022": _MEGATRON,
    "llama3_2024": {"attention": "flash", "dp_overlap": "backward", "fusion": "fused",
                    "vocab_parallel": True},
}

#: How each source's engine accumulated gradients across micro-batches
#: (``grad_accumulation``, :mod:`hetplan.cost_models.grad_accumulation`; the evidence in
#: ``docs/decisions/published-round6.md``, section 4), set from the software each paper ran,
#: never from the resulting ratio:
#:
#: - Narayanan et al. 2021: Table 1 was produced by NVIDIA/Megatron-LM
#:   ``examples/sc21/run_table_1.sh`` with ``CONFIG.sh`` (``--fp16 --loss-scale 8192``, no
#:   ``--accumulate-allreduce-grads-in-fp32``, ``--DDP-impl ${DDP}``): ``DDP=torch`` for
#:   1.7B-18B, whose pipeline-free schedule runs every micro-batch but the last under
#:   ``no_sync`` (``megatron/schedules.py``, ``forward_backward_no_pipelining``), so
#:   autograd adds each fp16 gradient into ``.grad`` (``autograd``); ``DDP=local`` for 39B
#:   and up, Megatron's local DDP whose hook adds every micro-batch's gradient into a
#:   ``main_grad`` buffer in the parameters' fp16 (``hook16``; gradient-accumulation fusion
#:   is off without fp32 accumulation, ``megatron/arguments.py``).
#: - Korthikanti et al. 2022: fp16 (calculon-ai/calculon ``validation/seqsel/tab5/*.json``,
#:   ``"datatype": "float16"``) with Megatron-LM of the sequence-parallel era
#:   (``megatron/arguments.py`` at 00129014: ``--DDP-impl`` defaults to ``local``,
#:   contiguous buffers default on, fp32 accumulation off and the fusion switched off
#:   without it): ``hook16``.
#: - BLOOM (Megatron-DeepSpeed, bf16, DeepSpeed's ``BF16_Optimizer``): after every
#:   micro-batch's backward ``update_hp_grads`` adds each bf16 gradient into its fp32
#:   gradient (``hp_grad.add_(lp.grad.to(fp32))``; the fp32 gradients are zeroed after each
#:   step): the fp32 hook's pattern, ``hook32`` (its cast to an fp32 temporary, 8 more
#:   bytes, is not counted).
#: - Llama 3 (Meta's own FSDP): nothing published says how it accumulates; priced as
#:   PyTorch's own accumulation, the stated default (``autograd``).
NARAYANAN_DDP: dict[str, str] = {
    "narayanan2021-gpt-1.7b": "torch", "narayanan2021-gpt-3.6b": "torch",
    "narayanan2021-gpt-7.5b": "torch", "narayanan2021-gpt-18.4b": "torch",
    "narayanan2021-gpt-39.1b": "local", "narayanan2021-gpt-76.1b": "local",
    "narayanan2021-gpt-145.6b": "local", "narayanan2021-gpt-310.1b": "local",
    "narayanan2021-gpt-529.6b": "local", "narayanan2021-gpt-1t": "local",
}
_BY_DDP = {"torch": "autograd", "local": "hook16"}
GRAD_ACCUMULATION: dict[str, str] = {"korthikanti2022": "hook16", "bloom2022": "hook32",
                                     "llama3_2024": "autograd"}


def grad_accumulation(run: Run) -> str | None:
    """The ``grad_accumulation`` setting of ``run``'s engine (see :data:`GRAD_ACCUMULATION`),
    or None for a source without one (the planner's default, ``autograd``)."""
    if run.source == "narayanan2021":
        if run.id not in NARAYANAN_DDP:
            raise ValueError(f"run {run.id!r}: add its --DDP-impl from Megatron-LM's "
                             "examples/sc21/run_table_1.sh to NARAYANAN_DDP")
        return _BY_DDP[NARAYANAN_DDP[run.id]]
    return GRAD_ACCUMULATION.get(run.source)


def _option_fields() -> set[str]:
    from hetplan import CompileOptions

    return set(CompileOptions.model_fields)


def express(run: Run) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The ``compile`` pins for ``run``'s published layout, and one record per dimension
    (``status``: pinned / default / unexpressed / unpublished)."""
    lay = run.layout
    fields = _option_fields()
    pins: dict[str, Any] = {"dp": lay.dp, "pp": lay.pp, "tp": lay.tp,
                            "schedule": lay.schedule}
    pins.update({k: v for k, v in SOFTWARE.get(run.source, {}).items() if k in fields})
    acc = grad_accumulation(run)
    if acc is not None and "grad_accumulation" in fields:
        pins["grad_accumulation"] = acc
    report = []
    for dim in DIMENSIONS:
        value = getattr(lay, dim.field)
        rec: dict[str, Any] = {"dimension": dim.name, "published": value, "what": dim.what}
        if value is None:
            rec["status"] = "unpublished"
        elif dim.name == "virtual_stages" and value == 1:
            # one chunk per rank is what the pinned non-interleaved schedule means (the
            # option takes 2 and more)
            rec["status"] = "default"
        elif dim.name == "dp_sharding" and value in ZERO_BY_SOURCE.get(run.source, {}):
            pins[dim.option or "zero_stage"] = ZERO_BY_SOURCE[run.source][value]
            rec["status"] = "pinned"
            rec["as"] = f"zero-{pins[dim.option or 'zero_stage']} (see ZERO_BY_SOURCE)"
        elif dim.option is not None and dim.option in fields:
            pins[dim.option] = dim.to_option(value)
            rec["status"] = "pinned"
        elif value == dim.default:
            rec["status"] = "default"
        else:
            rec["status"] = "unexpressed"
            wired = [c for c in dim.candidates if c in fields]
            if wired:
                rec["option_available"] = wired
        report.append(rec)
    return pins, report


# --------------------------------------------------------------------------------------------
# models and clusters
# --------------------------------------------------------------------------------------------


def _builder(m: ModelConfig) -> Callable[[], Any]:
    from hetplan.zoo.builders import hf

    if m.architecture == "gpt":
        return hf("GPT2Config", "GPT2LMHeadModel", vocab_size=m.vocab, n_positions=m.seq_len,
                  n_embd=m.hidden, n_layer=m.layers, n_head=m.heads, n_inner=m.ffn_hidden,
                  tie_word_embeddings=m.tied_embeddings)
    if m.architecture == "bloom":
        return hf("BloomConfig", "BloomForCausalLM", vocab_size=m.vocab, hidden_size=m.hidden,
                  n_layer=m.layers, n_head=m.heads, tie_word_embeddings=m.tied_embeddings)
    return hf("LlamaConfig", "LlamaForCausalLM", vocab_size=m.vocab, hidden_size=m.hidden,
              intermediate_size=m.ffn_hidden, num_hidden_layers=m.layers,
              num_attention_heads=m.heads, num_key_value_heads=m.kv_heads,
              max_position_embeddings=m.seq_len, tie_word_embeddings=m.tied_embeddings)


_IR_CACHE: dict[tuple[Any, ...], tuple[Any, float]] = {}


def capture_model(run: Run) -> tuple[Any, float]:
    """The captured IR of ``run``'s model (meta device, the run's 16-bit dtype, batch 1, the
    run's sequence length) and the seconds build + capture took (0 when cached)."""
    import torch

    from hetplan import capture

    m = run.model
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[
        run.layout.precision]
    key = (m.model_dump_json(), run.layout.precision)
    if key in _IR_CACHE:
        return _IR_CACHE[key][0], 0.0
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = _builder(m)().to(dtype)
    ids = torch.empty(1, m.seq_len, dtype=torch.long, device="meta")
    ir = capture(model, (ids,), {"use_cache": False},
                 name=f"{m.architecture}-l{m.layers}-h{m.hidden}-s{m.seq_len}")
    seconds = time.perf_counter() - t0
    _IR_CACHE[key] = (ir, seconds)
    return ir, seconds


def cluster_for(run: Run, *, unbounded_memory: bool = False) -> Any:
    """The run's cluster file scaled to its GPU count (optionally with unbounded memory)."""
    from hetplan import ClusterSpec

    c = run.cluster
    data = ClusterSpec.load(CLUSTER_DIR / c.cluster_file).model_dump(mode="json")
    nodes, rest = divmod(c.gpus, c.gpus_per_node)
    if rest or len(data["nodes"]) != 1:
        raise ValueError(f"run {run.id!r}: {c.gpus} GPUs is not a whole number of "
                         f"{c.gpus_per_node}-GPU nodes of {c.cluster_file}")
    data["nodes"][0]["count"] = nodes
    data["name"] = f"{data['name']}-{c.gpus}"
    if unbounded_memory:
        data["name"] += "-unbounded-memory"
        for spec in data["device_types"].values():
            spec["memory_gib"] = UNBOUNDED_GIB
    return ClusterSpec.from_dict(data, where=f"{c.cluster_file} for run {run.id}")


# --------------------------------------------------------------------------------------------
# one run
# --------------------------------------------------------------------------------------------


def _compile(ir: Any, cluster: Any, batch: int, **opts: Any) -> dict[str, Any]:
    """``hetplan.compile`` → its layout, predicted time and peak memory, or why it failed."""
    import hetplan
    from hetplan import HetplanError, InfeasiblePlanError

    t0 = time.perf_counter()
    try:
        plan = hetplan.compile(ir, cluster, batch_size=batch, **opts)
    except InfeasiblePlanError as e:
        return {"fits": False, "infeasible": str(e), "seconds": time.perf_counter() - t0}
    except HetplanError as e:
        return {"fits": None, "error": f"{type(e).__name__}: {e}",
                "seconds": time.perf_counter() - t0}
    s = plan.summary()
    lay = plan.layout
    pred = plan.predictions
    br = pred.breakdown if pred is not None else None
    return {
        "fits": True,
        "layout": {"dp": lay.dp, "pp": lay.pp, "tp": lay.tp,
                   "micro_batch_size": lay.micro_batch_size, "micro_batches": lay.micro_batches,
                   "schedule": lay.schedule, "virtual_stages": lay.virtual_stages},
        "predicted_iteration_s": s.iteration_time_ms / 1e3,
        "breakdown_s": ({k.removesuffix("_ms") + "_s": v / 1e3
                         for k, v in br.model_dump().items()} if br is not None else None),
        "bubble_ratio": s.bubble_ratio,
        "peak_memory_gib": (s.peak_memory_bytes or 0) / 2**30,
        "seconds": time.perf_counter() - t0,
    }


def _ratio(pred: float | None, meas: float) -> dict[str, float] | None:
    if pred is None:
        return None
    return {"ratio": pred / meas, "abs_error": abs(pred / meas - 1)}


def block_split(ir: Any, run: Run, pins: dict[str, Any], dtype: str,
                micro_batch: int) -> dict[str, float] | None:
    """Where one transformer block's time goes on one rank for one micro-batch, as the
    kernel model prices it with the run's settings (ms, forward and backward): matrix
    multiplies outside the attention core, the attention core's products, and the
    memory-bound kernels (with, materialized, the attention scores' share)."""
    from hetplan.cost_models.kernels import curve_for, kernel_times
    from hetplan.ir.plan_sections import WorkloadSummary

    ws = WorkloadSummary.from_model_ir(ir)
    block = next((lay for lay in ws.layers if lay.tp_pairs > 0), None)
    dev = cluster_for(run).devices()[0]
    curve = curve_for(dev.type)
    if block is None or curve is None:
        return None
    no_mem = {"mem_fwd_bytes": 0, "mem_bwd_bytes": 0, "core_mem_fwd_bytes": 0,
              "core_mem_bwd_bytes": 0}
    no_core = tuple(g for g in block.gemms if not g.core)
    kw: dict[str, Any] = dict(
        peak_flops=dev.flops(dtype), mem_bw=dev.mem_bandwidth_bytes_per_s, elem_bytes=2,
        bytes_scale=1.0, tokens=run.model.seq_len, r=float(micro_batch), tp=pins["tp"],
        sp=bool(pins.get("sequence_parallel")), attention=pins.get("attention", "flash"),
        fusion=pins.get("fusion", "none"))
    full = kernel_times(block, curve, **kw)
    bare = dict(kw, fusion="none")
    products = kernel_times(block.model_copy(update=no_mem), curve, **bare)
    linear = kernel_times(block.model_copy(update=dict(no_mem, gemms=no_core)), curve, **bare)
    return {
        "gemm_fwd_ms": linear.fwd_s * 1e3,
        "gemm_bwd_ms": linear.bwd_s * 1e3,
        "attention_core_gemm_fwd_ms": (products.fwd_s - linear.fwd_s) * 1e3,
        "attention_core_gemm_bwd_ms": (products.bwd_s - linear.bwd_s) * 1e3,
        "memory_bound_fwd_ms": (full.fwd_s - products.fwd_s) * 1e3,
        "memory_bound_bwd_ms": (full.bwd_s - products.bwd_s) * 1e3,
        "of_which_attention_scores_fwd_ms": (full.core_fwd_s - products.core_fwd_s) * 1e3,
        "fwd_ms": full.fwd_s * 1e3,
        "bwd_ms": full.bwd_s * 1e3,
    }


def bench_run(run: Run, data: PublishedRuns, *, free: bool) -> dict[str, Any]:
    """Pinned and free-search compiles of one published run (see module docstring)."""
    meas = measured_iteration(run, data.flops_conventions)
    ir, capture_s = capture_model(run)
    pins, dims = express(run)
    dtype = pins.pop("dtype", "fp32")
    batch = run.layout.global_batch_size
    cluster = cluster_for(run)

    pinned = _compile(ir, cluster, batch, dtype=dtype, **pins)
    if pinned["fits"] is False:
        unbounded = _compile(ir, cluster_for(run, unbounded_memory=True), batch, dtype=dtype,
                             **pins)
        pinned["memory_ignored"] = unbounded
        pred = unbounded.get("predicted_iteration_s")
    else:
        pred = pinned.get("predicted_iteration_s")
    pinned["options"] = dict(pins, dtype=dtype)
    pinned["vs_measured"] = _ratio(pred, meas.seconds)
    lay_used = pinned.get("layout") or (pinned.get("memory_ignored") or {}).get("layout")
    if lay_used:
        pinned["block_split"] = block_split(
            ir, run, pins, "bf16" if dtype == "bf16" else "fp16", lay_used["micro_batch_size"])

    out: dict[str, Any] = {
        "id": run.id,
        "source": run.source,
        "gpus": run.cluster.gpus,
        "gpu": run.cluster.gpu,
        "published_layout": run.layout.model_dump(),
        "params_captured": ir.num_params,
        "params_formula": param_count(run.model),
        "model": run.model.model_dump(),
        "capture_seconds": capture_s,
        "measured": {"iteration_s": meas.seconds, "how": meas.how,
                     "rel_uncertainty": meas.rel_uncertainty},
        "dimensions": dims,
        "unexpressed": [d["dimension"] for d in dims if d["status"] == "unexpressed"],
        "pinned": pinned,
    }
    if free:
        soft = {k: pins[k] for k in ("attention", "dp_overlap", "fusion", "vocab_parallel",
                                     "grad_accumulation") if k in pins}
        f = _compile(ir, cluster, batch, dtype=dtype, schedule="auto", **soft)
        fp = f.get("predicted_iteration_s")
        f["vs_measured"] = _ratio(fp, meas.seconds)
        f["at_least_as_fast_as_published"] = (fp <= pred) if fp is not None and pred else None
        out["free"] = f
    return out


# --------------------------------------------------------------------------------------------
# summary and table
# --------------------------------------------------------------------------------------------


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median / worst pinned error, feasibility counts, free search vs published."""
    def errs(sel: Callable[[dict[str, Any]], bool]) -> list[tuple[float, str]]:
        return sorted((r["pinned"]["vs_measured"]["abs_error"], r["id"]) for r in rows
                      if r["pinned"]["vs_measured"] is not None and sel(r))

    every = errs(lambda r: True)
    feasible = errs(lambda r: r["pinned"]["fits"] is True)
    ratios = [r["pinned"]["vs_measured"]["ratio"] for r in rows
              if r["pinned"]["vs_measured"] is not None]
    frees = [r["free"] for r in rows if "free" in r]
    out: dict[str, Any] = {
        "runs": len(rows),
        "sources": len({r["source"] for r in rows}),
        "pinned_predicted": len(every),
        "pinned_median_abs_error": statistics.median(e for e, _ in every) if every else None,
        "pinned_median_ratio": statistics.median(ratios) if ratios else None,
        "pinned_worst": {"id": every[-1][1], "abs_error": every[-1][0]} if every else None,
        "pinned_within_10pct": sum(e <= 0.10 for e, _ in every),
        "published_layouts_feasible": sum(r["pinned"]["fits"] is True for r in rows),
        "pinned_median_abs_error_feasible_only": (statistics.median(e for e, _ in feasible)
                                                  if feasible else None),
        "unexpressed_dimension_counts": {
            d.name: sum(d.name in r["unexpressed"] for r in rows) for d in DIMENSIONS},
        "by_source": {},
    }
    for src in sorted({r["source"] for r in rows}):
        mine = [r["pinned"]["vs_measured"] for r in rows
                if r["source"] == src and r["pinned"]["vs_measured"] is not None]
        out["by_source"][src] = {
            "runs": sum(r["source"] == src for r in rows),
            "median_abs_error": statistics.median(v["abs_error"] for v in mine) if mine else None,
            "ratios": [round(v["ratio"], 3) for v in mine],
        }
    out["same_work_pairs"] = same_work_pairs(rows)
    if frees:
        out.update(
            free_search_runs=len(frees),
            free_search_feasible=sum(f["fits"] is True for f in frees),
            free_search_at_least_as_fast_as_published=sum(
                f.get("at_least_as_fast_as_published") is True for f in frees),
        )
    return out


#: What makes two runs the same work per pipeline (besides the model's shape): one pipeline
#: of each runs the same stages on the same devices over the same number of micro-batches.
_SAME_WORK_LAYOUT = ("tp", "pp", "cp", "virtual_stages", "micro_batch_size", "schedule",
                     "sequence_parallel", "recompute", "dp_sharding", "precision")


def same_work_pairs(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Pairs of runs from different sources whose pipelines do the same work on the same GPU
    type: the same model shape (``params_billion`` aside, a rounding of the same shape), the
    same layout but for ``dp``, and the same micro-batches per pipeline. They differ only by
    the data-parallel sync, which the model prices.

    ``spread`` is the measured ratio of the two over the predicted ratio: a factor that no
    cost model which prices the same work the same way can reconcile. Such a model is off by
    at least ``sqrt(spread) - 1`` on one of the two (``min_worst_error``)."""
    def key(r: dict[str, Any]) -> tuple[Any, ...] | None:
        lay, m = r["published_layout"], r.get("model")
        if m is None or not lay.get("micro_batch_size"):
            return None
        per_pipe = lay["global_batch_size"] / (lay["dp"] * lay["micro_batch_size"])
        shape = tuple(v for k, v in sorted(m.items()) if k != "params_billion")
        return (r["gpu"], shape, per_pipe, *(lay.get(k) for k in _SAME_WORK_LAYOUT))

    def pred(r: dict[str, Any]) -> float | None:
        p = r["pinned"]
        return p.get("predicted_iteration_s") or (p.get("memory_ignored") or {}).get(
            "predicted_iteration_s")

    out = []
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            ka = key(a)
            if ka is None or a["source"] == b["source"] or ka != key(b):
                continue
            pa, pb = pred(a), pred(b)
            if not pa or not pb:
                continue
            meas = a["measured"]["iteration_s"] / b["measured"]["iteration_s"]
            spread = max(meas / (pa / pb), (pa / pb) / meas)
            out.append({"runs": [a["id"], b["id"]], "measured_ratio": round(meas, 4),
                        "predicted_ratio": round(pa / pb, 4), "spread": round(spread, 4),
                        "min_worst_error": round(spread ** 0.5 - 1, 4)})
    return out


def _fmt_layout(lay: dict[str, Any] | None) -> str:
    if not lay:
        return "-"
    mb = lay.get("micro_batch_size")
    return f"{lay['dp']}/{lay['pp']}/{lay['tp']}" + (f" mb{mb}" if mb else "")


def print_table(rows: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    head = (f"{'run':40s} {'gpus':>5s} {'dp/pp/tp':>14s} {'meas s':>8s} {'pinned s':>9s} "
            f"{'ratio':>6s} {'fits':>5s} {'free dp/pp/tp':>15s} {'free s':>8s}  unexpressed")
    print(head)
    print("-" * len(head))
    for r in rows:
        p = r["pinned"]
        pl = p.get("layout") or (p.get("memory_ignored") or {}).get("layout")
        pred = p.get("predicted_iteration_s") or (p.get("memory_ignored") or {}).get(
            "predicted_iteration_s")
        ratio = p["vs_measured"]["ratio"] if p["vs_measured"] else None
        f = r.get("free", {})
        print(f"{r['id']:40s} {r['gpus']:5d} {_fmt_layout(pl):>14s} "
              f"{r['measured']['iteration_s']:8.2f} "
              f"{pred if pred is not None else float('nan'):9.2f} "
              f"{ratio if ratio is not None else float('nan'):6.2f} "
              f"{'yes' if p['fits'] else 'no':>5s} {_fmt_layout(f.get('layout')):>15s} "
              f"{f.get('predicted_iteration_s') or float('nan'):8.2f}  "
              f"{','.join(r['unexpressed']) or '-'}")
    s = summary
    print()
    if s["pinned_median_abs_error"] is not None:
        print(f"pinned: median |pred/meas - 1| = {s['pinned_median_abs_error']:.1%} over "
              f"{s['pinned_predicted']} runs (median ratio {s['pinned_median_ratio']:.2f}); "
              f"worst {s['pinned_worst']['id']} ({s['pinned_worst']['abs_error']:.1%}); "
              f"{s['pinned_within_10pct']} within 10 %")
        for src, v in s["by_source"].items():
            if v["median_abs_error"] is not None:
                print(f"  {src:18s} {v['runs']:2d} runs, median |pred/meas - 1| "
                      f"{v['median_abs_error']:.1%}, ratios {v['ratios']}")
    for pair in s.get("same_work_pairs", []):
        print(f"  same work, two sources: {' vs '.join(pair['runs'])}: measured ratio "
              f"{pair['measured_ratio']:.3f}, predicted {pair['predicted_ratio']:.3f}; any "
              f"model pricing both alike is off by >= {pair['min_worst_error']:.1%} on one")
    print(f"published layouts that fit the planner's memory model: "
          f"{s['published_layouts_feasible']} / {s['runs']}")
    if "free_search_runs" in s:
        print(f"free search: {s['free_search_feasible']} / {s['free_search_runs']} found a "
              f"plan that fits; {s['free_search_at_least_as_fast_as_published']} predicted at "
              "least as fast as the published layout")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    ap.add_argument("--only", nargs="+", metavar="ID", help="only these run ids")
    ap.add_argument("--no-free", action="store_true", help="skip the free search")
    ap.add_argument("--out", type=Path, help="results file (default bench/results/"
                    "published.json, or published_quick.json with --quick)")
    args = ap.parse_args(argv)

    data = load_runs()
    runs = list(data.runs)
    if args.only:
        runs = [data.get(i) for i in args.only]
    elif args.quick:
        runs = [data.get(i) for i in QUICK]
    t0 = time.perf_counter()
    rows = []
    for run in runs:
        print(f"... {run.id}", file=sys.stderr, flush=True)
        rows.append(bench_run(run, data, free=not args.no_free))
    summary = summarize(rows)
    print_table(rows, summary)
    out_path = args.out or RESULTS / ("published_quick.json" if args.quick else "published.json")
    out = {
        "benchmark": "published",
        "machine": machine(note="2-core machine shared with other work; timings are wall "
                                "seconds of the planner, not of the published runs"),
        "settings": {"data_file": "bench/data/published_runs.json",
                     "unbounded_memory_gib": UNBOUNDED_GIB,
                     "dimensions": {d.name: d.option for d in DIMENSIONS},
                     "runs": [r.id for r in runs], "free_search": not args.no_free},
        "wall_seconds": time.perf_counter() - t0,
        "summary": summary,
        "rows": rows,
    }
    out_path.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out_path.relative_to(ROOT) if out_path.is_relative_to(ROOT) else out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
