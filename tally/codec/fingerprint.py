"""Linear fingerprints of ring vectors, so that a sum can be checked without anyone keeping it.

A load test or a fault campaign must prove that every committed sum is exactly the sum of the
inputs that went into it, for cohorts of thousands of devices spread over several processes and
machines, without shipping 10^5-value vectors around. A fingerprint is a few random linear
projections mod 2^bits: fp(a + b) = fp(a) + fp(b) (mod 2^bits), so each fleet shard adds up the
fingerprints of the inputs its devices sent, the shards' partial fingerprints add up, and the
total must equal the fingerprint the coordinator took of the cohort's unmasked sum. The
projections are public (drawn from the session and sum ids): a fingerprint checks integrity, it
hides nothing, and it reveals no more than the sum the server already sees.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np

PROJECTIONS = 2


def _projection(key: str, k: int, dim: int) -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(f"tally-fingerprint/{key}/{k}".encode()).digest()[:16], "little")
    return np.random.default_rng(seed).integers(0, 2**64 - 1, dim, dtype=np.uint64, endpoint=True)


def ring_fingerprint(vector: np.ndarray, bits: int, key: str) -> tuple[int, ...]:
    """``PROJECTIONS`` values of sum_j r_kj v_j mod 2^bits, with r_k drawn from ``key`` (the
    session and sum a vector belongs to, so that two sums never share projections)."""
    v = np.asarray(vector).astype(np.uint64, copy=False)
    mask = (1 << bits) - 1
    # uint64 products and sums wrap mod 2^64, and 2^bits divides 2^64: reducing last is exact.
    return tuple(int(np.dot(v, _projection(key, k, v.size))) & mask for k in range(PROJECTIONS))


def add_fingerprints(parts: Iterable[tuple[int, ...]], bits: int) -> tuple[int, ...]:
    """The fingerprint of the sum of the vectors whose fingerprints are ``parts``."""
    total = [0] * PROJECTIONS
    for part in parts:
        total = [t + p for t, p in zip(total, part, strict=True)]
    mask = (1 << bits) - 1
    return tuple(t & mask for t in total)


def sum_key(session_id: str, sum_id: str) -> str:
    """The projections' key for one sum of one session."""
    return f"{session_id}/{sum_id}"
