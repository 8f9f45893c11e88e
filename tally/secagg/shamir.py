"""Shamir sharing of secret scalars mod l, the prime order of edwards25519's base point.

The secrets (a device's mask key, as the scalar that stands for its X25519 key, and its self-mask
seed) are scalars of the group they are committed in, so a linear check on the shares can be
carried over to the commitments (``tally.secagg.sharecheck``): sharing them in any other field
would leave nothing that ties the constant term to what the dealer signed.

Arithmetic is Python's integers. The dealer evaluates its few polynomials at its holders with all
of them packed into one integer per coefficient (holder coordinates are small, so Horner's
products never need reducing until the end); rebuilding is one Lagrange combination per secret,
with the coefficients of a holder set cached (full-graph sums reuse them).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Sequence

from tally.secagg.crypto import GROUP_ORDER, random_scalar

P = GROUP_ORDER
SHARE_BYTES = 32


def holder_coordinates(xs: Sequence[int], t: int) -> list[int]:
    """Validated x-coordinates of one sharing's holders: distinct, in [1, p), at least ``t``."""
    x = [int(v) for v in xs]
    if any(v < 1 or v >= P for v in x):
        raise ValueError(f"holder x-coordinates must lie in [1, {P})")
    if len(set(x)) != len(x):
        raise ValueError("holder x-coordinates must be distinct")
    if not 1 <= t <= len(x):
        raise ValueError(f"threshold t={t} must lie in [1, {len(x)}] (the number of holders)")
    return x


def polynomials(secrets: Sequence[int], t: int,
                entropy: Callable[[int], bytes] = os.urandom) -> list[list[int]]:
    """Coefficients, constant term first: each secret gets a random polynomial of degree t - 1
    whose value at 0 is the secret. Kept whole so the dealer can publish a check polynomial."""
    if t < 1:
        raise ValueError("the threshold must be at least 1")
    return [[int(s) % P] + [random_scalar(entropy) for _ in range(t - 1)] for s in secrets]


def evaluate(coefficients: Sequence[Sequence[int]], xs: Sequence[int]) -> list[list[int]]:
    """Values of each polynomial at each of the points ``xs`` (small positive integers):
    out[polynomial][holder]. One Horner pass per point over all polynomials packed side by side
    in one integer, each in a slot wide enough for its unreduced value."""
    if not coefficients:
        return []
    degree = max(len(c) for c in coefficients)
    top = max((int(x) for x in xs), default=1)
    width = P.bit_length() + (degree - 1) * top.bit_length() + degree.bit_length() + 1
    packed = [sum((c[d] if d < len(c) else 0) << (width * i) for i, c in enumerate(coefficients))
              for d in range(degree)]
    mask = (1 << width) - 1
    out: list[list[int]] = [[] for _ in coefficients]
    for x in xs:
        acc = 0
        for coefficient in reversed(packed):
            acc = acc * x + coefficient
        for i, row in enumerate(out):
            row.append(((acc >> (width * i)) & mask) % P)
    return out


def share(secrets: Sequence[int], t: int, xs: Sequence[int]) -> list[list[int]]:
    """Shares of each secret for each holder: out[secret][holder]; any t of them recover it."""
    return evaluate(polynomials(secrets, t), holder_coordinates(xs, t))


def share_to_bytes(value: int) -> bytes:
    if not 0 <= value < P:
        raise ValueError(f"a share is a scalar below {P}")
    return value.to_bytes(SHARE_BYTES, "little")


def share_from_bytes(raw: bytes) -> int:
    if len(raw) != SHARE_BYTES:
        raise ValueError(f"a share is {SHARE_BYTES} bytes, got {len(raw)}")
    value = int.from_bytes(raw, "little")
    if value >= P:
        raise ValueError("share is not below the group order")
    return value


@functools.lru_cache(maxsize=4096)
def lagrange_at_zero(xs: tuple[int, ...]) -> tuple[int, ...]:
    """Coefficients recovering f(0) from f at ``xs``: prod_{j != i} x_j / (x_j - x_i). The products
    are exact integers (the coordinates are small); one modular inversion serves them all."""
    holder_coordinates(xs, len(xs))
    total = math.prod(xs)
    numerators = [total // xi % P for xi in xs]
    denominators = [math.prod([xj - xi for xj in xs if xj != xi]) % P for xi in xs]
    # Batch inversion: prefix products, one inverse, then back down.
    prefix = [1]
    for d in denominators:
        prefix.append(prefix[-1] * d % P)
    inverse = pow(prefix[-1], -1, P)
    out = [0] * len(xs)
    for i in range(len(xs) - 1, -1, -1):
        out[i] = numerators[i] * inverse * prefix[i] % P
        inverse = inverse * denominators[i] % P
    return tuple(out)


def reconstruct(xs_list: Sequence[Sequence[int]], shares: Sequence[Sequence[int]]) -> list[int]:
    """One secret per entry from its holders' x-coordinates and their shares (all are used: pass
    exactly the t holders chosen). Any values rebuild some scalar: callers that face tampering
    check it against its commitment, and ``decode`` around wrong shares."""
    if len(xs_list) != len(shares):
        raise ValueError(f"{len(xs_list)} holder sets for {len(shares)} share lists")
    out = []
    for xs, values in zip(xs_list, shares):
        key = tuple(int(x) for x in xs)
        if len(values) != len(key) or not key:
            raise ValueError("expected one share per holder, t >= 1")
        out.append(sum(c * int(v) for c, v in zip(lagrange_at_zero(key), values)) % P)
    return out


def decode(xs: Sequence[int], shares: Sequence[int], t: int) -> tuple[int, frozenset[int]]:
    """The secret behind ``shares`` held at ``xs`` when at most (m - t) // 2 of them are wrong,
    and the holders whose shares were wrong (Berlekamp-Welch).

    Shamir shares are a Reed-Solomon codeword, so m >= t + 2e shares correct e errors whatever
    the wrong values are. Raises ValueError when no polynomial of degree < t agrees with all but
    (m - t) // 2 shares: too many wrong shares to decode around.
    """
    x = [int(v) for v in xs]
    y = [int(v) % P for v in shares]
    m = len(x)
    if len(y) != m or len(set(x)) != m or not 1 <= t <= m:
        raise ValueError("need m >= t distinct holders with one share each")
    errors = (m - t) // 2
    poly = _berlekamp_welch(x, y, t, errors)
    wrong = frozenset(xi for xi, yi in zip(x, y) if _evaluate(poly, xi) != yi)
    if len(wrong) > errors:
        raise ValueError(f"{len(wrong)} wrong shares among {m}: at most {errors} can be corrected")
    return poly[0], wrong


def _evaluate(poly: Sequence[int], x: int) -> int:
    acc = 0
    for coefficient in reversed(poly):
        acc = (acc * x + coefficient) % P
    return acc


def _berlekamp_welch(x: list[int], y: list[int], t: int, errors: int) -> list[int]:
    """Coefficients (low to high) of the degree < t polynomial through all but ``errors`` of the
    points: solve Q(x_i) = y_i E(x_i) for Q of degree < t + errors and monic E of degree
    ``errors``; then P = Q / E."""
    rows = []
    for xi, yi in zip(x, y):
        powers = [pow(xi, j, P) for j in range(t + errors + 1)]
        rows.append(powers[: t + errors] + [(P - yi) * powers[j] % P for j in range(errors)]
                    + [yi * powers[errors] % P])
    solution = _solve(rows, t + 2 * errors)
    if solution is None:
        raise ValueError("too many wrong shares to decode")
    q = solution[: t + errors]
    e = solution[t + errors :] + [1]
    quotient = [0] * (len(q) - errors)
    for i in range(len(quotient) - 1, -1, -1):
        coefficient = q[i + errors]
        quotient[i] = coefficient
        for j, d in enumerate(e):
            q[i + j] = (q[i + j] - coefficient * d) % P
    if any(q[:errors]) or any(quotient[t:]):  # E does not divide Q, or P has degree >= t
        raise ValueError("too many wrong shares to decode")
    return quotient[:t]


def _solve(augmented: list[list[int]], cols: int) -> list[int] | None:
    """One solution of the system whose rows are [coefficients..., rhs] mod p (free variables
    0); None if there is none."""
    a = [row[:] for row in augmented]
    pivots: list[int] = []
    r = 0
    for c in range(cols):
        pivot = next((i for i in range(r, len(a)) if a[i][c]), None)
        if pivot is None:
            continue
        a[r], a[pivot] = a[pivot], a[r]
        inverse = pow(a[r][c], -1, P)
        a[r] = [v * inverse % P for v in a[r]]
        for i in range(len(a)):
            if i != r and a[i][c]:
                factor = a[i][c]
                a[i] = [(v - factor * w) % P for v, w in zip(a[i], a[r])]
        pivots.append(c)
        r += 1
        if r == len(a):
            break
    if any(row[cols] for row in a[r:]):
        return None
    solution = [0] * cols
    for row, c in enumerate(pivots):
        solution[c] = a[row][cols]
    return solution
