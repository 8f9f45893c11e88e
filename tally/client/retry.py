"""Backoff for coordinator calls: a device fleet must not hammer a coordinator that is
restarting, and every device must get through once it is back.

Delays grow exponentially with "equal jitter" (half fixed, half random), so a fleet that lost
its coordinator at the same instant does not come back in lock-step.
"""

from __future__ import annotations

import asyncio
import random
import weakref
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
    if not await _Sleepers.of(stop).sleep(seconds):
        raise Stopped


class _Sleepers:
    """Everything pausing on one stop event, woken together when it is set: one waiter on the
    event, not one each. An ``asyncio.Event`` keeps its waiters in a deque that each one leaving
    scans: 100,000 devices of a fleet pausing on its stop event spent most of the fleet's CPU
    there (a quadratic cost), the devices' own work a small part."""

    _by_event: weakref.WeakKeyDictionary[asyncio.Event, _Sleepers] = weakref.WeakKeyDictionary()

    def __init__(self, stop: asyncio.Event) -> None:
        self.futures: set[asyncio.Future[bool]] = set()
        self.watcher = asyncio.ensure_future(stop.wait())
        self.watcher.add_done_callback(lambda _: self._wake(stop))

    @classmethod
    def of(cls, stop: asyncio.Event) -> _Sleepers:
        sleepers = cls._by_event.get(stop)
        if sleepers is None or sleepers.watcher.done():
            sleepers = cls._by_event[stop] = cls(stop)
        return sleepers

    def _wake(self, stop: asyncio.Event) -> None:
        if self._by_event.get(stop) is self:
            del self._by_event[stop]  # a stop cleared and set again gets a new watcher
        for future in self.futures:
            if not future.done():
                future.set_result(False)

    async def sleep(self, seconds: float) -> bool:
        """True when ``seconds`` passed, False when the stop event was set first."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bool] = loop.create_future()
        timer = loop.call_later(seconds, lambda: future.done() or future.set_result(True))
        self.futures.add(future)
        try:
            return await future
        finally:
            timer.cancel()
            self.futures.discard(future)


class CoordinatorUnreachable(ConnectionError):
    """No device (of a device's CLI, or of a fleet) completed a single check-in within the connect
    timeout."""

    @classmethod
    def after(cls, who: str, coordinator: str, seconds: float, last_error: str) -> CoordinatorUnreachable:
        """``who`` ("no device reached") the coordinator in ``seconds``; the hint follows the last
        error, since a coordinator that answers with a certificate the devices refuse is not down."""
        hint = ("it answers, but the TLS handshake fails" if "(TLS: " in last_error
                else "is it running, and is the address right?")
        return cls(f"{who} the coordinator at {coordinator} within {seconds:g} s (last error: "
                   f"{last_error or 'none yet'}); {hint}")
