"""What a device does to its payload, and what the server does to the sum, per mechanism.

Central (DP-FedAvg as in the spec's DP-FED, McMahan et al. 2018): the device clips its payload's
L2 norm; the secure sum adds the clipped payloads; the coordinator adds N(0, (zC)^2) to the
decoded total. The server is trusted to add the noise.

Distributed discrete Gaussian (Kairouz, Liu, Steinke 2021): the device clips, rotates (random
Hadamard), scales and conditionally rounds its payload to integers, then adds its share of
discrete Gaussian noise in the ring. The secure sum's output already carries the whole noise:
neither the aggregator nor the coordinator ever holds an un-noised total. The server only
descales and unrotates.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tally.privacy import randomness
from tally.privacy.errors import PrivacyRefused
from tally.privacy.planning import DistributedPlan
from tally.privacy.rotation import rotate, unrotate

MAX_ROUNDING_TRIES = 1000


def clip_l2(vector: np.ndarray, clip: float) -> np.ndarray:
    """The vector scaled onto the L2 ball of radius ``clip`` (unchanged when inside it)."""
    norm = float(np.linalg.norm(vector))
    return vector if norm <= clip else vector * (clip / norm)


def conditional_round(scaled: np.ndarray, bound_sq: float) -> np.ndarray:
    """KLS conditional randomized rounding: round each coordinate up with probability its
    fractional part (unbiased), and redraw the whole vector while its squared norm exceeds
    ``bound_sq``, so the discretised sensitivity is a bound, not an expectation."""
    floor = np.floor(scaled)
    fraction = scaled - floor
    for _ in range(MAX_ROUNDING_TRIES):
        rounded: np.ndarray = floor + randomness.bernoulli(fraction)
        if float(rounded @ rounded) <= bound_sq:
            return rounded.astype(np.int64)
    raise PrivacyRefused(f"conditional rounding failed {MAX_ROUNDING_TRIES} times; the norm bound is wrong")


@dataclass(frozen=True)
class DeviceShare:
    """What a device needs of a distributed plan (broadcast with the step)."""

    clip: float
    scale: float
    bound_sq: float
    sigma_device: float

    @classmethod
    def of(cls, plan: DistributedPlan) -> DeviceShare:
        return cls(plan.clip, plan.scale, plan.bound_sq, plan.sigma_device)


def encode_distributed(vector: np.ndarray, share: DeviceShare, seed: int) -> np.ndarray:
    """A device's ring contribution: clipped, rotated, scaled, rounded, plus its noise share.
    Returns signed integers; reduction mod 2^b (modular clipping) is the ring's, at encoding."""
    clipped = clip_l2(np.asarray(vector, dtype=np.float64), share.clip)
    rounded = conditional_round(rotate(clipped, seed) * share.scale, share.bound_sq)
    noisy: np.ndarray = rounded + randomness.discrete_gaussian(share.sigma_device, rounded.size)
    return noisy


def decode_distributed(total: np.ndarray, plan: DistributedPlan, seed: int) -> np.ndarray:
    """The noisy sum in the payload's coordinates: descaled and unrotated."""
    return unrotate(np.asarray(total, dtype=np.float64) / plan.scale, seed, plan.dim)


def central_noise(noise_multiplier: float, clip: float, size: int) -> np.ndarray:
    """The coordinator's Gaussian noise for a sum of clipped payloads (std z * C)."""
    return randomness.gaussian(noise_multiplier * clip, size)
