"""One coordinator replica of several over a PostgreSQL store (``tally coordinator --database``).

Every replica serves devices on its own device port (behind one Service, the cluster spreads
devices over them). The leader (``tally.coordinator.state.leadership``) runs the whole coordinator:
rounds, the Admin API, and an internal port for the others. The others run a device front in
their own process, answering registrations and idle check-ins from the shared store and
forwarding the rest to the leader's internal port, and try for the lead every ``LEAD_POLL_S``:
when the leader's process or connection ends, or its lease runs out unrenewed (a paused process),
one of them takes over, resumes its running jobs from the store (a restart, as on one host) and
announces its internal port. A leader that finds it lost the lead (its lease not renewed, or a
write of its store refused) stops at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable

from tally import logs
from tally.coordinator.faces.admin_token import share_admin_token
from tally.coordinator.faces.device_front import DeviceFront
from tally.coordinator.service import CoordinatorService
from tally.coordinator.state.leadership import DEFAULT_LEASE_S, Leadership
from tally.coordinator.state.store import Store

log = logging.getLogger(__name__)

LEAD_POLL_S = 1.0  # how often a follower tries for the lead, and a leader checks it still has it
# A replica whose heartbeat (one per LEAD_POLL_S) is older than this is not counted as alive.
ALIVE_WITHIN_S = 5.0
STOP_GRACE_S = 5.0


class Replica:
    """``make_service(epoch)`` builds the coordinator this replica runs while it leads (and,
    with ``epoch`` None, the template its front takes its settings from); ``advertise`` is the
    host the other replicas reach its internal port at; ``on_serving`` runs each time it starts
    serving devices, as follower or leader (``role``, ``port`` and ``metrics_port`` say how), and
    ``on_lead`` once it leads (submitting a jobs directory's specs, say); ``lease_s``: how long
    its lead lasts unrenewed (``tally.coordinator.state.leadership``)."""

    def __init__(
        self,
        make_service: Callable[[int | None], CoordinatorService],
        advertise: str,
        on_lead: Callable[[CoordinatorService], None] = lambda service: None,
        on_serving: Callable[[Replica], None] = lambda replica: None,
        lease_s: float = DEFAULT_LEASE_S,
    ) -> None:
        self.make_service, self.advertise, self.on_lead = make_service, advertise, on_lead
        self.lease_s = lease_s
        self.on_serving = on_serving
        self.metrics_port: int | None = None
        self.template = make_service(None)
        if not self.template.database_url or not self.template.internal_listen:
            raise ValueError("a replica needs a database_url and an internal_listen address")
        self.role = "starting"
        self.port: int | None = None
        self.service: CoordinatorService | None = None
        self.front: DeviceFront | None = None
        self.serving = asyncio.Event()  # set each time it serves devices, as follower or leader
        self._renewing: asyncio.Task[None] | None = None  # renews the lease while it leads
        self._lease_lost = asyncio.Event()

    async def run(self, stopping: asyncio.Event) -> int:
        """Serve until ``stopping``: 0; or 1 when it lost the lead (its process should exit and
        be started again, as a follower, by its supervisor)."""
        await asyncio.to_thread(self._share_admin_token)
        leadership = Leadership(self.template.database_url, lease_s=self.lease_s)
        try:
            while not stopping.is_set():
                epoch = await asyncio.to_thread(leadership.try_lead)
                if epoch is not None:
                    self._keep_lead(leadership)
                    return await self._lead(epoch, leadership, stopping)
                await self._follow(leadership, stopping)
            return 0
        finally:
            if self._renewing is not None:
                self._renewing.cancel()
                await asyncio.gather(self._renewing, return_exceptions=True)
            leadership.close()

    def _keep_lead(self, leadership: Leadership) -> None:
        """Renew the lease each ``LEAD_POLL_S`` from the moment the lead is taken until a renewal
        fails (``_lease_lost``): stopping the front and starting the coordinator take longer than
        a short lease."""
        if self._renewing is None:
            self._renewing = asyncio.create_task(self._renew(leadership))

    async def _renew(self, leadership: Leadership) -> None:
        while await asyncio.to_thread(leadership.renew):
            await asyncio.sleep(LEAD_POLL_S)
        self._lease_lost.set()

    @property
    def _address(self) -> str:
        """Where this replica serves devices: its name among the replicas alive."""
        return f"{self.advertise}:{self.port}"

    def _pace(self, leadership: Leadership, service: CoordinatorService) -> None:
        """Heartbeat, and pace what the other live replicas forward at their combined rate."""
        try:
            leadership.heartbeat(self._address)
            others = leadership.replicas_alive(ALIVE_WITHIN_S) - {self._address}
        except leadership.errors:  # a lost connection: ``renew`` finds out next, and it stops
            return
        service.pace_replicas(len(others))

    def _share_admin_token(self) -> None:
        """A follower's state directory holds the admin token too: the operator reads it from
        whichever pod is at hand, and the Admin API it forwards checks the same token."""
        store = Store(self.template.state_dir, self.template.database_url)
        try:
            share_admin_token(store, self.template.state_dir)
        finally:
            store.close()

    async def _follow(self, leadership: Leadership, stopping: asyncio.Event) -> None:
        t = self.template
        config = dataclasses.replace(t.front_config(0, t.listen, coordinator=""), metrics_port=t.metrics_port,
                                     share_port=False)
        self.front = front = DeviceFront(config)
        try:
            self.port = await front.start()
            self.role, self.metrics_port = "following", front.metrics_port
            self.serving.set()
            self.on_serving(self)
            logs.event(log, "replica following", port=self.port, leader=front.target)
            while not front.stale.is_set():
                await asyncio.to_thread(leadership.heartbeat, self._address)
                if await _stopped(stopping, LEAD_POLL_S):
                    return
                if await asyncio.to_thread(leadership.try_lead) is not None:
                    self._keep_lead(leadership)
                    return  # leads: the caller starts the coordinator on the port the front frees
        finally:
            self.serving.clear()
            await front.stop(STOP_GRACE_S)
            self.front = None

    async def _lead(self, epoch: int, leadership: Leadership, stopping: asyncio.Event) -> int:
        self.service = service = self.make_service(epoch)
        try:
            self.port = await service.start()
            assert service.internal_port is not None
            await asyncio.to_thread(leadership.announce, f"{self.advertise}:{service.internal_port}")
            self.role, self.metrics_port = "leading", service.metrics_port
            self.serving.set()
            self.on_serving(self)
            logs.event(log, "replica leading", epoch=epoch, port=self.port, internal_port=service.internal_port)
            self.on_lead(service)
            while True:
                await asyncio.to_thread(self._pace, leadership, service)
                if await _stopped(stopping, LEAD_POLL_S, service.lost_lead, self._lease_lost):
                    break
            if stopping.is_set():
                return 0
            why = "its lease was not renewed" if self._lease_lost.is_set() else "a write of its store was refused"
            logs.event(log, "replica lost the lead; stopping", level=logging.ERROR, epoch=epoch, why=why)
            return 1
        finally:
            self.serving.clear()
            await service.stop(STOP_GRACE_S)
            self.service = None


async def _stopped(stopping: asyncio.Event, timeout_s: float, *more: asyncio.Event) -> bool:
    """Wait up to ``timeout_s`` for ``stopping`` (or any of ``more``); whether one was set."""
    waits = [asyncio.ensure_future(event.wait()) for event in (stopping, *more)]
    try:
        done, _ = await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
    return bool(done)
