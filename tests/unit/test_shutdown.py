"""tally.shutdown, how every long-running process stops: a service's stop event is set by SIGINT
or SIGTERM, and a harness's work is cancelled by them with its cleanup run first. The signals
are sent to this process; the loop's handlers catch them, so nothing else sees them."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from tally.shutdown import Signalled, cancelled_by_signals, stop_on_signals


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_either_signal_sets_the_stop_event(signum):
    async def main() -> bool:
        stopping = stop_on_signals()
        assert not stopping.is_set()
        os.kill(os.getpid(), signum)
        await asyncio.wait_for(stopping.wait(), timeout=10)
        return stopping.is_set()

    assert asyncio.run(main())


def test_a_signal_cancels_the_work_after_its_cleanup_and_says_which():
    cleaned: list[str] = []

    async def work() -> None:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.Event().wait()  # only the cancellation ends this
        finally:
            cleaned.append("stopped its processes")

    async def main() -> None:
        await cancelled_by_signals(work())

    with pytest.raises(Signalled) as raised:
        asyncio.run(main())
    assert raised.value.signum == signal.SIGTERM and str(raised.value) == "SIGTERM"
    assert cleaned == ["stopped its processes"]


def test_work_that_ends_returns_its_result_and_gives_the_signals_back():
    async def main() -> int:
        result = await cancelled_by_signals(asyncio.sleep(0, result=7), (signal.SIGTERM,))
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the loop's handler is gone
        return result

    assert asyncio.run(main()) == 7
