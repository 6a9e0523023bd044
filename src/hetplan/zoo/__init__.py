"""The built-in model zoo: named models with configs written in code and example inputs.

Every Hugging Face model is built from a config object typed in here (published sizes for the
full-size entries, tiny sizes for fast tests), never downloaded. Models are built on the
``meta`` device by default, so even ``llama-70b`` costs no memory::

    model = hetplan.zoo.build("llama-70b")                  # meta tensors only
    args, kwargs = hetplan.zoo.example_inputs("llama-70b")  # meta input_ids [1, 4096]
    ep = torch.export.export(model, args, kwargs=kwargs, strict=False)

``transformers`` is imported lazily inside the build functions; importing this module is cheap.

Input conventions (``example_inputs``):

- causal / masked LMs (``input_kind="tokens"``): ``args=(input_ids,)`` with ``input_ids`` of
  dtype ``long`` and shape [batch, seq]; ``kwargs={"use_cache": False}`` for models that accept
  it (decoders), ``{}`` otherwise (BERT, RoBERTa, the custom models).
- encoder-decoder (``"seq2seq"``, T5): ``args=(input_ids,)``,
  ``kwargs={"decoder_input_ids": ..., "use_cache": False}``, both [batch, seq].
- vision (``"image"``): ``args=(pixel_values,)`` float [batch, 3, H, W]; ``seq`` is ignored.
- ``"features"`` (MLP, DataDependentNet): ``args=(x,)`` float [batch, in_features].
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from hetplan.errors import SpecError
from hetplan.ir.validation import did_you_mean
from hetplan.zoo.builders import ExampleInputs, ZooEntry
from hetplan.zoo.entries import ZOO

__all__ = [
    "ZOO",
    "ExampleInputs",
    "ZooEntry",
    "build",
    "example_inputs",
    "get",
    "seq_too_long",
    "list_models",
]


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def list_models(*, family: str | None = None, size: str | None = None) -> list[ZooEntry]:
    """Lists zoo entries sorted by name.

    Args:
        family: keep only this family (e.g. ``"llama"``, ``"custom"``).
        size: keep only ``"full"`` or ``"tiny"`` entries.

    Returns:
        The matching entries, sorted by name.
    """
    return [
        e
        for _, e in sorted(ZOO.items())
        if (family is None or e.family == family) and (size is None or e.size == size)
    ]


def get(name: str) -> ZooEntry:
    """Looks up a zoo entry by name (case-insensitive; ``_`` and ``-`` are interchangeable).

    Args:
        name: the zoo name, e.g. ``"gpt2"``.

    Returns:
        The entry.

    Raises:
        SpecError: no entry has that name; the message suggests the closest names.
    """
    key = name.strip().lower().replace("_", "-")
    entry = ZOO.get(key)
    if entry is not None:
        return entry
    own = ""
    if any(c in name for c in "/\\:") or name.endswith((".py", ".json")):
        # a path or a module: the user meant a model of their own, which is no zoo name
        own = ("; a model of your own is given as a factory (CLI: --module pkg.mod:factory, a "
               "function returning (model, example inputs)) or as a workload file (--workload "
               "FILE, from `hetplan ir`)")
    raise SpecError(
        f"unknown model {name!r} in the hetplan zoo{did_you_mean(key, ZOO, n=3)}{own} "
        f"(expected one of: {', '.join(sorted(ZOO))}; see `hetplan models` or "
        "hetplan.zoo.list_models())"
    )


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype | None) -> Iterator[None]:
    if dtype is None or not dtype.is_floating_point:
        yield
        return
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build(
    name: str,
    *,
    device: torch.device | str = "meta",
    dtype: torch.dtype | None = None,
    seed: int | None = None,
) -> nn.Module:
    """Builds a zoo model.

    The model is constructed under ``with torch.device(device):`` so that on ``meta`` (the
    default) no parameter memory is allocated, whatever the model's size. The model is left in
    training mode.

    Args:
        name: the zoo name (see :func:`list_models`).
        device: where parameters are created; ``"meta"`` allocates nothing.
        dtype: floating dtype of parameters and buffers (``None``: torch's default, float32).
        seed: if given, initialize weights deterministically from this seed (the global RNG
            state is restored afterwards), so separate processes build identical models.

    Returns:
        The model.

    Raises:
        SpecError: ``name`` is not in the zoo, or ``dtype`` is not a floating dtype.
    """
    entry = get(name)
    if dtype is not None and not dtype.is_floating_point:
        raise SpecError(
            f"build({name!r}): dtype {dtype} is not a floating dtype; "
            "pass e.g. torch.float32, torch.bfloat16 or torch.float16"
        )
    rng = torch.random.fork_rng(devices=[]) if seed is not None else contextlib.nullcontext()
    with rng, _default_dtype(dtype), torch.device(device):
        if seed is not None:
            torch.manual_seed(seed)
        model = entry.build()
    if dtype is not None:
        model = model.to(dtype=dtype)
    return model


def seq_too_long(name: str, seq: int | None) -> str | None:
    """Why zoo model ``name`` cannot take sequences of ``seq`` tokens (longer than its
    learned position embeddings, ``ZooEntry.max_seq``: capture on ``meta`` would not notice
    the indices past them), or None when it can."""
    entry = get(name)
    if entry.max_seq is None or seq is None or seq <= entry.max_seq:
        return None
    return (f"{entry.name} has {entry.max_seq} positions (its position embeddings), so it "
            f"takes sequences of at most {entry.max_seq} tokens")


def example_inputs(
    name: str,
    batch: int | None = None,
    seq: int | None = None,
    *,
    device: torch.device | str = "meta",
    dtype: torch.dtype | None = None,
) -> ExampleInputs:
    """Makes example inputs for a zoo model: call it as ``model(*args, **kwargs)``.

    Token ids are random (fixed seed) in the model's vocabulary on real devices and
    uninitialized meta tensors on ``meta``. See the module docstring for each input kind.

    Args:
        name: the zoo name.
        batch: batch size (default: the entry's ``default_batch``).
        seq: sequence length (default: the entry's ``default_seq``); ignored by vision and
            feature models.
        device: device of the input tensors (``"meta"`` by default).
        dtype: dtype of floating inputs (pixel values, features); token ids stay ``long``.

    Returns:
        ``(args, kwargs)``.

    Raises:
        SpecError: unknown name, a non-positive batch or sequence length, or a sequence
            longer than the entry's ``max_seq`` (capture on ``meta`` would not notice it).
    """
    entry = get(name)
    b = entry.default_batch if batch is None else batch
    s = entry.default_seq if seq is None else seq
    if b < 1:
        raise SpecError(f"example_inputs({name!r}): batch must be >= 1, got {b}")
    if entry.default_seq is not None and (s is None or s < 1):
        raise SpecError(f"example_inputs({name!r}): seq must be >= 1, got {s}")
    if (why := seq_too_long(name, s)) is not None:
        raise SpecError(f"example_inputs({name!r}): seq {s}: {why}; give a seq of at most "
                        f"{entry.max_seq}")
    return entry.example_inputs(b, s, device=device, dtype=dtype)
