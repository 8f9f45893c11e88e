"""Backoff for coordinator calls: a device fleet must not hammer a coordinator that is
restarting, and every device must get through once it is back.

Delays grow exponentially with "equal jitter" (half fixed, half random), so a fleet that lost
its coordinator at the same instant does not come back in lock-step.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import grpc

# Transient by nature: the server is down or overloaded, or the call ran out of time. CANCELLED
# reaches a client as a status only when the server side cancelled the call, which is what a
# coordinator shutting down does to the check-ins it is holding (the device's own cancellations
# raise asyncio.CancelledError instead).
RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.CANCELLED,
    }
)


class Stopped(Exception):
    """The caller's stop event was set while the device was waiting."""


@dataclass(frozen=True)
class RetryPolicy:
    """``max_attempts`` None retries until stopped: a device outlives any coordinator outage."""

    initial_seconds: float = 0.2
    max_seconds: float = 15.0
    multiplier: float = 2.0
    jitter: float = 0.5
    # Deadline of one unary call (and of one attempt of a streamed download).
    call_timeout: float = 30.0
    max_attempts: int | None = None

    def __post_init__(self) -> None:
        if not 0 < self.initial_seconds <= self.max_seconds:
            raise ValueError("need 0 < initial_seconds <= max_seconds")
        if self.multiplier < 1 or not 0 <= self.jitter <= 1:
            raise ValueError("multiplier must be >= 1 and jitter in [0, 1]")
        if self.call_timeout <= 0:
            raise ValueError("call_timeout must be positive")

    def delay(self, attempt: int, rng: random.Random) -> float:
        """Seconds to wait before retry number ``attempt`` (0-based)."""
        base = min(self.max_seconds, self.initial_seconds * self.multiplier ** min(attempt, 64))
        return base * (1 - self.jitter * rng.random())

    def exhausted(self, attempt: int) -> bool:
        return self.max_attempts is not None and attempt + 1 >= self.max_attempts


async def pause(seconds: float, stop: asyncio.Event | None) -> None:
    """Sleep ``seconds``, or raise ``Stopped`` as soon as ``stop`` is set."""
    if stop is None:
        await asyncio.sleep(seconds)
        return
    if stop.is_set():
        raise Stopped
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    except TimeoutError:
        return
    raise Stopped
