"""Proof that a dealer's Shamir shares are shares of exactly the secrets it committed to,
checked before any input is masked.

A corrupt device could deal shares that lie on no polynomial of degree below t, or on one whose
constant term is not its committed secret (a random seed, a wrong mask key): each holder's share
looks fine alone, and the fault would show only in Unmask, after every honest device sent its
masked input (issue 23 finding 2, issue 38 problem 1). The secrets are scalars mod l, the order of
edwards25519's base point B (``tally.secagg.shamir``), committed in the signed AdvertiseKeys as
S_1 (the mask key's X25519 public key, which is s_1 * B read on the Montgomery curve) and S_2 =
s_2 * B (the seed's, in the same form). Each dealer also shares a random blinding polynomial g,
publishes G = g(0) * B, and for a challenge (c_1, c_2) drawn from a hash of G and all its
ciphertexts (fixed before the challenge is known) the check polynomial

    h = g + c_1 f_1 + c_2 f_2        (f_1, f_2: the polynomials of the mask key and the seed)

Holder i checks its shares against it: g(x_i) + c_1 f_1(x_i) + c_2 f_2(x_i) = h(x_i), a few scalar
products. The aggregator (or anyone: it is public) checks the constant term against the
commitments: h(0) * B - G = +-c_1 S_1 +- c_2 S_2 (``crypto.combination_opens``: two X25519
ladders and one fixed-base product per dealer, not Feldman's t per share).

Sound: let H be the honest holders, |H| >= t. If their shares of f_1, f_2 or g restricted to H are
not the values of polynomials of degree < t, the challenges that pass every holder in H form a
line in the plane of (c_1, c_2): one in 2^251 (the challenges are X25519-clamped, about 2^251
values, distinct mod l). Otherwise the honest shares fix F_1, F_2, Γ and h = Γ + c_1 F_1 + c_2 F_2,
and with G = γ B (it is, when the relation holds: the rest of it lies in the prime-order group)
the relation says Γ(0) - γ + c_1 F_1(0) + c_2 F_2(0) = ±c_1 s_1 ± c_2 s_2: for each of the four
signs a line again, unless F_1(0) = ±s_1 and F_2(0) = ±s_2. A dealer passes with a wrong constant
with probability below 2^-248 per ciphertext set it tries; a property test keeps it so. The sign
is no loss: X25519 sees only u, which s_1 and -s_1 give alike, and the seed is used as its
representative below l / 2 (``crypto.unsigned``).

Hiding: g is uniform and independent of the secrets, so h is a uniform polynomial whatever they
are, and G = g(0) B a uniform point; what fewer than t holders learn of f_1, f_2 from h, G and
their own shares they could compute themselves. S_1, S_2 hide s_1, s_2 as far as discrete
logarithms in edwards25519 are hard (S_1 is the X25519 public key that was public anyway).

The aggregator routes h and G with each share. That trusts it for liveness only, which a malicious
aggregator can break anyway: a holder whose check fails signs a complaint about exactly what it
received (``complaint_statement``), and a dealer answers only a complaint about its genuine
material, with the pair's Diffie-Hellman point and a proof that it is the right one
(``crypto.prove_shared_secret``): the aggregator re-derives the share key itself, so a dealer that
sealed a good share under another key is named, not the holder it tried to frame.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from tally.secagg import crypto, shamir
from tally.secagg.messages import SessionRef

SECRETS = 2  # the mask key and the self-mask seed of one sum
DIGEST_BYTES = 32
SCALAR = crypto.SCALAR_BYTES
# What a holder gets in plaintext: its shares of the mask key, the seed and the blinding polynomial.
PLAINTEXT_BYTES = (SECRETS + 1) * SCALAR


def message_bytes(t: int) -> int:
    """A dealer's published check for one sum: G, then h's t coefficients (constant first)."""
    return crypto.POINT_BYTES + SCALAR * t


def check_bytes_for(t: int) -> int:
    """What travels with each delivered share: the dealer's ciphertext digest and its check."""
    return DIGEST_BYTES + message_bytes(t)


def digest(ref: SessionRef, sum_id: str, dealer: int, ciphertexts: Sequence[bytes]) -> bytes:
    """Binds the challenge to every share the dealer sent (in ascending holder order)."""
    h = hashlib.sha256(b"tally/share-check|" + ref.context(sum_id) + b"|%d|" % int(dealer))
    for ciphertext in ciphertexts:
        h.update(len(ciphertext).to_bytes(4, "big") + ciphertext)
    return h.digest()


def challenge(check_digest: bytes, blind: bytes) -> list[tuple[int, bytes]]:
    """(c_q as an integer, the bytes X25519 multiplies by) for the SECRETS terms."""
    stream = hashlib.shake_256(b"tally/share-challenge|" + check_digest + blind).digest(SCALAR * SECRETS)
    return [crypto.challenge_scalar(stream[q * SCALAR : (q + 1) * SCALAR]) for q in range(SECRETS)]


def check_message(secret_polynomials: Sequence[Sequence[int]], blinding: Sequence[int],
                  check_digest: bytes) -> bytes:
    """G = g(0) B and h = g + sum_q c_q f_q, as the dealer publishes them."""
    blind = crypto.commit(blinding[0])
    c = [value for value, _ in challenge(check_digest, blind)]
    h = [(g + sum(cq * f[d] for cq, f in zip(c, secret_polynomials))) % shamir.P
         for d, g in enumerate(blinding)]
    return blind + b"".join(crypto.scalar_bytes(v) for v in h)


def passes(plaintext: bytes, check: bytes, holder: int) -> bool:
    """Whether a decrypted share (key share, seed share, blinding share) satisfies the check that
    came with it, at the holder's x-coordinate. Scalars outside [0, l) fail."""
    if len(plaintext) != PLAINTEXT_BYTES or len(check) < DIGEST_BYTES + crypto.POINT_BYTES + SCALAR:
        return False
    body = check[DIGEST_BYTES + crypto.POINT_BYTES :]
    if len(body) % SCALAR:
        return False
    raw = plaintext + body
    scalars = [int.from_bytes(raw[i : i + SCALAR], "little") for i in range(0, len(raw), SCALAR)]
    if max(scalars) >= shamir.P:
        return False
    key, seed, blind, *coefficients = scalars
    c = challenge(check[:DIGEST_BYTES], check[DIGEST_BYTES : DIGEST_BYTES + crypto.POINT_BYTES])
    expected = 0
    for coefficient in reversed(coefficients):
        expected = expected * holder + coefficient
    return (blind + c[0][0] * key + c[1][0] * seed - expected) % shamir.P == 0


def constant_opens(message: bytes, check_digest: bytes, mask_public: bytes, seed_commitment: bytes) -> bool:
    """The public half of the check: h(0) B - G = +-c_1 S_1 +- c_2 S_2, with S_1, S_2 the dealer's
    signed commitments. Anyone can run it; the aggregator does, once per dealer and sum."""
    blind = message[: crypto.POINT_BYTES]
    h0 = crypto.scalar_from_bytes(message[crypto.POINT_BYTES : crypto.POINT_BYTES + SCALAR])
    if h0 is None:
        return False
    (_, c1), (_, c2) = challenge(check_digest, blind)
    return crypto.combination_opens(h0, blind, [(c1, mask_public), (c2, seed_commitment)])


def complaint_statement(ref: SessionRef, sum_id: str, dealer: int, holder: int,
                        ciphertext: bytes, check: bytes) -> bytes:
    """What a holder signs to complain about a share: the share and check exactly as received.
    The dealer rebuilds it from what it sent; only if the signature then verifies (the holder
    got the genuine material, so it is lying or the dealer is faulty) does it reveal its key."""
    material = hashlib.sha256(len(ciphertext).to_bytes(4, "big") + ciphertext + check).digest()
    return b"tally/share-complaint|" + ref.context(sum_id) + b"|%d>%d|" % (int(dealer), int(holder)) + material


def proof_context(ref: SessionRef, sum_id: str, dealer: int, holder: int) -> bytes:
    """What a dealer's proof of the pair's shared secret is bound to."""
    return b"tally/share-key-proof|" + ref.context(sum_id) + b"|%d>%d" % (int(dealer), int(holder))
