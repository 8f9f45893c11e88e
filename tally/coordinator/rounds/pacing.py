"""Pace steering: hold a whole population's check-ins to a target rate.

Without it every turned-away device comes back after the planner's hint (the rest of the current
round, or ``IDLE_RETRY_S`` when no job runs), so the check-in rate grows with the population:
10,000 idle devices told 5 s make 2,000 check-ins per second, whatever the coordinator can serve.
The pacer hands out come-back *slots* spaced ``1 / rate`` apart, each no earlier than the
planner's hint: in steady state the population arrives at the target rate however large it is,
and the slots never run ahead of time more than a population's worth (each device holds one), so
nothing needs to know the population's size. Selected devices are never paced: they get a task,
or, when their hold ran out while their cohort's session was opening, a retry marked ``at_once``
that must bring them back at once (paced, it sent them behind the whole population and their
cohort waited out a phase deadline for them). Devices held for a job's next round and let go
because another job's selection opened get ``at_once`` too. In-round polling (``GetStep``) is not
a check-in.
"""

from __future__ import annotations

from dataclasses import replace

from tally.coordinator.rounds.come_back import Retry

# Longest come-back time the pacer will give: a population too large for the target rate is told
# to come back within the hour, and the rate is exceeded (the histogram of retry-after shows it).
MAX_PACED_RETRY_S = 3600.0


class CheckinPacer:
    """``steer`` turns the planner's ``Retry`` into one at the next free slot. One pacer per
    coordinator: its capacity, not a population's, is what the rate protects."""

    def __init__(self, rate_per_s: float | None) -> None:
        if rate_per_s is not None and not rate_per_s > 0:
            raise ValueError(f"a check-in target rate must be > 0 per second, got {rate_per_s}")
        self.rate_per_s = rate_per_s
        self._next_slot = 0.0

    def steer(self, retry: Retry, now: float) -> Retry:
        if self.rate_per_s is None or retry.at_once:
            return retry
        slot = max(now + retry.seconds, self._next_slot)
        slot = min(slot, now + MAX_PACED_RETRY_S)
        self._next_slot = max(self._next_slot, slot) + 1.0 / self.rate_per_s
        return replace(retry, seconds=slot - now)
