"""Runtime re-balancing on gloo: a pipeline trained k steps, re-balanced mid-run (layers,
parameters and Adam state moved point to point), continues with exactly the losses and
parameters of a run that never moved (same seeds); re-packing 4 -> 2 ranks likewise."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hetplan.errors import SpecError
from hetplan.profiling._spawn import run_local_ranks
from hetplan.runtime.rebalance import LayerStage, build_layer_stage, migrate

pytestmark = pytest.mark.dist

D, M, MB = 8, 4, 2
DT = torch.float64


def factory(k: int) -> nn.Module:
    """Layer ``k``; its initial weights depend only on ``k`` (not on where it is built)."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(1000 + k)
    layer = nn.Sequential(nn.Linear(D, D), nn.Tanh()).to(DT)
    torch.random.set_rng_state(gen_state)
    return layer


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return (torch.randn(M * MB, D, generator=g, dtype=DT),
            torch.randn(M * MB, D, generator=g, dtype=DT))


def train_step(stage: LayerStage, opt: torch.optim.Optimizer, s: int, n: int,
               step: int) -> float | None:
    """One GPipe iteration over ranks 0..n-1 (rank = stage index)."""
    x, y = batch(step)
    xs, ys = x.chunk(M), y.chunk(M)
    ins, outs = [], []
    for m in range(M):
        if s == 0:
            inp = xs[m]
        else:
            inp = torch.empty(MB, D, dtype=DT)
            dist.recv(inp, src=s - 1)
            inp.requires_grad_()
        out = stage(inp)
        if s < n - 1:
            dist.send(out.detach(), dst=s + 1)
        ins.append(inp)
        outs.append(out)
    total = 0.0
    for m in range(M):
        if s == n - 1:
            loss = F.mse_loss(outs[m], ys[m]) / M
            loss.backward()
            total += loss.item()
        else:
            g = torch.empty(MB, D, dtype=DT)
            dist.recv(g, src=s + 1)
            outs[m].backward(g)
        if s > 0:
            dist.send(ins[m].grad, dst=s - 1)
    opt.step()
    opt.zero_grad()
    return total if s == n - 1 else None


def worker(rank: int, world: int, runs: list[tuple[Any, Any, int, int]]) -> list[tuple]:
    """Each run ``(old, new, switch, steps)`` in turn, in this one process group: train
    ``steps`` GPipe iterations on the ``old`` layer ranges, migrating to ``new`` before
    iteration ``switch``. Per run: the losses by step, the parameters and Adam's second
    moments by layer, and the layers held at the end."""
    torch.set_num_threads(1)
    out = []
    for old, new, switch, steps in runs:
        stage = build_layer_stage(factory, old, rank)
        opt = torch.optim.Adam(stage.parameters(), lr=1e-2)
        bounds = old
        losses = {}
        for step in range(steps):
            if step == switch and new != old:
                stage, opt = migrate(stage, opt, bounds, new, rank, factory,
                                     list(range(len(bounds))))
                bounds = new
            if rank < len(bounds):
                loss = train_step(stage, opt, rank, len(bounds), step)
                if loss is not None:
                    losses[step] = loss
        params = {k: [p.detach().clone() for p in stage.layers[str(k)].parameters()]
                  for k in stage.indices}
        states = {k: [opt.state[p]["exp_avg_sq"].clone()
                      for p in stage.layers[str(k)].parameters()] for k in stage.indices}
        out.append((losses, params, states, stage.indices))
    return out


def run(world: int, *runs: tuple[Any, Any, int, int]) -> list[tuple]:
    """The runs ``(old, new, switch, steps)`` one after another in one group of ``world``
    ranks; per run: losses, parameters and Adam states over all ranks, and each rank's
    layers."""
    outs = run_local_ranks(worker, world, (list(runs),), timeout_s=180)
    merged = []
    for i in range(len(runs)):
        losses, params, states, held = {}, {}, {}, []
        for per_run in outs:
            lo, pa, stt, idx = per_run[i]
            losses.update(lo)
            params.update(pa)
            states.update(stt)
            held.append(idx)
        merged.append((losses, params, states, held))
    return merged


def assert_same(a, b) -> None:
    la, pa, sa, _ = a
    lb, pb, sb, _ = b
    assert la == lb  # bitwise: same ops on the same values wherever they run
    assert sorted(pa) == sorted(pb)
    for k in pa:
        for x, y in zip(pa[k], pb[k]):
            assert torch.equal(x, y)
        for x, y in zip(sa[k], sb[k]):
            assert torch.equal(x, y)


def test_rebalance_mid_run_matches_a_run_that_never_moved() -> None:
    """Adam state exists from the first step; the move comes after two steps, and two more
    steps use the moved state."""
    old = ((0, 1), (2, 7))
    new = ((0, 4), (5, 7))
    moved, still = run(2, (old, new, 2, 4), (old, old, 2, 4))
    assert len(moved[0]) == 4
    assert moved[3] == [[0, 1, 2, 3, 4], [5, 6, 7]]
    assert still[3] == [[0, 1], [2, 3, 4, 5, 6, 7]]
    assert_same(moved, still)


def test_repack_4_to_2_ranks_continues_training() -> None:
    old = ((0, 1), (2, 3), (4, 5), (6, 7))
    new = ((0, 3), (4, 7))
    packed, still = run(4, (old, new, 2, 4), (old, old, 2, 4))
    assert packed[3] == [[0, 1, 2, 3], [4, 5, 6, 7], [], []]  # ranks 2, 3 released
    assert_same(packed, still)


def test_migrate_refuses_bad_assignments() -> None:
    stage = build_layer_stage(factory, ((0, 1), (2, 3)), 0)
    opt = torch.optim.Adam(stage.parameters())
    with pytest.raises(SpecError, match="expected a non-empty range"):
        migrate(stage, opt, ((0, 1), (3, 3)), ((0, 1), (2, 3)), 0, factory, [0, 1])
    with pytest.raises(SpecError, match="len"):
        migrate(stage, opt, ((0, 1), (2, 3)), ((0, 0), (1, 1), (2, 3)), 0, factory, [0, 1])


# -- the Runtime executes the plan's events ---------------------------------------------------
RT_MODEL, RT_BATCH, RT_STEPS = "gpt-test", 8, 5


def _rt_cluster(world: int) -> Any:
    from hetplan.ir.cluster import ClusterSpec

    spec = ClusterSpec.from_preset("local-cpu").model_dump(mode="json")
    spec["nodes"][0]["devices"] = [{"type": "cpu", "count": world}]
    return ClusterSpec.from_dict(spec)


def _rt_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11 + step)
    ids = torch.randint(0, 256, (RT_BATCH, 32), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def _adam(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)


def _lm_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    out = getattr(out, "logits", out)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _rt_train(plan_json: str) -> tuple[dict, dict, dict, list]:
    from hetplan import zoo
    from hetplan.ir.plan import Plan
    from hetplan.runtime.executor import Runtime

    args, kwargs = zoo.example_inputs(RT_MODEL, batch=1, device="cpu")
    model = zoo.build(RT_MODEL, device="cpu", seed=0, dtype=torch.float64)
    rt = Runtime(Plan.from_json(plan_json), model, example_args=args, example_kwargs=kwargs,
                 loss_fn=_lm_loss, optimizer=_adam)
    losses = {}
    for step in range(RT_STEPS):
        loss = rt.train_step(*_rt_data(step))
        if not math.isnan(loss):  # NaN on ranks without the last stage
            losses[step] = loss
    params = {n: p.detach().clone() for n, p in rt.named_params}
    states = {n: rt.opt.state[p]["exp_avg_sq"].clone() for n, p in rt.named_params}
    out = (losses, params, states, list(rt.rebalanced_at))
    rt.close()
    return out


def _rt_worker(rank: int, world: int, plans: dict[str, str]) -> dict[str, tuple]:
    """Train RT_STEPS steps with each plan in turn, in this one process group; per plan label
    every rank returns its losses, its parameters and Adam's second moments by name, and the
    iterations it re-balanced at."""
    torch.set_num_threads(1)
    return {label: _rt_train(plan_json) for label, plan_json in plans.items()}


def _with_events(plan: Any, events: list[tuple[int, tuple[tuple[int, int], ...]]]) -> Any:
    from hetplan.ir.rebalancing import PlannedEvent, Rebalancing

    reb = Rebalancing(total_iterations=100, events=tuple(
        PlannedEvent(iteration=i, stages=b, applied=True) for i, b in events))
    return plan.model_copy(update={"rebalancing": reb})


def _rt_runs(world: int, plans: dict[str, Any]) -> dict[str, list[tuple]]:
    """The plans one after another in one group of ``world`` ranks: per label, every rank's
    ``(losses, params, states, rebalanced_at)``."""
    outs = run_local_ranks(_rt_worker, world, ({k: p.to_json() for k, p in plans.items()},),
                           timeout_s=300)
    return {label: [o[label] for o in outs] for label in plans}


def _merged(outs: list[tuple]) -> tuple[dict, dict, dict, list, list]:
    """Losses, parameters and Adam state by name over all ranks; per rank: the re-balanced
    iterations and the parameter names held at the end."""
    losses, params, states = {}, {}, {}
    for lo, pa, st, _ in outs:
        losses.update(lo)
        for n in pa:
            assert n not in params, f"{n} held by two ranks"
        params.update(pa)
        states.update(st)
    return losses, params, states, [o[3] for o in outs], [sorted(o[1]) for o in outs]


def _rt_plan(world: int, dp: int = 1, zero_stage: int | None = 0) -> Any:
    import hetplan
    from hetplan import zoo

    model = zoo.build(RT_MODEL, device="cpu", seed=0, dtype=torch.float64)
    ir = hetplan.capture(model, *zoo.example_inputs(RT_MODEL, batch=1, device="cpu"),
                         name=RT_MODEL)
    # ZeRO-0: re-balancing moves whole per-parameter optimizer state (the runtime refuses
    # it under ZeRO, whose state is sharded across the replicas), and the planner picks
    # ZeRO-1 for dp > 1
    return hetplan.compile(ir, _rt_cluster(world), batch_size=RT_BATCH, dp=dp,
                           pp=world // dp, tp=1, micro_batch_size=2, schedule="1f1b",
                           zero_stage=zero_stage)


def test_runtime_executes_plan_events_with_losses_of_a_run_that_never_moved() -> None:
    """gpt-test (8 IR layers) on 2 pipeline ranks with Adam: the plan moves the boundary at
    iteration 1 (4|4 -> 6|2 layers) and back past the start at iteration 2 (-> 2|6)."""
    plan = _rt_plan(2, zero_stage=None)
    first = [(s.first_layer, s.last_layer) for s in plan.stages]
    assert len(first) == 2
    moved_plan = _with_events(plan, [(1, ((0, 5), (6, 7))), (2, ((0, 1), (2, 7)))])
    assert tuple(first) not in (((0, 5), (6, 7)), ((0, 1), (2, 7)))
    runs = _rt_runs(2, {"still": plan, "moved": moved_plan})
    moved, still = _merged(runs["moved"]), _merged(runs["still"])
    assert moved[3] == [[1, 2], [1, 2]] and still[3] == [[], []]
    assert sorted(moved[0]) == list(range(RT_STEPS))
    assert moved[0] == still[0]  # bitwise: the same operations on the same values
    assert sorted(moved[1]) == sorted(still[1])
    for n in moved[1]:
        assert torch.equal(moved[1][n], still[1][n]), n
        assert torch.equal(moved[2][n], still[2][n]), n
    # the layers really moved: blocks.0 ends on rank 1 (it started on rank 0), rank 0 holds
    # only the embeddings
    assert any(n.startswith("blocks.0.") for n in still[4][0])
    assert any(n.startswith("blocks.0.") for n in moved[4][1])
    assert all(n.startswith(("tok_emb.", "pos_emb.")) for n in moved[4][0])


@pytest.fixture(scope="module")
def four_rank_runs() -> dict[str, list[tuple]]:
    """dp=2 x pp=2 and pp=4, each never moved and with events, one after another in one group
    of 4 ranks."""
    dp2 = _rt_plan(4, dp=2)
    assert dp2.layout is not None and (dp2.layout.dp, dp2.layout.pp) == (2, 2)
    pp4 = _rt_plan(4)
    return _rt_runs(4, {
        "dp2-still": dp2, "pp4-still": pp4,
        "dp2-moved": _with_events(dp2, [(1, ((0, 5), (6, 7))), (3, ((0, 7),))]),
        "pp4-moved": _with_events(pp4, [(1, ((0, 3), (4, 7))), (3, ((0, 7),))])})


@pytest.mark.slow
def test_runtime_rebalances_every_data_parallel_replica(
        four_rank_runs: dict[str, list[tuple]]) -> None:
    """dp=2 x pp=2 (4 gloo ranks): both replicas move the boundary at iteration 1 and
    re-pack onto one stage at iteration 3; every replica's losses, parameters and Adam
    moments match the never-moved run (bitwise while pipelined)."""
    outs = {"moved": four_rank_runs["dp2-moved"], "still": four_rank_runs["dp2-still"]}
    for rank in range(4):
        moved, still = outs["moved"][rank], outs["still"][rank]
        assert moved[3] == [1, 3]
        assert all(moved[0][k] == still[0][k] for k in still[0] if k < 4)
    held = {r: sorted(outs["moved"][r][1]) for r in range(4)}
    ref, ref_states = {}, {}
    for r in range(4):
        ref.update(outs["still"][r][1])
        ref_states.update(outs["still"][r][2])
    assert [bool(v) for v in held.values()].count(True) == 2  # one rank per replica remains
    for r, names in held.items():
        if not names:
            continue
        assert names == sorted(ref)
        for n in names:
            torch.testing.assert_close(outs["moved"][r][1][n], ref[n], rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(outs["moved"][r][2][n], ref_states[n], rtol=1e-8,
                                       atol=1e-14)


@pytest.mark.slow
def test_runtime_repacks_4_to_2_to_1_ranks_and_trains_on(
        four_rank_runs: dict[str, list[tuple]]) -> None:
    """gpt-test on 4 pipeline ranks with Adam; after iteration 1 the plan re-packs onto 2
    stages (ranks 2, 3 released), after iteration 3 onto rank 0 alone (no pipeline). Losses
    of the pipelined iterations equal the never-moved run bitwise; the last iteration (one
    process, the loss summed per micro-batch instead of averaged by the schedule) and the
    final parameters and Adam moments agree to rounding."""
    moved = _merged(four_rank_runs["pp4-moved"])
    still = _merged(four_rank_runs["pp4-still"])
    assert moved[3] == [[1, 3]] * 4
    assert moved[4][1] == moved[4][2] == moved[4][3] == []  # released: nothing held
    assert sorted(moved[4][0]) == sorted(still[1])  # rank 0 holds the whole model
    assert sorted(moved[0]) == list(range(RT_STEPS))
    assert all(moved[0][k] == still[0][k] for k in range(4))
    assert moved[0][4] == pytest.approx(still[0][4], rel=1e-12)
    for n in still[1]:
        torch.testing.assert_close(moved[1][n], still[1][n], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(moved[2][n], still[2][n], rtol=1e-8, atol=1e-14)


def test_hetplan_run_executes_events_and_warns_for_regrowing(tmp_path: Any) -> None:
    """`hetplan run` of an mlp plan (3 IR layers, 2 stages) with events at iteration 1 (move
    the boundary), 3 (re-pack onto rank 0, releasing rank 1) and 4 (back onto 2 stages): the
    report lists the first two, rank 0 warns that the third is not executed."""
    import json
    import subprocess
    import sys

    import hetplan

    plan = hetplan.compile("mlp", _rt_cluster(2), batch_size=8, dp=1, pp=2, tp=1,
                           micro_batch_size=2)
    first = tuple((s.first_layer, s.last_layer) for s in plan.stages)
    other = ((0, 1), (2, 2)) if first == ((0, 0), (1, 2)) else ((0, 0), (1, 2))
    plan = _with_events(plan, [(1, other), (3, ((0, 2),)), (4, first)])
    plan.save(tmp_path / "plan.json")
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "hetplan.cli", "run", str(tmp_path / "plan.json"), "--model",
         "mlp", "--steps", "4", "--report", str(report)],
        capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(report.read_text())
    assert data["rebalanced_at"] == [1, 3] and len(data["rebalance_ms"]) == 2
    assert "re-balanced the pipeline at iteration(s) [1, 3]" in proc.stdout
    assert "event at iteration 4 is not executed (it needs 2 stages but re-packing" in proc.stderr
    assert math.isfinite(data["final_loss"])  # rank 0 holds the whole model at the end


def test_plan_dynamics_then_run_executes_the_passes_event(tmp_path: Any) -> None:
    """End to end: `hetplan plan --dynamics` (pruning from iteration 0, every-event trigger)
    plans an applied event at iteration 1 for gpt-test on 2 stages; `hetplan run` executes
    it."""
    import json
    import subprocess
    import sys

    import yaml
    from typer.testing import CliRunner

    from hetplan.cli import app
    from hetplan.ir.plan import load_plan

    cluster = tmp_path / "cpu2.json"
    cluster.write_text(_rt_cluster(2).model_dump_json())
    dyn = tmp_path / "pruning.yaml"
    dyn.write_text(yaml.safe_dump({
        "total_iterations": 10,
        "pruning": {"final_sparsity": 0.9, "start_iteration": 0, "frequency": 1, "steps": 3,
                    "scale_skew": 1.5},
        "rebalance": {"trigger": "every-event"}}))
    plan_path, report = tmp_path / "plan.json", tmp_path / "report.json"

    def hetplan_cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "hetplan.cli", *args], capture_output=True,
                              text=True, timeout=240, check=False)

    # in-process: planning needs no fresh interpreter (`hetplan run` below starts one)
    planned = CliRunner().invoke(app, [
        "plan", "gpt-test", "-c", str(cluster), "-b", "8", "--dp", "1", "--pp", "2", "--tp",
        "1", "--micro-batch-size", "2", "--dynamics", str(dyn), "-o", str(plan_path)])
    assert planned.exit_code == 0, planned.output[-3000:]
    plan = load_plan(plan_path)
    assert plan.rebalancing is not None
    applied = [e.iteration for e in plan.rebalancing.events if e.applied]
    assert applied and applied[0] < 5
    proc = hetplan_cli("run", str(plan_path), "--model", "gpt-test", "--steps", "3",
                       "--report", str(report))
    assert proc.returncode == 0, proc.stderr[-3000:]
    ran = 2 + 3  # the worker's 2 warm-up iterations and 3 steps
    assert json.loads(report.read_text())["rebalanced_at"] == [i for i in applied if i < ran]
