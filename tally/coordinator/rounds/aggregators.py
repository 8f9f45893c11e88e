"""The aggregators a coordinator was given, and the calls it makes to them.

Each is checked before it is handed cohorts: a call to its control API (a ``CloseSession`` that
names no session: it closes nothing, and proves the address serves AggregatorControl and admits
this coordinator), then the standard gRPC health protocol. One that fails either, or whose call
fails at the transport level, is marked down with the reason and skipped until a later check
finds it serving again. An aggregator's device port answers health checks too, so a health check
alone passed it; a job then failed with ``OpenSession failed: UNIMPLEMENTED`` (issue 39).

The leader of coordinator replicas fences each aggregator with its epoch (``Fence``) whenever the
aggregator comes up (first seen serving, or back after being down, perhaps restarted and knowing no
epoch): from then on it refuses the sessions of older leaders. An aggregator that answers with a
newer epoch than this pool's says this replica no longer leads (``on_superseded``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tally import logs
from tally.security import OwnerTokens, TLSConfig, channel_options, owner_metadata
from tally.security.tls import file_stamps
from tally.security.tls import open_aio_channel as aio_channel
from tally.security.tls_failures import tls_failure
from tally.wire.v1 import aggregator_pb2, aggregator_pb2_grpc

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 2.0
# gRPC backs off reconnecting up to 120 s by default, and a probe on a channel in backoff fails at
# once: an aggregator restarted after a crash would look down for minutes. A coordinator has a
# handful of aggregators, so it retries them often (the fault campaign found this, seed 21).
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                     ("grpc.max_reconnect_backoff_ms", 2000)]
# How long calls in flight on a channel replaced by a certificate renewal may go on.
RETIRE_GRACE_S = 600.0
CONTROL_SERVICE = aggregator_pb2.DESCRIPTOR.services_by_name["AggregatorControl"].full_name
DEVICE_PORT = "this is a device port; give the --control-listen port"


class AggregatorCallFailed(Exception):
    """A control call to ``aggregator_id`` failed or returned something unusable."""

    def __init__(self, aggregator_id: str, message: str) -> None:
        super().__init__(f"aggregator {aggregator_id}: {message}")
        self.aggregator_id, self.reason = aggregator_id, message


# Status codes that say the aggregator (not the request) is the problem: it is marked down.
_TRANSPORT_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
    grpc.StatusCode.CANCELLED,
})


def parse_aggregator(text: str) -> tuple[str, str]:
    """``ID=HOST:PORT`` as given on the command line."""
    ident, sep, address = text.partition("=")
    if not sep or not ident or not address or ":" not in address:
        raise ValueError(f"expected ID=HOST:PORT, got {text!r}")
    return ident, address


@dataclass
class Aggregator:
    aggregator_id: str
    address: str
    channel: grpc.aio.Channel
    control: aggregator_pb2_grpc.AggregatorControlStub
    health: health_pb2_grpc.HealthStub
    up: bool = False
    # Why it is down ("" while up). Any first check differs from this, so every configured
    # aggregator's state is logged once at start, up or down.
    reason: str = "not checked yet"


class AggregatorPool:
    def __init__(
        self,
        aggregators: Sequence[tuple[str, str]],
        tls: TLSConfig,
        max_message_bytes: int,
        owner_tokens: OwnerTokens,
        on_change: Callable[[int], None] = lambda up: None,
        on_member: Callable[[str, bool], None] = lambda aggregator_id, up: None,
        fence: tuple[int, bytes] | None = None,
        on_superseded: Callable[[int], None] = lambda epoch: None,
    ) -> None:
        """``owner_tokens``: the coordinator's proof of owning the sessions it opens. ``on_change``
        gets the number up after each check, ``on_member`` each aggregator's id and whether it is up;
        ``fence``: a leading replica's epoch and its signed statement (``TicketSigner.sign_epoch``);
        ``on_superseded``: called with the newer epoch an aggregator knows of."""
        ids = [a for a, _ in aggregators]
        if len(set(ids)) != len(ids):
            raise ValueError(f"aggregator ids must be unique, got {ids}")
        self._tls, self._options = tls, channel_options(max_message_bytes) + RECONNECT_OPTIONS
        self._on_change, self._on_member = on_change, on_member
        self._owner = owner_tokens
        self._fence, self._on_superseded = fence, on_superseded
        self._stamp = None if tls.insecure else file_stamps(tls)
        self._retired: dict[grpc.aio.Channel, asyncio.Task[None]] = {}
        self.members = {ident: self._connect(ident, address) for ident, address in aggregators}

    def _connect(self, ident: str, address: str, up: bool = False, reason: str = "not checked yet") -> Aggregator:
        channel = aio_channel(address, self._tls, self._options)
        return Aggregator(
            ident, address, channel,
            aggregator_pb2_grpc.AggregatorControlStub(channel), health_pb2_grpc.HealthStub(channel), up, reason,
        )

    def _follow_certificates(self) -> None:
        """Reconnect with the coordinator's renewed client certificate once its files change
        (channel credentials are read once); calls in flight finish on the old channels."""
        if self._stamp is None:
            return
        try:
            stamp = file_stamps(self._tls)
        except OSError:
            return  # mid-renewal: keep the channels that work
        if stamp == self._stamp:
            return
        self._stamp = stamp
        old = list(self.members.values())
        self.members = {a.aggregator_id: self._connect(a.aggregator_id, a.address, a.up, a.reason) for a in old}
        logs.event(log, "client certificate changed: reconnecting to the aggregators",
                   aggregators=[a.aggregator_id for a in old])
        for agg in old:
            task = asyncio.ensure_future(agg.channel.close(grace=RETIRE_GRACE_S))
            self._retired[agg.channel] = task
            task.add_done_callback(lambda _, channel=agg.channel: self._retired.pop(channel, None))

    async def close(self) -> None:
        """Close every channel now, those retired by a renewal included."""
        retired = list(self._retired)
        for task in self._retired.values():
            task.cancel()
        await asyncio.gather(*(c.close() for c in [*retired, *(a.channel for a in self.members.values())]))

    def up_count(self) -> int:
        return sum(a.up for a in self.members.values())

    def unusable(self) -> dict[str, str]:
        """Each aggregator down at its last check: id -> why."""
        return {a.aggregator_id: a.reason for a in self.members.values() if not a.up}

    async def healthy(self, exclude: Sequence[str] = ()) -> list[str]:
        """Check every aggregator now; the ids of those serving, in configured order. Called
        before each attempt and periodically, it also picks up a renewed certificate."""
        self._follow_certificates()
        candidates = [a for a in self.members.values() if a.aggregator_id not in exclude]
        reasons = await asyncio.gather(*(self._check(a) for a in candidates))
        came_up = [agg for agg, reason in zip(candidates, reasons) if not reason and not agg.up]
        for agg, reason in zip(candidates, reasons):
            self._set(agg, not reason, reason)
        if self._fence is not None:
            await asyncio.gather(*(self._fence_one(agg.aggregator_id) for agg in came_up))
        return [a.aggregator_id for a, reason in zip(candidates, reasons) if not reason]

    async def _fence_one(self, aggregator_id: str) -> None:
        """Tell an aggregator that came up this leader's epoch. Failing, it is told again when it
        next comes up; meanwhile the first session this leader opens there raises its floor too."""
        assert self._fence is not None
        epoch, statement = self._fence
        try:
            reply = await self._call(aggregator_id, "Fence", aggregator_pb2.FenceRequest(leader_epoch=statement),
                                     HEALTH_TIMEOUT_S)
        except AggregatorCallFailed as exc:
            logs.event(log, "fence failed", logging.WARNING, aggregator_id=aggregator_id, error=str(exc))
            return
        if reply.leader_epoch > epoch:
            logs.event(log, "an aggregator knows a newer leader", logging.ERROR, aggregator_id=aggregator_id,
                       epoch=epoch, newer=reply.leader_epoch)
            self._on_superseded(reply.leader_epoch)

    async def _check(self, agg: Aggregator) -> str:
        """Why ``agg`` cannot take cohorts now; "" when it can."""
        try:
            await agg.control.CloseSession(aggregator_pb2.CloseSessionRequest(reason="health check"),
                                           timeout=HEALTH_TIMEOUT_S)
            # The control service's own status when the aggregator reports it (draining, say).
            reply = await agg.health.Check(health_pb2.HealthCheckRequest(service=CONTROL_SERVICE),
                                           timeout=HEALTH_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                return f"{agg.address} does not serve AggregatorControl: {DEVICE_PORT}"
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return ""  # a control API that does not report its health by name
            details = exc.details() or ""
            return f"health check: {exc.code().name}: {tls_failure(details) or details}"
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            return f"health check: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
        return ""

    def mark_down(self, aggregator_id: str, reason: str) -> None:
        self._set(self.members[aggregator_id], False, reason)

    def _set(self, agg: Aggregator, up: bool, reason: str) -> None:
        if agg.up != up or (not up and reason != agg.reason):
            logs.event(
                log, "aggregator up" if up else "aggregator down",
                logging.INFO if up else logging.WARNING,
                aggregator_id=agg.aggregator_id, address=agg.address, reason=reason,
            )
        agg.up, agg.reason = up, reason
        self._on_member(agg.aggregator_id, up)
        self._on_change(self.up_count())

    async def open_session(
        self, aggregator_id: str, request: aggregator_pb2.OpenSessionRequest, timeout: float
    ) -> aggregator_pb2.OpenSessionResponse:
        """Opens ``request``'s session, registering the hash of its owner token with it."""
        token = self._owner.token(aggregator_id, request.config.ref.session_id)
        request.owner_token_sha256 = hashlib.sha256(token).digest()
        return await self._call(aggregator_id, "OpenSession", request, timeout)

    async def await_result(
        self, aggregator_id: str, session_id: str, sum_id: str, timeout: float
    ) -> aggregator_pb2.CohortSum:
        request = aggregator_pb2.AwaitResultRequest(session_id=session_id, sum_id=sum_id)
        return await self._call(aggregator_id, "AwaitResult", request, timeout,
                                self._as_owner(aggregator_id, session_id))

    async def close_session(self, aggregator_id: str, session_id: str, reason: str, timeout: float) -> None:
        """Best effort: a session that cannot be closed ends at its own deadlines."""
        request = aggregator_pb2.CloseSessionRequest(session_id=session_id, reason=reason)
        try:
            await self._call(aggregator_id, "CloseSession", request, timeout, self._as_owner(aggregator_id, session_id))
        except AggregatorCallFailed as exc:
            logs.event(log, "close session failed", logging.WARNING, session_id=session_id, error=str(exc))

    def _as_owner(self, aggregator_id: str, session_id: str) -> tuple[tuple[str, bytes], ...]:
        return owner_metadata(self._owner.token(aggregator_id, session_id))

    async def _call(
        self, aggregator_id: str, method: str, request, timeout: float,
        metadata: tuple[tuple[str, bytes], ...] = (),
    ):
        agg = self.members.get(aggregator_id)
        if agg is None:
            raise AggregatorCallFailed(aggregator_id, "unknown aggregator")
        try:
            return await getattr(agg.control, method)(
                request, timeout=max(timeout, 0.001), metadata=metadata
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _TRANSPORT_CODES:
                self.mark_down(aggregator_id, f"{method}: {exc.code().name}")
            raise AggregatorCallFailed(
                aggregator_id, f"{method} failed: {exc.code().name}: {exc.details()}"
            ) from None
