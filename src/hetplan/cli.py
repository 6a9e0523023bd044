"""The ``hetplan`` command line: thin wrappers over the library, printed with rich.

User errors (any :class:`~hetplan.errors.HetplanError`) print one clear message and exit
with code 2; ``--debug`` shows the traceback. Unexpected failures print a one-line summary
and exit with code 1 (``--debug`` for the traceback).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.table import Table

from hetplan._version import __version__
from hetplan.errors import HetplanError, InfeasiblePlanError, PlanMismatchError, SpecError
from hetplan.ir.files import os_error_fix, write_text_file
from hetplan.ir.validation import check_output_path, did_you_mean

__all__ = ["app", "main"]

app = typer.Typer(
    name="hetplan",
    help="Compile distributed-training strategies for heterogeneous clusters.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
workload_app = typer.Typer(help="Workload files (models given as numbers).", no_args_is_help=True)
app.add_typer(workload_app, name="workload")

# Piped output (files, CI logs, tests) gets a fixed wide layout instead of rich's 80 columns.
out = Console(highlight=False, soft_wrap=False, width=None if sys.stdout.isatty() else 150)
err = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 150)
#: ``debug``: --debug; ``exit_now``: `run` has ended every process of its run, so ``main``
#: exits without the interpreter's teardown (see :func:`main`).
_state = {"debug": False, "exit_now": False}

F = TypeVar("F", bound=Callable[..., Any])


def _user_errors(fn: F) -> F:
    """Turn library errors into one message and exit code 2 (1 for internal errors)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except HetplanError as e:
            if _state["debug"]:
                raise
            err.print(f"[bold red]error:[/] {_escape(str(e))}")
            raise typer.Exit(2) from None
        except (typer.Exit, typer.Abort, KeyboardInterrupt):
            raise
        except OSError as e:
            if _state["debug"] or e.errno not in _HOST_ERRNOS:
                raise _internal(e) from None
            err.print(f"[bold red]error:[/] {_escape(_host_error(e))}")
            raise typer.Exit(2) from None
        except Exception as e:  # noqa: BLE001 - the CLI never shows a raw traceback
            raise _internal(e) from None

    return wrapper  # type: ignore[return-value]


#: The errors of the machine, not of hetplan: a full disk or quota, a read-only file system,
#: a permission, too many open files, an I/O error.
_HOST_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM,
                          errno.EMFILE, errno.ENFILE, errno.EIO})


def _host_error(e: OSError) -> str:
    """One line for an error of the machine: the file, what the system said, the fix."""
    what = f"{e.filename!s}: " if e.filename else ""
    return f"{what}{e.strerror or type(e).__name__}; {os_error_fix(e)}"


def _internal(e: Exception) -> Exception:
    """Print an unexpected error as a bug of hetplan and return the exit to raise (the
    exception itself under --debug, for its traceback)."""
    if _state["debug"]:
        return e
    err.print(
        f"[bold red]internal error:[/] {type(e).__name__}: {_escape(str(e))}\n"
        "This is a bug in hetplan; re-run with --debug for the traceback and report it."
    )
    return typer.Exit(1)


def _at_least_one(*options: tuple[str, int | None]) -> None:
    """Refuse a count option below 1 (a batch, a length, a number of workers) by its flag,
    before anything is imported or captured; None is an option left unset."""
    for flag, value in options:
        if value is not None and value < 1:
            raise SpecError(f"{flag} must be at least 1, got {value}")


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def _print_version(value: bool) -> None:
    if value:
        out.print(f"hetplan {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks of errors."),
    version: bool = typer.Option(
        False, "--version", help="Print the version and exit.", is_eager=True,
        callback=_print_version,
    ),
) -> None:
    _state["debug"] = debug


# --------------------------------------------------------------------------------------
# models and capture
# --------------------------------------------------------------------------------------
@app.command("models")
@_user_errors
def models_cmd(
    family: str = typer.Option(None, help="Only this family (gpt2, llama, custom ...)."),
    size: str = typer.Option(None, help="Only 'full' or 'tiny' models."),
) -> None:
    """List the built-in model zoo."""
    from hetplan import zoo

    families = sorted({e.family for e in zoo.list_models()})
    family, size = (x.strip().lower() if x is not None else None for x in (family, size))
    if family is not None and family not in families:
        raise SpecError(f"--family {family!r}: no zoo model is of that family"
                        f"{did_you_mean(family, families)} (families: {', '.join(families)})")
    if size is not None and size not in ("full", "tiny"):
        raise SpecError(f"--size {size!r}: give full or tiny")
    table = Table(title="hetplan model zoo", title_justify="left")
    for col in ("name", "family", "size", "params", "inputs", "description"):
        table.add_column(col)
    for e in zoo.list_models(family=family, size=size):
        table.add_row(e.name, e.family, e.size, e.params_approx, e.input_kind, e.description)
    out.print(table)


def load_model_ir(
    model: str | None,
    module: str | None = None,
    workload: Path | None = None,
    *,
    batch: int | None = None,
    seq: int | None = None,
    opaque: list[str] | None = None,
) -> Any:
    """The IR for a zoo name, a user factory, or a workload file (exactly one of them)."""
    given = [x for x in (model, module, workload) if x]
    if len(given) != 1:
        raise SpecError(
            "give exactly one of MODEL (a zoo name, see `hetplan models`), --module "
            "pkg.mod:factory, or --workload FILE"
        )
    from hetplan.ir.model import ModelIR

    if workload:
        if opaque:
            raise SpecError("--opaque changes how a model is captured; a --workload file is "
                            "already captured, so it would change nothing: drop --opaque (or "
                            "re-capture with `hetplan ir MODEL --opaque ... -o FILE`)")
        return ModelIR.load(workload)
    from hetplan.ir.capture import capture

    if module:
        from hetplan.ir.capture.factory import load_factory

        m, args, kwargs = load_factory(module)
        name = type(m).__name__
    else:
        from hetplan import zoo

        assert model is not None
        entry = zoo.get(model)
        m = zoo.build(entry.name)
        args, kwargs = zoo.example_inputs(entry.name, batch=batch, seq=seq)
        name = entry.name
    with err.status(f"capturing {name} …", spinner="dots"):
        return capture(m, args, kwargs, name=name, opaque_modules=opaque or ())


def _zoo_only(model: str | None, *options: tuple[str, Any]) -> None:
    """Refuse an option that shapes a zoo model's example inputs (``--seq``, ``--batch``)
    given with ``--module`` or ``--workload`` (or no model), which it would not change: the
    factory gives its own inputs and a workload file keeps the shapes it was captured with."""
    if model:
        return
    for flag, value in options:
        if value is not None:
            raise SpecError(f"{flag} shapes a zoo model's example inputs; a --module factory "
                            "gives its own and a --workload file keeps the shapes it was "
                            f"captured with, so {flag} would change nothing: drop it (or set "
                            "it in the factory)")


def _seq_fits(model: str | None, seq: int | None) -> None:
    """Refuse a ``--seq`` longer than the zoo model's position embeddings, before capture:
    capture runs on the meta device, which does not check the indices, so the plan would be
    made and `hetplan run` would refuse it. Refuse one for a model whose inputs have no
    sequence axis (image, features), which it would not change."""
    if not model or seq is None:
        return
    from hetplan import zoo

    entry = zoo.get(model)
    if entry.default_seq is None:
        raise SpecError(f"--seq {seq}: {entry.name} takes {entry.input_kind} inputs without a "
                        "sequence axis, so --seq would change nothing: drop --seq")
    if (why := zoo.seq_too_long(model, seq)) is not None:
        raise SpecError(f"--seq {seq}: {why}; give --seq {zoo.get(model).max_seq} or less")


def _fmt_count(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


def _fmt_bytes(n: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def _layer_rows(ir: Any) -> list[tuple[str, ...]]:
    """One row per layer, with runs of identical repeated blocks folded into one row."""
    from hetplan.report._text import layer_label

    rows: list[tuple[str, ...]] = []
    layers = list(ir.layers)
    i = 0
    while i < len(layers):
        lay = layers[i]
        j = i + 1
        if lay.group is not None:
            key = _block_key(lay)
            while j < len(layers) and layers[j].group == lay.group and _block_key(layers[j]) == key:
                j += 1
        count = j - i
        name = (layer_label(lay.name) if count == 1
                else f"{lay.name} … {layers[j - 1].name} (×{count})")
        idx = str(lay.index) if count == 1 else f"{lay.index}–{layers[j - 1].index}"
        rows.append(
            (
                idx,
                name,
                lay.kind.value,
                _fmt_count(lay.param_numel),
                _fmt_count(lay.fwd_flops),
                _fmt_count(lay.bwd_flops),
                _fmt_bytes(lay.act_out_bytes),
                str(len(lay.linears)) if lay.linears else "",
            )
        )
        i = j
    return rows


def _block_key(lay: Any) -> tuple:
    return (
        lay.module_type,
        lay.param_numel,
        lay.fwd_flops,
        lay.bwd_flops,
        lay.act_in_bytes,
        lay.act_out_bytes,
    )


def print_ir_summary(ir: Any, seconds: float | None = None) -> None:
    """Print the captured IR: a header and the layer table."""
    shapes = ", ".join("×".join(map(str, s)) for s in ir.input_shapes) or "—"
    took = f" in {seconds:.1f} s" if seconds is not None else ""
    out.print(f"[bold]{_escape(str(ir.name))}[/]  captured with {ir.method}{took}  ·  inputs "
              f"{shapes}")
    out.print(
        f"parameters {ir.num_params:,} ({_fmt_bytes(ir.param_bytes)})  ·  layers "
        f"{len(ir.layers)}  ·  gradient tensors {len(ir.grad_tensors)} "
        f"({_fmt_bytes(ir.grad_bytes)})"
    )
    out.print(
        f"FLOPs per step: forward {_fmt_count(ir.fwd_flops)}, backward "
        f"{_fmt_count(ir.bwd_flops)}  ·  fingerprint {ir.fingerprint()}"
    )
    table = Table(title_justify="left")
    for col, just in (
        ("#", "right"),
        ("layer", "left"),
        ("kind", "left"),
        ("params", "right"),
        ("fwd FLOPs", "right"),
        ("bwd FLOPs", "right"),
        ("act out", "right"),
        ("TP linears", "right"),
    ):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    for row in _layer_rows(ir):
        table.add_row(*(_escape(cell) for cell in row))
    out.print(table)
    if ir.grad_tensors:
        first = ", ".join(g.name for g in ir.grad_tensors[:3])
        out.print(f"gradients in backward-ready order: {first}, … {ir.grad_tensors[-1].name}",
                  markup=False)


@app.command("ir")
@_user_errors
def ir_cmd(
    model: str = typer.Argument(None, help="A zoo model name (see `hetplan models`)."),
    module: str = typer.Option(None, "--module", help="pkg.mod:factory returning (model, args)."),
    workload: Path = typer.Option(None, "--workload", help="A workload JSON file."),
    batch: int = typer.Option(None, help="Micro-batch size of the example inputs."),
    seq: int = typer.Option(None, help="Sequence length of the example inputs."),
    opaque: list[str] = typer.Option(
        None, "--opaque", help="Treat this module (its dotted name in the model, e.g. gate) as an "
        "opaque leaf, run on CPU with zero inputs (repeatable; for a module whose forward "
        "capture cannot follow: the error names it)."),
    as_json: bool = typer.Option(False, "--json", help="Print the workload JSON instead."),
    output: Path = typer.Option(None, "-o", "--output", help="Write the workload JSON here."),
) -> None:
    """Capture a model and summarise its IR: layers, parameters, FLOPs, gradients."""
    if output is not None:
        check_output_path(output, option="-o/--output", kind="workload")
    _at_least_one(("--batch", batch), ("--seq", seq))
    _zoo_only(model, ("--batch", batch), ("--seq", seq))
    _seq_fits(model, seq)
    t0 = time.perf_counter()
    ir = load_model_ir(model, module, workload, batch=batch, seq=seq, opaque=opaque)
    seconds = time.perf_counter() - t0
    if output:
        ir.save(output)
        err.print(f"wrote {output}", markup=False)
    if as_json:
        out.print(ir.to_json(), end="", markup=False)
        return
    print_ir_summary(ir, None if workload else seconds)


@workload_app.command("convert")
@_user_errors
def workload_convert_cmd(
    benchmark: Path = typer.Argument(..., help="The Espresso benchmark file (espresso_models.json)."),
    out_dir: Path = typer.Option(Path("workloads"), "-o", "--out-dir", help="Output directory."),
    gaps: str = typer.Option("raw", help="'raw' measured gaps or 'effective' (gap % 1000 µs)."),
) -> None:
    """Convert the Espresso benchmark models into workload JSON files."""
    from hetplan.ir.workload import espresso_workloads

    if gaps not in ("raw", "effective"):
        raise SpecError(f"--gaps must be 'raw' or 'effective', got {gaps!r}")
    _check_out_dir(out_dir, option="-o/--out-dir")
    workloads = espresso_workloads(benchmark, gaps=gaps)  # type: ignore[arg-type]
    out_dir.mkdir(exist_ok=True)
    table = Table(title=f"workloads written to {_escape(str(out_dir))}", title_justify="left")
    for col in ("file", "tensors", "layers", "params", "backprop"):
        table.add_column(col)
    for name, ir in workloads.items():
        path = out_dir / f"{name}.json"
        ir.save(path)
        backprop_ms = sum(g.ready_gap_us or 0 for g in ir.grad_tensors) / 1e3
        table.add_row(
            _escape(path.name),
            str(len(ir.grad_tensors)),
            str(len(ir.layers)),
            f"{ir.num_params:,}",
            f"{backprop_ms:.1f} ms",
        )
    out.print(table)


def _check_out_dir(out_dir: Path, *, option: str) -> None:
    """An output directory: an existing directory, or a new one whose parent exists (only
    the directory itself is created, as other outputs' directories are never created)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise SpecError(f"{option} {str(out_dir)!r} is a file, not a directory; give a "
                        "directory to write the workload files into")
    if not out_dir.exists() and not out_dir.parent.is_dir():
        raise SpecError(f"{option} {str(out_dir)!r}: the directory {str(out_dir.parent)!r} "
                        "does not exist; create it first (hetplan creates only the output "
                        "directory itself)")


# --------------------------------------------------------------------------------------
# plan / simulate
# --------------------------------------------------------------------------------------
def _with_group_sync(passes: str | None, mode: str) -> tuple[str | None, dict[str, Any]]:
    """The pass spec and compile options ``--group-sync MODE`` asks for: ``sdpipe{mode=..}``
    appended to the pipeline (or its mode set, when ``--passes`` names it) and ZeRO sharding
    pinned off (each replica steps its own optimizer)."""
    modes = ("auto", "sdpipe", "off")
    if mode not in modes:
        raise SpecError(f"--group-sync: unknown mode {mode!r}{did_you_mean(mode, modes)} "
                        f"(choose {', '.join(modes)})")
    if mode == "off":
        return passes, {}
    from hetplan.passes import DEFAULT_PIPELINE
    from hetplan.passes.spec import parse_pipeline

    spec = passes or DEFAULT_PIPELINE
    given = [p for p in parse_pipeline(spec, where="--passes") if p.name == "sdpipe"]
    if not given:
        return f"{spec},sdpipe{{mode={mode}}}", {"zero_stage": 0}
    if getattr(given[0], "mode") != mode:
        raise SpecError(f"--group-sync {mode} and --passes sdpipe{{mode="
                        f"{getattr(given[0], 'mode')}}} disagree; set the mode in one place")
    return spec, {"zero_stage": 0}


@app.command("plan")
@_user_errors
def plan_cmd(
    model: str = typer.Argument(None, help="A zoo model name (see `hetplan models`)."),
    cluster: str = typer.Option("a100-nvlink-8x8", "--cluster", "-c",
                                help="A cluster preset (see `hetplan presets`) or file."),
    batch_size: int = typer.Option(..., "--batch-size", "-b", help="Global batch size."),
    module: str = typer.Option(None, "--module", help="pkg.mod:factory returning (model, args)."),
    workload: Path = typer.Option(None, "--workload", help="A workload JSON file."),
    seq: int = typer.Option(None, help="Sequence length for zoo language models (default: "
                            "the model's own; `hetplan run` trains at that one, so a plan for "
                            "another length is for `export`)."),
    profile: Path = typer.Option(None, "--profile", help="Profile DB from `hetplan profile`."),
    schedule: str = typer.Option("1f1b", help="gpipe, 1f1b, interleaved-1f1b, chimera, or "
                                 "auto (1F1B and interleaved 1F1B searched side by side)."),
    dp: int = typer.Option(None, help="Pin the data-parallel degree (a plan uses every "
                           "device: dp x pp x tp is the cluster's device count)."),
    pp: int = typer.Option(None, help="Pin the pipeline-parallel degree."),
    tp: int = typer.Option(None, help="Pin the tensor-parallel degree."),
    micro_batch_size: int = typer.Option(
        None, "--micro-batch-size", help="Pin the samples per micro-batch (of each "
        "data-parallel replica; it divides the batch per replica)."),
    dtype: str = typer.Option(
        "mixed", help="Precision: mixed (per device type: bf16 on A100/H100, fp16 with loss "
        "scaling on V100, fp32 on CPU; fp32 master weights), or fp32, bf16, fp16 everywhere "
        "(a device without a peak for it, such as a CPU, stores 16-bit bytes and is priced "
        "at its fp32 peak)."),
    zero: int = typer.Option(None, "--zero", help="Pin the ZeRO stage inside data-parallel "
                             "groups: 0 (none), 1 (optimizer state), 2 (+ gradients), "
                             "3 (+ parameters, FSDP); default: the cheapest that fits."),
    recompute: str = typer.Option(
        "auto", "--recompute", help="Pin every stage's activation recomputation: none, "
        "selective (the attention core) or full; default auto: the cheapest that fits, per "
        "stage."),
    sp: bool = typer.Option(None, "--sp/--no-sp", help="Pin sequence parallelism with tensor "
                            "parallelism on or off (default: on whenever tp > 1)."),
    virtual_stages: int = typer.Option(
        None, "--virtual-stages", help="Pin the interleaved chunks per pipeline rank (2 or "
        "more; needs --schedule interleaved-1f1b or auto; default: 2-4 searched)."),
    progress: bool = typer.Option(None, "--progress/--no-progress", help="Show the layout "
                                  "search's progress bar on stderr (default: on a terminal, "
                                  "for a search over a second)."),
    require_profiled: bool = typer.Option(False, help="Refuse analytic compute estimates."),
    dynamics: Path = typer.Option(None, "--dynamics", help="A YAML/JSON file of how the model "
                                  "changes while training (pruning, freezing, early exit) and "
                                  "the re-balancing policy; see examples/pruning.yaml."),
    compress: str = typer.Option(
        "", "--compress", help="Compressors gradient sync may use, comma-separated (opt-in; "
        "lossy ones change convergence): dgc, randomk, topk, efsignsgd, onebit, qsgd, "
        "powersgd, fp16, bf16."),
    tp_controller: str = typer.Option(
        "off", "--tp-controller", help="Heterogeneous-TP controller the plan turns on (opt-in; "
        "resizing prunes computation): off, zero, migration, semi."),
    tp_gamma_max: float = typer.Option(
        None, "--tp-gamma-max", help="Largest pruning ratio the TP controller may use, in "
        "[0, 1) (default 0.9); needs --tp-controller."),
    passes: str = typer.Option(
        None, "--passes", help="The pass pipeline as a spec, e.g. "
        "'dynpipe,even-tp,ddp-buckets,espresso{compressors=dgc,fp16},cupcake-fusion,"
        "tp-resizing{controller=semi}' (default: the standard pipeline; `hetplan passes` "
        "lists every pass and its options)."),
    opaque: list[str] = typer.Option(
        None, "--opaque", help="Treat this module as an opaque leaf when capturing (repeatable; "
        "for a module whose forward capture cannot follow, see `hetplan ir`); such a plan can "
        "be inspected, simulated and exported: `hetplan run` does not take --opaque yet."),
    hetero: str = typer.Option(
        "off", "--hetero", help="Heterogeneous stages (each its own device class and dp x tp, "
        "order searched): 'on' always, 'auto' when predicted faster than the plan above, "
        "'off'."),
    sparse: str = typer.Option(
        "off", "--sparse", help="Sparse (embedding) gradients: off (dense all-reduce), auto "
        "(the fastest predicted of dense, AGsparse, Zen), zen (always Zen); appends the zen "
        "pass to the pipeline."),
    output: Path = typer.Option(None, "-o", "--output", help="Write the plan JSON here."),
    checkpoint: str = typer.Option(
        "none", "--checkpoint", help="Checkpointing to plan: none, or gemini (in-memory "
        "checkpoints in peers' CPU memory, sent in the network's idle time)."),
    replicas: int = typer.Option(None, "--replicas", help="Gemini: copies of every rank's "
                                 "state, its own node's included (default 2)."),
    group_sync: str = typer.Option(
        "off", "--group-sync", help="Semi-decentralized group sync of the pipeline replicas "
        "(SDPipe): auto (only when the straggler simulation predicts it faster), sdpipe "
        "(always; the sdpipe pass in --passes sets P and T), off. Pins zero_stage=0."),
) -> None:
    """Compile a plan: search layouts, run the passes, predict, compare with baselines."""
    from hetplan.cost_models.predict import resolve_cluster, resolve_profile
    from hetplan.ir.plan_checks import plan_problems
    from hetplan.optimizer.compile import compile as compile_plan
    from hetplan.optimizer.options import CompileOptions

    # Everything the user typed is checked before the model is captured or anything planned.
    if output is not None:
        check_output_path(output, option="-o/--output", kind="plan")
    if hetero not in ("off", "auto", "on"):
        raise SpecError(f"--hetero must be off, auto or on, got {hetero!r}")
    _hetero_pins(hetero, dp=dp, pp=pp, tp=tp, micro_batch_size=micro_batch_size,
                 schedule=schedule, virtual_stages=virtual_stages, zero=zero,
                 recompute=recompute, sp=sp)
    if sparse not in ("off", "auto", "zen"):
        raise SpecError(f"--sparse must be off, auto or zen, got {sparse!r}")
    if sparse != "off":
        from hetplan.passes import DEFAULT_PIPELINE

        passes = f"{passes or DEFAULT_PIPELINE},zen{{mode={sparse}}}"
    pipeline_spec = _with_checkpointing(passes, checkpoint, replicas)

    pipeline_spec, group_opts = _with_group_sync(pipeline_spec, group_sync)
    pins = strategy_pins(dtype=dtype, zero=zero, recompute=recompute, sp=sp, tp=tp,
                         virtual_stages=virtual_stages, schedule=schedule, pp=pp, dp=dp)
    if schedule == "chimera" and pp != 1 and dynamics is not None:
        raise SpecError("--dynamics with --schedule chimera: re-balancing moves layers between "
                        "stages, and a Chimera rank holds two stages (one per direction), "
                        "which the re-balancing does not model; drop --dynamics, or use "
                        "another --schedule (1f1b)")
    if group_opts.get("zero_stage") == 0 and zero not in (None, 0):
        raise SpecError(f"--group-sync {group_sync} steps each replica's own optimizer, so it "
                        f"cannot shard it: drop --zero {zero} (or use --group-sync off)")
    pins.update(group_opts)
    _zoo_only(model, ("--seq", seq))
    _seq_fits(model, seq)
    with _blaming_options():
        options = CompileOptions.build(
            batch_size=batch_size, seq=seq, schedule=schedule, dp=dp, pp=pp, tp=tp,
            micro_batch_size=micro_batch_size, require_profiled=require_profiled,
            progress=progress,
            **pins,
            dynamics=dynamics,
            compressors=tuple(c.strip() for c in compress.split(",") if c.strip()),
            tp_controller=tp_controller,
            tp_gamma_max=0.9 if tp_gamma_max is None else tp_gamma_max,
            **({"passes": pipeline_spec} if pipeline_spec is not None else {}),
        )
        pipeline = options.pipeline(where="--passes")  # a malformed spec fails before capture
    if tp_gamma_max is not None and all(getattr(p, "controller", "off") == "off"
                                        for p in pipeline if p.name == "tp-resizing"):
        raise SpecError(f"--tp-gamma-max {tp_gamma_max} bounds the pruning of the TP resizing "
                        "controller, which is off: give --tp-controller zero, migration or "
                        "semi too, or drop --tp-gamma-max")
    spec = resolve_cluster(cluster)
    db = resolve_profile(profile)
    t_capture = time.perf_counter()
    if workload is not None or module is not None or model is None or opaque:
        ir = load_model_ir(model, module, workload, batch=1, seq=seq, opaque=opaque)
        target: Any = ir
    else:
        from hetplan.optimizer.compile import model_ir

        target = model_ir(model, seq=seq)  # the capture compile() would make of the name
    captured = time.perf_counter() - t_capture
    if db is not None:  # compile() checks it too, without the file's name
        from hetplan.cost_models.predict import check_profile_fits
        from hetplan.ir.plan_sections import WorkloadSummary

        check_profile_fits(db, WorkloadSummary.from_model_ir(target), target.name, profile)
    t0 = time.perf_counter()
    plan = compile_plan(target, spec, options, profile=db)
    if hetero != "off":
        from hetplan.optimizer.hetero import choose_hetero

        plan = choose_hetero(plan, spec, db, batch_size, hetero,  # type: ignore[arg-type]
                             passes=options.pipeline(where="--passes"))
    seconds = time.perf_counter() - t0
    if problems := plan_problems(plan, complete=True):
        # What `load_plan` would refuse is never written: every later command reads the file
        # with the one validator, so such a plan is a bug of the planner, not a user's.
        raise RuntimeError("the compiled plan fails the plan validator, so it was not "
                           "written: " + "; ".join(problems))
    from hetplan.runtime.composition import refusals

    for line in refusals(plan):  # the planner may pair strategies this runtime cannot run
        err.print(f"[yellow]warning:[/] `hetplan run` refuses this plan: {_escape(line)}")
    if output:
        plan.save(output)
        err.print(f"wrote {output}", markup=False)
    _print_plan(plan)
    asked = [f for f, given in (("--schedule " + schedule, schedule not in ("1f1b", "auto")),
                                (f"--virtual-stages {virtual_stages}",
                                 virtual_stages is not None),
                                # re-balancing moves layers between pipeline stages
                                (f"--dynamics {dynamics}", dynamics is not None)) if given]
    if asked and plan.hetero is None and plan.layout is not None and plan.layout.pp == 1:
        err.print(f"note: the fastest layout has no pipeline (pp=1), so {' and '.join(asked)} "
                  "did not apply; pin --pp to plan a pipeline with "
                  f"{'it' if len(asked) == 1 else 'them'}", markup=False)
    lay = plan.layout if plan.hetero is None else None
    for flag, degree, what in ((f"--zero {zero}", "dp", "data"), ("--sp", "tp", "tensor")):
        if lay is not None and (zero if degree == "dp" else sp) and getattr(lay, degree) == 1:
            err.print(f"note: the layout has no {what} parallelism ({degree}=1), so {flag} did "
                      f"not apply; pin --{degree} 2 or more to plan with it", markup=False)
    err.print(f"model captured in {captured:.1f} s, planned in {seconds:.1f} s")


def _hetero_pins(hetero: str, **given: Any) -> None:
    """Refuse the layout pins the heterogeneous search would drop: it chooses each stage's
    (dp, tp), micro-batch, ZeRO stage and recomputation itself and plans 1F1B, taking none
    of them (``optimizer.hetero.compile_hetero`` gets the batch and the passes only), so
    under ``on`` (or ``auto`` where it wins) they vanished from the plan without a word."""
    if hetero == "off":
        return
    free = {"schedule": ("1f1b", "auto"), "recompute": ("auto",)}  # what the search does
    pinned = [f"--{k.replace('_', '-')} {v}" if not isinstance(v, bool) else
              ("--sp" if v else "--no-sp")
              for k, v in given.items() if v is not None and v not in free.get(k, ())]
    if pinned:
        raise SpecError(
            f"{', '.join(pinned)} with --hetero {hetero}: the heterogeneous search chooses "
            "each stage's dp x tp, micro-batch, ZeRO stage and recomputation itself and plans "
            "1F1B, so it would drop them; drop them, or use --hetero off to plan with them")


def _with_checkpointing(passes: str | None, checkpoint: str, replicas: int | None) -> str | None:
    """The pipeline spec with the checkpointing pass ``--checkpoint`` asks for appended."""
    from hetplan.passes import DEFAULT_PIPELINE

    if checkpoint not in ("none", "gemini"):
        raise SpecError(f"--checkpoint {checkpoint!r}: use 'none' or 'gemini'")
    if checkpoint == "none":
        if replicas is not None:
            raise SpecError("--replicas needs --checkpoint gemini")
        return passes
    if replicas is not None and replicas < 1:
        raise SpecError(f"--replicas {replicas}: must be >= 1 (2 keeps a copy on another node)")
    base = passes if passes is not None else DEFAULT_PIPELINE
    if "gemini" in base.split("{")[0].split(",") or ",gemini" in base:
        raise SpecError("--checkpoint gemini and a 'gemini' pass in --passes: set it in one "
                        "place")
    return f"{base},gemini{{replicas={replicas if replicas is not None else 2}}}"


def strategy_pins(*, dtype: str, zero: int | None, recompute: str, sp: bool | None,
                  tp: int | None, virtual_stages: int | None, schedule: str,
                  pp: int | None = None, dp: int | None = None) -> dict[str, Any]:
    """The strategy pins of `hetplan plan` as CompileOptions fields, checked before anything
    is captured or planned; a bad value is a SpecError naming the option and the fix."""
    from hetplan.cost_models.precision import POLICIES

    if dtype not in POLICIES:
        raise SpecError(f"--dtype {dtype!r} is not a precision{did_you_mean(dtype, POLICIES)} "
                        f"(use one of {', '.join(POLICIES)})")
    if zero is not None and zero not in (0, 1, 2, 3):
        raise SpecError(f"--zero {zero} is not a ZeRO stage; use 0, 1, 2 or 3")
    modes = ("auto", "none", "selective", "full")
    if recompute not in modes:
        raise SpecError(f"--recompute {recompute!r} is not a recomputation mode"
                        f"{did_you_mean(recompute, modes)} (use one of {', '.join(modes)})")
    if sp and tp == 1:
        raise SpecError("--sp needs tensor parallelism, but --tp 1 is pinned; pin --tp 2 or "
                        "more, or leave --tp free")
    if zero and dp == 1:
        raise SpecError(f"--zero {zero} shards state inside data-parallel groups, but --dp 1 "
                        "is pinned; pin --dp 2 or more, or leave --dp free")
    if schedule == "chimera" and pp != 1:  # (CompileOptions refuses these too, by field)
        if tp is not None and tp > 1:
            raise SpecError(f"--tp {tp} with --schedule chimera: Chimera is priced and "
                            "executed with tensor parallelism off (each rank runs a stage of "
                            "each of its two pipeline directions); use --tp 1 or drop --tp, "
                            "or another --schedule (1f1b)")
        if zero is not None and zero >= 2:
            raise SpecError(f"--zero {zero} with --schedule chimera: ZeRO-{zero} issues "
                            "collectives inside backward, which Chimera's two directions, "
                            "running different stages at once, would mismatch; use --zero 0 "
                            "or 1 or drop --zero, or another --schedule (1f1b)")
    if virtual_stages is not None:
        if virtual_stages < 2:
            raise SpecError(f"--virtual-stages {virtual_stages}: interleaving needs 2 or more "
                            "chunks per pipeline rank; use --virtual-stages 2 (or more)")
        if schedule not in ("interleaved-1f1b", "auto"):
            raise SpecError(f"--virtual-stages needs --schedule interleaved-1f1b or auto (the "
                            f"schedule is {schedule!r}); add --schedule interleaved-1f1b")
        if pp == 1:
            raise SpecError(f"--virtual-stages {virtual_stages} interleaves the chunks of a "
                            "pipeline, but --pp 1 is pinned (no pipeline); pin --pp 2 or more, "
                            "or drop --virtual-stages")
    return {"dtype": dtype, "zero_stage": zero, "recompute": recompute,
            "sequence_parallel": sp, "virtual_stages": virtual_stages}


@app.command("profile")
@_user_errors
def profile_cmd(
    model: str = typer.Argument(None, help="A zoo model whose layers to time (optional)."),
    output: Path = typer.Option(Path("profile.json"), "-o", "--output",
                                help="Profile DB to write (merged if it exists)."),
    world_size: int = typer.Option(2, "--world-size", "-n", help="Local processes."),
    device_type: str = typer.Option("cpu", help="Cluster device type to file records under."),
    what: list[str] = typer.Option(None, "--what",
                                   help="layers, collectives, compressors, step (the optimizer "
                                   "step; default: all)."),
    batch_size: int = typer.Option(1, help="Micro-batch of the layer measurements; with "
                                   "--sparsity, the samples each worker looks up per step."),
    seq: int = typer.Option(None, help="Sequence length for zoo language models."),
    layer_processes: int = typer.Option(
        None, help="Time layers on this many processes at once, each with the threads a rank "
        "of `hetplan run` gets (1, or OMP_NUM_THREADS): the plan's ranks per machine. Default: "
        "--world-size/-n on CPU (give -n 4 for local-cpu), 1 with a GPU; 1 times them in this "
        "process with all its threads.", show_default=False),
    link_kind: str = typer.Option(
        None, "--link-kind", help="Link kind to file collective records under (default: "
        "loopback on gloo); with HETPLAN_EMULATE_BW set, the kind of the emulated link, e.g. "
        "ethernet for cpu-2x2-slow."),
    dtype: list[str] = typer.Option(
        None, "--dtype", help="Compute dtype(s) to time layers in: fp32 (default), bf16, fp16 "
        "(autocast, as a mixed-precision plan runs); repeat for several."),
    module: str = typer.Option(None, "--module", help="pkg.mod:factory returning (model, args)"
                               " (instead of MODEL)."),
    sparsity: bool = typer.Option(
        False, "--sparsity", help="Measure the density, overlap and skew of every embedding "
        "gradient (forward steps of --workers simulated workers on CPU); alone, without "
        "--what, it measures only that."),
    workers: int = typer.Option(2, "--workers", help="--sparsity: data-parallel workers n."),
    steps: int = typer.Option(4, "--steps", help="--sparsity: steps per worker."),
    zipf_alpha: float = typer.Option(1.0, "--zipf-alpha", help="--sparsity: exponent of the "
                                     "synthetic Zipf token stream."),
    script: Path = typer.Option(None, "--script", help="--sparsity: a Python file defining "
                                "sparsity_batches(worker, workers, batch_size) that yields the "
                                "model's batches (instead of the Zipf stream)."),
) -> None:
    """Measure this machine (layers, collectives, compressors, optimizer step) and, with
    --sparsity, the model's sparse gradients into a profile DB."""
    from hetplan.profiling import WHAT, SparsitySpec, run_profile

    check_output_path(output, option="-o/--output", kind="profile DB")
    _at_least_one(("--seq", seq), ("--workers", workers), ("--steps", steps))
    _zoo_only(model, ("--seq", seq))
    _seq_fits(model, seq)
    if model and module:
        raise SpecError("give MODEL (a zoo name) or --module pkg.mod:factory, not both")
    if sparsity and not (model or module):
        raise SpecError("--sparsity needs a MODEL (see `hetplan models`) or --module "
                        "pkg.mod:factory")
    if not sparsity and (script is not None or zipf_alpha != 1.0):
        raise SpecError("--script and --zipf-alpha shape the --sparsity measurement; add "
                        "--sparsity")
    has_model = bool(model or module)
    default = () if sparsity else tuple(w for w in WHAT if w != "layers" or has_model)
    chosen = tuple(what) if what else default
    if "layers" in chosen and not has_model:
        raise SpecError("--what layers needs a MODEL (see `hetplan models`)")
    if what and "collectives" in chosen and world_size < 2:
        raise SpecError(f"--what collectives times collectives between processes, and "
                        f"--world-size/-n is {world_size}: give -n 2 or more")
    from typing import get_args

    from hetplan.ir.cluster import LinkKind

    kinds = get_args(LinkKind)
    if link_kind is not None and link_kind not in kinds:
        raise SpecError(f"--link-kind {link_kind!r}: choose one of {', '.join(kinds)}"
                        f"{did_you_mean(link_kind, list(kinds))}")
    _measures_the_device_type(device_type, chosen)
    if layer_processes is None:
        from hetplan.profiling import default_layer_processes

        layer_processes = default_layer_processes(world_size, chosen)
    dtypes = tuple(dict.fromkeys(dtype or ["fp32"]))
    bad = [d for d in dtypes if d not in ("fp32", "bf16", "fp16")]
    if bad:
        raise SpecError(f"--dtype {bad[0]!r}: choose fp32, bf16 or fp16")
    target: Any = model
    if module:
        from hetplan.ir.capture.factory import load_factory

        target = load_factory(module)
    spec = SparsitySpec(workers=workers, batch_size=batch_size, steps=steps,
                        zipf_alpha=zipf_alpha, script=script) if sparsity else None
    db = run_profile(
        target, world_size=world_size, device_type=device_type, output=output, what=chosen,
        batch_size=batch_size, seq=seq, layer_processes=layer_processes, dtypes=dtypes,
        sparsity=spec, link_kind=link_kind,
    )
    if spec is not None:
        from hetplan.profiling.sparsity import describe_records

        from hetplan import zoo

        name = zoo.get(model).name if model else type(target[0]).__name__
        for line in describe_records(r for r in db.sparsity if r.model == name
                                     and (r.workers, r.batch_size) == (workers, batch_size)):
            out.print(_escape(line))
    _note_layer_threads(chosen, device_type, layer_processes, world_size)
    out.print(
        f"wrote {output}: {len(db.compute)} layer record(s), {len(db.collectives)} "
        f"collective record(s), {len(db.compressors)} compressor record(s), "
        f"{len(db.sparsity)} sparsity record(s), {len(db.optimizer_steps)} optimizer-step "
        f"record(s), {len(db.handovers)} hand-over record(s)"
    )


def _note_layer_threads(what: tuple[str, ...], device_type: str, processes: int,
                        world_size: int) -> None:
    """Say when CPU layers were timed in one process with several threads for a run of
    several ranks (``--layer-processes 1`` with ``-n`` above 1): such a run gives each rank
    one thread (``OMP_NUM_THREADS=1``), and on a busy 2-core host a GPT-2 block timed with 2
    threads took 90x its one-thread time."""
    import torch

    threads = torch.get_num_threads()
    if "layers" in what and device_type == "cpu" and processes == 1 and world_size > 1 \
            and threads > 1:
        err.print(f"note: the layers were timed in this one process with {threads} threads; "
                  f"`hetplan run` gives each of several ranks on a machine one thread, so for "
                  f"a plan of {world_size} ranks per machine leave --layer-processes out (it "
                  f"follows -n) or give --layer-processes {world_size}", markup=False)


def _measures_the_device_type(device_type: str, what: tuple[str, ...]) -> None:
    """Refuse to file measurements of this machine's CPU under a built-in GPU type: without
    a CUDA device `hetplan profile` times on the CPU, and a plan would price an A100 at the
    CPU's speed. A type of the user's own (a cluster file's name for its CPU processes) is
    theirs to choose."""
    from hetplan.ir.cluster import DEVICE_CATALOGUE

    if device_type == "cpu" or device_type not in DEVICE_CATALOGUE or not what:
        return
    import torch

    if not torch.cuda.is_available():
        raise SpecError(
            f"--device-type {device_type!r} is a GPU type, but this machine has no CUDA device: "
            "the records would be CPU times filed as that GPU's; profile on a machine with "
            f"one, or file them as --device-type cpu")


@app.command(
    "run", context_settings={"allow_extra_args": True, "ignore_unknown_options": True}
)
@_user_errors
def run_cmd(
    ctx: typer.Context,
    plan_file: Path = typer.Argument(..., help="A plan JSON file."),
    model: str = typer.Option(None, "--model", help="The zoo model the plan was made for."),
    module: str = typer.Option(None, "--module", help="pkg.mod:factory returning (model, args)."),
    steps: int = typer.Option(10, help="Training iterations (after 2 warm-up ones)."),
    report: Path = typer.Option(None, "--report", help="Write the run report JSON here."),
    timeout: float = typer.Option(120.0, help="Seconds any collective may wait for a peer; "
                                  "a frozen or dead rank fails the run within it."),
    script: Path = typer.Option(None, "--script", help="Your training script (see "
                                "examples/train.py) instead of synthetic data."),
    dry_run: bool = typer.Option(False, help="Check the plan, print the torchrun command and "
                                 "exit."),
    oversubscribe: bool = typer.Option(False, help="Start a CPU plan's processes even beyond "
                                       "2 per core of this host."),
    trace: Path = typer.Option(None, "--trace", help="Write every rank's per-action trace of "
                               "one step here (Chrome trace-event JSON, opens in Perfetto); "
                               "compare it with `hetplan inspect PLAN --trace FILE`."),
    trace_step: int = typer.Option(0, "--trace-step", help="The step --trace records, "
                                   "counted as the progress line does (1 is the first warm-up "
                                   "step); 0, the default, records the last."),
) -> None:
    """Train with the plan under torchrun on synthetic data, or with your --script (extra
    options go to torchrun).

    Give the model the plan was made for: --model NAME (a zoo model) or --module
    pkg.mod:factory; --report writes the run report, which `hetplan inspect PLAN --run
    REPORT` puts beside the prediction. Before any rank starts, the plan is checked against its cluster, the model (captured
    here; not with --script), the world size, the --report path and this host: a plan for
    GPUs needs a CUDA device per process started here, a CPU plan at most 2 processes per
    core (at least 4) unless --oversubscribe; --dry-run skips the host check. Ctrl-C (SIGINT),
    SIGTERM or SIGHUP stop every rank within seconds (each prints one line); the launcher
    kills what has not stopped 5 s later, and no process of the run outlives it.

    Exit codes: 0 trained; 1 the run failed (a rank's error, a frozen or dead rank named
    after --timeout, torchrun killed); 2 refused (bad option or plan, plan not for this
    model, cluster or world size, ranks that loaded different plans); 130 stopped by Ctrl-C
    (SIGINT), 143 by SIGTERM, 129 by SIGHUP.
    """
    import signal

    from hetplan.ir.plan import load_plan
    from hetplan.runtime.checkpoint_store import dir_problem
    from hetplan.runtime.cpu_sched import cpu_sched_policy
    from hetplan.runtime.hetero_ranks import plan_world_size
    from hetplan.runtime.link_emulation import emulated_link
    from hetplan.runtime.launch import (
        HostCapacity,
        launch,
        preflight,
        prestart,
        torchrun_command,
    )

    plan = load_plan(plan_file)
    _check_torchrun_args(ctx)
    cpu_sched_policy()  # a bad HETPLAN_CPU_SCHED: refused here, not once per rank
    emulated_link()  # ... a bad HETPLAN_EMULATE_BW or HETPLAN_EMULATE_LATENCY_US
    if any(os.environ.get(f"HETPLAN_EMULATE_{v}", "").strip() for v in ("STRAGGLER",
                                                                         "GEMM_FLOPS")):
        # ... a bad HETPLAN_EMULATE_STRAGGLER (its module imports torch: only when set, so
        # that torchrun's process starts before this one imports torch)
        from hetplan.runtime.resizing import ENV_STRAGGLER, straggler_from_env

        straggler = straggler_from_env()
        if straggler is not None and straggler.rank >= (world := plan_world_size(plan)):
            raise SpecError(f"{ENV_STRAGGLER}: rank {straggler.rank} is not a rank of this run "
                            f"(0..{world - 1}); give CHI@RANK with one of its ranks")
    if os.environ.get("HETPLAN_EMULATE_DELAY", "").strip():
        from hetplan.runtime.handlers.group_sync import delay_setting

        delay_setting(plan, plan_world_size(plan))  # ... a bad HETPLAN_EMULATE_DELAY
    if trace is not None:
        _check_trace_options(trace, trace_step, steps, script, report)
    elif trace_step != 0:
        raise SpecError(f"--trace-step {trace_step} chooses the step --trace records; give "
                        "--trace FILE too")
    cmd = torchrun_command(plan, plan_file, model=model, module=module, steps=steps,
                           report=report, timeout_s=timeout, torchrun_args=ctx.args,
                           script=script, trace=trace, trace_step=trace_step)
    capture = None if script is not None else (lambda: _run_model_ir(plan, model, module))

    def check(model_ir: Any = None, host: HostCapacity | None = None) -> None:
        with _naming(plan_file):
            preflight(plan, cmd, model_ir=model_ir, report=report, steps=steps,
                      timeout_s=timeout, host=host, oversubscribe=oversubscribe)

    check()  # what needs neither torch nor the model: refused before anything starts
    if not dry_run and (why := dir_problem(plan.checkpointing is not None)):
        raise SpecError(why)  # this host's directories (a dry run's command is for others)
    # torchrun's process imports torch while this one checks the host and captures the model;
    # it starts no rank before launch() releases it, and a refused plan ends it
    job = None if dry_run else prestart(cmd, keep_agent_traceback=_state["debug"])
    try:
        check(capture, None if dry_run else HostCapacity.detect())
    except BaseException:
        if job is not None:
            job.abandon()
        raise
    if dry_run:
        out.print(" ".join(cmd), markup=False)
        return
    outcome = launch(cmd, keep_agent_traceback=_state["debug"], job=job)
    _state["exit_now"] = True
    if outcome.stopped_by is not None:
        err.print(f"stopped by {signal.Signals(outcome.stopped_by).name}: every process of "
                  "the run has ended", markup=False)
        raise typer.Exit(outcome.code)
    if outcome.code != 0:
        what = "refused the plan" if outcome.code == 2 else "failed"
        err.print(f"[bold red]error:[/] training {what} (exit code {outcome.code}); see the "
                  "ranks' errors above")
        raise typer.Exit(outcome.code)
    if report and report.is_file():
        data = json.loads(report.read_text())
        m, p = data["measured"], data["predicted"]
        pred = f"{p['iteration_ms']:.2f} ms" if p.get("iteration_ms") is not None else "—"
        # rank 0's: in a pipeline the progress lines are another rank's, whose times differ
        timed = f" (rank 0's median of {data['steps']} timed step(s))" \
            if isinstance(data.get("steps"), int) else ""
        out.print(f"measured {m['iteration_ms']:.2f} ms/iteration{timed} · predicted {pred} · "
                  f"report {report}")
        out.print(f"side by side, per rank: hetplan inspect {plan_file} --run {report}"
                  + (f" --trace {trace}" if trace is not None else ""), markup=False)
        if data.get("rebalanced_at"):
            out.print(f"re-balanced the pipeline at iteration(s) {data['rebalanced_at']} "
                      f"({', '.join(f'{x:.1f}' for x in data.get('rebalance_ms', []))} ms)")


#: What users of other trainers call ``hetplan run --steps``.
_STEP_WORDS = frozenset({"--iterations", "--iters", "--iter", "--num-steps", "--max-steps",
                         "--train-iters", "--num-iterations", "--step"})


def _check_torchrun_args(ctx: typer.Context) -> None:
    """The options ``hetplan run`` passes on to torchrun: refuse, before anything starts,
    one that torchrun's own parser does not take either (a typo such as ``--iterations``
    would otherwise fail every rank's launch), naming the closest option of either."""
    if not ctx.args:
        return
    import difflib

    from torch.distributed.run import get_args_parser

    parser = get_args_parser()

    def refuse(message: str) -> NoReturn:  # argparse reports every bad value through it
        raise SpecError(f"torchrun option: {message}")

    parser.error = refuse  # type: ignore[method-assign]
    _, unknown = parser.parse_known_args([*ctx.args, "script.py"])
    flags = [a for a in unknown if a.startswith("-")]
    if not flags:
        return
    ours = [o for p in ctx.command.params for o in getattr(p, "opts", ()) if o.startswith("--")]
    theirs = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    bad = flags[0].split("=", 1)[0]
    if bad in ours:  # `hetplan run PLAN -- ... --dry-run`: after `--`, all goes to torchrun
        raise SpecError(f"{bad} is an option of `hetplan run`, but it follows `--`, which "
                        f"passes everything after it to torchrun: put {bad} before `--`")
    close = (["--steps"] if bad in _STEP_WORDS else
             difflib.get_close_matches(bad, ours + theirs, n=1, cutoff=0.6))
    hint = f"; did you mean {close[0]}?" if close else ""
    raise SpecError(f"unknown option {bad!r}: neither `hetplan run` nor torchrun takes it"
                    f"{hint} (see `hetplan run --help`; extra options go to torchrun)")


def _check_trace_options(trace: Path, trace_step: int, steps: int,
                         script: Path | None, report: Path | None) -> None:
    """--trace: a writable JSON path (not a hetplan file of another kind, such as the plan,
    nor the --report path), a step the run takes, not with --script."""
    from hetplan.ir.files import check_overwrite

    if script is not None:
        raise SpecError("--trace records the synthetic-data worker's steps; a --script run "
                        "builds its own Runtime: call Runtime.start_trace() in the script")
    if trace.suffix != ".json":
        raise SpecError(f"--trace: {str(trace)!r} must end in .json (Chrome trace-event JSON)")
    if trace.is_dir() or not trace.resolve().parent.is_dir():
        raise SpecError(f"--trace: cannot write {str(trace)!r} (a directory, or its folder "
                        "does not exist)")
    check_overwrite(trace, option="--trace", kind="trace")
    if report is not None and trace.resolve() == report.resolve():
        raise SpecError(f"--trace and --report are both {str(trace)!r}: the trace would "
                        "replace the run report; give each its own file")
    total = steps + 2  # the worker's 2 warm-up steps
    if not 0 <= trace_step <= total:
        raise SpecError(f"--trace-step {trace_step}: the run takes {total} steps (2 warm-up "
                        f"and --steps {steps}); give 1..{total}, or 0 for the last")


@dataclasses.dataclass(frozen=True)
class _RunModel:
    """The model ``hetplan run`` was given (its name as the user gave it), fingerprinted as
    the ranks will fingerprint it, with its captured layers (their linears: the plan's TP
    linears are checked against them) and the head size of every fused-QKV attention module
    (rule 5 of :mod:`hetplan.ir.plan_tp_checks`), by its output projection's name (read off
    the module: the IR records head units, not which modules are fused) and its example
    inputs' shapes (to name a plan made with another ``--seq``)."""

    name: str
    digest: str
    layers: tuple[Any, ...] = ()
    grad_tensors: tuple[Any, ...] = ()
    head_dims: tuple[tuple[str, int], ...] = ()
    input_shapes: tuple[tuple[int, ...], ...] = ()

    def fingerprint(self) -> str:
        return self.digest


def _run_model_ir(plan: Any, model: str | None, module: str | None) -> _RunModel:
    """The model ``hetplan run`` would train, captured here as every rank captures it (batch
    1, under the plan's model name, which the fingerprint includes), for the preflight
    check."""
    from hetplan.ir.capture import capture
    from hetplan.ir.capture.factory import load_factory
    from hetplan.runtime.megatron import refused_head_splits

    if module:
        m, args, kwargs = load_factory(module)
        given = module
    else:
        from hetplan import zoo

        assert model is not None
        entry = zoo.get(model)
        m = zoo.build(entry.name)
        args, kwargs = zoo.example_inputs(entry.name, batch=1)
        given = entry.name
    with err.status(f"checking {given} against the plan …", spinner="dots"):
        ir = capture(m, args, kwargs, name=plan.model.name)
    heads = tuple(sorted(refused_head_splits(m).items()))
    return _RunModel(given, ir.fingerprint(), tuple(ir.layers), tuple(ir.grad_tensors), heads,
                     tuple(ir.input_shapes))


@app.command("simulate")
@_user_errors
def simulate_cmd(
    plan_file: Path = typer.Argument(..., help="A plan JSON file (also one edited by hand)."),
    cluster: str = typer.Option(None, "--cluster", help="Cluster, if the plan lacks one."),
    profile: Path = typer.Option(None, "--profile", help="Profile DB to use."),
    as_json: bool = typer.Option(False, "--json", help="Print the predictions as JSON."),
) -> None:
    """Re-predict a plan from the plan file alone (its workload summary and cluster)."""
    from hetplan.ir.plan import load_plan
    from hetplan.cost_models.predict import simulate

    plan = load_plan(plan_file)
    _need_cluster(plan, plan_file, cluster)
    try:
        with _naming(plan_file):
            pred = simulate(plan, cluster=cluster, profile=profile)
    except InfeasiblePlanError as e:  # a valid plan that does not fit: name the file
        raise InfeasiblePlanError(f"{plan_file}: the plan does not fit in memory: {e}") from e
    _note_profile_missing(plan, profile)
    if as_json:
        out.print(pred.model_dump_json(indent=2), markup=False)
        return
    stored = plan.predictions.iteration_time_ms if plan.predictions else None
    out.print(f"predicted iteration time: [bold]{pred.iteration_time_ms:.3f} ms[/]")
    if stored is not None:
        delta = pred.iteration_time_ms - stored
        out.print(f"in the plan file: {stored:.3f} ms ({delta:+.3f} ms)")
    b = pred.breakdown
    out.print(
        # as inspect words it: the compression time was left out, the ratio a fraction
        f"compute {b.compute_ms:.3f} ms · comm {b.comm_ms:.3f} ms · exposed comm "
        f"{b.exposed_comm_ms:.3f} ms · compression {b.compression_ms:.3f} ms · bubble "
        f"{b.bubble_ms:.3f} ms · optimizer step {b.optimizer_ms:.3f} ms · bubble ratio "
        f"{pred.bubble_ratio:.1%}"
    )


def _note_profile_missing(plan: Any, profile: Path | None) -> None:
    """A plan predicted with a profile DB, re-predicted without one (``simulate``, ``export``,
    ``timeline``): say the numbers are analytic and which DB to give, as inspect, diff and
    explain do; else they read as a stale plan's. Likewise a plan re-predicted with another
    DB than its own (or with one, where it was predicted without)."""
    recorded = plan.cost_settings.profile_fingerprint if plan.cost_settings else ""
    if recorded and profile is None:
        err.print(f"note: the plan was predicted with profile DB {recorded}, which the file "
                  "does not carry, so this prediction is analytic; give --profile DB to "
                  "re-predict it as planned", markup=False)
    if profile is not None:
        from hetplan.cost_models.predict import resolve_profile

        db = resolve_profile(profile)
        given = db.fingerprint() if db is not None else ""
        if given != recorded:
            was = f"with profile DB {recorded}" if recorded else "without one"
            err.print(f"note: this prediction uses --profile {profile} (profile DB {given}), "
                      f"but the plan was predicted {was}: a difference from the stored "
                      "prediction may come from the DB", markup=False)


#: The `plan` flag of each compile option whose flag is not ``--`` + its name with dashes.
_FLAGS = {"batch_size": "--batch-size/-b", "compressors": "--compress"}


@contextlib.contextmanager
def _blaming_options() -> Iterator[None]:
    """Name the `plan` flag at fault in a :class:`SpecError` about a compile option (the
    library names its field: ``compile options: tp_gamma_max: ...``), without the hint for
    files that a field error ends with."""
    from hetplan.ir.validation import DEFAULT_HINT
    from hetplan.optimizer.options import CompileOptions

    try:
        yield
    except SpecError as e:
        fields = "|".join(sorted(CompileOptions.model_fields))
        field = re.compile(rf"^(?:compile options: )?({fields}): ")
        lines = []
        for line in str(e).splitlines():
            if line == DEFAULT_HINT:
                continue
            m = field.match(line)
            if m is not None:
                name = m.group(1)
                flag = _FLAGS.get(name, "--" + name.replace("_", "-"))
                line = f"{flag}: {line[m.end():]}"
            elif line.startswith("compile options: "):
                line = "plan options: " + line[len("compile options: "):]
            lines.append(line)
        raise SpecError("\n".join(lines)) from None


def _check_profile_is_the_plans(plan_file: Path, recorded: str, profile: Path) -> None:
    """`inspect --profile DB` (no --trace) only re-checks the stored prediction, which only
    the DB the plan was predicted with can do: another DB is refused (it was accepted, and
    the report said in one line that nothing was re-checked)."""
    from hetplan.cost_models.predict import resolve_profile

    db = resolve_profile(profile)
    if db is not None and db.fingerprint() != recorded:
        raise SpecError(
            f"--profile {profile} is profile DB {db.fingerprint()}, but {plan_file} was "
            f"predicted with profile DB {recorded} (cost_settings.profile_fingerprint), so it "
            "cannot re-check the plan's stored prediction; give the DB the plan was made with, "
            "or drop --profile")


@contextlib.contextmanager
def _naming(plan_file: Path) -> Iterator[None]:
    """Name the plan file in each line of a :class:`PlanMismatchError` (``--cluster`` is not
    the plan's cluster, or a plan without its cluster does not fit the one given)."""
    try:
        yield
    except PlanMismatchError as e:
        raise PlanMismatchError("\n".join(f"{plan_file}: {line}"
                                           for line in str(e).splitlines())) from e


def _need_cluster(plan: Any, plan_file: Path, cluster: str | None) -> None:
    """Re-predicting needs the cluster: embedded in the plan, or given with --cluster."""
    if plan.cluster.spec is None and cluster is None:
        raise SpecError(
            f"{plan_file}: cluster.spec: the plan does not embed its cluster "
            f"{plan.cluster.name!r}; pass it with --cluster FILE|PRESET"
        )


def _per_stage_refusal(plan: Any, plan_file: Path) -> None:
    """Refuse to export a plan with per-stage degrees, which no engine runs
    (:func:`hetplan.report.explain_hetero.per_stage_refusal`), naming the file."""
    from hetplan.report.explain_hetero import per_stage_refusal

    if why := per_stage_refusal(plan):
        raise SpecError(f"{plan_file}: {why}")


# --------------------------------------------------------------------------------------
# clusters
# --------------------------------------------------------------------------------------
@app.command("presets")
@_user_errors
def presets_cmd() -> None:
    """List the built-in cluster presets."""
    from hetplan.ir.cluster import ClusterSpec, list_presets

    table = Table(title="cluster presets", title_justify="left")
    for col in ("name", "nodes", "devices", "world", "description"):
        table.add_column(col)
    for name, description in list_presets():
        spec = ClusterSpec.from_preset(name)
        kinds = sorted({d.type for d in spec.devices()})
        table.add_row(
            name, str(spec.num_nodes), ", ".join(kinds), str(spec.world_size), description
        )
    out.print(table)


@app.command("passes")
@_user_errors
def passes_cmd() -> None:
    """List the passes a pipeline spec (`hetplan plan --passes`) can name, with their options."""
    from hetplan.passes import DEFAULT_PIPELINE
    from rich.markup import escape

    from hetplan.passes.spec import describe_passes

    table = Table(title="passes", title_justify="left")
    for col in ("name", "what it decides", "options (default)"):
        table.add_column(col)
    for name, doc, options in describe_passes():
        opts = "\n".join(f"{o}: {ty} ({default})" for o, ty, default in options) or "none"
        table.add_row(name, escape(doc), escape(opts))
    out.print(table)
    out.print(f"default pipeline: {DEFAULT_PIPELINE}", markup=False)
    out.print("spec syntax: name{option=value other-option=a,b},next-pass", markup=False)


def print_cluster_summary(spec: Any) -> None:
    out.print(
        f"[bold]{_escape(spec.name)}[/]: {spec.num_nodes} node(s), {spec.world_size} devices, "
        f"{'heterogeneous' if spec.is_heterogeneous else 'homogeneous'}, "
        f"fingerprint {spec.fingerprint()}"
    )
    table = Table(title_justify="left")
    for col in ("node", "×", "devices", "intra link", "cpu cores", "slowdown"):
        table.add_column(col)
    for node in spec.nodes:
        devs = ", ".join(f"{g.count}× {g.type}" for g in node.devices)
        link = node.intra_link
        table.add_row(
            _escape(node.name),
            str(node.count),
            _escape(devs),
            f"{link.kind} {link.bandwidth_gbps:g} Gb/s, {link.latency_us:g} µs",
            str(node.cpu_cores),
            f"{node.slowdown:g}",
        )
    out.print(table)
    if spec.inter_node is not None:
        net = spec.inter_node
        out.print(
            f"inter-node: {net.kind} {net.bandwidth_gbps:g} Gb/s, {net.latency_us:g} µs latency"
        )


# --------------------------------------------------------------------------------------
# validate / inspect
# --------------------------------------------------------------------------------------
def _file_kind(path: Path) -> tuple[str, dict[str, Any] | None]:
    """The kind of hetplan file ``path`` is (:func:`hetplan.ir.files.file_kind`: 'plan',
    'workload', 'profile DB', 'run report', 'dynamics', 'trace'), from its top-level keys; 'cluster
    spec' when none matches (its loader names what is missing). With it the file's data when
    it was read to tell (None for a plan told from its first bytes), so that a cluster spec is
    not parsed twice (a large YAML file takes a while)."""
    from hetplan.ir.files import file_kind
    from hetplan.ir.validation import load_structured_file

    if path.suffix == ".json" and path.is_file():
        with path.open("rb") as f:
            head = f.read(4096).decode("utf-8", errors="replace")
        if '"tool_version"' in head or '"schema_version"' in head and '"cluster"' in head:
            return "plan", None  # even when truncated: the plan loader explains what is wrong
    data = load_structured_file(path, what="input")
    if "layers" in data:
        return "workload", data
    return file_kind(data) or "cluster spec", data


@app.command("validate")
@_user_errors
def validate_cmd(
    file: Path = typer.Argument(..., help="A cluster spec (YAML/JSON), plan, workload, profile "
                                "DB, dynamics file, run report or run trace."),
    model: str = typer.Option(None, "--model", help="A plan: also check it against this zoo "
                              "model, as `hetplan run --model` does."),
    module: str = typer.Option(None, "--module", help="A plan: also check it against the "
                               "model of pkg.mod:factory, as `hetplan run --module` does."),
) -> None:
    """Validate a cluster spec, plan, workload, profile DB, dynamics file, run report or run
    trace and summarise it.

    A plan gets every check of the plan file; with --model or --module also those that
    need the model (what `hetplan run` checks before launch: the model's fingerprint, the
    embedded workload, the tensor_parallel linears' names, splits, features and pair shard
    sizes). Without them the output says these were not run."""
    kind, data = _file_kind(file)
    if model and module:
        raise SpecError("give --model NAME or --module pkg.mod:factory, not both")
    if (model or module) and kind != "plan":
        raise SpecError(f"--model / --module check a plan against its model; {file} is a "
                        f"{kind}: drop the option")
    if kind == "plan":
        from hetplan.ir.plan import check_plan_matches, load_plan

        plan = load_plan(file)
        if model or module:
            with _naming(file):
                check_plan_matches(plan, model_ir=_run_model_ir(plan, model, module))
            out.print(f"[green]ok[/]: {_escape(str(file))} is a valid plan (schema "
                      f"v{plan.schema_version}) for model {_escape(module or model)}")
        else:
            out.print(f"[green]ok[/]: {_escape(str(file))} is a valid plan (schema "
                      f"v{plan.schema_version}); "
                      "not checked against its model (the workload, the tensor_parallel "
                      "linears): give --model NAME or --module pkg.mod:factory, as to "
                      "`hetplan run`")
        _print_plan(plan)
    elif kind == "workload":
        from hetplan.ir.model import ModelIR

        ir = ModelIR.load(file)
        out.print(f"[green]ok[/]: {_escape(str(file))} is a valid workload")
        print_ir_summary(ir)
    elif kind == "profile DB":
        from hetplan.cost_models.profile_db import ProfileDB

        db = ProfileDB.load(file)
        out.print(f"[green]ok[/]: {_escape(str(file))} is a valid profile DB: "
                  f"{len(db.compute)} layer, "
                  f"{len(db.collectives)} collective, {len(db.compressors)} compressor and "
                  f"{len(db.optimizer_steps)} optimizer-step record(s)")
    elif kind == "dynamics":
        from hetplan.ir.rebalancing import DynamicsSpec

        DynamicsSpec.load(file)
        out.print(f"[green]ok[/]: {_escape(str(file))} is a valid dynamics file")
    elif kind == "run report":
        data = _load_run_report(file)
        ranks, steps = data.get("world_size", "?"), data.get("steps", "?")
        out.print(f"[green]ok[/]: {_escape(str(file))} is a valid run report: {ranks} rank(s), "
                  f"{steps} timed step(s), {data['measured']['iteration_ms']:.2f} ms/iteration "
                  "measured; `hetplan inspect PLAN --run` puts it beside the plan's prediction")
    elif kind == "trace":
        from hetplan.ir.validation import load_structured_file
        from hetplan.report.trace_compare import load_trace

        load_trace(load_structured_file(file, what="trace"), str(file))
        out.print(f"[green]ok[/]: {_escape(str(file))} is a valid trace of `hetplan run --trace`")
    else:
        from hetplan.ir.cluster import ClusterSpec

        # what ClusterSpec.load(file) does, on the data _file_kind has read
        assert data is not None
        spec = ClusterSpec.from_dict(data, where=str(file))
        out.print(f"[green]ok[/]: {_escape(str(file))} is a valid cluster spec")
        print_cluster_summary(spec)


def _print_plan(plan: Any, sections: list[str] | None = None) -> None:
    """Print the inspection report of ``plan`` (:mod:`hetplan.report`)."""
    from hetplan.report.inspect import build_report
    from hetplan.report.render import render_report

    render_report(build_report(plan), out, sections=sections or ())


def _check_sections(sections: list[str] | None) -> list[str]:
    from hetplan.ir.validation import did_you_mean
    from hetplan.report.inspect import SECTIONS

    chosen = list(sections or [])
    for name in chosen:
        if name not in SECTIONS:
            raise SpecError(
                f"--section {name!r} is not a section{did_you_mean(name, SECTIONS)} "
                f"(sections: {', '.join(SECTIONS)})"
            )
    return chosen


@app.command("inspect")
@_user_errors
def inspect_cmd(
    plan_file: Path = typer.Argument(..., help="A plan JSON file."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    section: list[str] = typer.Option(
        None, "--section", "-s",
        help="Only this section (repeatable): layout, stages, tp, sync, memory, predictions, "
        "provenance, checkpointing, group_sync, rebalancing, warnings.",
    ),
    run: Path = typer.Option(None, "--run", help="A run report (`hetplan run --report`)."),
    trace: Path = typer.Option(None, "--trace", help="A run's trace (`hetplan run --trace`): "
                               "every rank's actions, predicted beside measured."),
    profile: Path = typer.Option(None, "--profile", help="The profile DB the plan was made "
                                 "with: to re-check its stored prediction and, with --trace, "
                                 "to predict its timeline again."),
) -> None:
    """Report on a plan: layout, stages, TP shards, sync, memory, predictions, warnings.

    The stored prediction is re-checked (the plan re-predicted as `hetplan simulate` does):
    where the plan was edited since, the re-predicted one is shown, and a line says so."""
    from hetplan.ir.plan import load_plan
    from hetplan.report._text import dump_json
    from hetplan.report.inspect import build_report, select_sections
    from hetplan.report.render import render_report
    from hetplan.report.stale import add_check, check_prediction

    sections = _check_sections(section)
    plan = load_plan(plan_file)
    recorded = plan.cost_settings is not None and plan.cost_settings.profile_fingerprint
    if profile is not None and trace is None and not recorded:
        raise SpecError("--profile re-predicts the plan beside a run's --trace; give --trace "
                        "FILE too (the plan was predicted without a profile DB, so re-checking "
                        "its stored prediction needs none)")
    if profile is not None and trace is None and recorded:
        _check_profile_is_the_plans(plan_file, str(recorded), profile)
    measured = _load_run_report(run) if run else None
    if measured is not None:
        _check_report_is_of(plan, plan_file, measured, run)
    traced = _trace_comparison(plan, plan_file, trace, profile) if trace else None
    with _naming(plan_file):
        check = check_prediction(plan, profile=profile)
    shown = check.plan  # re-predicted where the stored prediction is stale
    if as_json:
        report = select_sections(add_check(build_report(shown), check), sections)
        if measured is not None:
            report["run"] = measured
        if traced is not None:
            report["trace"] = traced
        typer.echo(dump_json(report), nl=False)
        return
    render_report(add_check(build_report(shown), check), out, sections=sections)
    if measured is not None:
        _print_run(shown, measured)
    if traced is not None:
        _print_trace(traced)


def _trace_comparison(plan: Any, plan_file: Path, trace: Path,
                      profile: Path | None) -> dict[str, Any]:
    from hetplan.ir.validation import load_structured_file
    from hetplan.report.trace_compare import compare_trace, load_trace

    _need_cluster(plan, plan_file, None)
    data = load_trace(load_structured_file(trace, what="trace"), str(trace))
    with _naming(plan_file):
        return compare_trace(plan, data, profile=profile, source=str(trace),
                             plan_source=str(plan_file))


def _print_trace(cmp: dict[str, Any]) -> None:
    """Per rank: every forward and backward, predicted beside measured, and where the
    measured micro-batch phase went."""
    def num(x: Any) -> str:
        return "—" if x is None else f"{x:.2f}"

    for r in cmp["ranks"]:
        table = Table(title=f"rank {r['rank']} (pipeline rank {r['pp_rank']}), step "
                            f"{cmp['step']}: predicted vs measured ms", title_justify="left")
        for col in ("action", "pred start", "pred", "meas start", "meas compute", "wait",
                    "loss"):
            table.add_column(col, justify="right" if col != "action" else "left")
        for a in r["actions"]:
            table.add_row(a["action"], num(a["predicted_start_ms"]), num(a["predicted_ms"]),
                          num(a["measured_start_ms"]), num(a["measured_ms"]),
                          num(a["wait_ms"]), num(a["loss_ms"]))
        out.print(table)
        p, m = r["predicted"], r["measured"]
        after = ", ".join(f"{k} {v:.2f}" for k, v in m["after_backward_ms"].items()
                          if v >= 0.01)
        synced = ", ".join(f"{k} {v:.2f}" for k, v in m.get("after_sync_ms", {}).items()
                           if v >= 0.01)
        out.print(f"  predicted: pipeline {num(p['pipeline_iteration_ms'])} ms, busy "
                  f"{num(p['busy_ms'])}, idle {num(p['idle_ms'])}; exposed sync "
                  f"{num(p['exposed_sync_ms'])}, optimizer {num(p['optimizer_ms'])}", markup=False)
        out.print(f"  measured: micro-batches from {m['micro_batches_start_ms']:.2f} ms, "
                  f"{m['micro_batches_ms']:.2f} ms = compute "
                  f"{m['compute_ms']:.2f} + waiting for activations "
                  f"{m['wait_for_activations_ms']:.2f} + for gradients "
                  f"{m['wait_for_gradients_ms']:.2f} + loss {m['loss_ms']:.2f} + other "
                  f"{m['other_ms']:.2f}; after backward ({after or 'nothing'}); after "
                  f"the sync ({synced or 'nothing'}); optimizer "
                  f"{m['optimizer_ms']:.2f}", markup=False)
        if m.get("sync_ms"):
            out.print("  gradient sync: " + ", ".join(f"{k} {v:.2f}"
                                                     for k, v in m["sync_ms"].items()),
                      markup=False)


def _load_run_report(path: Path) -> dict[str, Any]:
    from hetplan.ir.validation import load_structured_file

    data = load_structured_file(path, what="run report")
    measured = data.get("measured")
    if not isinstance(measured, dict) or "iteration_ms" not in measured:
        raise SpecError(f"{path}: not a run report (no measured.iteration_ms); write one with "
                        "`hetplan run PLAN --report FILE`")
    for key in ("iteration_ms", "compute_ms", "bubble_ms", "exposed_comm_ms", "optimizer_ms"):
        value = measured.get(key)
        if value is None and key != "iteration_ms":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                0 <= value < float("inf")):
            raise SpecError(f"{path}: measured.{key}: expected milliseconds (a number >= 0), "
                            f"got {value!r}; write the report with `hetplan run PLAN --report "
                            "FILE`")
    busiest = measured.get("busiest_rank")
    world = data.get("world_size")
    if busiest is not None and (isinstance(busiest, bool) or not isinstance(busiest, int)
                                or busiest < 0 or (isinstance(world, int) and busiest >= world)):
        span = f"0..{world - 1}" if isinstance(world, int) and world >= 1 else "0 or more"
        raise SpecError(f"{path}: measured.busiest_rank: expected a rank of the run (an integer "
                        f"in {span}) or null, got {busiest!r}; write the report with `hetplan "
                        "run PLAN --report FILE`")
    _check_report_fields(path, data)
    return data


def _check_report_fields(path: Path, data: dict[str, Any]) -> None:
    """What ``inspect --run`` prints of a run report beside ``measured``: the world size,
    every rank's times (a number, or an edited report was an internal error), the losses,
    the CPU policy (:func:`hetplan.runtime.cpu_sched.current_cpu_sched`'s names)."""
    fix = "write the report with `hetplan run PLAN --report FILE`"

    def number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    world = data.get("world_size")
    if world is not None and not (isinstance(world, int) and not isinstance(world, bool)
                                  and world >= 1):
        raise SpecError(f"{path}: world_size: expected the number of ranks (an integer >= 1), "
                        f"got {world!r}; {fix}")
    steps = data.get("steps")
    if steps is not None and not (isinstance(steps, int) and not isinstance(steps, bool)
                                  and steps >= 1):
        raise SpecError(f"{path}: steps: expected the number of timed iterations (an integer "
                        f">= 1), got {steps!r}; {fix}")
    ranks = data.get("per_rank")
    if ranks is not None and not isinstance(ranks, list):
        raise SpecError(f"{path}: per_rank: expected a list with one entry per rank, got "
                        f"{type(ranks).__name__}; {fix}")
    for i, r in enumerate(ranks or []):
        if not isinstance(r, dict):
            raise SpecError(f"{path}: per_rank[{i}]: expected a mapping, got {r!r:.40}; {fix}")
        rank = r.get("rank")
        if not (isinstance(rank, int) and not isinstance(rank, bool) and 0 <= rank
                and (world is None or rank < world)):
            bound = f"0..{world - 1} (world_size {world})" if world else "an integer >= 0"
            raise SpecError(f"{path}: per_rank[{i}].rank: expected a rank in {bound}, got "
                            f"{rank!r}; {fix}")
        for key in ("compute_ms", "bubble_ms", "exposed_comm_ms", "optimizer_ms", "cpu_ms",
                    "peak_memory_bytes", "predicted_memory_bytes"):
            if key in r and r[key] is not None and not (number(r[key]) and r[key] >= 0):
                raise SpecError(f"{path}: per_rank[{i}].{key}: expected a number >= 0, got "
                                f"{r[key]!r:.40}; {fix}")
            if key in r and r[key] is None and key.endswith("_ms"):
                raise SpecError(f"{path}: per_rank[{i}].{key}: expected milliseconds, got "
                                f"null; {fix}")
    losses = data.get("loss_per_step")
    if losses is not None and not (isinstance(losses, list) and all(number(x) for x in losses)):
        raise SpecError(f"{path}: loss_per_step: expected a list of numbers (one loss per "
                        f"step), got {losses!r:.60}; {fix}")
    policies = ("normal", "batch", "other", "unsupported")
    sched = data.get("cpu_sched")
    if sched is not None and sched not in policies:
        raise SpecError(f"{path}: cpu_sched: expected one of {', '.join(policies)} (the "
                        f"policy rank 0 ran under), got {sched!r}; {fix}")


def _check_report_is_of(plan: Any, plan_file: Path, report: dict[str, Any],
                        path: Path) -> None:
    """A run report beside another plan's predictions compares unrelated numbers: refuse a
    report whose ``plan_digest`` (written by the runs of this version) is another plan's,
    or, from an older run, whose world size is not the plan's."""
    from hetplan.report.trace_compare import plan_digest

    digest = report.get("plan_digest")
    if digest is not None and digest != plan_digest(plan):
        raise SpecError(f"{path}: the run report is of another plan (digest {digest}), not "
                        f"{plan_file} (digest {plan_digest(plan)}): give the plan the run was "
                        "made with")
    layout = plan.layout
    world = report.get("world_size")
    if layout is None or world is None:
        return
    # with per-stage degrees a run has a process per rank the stages list (the runtime's
    # plan_world_size), not the layout's dp x pp x tp
    need = (len({r for st in plan.stages for r in st.ranks}) if plan.hetero is not None
            else layout.num_ranks)
    shape = (plan.hetero.describe() if plan.hetero is not None
             else f"dp={layout.dp} pp={layout.pp} tp={layout.tp}")
    if world != need:
        raise SpecError(f"{path}: world_size {world}, but {plan_file} runs on {need} ranks "
                        f"({shape}): the report is of another plan; give the plan the run "
                        "was made with")


def _print_run(plan: Any, report: dict[str, Any]) -> None:
    """Predicted vs measured, side by side."""
    pred = plan.predictions
    m = report["measured"]
    table = Table(title=f"predicted vs measured ({report.get('steps', '?')} iterations, "
                        f"{report.get('world_size', '?')} ranks)", title_justify="left")
    for col in ("", "predicted ms", "measured ms", "error"):
        table.add_column(col, justify="right" if col else "left")
    rows = [("iteration", pred.iteration_time_ms if pred else None, m.get("iteration_ms")),
            ("compute", pred.breakdown.compute_ms if pred else None, m.get("compute_ms")),
            ("pipeline bubble", pred.breakdown.bubble_ms if pred else None, m.get("bubble_ms")),
            ("exposed comm", pred.breakdown.exposed_comm_ms if pred else None,
             m.get("exposed_comm_ms")),
            ("optimizer step", pred.breakdown.optimizer_ms if pred else None,
             m.get("optimizer_ms"))]
    for name, p, x in rows:
        err_text = f"{(p - x) / x:+.1%}" if p is not None and x else "—"
        table.add_row(name, "—" if p is None else f"{p:.3f}", "—" if x is None else f"{x:.3f}",
                      err_text)
    out.print(table)
    out.print("  error: (predicted - measured) / measured; below 0, the run took longer than "
              "predicted", markup=False)
    if m.get("busiest_rank") is not None:  # checked by _load_run_report
        out.print(f"  compute and pipeline bubble measured on rank {m['busiest_rank']}, the "
                  "busiest, as predicted for the busiest pipeline rank; the rest on rank 0",
                  markup=False)
    _print_run_ranks(plan, report)
    losses = report.get("loss_per_step")
    if isinstance(losses, list) and losses:
        dp = plan.loss_replicas()
        mean = f" (mean over the {dp} data-parallel replicas)" if dp > 1 else ""
        out.print(f"loss per step{mean}: " + " ".join(f"{x:.4f}" for x in losses[:20])
                  + (" ..." if len(losses) > 20 else ""))
    if report.get("cpu_sched") == "batch":
        out.print("the CPU ranks ran as batch tasks (HETPLAN_CPU_SCHED=batch): compare with "
                  "a plan made from a profile taken under batch too "
                  "(docs/decisions/cpu-sched.md)", markup=False)


def _print_run_ranks(plan: Any, report: dict[str, Any]) -> None:
    """Per rank: measured times, and measured peak memory beside the predicted one (without
    the allocator margin, which a tensor count cannot see)."""
    ranks = [r for r in report.get("per_rank") or [] if isinstance(r, dict)]
    if not ranks:
        return
    pred = plan.predictions
    table = Table(title="per rank (measured medians; memory: predicted vs measured peak)",
                  title_justify="left")
    for col in ("rank", "compute ms", "bubble ms", "exposed comm ms", "optimizer ms",
                "predicted MiB", "measured MiB", "error"):
        table.add_column(col, justify="right")
    for r in ranks:
        rank = r.get("rank")
        p = r.get("predicted_memory_bytes")
        if p is None and pred is not None and isinstance(rank, int) \
                and rank < len(pred.memory_breakdown):
            m = pred.memory_breakdown[rank]
            p = m.total - m.margin
        x = r.get("peak_memory_bytes")
        err = f"{(p - x) / x:+.1%}" if isinstance(p, (int, float)) and x else "—"
        table.add_row(str(rank), *(f"{r.get(k, 0.0):.3f}" for k in
                                   ("compute_ms", "bubble_ms", "exposed_comm_ms",
                                    "optimizer_ms")),
                      "—" if p is None else f"{p / 2**20:.2f}",
                      "—" if x is None else f"{x / 2**20:.2f}", err)
    out.print(table)


@app.command("explain")
@_user_errors
def explain_cmd(
    plan_file: Path = typer.Argument(..., help="A plan JSON file."),
    target: str = typer.Argument(
        ..., help="A gradient tensor name, bucket:N, stage:K (the boundary before stage K), "
        "rank:R or linear:NAME (a tensor-parallel linear with uneven shards)."),
    cluster: str = typer.Option(None, "--cluster", help="Cluster, if the plan lacks one."),
    profile: Path = typer.Option(None, "--profile", help="Profile DB the plan was made with."),
    as_json: bool = typer.Option(False, "--json", help="Print the explanation as JSON."),
) -> None:
    """Why the plan made one decision: alternatives re-evaluated with its cost model."""
    from hetplan.ir.plan import load_plan
    from hetplan.report._text import dump_json
    from hetplan.report.explain import explain

    plan = load_plan(plan_file)
    _need_cluster(plan, plan_file, cluster)
    with _naming(plan_file):
        result = explain(plan, target, cluster=cluster, profile=profile)
    if as_json:
        typer.echo(dump_json(result.to_dict()), nl=False)
        return
    typer.echo(result.text, nl=False)


@app.command("diff")
@_user_errors
def diff_cmd(
    plan_a: Path = typer.Argument(..., help="The first plan (a)."),
    plan_b: Path = typer.Argument(..., help="The second plan (b); differences are b - a."),
    as_json: bool = typer.Option(False, "--json", help="Print the differences as JSON."),
    profile: Path = typer.Option(None, "--profile", help="The profile DB the plans were made "
                                 "with: to re-check their stored predictions."),
) -> None:
    """What changed between two plans, and what it does to the predictions.

    A plan whose stored prediction no longer holds (edited by hand) is compared as
    `hetplan simulate` re-predicts it, with a line saying so, as `hetplan inspect` does."""
    from hetplan.ir.plan import load_plan
    from hetplan.report._text import dump_json
    from hetplan.report.diff import diff_checked, render_diff

    a, b = load_plan(plan_a), load_plan(plan_b)
    if profile is not None and not any(p.cost_settings is not None
                                       and p.cost_settings.profile_fingerprint for p in (a, b)):
        # as `inspect --profile` without --trace: the DB would re-check nothing, silently
        raise SpecError(f"--profile {profile}: neither {plan_a} nor {plan_b} was predicted "
                        "with a profile DB (cost_settings.profile_fingerprint is empty), so "
                        "their stored predictions are re-checked without one; drop --profile")
    d = diff_checked(a, b, profile=profile)
    if as_json:
        typer.echo(dump_json(d), nl=False)
        return
    if not d["identical"]:  # every line below reads "a → b"
        out.print(f"a: {plan_a}\nb: {plan_b}", markup=False)
    render_diff(d, out)


@app.command("export")
@_user_errors
def export_cmd(
    plan_file: Path = typer.Argument(..., help="A plan JSON file."),
    to: str = typer.Option(..., "--to", help="The engine: torchtitan, megatron or deepspeed."),
    output: Path = typer.Option(
        None, "-o", "--output", help="Write the configuration here (default: stdout, with the "
        "report on stderr)."),
    cluster: str = typer.Option(None, "--cluster", help="Cluster, if the plan lacks one."),
    profile: Path = typer.Option(None, "--profile", help="Profile DB the plan was made with."),
    as_json: bool = typer.Option(False, "--json", help="Print the export and its report as "
                                 "JSON."),
) -> None:
    """Write the launch configuration an engine needs for the parts of the plan it can express,
    and price the parts it cannot."""
    from hetplan.ir.plan import load_plan
    from hetplan.report._text import dump_json
    from hetplan.report.export import export_plan

    if output is not None:
        check_output_path(output, option="-o/--output", kind="")
    plan = load_plan(plan_file)
    _need_cluster(plan, plan_file, cluster)
    _per_stage_refusal(plan, plan_file)
    result = export_plan(plan, to, cluster=cluster, profile=profile)
    if output is not None:
        write_text_file(output, result.content, what="export")
    if as_json:
        typer.echo(dump_json(result.to_dict()), nl=False)
    elif output is None:
        typer.echo(result.content, nl=False)
        typer.echo(result.text, nl=False, err=True)
    else:
        typer.echo(result.text, nl=False)
    _note_profile_missing(plan, profile)
    if output is not None:
        err.print(f"wrote {output}", markup=False)


@app.command("timeline")
@_user_errors
def timeline_cmd(
    plan_file: Path = typer.Argument(..., help="A plan JSON file."),
    output: Path = typer.Option(..., "-o", "--output", help="out.png or out.html."),
    cluster: str = typer.Option(None, "--cluster", help="Cluster, if the plan lacks one."),
    profile: Path = typer.Option(None, "--profile", help="Profile DB to use."),
    run_report: Path = typer.Option(
        None, "--run-report", help="A run report of `hetplan run`, to overlay measured times."),
) -> None:
    """Draw the predicted iteration (pipeline and gradient sync) as a PNG or HTML timeline."""
    from hetplan.ir.plan import load_plan

    try:
        from hetplan.report.timeline import check_output, render_timeline
    except ImportError as e:  # the module, or its plotting library, is missing
        raise SpecError(f"timeline rendering is not available in this install: {e}") from e
    check_output(output, option="-o/--output")  # before the plan is simulated
    plan = load_plan(plan_file)
    _need_cluster(plan, plan_file, cluster)
    measured = None
    if run_report is not None:  # checked as `inspect --run` checks it: this plan's, by field
        measured = _load_run_report(run_report)
        _check_report_is_of(plan, plan_file, measured, run_report)
    with _naming(plan_file):
        render_timeline(plan, output, cluster=cluster, profile=profile, run_report=measured)
    _note_profile_missing(plan, profile)
    err.print(f"wrote {output}", markup=False)


def _unwrap_help(*apps: typer.Typer) -> None:
    """Join the lines of each paragraph of every command's help (its docstring, wrapped at
    the source's width): typer keeps single line breaks, so a terminal of any other width
    showed ragged lines; rich now wraps each paragraph to the terminal."""
    import inspect

    for sub in apps:
        for command in sub.registered_commands:
            doc = command.help or inspect.getdoc(command.callback) or ""
            command.help = "\n\n".join(" ".join(p.split()) for p in doc.split("\n\n"))


_unwrap_help(app, workload_app)


def main() -> None:
    """Console-script entry point.

    After `hetplan run` has ended every process of its run, the launcher exits at once
    (``os._exit`` once its output is flushed): the interpreter's teardown of the torch it
    imported to check the model took 3 to 5 s on a loaded machine (measured with load
    average 18 on 2 cores), which counted against the bound on a stopped or failed job.
    """
    try:
        app()
    except SystemExit as e:
        if not _state["exit_now"]:
            raise
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    else:
        if not _state["exit_now"]:
            return
        code = 0
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
