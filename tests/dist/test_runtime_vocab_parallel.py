"""The plan says whether the LM head is vocabulary-parallel, and the runtime does exactly that
(gloo, CPU, 2 ranks, tp 2, HF tiny GPT-2 with its tied embedding / LM head, float64, eval
mode, 2 SGD steps).

- ``split`` (compiled with the default ``vocab_parallel=True``): the embedding is a
  ``VocabParallelEmbedding`` and the loss the parallel cross-entropy;
- ``whole`` (compiled with ``vocab_parallel=False``): no vocabulary shard, the plain loss;
- ``unstated`` (the same plan as an older hetplan wrote it, ``"vocab_parallel": false``):
  split, as the runtime always ran such plans.

In each case the loss of every step and every parameter (shards gathered) equal the
single-process reference (rtol 1e-9, atol 1e-11).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from reflib import (case_results, cpu_cluster, train_plans, zoo_example, zoo_model,
                    zoo_reference)

import hetplan
from hetplan.ir.plan import Plan
from hetplan.profiling._spawn import run_local_ranks

pytestmark = pytest.mark.dist

NAME, STEPS, BATCH, SEQ = "tiny-gpt2", 2, 4, 16
TOL = {"rtol": 1e-9, "atol": 1e-11}


def _plan(vocab_parallel: bool) -> Plan:
    args, kwargs = zoo_example(NAME)
    ir = hetplan.capture(zoo_model(NAME), args, kwargs, name=NAME)
    return hetplan.compile(ir, cpu_cluster(2), batch_size=BATCH, dtype="fp32", zero_stage=0,
                           dp=1, pp=1, tp=2, sequence_parallel=False,
                           micro_batch_size=BATCH, vocab_parallel=vocab_parallel)


def _legacy(plan: Plan) -> str:
    """``plan`` as a hetplan before the plan stated it wrote it: ``vocab_parallel: false``."""
    data = json.loads(plan.to_json())
    data["cost_settings"]["vocab_parallel"] = False
    return json.dumps(data)


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    split, whole = _plan(True), _plan(False)
    return {"split": split, "whole": whole, "unstated": Plan.from_json(_legacy(split))}


@pytest.fixture(scope="module")
def results(plans: dict[str, Plan]) -> list[dict[str, Any]]:
    cases = {label: (NAME, BATCH, SEQ, STEPS, p.to_json()) for label, p in plans.items()}
    return run_local_ranks(train_plans, 2, (cases,), timeout_s=600, threads_per_process=1)


def test_the_plan_states_the_split(plans: dict[str, Plan]) -> None:
    said = {k: p.cost_settings.vocab_parallel for k, p in plans.items() if p.cost_settings}
    assert said == {"split": "split", "whole": "whole", "unstated": "unstated"}
    # the split plan is priced with the head's weight and logits divided over the 2 ranks
    split, whole = plans["split"].predictions, plans["whole"].predictions
    assert split is not None and whole is not None
    assert max(split.memory_per_rank_bytes) < max(whole.memory_per_rank_bytes)


@pytest.mark.parametrize("label,split", [("split", True), ("whole", False),
                                         ("unstated", True)])
def test_runtime_does_what_the_plan_says(results: list[dict[str, Any]], label: str,
                                         split: bool) -> None:
    losses, ref = zoo_reference(NAME, BATCH, SEQ, STEPS)
    for g in case_results(results, label):
        assert ("VocabParallelEmbedding" in g["kinds"]) is split
        assert (g["loss_fn"] == "VocabParallelLoss") is split
        assert g["losses"] == pytest.approx(losses, rel=1e-9)
        seen = set()
        for n, value in g["params"].items():
            if n in ref:
                torch.testing.assert_close(value, ref[n], **TOL, msg=lambda m, n=n: f"{n}: {m}")
                seen.add(n)
        # unsplit, the runtime lists the tied head's weight once, as the embedding's
        tied = set() if split else {"lm_head.weight"}
        assert set(ref) - seen <= tied, f"unchecked: {sorted(set(ref) - seen)}"
