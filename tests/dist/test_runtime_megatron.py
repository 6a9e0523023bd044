"""Megatron tensor parallelism in the runtime (gloo, CPU, 2 ranks): attention split by heads,
the MLP, the vocabulary-parallel embedding and LM head with the parallel cross-entropy, and
sequence parallelism. After k SGD steps the loss of every step and every parameter (gathered
from the shards) equal a single-process float64 reference (rtol 1e-9, atol 1e-11).

Cases: even heads; uneven heads (3 + 1, the plan's shard sizes for the output projection);
sequence parallelism with an odd sequence length (uneven slices); HF GPT-2 with its tied
embedding / LM head and sequence parallelism; separate q/k/v projections: HF Llama and
Mistral with grouped-query attention (whole key/value groups per rank; Mistral with sequence
parallelism and an odd sequence), HF OPT with even heads and with the plan's uneven 3 + 1
heads (OPT's padding row of the vocabulary-parallel embedding gets no gradient), and with
a plan that gives one rank no head (replicated); HF BERT (q/k/v under ``attention.self``, the
output projection under ``attention.output``; without sequence parallelism, which keeps its
attention replicated) with its vocabulary-parallel LM head, whose bias alias
``cls.predictions.bias`` is held to the reference too; HF ViT (an image classifier, no
vocabulary) with one head per rank, and with the plan's skewed sizes that would split a head
(replicated); HF T5 (attention replicated, its encoder's and decoder's lookups of the
shared table vocabulary-parallel); hetplan's MegatronBlock (a whole layer holding the fused
QKV projection: split by heads, replicated under sequence parallelism); PP 2 x TP 2 of
GPT-2-style models, hetplan's MegatronGPT (its blocks' attention split by heads) and HF
Llama. The models run in eval mode (no dropout, whose masks a split model cannot draw as one
process does). The cases of one world size train one after another in one process group
(``reflib.train_plans``): one spawn per world size.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from reflib import (case_results, cpu_cluster, train_plans, zoo_example, zoo_model,
                    zoo_reference)

import hetplan
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import TPLinearShard
from hetplan.profiling._spawn import run_local_ranks

pytestmark = pytest.mark.dist

STEPS = 2
BATCH = 4
TOL = {"rtol": 1e-9, "atol": 1e-11}


def _plan(name: str, sp: bool, sizes: tuple[int, int] | None = None, pp: int = 1) -> Plan:
    """The planner's plan at tp 2; ``sizes``: the attention output projection's shard sizes
    (features) to ask for instead (and its q/k/v projections' where the planner lists them
    as a pair)."""
    args, kwargs = zoo_example(name)
    ir = hetplan.capture(zoo_model(name), args, kwargs, name=name)
    plan = hetplan.compile(ir, cpu_cluster(2 * pp), batch_size=BATCH, dtype="fp32",
                           zero_stage=0, dp=1, pp=pp, tp=2, sequence_parallel=sp,
                           micro_batch_size=BATCH // pp)
    assert plan.layout is not None and plan.layout.sequence_parallel is sp
    if sizes is None:
        return plan
    tp = plan.tensor_parallel
    group = tp.groups[0]
    if name in ATTENTION:  # the attention pair q, k, v -> out, as the planner lists it
        module, *names = ATTENTION[name]
        width = int(zoo_model(name).get_submodule(f"{module.format(i=0)}.{names[-1]}")
                    .in_features)
        extra = tuple(TPLinearShard(name=f"{module.format(i=i)}.{n}",
                                    split="row" if n == names[-1] else "column",
                                    features=width, shard_sizes=sizes)
                      for i in range(2) for n in names)
    else:
        extra = tuple(TPLinearShard(name=f"blocks.{i}.attn.proj", split="row", features=64,
                                    shard_sizes=sizes) for i in range(4))
    asked = {x.name for x in extra}
    linears = tuple(x for x in group.linears if x.name not in asked) + extra
    group = group.model_copy(update={"linears": linears})
    return plan.model_copy(update={"tensor_parallel": tp.model_copy(update={"groups": (group,)})})


#: separate q/k/v projections: label -> (zoo model, sequence length, sequence parallel,
#: the plan's shard sizes (features) of the attention or None, (query, key/value) heads per
#: rank expected); heads of 16 features
QKV_CASES: dict[str, tuple[str, int, bool, tuple[int, int] | None,
                           tuple[tuple[int, int], tuple[int, int]]]] = {
    "tiny-llama-gqa": ("tiny-llama", 16, False, None, ((2, 2), (1, 1))),
    "tiny-mistral-gqa-sp-odd-seq": ("tiny-mistral", 15, True, None, ((2, 2), (1, 1))),
    "tiny-opt": ("tiny-opt", 16, False, None, ((2, 2), (2, 2))),
    "tiny-opt-uneven-heads": ("tiny-opt", 16, False, (48, 16), ((3, 1), (3, 1))),
    # OPT flattens the tokens to 2-D before its MLP: the sequence gathered as (batch, slice)
    "tiny-opt-sp-odd-seq": ("tiny-opt", 15, True, None, ((2, 2), (2, 2))),
    # the vocabulary-parallel LM head: cls.predictions.bias is its decoder's bias
    "tiny-bert": ("tiny-bert", 16, False, None, ((2, 2), (2, 2))),
    # an image classifier (no sequence length, no vocabulary): 2 heads, one per rank
    "tiny-vit": ("tiny-vit", 0, False, None, ((1, 1), (1, 1))),
}
#: zoo models without a vocabulary to split (their loss stays the given one)
NO_VOCAB = {"tiny-vit"}
#: zoo model -> (attention module of layer {i}, its q, k, v and output projections)
ATTENTION = {
    "tiny-llama": ("model.layers.{i}.self_attn", "q_proj", "k_proj", "v_proj", "o_proj"),
    "tiny-mistral": ("model.layers.{i}.self_attn", "q_proj", "k_proj", "v_proj", "o_proj"),
    "tiny-opt": ("model.decoder.layers.{i}.self_attn", "q_proj", "k_proj", "v_proj",
                 "out_proj"),
    "tiny-bert": ("bert.encoder.layer.{i}.attention", "self.query", "self.key", "self.value",
                  "output.dense"),
    "tiny-vit": ("vit.layers.{i}.attention", "q_proj", "k_proj", "v_proj", "o_proj"),
}
#: label -> (zoo model, sequence length, sequence parallel, the plan's shard sizes (features)
#: of the attention or None)
TP2_CASES: dict[str, tuple[str, int, bool, tuple[int, int] | None]] = {
    "attention-vocab": ("gpt-test", 16, False, None),
    "uneven-heads": ("gpt-test", 16, False, (48, 16)),
    "sequence-parallel-odd-seq": ("gpt-test", 15, True, None),
    "tiny-gpt2-tied-sp": ("tiny-gpt2", 16, True, None),
    # the plan gives rank 1 no head of OPT's attention: it stays replicated (a warning)
    "tiny-opt-no-head-on-a-rank": ("tiny-opt", 16, False, (64, 0)),
    # skewed sizes that split one of ViT's two heads of 16: it stays replicated (a warning)
    "tiny-vit-head-split-by-the-plan": ("tiny-vit", 0, False, (24, 8)),
    # hetplan's MegatronBlock: a whole layer holding the fused QKV (and the MLP)
    "megatron-block": ("megatron-gpt-test", 16, False, None),
    "megatron-block-sp-odd-seq": ("megatron-gpt-test", 15, True, None),
}
#: cases whose attention stays replicated (MegatronBlock, a whole layer, under sequence
#: parallelism too)
REPLICATED = {"tiny-opt-no-head-on-a-rank", "tiny-vit-head-split-by-the-plan",
              "megatron-block-sp-odd-seq"}
TP2_CASES |= {label: case[:4] for label, case in QKV_CASES.items()}
#: HF T5: its attention (a relative position bias per head) stays replicated; ``shared``,
#: ``encoder.embed_tokens`` and ``decoder.embed_tokens`` (three modules on one weight, tied
#: to ``lm_head``) are one vocabulary-parallel embedding
T5_CASE = "tiny-t5-vocab"
TP2_CASES[T5_CASE] = ("tiny-t5", 16, False, None)
#: label -> (zoo model, sequence parallel); traced stages fix the sequence length to the zoo
#: example's
PP2_TP2_CASES: dict[str, tuple[str, bool]] = {
    "gpt-test-sp": ("gpt-test", True), "tied-lm": ("tied-lm", False),
    "tiny-gpt2": ("tiny-gpt2", False), "tiny-llama": ("tiny-llama", False),
    "megatron-gpt-test": ("megatron-gpt-test", False),
}


def _seq(name: str) -> int:
    """The zoo example's sequence length (32 for gpt-test and megatron-gpt-test, 16 for the
    others), to which a traced pipeline stage is fixed (megatron-gpt-test's position slice)."""
    return int(zoo_example(name)[0][0].shape[1])


@pytest.fixture(scope="module")
def tp2_results() -> list[dict[str, Any]]:
    """Every TP-2 case, one after another in one group of 2 ranks."""
    cases = {label: (name, BATCH, seq, STEPS, _plan(name, sp, sizes).to_json())
             for label, (name, seq, sp, sizes) in TP2_CASES.items()}
    return run_local_ranks(train_plans, 2, (cases,), timeout_s=600, threads_per_process=1)


@pytest.fixture(scope="module")
def pp2_tp2_results() -> list[dict[str, Any]]:
    """Every PP 2 x TP 2 case, one after another in one group of 4 ranks."""
    cases = {}
    for label, (name, sp) in PP2_TP2_CASES.items():
        plan = _plan(name, sp, pp=2)
        assert plan.layout is not None and (plan.layout.pp, plan.layout.tp) == (2, 2)
        cases[label] = (name, BATCH, _seq(name), STEPS, plan.to_json())
    return run_local_ranks(train_plans, 4, (cases,), timeout_s=600, threads_per_process=1)


@pytest.mark.parametrize("label", [k for k in TP2_CASES
                                   if k not in QKV_CASES and k != T5_CASE])
def test_megatron_tp_equals_reference(tp2_results: list[dict[str, Any]], label: str) -> None:
    name, seq, _, _ = TP2_CASES[label]
    got = case_results(tp2_results, label)
    _check(got, name, seq)
    for g in got:
        if label in REPLICATED and name not in ATTENTION:
            assert "FusedColumnParallelLinear" not in g["kinds"]
        elif label in REPLICATED:
            module, q, *_ = ATTENTION[name]
            assert f"{module.format(i=0)}.{q}" not in g["shapes"]
        else:
            assert {"FusedColumnParallelLinear", "VocabParallelEmbedding"} <= set(g["kinds"])
        assert set(g["params"]) >= set(zoo_reference(name, BATCH, seq, STEPS)[1])


@pytest.mark.parametrize("label", list(QKV_CASES))
def test_separate_qkv_attention_split_by_heads(tp2_results: list[dict[str, Any]],
                                               label: str) -> None:
    """Separate q/k/v projections are split by whole heads (whole key/value groups with
    GQA): each rank's shards are its heads' rows, and training equals the reference."""
    name, seq, _, _, (q_heads, kv_heads) = QKV_CASES[label]
    got = case_results(tp2_results, label)
    _check(got, name, seq)
    module, q, k, v, out = ATTENTION[name]
    _, ref = zoo_reference(name, BATCH, seq, STEPS)
    width = ref[f"{module.format(i=0)}.{out}.weight"].shape[0]  # the model's hidden size
    for rank, g in enumerate(got):
        for i in range(2):
            attn = module.format(i=i)
            assert g["shapes"][f"{attn}.{q}"] == (16 * q_heads[rank], width)
            assert g["shapes"][f"{attn}.{k}"] == (16 * kv_heads[rank], width)
            assert g["shapes"][f"{attn}.{v}"] == (16 * kv_heads[rank], width)
            assert g["shapes"][f"{attn}.{out}"] == (width, 16 * q_heads[rank])
        if name not in NO_VOCAB:
            assert "VocabParallelEmbedding" in g["kinds"]


def test_t5_vocabulary_split_with_its_attention_replicated(
        tp2_results: list[dict[str, Any]]) -> None:
    """Every lookup of T5's split vocabulary (the encoder's and the decoder's) is
    vocabulary-parallel: training equals the reference, the shared table and its aliases
    included; no attention projection is split."""
    got = case_results(tp2_results, T5_CASE)
    _check(got, "tiny-t5", 16)
    for g in got:
        assert "VocabParallelEmbedding" in g["kinds"]
        assert g["shapes"]["shared"] == (256, 32)  # 512 ids, half per rank
        assert not [n for n in g["shapes"] if "Attention." in n]


def _check(got: list[dict], name: str, seq: int) -> None:
    losses, ref = zoo_reference(name, BATCH, seq, STEPS)
    seen: set[str] = set()
    for g in got:
        assert g["loss_fn"] == ("VocabParallelLoss" if name not in NO_VOCAB else "function")
        if all(x == x for x in g["losses"]):  # NaN: not the last stage
            assert g["losses"] == pytest.approx(losses, rel=1e-9)
        for n, value in g["params"].items():
            if n in ref:
                torch.testing.assert_close(value, ref[n], **TOL, msg=lambda m, n=n: f"{n}: {m}")
                seen.add(n)
    model = zoo_model(name)  # tied names the runtime lists once: checked under the other
    aliases = ({n for n, _ in model.named_parameters(remove_duplicate=False)}
               - {n for n, _ in model.named_parameters()})
    assert seen | aliases == set(ref), f"unchecked: {sorted(set(ref) - seen - aliases)}"


@pytest.mark.parametrize("label", list(PP2_TP2_CASES))
def test_pp2_x_tp2_equals_reference(pp2_tp2_results: list[dict[str, Any]], label: str) -> None:
    """PP 2 × TP 2 on 4 ranks; tied-lm's and GPT-2's tied embedding/head is vocabulary-
    parallel on the first and last stage, its gradients summed between them. GPT-2's
    attention is called with several inputs inside its traced stage, so it runs replicated
    there (with a warning); its MLP and vocabulary are split. MegatronGPT's blocks (kept
    whole in the traced stages) have their fused QKV split by heads."""
    name, _ = PP2_TP2_CASES[label]
    got = case_results(pp2_tp2_results, label)
    _check(got, name, _seq(name))
    if name == "megatron-gpt-test":  # each block's attention split by heads (2 of 4 per rank)
        for g in got:
            for i in range(4):
                assert g["shapes"][f"blocks.{i}.qkv"] == (96, 64)
                assert g["shapes"][f"blocks.{i}.out_proj"] == (64, 32)
