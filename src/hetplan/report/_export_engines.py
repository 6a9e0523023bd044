"""The three engine writers behind :func:`hetplan.report.export.export_plan`.

Each writer reads a :class:`~hetplan.report._export_gaps.PlanView` and returns an
:class:`EngineConfig`: the values in the engine's own names, the file text, the parts of the
plan it cannot express (each with the variant that drops it, for pricing) and notes on what
the user supplies. Plan fields are read, never re-searched.

- **DeepSpeed** (0.19): a ``ds_config`` JSON. Pipeline stages are built in the user's
  ``PipelineModule`` (``num_stages``, ``partition_method``), which the config cannot set; the
  ``pipeline`` section carries what ``PipelineEngine`` reads. ZeRO-2/3 do not compose with
  its pipeline engine.
- **Megatron** (Megatron-LM's ``pretrain_gpt.py``, megatron-core 0.16): command-line
  arguments, one per line. Any stage split of a GPT-style stack is expressible with
  ``--pipeline-model-parallel-layout``.
- **torchtitan** (0.3): the overrides its ``ConfigManager`` parses after ``--module`` and
  ``--config`` (0.3 builds its job config in Python and takes ``--section.key value``
  overrides; it reads no TOML), one per line. Stages are expressed with
  ``parallelism.module_fqns_per_model_part`` in its Llama module names.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from hetplan.report._export_gaps import (
    ENGINE_BUCKET_MB,
    RECOMPUTE_ORDER,
    PlanView,
    Unexpressed,
    Variant,
    checkpointing_gaps,
    common_dtype,
    even_stages,
    group_sync_gaps,
    lists_gaps,
    merge_virtual,
    rebalancing_gaps,
    relayout,
    sparse_gaps,
    sync_gaps,
    tp_gaps,
    used_strategies,
    with_recompute,
)
from hetplan.ir.plan_sections import CastSync, Stage

__all__ = ["EngineConfig", "WRITERS", "ENGINES", "gpt_tokens", "titan_fqns"]

MiB = 2**20


@dataclass(frozen=True)
class EngineConfig:
    """What a writer produces: ``values`` in the engine's names (DeepSpeed: the ds_config;
    Megatron: argparse destinations; torchtitan: ``section.key`` overrides), ``content`` the
    file to write, ``unexpressed`` the parts of the plan it cannot express, ``notes`` what
    the user supplies or what is approximated without a price."""

    values: dict[str, Any]
    content: str
    unexpressed: tuple[Unexpressed, ...]
    notes: tuple[str, ...]


# -- shared pieces ------------------------------------------------------------------------
def _strongest(modes: list[str]) -> str:
    return max(modes, key=RECOMPUTE_ORDER.index)


def _recompute_gap(view: PlanView, engine: str, supported: tuple[str, ...],
                   fallback: dict[str, str]) -> tuple[str, list[Unexpressed]]:
    """(the mode exported, gaps): one mode for every stage, the strongest the plan uses,
    mapped through ``fallback`` when the engine lacks it."""
    modes = view.recompute_modes()
    want = _strongest(modes)
    mode = want if want in supported else fallback[want]
    if modes == [mode]:
        return mode, []
    per_stage = ", ".join(f"stage {s.index}: {s.recompute}" for s in view.stages)
    plan_does = (f"recomputation per stage ({per_stage})" if len(modes) > 1
                 else f"{want} recomputation")
    return mode, [Unexpressed(
        "recompute", plan_does, f"{engine} recomputes '{mode}' in every stage",
        lambda v: replace(v, stages=with_recompute(v.stages, mode)))]


def _precision_gap(view: PlanView, engine: str, supported: tuple[str, ...]
                   ) -> tuple[str, list[Unexpressed]]:
    """(the compute dtype exported, gaps): one dtype for every device (the engines run one),
    fp32 where the common dtype is not one the engine trains in."""
    dtypes = sorted(set(view.dtypes.values()))
    common = common_dtype(dtypes) if dtypes else "fp32"
    dtype = common if common in supported else "fp32"
    if dtypes == [dtype] or not dtypes:
        return dtype, []
    per_type = ", ".join(f"{d} on {t}" for t, d in sorted(view.dtypes.items()))
    why = "" if dtype == common else f" ({engine} does not train in {common})"
    return dtype, [Unexpressed(
        "precision", f"computes {per_type}", f"{engine} computes {dtype} everywhere{why}",
        lambda v: replace(v, precision=dtype))]


def _schedule_gap(view: PlanView, engine: str, names: dict[str, str]
                  ) -> tuple[str, list[Unexpressed]]:
    """(the engine's schedule name, gaps); a schedule it lacks runs as 1F1B (interleaving
    dropped: the chunks of a pipeline rank are merged)."""
    lay = view.layout
    if lay.pp == 1:
        return "", []
    if lay.schedule in names:
        return names[lay.schedule], []
    exported = names["1f1b"]
    what = f"the {lay.schedule} pipeline schedule" + (
        f" with {lay.virtual_stages} virtual stages per rank" if lay.virtual_stages > 1 else "")

    def apply(v: Variant) -> Variant:
        stages = v.stages
        if v.layout.virtual_stages > 1:
            stages = merge_virtual(view, stages, v.layout.pp)
        return replace(v, stages=stages,
                       layout=relayout(v.layout, schedule="1f1b", virtual_stages=1))

    return exported, [Unexpressed("schedule", what, f"{engine} runs {exported}"
                                  + (" on merged stages" if lay.virtual_stages > 1 else ""),
                                  apply)]


def _zero_gap(view: PlanView, engine: str, exported: int, how: str) -> list[Unexpressed]:
    z = view.layout.zero_stage
    if exported == z:
        return []
    return [Unexpressed(
        "zero", f"ZeRO-{z} inside each data-parallel group", f"{engine}: {how}",
        lambda v: replace(v, layout=relayout(v.layout, zero_stage=exported)))]


def _even_split_gap(view: PlanView, engine: str, how: str) -> list[Unexpressed]:
    even = even_stages(view)
    if even is None or [(s.first_layer, s.last_layer) for s in even] == \
            [(s.first_layer, s.last_layer) for s in view.stages]:
        return []
    sizes = [s.last_layer - s.first_layer + 1 for s in view.stages]

    def apply(v: Variant) -> Variant:
        # after a schedule change the variant may have fewer (merged) stages
        st = even_stages(replace(view, stages=v.stages), len(v.stages))
        return v if st is None else replace(v, stages=st)

    return [Unexpressed("uneven-stages", f"stages of {sizes} layers (chosen per device speed)",
                        f"{engine}: {how}", apply)]


def _common_gaps(view: PlanView, engine: str, *, cast: str = "no",
                 bucket_knob: str = "") -> list[Unexpressed]:
    return (lists_gaps(view, engine=engine) + tp_gaps(view, engine=engine)
            + sync_gaps(view, engine=engine, cast=cast,  # type: ignore[arg-type]
                        bucket_knob=bucket_knob)
            + sparse_gaps(view, engine=engine) + rebalancing_gaps(view, engine=engine)
            + group_sync_gaps(view, engine=engine) + checkpointing_gaps(view, engine=engine))


def gpt_tokens(view: PlanView, stages: tuple[Stage, ...]) -> list[str] | None:
    """Megatron's pipeline layout of ``stages``: per stage ``E`` (embedding), one ``t`` per
    transformer block, ``L`` (output layer and loss); norms are not listed. None when the
    model is not an embedding–blocks–head stack or a stage puts the embedding after the
    first stage or the head before the last."""
    kinds = view.kinds
    if not {"embedding", "block", "head"} <= set(kinds) or \
            set(kinds) - {"embedding", "block", "norm", "head"}:
        return None
    out = []
    for k, st in enumerate(stages):
        span = kinds[st.first_layer:st.last_layer + 1]
        if ("embedding" in span and k != 0) or ("head" in span and k != len(stages) - 1):
            return None
        out.append(("E" if "embedding" in span else "") + "t" * span.count("block")
                   + ("L" if "head" in span else ""))
    return out


def titan_fqns(view: PlanView, stages: tuple[Stage, ...]) -> list[list[str]] | None:
    """torchtitan's ``module_fqns_per_model_part`` of ``stages`` in its Llama names
    (``tok_embeddings``, ``layers.N``, ``norm``, ``output``); None when the model is not
    such a stack."""
    kinds = view.kinds
    if gpt_tokens(view, stages) is None:
        return None
    names: list[str] = []
    block = 0
    for k in kinds:
        if k == "block":
            names.append(f"layers.{block}")
            block += 1
        else:
            names.append({"embedding": "tok_embeddings", "head": "output"}.get(k, "norm"))
    out = []
    for st in stages:
        part = list(dict.fromkeys(names[st.first_layer:st.last_layer + 1]))
        out.append(part)
    return out


def _not_gpt_note(view: PlanView, engine: str) -> list[str]:
    if gpt_tokens(view, view.stages) is not None:
        return []
    return [f"the model is not an embedding-blocks-head stack: {engine}'s GPT layer names "
            "cannot place its layers; the stage split is priced at an even split"]


# -- DeepSpeed ------------------------------------------------------------------------------
def deepspeed(view: PlanView) -> EngineConfig:
    """A ds_config for ``deepspeed.initialize`` (see the module docstring)."""
    lay = view.layout
    eng = "DeepSpeed"
    gaps: list[Unexpressed] = []
    notes: list[str] = []
    schedule, g = _schedule_gap(view, eng, {"1f1b": "1F1B"})
    gaps += g
    if lay.pp > 1:
        gaps += _even_split_gap(view, eng, "PipelineModule(partition_method='uniform') "
                                           "splits the blocks evenly")
    mode, g = _recompute_gap(view, eng, ("none", "full"), {"selective": "full"})
    gaps += g
    zero = min(lay.zero_stage, 1) if lay.pp > 1 else lay.zero_stage
    gaps += _zero_gap(view, eng, zero, f"ZeRO-{zero} (ZeRO-2/3 do not compose with its "
                                       "pipeline engine)")
    dtype, g = _precision_gap(view, eng, ("fp32", "bf16", "fp16"))
    gaps += g
    if lay.sequence_parallel:
        gaps.append(Unexpressed(
            "sequence-parallel", "Megatron sequence parallelism (norms and dropouts on 1/tp "
                                 "of the sequence)",
            f"{eng} has no Megatron-style sequence parallelism (Ulysses is another scheme)",
            lambda v: replace(v, layout=relayout(v.layout, sequence_parallel=False))))
    gaps += _common_gaps(view, eng, cast="uniform", bucket_knob="zero_optimization."
                                                                "reduce_bucket_size")
    bucket = int(ENGINE_BUCKET_MB * MiB // 4)  # elements of fp32 gradient
    cfg: dict[str, Any] = {
        "train_batch_size": view.global_batch,
        "train_micro_batch_size_per_gpu": lay.micro_batch_size,
        "gradient_accumulation_steps": lay.micro_batches,
        "zero_optimization": {"stage": zero, "reduce_bucket_size": bucket},
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16,
                       "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}
    if mode == "full":
        cfg["activation_checkpointing"] = {"partition_activations": lay.tp > 1,
                                           "contiguous_memory_optimization": False,
                                           "cpu_checkpointing": False}
    if lay.pp > 1:
        cfg["pipeline"] = {"stages": lay.pp, "partition": "uniform",
                           "activation_checkpoint_interval": 1 if mode == "full" else 0}
        notes.append(f"build the model as PipelineModule(layers, num_stages={lay.pp}, "
                     f"partition_method='uniform'{', activation_checkpoint_interval=1' if mode == 'full' else ''})")
    if lay.tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": lay.tp}
        notes.append(f"tensor parallelism through AutoTP training (tensor_parallel.autotp_size="
                     f"{lay.tp}); with pipeline stages DeepSpeed needs a model-parallel unit "
                     "(mpu) from the user's model code")
    sync = view.plan.gradient_sync
    if sync is not None:
        casts = {s.dtype for s in used_strategies(sync).values() if isinstance(s, CastSync)}
        if len(casts) == 1 and all(isinstance(s, CastSync)
                                   for s in used_strategies(sync).values()):
            cfg["communication_data_type"] = next(iter(casts))
    notes.append("you supply: the model, optimizer, scheduler and data (ds_config sets "
                 "batching, ZeRO, precision and the pipeline engine)")
    text = json.dumps(cfg, indent=2, sort_keys=True) + "\n"
    return EngineConfig(cfg, text, tuple(gaps), tuple(notes))


# -- Megatron -------------------------------------------------------------------------------
def megatron(view: PlanView) -> EngineConfig:
    """Arguments of Megatron-LM's ``pretrain_gpt.py`` (see the module docstring)."""
    lay = view.layout
    eng = "Megatron"
    gaps: list[Unexpressed] = []
    notes: list[str] = _not_gpt_note(view, eng)
    names = {"1f1b": "1F1B", "interleaved-1f1b": "interleaved 1F1B"}
    _, g = _schedule_gap(view, eng, names)
    gaps += g
    stages = view.stages
    if g and lay.virtual_stages > 1:
        stages = merge_virtual(view, stages, lay.pp)
    tokens = gpt_tokens(view, stages)
    if lay.pp > 1 and tokens is None:
        gaps += _even_split_gap(view, eng, "the blocks split evenly")
    mode, g = _recompute_gap(view, eng, RECOMPUTE_ORDER, {})
    gaps += g
    dtype, g = _precision_gap(view, eng, ("fp32", "bf16", "fp16"))
    gaps += g
    gaps += _common_gaps(view, eng, bucket_knob="--ddp-bucket-size")
    v = lay.virtual_stages if not any(x.part == "schedule" for x in gaps) else 1
    args: dict[str, Any] = {
        "num_layers": view.num_blocks,
        "tensor_model_parallel_size": lay.tp,
        "pipeline_model_parallel_size": lay.pp,
    }
    if lay.pp > 1 and tokens is not None:
        n = len(tokens)
        even = view.num_blocks % n == 0 and tokens == [
            ("E" if k == 0 else "") + "t" * (view.num_blocks // n) + ("L" if k == n - 1 else "")
            for k in range(n)]
        if not even:
            args["pipeline_model_parallel_layout"] = "|".join(tokens)
        elif v > 1:
            args["num_layers_per_virtual_pipeline_stage"] = view.num_blocks // n
    args["micro_batch_size"] = lay.micro_batch_size
    args["global_batch_size"] = view.global_batch
    if lay.sequence_parallel and lay.tp > 1:
        args["sequence_parallel"] = True
    if mode == "selective":
        args["recompute_granularity"] = "selective"
    elif mode == "full":
        args.update(recompute_granularity="full", recompute_method="uniform",
                    recompute_num_layers=1)
    z = lay.zero_stage
    if z == 1:
        args["use_distributed_optimizer"] = True
    elif z >= 2:  # Megatron-FSDP and the flags its documentation requires with it
        args["use_megatron_fsdp"] = True
        args["data_parallel_sharding_strategy"] = {2: "optim_grads", 3: "optim_grads_params"}[z]
        args["use_distributed_optimizer"] = True
        args["no_gradient_accumulation_fusion"] = True
        args["ckpt_format"] = "fsdp_dtensor"
    if dtype == "bf16":
        args["bf16"] = True
    elif dtype == "fp16":
        args["fp16"] = True  # no --loss-scale: dynamic loss scaling
    prec = view.plan.precision
    if dtype != "fp32" and prec is not None and prec.grad_reduce_dtype == "fp32":
        args["accumulate_allreduce_grads_in_fp32"] = True
    if view.plan.gradient_sync is not None:
        args["ddp_bucket_size"] = int(ENGINE_BUCKET_MB * MiB // 4)
    notes.append("you supply: the model shape (--hidden-size, --num-attention-heads, "
                 "--seq-length, --max-position-embeddings), data, tokenizer and optimizer "
                 "arguments")
    lines = []
    for key, val in args.items():
        flag = "--" + key.replace("_", "-")
        lines.append(flag if val is True else f"{flag} {val}")
    return EngineConfig(args, "\n".join(lines) + "\n", tuple(gaps), tuple(notes))


# -- torchtitan -----------------------------------------------------------------------------
#: torchtitan's names of the plan's schedules.
TITAN_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B"}


def torchtitan(view: PlanView) -> EngineConfig:
    """torchtitan 0.3 ``ConfigManager`` overrides (see the module docstring)."""
    lay = view.layout
    eng = "torchtitan"
    gaps: list[Unexpressed] = []
    notes: list[str] = _not_gpt_note(view, eng)
    schedule, g = _schedule_gap(view, eng, TITAN_SCHEDULES)
    gaps += g
    stages = view.stages
    if g and lay.virtual_stages > 1:
        stages = merge_virtual(view, stages, lay.pp)
    fqns = titan_fqns(view, stages)
    if lay.pp > 1 and fqns is None:
        gaps += _even_split_gap(view, eng, "its default split of the layers")
    mode, g = _recompute_gap(view, eng, RECOMPUTE_ORDER, {})
    gaps += g
    if mode == "selective":
        notes.append("torchtitan's selective activation checkpointing is per operator (it "
                     "also recomputes every second matmul), not the plan's attention-core "
                     "recomputation; not priced")
    z = lay.zero_stage
    zero = 2 if z == 1 else z
    gaps += _zero_gap(view, eng, zero, "FSDP without resharding after forward (ZeRO-2's "
                                       "memory and traffic; torchtitan has no optimizer-only "
                                       "sharding)")
    dtype, g = _precision_gap(view, eng, ("fp32", "bf16"))
    gaps += g
    gaps += _common_gaps(view, eng)
    if view.plan.gradient_sync is not None and not any(x.part == "fusion-buckets" for x in gaps):
        notes.append("torchtitan communicates per FSDP unit (one per block); its buckets are "
                     "priced as 25 MiB size-capped buckets")
    pp = lay.pp > 1
    local = lay.micro_batch_size * (lay.micro_batches if pp else 1)
    vals: dict[str, Any] = {
        "parallelism.data_parallel_replicate_degree": 1 if zero else lay.dp,
        "parallelism.data_parallel_shard_degree": lay.dp if zero else 1,
    }
    if zero:
        vals["parallelism.fsdp_reshard_after_forward"] = "always" if zero == 3 else "never"
    vals["parallelism.tensor_parallel_degree"] = lay.tp
    if lay.tp > 1:
        vals["parallelism.enable_sequence_parallel"] = lay.sequence_parallel
    vals["parallelism.pipeline_parallel_degree"] = lay.pp
    if pp:
        vals["parallelism.pipeline_parallel_schedule"] = schedule
        vals["parallelism.pipeline_parallel_microbatch_size"] = lay.micro_batch_size
        if fqns is not None:
            vals["parallelism.module_fqns_per_model_part"] = fqns
    vals["training.local_batch_size"] = local
    vals["training.global_batch_size"] = view.global_batch
    vals["training.mixed_precision_param"] = "bfloat16" if dtype == "bf16" else "float32"
    vals["activation_checkpoint"] = mode
    notes.append("you supply: --module and --config (the model and its registered "
                 "config), data and optimizer; these lines follow them on the command line")
    lines = []
    for key, val in vals.items():
        if key == "activation_checkpoint":
            continue
        if isinstance(val, bool):
            section, _, name = key.rpartition(".")
            lines.append(f"--{key}" if val else f"--{section}.no-{name}")
        elif isinstance(val, list):  # list[list[str]]: one comma-joined word per part
            lines.append(f"--{key} " + " ".join(",".join(part) for part in val))
        else:
            lines.append(f"--{key} {val}")
    lines.append(f"activation-checkpoint:{mode}")  # a tyro subcommand: it comes last
    return EngineConfig(vals, "\n".join(lines) + "\n", tuple(gaps), tuple(notes))


WRITERS: dict[str, Callable[[PlanView], EngineConfig]] = {
    "deepspeed": deepspeed,
    "megatron": megatron,
    "torchtitan": torchtitan,
}
ENGINES = tuple(sorted(WRITERS))
