"""Simulated network dropouts for load tests: a device that, in some sessions, really closes
its stream (cancels the call) at one phase, exactly as a phone losing its connection would.

The aggregator cannot tell it from a real dropout, so the protocol's recovery paths (pairwise
masks of a dropout removed with its reconstructed key) are exercised end to end.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from tally.secagg.phases import DROPPABLE, Phase

# Every droppable phase but the consistency check, which not every session runs.
DEFAULT_PHASES = tuple(p for p in DROPPABLE if p is not Phase.CONSISTENCY_CHECK)


@dataclass(frozen=True)
class DropoutPlan:
    """With ``probability`` per session, leave in one of ``phases`` (uniformly chosen).

    Draws are deterministic per (seed, device id), so a load test replays the same dropouts.
    """

    probability: float
    phases: tuple[str, ...] = DEFAULT_PHASES
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError(f"dropout probability must be in [0, 1], got {self.probability}")
        object.__setattr__(self, "phases", tuple(self.phases))
        if not self.phases:
            raise ValueError("a dropout plan needs at least one phase")
        unknown = set(self.phases) - set(DROPPABLE)
        if unknown:
            raise ValueError(f"unknown dropout phases {sorted(unknown)}; choose from {DROPPABLE}")

    def draws(self, device_id: str) -> Iterator[str | None]:
        """One draw per session of ``device_id``: the phase to leave in, or None to stay."""
        salt = int.from_bytes(hashlib.sha256(device_id.encode()).digest()[:8], "little")
        rng = np.random.default_rng([self.seed, salt])
        while True:
            leave = rng.random() < self.probability
            phase = self.phases[int(rng.integers(len(self.phases)))]
            yield phase if leave else None
