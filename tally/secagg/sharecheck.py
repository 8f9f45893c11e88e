"""Proof that a dealer's Shamir shares lie on one polynomial, checked before any input is masked.

A corrupt device could deal shares of its mask key and seed that lie on no polynomial of degree
below t: each holder's share looks fine alone, and the fault shows only in Unmask, after every
honest device has sent its masked input and none can be re-seated (finding 2 of issue 23). So
each dealer also shares ``ROWS`` random blinding polynomials g_r and publishes, for a challenge c
drawn from a hash of all its ciphertexts (fixed before c is known),

    h_r = g_r + sum_q c_rq f_q        (f_q: the polynomial of chunk q of the key or the seed)

and holder i checks g_r(x_i) + sum_q c_rq f_q(x_i) = h_r(x_i). Both facts below hold over the
same field as the sharing, GF(2^31 - 1), so the vectorised Shamir code is kept as it is.

Sound: if the honest holders' f-values are not on one polynomial, then for each r the challenges
that pass form at most an affine hyperplane, 1/p of them; a dealer passes every honest holder
with probability p^-ROWS (2^-93) per ciphertext set it tries.

Hiding: g_r is uniform and independent of f, so h_r is uniform whatever the secrets are; holders
that know g_r at fewer than t points learn nothing from h_r they could not compute themselves.

The server computes c, evaluates h_r at every holder and sends the value with the share. That
trusts it only for liveness, which a malicious server can break anyway: a holder whose check
fails signs a complaint about exactly what it received (``complaint_statement``), and a dealer
reveals its key for that one share only when the complaint is about its genuine material, so
a server that tampers with deliveries learns nothing but that it was caught.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from tally.secagg import shamir
from tally.secagg.messages import SessionRef

ROWS = 3
SECRETS = 2  # the mask key and the self-mask seed of one sum
TERMS = SECRETS * shamir.CHUNKS
DIGEST_BYTES = 32
# What travels with each delivered share: the dealer's ciphertext digest and h_r(x_holder).
CHECK_BYTES = DIGEST_BYTES + 4 * ROWS
POLYNOMIAL_BYTES_PER_DEGREE = 4 * ROWS
BLIND_BYTES = 4 * ROWS

_P = np.uint64(shamir.P)


def digest(ref: SessionRef, sum_id: str, dealer: int, ciphertexts: Sequence[bytes]) -> bytes:
    """Binds the challenge to every share the dealer sent (in ascending holder order)."""
    h = hashlib.sha256(b"tally/share-check|" + ref.context(sum_id) + b"|%d|" % int(dealer))
    for ciphertext in ciphertexts:
        h.update(len(ciphertext).to_bytes(4, "big") + ciphertext)
    return h.digest()


def challenge(check_digest: bytes) -> np.ndarray:
    """(ROWS, TERMS) field elements drawn from the digest (SHAKE-256, rejection sampling)."""
    wanted = ROWS * TERMS
    stream = hashlib.shake_256(b"tally/share-challenge|" + check_digest).digest(8 * wanted)
    draws: np.ndarray = np.frombuffer(stream, dtype="<u4").astype(np.uint64) & np.uint64(shamir.P)
    draws = draws[draws != _P]  # P itself is the only 31-bit value outside the field
    return draws[:wanted].reshape(ROWS, TERMS)


def check_polynomials(secret_polynomials: np.ndarray, blinding: np.ndarray, c: np.ndarray) -> np.ndarray:
    """(ROWS, t) coefficients of h_r from the (SECRETS, t, CHUNKS) sharing polynomials and the
    (ROWS, t) blinding ones."""
    t = secret_polynomials.shape[1]
    f = secret_polynomials.transpose(1, 0, 2).reshape(t, TERMS)  # degree -> term
    products = (c[:, None, :] * f[None, :, :]) % _P  # each below p: 18 of them fit in uint64
    checks: np.ndarray = (blinding + products.sum(axis=2)) % _P
    return checks


def evaluate_rows(polynomials: np.ndarray, xs: np.ndarray) -> np.ndarray:
    """h_r at each dealer's holders: (D, ROWS, t) coefficients and (D, L) points -> (D, L, ROWS)."""
    x = np.asarray(xs, dtype=np.uint64)[:, :, None]
    acc = np.zeros((*x.shape[:2], polynomials.shape[1]), dtype=np.uint64)
    for d in range(polynomials.shape[2] - 1, -1, -1):  # in place: thousands of dealers at once
        np.multiply(acc, x, out=acc)
        np.add(acc, polynomials[:, None, :, d], out=acc)
        np.remainder(acc, _P, out=acc)
    return acc


def check_bytes(check_digest: bytes, values: np.ndarray) -> bytes:
    return check_digest + np.asarray(values, dtype="<u4").tobytes()


def passes(plaintext: bytes, check: bytes) -> bool:
    """Whether a decrypted share (key share, seed share, blinding values) satisfies the check
    that came with it. Elements outside the field fail."""
    if len(plaintext) != 2 * shamir.SHARE_BYTES + BLIND_BYTES or len(check) != CHECK_BYTES:
        return False
    elements = np.frombuffer(plaintext, dtype="<u4").astype(np.uint64)
    values = np.frombuffer(check, dtype="<u4", offset=DIGEST_BYTES).astype(np.uint64)
    if np.any(elements >= _P) or np.any(values >= _P):
        return False
    c = challenge(check[:DIGEST_BYTES])
    combined = (elements[TERMS:] + ((c * elements[None, :TERMS]) % _P).sum(axis=1)) % _P
    return bool(np.array_equal(combined, values))


def complaint_statement(ref: SessionRef, sum_id: str, dealer: int, holder: int,
                        ciphertext: bytes, check: bytes) -> bytes:
    """What a holder signs to complain about a share: the share and check exactly as received.
    The dealer rebuilds it from what it sent; only if the signature then verifies (the holder
    got the genuine material, so it is lying or the dealer is faulty) does it reveal its key."""
    material = hashlib.sha256(len(ciphertext).to_bytes(4, "big") + ciphertext + check).digest()
    return b"tally/share-complaint|" + ref.context(sum_id) + b"|%d>%d|" % (int(dealer), int(holder)) + material
