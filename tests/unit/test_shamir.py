import os
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tally.secagg import shamir
from tally.secagg.shamir import CHUNKS, SHARE_BYTES, P

SECRETS = st.lists(st.binary(min_size=32, max_size=32), min_size=1, max_size=5)


def eval_poly_through(points: list[tuple[int, int]], x: int) -> int:
    """Value at x of the unique polynomial of degree < len(points) through points (mod P)."""
    total = 0
    for i, (xi, yi) in enumerate(points):
        num = den = 1
        for j, (xj, _) in enumerate(points):
            if j != i:
                num = num * (x - xj) % P
                den = den * (xi - xj) % P
        total = (total + yi * num * pow(den, -1, P)) % P
    return total


@given(SECRETS)
def test_field_round_trip(secrets):
    field = shamir.secrets_to_field(secrets)
    assert field.shape == (len(secrets), CHUNKS) and field.dtype == np.uint64
    assert (field[:, :-1] < 2**30).all() and (field[:, -1] < 2**16).all()
    assert shamir.field_to_secrets(field) == secrets


@given(SECRETS)
def test_chunks_are_the_secrets_bits_in_little_endian_order(secrets):
    field = shamir.secrets_to_field(secrets)
    for secret, chunks in zip(secrets, field.tolist()):
        value = int.from_bytes(secret, "little")
        assert chunks == [(value >> (30 * i)) & (2**30 - 1) for i in range(CHUNKS)]


def test_field_edge_values():
    secrets = [bytes(32), b"\xff" * 32]
    assert shamir.secrets_to_field(secrets)[1].tolist() == [2**30 - 1] * 8 + [2**16 - 1]
    assert shamir.field_to_secrets(shamir.secrets_to_field(secrets)) == secrets


@given(SECRETS, st.data())
@settings(max_examples=50)
def test_any_t_holders_reconstruct(secrets, data):
    holders = data.draw(st.integers(min_value=1, max_value=30))
    t = data.draw(st.integers(min_value=1, max_value=holders))
    xs = np.array(
        data.draw(st.lists(st.integers(1, P - 1), min_size=holders, max_size=holders, unique=True))
    )
    shares = shamir.share(secrets, t, xs)
    assert shares.shape == (len(secrets), holders, CHUNKS) and (shares < P).all()
    picks = [data.draw(st.permutations(range(holders)))[:t] for _ in secrets]
    got = shamir.reconstruct(
        [tuple(xs[p].tolist()) for p in picks], [shares[s, p] for s, p in enumerate(picks)]
    )
    assert got == secrets


@given(st.binary(min_size=32, max_size=32), st.binary(min_size=32, max_size=32), st.integers(2, 8))
@settings(max_examples=30)
def test_t_minus_one_shares_fit_every_secret(actual, candidate, t):
    """Perfect secrecy: t-1 shares plus any claimed secret complete a valid sharing of it."""
    xs = np.arange(1, t + 1)
    shares = shamir.share([actual], t, xs)[0]
    seen = [(int(x), shares[h]) for h, x in enumerate(xs[:-1])]
    wanted = shamir.secrets_to_field([candidate])[0]
    forged = np.array(
        [
            eval_poly_through([(0, int(wanted[c]))] + [(x, int(s[c])) for x, s in seen], t)
            for c in range(CHUNKS)
        ],
        dtype=np.uint64,
    )
    got = shamir.reconstruct([tuple(xs.tolist())], [np.vstack([s for _, s in seen] + [forged])])
    assert got == [candidate]


def test_t_minus_one_shares_do_not_reconstruct():
    t = 5
    secrets = [os.urandom(32) for _ in range(200)]
    shares = shamir.share(secrets, t, np.arange(1, t + 1))
    recovered = 0
    for s, secret in enumerate(secrets):
        try:
            recovered += shamir.reconstruct([(1, 2, 3, 4)], [shares[s, : t - 1]]) == [secret]
        except ValueError:  # out-of-range chunk: the usual outcome
            pass
    assert recovered == 0


def test_inconsistent_shares_are_detected():
    shares = shamir.share([os.urandom(32) for _ in range(100)], 3, np.arange(1, 4))
    # A random (not a structured) error: the reconstructed chunks become uniform in GF(p).
    shares[:, 0, :] = np.random.default_rng(3).integers(0, P, size=(100, CHUNKS), dtype=np.uint64)
    failures = 0
    for s in range(100):
        try:
            shamir.reconstruct([(1, 2, 3)], [shares[s]])
        except ValueError:
            failures += 1
    assert failures == 100


def test_share_bytes_round_trip():
    shares = shamir.share([os.urandom(32)], 3, np.arange(1, 6))[0]
    for h in range(5):
        b = shamir.share_to_bytes(shares[h])
        assert len(b) == SHARE_BYTES
        assert (shamir.share_from_bytes(b) == shares[h]).all()
    with pytest.raises(ValueError):
        shamir.share_from_bytes(b[:-1])
    with pytest.raises(ValueError):
        shamir.share_from_bytes(b"\xff" * SHARE_BYTES)  # 2^32 - 1 >= P
    with pytest.raises(ValueError):
        shamir.share_to_bytes(np.full(CHUNKS, P, dtype=np.uint64))


@pytest.mark.parametrize(
    "secrets,t,xs",
    [
        ([bytes(31)], 2, [1, 2]),
        ([bytes(32)], 0, [1, 2]),
        ([bytes(32)], 3, [1, 2]),
        ([bytes(32)], 2, [1, 1]),
        ([bytes(32)], 2, [0, 1]),
        ([bytes(32)], 2, [1, P]),
    ],
)
def test_share_validates(secrets, t, xs):
    with pytest.raises(ValueError):
        shamir.share(secrets, t, np.array(xs))


def test_reconstruct_validates():
    shares = shamir.share([bytes(32)], 2, np.arange(1, 3))[0]
    with pytest.raises(ValueError):
        shamir.reconstruct([(1, 2)], [])
    with pytest.raises(ValueError):
        shamir.reconstruct([(1, 2, 3)], [shares])
    with pytest.raises(ValueError):
        shamir.reconstruct([(1, 1)], [shares])


def test_lagrange_cache_hits_and_values():
    xs = (3, 7, 11, 20)
    before = shamir.lagrange_at_zero.cache_info().hits
    first = shamir.lagrange_at_zero(xs)
    assert shamir.lagrange_at_zero(xs) is first
    assert shamir.lagrange_at_zero.cache_info().hits == before + 1
    assert not first.flags.writeable
    # Interpolating x -> x^3 + 5 at zero gives 5.
    values = [(x**3 + 5) % P for x in xs]
    assert sum(int(c) * v for c, v in zip(first, values)) % P == 5


def test_full_graph_reconstruction_reuses_cached_set():
    secrets = [os.urandom(32) for _ in range(50)]
    xs = np.arange(1, 41)
    shares = shamir.share(secrets, 30, xs)
    holders = tuple(range(5, 35))
    before = shamir.lagrange_at_zero.cache_info()
    got = shamir.reconstruct([holders] * 50, [shares[s, 4:34] for s in range(50)])
    after = shamir.lagrange_at_zero.cache_info()
    assert got == secrets
    assert after.hits + after.misses == before.hits + before.misses + 1


@pytest.mark.parametrize("repeats", [0, 1, 500])
def test_batch_of_holder_sets_is_correct(repeats):
    """All-distinct sets (the hashed fast path), one repeated set among them, and mostly repeats
    (both exact deduplication paths) rebuild the same secrets."""
    n_secrets, holders, t = 1000, 100, 60
    secrets = [os.urandom(32) for _ in range(n_secrets)]
    xs = np.arange(1, holders + 1)
    shares = shamir.share(secrets, t, xs)
    rng = np.random.default_rng(7)
    picks = [np.sort(rng.choice(holders, t, replace=False)) for _ in range(n_secrets)]
    for s in range(1, repeats + 1):
        picks[s] = picks[0]
    sets = [tuple(xs[p].tolist()) for p in picks]
    assert len(set(sets)) == n_secrets - repeats
    arrays = [shares[s, p] for s, p in enumerate(picks)]
    assert shamir.reconstruct(sets, arrays) == secrets


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(1, 6), min_size=3, max_size=3), min_size=1, max_size=12),
       st.booleans())
def test_distinct_rows_are_exact_even_when_hashes_collide(rows, collide):
    xs = np.array(rows, dtype=np.int64)
    if collide:  # every row hashes alike: the exact check must catch it and sort the rows
        with mock.patch.object(shamir, "_SET_HASH_WEIGHTS", np.zeros(4096, dtype=np.int64)):
            distinct, index = shamir._distinct_rows(xs)
    else:
        distinct, index = shamir._distinct_rows(xs)
    assert len(distinct) == len(np.unique(xs, axis=0))
    assert np.array_equal(distinct[index.reshape(-1)], xs)


def test_mixed_thresholds_in_one_call():
    a, b = os.urandom(32), os.urandom(32)
    sa = shamir.share([a], 2, np.arange(1, 4))[0]
    sb = shamir.share([b], 3, np.arange(1, 4))[0]
    assert shamir.reconstruct([(2, 3), (1, 2, 3)], [sa[1:], sb]) == [a, b]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 2000), st.integers(1, 40), st.integers(1, 6), st.integers(0, 2**32 - 1))
def test_lagrange_by_logs_matches_products_for_unsorted_sets(n, t, sets, seed):
    """The signed-logarithm coefficients (one table look-up per difference, sign included) equal
    the plain products, for holder sets in any order, as the server's arrival-ordered sets are."""
    t = min(t, n)
    rng = np.random.default_rng(seed)
    xs = np.stack([rng.choice(np.arange(1, n + 1), t, replace=False) for _ in range(sets)])
    xs = xs.astype(np.uint64)
    assert np.array_equal(shamir._lagrange_by_logs(xs), shamir._lagrange_by_products(xs))


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([1, 2, 3, 52, 200, 5000]), st.integers(0, 2**32 - 1))
def test_combine_is_the_sum_of_products_mod_p(t, seed):
    """Coefficients below p times shares anywhere below 2^32 (out-of-field ones included), in
    parts that never wrap uint64: the exact sum mod p, which Python integers compute directly."""
    rng = np.random.default_rng(seed)
    lam = rng.integers(0, P, (2, t), dtype=np.uint64)
    shares = rng.integers(0, 2**32, (2, t, CHUNKS), dtype=np.uint64)
    shares[0, 0, 0] = 2**32 - 1
    lam[0, 0] = P - 1
    got = shamir._combine(lam, shares)
    for s in range(2):
        for c in range(CHUNKS):
            want = sum(int(a) * int(b) for a, b in zip(lam[s], shares[s, :, c])) % P
            assert int(got[s, c]) == want
