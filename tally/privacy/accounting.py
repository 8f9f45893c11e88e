"""(epsilon, delta) per round and over the job, from Google's ``dp-accounting`` (RDP accountant).

Nothing here composes or converts privacy losses by hand: each round becomes a ``DpEvent``
whose noise multiplier is the noise *actually present* in that round's sum (for distributed
DP: the honest survivors' noise, KLS Theorem 1, so dropouts show up as a larger epsilon), and
the library composes the events and converts RDP to (epsilon, delta). Neighbouring jobs differ
by one device's contribution replaced by nothing (dp-accounting's REPLACE_SPECIAL, the "zero-out"
relation): who took part is no secret from a server that seated the cohort, what they sent is,
and a device moves the sum by at most its L2 clip.

Sampling: the coordinator seats whichever devices check in, which is not a random sample, so by
default no amplification is claimed (q = 1). A job may state its population; then each round is
taken as Poisson sampling with q = cohort_size / population (the standard DP-FedAvg
assumption, McMahan et al. 2018), which the operator must make true.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: a second of scipy that `tally job validate` of a job without DP skips
    import dp_accounting
    from dp_accounting.rdp import rdp_privacy_accountant

from tally.privacy.errors import PrivacyRefused

NOISE_KEY = "privacy.noise_multiplier"
MAX_NOISE_MULTIPLIER = 1000.0
# Integer RDP orders only: the library's fractional-order series for subsampled Gaussians may not
# converge (it then drops the order with a warning); integers are computed in closed form.
ORDERS = [*range(2, 64), 80, 96, 128, 192, 256, 512, 1024]
MIN_NOISE_MULTIPLIER = 0.01


def round_event(noise_multiplier: float, sampling_rate: float = 1.0) -> dp_accounting.DpEvent:
    """One round's sum as a DpEvent: a Gaussian of the given multiplier, Poisson-sampled if q < 1.
    An infinite epsilon (no honest noise at all) is a non-private event, never a silent zero."""
    import dp_accounting

    if not math.isfinite(noise_multiplier) or noise_multiplier <= 0:
        return dp_accounting.NonPrivateDpEvent()
    gaussian = dp_accounting.GaussianDpEvent(noise_multiplier)
    return gaussian if sampling_rate >= 1.0 else dp_accounting.PoissonSampledDpEvent(sampling_rate, gaussian)


def _accountant() -> rdp_privacy_accountant.RdpAccountant:
    import dp_accounting
    from dp_accounting.rdp import rdp_privacy_accountant

    return rdp_privacy_accountant.RdpAccountant(
        ORDERS, dp_accounting.NeighboringRelation.REPLACE_SPECIAL)


def epsilon_of(noise_multiplier: float, rounds: int, delta: float, sampling_rate: float = 1.0) -> float:
    accountant = _accountant()
    accountant.compose(round_event(noise_multiplier, sampling_rate), rounds)
    return float(accountant.get_epsilon(delta))


@functools.lru_cache(maxsize=64)  # a job's submit check and its runner calibrate the same target
def calibrate(target_epsilon: float, delta: float, rounds: int, sampling_rate: float = 1.0) -> float:
    """The smallest noise multiplier whose ``rounds`` rounds stay within ``target_epsilon``;
    ``PrivacyRefused`` when none up to MAX_NOISE_MULTIPLIER does."""
    reachable = epsilon_of(MAX_NOISE_MULTIPLIER, rounds, delta, sampling_rate)
    if reachable > target_epsilon:
        raise PrivacyRefused(
            f"target_epsilon {target_epsilon:g} at delta {delta:g} over {rounds} rounds is out of reach: "
            f"even noise multiplier {MAX_NOISE_MULTIPLIER:g} gives epsilon {reachable:.3g}")
    if epsilon_of(MIN_NOISE_MULTIPLIER, rounds, delta, sampling_rate) <= target_epsilon:
        return MIN_NOISE_MULTIPLIER
    import dp_accounting
    from dp_accounting import mechanism_calibration

    return float(mechanism_calibration.calibrate_dp_mechanism(
        _accountant,
        lambda z: dp_accounting.SelfComposedDpEvent(round_event(z, sampling_rate), rounds),
        target_epsilon, delta,
        mechanism_calibration.ExplicitBracketInterval(MIN_NOISE_MULTIPLIER, MAX_NOISE_MULTIPLIER),
        tol=1e-4,
    ))


@dataclass(frozen=True)
class RoundPrivacy:
    """What one round cost and what the job has spent so far, at the job's delta."""

    round: int
    noise_multiplier: float
    noise_devices: int | None
    epsilon_round: float
    epsilon_total: float
    delta: float

    def as_metrics(self) -> dict[str, float]:
        out = {
            "privacy.epsilon": self.epsilon_total, "privacy.epsilon_round": self.epsilon_round,
            "privacy.delta": self.delta, NOISE_KEY: self.noise_multiplier,
        }
        if self.noise_devices is not None:
            out["privacy.noise_devices"] = float(self.noise_devices)
        return out


class PrivacyLedger:
    """The job's running account; ``record`` is called once per released sum."""

    def __init__(self, delta: float, sampling_rate: float = 1.0) -> None:
        if not 0 < delta < 1:
            raise PrivacyRefused(f"delta must be in (0, 1), got {delta}")
        self.delta, self.sampling_rate = delta, sampling_rate
        self._accountant = _accountant()
        self.rounds: list[RoundPrivacy] = []
        self._uncommitted: list[float] = []

    @property
    def epsilon(self) -> float:
        return self.rounds[-1].epsilon_total if self.rounds else 0.0

    def record(self, round_: int, noise_multiplier: float, noise_devices: int | None = None) -> RoundPrivacy:
        event = round_event(noise_multiplier, self.sampling_rate)
        self._accountant.compose(event)
        single = _accountant()
        single.compose(event)
        entry = RoundPrivacy(round_, noise_multiplier, noise_devices, float(single.get_epsilon(self.delta)),
                             float(self._accountant.get_epsilon(self.delta)), self.delta)
        self.rounds.append(entry)
        self._uncommitted.append(noise_multiplier)
        return entry

    def commit(self) -> dict[str, float]:
        """A round's ledger entries for its committed metrics: every sum released since the last
        commit (a failed attempt's decoded sums count too), so ``replay`` restores the account."""
        out = {f"{NOISE_KEY}.{i}": z for i, z in enumerate(self._uncommitted)}
        if self.rounds:
            out.update({k: v for k, v in self.rounds[-1].as_metrics().items() if k != NOISE_KEY})
        out["privacy.events"] = float(len(self._uncommitted))
        self._uncommitted = []
        return out

    def replay(self, round_: int, metrics: Mapping[str, float]) -> None:
        """Re-record a committed round's events (a restarted coordinator's account)."""
        for i in range(int(metrics.get("privacy.events", 0))):
            self.record(round_, float(metrics[f"{NOISE_KEY}.{i}"]))
        self._uncommitted = []
