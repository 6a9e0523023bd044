"""Contiguous pipeline partitioning of layers onto (heterogeneous) devices: pure solvers.

The problem (DynPipe's "Partition by Time/Param", ``research/dynpipe.md`` §3.2, §8.2): split
layers ``0..L-1`` into ``P`` non-empty contiguous stages, stage ``s`` running on the ``s``-th
device of the pipeline, minimizing the *bottleneck* — the largest stage load — subject to a
per-device memory capacity. The load of stage ``s`` holding layers ``i..j`` is::

    load(s, i, j) = sum(cost[s][i..j]) + send[s][j]

``cost[s][k]`` is layer ``k``'s cost on device ``s`` (time: per-device speeds and non-linear
per-device times both fit; params: the same count on every device), and ``send[s][j]`` the
time to hand the boundary activation of layer ``j`` to stage ``s+1`` (the seed's §D.2
network-aware load: the time until work arrives at the next worker; ``0`` for the last stage).
Memory: ``fixed_mem[s] + sum(mem[s][i..j]) <= mem_cap[s]`` (per-device, per-layer bytes, so
activation stashes that depend on the stage position — 1F1B stage ``s`` holds ``P-s``
micro-batches — are expressible). Cuts: ``cuttable[k]`` False forbids a stage to start at
layer ``k`` (the runtime cannot split the model there; ``LayerIR.cuttable_before``).

Decisions (the paper leaves these open; also in ``docs/decisions.md``):

* **Exact, not greedy.** A DP over (stage, last layer) finds the optimal bottleneck; the
  DeepSpeed-style binary search with a greedy front-fill probe (:func:`greedy_partition`) is
  kept as a baseline. Unlike DeepSpeed/DynMo, memory is inside the feasibility check, not
  checked after the fact.
* **Tie-break.** Among partitions with the optimal bottleneck, the one with the smallest sum
  of squared stage loads (then, per stage, the shorter stage) wins: non-bottleneck stages come out
  balanced too, and no stage is left empty (§6.3's greedy leaves trailing stages empty).
* **Every stage holds at least one layer**: the runtime builds one module per stage. A
  device better left idle is re-packing's business (:func:`repack`), which drops it.
* **Device order** (:func:`pipeline_device_order`): a node's devices stay contiguous
  (neighbouring stages then talk over NVLink; only node boundaries cross the network), nodes
  with more memory per device come first, and inside a node devices go by memory, then speed,
  descending: under 1F1B the early stages stash the most in-flight activations.

Complexity: :func:`min_max_partition` is O(P · L · w) where ``w`` is the number of layers a
stage can hold before its load exceeds the best candidate (the inner scan stops there), at
worst O(P · L²); 100 layers × 64 stages takes a few milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from hetplan.errors import InfeasiblePlanError, SpecError
from hetplan.ir.validation import check_bounds

__all__ = [
    "Partition",
    "min_max_partition",
    "partition_by_time",
    "partition_by_params",
    "greedy_partition",
    "uniform_partition",
    "stage_loads",
    "pipeline_device_order",
    "repack",
    "Repack",
]

_REL_EPS = 1e-12


@dataclass(frozen=True)
class Partition:
    """A contiguous partition: ``bounds[s] = (first, last)`` layers (inclusive) of stage ``s``.

    ``loads[s]`` is the stage's load under the problem it was solved for; ``bottleneck`` is
    ``max(loads)``.
    """

    bounds: tuple[tuple[int, int], ...]
    loads: tuple[float, ...]

    @property
    def bottleneck(self) -> float:
        return max(self.loads)

    @property
    def cuts(self) -> tuple[int, ...]:
        """First layer of every stage after the first (the cut points)."""
        return tuple(b[0] for b in self.bounds[1:])

    def stage_of_layer(self) -> tuple[int, ...]:
        """Stage index of every layer."""
        return tuple(s for s, (a, b) in enumerate(self.bounds) for _ in range(a, b + 1))


def _matrix(values: Sequence[float] | Sequence[Sequence[float]], rows: int, cols: int,
            what: str) -> list[list[float]]:
    """``values`` as a ``rows x cols`` matrix (a flat vector is repeated for every row)."""
    if len(values) and not isinstance(values[0], (int, float)):
        mat = [list(map(float, row)) for row in values]  # type: ignore[arg-type]
        if len(mat) != rows or any(len(row) != cols for row in mat):
            raise SpecError(f"{what} must be {rows} rows of {cols} values (one row per stage, "
                            f"one value per layer), got {len(mat)} rows")
    else:
        if len(values) != cols:
            raise SpecError(f"{what} needs one value per layer ({cols}), got {len(values)}")
        mat = [list(map(float, values))] * rows  # type: ignore[arg-type]
    for row in mat:
        for x in row:
            if not (math.isfinite(x) and x >= 0):
                raise SpecError(f"{what} must be finite and >= 0, got {x!r}")
    return mat


def _prefix(rows: list[list[float]]) -> list[list[float]]:
    out = []
    for row in rows:
        acc, pre = 0.0, [0.0]
        for x in row:
            acc += x
            pre.append(acc)
        out.append(pre)
    return out


@dataclass(frozen=True)
class _Problem:
    cost_pre: list[list[float]]
    send: list[list[float]]
    mem_pre: list[list[float]] | None
    room: list[float]  # mem_cap - fixed_mem per stage
    n: int
    p: int
    starts: list[bool]  # may a stage start at layer k (layer 0 always starts stage 0)

    def load(self, s: int, i: int, j: int) -> float:
        return self.cost_pre[s][j + 1] - self.cost_pre[s][i] + self.send[s][j]

    def fits(self, s: int, i: int, j: int) -> bool:
        if self.mem_pre is None:
            return True
        return self.mem_pre[s][j + 1] - self.mem_pre[s][i] <= self.room[s]


def _problem(
    cost: Sequence[float] | Sequence[Sequence[float]],
    num_stages: int,
    send: Sequence[float] | Sequence[Sequence[float]] | None,
    mem: Sequence[float] | Sequence[Sequence[float]] | None,
    mem_cap: float | Sequence[float] | None,
    fixed_mem: float | Sequence[float],
    cuttable: Sequence[bool] | None = None,
) -> _Problem:
    if num_stages < 1:
        raise SpecError(f"num_stages must be >= 1, got {num_stages!r}")
    first = cost[0] if len(cost) else None
    n = len(first) if first is not None and not isinstance(first, (int, float)) else len(cost)
    if n < num_stages:
        raise InfeasiblePlanError(
            f"{num_stages} pipeline stages need at least {num_stages} layers, got {n}; use "
            "fewer stages"
        )
    c = _matrix(cost, num_stages, n, "cost")
    snd = _matrix(send, num_stages, n, "send") if send is not None else [[0.0] * n] * num_stages
    snd = [row if s < num_stages - 1 else [0.0] * n for s, row in enumerate(snd)]
    mem_pre = None
    room = [math.inf] * num_stages
    if mem is not None:
        if mem_cap is None:
            raise SpecError("mem given without mem_cap; pass the capacity of every device")
        mem_pre = _prefix(_matrix(mem, num_stages, n, "mem"))
        caps = [float(mem_cap)] * num_stages if isinstance(mem_cap, (int, float)) \
            else [float(x) for x in mem_cap]
        fixed = [float(fixed_mem)] * num_stages if isinstance(fixed_mem, (int, float)) \
            else [float(x) for x in fixed_mem]
        if len(caps) != num_stages or len(fixed) != num_stages:
            raise SpecError(f"mem_cap and fixed_mem need one value per stage ({num_stages})")
        room = [cap - f for cap, f in zip(caps, fixed)]
    starts = [True] * n if cuttable is None else [bool(x) for x in cuttable]
    if len(starts) != n:
        raise SpecError(f"cuttable needs one value per layer ({n}), got {len(starts)}")
    if 1 + sum(starts[1:]) < num_stages:
        raise InfeasiblePlanError(
            f"{num_stages} pipeline stages need {num_stages - 1} cuts, but only "
            f"{sum(starts[1:])} of the {n - 1} layer boundaries can be cut (a stage cannot "
            "start at a layer that is not called as a module); use fewer stages")
    return _Problem(_prefix(c), snd, mem_pre, room, n, num_stages, starts)


def _solve(pr: _Problem, limit: float | None) -> list[tuple[int, int]] | None:
    """DP: with ``limit is None`` minimize the bottleneck, else minimize the sum of squared
    loads over partitions whose every load is ``<= limit``. Returns the bounds or None."""
    n, p = pr.n, pr.p
    inf = math.inf
    # best[s][j]: objective of stages 0..s covering layers 0..j; arg[s][j]: first layer of s
    best = [[inf] * n for _ in range(p)]
    arg = [[-1] * n for _ in range(p)]
    # the loop inlines _Problem.load and .fits (same arithmetic): it runs O(P · L · w) times
    cap = limit if limit is not None else inf
    starts = [True, *pr.starts[1:]]  # stage 0 starts at layer 0
    for s in range(p):
        pre, snd, room = pr.cost_pre[s], pr.send[s], pr.room[s]
        mpre = pr.mem_pre[s] if pr.mem_pre is not None else None
        prev_row = best[s - 1] if s else None
        row_b, row_a = best[s], arg[s]
        # stage s ends at j; stages after it need one layer each
        for j in range(s, n - (p - 1 - s)):
            b, a = inf, -1
            end, tail = pre[j + 1], snd[j]
            mend = mpre[j + 1] if mpre is not None else 0.0
            for i in (range(j, s - 1, -1) if s else (0,)):  # stage s = layers i..j
                if mpre is not None and not mend - mpre[i] <= room:
                    break  # memory only grows as the stage gets longer
                ld = end - pre[i] + tail
                if ld > cap:
                    break
                if limit is None and ld >= b:
                    break  # load only grows; cannot improve max(prev, load)
                if not starts[i]:
                    continue  # the runtime cannot split before layer i
                prev = 0.0 if prev_row is None else prev_row[i - 1]
                if prev == inf:
                    continue
                val = max(prev, ld) if limit is None else prev + ld * ld
                if val < b:  # strict: on ties the shorter stage s (found first) stays
                    b, a = val, i
            row_b[j], row_a[j] = b, a
    if best[p - 1][n - 1] == inf:
        return None
    bounds, j = [], n - 1
    for s in range(p - 1, -1, -1):
        i = arg[s][j]
        bounds.append((i, j))
        j = i - 1
    return bounds[::-1]


def _loads(pr: _Problem, bounds: Sequence[tuple[int, int]]) -> tuple[float, ...]:
    return tuple(pr.load(s, i, j) for s, (i, j) in enumerate(bounds))


def _infeasible(pr: _Problem) -> InfeasiblePlanError:
    assert pr.mem_pre is not None  # without memory limits every partition is feasible
    need = [round(pr.mem_pre[s][pr.n]) for s in range(pr.p)]
    return InfeasiblePlanError(
        f"no partition of {pr.n} layers into {pr.p} stages fits the devices' memory: free "
        f"room per stage {[round(r) for r in pr.room]} bytes, the whole model needs "
        f"{min(need)} bytes on one stage; use more stages, devices with more memory, or a "
        "smaller micro-batch"
    )


def min_max_partition(
    cost: Sequence[float] | Sequence[Sequence[float]],
    num_stages: int,
    *,
    send: Sequence[float] | Sequence[Sequence[float]] | None = None,
    mem: Sequence[float] | Sequence[Sequence[float]] | None = None,
    mem_cap: float | Sequence[float] | None = None,
    fixed_mem: float | Sequence[float] = 0.0,
    cuttable: Sequence[bool] | None = None,
) -> Partition:
    """Exact min–max contiguous partition (see module docstring for the model).

    Args:
        cost: per-layer loads (same on every device) or ``cost[s][k]`` per stage and layer.
        num_stages: ``P``; every stage gets at least one layer.
        send: boundary transfer time ``send[s][j]`` (stage ``s`` ends at layer ``j``), or one
            value per layer for every stage; ignored for the last stage.
        mem: per-layer bytes (per stage and layer, or one vector); needs ``mem_cap``.
        mem_cap: bytes each device may hold (one value, or one per stage).
        fixed_mem: bytes each stage holds whatever its layers (one value or one per stage).
        cuttable: per layer, whether a stage may start there (default: everywhere); the
            first layer always starts stage 0.

    Returns:
        The optimal :class:`Partition`; ties go to the smallest sum of squared loads.

    Raises:
        InfeasiblePlanError: fewer layers (or cuttable boundaries) than stages, or no
            partition fits in memory.
        SpecError: malformed inputs (shapes, negative or non-finite values).

    Example:
        >>> min_max_partition([2, 2, 2, 2, 1, 1, 1, 1], 4).bounds
        ((0, 1), (2, 2), (3, 4), (5, 7))
    """
    pr = _problem(cost, num_stages, send, mem, mem_cap, fixed_mem, cuttable)
    bounds = _solve(pr, None)
    if bounds is None:
        raise _infeasible(pr)
    opt = max(_loads(pr, bounds))
    refined = _solve(pr, opt * (1 + _REL_EPS) + _REL_EPS)
    if refined is not None and max(_loads(pr, refined)) <= opt * (1 + _REL_EPS) + _REL_EPS:
        bounds = refined
    return Partition(tuple(bounds), _loads(pr, bounds))


def partition_by_time(
    layer_ms: Sequence[float],
    num_stages: int,
    *,
    speeds: Sequence[float] | None = None,
    send_ms: Sequence[float] | Sequence[Sequence[float]] | None = None,
    mem: Sequence[float] | Sequence[Sequence[float]] | None = None,
    mem_cap: float | Sequence[float] | None = None,
    fixed_mem: float | Sequence[float] = 0.0,
) -> Partition:
    """"Partition by Time": layer times on a reference device divided by each stage device's
    relative ``speeds`` (1.0 = the reference; default: all equal). Other arguments as in
    :func:`min_max_partition`.

    The paper's name for a use of :func:`min_max_partition`, kept as a convenience for
    scripts; no pass calls it (the ``dynpipe`` pass and the balancer build per-device cost
    rows themselves)."""
    if speeds is None:
        cost: Sequence[float] | list[list[float]] = layer_ms
    else:
        if len(speeds) != num_stages or any(not (x > 0 and math.isfinite(x)) for x in speeds):
            raise SpecError(f"speeds needs {num_stages} positive values, got {list(speeds)}")
        cost = [[t / v for t in layer_ms] for v in speeds]
    return min_max_partition(cost, num_stages, send=send_ms, mem=mem, mem_cap=mem_cap,
                             fixed_mem=fixed_mem)


def partition_by_params(
    layer_params: Sequence[float],
    num_stages: int,
    *,
    mem: Sequence[float] | Sequence[Sequence[float]] | None = None,
    mem_cap: float | Sequence[float] | None = None,
    fixed_mem: float | Sequence[float] = 0.0,
) -> Partition:
    """"Partition by Param": balance (non-zero) parameter counts, ignoring device speed and
    transfers (PipeTransformer / DeepSpeed ``parameters`` method), memory-feasible.

    Like :func:`partition_by_time`, a named convenience that no pass calls (the ``dynpipe``
    pass screens the same ``params`` cost through :func:`min_max_partition`)."""
    return min_max_partition(layer_params, num_stages, mem=mem, mem_cap=mem_cap,
                             fixed_mem=fixed_mem)


def stage_loads(
    bounds: Sequence[tuple[int, int]],
    cost: Sequence[float] | Sequence[Sequence[float]],
    *,
    send: Sequence[float] | Sequence[Sequence[float]] | None = None,
) -> tuple[float, ...]:
    """Loads of a given partition under ``cost``/``send`` (same conventions). O(L).

    An independent evaluator, called by no pass: the property tests check the solvers'
    reported loads and compare baselines with it."""
    pr = _problem(cost, len(bounds), send, None, None, 0.0)
    check_bounds(bounds, pr.n)
    return _loads(pr, bounds)


def uniform_partition(num_layers: int, num_stages: int,
                      cuttable: Sequence[bool] | None = None) -> tuple[tuple[int, int], ...]:
    """Megatron's default: equal layer counts, the first ``L mod P`` stages one more. O(P).

    When a cut of that split falls where ``cuttable`` forbids one, the most even layer
    counts among the allowed cuts instead (:func:`min_max_partition` of one per layer)."""
    if num_stages < 1 or num_layers < num_stages:
        raise InfeasiblePlanError(f"cannot split {num_layers} layers into {num_stages} stages")
    base, extra = divmod(num_layers, num_stages)
    out, first = [], 0
    for s in range(num_stages):
        size = base + (1 if s < extra else 0)
        out.append((first, first + size - 1))
        first += size
    if cuttable is not None and not all(cuttable[i] for i, _ in out[1:]):
        return min_max_partition([1.0] * num_layers, num_stages, cuttable=cuttable).bounds
    return tuple(out)


def greedy_partition(
    cost: Sequence[float] | Sequence[Sequence[float]],
    num_stages: int,
    *,
    send: Sequence[float] | Sequence[Sequence[float]] | None = None,
    iterations: int = 60,
) -> Partition:
    """DeepSpeed's ``partition_balanced`` idea, generalised: bisection on the bottleneck with a
    greedy front-fill probe (each stage takes the longest prefix whose load fits, leaving one
    layer for each later stage). O(iterations · L).

    A reference baseline kept for differential tests, not used for plans: the property tests
    check that the exact :func:`min_max_partition` is never worse than it."""
    pr = _problem(cost, num_stages, send, None, None, 0.0)

    def probe(limit: float) -> list[tuple[int, int]] | None:
        bounds, i = [], 0
        for s in range(pr.p):
            last = pr.n - (pr.p - s)  # leave one layer per later stage
            if s == pr.p - 1:
                j = pr.n - 1
            else:
                j = i
                while j + 1 <= last and pr.load(s, i, j + 1) <= limit:
                    j += 1
            if pr.load(s, i, j) > limit:
                return None
            bounds.append((i, j))
            i = j + 1
        return bounds

    lo, hi = 0.0, max(sum(pr.load(s, 0, pr.n - 1) for s in range(pr.p)), 1e-300)
    best = probe(hi * 2)
    assert best is not None
    for _ in range(iterations):
        mid = (lo + hi) / 2
        got = probe(mid)
        if got is None:
            lo = mid
        else:
            hi, best = mid, got
    return Partition(tuple(best), _loads(pr, best))


def pipeline_device_order(
    nodes: Sequence[int], memory_bytes: Sequence[float], speeds: Sequence[float]
) -> tuple[int, ...]:
    """The order in which to lay devices out along a pipeline (see module docstring).

    Args:
        nodes: node index of every device.
        memory_bytes: memory of every device.
        speeds: relative speed of every device.

    Returns:
        Device indices in pipeline order: each node's devices contiguous; nodes by descending
        memory per device (then speed, then index); inside a node by memory, then speed,
        descending, then index. O(D log D).
    """
    if not (len(nodes) == len(memory_bytes) == len(speeds)):
        raise SpecError("nodes, memory_bytes and speeds need one entry per device")
    by_node: dict[int, list[int]] = {}
    for d, nd in enumerate(nodes):
        by_node.setdefault(nd, []).append(d)

    def node_key(nd: int) -> tuple[float, float, int]:
        ds = by_node[nd]
        return (-min(memory_bytes[d] for d in ds), -min(speeds[d] for d in ds), nd)

    out: list[int] = []
    for nd in sorted(by_node, key=node_key):
        out += sorted(by_node[nd], key=lambda d: (-memory_bytes[d], -speeds[d], d))
    return tuple(out)


@dataclass(frozen=True)
class Repack:
    """Result of :func:`repack`: the partition on the first ``len(bounds)`` devices of the
    pipeline and the devices (pipeline positions) released."""

    partition: Partition
    released: tuple[int, ...]


def repack(
    cost: Sequence[Sequence[float]],
    mem: Sequence[Sequence[float]],
    mem_cap: Sequence[float],
    *,
    target: int = 1,
    fixed_mem: Sequence[float] | None = None,
    max_slowdown: float = math.inf,
    cuttable: Sequence[bool] | None = None,
) -> Repack:
    """Re-pack layers onto fewer devices: the fewest pipeline stages ``k >= target`` on the
    first ``k`` devices of the pipeline such that an exact memory-feasible partition exists
    and its bottleneck is at most ``max_slowdown`` times the bottleneck on all devices.

    DynPipe's Algorithm 3 merges stages first-fit and may join non-adjacent stages (§6.5);
    here the stages stay contiguous and the layers are re-balanced over the devices kept, in
    one step. ``cost``/``mem`` are per device (row ``d`` = device ``d``, in pipeline order);
    ``mem`` may depend on the stage count (1F1B stashes), so callers that care pass the worst
    case (the count of the first stage at the largest ``P``), which is conservative.

    Returns:
        The partition on the devices kept and the released device positions.

    Raises:
        InfeasiblePlanError: not even all devices fit.

    Complexity: O(D) calls of :func:`min_max_partition`.
    """
    d = len(cost)
    if not (len(mem) == len(mem_cap) == d) or d < 1:
        raise SpecError("cost, mem and mem_cap need one row per device")
    fixed = list(fixed_mem) if fixed_mem is not None else [0.0] * d
    full = min_max_partition(cost, d, mem=mem, mem_cap=mem_cap, fixed_mem=fixed,
                             cuttable=cuttable)
    for k in range(max(1, target), d):
        try:
            part = min_max_partition(cost[:k], k, mem=mem[:k], mem_cap=mem_cap[:k],
                                     fixed_mem=fixed[:k], cuttable=cuttable)
        except InfeasiblePlanError:
            continue
        if part.bottleneck <= full.bottleneck * max_slowdown * (1 + _REL_EPS):
            return Repack(part, tuple(range(k, d)))
    return Repack(full, ())
