"""How simulated devices behave: a load tester's YAML profile (``tally fleet --profile``).

A real population is not a thousand identical, always-online devices: some are offline, some
check in rarely, some train slowly or sit behind a slow uplink, some leave for good and new ones
join, and a few send what they should not. A profile states the distributions; every device
draws its own traits from them, deterministically from (fleet seed, device id), so N shards on N
machines are one population and a run can be replayed::

    availability: {online: 0.8, spell_seconds: 300}      # or diurnal: {trough: 0.2, peak: 0.9, period_seconds: 600}
    checkin: {period_seconds: 5, jitter: 0.3}
    compute: {seconds: 1.0, speed_sigma: 0.5}             # log-normal speed factor around 1
    network: {uplink_mbps: 20, downlink_mbps: 50, bandwidth_sigma: 0.7, latency_ms: [20, 200]}
    dropout: {advertise_keys: 0.02, share_keys: 0.02, masked_input: 0.05, unmask: 0.01}
    churn: {leave_per_hour: 0.5}
    misbehaviour: {late: 0.01, duplicate: 0.01, replay: 0.01, corrupt: 0.01, stall: 0.01,
                   bad_shares: 0.01, garbage_share: 0.01}

Bandwidth and latency are applied on the device side (a delay before each message it sends and
after each it receives), so a fleet on one machine sees the session timings of a slow network
without traffic control on the host.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tally.loadtest.dropout import DEFAULT_PHASES
from tally.secagg.adversary import CorruptDealer, GarbageDealer, InconsistentDealer

Probability = Annotated[float, Field(ge=0.0, le=1.0)]
Positive = Annotated[float, Field(gt=0.0)]
NonNegative = Annotated[float, Field(ge=0.0)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Diurnal(_Section):
    """The online fraction follows a cosine between ``trough`` and ``peak`` over ``period_seconds``
    (a day, or a compressed one for a load test), peaking ``peak_at_seconds`` into it."""

    trough: Probability
    peak: Probability
    period_seconds: Positive = 86_400.0
    peak_at_seconds: NonNegative = 0.0

    def online(self, t: float) -> float:
        phase = 2 * math.pi * (t - self.peak_at_seconds) / self.period_seconds
        return self.trough + (self.peak - self.trough) * (1 + math.cos(phase)) / 2


class Availability(_Section):
    """A device is online or offline for spells of ``spell_seconds`` (exponential, mean); at each
    spell's start it is online with the fraction at that time: ``online``, or ``diurnal``'s."""

    online: Probability = 1.0
    diurnal: Diurnal | None = None
    spell_seconds: Positive = 300.0

    def fraction(self, t: float) -> float:
        return self.diurnal.online(t) if self.diurnal is not None else self.online


class CheckIn(_Section):
    """An idle device waits at least ``period_seconds`` between check-ins (longer when the
    coordinator says so), stretched by up to ``jitter`` of itself at random."""

    period_seconds: NonNegative = 0.0
    jitter: NonNegative = 0.1


class Compute(_Section):
    """Seconds a task's local computation takes on a median device, and the spread of device
    speeds (log-normal sigma): a device's time is ``seconds`` divided by its speed."""

    seconds: NonNegative = 0.0
    speed_sigma: NonNegative = 0.0


class Network(_Section):
    """Median uplink and downlink (Mbit/s, log-normal across devices with ``bandwidth_sigma``)
    and a one-way latency drawn per device, uniform in [low, high] milliseconds."""

    uplink_mbps: Positive | None = None
    downlink_mbps: Positive | None = None
    bandwidth_sigma: NonNegative = 0.0
    latency_ms: tuple[NonNegative, NonNegative] = (0.0, 0.0)

    @model_validator(mode="after")
    def _ordered(self) -> Network:
        if self.latency_ms[0] > self.latency_ms[1]:
            raise ValueError(f"latency_ms: low {self.latency_ms[0]} is above high {self.latency_ms[1]}")
        return self


class Churn(_Section):
    """Devices leave for good at ``leave_per_hour`` (per device, exponential lifetimes); each
    one that leaves is replaced by a new device (new id, new identity, new registration)."""

    leave_per_hour: NonNegative = 0.0


class Misbehaviour(_Section):
    """Per session, the probability that the device sends its masked input after the phase's
    deadline (``late``), sends one message twice (``duplicate``), sends a message of an earlier
    session again (``replay``), sends bytes that are no message (``corrupt``), stops reading
    and writing without closing its stream (``stall``), deals Shamir shares that lie on no
    polynomial (``bad_shares``) or random bytes for one neighbour (``garbage_share``). The
    aggregator must refuse, outwait or exclude each, and the round go on."""

    late: Probability = 0.0
    duplicate: Probability = 0.0
    replay: Probability = 0.0
    corrupt: Probability = 0.0
    stall: Probability = 0.0
    bad_shares: Probability = 0.0
    garbage_share: Probability = 0.0


class BehaviourProfile(_Section):
    availability: Availability = Availability()
    checkin: CheckIn = CheckIn()
    compute: Compute = Compute()
    network: Network = Network()
    # Probability of leaving in each phase (a device leaves in at most one, the first drawn).
    dropout: dict[str, Probability] = {}
    churn: Churn = Churn()
    misbehaviour: Misbehaviour = Misbehaviour()

    @model_validator(mode="after")
    def _known_phases(self) -> BehaviourProfile:
        unknown = sorted(set(self.dropout) - set(DEFAULT_PHASES))
        if unknown:
            raise ValueError(f"dropout: unknown phases {unknown}; choose from {list(DEFAULT_PHASES)}")
        return self

    @classmethod
    def load(cls, path: Path) -> BehaviourProfile:
        """Raises ValueError naming the field at fault (OSError when it cannot be read)."""
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ValueError(f"not YAML: {exc}") from None
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            raise ValueError("; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'profile'}: {e['msg']}"
                                       for e in exc.errors())) from None

    def traits(self, seed: int, device_id: str) -> DeviceTraits:
        return DeviceTraits(self, _rng(seed, device_id, "traits"), _rng(seed, device_id, "events"))


@dataclass(frozen=True)
class SessionEvents:
    """What a simulated device does in one session besides the protocol: leave in a phase, send
    its masked input after the phase's deadline, send a message twice, open with a message of
    its previous session, send bytes that are no message, fall silent with its stream open, or
    deal as a corrupt dealer (``tally.secagg.adversary``)."""

    drop_phase: str | None = None
    late: bool = False
    duplicate: bool = False
    replay: bool = False
    corrupt: bool = False
    stall: bool = False
    dealer: type[CorruptDealer] | None = None


def _rng(seed: int, device_id: str, what: str) -> np.random.Generator:
    digest = hashlib.sha256(f"tally-behaviour/{seed}/{device_id}/{what}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:16], "little"))


class DeviceTraits:
    """One device's draw from a profile: fixed traits (speed, bandwidth, latency, lifetime) and a
    stream of per-session events (dropout phase, misbehaviour), both reproducible."""

    def __init__(self, profile: BehaviourProfile, fixed: np.random.Generator, events: np.random.Generator) -> None:
        self.profile = profile
        self._events = events
        net = profile.network
        self.speed = float(fixed.lognormal(0.0, profile.compute.speed_sigma))
        self.uplink_bps = _bandwidth(fixed, net.uplink_mbps, net.bandwidth_sigma)
        self.downlink_bps = _bandwidth(fixed, net.downlink_mbps, net.bandwidth_sigma)
        self.latency_s = float(fixed.uniform(*net.latency_ms)) / 1000.0
        rate = profile.churn.leave_per_hour / 3600.0
        self.lifetime_s = float(fixed.exponential(1.0 / rate)) if rate > 0 else math.inf
        self._spells = fixed  # availability spells continue the fixed stream: a device's own schedule
        self._spell_end = 0.0
        self._online = True

    @property
    def compute_seconds(self) -> float:
        return self.profile.compute.seconds / self.speed

    def send_delay(self, size: int) -> float:
        return self.latency_s + (8 * size / self.uplink_bps if self.uplink_bps else 0.0)

    def receive_delay(self, size: int) -> float:
        return self.latency_s + (8 * size / self.downlink_bps if self.downlink_bps else 0.0)

    def offline_for(self, t: float) -> float:
        """Seconds from ``t`` (seconds since the fleet started) until the device is online: 0
        when it is. Spells are drawn as time passes, so the schedule depends only on ``t``'s
        sequence, not on how often the device asks."""
        availability = self.profile.availability
        while t >= self._spell_end:
            start = self._spell_end
            self._online = bool(self._spells.random() < availability.fraction(start))
            self._spell_end = start + float(self._spells.exponential(availability.spell_seconds))
        return 0.0 if self._online else self._spell_end - t

    def checkin_wait(self, asked: float) -> float:
        checkin = self.profile.checkin
        return max(asked, checkin.period_seconds) * (1 + checkin.jitter * float(self._events.random()))

    def session_events(self) -> SessionEvents:
        """This session's draw: the phase the device leaves in (or None) and what it misbehaves."""
        drop = None
        for phase in DEFAULT_PHASES:
            if self._events.random() < self.profile.dropout.get(phase, 0.0) and drop is None:
                drop = phase
        bad = self.profile.misbehaviour
        flags = [bool(self._events.random() < p) for p in (bad.late, bad.duplicate, bad.replay, bad.corrupt, bad.stall)]
        dealer = None
        # Drawn only when asked for, so the profiles before these faults keep their draws.
        for adversary, p in ((InconsistentDealer, bad.bad_shares), (GarbageDealer, bad.garbage_share)):
            if p > 0 and self._events.random() < p and dealer is None:
                dealer = adversary
        return SessionEvents(drop, *flags, dealer=dealer)


def _bandwidth(rng: np.random.Generator, median_mbps: float | None, sigma: float) -> float | None:
    draw = float(rng.lognormal(0.0, sigma))  # drawn even when unset: other traits stay put
    return None if median_mbps is None else median_mbps * 1e6 * draw
