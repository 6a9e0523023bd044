"""The validation set of published training runs (``bench/data/published_runs.json``).

Checks the data file's schema and its internal consistency: each layout covers its GPUs and
divides its batch, parameter counts follow from the model shape, each source's throughput
figures agree with each other and with its FLOP convention, every cluster file loads and
matches the run. A wrong number in one entry fails one of these. The bench's mapping of
published strategy dimensions onto ``compile`` options is checked against ``CompileOptions``.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.append(str(BENCH))  # after everything else: bench/ holds scripts named like modules

import published_data as pdata  # noqa: E402

DATA = pdata.load_runs()
RUNS = {r.id: r for r in DATA.runs}
ids = pytest.mark.parametrize("run", list(DATA.runs), ids=[r.id for r in DATA.runs])


def _half_unit(run: pdata.Run, key: str) -> float:
    return pdata._rounding(run.measured, key)


def test_enough_runs_from_independent_sources() -> None:
    assert len(DATA.runs) >= 12
    used = {r.source for r in DATA.runs}
    assert used == set(DATA.sources), "every source is used and every run cites a known one"
    orgs = {DATA.sources[s].org.split(" (")[0] for s in used}
    assert len(orgs) >= 3, orgs


def test_bad_entry_is_refused_with_its_field_path() -> None:
    raw = DATA.model_dump(mode="json")
    raw["runs"][0]["layout"]["tp_size"] = 8
    with pytest.raises(ValueError, match="tp_size"):
        pdata.PublishedRuns.model_validate(raw)
    raw = DATA.model_dump(mode="json")
    raw["runs"][0]["source"] = "narayanan"
    with pytest.raises(ValueError, match="unknown source 'narayanan'"):
        pdata.PublishedRuns.model_validate(raw)


@ids
def test_layout_covers_the_gpus(run: pdata.Run) -> None:
    lay, c = run.layout, run.cluster
    assert lay.tp * lay.pp * lay.dp * lay.cp == c.gpus
    assert c.gpus % c.gpus_per_node == 0
    assert c.gpus_per_node % lay.tp == 0, "a TP group stays inside a node"


@ids
def test_layout_divides_the_batch_and_the_model(run: pdata.Run) -> None:
    lay, m = run.layout, run.model
    assert lay.global_batch_size % lay.dp == 0
    per_replica = lay.global_batch_size // lay.dp
    if lay.micro_batch_size is not None:
        assert per_replica % lay.micro_batch_size == 0
        if lay.pp > 1:
            assert per_replica // lay.micro_batch_size >= lay.pp, "fewer micro-batches than stages"
    if lay.virtual_stages is not None:
        assert (lay.schedule == "interleaved-1f1b") == (lay.virtual_stages > 1)
        if lay.virtual_stages > 1:
            assert m.layers % (lay.pp * lay.virtual_stages) == 0
    assert m.hidden % m.heads == 0 and m.heads % m.kv_heads == 0
    assert m.heads % lay.tp == 0 and m.kv_heads % lay.tp == 0


@ids
def test_params_follow_from_the_shape(run: pdata.Run) -> None:
    m = run.model
    exact = pdata.param_count(m) / 1e9
    # published sizes are printed to 0.1B or nominal (22B, 175B, 1T ...)
    assert abs(exact - m.params_billion) <= max(0.05, 0.01 * m.params_billion) + 1e-9
    l, h, v = m.layers, m.hidden, m.vocab
    if m.architecture in ("gpt", "bloom"):
        assert m.ffn_hidden == 4 * h
        standard = 12 * l * h * h + v * h  # the usual 12·l·h² plus the embedding
    else:
        kv = m.kv_heads * (h // m.heads)
        standard = l * (2 * h * h + 2 * h * kv + 3 * h * m.ffn_hidden) + 2 * v * h
    assert standard / 1e9 == pytest.approx(m.params_billion, rel=0.04)


@ids
def test_throughput_figures_agree(run: pdata.Run) -> None:
    """% of peak and aggregate PFLOP/s agree with TFLOP/s per GPU within their rounding."""
    m, n = run.measured, run.cluster.gpus
    peak = pdata.PEAK_TFLOPS[run.cluster.gpu]
    if m.tflops_per_gpu is not None and m.percent_of_peak is not None:
        tol = _half_unit(run, "percent_of_peak") + 100 * _half_unit(run, "tflops_per_gpu") / peak
        assert abs(100 * m.tflops_per_gpu / peak - m.percent_of_peak) <= tol + 1e-9
    if m.tflops_per_gpu is not None and m.mfu_percent is not None:
        tol = _half_unit(run, "mfu_percent") + 100 * _half_unit(run, "tflops_per_gpu") / peak
        assert abs(100 * m.tflops_per_gpu / peak - m.mfu_percent) <= tol + 1e-9
    if m.tflops_per_gpu is not None and m.aggregate_pflops is not None:
        tol = _half_unit(run, "tflops_per_gpu") + 1e3 * _half_unit(run, "aggregate_pflops") / n
        assert abs(1e3 * m.aggregate_pflops / n - m.tflops_per_gpu) <= tol + 1e-9
    if m.samples_per_s is not None and m.iteration_time_s is not None:
        rate = run.layout.global_batch_size / m.iteration_time_s
        assert rate == pytest.approx(m.samples_per_s, abs=_half_unit(run, "samples_per_s") * 2)


def _time_and_utilization(run: pdata.Run) -> bool:
    m = run.measured
    return m.iteration_time_s is not None and any(
        v is not None for v in (m.mfu_percent, m.hfu_percent, m.tflops_per_gpu))


def test_only_full_recompute_rows_publish_time_alone() -> None:
    alone = {r.id for r in DATA.runs
             if r.measured.iteration_time_s is not None and not _time_and_utilization(r)}
    assert alone == {r.id for r in DATA.runs
                     if r.source == "korthikanti2022" and r.layout.recompute == "full"}


@pytest.mark.parametrize("run", [r for r in DATA.runs if _time_and_utilization(r)],
                         ids=[r.id for r in DATA.runs if _time_and_utilization(r)])
def test_time_and_utilization_agree_through_the_flops_convention(run: pdata.Run) -> None:
    """A source that publishes both time and utilization: the convention links them."""
    m, n = run.measured, run.cluster.gpus
    peak = pdata.PEAK_TFLOPS[run.cluster.gpu] * 1e12
    assert m.iteration_time_s is not None
    t_rel = _half_unit(run, "iteration_time_s") / m.iteration_time_s
    for key, conv in (("mfu_percent", "megatron-model-flops"),
                      ("hfu_percent", "megatron-hardware-selective")):
        published = getattr(m, key)
        if published is not None:
            util = 100 * pdata.flops_per_iteration(run, conv) / (n * m.iteration_time_s * peak)
            assert abs(util - published) <= _half_unit(run, key) + util * t_rel + 1e-9, key
    if m.tflops_per_gpu is not None:
        x = pdata.flops_per_iteration(run) / (n * m.iteration_time_s) / 1e12
        tol = _half_unit(run, "tflops_per_gpu") + x * t_rel
        assert abs(x - m.tflops_per_gpu) <= tol + 1e-9


def test_throughput_converts_back_to_time_as_the_source_counted() -> None:
    """BLOOM's log gives both: its TFLOPs, converted with megatron-eq3, is its time."""
    run = RUNS["bloom2022-176b"]
    as_throughput = run.model_copy(update={"measured": run.measured.model_copy(
        update={"iteration_time_s": None, "printed": {}})})
    t = pdata.measured_iteration(as_throughput, DATA.flops_conventions)
    assert t.seconds == pytest.approx(104.70, rel=1e-4)
    assert "149.77 TFLOP/s per GPU via megatron-eq3" in t.how
    assert pdata.measured_iteration(run).how == "published iteration time"


def test_measured_time_uses_the_more_precise_published_figure() -> None:
    run = RUNS["narayanan2021-gpt-1t"]  # 163 TFLOP/s (±0.3 %) vs 502.0 PFLOP/s (±0.01 %)
    t = pdata.measured_iteration(run, DATA.flops_conventions)
    assert "502 PFLOP/s aggregate" in t.how
    assert t.rel_uncertainty == pytest.approx(0.05 / 502.0)
    assert t.seconds == pytest.approx(pdata.flops_per_iteration(run) / 502.0e15)
    small = pdata.measured_iteration(RUNS["narayanan2021-gpt-1.7b"])
    assert "137 TFLOP/s per GPU" in small.how
    llama = pdata.measured_iteration(RUNS["llama3-405b-8k-gpus"], DATA.flops_conventions)
    assert llama.rel_uncertainty == pytest.approx(5.0 / 430 + 0.01)
    assert all(math.isfinite(pdata.measured_iteration(r).seconds) for r in DATA.runs)


@ids
def test_cluster_file_matches_the_run(run: pdata.Run) -> None:
    from hetplan.ir.cluster import ClusterSpec

    c = run.cluster
    spec = ClusterSpec.load(pdata.CLUSTER_DIR / c.cluster_file)
    assert len(spec.nodes) == 1 and spec.nodes[0].devices_per_node == c.gpus_per_node
    dev = spec.devices()[0]
    assert dev.type == c.gpu
    assert dev.memory_bytes == int(c.gpu_memory_gib * 2**30)
    assert dict(dev.peak_flops)["bf16"] == pdata.PEAK_TFLOPS[c.gpu] * 1e12
    assert spec.inter_node is not None
    assert spec.inter_node.bandwidth_gbps == c.inter_node_gbps_per_node


def test_bench_pins_only_options_the_planner_has() -> None:
    import published
    from hetplan.optimizer.options import CompileOptions

    fields = set(CompileOptions.model_fields)
    for run in DATA.runs:
        pins, dims = published.express(run)
        assert set(pins) <= fields, run.id
        assert {"dp", "pp", "tp", "dtype"} <= set(pins)
        by_name = {d["dimension"]: d for d in dims}
        assert len(by_name) == len(published.DIMENSIONS)
        for dim in published.DIMENSIONS:
            rec = by_name[dim.name]
            if rec["status"] == "pinned":
                assert dim.option in pins
            if rec["status"] == "unexpressed":
                assert dim.option is None and rec["published"] is not None
    sel = published.express(RUNS["korthikanti2022-gpt-175b-sp-selective"])[1]
    status = {d["dimension"]: d["status"] for d in sel}
    assert status["micro_batch_size"] == "pinned" and status["compute_dtype"] == "pinned"
    llama = {d["dimension"]: d["status"]
             for d in published.express(RUNS["llama3-405b-8k-gpus"])[1]}
    assert llama["micro_batch_size"] == "unpublished" and llama["recompute"] == "unpublished"


def test_engine_settings_and_llama3_sharding() -> None:
    import published

    pins, dims = published.express(RUNS["llama3-405b-8k-gpus"])
    # Llama 3's FSDP keeps parameters whole through backward: the planner's ZeRO-2
    assert pins["zero_stage"] == 2
    assert {d["dimension"]: d.get("as") for d in dims}["dp_sharding"] == (
        "zero-2 (see ZERO_BY_SOURCE)")
    assert pins["fusion"] == "fused" and pins["vocab_parallel"] is True
    assert pins["attention"] == "flash"
    meg, _ = published.express(RUNS["korthikanti2022-gpt-175b-sp-selective"])
    assert (meg["attention"], meg["fusion"], meg["dp_overlap"]) == (
        "materialized", "fused", "after-flush")
    bloom, _ = published.express(RUNS["bloom2022-176b"])
    assert bloom["zero_stage"] == 1


def test_grad_accumulation_per_source() -> None:
    import published

    acc = {r.id: published.express(r)[0].get("grad_accumulation") for r in DATA.runs}
    # Narayanan 2021: run_table_1.sh's DDP=torch up to 18B, DDP=local from 39B
    assert acc["narayanan2021-gpt-18.4b"] == "autograd"
    assert acc["narayanan2021-gpt-39.1b"] == "hook16"
    assert {acc[r.id] for r in DATA.runs if r.source == "narayanan2021"} == {"autograd",
                                                                            "hook16"}
    assert {acc[r.id] for r in DATA.runs if r.source == "korthikanti2022"} == {"hook16"}
    assert acc["bloom2022-176b"] == "hook32"
    assert acc["llama3-405b-16k-gpus"] == "autograd"
