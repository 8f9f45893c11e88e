"""What a device turned away at check-in is told: when to come back, and why.

Apart from the round planner because every process serving devices answers idle check-ins (the
coordinator and its device fronts), and a front must not import the planner's numerics.
"""

from __future__ import annotations

from dataclasses import dataclass

# Come-back time when no job of the device's population is running.
IDLE_RETRY_S = 5.0


@dataclass(frozen=True)
class Retry:
    seconds: float
    reason: str
    population_idle: bool = False  # no job of the device's population is running
    # The device is wanted back at once (it has a seat whose task it has not received, or the
    # selection it was held away from opened): pace steering leaves this answer alone.
    at_once: bool = False


def idle_retry(population: str) -> Retry:
    """The answer to a device of a population no job is running for."""
    return Retry(IDLE_RETRY_S, f"no running job for population {population!r}", population_idle=True)
