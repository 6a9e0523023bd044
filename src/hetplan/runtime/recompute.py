"""Activation recomputation of a stage's transformer blocks, as ``Stage.recompute`` says.

- ``full``: every block (an IR layer of kind ``block``) runs its forward under
  ``torch.utils.checkpoint`` (non-reentrant): autograd keeps the block's input only, and the
  backward runs the block's forward again.
- ``selective``: only the attention core inside each block is recomputed (Korthikanti et al.
  2022): a submodule whose class is one the capture counts as a core
  (:data:`~hetplan.ir.capture.execute.ATTENTION_CORE_TYPES`: Megatron's ``CoreAttention``,
  ``DotProductAttention``), and every ``scaled_dot_product_attention`` call the block makes
  (a function mode routes it through the checkpoint). These are exactly the regions whose
  saved bytes the capture records as ``act_attn_core_bytes``, so the memory the plan predicts
  for ``selective`` is the memory this saves.
- ``none``: nothing changes.

The checkpoint preserves the RNG state, so dropout inside a recomputed region draws the same
mask again: the gradients equal those without recomputation. Wrapping sets the module's
``forward`` as an instance attribute; :func:`unwrap` restores it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from hetplan.errors import SpecError
from hetplan.ir.capture.execute import ATTENTION_CORE_TYPES
from hetplan.ir.model import LayerIR, LayerKind

__all__ = ["apply_recompute", "unwrap"]


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


#: ``scaled_dot_product_attention`` as a traced pipeline stage calls it (an aten operator)
_SDPA_OPS = (torch.ops.aten.scaled_dot_product_attention.default,)


class _CheckpointSDPA(TorchFunctionMode):
    """Routes ``scaled_dot_product_attention`` calls through a non-reentrant checkpoint."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention or func in _SDPA_OPS:
            return checkpoint(func, *args, use_reentrant=False, **kwargs)
        return func(*args, **kwargs)


def _sdpa_checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        with _CheckpointSDPA():
            return forward(*args, **kwargs)

    return run


def _wrap(module: nn.Module, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    if "forward" in module.__dict__:
        raise SpecError(f"module {type(module).__name__} already has its forward replaced "
                        "(recomputation applied twice?)")
    module.forward = make(module.forward)


def apply_recompute(root: nn.Module, layers: Sequence[LayerIR], mode: str,
                    types_from: nn.Module | None = None) -> list[nn.Module]:
    """Apply recomputation ``mode`` to the blocks among ``layers`` (their ``name`` is their
    qualified name in ``root``); returns the modules whose forward was wrapped.

    ``types_from``: the model whose modules of the same names say which submodules are
    attention cores (default ``root``). A traced pipeline stage keeps the model's module
    names but not its classes: there ``root`` is the stage and ``types_from`` the model.

    Raises:
        SpecError: an unknown mode, or a block the IR names that ``root`` does not have.
    """
    if mode not in ("none", "selective", "full"):
        raise SpecError(f"unknown recompute mode {mode!r} in the plan's stages; expected "
                        "none, selective or full")
    if mode == "none":
        return []
    wrapped: list[nn.Module] = []
    for lay in layers:
        if lay.kind != LayerKind.BLOCK:
            continue
        try:
            block = root.get_submodule(lay.name)
            typed = (types_from if types_from is not None else root).get_submodule(lay.name)
        except AttributeError as e:
            raise SpecError(f"the plan recomputes block {lay.name!r}, which the model does not "
                            "have; re-run `hetplan plan` for this model") from e
        if mode == "full":
            _wrap(block, _checkpointed)
            wrapped.append(block)
            continue
        for rel, sub in typed.named_modules():
            if type(sub).__name__ in ATTENTION_CORE_TYPES:
                core = block.get_submodule(rel)
                _wrap(core, _checkpointed)
                wrapped.append(core)
        _wrap(block, _sdpa_checkpointed)
        wrapped.append(block)
    return wrapped


def unwrap(modules: Sequence[nn.Module]) -> None:
    """Restore the forwards :func:`apply_recompute` replaced."""
    for m in modules:
        m.__dict__.pop("forward", None)
