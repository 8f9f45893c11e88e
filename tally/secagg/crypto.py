"""Cryptographic primitives of the secure sum (DESIGN.md section 4).

Every key is bound to a *context* (job, round, session, sum) through HKDF's ``info``
so that no key, seed or keystream is ever reused across two sums or two sessions:
revealing a dropped device's key for one sum reveals nothing about another.

Key agreement, AEAD, HKDF and signatures are ``cryptography``'s (OpenSSL). The prime-order group
the shared secrets are committed in is edwards25519's, through PyNaCl's libsodium bindings
(``nacl.bindings``: scalar multiplication, point addition and validation), which ``cryptography``
does not expose; it is the group X25519 already computes in, so a mask key's commitment is its
X25519 public key read on the Edwards curve (the birational map u = (1 + y) / (1 - y)).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable

import nacl.bindings as sodium
import nacl.exceptions
import numpy as np
from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.hazmat.primitives.asymmetric.x25519 import (
    X25519PrivateKey,
    X25519PublicKey,
)
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

KEY_BYTES = 32
PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
MASK_KEY_BYTES = 16
_ZERO_NONCE_12 = bytes(12)
_ZERO_COUNTER_16 = bytes(16)
# Keystream is produced in chunks of this size so the buffer stays in cache and
# memory stays bounded whatever the vector length.
CHUNK_BYTES = 1 << 20


class CryptoError(ValueError):
    """A key, ciphertext or signature failed validation."""


class KeyPair:
    """An X25519 key pair. The raw 32-byte private key is what Shamir shares; the parsed
    key object is kept because parsing costs as much as an agreement."""

    __slots__ = ("private", "public", "_key")

    def __init__(self, private: bytes) -> None:
        try:
            self._key = X25519PrivateKey.from_private_bytes(private)
        except ValueError as exc:
            raise CryptoError(f"invalid X25519 private key: {exc}") from exc
        self.private = private
        self.public = self._key.public_key().public_bytes_raw()

    def agree(self, peer_public: bytes) -> bytes:
        """X25519 shared secret; a malformed peer key is a protocol error, not a crash."""
        try:
            return self._key.exchange(X25519PublicKey.from_public_bytes(peer_public))
        except ValueError as exc:
            raise CryptoError(f"invalid X25519 key: {exc}") from exc


# Any scalar works: X25519 clamps it to a multiple of 8, which sends every point of small order
# (the all-zero key among them) to zero, and cryptography refuses an all-zero shared secret.
_PROBE = X25519PrivateKey.from_private_bytes(bytes(range(1, 33)))


def check_public_key(public: bytes) -> None:
    """Refuse a key no honest device makes: wrong length, or of small order (zero and the other
    low-order points), which would give every neighbour a known, all-zero shared secret."""
    if len(public) != PUBLIC_KEY_BYTES:
        raise CryptoError(f"X25519 public keys are {PUBLIC_KEY_BYTES} bytes, got {len(public)}")
    try:
        _PROBE.exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError as exc:
        raise CryptoError("X25519 public key of small order") from exc


def derive(secret: bytes, info: bytes, length: int = KEY_BYTES) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=info).derive(secret)


def share_key(shared_secret: bytes, context: bytes, sender: int, recipient: int) -> bytes:
    """AES-256-GCM key for shares sent from ``sender`` to ``recipient``.

    The direction is part of the key, so the two ciphertexts of a pair never share a
    (key, nonce) and a fixed nonce is safe: each key encrypts exactly one message.
    """
    info = b"tally/share|" + context + b"|%d>%d" % (sender, recipient)
    return derive(shared_secret, info)


def seal(key: bytes, plaintext: bytes, associated: bytes) -> bytes:
    return AESGCM(key).encrypt(_ZERO_NONCE_12, plaintext, associated)


def open_sealed(key: bytes, ciphertext: bytes, associated: bytes) -> bytes:
    try:
        return AESGCM(key).decrypt(_ZERO_NONCE_12, ciphertext, associated)
    except InvalidTag as exc:
        raise CryptoError("share ciphertext failed authentication") from exc


def pairwise_mask_key(shared_secret: bytes, context: bytes) -> bytes:
    return derive(shared_secret, b"tally/pairwise-mask|" + context, MASK_KEY_BYTES)


def self_mask_key(seed: int, context: bytes) -> bytes:
    """The self mask's key from the seed scalar, which is fixed only up to sign (``unsigned``)."""
    return derive(scalar_bytes(unsigned(seed)), b"tally/self-mask|" + context, MASK_KEY_BYTES)


class MaskExpander:
    """Adds or subtracts AES-128-CTR keystreams to a ring vector in place.

    The buffers are allocated once per vector shape; each mask costs one keystream
    pass plus one vectorised add, which is the floor the benchmark measures against.
    """

    def __init__(self, dim: int, dtype: np.dtype) -> None:
        self.dim = dim
        self.dtype = np.dtype(dtype)
        item = self.dtype.itemsize
        self._chunk_values = max(1, min(dim, CHUNK_BYTES // item))
        chunk_bytes = self._chunk_values * item
        self._zeros = bytes(chunk_bytes)
        # update_into needs room for one block beyond the data.
        self._out = bytearray(chunk_bytes + 15)
        self._view = np.frombuffer(self._out, dtype=self.dtype, count=self._chunk_values)
        # The last, shorter chunk's input, sliced once here: slicing bytes copies them.
        tail = dim % self._chunk_values
        self._tail_zeros = self._zeros[: tail * item] if tail else self._zeros

    def apply(self, acc: np.ndarray, key: bytes, subtract: bool = False) -> None:
        if acc.shape != (self.dim,) or acc.dtype != self.dtype:
            raise ValueError(f"accumulator must be {self.dtype}[{self.dim}]")
        encryptor = Cipher(algorithms.AES(key), modes.CTR(_ZERO_COUNTER_16)).encryptor()
        op = np.subtract if subtract else np.add
        step, dim, out, view = self._chunk_values, self.dim, self._out, self._view
        zeros = self._zeros
        for start in range(0, dim, step):
            stop = start + step
            if stop <= dim:
                encryptor.update_into(zeros, out)
                part = acc[start:stop]
                op(part, view, out=part)
            else:
                encryptor.update_into(self._tail_zeros, out)
                part = acc[start:]
                op(part, view[: dim - start], out=part)


# ---- the group the secrets are committed in ---------------------------------------------------

GROUP_ORDER = 2**252 + 27742317777372353535851937790883648493  # l: order of edwards25519's base point
SCALAR_BYTES = 32
POINT_BYTES = 32
_FIELD = 2**255 - 19
_SIGN_BIT = 1 << 255
_CLAMPED_LOW, _CLAMPED_HIGH = 1 << 254, 1 << 255
_INVERSE_8 = pow(8, -1, GROUP_ORDER)


def scalar_bytes(scalar: int) -> bytes:
    return scalar.to_bytes(SCALAR_BYTES, "little")


def scalar_from_bytes(raw: bytes) -> int | None:
    """A canonical scalar (below l), or None."""
    value = int.from_bytes(raw, "little")
    return value if len(raw) == SCALAR_BYTES and value < GROUP_ORDER else None


def random_scalar(entropy: Callable[[int], bytes] = os.urandom) -> int:
    """Uniform in [0, l): 512 random bits reduced (bias below 2^-259)."""
    return int.from_bytes(entropy(64), "little") % GROUP_ORDER


def commit(scalar: int) -> bytes:
    """scalar * B, the commitment to a secret scalar: binding (B has prime order l) and hiding
    as far as discrete logarithms are hard."""
    return sodium.crypto_scalarmult_ed25519_base_noclamp(scalar_bytes(scalar % GROUP_ORDER))


def edwards_of_montgomery(u_bytes: bytes) -> bytes:
    """The Edwards point (x sign 0) with Montgomery u-coordinate ``u_bytes`` (an X25519 public
    key): y = (u - 1) / (u + 1). Whether it is on the curve is for the operations to decide."""
    u = int.from_bytes(u_bytes, "little") & (_SIGN_BIT - 1)
    denominator = (u + 1) % _FIELD
    y = (u - 1) * pow(denominator, -1, _FIELD) % _FIELD if denominator else 0
    return y.to_bytes(POINT_BYTES, "little")


def _montgomery_of_edwards(point: bytes) -> bytes:
    """The X25519 form (u-coordinate) of an Edwards point: u = (1 + y) / (1 - y)."""
    y = int.from_bytes(point, "little") & (_SIGN_BIT - 1)
    denominator = (1 - y) % _FIELD
    u = (1 + y) * pow(denominator, -1, _FIELD) % _FIELD if denominator else 0
    return u.to_bytes(PUBLIC_KEY_BYTES, "little")


def _clamped(private: bytes) -> int:
    value = int.from_bytes(private, "little")
    return (value & ~7 & (_CLAMPED_HIGH - 1)) | _CLAMPED_LOW


def mask_scalar(private: bytes) -> int:
    """The scalar that stands for X25519 private key ``private`` in the group: its clamped value
    mod l, negated if need be so that scalar * B is ``edwards_of_montgomery`` of its public key
    (X25519 sees only u, which a point and its negative share)."""
    scalar = _clamped(private) % GROUP_ORDER
    return scalar if commit(scalar)[31] < 0x80 else GROUP_ORDER - scalar


def _clamped_key(scalar: int) -> bytes | None:
    """An X25519 private key k, fixed by clamping, with k = +-scalar mod l; None if there is none
    (an honest device's key always has one: it is such a k)."""
    for value in (scalar, GROUP_ORDER - scalar):
        # k = 8 j with j = value / 8 mod l, plus a multiple of l that lands j in [2^251, 2^252).
        j = value * _INVERSE_8 % GROUP_ORDER
        while j < _CLAMPED_LOW >> 3:
            j += GROUP_ORDER
        if j < _CLAMPED_HIGH >> 3:
            return (8 * j).to_bytes(KEY_BYTES, "little")
    return None


class ScalarKey:
    """A rebuilt mask key: the scalar that stands for an X25519 key (``mask_scalar``), agreeing the
    same shared secrets, u(scalar * peer). X25519 does the work when the scalar has a clamped form
    (an honest device's always has: it is its key), libsodium on the Edwards curve when a corrupt
    device chose one that has not. Parsed once: a dropout's key agrees with every neighbour."""

    __slots__ = ("scalar", "_pair")

    def __init__(self, scalar: int) -> None:
        self.scalar = scalar % GROUP_ORDER
        key = _clamped_key(self.scalar)
        self._pair = None if key is None else KeyPair(key)

    def agree(self, peer_public: bytes) -> bytes:
        if self._pair is not None:
            return self._pair.agree(peer_public)
        try:
            product = sodium.crypto_scalarmult_ed25519_noclamp(
                scalar_bytes(self.scalar), edwards_of_montgomery(peer_public))
        except nacl.exceptions.RuntimeError as exc:
            raise CryptoError("X25519 key is not a point of the prime-order group") from exc
        return _montgomery_of_edwards(product)


def public_of_scalar(scalar: int) -> bytes:
    """The X25519 form (u-coordinate) of scalar * B: the commitment to a secret scalar, binding
    it up to sign (a point and its negative share u) and hiding as far as discrete logarithms are
    hard. A mask key's commitment is thus its X25519 public key itself."""
    return _montgomery_of_edwards(commit(scalar))


def unsigned(scalar: int) -> int:
    """The one of +-scalar mod l below l / 2: what a secret fixed up to sign is used as."""
    scalar %= GROUP_ORDER
    return min(scalar, GROUP_ORDER - scalar)


def challenge_scalar(raw: bytes) -> tuple[int, bytes]:
    """A challenge from 32 random bytes, in the clamped form X25519 multiplies by: (its value,
    the bytes X25519 takes). About 2^251 values, all distinct mod l."""
    value = _clamped(raw)
    return value, value.to_bytes(KEY_BYTES, "little")


_MONTGOMERY_A = 486662


def combination_opens(value: int, blind: bytes, terms: list[tuple[bytes, bytes]]) -> bool:
    """Whether value * B - blind = +-c_1 S_1 +- c_2 S_2 for the two (challenge bytes, X25519-form
    commitment) ``terms``: a public linear relation between committed scalars, each fixed up to
    sign. The products are libsodium's X25519 ladders (faster here than a parse and an exchange
    through ``cryptography``), the sum is checked on u-coordinates alone:
    u_R is u(P + Q) or u(P - Q) exactly when it is a root of
    (u_P - u_Q)^2 X^2 - 2 ((u_P u_Q + 1)(u_P + u_Q) + 2 A u_P u_Q) X + (u_P u_Q - 1)^2.
    False also when a point is malformed or outside the curve."""
    (c1, s1), (c2, s2) = terms
    try:
        rest = sodium.crypto_core_ed25519_sub(commit(value), blind)
        u_p, u_q = (int.from_bytes(sodium.crypto_scalarmult(c, point), "little") for c, point in ((c1, s1), (c2, s2)))
    except nacl.exceptions.RuntimeError:
        return False
    if u_p == u_q:
        return False
    # u_R = (1 + y) / (1 - y): the quadratic times (1 - y)^2, so no inversion is needed.
    y = int.from_bytes(rest, "little") & (_SIGN_BIT - 1)
    top, bottom = 1 + y, 1 - y
    product = u_p * u_q
    quadratic = ((u_p - u_q) ** 2 * top * top
                 - 2 * ((product + 1) * (u_p + u_q) + 2 * _MONTGOMERY_A * product) * top * bottom
                 + (product - 1) ** 2 * bottom * bottom)
    return quadratic % _FIELD == 0


# ---- proof that a revealed X25519 shared secret is the right one (Chaum-Pedersen) ---------------

DH_PROOF_BYTES = POINT_BYTES + 2 * SCALAR_BYTES


def _dh_challenge(points: list[bytes], context: bytes) -> int:
    h = hashlib.sha512(b"tally/dh-proof|" + context)
    for point in points:
        h.update(point)
    return int.from_bytes(h.digest(), "little") % GROUP_ORDER


def prove_shared_secret(private: bytes, peer_public: bytes, context: bytes) -> bytes:
    """The pair's Diffie-Hellman point Z = a * P (P the peer's key on the Edwards curve, a this
    key's ``mask_scalar``) and a proof that log_B(A) = log_P(Z): whoever checks it re-derives the
    X25519 secret of the pair without trusting the prover, and learns nothing about a."""
    a = mask_scalar(private)
    public = commit(a)
    peer = edwards_of_montgomery(peer_public)
    try:
        shared = sodium.crypto_scalarmult_ed25519_noclamp(scalar_bytes(a), peer)
        r = random_scalar()
        nonces = [commit(r), sodium.crypto_scalarmult_ed25519_noclamp(scalar_bytes(r), peer)]
    except nacl.exceptions.RuntimeError as exc:
        raise CryptoError("peer X25519 key is not a point of the prime-order group") from exc
    c = _dh_challenge([public, peer, shared, *nonces], context)
    return shared + scalar_bytes(c) + scalar_bytes((r + c * a) % GROUP_ORDER)


def verified_shared_secret(proof: bytes, public: bytes, peer_public: bytes, context: bytes) -> bytes | None:
    """The X25519 shared secret of ``public``'s owner and ``peer_public`` that ``proof`` proves,
    or None if it proves nothing."""
    if len(proof) != DH_PROOF_BYTES:
        return None
    shared = proof[:POINT_BYTES]
    c = scalar_from_bytes(proof[POINT_BYTES : POINT_BYTES + SCALAR_BYTES])
    z = scalar_from_bytes(proof[POINT_BYTES + SCALAR_BYTES :])
    if c is None or z is None:
        return None
    a_point, peer = edwards_of_montgomery(public), edwards_of_montgomery(peer_public)
    minus_c = scalar_bytes((GROUP_ORDER - c) % GROUP_ORDER)
    try:
        nonces = [
            sodium.crypto_core_ed25519_add(
                commit(z), sodium.crypto_scalarmult_ed25519_noclamp(minus_c, a_point)),
            sodium.crypto_core_ed25519_add(
                sodium.crypto_scalarmult_ed25519_noclamp(scalar_bytes(z), peer),
                sodium.crypto_scalarmult_ed25519_noclamp(minus_c, shared)),
        ]
    except nacl.exceptions.RuntimeError:
        return None
    if _dh_challenge([a_point, peer, shared, *nonces], context) != c:
        return None
    return _montgomery_of_edwards(shared)


def in_group(public: bytes) -> bool:
    """Whether an X25519 public key is a point of the prime-order group (not on the twist)."""
    return bool(sodium.crypto_core_ed25519_is_valid_point(edwards_of_montgomery(public)))


class SigningKey:
    """A device's long-term Ed25519 identity key, enrolled with the coordinator: it signs the
    device's session keys (AdvertiseKeys) and survivor sets (ConsistencyCheck)."""

    __slots__ = ("public", "_key")

    def __init__(self, private: bytes) -> None:
        try:
            self._key = Ed25519PrivateKey.from_private_bytes(private)
        except ValueError as exc:
            raise CryptoError(f"invalid Ed25519 private key: {exc}") from exc
        self.public = self._key.public_key().public_bytes_raw()

    @classmethod
    def generate(cls) -> SigningKey:
        return cls(os.urandom(KEY_BYTES))

    def sign(self, message: bytes) -> bytes:
        return self._key.sign(message)


def verify_signature(public: bytes, signature: bytes, message: bytes) -> bool:
    if len(public) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True
