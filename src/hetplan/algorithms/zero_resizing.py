"""ZERO-resizing and SEMI-migration decisions: the paper's closed-form rules, pure (no torch).

Source: Wang et al., *Accelerating Heterogeneous Tensor Parallelism via Flexible Workload
Control* (digest ``research/zero_resizing.md``). A straggler of a tensor-parallel group either
prunes a fraction γ of the contraction columns of its linears (ZERO-resizing), sends part of
them to the other ranks (lightweight migration), or both (SEMI). This module holds the rules
that decide *how much* and *who*; :mod:`hetplan.runtime.resizing` executes them.

Decisions on what the paper leaves open (§7 of the digest; also in ``docs/decisions.md``):

* **Eq. (1) feedback loop (§7.1).** Times measured while a rank prunes or migrates are
  smaller than its un-balanced time, so Eq. (1) fed with them would shrink γ and oscillate.
  Every rank therefore reports its *un-balanced* estimate (:func:`unbalanced_times`):
  ``M_raw = M / (1 − r)`` with ``r`` the fraction of its own columns it skipped, and
  ``T_raw = T − R + r · M_raw`` with ``R`` the time it spent computing other ranks' migrated
  columns. Eq. (1) and Eqs. (2)–(3) use the raw times of every rank, so a steady straggler
  gets a steady γ (a fixed point, not an oscillation).
* **Clamp (§7.2).** γ ∈ [0, γ_max] for resizing; a migrated fraction ∈ [0, 1].
* **Straggler criterion (§7.25).** ZERO: ``T_raw > T_avg``; SEMI: ``T_raw > T_min · (1 + eps)``
  (the relative tolerance ``eps`` keeps measurement noise from making everyone a straggler).
* **PriDiff (§2.6, §7.7, §7.8).** ``γ_k = min(γ_max, max(|{δ < θ}| / L_k, α · γ))``; θ is
  compared with the column's *accumulated* per-iteration change over the statistics period
  (θ = n_iter · θ_iter only makes sense for a path length, §7.7). The per-layer ratios are then
  raised by a common amount until their cost-weighted mean reaches γ
  (:func:`renormalise_ratios`, §7.8): with the floor α · γ alone the rank would save only
  ~α of what Eq. (1) asked, and never reach its target.
* **Pruned set (§7.5).** The ``n`` columns with the smallest statistic, ties by lower index,
  returned sorted ascending (the lineage); the kept set is its sorted complement.
* **Rounding (§7.6).** Column counts round half-up (``floor(x + 0.5)``), clamped to [0, L].
* **Receivers (§3.2, §7.23).** The paper's virtual renumbering ``r' = (r + e − s) % e``
  orders the receivers; ``m = n // len(receivers)`` columns each and the remainder goes one
  extra column to the first receivers. With several migrating stragglers the receivers of
  each are the ranks that do not migrate (for one straggler: every other rank, the paper).
* **Alg. 2 (§7.18–7.22).** Every rank computes the same decision from the gathered times.
  One straggler: Eq. (2) splits ``G = L · γ`` into migrated ``β · G`` and resized
  ``(1 − β) · G``. Several: x = the largest k with f(1..k) > 0 (x = z when f never turns
  non-positive, x = 0: nobody migrates); the top x migrate their Eq. (1) fraction (T_min),
  the others resize theirs. Γ(x) uses the paper's literal ``L_k (T_k − T_min) / T_k``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from hetplan.errors import SpecError

__all__ = [
    "CostCoefficients",
    "RankDecision",
    "choose_migrators",
    "eq1_gamma",
    "eq2_beta",
    "eq3_f",
    "gamma_workload",
    "n_columns",
    "plan_roles",
    "pridiff_ratio",
    "receiver_ranges",
    "renormalise_ratios",
    "select_pruned",
    "semi_decision",
    "unbalanced_times",
    "update_wvar",
    "virtual_rank",
    "zero_decision",
]

Role = Literal["normal", "resize", "migrate_src"]


def _check_same_len(**seqs: Sequence[float]) -> int:
    lens = {k: len(v) for k, v in seqs.items()}
    if len(set(lens.values())) != 1 or not next(iter(lens.values())):
        raise SpecError(f"per-rank lists must be non-empty and of one length, got {lens}")
    return next(iter(lens.values()))


def unbalanced_times(t: float, m: float, skipped: float, received: float = 0.0
                     ) -> tuple[float, float]:
    """A rank's estimated iteration and matmul time had it computed all its own columns.

    Args:
        t: measured busy time of the iteration (seconds, without waits in collectives).
        m: measured time of its own prunable matmuls (seconds).
        skipped: fraction of its own contraction columns it pruned or migrated, in [0, 1).
        received: time it spent computing columns migrated to it by other ranks.

    Returns:
        ``(T_raw, M_raw)`` with ``M_raw = m / (1 − skipped)``, ``T_raw = t − received +
        skipped · M_raw`` (the feedback-loop fix of §7.1).
    """
    if not 0.0 <= skipped < 1.0:
        raise SpecError(f"skipped fraction must be in [0, 1), got {skipped}")
    m_raw = m / (1.0 - skipped)
    return max(t - received, 0.0) + skipped * m_raw, m_raw


def eq1_gamma(t_raw: float, t_ref: float, m_raw: float, cap: float) -> float:
    """Eq. (1): ``γ = (T − T_ref) / M`` clamped to ``[0, cap]`` (0 when ``M`` is 0)."""
    if m_raw <= 0.0:
        return 0.0
    return min(max((t_raw - t_ref) / m_raw, 0.0), cap)


def n_columns(ratio: float, total: int) -> int:
    """``ratio · total`` rounded half-up and clamped to ``[0, total]``."""
    return min(max(math.floor(ratio * total + 0.5), 0), total)


def pridiff_ratio(w_var: Sequence[float], theta: float, gamma: float, alpha: float,
                  gamma_max: float) -> float:
    """PriDiff's per-layer ratio: ``min(γ_max, max(#{δ < θ} / L, α · γ))``; 0 when γ is 0.

    Args:
        w_var: the layer's per-column statistic δ (indexed by column).
        theta: the candidate threshold θ.
        gamma: the rank's uniform Eq. (1) ratio.
        alpha: the floor factor (paper: 0.8).
        gamma_max: the cap (not in the paper, §7.7).
    """
    if gamma <= 0.0 or not w_var:
        return 0.0
    cand = sum(1 for d in w_var if d < theta) / len(w_var)
    return min(gamma_max, max(cand, alpha * gamma))


def renormalise_ratios(ratios: Sequence[float], weights: Sequence[float], gamma: float,
                       cap: float) -> list[float]:
    """Raise per-layer ratios until their weighted mean reaches ``gamma`` (§7.8).

    PriDiff's floor ``α · γ`` lets every layer without enough candidates prune less than γ,
    so the rank saves less than Eq. (1) asked and — with the feedback-loop fix — never
    catches up. Every ratio is raised by one common ``t`` (capped at ``cap``) — the smallest
    ``t`` whose ``Σ w_k min(cap, γ_k + t) / Σ w_k ≥ γ`` (bisection); ratios whose mean
    already reaches γ are returned unchanged.

    Args:
        ratios: PriDiff's per-layer ratios.
        weights: each layer's cost share (e.g. its weight's element count: FLOPs ∝ it).
        gamma: the rank's Eq. (1) ratio.
        cap: γ_max.
    """
    if len(ratios) != len(weights) or not ratios:
        raise SpecError(f"{len(ratios)} ratios for {len(weights)} weights")
    total = sum(weights)
    target = min(gamma, cap)

    def mean(t: float) -> float:
        return sum(w * min(cap, r + t) for r, w in zip(ratios, weights, strict=True)) / total

    if total <= 0 or mean(0.0) >= target:
        return list(ratios)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean(mid) < target else (lo, mid)
    return [min(cap, r + hi) for r in ratios]


def select_pruned(w_var: Sequence[float], n: int) -> tuple[int, ...]:
    """The ``n`` columns with the smallest statistic (ties: lower index), sorted ascending."""
    if not 0 <= n <= len(w_var):
        raise SpecError(f"cannot prune {n} of {len(w_var)} columns")
    order = sorted(range(len(w_var)), key=lambda i: (w_var[i], i))
    return tuple(sorted(order[:n]))


def update_wvar(old: Sequence[float], new: Sequence[float], pruned: Sequence[int]
                ) -> list[float]:
    """Incremental priority update (§2.5): pruned columns keep their old statistic."""
    if len(old) != len(new):
        raise SpecError(f"statistics of {len(old)} and {len(new)} columns")
    frozen = set(pruned)
    return [o if i in frozen else n for i, (o, n) in enumerate(zip(old, new, strict=True))]


def virtual_rank(r: int, straggler: int, e: int) -> int:
    """The paper's renumbering ``r' = (r + e − s) % e`` (positions in the group, 0-based)."""
    return (r + e - straggler) % e


def receiver_ranges(straggler: int, receivers: Sequence[int], e: int, n: int
                    ) -> dict[int, tuple[int, int]]:
    """Split ``n`` migrated columns over ``receivers`` by virtual renumbering.

    Args:
        straggler: group position of the sender.
        receivers: group positions that compute migrated columns (not the straggler).
        e: group size.
        n: number of migrated columns.

    Returns:
        ``{receiver: (lo, hi)}``: the half-open range of positions in the migrated-column
        list; receivers in order of ``r'``, ``n // k`` each and one more for the first
        ``n % k``. With every other rank receiving and ``k | n`` this is the paper's
        ``[m (r' − 1), m r' − 1]``.
    """
    if straggler in receivers or not receivers:
        raise SpecError(f"receivers {list(receivers)} must be non-empty and exclude the "
                        f"straggler {straggler}")
    order = sorted(receivers, key=lambda r: virtual_rank(r, straggler, e))
    base, extra = divmod(n, len(order))
    out: dict[int, tuple[int, int]] = {}
    lo = 0
    for i, r in enumerate(order):
        hi = lo + base + (1 if i < extra else 0)
        out[r] = (lo, hi)
        lo = hi
    return out


@dataclass(frozen=True)
class CostCoefficients:
    """Linear cost models of Eq. (2)/(3), seconds per column (Ω_1 in seconds).

    ``omega2`` prices extracting a resized column, ``phi1`` communicating a migrated one,
    ``phi2`` computing one on a receiver (Φ_2(n) = phi2 · n).
    """

    omega1: float = 0.0
    omega2: float = 0.0
    phi1: float = 0.0
    phi2: float = 0.0


def eq2_beta(g: float, e: int, c: CostCoefficients) -> float:
    """Eq. (2) with linear costs: ``Ω1 + b G (1 − β) = c G β + d G β / (e − 1)``.

    Returns ``β = (Ω1 + b G) / (G (b + c + d / (e − 1)))`` clipped to [0, 1]; 0 when there is
    nothing to move (``G = 0``), no receiver (``e = 1``) or no cost at all (every split ties:
    resizing is kept, it needs no communication).
    """
    if g <= 0.0 or e < 2:
        return 0.0
    denom = g * (c.omega2 + c.phi1 + c.phi2 / (e - 1))
    if denom <= 0.0:
        return 0.0
    return min(max((c.omega1 + c.omega2 * g) / denom, 0.0), 1.0)


def gamma_workload(t_sorted: Sequence[float], l_sorted: Sequence[float], x: int,
                   t_min: float) -> float:
    """Γ(x) = Σ_{k ≤ x} L_k (T_k − T_min) / T_k over the x slowest ranks (sorted desc)."""
    return sum(l_sorted[k] * (t_sorted[k] - t_min) / t_sorted[k] for k in range(x)
               if t_sorted[k] > 0)


def eq3_f(t_sorted: Sequence[float], l_sorted: Sequence[float], x: int, t_min: float,
          phi1: float) -> float:
    """Eq. (3): ``(T_x − T_min) − Φ1(Γ(x)) − max_{y > x} Γ(x)/(e − x) · T_y / L_y``.

    ``x`` is 1-based (the x slowest migrate); the receivers are all ``e − x`` others (the
    paper's literal set, §7.23). Φ1 is linear: ``phi1 · Γ``.
    """
    e = len(t_sorted)
    if not 1 <= x < e:
        raise SpecError(f"x must be in [1, {e - 1}], got {x}")
    gam = gamma_workload(t_sorted, l_sorted, x, t_min)
    share = gam / (e - x)
    worst = max(share * t_sorted[y] / l_sorted[y] for y in range(x, e) if l_sorted[y] > 0)
    return (t_sorted[x - 1] - t_min) - phi1 * gam - worst


def choose_migrators(t_sorted: Sequence[float], l_sorted: Sequence[float], z: int,
                     phi1: float) -> int:
    """Alg. 2 lines 14–19: the largest x ≤ z with f(1..x) all > 0 (0: nobody migrates)."""
    t_min = min(t_sorted)
    x = 0
    for k in range(1, min(z, len(t_sorted) - 1) + 1):
        if eq3_f(t_sorted, l_sorted, k, t_min, phi1) <= 0.0:
            break
        x = k
    return x


@dataclass(frozen=True)
class RankDecision:
    """What one rank does this period.

    ``resize``: fraction of its columns it prunes; ``migrate``: fraction it sends to
    ``receivers`` (group positions). A receiver has role ``normal`` here.
    """

    role: Role = "normal"
    resize: float = 0.0
    migrate: float = 0.0
    receivers: tuple[int, ...] = ()


class PlanRole(Protocol):
    """A plan's initial role of one rank (``ir.plan_sections.TPRankRole``)."""

    @property
    def rank(self) -> int: ...

    @property
    def role(self) -> str: ...

    @property
    def gamma(self) -> float: ...

    @property
    def beta(self) -> float: ...


class PlanGroup(Protocol):
    """A plan's TP group (``ir.plan_sections.TPGroup``): its ranks and their roles."""

    @property
    def ranks(self) -> tuple[int, ...]: ...

    @property
    def roles(self) -> Sequence[PlanRole]: ...


def plan_roles(group: PlanGroup) -> list[RankDecision]:
    """The plan's initial roles as decisions, one per group position.

    ``resize`` prunes ``γ``; ``migrate_src`` sends ``γ·β`` and prunes ``γ·(1 − β)`` (the
    Eq. (2) split) to the ``migrate_dst`` ranks (every other rank when none is listed).
    The one reading of a plan's roles: the runtime starts from it, the cost model
    (:mod:`hetplan.cost_models.tp_shares`) prices it.
    """
    pos = {r: i for i, r in enumerate(group.ranks)}
    by_rank = {role.rank: role for role in group.roles}
    dst = tuple(pos[r.rank] for r in group.roles if r.role == "migrate_dst")
    out = []
    for i, r in enumerate(group.ranks):
        role = by_rank.get(r)
        if role is None or role.role in ("normal", "migrate_dst") or role.gamma <= 0:
            out.append(RankDecision())
        elif role.role == "resize":
            out.append(RankDecision("resize", resize=role.gamma))
        else:
            takers = dst or tuple(j for j in range(len(group.ranks)) if j != i)
            out.append(RankDecision("migrate_src", resize=role.gamma * (1 - role.beta),
                                    migrate=role.gamma * role.beta, receivers=takers))
    return out


def zero_decision(t_raw: Sequence[float], m_raw: Sequence[float], gamma_max: float,
                  criterion: Literal["avg", "min"] = "avg", eps: float = 0.0
                  ) -> list[RankDecision]:
    """ZERO-resizing: every rank with ``T_raw > T_ref · (1 + eps)`` prunes its Eq. (1) γ
    towards ``T_ref`` (``avg``: the mean, the paper's ZERO; ``min``: the fastest rank)."""
    _check_same_len(t_raw=t_raw, m_raw=m_raw)
    t_ref = sum(t_raw) / len(t_raw) if criterion == "avg" else min(t_raw)
    out = []
    for t, m in zip(t_raw, m_raw, strict=True):
        g = eq1_gamma(t, t_ref, m, gamma_max) if t > t_ref * (1.0 + eps) else 0.0
        out.append(RankDecision("resize", resize=g) if g > 0.0 else RankDecision())
    return out


def _migrate(frac: float, receivers: Sequence[int], resize: float = 0.0) -> RankDecision:
    return RankDecision("migrate_src", resize=resize, migrate=frac, receivers=tuple(receivers))


def semi_decision(t_raw: Sequence[float], m_raw: Sequence[float], cols: Sequence[int],
                  costs: CostCoefficients, gamma_max: float, eps: float,
                  variant: Literal["semi", "migration"] = "semi",
                  receivers: Literal["all", "normal"] = "all") -> list[RankDecision]:
    """SEMI-migration (Alg. 2, cleaned up) or migration only, identical on every rank.

    Args:
        t_raw / m_raw: every rank's un-balanced iteration and matmul time.
        cols: every rank's workload L (contraction columns of its prunable linears).
        costs: the Eq. (2)/(3) cost coefficients.
        gamma_max: cap of a resizing ratio.
        eps: relative straggler tolerance on ``T_min``.
        variant: ``migration`` migrates every straggler's full Eq. (1) fraction (MIG).
        receivers: ``all`` ranks that do not migrate (Eq. (3) literal) or only ``normal``
            ones (no straggler receives work, §7.23).
    """
    e = _check_same_len(t_raw=t_raw, m_raw=m_raw, cols=[float(c) for c in cols])
    t_min = min(t_raw)
    slow = sorted((r for r in range(e) if t_raw[r] > t_min * (1.0 + eps)),
                  key=lambda r: (-t_raw[r], r))
    out = [RankDecision() for _ in range(e)]
    if not slow or e < 2:
        return out
    frac = {r: eq1_gamma(t_raw[r], t_min, m_raw[r], 1.0) for r in slow}
    if variant == "migration":
        x = len(slow)  # the fastest rank is never slow: at least one receiver
    elif len(slow) == 1:
        s = slow[0]
        g = cols[s] * frac[s]
        beta = eq2_beta(g, e, costs)
        others = [r for r in range(e) if r != s]
        resize = min(frac[s] * (1.0 - beta), gamma_max)
        out[s] = (_migrate(frac[s] * beta, others, resize) if beta > 0.0
                  else RankDecision("resize", resize=resize))
        return out
    else:
        order = slow + sorted((r for r in range(e) if r not in slow),
                              key=lambda r: (-t_raw[r], r))  # every rank, slowest first
        x = choose_migrators([t_raw[r] for r in order], [float(cols[r]) for r in order],
                             len(slow), costs.phi1)
    migrators = slow[:x]
    busy = slow if receivers == "normal" else migrators
    takers = [r for r in range(e) if r not in busy]
    for r in slow:
        if r in migrators:
            out[r] = _migrate(frac[r], takers)
        elif frac[r] > 0.0:
            out[r] = RankDecision("resize", resize=min(frac[r], gamma_max))
    return out
