"""Whether a model has the vocabulary pair a vocabulary-parallel LM head splits.

A language model's LM head is its last layer, a ``head`` whose forward product is
``tokens x h -> V``; the token embedding whose rows are its outputs holds ``V x h``
parameters. Under tensor parallelism with ``cost_settings.vocab_parallel == "split"`` the
runtime's ``shard_vocab`` splits exactly this pair (it finds it on the module: the last
layer is a linear beside an ``nn.Embedding`` of ``V x h``), the cost model prices exactly
it (:mod:`hetplan.cost_models.engine_memory`), and the plan's validator refuses ``split``
for a workload without it (``docs/decisions/vocab-parallel.md``).

Pure over the captured :class:`~hetplan.ir.plan_sections.LayerCost` rows; O(layers).
"""

from __future__ import annotations

from collections.abc import Sequence

from hetplan.ir.model import DTYPE_BYTES
from hetplan.ir.plan_sections import LayerCost, WorkloadSummary

__all__ = ["capture_dtype_bytes", "lm_vocab", "splits_vocabulary", "vocab_table"]


def lm_vocab(layers: Sequence[LayerCost]) -> tuple[int, int] | None:
    """(V, h) of the model's LM head (its last layer), or None when it has none."""
    head = layers[-1] if layers else None
    if head is None or head.kind != "head":
        return None
    fwd = [g for g in head.gemms if g.phase == "fwd" and not g.core]
    if not fwd:
        return None
    g = max(fwd, key=lambda g: g.n * g.k)
    return g.n, g.k


def vocab_table(lay: LayerCost, vocab: tuple[int, int], capture_bytes: int) -> bool:
    """Whether ``lay`` is the token embedding of a ``V x h`` vocabulary."""
    return lay.kind == "embedding" and lay.param_bytes == vocab[0] * vocab[1] * capture_bytes


def splits_vocabulary(layers: Sequence[LayerCost], capture_bytes: int) -> bool:
    """Whether the model has an LM head beside its ``V x h`` token embedding (the pair a
    vocabulary-parallel head splits); ``capture_bytes``: bytes per element of the floating
    dtype the model was captured in."""
    vocab = lm_vocab(layers)
    return vocab is not None and any(vocab_table(x, vocab, capture_bytes) for x in layers)


def capture_dtype_bytes(workload: WorkloadSummary) -> int:
    """Bytes per element of the floating dtype ``workload`` was captured in: its gradients'
    (the parameters') most common dtype; 4 (fp32) when it lists none."""
    counts: dict[str, int] = {}
    for g in workload.grads:
        counts[g.dtype] = counts.get(g.dtype, 0) + 1
    if not counts:
        return 4
    dtype = max(sorted(counts), key=lambda d: counts[d])
    return DTYPE_BYTES.get(dtype, 4)
