"""``hetplan profile --sparsity``: measure how sparse each embedding gradient is (Zen, ch. 3).

Decides nothing; measures, per row-sparse gradient of a model
(:func:`hetplan.ir.sparse_grads.sparse_gradients` of its capture), the statistics the zen pass
chooses a sync scheme with, and returns them as
:class:`~hetplan.cost_models.profile_db.SparsityRecord` s.

How (:func:`profile_sparsity`):

1. ``n`` workers are simulated in this process on CPU. Each runs ``K`` real forward steps of
   ``batch_size`` samples (no backward: the rows a step's gradient touches are the rows its
   forward looks up). A forward pre-hook on every sparse ``nn.Embedding`` /
   ``nn.EmbeddingBag`` records the row ids the layer receives (its ``padding_idx`` excluded:
   that row's gradient is always zero).
2. The batches are a synthetic token stream by default: every integer input tensor of the
   example inputs is replaced by i.i.d. Zipf(``alpha``) ids (``P(r) ∝ 1/(r+1)^alpha``, frequent
   ids first, as tokenizers number them) of shape ``(batch_size, *example.shape[1:])`` over
   the vocabulary of the embedding that reads it (the fewest rows among the embeddings that
   receive that tensor in a probe forward; the fewest rows of any embedding otherwise).
   Other tensors repeat the example's rows up to ``batch_size`` (dimension 0 is the batch).
   Worker ``i``'s stream is seeded by ``(seed, i)``: deterministic. With ``script`` the
   batches are the user's instead (:func:`load_batches`).
3. Per step, with ``I_i`` the rows worker ``i`` touched and ``R`` the table's rows
   (:func:`sparsity_stats`): ``d_G = mean_i |I_i| / R``, ``d_G^n = |∪_i I_i| / R``
   (Definition 3.4, ``gamma = d_G^n / d_G``) and ``s_G^n = mean_i skew(I_i)``, where
   ``skew(I)`` is the densest of ``n`` even row partitions over ``|I| / R`` (Definition 3.5,
   :func:`hetplan.algorithms.zen.skew_of`). The record holds the mean over the ``K`` steps.

The user script (``--script FILE``) is a Python file defining::

    def sparsity_batches(worker: int, workers: int, batch_size: int) -> Iterable[batch]

that yields at least ``K`` batches of worker ``worker`` (of ``workers``), each a tensor (the
model's one positional input), a tuple/list of positional inputs, or a dict of keyword inputs.

Cost: ``n x K`` forward passes plus a ``np.unique`` per lookup; the model is built on CPU.
"""

from __future__ import annotations

import importlib.util
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from hetplan.algorithms.zen import skew_of
from hetplan.cost_models.profile_db import SparsityRecord
from hetplan.errors import SpecError, TraceError
from hetplan.ir.model import ModelIR
from hetplan.ir.sparse_grads import sparse_gradients

__all__ = [
    "BATCHES_FUNCTION",
    "SparsitySpec",
    "StepStats",
    "describe_records",
    "load_batches",
    "profile_sparsity",
    "sparsity_stats",
    "zipf_probabilities",
]

#: The function a ``--script`` file must define.
BATCHES_FUNCTION = "sparsity_batches"

Batch = tuple[tuple[Any, ...], dict[str, Any]]
BatchSource = Callable[[int, int, int], Iterable[Any]]


@dataclass(frozen=True)
class SparsitySpec:
    """What ``hetplan profile --sparsity`` measures (:func:`profile_sparsity`'s options).

    Attributes:
        workers: ``n``, simulated data-parallel workers.
        batch_size: samples per worker per step.
        steps: ``K``, steps per worker.
        zipf_alpha: exponent of the synthetic token stream.
        script: a user script's batches instead of the synthetic stream.
        seed: seed of the synthetic stream.
    """

    workers: int = 2
    batch_size: int = 8
    steps: int = 4
    zipf_alpha: float = 1.0
    script: str | Path | None = None
    seed: int = 0


@dataclass(frozen=True)
class StepStats:
    """One step's statistics of one gradient (module docstring, step 3).

    Attributes:
        density: ``d_G``, mean over workers of the fraction of rows each touched.
        density_n: ``d_G^n``, the fraction touched by their union.
        skew: ``s_G^n``, mean over workers of the skew of each one's rows (1 when empty).
    """

    density: float
    density_n: float
    skew: float


def sparsity_stats(index_sets: Sequence[np.ndarray], rows: int) -> StepStats:
    """Definitions 3.4-3.5 on one step's index sets, one per worker (``n = len(index_sets)``).

    Args:
        index_sets: the row ids each worker's step looked up (repeats allowed).
        rows: the table's rows ``R``; every id must be in ``[0, R)``.

    Returns:
        ``d_G = mean_i |I_i| / R``, ``d_G^n = |∪ I_i| / R``, ``s_G^n = mean_i skew_of(I_i, R,
        n)``. Example: ``[{0, 1}, {1, 5}]`` of 8 rows gives ``d = 0.25``, ``d^n = 0.375`` and
        skews ``2`` (both rows in the first half) and ``1``, so ``s = 1.5``.
    """
    n = len(index_sets)
    if n < 1:
        raise ValueError("sparsity_stats needs at least one worker's index set")
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows!r}")
    uniq = [np.unique(np.asarray(s, dtype=np.int64).reshape(-1)) for s in index_sets]
    for u in uniq:
        if u.size and (u[0] < 0 or u[-1] >= rows):
            raise ValueError(f"row ids must be in [0, {rows}), got ids {u[0]}..{u[-1]}")
    union = np.unique(np.concatenate(uniq)) if uniq else np.empty(0, np.int64)
    density = float(np.mean([u.size for u in uniq])) / rows
    skew = float(np.mean([skew_of(u, rows, n) for u in uniq]))
    return StepStats(density, union.size / rows, skew)


def zipf_probabilities(vocab: int, alpha: float) -> np.ndarray:
    """``P(r) ∝ 1/(r+1)^alpha`` over ``[0, vocab)`` (the distribution ``zipf_stats`` assumes)."""
    p = 1.0 / np.arange(1, vocab + 1, dtype=np.float64) ** alpha
    return p / p.sum()


def load_batches(script: str | Path) -> BatchSource:
    """The ``sparsity_batches`` function of a user script (see the module docstring).

    Raises:
        SpecError: the file does not exist or defines no callable ``sparsity_batches``.
        TraceError: importing it raised.
    """
    path = Path(script)
    if not path.is_file():
        raise SpecError(f"--script {str(script)!r}: no such file; give a Python file that "
                        f"defines {BATCHES_FUNCTION}(worker, workers, batch_size)")
    spec = importlib.util.spec_from_file_location(f"_hetplan_batches_{uuid.uuid4().hex}", path)
    if spec is None or spec.loader is None:
        raise SpecError(f"--script {str(path)!r}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - the user's script raised while importing
        raise TraceError(f"--script {str(path)!r}: importing it raised {type(e).__name__}: {e}",
                         module=str(path), reason=f"{type(e).__name__}: {e}") from e
    fn = getattr(module, BATCHES_FUNCTION, None)
    if not callable(fn):
        raise SpecError(f"--script {str(path)!r} defines no function {BATCHES_FUNCTION}"
                        "(worker, workers, batch_size) yielding the model's batches")
    return fn


def _as_batch(item: Any, where: str) -> Batch:
    if isinstance(item, torch.Tensor):
        return (item,), {}
    if isinstance(item, (tuple, list)):
        return tuple(item), {}
    if isinstance(item, Mapping):
        return (), dict(item)
    raise SpecError(f"{where}: a batch must be a tensor, a tuple of inputs or a dict of "
                    f"keyword inputs, got {type(item).__name__}")


def _script_batches(fn: BatchSource, worker: int, workers: int, batch_size: int,
                    steps: int, where: str) -> list[Batch]:
    out: list[Batch] = []
    try:
        for item in fn(worker, workers, batch_size):
            out.append(_as_batch(item, where))
            if len(out) == steps:
                break
    except SpecError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's generator raised
        raise TraceError(f"{where}: {BATCHES_FUNCTION}({worker}, {workers}, {batch_size}) "
                         f"raised {type(e).__name__}: {e}", module=where,
                         reason=f"{type(e).__name__}: {e}") from e
    if len(out) < steps:
        raise SpecError(f"{where}: {BATCHES_FUNCTION} gave worker {worker} {len(out)} "
                        f"batch(es), --steps asks for {steps}; yield more or lower --steps")
    return out


def _is_ids(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and not x.is_floating_point() and not x.is_complex() \
        and x.dtype != torch.bool and x.dim() >= 1


def _rows(embedding: nn.Module) -> int:
    weight = embedding.weight
    assert isinstance(weight, torch.Tensor)  # nn.Embedding / EmbeddingBag
    return int(weight.shape[0])


def _vocabularies(net: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                  ) -> dict[int, int]:
    """Position of each integer input (args first, then kwargs in order) → its vocabulary."""
    embs = [m for m in net.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
    if not embs:
        return {}
    inputs = list(args) + list(kwargs.values())
    ptrs = {i: x.untyped_storage().data_ptr() for i, x in enumerate(inputs) if _is_ids(x)}
    seen: dict[int, int] = {}

    def hook(module: nn.Module, a: tuple[Any, ...], kw: dict[str, Any]) -> None:
        ids = a[0] if a else kw.get("input")
        if not isinstance(ids, torch.Tensor):
            return
        ptr = ids.untyped_storage().data_ptr()
        for i, p in ptrs.items():
            if p == ptr:
                rows = _rows(module)
                seen[i] = min(seen.get(i, rows), rows)

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in embs]
    try:
        with torch.no_grad():
            net(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    smallest = min(_rows(m) for m in embs)
    return {i: seen.get(i, smallest) for i in ptrs}


def _zipf_batches(args: tuple[Any, ...], kwargs: dict[str, Any], vocab: dict[int, int],
                  batch_size: int, steps: int, alpha: float, rng: np.random.Generator
                  ) -> list[Batch]:
    probs = {v: zipf_probabilities(v, alpha) for v in sorted(set(vocab.values()))}
    keys = list(kwargs)

    def make(i: int, x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            return x
        shape = (batch_size, *x.shape[1:])
        if i in vocab:
            ids = rng.choice(vocab[i], size=shape, p=probs[vocab[i]])
            return torch.from_numpy(ids.astype(np.int64)).to(x.dtype)
        return x[torch.arange(batch_size) % x.shape[0]]

    out: list[Batch] = []
    for _ in range(steps):
        made = [make(i, x) for i, x in enumerate(list(args) + list(kwargs.values()))]
        out.append((tuple(made[:len(args)]), dict(zip(keys, made[len(args):], strict=True))))
    return out


def _lookup_modules(net: nn.Module, ir: ModelIR) -> dict[str, tuple[nn.Module, int]]:
    """Sparse gradient name → (its embedding module, rows)."""
    params = dict(net.named_parameters())
    owner = {id(m.weight): m for m in net.modules()
             if isinstance(m, (nn.Embedding, nn.EmbeddingBag))}
    found: dict[str, tuple[nn.Module, int]] = {}
    for sg in sparse_gradients(ir):
        p = params.get(sg.name)
        module = owner.get(id(p)) if p is not None else None
        if module is None:
            raise TraceError(f"sparse gradient {sg.name!r} of {ir.name!r}: no nn.Embedding / "
                             "EmbeddingBag of the model owns that parameter",
                             module=sg.layer, reason="parameter not found")
        found[sg.name] = (module, sg.rows)
    return found


def _record_lookups(modules: dict[str, tuple[nn.Module, int]]
                    ) -> tuple[dict[str, list[np.ndarray]], list[Any]]:
    seen: dict[str, list[np.ndarray]] = {name: [] for name in modules}
    handles = []
    for name, (module, _rows) in modules.items():
        pad = getattr(module, "padding_idx", None)

        def hook(m: nn.Module, a: tuple[Any, ...], kw: dict[str, Any],
                 name: str = name, pad: int | None = pad) -> None:
            ids = a[0] if a else kw["input"]
            u = np.unique(ids.detach().cpu().numpy().astype(np.int64).reshape(-1))
            seen[name].append(u[u != pad] if pad is not None else u)

        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    return seen, handles


def profile_sparsity(
    net: nn.Module,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None,
    *,
    ir: ModelIR,
    workers: int = 2,
    batch_size: int = 8,
    steps: int = 4,
    zipf_alpha: float = 1.0,
    script: str | Path | None = None,
    seed: int = 0,
) -> tuple[SparsityRecord, ...]:
    """Measure every sparse gradient of ``net`` (see the module docstring).

    Args:
        net: the model (on CPU; it is put in eval mode for the forwards and restored).
        args / kwargs: one example batch (its shapes, dtypes and vocabulary shape the
            synthetic stream).
        ir: ``net``'s capture; its name is the records' ``model`` and its sparse gradients
            the ones measured.
        workers: ``n``, simulated data-parallel workers (>= 1).
        batch_size: samples per worker per step.
        steps: ``K``, steps per worker (>= 1).
        zipf_alpha: exponent of the synthetic stream (> 0); unused with ``script``.
        script: a user script's batches instead of the synthetic stream.
        seed: seed of the synthetic stream.

    Returns:
        One record per sparse gradient whose steps touched any row, sorted by gradient name.

    Raises:
        SpecError: a bad count, no sparse gradient in ``net``, or a bad script.
        TraceError: the script or the model raised.
    """
    if workers < 1 or batch_size < 1 or steps < 1:
        raise SpecError(f"--workers, --batch-size and --steps must be >= 1, got {workers}, "
                        f"{batch_size}, {steps}")
    if not zipf_alpha > 0:
        raise SpecError(f"--zipf-alpha must be > 0, got {zipf_alpha!r}")
    modules = _lookup_modules(net, ir)
    if not modules:
        raise SpecError(f"{ir.name!r} has no sparse gradient (an untied nn.Embedding / "
                        "EmbeddingBag whose ids are an input); nothing to measure")
    args, kwargs = tuple(args), dict(kwargs or {})
    data: Literal["zipf", "script"] = "script" if script is not None else "zipf"
    batches = _worker_batches(net, args, kwargs, workers, batch_size, steps, zipf_alpha,
                              script, seed)
    per_step: dict[str, list[StepStats]] = {name: [] for name in modules}
    seen, handles = _record_lookups(modules)
    was_training = net.training
    net.eval()
    try:
        with torch.no_grad():
            for k in range(steps):
                sets: dict[str, list[np.ndarray]] = {name: [] for name in modules}
                for w in range(workers):
                    for lst in seen.values():
                        lst.clear()
                    a, kw = batches[w][k]
                    net(*a, **kw)
                    for name in modules:
                        got = seen[name]
                        sets[name].append(np.unique(np.concatenate(got)) if got
                                          else np.empty(0, np.int64))
                for name, (_m, rows) in modules.items():
                    per_step[name].append(sparsity_stats(sets[name], rows))
    finally:
        net.train(was_training)
        for h in handles:
            h.remove()
    records = []
    for name in sorted(modules):
        rows = modules[name][1]
        st = per_step[name]
        d = float(np.mean([s.density for s in st]))
        if d <= 0:
            continue
        records.append(SparsityRecord(
            model=ir.name, gradient=name, workers=workers, batch_size=batch_size, rows=rows,
            density=d, density_n=max(d, float(np.mean([s.density_n for s in st]))),
            skew=max(1.0, float(np.mean([s.skew for s in st]))), steps=steps, data=data,
            zipf_alpha=zipf_alpha if data == "zipf" else None))
    return tuple(records)


def _worker_batches(net: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                    workers: int, batch_size: int, steps: int, alpha: float,
                    script: str | Path | None, seed: int) -> list[list[Batch]]:
    """``steps`` batches for each of ``workers`` workers."""
    if script is not None:
        fn = load_batches(script)
        return [_script_batches(fn, w, workers, batch_size, steps, f"--script {str(script)!r}")
                for w in range(workers)]
    vocab = _vocabularies(net, args, kwargs)
    if not vocab:
        raise SpecError("the example inputs have no integer tensor to draw Zipf token ids "
                        "for; give --script FILE with the model's batches")
    return [_zipf_batches(args, kwargs, vocab, batch_size, steps, alpha,
                          np.random.default_rng([seed, w])) for w in range(workers)]


def describe_records(records: Iterable[SparsityRecord]) -> Iterator[str]:
    """One line per record, for the CLI: ``gradient: d, d^n, skew (n workers, batch)``."""
    for r in records:
        yield (f"{r.gradient}: d={r.density:.5f}, d^n={r.density_n:.5f} "
               f"(gamma {r.density_n / r.density:.2f}), skew={r.skew:.2f} on {r.workers} "
               f"worker(s) x batch {r.batch_size}, {r.steps} step(s) of {r.data} data")
