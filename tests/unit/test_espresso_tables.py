"""The candidate filter and the uniform seeds over whole cost tables
(:mod:`hetplan.algorithms.espresso_tables`, ``SelectionProblem.ops_table``) decide what the
per-tuple code decides: the same candidate lists, the same best seed, the same selection."""

from __future__ import annotations

import random

import numpy as np
import pytest

from hetplan.algorithms.dp_session import DPSession
from hetplan.algorithms.dp_types import CPU, GPU, Op
from hetplan.algorithms.espresso import SelectionProblem, _best_seed, select
from hetplan.algorithms.espresso_candidates import Candidates
from hetplan.algorithms.espresso_tables import OpsTable, keep_by_row

Key = tuple[str, int]
_PATHS = ((GPU, "net", GPU), ("net",), (GPU, "intra", "net", GPU), ("intra", "net"),
          (CPU, "net", CPU))


def _instance(seed: int) -> tuple[SelectionProblem[Key], SelectionProblem[Key]]:
    """A problem with tables and the same problem without them: options on a few paths,
    durations from a small set of values per row (so that equal ops and step-for-step
    dominance are common), tensors in a few size classes."""
    rng = random.Random(seed)
    classes = rng.randint(1, 4)
    n = rng.randint(3, 9)
    rows = [rng.randrange(classes) for _ in range(n)]
    opts: list[Key] = [("p", x) for x in range(rng.randint(4, 14))]
    base: Key = ("b", 0)
    tables: dict[Key, OpsTable] = {}
    interned: dict[tuple[tuple[str, float, str], ...], int] = {}
    cache: dict[tuple[Key, int], tuple[Op, ...]] = {}
    for k in [base, *opts]:
        path = ("net",) if k == base else rng.choice(_PATHS)
        label = rng.choice(("a", "b"))
        dur = np.array([[rng.choice((1e-3, 2e-3, 3e-3)) * (c + 1) for _ in path]
                        for c in range(classes)])
        sigs = []
        for c in range(classes):
            ops = tuple(Op(r, float(t), label) for r, t in zip(path, dur[c]))
            cache[(k, c)] = ops
            sigs.append(interned.setdefault(
                tuple((o.resource, o.duration_s, o.label) for o in ops), len(interned)))
        tables[k] = OpsTable(path, dur, sigs, [cache[(k, c)] for c in range(classes)])
    by_id = {id(o): interned[tuple((x.resource, x.duration_s, x.label) for x in o)]
             for o in cache.values()}

    def make(with_tables: bool) -> SelectionProblem[Key]:
        return SelectionProblem(
            backprop_s=[1e-3 * (1 + (i % 3)) for i in range(n)],
            sizes=[1000 * (r + 1) for r in rows], baseline=[base] * n,
            gpu_options=[opts] * n, ops=lambda i, k: cache[(k, rows[i])],
            compressed=lambda k: k != base, ops_class=list(rows),
            ops_fields=lambda o: by_id[id(o)],
            ops_table=tables.__getitem__ if with_tables else None,
            table_rows=rows if with_tables else None)

    return make(True), make(False)


@pytest.mark.parametrize("prune", [True, False])
@pytest.mark.parametrize("seed", range(40))
def test_table_filter_gives_the_tuple_filters_lists(seed: int, prune: bool) -> None:
    fast, plain = _instance(seed)
    a, b = Candidates(fast, prune), Candidates(plain, prune)
    for j in range(len(fast.backprop_s)):
        assert [c[0] for c in a.candidates(j)] == [c[0] for c in b.candidates(j)]
        assert [c[2:] for c in a.candidates(j)] == [c[2:] for c in b.candidates(j)]
        for cur in [fast.baseline[j], *fast.gpu_options[j][:3]]:
            assert a.tried(j, cur)[0] == b.tried(j, cur)[0]


@pytest.mark.parametrize("seed", range(20))
def test_table_seeds_and_selection_match(seed: int) -> None:
    fast, plain = _instance(seed)
    n = len(fast.backprop_s)
    seeds = [[k] * n for k in fast.gpu_options[0]]
    assert _best_seed(fast, seeds, True) == _best_seed(plain, seeds, True)
    got = select(fast, seeds=seeds, exhaustive_limit=0, benefits=False, screen=2,
                 seed_within=0.1)
    want = select(plain, seeds=seeds, exhaustive_limit=0, benefits=False, screen=2,
                  seed_within=0.1)
    assert (got.strategy, got.iteration_s) == (want.strategy, want.iteration_s)


def test_dominance_is_per_row_and_needs_a_longer_step() -> None:
    tables = [
        OpsTable(("net",), np.array([[5.0], [5.0]]), [0, 1], []),  # baseline: always kept
        OpsTable(("net",), np.array([[2.0], [1.0]]), [10, 11], []),
        OpsTable(("net",), np.array([[1.0], [1.0]]), [20, 21], []),  # ties the one above in row 1
    ]
    assert keep_by_row(tables, True) == [[0, 2], [0, 1, 2]]
    assert keep_by_row(tables, False) == [[0, 1, 2], [0, 1, 2]]


def test_best_tables_is_best_classes_on_the_same_ops() -> None:
    s = DPSession([1e-3, 2e-3, 1e-3])
    s.rebase([(Op("net", 3e-3),)] * 3)
    strategies = [(("net",), np.array([[2e-3], [4e-3]])),
                  ((GPU, "net"), np.array([[1e-4, 1e-3], [1e-4, 1e-3]]))]
    as_ops = [[tuple(Op(r, float(t)) for r, t in zip(res, d[c])) for c in range(2)]
              for res, d in strategies]
    assert s.best_tables([0, 1, 0], strategies) == s.best_classes([0, 1, 0], as_ops)
    with pytest.raises(ValueError, match="a row per class"):
        s.best_tables([0, 1, 0], [strategies[0], (("net",), np.zeros((3, 1)))])
    with pytest.raises(ValueError, match="class index 2"):
        s.best_tables([0, 2, 0], strategies)


def test_ops_table_needs_rows_and_fields() -> None:
    fast, _ = _instance(0)
    with pytest.raises(ValueError, match="ops_table needs table_rows and ops_fields"):
        SelectionProblem(backprop_s=fast.backprop_s, sizes=fast.sizes,
                         baseline=fast.baseline, gpu_options=fast.gpu_options, ops=fast.ops,
                         compressed=fast.compressed, ops_table=fast.ops_table)


def _session_pair() -> tuple[DPSession, DPSession, list[tuple[Op, ...]]]:
    ops = [(Op("net", 2e-3),), (Op(GPU, 1e-4), Op("net", 1e-3)), (Op("net", 4e-3),),
           (Op("net", 1e-3), Op(GPU, 2e-4))]
    a, b = DPSession([1e-3, 1e-3, 3e-3, 1e-3]), DPSession([1e-3, 1e-3, 3e-3, 1e-3])
    a.rebase(ops)
    b.rebase(ops)
    return a, b, ops


@pytest.mark.parametrize("j", range(4))
def test_replace_is_rebase_with_one_tensor_changed(j: int) -> None:
    a, b, ops = _session_pair()
    new = (Op("net", 5e-4),)
    assert a.replace(j, new) == b.rebase([*ops[:j], new, *ops[j + 1:]])
    assert a.base_ops == b.base_ops
    # the saved states agree too: every later trial gives the same time
    for i in range(4):
        assert a.trial({i: (Op("net", 3e-3),)}) == b.trial({i: (Op("net", 3e-3),)})
    assert a.replace(j, new) == a.base_s  # no change: the base stays


def test_replace_needs_a_base_and_bubble_mask_is_before_bubbles() -> None:
    with pytest.raises(ValueError, match="rebase the session first"):
        DPSession([1e-3]).replace(0, (Op("net", 1e-3),))
    a, _, _ = _session_pair()
    a.replace(3, (Op("net", 1e-5),))
    mask = a.bubble_mask(1e-9)
    assert set(np.flatnonzero(mask).tolist()) == a.before_bubbles(1e-9)
    assert mask.any()  # a bubble: tensor 0 is done before the long backprop of tensor 2


def test_best_packed_is_best_option_and_checks_its_scope() -> None:
    a, _, _ = _session_pair()
    cands = [(Op("net", 1e-3),), (Op(GPU, 1e-4), Op("net", 5e-4)), (Op("net", 9e-3),)]
    backs = [False, False, True]
    for j in range(4):
        want = a.best_option(j, cands, backs, a.base_s, 1e-9)
        assert a.best_packed(j, a.pack(cands), np.array(backs), a.base_s, 1e-9) == want
    shared = DPSession([1e-3] * 4, share=a)
    shared.rebase(a.base_ops)
    assert shared.best_packed(1, a.pack(cands), np.array(backs), shared.base_s, 1e-9) == (
        shared.best_option(1, cands, backs, shared.base_s, 1e-9))
    other, _, _ = _session_pair()
    with pytest.raises(ValueError, match="other resource ids"):
        other.best_packed(0, a.pack(cands), np.array(backs), other.base_s, 1e-9)
