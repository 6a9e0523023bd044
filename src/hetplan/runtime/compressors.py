"""Gradient compressors: the one implementation the runtime executes and ``hetplan profile`` times.

Every compressor works on a flat (1-D) floating-point tensor on the CPU or a CUDA device and
returns a :data:`Payload`: a tuple of tensors on the same device. ``decompress(payload,
numel)`` gives back a dense fp32 tensor of ``numel`` elements. Empty tensors are allowed (the
payload is then empty too). Sizes on the wire are :func:`payload_bytes` of the payload.

The compressors and what they guarantee (``x`` the input, ``x̂ = decompress(compress(x))``,
``n = numel``, ``e = x - x̂``):

* ``fp16`` / ``bf16`` (:class:`Cast`): round to nearest; ``|e_i| <= 2^-11 |x_i|`` (fp16, for
  ``|x_i|`` in fp16's normal range 6.1e-5 .. 65504; larger values overflow to inf, smaller
  ones lose relative precision: absolute error ``<= 2^-25``) and ``|e_i| <= 2^-8 |x_i|``
  (bf16, whole fp32 range). Wire: 2 bytes per element.
* ``topk`` (:class:`TopK`): the ``k = max(1, int(n * ratio))`` largest magnitudes (fp32 value
  + int32 index each); ``||e||² <= (1 - k/n) ||x||²``, and ``e`` is exactly the rest.
* ``randomk`` (:class:`RandomK`): ``k`` distinct positions drawn uniformly from a seeded
  generator (the same seed gives the same positions on every rank and device); unscaled, so
  ``E||e||² = (1 - k/n) ||x||²`` and ``e`` is exactly the elements not drawn.
* ``dgc`` (:class:`DGC`): the threshold is the k_s-th largest magnitude of a seeded random
  sample of ``max(1, n // 100)`` elements (k_s = the same ``ratio`` of the sample); every
  element at or above it is kept, at most ``2k`` (then the ``2k`` largest). The kept set is
  therefore the top-k' elements for some ``1 <= k' <= 2k``: ``||e||² <= (1 - k'/n) ||x||²``.
  DGC's momentum correction and gradient clipping belong to the optimizer and are not done
  here; error feedback (below) is DGC's residual accumulation.
* ``efsignsgd`` (:class:`EFSignSGD`): ``x̂ = (||x||₁ / n) sign(x)`` (sign(0) = +1), one bit per
  element plus one fp32 scale. Exactly ``||e||² = ||x||² - ||x||₁² / n``.
* ``onebit`` (:class:`OneBit`, 1-bit SGD): elements ``>= 0`` become the mean of those
  elements, the others the mean of the negative ones; one bit per element plus two fp32
  scales. ``x̂`` is the orthogonal projection of ``x`` onto the two-level vectors of its sign
  pattern, so ``<e, x̂> = 0`` and ``||e||² = ||x||² - ||x̂||² <= ||x||² - ||x||₁² / n``.
* ``qsgd`` (:class:`QSGD`, ``levels = s <= 127``): ``x̂_i = ||x|| sign(x_i) l_i / s`` with
  ``l_i`` the stochastic rounding of ``s |x_i| / ||x||`` (seeded); unbiased, ``E x̂ = x``, with
  ``|e_i| < ||x|| / s`` always and ``E||e||² <= min(n / s², sqrt(n) / s) ||x||²`` (Alistarh et
  al., Lemma 3.1). Wire: one int8 per element plus one fp32 norm.
* ``powersgd`` (:class:`PowerSGD`, ``rank = r``): the buffer is viewed as a ``rows × cols``
  matrix M (``rows`` the largest divisor of ``n`` not above ``sqrt(n)``); one power iteration
  from a seeded Gaussian ``Q``: ``P = orth(M Q)``, ``Q' = Mᵀ P``, ``x̂ = P Q'ᵀ``, the
  orthogonal projection of M's columns onto span(P). So ``<e, x̂> = 0``,
  ``||e||² = ||M||² - ||Pᵀ M||² <= ||x||²``, and ``e = 0`` when rank(M) <= r. When
  ``r (rows + cols) >= n`` (small or prime-sized buffers) the raw tensor is sent instead.
  The cost model's ratio uses the tensor's own first dimension; a fused buffer has no shape,
  so the runtime uses this square-ish view (decision in ``docs/decisions.md``).

**Error feedback** (:class:`ErrorFeedback`): a residual memory keyed by compression site. Before
compressing, the site's residual is added (``c = x + r``); afterwards ``r = c - x̂(c)``. For a
contraction (topk, dgc, efsignsgd, onebit, powersgd) this keeps the total of what was sent
equal to the total of the inputs minus the last residual (Karimireddy et al. 2019).

Seeds: randomized compressors take ``seed``; the runtime derives it from (site, iteration) so
runs are reproducible and ranks draw independently but deterministically.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from hetplan.errors import SpecError
from hetplan.ir.compressors import (
    COMPRESSORS,
    DEFAULT_POWERSGD_RANK,
    DEFAULT_QSGD_LEVELS,
    DEFAULT_SPARSITY_RATIO,
)
from hetplan.ir.validation import did_you_mean

__all__ = [
    "DGC",
    "QSGD",
    "Cast",
    "Compressor",
    "EFSignSGD",
    "ErrorFeedback",
    "OneBit",
    "Payload",
    "PowerSGD",
    "RandomK",
    "TopK",
    "make_compressor",
    "payload_bytes",
]

#: What a compressor sends: tensors on the input's device.
Payload = tuple[torch.Tensor, ...]

_BIT_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def payload_bytes(payload: Payload) -> int:
    """Bytes the payload's tensors occupy on the wire."""
    return sum(t.numel() * t.element_size() for t in payload)


def _bits(device: torch.device) -> torch.Tensor:
    w = _BIT_WEIGHTS.get(device)
    if w is None:
        w = _BIT_WEIGHTS[device] = 2 ** torch.arange(8, dtype=torch.uint8, device=device)
    return w


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Booleans → uint8, 8 per byte, little-endian within a byte (zero-padded)."""
    pad = (-mask.numel()) % 8
    m = torch.nn.functional.pad(mask.reshape(-1).to(torch.uint8), (0, pad)).view(-1, 8)
    return (m * _bits(mask.device)).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` booleans packed by :func:`pack_bits`."""
    return packed.unsqueeze(1).bitwise_and(_bits(packed.device)).ne(0).view(-1)[:n]


def _generator(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)


def _flat32(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 1:
        raise ValueError(f"compressors take flat (1-D) tensors, got shape {tuple(x.shape)}")
    return x.to(torch.float32)


class Compressor(ABC):
    """A gradient compressor; see the module docstring for each one's error bound."""

    name: ClassVar[str]
    #: True when decompress(compress(x)) == x up to rounding (the casts).
    lossless: ClassVar[bool] = False

    @abstractmethod
    def _encode(self, x: torch.Tensor, seed: int) -> Payload: ...

    @abstractmethod
    def _decode(self, payload: Payload, numel: int) -> torch.Tensor: ...

    def compress(self, x: torch.Tensor, seed: int = 0) -> Payload:
        """Compress a flat tensor; ``seed`` drives the randomized compressors."""
        x = _flat32(x)
        return () if x.numel() == 0 else self._encode(x, seed)

    def decompress(self, payload: Payload, numel: int) -> torch.Tensor:
        """The dense fp32 tensor of ``numel`` elements a payload stands for."""
        if numel == 0:
            dev = payload[0].device if payload else torch.device("cpu")
            return torch.zeros(0, dtype=torch.float32, device=dev)
        return self._decode(payload, numel)

    def roundtrip(self, x: torch.Tensor, seed: int = 0) -> torch.Tensor:
        """``decompress(compress(x))``."""
        return self.decompress(self.compress(x, seed), x.numel())


@dataclass(frozen=True)
class Cast(Compressor):
    """fp16 or bf16 on the wire (round to nearest)."""

    dtype: str = "fp16"
    lossless: ClassVar[bool] = True

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.dtype

    def _encode(self, x: torch.Tensor, seed: int) -> Payload:
        return (x.to(torch.float16 if self.dtype == "fp16" else torch.bfloat16),)

    def _decode(self, payload: Payload, numel: int) -> torch.Tensor:
        return payload[0].to(torch.float32)


def _k(numel: int, ratio: float) -> int:
    return min(numel, max(1, int(numel * ratio)))


class _Sparsifier(Compressor):
    """Payload: (fp32 values, int32 indices); decode scatters into zeros."""

    def _decode(self, payload: Payload, numel: int) -> torch.Tensor:
        vals, idx = payload
        out = torch.zeros(numel, dtype=torch.float32, device=vals.device)
        return out.index_put_((idx.long(),), vals.to(torch.float32), accumulate=True)


@dataclass(frozen=True)
class TopK(_Sparsifier):
    """The ``ratio`` fraction of largest-magnitude elements."""

    ratio: float = DEFAULT_SPARSITY_RATIO
    name: ClassVar[str] = "topk"

    def _encode(self, x: torch.Tensor, seed: int) -> Payload:
        idx = torch.topk(x.abs(), _k(x.numel(), self.ratio), sorted=False).indices
        return x[idx], idx.to(torch.int32)


@dataclass(frozen=True)
class RandomK(_Sparsifier):
    """``ratio`` of the elements at seeded uniformly random distinct positions (unscaled)."""

    ratio: float = DEFAULT_SPARSITY_RATIO
    name: ClassVar[str] = "randomk"

    def _encode(self, x: torch.Tensor, seed: int) -> Payload:
        n = x.numel()
        gen = _generator(seed, torch.device("cpu"))
        idx = torch.randperm(n, generator=gen)[: _k(n, self.ratio)].to(x.device)
        return x[idx], idx.to(torch.int32)


@dataclass(frozen=True)
class DGC(_Sparsifier):
    """Deep Gradient Compression's selection: a threshold estimated on a 1 % sample."""

    ratio: float = DEFAULT_SPARSITY_RATIO
    sample_fraction: float = 0.01
    name: ClassVar[str] = "dgc"

    def _encode(self, x: torch.Tensor, seed: int) -> Payload:
        n, a = x.numel(), x.abs()
        k = _k(n, self.ratio)
        m = max(1, int(n * self.sample_fraction))
        gen = _generator(seed, torch.device("cpu"))
        picks = torch.randint(0, n, (m,), generator=gen).to(x.device)
        thr = torch.topk(a[picks], _k(m, self.ratio), sorted=False).values.min()
        idx = torch.nonzero(a >= thr).view(-1)
        if idx.numel() > 2 * k:
            idx = torch.topk(a, min(n, 2 * k), sorted=False).indices
        return x[idx], idx.to(torch.int32)


@dataclass(frozen=True)
class EFSignSGD(Compressor):
    """Signs (1 bit each) scaled by the mean magnitude."""

    name: ClassVar[str] = "efsignsgd"

    def _encode(self, x: torch.Tensor, seed: int) -> Payload:
        return x.abs().mean().reshape(1), pack_bits(x >= 0)

    def _decode(self, payload: Payload, numel: int) -> torch.Tensor:
        scale, bits = payload
        s = scale.to(torch.float32)
        return torch.where(unpack_bits(bits, numel), s, -s)


@dataclass(frozen=True)
class OneBit(Compressor):
    """1-bit SGD: one bit per element, reconstructed as the mean of its sign class."""

    name: ClassVar[str] = "onebit"

    def _encode(self, x: torch.Tensor, seed: int) -> Payload:
        pos = x >= 0
        n_pos = pos.sum()
        s_pos = torch.where(pos, x, 0.0).sum() / n_pos.clamp(min=1)
        s_neg = torch.where(pos, 0.0, x).sum() / (x.numel() - n_pos).clamp(min=1)
        return torch.stack([s_pos, s_neg]), pack_bits(pos)

    def _decode(self, payload: Payload, numel: int) -> torch.Tensor:
        means, bits = payload
        return torch.where(unpack_bits(bits, numel), means[0], means[1]).to(torch.float32)


@dataclass(frozen=True)
class QSGD(Compressor):
    """QSGD: unbiased stochastic rounding to ``levels`` levels of the norm, int8 on the wire."""

    levels: int = DEFAULT_QSGD_LEVELS
    name: ClassVar[str] = "qsgd"

    def __post_init__(self) -> None:
        if not 1 <= self.levels <= 127:
            raise SpecError(f"qsgd levels must be in 1..127 (int8 on the wire), got {self.levels}")

    def _encode(self, x: torch.Tensor, seed: int) -> Payload:
        norm = x.norm()
        scaled = x.abs() / norm.clamp(min=1e-30) * self.levels
        gen = _generator(seed, x.device)
        noise = torch.rand(x.shape, generator=gen, device=x.device)
        level = (scaled + noise).floor_().clamp_(max=self.levels)
        return norm.reshape(1), (level * torch.where(x >= 0, 1.0, -1.0)).to(torch.int8)

    def _decode(self, payload: Payload, numel: int) -> torch.Tensor:
        norm, q = payload
        return q.to(torch.float32) * (norm.to(torch.float32) / self.levels)


def matrix_view(numel: int) -> tuple[int, int]:
    """(rows, cols) of PowerSGD's view: rows the largest divisor of numel <= sqrt(numel)."""
    rows = max(1, math.isqrt(numel))
    while numel % rows:
        rows -= 1
    return rows, numel // rows


@dataclass(frozen=True)
class PowerSGD(Compressor):
    """Rank-``rank`` PowerSGD (one power iteration, seeded start), raw when it does not pay."""

    rank: int = DEFAULT_POWERSGD_RANK
    name: ClassVar[str] = "powersgd"

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise SpecError(f"powersgd rank must be >= 1, got {self.rank}")

    def _raw(self, numel: int) -> bool:
        rows, cols = matrix_view(numel)
        return self.rank * (rows + cols) >= numel

    def _encode(self, x: torch.Tensor, seed: int) -> Payload:
        if self._raw(x.numel()):
            return (x.clone(),)
        rows, cols = matrix_view(x.numel())
        m = x.view(rows, cols)
        gen = _generator(seed, x.device)
        q = torch.randn(cols, self.rank, generator=gen, device=x.device)
        p = torch.linalg.qr(m @ q).Q
        return p, m.t() @ p

    def _decode(self, payload: Payload, numel: int) -> torch.Tensor:
        if len(payload) == 1:
            return payload[0].to(torch.float32)
        p, q = payload
        return (p @ q.t()).reshape(-1)


def make_compressor(name: str, params: Mapping[str, object] | None = None) -> Compressor:
    """The compressor called ``name`` with plan parameters (``ratio``, ``levels``, ``rank``).

    Raises:
        SpecError: unknown name, or a parameter it does not take.
    """
    params = dict(params or {})
    cls: type[Compressor]
    allowed: tuple[str, ...]
    classes: dict[str, tuple[type[Compressor], tuple[str, ...]]] = {
        "topk": (TopK, ("ratio",)), "randomk": (RandomK, ("ratio",)),
        "dgc": (DGC, ("ratio", "sample_fraction")), "efsignsgd": (EFSignSGD, ()),
        "onebit": (OneBit, ()), "qsgd": (QSGD, ("levels",)), "powersgd": (PowerSGD, ("rank",)),
    }
    if name in ("fp16", "bf16"):
        cls, allowed, params = Cast, ("dtype",), {"dtype": name, **params}
    elif name in classes:
        cls, allowed = classes[name]
    else:
        raise SpecError(f"unknown compressor {name!r}{did_you_mean(name, COMPRESSORS)} "
                        f"(known: {', '.join(COMPRESSORS)})")
    if bad := sorted(set(params) - set(allowed)):
        raise SpecError(f"compressor {name!r} takes parameters {list(allowed)}, got {bad}")
    if "ratio" in params and not 0 < float(params["ratio"]) <= 1:  # type: ignore[arg-type]
        raise SpecError(f"compressor {name!r}: ratio must be in (0, 1], got {params['ratio']}")
    return cls(**params)


@dataclass
class ErrorFeedback:
    """Residual memory per compression site (a bucket × a place along its path).

    ``compress`` adds the site's residual, compresses, and keeps what compression dropped.
    A site whose size or device changed starts from zero (e.g. a re-planned bucket).
    """

    residuals: dict[Hashable, torch.Tensor] = field(default_factory=dict)

    def compress(self, comp: Compressor, key: Hashable, x: torch.Tensor,
                 seed: int = 0) -> Payload:
        """Compress ``x`` plus the residual of ``key``; store the new residual."""
        r = self.residuals.get(key)
        c = _flat32(x)
        if r is not None and r.shape == c.shape and r.device == c.device:
            c = c + r
        payload = comp.compress(c, seed)
        self.residuals[key] = c - comp.decompress(payload, c.numel())
        return payload

    def clear(self) -> None:
        """Forget every residual."""
        self.residuals.clear()
