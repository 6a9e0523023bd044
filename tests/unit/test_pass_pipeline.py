"""The pass pipeline as data: spec parsing, section enforcement, failures that keep their
attributes, and CompileOptions' shorthands.

Passes run on small synthetic workloads (the helpers of ``test_passes.py``), never traced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest

from hetplan.errors import PassError, SpecError, TraceError
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import Layout, Stage
from hetplan.optimizer.options import CompileOptions
from hetplan.passes import BASELINE_PIPELINE, DEFAULT_PASSES, DEFAULT_PIPELINE, get_all_passes
from hetplan.passes.base import PassContext, PassResult
from hetplan.passes.cupcake import CupcakeFusion
from hetplan.passes.ddp_buckets import DDPBuckets
from hetplan.passes.espresso import Espresso
from hetplan.passes.manager import run_passes
from hetplan.passes.spec import format_pipeline, parse_pipeline, resolve_pipeline
from hetplan.passes.tp_resizing import TPResizing
from hetplan.passes.uniform_stages import UniformStages

from test_passes import context, empty_plan, workload


# -- parsing -------------------------------------------------------------------------------
def test_default_pipeline_parses_to_the_registered_passes_in_order() -> None:
    passes = parse_pipeline(DEFAULT_PIPELINE)
    assert tuple(p.name for p in passes) == DEFAULT_PASSES
    registry = get_all_passes()
    assert all(type(p) is registry[p.name] for p in passes)
    assert all(p == registry[p.name]() for p in passes)  # no option set: the defaults


def test_spec_options_become_typed_fields() -> None:
    passes = parse_pipeline(
        "dynpipe,espresso{compressors=dgc,fp16 max-compressions=1 uniform_seeds=false},"
        "cupcake-fusion{max-group=3},tp-resizing{controller=semi gamma-max=0.5 criterion=none}"
    )
    assert [p.name for p in passes] == ["dynpipe", "espresso", "cupcake-fusion", "tp-resizing"]
    assert passes[1] == Espresso(compressors=("dgc", "fp16"), max_compressions=1,
                                 uniform_seeds=False)
    assert passes[2] == CupcakeFusion(max_group=3)
    assert passes[3] == TPResizing(controller="semi", gamma_max=0.5, criterion=None)


def test_format_pipeline_round_trips() -> None:
    spec = ("uniform-stages,even-tp,ddp-buckets{bucket-cap-mb=50.0},"
            "espresso{compressors=dgc,fp16 devices=gpu},tp-resizing{controller=zero}")
    passes = parse_pipeline(spec)
    assert format_pipeline(passes) == spec
    assert parse_pipeline(format_pipeline(passes)) == passes


def test_refines_follows_the_options() -> None:
    assert Espresso().refines is False  # fp32 routing only: cheap, every layout gets it
    assert Espresso(compressors=("dgc",)).refines is True
    assert CupcakeFusion().refines is True
    assert UniformStages().refines is False


@pytest.mark.parametrize("spec, words", [
    ("dynpipe,espreso", ["unknown pass 'espreso'", "did you mean 'espresso'"]),
    ("espresso{compresors=dgc}", ["unknown option 'compresors'", "did you mean 'compressors'"]),
    ("espresso{max-compressions=two}", ["max-compressions='two'", "expected int"]),
    ("tp-resizing{controller=sem}", ["controller='sem'", "off|zero|migration|semi"]),
    ("tp-resizing{gamma-max=1.5}", ["gamma_max must be in [0, 1)"]),
    # were: a pydantic ValidationError once the search had run ("pass 'tp-resizing' failed")
    ("tp-resizing{alpha=nan}", ["alpha must be in [0, 1]", "got nan"]),
    ("tp-resizing{theta-iter=-1}", ["theta_iter must be", "got -1.0"]),
    ("tp-resizing{replan-trigger=inf}", ["replan_trigger must be", "got inf"]),
    ("tp-resizing{straggler-eps=nan}", ["straggler_eps must be", "got nan"]),
    ("sdpipe{p=1000000000}", ["sdpipe{p=1000000000}", "1..1000000"]),
    ("espresso{compressors=dgc ratio=nan}", ["ratio must be in (0, 1]", "got nan"]),
    ("espresso{compressors=dgc ratio=2}", ["ratio must be in (0, 1]", "got 2.0"]),
    ("espresso-reference{ratio=0}", ["ratio must be in (0, 1]", "got 0.0"]),
    # were: accepted
    ("espresso{seed-within=nan}", ["seed_within=nan: must be >= 0"]),
    ("espresso{bound-within=nan}", ["bound_within=nan: must be >= 0"]),
    ("espresso{max-compressions=-1}", ["max_compressions=-1: must be >= 0"]),
    ("espresso{devices=gpu,tpu}", ["espresso devices: unknown 'tpu'", "gpu, cpu"]),
    # was: refused after the layout search had run
    ("espresso{compressors=dgc devices=cpu}", ["espresso needs 'gpu' in devices"]),
    # were: accepted, buckets drawn at a cap of -1 or nan MiB
    ("ddp-buckets{bucket-cap-mb=-1}", ["bucket-cap-mb must be", "got -1.0"]),
    ("ddp-buckets{bucket-cap-mb=nan}", ["bucket-cap-mb must be", "got nan"]),
    ("ddp-buckets{first-bucket-mb=-1}", ["first-bucket-mb must be", "got -1.0"]),
    ("espresso{compressors=zip}", ["unknown compressor 'zip'"]),
    ("espresso{compressors=dgc", ["unclosed '{'"]),
    ("espresso}", ["unmatched '}'"]),
    ("dynpipe,,espresso", ["empty pass name"]),
    ("espresso{compressors}", ["is not key=value"]),
    ("espresso{ratio=0.1 ratio=0.2}", ["given twice"]),
    ("dynpipe{dynamics=/no/such/file.yaml}", ["dynamics", "does not exist"]),
    ("", ["pipeline is empty"]),
])
def test_bad_specs_name_the_pass_option_and_fix(spec: str, words: list[str]) -> None:
    with pytest.raises(SpecError) as info:
        parse_pipeline(spec, where="--passes")
    msg = str(info.value)
    assert msg.startswith("--passes: ")
    for w in words:
        assert w in msg, msg


def test_resolve_pipeline_takes_names_specs_and_instances() -> None:
    passes = resolve_pipeline(["uniform-stages", "even-tp,ddp-buckets", CupcakeFusion(3)])
    assert [p.name for p in passes] == ["uniform-stages", "even-tp", "ddp-buckets",
                                        "cupcake-fusion"]
    assert passes[-1] == CupcakeFusion(max_group=3)
    with pytest.raises(SpecError, match="neither a pass name nor a pass instance"):
        resolve_pipeline(["uniform-stages", 3])  # type: ignore[list-item]


# -- CompileOptions ------------------------------------------------------------------------
def test_compile_options_shorthands_set_pass_options() -> None:
    opts = CompileOptions(batch_size=8, compressors=("dgc",), tp_controller="semi",
                          tp_gamma_max=0.5)
    passes = {p.name: p for p in opts.pipeline()}
    assert passes["espresso"] == Espresso(compressors=("dgc",))
    assert passes["tp-resizing"] == TPResizing(controller="semi", gamma_max=0.5)
    # the same, spelled in the spec
    spec = DEFAULT_PIPELINE.replace("espresso", "espresso{compressors=dgc}").replace(
        "tp-resizing", "tp-resizing{controller=semi gamma-max=0.5}")
    assert CompileOptions(batch_size=8, passes=spec).pipeline() == opts.pipeline()


def test_compile_options_refuse_contradictions_and_orphans() -> None:
    spec = DEFAULT_PIPELINE.replace("espresso", "espresso{compressors=topk}")
    with pytest.raises(SpecError, match="disagree"):
        CompileOptions(batch_size=8, passes=spec, compressors=("dgc",)).pipeline()
    with pytest.raises(SpecError, match="no 'espresso' pass"):
        CompileOptions(batch_size=8, passes=BASELINE_PIPELINE, compressors=("dgc",)).pipeline()
    with pytest.raises(SpecError, match="start it with a pass that writes them"):
        CompileOptions(batch_size=8, passes="even-tp,uniform-stages").pipeline()


def test_compile_options_validate_fields_with_suggestions() -> None:
    with pytest.raises(SpecError, match="did you mean 'batch_size'"):
        CompileOptions.build(batch_sise=8)
    with pytest.raises(SpecError, match="unknown schedule 'zigzag'"):
        CompileOptions.build(batch_size=8, schedule="zigzag")
    with pytest.raises(SpecError, match="batch_size"):
        CompileOptions.build(batch_size=0)
    opts = CompileOptions.build(CompileOptions(batch_size=8, passes=(UniformStages(),)), pp=2)
    assert opts.pp == 2 and opts.passes == (UniformStages(),)  # instances kept as given


def test_compile_options_built_directly_raise_spec_errors() -> None:
    # before: pydantic's ValidationError, where compile() documents a SpecError
    with pytest.raises(SpecError, match="compile options: batch_size: Input should be greater "
                                        "than or equal to 1"):
        CompileOptions(batch_size=0)
    with pytest.raises(SpecError, match="did you mean 'schedule'"):
        CompileOptions(batch_size=8, shedule="1f1b")  # type: ignore[call-arg]


@pytest.mark.parametrize("option, value, kind", [
    ("batch_size", True, "a boolean"), ("batch_size", "8", "a string"), ("dp", True, "a boolean"),
    ("pp", "2", "a string"), ("tp", False, "a boolean"), ("micro_batch_size", True, "a boolean"),
    ("seq", True, "a boolean"), ("virtual_stages", "2", "a string"),
    ("zero_stage", True, "a boolean"), ("efficiency", True, "a boolean"),
    ("tp_gamma_max", "0.5", "a string"),
])
def test_compile_options_numbers_are_strict(option: str, value: object, kind: str) -> None:
    # before, pydantic's lax mode read batch_size=True as 1, dp=True as dp=1 and "8" as 8:
    # a plan for numbers nobody asked for
    kwargs = {"batch_size": 8, option: value}
    with pytest.raises(SpecError, match=f"{option}: expected (an integer|a number), got {kind}"):
        CompileOptions.build(**kwargs)


# -- the manager ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Trespasser:
    """Declares ``gradient_sync`` but rewrites the stages too."""

    name: ClassVar[str] = "trespasser"
    sections: ClassVar[tuple[str, ...]] = ("gradient_sync",)
    refines: ClassVar[bool] = False

    def run(self, plan: Plan, ctx: PassContext) -> PassResult:
        moved = tuple(st.model_copy(update={"fwd_ms": 1.0}) for st in plan.stages)
        return PassResult(plan.model_copy(update={"stages": moved}), True)


@dataclass(frozen=True)
class Tracer:
    """Raises a TraceError with its attributes set."""

    name: ClassVar[str] = "tracer"
    sections: ClassVar[tuple[str, ...]] = ("stages",)
    refines: ClassVar[bool] = False

    def run(self, plan: Plan, ctx: PassContext) -> PassResult:
        raise TraceError("cannot trace", module="blocks.3.attn", reason="data-dependent")


def test_pass_writing_outside_its_sections_fails() -> None:
    ctx = context(workload(4), Layout(dp=2, pp=2))
    with pytest.raises(PassError) as info:
        run_passes(empty_plan(ctx), [UniformStages(), Trespasser()], ctx)
    msg = str(info.value)
    assert "'trespasser'" in msg and "section 'stages'" in msg
    assert "stages[0].fwd_ms" in msg  # the first field that changed
    assert "['gradient_sync']" in msg


def test_pass_writing_its_own_sections_passes() -> None:
    ctx = context(workload(4), Layout(dp=2, pp=2))
    plan = run_passes(empty_plan(ctx), [UniformStages(), DDPBuckets()], ctx)
    assert [e.name for e in plan.pass_log] == ["uniform-stages", "ddp-buckets"]
    assert all(isinstance(st, Stage) for st in plan.stages)


def test_failures_keep_class_attributes_and_cause() -> None:
    ctx = context(workload(4), Layout(dp=2))
    with pytest.raises(TraceError) as info:
        run_passes(empty_plan(ctx), [Tracer()], ctx)
    assert info.value.module == "blocks.3.attn" and info.value.reason == "data-dependent"
    assert "in pass 'tracer'" in str(info.value)
    assert isinstance(info.value.__cause__, TraceError)


def test_hetplan_passes_names_the_module_a_description_points_to() -> None:
    """`hetplan passes` printed 'Optimal contiguous buckets per shared strategy (see module
    docstring)' without saying which module; it now names it."""
    from hetplan.passes.spec import describe_passes

    docs = {name: doc for name, doc, _ in describe_passes()}
    assert docs["cupcake-fusion"].endswith("(see the docstring of hetplan.passes.cupcake).")
    assert not any("(see module docstring)" in d or "(module docstring)" in d
                   for d in docs.values())
