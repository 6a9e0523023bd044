"""Megatron tensor parallelism in the runtime (gloo, CPU, 2 ranks): attention split by heads,
the MLP, the vocabulary-parallel embedding and LM head with the parallel cross-entropy, and
sequence parallelism. After k SGD steps the loss of every step and every parameter (gathered
from the shards) equal a single-process float64 reference (rtol 1e-9, atol 1e-11).

Cases: even heads; uneven heads (3 + 1, the plan's shard sizes for the output projection);
sequence parallelism with an odd sequence length (uneven slices); HF GPT-2 with its tied
embedding / LM head and sequence parallelism. The models run in eval mode (no dropout, whose
masks a split model cannot draw as one process does). The cases of one world size train one
after another in one process group (``reflib.train_plans``): one spawn per world size.
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


def _plan(name: str, sp: bool, heads: tuple[int, int] | None = None, pp: int = 1) -> Plan:
    args, kwargs = zoo_example(name)
    ir = hetplan.capture(zoo_model(name), args, kwargs, name=name)
    plan = hetplan.compile(ir, cpu_cluster(2 * pp), batch_size=BATCH, dtype="fp32",
                           zero_stage=0, dp=1, pp=pp, tp=2, sequence_parallel=sp,
                           micro_batch_size=BATCH // pp)
    assert plan.layout is not None and plan.layout.sequence_parallel is sp
    if heads is None:
        return plan
    tp = plan.tensor_parallel
    group = tp.groups[0]
    extra = tuple(TPLinearShard(name=f"blocks.{i}.attn.proj", split="row", features=64,
                                shard_sizes=(16 * heads[0], 16 * heads[1])) for i in range(4))
    group = group.model_copy(update={"linears": group.linears + extra})
    return plan.model_copy(update={"tensor_parallel": tp.model_copy(update={"groups": (group,)})})


#: label -> (zoo model, sequence length, sequence parallel, attention heads per rank)
TP2_CASES: dict[str, tuple[str, int, bool, tuple[int, int] | None]] = {
    "attention-vocab": ("gpt-test", 16, False, None),
    "uneven-heads": ("gpt-test", 16, False, (3, 1)),
    "sequence-parallel-odd-seq": ("gpt-test", 15, True, None),
    "tiny-gpt2-tied-sp": ("tiny-gpt2", 16, True, None),
}
#: label -> (zoo model, sequence parallel); traced stages fix the sequence length to the zoo
#: example's
PP2_TP2_CASES: dict[str, tuple[str, bool]] = {
    "gpt-test-sp": ("gpt-test", True), "tied-lm": ("tied-lm", False),
    "tiny-gpt2": ("tiny-gpt2", False),
}


def _seq(name: str) -> int:
    return 32 if name == "gpt-test" else 16


@pytest.fixture(scope="module")
def tp2_results() -> list[dict[str, Any]]:
    """Every TP-2 case, one after another in one group of 2 ranks."""
    cases = {label: (name, BATCH, seq, STEPS, _plan(name, sp, heads).to_json())
             for label, (name, seq, sp, heads) in TP2_CASES.items()}
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


@pytest.mark.parametrize("label", list(TP2_CASES))
def test_megatron_tp_equals_reference(tp2_results: list[dict[str, Any]], label: str) -> None:
    name, seq, _, _ = TP2_CASES[label]
    got = case_results(tp2_results, label)
    _check(got, name, seq)
    for g in got:
        assert {"FusedColumnParallelLinear", "VocabParallelEmbedding"} <= set(g["kinds"])
        assert set(g["params"]) >= set(zoo_reference(name, BATCH, seq, STEPS)[1])


def _check(got: list[dict], name: str, seq: int) -> None:
    losses, ref = zoo_reference(name, BATCH, seq, STEPS)
    seen: set[str] = set()
    for g in got:
        assert g["loss_fn"] == "VocabParallelLoss"
        if all(x == x for x in g["losses"]):  # NaN: not the last stage
            assert g["losses"] == pytest.approx(losses, rel=1e-9)
        for n, value in g["params"].items():
            if n in ref:
                torch.testing.assert_close(value, ref[n], **TOL, msg=lambda m, n=n: f"{n}: {m}")
                seen.add(n)
    assert seen == set(ref), f"unchecked: {sorted(set(ref) - seen)}"


@pytest.mark.parametrize("label", list(PP2_TP2_CASES))
def test_pp2_x_tp2_equals_reference(pp2_tp2_results: list[dict[str, Any]], label: str) -> None:
    """PP 2 × TP 2 on 4 ranks; tied-lm's and GPT-2's tied embedding/head is vocabulary-
    parallel on the first and last stage, its gradients summed between them. GPT-2's
    attention is called with several inputs inside its traced stage, so it runs replicated
    there (with a warning); its MLP and vocabulary are split."""
    name, _ = PP2_TP2_CASES[label]
    _check(case_results(pp2_tp2_results, label), name, _seq(name))
