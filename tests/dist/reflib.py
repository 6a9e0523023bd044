"""Single-process references and the rank function that the runtime-equality tests share.

Three families:

- zoo language models (``gpt-test``, ``tied-lm``, ``tiny-gpt2``, ...) and image classifiers
  (``tiny-vit``) in float64 and eval mode, trained with SGD on next-token batches (labelled
  random images: :func:`zoo_data`) (``test_runtime_megatron.py``,
  ``test_runtime_pp_tied.py``): :func:`zoo_reference` trains one process, :func:`train_plans`
  trains several compiled plans one after another inside one process group (one spawn per
  world size, not one per plan) and returns what each rank ended with;
- a 2-layer :class:`~hetplan.models.MegatronGPT` trained with Adam (fp64) or SGD with
  momentum (bf16) on 2 ranks (``test_runtime_strategies.py``,
  ``test_runtime_pp_strategies.py``): :func:`gpt_reference` is the full-batch recipe;
- heterogeneous plans (``test_runtime_hetero*.py``): :func:`searched_hetero` is the plan
  ``hetplan plan --hetero on`` searches for a float64 zoo model on a fixture cluster,
  :func:`train_reference` the single-process run it is held against.

Models are built from a seed, so every rank and the reference start from the same weights.
"""

from __future__ import annotations

import copy
import functools
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import hetplan
from hetplan import zoo
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.cluster_presets import PRESET_SPECS
from hetplan.ir.plan import Plan
from hetplan.models import MegatronGPT

SGD_LR = 0.05


class Block(nn.Module):
    """A residual block: ``x + tanh(fc(x))``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Blocks(nn.Module):
    """``n`` residual blocks in a ModuleList and a linear head to 3 outputs (float input, no
    embedding): every stage boundary carries a ``(batch, dim)`` activation, so two
    micro-batches swapped on the wire would go unnoticed by shapes."""

    def __init__(self, dim: int = 8, n: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n))
        self.head = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def cpu_cluster(world: int) -> ClusterSpec:
    """The ``local-cpu`` preset with ``world`` CPU devices."""
    spec = copy.deepcopy(PRESET_SPECS["local-cpu"])
    spec["name"] = f"cpu-{world}"
    spec["nodes"][0]["devices"] = [{"type": "cpu", "count": world}]
    return ClusterSpec.model_validate(spec)


# -- zoo language models ----------------------------------------------------------------------
def zoo_model(name: str) -> nn.Module:
    """The zoo model in float64; eval(): no dropout, whose random masks a split model cannot
    draw as one process does."""
    return zoo.build(name, device="cpu", seed=0, dtype=torch.float64).eval()


def zoo_example(name: str) -> tuple[tuple, dict]:
    """The zoo's example inputs (batch 1), with ``use_cache=False`` where the model takes it."""
    args, kwargs = zoo.example_inputs(name, batch=1, device="cpu")
    return args, ({k: v for k, v in kwargs.items() if k != "use_cache"}
                  | ({"use_cache": False} if "use_cache" in kwargs else {}))


def lm_data(step: int, batch: int, seq: int, *, vocab: int = 64,
            seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s token ids (``vocab`` of them) and their next-token targets."""
    g = torch.Generator().manual_seed(seed + step)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


@functools.cache
def _num_labels(name: str) -> int:
    return int(zoo_model(name).config.num_labels)


def zoo_data(name: str, step: int, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s inputs and targets for zoo model ``name``: next-token batches
    (:func:`lm_data`) for a language model (for an encoder-decoder, ``input_kind``
    ``"seq2seq"``, the inputs are the encoder's ids, an all-ones attention mask and the
    decoder's ids, whose next tokens are the targets); for an image classifier (``input_kind``
    ``"image"``: ``seq`` is unused) float64 pixels [batch, 3, H, W] and class labels
    [batch], which :func:`lm_loss` takes as it is (logits [batch, labels])."""
    kind = zoo.get(name).input_kind
    if kind == "seq2seq":  # HF T5: (input_ids, attention_mask, decoder_input_ids), positional
        ids, _ = lm_data(step, batch, seq)
        dec, target = lm_data(step, batch, seq, seed=101)
        return (ids, torch.ones_like(ids), dec), target
    if kind != "image":
        return lm_data(step, batch, seq)
    (meta,), _ = zoo.example_inputs(name, batch=batch)  # on "meta": the shape only
    g = torch.Generator().manual_seed(7 + step)
    pixels = torch.randn(meta.shape, generator=g, dtype=torch.float64)
    return pixels, torch.randint(0, _num_labels(name), (batch,), generator=g)


def lm_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the logits (a HF output's ``logits``, or a tuple's first item)."""
    out = getattr(out, "logits", out)
    if isinstance(out, (tuple, list)):
        out = out[0]
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def zoo_plan(name: str, world: int, batch: int, **pins: Any) -> Plan:
    """``hetplan.compile`` of zoo model ``name`` for ``world`` CPU ranks, fp32 compute and
    ZeRO-0 unless ``pins`` say otherwise."""
    args, kwargs = zoo_example(name)
    ir = hetplan.capture(zoo_model(name), args, kwargs, name=name)
    pins = {"dtype": "fp32", "zero_stage": 0, **pins}
    return hetplan.compile(ir, cpu_cluster(world), batch_size=batch, **pins)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=SGD_LR)


@functools.cache
def zoo_reference(name: str, batch: int, seq: int, steps: int,
                  ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process trains ``steps`` SGD steps: the loss of each step and every parameter
    (tied ones under each of their names). Computed once per argument tuple; callers must
    not modify what it returns."""
    model = zoo_model(name)
    _, example = zoo_example(name)  # the runtime passes the non-tensor keywords only
    kwargs = {k: v for k, v in example.items() if not isinstance(v, torch.Tensor)}
    opt = sgd(list(model.parameters()))
    losses = []
    for step in range(steps):
        x, y = zoo_data(name, step, batch, seq)
        loss = lm_loss(model(*x, **kwargs) if isinstance(x, tuple) else model(x, **kwargs), y)
        loss.backward()
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
    return losses, {n: p.detach().clone()
                    for n, p in model.named_parameters(remove_duplicate=False)}


def _train_one(name: str, batch: int, seq: int, steps: int, plan_json: str) -> dict[str, Any]:
    from hetplan.runtime.executor import Runtime

    args, kwargs = zoo_example(name)
    rt = Runtime(Plan.from_json(plan_json), zoo_model(name), example_args=args,
                 example_kwargs=kwargs, loss_fn=lm_loss, optimizer=sgd)
    losses = [rt.train_step(*zoo_data(name, step, batch, seq)) for step in range(steps)]
    # ZeRO-3's DTensor shards gathered (a collective over the data-parallel group)
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for n, p in rt.named_params}
    mine = {id(p) for _, p in rt.named_params}  # this rank's stages' parameters
    full: dict[int, torch.Tensor] = {}  # a shard's id -> the full tensor
    for mname, module in rt.model.named_modules():
        if not any(id(p) in mine for p in module.parameters(recurse=False)):
            continue
        if hasattr(module, "gather_weight"):  # a tensor-parallel shard: the full weight
            params[f"{mname}.weight"] = full[id(module.weight)] = module.gather_weight()
            if getattr(module, "bias", None) is not None:
                params[f"{mname}.bias"] = full[id(module.bias)] = module.gather_bias()
    for n, p in rt.model.named_parameters(remove_duplicate=False):  # a shard's other names
        if id(p) in full:  # (HF BERT's cls.predictions.bias is its decoder's bias)
            params[n] = full[id(p)]
    kinds = sorted({type(m).__name__ for m in rt.model.modules() if hasattr(m, "gather_weight")})
    shapes = {n: tuple(m.weight.shape) for n, m in rt.model.named_modules()
              if hasattr(m, "gather_weight")}  # this rank's shards
    out = {"losses": losses, "params": params, "kinds": kinds, "shapes": shapes,
           "loss_fn": type(rt.ctx.loss_fn).__name__}
    rt.close()
    return out


def run_each(cases: dict[str, Any], train: Callable[[Any], dict[str, Any]],
             ) -> dict[str, dict[str, Any]]:
    """``label -> train(case)`` for each case in turn, inside a rank of a process group that
    all cases share. The first case that raises ends the run: its label maps to
    ``{"error": traceback}``, and the cases after it are absent (the ranks' collectives no
    longer line up). :func:`case_results` reads the outcome back per case."""
    out: dict[str, dict[str, Any]] = {}
    for label, case in cases.items():
        try:
            out[label] = train(case)
        except Exception:  # reported to the case's test, which fails with it
            out[label] = {"error": traceback.format_exc()}
            # and now, to stderr: ranks of another pipeline stage may wait on this one until
            # the run times out, and their results (this one's too) never come back
            print(f"{label}:\n{out[label]['error']}", file=sys.stderr, flush=True)
            break
    return out


def train_plans(rank: int, world: int, cases: dict[str, tuple[str, int, int, int, str]],
                ) -> dict[str, dict[str, Any]]:
    """Rank function for :func:`hetplan.profiling._spawn.run_local_ranks`: trains each case
    ``label -> (zoo model, batch, seq, steps, plan JSON)`` in turn (:func:`run_each`) and
    returns, per label, the losses per step (NaN where this rank holds no last stage), its
    parameters (tensor-parallel shards gathered to full tensors), the kinds of parallel
    modules built, the local weight shape of each, and the loss function's class."""
    return run_each(cases, lambda case: _train_one(*case))


def case_results(results: list[dict[str, dict[str, Any]]], label: str) -> list[dict[str, Any]]:
    """Every rank's result of case ``label``; fails with the rank's traceback if it raised, or
    names the case that stopped the run before it."""
    got = []
    for rank, res in enumerate(results):
        if label not in res:
            failed = [k for k, v in res.items() if "error" in v]
            raise AssertionError(f"rank {rank} never ran {label}: {failed} failed before it")
        assert "error" not in res[label], f"rank {rank}, {label}:\n{res[label]['error']}"
        got.append(res[label])
    return got


# -- heterogeneous plans (test_runtime_hetero*.py) -----------------------------------------
#: the fixture clusters the heterogeneous runtime tests plan for
CLUSTERS = Path(__file__).parents[1] / "fixtures" / "clusters"


def zoo_ids(name: str) -> tuple[torch.Tensor, ...]:
    """The zoo's example positional inputs (batch 1): the token ids of a language model."""
    return tuple(zoo.example_inputs(name, batch=1, device="cpu")[0])


def searched_hetero(name: str, cluster: Path, batch: int, **compile_kw: Any) -> Plan:
    """The plan ``hetplan plan --hetero on`` searches for the float64 zoo model ``name``
    (whose fingerprint the runtime checks) on the cluster file ``cluster`` at global batch
    ``batch``: ``compile`` (fp32; ``compile_kw`` added) then ``choose_hetero(..., "on")``."""
    from hetplan.optimizer.hetero import choose_hetero

    spec = ClusterSpec.load(cluster)
    ir = hetplan.capture(zoo_model(name), zoo_ids(name), name=name)
    plan = hetplan.compile(ir, spec, batch_size=batch, dtype="fp32", **compile_kw)
    return choose_hetero(plan, spec, None, batch, "on")


def train_reference(name: str, data: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                    steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process trains the float64 zoo model ``name`` for ``steps`` steps on
    ``data(step)`` (ids, next-token targets) with the token cross-entropy: the loss of each
    step and every parameter at the end."""
    model = zoo_model(name)
    opt = optimizer(list(model.parameters()))
    losses = []
    for step in range(steps):
        ids, y = data(step)
        out = model(ids)
        loss = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        loss.backward()
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


# -- a 2-layer Megatron GPT on 2 ranks --------------------------------------------------------
WORLD, BATCH, SEQ, VOCAB, LR = 2, 8, 8, 64, 1e-2


def gpt_model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return MegatronGPT(vocab_size=VOCAB, max_seq=SEQ, dim=16, n_layers=2, n_heads=2,
                       dropout=0.0).to(dtype)


def gpt_example() -> torch.Tensor:
    return torch.zeros(1, SEQ, dtype=torch.long)


def gpt_batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))


def gpt_optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    """Adam for the fp64 cases; SGD with momentum for bf16, whose update is linear in the
    gradient (Adam's normalisation turns bf16 rounding of near-zero gradients into full
    ``lr``-sized steps of either sign, which no tolerance on the weights can bound)."""
    if kind == "adam":
        return torch.optim.Adam(params, lr=LR)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


@functools.cache
def gpt_reference(dtype: torch.dtype, steps: int, half: torch.dtype | None = None,
                  ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Full-batch training in one process (Adam in fp64, else SGD with momentum); with
    ``half``: 16-bit working weights, autocast forward, fp32 loss, fp32 master weights.
    Computed once per argument tuple; callers must not modify what it returns."""
    master = gpt_model(dtype)
    work = copy.deepcopy(master).to(half) if half is not None else master
    opt = gpt_optimizer("adam" if dtype == torch.float64 else "sgd-momentum",
                        master.parameters())
    losses = []
    for step in range(steps):
        ids = gpt_batch(step)
        with torch.autocast("cpu", dtype=half, enabled=half is not None):
            out = work(ids)
        logits = out.float() if half is not None else out
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids.reshape(-1))
        loss.backward()
        if half is not None:
            for m, w in zip(master.parameters(), work.parameters(), strict=True):
                m.grad = w.grad.float()
                w.grad = None
        opt.step()
        opt.zero_grad()
        if half is not None:
            with torch.no_grad():
                for m, w in zip(master.parameters(), work.parameters(), strict=True):
                    w.copy_(m)
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().double() for n, p in master.named_parameters()}


def assert_params(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                  **tol: float) -> None:
    """``got`` has exactly ``want``'s names, each value within ``tol`` of it."""
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, msg=lambda m: f"{name}: {m}", **tol)
