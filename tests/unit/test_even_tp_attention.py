"""``even-tp`` names the attention the runtime cannot split at the plan's ``tp``.

The runtime splits attention by whole heads (key/value groups under GQA) and keeps it whole
on every rank where there are fewer of them than ``tp``; the cost model divides every TP
layer by ``tp``. The pass's note says which modules that is, from the IR's ``split_unit``
(``docs/decisions.md``, "TP resizing pass"). The head counts below come from the zoo models'
configurations, not from the code under test.
"""

from __future__ import annotations

import functools

import pytest

from hetplan import zoo
from hetplan.ir.capture import capture
from hetplan.ir.model import ModelIR
from hetplan.optimizer.compile import compile
from hetplan.passes.even_tp import unsplit_attention


@functools.cache
def _ir(name: str) -> ModelIR:
    args, kwargs = zoo.example_inputs(name, batch=1)
    return capture(zoo.build(name), args, kwargs, name=name)


@pytest.mark.parametrize(("name", "units", "tp", "expected"), [
    # tiny-llama: 4 query heads in 2 key/value groups; tiny-vit: 2 heads; tiny-gpt2: 4 heads
    ("tiny-llama", 2, 2, 0), ("tiny-llama", 2, 4, 2),
    ("tiny-vit", 2, 2, 0), ("tiny-vit", 2, 4, 2),
    ("tiny-gpt2", 4, 4, 0), ("tiny-gpt2", 4, 8, 2),
])
def test_unsplit_attention_counts_heads_or_groups_against_tp(
        name: str, units: int, tp: int, expected: int) -> None:
    found = unsplit_attention(_ir(name), tp)
    assert len(found) == expected  # one module per layer, 2 layers
    assert all(u == units for _, u in found)


def test_no_model_ir_no_finding() -> None:
    assert unsplit_attention(None, 8) == []


def _even_tp_notes(plan_notes: list[tuple[str, tuple[str, ...]]]) -> tuple[str, ...]:
    return next(notes for name, notes in plan_notes if name == "even-tp")


def test_the_plan_says_when_attention_runs_replicated() -> None:
    plan = compile("tiny-vit", "mixed-tp-node", batch_size=16, tp=4)
    notes = _even_tp_notes([(e.name, e.notes) for e in plan.pass_log])
    said = [n for n in notes if "run replicated" in n]
    assert len(said) == 1 and "2 attention module(s)" in said[0] and "tp=4" in said[0]


def test_no_note_where_every_rank_gets_a_head() -> None:
    plan = compile("tiny-vit", "mixed-tp-node", batch_size=16, tp=2)
    notes = _even_tp_notes([(e.name, e.notes) for e in plan.pass_log])
    assert not any("replicated" in n for n in notes)
