"""Which gradients of a captured model are row-sparse (Zen's input, thesis ch. 3).

A gradient is sparse when its parameter is the weight of an ``nn.Embedding`` or
``nn.EmbeddingBag`` layer and nothing else uses that weight: an iteration touches only the
rows its tokens look up. A weight tied to another layer (the LM head of GPT-2) is not: the
head's gradient is dense over every row, so the sum is dense. Embeddings inside a larger
layer (a block that owns other parameters) are not detected; they stay on the dense path.

``lookups_per_sample`` is read from the capture: the layer's input is its index tensor
(int64, 8 bytes per id), ``act_in_bytes / 8`` ids per captured micro-batch. An embedding whose
ids the capture does not see as an input activation (``act_in_bytes == 0``: ids made inside
``forward``, such as GPT-2's position ids from ``arange``) is left dense: such ids are
typically every position of the sequence, so every iteration touches the same rows, and there
is no count to estimate a density from.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetplan.ir.model import ModelIR

__all__ = ["SPARSE_MODULES", "SparseGrad", "sparse_gradients"]

#: The module classes whose weight gradient is row-sparse.
SPARSE_MODULES = ("Embedding", "EmbeddingBag")


@dataclass(frozen=True, slots=True)
class SparseGrad:
    """A row-sparse gradient.

    Attributes:
        name: the gradient's (parameter's) name.
        layer: the embedding layer's name.
        rows / row_elems: the table's shape.
        lookups_per_sample: ids the layer looks up per sample of the captured batch.
    """

    name: str
    layer: str
    rows: int
    row_elems: int
    lookups_per_sample: float


def sparse_gradients(ir: ModelIR) -> tuple[SparseGrad, ...]:
    """The row-sparse gradients of ``ir``, in backward-ready order (see module docstring)."""
    tied = {p.tied_to for layer in ir.layers for p in layer.params if p.tied_to}
    grads = {g.name for g in ir.grad_tensors}
    found: dict[str, SparseGrad] = {}
    for layer in ir.layers:
        if layer.module_type not in SPARSE_MODULES or len(layer.params) != 1:
            continue
        p = layer.params[0]
        if (len(p.shape) != 2 or p.tied_to or p.name in tied or not p.requires_grad
                or p.name not in grads):
            continue
        ids = layer.act_in_bytes / 8
        if ids <= 0:  # ids generated inside forward (positions): dense, see module docstring
            continue
        found[p.name] = SparseGrad(p.name, layer.name, p.shape[0], p.shape[1],
                                   ids / max(ir.batch_size, 1))
    return tuple(found[g.name] for g in ir.grad_tensors if g.name in found)
