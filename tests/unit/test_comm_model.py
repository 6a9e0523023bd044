"""Unit tests of the communication cost model (alpha–beta per collective)."""

from __future__ import annotations

import random
from typing import Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetplan.cost_models.comm import (
    COLLECTIVES,
    AlphaBeta,
    CommModel,
    LinkRef,
    analytic_time_s,
    bus_factor,
    fit_alpha_beta,
    latency_steps,
)
from hetplan.cost_models.profile_db import CollectiveRecord, CollectiveSample, ProfileDB
from hetplan.errors import SpecError
from hetplan.ir.cluster import ClusterSpec, LinkSpec

LINK_100G = LinkSpec(kind="ethernet", bandwidth_gbps=100, latency_us=10)  # 12.5e9 B/s, 10 µs


@pytest.fixture(scope="module")
def pcie() -> ClusterSpec:
    return ClusterSpec.from_preset("v100-pcie-8x8")


# -- the documented formula, by hand -------------------------------------------------------
def test_allreduce_100mb_8_ranks_by_hand(pcie: ClusterSpec) -> None:
    # steps = 2(n-1) = 14 -> 14 * 10 µs = 140 µs
    # factor = 2(n-1)/n = 1.75 -> 1.75 * 1e8 B / 12.5e9 B/s = 14 ms
    m = CommModel(pcie)
    assert m.time_s("allreduce", 100e6, 8, LINK_100G) == pytest.approx(0.014 + 140e-6)
    cost = m.cost("allreduce", 100e6, 8, LINK_100G)
    assert cost.source == "analytic" and cost.seconds == pytest.approx(0.01414)


@pytest.mark.parametrize(
    ("collective", "expected"),
    [
        # n = 8, M = 1e8 B, B = 12.5e9 B/s (M/B = 8 ms), α = 10 µs
        ("reduce_scatter", 7 * 10e-6 + 0.875 * 8e-3),
        ("allgather", 7 * 10e-6 + 0.875 * 8e-3),  # M = total gathered bytes
        ("alltoall", 7 * 10e-6 + 0.875 * 8e-3),
        ("gather", 7 * 10e-6 + 0.875 * 8e-3),
        ("broadcast", 7 * 10e-6 + 8e-3),
        ("reduce", 7 * 10e-6 + 8e-3),
        ("p2p", 10e-6 + 8e-3),
    ],
)
def test_each_collective_by_hand(pcie: ClusterSpec, collective: str, expected: float) -> None:
    assert CommModel(pcie).time_s(collective, 100e6, 8, LINK_100G) == pytest.approx(expected)


def test_factors_and_steps() -> None:
    assert bus_factor("allreduce", 4) == 1.5
    assert bus_factor("allgather", 4) == 0.75
    assert bus_factor("broadcast", 4) == 1.0
    assert latency_steps("allreduce", 4) == 6
    assert latency_steps("alltoall", 4) == 3
    assert latency_steps("p2p", 4) == 1
    assert all(bus_factor(c, 1) == 0 and latency_steps(c, 1) == 0 for c in COLLECTIVES)


def test_group_of_one_and_zero_bytes_cost_nothing(pcie: ClusterSpec) -> None:
    m = CommModel(pcie)
    for c in COLLECTIVES:
        assert m.time_s(c, 1e9, 1, "inter") == 0.0
        assert m.time_s(c, 0, 8, "inter") == 0.0
        assert analytic_time_s(c, 1e9, 1, 1e9, 1e-5) == 0.0


def test_bad_arguments(pcie: ClusterSpec) -> None:
    m = CommModel(pcie)
    with pytest.raises(ValueError, match="did you mean 'allreduce'"):
        m.time_s("all_reduce", 1e6, 8, "intra")
    with pytest.raises(ValueError, match="group_size"):
        m.time_s("allreduce", 1e6, 0, "intra")
    with pytest.raises(ValueError, match="nbytes"):
        m.time_s("allreduce", -1, 8, "intra")
    with pytest.raises(ValueError, match="'intra' or 'inter'"):
        m.time_s("allreduce", 1e6, 8, "intre")  # type: ignore[arg-type]
    with pytest.raises(SpecError, match="no 'inter_node' link"):
        CommModel(ClusterSpec.from_preset("local-cpu")).time_s("allreduce", 1e6, 2, "inter")


def test_nccl_bus_bandwidth_below_nvlink_and_infiniband_line_rate(pcie: ClusterSpec) -> None:
    # NVLink 3 (2400 Gb/s = 300e9 B/s line rate) reaches 0.80 of it as bus bandwidth: 240e9 B/s.
    # all-reduce of 84e6 B over 8 ranks: 14 steps x 2 µs + 1.75 x 84e6 / 240e9 = 0.028 + 0.6125 ms
    nvlink = LinkSpec(kind="nvlink", bandwidth_gbps=2400, latency_us=2)
    m = CommModel(pcie)
    assert m.time_s("allreduce", 84e6, 8, nvlink) == pytest.approx(28e-6 + 0.6125e-3)
    assert "x 0.8" in m.alpha_beta("allreduce", 8, nvlink).detail
    # HDR InfiniBand, 8 x 200 Gb/s per node (200e9 B/s) at 0.96: 192e9 B/s; p2p of 96e6 B
    ib = LinkSpec(kind="infiniband", bandwidth_gbps=1600, latency_us=3)
    assert m.time_s("p2p", 96e6, 2, ib) == pytest.approx(3e-6 + 0.5e-3)
    # kinds without a published NCCL figure keep the line rate (the by-hand tests above)
    eth = LinkSpec(kind="ethernet", bandwidth_gbps=1600, latency_us=3)
    assert m.time_s("p2p", 96e6, 2, eth) == pytest.approx(3e-6 + 96e6 / 200e9)


def test_measured_bus_bandwidth_is_not_derated() -> None:
    # the Espresso artifact's NVLink constant (50 GB/s) is a measured bus bandwidth:
    # all-reduce of 1e8 B over 8 ranks = 14 x 2 µs + 1.75 x 1e8 / 50e9 = 0.028 + 3.5 ms
    espresso = ClusterSpec.from_preset("espresso-nvlink-8x8")
    link = espresso.nodes[0].intra_link
    assert link.kind == "nvlink" and link.bus_efficiency == 1.0
    assert CommModel(espresso).time_s("allreduce", 1e8, 8, link) == pytest.approx(
        28e-6 + 3.5e-3)
    # the same link as a line rate is priced at 0.80 of it
    line = LinkSpec(kind="nvlink", bandwidth_gbps=400, latency_us=2)
    assert CommModel(espresso).time_s("allreduce", 1e8, 8, line) == pytest.approx(
        28e-6 + 3.5e-3 / 0.8)
    with pytest.raises(ValueError, match="bus_efficiency"):
        LinkSpec(kind="nvlink", bandwidth_gbps=400, latency_us=2, bus_efficiency=1.5)


def test_named_links_and_backend() -> None:
    mixed = ClusterSpec.from_preset("mixed-generations")
    m = CommModel(mixed)
    assert m.backend == "nccl"
    assert m.resolve_link("intra").bandwidth_gbps == 1200  # the slower (NVLink 2) node group
    assert m.resolve_link("inter") == mixed.inter_node
    assert CommModel(ClusterSpec.from_preset("local-cpu")).backend == "gloo"


# -- fitting --------------------------------------------------------------------------------
SIZES = [2**k for k in range(10, 31, 2)]


def test_fit_recovers_exact_line() -> None:
    fit = fit_alpha_beta([(x, 25e-6 + 4e-10 * x) for x in SIZES])
    assert fit.source == "profiled"
    assert fit.alpha_s == pytest.approx(25e-6, rel=1e-9)
    assert fit.beta_s_per_byte == pytest.approx(4e-10, rel=1e-9)
    plain = fit_alpha_beta([(x, 25e-6 + 4e-10 * x) for x in SIZES], relative=False)
    assert plain.alpha_s == pytest.approx(25e-6, rel=1e-6)


def test_fit_with_multiplicative_noise() -> None:
    rng = random.Random(0)
    samples = [(x, (25e-6 + 4e-10 * x) * rng.uniform(0.95, 1.05)) for x in SIZES for _ in range(8)]
    fit = fit_alpha_beta(samples)
    assert fit.alpha_s == pytest.approx(25e-6, rel=0.05)
    assert fit.beta_s_per_byte == pytest.approx(4e-10, rel=0.05)


def test_fit_is_non_negative() -> None:
    # decreasing times would give a negative slope: clamp β = 0, α = (weighted) mean
    fit = fit_alpha_beta([(1e6, 1e-3), (2e6, 0.5e-3)])
    assert fit.beta_s_per_byte == 0.0 and fit.alpha_s > 0
    # a line through below the origin would give a negative intercept: clamp α = 0
    fit = fit_alpha_beta([(1e6, 1e-4), (2e6, 3e-4), (3e6, 5e-4)])
    assert fit.alpha_s == 0.0 and fit.beta_s_per_byte > 0
    # one size only: the line through the origin
    fit = fit_alpha_beta([(1e6, 1e-3), (1e6, 1e-3)])
    assert (fit.alpha_s, fit.beta_s_per_byte) == (0.0, pytest.approx(1e-9))


def test_fit_rejects_bad_samples() -> None:
    with pytest.raises(ValueError, match="at least one"):
        fit_alpha_beta([])
    with pytest.raises(ValueError, match="non-negative"):
        fit_alpha_beta([(1e6, -1.0)])


# -- profiled precedence --------------------------------------------------------------------
def _db(backend: str = "nccl", n: int = 8) -> ProfileDB:
    samples = tuple(CollectiveSample(nbytes=x, seconds=50e-6 + 1e-9 * x) for x in SIZES)
    return ProfileDB(collectives=(
        CollectiveRecord(collective="allreduce", backend=backend, link_kind="ethernet",
                         group_size=n, samples=samples),
        CollectiveRecord(collective="allgather", backend=backend, link_kind="pcie",
                         group_size=8, alpha_s=1e-3, beta_s_per_byte=0.0),
    ))


def test_profiled_fit_beats_analytic(pcie: ClusterSpec) -> None:
    m = CommModel(pcie, _db())
    cost = m.cost("allreduce", 1e8, 8, "inter")  # inter link of the preset is ethernet
    assert cost.source == "profiled"
    assert cost.seconds == pytest.approx(50e-6 + 1e-9 * 1e8, rel=1e-6)
    assert cost.seconds != pytest.approx(CommModel(pcie).time_s("allreduce", 1e8, 8, "inter"))
    # a fit stored in the DB is used as is
    assert m.time_s("allgather", 1e9, 8, "intra") == pytest.approx(1e-3)
    # nothing measured on the link kind: analytic
    assert m.cost("allreduce", 1e8, 8, LinkSpec(kind="infiniband", bandwidth_gbps=100,
                                                latency_us=1)).source == "analytic"


# -- routines a profile lacks (gloo) --------------------------------------------------------
def _gloo(pcie: ClusterSpec, **kw: int) -> CommModel:
    return CommModel(pcie, _db(backend="gloo", **kw), backend="gloo")


def test_a_routine_the_profile_lacks_takes_a_measured_upper_bound(pcie: ClusterSpec) -> None:
    # ethernet has only allreduce measured (50 µs + 1e-9 s/B at n = 8): every other routine
    # there is priced as that all-reduce, not from the link's spec
    m = _gloo(pcie)
    for routine in ("reduce", "broadcast", "reduce_scatter", "alltoall", "allgather",
                    "gather"):
        cost = m.cost(routine, 1e8, 8, "inter")
        assert cost.source == "profiled", routine
        assert cost.seconds == pytest.approx(50e-6 + 1e-9 * 1e8, rel=1e-6), routine
        assert f"allreduce standing in for {routine}" in cost.detail
        # the spec's line is cheaper than the measured one it stands beside
        assert CommModel(pcie).time_s(routine, 1e8, 8, "inter") < 0.5 * cost.seconds
    # p2p has no stand-in: a pipeline's hand-over is not a collective
    assert m.cost("p2p", 1e8, 2, "inter").source == "analytic"
    # what the profile measured is its own line, never a stand-in
    assert "standing in" not in m.cost("allreduce", 1e8, 8, "inter").detail


def test_a_gather_prefers_the_measured_allgather(pcie: ClusterSpec) -> None:
    # pcie has allgather measured (1 ms flat at n = 8) but no allreduce
    m = _gloo(pcie)
    gather = m.alpha_beta("gather", 8, "intra")
    assert (gather.alpha_s, gather.beta_s_per_byte) == (pytest.approx(1e-3), 0.0)
    assert "allgather standing in for gather" in gather.detail
    # the others have no measured stand-in on pcie (allreduce is not measured there)
    assert m.cost("reduce", 1e6, 8, "intra").source == "analytic"


def test_a_stand_in_is_rescaled_as_its_own_routine(pcie: ClusterSpec) -> None:
    # measured at n = 8, asked at n = 4: the all-reduce's steps and factor, not the reduce's
    m = _gloo(pcie, n=8)
    line = m.alpha_beta("reduce", 4, "inter")
    assert line.alpha_s == pytest.approx(50e-6 * 6 / 14)
    assert line.beta_s_per_byte == pytest.approx(1e-9 * 1.5 / 1.75)
    assert "rescaled to n=4" in line.detail and "standing in for reduce" in line.detail
    assert line.alpha_s == m.alpha_beta("allreduce", 4, "inter").alpha_s


def test_a_measured_routine_is_never_replaced(pcie: ClusterSpec) -> None:
    db = ProfileDB(collectives=_db(backend="gloo").collectives + (
        CollectiveRecord(collective="reduce", backend="gloo", link_kind="ethernet",
                         group_size=8, alpha_s=2e-6, beta_s_per_byte=3e-12),))
    line = CommModel(pcie, db, backend="gloo").alpha_beta("reduce", 8, "inter")
    assert (line.alpha_s, line.beta_s_per_byte) == (2e-6, 3e-12)
    assert "standing in" not in line.detail


def test_a_profile_of_p2p_alone_leaves_the_collectives_analytic() -> None:
    spec = ClusterSpec.from_preset("local-cpu")
    db = ProfileDB(collectives=(CollectiveRecord(
        collective="p2p", backend="gloo", link_kind="loopback", group_size=2, alpha_s=1e-4,
        beta_s_per_byte=1e-9),))
    m = CommModel(spec, db)
    assert m.cost("p2p", 4096, 2, "intra").source == "profiled"
    for routine in ("allreduce", "reduce", "gather"):  # no stand-in measured
        assert m.cost(routine, 4096, 4, "intra").source == "analytic"


def test_nccl_keeps_the_analytic_line_for_a_routine_its_profile_lacks(
        pcie: ClusterSpec) -> None:
    m = CommModel(pcie, _db())  # nccl: allreduce measured on ethernet
    assert m.cost("allreduce", 1e8, 8, "inter").source == "profiled"
    for routine in ("reduce", "reduce_scatter", "allgather", "gather"):
        cost = m.cost(routine, 1e8, 8, "inter")
        assert cost.source == "analytic", routine
        assert cost.seconds == pytest.approx(CommModel(pcie).time_s(routine, 1e8, 8, "inter"))


def test_a_gpu_plan_from_a_partial_nccl_profile_keeps_its_analytic_routines() -> None:
    """A GPU plan made from a profile that measured only the all-reduce (older defaults, or
    ``--collectives`` narrowed) is the plan the analytic intra-node lines give it: an
    all-reduce standing in for the intra-node reduce-scatter and all-gather (half its bytes)
    would make the hierarchical path look twice as dear."""
    import hetplan

    spec = ClusterSpec.from_preset("a100-nvlink-8x8")
    partial = ProfileDB(collectives=tuple(CollectiveRecord(
        collective=c, backend="nccl", link_kind="nvlink", group_size=n, alpha_s=a,
        beta_s_per_byte=1e-9) for c, n, a in (("p2p", 2, 5e-6), ("allreduce", 32, 5e-5))))
    pins = dict(dp=32, pp=2, tp=1, zero_stage=0, micro_batch_size=2)

    def routines(db: ProfileDB) -> set[tuple[str, ...]]:
        plan = hetplan.compile("gpt-test", spec, batch_size=256, profile=db, **pins)
        assert plan.gradient_sync is not None
        return {tuple(f"{st.level}:{st.routine}" for st in s.steps)  # type: ignore[union-attr]
                for s in plan.gradient_sync.strategies.values()}

    # the intra-node reduce-scatter and all-gather priced from the spec's NVLink line: the
    # hierarchical path (priced as the measured all-reduce instead, the flat one would win)
    assert routines(partial) == {("intra:reduce_scatter", "inter:allreduce",
                                  "intra:allgather")}


def test_profiled_fit_rescaled_to_other_group_size(pcie: ClusterSpec) -> None:
    m = CommModel(pcie, _db(n=8))
    line = m.alpha_beta("allreduce", 4, "inter")
    assert line.source == "profiled" and "rescaled" in line.detail
    # α: 50 µs for 14 steps -> 6 steps; β: 1e-9 for factor 1.75 -> factor 1.5
    assert line.alpha_s == pytest.approx(50e-6 * 6 / 14)
    assert line.beta_s_per_byte == pytest.approx(1e-9 * 1.5 / 1.75)
    assert m.time_s("allreduce", 1e6, 1, "inter") == 0.0


def test_other_backend_measurements_are_ignored(pcie: ClusterSpec) -> None:
    assert CommModel(pcie, _db(backend="gloo")).cost("allreduce", 1e6, 8, "inter").source == (
        "analytic"
    )
    assert CommModel(pcie, _db(backend="gloo"), backend="gloo").cost(
        "allreduce", 1e6, 8, "inter").source == "profiled"


# -- hierarchical ---------------------------------------------------------------------------
def test_hierarchical_by_hand(pcie: ClusterSpec) -> None:
    m = CommModel(pcie)
    M = 100e6
    intra_b, inter_b = 126e9 / 8, 25e9 / 8
    expected = (
        (7 * 3e-6 + 7 / 8 * M / intra_b)  # intra reduce-scatter
        + (14 * 25e-6 + 2 * 7 / 8 * M / inter_b)  # inter allreduce, full M per NIC
        + (7 * 3e-6 + 7 / 8 * M / intra_b)  # intra allgather
    )
    assert m.hierarchical_allreduce_s(M, 8, 8) == pytest.approx(expected)
    cost = m.hierarchical_allreduce_cost(M, 8, 8)
    assert cost.source == "analytic" and "inter allreduce" in cost.detail
    # one node: reduce-scatter + allgather = a flat intra allreduce
    assert m.hierarchical_allreduce_s(M, 8, 1) == pytest.approx(m.time_s("allreduce", M, 8,
                                                                         "intra"))


def test_hierarchical_vs_flat_on_pcie_8x8(pcie: ClusterSpec) -> None:
    m = CommModel(pcie)
    # Up to tens of MB hierarchical wins: 14 inter + 14 intra latency steps instead of 126
    # inter steps of a flat 64-rank ring.
    for M in (64e3, 1e6, 25e6):
        assert m.hierarchical_allreduce_s(M, 8, 8) < m.time_s("allreduce", M, 64, "inter")
    # For very large messages the flat ring is bandwidth-optimal (each node's NIC carries
    # 2(n-1)/n·M either way; hierarchical adds the intra phases): within 10 %.
    flat, hier = m.time_s("allreduce", 1e9, 64, "inter"), m.hierarchical_allreduce_s(1e9, 8, 8)
    assert flat <= hier <= 1.1 * flat
    # Compressed gradients are allgathered, and allgather volume grows with the group: with
    # c compressed bytes per rank, a flat allgather over 64 ranks moves 63c through each NIC;
    # the inter phase of the hierarchical scheme (each node's 8 GPUs send c in all, as 8
    # concurrent shards sharing the NIC) moves 7c. Hierarchical wins at every size.
    for c in (1e3, 1e6, 1e8):
        flat_ag = m.time_s("allgather", 64 * c, 64, "inter")
        inter_ag = m.time_s("allgather", 8 * c, 8, "inter")
        assert inter_ag < flat_ag
        # bandwidth terms (latency removed) are in the ratio 63 : 7
        assert flat_ag - 63 * 25e-6 == pytest.approx(9 * (inter_ag - 7 * 25e-6))


def test_profiled_hierarchical_source(pcie: ClusterSpec) -> None:
    samples = tuple(CollectiveSample(nbytes=x, seconds=1e-5 + 1e-10 * x) for x in SIZES)
    recs = tuple(
        CollectiveRecord(collective=c, backend="nccl", link_kind=k,  # type: ignore[arg-type]
                         group_size=8, samples=samples)
        for c, k in (("reduce_scatter", "pcie"), ("allgather", "pcie"),
                     ("allreduce", "ethernet"))
    )
    m = CommModel(pcie, ProfileDB(collectives=recs))
    assert m.hierarchical_allreduce_cost(1e8, 8, 8).source == "profiled"
    assert m.hierarchical_allreduce_s(1e8, 8, 8) == pytest.approx(3 * (1e-5 + 1e-10 * 1e8))


# -- properties -----------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(
    collective=st.sampled_from(COLLECTIVES),
    n=st.integers(1, 1024),
    nbytes=st.floats(0, 1e11),
    bw=st.floats(1e6, 1e12),
    more=st.floats(1.0, 100.0),
    lat=st.floats(0, 1e-3),
)
def test_more_bandwidth_never_increases_time(
    collective: str, n: int, nbytes: float, bw: float, more: float, lat: float
) -> None:
    assert analytic_time_s(collective, nbytes, n, bw * more, lat) <= analytic_time_s(
        collective, nbytes, n, bw, lat)
    slow = LinkSpec(kind="ethernet", bandwidth_gbps=bw * 8 / 1e9, latency_us=lat * 1e6)
    fast = LinkSpec(kind="ethernet", bandwidth_gbps=bw * more * 8 / 1e9, latency_us=lat * 1e6)
    m = CommModel(ClusterSpec.from_preset("v100-pcie-8x8"))
    assert m.time_s(collective, nbytes, n, fast) <= m.time_s(collective, nbytes, n, slow)


@settings(max_examples=200, deadline=None)
@given(
    collective=st.sampled_from(COLLECTIVES),
    n=st.integers(1, 1024),
    a=st.floats(0, 1e10),
    b=st.floats(0, 1e10),
    link=st.sampled_from(["intra", "inter"]),
)
def test_monotonic_in_bytes(
    collective: str, n: int, a: float, b: float, link: Literal["intra", "inter"]
) -> None:
    m = CommModel(ClusterSpec.from_preset("v100-pcie-8x8"), _db())
    lo, hi = sorted((a, b))
    assert m.time_s(collective, lo, n, link) <= m.time_s(collective, hi, n, link)


def test_hot_path_builds_each_line_once(
    pcie: ClusterSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the hot path is a dict lookup and one multiply-add: the line of a key is built (fitted or
    # derived from the spec) on its first use only; its speed is measured in bench/
    m = CommModel(pcie, _db())
    built: list[tuple[str, int, object]] = []
    build = m._build_line

    def counting(collective: str, group_size: int, link: LinkRef) -> AlphaBeta:
        built.append((collective, group_size, link))
        return build(collective, group_size, link)

    monkeypatch.setattr(m, "_build_line", counting)
    times = [m.time_s("allreduce", float(i), 8, "inter") for i in range(1_000)]
    times += [m.time_s("allgather", float(i), 4, "intra") for i in range(1_000)]
    assert built == [("allreduce", 8, "inter"), ("allgather", 4, "intra")]
    line = m.alpha_beta("allreduce", 8, "inter")
    assert times[:1_000] == [line.time_s(float(i)) for i in range(1_000)]


def test_alpha_beta_line() -> None:
    line = AlphaBeta(1e-5, 1e-9)
    assert line.time_s(1e6) == pytest.approx(1e-5 + 1e-3)
    assert line.time_s(0) == 0.0 and line.source == "analytic"


def test_the_link_kinds_a_profile_left_analytic_are_named() -> None:
    """A profile of one machine (loopback) used for cpu-2x2-slow, whose nodes talk over
    ethernet: the plan's warning said 'comm: analytic, profiled; measure them with `hetplan
    profile`', which the user had just done; it now names the link kind the profile lacks."""
    import hetplan

    spec = ClusterSpec.from_preset("cpu-2x2-slow")
    db = ProfileDB(collectives=tuple(
        CollectiveRecord(collective=c, backend="gloo", link_kind="loopback", group_size=n,
                         alpha_s=1e-4, beta_s_per_byte=1e-9)
        for c in ("allreduce", "allgather") for n in (2, 4)))
    m = CommModel(spec, db)
    assert m.unprofiled_link_kinds() == []
    m.cost("allreduce", 1e6, 2, "intra")
    assert m.unprofiled_link_kinds() == []  # loopback is measured
    m.cost("allreduce", 1e6, 2, "inter")
    assert m.unprofiled_link_kinds() == ["ethernet"]
    assert CommModel(spec).unprofiled_link_kinds() == []  # no profile: nothing to name
    plan = hetplan.compile("mlp", spec, batch_size=8, dp=4, profile=db)
    detail = plan.provenance["comm"].detail
    assert "no gloo collectives on ethernet links" in detail
    assert "hetplan profile --link-kind ethernet" in detail
