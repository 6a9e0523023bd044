"""Pipeline stages and schedules on gloo (2 or 4 CPU processes) equal a single-process
reference: the loss of every step and every parameter after 2 SGD steps (float64; the two
steps see different batches, and the second runs on the weights the first updated). The
2-rank cases train one after another in one process group."""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from reflib import Blocks, case_results, run_each
from torch import nn

from hetplan.errors import SpecError, TraceError
from hetplan.ir.capture import capture
from hetplan.ir.plan_sections import Layout, Stage
from hetplan.models import DataDependentGate, DataDependentNet, TiedLM, TinyGPT
from hetplan.profiling._spawn import run_local_ranks
from hetplan.runtime.pipeline import (
    SequentialStageModule,
    build_stage,
    build_stages,
    split_points,
    stage_indices_of_rank,
    tied_across_stages,
)
from hetplan.runtime.schedule import make_schedule
from hetplan.runtime.schedule import step as pp_step

pytestmark = pytest.mark.dist

STEPS = 2
BATCH = 8
MICRO_BATCHES = 4
LR = 0.1
TOL = {"rtol": 1e-10, "atol": 1e-12}


# -- models, data, reference ------------------------------------------------------------------
def _untraceable_sequential() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), DataDependentGate(8), nn.Linear(8, 8),
                         nn.Tanh(), nn.Linear(8, 3))


class Skips(nn.Module):
    """The first layer's output is added back after the third and the fourth: stage 0 of a
    four-stage cut feeds stages 2 and 3 (a float tensor, so its gradient crosses the relay);
    stage 1 does not read it."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.a, self.b, self.c = (nn.Linear(8, 8) for _ in range(4))
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        v = torch.tanh(self.b(torch.tanh(self.a(torch.tanh(h))))) + h
        return self.out(torch.tanh(self.c(v)) + 2 * h)


class _InputSkip(nn.Module):
    """The model's input is read by the first layer and again after the third."""

    def __init__(self, second_input: bool = False) -> None:
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(8, 8) for _ in range(3))
        self.out = nn.Linear(8, 3)
        self.second_input = second_input

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        return self.out(torch.tanh(self.c(h)) + (y if self.second_input else x))


def _lm_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.size(-1)), target.reshape(-1))


@dataclass(frozen=True)
class Case:
    build: Callable[[], nn.Module]
    data: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[Any, Any], torch.Tensor]
    cuts: tuple[int, ...]  # first layer of every stage after the first
    opaque: tuple[str, ...] = ()


CASES = {
    "blocks": Case(Blocks, lambda g: (torch.randn(BATCH, 8, generator=g, dtype=torch.float64),
                                      torch.randn(BATCH, 3, generator=g, dtype=torch.float64)),
                   F.mse_loss, (2,)),
    "gpt": Case(lambda: TinyGPT(64, 16, 32, 4, 4),
                lambda g: (torch.randint(0, 64, (BATCH, 16), generator=g),
                           torch.randint(0, 64, (BATCH, 16), generator=g)),
                _lm_loss, (4,)),
    "seq": Case(_untraceable_sequential,
                lambda g: (torch.randn(BATCH, 6, generator=g, dtype=torch.float64),
                           torch.randn(BATCH, 3, generator=g, dtype=torch.float64)),
                F.mse_loss, (2,), opaque=("2",)),
    "tied": Case(lambda: TiedLM(64, 16, 2),
                 lambda g: (torch.randint(0, 64, (BATCH, 8), generator=g),
                            torch.randint(0, 64, (BATCH, 8), generator=g)),
                 _lm_loss, (2,)),
    "blocks4": Case(Blocks, lambda g: (torch.randn(BATCH, 8, generator=g, dtype=torch.float64),
                                       torch.randn(BATCH, 3, generator=g, dtype=torch.float64)),
                    F.mse_loss, (1, 2, 3)),
    "skips": Case(Skips, lambda g: (torch.randn(BATCH, 8, generator=g, dtype=torch.float64),
                                    torch.randn(BATCH, 3, generator=g, dtype=torch.float64)),
                  F.mse_loss, (1, 2, 3)),
    "input-skip": Case(_InputSkip,
                       lambda g: (torch.randn(BATCH, 8, generator=g, dtype=torch.float64),
                                  torch.randn(BATCH, 3, generator=g, dtype=torch.float64)),
                       F.mse_loss, (1, 2, 3)),
}


def _model(case: str) -> nn.Module:
    torch.manual_seed(0)
    return CASES[case].build().double()


def _data(case: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return CASES[case].data(torch.Generator().manual_seed(100 + step))


@functools.cache
def _reference(case: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model(case)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = _data(case, step)
        loss = CASES[case].loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone()
                    for n, p in model.named_parameters(remove_duplicate=False)}


def _layout(schedule: str, dp: int, pp: int, virtual: int = 1) -> Layout:
    return Layout(dp=dp, pp=pp, micro_batches=MICRO_BATCHES, schedule=schedule,
                  micro_batch_size=BATCH // dp // MICRO_BATCHES, virtual_stages=virtual)


def _stages(case: str, layout: Layout) -> list[Stage]:
    """Stages cut at the case's boundaries; stage s on pipeline coordinate s % pp."""
    example = _data(case, 0)[0][:1]
    names = [lay.name for lay in
             capture(_model(case), example, opaque_modules=CASES[case].opaque).layers]
    bounds = [0, *CASES[case].cuts, len(names)]
    return [Stage(index=s, first_layer=a, last_layer=b - 1, layer_names=tuple(names[a:b]),
                  ranks=tuple(layout.rank_of(d, s % layout.pp, 0) for d in range(layout.dp)))
            for s, (a, b) in enumerate(itertools.pairwise(bounds))]


# -- the multi-process run ----------------------------------------------------------------------
def _train(rank: int, case: str, layout_json: str, stages: list[Stage]) -> dict[str, Any]:
    layout = Layout.model_validate_json(layout_json)
    d, _, _ = layout.coords(rank)
    pp_groups = [dist.new_group([layout.rank_of(i, j, 0) for j in range(layout.pp)])
                 for i in range(layout.dp)]
    dp_groups = [dist.new_group([layout.rank_of(i, j, 0) for i in range(layout.dp)])
                 for j in range(layout.pp)]
    dp_group = dp_groups[layout.coords(rank)[1]]
    model = _model(case)
    shard = slice(d * BATCH // layout.dp, (d + 1) * BATCH // layout.dp)
    micro = _data(case, 0)[0][shard][:layout.micro_batch_size]
    indices = stage_indices_of_rank(stages, rank)
    names = [n for s in stages for n in s.layer_names]
    ties = tied_across_stages(model, stages, names)
    built = build_stages(model, (micro,), None, stages, indices, pp_groups[d], "cpu",
                         allow_cross_stage_ties=True)
    schedule = make_schedule(built if len(built) > 1 else built[0], layout, CASES[case].loss)
    named = [(n, p) for st in built for n, p in st.submod.named_parameters()]
    params = [p for _, p in named]
    opt = torch.optim.SGD(params, lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = _data(case, step)
        loss = pp_step(schedule, indices, len(stages), x[shard], y[shard])
        for tie in ties:  # copies of a tied tensor on several stages: sum their grads
            local = [p for n, p in named if n in tie and p.grad is not None]
            buf = local[0].grad if local else torch.zeros_like(model.get_parameter(tie[0]))
            dist.all_reduce(buf, group=pp_groups[d])
        if layout.dp > 1:  # stand-in for the runtime's gradient sync: average replicas
            for p in params:
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=dp_group)
                    p.grad /= layout.dp
        opt.step()
        opt.zero_grad(set_to_none=False)
        if loss is not None:
            losses.append(float(loss))
    # a traced stage may keep an unused stale alias of a tied tensor: skip it
    stale = {n for n, p in named if p.grad is None and any(n in t for t in ties)}
    trained = {n: p.detach().clone() for n, p in named if n not in stale}
    manual = all(isinstance(st.submod, SequentialStageModule) for st in built)
    return {"losses": losses, "params": trained, "manual": manual}


def _worker(rank: int, world: int, cases: dict[str, tuple[str, str, list[Stage]]],
            ) -> dict[str, dict[str, Any]]:
    """Each case ``label -> (model case, layout JSON, stages)`` in turn, in this one group."""
    return run_each(cases, lambda c: _train(rank, *c))


#: label -> (model case, layout) of the 2-rank runs, all trained in one process group
TWO_RANKS: dict[str, tuple[str, Layout]] = {
    **{f"{case}-{schedule}": (case, _layout(schedule, dp=1, pp=2))
       for case in ("blocks", "gpt") for schedule in ("gpipe", "1f1b")},
    "tied-1f1b": ("tied", _layout("1f1b", dp=1, pp=2)),
    "seq-1f1b": ("seq", _layout("1f1b", dp=1, pp=2)),
    "blocks4-interleaved": ("blocks4", _layout("interleaved-1f1b", dp=1, pp=2, virtual=2)),
    "skips-interleaved": ("skips", _layout("interleaved-1f1b", dp=1, pp=2, virtual=2)),
    "input-skip-interleaved": ("input-skip", _layout("interleaved-1f1b", dp=1, pp=2,
                                                     virtual=2)),
}


def _spawn(runs: dict[str, tuple[str, Layout]]) -> list[dict[str, dict[str, Any]]]:
    world = {layout.num_ranks for _, layout in runs.values()}
    assert len(world) == 1
    cases = {label: (case, layout.model_dump_json(), _stages(case, layout))
             for label, (case, layout) in runs.items()}
    return run_local_ranks(_worker, world.pop(), (cases,), timeout_s=600)


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, dict[str, Any]]]:
    return _spawn(TWO_RANKS)


def _compare(results: list[dict[str, dict[str, Any]]], label: str, case: str,
             layout: Layout) -> list[dict]:
    got = case_results(results, label)
    ref_losses, ref_params = _reference(case)
    last = [g["losses"] for g in got if g["losses"]]
    assert len(last) == layout.dp  # one last-stage rank per replica
    mean = [sum(vals) / len(vals) for vals in zip(*last)]  # replica shards are equal-sized
    assert mean == pytest.approx(ref_losses, rel=TOL["rtol"])
    seen: set[str] = set()
    for g in got:
        for name, value in g["params"].items():
            torch.testing.assert_close(value, ref_params[name], **TOL)
            seen.add(name)
    assert seen == set(ref_params), "every parameter lives on some stage"
    return got


def _compare_two(results: list[dict[str, dict[str, Any]]], label: str) -> list[dict]:
    case, layout = TWO_RANKS[label]
    return _compare(results, label, case, layout)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("case", ["blocks", "gpt"])
def test_two_stages_equal_single_process(two_ranks: list[dict[str, dict[str, Any]]], case: str,
                                         schedule: str) -> None:
    got = _compare_two(two_ranks, f"{case}-{schedule}")
    assert not any(g["manual"] for g in got), "traced stages expected"


def test_tied_embedding_across_stages_with_summed_grads(
        two_ranks: list[dict[str, dict[str, Any]]]) -> None:
    _compare_two(two_ranks, "tied-1f1b")


def test_untraceable_sequential_uses_manual_stages(
        two_ranks: list[dict[str, dict[str, Any]]]) -> None:
    got = _compare_two(two_ranks, "seq-1f1b")
    assert all(g["manual"] for g in got)


def test_interleaved_1f1b_two_chunks_per_rank(two_ranks: list[dict[str, dict[str, Any]]]) -> None:
    _compare_two(two_ranks, "blocks4-interleaved")


def test_tensors_read_past_the_next_stage_are_relayed(
        two_ranks: list[dict[str, dict[str, Any]]]) -> None:
    """Stage 0's output, read by stages 2 and 3, goes through the stages in between (torch's
    schedules send only to the next stage): the same losses and weights as one process."""
    got = _compare_two(two_ranks, "skips-interleaved")
    assert not any(g["manual"] for g in got), "traced stages expected"


def test_relay_leaves_only_adjacent_edges() -> None:
    """The split graph of ``Skips`` cut in four: stage 0 feeds stages 2 and 3 before the
    relay, only stage 1 after; stage 2 forwards the copy it reads itself (sent once)."""
    import operator

    from hetplan.runtime import pipeline as pipeline_mod

    layout = _layout("interleaved-1f1b", dp=1, pp=2, virtual=2)
    stages = _stages("skips", layout)
    names = [n for st in stages for n in st.layer_names]
    pipe, _ = pipeline_mod._trace(_model("skips"), (_data("skips", 0)[0][:2],), None,
                                  split_points(names, stages))

    def sources() -> list[set[int]]:
        calls = [n for n in pipe.split_gm.graph.nodes if n.op == "call_module"]
        out = []
        for call in calls:
            srcs = set()
            for a in call.args:
                while a.op == "call_function" and a.target is operator.getitem:
                    a = a.args[0]
                if a.op == "call_module":
                    srcs.add(calls.index(a))
            out.append(srcs)
        return out

    assert sources() == [set(), {0}, {0, 1}, {0, 2}]
    assert pipeline_mod._relay_skips(pipe) == 2  # the inputs of stages 2 and 3
    assert sources() == [set(), {0}, {1}, {2}]
    n_inputs = [sum(n.op == "placeholder" for n in pipe.get_stage_module(i).graph.nodes)
                for i in range(4)]
    assert n_inputs == [1, 2, 2, 2]  # stage 1 takes h too; stage 2 reads it itself
    x = _data("skips", 0)[0][:2]
    y = pipe(x)
    torch.testing.assert_close(y[0] if isinstance(y, tuple) else y, _model("skips")(x))


def _input_skip_pipe(model: nn.Module, args: tuple) -> Any:
    from hetplan.runtime import pipeline as pipeline_mod

    names = [lay.name for lay in capture(model, args).layers]
    stages = [Stage(index=s, first_layer=s, last_layer=s, layer_names=(names[s],), ranks=(s,))
              for s in range(4)]
    pipe, _ = pipeline_mod._trace(model, args, None, split_points(names, stages))
    return pipe


def test_a_model_input_read_by_a_later_stage_is_relayed_from_the_first(
        two_ranks: list[dict[str, dict[str, Any]]]) -> None:
    """Torch feeds the model's inputs to the first stage only: an input the first stage and
    the third read goes through the first two stages, and the split equals the model."""
    from hetplan.runtime import pipeline as pipeline_mod

    torch.manual_seed(0)
    model = _InputSkip().double()
    x = torch.randn(2, 8, dtype=torch.float64)
    pipe = _input_skip_pipe(model, (x,))
    assert pipeline_mod._relay_skips(pipe) == 1
    calls = [n for n in pipe.split_gm.graph.nodes if n.op == "call_module"]
    for k, call in enumerate(calls[1:], start=1):
        for a in call.args:
            while a.op == "call_function" and a.target is operator.getitem:
                a = a.args[0]
            assert calls.index(a) == k - 1
    y = pipe(x)
    torch.testing.assert_close(y[0] if isinstance(y, tuple) else y, model(x))
    # trained on 2 ranks (interleaved, 4 stages): the losses and weights of one process
    _compare_two(two_ranks, "input-skip-interleaved")


def test_a_model_input_only_a_later_stage_reads_is_refused() -> None:
    from hetplan.runtime import pipeline as pipeline_mod

    torch.manual_seed(0)
    model = _InputSkip(second_input=True).double()
    x, y = torch.randn(2, 8, dtype=torch.float64), torch.randn(2, 8, dtype=torch.float64)
    pipe = _input_skip_pipe(model, (x, y))
    with pytest.raises(SpecError, match="stage 2 reads the model input 'y', which the first "
                                        "stage does not"):
        pipeline_mod._relay_skips(pipe)


@pytest.mark.slow  # 4 processes
def test_dp2_pp2_equals_single_process() -> None:
    layout = _layout("1f1b", dp=2, pp=2)
    _compare(_spawn({"dp2-pp2": ("blocks", layout)}), "dp2-pp2", "blocks", layout)


# -- split points and refusals (single process) ------------------------------------------------
def _two(names: list[str], cut: int) -> list[Stage]:
    return [Stage(index=0, first_layer=0, last_layer=cut - 1, ranks=(0,)),
            Stage(index=1, first_layer=cut, last_layer=len(names) - 1, ranks=(1,))]


def test_split_points_mark_the_first_layer_of_later_stages() -> None:
    from torch.distributed.pipelining import SplitPoint

    names = ["emb", "h.0", "h.1", "h.2", "head"]
    stages = [Stage(index=0, first_layer=0, last_layer=1, ranks=(0,)),
              Stage(index=1, first_layer=2, last_layer=2, ranks=(1,)),
              Stage(index=2, first_layer=3, last_layer=4, ranks=(2,))]
    assert split_points(names, stages) == {"h.1": SplitPoint.BEGINNING,
                                           "h.2": SplitPoint.BEGINNING}
    one = Stage(index=0, first_layer=0, last_layer=4, ranks=(0,))
    assert split_points(names, [one]) == {}


@pytest.mark.parametrize(("names", "cut", "match"), [
    (["emb", "h.0", "emb@1"], 2, "second invocation"),
    (["emb", "shared", "h.0", "shared@1"], 1, "invoked again"),
    (["cls", "", "head"], 1, "root module"),
    (["enc.a", "enc", "head"], 1, "enclosing layer 'enc.a'"),
])
def test_split_points_refuse_unsplittable_boundaries(names: list[str], cut: int,
                                                     match: str) -> None:
    with pytest.raises(SpecError, match=match):
        split_points(names, _two(names, cut))


def test_split_points_refuse_stages_that_do_not_tile_the_layers() -> None:
    names = ["a", "b", "c"]
    gap = [Stage(index=0, first_layer=0, last_layer=0, ranks=(0,)),
           Stage(index=1, first_layer=2, last_layer=2, ranks=(1,))]
    with pytest.raises(SpecError, match="contiguously"):
        split_points(names, gap)
    wrong = [Stage(index=0, first_layer=0, last_layer=0, layer_names=("x",), ranks=(0,)),
             Stage(index=1, first_layer=1, last_layer=2, ranks=(1,))]
    with pytest.raises(SpecError, match="another model"):
        split_points(names, wrong)


def test_boundary_at_glue_only_layer_is_refused() -> None:
    model = _model("gpt")  # pos_emb is only read as pos_emb.weight[:t] by glue code
    names = [lay.name for lay in capture(model, torch.zeros(1, 16, dtype=torch.long)).layers]
    assert names[1] == "pos_emb"
    with pytest.raises(SpecError, match="'pos_emb' is never called as a module"):
        build_stage(model, (torch.zeros(2, 16, dtype=torch.long),), None, _two(names, 1), 0,
                    None, "cpu", ir_layer_names=names)
    assert "forward" not in model.blocks[0].__dict__, "the model's forwards are restored"


def test_ties_across_stages_are_refused_by_default() -> None:
    model = _model("tied")
    stages = _stages("tied", _layout("1f1b", dp=1, pp=2))
    with pytest.raises(SpecError, match=r"\('embed.weight', 'head.weight'\)"):
        build_stage(model, (torch.zeros(2, 8, dtype=torch.long),), None, stages, 0, None, "cpu")


def test_untraceable_non_sequential_model_is_named() -> None:
    model = DataDependentNet().double()
    names = ["fc_in", "gate", "fc_out"]
    with pytest.raises(TraceError, match="DataDependentNet.*not a plain sequence"):
        build_stage(model, (torch.randn(2, 16, dtype=torch.float64),), None, _two(names, 2),
                    0, None, "cpu", ir_layer_names=names)


def test_make_schedule_refuses_schedules_torch_does_not_run() -> None:
    """Chimera runs on its own executor (``handlers/chimera.py``), not torch's schedule
    runtime: handed to torch's, it is refused by name."""
    with pytest.raises(SpecError, match="'chimera' runs on the runtime's Chimera executor"):
        make_schedule(object(), _layout("chimera", dp=1, pp=2), F.mse_loss)  # type: ignore


def test_step_refuses_unequal_micro_batches() -> None:
    schedule = SimpleNamespace(_n_microbatches=3)
    with pytest.raises(SpecError, match="equal micro-batches"):
        pp_step(schedule, 0, 2, torch.zeros(8, 2))
