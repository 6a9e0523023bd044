"""``hetplan.report.timeline``: the drawn bars agree with the simulator, and files get written.

The plan is built by hand (no torch): a made-up 6-layer model with 204 gradient tensors (one
4 MB weight and 33 tiny biases per layer) on 4 nodes x 2 devices, ``dp=4 pp=2`` with 6
micro-batches. Stage 1 syncs layers 5 and 4 with GPU-compressed hierarchical DGC buckets and
layer 3 tensor by tensor in fp32; stage 0 syncs layer 2 with CPU compression and layers 1-0
in one fp32 bucket. So every lane kind appears: GPU stream, CPU, flat network, intra, inter.
"""

from __future__ import annotations

from collections import defaultdict
from itertools import pairwise
from pathlib import Path

import pytest

from hetplan.errors import SpecError
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.plan import (
    Bucket,
    ClusterRef,
    CommStep,
    CompressedSync,
    GradCost,
    GradientSync,
    LayerCost,
    Layout,
    ModelRef,
    NoSync,
    Plan,
    Stage,
    WorkloadSummary,
)
from hetplan.cost_models.predict import simulate
from hetplan.report.timeline import Segment, render_timeline, timeline_segments

PP, DP, MICRO_BATCHES = 2, 4, 6
LAYERS, TINY = 6, 33
TOL = 1e-6  # ms


def toy_cluster() -> ClusterSpec:
    return ClusterSpec.from_dict({
        "name": "toy-4x2",
        "nodes": [{
            "name": "box", "count": 4, "devices": [{"type": "toy", "count": 2}],
            "cpu_cores": 8,
            "intra_link": {"kind": "pcie", "bandwidth_gbps": 100.0, "latency_us": 5.0},
        }],
        "inter_node": {"kind": "ethernet", "bandwidth_gbps": 10.0, "latency_us": 20.0},
        "device_types": {
            "toy": {"memory_gib": 16.0, "peak_tflops": {"fp32": 10.0},
                    "mem_bandwidth_gb_s": 1000.0},
        },
    })


def toy_workload() -> WorkloadSummary:
    layers = tuple(
        LayerCost(name=f"L{i}", fwd_flops=10**10, bwd_flops=2 * 10**10,
                  param_bytes=4_000_000 + TINY * 4096, act_in_bytes=10**6,
                  act_out_bytes=10**6, act_saved_bytes=10**6)
        for i in range(LAYERS)
    )
    grads = []
    for i in reversed(range(LAYERS)):  # backward-ready order
        grads.append(GradCost(name=f"L{i}.w", size_bytes=4_000_000, layer_index=i))
        grads += [GradCost(name=f"L{i}.b{k}", size_bytes=4096, layer_index=i)
                  for k in range(TINY)]
    return WorkloadSummary(batch_size=1, layers=layers, grads=tuple(grads))


def names(wl: WorkloadSummary, *layers: int) -> tuple[str, ...]:
    return tuple(g.name for g in wl.grads if g.layer_index in layers)


def bucket(wl: WorkloadSummary, strategy: str, *layers: int) -> Bucket:
    size = sum(g.size_bytes for g in wl.grads if g.layer_index in layers)
    return Bucket(tensors=names(wl, *layers), size_bytes=size, strategy=strategy)


def make_plan() -> Plan:
    """The toy plan of the module docstring."""
    spec, wl = toy_cluster(), toy_workload()
    gpu_dgc = CompressedSync(
        compressor="dgc", params={"ratio": 0.01}, compress_device="gpu",
        hierarchy="hierarchical",
        steps=(CommStep(level="intra", routine="allgather", compressed=True),
               CommStep(level="inter", routine="allgather", compressed=True)),
    )
    cpu_dgc = CompressedSync(compressor="dgc", params={"ratio": 0.01}, compress_device="cpu",
                             decompress_device="cpu")
    sync = GradientSync(
        strategies={"fp32": NoSync(), "dgc": gpu_dgc, "cpu-dgc": cpu_dgc},
        buckets=(bucket(wl, "dgc", 5), bucket(wl, "dgc", 4), bucket(wl, "cpu-dgc", 2),
                 bucket(wl, "fp32", 1, 0)),
    )
    half = LAYERS // 2
    return Plan(
        model=ModelRef(name="toy-net", fingerprint="f00d", num_params=10**7, workload=wl),
        cluster=ClusterRef.from_cluster(spec),
        layout=Layout(dp=DP, pp=PP, micro_batches=MICRO_BATCHES, micro_batch_size=1,
                      global_batch_size=DP * MICRO_BATCHES),
        stages=(Stage(index=0, first_layer=0, last_layer=half - 1, ranks=(0, 1, 2, 3)),
                Stage(index=1, first_layer=half, last_layer=LAYERS - 1, ranks=(4, 5, 6, 7))),
        gradient_sync=sync,
    )


@pytest.fixture(scope="module")
def plan() -> Plan:
    return make_plan()


@pytest.fixture(scope="module")
def segments(plan: Plan) -> list[Segment]:
    return timeline_segments(plan)


def by_lane(segments: list[Segment]) -> dict[str, list[Segment]]:
    lanes: dict[str, list[Segment]] = defaultdict(list)
    for s in segments:
        lanes[s.lane].append(s)
    return lanes


# --------------------------------------------------------------------------------------
# segments
# --------------------------------------------------------------------------------------
def test_one_rectangle_per_forward_and_backward(segments: list[Segment]) -> None:
    fb = [s for s in segments if s.kind in ("F", "B")]
    assert len(fb) == PP * MICRO_BATCHES * 2
    for stage in range(PP):
        for kind in "FB":
            mine = [s for s in fb if s.stage == stage and s.kind == kind]
            assert sorted(s.microbatch for s in mine) == list(range(MICRO_BATCHES))
            assert all(s.lane == f"stage {stage}" and s.label == str(s.microbatch) for s in mine)


def test_every_lane_kind_is_drawn(segments: list[Segment]) -> None:
    lanes = set(by_lane(segments))
    for stage in range(PP):
        assert {f"stage {stage}", f"stage {stage} · GPU stream"} <= lanes
    assert "stage 0 · CPU" in lanes  # CPU compression of layer 2's bucket
    assert {"stage 1 · intra-node", "stage 1 · inter-node"} <= lanes  # hierarchical DGC
    assert "stage 1 · network (flat)" in lanes  # layer 3 tensor by tensor
    kinds = {s.kind for s in segments}
    assert {"compress", "decompress", "allgather", "allreduce", "backprop", "optimizer",
            "predicted"} <= kinds
    assert "measured" not in kinds


def test_segments_do_not_overlap_within_a_lane(segments: list[Segment]) -> None:
    for lane, segs in by_lane(segments).items():
        segs = sorted(segs, key=lambda s: s.start_ms)
        for a, b in pairwise(segs):
            assert b.start_ms >= a.end_ms - TOL, (lane, a, b)
        assert all(s.end_ms >= s.start_ms for s in segs)


def test_dp_lanes_start_after_the_last_backward_starts(segments: list[Segment]) -> None:
    for stage in range(PP):
        last_b = max(s.start_ms for s in segments if s.kind == "B" and s.stage == stage)
        dp = [s for s in segments if s.lane.startswith(f"stage {stage} · ")]
        assert dp
        assert min(s.start_ms for s in dp) == pytest.approx(last_b, abs=TOL)
        gpu = [s for s in dp if s.lane.endswith("GPU stream")]
        assert gpu[0].kind == "backprop"  # the GPU stream starts with the last backward


def test_totals_match_the_simulated_iteration(plan: Plan, segments: list[Segment]) -> None:
    predicted = simulate(plan).iteration_time_ms
    drawn = [s for s in segments if s.stage >= 0]
    assert max(s.end_ms for s in drawn) == pytest.approx(predicted, abs=TOL)
    (total,) = [s for s in segments if s.kind == "predicted"]
    assert (total.start_ms, total.end_ms) == pytest.approx((0.0, predicted), abs=TOL)
    # the optimizer step closes the iteration on every stage
    opt = [s for s in segments if s.kind == "optimizer"]
    assert len(opt) == PP and all(s.end_ms == pytest.approx(predicted) for s in opt)


def test_tiny_ops_and_backprop_are_merged(plan: Plan, segments: list[Segment]) -> None:
    # layer 3: 34 tensors synced one by one; the 33 tiny allreduces run back to back
    flat = by_lane(segments)["stage 1 · network (flat)"]
    assert len(flat) < TINY
    assert any("merged" in s.detail for s in flat)
    # without GPU compression the backprop of the last micro-batch is one bar per stage
    layerwise = timeline_segments(plan.model_copy(update={"gradient_sync": None}))
    bp = [s for s in layerwise if s.kind == "backprop"]
    assert len(bp) == PP


def test_run_report_adds_a_measured_bar(plan: Plan) -> None:
    flat = timeline_segments(plan, run_report={"iteration_ms": 123.4, "compute_ms": 100.0})
    (m,) = [s for s in flat if s.kind == "measured"]
    assert (m.lane, m.start_ms, m.end_ms) == ("measured", 0.0, 123.4)
    assert "compute 100.0 ms" in m.detail
    nested = {"measured": {"iteration_ms": 50.0, "exposed_comm_ms": 5.0}, "predicted": {}}
    (m,) = [s for s in timeline_segments(plan, run_report=nested) if s.kind == "measured"]
    assert m.end_ms == 50.0
    with pytest.raises(SpecError, match="iteration_ms"):
        timeline_segments(plan, run_report={"compute_ms": 1.0})


def test_plan_without_workload_is_refused(plan: Plan) -> None:
    bare = plan.model_copy(update={"model": plan.model.model_copy(update={"workload": None}),
                                   "stages": (), "gradient_sync": None})
    with pytest.raises(SpecError, match="workload"):
        timeline_segments(bare)


# --------------------------------------------------------------------------------------
# files
# --------------------------------------------------------------------------------------
def test_png_is_written(plan: Plan, tmp_path: Path) -> None:
    out = render_timeline(plan, tmp_path / "t.png", run_report={"iteration_ms": 80.0})
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000


def test_png_draws_every_bar_in_one_collection_per_kind(
        plan: Plan, segments: list[Segment], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Bars are rectangles of one collection per kind, not one patch each: a plan of 65,536
    micro-batches took 2-3 minutes to draw as patches (matplotlib adds and draws each one).
    Every segment's rectangle is there, at its lane and time."""
    from matplotlib.figure import Figure

    drawn: list[Figure] = []
    save = Figure.savefig

    def keep(fig: Figure, *args: object, **kwargs: object) -> None:
        drawn.append(fig)
        save(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    render_timeline(plan, tmp_path / "t.png")
    (ax,) = drawn[0].axes
    kinds = list(dict.fromkeys(s.kind for s in segments))
    assert len(ax.collections) == len(kinds)
    assert not ax.patches
    starts = sorted(round(float(p.vertices[:, 0].min()), 6)
                    for c in ax.collections for p in c.get_paths())
    assert starts == sorted(round(s.start_ms, 6) for s in segments)


def test_a_missing_directory_is_refused_not_created(plan: Plan, tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="directory .*sub' does not exist"):
        render_timeline(plan, tmp_path / "sub" / "t.png")
    assert not (tmp_path / "sub").exists()


def test_html_is_self_contained(plan: Plan, tmp_path: Path) -> None:
    out = render_timeline(plan, tmp_path / "t.html")
    text = out.read_text(encoding="utf-8")
    assert "plotly" in text and "toy-net" in text
    assert len(text) > 1_000_000  # plotly.js itself is inlined: works offline
    assert '<script src="http' not in text


@pytest.mark.parametrize("name", ["t.svg", "t.pdf", "timeline", "t.png.txt"])
def test_unknown_suffix_is_a_spec_error(plan: Plan, tmp_path: Path, name: str) -> None:
    with pytest.raises(SpecError, match=r"\.png"):
        render_timeline(plan, tmp_path / name)
    assert not (tmp_path / name).exists()


def test_a_cpu_plan_has_no_gpu_stream_lane() -> None:
    """Was: every plan's device-side lane was "GPU stream", a CPU plan's included."""
    import hetplan

    plan = hetplan.compile("mlp", "local-cpu", batch_size=8, dp=4, pp=1, tp=1)
    lanes = {s.lane for s in timeline_segments(plan)}
    assert "stage 0 · device stream" in lanes, lanes
    assert not any("GPU" in lane for lane in lanes), lanes


def test_a_bad_run_report_is_named_by_file_and_field(plan: Plan, tmp_path: Path) -> None:
    # before: "run_report needs a positive number 'iteration_ms' ..., got True", naming
    # neither the file nor the field's place in it
    from typer.testing import CliRunner

    from hetplan.cli import app

    plan.save(tmp_path / "p.json")
    report = tmp_path / "run.json"
    report.write_text('{"measured": {"iteration_ms": true}, "per_rank": []}')
    result = CliRunner().invoke(app, ["timeline", str(tmp_path / "p.json"), "-o",
                                      str(tmp_path / "t.html"), "--run-report", str(report)])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert f"{report}: measured.iteration_ms: expected milliseconds" in text
