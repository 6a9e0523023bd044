"""The validation set of published training runs: its schema, and measured iteration times.

``bench/data/published_runs.json`` holds published large-model training runs (model, cluster,
parallel layout, what was measured) with their sources. This module reads and validates it
(pydantic, ``extra="forbid"``: a misspelt field fails with its path) and turns what each
source measured into the iteration time the planner predicts:

- a source that publishes the iteration time (Korthikanti et al. 2022 Table 4, BLOOM's
  training log) is used as is;
- a source that publishes throughput (TFLOP/s per GPU, or aggregate PFLOP/s) is converted back
  with the FLOP count *that source* used (``flops_conventions``): ``T = F / (n · X)``. Where a
  table rounds both the per-GPU and the aggregate figure, the one with the smaller relative
  rounding error is used, and that error is reported.

No planner code is imported here (only pydantic), so the data test runs in milliseconds.

Usage::

    from published_data import load_runs, measured_iteration
    data = load_runs()
    for run in data.runs:
        m = measured_iteration(run)   # MeasuredTime(seconds, how, rel_uncertainty)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "DATA_FILE",
    "CLUSTER_DIR",
    "PEAK_TFLOPS",
    "Run",
    "PublishedRuns",
    "MeasuredTime",
    "load_runs",
    "flops_per_iteration",
    "measured_iteration",
    "param_count",
]

BENCH = Path(__file__).resolve().parent
DATA_FILE = BENCH / "data" / "published_runs.json"
CLUSTER_DIR = BENCH / "data" / "clusters"

#: Dense 16-bit tensor-core peak (TFLOP/s) the sources quote their "% of peak" / MFU against.
PEAK_TFLOPS = {"A100-80GB": 312.0, "A100-40GB": 312.0, "H100-80GB": 989.4}

_CONFIG = ConfigDict(frozen=True, extra="forbid")


class Source(BaseModel):
    """One publication (or training report) that runs are taken from."""

    model_config = _CONFIG

    title: str
    authors: str
    org: str
    year: int
    venue: str
    url: str = Field(pattern=r"^https://")
    where: str = Field(min_length=1, description="tables / figures / log lines used")
    companion: str | None = None


class Convention(BaseModel):
    """How a source turned time into FLOP/s (``formula`` is for humans; the code is
    :func:`flops_per_iteration`)."""

    model_config = _CONFIG

    formula: str
    meaning: str
    used_by: str
    #: relative uncertainty of a time converted with this convention, beyond rounding (e.g.
    #: a parameter count the source does not define exactly); 0 when the source is explicit
    rel_uncertainty: float = Field(default=0.0, ge=0, lt=1)


class ModelConfig(BaseModel):
    """The trained model's shape."""

    model_config = _CONFIG

    architecture: Literal["gpt", "bloom", "llama"]
    layers: int = Field(ge=1)
    hidden: int = Field(ge=1)
    heads: int = Field(ge=1)
    kv_heads: int = Field(ge=1)
    ffn_hidden: int = Field(ge=1)
    vocab: int = Field(ge=1)
    seq_len: int = Field(ge=1)
    params_billion: float = Field(gt=0)
    tied_embeddings: bool


class ClusterConfig(BaseModel):
    """The hardware: ``cluster_file`` (under ``bench/data/clusters``) describes one node and
    the network; the bench scales it to ``gpus``."""

    model_config = _CONFIG

    system: str
    cluster_file: str
    gpu: str
    gpu_memory_gib: float = Field(gt=0)
    gpus: int = Field(ge=1)
    gpus_per_node: int = Field(ge=1)
    intra_node_link: str
    inter_node_per_node: str
    inter_node_gbps_per_node: float = Field(gt=0)


class Layout(BaseModel):
    """The published parallel layout; ``None`` where the source does not publish a field."""

    model_config = _CONFIG

    tp: int = Field(ge=1)
    pp: int = Field(ge=1)
    dp: int = Field(ge=1)
    cp: int = Field(ge=1)
    virtual_stages: int | None = Field(ge=1)
    micro_batch_size: int | None = Field(ge=1)
    global_batch_size: int = Field(ge=1)
    schedule: Literal["1f1b", "interleaved-1f1b", "gpipe"]
    sequence_parallel: bool | None
    recompute: Literal["none", "selective", "full"] | None
    dp_sharding: Literal["none", "zero-1", "zero-2", "zero-3", "fsdp"] | None
    precision: Literal["fp16", "bf16", "fp32"]


class Measured(BaseModel):
    """What the source measured, as published (percentages in percent)."""

    model_config = _CONFIG

    iteration_time_s: float | None = Field(default=None, gt=0)
    tflops_per_gpu: float | None = Field(default=None, gt=0)
    percent_of_peak: float | None = Field(default=None, gt=0, le=100)
    aggregate_pflops: float | None = Field(default=None, gt=0)
    mfu_percent: float | None = Field(default=None, gt=0, le=100)
    hfu_percent: float | None = Field(default=None, gt=0, le=100)
    samples_per_s: float | None = Field(default=None, gt=0)
    tokens_per_batch: str | None = None
    memory_gib: float | None = Field(default=None, gt=0)
    #: values as the source prints them where JSON would drop trailing zeros ("1.10"), so
    #: that their rounding is known
    printed: dict[str, str] = Field(default_factory=dict)
    #: half-unit rounding of values the source rounds more coarsely than their digits show
    #: (e.g. 5.0 for TFLOP/s rounded to tens); ``field_sources`` says why
    rounding: dict[str, float] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _printed_matches(self) -> Measured:
        for key, text in self.printed.items():
            value = getattr(self, key, None)
            if not isinstance(value, float) or float(text) != value:
                raise ValueError(f"printed[{key!r}] = {text!r} does not match {key} = {value!r}")
        return self

    @model_validator(mode="after")
    def _has_time_or_throughput(self) -> Measured:
        if (self.iteration_time_s is None and self.tflops_per_gpu is None
                and self.aggregate_pflops is None):
            raise ValueError("measured needs iteration_time_s, tflops_per_gpu or "
                             "aggregate_pflops (what the source published)")
        return self


class Run(BaseModel):
    """One published training run."""

    model_config = _CONFIG

    id: str = Field(pattern=r"^[a-z0-9][a-z0-9.\-]*$")
    source: str
    table: str
    model: ModelConfig
    cluster: ClusterConfig
    layout: Layout
    measured: Measured
    flops_convention: str
    field_sources: dict[str, str] = Field(default_factory=dict)
    notes: str = ""


class PublishedRuns(BaseModel):
    """The whole data file; cross-references (source and convention names) are checked."""

    model_config = _CONFIG

    about: str
    schema_version: Literal[1]
    sources: dict[str, Source]
    flops_conventions: dict[str, Convention]
    runs: tuple[Run, ...]

    @model_validator(mode="after")
    def _references(self) -> PublishedRuns:
        ids = [r.id for r in self.runs]
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate run ids: {sorted({i for i in ids if ids.count(i) > 1})}")
        for r in self.runs:
            if r.source not in self.sources:
                raise ValueError(f"run {r.id!r}: unknown source {r.source!r} "
                                 f"(known: {sorted(self.sources)})")
            if r.flops_convention not in self.flops_conventions:
                raise ValueError(f"run {r.id!r}: unknown flops_convention {r.flops_convention!r} "
                                 f"(known: {sorted(self.flops_conventions)})")
            if r.flops_convention not in _FORMULAS:
                raise ValueError(f"run {r.id!r}: flops_convention {r.flops_convention!r} has no "
                                 "implementation in published_data._FORMULAS")
        return self

    def get(self, run_id: str) -> Run:
        for r in self.runs:
            if r.id == run_id:
                return r
        raise KeyError(f"no run {run_id!r}; known: {', '.join(r.id for r in self.runs)}")


def load_runs(path: str | Path = DATA_FILE) -> PublishedRuns:
    """Reads and validates the data file (raises pydantic's ``ValidationError`` naming the
    field path on a bad entry)."""
    return PublishedRuns.model_validate(json.loads(Path(path).read_text()))


# --------------------------------------------------------------------------------------------
# FLOP counts, as each source counted them
# --------------------------------------------------------------------------------------------


def _megatron_eq3(m: ModelConfig, batch: int) -> float:
    b, s, l, h, v = batch, m.seq_len, m.layers, m.hidden, m.vocab
    return 96.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


def _megatron_model(m: ModelConfig, batch: int) -> float:
    b, s, l, h, v = batch, m.seq_len, m.layers, m.hidden, m.vocab
    return 72.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))


def _megatron_hw_selective(m: ModelConfig, batch: int) -> float:
    b, s, l, h, v = batch, m.seq_len, m.layers, m.hidden, m.vocab
    return 72.0 * b * s * l * h * h * (1 + s / (3 * h) + v / (12 * l * h))


def _palm(m: ModelConfig, batch: int) -> float:
    tokens = batch * m.seq_len
    return tokens * (6.0 * param_count(m) + 12.0 * m.layers * m.hidden * m.seq_len)


_FORMULAS = {
    "megatron-eq3": _megatron_eq3,
    "megatron-model-flops": _megatron_model,
    "megatron-hardware-selective": _megatron_hw_selective,
    "palm-model-flops": _palm,
}


def flops_per_iteration(run: Run, convention: str | None = None) -> float:
    """FLOPs of one iteration of ``run`` (its global batch) under ``convention`` (default:
    the run's own)."""
    return _FORMULAS[convention or run.flops_convention](run.model, run.layout.global_batch_size)


def param_count(m: ModelConfig) -> float:
    """Parameters of the architecture (embeddings included), from its shape alone.

    GPT (Megatron): ``12 l h² (1 + 13/(12h) + (V + s)/(12 l h))`` (Narayanan et al. Eq. 2);
    BLOOM: the same without position embeddings, plus the embedding LayerNorm; Llama: SwiGLU
    MLP, grouped-query attention, RMSNorm, untied head.
    """
    l, h, v, s, f = m.layers, m.hidden, m.vocab, m.seq_len, m.ffn_hidden
    if m.architecture == "gpt":
        return 12.0 * l * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * l * h))
    if m.architecture == "bloom":
        return l * (4.0 * h * h + 4 * h + 2.0 * h * f + f + h + 4 * h) + v * h + 4 * h
    kv = m.kv_heads * (h // m.heads)
    per_layer = 2.0 * h * h + 2.0 * h * kv + 3.0 * h * f + 2 * h
    return l * per_layer + v * h * (1 if m.tied_embeddings else 2) + h


# --------------------------------------------------------------------------------------------
# measured iteration time
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MeasuredTime:
    """A run's measured iteration time, how it was obtained, and its relative uncertainty
    from the source's rounding (not from run-to-run variation, which no source reports)."""

    seconds: float
    how: str
    rel_uncertainty: float


def _rounding(measured: Measured, key: str) -> float:
    """Half a unit of the last printed digit of ``measured.<key>`` (137 → 0.5, 4.4 → 0.05,
    "1.10" → 0.005)."""
    if key in measured.rounding:
        return measured.rounding[key]
    text = measured.printed.get(key) or repr(float(getattr(measured, key)))
    decimals = len(text.split(".")[1]) if "." in text else 0
    if key not in measured.printed and text.endswith(".0"):
        decimals = 0
    return 0.5 * 10.0 ** (-decimals)


def measured_iteration(run: Run, conventions: dict[str, Convention] | None = None
                       ) -> MeasuredTime:
    """The measured iteration time of ``run`` in seconds (see module docstring).

    ``conventions`` (the data file's) adds a convention's own ``rel_uncertainty`` to the
    rounding error of a converted time.
    """
    m = run.measured
    if m.iteration_time_s is not None:
        return MeasuredTime(m.iteration_time_s, "published iteration time",
                            _rounding(m, "iteration_time_s") / m.iteration_time_s)
    flops = flops_per_iteration(run)
    n = run.cluster.gpus
    options = []
    if m.tflops_per_gpu is not None:
        options.append((_rounding(m, "tflops_per_gpu") / m.tflops_per_gpu,
                        m.tflops_per_gpu * 1e12 * n, f"{m.tflops_per_gpu:g} TFLOP/s per GPU"))
    if m.aggregate_pflops is not None:
        options.append((_rounding(m, "aggregate_pflops") / m.aggregate_pflops,
                        m.aggregate_pflops * 1e15, f"{m.aggregate_pflops:g} PFLOP/s aggregate"))
    rel, rate, what = min(options)
    conv = (conventions or {}).get(run.flops_convention)
    rel += conv.rel_uncertainty if conv is not None else 0.0
    return MeasuredTime(flops / rate, f"{what} via {run.flops_convention}", rel)
