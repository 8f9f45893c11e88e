import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tally.secagg import params as params_module
from tally.secagg.graph import HararyGraph
from tally.secagg.params import (
    MIN_HARARY_N,
    GraphParams,
    ThreatModel,
    UnsafeParameters,
    choose_params,
    validate_params,
)

DEFAULT = ThreatModel()
SEEDS = st.binary(min_size=32, max_size=32)


@st.composite
def graphs(draw):
    n = draw(st.integers(min_value=2, max_value=300))
    k = draw(st.sampled_from(sorted({n - 1, *range(2, n - 1, 2)})))
    return n, k, draw(SEEDS)


def adjacency(g: HararyGraph) -> np.ndarray:
    adj = np.zeros((g.n, g.n), dtype=bool)
    for i in range(g.n):
        adj[i, g.neighbours(i)] = True
    return adj


@given(graphs())
def test_graph_is_symmetric_k_regular_without_self_loops(case):
    n, k, seed = case
    g = HararyGraph(n, k, seed)
    adj = adjacency(g)
    assert (adj == adj.T).all()
    assert (adj.sum(axis=1) == k).all()
    assert not adj.diagonal().any()
    for i in range(n):
        nb = g.neighbours(i)
        assert (np.diff(nb) > 0).all()


@given(graphs())
def test_graph_is_determined_by_seed(case):
    n, k, seed = case
    a, b = HararyGraph(n, k, seed), HararyGraph(n, k, seed)
    assert all((a.neighbours(i) == b.neighbours(i)).all() for i in range(n))


@given(st.integers(min_value=20, max_value=500), SEEDS, SEEDS)
def test_different_seeds_give_different_graphs(n, s1, s2):
    if s1 == s2:
        return
    assert (adjacency(HararyGraph(n, 4, s1)) != adjacency(HararyGraph(n, 4, s2))).any()


def test_full_graph_neighbours_are_everyone_else():
    g = HararyGraph(6, 5, bytes(32))
    assert g.full
    assert g.neighbours(2).tolist() == [0, 1, 3, 4, 5]


@pytest.mark.parametrize(
    "n,k,seed",
    [(1, 1, bytes(32)), (10, 3, bytes(32)), (10, 10, bytes(32)), (10, 0, bytes(32)), (10, 4, b"x")],
)
def test_graph_rejects_bad_shapes(n, k, seed):
    with pytest.raises(ValueError):
        HararyGraph(n, k, seed)


@pytest.mark.parametrize("n", [10, 100, 1000, 10000, 100000])
def test_choose_params_is_feasible_and_validates(n):
    p = choose_params(n, DEFAULT)
    validate_params(p, DEFAULT)
    assert 2 <= p.t <= p.k <= n - 1
    assert p.full == (n < MIN_HARARY_N)
    if not p.full:
        assert p.k % 2 == 0
        assert 2 * p.t > p.k  # malicious server: key and seed share sets must overlap


def test_degree_grows_slowly():
    ks = [choose_params(n, DEFAULT).k for n in (1000, 10000, 100000)]
    assert ks == sorted(ks)
    assert ks[-1] < 400


def test_semi_honest_needs_lower_threshold():
    honest = choose_params(1000, dataclasses.replace(DEFAULT, malicious_server=False))
    malicious = choose_params(1000, DEFAULT)
    assert honest.k <= malicious.k and honest.t < malicious.t


def test_high_rates_need_dense_graphs_and_tiny_cohorts_are_refused():
    heavy = ThreatModel(dropout_rate=0.4, corrupt_rate=0.1)
    p = choose_params(150, heavy)
    validate_params(p, heavy)
    assert p.k > 150 // 2 > choose_params(150, DEFAULT).k
    with pytest.raises(UnsafeParameters, match="cohort too small"):
        choose_params(4, DEFAULT)
    with pytest.raises(UnsafeParameters, match="at least 2"):
        choose_params(1, DEFAULT)


@pytest.mark.parametrize(
    "threat",
    [
        dict(dropout_rate=-0.1),
        dict(corrupt_rate=1.0),
        dict(dropout_rate=0.4, corrupt_rate=0.2),  # 0.2 + 2 * 0.4 > 0.9
        dict(dropout_rate=0.5, corrupt_rate=0.5, malicious_server=False),
    ],
)
def test_threat_model_refuses_infeasible_rates(threat):
    with pytest.raises(UnsafeParameters, match=r"\d"):
        ThreatModel(**threat)


def test_threat_model_accepts_semi_honest_budget():
    ThreatModel(dropout_rate=0.4, corrupt_rate=0.2, malicious_server=False)


def test_validate_refuses_bad_overrides():
    p = choose_params(1000, DEFAULT)
    with pytest.raises(UnsafeParameters, match="even"):
        validate_params(GraphParams(1000, p.k + 1, p.t), DEFAULT)
    with pytest.raises(UnsafeParameters, match=r"t=\d+ must lie"):
        validate_params(GraphParams(1000, p.k, p.k + 1), DEFAULT)
    with pytest.raises(UnsafeParameters, match=rf"too low.*\[{p.t}, \d+\]"):
        validate_params(GraphParams(1000, p.k, p.t - 1), DEFAULT)
    with pytest.raises(UnsafeParameters, match="too high"):
        validate_params(GraphParams(1000, p.k, p.k), DEFAULT)
    with pytest.raises(UnsafeParameters, match="disconnects"):
        validate_params(GraphParams(1000, 4, 3), DEFAULT)
    with pytest.raises(UnsafeParameters, match="full graph"):
        validate_params(GraphParams(50, 10, 6), DEFAULT)


def test_validate_full_graph_rules():
    n = 20
    p = choose_params(n, DEFAULT)
    assert p == GraphParams(n, n - 1, 11)  # 2t > 19 + ceil(0.05 * 20)
    with pytest.raises(UnsafeParameters, match="too low"):
        validate_params(GraphParams(n, n - 1, 10), DEFAULT)
    with pytest.raises(UnsafeParameters, match="too high"):
        validate_params(GraphParams(n, n - 1, 18), DEFAULT)  # > 19 - ceil(0.1 * 20)
    validate_params(GraphParams(n, n - 1, 17), DEFAULT)


def test_chosen_threshold_survives_random_dropout():
    n = 1000
    p = choose_params(n, DEFAULT)
    g = HararyGraph(n, p.k, bytes(range(32)))
    neighbours = np.stack([g.neighbours(i) for i in range(n)])
    rng = np.random.default_rng(1234)
    dropouts = int(DEFAULT.dropout_rate * n)
    for _ in range(200):
        alive = np.ones(n, dtype=bool)
        alive[rng.choice(n, dropouts, replace=False)] = False
        assert alive[neighbours].sum(axis=1).min() >= p.t


@given(graphs())
def test_graph_table_rows_are_the_neighbourhoods(case):
    n, k, seed = case
    g = HararyGraph(n, k, seed)
    table = g.table()
    assert table.shape == (n, k)
    for i in range(n):
        assert np.array_equal(table[i], g.neighbours(i))


@given(graphs(), st.data())
def test_server_neighbourhood_lookups_match_the_graph(case, data):
    """The server's tabulated neighbourhoods, its UnmaskRequest survivor lists, the owners each
    Unmask answer must name and its dropouts-with-a-surviving-neighbour equal the per-device
    computation they replace."""
    from tally.secagg import unmask
    from tally.secagg.config import SessionConfig
    from tally.secagg.messages import SessionRef, SumSpec

    n, k, seed = case
    if n < 3:
        return
    t = max(1, k // 2)
    config = SessionConfig(SessionRef("j", 0, "s"), (SumSpec("x", 4, 8),), GraphParams(n, k, t), seed,
                           identities=tuple(bytes([i % 256, i // 256]) + bytes(30) for i in range(n)))
    assert config.neighbour_table is not None and not config.neighbour_table.flags.writeable
    for i in range(1, n + 1):
        assert np.array_equal(config.neighbours(i), g_neighbours := config.graph.neighbours(i - 1) + 1)
        assert i not in g_neighbours.tolist()
    alive = data.draw(st.sets(st.integers(1, n), min_size=1))
    survivors = tuple(sorted(alive))
    is_survivor = unmask.indicator(n, alive)
    dropped = frozenset(range(1, n + 1)) - alive
    row_of = np.arange(n + 1) * 10  # any distinct rows
    expect = unmask.expected_answers(config, list(survivors), is_survivor,
                                     unmask.indicator(n, dropped), row_of)
    for i in survivors:
        neighbours = [int(j) for j in config.graph.neighbours(i - 1) + 1]
        seeds = sorted(j for j in neighbours if j in alive)
        keys = sorted(j for j in neighbours if j in dropped)
        assert list(expect.status(i)) == sorted([i, *seeds])
        got_seeds, got_keys, rows = expect.of(i)
        assert (list(got_seeds), list(got_keys)) == (seeds, keys)
        assert rows.tolist() == [10 * j for j in seeds + keys]
    needed = unmask.with_surviving_neighbour(config, dropped, is_survivor)
    assert needed == {j for j in dropped if any(int(i) in alive for i in config.graph.neighbours(j - 1) + 1)}
    # A cohort too large to tabulate computes the same rows for just the devices asked about.
    subset = np.asarray(survivors, dtype=np.int64)
    assert np.array_equal(config.graph.rows(subset - 1) + 1, config.neighbour_table[subset])


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 3000), corrupt=st.floats(0.0, 0.2), dropout=st.floats(0.0, 0.3))
def test_a_malicious_server_threshold_overlaps_beyond_the_corrupt_neighbours(n, corrupt, dropout):
    """The consistency check's argument (tally/secagg/client.py) needs 2t > k + c, c the corrupt
    neighbours a device may have: at least the expected share of corrupt devices among its k (the
    finder's 2^-40 tail bound is higher still; the full graph rounds the count up)."""
    threat = ThreatModel(dropout_rate=dropout, corrupt_rate=corrupt)
    try:
        p = choose_params(n, threat)
    except UnsafeParameters:
        return
    # Counts as the finder takes them: float noise below 1e-9 device is no device.
    expected_corrupt = math.ceil(round(corrupt * n, 9)) if p.full else math.floor(round(corrupt * p.k, 9))
    assert 2 * p.t > p.k + expected_corrupt


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_the_hypergeometric_tails_agree_with_scipy(data):
    """The tails are computed with lgamma (the aggregator's image has no scipy); scipy.stats, in
    the test environment, is the reference, edge cases included (no successes, all successes,
    a sample larger than the failures, a sample of 0)."""
    from scipy.stats import hypergeom

    n = data.draw(st.integers(1, 3000))
    successes = data.draw(st.integers(0, n))
    k = data.draw(st.integers(0, n))
    log_gt, log_lt = params_module._log_tails(n, successes, k)
    logpmf = hypergeom.logpmf(np.arange(k + 1), n, successes, k)
    ge = np.logaddexp.accumulate(logpmf[::-1])[::-1]
    le = np.logaddexp.accumulate(logpmf)
    for ours, reference in ((log_gt, np.append(ge[1:], -np.inf)), (log_lt, np.insert(le[:-1], 0, -np.inf))):
        assert np.array_equal(np.isfinite(ours), np.isfinite(reference))
        finite = np.isfinite(reference)
        assert np.allclose(ours[finite], reference[finite], rtol=1e-9, atol=1e-9)
