"""The check-ins one job holds open, apart from the round loop that answers them.

A device that the selection seats, or that waits for the next attempt's selection while this one
aggregates (``WaitingRoom``), is not answered at once: its check-in is held until its task is
ready or the hold runs out. Holding is its own concern because every way out of a round (a task
delivered, an attempt failed, another job's selection opening, the job stopping) must answer
each held check-in exactly once, and a hold that ends must give its seat back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

from tally.coordinator.rounds.planner import MIN_RETRY_S, Retry, RoundPlanner, WaitingRoom
from tally.wire.v1 import coordinator_pb2

CheckInResult = coordinator_pb2.TaskAssignment | Retry


class CheckInHolds:
    """One job's held check-ins: those waiting for the current selection's tasks, and (in
    ``waiting``) those waiting for the next attempt's selection.

    ``planner`` returns the job's current attempt (None between rounds): a hold outlives
    attempts, so it must free its seat in whichever attempt is current when it ends.
    ``silos_full`` says whether every silo id of the job is taken, none by the device."""

    def __init__(
        self, planner: Callable[[], RoundPlanner | None], silos_full: Callable[[str], bool]
    ) -> None:
        self._planner, self._silos_full = planner, silos_full
        self._futures: dict[str, asyncio.Future[CheckInResult]] = {}
        self.waiting: WaitingRoom | None = None

    async def hold(self, device_id: str, hold_s: float) -> CheckInResult:
        """Wait for a held device's task; free its seat if the wait ends first."""
        previous = self._futures.get(device_id)
        if previous is not None and not previous.done():
            previous.set_result(Retry(MIN_RETRY_S, "superseded by a newer check-in"))
        future: asyncio.Future[CheckInResult] = asyncio.get_running_loop().create_future()
        self._futures[device_id] = future
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout=hold_s)
        except TimeoutError:
            if future.done():
                return future.result()
            return self._hold_ended(device_id)
        except asyncio.CancelledError:
            self._withdraw(device_id)
            raise
        finally:
            if self._futures.get(device_id) is future:
                del self._futures[device_id]

    def _hold_ended(self, device_id: str) -> Retry:
        """A hold ran out: free the device's place, unless the selection already closed with it
        (the cohorts are being formed, as happens to a device held since the last aggregation):
        then its task is on the way and it comes back for it at once, unpaced."""
        planner = self._planner()
        if planner is not None and planner.has_seat(device_id):
            return Retry(MIN_RETRY_S, "seated: come back for the task", at_once=True)
        waited_for_next = self._withdraw(device_id)
        return Retry(MIN_RETRY_S, "next selection not open yet" if waited_for_next else "selection still open")

    def _withdraw(self, device_id: str) -> bool:
        """Free whatever seat a held check-in had; True if it was waiting for the next attempt."""
        room = self.waiting
        if room is not None and device_id in room.held:
            room.withdraw(device_id)
            return True
        planner = self._planner()
        if planner is not None:
            planner.withdraw(device_id)
        return False

    def _answer(self, device_id: str, answer: Retry) -> None:
        """End ``device_id``'s held check-in, if it is still waiting, with ``answer``."""
        future = self._futures.pop(device_id, None)
        if future is not None and not future.done():
            future.set_result(answer)

    def revoke(self, device_id: str) -> None:
        """End ``device_id``'s held check-in and free its place (its device was revoked)."""
        if device_id in self._futures:
            self._withdraw(device_id)
            self._answer(device_id, Retry(MIN_RETRY_S, "device revoked"))

    def hold_for_next(self, device_id: str, ledger_id: str = "") -> bool:
        """Whether ``device_id``, turned away while an attempt aggregates, is held for the next
        attempt's selection instead (then ``hold`` it); ``ledger_id`` goes with it to its seat."""
        room, planner = self.waiting, self._planner()
        if room is None or (planner is not None and device_id in planner.seats):
            return False
        return not self._silos_full(device_id) and room.offer(device_id, ledger_id)

    def open_waiting_room(self, capacity: int) -> None:
        """From now on, devices turned away may wait for the next attempt's selection."""
        self.waiting = WaitingRoom(capacity)

    def seat_waiting(self, planner: RoundPlanner, now: float) -> tuple[int, int] | None:
        """Offer the devices held while the previous attempt aggregated to ``planner``'s
        selection as its first arrivals; those it may not seat (seated in an earlier attempt of
        the round) are answered at once. (seated, turned away), or None when nobody waited."""
        room, self.waiting = self.waiting, None
        if room is None:
            return None
        turned_away = [d for d, ledger_id in room.held.items() if not planner.selection.offer(d, ledger_id)]
        for device_id in turned_away:
            self._answer(device_id, planner.retry(now, "seated in an earlier attempt of this round"))
        return len(room.held) - len(turned_away), len(turned_away)

    def deliver(self, planner: RoundPlanner, tasks: Mapping[str, coordinator_pb2.TaskAssignment]) -> None:
        """Hand the held seats of ``planner``'s opened selection their tasks."""
        for seat in planner.opened():
            future = self._futures.get(seat.device_id)
            if future is not None and not future.done():
                future.set_result(tasks[seat.device_id])
                planner.mark_delivered(seat.device_id)

    def release_waiting(self, reason: str) -> None:
        """Answer the devices held for the next selection: they come back at once, unpaced."""
        room = self.waiting
        if room is None:
            return
        for device_id in room.empty():
            self._answer(device_id, Retry(MIN_RETRY_S, reason, at_once=True))

    def release_selection(self, reason: str) -> None:
        """Answer every held check-in but those waiting for the next attempt."""
        kept = self.waiting.held if self.waiting is not None else {}
        for device_id in [d for d in self._futures if d not in kept]:
            self._answer(device_id, Retry(MIN_RETRY_S, reason))

    def close(self, reason: str) -> None:
        """Answer every held check-in: nobody is held for a round that will not come."""
        self.waiting = None
        self.release_selection(reason)
