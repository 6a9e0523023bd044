"""Workloads given as numbers rather than models: the Espresso benchmark file.

``data/espresso_models.json`` (from the Espresso artifact) describes each model only
as gradient tensors in backward-ready order (names, element counts) and the measured time
between consecutive gradient-ready events on a V100. :func:`espresso_workloads` turns each
into a :class:`~hetplan.ir.model.ModelIR` (method ``workload``) that the rest of hetplan
accepts in place of a captured model, and ``hetplan workload convert`` writes them as
workload JSON files.

Decisions (also in ``docs/decisions.md``):

- Layers are rebuilt from tensor names: a tensor belongs to the module path up to and
  including its first numeric component (``layer4.2.bn3.weight`` → ``layer4.2``,
  ``bert.encoder.layer.11.output.dense.bias`` → ``bert.encoder.layer.11``), else to its
  module (the name without its last component: ``fc.bias`` → ``fc``). Layers are ordered by
  forward dataflow, i.e. the reverse of the order in which their gradients complete.
- Gaps: by default the raw measured gaps (``ready_gaps``). The reference simulator of the
  Espresso artifact uses each gap modulo 1000 µs (``ready_gaps_effective``); pass
  ``gaps="effective"`` to reproduce its numbers.
- Per layer, ``measured_bwd_us`` is the sum of the gaps that end at its tensors; FLOPs are
  unknown (0) — cost models use the measured times for such workloads.
- Shapes are unknown: each parameter is recorded as a 1-D tensor of its element count.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

from hetplan.errors import SpecError
from hetplan.ir.files import read_text_file
from hetplan.ir.model import (
    GradTensor,
    LayerIR,
    LayerKind,
    ModelIR,
    ParamInfo,
    verify_model_ir,
)

__all__ = ["espresso_workloads", "workload_from_gradients", "layer_of_tensor"]

_NUMERIC = re.compile(r"^\d+$")


def layer_of_tensor(name: str) -> str:
    """The layer a gradient tensor belongs to, from its name (see module docstring)."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if _NUMERIC.match(part):
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or name


def workload_from_gradients(
    name: str,
    tensor_names: list[str],
    tensor_numels: list[int],
    ready_gaps_us: list[float],
    *,
    bytes_per_element: int = 4,
    dtype: str = "float32",
    source: str = "",
) -> ModelIR:
    """Build a workload IR from gradients listed in backward-ready order.

    Args:
        name: workload name.
        tensor_names: gradient (parameter) names, first-ready first.
        tensor_numels: their element counts.
        ready_gaps_us: time between the previous gradient-ready event and this one
            (the first is the time from the start of backprop, usually 0).
        bytes_per_element / dtype: element type of the gradients.
        source: where the numbers come from.
    """
    n = len(tensor_names)
    if not (len(tensor_numels) == n == len(ready_gaps_us)):
        raise SpecError(
            f"workload {name!r}: {n} tensor names, {len(tensor_numels)} sizes and "
            f"{len(ready_gaps_us)} gaps; the three lists must have the same length"
        )
    if n == 0:
        raise SpecError(f"workload {name!r} has no gradient tensors")
    for t, numel, gap in zip(tensor_names, tensor_numels, ready_gaps_us):
        if numel <= 0 or gap < 0:
            raise SpecError(
                f"workload {name!r}: tensor {t!r} has {numel} elements and gap {gap} µs; "
                "sizes must be positive and gaps non-negative"
            )
    # forward order of layers = reverse order of gradient completion
    forward_layers: list[str] = []
    for t in reversed(tensor_names):
        lay = layer_of_tensor(t)
        if lay not in forward_layers:
            forward_layers.append(lay)
    index = {lay: i for i, lay in enumerate(forward_layers)}
    params: dict[str, list[ParamInfo]] = {lay: [] for lay in forward_layers}
    bwd_us: dict[str, float] = {lay: 0.0 for lay in forward_layers}
    grads = []
    for t, numel, gap in zip(tensor_names, tensor_numels, ready_gaps_us):
        lay = layer_of_tensor(t)
        size = numel * bytes_per_element
        params[lay].append(ParamInfo(t, (numel,), dtype, numel, size))
        bwd_us[lay] += float(gap)
        grads.append(GradTensor(t, numel, size, dtype, lay, index[lay], float(gap)))
    last = len(forward_layers) - 1
    layers = tuple(
        LayerIR(
            index=i,
            name=lay,
            kind=_guess_kind(lay, i, last),
            module_type="unknown",
            params=tuple(sorted(params[lay], key=lambda p: tensor_names.index(p.name))),
            measured_bwd_us=bwd_us[lay],
        )
        for i, lay in enumerate(forward_layers)
    )
    ir = ModelIR(
        name=name,
        layers=layers,
        grad_tensors=tuple(grads),
        num_params=sum(tensor_numels),
        method="workload",
        source=source,
    )
    verify_model_ir(ir, where=f"workload {name!r}")
    return ir


def _guess_kind(layer: str, index: int, last: int) -> LayerKind:
    leaf = layer.rsplit(".", 1)[-1].lower()
    if _NUMERIC.match(leaf):
        return LayerKind.BLOCK
    if "emb" in leaf or leaf in ("wte", "wpe"):
        return LayerKind.EMBEDDING
    if "norm" in leaf or leaf.startswith(("bn", "ln")):
        return LayerKind.NORM
    if index == last:
        return LayerKind.HEAD
    return LayerKind.OTHER


def espresso_workloads(
    path: str | Path, *, gaps: Literal["raw", "effective"] = "raw", include_extra: bool = True
) -> dict[str, ModelIR]:
    """Read the Espresso benchmark file into workload IRs, keyed by model name.

    Args:
        path: ``espresso_models.json``.
        gaps: ``raw`` measured gaps, or ``effective`` (gap % 1000, as the reference
            simulator uses them).
        include_extra: also the models the reference CLI cannot select (resnet50,
            bert_large, ncf).
    """
    p = Path(path)
    if not p.is_file():
        raise SpecError(f"benchmark file {str(p)!r} does not exist; the repository ships "
                        "it as data/espresso_models.json")
    try:
        data = json.loads(read_text_file(p, what="benchmark"))
    except json.JSONDecodeError as e:
        raise SpecError(f"{p}: not valid JSON ({e.msg} at line {e.lineno})") from e
    sections = ["models"] + (["extra_models_not_selectable_from_cli"] if include_extra else [])
    if not isinstance(data, dict) or "models" not in data:
        raise SpecError(f"{p}: no 'models' section; is this the Espresso benchmark file?")
    key = "ready_gaps" if gaps == "raw" else "ready_gaps_effective"
    constants = data.get("constants", {})
    if not isinstance(constants, dict):
        raise SpecError(f"{p}: constants: expected a mapping, got {type(constants).__name__}")
    bpe = constants.get("bytes_per_element", 4)
    if isinstance(bpe, bool) or not isinstance(bpe, int) or bpe < 1:
        raise SpecError(f"{p}: constants.bytes_per_element: expected a positive integer (4 for "
                        f"fp32), got {bpe!r}")
    out: dict[str, ModelIR] = {}
    for section in sections:
        models = data.get(section, {})
        if not isinstance(models, dict):
            raise SpecError(f"{p}: {section}: expected a mapping of model names to models, "
                            f"got {type(models).__name__}")
        for name, m in sorted(models.items()):
            if not isinstance(m, dict):
                raise SpecError(f"{p}: {section}.{name}: expected a mapping with tensor_names, "
                                f"tensor_sizes and {key}, got {type(m).__name__}")
            if not name or name in (".", "..") or any(c in name for c in "/\\\0"):
                raise SpecError(f"{p}: {section}: model name {name!r} is not a file name (each "
                                "model is written to NAME.json in the output directory); "
                                "rename it without path separators, e.g. "
                                f"{_file_name(name)!r}")
            names = m.get("tensor_names")
            if isinstance(names, list) and (dup := sorted(
                    {str(x) for x in names if names.count(x) > 1})):
                raise SpecError(f"{p}: {section}.{name}.tensor_names: {dup[:3]} listed more "
                                "than once; each gradient tensor has one name")
            try:
                out[name] = workload_from_gradients(
                    name,
                    list(m["tensor_names"]),
                    [int(x) for x in m["tensor_sizes"]],
                    [float(x) for x in m[key]],
                    bytes_per_element=bpe,
                    source=f"{p.name}:{section}.{name} ({gaps} gaps, V100 testbed)",
                )
            except KeyError as e:
                raise SpecError(f"{p}: model {name!r} lacks the field {e.args[0]!r}") from e
            except SpecError as e:
                raise SpecError(f"{p}: {section}.{name}: {e}") from e
            except (TypeError, ValueError) as e:
                raise SpecError(f"{p}: model {name!r}: tensor_names must be a list of names, "
                                f"tensor_sizes of integers and {key} of numbers ({e})") from e
    if not out:
        raise SpecError(f"{p}: {' and '.join(sections)} list no models; is this the Espresso "
                        "benchmark file (data/espresso_models.json)?")
    return out


def _file_name(name: str) -> str:
    """A model name made a file name, for the advice: separators dashed, dots and dashes at
    the ends dropped; ``model`` when nothing is left (``..``, ``.``, ``/``)."""
    return name.replace("/", "-").replace("\\", "-").replace("\0", "").strip(".-") or "model"
