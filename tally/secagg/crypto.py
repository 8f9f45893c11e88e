"""Cryptographic primitives of the secure sum (DESIGN.md section 4).

Every key is bound to a *context* (job, round, session, sum) through HKDF's ``info``
so that no key, seed or keystream is ever reused across two sums or two sessions:
revealing a dropped device's key for one sum reveals nothing about another.
"""

from __future__ import annotations

import os

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


def self_mask_key(seed: bytes, context: bytes) -> bytes:
    return derive(seed, b"tally/self-mask|" + context, MASK_KEY_BYTES)


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
