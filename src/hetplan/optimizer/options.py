"""``CompileOptions``: everything ``compile`` is asked to do, validated in one place.

The pass pipeline is data (:mod:`hetplan.passes.spec`): ``passes`` is a spec string such as
``"dynpipe,espresso{compressors=dgc,fp16},cupcake-fusion,tp-resizing{controller=semi}"``, or
a sequence of names / pass instances. Three options are shorthands that set a pass option on
the pipeline (they exist because ``hetplan plan`` has had these flags since before specs):

- ``compressors`` sets ``espresso{compressors=...}``;
- ``dynamics`` sets ``dynpipe{dynamics=...}`` (and needs a ``dynpipe`` pass);
- ``tp_controller`` / ``tp_gamma_max`` set ``tp-resizing{controller=... gamma-max=...}``;
- ``recompute`` sets the ``recompute`` option of the pass that writes the stages
  (``dynpipe`` or ``uniform-stages``).

A shorthand and the spec may not disagree: setting the same option both ways to different
values is a :class:`~hetplan.errors.SpecError`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from hetplan.cost_models.pipeline import SCHEDULES
from hetplan.errors import SpecError
from hetplan.ir.fields import MAX_COUNT, strict_float, strict_int
from hetplan.ir.rebalancing import DynamicsSpec
from hetplan.ir.validation import did_you_mean, format_validation_error
from hetplan.passes import DEFAULT_PIPELINE, get_all_passes
from hetplan.passes.base import Pass
from hetplan.passes.spec import resolve_pipeline

__all__ = ["CompileOptions"]

PosInt = Field(default=None, ge=1)


class CompileOptions(BaseModel):
    """What to plan and how (see module docstring and :func:`hetplan.compile`).

    Attributes:
        batch_size: global batch size per iteration (samples).
        seq: sequence length for zoo language models.
        schedule: pipeline schedule (one of ``cost_models.pipeline.SCHEDULES``), or ``auto``:
            search 1F1B and interleaved 1F1B (2 to 4 chunks per rank) side by side (1F1B
            alone when ``dynamics`` are re-balanced: DynPipe needs one chunk per rank).
        passes: the pass pipeline (spec string, or names / pass instances).
        dp / pp / tp / micro_batch_size: pin a layout dimension.
        virtual_stages / sequence_parallel / zero_stage: pin a strategy dimension (interleaved
            chunks per pipeline rank; Megatron sequence parallelism with TP; ZeRO sharding
            inside data-parallel groups); None: searched.
        recompute: pin every stage's activation recomputation (``none``, ``selective``,
            ``full``); ``auto``: the cheapest that fits, per stage (the shorthand sets the
            ``recompute`` option of the pass that writes the stages).
        dtype: the precision policy: ``mixed`` (the default: bf16 on device types with a bf16
            peak, fp16 with loss scaling where only fp16, fp32 elsewhere; fp32 master weights
            and optimizer state) or one of ``fp32``, ``bf16``, ``fp16`` everywhere.
        efficiency / optimizer / attention / dp_overlap / fusion / grad_accumulation:
            cost-model settings (recorded in the plan; see ``CostSettings``).
            ``grad_accumulation`` defaults to ``autograd``, how the hetplan runtime adds
            each micro-batch's gradients (``docs/decisions/grad-accumulation-default.md``).
        vocab_parallel: split the LM head and its ``V x h`` token embedding by vocabulary
            under TP (the default, as Megatron-LM does); the plan states ``split`` only where
            the model has that pair and no TP resizing controller runs, else ``whole``
            (``docs/decisions/vocab-parallel.md``).
        require_profiled: refuse analytic compute estimates.
        compressors / dynamics / tp_controller / tp_gamma_max: pipeline shorthands.
        progress: the layout search's progress bar on stderr for a search over a second
            (:mod:`hetplan.optimizer.progress`): True always, False never, None (default)
            only when stderr is a terminal. It does not change the plan.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    batch_size: int = Field(ge=1, le=MAX_COUNT)
    seq: int | None = PosInt
    schedule: str = "1f1b"
    passes: str | tuple[Any, ...] = DEFAULT_PIPELINE
    dp: int | None = PosInt
    pp: int | None = PosInt
    tp: int | None = PosInt
    micro_batch_size: int | None = PosInt
    virtual_stages: int | None = Field(default=None, ge=2)
    sequence_parallel: bool | None = None
    zero_stage: Literal[0, 1, 2, 3] | None = None
    recompute: Literal["auto", "none", "selective", "full"] = "auto"
    dtype: Literal["mixed", "fp32", "bf16", "fp16"] = "mixed"
    efficiency: float = Field(default=0.5, gt=0, le=1, allow_inf_nan=False)
    optimizer: Literal["adam", "adamw", "sgd-momentum", "sgd"] = "adam"
    attention: Literal["flash", "materialized"] = "flash"
    dp_overlap: Literal["backward", "after-flush"] = "backward"
    fusion: Literal["none", "fused"] = "none"
    grad_accumulation: Literal["unpriced", "autograd", "hook16", "hook32", "fused"] = "autograd"
    vocab_parallel: bool = True
    require_profiled: bool = False
    compressors: tuple[str, ...] = ()
    dynamics: DynamicsSpec | str | Path | None = None
    tp_controller: Literal["off", "zero", "migration", "semi"] = "off"
    tp_gamma_max: float = 0.9
    progress: bool | None = None

    def __init__(self, **data: Any) -> None:
        """Validate ``data``; an invalid option is a :class:`SpecError` (as from
        :meth:`build` and ``compile``), not pydantic's ValidationError."""
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise SpecError(format_validation_error(e, where="compile options",
                                                    model=type(self))) from None

    @field_validator("batch_size", "seq", "dp", "pp", "tp", "micro_batch_size", "virtual_stages",
                     "zero_stage", mode="before")
    @classmethod
    def _strict_int(cls, v: Any) -> Any:
        """A boolean or a string is not a count (pydantic would read True as 1, "8" as 8)."""
        return v if v is None else strict_int(v)

    @field_validator("efficiency", "tp_gamma_max", mode="before")
    @classmethod
    def _strict_float(cls, v: Any) -> Any:
        return strict_float(v)

    @field_validator("schedule")
    @classmethod
    def _known_schedule(cls, v: str) -> str:
        known = (*SCHEDULES, "auto")
        if v not in known:
            raise ValueError(f"unknown schedule {v!r}{did_you_mean(v, known)} "
                             f"(known: {', '.join(known)})")
        return v

    @model_validator(mode="after")
    def _batch_splits(self) -> CompileOptions:
        """Blame a pinned dp or micro-batch size that cannot split the global batch (before
        any layout search, which would only report that no layout fits)."""
        batch, dp, mbs = self.batch_size, self.dp, self.micro_batch_size
        if dp is not None and batch % dp:
            raise ValueError(f"dp={dp} does not divide batch_size={batch} (each data-parallel "
                             "replica trains batch_size / dp samples); pin a dp that divides "
                             "it, or change the batch size")
        per = batch // dp if dp is not None else batch
        if mbs is not None and per % mbs:
            of = f"the per-replica batch {per} (batch_size={batch} / dp={dp})" if dp else (
                f"batch_size={batch}")
            raise ValueError(f"micro_batch_size={mbs} does not divide {of}; choose a "
                             "micro-batch size that divides it")
        return self

    @model_validator(mode="after")
    def _chimera_composes(self) -> CompileOptions:
        """Refuse a pin Chimera does not compose with, before any search (the layout search
        itself offers Chimera pipelines only with ``tp = 1`` and ZeRO 0 or 1; decision in
        ``docs/decisions.md``, "Chimera: what is priced"). A pinned ``pp = 1`` has no
        pipeline to run Chimera on (the plan is written with 1F1B): nothing to refuse."""
        if self.schedule != "chimera" or self.pp == 1:
            return self
        other = "or plan another schedule (schedule='1f1b')"
        if self.tp is not None and self.tp > 1:
            raise ValueError(
                f"tp={self.tp} with schedule 'chimera': Chimera is priced and executed with "
                "tp=1 only (each rank runs a stage of each of its two pipeline directions); "
                f"pin tp=1 or leave it free, {other}")
        if self.zero_stage is not None and self.zero_stage >= 2:
            raise ValueError(
                f"zero_stage={self.zero_stage} with schedule 'chimera': ZeRO-"
                f"{self.zero_stage} issues collectives inside backward, which Chimera's two "
                "directions, running different stages at once, would mismatch; pin "
                f"zero_stage 0 or 1 or leave it free, {other}")
        if self.dynamics is not None:
            raise ValueError(
                "dynamics with schedule 'chimera': re-balancing moves layers between "
                "stages, and a Chimera rank holds two stages (one per direction), which the "
                f"re-balancing does not model; drop dynamics, {other}")
        return self

    @classmethod
    def build(cls, options: CompileOptions | None = None, /, **kwargs: Any) -> CompileOptions:
        """``options`` updated with ``kwargs`` (or built from them), validated.

        Raises:
            SpecError: an unknown option (with a suggestion) or a value out of range.
        """
        if options is not None and not isinstance(options, CompileOptions):
            raise SpecError(f"options: expected a CompileOptions, got {type(options).__name__}; "
                            "pass the options as keywords (batch_size=8, ...) or as "
                            "CompileOptions(batch_size=8, ...)")
        data = options.model_dump() if options is not None else {}
        if options is not None:
            data["passes"] = options.passes  # keep pass instances as they are
        data.update(kwargs)
        return cls(**data)  # an invalid option: __init__'s SpecError

    def pipeline(self, *, where: str = "passes") -> tuple[Pass, ...]:
        """The pass instances to run: ``passes`` parsed, with the shorthands applied.

        Raises:
            SpecError: a malformed spec, or a shorthand that contradicts the spec or has no
                pass to apply to.
        """
        passes = list(resolve_pipeline(self.passes, where=where))
        names = [p.name for p in passes]
        dynamics = self.dynamics
        if isinstance(dynamics, (str, Path)):
            dynamics = DynamicsSpec.load(dynamics)
        shorthands: list[tuple[str, str, dict[str, Any]]] = [
            ("compressors", "espresso", {"compressors": self.compressors}
             if self.compressors else {}),
            ("dynamics", "dynpipe", {"dynamics": dynamics} if dynamics is not None else {}),
            ("tp_controller", "tp-resizing",
             {"controller": self.tp_controller} if self.tp_controller != "off" else {}),
            ("tp_gamma_max", "tp-resizing",
             {"gamma_max": self.tp_gamma_max} if self.tp_gamma_max != 0.9 else {}),
        ]
        if self.recompute != "auto":
            writer = next((n for n in names if n in ("dynpipe", "uniform-stages")), "dynpipe")
            shorthands.append(("recompute", writer, {"recompute": self.recompute}))
        for option, pass_name, values in shorthands:
            if not values:
                continue
            if pass_name not in names:
                raise SpecError(
                    f"{option}: given, but the pass pipeline has no {pass_name!r} pass to "
                    f"apply it to (passes: {','.join(names)}); add {pass_name!r} to the pipeline"
                )
            i = names.index(pass_name)
            try:
                passes[i] = _set_options(passes[i], values, option, where)
            except SpecError as e:  # the pass refused the value: name the option given
                if str(e).startswith(f"{where}: "):
                    raise  # the option and the spec disagree: both named already
                raise SpecError(f"{option}: {e}") from None
        if self.schedule == "chimera" and self.pp != 1:
            _refuse_under_chimera(passes, where)
        if "stages" not in passes[0].sections:
            writers = [n for n, cls in sorted(get_all_passes().items())
                       if "stages" in getattr(cls, "sections", ())]
            # a stage writer later in the list moves to the front, else dynpipe is added
            first = next((n for n in names if n in writers), "dynpipe")
            rest = [n for n in names if n != first]
            raise SpecError(
                f"{where}: the pipeline starts with {names[0]!r}, but the passes after the "
                f"first read the pipeline stages: start it with a pass that writes them "
                f"({' or '.join(writers)}), e.g. '{','.join([first, *rest])}'"
            )
        return tuple(passes)


#: The passes (and the `hetplan plan` flag that adds each) Chimera does not compose with, and
#: why (``docs/decisions.md``, "Chimera: what is priced").
_NOT_WITH_CHIMERA = {
    "zen": ("--sparse", "Zen's sparse sync is priced over a data-parallel group of dp ranks, "
                        "and a Chimera stage's gradients are averaged over its 2·dp holders"),
    "sdpipe": ("--group-sync", "SDPipe's group sync averages each pipeline replica's stages "
                               "apart, and a Chimera rank holds stages of two replicas"),
}


def _refuse_under_chimera(passes: list[Pass], where: str) -> None:
    """Raise a :class:`SpecError` for the first pass of ``passes`` Chimera does not compose
    with (:data:`_NOT_WITH_CHIMERA` when forced, ``mode`` other than ``auto``; and DynPipe
    re-balancing a dynamic model). In ``auto`` mode those passes decline under Chimera."""
    for p in passes:
        # ``mode=auto`` lets the pass choose: it declines under Chimera, with a note
        if p.name in _NOT_WITH_CHIMERA and getattr(p, "mode", "auto") != "auto":
            flag, why = _NOT_WITH_CHIMERA[p.name]
            raise SpecError(f"{where}: the {p.name!r} pass ({flag}) does not compose with "
                            f"schedule 'chimera': {why}; drop it, or plan another schedule "
                            "(--schedule 1f1b)")
        if p.name == "dynpipe" and getattr(p, "dynamics", None) is not None:
            raise SpecError(f"{where}: dynpipe{{dynamics=...}} re-balances a dynamic model, "
                            "which schedule 'chimera' does not compose with (a Chimera rank "
                            "holds two stages, one per direction); drop the dynamics, or plan "
                            "another schedule (--schedule 1f1b)")


def _set_options(p: Pass, values: dict[str, Any], option: str, where: str) -> Pass:
    """``p`` with ``values`` set; a value the spec already set differently is an error."""
    fields = {f.name: f for f in dataclasses.fields(p)}  # type: ignore[arg-type]
    for key, value in values.items():
        f = fields[key]
        default = f.default if f.default is not dataclasses.MISSING else None
        current = getattr(p, key)
        if current != default and current != value:
            raise SpecError(
                f"{where}: {p.name}{{{key.replace('_', '-')}=...}} and the {option} option "
                f"disagree ({current!r} vs {value!r}); set it in one place"
            )
    return dataclasses.replace(p, **values)  # type: ignore[type-var]
