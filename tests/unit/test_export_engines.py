"""Exported configurations checked by each engine's own parser or validator.

- Megatron (``megatron-core``, in the ``test`` extras): the exported argument destinations
  become megatron-core's ``TransformerConfig`` (through ``ModelParallelConfig``),
  ``DistributedDataParallelConfig`` and ``OptimizerConfig`` the way Megatron-LM's
  ``core_transformer_config_from_args`` builds them: every destination that names a field of
  the config class, plus the dtypes ``--bf16`` / ``--fp16`` imply. Megatron-LM's training
  argument parser is not part of the megatron-core package, so it is not run.
- DeepSpeed (not in the extras: an sdist that needs torch at build time):
  ``deepspeed.runtime.config.DeepSpeedConfig`` with a model-parallel unit giving the plan's
  data-parallel size, which runs DeepSpeed's batch-size checks.
- torchtitan (not in the extras: it pulls wandb, datasets, tensorboard ...): its
  ``ConfigManager.parse_args`` on the exported lines, over a registered config made of
  torchtitan's own ``TrainingConfig``, ``ParallelismConfig`` and activation-checkpoint
  configs (its ``Trainer`` imports triton, which CPU machines lack); the ``Trainer.Config``
  batch check is repeated here.

Engines that are not installed skip with the reason. To run them all (see
``docs/decisions/export.md``)::

    python -m venv /tmp/exportvenv && ... pip install megatron-core==0.16.1 torchtitan==0.3.0
    DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed==0.19.8
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from hetplan.ir.model import ModelIR
from hetplan.ir.plan import Plan
from hetplan.optimizer.compile import compile as compile_plan
from hetplan.report.export import export_plan

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    """Plans covering the layouts the writers handle differently."""
    ir = ModelIR.load(GOLDEN / "inspect_small.workload.json")

    def make(**kw: Any) -> Plan:
        return compile_plan(ir, "mixed-generations", batch_size=64, **kw)

    return {
        "pp-tp-sp-zero1": make(dp=8, pp=2, tp=2),
        "interleaved": make(dp=8, pp=2, tp=2, schedule="interleaved-1f1b", virtual_stages=2),
        "gpipe-selective-zero2": make(dp=8, pp=2, tp=2, schedule="gpipe", recompute="selective",
                                      zero_stage=2),
        "dp-zero3-full-bf16": make(dp=32, pp=1, tp=1, zero_stage=3, recompute="full",
                                   dtype="bf16"),
    }


# -- Megatron --------------------------------------------------------------------------------
def test_megatron_core_configs(plans: dict[str, Plan]) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (it is in the "
                        "`test` extras: pip install -e '.[test]')")
    import torch
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    def build(cls: Any, args: dict[str, Any], **extra: Any) -> Any:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in args.items() if k in names}, **extra)

    for name, plan in plans.items():
        args = dict(export_plan(plan, "megatron").values)
        lay = plan.layout
        assert lay is not None
        dtype = torch.bfloat16 if args.get("bf16") else (
            torch.float16 if args.get("fp16") else torch.float32)
        if "num_layers_per_virtual_pipeline_stage" in args:  # as Megatron-LM's arguments do
            args["virtual_pipeline_model_parallel_size"] = (
                args["num_layers"] // args["pipeline_model_parallel_size"]
                // args.pop("num_layers_per_virtual_pipeline_stage"))
        cfg = build(TransformerConfig, args, hidden_size=64, num_attention_heads=4,
                    params_dtype=dtype, pipeline_dtype=dtype)
        assert cfg.tensor_model_parallel_size == lay.tp, name
        assert cfg.pipeline_model_parallel_size == lay.pp, name
        assert cfg.sequence_parallel == (lay.sequence_parallel and lay.tp > 1), name
        if lay.virtual_stages > 1:
            vpp = cfg.virtual_pipeline_model_parallel_size
            layout = cfg.pipeline_model_parallel_layout
            assert (vpp or layout.virtual_pipeline_model_parallel_size) == lay.virtual_stages
        if "pipeline_model_parallel_layout" in args:
            assert cfg.pipeline_model_parallel_layout is not None, name
        recompute = {s.recompute for s in plan.stages}
        assert cfg.recompute_granularity == (None if recompute == {"none"} else max(recompute))
        ddp = build(DistributedDataParallelConfig, args,
                    bucket_size=args.get("ddp_bucket_size"))
        assert ddp.use_distributed_optimizer == (lay.zero_stage >= 1), name
        assert ddp.data_parallel_sharding_strategy == {
            0: "no_shard", 1: "no_shard", 2: "optim_grads", 3: "optim_grads_params"}[
                lay.zero_stage], name
        opt = build(OptimizerConfig, args)
        assert (opt.bf16, opt.fp16) == (bool(args.get("bf16")), bool(args.get("fp16")))
        # Megatron derives the micro-batch count from these three
        assert args["global_batch_size"] // (args["micro_batch_size"] * lay.dp) == \
            lay.micro_batches, name


# -- DeepSpeed -------------------------------------------------------------------------------
def test_deepspeed_config(plans: dict[str, Plan], monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (not in the extras: "
                        "DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed==0.19.8)")
    import deepspeed.runtime.config as ds_config

    # DeepSpeedConfig asks the (here uninitialized) process group for its rank before it
    # reads the data-parallel size from the model-parallel unit
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)
    for name, plan in plans.items():
        lay = plan.layout
        assert lay is not None

        class MPU:
            def get_data_parallel_world_size(self) -> int:
                return lay.dp

            def get_model_parallel_world_size(self) -> int:
                return lay.tp

        values = export_plan(plan, "deepspeed").values
        cfg = ds_config.DeepSpeedConfig(dict(values), mpu=MPU())
        assert cfg.world_size == lay.dp
        assert cfg.train_batch_size == lay.micro_batch_size * lay.micro_batches * lay.dp
        assert cfg.train_micro_batch_size_per_gpu == lay.micro_batch_size
        assert cfg.gradient_accumulation_steps == lay.micro_batches
        assert cfg.zero_optimization_stage == values["zero_optimization"]["stage"]
        assert cfg.bfloat16_config.enabled == ("bf16" in values), name
        assert cfg.float16_config.enabled == ("fp16" in values), name
        if "fp16" in values:
            assert cfg.float16_config.loss_scale == 0  # dynamic loss scaling
        if lay.pp > 1:
            assert cfg.pipeline["stages"] == lay.pp
            assert cfg.zero_optimization_stage <= 1  # DeepSpeed's pipeline engine's rule


# -- torchtitan ------------------------------------------------------------------------------
_SECTIONS = '''
from dataclasses import dataclass, field
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import (
    ActivationCheckpointingConfig, SelectiveAC)


@dataclass(kw_only=True, slots=True)
class Sections:
    hf_assets_path: str = "."
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    activation_checkpoint: ActivationCheckpointingConfig = field(
        default_factory=SelectiveAC.Config)


def sections():
    return Sections()
'''


def test_torchtitan_config_manager(plans: dict[str, Plan], tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torchtitan.config", reason="torchtitan is not installed (not in the "
                        "extras: pip install torchtitan==0.3.0)")
    from torchtitan.config import ConfigManager

    (tmp_path / "hetplan_titan_sections.py").write_text(textwrap.dedent(_SECTIONS))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("hetplan_titan_sections", None)
    for name, plan in plans.items():
        lay = plan.layout
        assert lay is not None
        result = export_plan(plan, "torchtitan")
        argv = ["--module", "hetplan_titan_sections", "--config", "sections"]
        cfg = ConfigManager().parse_args(argv + shlex.split(result.content))
        par, tr = cfg.parallelism, cfg.training
        assert par.data_parallel_shard_degree * par.data_parallel_replicate_degree == lay.dp
        assert (par.tensor_parallel_degree, par.pipeline_parallel_degree) == (lay.tp, lay.pp)
        assert tr.global_batch_size == lay.micro_batch_size * lay.micro_batches * lay.dp
        if lay.pp > 1:
            assert par.pipeline_parallel_microbatch_size == lay.micro_batch_size
            assert tr.local_batch_size % par.pipeline_parallel_microbatch_size == 0  # Trainer
            assert tr.local_batch_size // par.pipeline_parallel_microbatch_size == \
                lay.micro_batches
            assert par.module_fqns_per_model_part == \
                result.values["parallelism.module_fqns_per_model_part"]
        else:  # gradient accumulation steps = global / (local x dp)
            assert tr.global_batch_size // (tr.local_batch_size * lay.dp) == lay.micro_batches
        mode = result.values["activation_checkpoint"]
        kind = type(cfg.activation_checkpoint).__qualname__.split(".")[0]
        assert {"none": "NoneType", "full": "FullAC", "selective": "SelectiveAC"}[mode] == kind
