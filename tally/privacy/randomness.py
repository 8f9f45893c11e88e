"""Noise and rounding bits from the operating system's CSPRNG.

A device's noise is its whole privacy: if the server could predict it, it could subtract it.
numpy's generators are seeded, fast and predictable from their output; TensorFlow Privacy's
Skellam query seeds one from a timestamp. Here every uniform comes from ``os.urandom``
(getrandom(2): ChaCha20 in the kernel), 53 bits per double, so there is no seed to guess and
no state to recover. It costs ~8 bytes of kernel randomness per value, a few ms per 10^5
values, which is small next to local training.
"""

from __future__ import annotations

import os

import numpy as np

_DOUBLE = 2.0**-53


def uniform(size: int) -> np.ndarray:
    """``size`` doubles in (0, 1]: never 0, so that ``log`` of one is finite."""
    words = np.frombuffer(os.urandom(8 * size), dtype=np.uint64)
    return ((words >> np.uint64(11)).astype(np.float64) + 1.0) * _DOUBLE


def bernoulli(p: np.ndarray) -> np.ndarray:
    """One secure coin per entry of ``p``, heads with probability p."""
    return uniform(p.size).reshape(p.shape) <= p


def gaussian(sigma: float, size: int) -> np.ndarray:
    """Continuous N(0, sigma^2) by Box-Muller on secure uniforms (the central mechanism's noise)."""
    half = (size + 1) // 2
    radius = np.sqrt(-2.0 * np.log(uniform(half)))
    angle = 2.0 * np.pi * uniform(half)
    return sigma * np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:size]


def discrete_gaussian(sigma: float, size: int) -> np.ndarray:
    """N_Z(0, sigma^2) by rejection from a discrete Laplace (Canonne, Kamath, Steinke 2020,
    Algorithm 3), vectorised: draw a batch, keep the accepted, redraw the rest.

    The acceptance test uses floating-point ``exp`` on secure uniforms rather than CKS's exact
    rational arithmetic (which runs ~10^5 times slower in Python); the sampled law differs from
    N_Z only by double rounding, as in the vectorised samplers of KLS's and TFF's code.
    """
    out = np.zeros(size, dtype=np.int64)
    if sigma <= 0 or size == 0:
        return out
    t = np.floor(sigma) + 1.0
    pending = np.arange(size)
    while pending.size:
        m = pending.size
        u = uniform(3 * m)
        # A two-sided geometric: the difference of two geometrics with ratio exp(-1/t).
        laplace = np.floor(-t * np.log(u[:m])) - np.floor(-t * np.log(u[m:2 * m]))
        accept = u[2 * m:] <= np.exp(-((np.abs(laplace) - sigma**2 / t) ** 2) / (2.0 * sigma**2))
        out[pending[accept]] = laplace[accept].astype(np.int64)
        pending = pending[~accept]
    return out
