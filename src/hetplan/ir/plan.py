"""The Plan: the only contract between the optimizer and the runtime (schema version 1).

A :class:`Plan` names the model and cluster it was made for (by fingerprint) and holds one
section per pass: parallel layout, pipeline stages, tensor-parallel shards, gradient
synchronization (per-tensor strategies and fusion buckets), predictions, cost provenance and a
pass log. Sections are filled by later passes, so all are optional or empty by default; the
section types live in :mod:`hetplan.ir.plan_sections`.

Serialization is deterministic: ``Plan.to_json()`` writes sorted keys with a fixed indent and
no timestamps or paths, so equal plans give byte-identical files. Reading checks the schema
version first and refuses plans from a newer hetplan (:class:`PlanVersionError`).

Validation: every plan, however it is made (``Plan(...)``, ``model_validate`` after each pass,
:func:`load_plan`), passes its sections' own checks and the cross-section rules of
:mod:`hetplan.ir.plan_checks`; a plan file must also be complete (a layout, the stages of a
pipeline, the workload summary). Every problem is one line naming the field path.

Example:
    >>> plan = Plan(model=ModelRef(name="mlp", fingerprint="ab12", num_params=10),
    ...             cluster=ClusterRef(name="local", fingerprint="cd34", world_size=2))
    >>> Plan.from_json(plan.to_json()) == plan
    True

Run ``python -m hetplan.ir.plan --write-schema tests/golden/plan.schema.json`` after changing
the format (and bump ``SCHEMA_VERSION``).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    model_validator,
)

from hetplan._version import __version__
from hetplan.errors import PlanMismatchError, PlanVersionError, SpecError
from hetplan.ir.plan_checkpointing import Checkpointing
from hetplan.ir.plan_checks import plan_problems
from hetplan.ir.plan_tp_checks import TPModel, tp_model_problems
from hetplan.ir.plan_sections import (
    Baseline,
    Bucket,
    CastSync,
    ClusterRef,
    CommStep,
    CompressedSync,
    CostSettings,
    CostSource,
    GradCost,
    GradientSync,
    LayerCost,
    Layout,
    ModelRef,
    Name,
    NoSync,
    PassLogEntry,
    PipelineActions,
    Precision,
    Predictions,
    RankPlacement,
    ResizingController,
    Stage,
    SyncStrategy,
    TensorParallel,
    TensorSync,
    TimeBreakdown,
    TPGroup,
    TPLinearShard,
    TPRankRole,
    WorkloadSummary,
)
from hetplan.ir.plan_group_sync import GroupSync
from hetplan.ir.plan_hetero import Hetero
from hetplan.ir.plan_sparse import SparseSync
from hetplan.ir.rebalancing import Rebalancing
from hetplan.ir.files import check_kind, check_kind_of_text, file_path, write_text_file
from hetplan.ir.validation import format_validation_error, loads_json, read_text_file

__all__ = [
    "SCHEMA_VERSION",
    "Plan",
    "PlanSummary",
    "load_plan",
    "check_plan_matches",
    "export_json_schema",
    # sections, re-exported for convenience
    "Baseline",
    "Bucket",
    "CastSync",
    "ClusterRef",
    "CommStep",
    "CompressedSync",
    "CostSettings",
    "CostSource",
    "GradCost",
    "GradientSync",
    "LayerCost",
    "Layout",
    "ModelRef",
    "NoSync",
    "PassLogEntry",
    "PipelineActions",
    "Precision",
    "Predictions",
    "RankPlacement",
    "ResizingController",
    "Stage",
    "SyncStrategy",
    "TensorParallel",
    "TensorSync",
    "TimeBreakdown",
    "TPGroup",
    "TPLinearShard",
    "TPRankRole",
    "WorkloadSummary",
]

#: The plan format this hetplan writes and reads.
SCHEMA_VERSION: Literal[1] = 1

_RERUN = "re-run `hetplan plan` for this model and cluster"


class Plan(BaseModel):
    """An execution plan for one model on one cluster.

    Attributes:
        schema_version: format version; readers refuse versions they do not know.
        tool_version: the hetplan version that wrote the plan.
        model: model name, fingerprint, size and (optionally) its workload numbers.
        cluster: cluster name, fingerprint and world size.
        layout: dp × pp × tp, micro-batching, schedule, rank mapping (None: not decided).
        stages: pipeline stages, in order (empty: no pipeline decided).
        pipeline_actions: per pipeline rank, the ordered actions of the layout's schedule
            (None: no pipeline, or a plan written before this section; the runtime then
            generates the same lists from the layout).
        tensor_parallel: TP groups, shard sizes and resizing controller (None: no TP).
        gradient_sync: per-tensor strategies and fusion buckets (None: not decided).
        sparse_sync: the scheme of each sparse (embedding) gradient (None: all dense;
            :mod:`hetplan.ir.plan_sparse`).
        predictions: predicted iteration time, memory and the baselines' numbers.
        provenance: for each cost kind (``compute``, ``comm.inter`` ...) where it came from.
        cost_settings: the cost-model settings the predictions were made with.
        precision: the compute dtype of every device type, master weights, optimizer state
            and gradient-reduce dtypes (None: a plan written before the section existed,
            computing in ``cost_settings.dtype`` everywhere).
        pass_log: the passes that ran, in order.
        rebalancing: pipeline re-balancing policy and planned events for a dynamic model
            (None: static model).
        checkpointing: Gemini's in-memory checkpoints (None: no checkpointing planned);
            :mod:`hetplan.ir.plan_checkpointing`.
        group_sync: semi-decentralized group synchronisation of the pipeline replicas
            (SDPipe; :mod:`hetplan.ir.plan_group_sync`), or None: synchronous data parallel.
        hetero: each stage's own device class and (dp, tp) (:mod:`hetplan.ir.plan_hetero`),
            or None: every stage runs the layout's dp x tp.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    schema_version: Literal[1] = SCHEMA_VERSION
    tool_version: str = Field(default_factory=lambda: __version__, min_length=1)
    model: ModelRef
    cluster: ClusterRef
    layout: Layout | None = None
    stages: tuple[Stage, ...] = ()
    pipeline_actions: PipelineActions | None = None
    tensor_parallel: TensorParallel | None = None
    gradient_sync: GradientSync | None = None
    sparse_sync: SparseSync | None = None
    rebalancing: Rebalancing | None = None
    predictions: Predictions | None = None
    provenance: dict[Name, CostSource] = Field(default_factory=dict)
    cost_settings: CostSettings | None = None
    precision: Precision | None = None
    pass_log: tuple[PassLogEntry, ...] = ()
    checkpointing: Checkpointing | None = None
    group_sync: GroupSync | None = None
    hetero: Hetero | None = None

    @model_validator(mode="after")
    def _check_cross_section(self, info: ValidationInfo) -> Plan:
        """The one semantic check (:mod:`hetplan.ir.plan_checks`); a complete plan is
        required when the validation context says ``{"complete": True}`` (reading JSON)."""
        complete = bool(info.context and info.context.get("complete"))
        if problems := plan_problems(self, complete=complete):
            raise ValueError("\n".join(problems))  # one line each in the SpecError
        return self

    def loss_replicas(self) -> int:
        """The data-parallel replicas that each compute a loss (the run's progress line
        shows one of them, its report their mean): the layout's ``dp``; with per-stage
        degrees (``hetero``, whose layout holds placeholders), the last stage's."""
        if self.hetero is not None and self.hetero.stages:
            return self.hetero.stages[-1].dp
        return self.layout.dp if self.layout is not None else 1

    # -- serialization -------------------------------------------------------------------
    def to_json(self) -> str:
        """The plan as JSON: sorted keys, indent 2, trailing newline; byte-identical for
        equal plans."""
        data = self.model_dump(mode="json")
        return json.dumps(data, sort_keys=True, indent=2, allow_nan=False) + "\n"

    def save(self, path: str | Path) -> None:
        """Write :meth:`to_json` to ``path`` (UTF-8)."""
        write_text_file(path, self.to_json(), what="plan")

    @classmethod
    def from_json(cls, text: str, *, where: str = "<string>", complete: bool = False) -> Plan:
        """Parse plan JSON.

        Args:
            text: the JSON text.
            where: how to name the source in error messages (usually the file path).
            complete: also require a finished plan (a layout, the stages of a pipeline, the
                workload summary: rule 9 of :mod:`hetplan.ir.plan_checks`), as
                :func:`load_plan` does for plan files; the default reads drafts too.

        Raises:
            SpecError: invalid JSON (a key written twice, nesting too deep included), not an
                object, missing ``schema_version``, a field that is unknown, missing or out
                of range, or sections that do not fit together; one line per problem, each
                naming ``where`` and the field path.
            PlanVersionError: the plan has a schema version this hetplan does not read.
        """
        if not isinstance(text, (str, bytes, bytearray)):
            fix = ("for a dict parsed already, pass json.dumps(data)" if isinstance(text, dict)
                   else "to read a plan file, call hetplan.load_plan(path)")
            raise SpecError(f"{where}: Plan.from_json takes a plan's JSON text, got "
                            f"{type(text).__name__}; {fix}")
        try:
            data = loads_json(text, where=where)
        except json.JSONDecodeError as e:
            check_kind_of_text(text, what="plan", where=where)  # a YAML cluster spec, say
            hint = ""
            if not text.strip():
                hint = " (the file is empty)"
            elif e.pos >= len(text.rstrip()):
                hint = " (the file looks truncated)"
            raise SpecError(
                f"{where}: not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}{hint}; "
                f"{_RERUN} to write a fresh plan"
            ) from e
        if not isinstance(data, dict):
            raise SpecError(
                f"{where}: a plan is a JSON object, got a JSON {_json_type(data)}; "
                "is this a hetplan plan file?"
            )
        check_kind(data, what="plan", where=where)  # before its schema_version is read
        _check_version(data, where)
        try:
            return cls.model_validate(data, context={"complete": complete})
        except ValidationError as e:
            hint = f"hint: plan files are written by `hetplan plan`; {_RERUN} rather than editing"
            raise SpecError(format_validation_error(e, where=where, model=cls, hint=hint)) from e

    # -- reporting -------------------------------------------------------------------------
    def summary(self) -> PlanSummary:
        """The headline numbers of the plan, for ``hetplan inspect`` and logs."""
        lay = self.layout
        pred = self.predictions
        sync = self.gradient_sync
        baselines = pred.baselines if pred is not None else ()
        best = min(baselines, key=lambda b: (b.iteration_time_ms, b.name), default=None)
        compressed: set[str] = set()
        if sync is not None:
            uses = [(t.name, t.strategy) for t in sync.tensors]
            uses += [(name, b.strategy) for b in sync.buckets for name in b.tensors]
            compressed = {n for n, s in uses if sync.strategies[s].kind == "compressed"}
        return PlanSummary(
            model=self.model.name,
            cluster=self.cluster.name,
            world_size=self.cluster.world_size,
            layout=f"dp={lay.dp} pp={lay.pp} tp={lay.tp}" if lay is not None else "undecided",
            schedule=lay.schedule if lay is not None else None,
            micro_batches=lay.micro_batches if lay is not None else None,
            num_stages=len(self.stages),
            num_buckets=len(sync.buckets) if sync is not None else 0,
            compressed_tensors=len(compressed),
            iteration_time_ms=pred.iteration_time_ms if pred is not None else None,
            bubble_ratio=pred.bubble_ratio if pred is not None else None,
            peak_memory_bytes=max(pred.memory_per_rank_bytes, default=None)
            if pred is not None else None,
            best_baseline=best.name if best is not None else None,
            best_baseline_time_ms=best.iteration_time_ms if best is not None else None,
        )


@dataclass(frozen=True)
class PlanSummary:
    """Headline numbers of a plan; ``None`` where the plan has not decided or predicted it."""

    model: str
    cluster: str
    world_size: int
    layout: str
    schedule: str | None
    micro_batches: int | None
    num_stages: int
    num_buckets: int
    compressed_tensors: int
    iteration_time_ms: float | None
    bubble_ratio: float | None
    peak_memory_bytes: int | None
    best_baseline: str | None
    best_baseline_time_ms: float | None

    @property
    def speedup(self) -> float | None:
        """Best baseline time / plan time (> 1 means the plan is faster)."""
        if not self.iteration_time_ms or self.best_baseline_time_ms is None:
            return None
        return self.best_baseline_time_ms / self.iteration_time_ms

    def to_dict(self) -> dict[str, Any]:
        """The fields plus ``speedup``, as a plain dict (for JSON output of the CLI)."""
        return {**asdict(self), "speedup": self.speedup}


def _json_type(value: object) -> str:
    names = {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _check_version(data: dict[str, Any], where: str) -> None:
    if "schema_version" not in data:
        raise SpecError(
            f"{where}: missing 'schema_version'; a hetplan plan starts with "
            f'"schema_version": {SCHEMA_VERSION}. Is this a plan written by `hetplan plan`?'
        )
    version = data["schema_version"]
    if isinstance(version, bool) or not isinstance(version, int):
        raise SpecError(
            f"{where}: schema_version: must be an integer (this hetplan reads "
            f"{SCHEMA_VERSION}), got {version!r}"
        )
    if version > SCHEMA_VERSION and data.get("tool_version") == __version__:
        raise PlanVersionError(
            f"{where} has schema_version {version}, but its tool_version is this hetplan's "
            f"({__version__}), which writes version {SCHEMA_VERSION}: the field was edited; "
            f"restore \"schema_version\": {SCHEMA_VERSION}, or {_RERUN}")
    if version > SCHEMA_VERSION:
        tool = data.get("tool_version")
        by = f" {tool}" if isinstance(tool, str) else ""
        raise PlanVersionError(
            f"{where} was written by a newer hetplan{by} (schema_version {version}); this "
            f"hetplan ({__version__}) reads version {SCHEMA_VERSION}; upgrade hetplan"
        )
    if version != SCHEMA_VERSION:
        raise PlanVersionError(
            f"{where} has schema_version {version}, which no hetplan release wrote; this "
            f"hetplan reads version {SCHEMA_VERSION}; {_RERUN}"
        )


def load_plan(path: str | Path) -> Plan:
    """Read a plan file written by :meth:`Plan.save`.

    Every command that reads a plan (``validate``, ``inspect``, ``simulate``, ``explain``,
    ``diff``, ``timeline``, ``run`` and its workers) reads it here, so each sees the same
    verdict: the plan's full validation, a complete plan required (see
    :mod:`hetplan.ir.plan_checks`).

    Raises:
        SpecError: the file is missing, unreadable, or not a valid, complete plan; one line
            per problem, each naming the file and the field path.
        PlanVersionError: the plan is from a newer (or unknown) schema version.
    """
    p = file_path(path, what="plan")
    if not p.exists():
        raise SpecError(f"plan file {str(p)!r} does not exist; create one with `hetplan plan`")
    text = read_text_file(p, what="plan")
    return Plan.from_json(text, where=str(p), complete=True)


class _Fingerprinted(Protocol):
    @property
    def name(self) -> str: ...

    def fingerprint(self) -> str: ...


def check_plan_matches(
    plan: Plan,
    *,
    model_ir: _Fingerprinted | None = None,
    cluster: _Fingerprinted | None = None,
    world_size: int | None = None,
) -> None:
    """Check that ``plan`` was made for this model, cluster and world size.

    With the model it was made for (same fingerprint), also what only the model can tell:
    the embedded workload was not edited, and the ``tensor_parallel`` linears are the
    model's, split their own way, with its ``features`` and one size list per Megatron pair
    (:mod:`hetplan.ir.plan_tp_checks`).

    Args:
        plan: the plan to check.
        model_ir: a :class:`~hetplan.ir.model.ModelIR` (anything with ``name`` and
            ``fingerprint()``; its ``layers``, when it has them, for the workload and TP
            checks); skipped when None.
        cluster: a :class:`~hetplan.ir.cluster.ClusterSpec`; skipped when None.
        world_size: the number of processes of the running job; skipped when None.

    Raises:
        PlanMismatchError: listing every mismatch, both sides, and how to fix it (one line
            per ``tensor_parallel`` problem, naming its field path).
    """
    problems = []
    lines: list[str] = []  # field-path problems, each with its own fix
    if model_ir is not None and model_ir.fingerprint() != plan.model.fingerprint:
        problems.append(
            f"the plan is for model {plan.model.name!r} (fingerprint "
            f"{plan.model.fingerprint}), but the model given is {model_ir.name!r} "
            f"(fingerprint {model_ir.fingerprint()}): its layers, parameter sizes or input "
            "shapes differ from what was planned"
            + _input_shapes_differ(plan, model_ir) + _opaque_layers(plan)
        )
    if model_ir is not None and not problems:  # the model planned for: was the plan edited?
        problems += _edited_workload(plan, model_ir)
        lines += _tp_problems(plan, model_ir)
    if cluster is not None and cluster.fingerprint() != plan.cluster.fingerprint:
        problems.append(
            f"the plan is for cluster {plan.cluster.name!r} (fingerprint "
            f"{plan.cluster.fingerprint}), but the cluster given is {cluster.name!r} "
            f"(fingerprint {cluster.fingerprint()})"
        )
    if world_size is not None and world_size != plan.cluster.world_size:
        problems.append(
            f"the plan expects world size {plan.cluster.world_size} (cluster "
            f"{plan.cluster.name!r}), but the job runs {world_size} processes"
        )
    if problems:
        lines.insert(0, "plan does not match: " + "; ".join(problems) + f". To fix, {_RERUN} "
                     "(or load the plan that was made for them).")
    if lines:
        raise PlanMismatchError("\n".join(lines))


def _opaque_layers(plan: Plan) -> str:
    """Why a plan captured with opaque modules never matches a run's capture (its ranks and
    `hetplan run` capture without them): "" for a plan without such layers."""
    wl = plan.model.workload
    names = [lay.name for lay in wl.layers if lay.kind == "opaque"] if wl is not None else []
    if not names:
        return ""
    return (f"; the plan was captured with opaque modules ({', '.join(names[:3])}"
            f"{', ...' if len(names) > 3 else ''}), which `hetplan run` and the runtime do not "
            "take yet: such a plan can be inspected, simulated and exported, not run")


def _input_shapes_differ(plan: Plan, model_ir: _Fingerprinted) -> str:
    """When the same model (its layers' names and parameter bytes) was given inputs that
    differ beyond the batch dimension (a plan made with ``--seq`` for a zoo model, which
    ``hetplan run`` builds at its default length), say so: it is then the cause of the
    fingerprint mismatch, which the message would otherwise not name."""
    given = getattr(model_ir, "input_shapes", None)
    layers = getattr(model_ir, "layers", None)
    workload = plan.model.workload
    if not given or workload is None or not workload.input_shapes or layers is None:
        return ""
    planned = workload.input_shapes
    if ([(x.name, x.param_bytes) for x in workload.layers]
            != [(x.name, x.param_bytes) for x in layers]):
        return ""  # another model altogether, not the same one at another length

    def shown(shapes: Any) -> str:
        return ", ".join("×".join(str(d) for d in s) for s in shapes)

    if [tuple(s[1:]) for s in given] == [tuple(s[1:]) for s in planned]:
        return ""
    return (f" (the plan's example inputs are {shown(planned)}, the model given takes "
            f"{shown(given)}: `hetplan run` builds a zoo model's inputs at its default "
            "sequence length, so plan it without --seq)")


def _edited_workload(plan: Plan, model_ir: _Fingerprinted) -> list[str]:
    """The first difference between the plan's embedded workload and the model it was made
    for (same fingerprint) in what capture alone decides: layer names and parameter bytes,
    gradient names, sizes and layers. A plan file whose workload was edited is priced on the
    edited numbers and runs the real model; the file alone cannot tell (the fingerprint
    hashes the whole IR, which the plan does not embed)."""
    workload = plan.model.workload
    layers, grads = getattr(model_ir, "layers", None), getattr(model_ir, "grad_tensors", None)
    if workload is None or layers is None or grads is None:
        return []
    ours = [("layers", i, "name / param_bytes", (x.name, x.param_bytes))
            for i, x in enumerate(workload.layers)]
    theirs = [(x.name, x.param_bytes) for x in layers]
    ours_g = [("grads", i, "name / size_bytes / layer_index",
               (g.name, g.size_bytes, g.layer_index)) for i, g in enumerate(workload.grads)]
    theirs_g = [(g.name, g.size_bytes, g.layer_index) for g in grads]
    for mine, real in ((ours, theirs), (ours_g, theirs_g)):
        if len(mine) != len(real):
            return [f"model.workload.{mine[0][0] if mine else 'layers'}: {len(mine)}, but model "
                    f"{model_ir.name!r} has {len(real)}: the plan was edited after planning"]
        for (section, i, fields, value), want in zip(mine, real):
            if value != want:
                return [f"model.workload.{section}[{i}] ({fields}): {value}, but model "
                        f"{model_ir.name!r} has {want}: the plan was edited after planning"]
    return []


def _tp_problems(plan: Plan, model_ir: _Fingerprinted) -> list[str]:
    """The ``tensor_parallel`` rules that need the model (``model_ir``: a ModelIR, its layers
    and their ``linears``; where it has ``head_dims``, the attention modules' output
    projections and head sizes, whole heads too): :mod:`hetplan.ir.plan_tp_checks`. The plan
    validator sees only the workload's layers; these check each listed linear against the
    module itself."""
    layers = getattr(model_ir, "layers", None)
    if plan.tensor_parallel is None or layers is None:
        return []
    model = TPModel.of(model_ir.name,
                       (lin for layer in layers for lin in getattr(layer, "linears", ())),
                       other_names=(layer.name for layer in layers),  # a layer may be a linear
                       head_dims=dict(getattr(model_ir, "head_dims", ())))
    return tp_model_problems(plan.tensor_parallel, model)


def export_json_schema() -> str:
    """The JSON Schema of :class:`Plan`, as deterministic JSON (sorted keys, indent 2)."""
    return json.dumps(Plan.model_json_schema(), sort_keys=True, indent=2) + "\n"


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hetplan.ir.plan", description="Export the JSON Schema of the plan."
    )
    parser.add_argument("--write-schema", metavar="PATH", help="write the schema to PATH")
    args = parser.parse_args(argv)
    if args.write_schema is None:
        sys.stdout.write(export_json_schema())
        return 0
    Path(args.write_schema).write_text(export_json_schema(), encoding="utf-8")
    print(f"wrote {args.write_schema}")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
