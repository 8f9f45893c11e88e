"""What a device accepts, whatever the coordinator and the aggregator tell it.

The configuration of a session comes from servers the threat model does not trust. A device
therefore re-checks it against its own minimum threat model before it makes a single key: a
threshold low enough for corrupt neighbours and a lying server to reach, a cohort below its own
privacy floor, a roster that does not list its own identity key, or a plain (unmasked) session
it never opted into are all refused, and so is a session without the consistency check unless
the device's policy says the server is semi-honest. So is a step whose DP noise is below the device's noise
floor, checked when its broadcast arrives. (A survivor set smaller than t is refused later, phase by
phase: the device unmasks only with t surviving neighbours.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tally.secagg.config import SessionConfig
from tally.secagg.errors import ProtocolError
from tally.secagg.params import ThreatModel, UnsafeParameters, check_privacy


class UnsafeSession(ProtocolError):
    """The device refuses a session configuration its policy does not allow."""

    status = "FAILED_PRECONDITION"


@dataclass(frozen=True)
class DevicePolicy:
    """``threat``: the worst case the device assumes (the job may assume worse, never better).
    By default 5 % corrupt devices colluding with a malicious server; the dropout rate is left
    to the job, which tunes it for liveness (a higher rate only raises k). ``allow_plain``: the
    device was started for a benchmark that measures what masking costs, and accepts sending
    its input unmasked. ``min_cohort``: the smallest cohort it joins. ``threat=None`` accepts
    whatever (k, t) the coordinator chose: for a device that trusts its coordinator, and for
    tests of the protocol mechanics at thresholds no real device would accept."""

    threat: ThreatModel | None = field(default_factory=lambda: ThreatModel(dropout_rate=0.0))
    allow_plain: bool = False
    min_cohort: int = 2
    # Differential privacy the device requires of every sum it joins (0: none required): a step
    # must add distributed noise of at least this multiplier (tally.privacy.payload.check_noise_floor).
    min_noise_multiplier: float = 0.0

    def check(self, config: SessionConfig, index: int, identity_public: bytes) -> None:
        if config.plain:
            if not self.allow_plain:
                raise UnsafeSession(
                    "the session is plain (unmasked) and this device did not opt in to plain "
                    "sessions: refusing to send its input in the clear"
                )
            return
        if self.threat is not None and self.threat.malicious_server and not config.consistency_check:
            raise UnsafeSession(
                "the session skips the consistency check, which this device requires of a server "
                "that may be malicious (without it the server can show each device its own "
                "survivor set and read one device's input); only a semi-honest policy "
                "(ThreatModel(malicious_server=False)) accepts such a session"
            )
        if config.n < self.min_cohort:
            raise UnsafeSession(f"cohort of {config.n} is below this device's floor {self.min_cohort}")
        try:
            if self.threat is not None:
                check_privacy(config.params, self.threat)
        except UnsafeParameters as exc:
            raise UnsafeSession(f"unsafe session parameters: {exc}") from None
        if config.identity(index) != identity_public:
            raise UnsafeSession(f"the roster does not list this device's identity key at index {index}")
