"""Shamir sharing of scalars mod l (``tally.secagg.shamir``): any t holders rebuild a secret,
fewer fit every secret alike, wrong shares are decoded around, bad input is refused."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tally.secagg import shamir
from tally.secagg.shamir import SHARE_BYTES, P

SECRETS = st.lists(st.integers(0, P - 1), min_size=1, max_size=4)


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


@settings(max_examples=40, deadline=None)
@given(SECRETS, st.data())
def test_any_t_holders_reconstruct(secrets, data):
    holders = data.draw(st.lists(st.integers(1, 5000), min_size=1, max_size=12, unique=True))
    t = data.draw(st.integers(1, len(holders)))
    shares = shamir.share(secrets, t, holders)
    chosen = data.draw(st.permutations(range(len(holders)))).copy()[:t]
    rebuilt = shamir.reconstruct([[holders[i] for i in chosen]] * len(secrets),
                                 [[row[i] for i in chosen] for row in shares])
    assert rebuilt == secrets


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.integers(0, P - 1), min_size=1, max_size=20), min_size=1, max_size=4),
       st.lists(st.integers(1, 100_000), min_size=1, max_size=30, unique=True))
def test_packed_evaluation_is_horner_mod_l(polynomials, xs):
    expected = [[sum(c * pow(x, d, P) for d, c in enumerate(poly)) % P for x in xs] for poly in polynomials]
    assert shamir.evaluate(polynomials, xs) == expected


@settings(max_examples=30, deadline=None)
@given(st.integers(0, P - 1), st.integers(0, P - 1), st.integers(2, 8))
def test_t_minus_one_shares_fit_every_secret(actual, candidate, t):
    """Hiding: the t - 1 shares of one secret are the values of some polynomial whose constant
    is any other candidate, so they say nothing about which it is."""
    xs = list(range(1, t))
    shares = shamir.share([actual], t, [*xs, t])[0][:-1]
    points = [(0, candidate), *zip(xs, shares)]
    assert all(eval_poly_through(points, x) == y for x, y in zip(xs, shares))


def test_share_bytes_round_trip_and_refuse_out_of_range():
    for value in (0, 1, P - 1):
        assert shamir.share_from_bytes(shamir.share_to_bytes(value)) == value
    with pytest.raises(ValueError, match="below the group order"):
        shamir.share_from_bytes(P.to_bytes(SHARE_BYTES, "little"))
    with pytest.raises(ValueError, match="32 bytes"):
        shamir.share_from_bytes(bytes(31))
    with pytest.raises(ValueError, match="scalar below"):
        shamir.share_to_bytes(P)


@pytest.mark.parametrize("xs, t, match", [([1, 1, 2], 2, "distinct"), ([0, 1], 1, r"\[1,"), ([1, 2], 3, "threshold")])
def test_share_validates_holders(xs, t, match):
    with pytest.raises(ValueError, match=match):
        shamir.share([5], t, xs)


def test_lagrange_coefficients_are_cached_and_interpolate_at_zero():
    shamir.lagrange_at_zero.cache_clear()
    xs = (3, 7, 11, 20)
    first = shamir.lagrange_at_zero(xs)
    assert shamir.lagrange_at_zero(xs) is first
    assert shamir.lagrange_at_zero.cache_info().hits == 1
    poly = [123, 456, 789, 1011]
    values = [sum(c * x**d for d, c in enumerate(poly)) % P for x in xs]
    assert sum(c * v for c, v in zip(first, values)) % P == 123


@settings(max_examples=15, deadline=None)
@given(st.integers(0, P - 1), st.integers(1, 5), st.integers(0, 3), st.data())
def test_decode_corrects_up_to_half_the_extra_shares(secret, t, errors, data):
    m = t + 2 * errors
    xs = list(range(1, m + 1))
    [shares] = shamir.share([secret], t, xs)
    wrong = data.draw(st.lists(st.integers(0, m - 1), max_size=errors, unique=True))
    for i in wrong:
        shares[i] = (shares[i] + data.draw(st.integers(1, P - 1))) % P
    decoded, named = shamir.decode(xs, shares, t)
    assert decoded == secret and named == {xs[i] for i in wrong}


def test_decode_refuses_too_many_wrong_shares():
    xs = list(range(1, 6))
    [shares] = shamir.share([42], 3, xs)
    shares[0], shares[1] = (shares[0] + 1) % P, (shares[1] + 2) % P  # 2 errors, 1 correctable
    with pytest.raises(ValueError, match="wrong shares"):
        shamir.decode(xs, shares, 3)
