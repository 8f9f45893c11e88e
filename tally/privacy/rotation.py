"""The randomized Hadamard rotation: flattens any vector so that every coordinate is small.

A clipped update may put all its norm in a few coordinates; after x -> H D x / sqrt(n) (D random
signs, H the Walsh-Hadamard matrix) each coordinate is a Rademacher sum, sub-Gaussian with
variance proxy ||x||^2 / n. That is what lets a narrow ring hold the noisy sum (the range is
set by ||x||/sqrt(n), not by ||x||). The rotation is orthonormal, so it keeps L2 norms and
the server undoes it exactly after decoding. The signs come from a public per-round seed: they
need to be unpredictable to the data, not secret.
"""

from __future__ import annotations

import numpy as np


def padded_size(dim: int) -> int:
    """The power of two the vector is zero-padded to (Walsh-Hadamard needs one)."""
    if dim < 1:
        raise ValueError(f"a rotation needs at least one value, got {dim}")
    return 1 << (dim - 1).bit_length()


def walsh_hadamard(vector: np.ndarray) -> np.ndarray:
    """H x / sqrt(n) by the fast butterfly, O(n log n); symmetric and its own inverse."""
    n = vector.size
    if n & (n - 1):
        raise ValueError(f"Walsh-Hadamard needs a power-of-two length, got {n}")
    out = np.asarray(vector, dtype=np.float64).reshape(1, n)
    h = n
    while h > 1:
        h //= 2
        pairs = out.reshape(-1, 2, h)
        out = np.concatenate([pairs[:, 0] + pairs[:, 1], pairs[:, 0] - pairs[:, 1]], axis=1)
    scaled: np.ndarray = out.reshape(n) / np.sqrt(n)
    return scaled


def _signs(seed: int, n: int) -> np.ndarray:
    return np.where(np.random.default_rng(seed).random(n) < 0.5, -1.0, 1.0)


def rotate(vector: np.ndarray, seed: int) -> np.ndarray:
    """Pad ``vector`` to a power of two and rotate it."""
    n = padded_size(vector.size)
    padded = np.zeros(n)
    padded[: vector.size] = vector
    return walsh_hadamard(_signs(seed, n) * padded)


def unrotate(rotated: np.ndarray, seed: int, dim: int) -> np.ndarray:
    """The inverse of ``rotate``: the first ``dim`` values of D H y."""
    unrotated: np.ndarray = _signs(seed, rotated.size) * walsh_hadamard(rotated)
    return unrotated[:dim]
