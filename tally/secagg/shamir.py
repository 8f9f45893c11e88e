"""Vectorised Shamir sharing of 32-byte secrets (X25519 private keys, self-mask seeds).

The field is GF(2^31 - 1): a product of two elements fits in uint64, so sharing and
reconstruction are plain numpy arithmetic over all secrets, holders and chunks at once. A secret
is cut into 9 chunks (8 of 30 bits, one of 16) and every chunk gets its own random polynomial, so
fewer than t shares reveal nothing about any chunk.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import numpy as np

P = 2**31 - 1
CHUNKS = 9
SHARE_BYTES = 4 * CHUNKS
SECRET_BYTES = 32

_CHUNK_BITS = 30
_LAST_CHUNK_BITS = 8 * SECRET_BYTES - _CHUNK_BITS * (CHUNKS - 1)  # 16
_CHUNK_LIMITS = np.array([1 << _CHUNK_BITS] * (CHUNKS - 1) + [1 << _LAST_CHUNK_BITS], np.uint64)
_P = np.uint64(P)
# Below this many distinct holder sets per reconstruction, the per-set cache is cheaper than a
# batch computation; above it, sets are the all-different SecAgg+ kind and batching wins.
_CACHED_SETS_MAX = 8


# Chunk i holds bits [30 i, 30 i + 30) of the secret: where they sit in its four 64-bit words.
_WORD_OF = [(_CHUNK_BITS * i) // 64 for i in range(CHUNKS)]
_SHIFT_OF = [(_CHUNK_BITS * i) % 64 for i in range(CHUNKS)]
_SPILLS = [shift + (_CHUNK_BITS if i < CHUNKS - 1 else _LAST_CHUNK_BITS) > 64
           for i, shift in enumerate(_SHIFT_OF)]
_WORDS = SECRET_BYTES // 8


def secrets_to_field(secrets: Sequence[bytes]) -> np.ndarray:
    """(S, 9) uint64 chunks of 32-byte secrets, little-endian bit order."""
    for s in secrets:
        if len(s) != SECRET_BYTES:
            raise ValueError(f"secrets must be {SECRET_BYTES} bytes, got {len(s)}")
    words = np.frombuffer(b"".join(secrets), dtype="<u8").reshape(len(secrets), _WORDS)
    out = np.empty((len(secrets), CHUNKS), dtype=np.uint64)
    for i, (word, shift, spills) in enumerate(zip(_WORD_OF, _SHIFT_OF, _SPILLS)):
        chunk = words[:, word] >> np.uint64(shift)
        if spills:
            chunk |= words[:, word + 1] << np.uint64(64 - shift)
        out[:, i] = chunk & (_CHUNK_LIMITS[i] - np.uint64(1))
    return out


def field_to_secrets(arr: np.ndarray) -> list[bytes]:
    """Inverse of ``secrets_to_field``; refuses chunks that no 32-byte secret produces."""
    arr = np.asarray(arr, dtype=np.uint64)
    if arr.ndim != 2 or arr.shape[1] != CHUNKS:
        raise ValueError(f"expected shape (S, {CHUNKS}), got {arr.shape}")
    if np.any(arr >= _CHUNK_LIMITS):
        raise ValueError("value is not a valid secret chunk (inconsistent or corrupted shares?)")
    # Chunks never overlap, so OR-ing each into its word (and its spill into the next) is exact.
    words = np.zeros((len(arr), _WORDS), dtype="<u8")
    for i, (word, shift, spills) in enumerate(zip(_WORD_OF, _SHIFT_OF, _SPILLS)):
        words[:, word] |= arr[:, i] << np.uint64(shift)
        if spills:
            words[:, word + 1] |= arr[:, i] >> np.uint64(64 - shift)
    raw = words.tobytes()
    return [raw[i : i + SECRET_BYTES] for i in range(0, len(raw), SECRET_BYTES)]


def _random_field(shape: tuple[int, ...]) -> np.ndarray:
    """Uniform elements of GF(p) from the OS CSPRNG.

    31-bit draws are uniform on [0, 2^31); rejecting the single value p leaves [0, p) uniform.
    """
    count = int(np.prod(shape))
    out = np.empty(count, dtype=np.uint64)
    filled = 0
    while filled < count:
        draws = np.frombuffer(os.urandom(4 * (count - filled)), dtype="<u4") & np.uint32(P)
        draws = draws[draws != P]
        out[filled : filled + len(draws)] = draws
        filled += len(draws)
    return out.reshape(shape)


def _check_holder_sets(xs: np.ndarray) -> np.ndarray:
    """Validated (S, t) holder x-coordinates as uint64; each row must be distinct and in [1, p)."""
    xs = np.asarray(xs)
    if xs.ndim != 2 or not np.issubdtype(xs.dtype, np.integer):
        raise ValueError("holder x-coordinates must be integers")
    if np.any(xs < 1) or np.any(xs >= P):
        raise ValueError(f"holder x-coordinates must lie in [1, {P})")
    ordered = np.sort(xs, axis=1)
    if np.any(ordered[:, 1:] == ordered[:, :-1]):
        raise ValueError("holder x-coordinates must be distinct")
    return xs.astype(np.uint64)


def share(secrets: Sequence[bytes], t: int, xs: np.ndarray) -> np.ndarray:
    """Shares of each secret for each holder, (S, len(xs), 9) uint64; any t of them recover it."""
    x = holder_coordinates(xs, t)
    return evaluate(polynomials(secrets, t), x)


def holder_coordinates(xs: np.ndarray, t: int) -> np.ndarray:
    """Validated x-coordinates of one sharing's holders: distinct, in [1, p), at least ``t``."""
    if np.ndim(xs) != 1:
        raise ValueError("holder x-coordinates must be a 1-d array")
    x: np.ndarray = _check_holder_sets(np.asarray(xs)[None, :])[0]
    if not 1 <= t <= len(x):
        raise ValueError(f"threshold t={t} must lie in [1, {len(x)}] (the number of holders)")
    return x


def polynomials(secrets: Sequence[bytes], t: int) -> np.ndarray:
    """(S, t, 9) coefficients, constant term first: each chunk of each secret gets a random
    polynomial of degree t - 1 whose value at 0 is that chunk. Kept whole (rather than only
    evaluated) so the dealer can also publish a check polynomial derived from them."""
    coefficients = _random_field((len(secrets), t, CHUNKS))
    coefficients[:, 0, :] = secrets_to_field(secrets)
    return coefficients


def random_polynomials(count: int, t: int) -> np.ndarray:
    """(count, t) uniformly random polynomials of degree < t (all coefficients random)."""
    return _random_field((count, t))


def evaluate(coefficients: np.ndarray, xs: np.ndarray) -> np.ndarray:
    """Values of polynomials (..., t, C) at points ``xs`` (L,), as (..., L, C) mod p."""
    x = np.asarray(xs, dtype=np.uint64)[:, None]
    acc = np.zeros((*coefficients.shape[:-2], len(x), coefficients.shape[-1]), dtype=np.uint64)
    # Horner from the top coefficient; each step stays below 2^62 + 2^31 before the reduction.
    for d in range(coefficients.shape[-2] - 1, -1, -1):
        acc = (acc * x + coefficients[..., d, None, :]) % _P
    return acc


def share_to_bytes(arr: np.ndarray) -> bytes:
    arr = np.asarray(arr)
    if arr.shape != (CHUNKS,) or np.any(arr >= P):
        raise ValueError(f"a share is {CHUNKS} field elements below {P}")
    return arr.astype("<u4").tobytes()


def share_from_bytes(b: bytes) -> np.ndarray:
    if len(b) != SHARE_BYTES:
        raise ValueError(f"a share is {SHARE_BYTES} bytes, got {len(b)}")
    arr = np.frombuffer(b, dtype="<u4").astype(np.uint64)
    if np.any(arr >= P):
        raise ValueError(f"share element not below the field prime {P}")
    return arr


def _pow_mod(base: np.ndarray, exponent: int | np.ndarray) -> np.ndarray:
    """base^exponent mod p, elementwise; ``exponent`` a scalar or an array of base's shape."""
    result = np.ones_like(base)
    exponent = np.asarray(exponent, dtype=np.uint64).copy()
    while np.any(exponent):
        result = np.where(exponent & np.uint64(1), result * base % _P, result)
        base = base * base % _P
        exponent >>= np.uint64(1)
    return result


def _lagrange_batch(xs: np.ndarray) -> np.ndarray:
    """Interpolation-at-zero coefficients for many holder sets at once: (S, t) -> (S, t).

    lambda_i = prod_{j != i} x_j / (x_j - x_i). Holder x-coordinates are device indices, so every
    factor is a small integer: with a table of discrete logarithms the t^2 products per set
    become t^2 table look-ups and integer additions, and one exponentiation per coefficient
    (two look-ups) ends it. The table costs about as much as that many products, so it is
    built (once per process) only for batches at least as large as it; small batches and large
    coordinates take the generic t^2 products.
    """
    if xs.size and int(xs.max()) <= _LOG_TABLE_MAX and xs.size * xs.shape[1] >= _log_table_size(xs):
        return _lagrange_by_logs(xs)
    return _lagrange_by_products(xs)


def _log_table_size(xs: np.ndarray) -> int:
    return max(1 << 10, 1 << int(xs.max()).bit_length())


def _lagrange_by_products(xs: np.ndarray) -> np.ndarray:
    """t vector steps build all numerators and denominators, one Fermat inversion ends them."""
    xs = xs.astype(np.uint64)
    num = np.ones_like(xs)
    den = np.ones_like(xs)
    t = xs.shape[1]
    for j in range(t):
        xj = xs[:, j : j + 1]
        same = np.arange(t) == j
        num = num * np.where(same, np.uint64(1), xj) % _P
        den = den * np.where(same, np.uint64(1), (xj + _P - xs) % _P) % _P
    coefficients: np.ndarray = num * _pow_mod(den, P - 2) % _P
    return coefficients


# 7 generates GF(p)*, whose order p - 1 = 2 * 3^2 * 7 * 11 * 31 * 151 * 331 is smooth enough for
# Pohlig-Hellman to take the logarithms of a whole table at once.
_GENERATOR = 7
_ORDER = P - 1
_ORDER_FACTORS = (2, 9, 7, 11, 31, 151, 331)
_LOG_MINUS_ONE = _ORDER // 2
_LOG_TABLE_MAX = 1 << 17
_EXP_DIGIT_BITS = 11
# Sets of this many coefficients per vectorised block keep the (sets, t, t) look-ups in cache.
_LOG_BLOCK = 1 << 16


@functools.lru_cache(maxsize=1)
def _exp_tables() -> np.ndarray:
    """(3, 2048): g^e = t[0][e & 2047] * t[1][(e >> 11) & 2047] * t[2][e >> 22] mod p."""
    digits = np.arange(1 << _EXP_DIGIT_BITS, dtype=np.uint64)
    bases = [pow(_GENERATOR, 1 << (_EXP_DIGIT_BITS * level), P) for level in range(3)]
    return np.stack([_pow_mod(np.full(digits.size, base, dtype=np.uint64), digits) for base in bases])


def _exp(exponent: np.ndarray) -> np.ndarray:
    """g^exponent mod p for exponents in [0, p - 1)."""
    tables = _exp_tables()
    mask = (1 << _EXP_DIGIT_BITS) - 1
    low = tables[0][exponent & mask] * tables[1][(exponent >> _EXP_DIGIT_BITS) & mask] % _P
    power: np.ndarray = low * tables[2][exponent >> (2 * _EXP_DIGIT_BITS)] % _P
    return power


@functools.lru_cache(maxsize=4)
def _log_table(size: int) -> np.ndarray:
    """Discrete logarithms base g of 0..size-1 (entry 0 unused, 0), by Pohlig-Hellman."""
    values = np.arange(size, dtype=np.uint64)
    values[0] = 1
    logs = np.zeros(size, dtype=np.int64)
    for modulus in _ORDER_FACTORS:
        cofactor = _ORDER // modulus
        # x^cofactor lies in the subgroup of order `modulus`, generated by g^cofactor.
        reduced = _pow_mod(values, cofactor)
        subgroup = _pow_mod(np.full(modulus, pow(_GENERATOR, cofactor, P), dtype=np.uint64),
                            np.arange(modulus, dtype=np.uint64))
        order = np.argsort(subgroup)
        residue = order[np.searchsorted(subgroup, reduced, sorter=order)].astype(np.int64)
        # Chinese remainder: the log is residue mod `modulus` for every factor.
        weight = cofactor * pow(cofactor, -1, modulus) % _ORDER
        logs = (logs + residue * weight) % _ORDER
    logs[0] = 0
    logs = logs.astype(np.int32)  # logs lie below 2^31 - 1: half the bytes to gather
    logs.setflags(write=False)
    return logs


@functools.lru_cache(maxsize=4)
def _signed_log_table(size: int) -> np.ndarray:
    """Discrete logarithms of -(size-1)..size-1 at offset size-1, with log(-m) = log(m) + (p-1)/2
    (g^((p-1)/2) = -1) and 0 at m = 0: one look-up per difference x_j - x_i, sign included, and
    a holder's difference with itself adds nothing."""
    logs = _log_table(size).astype(np.int64)
    negative = (logs[:0:-1] + _LOG_MINUS_ONE) % _ORDER
    table = np.concatenate([negative, [0], logs[1:]]).astype(np.int32)
    table.setflags(write=False)
    return table


def _lagrange_by_logs(xs: np.ndarray) -> np.ndarray:
    s, t = xs.shape
    size = _log_table_size(xs)
    signed = _signed_log_table(size)
    x = xs.astype(np.int32)
    log_x = np.take(_log_table(size), x).astype(np.int64)
    numerators = log_x.sum(axis=1, keepdims=True) - log_x
    out = np.empty((s, t), dtype=np.uint64)
    block = max(1, _LOG_BLOCK // (t * t))
    for first in range(0, s, block):
        rows = x[first : first + block]
        # [set, i, j] = x_j - x_i at the table's offset, shifted on the (sets, t) side, not (sets, t, t).
        differences = rows[:, None, :] - (rows - (size - 1))[:, :, None]
        denominators = np.take(signed, differences).sum(axis=2, dtype=np.int64)
        out[first : first + block] = _exp((numerators[first : first + block] - denominators) % _ORDER)
    return out


@functools.lru_cache(maxsize=4096)
def lagrange_at_zero(xs: tuple[int, ...]) -> np.ndarray:
    """Coefficients recovering f(0) from f at ``xs``; cached because full-graph sums reuse sets.

    The returned array is shared by the cache and read-only.
    """
    coefficients: np.ndarray = _lagrange_batch(_check_holder_sets(np.array([xs], dtype=np.int64)))[0]
    coefficients.setflags(write=False)
    return coefficients


def _coefficients(xs: np.ndarray) -> np.ndarray:
    """(S, t) coefficients for holder sets (S, t), computing each distinct set once."""
    distinct, index = _distinct_rows(xs)
    if len(distinct) <= _CACHED_SETS_MAX:
        table = np.stack([lagrange_at_zero(tuple(row)) for row in distinct.tolist()])
    else:
        table = _lagrange_batch(_check_holder_sets(distinct))
    rows: np.ndarray = table[index.reshape(-1)]
    return rows


_SET_HASH_WEIGHTS = np.random.default_rng(0).integers(1, 1 << 62, 4096, dtype=np.int64) | 1


def _distinct_rows(xs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct rows of xs and, per row, its index among them.

    Rows are grouped by a hash and the grouping is then checked exactly (every row equals its
    group's first), so only a true hash collision pays for sorting whole rows. SecAgg+ holder
    sets are nearly all different (two owners' first t answers can coincide), full-graph sets
    nearly all alike: hashing serves both for far less than a sort of the rows.
    """
    t = xs.shape[1]
    if t <= len(_SET_HASH_WEIGHTS):
        hashes = xs.astype(np.int64, copy=False) @ _SET_HASH_WEIGHTS[:t]  # wraps mod 2^64: fine
        _, first, index = np.unique(hashes, return_index=True, return_inverse=True)
        distinct = xs[first]
        if np.array_equal(distinct[index], xs):
            return distinct, index
    distinct, index = np.unique(xs, axis=0, return_inverse=True)
    return distinct, index.reshape(-1)  # numpy 2.0.0 gave the inverse a trailing axis


def _combine(lam: np.ndarray, wide: np.ndarray) -> np.ndarray:
    """sum_i lam_i * share_i mod p per secret and chunk: (S, t) x (S, t, 9) uint64 -> (S, 9).

    Reducing every product mod p would be a division per term; instead the coefficients are cut
    into parts small enough that t products of a part and a share below 2^32 sum without
    wrapping uint64, so each part is one integer matmul and only the (S, 9) results are reduced.
    A secret with a share of 2^32 or more gets a wrapped sum, but no share outside the field
    rebuilds anything: the caller discards it.
    """
    bits = 32 - max(1, (lam.shape[1] - 1).bit_length())  # >= 1 for any t below 2^31
    out = np.zeros((len(lam), CHUNKS), dtype=np.uint64)
    mask = np.uint64((1 << bits) - 1)
    for shift in range(0, 31, bits):
        part = (lam >> np.uint64(shift)) & mask
        partial = np.matmul(part[:, None, :], wide)[:, 0] % _P
        out = (out + partial * np.uint64(pow(2, shift, P))) % _P
    return out


def reconstruct_block(xs: np.ndarray, shares: np.ndarray) -> list[bytes | None]:
    """``reconstruct_each`` for secrets that all have t holders: holder x-coordinates (S, t) and
    their shares (S, t, 9) as arrays, so a server rebuilding thousands of secrets never walks
    them one by one."""
    xs = np.asarray(xs)
    shares = np.asarray(shares)
    if xs.ndim != 2 or shares.shape != (*xs.shape, CHUNKS) or xs.shape[1] == 0:
        raise ValueError(f"expected holders (S, t) and shares (S, t, {CHUNKS}), t >= 1")
    out: list[bytes | None] = [None] * len(xs)
    if not len(xs):
        return out
    wide = shares.astype(np.uint64)
    in_field = ~np.any(wide >= _P, axis=(1, 2))
    chunks = _combine(_coefficients(xs), wide)
    valid = in_field & np.all(chunks < _CHUNK_LIMITS, axis=1)
    good = np.flatnonzero(valid).tolist()
    for i, secret in zip(good, field_to_secrets(chunks[valid]) if good else ()):
        out[i] = secret
    return out


def reconstruct(xs_list: Sequence[tuple[int, ...]], shares: Sequence[np.ndarray]) -> list[bytes]:
    """Recover one secret per entry from its holders' x-coordinates and their (t, 9) shares.

    Every secret may have its own holder set and size (SecAgg+ neighbourhoods all differ); all
    shares given are used, so pass exactly the t holders chosen. A garbage share makes every
    chunk uniform in GF(p), so some chunk falls out of its 30- or 16-bit range and ValueError is
    raised, except with probability about 2^-23. A deliberate offset can pass this range check:
    callers that face tampering check the secret against a commitment (``reconstruct_each``
    then ``decode`` around the wrong shares).
    """
    out = reconstruct_each(xs_list, shares)
    if any(secret is None for secret in out):
        raise ValueError("value is not a valid secret chunk (inconsistent or corrupted shares?)")
    return out  # type: ignore[return-value]


def reconstruct_each(
    xs_list: Sequence[tuple[int, ...]], shares: Sequence[np.ndarray]
) -> list[bytes | None]:
    """``reconstruct`` that answers None for a secret whose chunks are out of range, instead of
    failing the whole batch: one device's bad share must not stop everyone else's secret."""
    if len(xs_list) != len(shares):
        raise ValueError(f"{len(xs_list)} holder sets for {len(shares)} share arrays")
    xs_list = [tuple(int(x) for x in xs) for xs in xs_list]
    out: list[bytes | None] = [None] * len(xs_list)
    groups: dict[int, list[int]] = {}
    for i, (xs, sh) in enumerate(zip(xs_list, shares)):
        if np.shape(sh) != (len(xs), CHUNKS) or len(xs) == 0:
            raise ValueError(f"secret {i}: expected one ({CHUNKS},) share per holder, t >= 1")
        groups.setdefault(len(xs), []).append(i)
    for members in groups.values():
        block = reconstruct_block(
            np.array([xs_list[i] for i in members], dtype=np.int64),
            np.stack([np.asarray(shares[i], dtype=np.uint64) for i in members]),
        )
        for i, secret in zip(members, block):
            out[i] = secret
    return out


def decode(xs: Sequence[int], shares: np.ndarray, t: int) -> tuple[bytes, frozenset[int]]:
    """The secret behind ``shares`` (m, 9) held at ``xs`` when at most (m - t) // 2 of them are
    wrong, and the holders whose shares were wrong (Berlekamp-Welch on every chunk).

    Shamir shares are a Reed-Solomon codeword, so m >= t + 2e shares correct e errors whatever
    the wrong values are. Raises ValueError when no polynomial of degree < t agrees with all but
    (m - t) // 2 shares: too many wrong shares to decode around.
    """
    xs = [int(x) for x in xs]
    shares = np.asarray(shares).astype(np.int64)
    m = len(xs)
    if shares.shape != (m, CHUNKS) or len(set(xs)) != m or not 1 <= t <= m:
        raise ValueError(f"need m >= t distinct holders with one ({CHUNKS},) share each")
    # An element outside the field is certainly wrong: reduced, it is just another error.
    shares = shares % P
    errors = (m - t) // 2
    x = np.array(xs, dtype=np.int64)
    wrong: set[int] = set()
    chunks = np.zeros(CHUNKS, dtype=np.uint64)
    for c in range(CHUNKS):
        poly = _berlekamp_welch(x, shares[:, c], t, errors)
        wrong.update(np.asarray(xs)[_evaluate(poly, x) != shares[:, c]].tolist())
        chunks[c] = poly[0]
    if len(wrong) > errors:
        raise ValueError(f"{len(wrong)} wrong shares among {m}: at most {errors} can be corrected")
    if np.any(chunks >= _CHUNK_LIMITS):
        raise ValueError("decoded value is not a valid secret chunk")
    return field_to_secrets(chunks[None, :])[0], frozenset(wrong)


def _powers(x: np.ndarray, count: int) -> np.ndarray:
    """(len(x), count) matrix of x^j mod p, j < count."""
    out = np.ones((len(x), count), dtype=np.int64)
    for j in range(1, count):
        out[:, j] = out[:, j - 1] * x % P
    return out


def _evaluate(poly: np.ndarray, x: np.ndarray) -> np.ndarray:
    acc = np.zeros(len(x), dtype=np.int64)
    for coefficient in poly[::-1]:
        acc = (acc * x + int(coefficient)) % P
    return acc


def _berlekamp_welch(x: np.ndarray, y: np.ndarray, t: int, errors: int) -> np.ndarray:
    """Coefficients (low to high) of the degree < t polynomial through all but ``errors`` of
    the points: solve Q(x_i) = y_i E(x_i) for Q of degree < t + errors and monic E of degree
    ``errors``; then P = Q / E."""
    powers = _powers(x, t + errors)
    matrix = np.concatenate([powers[:, : t + errors], (P - y[:, None]) * powers[:, :errors] % P], axis=1)
    rhs = y * powers[:, errors] % P
    solution = _solve(matrix, rhs)
    if solution is None:
        raise ValueError("too many wrong shares to decode")
    q = [int(v) for v in solution[: t + errors]]
    e = [int(v) for v in solution[t + errors :]] + [1]
    quotient = [0] * (len(q) - errors)
    for i in range(len(quotient) - 1, -1, -1):
        coefficient = q[i + errors]
        quotient[i] = coefficient
        for j, d in enumerate(e):
            q[i + j] = (q[i + j] - coefficient * d) % P
    if any(q[:errors]) or any(quotient[t:]):  # E does not divide Q, or P has degree >= t
        raise ValueError("too many wrong shares to decode")
    return np.array(quotient[:t], dtype=np.int64)


def _solve(matrix: np.ndarray, rhs: np.ndarray) -> np.ndarray | None:
    """One solution of matrix @ v = rhs over GF(p) (free variables 0); None if there is none."""
    a = np.concatenate([matrix, rhs[:, None]], axis=1).astype(np.int64) % P
    rows, cols = a.shape[0], a.shape[1] - 1
    pivots: list[int] = []
    r = 0
    for c in range(cols):
        if r == rows:
            break
        nonzero = np.flatnonzero(a[r:, c])
        if not len(nonzero):
            continue
        p = r + int(nonzero[0])
        a[[r, p]] = a[[p, r]]
        a[r] = a[r] * pow(int(a[r, c]), P - 2, P) % P
        others = np.flatnonzero(a[:, c])
        others = others[others != r]
        a[others] = (a[others] - a[others, c : c + 1] * a[r]) % P
        pivots.append(c)
        r += 1
    if np.any(a[r:, cols] != 0):
        return None
    solution = np.zeros(cols, dtype=np.int64)
    for row, c in enumerate(pivots):
        solution[c] = a[row, cols]
    return solution
