"""Parameters of the distributed discrete Gaussian (Kairouz, Liu, Steinke 2021, "KLS") for one
payload: scale, rounding bound, per-device noise, per-device ring share, hence the bit width.

Everything is in ring units (a real value x becomes round(x * scale)). The privacy guarantee is
stated against the *discretised* sensitivity, so quantisation never weakens it; it costs accuracy
instead, as extra noise z * (Delta_2 / scale - C), which the automatic scale keeps below
``inflation`` of the ideal z * C.

The ring: a cohort sum over c survivors must stay inside [-c*M, c*M], the range the coordinator's
decoder accepts for c contributors of a field of per-device bound M (a sum outside it is refused,
never wrapped silently). After the rotation each coordinate of the sum is sub-Gaussian with
proxy (c*u)^2/D (u = C*scale; worst case: every update aligned), plus at most c of rounding and
Gaussian noise of variance c*sigma_dev^2; so M >= 1 + k*sqrt(u^2/D + sigma_dev^2/c) with
k = sqrt(2 ln(2D/beta)) holds every coordinate with probability 1 - beta. The bound is worst at
the fewest survivors a cohort sum may have (``min_cohort``); the bit width is then the codec's
for the cohort size: bits = bitlength(2 n M). This is where noise, cohort size and dropout rate
set the bits: more noise widens M, a larger cohort multiplies it, and expected dropouts raise
the noise each device adds (sigma_dev^2 = sigma^2 / honest survivors).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tally.codec import Field, PayloadSchema
from tally.codec.schema import MAX_RING_BITS
from tally.privacy.errors import PrivacyRefused
from tally.privacy.rotation import padded_size

DP_FIELD = "dp_ring"
# KLS's conditional rounding retries when the rounded norm exceeds its bound; with
# beta = exp(-1/2) a device needs about 1.6 tries on average (KLS section 5).
ROUNDING_BETA = math.exp(-0.5)
DEFAULT_INFLATION = 0.01
DEFAULT_WRAP_PROBABILITY = 1e-6
MIN_SCALE_UNITS = 1e-3


def rounding_bound_sq(units: float, dim: int, beta: float = ROUNDING_BETA) -> float:
    """KLS Theorem 2: the squared L2 norm a conditionally rounded vector of norm <= ``units``
    may have (the retry loop enforces it), min of the concentration and the trivial bound."""
    root = math.sqrt(2.0 * math.log(1.0 / beta))
    return min(units**2 + dim / 4.0 + root * (units + math.sqrt(dim) / 2.0),
               (units + math.sqrt(dim)) ** 2)


def kls_epsilon(sensitivity: float, sigma: float, devices: int, dim: int) -> float:
    """KLS Theorem 1: the sum of ``devices`` independent N_Z(0, sigma^2)^dim vectors is
    (eps^2/2)-zCDP for an integer input of L2 norm <= ``sensitivity``; the tau terms measure how
    far a sum of discrete Gaussians is from one discrete Gaussian (negligible for sigma >= 2)."""
    if devices < 1 or sigma <= 0:
        return math.inf
    tau = 10.0 * sum(math.exp(-2.0 * math.pi**2 * sigma**2 * k / (k + 1)) for k in range(1, devices))
    total = devices * sigma**2
    return min(math.sqrt(sensitivity**2 / total + tau * dim / 2.0),
               sensitivity / math.sqrt(total) + tau * math.sqrt(dim))


@dataclass(frozen=True)
class DistributedPlan:
    """One step's distributed-DP parameters; ``share`` is M, each device's part of the range."""

    clip: float
    dim: int
    padded: int
    scale: float
    noise_multiplier: float
    noise_devices: int
    wrap_probability: float
    min_survivors: int

    @property
    def units(self) -> float:
        return self.clip * self.scale

    @property
    def bound_sq(self) -> float:
        return rounding_bound_sq(self.units, self.padded)

    @property
    def sensitivity(self) -> float:
        """Delta_2 in ring units: the largest norm a device's rounded vector can have."""
        return math.sqrt(self.bound_sq)

    @property
    def sigma_total(self) -> float:
        return self.noise_multiplier * self.sensitivity

    @property
    def sigma_device(self) -> float:
        return self.sigma_total / math.sqrt(self.noise_devices)

    @property
    def inflation(self) -> float:
        """Noise actually added over the ideal z*C, from discretisation (>= 1)."""
        return self.sensitivity / self.units

    @property
    def share(self) -> int:
        k = math.sqrt(2.0 * math.log(2.0 * self.padded / self.wrap_probability))
        spread = math.sqrt(self.units**2 / self.padded + self.sigma_device**2 / self.min_survivors)
        return math.ceil(1.0 + k * spread)

    def wire_schema(self) -> PayloadSchema:
        return PayloadSchema((Field(DP_FIELD, (self.padded,), clip=float(self.share), frac_bits=0),))

    def bits(self, cohort_size: int) -> int:
        return self.wire_schema().required_bits(cohort_size)

    def epsilon_zcdp(self, noise_devices: int) -> float:
        """The zCDP epsilon (rho = eps^2/2) of a sum to which ``noise_devices`` honest devices
        added their noise: the noise actually present, not the noise planned."""
        return kls_epsilon(self.sensitivity, self.sigma_device, noise_devices, self.padded)


def _kls_tight(plan: DistributedPlan) -> bool:
    """Whether the planned honest survivors' noise is as private as the spec's multiplier."""
    return 1.0 / plan.epsilon_zcdp(plan.noise_devices) >= plan.noise_multiplier * (1 - 1e-3)


def noise_devices(cohort_size: int, dropout_rate: float, corrupt_rate: float) -> int:
    """Honest survivors a cohort is planned for: expected dropouts and devices colluding with the
    server (who know, and can subtract, their own noise) add nothing the accountant may count."""
    return math.floor(cohort_size * (1.0 - dropout_rate)) - corrupt_devices(cohort_size, corrupt_rate)


def corrupt_devices(cohort_size: int, corrupt_rate: float) -> int:
    return math.ceil(cohort_size * corrupt_rate)


def plan_distributed(
    *, clip: float, dim: int, noise_multiplier: float, cohort_size: int, dropout_rate: float,
    corrupt_rate: float, min_survivors: int, bits: int | None = None,
    inflation: float = DEFAULT_INFLATION, wrap_probability: float = DEFAULT_WRAP_PROBABILITY,
) -> DistributedPlan:
    """The scale is the smallest that keeps discretisation below ``inflation``, or, with
    ``bits``, the largest whose ring fits that many bits. ``PrivacyRefused`` says why no plan
    exists."""
    honest = noise_devices(cohort_size, dropout_rate, corrupt_rate)
    if honest < 1:
        raise PrivacyRefused(
            f"cohort_size {cohort_size} with dropout_rate {dropout_rate} and corrupt_rate {corrupt_rate} "
            "leaves no honest survivor to add noise; distributed DP needs a larger cohort")
    if noise_multiplier <= 0:
        raise PrivacyRefused(f"noise multiplier must be > 0, got {noise_multiplier}")
    padded = padded_size(dim)

    def at(units: float) -> DistributedPlan:
        return DistributedPlan(clip, dim, padded, units / clip, noise_multiplier, honest, wrap_probability,
                               max(1, min_survivors))

    if bits is None:
        low, high = MIN_SCALE_UNITS, 1e12  # Delta/u falls monotonically in u
        if at(high).inflation > 1 + inflation:
            raise PrivacyRefused(f"no scale keeps discretisation below {inflation:.0%}")
        for _ in range(200):
            mid = math.sqrt(low * high)
            low, high = (low, mid) if at(mid).inflation <= 1 + inflation else (mid, high)
        plan = at(high)
        # Large cohorts split the noise thinly: widen the scale until each device's share is
        # large enough for a sum of discrete Gaussians to be as private as one (KLS tau term).
        while not _kls_tight(plan) and plan.units < 1e12:
            plan = at(plan.units * 1.25)
    else:
        if at(MIN_SCALE_UNITS).bits(cohort_size) > bits:
            raise PrivacyRefused(
                f"{bits} bits cannot hold the noisy sum of {cohort_size} devices at noise multiplier "
                f"{noise_multiplier}; it needs at least {at(MIN_SCALE_UNITS).bits(cohort_size)}")
        low, high = MIN_SCALE_UNITS, 1e12
        for _ in range(200):
            mid = math.sqrt(low * high)
            low, high = (mid, high) if at(mid).bits(cohort_size) <= bits else (low, mid)
        plan = at(low)
    if plan.sigma_device < 0.5:  # KLS Theorem 1 needs sigma >= 1/2 per device
        raise PrivacyRefused(
            f"each device's share of the noise ({plan.sigma_device:.3g} ring units) is below the 1/2 "
            "the distributed discrete Gaussian's analysis needs; use more bits or more noise")
    if not _kls_tight(plan):
        raise PrivacyRefused(
            f"a sum of {honest} devices' discrete Gaussians at {plan.sigma_device:.3g} ring units each is "
            f"measurably less private than noise multiplier {noise_multiplier:g} (KLS tau term); use more bits")
    if plan.bits(cohort_size) > MAX_RING_BITS:
        raise PrivacyRefused(
            f"the noisy sum of {cohort_size} devices needs {plan.bits(cohort_size)} bits, more than "
            f"a ring's {MAX_RING_BITS}")
    return plan
