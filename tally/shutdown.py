"""Stopping on SIGINT and SIGTERM, the one way every long-running tally process does it.

A service (coordinator, its device fronts, an aggregator, a device) waits on ``stop_on_signals``'
event and then stops gracefully: its supervisor's SIGTERM lets in-flight calls finish. A harness
that started processes of its own (the demo, the fault campaign, the fleet bench) runs its work
under ``cancelled_by_signals`` instead, so the work's ``finally`` stops those processes: killed
with a plain ``kill`` it would otherwise leave them running, holding their ports and cores.

Both need a running event loop (the handlers are the loop's, so the signal is seen between
awaits, not in the middle of one).
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Collection
from typing import TypeVar

T = TypeVar("T")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def stop_on_signals() -> asyncio.Event:
    """An event that SIGINT or SIGTERM sets, for the running loop's lifetime."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, stopping.set)
    return stopping


class Signalled(Exception):
    """A signal cancelled the work; whatever it had started was stopped in its ``finally``."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


async def cancelled_by_signals(work: Awaitable[T], signals: Collection[int] = STOP_SIGNALS) -> T:
    """Await ``work``; the first of ``signals`` cancels it and raises ``Signalled`` once its
    cleanup has run. The handlers are removed again when ``work`` ends, either way."""
    task = asyncio.ensure_future(work)
    loop = asyncio.get_running_loop()
    received: list[int] = []

    def cancel(signum: int) -> None:
        received.append(signum)
        task.cancel()

    for signum in signals:
        loop.add_signal_handler(signum, cancel, signum)
    try:
        return await task
    except asyncio.CancelledError:
        if received:
            raise Signalled(received[0]) from None
        raise
    finally:
        for signum in signals:
            loop.remove_signal_handler(signum)
